"""Calibration: the observers clip where they say they do, and calibration text loads from each
accepted source (a folder of .txt, a .jsonl with 'text', a well-known name with a local copy)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from mixprec.errors import MixprecError
from mixprec.formats import E4M3
from mixprec.inference.calibration import (
    MaxObserver,
    MseObserver,
    PercentileObserver,
    calibrate,
    load_texts,
)
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
    amax, kv = calibrate(model, batches, ["0"], observer=observer)
    assert kv == {}
    assert 0 < amax["0"] < calibrate(model, batches, ["0"], observer="max")[0]["0"] == pytest.approx(1.3)


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
