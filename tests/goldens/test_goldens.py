"""Behaviour kept through refactors: every quantized checkpoint byte and every training number equals the
digest produced at the base commit (golden_lib.py says how, and why the digests are per CPU kind)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import golden_lib as g
import pytest
import torch

pytest.importorskip("transformers")
GOLDENS = json.loads(g.GOLDENS.read_text())
KIND = g.cpu_kind()
EXPECTED = GOLDENS["kinds"].get(KIND)
pytestmark = pytest.mark.skipif(
    EXPECTED is None or GOLDENS["torch"] != torch.__version__,
    reason=f"goldens.json has digests for {sorted(GOLDENS['kinds'])} with torch {GOLDENS['torch']}; this is "
    f"{KIND} with torch {torch.__version__} (golden_lib.py says how to add a kind at the base commit)",
)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("goldens")
    yield tmp, *g._source_model(tmp)
    torch.set_num_threads(threads)


@pytest.mark.parametrize("case", [c[0] for c in g.CHECKPOINT_CASES])
def test_checkpoint_bytes_equal_the_base_commits(case, source):
    tmp, model_dir, calib = source
    assert g.run_checkpoint_case(case, tmp, model_dir, calib) == EXPECTED[f"checkpoints/{case}"]


@pytest.mark.parametrize("recipe", g.TRAINING_RECIPES)
@pytest.mark.parametrize("loop", ["training", "step"])
def test_training_numbers_equal_the_base_commits(loop, recipe, source):
    run = g.run_training_case if loop == "training" else g.run_step_case
    assert run(recipe) == EXPECTED[f"{loop}/{recipe}"]


def test_a_changed_byte_changes_the_digest(source):
    """The digest sees a flipped payload byte and a changed config value, and ignores the run-dependent
    fields of the scales file (so the goldens are not too coarse or too fine to be worth checking)."""
    tmp, model_dir, calib = source
    out = tmp / "quantize-fp8-static-kv-ct"
    if not out.exists():
        g.run_checkpoint_case("quantize-fp8-static-kv-ct", tmp, model_dir, calib)
    before = g.directory_digests(out)
    with tempfile.TemporaryDirectory() as d:
        copy = Path(d) / "c"
        import shutil

        shutil.copytree(out, copy)
        scales = json.loads((copy / g.SCALES_FILE).read_text())
        scales["calibration"]["seconds"] = 61.2  # times are in the report only; one here is still ignored
        scales["producer"] = "mixprec 9.9"
        (copy / g.SCALES_FILE).write_text(json.dumps(scales))
        assert g.directory_digests(copy)[g.SCALES_FILE] == before[g.SCALES_FILE]
        shard = next(copy.glob("*.safetensors"))
        raw = bytearray(shard.read_bytes())
        raw[-1] ^= 1
        shard.write_bytes(bytes(raw))
        cfg = json.loads((copy / "config.json").read_text())
        cfg["quantization_config"]["ignore"].append("x")
        (copy / "config.json").write_text(json.dumps(cfg))
        after = g.directory_digests(copy)
    assert after[shard.name] != before[shard.name] and after["config.json"] != before["config.json"]
