"""`quantize_checkpoint(..., algorithm="gptq")`: GPTQ on a tiny Llama written in every scheme family, read
back by mixprec and by transformers through compressed-tensors, the record in the report and the side
file, and the errors before any work."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from inference_helpers import assert_same_quantized, read_tensors, save_with_tokenizer, tiny_llama

import mixprec
from mixprec.errors import MixprecError
from mixprec.inference.algorithms.gptq import HessianAccumulator, gptq_quantize
from mixprec.inference.algorithms.gptq_pass import input_groups
from mixprec.inference.algorithms.spec import AlgorithmSpec, GptqParams
from mixprec.inference.checkpoint.algorithm_file import ALGORITHM_FILE, read_algorithm_file
from mixprec.inference.producers.quantize import quantize_checkpoint
from mixprec.inference.runtime.linear import QuantizedLinear
from mixprec.inference.schemes import InferenceScheme
from mixprec.kernels import emulation

transformers = pytest.importorskip("transformers")

SCHEMES = ("fp8-dynamic", "fp8-static", "fp8-block", "nvfp4a16", "nvfp4", "mxfp4a16")
CALIB = dict(calib_samples=8, calib_seq_len=32)


def _quantize(src, out, scheme, calib, algorithm="gptq", **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return quantize_checkpoint(
            src, out, scheme, calib_data=calib, algorithm=algorithm, progress=False, **CALIB, **kw
        )


@pytest.fixture(scope="module")
def written(llama_dir, calib_file, tmp_path_factory):
    out = {}
    for scheme in SCHEMES:
        path = tmp_path_factory.mktemp(scheme) / "q"
        out[scheme] = (_quantize(llama_dir, path, scheme, calib_file), path)
    return out


@pytest.mark.parametrize("scheme", SCHEMES)
def test_gptq_lowers_every_layers_calibration_output_error(written, scheme):
    report, _ = written[scheme]
    layers = report.algorithm["layers"]
    assert len(layers) == 14  # 7 Linears x 2 blocks
    for name, rec in layers.items():
        assert rec["output_error"] < rec["output_error_rtn"], name
        assert rec["tokens"] == 8 * 32 and rec["damp"] > 0


@pytest.mark.parametrize("scheme", SCHEMES)
def test_gptq_checkpoint_loads_the_same_in_transformers_and_mixprec(written, scheme):
    _, path = written[scheme]
    mine = mixprec.load_quantized(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=transformers.CompressedTensorsConfig(dequantize=True)
    )
    # compressed-tensors decompresses FP4 payloads in bf16 (then casts to the model's dtype)
    dtype = torch.bfloat16 if InferenceScheme.from_name(scheme).fmt.bits == 4 else torch.float32
    seen = 0
    for name, m in mine.named_modules():
        if isinstance(m, QuantizedLinear):
            w = hf.get_submodule(name).weight.detach()
            assert torch.equal(w.to(dtype), m.dequantized_weight(dtype)), name
            seen += 1
    assert seen == 14


def test_gptq_checkpoint_differs_from_rtn_and_records_itself(written, llama_dir, calib_file, tmp_path):
    report, path = written["nvfp4a16"]
    rtn = tmp_path / "rtn"
    _quantize(llama_dir, rtn, "nvfp4a16", calib_file, algorithm=None)
    a, b = read_tensors(path), read_tensors(rtn)
    assert a.keys() == b.keys()
    packed = [k for k in a if k.endswith("weight_packed")]
    assert packed and any(not torch.equal(a[k], b[k]) for k in packed)
    # the shared global scales are the RTN writer's (from the original weights' amax)
    assert all(torch.equal(a[k], b[k]) for k in a if k.endswith("weight_global_scale"))
    doc = read_algorithm_file(path)
    assert doc["kind"] == "mixprec-algorithm" and doc["names"] == ["gptq"] and doc["scheme"] == "nvfp4a16"
    assert doc["gptq"] == {"damp": 0.01, "block": 128, "act_order": True, "sequential": True}
    assert doc["hessian_arithmetic"] == "fp32"  # an fp32 model (and the suite pins the fp32 emulation)
    assert (
        doc["tokens"] == 256
        and len(doc["data_sha256"]) == 64
        and doc["layers"].keys() == report.algorithm["layers"].keys()
    )
    assert read_algorithm_file(rtn) is None
    cfg = json.loads((path / "config.json").read_text())["quantization_config"]
    assert "gptq" not in json.dumps(cfg)  # nothing new in the engines' config
    assert report.to_dict()["algorithm"]["names"] == ["gptq"]


def test_fp8_static_fused_shards_share_the_weight_scale_fixed_before_the_solve(written):
    _, path = written["fp8-static"]
    t = read_tensors(path)
    for i in range(2):
        p = f"model.layers.{i}."
        qkv = [float(t[f"{p}self_attn.{m}_proj.weight_scale"]) for m in "qkv"]
        gu = [float(t[f"{p}mlp.{m}_proj.weight_scale"]) for m in ("gate", "up")]
        assert len(set(qkv)) == 1 and len(set(gu)) == 1
        assert f"{p}self_attn.q_proj.input_scale" in t


def test_a_bf16_models_hessians_take_the_bf16_units_and_say_so(calib_file, tmp_path):
    """Under the bf16 GEMM emulation the Hessians of a bf16 model's inputs are formed on the bf16
    units (where the CPU has them: the record says which ran); GPTQ still beats RTN on every Linear,
    and where both ran in fp32 the two checkpoints are the same bytes."""
    src = save_with_tokenizer(tiny_llama().to(torch.bfloat16), tmp_path / "model")
    reports = {}
    for backend in ("fp32", "bf16"):
        with emulation.forced(backend):
            reports[backend] = _quantize(src, tmp_path / backend, "nvfp4a16", calib_file)
    native = emulation.native_bf16()
    assert reports["fp32"].algorithm["hessian_arithmetic"] == "fp32"
    assert reports["bf16"].algorithm["hessian_arithmetic"] == ("bf16" if native else "fp32")
    for rec in reports["bf16"].algorithm["layers"].values():
        assert rec["output_error"] < rec["output_error_rtn"]
    if not native:
        a, b = read_tensors(tmp_path / "fp32"), read_tensors(tmp_path / "bf16")
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_parallel_propagation_and_parameters_are_recorded(llama_dir, calib_file, tmp_path):
    spec = AlgorithmSpec.parse("gptq", damp=0.1, block=16, act_order=False, sequential=False)
    report = _quantize(llama_dir, tmp_path / "q", "fp8-dynamic", calib_file, algorithm=spec)
    rec = report.algorithm
    assert rec["gptq"] == {"damp": 0.1, "block": 16, "act_order": False, "sequential": False}
    assert rec["propagation"].startswith("parallel")
    assert all(r["output_error"] < r["output_error_rtn"] for r in rec["layers"].values())


def test_too_few_tokens_for_a_hessian_is_warned_with_the_figures(llama_dir, calib_file, tmp_path):
    with pytest.warns(
        UserWarning,
        match=r"fewer calibration tokens than they have inputs \(e\.g\. .*down_proj: 32 tokens for 256",
    ):
        quantize_checkpoint(llama_dir, tmp_path / "q", "fp8-dynamic", calib_data=calib_file, algorithm="gptq",
                            calib_samples=1, calib_seq_len=32, progress=False)  # fmt: skip


@pytest.mark.parametrize(
    ("algorithm", "message"),
    [
        ("awqq", "unknown algorithm 'awqq'"),
        ("rtn,gptq", "'rtn' is round to nearest alone"),
        ("gptq,gptq", "named twice"),
    ],
)
def test_bad_algorithm_refused_before_any_work(llama_dir, calib_file, tmp_path, algorithm, message):
    with pytest.raises(MixprecError, match=message):
        quantize_checkpoint(
            llama_dir, tmp_path / "q", "fp8-dynamic", calib_data=calib_file, algorithm=algorithm
        )
    assert not (tmp_path / "q").exists()


def test_gptq_needs_calibration_data(llama_dir, tmp_path):
    with pytest.raises(MixprecError, match="--algorithm gptq needs --calib-data"):
        quantize_checkpoint(llama_dir, tmp_path / "q", "nvfp4a16", algorithm="gptq")
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize(("kw", "message"), [({"damp": -1.0}, "dampening"), ({"block": 0}, "block")])
def test_bad_gptq_parameters(kw, message):
    with pytest.raises(MixprecError, match=message):
        GptqParams(**kw)


@pytest.mark.parametrize(("kw", "message"), [({"n_grid": 0}, "AWQ grid"), ({"awq_scales": "weight"}, "AWQ scales"),
                                             ({"alpha": 2.0}, "SmoothQuant alpha")])  # fmt: skip
def test_bad_fold_parameters(kw, message):
    with pytest.raises(MixprecError, match=message):
        AlgorithmSpec.parse("awq", **kw)


def test_input_groups_put_fused_shards_together():
    names = [f"m.layers.0.self_attn.{p}_proj" for p in "qkvo"] + [
        f"m.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")
    ]
    groups = input_groups(names)
    assert groups[0] == tuple(names[:3]) and groups[1] == (names[3],)
    assert groups[2] == tuple(names[4:6]) and groups[3] == (names[6],)


def test_writer_stores_gptq_rounding_as_given(llama_dir, calib_file, tmp_path):
    """A block's GPTQ result computed here from the block's own inputs equals what the checkpoint holds
    for the first block (sequential or not, block 0 sees the unquantized embeddings)."""
    path = tmp_path / "q"
    _quantize(llama_dir, path, "mxfp4a16", calib_file)
    model = transformers.LlamaForCausalLM.from_pretrained(llama_dir).eval()
    from mixprec.hf import load_tokenizer
    from mixprec.inference.calibration.data import load_texts, token_batches

    batches = token_batches(load_texts(calib_file), load_tokenizer(llama_dir), 8, 32)
    down = model.model.layers[0].mlp.down_proj
    acc = HessianAccumulator(down.in_features)
    handle = down.register_forward_pre_hook(lambda _m, a: acc.add(a[0]))
    with torch.no_grad():
        for b in batches:
            model(input_ids=b)
    handle.remove()
    sch = InferenceScheme.from_name("mxfp4a16")
    expected = gptq_quantize(down.weight, acc.finish(), sch.fmt.name, sch.weight_granularity, act_order=True)
    loaded = mixprec.load_quantized(path).get_submodule("model.layers.0.mlp.down_proj")
    assert torch.equal(loaded.dequantized_weight(torch.float32), expected.quantized.dequantize())
    assert (path / ALGORITHM_FILE).is_file()


@pytest.mark.parametrize("scheme", ["nvfp4a16", "fp8-static"])
def test_online_gptq_equals_the_checkpoints_bit_for_bit(written, llama_dir, calib_file, scheme):
    """mixprec.quantize_model_(..., algorithm="gptq") on the live model walks the same blocks on the same
    tokens as quantize_checkpoint: the same payloads and scales."""
    from mixprec.hf import load_tokenizer

    model = transformers.LlamaForCausalLM.from_pretrained(llama_dir).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = mixprec.quantize_model_(model, scheme, calib_data=calib_file, tokenizer=load_tokenizer(llama_dir),
                                         algorithm="gptq", **CALIB)  # fmt: skip
    offline = mixprec.load_quantized(written[scheme][1])
    assert report.algorithm["layers"].keys() == written[scheme][0].algorithm["layers"].keys()
    assert assert_same_quantized(model, offline) > 0


def test_online_gptq_refuses_what_it_cannot_use(llama_dir):
    model = transformers.LlamaForCausalLM.from_pretrained(llama_dir).eval()
    with pytest.raises(MixprecError, match="needs calib_data="):
        mixprec.quantize_model_(model, "fp8-dynamic", algorithm="gptq")
    with pytest.raises(MixprecError, match="token-id tensors"):
        mixprec.quantize_model_(model, "fp8-dynamic", calib_data=[torch.randn(2, 8, 128)], algorithm="gptq")
    with pytest.raises(MixprecError, match="'awq' needs calib_data="):
        mixprec.quantize_model_(model, "nvfp4a16", algorithm="awq")
    with pytest.raises(MixprecError, match="computes the weight scales itself"):
        mixprec.quantize_model_(model, "nvfp4a16", algorithm="rotate", scales={"layers": {}})
    with pytest.raises(MixprecError, match="token-id tensors"):
        mixprec.quantize_model_(model, "nvfp4a16", calib_data=[torch.randn(2, 8, 128)], algorithm="awq,gptq")
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())


def test_recorded_output_errors_are_the_hessians(written, llama_dir, calib_file):
    """Block 0's recorded output errors of RTN and GPTQ (denominator from the layers' outputs, GPTQ's own
    error from its solve) against tr(E H E^T) / tr(W H W^T) computed here in float64 from the block's
    inputs (block 0 sees the unquantized embeddings)."""
    from mixprec.hf import load_tokenizer
    from mixprec.inference.calibration.data import load_texts, token_batches
    from mixprec.quantization import quantize

    report, path = written["mxfp4a16"]
    model = transformers.LlamaForCausalLM.from_pretrained(llama_dir).eval()
    batches = token_batches(load_texts(calib_file), load_tokenizer(llama_dir), 8, 32)
    names = [n for n in report.algorithm["layers"] if n.startswith("model.layers.0.")]
    inputs = {n: [] for n in names}
    handles = [model.get_submodule(n).register_forward_pre_hook(lambda _m, a, n=n: inputs[n].append(a[0]))
               for n in names]  # fmt: skip
    with torch.no_grad():
        for b in batches:
            model(input_ids=b)
    for h in handles:
        h.remove()
    loaded = mixprec.load_quantized(path)
    sch = InferenceScheme.from_name("mxfp4a16")
    for n in names:
        x = torch.cat([a.reshape(-1, a.shape[-1]) for a in inputs[n]]).double()
        w = model.get_submodule(n).weight.detach().float()
        rtn = quantize(w, sch.fmt, sch.weight_granularity).dequantize()
        gptq = loaded.get_submodule(n).dequantized_weight(torch.float32)

        def err(q, x=x, w=w):
            return float((x @ (w - q).double().T).square().sum() / (x @ w.double().T).square().sum())

        rec = report.algorithm["layers"][n]
        assert rec["output_error_rtn"] == pytest.approx(err(rtn), rel=2e-3), n
        assert rec["output_error"] == pytest.approx(err(gptq), rel=2e-3), n
