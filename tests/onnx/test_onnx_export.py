"""A tiny Llama exported to ONNX, quantized to FP8 Q/DQ and run in onnxruntime."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

import onnx
from mixprec.cli import main
from mixprec.formats import E4M3
from mixprec.onnx import export_onnx, quantize_onnx
from mixprec.onnx.common import load_model
from mixprec.onnx.inputs import load_calib_inputs
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
    m = onnx.load(str(root / "llama.onnx"))
    assert [i.name for i in m.graph.input] == ["input_ids"] and [o.name for o in m.graph.output] == ["logits"]
    assert any(p.key == "mixprec.source_model" for p in m.metadata_props)


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
        None, {"input_ids": ids.numpy()}
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


def test_export_bad_input(exported, tmp_path, capsys):
    root, _, _ = exported
    assert main(["export-onnx", "--model", str(tmp_path / "nope"), "--output", str(tmp_path / "x.onnx")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["export-onnx", "--model", str(root / "llama"), "--output", str(root / "llama.onnx")]) == 2
    assert "exists" in capsys.readouterr().err
    assert (
        main(
            [
                "export-onnx",
                "--model",
                str(root / "llama"),
                "--output",
                str(tmp_path / "x.onnx"),
                "--opset",
                "17",
            ]
        )
        == 2
    )
