"""`mixprec compare` under `torchrun --nproc-per-node 2` (CPU, gloo), launched as any program is — the
console script (`torchrun ... $(which mixprec) compare`) and `-m mixprec compare` — runs under DDP and
FSDP2: one summary table, artefacts written by rank 0 only, bit-identical weights on every rank
(--check-replicas), and the same numbers from both launches. On 2 ranks an interrupted FSDP2 comparison
resumed gives the numbers of an uninterrupted one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from distributed import compare_scenarios
from distributed.harness import run_distributed

SETTINGS = {
    "vocab_size": 320,
    "max_chars": 60_000,
    "val_blocks": 8,
    "model_config": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
    },
}
TABLE_TITLE = "mixprec compare (verdict on"


def _beside_python(name: str) -> str:
    exe = shutil.which(name, path=os.path.dirname(sys.executable)) or shutil.which(name)
    if exe is None:
        pytest.skip(f"{name} is not installed next to this Python")
    return exe


def _torchrun_compare(tmp_path, launch: str, dp: str, steps: int, out) -> subprocess.CompletedProcess:
    entry = [_beside_python("mixprec")] if launch == "script" else ["-m", "mixprec"]
    cmd = [
        _beside_python("torchrun"), "--standalone", "--nproc-per-node", "2", *entry, "compare",
        "--recipes", "bf16,fp8-delayed", "--baseline", "bf16", "--steps", str(steps), "--batch-size", "4",
        "--seq-len", "32", "--no-noise", "--eval-every", "3", "--monitor-every", "3", "--no-progress",
        "--check-replicas", "--dp", dp, "--out", str(out), "--settings", json.dumps(SETTINGS),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)


def _check_one_writer(proc: subprocess.CompletedProcess, out, steps: int) -> None:
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    assert "replicas: identical on 2 ranks" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count(TABLE_TITLE) == 1  # one summary table: rank 0 alone prints
    assert proc.stdout.count("report:") == 1
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "report.html", "summary.json"]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["recipes"]) == {"bf16", "fp8-delayed"}
    steps_logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["kind"] == "step" and r["run"] == "fp8-delayed" for r in steps_logged) == steps


@pytest.fixture(scope="module")
def ddp_launches(tmp_path_factory) -> dict:
    """The same DDP comparison launched as the console script and as `-m mixprec`."""
    runs = {}
    for launch in ("script", "module"):
        tmp = tmp_path_factory.mktemp(launch)
        runs[launch] = (_torchrun_compare(tmp, launch, "ddp", 6, tmp / "out"), tmp / "out")
    return runs


@pytest.mark.parametrize("launch", ["script", "module"])
def test_ddp_compare_under_torchrun_has_one_table_and_one_writer(ddp_launches, launch):
    proc, out = ddp_launches[launch]
    _check_one_writer(proc, out, steps=6)


def test_both_launches_give_the_same_numbers(ddp_launches):
    assert _numbers(ddp_launches["script"][1]) == _numbers(ddp_launches["module"][1])


def test_fsdp2_compare_under_torchrun(tmp_path):
    out = tmp_path / "out"
    _check_one_writer(_torchrun_compare(tmp_path, "module", "fsdp2", 4, out), out, steps=4)


def test_a_command_that_is_not_data_parallel_refuses_before_any_work(tmp_path):
    out = tmp_path / "fp8"
    cmd = [_beside_python("torchrun"), "--standalone", "--nproc-per-node", "2", _beside_python("mixprec"),
           "convert", str(tmp_path), str(out), "--to", "hf-fp8"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode != 0 and "exitcode: 2" in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count("mixprec convert: error: `mixprec convert` does not run data-parallel") == 1
    assert not out.exists()


def _numbers(out) -> tuple[list[dict], dict]:
    """metrics.jsonl and summary.json without wall-clock figures and paths."""
    summary = json.loads((out / "summary.json").read_text())
    for key in ("speed", "out_dir", "report_path"):
        summary.pop(key)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], summary


def test_fsdp2_resume_on_two_ranks_equals_uninterrupted(tmp_path):
    per_rank = run_distributed(compare_scenarios.resume_fsdp2, 2, tmp_path / "ranks", str(tmp_path))
    assert all(r["interrupted"] for r in per_rank)
    assert per_rank[0]["left"] == ["bf16.dist"]  # per-rank shards of the interrupted run, step 2
    assert _numbers(tmp_path / "c") == _numbers(tmp_path / "a")
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [
        "metrics.jsonl",
        "report.html",
        "summary.json",
    ]
