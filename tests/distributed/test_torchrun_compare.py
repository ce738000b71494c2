"""`mixprec compare` under `torchrun --nproc-per-node 2` (CPU, gloo): runs under DDP and FSDP2, writes the
artefacts from rank 0 only, every rank ends with bit-identical weights (--check-replicas); on 2 ranks an
interrupted FSDP2 comparison resumed gives the numbers of an uninterrupted one."""

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


def _torchrun() -> list[str]:
    exe = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(exe):
        pytest.skip("torchrun is not installed next to this Python")
    return [exe]


@pytest.mark.parametrize("dp, steps", [("ddp", 6), ("fsdp2", 4)])
def test_compare_under_torchrun(tmp_path, dp, steps):
    out = tmp_path / "out"
    cmd = [
        *_torchrun(), "--standalone", "--nproc-per-node", "2", "-m", "mixprec.commands.torchrun", "compare",
        "--recipes", "bf16,fp8-delayed", "--baseline", "bf16", "--steps", str(steps), "--batch-size", "4",
        "--seq-len", "32", "--no-noise", "--eval-every", "3", "--monitor-every", "3", "--no-progress",
        "--check-replicas", "--dp", dp, "--out", str(out), "--settings", json.dumps(SETTINGS),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    assert "replicas: identical on 2 ranks" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("report:") == 1  # rank 0 alone prints and writes
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "report.html", "summary.json"]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["recipes"]) == {"bf16", "fp8-delayed"}
    steps_logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["kind"] == "step" and r["run"] == "fp8-delayed" for r in steps_logged) == steps


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
