"""`mixprec quantize --resume` (producers/resume.py): a quantization interrupted at any point (an
exception raised from inside the writer after shard k, in the middle of a shard, after calibration,
just before the checkpoint is published; and one real kill -9 of a subprocess) resumes to an output
byte-identical, file for file, to an uninterrupted run. A partial run of another job is refused, and
--force discards it."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from inference_helpers import SimulatedKill, directory_files

from mixprec.cli import main
from mixprec.errors import MixprecError
from mixprec.inference import quantize_checkpoint
from mixprec.inference.checkpoint.safetensors_io import PlannedShardWriter
from mixprec.inference.producers import quantize as quantize_module
from mixprec.inference.producers import quantize_folds, quantize_stream
from mixprec.inference.producers.resume import MANIFEST, OUTPUT_SUBDIR, SHARDS_LOG, PartialRun, work_dir_of

CALIB = dict(calib_samples=8, calib_seq_len=32)
# case: options; each shard bound cuts the tiny Llama's ~0.5 MB into 9 to 23 shards, some Linears' tensors
# across a boundary (test_a_linear_is_cut_by_a_shard_boundary)
CASES = {
    "fp8-dynamic": {"max_shard_size": "33000"},
    "nvfp4a16": {"max_shard_size": "36000"},  # fused q/k/v and gate/up groups share one task
    "fp8-static": {"max_shard_size": "32000", "kv_cache": "fp8"},  # calibrated: the result is kept
    "mxfp4a16+gptq": {"max_shard_size": "34000", "algorithm": "gptq"},  # the rounded weights are kept
    "fp8-dynamic+rotate": {"max_shard_size": "33000", "algorithm": "rotate"},  # the folded model is kept
}


def _quantize(src: Path, out: Path, case: str, calib: Path, **kw):
    scheme = kw.pop("scheme", case.split("+")[0])
    options = {**CASES[case], **kw}
    if "algorithm" in options or "kv_cache" in options:
        options = {"calib_data": calib, **CALIB, **options}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize_checkpoint(src, out, scheme, progress=False, **options)


@pytest.fixture(scope="module")
def references(llama_dir, calib_file, tmp_path_factory):
    """Each case's uninterrupted output."""
    out = {}
    for case in CASES:
        path = tmp_path_factory.mktemp(case.replace("+", "-")) / "q"
        _quantize(llama_dir, path, case, calib_file)
        out[case] = path
    return out


def _kill_after_shard(monkeypatch, k: int) -> None:
    original = PartialRun.shard_done

    def shard_done(self, index, *args):
        original(self, index, *args)
        if index == k:
            self.wait()  # the shard's record written (in the background, in a real run)
            raise SimulatedKill(f"after shard {k}")

    monkeypatch.setattr(PartialRun, "shard_done", shard_done)


def _kill_mid_shard(monkeypatch, n_writes: int) -> None:
    """Raise on the n-th tensor written to the output: a shard file half written, not recorded as
    finished (the streamed folds write their own checkpoints with the same writer: not counted)."""
    calls = {"n": 0}
    original = PlannedShardWriter.write

    def write(self, name, tensor):
        calls["n"] += self.out_dir.name == OUTPUT_SUBDIR
        if calls["n"] == n_writes:
            raise SimulatedKill(f"at tensor {name}")
        original(self, name, tensor)

    monkeypatch.setattr(PlannedShardWriter, "write", write)


def _kill_before_publish(monkeypatch) -> None:
    def config(*args):
        raise SimulatedKill("every shard written, before config.json")

    monkeypatch.setattr(quantize_module, "output_config", config)


def _kill_after_calibration(monkeypatch) -> None:
    original = PartialRun.save_calibration

    def save(self, *args):
        original(self, *args)
        raise SimulatedKill("after calibration")

    monkeypatch.setattr(PartialRun, "save_calibration", save)


KILLS = {
    "after-shard-1": lambda mp: _kill_after_shard(mp, 1),
    "after-shard-4": lambda mp: _kill_after_shard(mp, 4),
    "mid-shard": lambda mp: _kill_mid_shard(mp, 9),
    "before-publish": _kill_before_publish,
}


def _interrupt(monkeypatch, kill: str, llama_dir, out, case, calib_file) -> None:
    with monkeypatch.context() as mp:
        KILLS[kill](mp) if kill != "after-calibration" else _kill_after_calibration(mp)
        with pytest.raises(SimulatedKill):
            _quantize(llama_dir, out, case, calib_file)
    work = work_dir_of(out)
    assert not out.exists()  # a partial output is never where the output goes
    assert (work / MANIFEST).is_file()
    partial = sorted(p.name for p in (work / OUTPUT_SUBDIR).iterdir())
    assert "config.json" not in partial  # (the index is there only once every shard is)
    assert "model.safetensors.index.json" not in partial or kill == "before-publish"


def test_killed_in_the_streamed_fold_leaves_nothing_and_a_rerun_writes_the_same(references, llama_dir, calib_file,
                                                                                 tmp_path, monkeypatch):  # fmt: skip
    """A run killed while the rotation writes its folded checkpoint has no finished work: nothing is kept
    (no work directory, no folded copy), and running it again gives the uninterrupted run's bytes."""
    out = tmp_path / "q"
    calls = {"n": 0}
    original = PlannedShardWriter.write

    def write(self, name, tensor):
        calls["n"] += 1
        if calls["n"] == 3:
            raise SimulatedKill(f"in the fold, at tensor {name}")
        original(self, name, tensor)

    with monkeypatch.context() as mp:
        mp.setattr(PlannedShardWriter, "write", write)
        with pytest.raises(SimulatedKill):
            _quantize(llama_dir, out, "fp8-dynamic+rotate", calib_file)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    _quantize(llama_dir, out, "fp8-dynamic+rotate", calib_file, resume=True)
    assert directory_files(out) == directory_files(references["fp8-dynamic+rotate"])


@pytest.mark.parametrize("kill", [*KILLS, "after-calibration"])
@pytest.mark.parametrize("case", list(CASES))
def test_interrupted_then_resumed_is_byte_identical(case, kill, references, llama_dir, calib_file, tmp_path,
                                                    monkeypatch):  # fmt: skip
    if kill == "after-calibration" and case in ("fp8-dynamic", "nvfp4a16", "fp8-dynamic+rotate"):
        pytest.skip("nothing is calibrated")
    out = tmp_path / "q"
    _interrupt(monkeypatch, kill, llama_dir, out, case, calib_file)
    finished = PartialRun(work_dir_of(out), {}).layers  # the Linears in finished shards
    quantized = []
    original_task = quantize_stream._quantize_task
    monkeypatch.setattr(quantize_stream, "_quantize_task",
                        lambda r, info, *a, **k: quantized.append(info.name) or original_task(r, info, *a, **k))  # fmt: skip
    monkeypatch.setattr(quantize_module, "calibrate_job", _no_second_calibration)
    monkeypatch.setattr(quantize_folds, "_fold_into", _no_second_fold)
    report = _quantize(llama_dir, out, case, calib_file, resume=True)
    assert directory_files(out) == directory_files(references[case])
    assert not work_dir_of(out).exists()
    reference = json.loads((references[case] / "model.fp8_scales.json").read_text())
    assert len(report.layers) == len(reference["layers"]) or not case.startswith("fp8")
    if case in ("fp8-dynamic", "fp8-static"):  # the finished shards' Linears were not quantized again
        assert not {f"{m}.weight" for m in finished} & set(quantized)
        assert len(quantized) == len(report.layers) - len(finished) > 0 or kill == "before-publish"


def _no_second_fold(*args):
    raise AssertionError("a resumed run folded the model again")


def _no_second_calibration(job, *args):
    if job.calibrates:
        raise AssertionError("a resumed run calibrated again")
    from mixprec.inference.producers.quantize_calibration import NOT_CALIBRATED

    return NOT_CALIBRATED


@pytest.mark.parametrize("case", list(CASES))
def test_a_linear_is_cut_by_a_shard_boundary(case, references):
    """The boundary case of a resumed writer (a Linear's payload in one shard, its scale in the next) occurs."""
    index = json.loads((references[case] / "model.safetensors.index.json").read_text())["weight_map"]
    payload = {
        n.rsplit(".", 1)[0]: shard for n, shard in index.items() if n.endswith((".weight", ".weight_packed"))
    }
    cut = [n for n in index if n.endswith(".weight_scale") and index[n] != payload[n.rsplit(".", 1)[0]]]
    assert cut


@pytest.mark.parametrize("case", ["nvfp4a16", "fp8-dynamic"])
@pytest.mark.parametrize(("workers", "ahead"), [(1, 0), (2, 0), (4, 3)])
def test_any_depth_of_the_stream_writes_the_same_bytes(case, workers, ahead, references, llama_dir, calib_file,
                                                       tmp_path, monkeypatch):  # fmt: skip
    """Fewer weights in flight than a fused group has members (q/k/v: 3, with o_proj between k and q in
    plan order) still writes every tensor, and more in flight changes no byte."""
    monkeypatch.setattr(quantize_stream, "stream_workers", lambda: workers)
    monkeypatch.setattr(quantize_stream, "WEIGHTS_AHEAD", ahead)
    _quantize(llama_dir, tmp_path / "q", case, calib_file)
    assert directory_files(tmp_path / "q") == directory_files(references[case])


def test_kill_9_then_cli_resume(references, llama_dir, tmp_path):
    """A real SIGKILL of the process right after shard 2 is recorded, then `mixprec quantize --resume`."""
    out = tmp_path / "q"
    script = f"""
import os, signal, sys
from mixprec.inference.producers.resume import PartialRun
original = PartialRun.shard_done
def shard_done(self, index, *args):
    original(self, index, *args)
    if index == 2:
        self.wait()
        os.kill(os.getpid(), signal.SIGKILL)
PartialRun.shard_done = shard_done
from mixprec.cli import main
sys.exit(main(["quantize", "--model", {str(llama_dir)!r}, "--output", {str(out)!r}, "--scheme", "fp8-dynamic",
               "--max-shard-size", "33000", "--quiet"]))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert not out.exists()
    records = PartialRun(work_dir_of(out), {}).shards
    assert len(records) == 3
    for rec in records:  # the writer hashed the bytes it wrote: the same digest as the file's, read back
        data = (work_dir_of(out) / OUTPUT_SUBDIR / rec["name"]).read_bytes()
        assert rec["nbytes"] == len(data) and rec["sha256"] == hashlib.sha256(data).hexdigest()
    argv = [
        "quantize",
        "--model",
        str(llama_dir),
        "--output",
        str(out),
        "--max-shard-size",
        "33000",
        "--quiet",
    ]
    assert main([*argv, "--resume"]) == 0
    assert directory_files(out) == directory_files(references["fp8-dynamic"])
    assert not work_dir_of(out).exists()


def test_resume_of_another_job_is_refused(llama_dir, calib_file, tmp_path, monkeypatch):
    out = tmp_path / "q"
    _interrupt(monkeypatch, "after-shard-1", llama_dir, out, "fp8-dynamic", calib_file)
    with pytest.raises(
        MixprecError, match=r"another job: scheme \(partial run: \"fp8-dynamic\"; now: \"fp8-block\"\)"
    ):
        _quantize(llama_dir, out, "fp8-dynamic", calib_file, scheme="fp8-block", resume=True)
    with pytest.raises(MixprecError, match="another job: max_shard_bytes"):
        _quantize(llama_dir, out, "fp8-dynamic", calib_file, max_shard_size="1MB", resume=True)
    assert (work_dir_of(out) / MANIFEST).is_file()  # a refusal keeps the partial run


def test_resume_refused_when_the_input_changed(llama_dir, calib_file, tmp_path, monkeypatch):
    import shutil

    src = shutil.copytree(llama_dir, tmp_path / "m")
    out = tmp_path / "q"
    _interrupt(monkeypatch, "after-shard-1", src, out, "fp8-dynamic", calib_file)
    shard = src / "model.safetensors"
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    with pytest.raises(MixprecError, match=r"another job: input_files\.model\.safetensors"):
        _quantize(src, out, "fp8-dynamic", calib_file, resume=True)


def test_partial_run_refused_without_resume_and_discarded_by_force(references, llama_dir, calib_file, tmp_path,
                                                                   monkeypatch):  # fmt: skip
    out = tmp_path / "q"
    _interrupt(monkeypatch, "after-calibration", llama_dir, out, "fp8-static", calib_file)
    with pytest.raises(
        MixprecError, match=r"a partial run .* pass --resume to continue it, or --force to discard it"
    ):
        _quantize(llama_dir, out, "fp8-static", calib_file)
    calibrated = []
    original = quantize_module.calibrate_job
    monkeypatch.setattr(quantize_module, "calibrate_job", lambda *a: calibrated.append(1) or original(*a))
    _quantize(llama_dir, out, "fp8-static", calib_file, force=True)
    assert calibrated == [1]  # discarded: calibrated afresh
    assert directory_files(out) == directory_files(references["fp8-static"])
    assert not work_dir_of(out).exists()


def test_resume_without_a_partial_run_starts_afresh(references, llama_dir, calib_file, tmp_path):
    out = tmp_path / "q"
    _quantize(llama_dir, out, "fp8-dynamic", calib_file, resume=True)
    assert directory_files(out) == directory_files(references["fp8-dynamic"])


def test_bad_input_error_leaves_nothing_even_when_resumable(llama_dir, calib_file, tmp_path, monkeypatch):
    """A MixprecError (bad input) discards the partial run as any failed run leaves nothing behind."""
    original = PartialRun.shard_done

    def shard_done(self, index, *args):
        original(self, index, *args)
        raise MixprecError("bad tensor")

    monkeypatch.setattr(PartialRun, "shard_done", shard_done)
    out = tmp_path / "sub" / "q"
    with pytest.raises(MixprecError, match="bad tensor"):
        _quantize(llama_dir, out, "fp8-dynamic", calib_file)
    assert not (tmp_path / "sub").exists()


def test_a_second_process_on_the_same_output_is_refused(llama_dir, calib_file, tmp_path, monkeypatch):
    """While a run holds the work directory (flock), another one is refused and changes nothing."""
    fcntl = pytest.importorskip("fcntl")
    out = tmp_path / "q"
    _interrupt(monkeypatch, "after-shard-1", llama_dir, out, "fp8-dynamic", calib_file)
    before = directory_files(work_dir_of(out) / OUTPUT_SUBDIR)
    fd = os.open(work_dir_of(out), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        for kw in ({"resume": True}, {"force": True}):
            with pytest.raises(MixprecError, match="another process is writing"):
                _quantize(llama_dir, out, "fp8-dynamic", calib_file, **kw)
    finally:
        os.close(fd)
    assert directory_files(work_dir_of(out) / OUTPUT_SUBDIR) == before
    report = _quantize(llama_dir, out, "fp8-dynamic", calib_file, resume=True)
    assert any(n.startswith("resumed: 2 of ") for n in report.notes)


def test_a_changed_shard_and_a_cut_log_line_are_written_again(references, llama_dir, calib_file, tmp_path,
                                                              monkeypatch):  # fmt: skip
    """A finished shard whose bytes changed is written again (only it: each shard's bytes stand alone); a
    record cut by the kill (the log's last line without its end) counts as not written, and is dropped
    from the log so that the next records are not appended to it."""
    out = tmp_path / "q"
    _interrupt(monkeypatch, "after-shard-4", llama_dir, out, "fp8-dynamic", calib_file)
    work = work_dir_of(out)
    run = PartialRun(work, {})
    assert len(run.shards) == 5
    with open(work / SHARDS_LOG, "a") as f:
        f.write('{"index":5,"name":"model-00006-of')  # a record cut by the kill
    assert len(PartialRun(work, {}).shards) == 5
    shard = work / OUTPUT_SUBDIR / run.shards[2]["name"]
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.warns(UserWarning, match="missing or changed; it is written again"):
        report = quantize_checkpoint(llama_dir, out, "fp8-dynamic", progress=False, resume=True,
                                     **CASES["fp8-dynamic"])  # fmt: skip
    assert any(n.startswith("resumed: 4 of ") for n in report.notes)
    assert directory_files(out) == directory_files(references["fp8-dynamic"])


def test_a_cut_log_line_is_dropped_before_new_records_follow(llama_dir, calib_file, tmp_path, monkeypatch):
    """Killed twice: the records the second run appends after a line the first kill cut are read back."""
    out = tmp_path / "q"
    _interrupt(monkeypatch, "after-shard-1", llama_dir, out, "fp8-dynamic", calib_file)
    work = work_dir_of(out)
    with open(work / SHARDS_LOG, "a") as f:
        f.write('{"index":2,"name":"model-00003-of')  # a record cut by the kill
    with monkeypatch.context() as mp:
        KILLS["after-shard-4"](mp)
        with pytest.raises(SimulatedKill):
            _quantize(llama_dir, out, "fp8-dynamic", calib_file, resume=True)
    assert [r["index"] for r in PartialRun(work, {}).shards] == [0, 1, 2, 3, 4]
