"""`mixprec finetune` end to end on a tiny llama: QAT writes a checkpoint that loads and computes what the
trained model computed; LoRA writes a peft adapter that loads over the quantized base; the report follows
its schema; bad input is refused before any work and leaves nothing behind."""

from __future__ import annotations

import json

import pytest
import torch

from inference.inference_helpers import CALIB_TEXTS, save_with_tokenizer, tiny_llama
from mixprec.cli import main
from mixprec.errors import MixprecError
from mixprec.finetune.data import text_windows
from mixprec.finetune.loop import LoopSettings
from mixprec.finetune.runner import REPORT_NAME, FinetuneJob, finetune
from mixprec.finetune.verdict import score
from mixprec.hf import load_tokenizer
from mixprec.inference import quantize_checkpoint
from mixprec.inference.readers.load import load_quantized

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_with_tokenizer(tiny_llama(seed=3), tmp_path_factory.mktemp("ft") / "model")


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("ft-data") / "train.txt"
    path.write_text("\n\n".join(CALIB_TEXTS))
    return path


def _args(model_dir, text, out, mode, *extra):
    return ["finetune", "--model", str(model_dir), "--scheme", "nvfp4a16", "--mode", mode, "--data", str(text),
            "--output", str(out), "--steps", "3", "--batch-size", "2", "--seq-len", "32", "--held-out", "4",
            "--warmup-steps", "1", "--quiet", *extra]  # fmt: skip


def _check_report(doc: dict, mode: str, text) -> None:
    assert doc["schema_version"] == 2 and doc["mode"] == mode and doc["scheme"] == "nvfp4a16"
    assert len(doc["training"]["losses"]) == 3 and all(x == x for x in doc["training"]["losses"])
    assert doc["gradient_flow"]["ok"] and doc["gradient_flow"]["broken"] == []
    assert doc["data"]["held_out"] == {f"{text} (last 4 windows)": 4}
    assert doc["parallel"] == {"world_size": 1, "strategy": "none"}
    (verdict,) = doc["verdicts"]
    rows = verdict["rows"]
    assert verdict["text"] == f"{text} (last 4 windows)" and verdict["windows"] == 4
    assert [row["model"] for row in rows] == ["nvfp4a16 RTN", f"nvfp4a16 {mode}"]
    assert verdict["baseline"] == "nvfp4a16 RTN" and verdict["reference"] == "original"
    assert "gap_closed" in rows[1] and rows[1]["verdict_vs_rtn"] in ("better", "worse", "inconclusive")


def test_qat_writes_a_checkpoint_that_computes_what_was_trained(model_dir, text, tmp_path, capsys):
    out = tmp_path / "qat"
    assert main(_args(model_dir, text, out, "qat", "--lr", "1e-3")) == 0
    assert "nvfp4a16 qat" in capsys.readouterr().out
    doc = json.loads((out / REPORT_NAME).read_text())
    _check_report(doc, "qat", text)
    assert not (tmp_path / ".qat.finetune-state").exists()  # the resumable state goes once the run ends

    served = load_quantized(out)
    start = load_quantized(_rtn_checkpoint(model_dir, tmp_path))
    ids = torch.randint(0, 320, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert not torch.equal(served(ids).logits, start(ids).logits)  # the weights moved


def _rtn_checkpoint(model_dir, tmp_path):
    quantize_checkpoint(model_dir, tmp_path / "rtn", "nvfp4a16", progress=False)
    return tmp_path / "rtn"


def test_qat_checkpoint_reproduces_the_verdicts_logits(model_dir, text, tmp_path):
    """The checkpoint on disk scores exactly what the verdict scored for the QAT candidate."""
    job = FinetuneJob(model=model_dir, scheme="nvfp4a16", mode="qat", data=text, output=tmp_path / "q",
                      held_out=4, seq_len=32, loop=LoopSettings(steps=2, batch_size=2, lr=1e-3, warmup_steps=0),
                      progress=False)  # fmt: skip
    report = finetune(job)
    served = load_quantized(tmp_path / "q")
    held = text_windows(text, load_tokenizer(model_dir), 32)[-4:]
    scored = score("x", served.float(), held)
    assert (
        float(torch.exp(scored.nll.sum() / scored.tokens.sum()))
        == report["verdicts"][0]["rows"][1]["perplexity"]
    )


def test_lora_writes_a_peft_adapter_over_the_quantized_base(model_dir, text, tmp_path):
    out = tmp_path / "lora"
    assert main(_args(model_dir, text, out, "lora", "--lora-rank", "4", "--json")) == 0
    doc = json.loads((out / REPORT_NAME).read_text())
    _check_report(doc, "lora", text)
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4


def test_each_eval_text_gets_its_own_verdict_and_the_data_tail_stays_held_out(model_dir, text, tmp_path):
    """--eval-data (e.g. another corpus) adds a verdict on that text; the last --held-out windows of --data
    are still never trained on and still judged."""
    other = tmp_path / "other.txt"
    other.write_text(
        "\n\n".join(f"A different text, line {i}: seven sleepy cats nap in the sun." for i in range(60))
    )
    job = FinetuneJob(model=model_dir, scheme="nvfp4a16", mode="qat", data=text, output=tmp_path / "q",
                      eval_data=(other,), held_out=4, seq_len=32, progress=False,
                      loop=LoopSettings(steps=2, batch_size=2, lr=1e-3, warmup_steps=0))  # fmt: skip
    report = finetune(job)
    windows = text_windows(text, load_tokenizer(model_dir), 32)
    assert report["data"]["train_windows"] == windows.shape[0] - 4
    assert [v["text"] for v in report["verdicts"]] == [f"{text} (last 4 windows)", str(other)]
    assert report["data"]["held_out"] == {f"{text} (last 4 windows)": 4, str(other): 4}
    tail, elsewhere = report["verdicts"]
    assert tail["reference_perplexity"] != elsewhere["reference_perplexity"]  # scored on different windows
    assert [r["model"] for r in elsewhere["rows"]] == ["nvfp4a16 RTN", "nvfp4a16 qat"]


def test_teacher_turns_on_distillation(model_dir, text, tmp_path):
    job = FinetuneJob(model=model_dir, scheme="nvfp4a16", mode="lora", data=text, output=tmp_path / "d",
                      teacher=model_dir, held_out=4, seq_len=32, lora_rank=2,
                      loop=LoopSettings(steps=2, batch_size=2, warmup_steps=0), progress=False)  # fmt: skip
    report = finetune(job)
    assert report["teacher"] == str(model_dir) and report["training"]["loss"] == "distillation"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"mode": "sft"}, "--mode must be one of"),
        ({"scheme": "int3"}, "int3"),
        ({"data": "missing.txt"}, "does not exist"),
        ({"seq_len": 4096}, "fewer than one window"),
        ({"held_out": 1}, "held-out"),
        ({"loop": LoopSettings(steps=0)}, "must be positive"),
    ],
)
def test_bad_input_is_refused_before_any_work(model_dir, text, tmp_path, change, message):
    kw = dict(model=model_dir, scheme="nvfp4a16", mode="qat", data=text, output=tmp_path / "out", seq_len=32,
              held_out=4, progress=False)  # fmt: skip
    if change.get("data"):
        change = {"data": tmp_path / change["data"]}
    kw.update(change)
    with pytest.raises(MixprecError, match=message):
        finetune(FinetuneJob(**kw))
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written, no state left


def test_an_existing_output_is_refused_without_force(model_dir, text, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    job = FinetuneJob(model=model_dir, scheme="nvfp4a16", mode="qat", data=text, output=tmp_path / "out",
                      seq_len=32, held_out=4, progress=False)  # fmt: skip
    with pytest.raises(MixprecError, match="exists"):
        finetune(job)
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_a_quantized_model_trains_from_its_weights_and_must_hold_the_scheme(model_dir, text, tmp_path):
    """GPTQ-then-QAT's path: --model a quantized checkpoint, --teacher the original. Its scheme must be
    --scheme; another is refused before training, and nothing is written."""
    rtn = _rtn_checkpoint(model_dir, tmp_path)
    settings = LoopSettings(steps=2, batch_size=2, lr=1e-3, warmup_steps=0)
    kw = dict(model=rtn, mode="qat", data=text, teacher=model_dir, held_out=4, seq_len=32, loop=settings,
              progress=False)  # fmt: skip
    with pytest.raises(MixprecError, match=r"holds nvfp4a16, not --scheme mxfp4a16"):
        finetune(FinetuneJob(scheme="mxfp4a16", output=tmp_path / "wrong", **kw))
    assert not (tmp_path / "wrong").exists() and not (tmp_path / ".wrong.finetune-state").exists()
    report = finetune(FinetuneJob(scheme="nvfp4a16", output=tmp_path / "q", **kw))
    rows = report["verdicts"][0]["rows"]
    assert [r["model"] for r in rows] == ["rtn (start)", "nvfp4a16 qat"]
