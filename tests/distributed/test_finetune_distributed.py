"""`mixprec finetune` data-parallel: two gloo ranks (DDP for LoRA, FSDP2 for QAT) compute what one process
computes on the whole batch, and rank 0 alone writes the output. One spawn for the module (each costs
seconds): every scenario runs inside it."""

from __future__ import annotations

import json

import pytest
import torch

from distributed.harness import run_distributed
from inference.inference_helpers import CALIB_TEXTS, save_with_tokenizer, tiny_llama
from mixprec.finetune.loop import LoopSettings
from mixprec.finetune.runner import REPORT_NAME, FinetuneJob, finetune
from mixprec.inference.readers.load import load_quantized

pytest.importorskip("peft")
pytest.importorskip("transformers")

SETTINGS = LoopSettings(steps=3, batch_size=4, lr=1e-3, warmup_steps=1, save_every=2)


def _job(model_dir, text, out, mode: str, strategy: str = "none") -> FinetuneJob:
    return FinetuneJob(model=model_dir, scheme="nvfp4a16", mode=mode, data=text, output=out, teacher=model_dir,
                       held_out=4, seq_len=32, loop=SETTINGS, lora_rank=4, progress=False,
                       data_parallel=strategy)  # fmt: skip


def _both_modes(rank: int, world: int, model_dir: str, text: str, out: str) -> dict:
    from pathlib import Path

    reports = {}
    for mode, strategy in (("lora", "ddp"), ("qat", "fsdp2")):
        report = finetune(_job(Path(model_dir), Path(text), Path(out) / mode, mode, strategy))
        reports[mode] = report["training"]["losses"] if report else None
    return reports


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("ft-dp")
    model_dir = save_with_tokenizer(tiny_llama(seed=5), root / "model")
    text = root / "train.txt"
    text.write_text("\n\n".join(CALIB_TEXTS))
    return model_dir, text, root


@pytest.fixture(scope="module")
def two_ranks(files):
    model_dir, text, root = files
    results = run_distributed(_both_modes, 2, root / "ranks", str(model_dir), str(text), str(root / "dp"))
    return results, root / "dp"


@pytest.mark.parametrize("mode", ["lora", "qat"])
def test_two_ranks_train_what_one_process_trains(files, two_ranks, tmp_path, mode):
    model_dir, text, _ = files
    results, dp_out = two_ranks
    assert results[1][mode] is None  # rank 1 returns no report: rank 0 scores and writes
    single = finetune(_job(model_dir, text, tmp_path / mode, mode))
    torch.testing.assert_close(results[0][mode], single["training"]["losses"], rtol=1e-5, atol=1e-6)
    report = json.loads((dp_out / mode / REPORT_NAME).read_text())
    assert report["parallel"] == {"world_size": 2, "strategy": "ddp" if mode == "lora" else "fsdp2"}
    assert single["parallel"] == {"world_size": 1, "strategy": "none"}
    assert not (dp_out / f".{mode}.finetune-state").exists()
    if mode == "lora":  # the adapters, trained on two ranks, equal the single process's
        from safetensors.torch import load_file

        two, one = (load_file(d / "adapter_model.safetensors") for d in (dp_out / mode, tmp_path / mode))
        assert two.keys() == one.keys()
        for key in one:
            torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=1e-6)
    else:  # the QAT checkpoint written from FSDP2 shards computes what the single process's computes
        ids = torch.randint(0, 320, (1, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            a, b = load_quantized(dp_out / mode)(ids).logits, load_quantized(tmp_path / mode)(ids).logits
        assert float((a - b).norm() / b.norm()) < 1e-2


def test_torchrun_launches_the_command_data_parallel(files, tmp_path):
    """`torchrun --nproc-per-node 2 -m mixprec finetune`: one summary, one writer, the report says so."""
    import os
    import shutil
    import subprocess
    import sys

    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this Python")
    model_dir, text, _ = files
    out = tmp_path / "lora"
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "mixprec", "finetune", "--model", str(model_dir),
           "--scheme", "fp8-dynamic", "--mode", "lora", "--data", str(text), "--output", str(out), "--steps", "2",
           "--batch-size", "4", "--seq-len", "32", "--held-out", "4", "--warmup-steps", "1", "--quiet"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("lora for fp8-dynamic: 2 steps") == 1  # rank 0 alone prints
    report = json.loads((out / REPORT_NAME).read_text())
    assert report["parallel"] == {"world_size": 2, "strategy": "ddp"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora"]  # no state directory left behind
