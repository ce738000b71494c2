"""Progress bars: one look for every long-running step (rich), and nothing at all when disabled.

    with ProgressBars(enabled) as bars:
        bar = bars.add("quantizing", total=len(tensors))
        for t in tensors:
            ...
            bar.advance()            # or bar.advance(n), bar.update(completed=step)

    with progress_bar(enabled, "calibrating", len(batches)) as advance:   # the one-bar case
        for b in batches: ...; advance()

rich is imported only when a bar is shown, so a disabled bar costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager


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
    with ProgressBars(enabled) as bars:
        yield bars.add(description, total).advance


__all__ = ["Bar", "ProgressBars", "progress_bar"]
