"""A tiny Llama and a tiny BERT exported to ONNX (padded batches), a tiny Llama quantized to FP8 Q/DQ and run
in onnxruntime, an FP8 checkpoint exported dequantized, and export-onnx's bad inputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

import onnx
from mixprec.cli import main
from mixprec.formats import E4M3
from mixprec.inference import quantize_checkpoint
from mixprec.onnx import export as export_module
from mixprec.onnx import export_onnx, quantize_onnx
from mixprec.onnx.common import load_model
from mixprec.onnx.export import VERIFY_RELATIVE_ERROR, check_export_inputs, load_for_export
from mixprec.onnx.inputs import load_calib_inputs, synthetic_inputs
from mixprec.quantization import fake_quantize
from mixprec.scaling import Granularity
from onnx import TensorProto

WORDS = [
    "the",
    "a",
    "model",
    "weight",
    "scale",
    "bit",
    "eight",
    "float",
    "range",
    "small",
    "tensor",
    "layer",
    "token",
    "error",
    "loss",
    "step",
    "data",
]
BOUND_WEIGHT_ONLY = 2**-4  # relative L2 error of the logits: one E4M3 rounding (3 mantissa bits)
BOUND_STATIC = 2 * 2**-4  # plus one rounding of each activation


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("onnx")
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[EOS]", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]"
    )
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(root / "llama")
    hf_tok.save_pretrained(root / "llama")
    rng = np.random.default_rng(0)
    (root / "calib.txt").write_text("\n\n".join(" ".join(rng.choice(WORDS, 40)) for _ in range(20)))
    report = export_onnx(root / "llama", root / "llama.onnx")
    return root, model, report


def test_export(exported):
    root, _, report = exported
    assert report.kind == "causal-lm" and report.opset >= 19 and report.max_abs_diff < 1e-4
    assert report.relative_error < 1e-5 and "left-padded" in report.check_batch
    m = onnx.load(str(root / "llama.onnx"))
    assert [i.name for i in m.graph.input] == ["input_ids", "attention_mask"]
    assert [o.name for o in m.graph.output] == ["logits"]
    assert any(p.key == "mixprec.source_model" for p in m.metadata_props)


def run_padded(path, sequences, left=False):
    """onnxruntime on one padded batch of `sequences` (lists of ids): outputs and the mask."""
    length = max(len(s) for s in sequences)
    ids = np.zeros((len(sequences), length), dtype=np.int64)
    mask = np.zeros_like(ids)
    for row, seq in enumerate(sequences):
        cols = slice(length - len(seq), length) if left else slice(0, len(seq))
        ids[row, cols], mask[row, cols] = seq, 1
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {"input_ids": ids, "attention_mask": mask})[0], mask.astype(bool)


@pytest.mark.parametrize("left", [False, True], ids=["right-padded", "left-padded"])
def test_llama_padded_batch_gives_each_sequence_what_it_gets_alone(exported, left):
    root, model, _ = exported
    rng = np.random.default_rng(2)
    sequences = [rng.integers(3, model.config.vocab_size, n).tolist() for n in (13, 4, 9)]
    got, mask = run_padded(root / "llama.onnx", sequences, left=left)
    for row, seq in enumerate(sequences):
        with torch.no_grad():
            alone = model(input_ids=torch.tensor([seq])).logits[0].numpy()
        np.testing.assert_allclose(got[row][mask[row]], alone, atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    from transformers import BertConfig, BertModel

    root = tmp_path_factory.mktemp("bert")
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=32)  # fmt: skip
    model = BertModel(cfg).eval()
    model.save_pretrained(root / "bert")
    report = export_onnx(root / "bert", root / "bert.onnx")
    return root, model, report


def mean_pool(hidden, mask):
    m = mask[..., None].astype(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1)


def test_bert_padded_batch_agrees_with_torch(bert):
    root, model, report = bert
    assert report.kind == "encoder" and report.outputs == ["last_hidden_state"]
    assert report.inputs == ["input_ids", "attention_mask"] and report.relative_error < 1e-5
    rng = np.random.default_rng(3)
    sequences = [rng.integers(1, 40, n).tolist() for n in (17, 3, 8)]  # right padding, as BERT pads
    got, mask = run_padded(root / "bert.onnx", sequences)
    pooled = mean_pool(got, mask)
    for row, seq in enumerate(sequences):
        with torch.no_grad():
            alone = model(input_ids=torch.tensor([seq])).last_hidden_state[0].numpy()
        np.testing.assert_allclose(got[row][mask[row]], alone, atol=2e-5, rtol=1e-4)
        want = alone.mean(0)
        cos = pooled[row] @ want / (np.linalg.norm(pooled[row]) * np.linalg.norm(want))
        assert cos > 1 - 1e-6
    # the test can see the bug it guards against: without the mask the short sentence's states move by
    # more than the export's own check tolerates
    unmasked = run_padded(root / "bert.onnx", [s + [0] * (17 - len(s)) for s in sequences])[0]
    with torch.no_grad():
        short = model(input_ids=torch.tensor([sequences[1]])).last_hidden_state[0].numpy()
    moved = np.linalg.norm(unmasked[1][mask[1]] - short) / np.linalg.norm(short)
    assert moved > VERIFY_RELATIVE_ERROR


def test_calibration_longer_than_the_model_positions_is_refused(bert, tmp_path, capsys):
    root, _, _ = bert
    graph = load_model(root / "bert.onnx")
    assert {p.key: p.value for p in graph.metadata_props}["mixprec.max_positions"] == "32"
    (tmp_path / "t.txt").write_text("some words of text\n" * 50)
    argv = ["quantize-onnx", "--input", str(root / "bert.onnx"), "--output", str(tmp_path / "q.onnx"),
            "--calib-data", str(tmp_path / "t.txt"), "--calib-seq-len", "33"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--calib-seq-len 33 is longer than the 32 positions" in err and err.count("\n") == 1
    assert not (tmp_path / "q.onnx").exists()


def test_quantized_checkpoint_is_exported_dequantized(exported, tmp_path):
    """An FP8 checkpoint: its Linears become plain fp32 Linears holding payload x scale, bit for bit."""
    root, model, _ = exported
    quantize_checkpoint(root / "llama", tmp_path / "fp8", "fp8-dynamic", progress=False)
    config = check_export_inputs(tmp_path / "fp8", tmp_path / "x.onnx")
    loaded, count, notes = load_for_export(tmp_path / "fp8", config, "causal-lm")
    assert count == 14 and "dequantized" in notes[0] and "quantize-onnx" in notes[0]
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            want = fake_quantize(mod.weight.detach(), E4M3, Granularity.rows())
            assert torch.equal(loaded.get_submodule(name).weight, want), name
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)  # kept in high precision


def test_weight_only_fp8_matches_fake_quantized_torch(exported):
    root, model, _ = exported
    report = quantize_onnx(root / "llama.onnx", root / "w8.onnx")
    m = onnx.load(str(root / "w8.onnx"))
    fp8 = [t for t in m.graph.initializer if t.data_type == TensorProto.FLOAT8E4M3FN and len(t.dims) == 2]
    ops = [n.op_type for n in m.graph.node]
    assert (
        len(fp8) == 14 == ops.count("DequantizeLinear") and "QuantizeLinear" not in ops
    )  # 7 Linears x 2 layers
    assert [s["module"] for s in report.skipped] == ["lm_head"]
    assert report.check["worst_relative_l2_error"] < BOUND_WEIGHT_ONLY
    assert report.check["outputs"]["logits"]["top1_agreement"] > 0.9
    # independent: the torch model with its Linear weights rounded the same way gives the same logits
    fq = type(model)(model.config).eval()
    fq.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, mod in fq.named_modules():
            if isinstance(mod, torch.nn.Linear) and name != "lm_head":
                mod.weight.copy_(fake_quantize(mod.weight, E4M3, Granularity.rows()))
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    got = ort.InferenceSession(str(root / "w8.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"input_ids": ids.numpy(), "attention_mask": np.ones(ids.shape, dtype=np.int64)}
    )[0]
    with torch.no_grad():
        want = fq(input_ids=ids).logits.numpy()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


def test_static_fp8_from_text_calibration_via_cli(exported, capsys):
    root, _, _ = exported
    argv = ["quantize-onnx", "--input", str(root / "llama.onnx"), "--output", str(root / "s8.onnx"), "--calib-data",
            str(root / "calib.txt"), "--calib-samples", "8", "--calib-seq-len", "16", "--max-error", str(BOUND_STATIC)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "14 FP8 weights" in out and "relative L2 error" in out
    m = onnx.load(str(root / "s8.onnx"))
    ops = [n.op_type for n in m.graph.node]
    assert ops.count("QuantizeLinear") >= 8 and ops.count("DequantizeLinear") == 14 + ops.count(
        "QuantizeLinear"
    )
    feeds = load_calib_inputs(root / "calib.txt", load_model(root / "llama.onnx"), samples=8, seq_len=16)
    assert feeds[0]["input_ids"].shape == (4, 16) and feeds[0]["input_ids"].dtype == np.int64
    assert feeds[0]["attention_mask"].shape == (4, 16) and feeds[0]["attention_mask"].all()
    synthetic = synthetic_inputs(load_model(root / "llama.onnx"))
    assert synthetic[0]["attention_mask"].all() and synthetic[0]["input_ids"].max() < 20


@pytest.fixture
def no_model_loading(monkeypatch):
    """Bad arguments are refused before any model is loaded: loading fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(export_module, "load_model", refuse)
    monkeypatch.setattr(export_module, "load_quantized", refuse)


def test_export_bad_inputs(exported, tmp_path, capsys, no_model_loading):
    root, _, _ = exported
    llama, out = str(root / "llama"), str(tmp_path / "x.onnx")
    (tmp_path / "notes.txt").write_text("not a model\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "out.onnx").mkdir()
    cases = [
        (["--model", str(tmp_path / "nope"), "--output", out], "does not exist"),
        (["--model", str(tmp_path / "notes.txt"), "--output", out], "is a file"),
        (["--model", str(tmp_path / "empty"), "--output", out], "has no config.json"),
        (["--model", llama, "--output", str(root / "llama.onnx")], "already exists"),
        (["--model", llama, "--output", str(tmp_path / "out.onnx"), "--force"], "is a directory"),
        (
            ["--model", llama, "--output", str(tmp_path / "notes.txt" / "x.onnx")],
            "is a file, not a directory",
        ),
        (["--model", llama, "--output", str(tmp_path / "x.txt")], "must end in .onnx"),
        (["--model", llama, "--output", out, "--opset", "17"], "opset 19 or later"),
        (["--model", llama, "--output", out, "--opset", "999"], "exporter goes up to"),
        (["--model", llama, "--output", out, "--seq-len", "0"], "at least 2 tokens"),
        (["--model", llama, "--output", out, "--seq-len", "-5"], "at least 2 tokens"),
        (["--model", llama, "--output", out, "--seq-len", "65"], "64 positions"),
    ]
    for argv, message in cases:
        assert main(["export-onnx", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (argv, err)
    assert not (tmp_path / "x.onnx").exists()


def test_export_refuses_fp8_tensors_without_a_quantization_config(tmp_path, capsys):
    from safetensors.torch import save_file

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(
        '{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}'
    )
    save_file({"w": torch.zeros(2, 2, dtype=torch.float8_e4m3fn)}, str(tmp_path / "m" / "model.safetensors"))
    assert main(["export-onnx", "--model", str(tmp_path / "m"), "--output", str(tmp_path / "x.onnx")]) == 2
    err = capsys.readouterr().err
    assert "FP8 tensors" in err and "no quantization_config" in err and err.count("\n") == 1


def test_docs_promise_on_quantized_checkpoints_is_an_example_that_runs():
    """docs/onnx.md says an FP8 checkpoint is exported dequantized; its docs test runs exactly that."""
    from test_docs_examples import parse_page  # tests/ is on sys.path (conftest.py)

    text = (Path(__file__).resolve().parents[2] / "docs" / "onnx.md").read_text(encoding="utf-8")
    assert "exported *dequantized*" in text and "payload × scale" in text
    runs = [b.code for b in parse_page("onnx.md") if b.lang == "bash" and b.action == "run"]
    assert any("mixprec quantize " in c and "export-onnx --model llama-fp8" in c for c in runs)
    assert any("|| echo" in c and "test ! -e strict.onnx" in c for c in runs)  # the failed --max-error
