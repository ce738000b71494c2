"""Resuming an offline quantization that was killed part way (`mixprec quantize --resume`,
`quantize_checkpoint(resume=True)`).

Where the unfinished output lives: `.<output name>.partial/` beside --output (files.resumable_output_dir)

    manifest.json   (docs/schemas/resume.md) the job's identity, the folds' and calibration's results
    shards.jsonl    a line per finished shard: its size, sha256, and the scales-file entries of the
                    Linears it completes (appended; a line cut by a kill is ignored)
    calibration.safetensors   the weights GPTQ rounded (only with --algorithm gptq)
    folded/         the folded model (only with --algorithm rotate, smoothquant or awq), read as the input
    output/         the checkpoint being written: the finished shards, then the one in progress; no
                    index, config.json or side files until the very end, when output/ is renamed onto
                    --output and the work directory removed

The manifest is rewritten (atomically) after the folds and after calibration; a shard's line is
appended once the shard is complete (its sha256 computed by the writer from the bytes it wrote: a
finished shard is never read back; the last shard is not recorded, the publish follows it), so a kill at any point loses at most the
shards not yet recorded. Shards are not fsync'ed: after an OS crash a shard the disk
lost fails the sha256 check on resume and is written again. A resumed run checks the job's
identity (refused, naming what differs), reuses the calibration result (no second calibration), checks
every finished shard's size and sha256 (a shard that fails is written again, with the ones after it),
and starts writing at the first unfinished shard: input tensors whose outputs all lie in finished
shards are not read again; a Linear cut by a shard boundary is quantized again (deterministic) and only
its tensors planned after the boundary are written.

Flags: without --resume a partial run is refused (it holds finished work) unless --force, which
discards it; --resume without a partial run starts afresh; --resume --force resumes the partial run and
lets the result replace an existing --output. Errors: a MixprecError (bad input) discards the work
directory as any failed run leaves nothing behind; any other interruption (Ctrl-C, a full disk, kill -9)
keeps it once it holds finished work.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

try:
    import fcntl
except ImportError:  # not on Windows
    fcntl = None

from mixprec.conversion import ConversionReport
from mixprec.errors import MixprecError
from mixprec.files import resumable_output_dir, write_json_atomic, write_text_atomic
from mixprec.formats import get_format
from mixprec.inference.calibration.across_ranks import wait_for_all_ranks
from mixprec.inference.checkpoint.layout import planned_tensors
from mixprec.inference.checkpoint.safetensors_io import (
    Checkpoint,
    PlannedTensor,
    shard_names,
)
from mixprec.inference.producers.quantize_calibration import Calibration
from mixprec.inference.producers.quantize_job import QuantizeJob, Selection, Source
from mixprec.ranks import is_main_process
from mixprec.scaling import Granularity, QuantizedTensor

SCHEMA_VERSION = 1
KIND = "mixprec-quantize-partial"
MANIFEST = "manifest.json"
SHARDS_LOG = "shards.jsonl"
PREQUANTIZED_FILE = "calibration.safetensors"
OUTPUT_SUBDIR = "output"
FOLDED_SUBDIR = "folded"


def work_dir_of(output_dir: Path) -> Path:
    """Where the unfinished output of `output_dir` lives: a hidden directory beside it."""
    return output_dir.parent / f".{output_dir.name}.partial"


def _file_stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def job_identity(job: QuantizeJob, source: Source) -> dict[str, Any]:
    """Everything that changes the output's bytes: the input directory's files (sizes and modification
    times: shards, config, tokenizer, side files), the
    calibration texts (sha256 of what was read), the scheme and every option of the writer, calibration
    and algorithms, and the mixprec version. (layer_by_layer, strict and progress change no byte.)"""
    from mixprec import __version__

    # every file of the input directory: shards, config, index, and the tokenizer calibration reads
    files = {p.name: _file_stamp(p) for p in sorted(job.model_dir.iterdir()) if p.is_file()}
    files.update({p.name: _file_stamp(p) for p in source.ckpt.shards})
    identity: dict[str, Any] = {
        "mixprec": __version__,
        "input_files": files,
        "scheme": job.scheme.name,
        "assignment": None
        if job.assignment is None
        else {n: s.name for n, s in sorted(job.assignment.items())},
        "ignore": list(job.ignore),
        "format": job.format,
        "kv_cache": job.kv_cache,
        "max_shard_bytes": job.max_shard_bytes,
        "algorithm": job.algorithm.to_dict(),
        "calibration": None,
    }
    if job.calibrates:
        texts = hashlib.sha256()
        for t in source.texts or []:
            texts.update(t.encode("utf-8", "surrogatepass") + b"\0")
        identity["calibration"] = {
            "data": str(job.calib_data), "texts_sha256": texts.hexdigest(), "samples": job.calib_samples,
            "seq_len": job.calib_seq_len, "observer": job.observer,
            "stop": None if job.calib_stop is None else dataclasses.asdict(job.calib_stop),
        }  # fmt: skip
    return identity


def _differences(old: Any, new: Any, path: str = "") -> list[str]:
    """Where two identities differ, as 'key (partial run: X; now: Y)'."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in dict.fromkeys([*old, *new]):
            out += _differences(old.get(k), new.get(k), f"{path}.{k}" if path else str(k))
        return out
    if old == new:
        return []
    return [f"{path} (partial run: {json.dumps(old)[:60]}; now: {json.dumps(new)[:60]})"]


@dataclasses.dataclass(frozen=True)
class FinishedShard:
    """A complete shard file: its index in the plan, file name, size and sha256."""

    index: int
    name: str
    nbytes: int
    sha256: str


class PartialRun:
    """The work directory of one quantization and its manifest: what is finished, recorded as it finishes.
    Finished shards are hashed and recorded on a background thread, in order, off the writer's path."""

    def __init__(self, work: Path, manifest: dict[str, Any]):
        self.work = work
        self.manifest = manifest
        self.shards = _read_shard_log(work / SHARDS_LOG)  # the finished shards' records, in order
        self._recorder: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []

    @property
    def output(self) -> Path:
        """Where the checkpoint is being written."""
        return self.work / OUTPUT_SUBDIR

    @property
    def has_progress(self) -> bool:
        m = self.manifest
        return m["calibration"] is not None or bool(self.shards) or m.get("folds") is not None

    def _save(self) -> None:
        write_json_atomic(self.work / MANIFEST, self.manifest, indent=None, separators=(",", ":"))

    # ---- folds (--algorithm rotate, smoothquant, awq) -------------------------------------------------
    @property
    def folded_dir(self) -> Path:
        """Where the folded model is kept."""
        return self.work / FOLDED_SUBDIR

    def folds_record(self) -> dict[str, Any] | None:
        """The folds' record once the folded model is complete in folded_dir (None before)."""
        return self.manifest.get("folds")

    def save_folds(self, record: dict[str, Any]) -> None:
        self.manifest["folds"] = record
        self._save()

    # ---- calibration ------------------------------------------------------------------------------
    def save_calibration(self, cal: Calibration, report: ConversionReport, before: ReportMark) -> None:
        """Record the calibration result and what calibration added to the report."""
        tensors, meta = {}, {}
        for name, q in cal.prequantized.items():
            tensors[f"{name}.data"], tensors[f"{name}.scale"] = q.data.contiguous(), q.scale.contiguous()
            if q.global_scale is not None:
                tensors[f"{name}.global_scale"] = q.global_scale.contiguous()
            meta[name] = {"format": q.fmt.name, "granularity": dataclasses.asdict(q.granularity),
                          "shape": list(q.shape)}  # fmt: skip
        if tensors:
            from safetensors.torch import save_file

            save_file(tensors, str(self.work / PREQUANTIZED_FILE))
        self.manifest["calibration"] = {
            "input_amax": cal.input_amax, "kv_amax": {str(i): list(a) for i, a in cal.kv_amax.items()},
            "kv_names": {str(i): n for i, n in cal.kv_names.items()}, "info": cal.info,
            "prequantized": meta, "report": before.added(report),
        }  # fmt: skip
        self._save()

    def cached_calibration(self, report: ConversionReport) -> Calibration | None:
        """The recorded calibration result (None when there is none), its report fields restored."""
        rec = self.manifest["calibration"]
        if rec is None:
            return None
        pre: dict[str, QuantizedTensor] = {}
        if rec["prequantized"]:
            from safetensors.torch import load_file

            t = load_file(str(self.work / PREQUANTIZED_FILE))
            for name, m in rec["prequantized"].items():
                pre[name] = QuantizedTensor(
                    t[f"{name}.data"], t[f"{name}.scale"], get_format(m["format"]), Granularity(**m["granularity"]),
                    torch.Size(m["shape"]), t.get(f"{name}.global_scale"),
                )  # fmt: skip
        ReportMark.restore(report, rec["report"])
        report.notes.append("calibration: reused from the partial run (--resume)")
        kv_amax = {int(i): (a[0], a[1]) for i, a in rec["kv_amax"].items()}
        kv_names = {int(i): n for i, n in rec["kv_names"].items()}
        return Calibration(rec["input_amax"], kv_amax, kv_names, rec["info"], pre)

    # ---- shards -----------------------------------------------------------------------------------
    def shard_done(self, index: int, path: Path, sha256: str, layers: dict[str, dict[str, Any]]) -> None:
        """Record a complete shard file (its sha256 as the writer computed it) with `layers`: the
        scales-file entries of the Linears it completes. Appended on a background thread, off the
        writer's path."""
        if self._recorder is None:
            self._recorder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mixprec-resume")
        self._pending.append(self._recorder.submit(self._record_shard, index, path, sha256, layers))

    def recorder(
        self, shards: ShardMap, layers: Mapping[str, dict[str, Any]]
    ) -> Callable[[int, Path, str], None]:
        """The writer's on_shard: records every shard but the last, with the scales-file entries (from
        `layers`, filled as the stream goes) of the Linears it completes. The last shard is followed at
        once by the publish: a kill in between costs that shard."""

        def record(index: int, path: Path, sha256: str) -> None:
            if index < len(shards.names) - 1:
                self.shard_done(index, path, sha256, shards.layers_completed_by(index, layers))

        return record

    def _record_shard(self, index: int, path: Path, sha256: str, layers: dict[str, dict[str, Any]]) -> None:
        """One line appended to the shard log (a line cut by a kill is ignored when read)."""
        shard = FinishedShard(index, path.name, path.stat().st_size, sha256)
        rec = {**dataclasses.asdict(shard), "layers": layers}
        line = (json.dumps(rec, separators=(",", ":")) + "\n").encode()
        # one write() in append mode: the ranks of a split run append to one log, line by whole line
        fd = os.open(self.work / SHARDS_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        self.shards.append(rec)

    def wait(self) -> None:
        """Wait until every finished shard is recorded; raise what recording raised."""
        pending, self._pending = self._pending, []
        for fut in pending:
            fut.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._recorder is not None:
                self._recorder.shutdown(wait=True)

    @property
    def layers(self) -> dict[str, dict[str, Any]]:
        """The scales-file entries of the Linears the finished shards hold."""
        return {m: e for rec in self.shards for m, e in rec["layers"].items()}

    def finished_shards(self, shards: ShardMap, report: ConversionReport) -> frozenset[int]:
        """The shards kept from the partial run: each recorded shard that is still the one planned at its
        index and whose file has the recorded size and sha256. Records may come in any order (the ranks
        of a run split across processes finish theirs independently); a shard that fails is written again."""
        kept: dict[int, dict[str, Any]] = {}
        for rec in self.shards:
            i, path = rec["index"], self.output / rec["name"]
            if i >= len(shards.names) or rec["name"] != shards.names[i]:
                continue
            if not path.is_file() or path.stat().st_size != rec["nbytes"] or _sha256(path) != rec["sha256"]:
                report.warn(f"--resume: finished shard {path} is missing or changed; it is written again")
                kept.pop(i, None)
                continue
            kept[i] = rec
        self.shards = [kept[i] for i in sorted(kept)]
        text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in self.shards)
        log = self.work / SHARDS_LOG
        # rewritten when anything was dropped, a line cut by the kill included: lines appended after a
        # cut one would join it, and be lost to the next resume
        if (log.read_text(encoding="utf-8") if log.is_file() else "") != text:
            write_text_atomic(log, text)
        return frozenset(kept)


def _read_shard_log(path: Path) -> list[dict[str, Any]]:
    """The shard records of the log, up to the first line that is not a whole record (cut by a kill)."""
    records: list[dict[str, Any]] = []
    if not path.is_file():
        return records
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            rec = json.loads(line) if line.endswith("\n") else None
        except ValueError:
            rec = None
        if not isinstance(rec, dict) or not {"index", "name", "nbytes", "sha256", "layers"} <= rec.keys():
            break
        records.append(rec)
    return records


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class ReportMark:
    """How long the report's notes and warnings were before a stage: to record what the stage added."""

    notes: int
    warnings: int

    @classmethod
    def of(cls, report: ConversionReport) -> ReportMark:
        return cls(len(report.notes), len(report.warnings))

    def added(self, report: ConversionReport) -> dict[str, Any]:
        return {"notes": report.notes[self.notes :], "warnings": report.warnings[self.warnings :],
                "calibration": report.calibration, "algorithm": report.algorithm}  # fmt: skip

    @staticmethod
    def restore(report: ConversionReport, rec: dict[str, Any]) -> None:
        report.notes += rec["notes"]
        for w in rec["warnings"]:
            report.warn(w)
        report.calibration, report.algorithm = rec["calibration"], rec["algorithm"]


def _fresh_manifest(identity: dict[str, Any]) -> dict[str, Any]:
    from mixprec import __version__

    return {"schema_version": SCHEMA_VERSION, "kind": KIND, "producer": f"mixprec {__version__}",
            "identity": identity, "folds": None, "calibration": None}  # fmt: skip


def _read_manifest(work: Path, identity: dict[str, Any]) -> dict[str, Any]:
    """The partial run's manifest; MixprecError when it is unreadable or for another job."""
    path = work / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise MixprecError(
            f"--resume: {path} is not readable ({e}); pass --force to discard the partial run"
        ) from None
    version = manifest.get("schema_version") if isinstance(manifest, dict) else None
    if manifest.get("kind") != KIND or not isinstance(version, int) or version > SCHEMA_VERSION:
        raise MixprecError(f"--resume: {path} is not a partial-run manifest this mixprec reads (schema_version "
                           f"{version!r}); pass --force to discard the partial run")  # fmt: skip
    diff = _differences(manifest["identity"], identity)
    if diff:
        more = f" and {len(diff) - 1} more" if len(diff) > 1 else ""
        raise MixprecError(f"--resume: the partial run in {work} is another job: {diff[0]}{more}; "
                           "run it with the same inputs and options, or pass --force to discard it")  # fmt: skip
    return manifest


def _open_manifest(job: QuantizeJob, work: Path, identity: dict[str, Any]) -> dict[str, Any]:
    """The manifest to continue (--resume), or a fresh one; a partial run is refused or discarded."""
    if job.resume and (work / MANIFEST).is_file():
        return _read_manifest(work, identity)
    if work.exists() and not job.resume and not job.force:
        raise MixprecError(f"a partial run of {job.output_dir} is in {work}: pass --resume to continue it, "
                           "or --force to discard it")  # fmt: skip
    shutil.rmtree(work, ignore_errors=True)  # --force, or a run killed before it wrote its manifest
    return _fresh_manifest(identity)


class PartialRunBusy(MixprecError):
    """Another process holds the partial run: it is left as it is."""


def _lock(work: Path) -> int | None:
    """An exclusive lock on the work directory (flock on the directory, held while the run lasts): a
    second process quantizing to the same output is refused instead of writing the same files."""
    if fcntl is None:  # no flock on this platform: no guard
        return None
    fd = os.open(work, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise PartialRunBusy(f"another process is writing {work} (a quantization to the same output is "
                           "running); wait for it to end") from None  # fmt: skip
    return fd


@contextmanager
def partial_run(job: QuantizeJob, source: Source) -> Iterator[PartialRun]:
    """The run's work directory (continued with --resume, made otherwise); published onto the output
    when the body completes, kept on an interruption once it holds finished work (module docstring).
    In a run split across ranks (producers/quantize_ranks.py) rank 0 does all of that; the other ranks
    join the work directory once it is ready, and only append their finished shards to its log."""
    if not is_main_process():
        with _joined_run(job, source) as run:
            yield run
        return
    work = work_dir_of(job.output_dir)
    fd = _lock(work) if work.is_dir() else None
    try:
        run = PartialRun(work, _open_manifest(job, work, job_identity(job, source)))

        def keep(error: BaseException) -> bool:
            if isinstance(error, PartialRunBusy):  # another process's work
                return True
            return not isinstance(error, MixprecError) and run.has_progress

        with resumable_output_dir(job.output_dir, work, OUTPUT_SUBDIR, job.force, keep):
            if fd is not None and not (work / MANIFEST).is_file():  # the locked directory was discarded
                os.close(fd)
                fd = None
            fd = _lock(work) if fd is None else fd
            os.makedirs(run.output, exist_ok=True)
            if not (work / MANIFEST).is_file():
                run._save()
            wait_for_all_ranks()  # the work directory is ready for the other ranks
            try:
                yield run
            finally:  # on an interruption too: a shard written in full is recorded
                run.close()
    finally:
        if fd is not None:
            os.close(fd)


@contextmanager
def _joined_run(job: QuantizeJob, source: Source) -> Iterator[PartialRun]:
    """A rank other than 0: the work directory rank 0 made ready, its manifest read (and checked)."""
    wait_for_all_ranks()
    work = work_dir_of(job.output_dir)
    run = PartialRun(work, _read_manifest(work, job_identity(job, source)))
    try:
        yield run
    finally:
        run.close()


class ShardMap:
    """The output's shards as planned, and which input tensors and Linears each one completes."""

    def __init__(self, shards: list[list[PlannedTensor]], selection: Selection, layout: str):
        self.shards = shards
        self.layout = layout
        self.names = shard_names(len(shards))
        shard_of = {t.name: i for i, shard in enumerate(shards) for t in shard}
        self.selection = selection
        # a Linear is complete once the shard of its last planned tensor is
        self.last_shard = {
            m: max(shard_of[n] for n, _, _ in planned_tensors(m, dims, selection.schemes[m], layout))
            for m, dims in selection.targets.items()
        }
        self.shard_of = shard_of
        self.completed_by: dict[int, list[str]] = {}
        for m, last in self.last_shard.items():
            self.completed_by.setdefault(last, []).append(m)

    def layers_completed_by(
        self, index: int, layers: Mapping[str, dict[str, Any]]
    ) -> dict[str, dict[str, Any]]:
        """The entries of `layers` of the Linears whose last tensor lies in shard `index`."""
        return {m: layers[m] for m in self.completed_by.get(index, ()) if m in layers}

    def done_inputs(self, ckpt: Checkpoint, skip: Collection[int], layers: Mapping[str, dict[str, Any]]) -> dict[str, dict[str, Any] | None]:  # fmt: skip
        """{input tensor: its Linear's recorded scales-file entry, or None for a tensor written unchanged}
        of the input tensors whose outputs all lie in finished shards (`skip`, whose Linears `layers`
        records)."""
        return {n: layers.get(self._module(n)) for n in self.inputs_within(ckpt, skip)
                if self._module(n) not in self.selection.targets or self._module(n) in layers}  # fmt: skip

    def inputs_within(self, ckpt: Checkpoint, shards: Collection[int]) -> list[str]:
        """The input tensors whose outputs all lie in `shards`."""
        out = []
        for n in ckpt.tensors:
            module = self._module(n)
            if module in self.selection.targets:
                planned = planned_tensors(module, self.selection.targets[module], self.selection.schemes[module],
                                          self.layout)  # fmt: skip
                if all(self.shard_of[p] in shards for p, _, _ in planned):
                    out.append(n)
            elif n in self.shard_of and self.shard_of[n] in shards:
                out.append(n)
        return out

    @staticmethod
    def _module(name: str) -> str | None:
        return name[: -len(".weight")] if name.endswith(".weight") else None


__all__ = ["MANIFEST", "PartialRun", "ReportMark", "ShardMap", "job_identity", "partial_run", "work_dir_of"]
