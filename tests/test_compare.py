"""`mixprec compare` on a tiny configuration: artefacts, agreement, repeatability, resume, broken recipe, bad input.

One module-scoped comparison is shared by the artefact and verdict tests; the repeatability and
resume tests run a smaller one (two recipes, 16 steps).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mixprec.cli import main
from mixprec.comparison.config import CompareConfig
from mixprec.comparison.outdir import MARKER
from mixprec.comparison.runner import compare
from mixprec.comparison.summary import summarize
from mixprec.errors import MixprecError

TINY_MODEL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}
TINY = dict(
    batch_size=4, seq_len=32, vocab_size=320, max_chars=40_000, val_blocks=4, eval_every=4, monitor_every=4,
    model_config=TINY_MODEL, lr=3e-3,
)  # fmt: skip


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _numbers(out: Path) -> tuple[list[dict], dict]:
    """metrics.jsonl and summary.json without wall-clock figures (the only thing a seed does not fix)."""
    summary = json.loads((out / "summary.json").read_text())
    summary.pop("speed")
    summary.pop("out_dir")
    summary.pop("report_path")
    return _records(out), summary


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """fp32, a correct fp8 recipe and the broken negative control (both judged against fp32), 20 steps.

    At this size and length the held-out loss is mostly unigram statistics learnt by the embeddings and
    the head, so the Linear layers that the broken recipe stops learning move it little: measured here
    fp8-delayed +0.02 %, fp8-unscaled +0.22 % validation gap at lr 1e-2. The fp8 threshold is therefore
    set to 0.1 % for this test (the default 0.25 % is sized for the default run)."""
    out = tmp_path_factory.mktemp("cmp") / "out"
    settings = dict(TINY, lr=1e-2, thresholds={"fp8": 0.001})
    summary = compare(["fp32", "fp8-delayed", "fp8-unscaled"], steps=20, out=out, progress=False, **settings)
    return summary, out


def test_writes_every_artefact_and_nothing_else(tiny):
    summary, out = tiny
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "report.html", "summary.json"]
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 4  # loss curves, gaps, heat maps
    assert "Verdict" in html and "fp8-unscaled" in html
    doc = json.loads((out / "summary.json").read_text())
    assert doc["schema_version"] == 2 and doc["verdict_loss"] == "train"
    assert all(r["schema_version"] == 1 for r in _records(out))
    kinds = {r["kind"] for r in _records(out)}
    assert {"step", "eval", "precision"} <= kinds
    runs = {r["run"] for r in _records(out)}
    assert runs == {"fp32", "fp8-delayed", "fp8-unscaled", "fp32~reorder"}
    assert summary.report_path == str(out / "report.html")


def test_summary_agrees_with_metrics(tiny):
    _, out = tiny
    doc = json.loads((out / "summary.json").read_text())
    recomputed = summarize(_records(out), CompareConfig.from_dict(doc["config"])).to_dict()
    assert recomputed["recipes"] == doc["recipes"]
    assert recomputed["noise_runs"] == doc["noise_runs"]
    # and by hand: the final train loss is the mean of the last 10 % of steps (20 steps -> 2)
    fp8 = doc["recipes"]["fp8-delayed"]
    losses = [r["loss"] for r in _records(out) if r["kind"] == "step" and r["run"] == "fp8-delayed"]
    assert len(losses) == 20
    assert fp8["final_train_loss"] == pytest.approx(sum(losses[-2:]) / 2, rel=1e-12)
    evals = [r["val_loss"] for r in _records(out) if r["kind"] == "eval" and r["run"] == "fp8-delayed"]
    assert fp8["final_val_loss"] == pytest.approx(sum(evals[-3:]) / 3, rel=1e-12)
    base = doc["recipes"]["fp32"]["final_val_loss"]
    assert fp8["val_gap"] == pytest.approx((fp8["final_val_loss"] - base) / base)
    assert fp8["baseline"] == "fp32" and fp8["noise_val"] == doc["noise_runs"]["fp32"]["val"]
    # the underflow peak is the largest underflow row of that run
    rows = [r for r in _records(out) if r["kind"] == "precision" and r["run"] == "fp8-unscaled"]
    top = max((r for r in rows if r["role"] == "grad_output"), key=lambda r: r["underflow"])
    peak = doc["recipes"]["fp8-unscaled"]["underflow_peak"]["grad_output"]
    assert peak == {"value": top["underflow"], "step": top["step"], "layer": top["layer"]}


def test_broken_recipe_fails_and_the_statistics_show_why(tiny):
    summary, _ = tiny
    broken = summary.recipes["fp8-unscaled"]
    assert broken.verdict == "fail"
    assert summary.passed is False and summary.exit_code == 1
    # E4M3 with scale 1: gradients (~1e-4) fall below E4M3's smallest subnormal and vanish
    assert broken.underflow_peak["grad_output"]["value"] > 0.5
    assert any("underflow up to 100.0% of grad_output" in r for r in broken.reasons)
    # its loss gap at 20 steps depends on the machine's BLAS (+0.22 % validation on one CPU, -0.16 % train
    # on another): the statistics fail it whichever way the gap fell
    assert broken.train_gap > summary.config["thresholds"]["fp8"] or any(
        "beyond their limits" in r for r in broken.reasons
    )
    good = summary.recipes["fp8-delayed"]
    assert good.underflow_peak["grad_output"]["value"] < broken.underflow_peak["grad_output"]["value"]
    assert summary.recipes["fp32"].verdict == "baseline"


SMALL = dict(TINY, checkpoint_every=4, noise=False)


def test_same_seed_same_numbers_and_resume_equals_uninterrupted(tmp_path):
    recipes = ["fp32", "fp8-delayed"]  # delayed scaling: its amax history must survive the resume
    compare(recipes, steps=12, out=tmp_path / "a", progress=False, **SMALL)
    compare(recipes, steps=12, out=tmp_path / "b", progress=False, **SMALL)
    assert _numbers(tmp_path / "a") == _numbers(tmp_path / "b")

    with pytest.raises(KeyboardInterrupt):
        compare(recipes, steps=12, out=tmp_path / "c", progress=False, stop_after=6, **SMALL)
    left = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert left == [MARKER, "checkpoints"]  # the marker and checkpoints, nothing else
    assert [p.name for p in (tmp_path / "c" / "checkpoints").iterdir()] == ["fp32.pt"]
    # an interrupted run is not silently overwritten
    assert main(["compare", "--out", str(tmp_path / "c"), "--recipes", "fp32", "--steps", "4"]) == 2
    compare(recipes, steps=12, out=tmp_path / "c", progress=False, resume=True, **SMALL)
    assert _numbers(tmp_path / "c") == _numbers(tmp_path / "a")
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [
        "metrics.jsonl",
        "report.html",
        "summary.json",
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--data", "{tmp}/missing.txt"], "does not exist"),
        (["--data", "{tmp}/empty"], "no .txt or .md"),
        (["--data", "{tmp}/empty.txt"], "empty corpus"),
        (["--recipes", "fp32,fp8-nonsense"], "fp8-nonsense"),
        (["--steps", "0"], "steps"),
        (["--model", "{tmp}/noweights"], "no .safetensors"),
        (["--recipes", "fp8-delayed"], "needs a baseline"),
    ],
)
def test_bad_input_exit_2_and_out_untouched(tmp_path, capsys, argv, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text("{}")
    (tmp_path / "noweights" / "pytorch_model.bin").write_bytes(b"")
    out = tmp_path / "out"
    args = ["compare", "--out", str(out), "--steps", "4", *[a.format(tmp=tmp_path) for a in argv]]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not out.exists()


def test_existing_out_refused_untouched(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["compare", "--out", str(out), "--steps", "4"]) == 2
    assert "--force" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def _synthetic(run: str, losses: list[float], vals: list[float]) -> list[dict]:
    rows = [
        {"kind": "step", "run": run, "step": i + 1, "loss": v, "skipped": False} for i, v in enumerate(losses)
    ]
    return rows + [{"kind": "eval", "run": run, "step": 4 * i, "val_loss": v} for i, v in enumerate(vals)]


def test_baselines_thresholds_and_verdicts_from_records():
    cfg = CompareConfig(
        recipes=("fp32", "bf16", "fp8-delayed", "fp8-current"), steps=10, eval_last=2, verdict_loss="val"
    )
    assert cfg.baselines() == {"fp32": None, "bf16": "fp32", "fp8-delayed": "bf16", "fp8-current": "bf16"}
    assert CompareConfig(recipes=("fp32", "fp8-delayed"), steps=10).baselines()["fp8-delayed"] == "fp32"
    assert (
        CompareConfig(recipes=("fp32", "bf16", "fp8-delayed"), baseline="fp32").baselines()["fp8-delayed"]
        == "fp32"
    )
    flat = [2.0] * 10
    records = (
        _synthetic("fp32", flat, [3.0, 2.0, 2.0])
        + _synthetic("bf16", flat, [3.0, 2.001, 2.001])  # +0.05 %: within 0.1 %
        + _synthetic("fp8-delayed", flat, [3.0, 2.005, 2.005])  # +0.2 % vs bf16's 2.001: within 0.25 %
        + _synthetic("fp8-current", flat, [3.0, 1.9, 2.02])  # mean 1.96: better than bf16, passes
        + _synthetic("fp32~reorder", flat, [3.0, 2.01, 2.01])
    )
    s = summarize(records, cfg)
    assert s.recipes["bf16"].val_gap == pytest.approx(0.0005)
    assert s.recipes["bf16"].noise_val == pytest.approx(0.005)
    assert s.recipes["fp8-delayed"].val_gap == pytest.approx(0.004 / 2.001)
    assert [r.verdict for r in s.recipes.values()] == ["baseline", "pass", "pass", "pass"]
    assert s.passed and s.exit_code == 0
    worse = [
        *records,
        {"kind": "nan_event", "run": "bf16", "step": 3, "layer": "l", "tensor": "loss", "type": "nan"},
    ]
    assert summarize(worse, cfg).recipes["bf16"].verdict == "fail"
    tight = CompareConfig(
        recipes=cfg.recipes, steps=10, eval_last=2, thresholds={"fp8": 0.001}, verdict_loss="val"
    )
    assert summarize(records, tight).recipes["fp8-delayed"].verdict == "fail"
    assert summarize(records, tight).exit_code == 1


def _precision_row(run: str, role: str, saturation: float, underflow: float) -> dict:
    return {"kind": "precision", "run": run, "step": 5, "layer": "l", "role": role,
            "saturation": saturation, "underflow": underflow}  # fmt: skip


def test_a_gap_within_the_baselines_noise_is_inconclusive_unless_the_statistics_show_a_problem():
    """Above the threshold but within the baseline's own run-to-run noise: not evidence of a precision
    loss (the demo's 120 steps show 2-4 % noise) -> "inconclusive", which does not fail the run. The
    same gap with saturation or underflow beyond the limits fails; a gap beyond the noise fails."""
    cfg = CompareConfig(recipes=("fp32", "fp8-current"), steps=10, eval_last=2)
    base = _synthetic("fp32", [2.0] * 10, [2.0, 2.0])
    noise = _synthetic("fp32~reorder", [2.0] * 9 + [2.04], [2.0, 2.0])  # last 10 % of steps: +2 % train

    def judged(fp8_last_loss, *precision):
        fp8 = _synthetic("fp8-current", [2.0] * 9 + [fp8_last_loss], [2.0, 2.0])
        return summarize(base + noise + fp8 + list(precision), cfg)

    s = judged(2.01)  # +0.5 %: above 0.25 %, within the 2 % noise
    r = s.recipes["fp8-current"]
    assert r.verdict == "inconclusive" and s.passed and s.exit_code == 0
    assert "run-to-run noise (+2.000%" in r.reasons[0] and "too short to tell" in r.reasons[0]
    quiet = [_precision_row("fp8-current", "grad_output", 0.005, 0.02)]  # under the 1 % / 5 % limits
    assert judged(2.01, *quiet).recipes["fp8-current"].verdict == "inconclusive"
    for bad, says in (
        (_precision_row("fp8-current", "input", 0.02, 0.0), "saturation up to 2.0% of input"),
        (_precision_row("fp8-current", "grad_output", 0.0, 0.9), "underflow up to 90.0% of grad_output"),
    ):
        r = judged(2.01, bad).recipes["fp8-current"]
        assert r.verdict == "fail" and "above the 0.25% threshold" in r.reasons[0]
        assert says in r.reasons[-1]
    assert judged(2.1).recipes["fp8-current"].verdict == "fail"  # +5 %: beyond the noise
    assert judged(2.004).recipes["fp8-current"].verdict == "pass"  # +0.2 %: within the threshold
    strict = CompareConfig(recipes=cfg.recipes, steps=10, eval_last=2, thresholds={"saturation": 0.001})
    mild = [_precision_row("fp8-current", "input", 0.005, 0.0)]
    assert (
        summarize(base + noise + _synthetic("fp8-current", [2.0] * 9 + [2.01], [2.0, 2.0]) + mild, strict)
        .recipes["fp8-current"]
        .verdict
        == "fail"
    )
    with pytest.raises(MixprecError, match="threshold saturation"):
        CompareConfig(recipes=cfg.recipes, thresholds={"saturation": -1}).validate()


def test_statistics_beyond_their_limits_fail_a_recipe_whose_gap_is_within_the_threshold():
    cfg = CompareConfig(recipes=("fp32", "fp8-current"), steps=10, eval_last=2)
    base = _synthetic("fp32", [2.0] * 10, [2.0, 2.0])
    fp8 = _synthetic("fp8-current", [2.0] * 10, [2.0, 2.0])  # the same loss: a gap of 0
    clean = summarize(base + fp8 + [_precision_row("fp8-current", "grad_output", 0.0, 0.049)], cfg)
    assert clean.recipes["fp8-current"].verdict == "pass"
    lost = summarize(base + fp8 + [_precision_row("fp8-current", "grad_output", 0.0, 1.0)], cfg)
    judged = lost.recipes["fp8-current"]
    assert judged.verdict == "fail" and lost.exit_code == 1
    assert judged.reasons[0].startswith("train loss +0.000% vs fp32, within the 0.25% threshold, but")
    assert judged.reasons[1:] == ["underflow up to 100.0% of grad_output (l, step 5)"]


def test_library_entry_point_is_the_comparison_function():
    import mixprec
    from mixprec.comparison.runner import compare

    assert mixprec.compare is compare
    with pytest.raises(MixprecError, match="steps"):
        mixprec.compare(["fp32"], steps=0)


def test_resume_refuses_checkpoints_of_the_other_kind(tmp_path):
    """One process checkpoints into <run>.pt, torchrun ranks into <run>.dist/: resuming one kind with the
    other would silently start over, so it is refused (checked before any run starts)."""
    from mixprec.comparison.runner import _check_checkpoint_kind

    (tmp_path / "fp32.dist").mkdir()
    with pytest.raises(MixprecError, match=r"multi-rank checkpoints .*fp32\.dist.*torchrun"):
        _check_checkpoint_kind(tmp_path, world=1)
    _check_checkpoint_kind(tmp_path, world=2)
    (tmp_path / "bf16.pt").write_bytes(b"")
    with pytest.raises(MixprecError, match=r"single-process checkpoints .*bf16\.pt.*without torchrun"):
        _check_checkpoint_kind(tmp_path, world=2)
