"""An FP4 / MX quantized model behaves like a model, as the FP8 one does (test_model_behaviour.py):
casts change the compute and output dtype only (the packed E2M1 payloads, the E4M3 / E8M0 block scales
and the fp32 global scales keep their dtypes and bits), device moves move them, a saved state_dict
loaded into a fresh model gives identical outputs, and torch.compile traces the layers without a graph
break and gives the eager result (Inductor: test_compile_inductor.py)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from inference_helpers import CASTS, quantized_state, same_bits, tiny_llama
from torch import nn

import mixprec
from mixprec.errors import MixprecError
from mixprec.inference import SCHEMES, QuantizedLinear, quantize_checkpoint
from mixprec.inference.runtime.linear import BlockQuantizedLinear

FP4_SCHEMES = ("nvfp4", "nvfp4a16", "mxfp4", "mxfp4a16")
# what a compressed-tensors checkpoint stores, with the dtypes it stores them in
BUFFERS = ("weight_packed", "weight", "weight_scale", "weight_global_scale", "input_global_scale")
DTYPES = {
    "nvfp4": {"weight_packed": torch.uint8, "weight_scale": torch.float8_e4m3fn,
              "weight_global_scale": torch.float32, "input_global_scale": torch.float32},
    "nvfp4a16": {"weight_packed": torch.uint8, "weight_scale": torch.float8_e4m3fn,
                 "weight_global_scale": torch.float32},
    "mxfp4": {"weight_packed": torch.uint8, "weight_scale": torch.uint8},
    "mxfp4a16": {"weight_packed": torch.uint8, "weight_scale": torch.uint8},
}  # fmt: skip


def _quantize_online(scheme: str, input_ids: torch.Tensor, seed: int = 0) -> nn.Module:
    model = tiny_llama(seed)
    calib = [input_ids] if SCHEMES[scheme].needs_calibration else None  # nvfp4: input global scales
    mixprec.quantize_model_(model, scheme, calib_data=calib)
    return model


@pytest.fixture(scope="module")
def checkpoints(llama_dir, calib_file, tmp_path_factory):
    """One checkpoint per scheme, written by quantize_checkpoint (what load_quantized reads)."""
    root = tmp_path_factory.mktemp("fp4_behaviour")
    out = {}
    for scheme in FP4_SCHEMES:
        out[scheme] = root / scheme
        quantize_checkpoint(llama_dir, out[scheme], scheme, calib_data=calib_file, calib_samples=4,
                            calib_seq_len=32, progress=False)  # fmt: skip
    return out


@pytest.fixture(params=[(s, src) for s in FP4_SCHEMES for src in ("load_quantized", "quantize_model_")],
                ids=lambda p: f"{p[0]}-{p[1]}")  # fmt: skip
def quantized(request, checkpoints, input_ids):
    scheme, source = request.param
    if source == "load_quantized":
        model = mixprec.load_quantized(checkpoints[scheme])
    else:
        model = _quantize_online(scheme, input_ids)
    layers = _block_layers(model)
    assert layers and {m.scheme.name for m in layers} == {scheme}
    return model


def _block_layers(model: nn.Module) -> list[BlockQuantizedLinear]:
    return [m for m in model.modules() if isinstance(m, BlockQuantizedLinear)]


def _quantized_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every packed payload and scale, as stored (bit-identity is compared on the raw bytes)."""
    return quantized_state(model, BlockQuantizedLinear, BUFFERS)


def _check_dtypes(model: nn.Module) -> None:
    for m in _block_layers(model):
        want = DTYPES[m.scheme.name]
        got = {k: getattr(m, k).dtype for k in BUFFERS if getattr(m, k) is not None}
        assert got == want, (m.scheme.name, got)


@pytest.mark.parametrize("cast", list(CASTS))
def test_casts_keep_payloads_and_change_the_output_dtype(quantized, cast, input_ids):
    fn, dtype = CASTS[cast]
    before = _quantized_state(quantized)
    _check_dtypes(quantized)
    assert fn(quantized) is quantized
    assert same_bits(_quantized_state(quantized), before)
    _check_dtypes(quantized)
    logits = quantized(input_ids).logits
    assert logits.dtype == dtype and torch.isfinite(logits).all()
    assert {m.out_dtype for m in _block_layers(quantized)} == {dtype}


@pytest.mark.parametrize("scheme", FP4_SCHEMES)
def test_cast_layer_equals_the_fp32_layer_rounded(scheme):
    """The independent reference: the same layer in fp32 on the same (bf16 / fp16-representable)
    inputs, rounded once — what an FP4 GEMM with fp32 accumulation and a bf16 / fp16 output gives;
    and a cast there and back (`.half().float()`) leaves the layer as it was. The bf16 GEMM path
    (nvfp4a16) rounds the sums to bf16 before the global scale (test_bf16_forward.py bounds it): pinned off."""
    torch.manual_seed(0)
    gscale = torch.tensor(448 * 6 / 4.0) if scheme == "nvfp4" else None  # the input's global scale
    layer = QuantizedLinear.from_linear(nn.Linear(128, 48, bias=False), SCHEMES[scheme], input_scale=gscale)
    layer.bf16_gemm = "never"
    assert isinstance(layer, BlockQuantizedLinear)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1)) * 1.5
    for dtype in (torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        cast = copy.deepcopy(layer).to(dtype)
        expected = layer(xd.float()).to(dtype)
        assert torch.equal(cast(xd), expected) and torch.equal(cast(xd.float()), expected)
        assert same_bits(_quantized_state(cast), _quantized_state(layer))
    assert torch.equal(copy.deepcopy(layer).half().float()(x), layer(x))


def test_device_moves_move_payloads_with_their_dtypes(quantized):
    meta = copy.deepcopy(quantized).to("meta")
    assert all(t.device.type == "meta" for t in _quantized_state(meta).values())
    _check_dtypes(meta)
    before = _quantized_state(quantized)
    quantized.to("cpu")
    assert same_bits(_quantized_state(quantized), before)


def test_state_dict_round_trip_into_a_fresh_model(quantized, input_ids):
    """A bf16-cast model's state_dict, saved and loaded, turns a fresh model quantized from other
    weights into this one: the same payloads and scales (dtypes and bits) and identical outputs."""
    quantized.bfloat16()
    scheme = _block_layers(quantized)[0].scheme.name
    buf = io.BytesIO()
    torch.save(quantized.state_dict(), buf)
    sd = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert sd[next(k for k in sd if k.endswith("q_proj.weight_packed"))].dtype == torch.uint8
    fresh = _quantize_online(scheme, input_ids, seed=1).bfloat16()
    assert not same_bits(_quantized_state(fresh), _quantized_state(quantized))  # other weights
    fresh.load_state_dict(sd, strict=True)
    assert same_bits(_quantized_state(fresh), _quantized_state(quantized))
    got, want = fresh(input_ids).logits, quantized(input_ids).logits
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def _small(scheme: str) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))
    calib = [torch.randn(8, 64)] if SCHEMES[scheme].needs_calibration else None
    mixprec.quantize_model_(model, scheme, calib_data=calib, default_ignore=False)
    assert len(_block_layers(model)) == 2
    return model.eval()


@pytest.mark.parametrize("scheme", FP4_SCHEMES)
def test_torch_compile_full_graph(scheme):
    """The layers of a cast model trace without graph breaks (aot_eager: the graph as compiled, run
    eagerly) and give the eager result; the data-dependent checks (NaN in an E2M1 input, the input's
    global scale) are assertions inside the graph."""
    model = _small(scheme).bfloat16()
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    torch._dynamo.reset()
    out = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, model(x))


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4"])
def test_nan_input_refused_eager_and_compiled(scheme):
    """W4A4 quantizes its input to E2M1, which has no NaN code: eager raises MixprecError, the compiled
    model (no graph break) raises from its in-graph assertion with the same message."""
    model = _small(scheme)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    x[2, 5] = float("nan")
    message = "cannot encode NaN in e2m1: the format has no NaN code"
    with pytest.raises(MixprecError, match=message):
        model(x)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x.nan_to_num()), model(x.nan_to_num()))
    with pytest.raises(RuntimeError, match=message):
        compiled(x)


def test_bad_input_global_scale_refused_eager_and_compiled():
    model = _small("nvfp4")
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), model(x))
    model[0].input_global_scale.fill_(0.0)
    with pytest.raises(MixprecError, match=r"a global scale must be finite and positive, got 0\.0"):
        model(x)
    with pytest.raises(RuntimeError, match="a global scale must be finite and positive"):
        compiled(x)
