"""bench/algorithms_side_by_side.py's bookkeeping (GNU time's report, the adopted run's name, the markdown
table) and bench/anchor_llmcompressor.py's checkpoint statistics and token hash, without llm-compressor."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sbs():
    yield _load("algorithms_side_by_side")
    sys.modules.pop("algorithms_side_by_side", None)
    sys.modules.pop("anchor_llmcompressor", None)


TIME_V = """\
\tCommand being timed: "mixprec quantize ..."
\tElapsed (wall clock) time (h:mm:ss or m:ss): 1:19:00.59
\tMaximum resident set size (kbytes): 2097152
"""


def test_parse_time_v(sbs):
    wall, rss = sbs.parse_time_v(TIME_V)
    assert wall == pytest.approx(3600 + 19 * 60 + 0.59)
    assert rss == 2048.0
    assert sbs.parse_time_v(TIME_V.replace("1:19:00.59", "19:00.59"))[0] == pytest.approx(1140.59)
    with pytest.raises(ValueError):
        sbs.parse_time_v("Elapsed (wall clock) time (h:mm:ss or m:ss): 0:01")


def _checkpoint(path: Path) -> Path:
    path.mkdir()
    tensors = {
        "model.layers.0.mlp.up_proj.weight_packed": torch.zeros(4, 8, dtype=torch.uint8),  # 64 FP4 weights
        "model.layers.0.mlp.up_proj.weight_scale": torch.zeros(4, 4, dtype=torch.uint8),  # 16 bytes
        "model.layers.0.mlp.up_proj.weight_global_scale": torch.ones(1),  # 4 bytes
        "model.norm.weight": torch.ones(10, dtype=torch.bfloat16),  # not a quantized weight
    }
    save_file(tensors, path / "model.safetensors")
    config = {
        "quantization_config": {
            "config_groups": {"group_0": {"weights": {"num_bits": 4}}},
            "ignore": ["lm_head"],
        }
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_checkpoint_stats_counts_packed_scales_and_global_scales(sbs, tmp_path):
    directory = _checkpoint(tmp_path / "ckpt")
    stats = sbs.checkpoint_stats(directory)
    assert stats["quantized_weights"] == 64
    assert stats["bits_per_weight"] == 8 * (32 + 16 + 4) / 64
    assert stats["file_bytes"] == (directory / "model.safetensors").stat().st_size
    assert sbs.kept_by(directory) == ["lm_head"]


def test_adopt_reads_name_time_and_eval(sbs, tmp_path):
    (tmp_path / "eval").mkdir()
    log = tmp_path / "time.txt"
    log.write_text(TIME_V)
    report = tmp_path / "e.json"
    report.write_text("{}")
    run = sbs.adopt(f"llmc-awq-gptq-nvfp4a16={tmp_path},{log},{report}", tmp_path)
    assert (run.tool, run.recipe, run.scheme) == ("llm-compressor", "awq+gptq", "nvfp4a16")
    assert run.name == "llmc-awq-gptq-nvfp4a16"
    assert (tmp_path / "eval" / "llmc-awq-gptq-nvfp4a16.json").read_text() == "{}"
    with pytest.raises(SystemExit):
        sbs.adopt(f"other-rtn-nvfp4a16={tmp_path},{log}", tmp_path)


def test_table_rows(sbs):
    scored = sbs.Run("mixprec", "gptq", "nvfp4a16", "/x", 1140.0, 3072.0, 4.5001, 116494680, "ab", 1140.0)
    unscored = sbs.Run("llm-compressor", "rtn", "nvfp4a16", "/y", None, None)
    anchor = sbs.Run("llm-compressor", "gptq", "nvfp4a16", "/w", 100.0, 1024.0, process_seconds=108.4)
    report = {"tasks": {"lm": {"intervals": {"perplexity_relative_change": {"estimate": 0.1234, "low": 0.1, "high": 0.15}}}}}  # fmt: skip
    lines = sbs.table([(scored, report), (unscored, None)]).splitlines()
    assert len(lines) == 4
    assert (
        lines[2]
        == "| mixprec | gptq | nvfp4a16 | 4.500 | 111.1 MiB | +12.34% [+10.00%, +15.00%] | 19.0 min | 19.0 min | 3.00 GiB |"
    )
    assert lines[3] == "| llm-compressor | rtn | nvfp4a16 | - | - | (not scored) | - | - | - |"
    assert sbs.table([(sbs.Run("mixprec", "rtn", "nvfp4a16", "/z", 9.14, 554.5), None)]).endswith(
        "| 9 s | - | 0.54 GiB |"
    )
    # the anchor's wall starts after its imports; its whole process is the next column
    assert sbs.table([(anchor, None)]).endswith("| 100 s | 108 s | 1.00 GiB |")
    assert sbs.same_tokens([scored, unscored]) == "identical calibration tokens (one sha256)"
    assert sbs.same_tokens([scored, sbs.Run("mixprec", "rtn", "nvfp4a16", "/z", 1.0, 1.0, tokens_sha256="cd")]).startswith("DIFFERENT")  # fmt: skip


class _Tokenizer:
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def test_anchor_token_hash_is_mixprec_gptq_data_sha256(tmp_path):
    """The anchor's tokens_sha256 over the concatenated windows equals the hash mixprec's GPTQ records
    (sha256 updated batch after batch, int64), so the side-by-side script can compare the two."""
    anchor = _load("anchor_llmcompressor")
    calib = tmp_path / "calib.txt"
    calib.write_text("first paragraph of text\n\nsecond one, a little longer than the first\n\nthird")
    ids = anchor.calibration_ids(str(calib), _Tokenizer(), samples=5, seq_len=8)
    assert ids.shape == (5, 8)
    digest = hashlib.sha256()
    for batch in ids.split(4):
        digest.update(batch.to(torch.int64).numpy().tobytes())
    assert anchor.ids_sha256(ids) == digest.hexdigest()
    assert ids[0].tolist() == [ord(c) for c in "first pa"]


def test_calibration_hash_from_either_tool(sbs, tmp_path):
    mixprec_dir, llmc_dir, rtn_dir = (tmp_path / n for n in ("m", "l", "r"))
    for d in (mixprec_dir, llmc_dir, rtn_dir):
        d.mkdir()
    (mixprec_dir / "mixprec_algorithm.json").write_text(json.dumps({"data_sha256": "aa"}))
    (llmc_dir / sbs.RECORD).write_text(json.dumps({"tokens_sha256": "aa"}))
    assert sbs.calibration_hash(mixprec_dir) == sbs.calibration_hash(llmc_dir) == "aa"
    assert sbs.calibration_hash(rtn_dir) is None


def test_timed_reports_the_childs_own_peak_rss(sbs, tmp_path):
    grab = "import sys; b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096]); print('ok')"
    _, rss = sbs.timed([sys.executable, "-c", grab], tmp_path / "big.log")
    assert rss >= 300
    # A parent larger than the child (as pytest, or the bench after loading a model): Linux hands a forked
    # child its parent's RSS as the start of its peak, which the launcher in timed() keeps out.
    ballast = bytearray(400 * 2**20)
    ballast[::4096] = b"x" * len(ballast[::4096])
    _, small = sbs.timed([sys.executable, "-c", "print('ok')"], tmp_path / "small.log")
    del ballast
    assert small < 300  # the child's own peak, not its parent's nor the largest child's so far
    assert (tmp_path / "small.log").read_text() == "ok\n"
    with pytest.raises(SystemExit, match="failed"):
        sbs.timed([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "fail.log")


def _report(change: float, block_nll: list[float] | None = None) -> dict:
    """An evaluate --json with a perplexity change and (optionally) per-block NLL sums, 4 blocks of 100
    tokens whose reference NLL is 200 each."""
    doc = {"tasks": {"lm": {"intervals": {"perplexity_relative_change": {"estimate": change, "low": change, "high": change}}}}}  # fmt: skip
    if block_nll is not None:
        doc["candidate"] = {"source": "x"}
        doc["per_sample"] = {"lm.block_reference_nll": [200.0] * 4, "lm.block_candidate_nll": block_nll,
                             "lm.block_tokens": [100.0] * 4}  # fmt: skip
    return doc


def test_best_recipe_is_chosen_on_validation_and_reported_held_out(sbs, tmp_path):
    import argparse

    (tmp_path / "eval").mkdir()
    runs = [
        sbs.Run("mixprec", "rtn", "nvfp4a16", "/a", 1.0, 1.0),
        sbs.Run("mixprec", "gptq", "nvfp4a16", "/b", 1.0, 1.0),
        sbs.Run("mixprec", "awq,gptq", "nvfp4a16", "/c", 1.0, 1.0),
        sbs.Run("llm-compressor", "gptq", "nvfp4a16", "/d", 1.0, 1.0),
        sbs.Run("llm-compressor", "awq+gptq", "nvfp4a16", "/e", 1.0, 1.0),
    ]
    # validation: mixprec's gptq and llm-compressor's awq+gptq are best; held out, mixprec's awq,gptq would be
    val = dict(zip([r.name for r in runs], [_report(c) for c in (0.3, 0.05, 0.06, 0.08, 0.07)], strict=True))
    held = {"rtn": [220.0] * 4, "gptq": [204.0, 205.0, 206.0, 205.0], "awq-gptq": [201.0] * 4}
    for run in runs:
        nll = held.get(sbs.slug(run.recipe), [203.0, 204.0, 205.0, 204.0])
        (tmp_path / "eval" / f"{run.name}.json").write_text(json.dumps(_report(0.0, nll)))
    best = sbs.best_by_validation(runs, val)
    assert best[("nvfp4a16", "mixprec")].recipe == "gptq"
    assert best[("nvfp4a16", "llm-compressor")].recipe == "awq+gptq"
    args = argparse.Namespace(schemes=["nvfp4a16"], work=tmp_path)
    row = sbs.best_table(args, runs, val).splitlines()[2]
    # held out: mixprec's gptq (mean NLL 2.05) minus llm-compressor's awq+gptq (2.01), reference 2.0
    expected = math.exp(0.05) - math.exp(0.01)
    assert row.startswith("| nvfp4a16 | gptq (+5.00%) | awq+gptq (+7.00%) | ")
    low, high = (float(x.rstrip("%")) / 100 for x in row.split("[")[1].split("]")[0].split(", "))
    assert low <= high and low > 0
    assert float(row.split(" | ")[3].split()[0].rstrip("%")) / 100 == pytest.approx(expected, abs=1e-4)
    assert row.endswith("| 2.21% |")  # RTN: mean NLL 2.2, a change of e^0.2 - 1
