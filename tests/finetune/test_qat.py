"""QAT: what you train is what you serve. For every scheme the QAT model's eval logits equal, bit for bit,
those of load_quantized(save_quantized(convert_qat_(model))) — before and after training steps, fp32 and bf16;
the weight-only checkpoints decompress (compressed-tensors) to the weights the QAT forward used; the
straight-through gradients equal a plain autograd reference; training lowers the loss; refusals."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from inference.inference_helpers import VOCAB, tiny_llama
from mixprec.errors import MixprecError
from mixprec.finetune.qat import QATLinear, convert_qat_, distillation_loss, prepare_qat_, qat_linears
from mixprec.formats import get_format
from mixprec.inference.producers.save import save_quantized
from mixprec.inference.readers.load import load_quantized
from mixprec.inference.runtime.gradients import FakeQuantLinearFunction
from mixprec.inference.runtime.linear import QuantizedLinear, quantized_linear
from mixprec.inference.schemes import SCHEMES, InferenceScheme, quantize_weight
from mixprec.quantization import quantize
from mixprec.scaling import expand_scale
from mixprec.training.gradient_flow import check_gradient_flow

IDS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
CALIB = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(2))


def _model(dtype: torch.dtype) -> nn.Module:
    """tiny_llama in `dtype` as from_pretrained(dtype=...) gives it: the rotary inv_freq buffers stay fp32
    (a `.to(bf16)` would round them, and a loaded checkpoint would then compute different angles)."""
    model = tiny_llama()
    rotary = {n: b.clone() for n, b in model.named_buffers() if "inv_freq" in n}
    model.to(dtype)
    for name, buffer in rotary.items():
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, buffer)
    return model


def _prepared(scheme: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    model = _model(dtype)
    prepare_qat_(model, scheme, calib_data=CALIB)
    return model


def _train_steps(model: nn.Module, steps: int, lr: float = 1e-3) -> list[float]:
    """AdamW steps of the LM loss on IDS; the losses before each step."""
    torch.manual_seed(0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(IDS, labels=IDS).loss
        losses.append(float(loss.detach()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return losses


def _served_logits(model: nn.Module, tmp_path) -> tuple[torch.Tensor, nn.Module]:
    convert_qat_(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_quantized(model, tmp_path / "q")
        served = load_quantized(tmp_path / "q")
    with torch.no_grad():
        return served(IDS).logits, served


@pytest.mark.parametrize("steps", [0, 3])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_qat_logits_are_the_served_checkpoints_bit_for_bit(scheme, steps, tmp_path):
    model = _prepared(scheme)
    before = {n: m.weight.detach().clone() for n, m in qat_linears(model).items()}
    _train_steps(model, steps)
    if steps:  # the master weights moved, and so did what the checkpoint stores
        assert all(not torch.equal(m.weight, before[n]) for n, m in qat_linears(model).items())
    with torch.no_grad():
        qat = model(IDS).logits
    assert torch.equal(model(IDS).logits.detach(), qat)  # the autograd forward is the same forward
    served, loaded = _served_logits(model, tmp_path)
    assert sum(isinstance(m, QuantizedLinear) for m in loaded.modules()) == 14  # 2 layers x 7 Linears
    assert qat.dtype == served.dtype and torch.equal(qat, served)


@pytest.mark.parametrize("scheme", ["nvfp4a16", "mxfp4a16", "fp8-dynamic"])
def test_bf16_qat_logits_are_the_served_checkpoints_bit_for_bit(scheme, tmp_path):
    model = _prepared(scheme, torch.bfloat16)
    _train_steps(model, 2)
    with torch.no_grad():
        qat = model(IDS).logits
    served, _ = _served_logits(model, tmp_path)
    assert qat.dtype == torch.bfloat16 and torch.equal(qat, served)


@pytest.mark.parametrize("scheme", ["nvfp4a16", "mxfp4a16"])
def test_weight_only_checkpoint_decompresses_to_the_qat_weights(scheme, tmp_path):
    """compressed-tensors (the library transformers decompresses these checkpoints with) turns the saved
    tensors back into exactly the bf16 weights the QAT forward multiplied by."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from safetensors.torch import load_file

    assert ct is not None
    model = _prepared(scheme, torch.bfloat16)
    _train_steps(model, 2)
    used = {n: m.quantize()[0].dequantize(torch.bfloat16) for n, m in qat_linears(model).items()}
    convert_qat_(model)
    save_quantized(model, tmp_path / "q")
    stored = load_file(tmp_path / "q" / "model.safetensors")
    compressor = NVFP4PackedCompressor if scheme == "nvfp4a16" else MXFP4PackedCompressor
    ct_scheme = preset_name_to_scheme(scheme.upper(), ["Linear"])
    for name, weight in used.items():
        tensors = {k.rsplit(".", 1)[1]: v for k, v in stored.items() if k.startswith(name + ".")}
        assert torch.equal(compressor.decompress(tensors, ct_scheme)["weight"], weight), name


def _ste(value: torch.Tensor, quantized: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Forward: the quantized value; backward: the identity where the quantizer did not clip, else 0."""
    return quantized.detach() + (value - value.detach()) * mask


def _mask(x: torch.Tensor, q) -> torch.Tensor:
    scale = expand_scale(q.effective_scale(), q.granularity, *x.shape)
    return (x.abs() / scale <= q.fmt.overflow_threshold).float()


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_gradients_equal_a_straight_through_reference(scheme):
    sch = InferenceScheme.from_name(scheme)
    gen = torch.Generator().manual_seed(3)
    linear = nn.Linear(256, 128, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(128, 256, generator=gen) * 0.05)
        linear.bias.copy_(torch.randn(128, generator=gen))
    x = torch.randn(24, 256, generator=gen) * 2
    x[3, 5] = 400.0  # beyond a static input scale calibrated on the rest: the input mask clips it
    in_scale = None
    if sch.needs_calibration:
        from mixprec.inference.runtime.online import static_input_scale

        in_scale = static_input_scale(sch, float(x[4:].abs().max()), torch.float32)
    layer = QATLinear(linear, sch, "proj", input_scale=in_scale)
    xa = x.clone().requires_grad_(True)
    g = torch.randn(24, 128, generator=gen)
    (layer(xa) * g).sum().backward()

    w = linear.weight.detach().clone().requires_grad_(True)
    b = linear.bias.detach().clone().requires_grad_(True)
    xr = x.clone().requires_grad_(True)
    wq = layer.quantize()[0]
    w_hat = _ste(w, wq.dequantize(), _mask(w.detach(), wq))
    if sch.weights_only:
        x_hat = xr
    else:
        xq = quantize(x, get_format(sch.input_format), layer.quantize()[2].input_granularity,
                      scale=None if sch.input_global else in_scale,
                      global_scale=in_scale if sch.input_global else None)  # fmt: skip
        x_hat = _ste(xr, xq.dequantize(), _mask(x, xq))
    ((x_hat @ w_hat.t() + b) * g).sum().backward()
    for ours, ref in ((xa.grad, xr.grad), (linear.weight.grad, w.grad), (linear.bias.grad, b.grad)):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    if sch.needs_calibration:
        assert float(xa.grad[3, 5]) == 0.0  # clipped: no gradient


def test_weight_gradient_is_masked_where_the_weight_quantizer_clipped():
    """The schemes' own weight scales hardly ever saturate (absmax scales; MX's "even" rule stays below
    max + half an ulp), so a weight quantized with a scale half its absmax one makes the clipping happen."""
    sch = InferenceScheme.from_name("fp8-static")
    gen = torch.Generator().manual_seed(4)
    w = (torch.randn(32, 64, generator=gen) * 0.1).requires_grad_(True)
    scale = (w.detach().abs().max() / 448 / 2).reshape(1, 1)
    wq, _ = quantize_weight(w.detach(), sch, scale=scale)
    layer = quantized_linear(wq, None, sch, input_scale=torch.tensor([0.01]))
    x = torch.randn(8, 64, generator=gen)
    g = torch.randn(8, 32, generator=gen)
    (FakeQuantLinearFunction.apply(x, w, None, layer, wq) * g).sum().backward()
    clipped = w.detach().abs() / scale > get_format("e4m3").overflow_threshold
    xq = quantize(x, get_format("e4m3"), layer.input_granularity, scale=torch.tensor([0.01]))
    expected = (g.t() @ xq.dequantize()) * ~clipped
    assert 0 < int(clipped.sum()) < clipped.numel() and bool((w.grad[clipped] == 0).all())
    torch.testing.assert_close(w.grad, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scheme", ["fp8-static", "nvfp4a16", "nvfp4", "mxfp4"])
def test_adamw_lowers_the_loss(scheme):
    model = _prepared(scheme)
    losses = _train_steps(model, 6)
    assert losses[-1] < losses[0] - 0.05, losses


@pytest.mark.parametrize("scheme", ["fp8-dynamic", "nvfp4", "mxfp4a16"])
def test_gradient_flow_reaches_every_layer(scheme):
    model = _prepared(scheme)
    report = check_gradient_flow(model, IDS)
    assert report.ok, report.message()


def test_distillation_loss_is_kl_teacher_to_student():
    t = torch.tensor([[[1.0, 2.0, 0.5]], [[0.0, -1.0, 3.0]]])
    assert float(distillation_loss(t, t)) == 0.0
    s = torch.tensor([[[0.5, 2.5, 0.0]], [[1.0, -1.0, 2.0]]])
    for temp in (1.0, 2.0):
        kl = []
        for st, te in zip(s.reshape(-1, 3).tolist(), t.reshape(-1, 3).tolist(), strict=True):
            zs = sum(torch.tensor(st).div(temp).exp().tolist())
            zt = sum(torch.tensor(te).div(temp).exp().tolist())
            ps = [float(torch.tensor(v / temp).exp()) / zs for v in st]
            pt = [float(torch.tensor(v / temp).exp()) / zt for v in te]
            kl.append(sum(p * (float(torch.tensor(p / q).log())) for p, q in zip(pt, ps, strict=True)))
        expected = sum(kl) / len(kl) * temp**2
        assert abs(float(distillation_loss(s, t, temp)) - expected) < 1e-6


def _unchanged(model: nn.Module, state: dict[str, torch.Tensor]) -> bool:
    now = model.state_dict()
    return (
        not qat_linears(model)
        and now.keys() == state.keys()
        and all(torch.equal(now[k], state[k]) for k in now)
    )


@pytest.mark.parametrize(
    "scheme, kwargs, message",
    [
        ("fp8-static", {}, "needs calibration data"),
        ("nvfp4", {}, "needs calibration data"),
        ("fp8-dynamic", {"kv_cache": True}, "does not quantize the KV cache"),
        ("fp8-dynamic", {"ignore": ["re:.*"]}, "quantizes no Linear"),
        ("nvfp5", {}, "unknown inference scheme"),
    ],
)
def test_bad_input_is_refused_before_any_change(scheme, kwargs, message):
    model = tiny_llama()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(MixprecError, match=message):
        prepare_qat_(model, scheme, **kwargs)
    assert _unchanged(model, state)


def test_a_scheme_the_shapes_cannot_take_is_refused():
    model = tiny_llama(hidden_size=48, intermediate_size=80, head_dim=12)  # no in_features a multiple of 32
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(MixprecError, match=r"mxfp4 quantizes no Linear.*not a multiple of mxfp4's 32"):
        prepare_qat_(model, "mxfp4")
    assert _unchanged(model, state)


def test_moe_experts_are_refused_by_name():
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config)
    with pytest.raises(MixprecError, match=r"MoE experts: model\.layers\.0\.mlp\.experts \(MixtralExperts\)"):
        prepare_qat_(model, "fp8-dynamic")
    assert not qat_linears(model)


def test_convert_without_qat_layers_is_refused():
    with pytest.raises(MixprecError, match="no QAT Linear"):
        convert_qat_(tiny_llama())


def test_prepare_reports_the_qat_layers_and_what_stays_in_high_precision():
    model = tiny_llama()
    report = prepare_qat_(model, "fp8-dynamic")
    assert report.summary() == {"qat:fp8-dynamic": 14, "skipped: ignored by pattern": 1}  # lm_head
    q_proj = model.get_submodule("model.layers.0.self_attn.q_proj")
    assert isinstance(q_proj, QATLinear) and q_proj.weight.requires_grad
    assert set(q_proj.peers) == {f"model.layers.0.self_attn.{p}_proj" for p in "qkv"}


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_untrained_qat_model_is_the_ptq_model(scheme):
    """Before any step, QAT computes what apply_scheme_ (round to nearest, the same calibration and NVFP4
    fused global scales) computes: one quantizer for both."""
    from mixprec.inference.runtime.online import apply_scheme_

    qat, ptq = _prepared(scheme), tiny_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_scheme_(ptq, scheme, calib_data=CALIB)
    with torch.no_grad():
        assert torch.equal(qat(IDS).logits, ptq(IDS).logits)


def test_prepare_twice_is_refused():
    model = _prepared("fp8-dynamic")
    with pytest.raises(MixprecError, match="already prepared for QAT"):
        prepare_qat_(model, "nvfp4a16")


def test_a_cast_keeps_the_static_input_scale_bits():
    model = _prepared("nvfp4")
    scales = {n: m.input_scale.clone() for n, m in qat_linears(model).items()}
    model.half()
    layers = qat_linears(model)
    assert all(layers[n].input_scale.dtype == torch.float32 and torch.equal(layers[n].input_scale, s)
               for n, s in scales.items())  # fmt: skip
    assert all(m.weight.dtype == torch.float16 for m in layers.values())


def test_static_scheme_checkpoint_records_the_calibrated_input(tmp_path):
    import json

    model = _prepared("fp8-static")
    amax = {n: m.input_amax for n, m in qat_linears(model).items()}
    scale = {n: float(m.input_scale) for n, m in qat_linears(model).items()}
    convert_qat_(model)
    save_quantized(model, tmp_path / "q")
    layers = json.loads((tmp_path / "q" / "model.fp8_scales.json").read_text())["layers"]
    assert {n: layers[n]["input"]["amax"] for n in amax} == amax
    assert {n: layers[n]["input"]["scale"] for n in scale} == scale
