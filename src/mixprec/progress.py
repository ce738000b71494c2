"""Progress bars: one look for every long-running step (rich), and nothing at all when disabled.

    with ProgressBars(enabled) as bars:
        bar = bars.add("quantizing", total=len(tensors))
        for t in tensors:
            ...
            bar.advance()            # or bar.advance(n), bar.update(completed=step)

    with progress_bar(enabled, "calibrating", len(batches)) as advance:   # the one-bar case
        for b in batches: ...; advance()

rich is imported only when a bar is shown, so a disabled bar costs nothing. A bar of known length
shows the time remaining.

The stages of a long job (StageMeter) are timed, each with its own peak resident memory:

    with StageMeter() as meter:                  # or finish() at the end
        meter.next("calibration"); ...; meter.next("write"); ...
    meter.stages  # [{"stage": "calibration", "seconds": 12.3, "peak_rss_bytes": ..., ...}, ...]
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class Bar:
    """One bar of a ProgressBars; every method is a no-op when the bars are disabled."""

    def __init__(self, progress, task) -> None:
        self._progress, self._task = progress, task

    def advance(self, n: float = 1) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, n)

    def update(self, *, completed: float) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=completed)


class ProgressBars:
    """A group of progress bars shown together (description, bar, done/total, elapsed time)."""

    def __init__(self, enabled: bool = True, *, time_remaining: bool = False, label_width: int = 0) -> None:
        self.enabled = enabled
        self._time_remaining = time_remaining
        self._label_width = label_width
        self._progress = None

    def __enter__(self) -> ProgressBars:
        if self.enabled:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            label = (
                f"{{task.description:<{self._label_width}}}" if self._label_width else "{task.description}"
            )
            columns = [TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
            if self._time_remaining:
                columns.append(TimeRemainingColumn())
            self._progress = Progress(*columns, transient=False)
            self._progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)
            self._progress = None

    def add(self, description: str, total: float | None) -> Bar:
        """A new bar (total None: unknown length)."""
        task = self._progress.add_task(description, total=total) if self._progress is not None else None
        return Bar(self._progress, task)


@contextmanager
def progress_bar(enabled: bool, description: str, total: float | None) -> Iterator[Callable[[], None]]:
    """One bar; yields a function that advances it by one."""
    with ProgressBars(enabled, time_remaining=total is not None) as bars:
        yield bars.add(description, total).advance


_STATUS = Path("/proc/self/status")


def _status_bytes(field: str) -> int | None:
    """A memory field of /proc/self/status in bytes; None where the OS does not say (not Linux)."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss() -> int | None:
    """This process's peak resident memory since it started, in bytes (VmHWM); None where unknown."""
    return _status_bytes("VmHWM:")


class StageMeter:
    """Wall time and peak resident memory of the consecutive stages of a job: `next(name)` ends the
    stage in progress and starts `name`, `finish()` ends the last (call it, or the sampling thread runs
    on). Each record: `stage`, `seconds`, `peak_rss_bytes` and `peak_rss_exact`.

    The process's own peak (VmHWM) is never reset: the tools that measure a whole run read it (wait4's
    ru_maxrss is the same counter). A stage that raised it has its exact peak there; any other stage's
    peak is the largest resident size sampled every 20 ms (`peak_rss_exact` false: a spike shorter
    than that can be missed). None where the OS does not say (not Linux)."""

    INTERVAL = 0.02

    def __init__(self) -> None:
        self.stages: list[dict[str, Any]] = []
        self._name: str | None = None
        self._start = 0.0
        self._hwm: int | None = None
        self._sampled = 0
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def _sample(self, stop: threading.Event) -> None:
        while not stop.wait(self.INTERVAL):
            self._sampled = max(self._sampled, _status_bytes("VmRSS:") or 0)

    def next(self, name: str) -> None:
        self.finish()
        self._name, self._start = name, time.perf_counter()
        self._hwm = peak_rss()
        self._sampled = _status_bytes("VmRSS:") or 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(self._stop,), daemon=True,
                                        name="mixprec-stage-meter")  # fmt: skip
        self._thread.start()

    def __enter__(self) -> StageMeter:
        return self

    def __exit__(self, *exc) -> None:
        self.finish()

    def finish(self) -> None:
        if self._name is None:
            return
        self._stop.set()
        self._thread.join()
        hwm = peak_rss()
        raised = hwm is not None and self._hwm is not None and hwm > self._hwm
        peak = hwm if raised else (max(self._sampled, _status_bytes("VmRSS:") or 0) or None)
        self.stages.append({"stage": self._name, "seconds": round(time.perf_counter() - self._start, 3),
                            "peak_rss_bytes": peak, "peak_rss_exact": raised})  # fmt: skip
        self._name = None


__all__ = ["Bar", "ProgressBars", "StageMeter", "peak_rss", "progress_bar"]
