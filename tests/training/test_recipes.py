"""Recipes: names and options, canonical specs, and which layout each GEMM operand gets."""

from __future__ import annotations

import pytest
import torch

from mixprec import recipes
from mixprec.errors import MixprecError
from mixprec.formats import E4M3, E5M2
from mixprec.gemm import check_operand
from mixprec.quantization import quantize
from mixprec.recipes import (
    GEMMS,
    Bf16AmpRecipe,
    Bf16Recipe,
    BlockwiseScaling,
    CurrentScaling,
    DelayedScaling,
    Fp16AmpRecipe,
    Fp32Recipe,
    MXFP8Scaling,
    RowwiseScaling,
    UnscaledFp8,
    from_name,
)
from mixprec.scaling import Granularity

FP8_NAMES = ["fp8-delayed", "fp8-current", "fp8-rowwise", "fp8-blockwise", "fp8-mxfp8", "fp8-unscaled"]


def test_every_name_builds_its_class():
    want = {
        "fp8-delayed": DelayedScaling(),
        "fp8-current": CurrentScaling(),
        "fp8-rowwise": RowwiseScaling(),
        "fp8-blockwise": BlockwiseScaling(),
        "fp8-mxfp8": MXFP8Scaling(),
        "fp8-unscaled": UnscaledFp8(),
        "fp4-nvfp4": recipes.NVFP4Training(),
        "fp4-mxfp4": recipes.MXFP4Training(),
        "fp32": Fp32Recipe(),
        "bf16": Bf16Recipe(),
        "bf16-amp": Bf16AmpRecipe(),
        "fp16-amp": Fp16AmpRecipe(),
    }
    assert set(want) == set(recipes.RECIPES)
    for name, obj in want.items():
        assert from_name(name) == obj
        assert from_name(name.upper().replace("-", "_")) == obj
        assert from_name(obj) is obj
        assert obj.spec() == name


def test_defaults_follow_the_guide_and_te():
    d = DelayedScaling()
    assert (d.amax_history_len, d.amax_compute_algo, d.margin, d.fp8_format) == (1024, "max", 0, "hybrid")
    f = Fp16AmpRecipe()
    assert (f.init_scale, f.growth_interval) == (2.0**14, 1000)
    assert Bf16Recipe().moments_dtype == "bf16" and Bf16Recipe().master_weights


@pytest.mark.parametrize(
    "spec,want",
    [
        ("fp8-delayed:e4m3", DelayedScaling(fp8_format="e4m3")),
        ("fp8-delayed:history=16,algo=most_recent,margin=1", DelayedScaling(16, "most_recent", 1)),
        ("fp8-delayed:history=16:most_recent", DelayedScaling(16, "most_recent")),
        ("fp8-current:e4m3", CurrentScaling("e4m3")),
        ("fp8-blockwise:pow2", BlockwiseScaling(power_of_two_scales=True)),
        ("fp8-blockwise:pow2=false", BlockwiseScaling()),
        ("fp8-mxfp8:rceil", MXFP8Scaling("rceil")),
        ("fp8-mxfp8:rounding=floor", MXFP8Scaling("floor")),
        ("fp16-amp:init_scale=2**16,growth_interval=2000", Fp16AmpRecipe(2.0**16, 2000)),
        ("bf16:moments=fp32", Bf16Recipe(moments_dtype="fp32")),
    ],
)
def test_options_from_the_name_and_spec_round_trip(spec, want):
    got = from_name(spec)
    assert got == want
    assert from_name(got.spec()) == got


@pytest.mark.parametrize(
    "spec,match",
    [
        ("fp8-delayd", "valid recipes: fp8-delayed, fp8-current"),
        ("int8", "unknown recipe"),
        ("fp8-delayed:e5m3", "valid options: e4m3, hybrid, max, most_recent, algo=, "),
        ("fp8-delayed:window=3", "unknown option 'window'"),
        ("fp8-delayed:history=abc", "expected an integer"),
        ("fp8-delayed:history=0", "amax_history_len must be a positive integer"),
        ("fp8-delayed:algo=mean", "amax_compute_algo"),
        ("fp8-delayed:margin=-1", "margin"),
        ("fp8-rowwise:pow2", "valid options: none"),
        ("fp8-blockwise:pow2=maybe", "boolean"),
        ("fp8-mxfp8:ceil", "floor, rceil"),
        ("bf16:moments=fp8", "moments_dtype"),
    ],
)
def test_unknown_names_and_options_are_clear_errors(spec, match):
    with pytest.raises(MixprecError, match=match):
        from_name(spec)


def test_hybrid_and_e4m3_formats():
    assert DelayedScaling().formats() == {"input": E4M3, "weight": E4M3, "grad_output": E5M2}
    assert DelayedScaling(fp8_format="e4m3").formats()["grad_output"] is E4M3
    for name in ("fp8-rowwise", "fp8-blockwise", "fp8-mxfp8", "fp8-unscaled"):
        assert set(from_name(name).formats().values()) == {E4M3}


def _ops(recipe, gemm):
    lay = recipe.gemm_layout(gemm)
    return [(op.role, op.transposed, op.granularity) for op in (lay.a, lay.b)]


def test_blockwise_layouts_are_deepseek_v3():
    r = BlockwiseScaling()
    tile, block = Granularity.blocks(1, 128), Granularity.blocks(128, 128)
    assert _ops(r, "output") == [("input", False, tile), ("weight", False, block)]
    assert _ops(r, "grad_input") == [("grad_output", False, tile), ("weight", True, block)]
    # dYᵀ and Xᵀ in 1x128 tiles = 128x1 tiles of dY and X
    assert _ops(r, "grad_weight") == [("grad_output", True, tile), ("input", True, tile)]
    assert r.gemm_layout("grad_weight").a.granularity.transposed() == Granularity.blocks(128, 1)


def test_rowwise_and_mx_requantize_along_each_gemms_k():
    rows = Granularity.rows()
    for gemm in GEMMS:
        assert [g for *_, g in _ops(RowwiseScaling(), gemm)] == [rows, rows]
        assert [g for *_, g in _ops(MXFP8Scaling(), gemm)] == [Granularity.mx(32)] * 2
    assert _ops(MXFP8Scaling("rceil"), "output")[0][2].mx_rounding == "rceil"
    assert RowwiseScaling().precision_layout() == {"input": rows, "weight": rows, "grad_output": rows}


@pytest.mark.parametrize("name", FP8_NAMES)
def test_every_operand_layout_is_one_a_kernel_runs(name, gen):
    """Quantize each operand as laid out and pass it through the seam's layout check (no columnwise)."""
    r = from_name(name)
    shapes = {"input": (256, 192), "weight": (160, 192), "grad_output": (256, 160)}
    for gemm in GEMMS:
        lay = r.gemm_layout(gemm)
        ks = []
        for op in (lay.a, lay.b):
            t = torch.randn(*shapes[op.role], generator=gen)
            t = t.t() if op.transposed else t
            q = quantize(t.contiguous(), op.fmt, op.granularity, power_of_two=op.power_of_two)
            check_operand(q, f"{name} {gemm}")
            ks.append(q.data.shape[1])
        assert ks[0] == ks[1]
    assert "grad_weight" in r.describe()


def test_each_recipe_carries_its_kind():
    assert all(from_name(n).kind == "fp8" for n in FP8_NAMES)
    assert {n: from_name(n).kind for n in ("fp32", "bf16", "bf16-amp", "fp16-amp")} == {
        "fp32": "fp32", "bf16": "bf16", "bf16-amp": "bf16-amp", "fp16-amp": "fp16-amp"
    }  # fmt: skip
    assert {cls.kind for cls in recipes.RECIPES.values()} == set(recipes.KINDS)
    assert from_name("fp8-delayed:e4m3").kind == DelayedScaling.kind == "fp8"  # a class attribute
    assert not any(hasattr(cls, "is_fp8") for cls in recipes.RECIPES.values())
    with pytest.raises(MixprecError, match="GEMM"):
        DelayedScaling().gemm_layout("attention")


def test_fp8_and_fp4_recipes_are_siblings_under_one_quantized_base():
    """An FP4 recipe is no FP8 recipe: both families derive from QuantizedRecipe, whose instances are
    exactly the recipes of the quantized kinds."""
    assert not issubclass(recipes.Fp4Recipe, recipes.Fp8Recipe)
    assert not issubclass(recipes.Fp8Recipe, recipes.Fp4Recipe)
    for cls in recipes.RECIPES.values():
        quantized = issubclass(cls, recipes.QuantizedRecipe)
        assert quantized == (cls.kind in recipes.QUANTIZED_KINDS), cls
        assert issubclass(cls, recipes.Fp8Recipe) == (cls.kind == "fp8"), cls
        assert issubclass(cls, recipes.Fp4Recipe) == (cls.kind == "fp4"), cls
