"""`mixprec demo`: the training comparison and the inference half end to end, shrunk to seconds."""

from __future__ import annotations

import json

import pytest

from mixprec.demo import CONTROLS, DEMO_RECIPES, REAL_RECIPES, demo_config, run_demo, training_gate
from mixprec.verdicts import DIFFERENT, EQUIVALENT, FP8_MARGIN, INCONCLUSIVE, WORSE

TINY_MODEL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}


def test_demo_defaults_are_the_documented_comparison():
    cfg = demo_config()
    assert cfg.recipes == DEMO_RECIPES == ("bf16", "fp8-delayed", "fp8-current", "fp8-unscaled", "fp4-nvfp4")
    assert REAL_RECIPES == ("fp8-delayed", "fp8-current") and CONTROLS == ("fp8-unscaled", "fp4-nvfp4")
    assert cfg.baseline == "bf16" and cfg.null_runs == 3  # every FP8 recipe against bf16 and its runs
    assert cfg.verdict_loss == "both"  # train and held-out losses must both be equivalent
    # every recipe is held to FP8's margin, the subtle FP4 control too
    assert cfg.threshold_for("fp4-nvfp4") == cfg.threshold_for("fp8-current") == FP8_MARGIN
    # the real recipes measure their own scatter; the controls are judged without
    assert cfg.null_run_targets() == ["bf16", "fp8-delayed", "fp8-current"]
    assert cfg.data is None and cfg.model_dir is None  # the stdlib corpus and the built-in model
    cfg.validate()


def test_demo_runs_both_halves_and_reports(tmp_path):
    out = tmp_path / "demo"
    result = run_demo(
        out,
        progress=False,
        steps=4,
        batch_size=4,
        seq_len=32,
        vocab_size=320,
        max_chars=40_000,
        val_blocks=4,
        model_config=TINY_MODEL,
        null_runs=0,
    )
    doc = json.loads((out / "demo.json").read_text())
    assert doc["schema_version"] == 4
    assert set(doc["controls"]) == set(CONTROLS) and set(doc["real_recipes"]) == set(REAL_RECIPES)
    assert isinstance(doc["conclusive"], bool) and doc["detectable"] is None  # no null runs: no power figure
    assert set(doc["seconds"]) == {"training", "inference", "total"}
    html = (out / "report.html").read_text()
    assert "mixprec demo" in html and "Verdict" in html and "FP8 inference" in html
    assert set(result.training.recipes) == set(DEMO_RECIPES)
    info = result.inference
    assert info["status"] == "done", info
    assert (out / "model-bf16" / "config.json").is_file()
    assert (out / "inference" / "report.html").is_file()
    assert {g["name"] for g in info["gates"]} >= {"max_ppl_increase"}


@pytest.mark.parametrize(
    "real, controls, passed",
    [
        ((EQUIVALENT, EQUIVALENT), (WORSE, WORSE), True),
        ((EQUIVALENT, EQUIVALENT), (WORSE, DIFFERENT), True),  # a control detected in either direction
        ((EQUIVALENT, INCONCLUSIVE), (WORSE, WORSE), False),  # not shown equivalent
        ((EQUIVALENT, DIFFERENT), (WORSE, WORSE), False),  # lower than bf16 by more than the margin
        ((EQUIVALENT, WORSE), (WORSE, WORSE), False),
        ((EQUIVALENT, EQUIVALENT), (WORSE, INCONCLUSIVE), False),  # the subtle control not detected
        ((EQUIVALENT, EQUIVALENT), (EQUIVALENT, WORSE), False),
    ],
)
def test_the_demo_gate_passes_only_equivalent_recipes_and_detected_controls(real, controls, passed):
    verdicts = {"bf16": "baseline", **dict(zip(REAL_RECIPES, real)), **dict(zip(CONTROLS, controls))}
    assert training_gate(verdicts) is passed
