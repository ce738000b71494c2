"""`mixprec demo`: the training comparison and the inference half end to end, shrunk to seconds."""

from __future__ import annotations

import json

from mixprec.demo import DEMO_RECIPES, NEGATIVE_CONTROLS, demo_config, run_demo

TINY_MODEL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}


def test_demo_defaults_are_the_documented_comparison():
    cfg = demo_config()
    assert cfg.recipes == DEMO_RECIPES == ("bf16", "fp8-delayed", "fp8-current", "fp8-unscaled")
    assert NEGATIVE_CONTROLS == ("fp8-unscaled",)
    assert cfg.baseline == "bf16" and cfg.null_runs == 3  # every FP8 recipe against bf16 and its runs
    # the real recipes measure their own scatter; the negative control is judged without
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
    assert doc["schema_version"] == 3
    assert set(doc["negative_controls"]) == {"fp8-unscaled"} and isinstance(doc["conclusive"], bool)
    assert set(doc["seconds"]) == {"training", "inference", "total"}
    html = (out / "report.html").read_text()
    assert "mixprec demo" in html and "Verdict" in html and "FP8 inference" in html
    assert set(result.training.recipes) == set(DEMO_RECIPES)
    info = result.inference
    assert info["status"] == "done", info
    assert (out / "model-bf16" / "config.json").is_file()
    assert (out / "inference" / "report.html").is_file()
    assert {g["name"] for g in info["gates"]} >= {"max_ppl_increase"}
