"""convert_for_training: every recipe kind through one call, the report, rules, islands, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import IDS, tiny_llama, tiny_mixtral
from torch import nn

import mixprec
from mixprec.errors import MixprecError
from mixprec.training import Policy, Rule, convert_for_training
from mixprec.training.convert import conversion_state

transformers = pytest.importorskip("transformers")


def _step(model):
    out = model(input_ids=IDS, labels=IDS)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    return out


def test_bf16_pure_params_and_every_module_listed():
    m = tiny_llama(tie=True)
    n_modules = len(list(m.named_modules()))
    report = mixprec.convert_for_training(m, "bf16")
    assert len(report) == n_modules
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    assert m.lm_head.weight is m.model.embed_tokens.weight  # tying survives the cast
    assert report["lm_head"].role == "head" and report["model.norm"].precision == "bf16"
    out = _step(m)
    assert out.logits.dtype == torch.bfloat16
    assert m.model.embed_tokens.weight.grad.dtype == torch.bfloat16


def test_bf16_amp_keeps_fp32_params_and_autocasts():
    m = tiny_llama()
    report = convert_for_training(m, "bf16-amp")
    assert report.kind == "bf16-amp"
    assert all(p.dtype == torch.float32 for p in m.parameters())
    out = _step(m)
    assert out.logits.dtype == torch.bfloat16  # lm_head ran under autocast
    assert m.lm_head.weight.grad.dtype == torch.float32
    assert not torch.is_autocast_enabled("cpu")  # the hooks left autocast as they found it


def test_fp16_amp_grad_scaler_defaults():
    m = tiny_llama()
    convert_for_training(m, "fp16-amp")
    scaler = mixprec.training.make_grad_scaler(m)
    assert scaler.is_enabled() and scaler.get_scale() == 2.0**14
    assert scaler.get_growth_interval() == 1000
    out = m(input_ids=IDS, labels=IDS)
    assert out.logits.dtype == torch.float16


def test_fp32_stays_true_fp32_under_fast_paths():
    m = tiny_llama().to(torch.bfloat16)
    convert_for_training(m, "fp32")
    assert all(p.dtype == torch.float32 for p in m.parameters())
    seen, seen_backward = [], []
    m.model.layers[0].mlp.register_forward_hook(lambda *a: seen.append(torch.get_float32_matmul_precision()))
    m.model.layers[0].mlp.register_full_backward_hook(
        lambda *a: seen_backward.append(torch.get_float32_matmul_precision())
    )
    with mixprec.enable_fast_paths():
        assert torch.get_float32_matmul_precision() == "high"
        _step(m)
        assert torch.get_float32_matmul_precision() == "high"
    assert seen == ["highest"]
    assert seen_backward == ["highest"]  # the backward GEMMs too, not only the forward


def test_fp32_island_rule():
    m = tiny_llama()
    report = convert_for_training(m, "bf16", {"lm_head": "fp32"})  # a dict is Policy.from_rules
    assert m.lm_head.weight.dtype == torch.float32 and m.model.norm.weight.dtype == torch.bfloat16
    assert report["lm_head"].precision == "fp32" and "rule" in report["lm_head"].reason
    out = _step(m)
    assert out.logits.dtype == torch.bfloat16  # cast back to the input's dtype
    assert m.lm_head.weight.grad.dtype == torch.float32


def test_moe_model_converts_and_runs():
    m = tiny_mixtral()
    report = convert_for_training(m, "bf16")
    assert report["model.layers.0.mlp.gate"].role == "router"
    assert report["model.layers.0.mlp.experts"].role == "experts"
    _step(m)


def test_report_outputs():
    m = tiny_llama()
    report = convert_for_training(m, "bf16")
    d = json.loads(report.to_json())
    assert d["schema_version"] == 6 and d["recipe"] and len(d["modules"]) == len(report)
    assert {"name", "type", "role", "precision", "reason"} <= set(d["modules"][0])
    text = str(report)
    assert "lm_head" in text and "model.layers.1.mlp.down_proj" in text
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(report)
    assert "model.embed_tokens" in console.export_text()
    assert conversion_state(m).report is report


def test_plain_module():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 16))
    report = convert_for_training(m, "bf16")
    assert report["2"].role == "norm" and report["0"].role == "linear"
    y = m(torch.randn(4, 32).bfloat16())
    assert y.dtype == torch.bfloat16


def test_bad_input():
    with pytest.raises(MixprecError, match=r"(?i)recipe"):
        convert_for_training(tiny_llama(), "fp7-magic")
    with pytest.raises(MixprecError, match=r"nn\.Module"):
        convert_for_training("not a model", "bf16")
    with pytest.raises(MixprecError, match="no parameters"):
        convert_for_training(nn.Sequential(nn.ReLU()), "bf16")
    int_model = nn.Linear(16, 16)
    int_model.weight = nn.Parameter(torch.zeros(16, 16, dtype=torch.int8), requires_grad=False)
    int_model.bias = None
    with pytest.raises(MixprecError, match="floating"):
        convert_for_training(int_model, "bf16")
    m = tiny_llama()
    convert_for_training(m, "bf16")
    with pytest.raises(MixprecError, match="already converted"):
        convert_for_training(m, "fp32")
    with pytest.raises(MixprecError, match="Policy"):
        convert_for_training(tiny_llama(), "bf16", policy=["lm_head"])
    with pytest.raises(MixprecError, match="action"):
        convert_for_training(tiny_llama(), "bf16", policy={"lm_head": "fp8"})


# ---- FP8 recipes ---------------------------------------------------------------------------------


def test_fp8_default_policy_leaves_embeddings_norms_head_untouched_on_llama():
    from mixprec.training.low_precision_linear import LowPrecisionLinear

    m = tiny_llama(tie=True)
    report = convert_for_training(m, "fp8-delayed")
    assert type(m.model.embed_tokens) is nn.Embedding and type(m.lm_head) is nn.Linear
    assert type(m.model.norm).__name__ == "LlamaRMSNorm"
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    fp8 = {n for n, mod in m.named_modules() if isinstance(mod, LowPrecisionLinear)}
    assert fp8 == {
        f"model.layers.{i}.{p}"
        for i in range(2)
        for p in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    }
    assert set(report.converted) == fp8
    assert report["lm_head"].precision == "bf16" and "tied" in report["lm_head"].reason
    _step(m)


def test_fp8_moe_router_untouched_experts_grouped():
    from mixprec.training.grouped import GroupedFp8Experts

    ref = tiny_mixtral().to(torch.bfloat16)
    m = tiny_mixtral()
    report = convert_for_training(m, "fp8-current")
    moe = m.model.layers[0].mlp
    assert type(moe.gate).__name__ == "MixtralTopKRouter"
    assert isinstance(moe.experts, GroupedFp8Experts)
    assert report["model.layers.0.mlp.experts"].precision == "fp8:fp8-current"
    assert report["model.layers.0.mlp.gate"].precision == "bf16"
    # embeddings, norms and the head stay as they were (bf16), like on a dense model
    assert type(m.model.embed_tokens) is nn.Embedding and type(m.lm_head) is nn.Linear
    norms = [n for n, mod in m.named_modules() if type(mod).__name__ == "MixtralRMSNorm"]
    assert len(norms) == 3 and all(report[n].precision == "bf16" for n in norms)
    assert report["model.embed_tokens"].precision == "bf16" and report["lm_head"].precision == "bf16"
    assert report["model.embed_tokens"].role == "embedding" and report["lm_head"].role == "head"
    # the grouped FP8 experts compute what the bf16 experts compute, up to FP8 quantization
    with torch.no_grad():
        y = m(input_ids=IDS).logits.float()
        y_ref = ref(input_ids=IDS).logits.float()
    snr = 10 * torch.log10(y_ref.pow(2).mean() / (y - y_ref).pow(2).mean())
    assert snr > 20
    out = _step(m)
    assert moe.experts.gate_up_proj.grad is not None and torch.isfinite(out.loss)


def test_fp4_moe_experts_grouped_with_their_rounding_state():
    """FP4 recipes convert fused experts too: every expert's shell keeps FP4's [seed, step] buffer (made
    on the experts' device, as delayed scaling's buffers are), and a step trains through them."""
    m = tiny_mixtral()
    report = convert_for_training(m, "fp4-nvfp4")
    experts = m.model.layers[0].mlp.experts
    assert report["model.layers.0.mlp.experts"].precision == "fp4:fp4-nvfp4"
    shells = [*experts.fp8_gate_up, *experts.fp8_down]
    assert all(s.fp4_state.tolist() == [0, 0] and s.fp4_state.device.type == "cpu" for s in shells)
    _step(m)
    assert experts.gate_up_proj.grad is not None


def test_fp8_qwen_moe_shared_expert_and_router():
    cfg = transformers.Qwen2MoeConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    m = transformers.Qwen2MoeForCausalLM(cfg)
    report = convert_for_training(m, "fp8-rowwise")
    mlp = "model.layers.0.mlp"
    assert report[f"{mlp}.gate"].precision == "bf16" and report[f"{mlp}.gate"].role == "router"
    assert report[f"{mlp}.shared_expert.gate_proj"].precision == "fp8:fp8-rowwise"
    assert report[f"{mlp}.shared_expert_gate"].precision == "bf16"  # Linear(64, 1)
    assert report[f"{mlp}.experts"].converted_to == "GroupedFp8Experts"
    _step(m)


def test_fp8_layer_the_recipe_cannot_take_is_reported():
    class OddExperts(nn.Module):  # fused experts stored transposed: no grouped path
        is_transposed = True

        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(4, 32, 64))
            self.down_proj = nn.Parameter(torch.randn(4, 32, 32))

    m = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 24))
    m.add_module("experts", OddExperts())
    report = convert_for_training(m, "fp8-rowwise")
    assert report["experts"].precision.startswith("skipped") and "transposed" in report["experts"].reason
    assert report["1"].precision == "bf16" and "not multiples of 16" in report["1"].reason
    assert report.skipped == ["experts"] and report.converted == ["0"]


def test_fp8_nothing_to_convert():
    m = nn.Sequential(nn.Embedding(10, 8), nn.LayerNorm(8), nn.Linear(8, 10))
    with pytest.raises(MixprecError, match="nothing to convert"):
        convert_for_training(m, "fp8-delayed")
    with pytest.raises(MixprecError, match=r"option|recipe"):
        convert_for_training(tiny_llama(), "fp8-delayed:colour=blue")


def test_fast_paths_report_and_undo():
    before = torch.get_float32_matmul_precision()
    handle = mixprec.enable_fast_paths()
    assert torch.get_float32_matmul_precision() == "high"
    d = handle.to_dict()
    assert "float32_matmul_precision" in d["settings"]
    if not torch.cuda.is_available():
        assert not d["settings"]["cuda.matmul.allow_tf32"]["effective_here"]
    handle.undo()
    assert torch.get_float32_matmul_precision() == before
    with mixprec.training.true_fp32():
        assert torch.get_float32_matmul_precision() == "highest"


def test_cpu_bf16_gemm_choice():
    from mixprec.kernels import bf16_cpu

    m = tiny_llama()
    report = convert_for_training(m, "bf16", cpu_bf16_gemm="fp32")
    assert any("compute in fp32" in n for n in report.notes)
    assert any(isinstance(h, bf16_cpu.Installed) for h in conversion_state(m).handles)
    m = tiny_llama()
    report = convert_for_training(m, "bf16-amp", cpu_bf16_gemm="native")
    assert not any(isinstance(h, bf16_cpu.Installed) for h in conversion_state(m).handles)
    # same numbers either way, up to accumulation order: compare logits of the two paths
    a, b = tiny_llama(), tiny_llama()
    convert_for_training(a, "bf16", cpu_bf16_gemm="fp32")
    convert_for_training(b, "bf16", cpu_bf16_gemm="native")
    with torch.no_grad():
        la, lb = a(input_ids=IDS).logits.float(), b(input_ids=IDS).logits.float()
    assert (la - lb).abs().max() < 0.1 * la.abs().max()


def test_fp32_island_around_a_container():
    m = tiny_llama()
    report = convert_for_training(
        m, "fp8-current", Policy(rules=(Rule("fp32", module_type="LlamaAttention"),))
    )
    attn = m.model.layers[0].self_attn
    assert type(attn.q_proj) is nn.Linear and attn.q_proj.weight.dtype == torch.float32
    assert report["model.layers.0.self_attn"].precision == "fp32"
    assert report["model.layers.0.mlp.up_proj"].precision == "fp8:fp8-current"
    out = _step(m)
    assert attn.q_proj.weight.grad.dtype == torch.float32 and torch.isfinite(out.loss)


def test_convert_after_wrapping_is_refused(tmp_path):
    """DDP and FSDP2 (DTensor parameters) are applied AFTER conversion; the other order is a clear error."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 8)))
        with pytest.raises(
            MixprecError, match="convert before wrapping: Sequential is already wrapped in Dist"
        ):
            convert_for_training(ddp, "bf16")
        sharded = fully_shard(nn.Sequential(nn.Linear(8, 8)), mesh=init_device_mesh("cpu", (1,)))
        with pytest.raises(
            MixprecError, match=r"convert before wrapping: .*DTensor parameters \(0\.weight and 1"
        ):
            convert_for_training(sharded, "fp8-delayed")
    finally:
        dist.destroy_process_group()


def test_fp8_delayed_expert_that_got_no_tokens_in_its_first_step_keeps_small_gradients():
    """An expert routed no tokens in step 1 has no scale after the advance; in step 2 it scales from
    its own amax (a placeholder scale of 1 would flush these 1e-6 gradients to zero)."""
    from mixprec.training import scaling_state

    m = tiny_mixtral()
    convert_for_training(m, "fp8-delayed")
    experts = m.model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(8, 64, generator=gen).to(torch.bfloat16)
    weights = torch.ones(8, 1, dtype=torch.bfloat16)
    experts(h, torch.zeros(8, 1, dtype=torch.long), weights).float().sum().backward()  # expert 0 only
    scaling_state.advance(m)
    assert experts.fp8_down[1].fp8_scale.tolist() == [0.0, 0.0, 0.0]  # expert 1: nothing recorded yet
    experts.down_proj.grad = None
    out = experts(h, torch.ones(8, 1, dtype=torch.long), weights)  # now expert 1 gets every token
    (out.float() * 1e-6).sum().backward()
    assert experts.down_proj.grad[1].abs().max() > 0
