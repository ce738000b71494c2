"""Calibration: the observers clip where they say they do, calibration stops when the stop rule says
(what the window's inputs carried above the amax held before them is a small enough share of their
energy, after the minimum tokens; the cap otherwise) and says so, and
calibration text loads from each accepted source (a folder of .txt, a .jsonl with 'text', a
well-known name with a local copy)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from mixprec.errors import MixprecError
from mixprec.formats import E4M3
from mixprec.inference.calibration.data import load_texts
from mixprec.inference.calibration.observers import MaxObserver, MseObserver, PercentileObserver
from mixprec.inference.calibration.run import NEVER_STOP_EARLY, StopRule, calibrate
from mixprec.quantization import fake_quantize
from mixprec.scaling import Granularity, compute_scale

# ---- observers -------------------------------------------------------------------------------------


def _outlier_batches(n: int = 4) -> list[torch.Tensor]:
    """Dense values in [-1, 1] and one rare outlier per batch (1.3): the case clipping is for."""
    g = torch.Generator().manual_seed(0)
    batches = []
    for i in range(n):
        x = torch.rand(64, 320, generator=g) * 2 - 1
        x[i, 7] = 1.3
        batches.append(x)
    return batches


def _observe(observer, batches):
    for b in batches:
        observer.update(b)
    return observer.amax()


def _max_of(x: torch.Tensor) -> float:
    obs = MaxObserver()
    obs.update(x)
    return obs.amax()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_max_observer_takes_the_largest_finite_magnitude(dtype):
    """max |x| over the finite entries, as x[isfinite(x)].abs().max() gives it: inf and NaN skipped, a
    negative extreme counted, nothing finite (or nothing at all) 0."""
    x = (torch.randn(64, 96, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    assert _max_of(x) == float(x.abs().max())
    x[5, 7] = -40.0
    assert _max_of(x) == 40.0
    for bad in (float("inf"), float("-inf"), float("nan")):
        y = x.clone()
        y[0, 0], y[9, 9] = bad, float("nan")
        assert _max_of(y) == float(y[torch.isfinite(y)].abs().max()) == 40.0
    assert _max_of(torch.full((3, 3), float("nan"), dtype=dtype)) == 0.0
    assert _max_of(torch.empty(0, 4, dtype=dtype)) == 0.0


def test_percentile_clips_outliers_strictly_below_max():
    batches = _outlier_batches()
    top = _observe(MaxObserver(), batches)
    got = _observe(PercentileObserver(), batches)
    assert top == pytest.approx(1.3)
    # as defined: the mean over batches of the 99.99th percentile of |x|, which an outlier barely moves
    expected = sum(float(torch.quantile(b.abs().flatten(), 0.9999)) for b in batches) / len(batches)
    assert got == pytest.approx(expected, rel=1e-6)
    assert got < 1.0 < top


def _mse(sample: torch.Tensor, clip: float) -> float:
    scale = compute_scale(clip, E4M3).reshape(1, 1)
    return float((sample - fake_quantize(sample, E4M3, Granularity.tensor(), scale=scale)).pow(2).mean())


def test_mse_picks_the_candidate_with_least_error_strictly_below_max():
    batches = _outlier_batches()
    obs = MseObserver()
    top = _observe(MaxObserver(), batches)
    got = _observe(obs, batches)
    assert got < top
    # its candidates: 0.3..1.0 x max on a grid; the choice minimises the error on its own sample
    sample = torch.cat(obs._samples)
    candidates = [top * (0.3 + 0.7 * (i + 1) / obs.grid) for i in range(obs.grid)]
    errors = [_mse(sample, c) for c in candidates]
    assert got == pytest.approx(candidates[errors.index(min(errors))], rel=1e-9)
    assert min(errors) < _mse(sample, top)


@pytest.mark.parametrize("observer", ["percentile", "mse"])
def test_calibrate_uses_the_observer(observer):
    model = nn.Sequential(nn.Linear(320, 32), nn.ReLU(), nn.Linear(32, 16))
    batches = _outlier_batches()
    result = calibrate(model, batches, ["0"], observer=observer)
    assert result.kv_amax == {}
    top = calibrate(model, batches, ["0"], observer="max").input_amax["0"]
    assert 0 < result.input_amax["0"] < top == pytest.approx(1.3)


# ---- calibration data --------------------------------------------------------------------------------


def test_texts_from_a_folder_of_txt(tmp_path):
    d = tmp_path / "texts"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("first paragraph\nstill first\n\nsecond paragraph\n")
    (d / "sub" / "b.txt").write_text("third\n")
    (d / "notes.md").write_text("not calibration text")
    assert load_texts(d) == ["first paragraph\nstill first", "second paragraph", "third"]


def test_texts_from_jsonl_with_text_field(tmp_path):
    p = tmp_path / "data.jsonl"
    p.write_text(json.dumps({"text": "one", "id": 1}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    assert load_texts(p) == ["one", "two"]
    p.write_text(json.dumps({"text": "one"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    with pytest.raises(
        MixprecError, match=r'data\.jsonl:2: each line must be a JSON object with a string "text"'
    ):
        load_texts(p)


def test_well_known_name_uses_the_local_copy(tmp_path, monkeypatch, llama_dir):
    """`--calib-dataset wikitext-2-raw` reads ~/.cache/mixprec/datasets/wikitext-2-raw/, where the error
    message says to put it (HOME points at a temporary directory here; nothing is downloaded)."""
    from mixprec.inference import quantize_checkpoint

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # no ./wikitext-2-raw to be taken for a path
    root = tmp_path / "home" / ".cache" / "mixprec" / "datasets" / "wikitext-2-raw"
    with pytest.raises(MixprecError, match="downloads nothing") as e:
        load_texts("wikitext-2-raw")
    assert str(root) in str(e.value)
    root.mkdir(parents=True)
    lines = [f" = Section {i} = \n\n The quick brown fox {i} jumps over the lazy dog .\n" for i in range(40)]
    (root / "wiki.train.txt").write_text("\n".join(lines))
    texts = load_texts("wikitext-2-raw")
    assert texts[:2] == ["= Section 0 =", "The quick brown fox 0 jumps over the lazy dog ."]
    report = quantize_checkpoint(llama_dir, work / "out", "fp8-static", calib_data="wikitext-2-raw",
                                 calib_samples=4, calib_seq_len=32, progress=False)  # fmt: skip
    assert len(report.converted) == 14
    doc = json.loads((work / "out" / "model.fp8_scales.json").read_text())
    assert doc["calibration"]["data"] == "wikitext-2-raw"


# ---- when calibration stops ----------------------------------------------------------------------------


def _settling_batches(n: int, rows: int = 4, outlier_at: int | None = None) -> list[torch.Tensor]:
    """Batches of `rows` tokens whose amax is 1.0 from the first batch on; at `outlier_at` one token of 3.0."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for i in range(n):
        x = torch.rand(rows, 16, generator=g) * 0.5
        x[0, 0] = 1.0
        if i == outlier_at:
            x[1, 3] = 3.0
        batches.append(x)
    return batches


def _layer():
    return nn.Sequential(nn.Linear(16, 8))


def test_stops_once_settled_after_the_minimum_tokens():
    # amax is 1.0 from batch 1: settled over a window of 3 once 4 snapshots exist (batch 4), but the
    # minimum of 40 tokens (4 per batch) holds it to batch 10
    result = calibrate(_layer(), _settling_batches(50), ["0"], stop=StopRule(0.01, 3, 40))
    run = result.run
    # a float input [rows, features] is `rows` tokens (and samples)
    assert (run.stopped, run.batches, run.tokens, run.samples, run.samples_available) == ("converged", 10, 40, 40, 200)  # fmt: skip
    assert run.max_change == 0.0 and run.max_change_by_batch == [None] * 3 + [0.0] * 7
    # nothing above the amax held before any batch from batch 2 on: the window of 3 holds batch 1's
    # growth (from 0, the whole energy) until batch 4
    assert run.clipped == 0.0 and run.clipped_by_batch == [None] * 3 + [0.0] * 7
    assert "converged" in run.reason and "40 tokens" in run.reason
    assert run.rule == {"tolerance": 0.01, "window": 3, "min_tokens": 40}


def test_cap_when_it_never_settles_or_tolerance_is_zero():
    growing = [torch.full((4, 16), float(i + 1)) for i in range(6)]
    run = calibrate(_layer(), growing, ["0"], stop=StopRule(0.01, 2, 0)).run
    assert (run.stopped, run.batches, run.samples) == ("cap", 6, 24)
    # every value of batches 5 and 6 lies 1.0 above the amax before it: 2 * 64 of 64 * (25 + 36) energy
    assert run.clipped == pytest.approx(2 / 61, rel=1e-3) and "cap" in run.reason
    assert run.max_change == pytest.approx(2 / 6)
    run = calibrate(_layer(), _settling_batches(7), ["0"], stop=NEVER_STOP_EARLY).run
    assert (run.stopped, run.batches) == ("cap", 7)


def test_clipped_share_is_the_energy_above_the_amax_held_before_each_batch():
    a = torch.zeros(2, 16)
    a[0, 0] = 2.0
    b = torch.full((2, 16), 0.5)
    b[1, 5] = 3.0  # 1.0 above the amax held before this batch
    run = calibrate(_layer(), [a, b], ["0"], stop=StopRule(0.5, 1, 0)).run
    energy_b = 31 * 0.25 + 9.0
    assert run.clipped_by_batch == [None, pytest.approx(1.0 / energy_b, rel=1e-3)]
    # a percentile amax clips by design: only what the earlier amax clipped beyond the current one counts
    obs = PercentileObserver(percentile=50.0)
    obs.observe(torch.tensor([1.0, 3.0]))  # amax 2.0 (the median), from 0: everything above 0 and 2.0
    assert obs.take_energies() == (pytest.approx(1.0 + 9.0 - 1.0), pytest.approx(10.0))
    obs.observe(torch.tensor([1.0, 3.0]))  # amax stays 2.0: stopping earlier would have clipped nothing more
    assert obs.take_energies() == (0.0, pytest.approx(10.0))


def test_a_growing_maximum_stops_once_what_it_would_clip_is_negligible():
    # the largest |x| grows 5 % every batch (a sample maximum on heavy tails does that for long), but
    # the growth is one value among 4096: the amax change never falls below 2 %, the clipped share does
    g = torch.Generator().manual_seed(0)
    batches = []
    for i in range(20):
        x = torch.randn(256, 16, generator=g).clamp(-4, 4)
        x[0, 0] = 10.0 * 1.05**i
        batches.append(x)
    run = calibrate(_layer(), batches, ["0"], stop=StopRule(1e-4, 4, 256 * 8)).run
    assert run.stopped == "converged" and run.batches == 8
    assert run.max_change > 0.15 and run.clipped < 1e-4


def test_minimum_tokens_is_what_catches_a_late_outlier():
    batches = _settling_batches(50, outlier_at=12)
    early = calibrate(_layer(), batches, ["0"], stop=StopRule(0.01, 3, 0))
    assert early.run.batches == 4 and early.input_amax["0"] == 1.0  # stopped before the outlier
    late = calibrate(_layer(), batches, ["0"], stop=StopRule(0.01, 3, 64))
    assert late.input_amax["0"] == 3.0
    # the outlier (batch 13) carried (3 - 1)^2 above the amax before it: the window of 3 must pass it
    assert late.run.stopped == "converged" and late.run.batches == 16


def test_an_observer_that_saw_nothing_has_not_settled():
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    with torch.no_grad():
        model[0].weight.fill_(-1.0)
        model[0].bias.fill_(-1.0)  # ReLU output is all zero: layer 2 sees nothing
    batches = [torch.rand(4, 16) for _ in range(6)]
    with pytest.raises(MixprecError, match="never saw a nonzero input for '2'"):
        calibrate(model, batches, ["0", "2"], stop=StopRule(0.5, 1, 0))


class _RarelyRouted(nn.Module):
    """A dense Linear and an 'expert' that sees only the tokens routed to it (first feature above 2),
    and is not called at all when none is: an MoE expert that the first batches leave unrouted."""

    def __init__(self):
        super().__init__()
        self.dense, self.expert = nn.Linear(16, 8), nn.Linear(16, 8)

    def forward(self, x):
        out = self.dense(x)
        routed = x[:, 0] > 2.0
        if routed.any():
            out[routed] += self.expert(x[routed])
        return out


def test_an_observer_that_has_seen_nothing_yet_keeps_calibration_running():
    """The dense layer's amax is 3.0 from the first batch; the expert sees its first tokens in batch 6. An
    observer with nothing seen must not count as settled (nothing seen, nothing clipped: without the
    guard its share would read 0), so the run goes on until the expert has settled too: its tokens
    (amax 3.0) enter the window of 2 in batch 6, which passes out of it after batch 8."""
    batches = _settling_batches(12)
    for i, x in enumerate(batches):
        x[0, 1] = 3.0  # the dense layer's amax, from the first batch on
        if i >= 5:
            x[2, 0] = 3.0  # routed to the expert from batch 6 on
    result = calibrate(_RarelyRouted(), batches, ["dense", "expert"], stop=StopRule(0.01, 2, 0))
    assert result.input_amax == {"dense": 3.0, "expert": 3.0}
    run = result.run
    assert (run.stopped, run.batches) == ("converged", 8)
    # batches 3-5: the dense layer has settled, the expert has not begun (an infinite share: None)
    assert run.clipped_by_batch[:5] == [None] * 5 and run.clipped_by_batch[7] == 0.0


@pytest.mark.parametrize(
    "kwargs, flag",
    [({"tolerance": -0.1}, "--calib-tolerance"), ({"tolerance": float("nan")}, "--calib-tolerance"),
     ({"tolerance": 1.0}, "--calib-tolerance"),
     ({"window": 0}, "--calib-window"), ({"min_tokens": -1}, "--calib-min-tokens")],
)  # fmt: skip
def test_bad_stop_rule_is_refused(kwargs, flag):
    with pytest.raises(MixprecError, match=flag):
        StopRule(**kwargs)


def test_cli_bad_tolerance_exits_2_before_any_work(llama_dir, calib_file, tmp_path, capsys):
    from mixprec.cli import main

    argv = ["quantize", "--model", str(llama_dir), "--output", str(tmp_path / "out"), "--scheme", "fp8-static",
            "--calib-data", str(calib_file), "--calib-tolerance", "-1"]  # fmt: skip
    assert main(argv) == 2
    assert "--calib-tolerance" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_report_and_scales_file_say_how_much_ran_and_why_it_stopped(llama_dir, calib_file, tmp_path):
    from mixprec.inference import quantize_checkpoint

    report = quantize_checkpoint(llama_dir, tmp_path / "q", "fp8-static", calib_data=calib_file, calib_samples=40,
                                 calib_seq_len=16, calib_stop=StopRule(0.05, 2, 256), progress=False)  # fmt: skip
    cal = report.to_dict()["calibration"]
    assert report.to_dict()["schema_version"] == 6
    assert cal["stopped"] in ("converged", "cap") and cal["samples_available"] == 40
    assert cal["tokens"] == cal["samples"] * 16 and cal["batches"] == len(cal["clipped_by_batch"])
    if cal["stopped"] == "converged":
        assert cal["tokens"] >= 256 and cal["clipped"] <= 0.05 and cal["samples"] < 40
    doc = json.loads((tmp_path / "q" / "model.fp8_scales.json").read_text())
    assert doc["schema_version"] == 3
    # the file carries the report's calibration record but not its wall time: outputs stay byte-comparable
    assert "seconds" in cal and "seconds" not in doc["calibration"]
    assert doc["calibration"] == {k: v for k, v in cal.items() if k != "seconds"}


# ---- compute: fp32 GEMMs rounded to the model dtype on CPUs without fast bf16 ------------------------


def _bf16_mlp() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 16)).to(torch.bfloat16)


@pytest.mark.parametrize("fast_bf16", [False, True])
def test_bf16_calibration_forward_computes_gemms_in_fp32_where_bf16_is_slow(monkeypatch, fast_bf16):
    """Without AVX-512-BF16/AMX the second Linear's input is relu(x W1ᵀ + b1) with the product of the
    bf16 operands formed in fp32 and rounded once to bf16 (what a GPU bf16 GEMM gives); with them, the
    native bf16 GEMM runs (the observers see its result)."""
    from mixprec.kernels import bf16_cpu

    monkeypatch.setattr(bf16_cpu, "cpu_has_fast_bf16", lambda: fast_bf16)
    model = _bf16_mlp()
    x = torch.randn(32, 64).to(torch.bfloat16)
    seen = []
    original = bf16_cpu.Fp32ComputeMode.__torch_function__

    def spy(self, func, types, args=(), kwargs=None):
        seen.append(func)
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(bf16_cpu.Fp32ComputeMode, "__torch_function__", spy)
    result = calibrate(model, [x], ["0", "2"], stop=NEVER_STOP_EARLY)
    w1, b1 = model[0].weight.detach(), model[0].bias.detach()
    if fast_bf16:
        assert not seen  # the native path: no mode entered
        hidden = torch.relu(model[0](x)).detach()
    else:
        assert seen
        hidden = torch.relu((x.float() @ w1.float().T + b1.float()).to(torch.bfloat16))
    assert result.input_amax["0"] == float(x.abs().max())
    assert result.input_amax["2"] == float(hidden.abs().max())


def test_observing_keys_and_values_keeps_the_attention_mask():
    # transformers builds no attention mask for an implementation name it does not know: the routed
    # attention gets the inner implementation's mask function, so a padded batch stays padded
    transformers = pytest.importorskip("transformers")
    from mixprec.inference.calibration.run import kv_attention_patch

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, attn_implementation="sdpa")  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
        observers = {}
        undo = kv_attention_patch(model, observers)
        try:
            routed = model(input_ids=ids, attention_mask=mask).logits
        finally:
            undo()
        after = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(routed, before) and torch.equal(after, before) and set(observers) == {0}
