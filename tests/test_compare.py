"""`mixprec compare` on a tiny configuration: artefacts, agreement, repeatability, resume, broken recipe, bad input.

One module-scoped comparison is shared by the artefact and verdict tests; the repeatability and
resume tests run a smaller one (two recipes, 16 steps).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import torch

from mixprec.cli import main
from mixprec.comparison.config import CompareConfig
from mixprec.comparison.outdir import MARKER
from mixprec.comparison.runner import compare
from mixprec.comparison.summary import summarize
from mixprec.errors import MixprecError
from mixprec.verdicts import FP8_MARGIN, HALF_MARGIN, replicate_interval, student_t_quantile

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
    """fp32, a correct fp8 recipe and the broken negative control (both judged against fp32, so each is
    re-run from perturbed weights too: fp32's runs barely scatter), 2 null runs each, 20 steps.

    At this size and length the held-out loss is mostly unigram statistics learnt by the embeddings and
    the head, so the Linear layers that the broken recipe stops learning move it little: measured here
    fp8-delayed +0.02 %, fp8-unscaled +0.22 % validation gap at lr 1e-2 — the statistics, not the loss,
    catch it at this length."""
    out = tmp_path_factory.mktemp("cmp") / "out"
    settings = dict(TINY, lr=1e-2, null_runs=2)
    summary = compare(["fp32", "fp8-delayed", "fp8-unscaled"], steps=20, out=out, progress=False, **settings)
    return summary, out


def test_writes_every_artefact_and_nothing_else(tiny):
    summary, out = tiny
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "report.html", "summary.json"]
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 4  # loss curves, gaps, heat maps
    assert "Verdict" in html and "fp8-unscaled" in html and "Null check of fp32" in html
    doc = json.loads((out / "summary.json").read_text())
    assert doc["schema_version"] == 6 and doc["verdict_loss"] == "both"
    assert all(r["schema_version"] == 2 for r in _records(out))
    kinds = {r["kind"] for r in _records(out)}
    assert {"step", "eval", "precision"} <= kinds
    runs = {r["run"] for r in _records(out)}
    recipes = ("fp32", "fp8-delayed", "fp8-unscaled")
    assert runs == {*recipes, *(f"{r}~null{k}" for r in recipes for k in (1, 2))}
    assert summary.report_path == str(out / "report.html")


def test_summary_agrees_with_metrics(tiny):
    _, out = tiny
    doc = json.loads((out / "summary.json").read_text())
    recomputed = summarize(_records(out), CompareConfig.from_dict(doc["config"])).to_dict()
    assert recomputed["recipes"] == doc["recipes"]
    assert recomputed["bands"] == doc["bands"]
    # and by hand: the final train loss is the mean of the last 10 % of steps (20 steps -> 2)
    fp8 = doc["recipes"]["fp8-delayed"]
    losses = {}
    for r in _records(out):
        if r["kind"] == "step":
            losses.setdefault(r["run"], []).append(r["loss"])
    assert len(losses["fp8-delayed"]) == 20
    assert fp8["final_train_loss"] == pytest.approx(sum(losses["fp8-delayed"][-2:]) / 2, rel=1e-12)
    evals = [r["val_loss"] for r in _records(out) if r["kind"] == "eval" and r["run"] == "fp8-delayed"]
    assert fp8["final_val_loss"] == pytest.approx(sum(evals[-3:]) / 3, rel=1e-12)
    base = doc["recipes"]["fp32"]["final_val_loss"]
    assert fp8["val_gap"] == pytest.approx((fp8["final_val_loss"] - base) / base)

    # the band, by hand: the baseline and its null runs are equally good runs; one more such run may land
    # t(2 degrees of freedom) x their spread x sqrt(1 + 1/3) from their mean
    def window_gap(run):
        return sum(losses[run][-2:]) / sum(losses["fp32"][-2:]) - 1

    gaps = [window_gap(f"fp32~null{k}") for k in (1, 2)]
    assert doc["bands"]["fp32"]["train"] == pytest.approx(gaps, rel=1e-9)
    refs = [0.0, *gaps]
    assert fp8["band_train"] == pytest.approx(
        4.302652729911275 * statistics.stdev(refs) * math.sqrt(1 + 1 / 3), rel=1e-6
    )
    # the recipe has its own null runs: the difference of the means of the two groups of runs, with
    # Welch's interval (t at the Welch-Satterthwaite degrees of freedom, rounded down)
    cands = [window_gap(r) for r in ("fp8-delayed", "fp8-delayed~null1", "fp8-delayed~null2")]
    vc, vr = statistics.variance(cands) / 3, statistics.variance(refs) / 3
    dof = max(1, math.floor((vc + vr) ** 2 / (vc**2 / 2 + vr**2 / 2)))
    half = student_t_quantile(0.975, dof) * math.sqrt(vc + vr)
    estimate = statistics.mean(cands) - statistics.mean(refs)
    assert fp8["intervals"]["train"]["estimate"] == pytest.approx(estimate, rel=1e-9, abs=1e-15)
    assert fp8["intervals"]["train"]["high"] - fp8["intervals"]["train"]["low"] == pytest.approx(
        2 * half, rel=1e-9
    )
    # the underflow peak is the largest underflow row of that run
    rows = [r for r in _records(out) if r["kind"] == "precision" and r["run"] == "fp8-unscaled"]
    top = max((r for r in rows if r["role"] == "grad_output"), key=lambda r: r["underflow"])
    peak = doc["recipes"]["fp8-unscaled"]["underflow_peak"]["grad_output"]
    assert peak == {"value": top["underflow"], "step": top["step"], "layer": top["layer"]}


def test_null_runs_start_from_weights_one_ulp_away_and_pass_the_null_check(tiny):
    """The null check first: a rounding-level perturbation of the baseline is as good as the baseline,
    so null run 1, judged like a recipe against the baseline and the other one, must come out equivalent."""
    summary, out = tiny
    check = summary.bands["fp32"]["null_check"]
    assert check["run"] == "fp32~null1" and check["against"] == ["fp32", "fp32~null2"]
    assert check["verdict"] == "equivalent", check
    # the perturbation changed each run (an fp32 ulp can leave a 2-step window's mean loss unchanged at
    # this length, so the whole curve is compared)
    losses = {}
    for r in _records(out):
        if r["kind"] == "step":
            losses.setdefault(r["run"], []).append(r["loss"])
    assert all(losses[f"fp32~null{k}"] != losses["fp32"] for k in (1, 2))


def test_perturbation_moves_weights_by_exactly_one_ulp():
    import torch

    from mixprec.comparison.training_run import PERTURBED_SHARE, perturb_weights

    for dtype in (torch.bfloat16, torch.float32):
        w = torch.randn(4096, dtype=torch.float32).to(dtype).float()
        w[0] = 0.0
        model = torch.nn.Linear(4096, 1, bias=False)
        model.weight.data.copy_(w)
        perturb_weights(model, seed=7, ulp_dtype=dtype)
        moved = model.weight.data[0]
        changed = moved != w
        assert not bool(changed[0])  # zero stays zero
        assert abs(changed.float().mean().item() - PERTURBED_SHARE) < 0.05
        # each moved element is the format's next or previous representable value
        up = torch.nextafter(w.to(dtype), torch.tensor(float("inf"), dtype=dtype)).float()
        down = torch.nextafter(w.to(dtype), torch.tensor(float("-inf"), dtype=dtype)).float()
        assert bool(((moved == up) | (moved == down))[changed].all())
        again = torch.nn.Linear(4096, 1, bias=False)
        again.weight.data.copy_(w)
        perturb_weights(again, seed=7, ulp_dtype=dtype)
        assert torch.equal(again.weight.data, model.weight.data)  # the seed fixes the perturbation


def test_broken_recipe_is_worse_and_the_statistics_show_why(tiny):
    summary, _ = tiny
    broken = summary.recipes["fp8-unscaled"]
    assert broken.verdict == "worse"
    assert summary.passed is False and summary.exit_code == 1
    # E4M3 with scale 1: gradients (~1e-4) fall below E4M3's smallest subnormal and vanish
    assert broken.underflow_peak["grad_output"]["value"] > 0.5
    assert any("underflow up to 100.0% of grad_output" in r for r in broken.reasons)
    good = summary.recipes["fp8-delayed"]
    assert good.underflow_peak["grad_output"]["value"] < broken.underflow_peak["grad_output"]["value"]
    assert summary.recipes["fp32"].verdict == "baseline"


SMALL = dict(TINY, checkpoint_every=4, null_runs=0)


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


def test_baselines_and_margins():
    cfg = CompareConfig(recipes=("fp32", "bf16", "fp8-delayed", "fp8-current"), steps=10)
    assert cfg.baselines() == {"fp32": None, "bf16": "fp32", "fp8-delayed": "bf16", "fp8-current": "bf16"}
    assert CompareConfig(recipes=("fp32", "fp8-delayed"), steps=10).baselines()["fp8-delayed"] == "fp32"
    assert (
        CompareConfig(recipes=("fp32", "bf16", "fp8-delayed"), baseline="fp32").baselines()["fp8-delayed"]
        == "fp32"
    )
    assert cfg.threshold_for("fp8-delayed") == FP8_MARGIN and cfg.threshold_for("bf16") == HALF_MARGIN
    with pytest.raises(MixprecError, match="null_runs"):
        CompareConfig(recipes=cfg.recipes, null_runs=1).validate()


def _precision_row(run: str, role: str, saturation: float, underflow: float) -> dict:
    return {"kind": "precision", "run": run, "step": 5, "layer": "l", "role": role,
            "saturation": saturation, "underflow": underflow}  # fmt: skip


# Synthetic curves: 20 steps, window = the last 2; the baseline is flat at 2.0; the null runs sit at
# fixed relative offsets over the window; the candidate at a fixed gap g. The members (baseline + null
# runs) are [0, *NULLS]: the decided interval is g - mean(members) ± t3 x stdev(members) x sqrt(1 + 1/4).
NULLS = (0.0002, -0.0004, 0.0003)
T3_975 = 3.182446305284263  # Student's t, 3 degrees of freedom, 0.975 (tabulated)
CENTRE = statistics.mean((0.0, *NULLS))
HALF = T3_975 * statistics.stdev((0.0, *NULLS)) * math.sqrt(1 + 1 / 4)  # 0.110 %


def _judged(gap, *extra, nulls=NULLS, early=None, recipe="fp8-current", val_gap=None, **settings):
    """Summary of bf16 (baseline) + its null runs + `recipe` at `gap`; `early`: the null offsets over
    the first half of the run (default: the same as the window's); `val_gap`: the recipe's held-out gap
    (default: `gap`)."""
    cfg = CompareConfig(recipes=("bf16", recipe), baseline="bf16", steps=20, eval_last=2, **settings)
    early = nulls if early is None else early

    def curve(late_offset, early_offset):
        return [2.0 * (1 + (early_offset if i < 10 else late_offset)) for i in range(20)]

    rows = _synthetic("bf16", curve(0, 0), [2.0, 2.0])
    for k, (late, first) in enumerate(zip(nulls, early), start=1):
        rows += _synthetic(f"bf16~null{k}", curve(late, first), [2.0 * (1 + late)] * 2)
    rows += _synthetic(recipe, curve(gap, gap), [2.0 * (1 + (gap if val_gap is None else val_gap))] * 2)
    return summarize(rows + list(extra), cfg)


def test_both_losses_must_be_equivalent_and_either_can_fail_the_recipe():
    inside, above, below, straddling = CENTRE, 0.01 + CENTRE, -0.01 + CENTRE, FP8_MARGIN + CENTRE
    cases = [  # (train gap, held-out gap) -> verdict
        ((inside, inside), "equivalent"),
        ((inside, above), "worse"),  # a held-out loss that disagrees is consulted
        ((above, inside), "worse"),
        ((inside, below), "different"),
        ((below, above), "worse"),  # worse wins over different
        ((inside, straddling), "inconclusive"),
        ((straddling, below), "different"),
    ]
    for (train, val), verdict in cases:
        r = _judged(train, val_gap=val).recipes["fp8-current"]
        assert r.verdict == verdict, (train, val, r.loss_verdicts, r.reasons)
        assert set(r.loss_verdicts) == {"train", "val"} and set(r.intervals) == {"train", "val"}
    # one loss alone, when asked: the other is reported, not judged
    only_train = _judged(inside, val_gap=above, verdict_loss="train").recipes["fp8-current"]
    assert only_train.verdict == "equivalent" and set(only_train.loss_verdicts) == {"train"}
    assert only_train.val_gap == pytest.approx(above, rel=1e-6)
    assert _judged(inside, val_gap=above, verdict_loss="val").recipes["fp8-current"].verdict == "worse"
    with pytest.raises(MixprecError, match="verdict_loss must be one of both, train, val"):
        CompareConfig(recipes=("bf16", "fp8-current"), verdict_loss="mean").validate()


def test_minimum_detectable_effect_from_the_band():
    """One run judged against n = 4 equally good runs: its interval is estimate ± t3 s sqrt(1 + 1/4); it
    comes out worse with 80 % probability when the true gap is margin + (t3(0.975) + t3(0.80)) s sqrt(1 + 1/4)."""
    s = _judged(CENTRE)
    band = s.bands["bf16"]
    se = statistics.stdev((0.0, *NULLS)) * math.sqrt(1 + 1 / 4)
    t3_80 = 0.9784723123633045  # Student's t, 3 degrees of freedom, 0.80 (tabulated)
    expected = FP8_MARGIN + (T3_975 + t3_80) * se
    assert band["detectable_train"] == pytest.approx(expected, rel=1e-6)
    assert band["detectable_val"] == pytest.approx(expected, rel=1e-6) and band["margin"] == FP8_MARGIN
    r = s.recipes["fp8-current"]
    assert r.detectable == {
        "train": pytest.approx(expected, rel=1e-6),
        "val": pytest.approx(expected, rel=1e-6),
    }
    # and by simulation: true gap at the detectable effect, equally good runs scattering with s -> the
    # interval lies wholly above the margin in ~80 % of comparisons
    generator = torch.Generator().manual_seed(0)
    spread = statistics.stdev((0.0, *NULLS))
    trials, detected = 4000, 0
    for _ in range(trials):
        refs = (torch.randn(4, generator=generator, dtype=torch.float64) * spread).tolist()
        candidate = expected + float(torch.randn(1, generator=generator, dtype=torch.float64)) * spread
        iv = replicate_interval(candidate, refs)
        detected += iv.low > FP8_MARGIN
    assert 0.77 < detected / trials < 0.83


def test_verdict_boundaries_on_synthetic_curves():
    margin = FP8_MARGIN
    edge = margin - HALF  # the largest |estimate| whose interval lies within ±margin
    for estimate in (-0.99 * edge, 0.0, 0.5 * edge, 0.99 * edge):
        r = _judged(estimate + CENTRE).recipes["fp8-current"]
        assert r.verdict == "equivalent", (estimate, r.reasons)
        for loss in ("train", "val"):  # the synthetic runs' held-out gaps equal their train gaps
            iv = r.intervals[loss]
            assert iv["low"] == pytest.approx(estimate - HALF) and iv["high"] == pytest.approx(
                estimate + HALF
            )
        assert r.band_train == pytest.approx(HALF) and r.null_runs_to_settle is None
    # inconclusive: the interval straddles +margin or -margin (either side of it)
    for estimate in (1.01 * edge, margin, margin + 0.99 * HALF, -1.01 * edge, -margin, -margin - 0.99 * HALF):
        s = _judged(estimate + CENTRE)
        r = s.recipes["fp8-current"]
        assert r.verdict == "inconclusive", (estimate, r.reasons)
        assert s.passed and s.exit_code == 0  # inconclusive does not fail (only --strict makes it)
        assert "not wholly within ±0.25%" in r.reasons[0]
    # different: the whole interval below -margin — lower than the baseline by more than rounding explains;
    # it fails the gate like worse, unless improvements are accepted
    for estimate in (-margin - 1.01 * HALF, -0.02):
        s = _judged(estimate + CENTRE)
        r = s.recipes["fp8-current"]
        assert r.verdict == "different" and r.direction == "lower", (estimate, r.reasons)
        assert r.loss_verdicts == {"train": "different", "val": "different"}
        assert not s.passed and s.exit_code == 1 and s.failures() == ["fp8-current"]
        assert s.gate(accept_better=True) and s.gate(accept_better=True, strict=True)  # strict: inconclusive
        assert (
            "wholly below -0.25%" in r.reasons[0] and "something changed more than rounding" in r.reasons[0]
        )
    # worse: the whole interval above the margin
    for estimate in (margin + 1.01 * HALF, 0.05):
        s = _judged(estimate + CENTRE)
        assert s.recipes["fp8-current"].verdict == "worse" and not s.passed and s.exit_code == 1
        assert s.recipes["fp8-current"].direction == "higher" and not s.gate(accept_better=True)
        assert "wholly above the 0.25% margin" in s.recipes["fp8-current"].reasons[0]
    # a wider spread of equally good runs turns the same gap from equivalent into inconclusive
    assert _judged(0.001).recipes["fp8-current"].verdict == "equivalent"
    assert _judged(0.001, nulls=(0.002, -0.001, 0.0)).recipes["fp8-current"].verdict == "inconclusive"
    # the margin can be set
    assert _judged(0.001, thresholds={"fp8": 0.0015}).recipes["fp8-current"].verdict == "inconclusive"


def test_null_runs_to_settle_from_the_spread_of_equally_good_runs():
    # estimate 0.16 %: 0.09 % from the margin. With the spread s of the 4 runs, n runs give a half-width
    # t(n-1) s sqrt(1 + 1/n): 4 -> 0.110 %, 5 -> 0.094 %, 6 -> 0.086 % < 0.09 %: 6 runs, 5 null runs
    spread = statistics.stdev((0.0, *NULLS))
    halves = {n: statistics_t(n - 1) * spread * math.sqrt(1 + 1 / n) for n in (5, 6)}
    assert halves[5] > 0.0009 > halves[6]
    r = _judged(0.0016 + CENTRE).recipes["fp8-current"]
    assert r.verdict == "inconclusive" and r.null_runs_to_settle == 5
    assert "about 5 null runs would settle it (--null-runs 5)" in r.reasons
    # 0.01 % from the margin: one run of the recipe scatters by more than that on its own
    close = _judged(0.0024 + CENTRE).recipes["fp8-current"]
    assert close.null_runs_to_settle == -1 and any("no number of null runs" in x for x in close.reasons)


def test_a_recipe_with_null_runs_of_its_own_brings_its_own_spread():
    own = (0.001, -0.001)  # the recipe's own null runs, relative to the recipe's run
    gap = 0.0005
    rows = [
        row
        for k, offset in enumerate(own, start=1)
        for row in _synthetic(
            f"fp8-current~null{k}", [2.0 * (1 + gap + offset)] * 20, [2.0 * (1 + gap + offset)] * 2
        )
    ]
    r = _judged(gap, *rows).recipes["fp8-current"]
    cands, refs = [gap, gap + own[0], gap + own[1]], [0.0, *NULLS]
    se = math.sqrt(statistics.variance(cands) / 3 + statistics.variance(refs) / 4)
    dof = se**4 / ((statistics.variance(cands) / 3) ** 2 / 2 + (statistics.variance(refs) / 4) ** 2 / 3)
    assert 2 <= dof < 3  # Welch-Satterthwaite, rounded down to 2: t = 4.303
    estimate = statistics.mean(cands) - statistics.mean(refs)
    assert r.intervals["train"]["estimate"] == pytest.approx(estimate)
    assert r.intervals["train"]["high"] - r.intervals["train"]["low"] == pytest.approx(
        2 * 4.302652729911275 * se
    )

    # which recipes get null runs: every judged recipe by default; with recipe_null_runs=False every
    # baseline, and every recipe judged against fp32 (whose runs barely scatter, so they cannot stand in
    # for the recipe's own scatter)
    def targets(recipes, **kw):
        return CompareConfig(recipes=recipes, **kw).null_run_targets()

    assert targets(("fp32", "bf16", "fp8-delayed")) == ["fp32", "bf16", "fp8-delayed"]
    assert targets(("fp32", "bf16", "fp8-delayed"), recipe_null_runs=False) == ["fp32", "bf16"]
    assert targets(("fp32", "fp8-delayed"), recipe_null_runs=False) == ["fp32", "fp8-delayed"]
    assert targets(("bf16", "fp8-current"), baseline="bf16", recipe_null_runs=False) == ["bf16"]
    chosen = targets(
        ("bf16", "fp8-current", "fp8-delayed"), baseline="bf16", recipe_null_runs=("fp8-delayed",)
    )
    assert chosen == ["bf16", "fp8-delayed"]
    with pytest.raises(MixprecError, match="recipe_null_runs names recipes not compared: fp8-rowwise"):
        CompareConfig(recipes=("bf16", "fp8-current"), recipe_null_runs=("fp8-rowwise",)).validate()


def statistics_t(dof: int) -> float:
    return {4: 2.7764451051977987, 5: 2.5705818366147395}[dof]  # Student's t at 0.975 (tabulated)


def test_nan_and_statistics_beyond_their_limits_make_a_recipe_worse_whatever_its_gap():
    nan = {
        "kind": "nan_event",
        "run": "fp8-current",
        "step": 3,
        "layer": "l",
        "tensor": "loss",
        "type": "nan",
    }
    assert _judged(0.0, nan).recipes["fp8-current"].verdict == "worse"
    clean = _judged(0.0, _precision_row("fp8-current", "grad_output", 0.0, 0.049)).recipes["fp8-current"]
    assert clean.verdict == "equivalent"
    lost = _judged(0.0, _precision_row("fp8-current", "grad_output", 0.0, 1.0))
    judged = lost.recipes["fp8-current"]
    assert judged.verdict == "worse" and lost.exit_code == 1
    assert judged.reasons[0].startswith("train loss +0.000% vs bf16") and "within ±0.25%" in judged.reasons[0]
    assert judged.reasons[1].startswith("validation loss +0.000% vs bf16")
    assert judged.reasons[2:] == [
        "the precision statistics are beyond their limits",
        "underflow up to 100.0% of grad_output (l, step 5)",
    ]
    saturated = _judged(0.0, _precision_row("fp8-current", "input", 0.02, 0.0)).recipes["fp8-current"]
    assert saturated.verdict == "worse" and "saturation up to 2.0% of input (l, step 5)" in saturated.reasons
    strict = _judged(
        0.0, _precision_row("fp8-current", "input", 0.005, 0.0), thresholds={"saturation": 0.001}
    )
    assert strict.recipes["fp8-current"].verdict == "worse"
    with pytest.raises(MixprecError, match="threshold saturation"):
        CompareConfig(recipes=("bf16", "fp8-current"), thresholds={"saturation": -1}).validate()


def test_fp4_recipes_have_their_own_margin_and_underflow_limit():
    """FP4 against bf16: a 1 % margin (NVIDIA's NVFP4 pretraining) and a 50 % underflow limit (E2M1
    zeroes values below 1/24 of their block's maximum by design); saturation's limit is everyone's."""
    fp4 = "fp4-nvfp4"
    half = _judged(0.005, _precision_row(fp4, "input", 0.0, 0.29), recipe=fp4).recipes[fp4]
    assert half.margin == 0.01 and half.verdict == "equivalent", half.reasons
    assert _judged(0.005, recipe="fp8-current").recipes["fp8-current"].verdict == "worse"  # 0.25 %
    lost = _judged(0.0, _precision_row(fp4, "grad_output", 0.0, 0.6), recipe=fp4).recipes[fp4]
    assert lost.verdict == "worse" and "underflow up to 60.0% of grad_output (l, step 5)" in lost.reasons
    clipped = _judged(0.0, _precision_row(fp4, "input", 0.02, 0.0), recipe=fp4).recipes[fp4]
    assert clipped.verdict == "worse"
    stricter = _judged(
        0.0, _precision_row(fp4, "input", 0.0, 0.29), recipe=fp4, thresholds={"underflow_fp4": 0.2}
    )
    assert stricter.recipes[fp4].verdict == "worse"


def test_without_null_runs_the_interval_is_the_bootstrap_alone_and_the_check_is_absent():
    s = _judged(0.001, nulls=())
    r = s.recipes["fp8-current"]
    assert r.band_train is None and r.intervals["train"]["low"] == pytest.approx(0.001)
    assert r.verdict == "equivalent" and "no null runs" in r.reasons[0]
    assert s.bands == {}
    check = _judged(0.0).bands["bf16"]["null_check"]
    # null run 1 (+0.02 %) against the baseline and null runs 2 and 3 [0, -0.04 %, +0.03 %]:
    # +0.0233 % ± t2 x 0.0351 % x sqrt(1 + 1/3), within ±0.25 %
    others = (0.0, -0.0004, 0.0003)
    half = 4.302652729911275 * statistics.stdev(others) * math.sqrt(1 + 1 / 3)
    assert check["verdict"] == "equivalent" and check["against"] == ["bf16", "bf16~null2", "bf16~null3"]
    for loss in ("train", "val"):
        iv = check["intervals"][loss]
        assert iv["estimate"] == pytest.approx(0.0002 - statistics.mean(others))
        assert iv["high"] - iv["low"] == pytest.approx(2 * half)


def test_strict_makes_inconclusive_fail():
    from mixprec.commands.compare import exit_code

    s = _judged(0.0025)
    assert exit_code(s, strict=False) == 0 and exit_code(s, strict=True) == 1
    assert exit_code(_judged(0.0), strict=True) == 0
    # --accept-better lets `different` pass (and only it); with --strict, inconclusive still fails
    better = _judged(-0.02)
    assert exit_code(better, strict=False) == 1 and exit_code(better, strict=False, accept_better=True) == 0
    assert exit_code(better, strict=True, accept_better=True) == 0
    assert exit_code(s, strict=True, accept_better=True) == 1
    assert exit_code(_judged(0.05), strict=False, accept_better=True) == 1


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


def test_export_writes_the_trained_model_and_the_heldout_text(tmp_path, capsys):
    """`--export bf16`: the trained model as a Hugging Face directory (with its tokenizer) that the
    inference workflows read, and the validation documents; an unknown recipe is refused first."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "out"
    settings = json.dumps({k: v for k, v in TINY.items() if k not in ("batch_size", "seq_len", "lr")})
    base = ["compare", "--recipes", "bf16", "--baseline", "bf16", "--steps", "2", "--batch-size", "4",
            "--seq-len", "32", "--no-noise", "--no-progress", "--settings", settings, "--out", str(out)]  # fmt: skip
    assert main([*base, "--export", "fp8-current"]) == 2
    assert "--export fp8-current: not a recipe of this comparison" in capsys.readouterr().err
    assert not out.exists()
    assert main([*base, "--export", "bf16"]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "model-bf16")
    assert model.dtype == torch.bfloat16 and model.config.num_hidden_layers == TINY_MODEL["num_hidden_layers"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(out / "model-bf16")
    docs = [json.loads(line)["text"] for line in (out / "heldout.jsonl").read_text().splitlines()]
    assert docs and all(docs)
    ids = tokenizer(docs[0][:200], return_tensors="pt").input_ids
    assert torch.isfinite(model(ids).logits).all()
