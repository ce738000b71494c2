"""The automatic training policy: a model built to need it keeps exactly the layer that needs it.

The model: a small Llama whose first MLP has one dead unit (its gate and up rows zero, so the unit's
activation is exactly 0 and no gradient reaches its weights) with a large outgoing weight column in
down_proj (2^16 against weights of ~0.02). In bf16 the unit is an exact no-op; but it sets the FP8 scale
of down_proj's weight, whatever the recipe's granularity along that row, and the other weights flush to
zero. The profile sees it; the automatic policy keeps that down_proj in bf16, and nothing else.
"""

from __future__ import annotations

import copy

import pytest
import torch

from mixprec.comparison import runner
from mixprec.comparison.config import DEFAULT_THRESHOLDS, CompareConfig
from mixprec.comparison.runner import run_specs, with_automatic_policies
from mixprec.comparison.training_run import train_run
from mixprec.data import TokenizedData
from mixprec.errors import MixprecError
from mixprec.models import ReferenceModelConfig, build_reference_model, lm_loss
from mixprec.sensitivity import Limits, automatic_policy, profile_model
from mixprec.sensitivity.policy import exact_pattern
from mixprec.training import Policy, convert_for_training

VOCAB = 256
DEAD_UNIT, BIG = 5, 2.0**16
NEEDY = "model.layers.0.mlp.down_proj"


def needy_model() -> torch.nn.Module:
    cfg = ReferenceModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    model = build_reference_model(VOCAB, seed=0, config=cfg)
    mlp = model.model.layers[0].mlp
    with torch.no_grad():
        mlp.gate_proj.weight[DEAD_UNIT] = 0
        mlp.up_proj.weight[DEAD_UNIT] = 0
        mlp.down_proj.weight[:, DEAD_UNIT] = BIG
    return model


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (2, 32), generator=g) for _ in range(n)]


@pytest.fixture(scope="module")
def profile():
    return profile_model(needy_model(), batches(1), recipes=["fp8-current", "fp8-rowwise"])


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-rowwise"])
def test_the_automatic_policy_keeps_exactly_the_layer_that_needs_it(profile, recipe):
    auto = automatic_policy(profile, recipe)
    assert [k.name for k in auto.kept] == [NEEDY]
    assert any(r.startswith("weight underflows") for r in auto.kept[0].reasons)
    assert profile.cell(NEEDY, "weight", recipe).peak_underflow > 0.9


def test_convert_for_training_takes_it_and_the_model_gets_closer_to_bf16(profile):
    model = needy_model()
    auto = automatic_policy(profile, "fp8-current")
    assert isinstance(auto.policy, Policy)
    batch = batches(3)[-1]

    def loss_under(recipe: str, policy=None):
        m = copy.deepcopy(model)
        report = convert_for_training(m, recipe, policy)
        with torch.no_grad():
            return float(lm_loss(m, batch)), report

    bf16, _ = loss_under("bf16")
    default, _ = loss_under("fp8-current")
    automatic, report = loss_under("fp8-current", auto.policy)
    entry = next(e for e in report.entries if e.name == NEEDY)
    assert entry.precision == "bf16" and "automatic policy for fp8-current: weight underflows" in entry.reason
    converted = [e.name for e in report.entries if e.precision.startswith("fp8")]
    assert len(converted) == 6 and NEEDY not in converted  # q, k, v, o, gate, up
    # default FP8 loses the MLP's down projection; the automatic policy keeps it
    assert abs(automatic - bf16) < abs(default - bf16) / 10


def test_limits_come_from_one_home_and_change_the_decision(profile):
    assert (DEFAULT_THRESHOLDS["saturation"], DEFAULT_THRESHOLDS["underflow"]) == (
        Limits().saturation, Limits().underflow
    )  # fmt: skip
    lax = Limits(underflow=1.0, min_snr_db=-100.0)
    assert automatic_policy(profile, "fp8-current", lax).kept == ()
    with pytest.raises(MixprecError, match="underflow"):
        Limits(underflow=2.0)
    with pytest.raises(MixprecError, match="not in the profile"):
        automatic_policy(profile, "fp8-blockwise")


def test_rules_name_exactly_one_layer():
    names = ["a.mlp.down_proj", "mlp.down_proj", "b.up"]
    assert exact_pattern("a.mlp.down_proj", names) == "a.mlp.down_proj"
    assert exact_pattern("mlp.down_proj", names) == r"re:mlp\.down_proj$"


def test_compare_policy_auto_gives_each_fp8_run_its_policy_and_reports_it(monkeypatch):
    monkeypatch.setattr(runner, "AUTO_POLICY_PASSES", 1)
    g = torch.Generator().manual_seed(0)
    data = TokenizedData(torch.randint(0, VOCAB, (8, 32), generator=g), torch.randint(0, VOCAB, (2, 32), generator=g),
                         VOCAB, 32, tokenizer=None)  # fmt: skip
    config = CompareConfig(recipes=("bf16", "fp8-current"), baseline="bf16", steps=1, batch_size=2, seq_len=32,
                           null_runs=0, policy="auto")  # fmt: skip
    config.validate()
    info: dict = {}
    model = needy_model()
    specs = with_automatic_policies(config, run_specs(config), model, data, info)
    by_name = {s.name: s for s in specs}
    assert by_name["bf16"].policy is None
    kept = info["automatic_policy"]["policies"]["fp8-current"]["kept"]
    assert [k["layer"] for k in kept] == [NEEDY]
    result = train_run(by_name["fp8-current"], model, data)
    entry = next(e for e in result.conversion if e["module"] == NEEDY)
    assert entry["precision"] == "bf16" and "automatic policy" in entry["reason"]
    with pytest.raises(MixprecError, match="policy"):
        CompareConfig(policy="smart").validate()


def test_fp4_recipes_are_held_to_fp4_limits():
    """E2M1 zeroes values below 1/24 of a block's maximum and quantizes Gaussian values at 19-20 dB by
    design: held to the FP8 limits, every FP4 layer would be kept; held to FP4's own, only the layer
    whose weight underflows almost wholly is."""
    limits = Limits()
    fp4 = limits.for_kind("fp4")
    assert (fp4.underflow, fp4.min_snr_db, fp4.saturation) == (0.5, 13.0, limits.saturation)
    assert limits.for_kind("fp8") is limits
    fp4_profile = profile_model(needy_model(), batches(1), recipes=["fp4-nvfp4"])
    auto = automatic_policy(fp4_profile, "fp4-nvfp4")
    assert [k.name for k in auto.kept] == [NEEDY]
    assert any(r.startswith("weight underflows") for r in auto.kept[0].reasons)
    strict = automatic_policy(fp4_profile, "fp4-nvfp4", Limits(fp4_underflow=0.05, fp4_min_snr_db=20.0))
    assert len(strict.kept) > 1  # the FP8 limits would keep healthy FP4 layers too
