"""model.fp8_scales.json beside a checkpoint: applied to high-precision weights (online quantization,
the guide's case) or checked and reported beside FP8 ones, by load_quantized and by evaluate's
candidate loading; a corrupt one is an error naming the file and where in it (line and column, or
the key path), exit 2, before any work."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import mixprec
from mixprec.cli import main
from mixprec.errors import MixprecError
from mixprec.evaluation.models import load_dir
from mixprec.inference import QuantizedLinear, quantize_checkpoint

LAYER = "model.layers.0.mlp.up_proj"  # [256, 128] in the tiny Llama


@pytest.fixture(scope="module")
def static_ckpt(llama_dir, calib_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("scales") / "static"
    quantize_checkpoint(llama_dir, out, "fp8-static", calib_data=calib_file, calib_samples=4, calib_seq_len=32,
                        progress=False)  # fmt: skip
    return out


@pytest.fixture()
def plain_with_scales(llama_dir, static_ckpt, tmp_path):
    """The high-precision checkpoint with the static checkpoint's scales file beside it."""
    d = tmp_path / "plain"
    shutil.copytree(llama_dir, d)
    shutil.copy(static_ckpt / "model.fp8_scales.json", d / "model.fp8_scales.json")
    return d


def _edit(directory, change) -> None:
    path = directory / "model.fp8_scales.json"
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc, indent=1))


def test_applied_to_high_precision_weights_and_reported(plain_with_scales, static_ckpt, input_ids):
    model = mixprec.load_quantized(plain_with_scales)
    ref = mixprec.load_quantized(static_ckpt)
    assert isinstance(model.get_submodule(LAYER), QuantizedLinear)
    with torch.no_grad():
        assert torch.equal(model(input_ids).logits, ref(input_ids).logits)
    assert any("model.fp8_scales.json: 14 layers, applied" in n for n in model.mixprec_report.notes)
    # beside an FP8 checkpoint it is checked and said so (the checkpoint's own scales come first)
    assert any("model.fp8_scales.json: 14 layers, checked" in n for n in ref.mixprec_report.notes)


def test_evaluate_candidate_loading_applies_it(plain_with_scales):
    candidate = load_dir(plain_with_scales, "candidate")
    assert isinstance(candidate.model.get_submodule(LAYER), QuantizedLinear)
    assert candidate.scheme == "fp8-static" and candidate.info["checkpoint_layout"] == "scales-file"
    reference = load_dir(plain_with_scales, "reference")  # the reference stays as stored
    assert not any(isinstance(m, QuantizedLinear) for m in reference.model.modules())


def _set(path_keys, value):
    def change(doc):
        target = doc
        for k in path_keys[:-1]:
            target = target[k]
        target[path_keys[-1]] = value

    return change


CORRUPT = [
    # (what, how the file is changed, what the message says)
    ("bad JSON", None, "not valid JSON at line 3 column 8: Expecting value"),
    ("NaN", "nan", "not valid JSON at line"),
    ("non-positive", _set(["layers", LAYER, "weight", "scale", 0], 0.0),
     f"layers['{LAYER}'].weight.scale[0] must be a positive finite number"),
    ("negative input scale", _set(["layers", LAYER, "input", "scale"], -1.0),
     f"layers['{LAYER}'].input.scale must be a positive finite number"),
    ("wrong shape", _set(["layers", LAYER, "shape"], [128, 256]),
     f"layers['{LAYER}'].shape is [128, 256], the checkpoint's {LAYER}.weight is [256, 128]"),
    ("wrong scale count", _set(["layers", LAYER, "weight"], {"granularity": "row", "scale": [0.1] * 3}),
     f"layers['{LAYER}'].weight.scale has 3 values, a row scale of a [256, 128] weight has 256"),
    ("unknown layer", lambda doc: doc["layers"].update({"model.layers.7.mlp.up_proj": {}}),
     "layers['model.layers.7.mlp.up_proj']: the checkpoint has no Linear weight model.layers.7.mlp.up_proj.weight"),
]  # fmt: skip


def _corrupt(directory, how):
    path = directory / "model.fp8_scales.json"
    if how is None:
        path.write_text('{"schema_version": 1,\n "layers": {\n  "a": }\n}\n')
    elif how == "nan":
        path.write_text(path.read_text().replace('"scale": [', '"scale": [NaN, ', 1))
    else:
        _edit(directory, how)
    return path


@pytest.mark.parametrize("what, how, says", CORRUPT, ids=[c[0] for c in CORRUPT])
@pytest.mark.parametrize("beside", ["high-precision", "fp8"])
def test_corrupt_file_is_an_error_naming_file_and_position(plain_with_scales, static_ckpt, tmp_path, what, how,
                                                           says, beside):  # fmt: skip
    d = plain_with_scales
    if beside == "fp8":
        d = tmp_path / "fp8"
        shutil.copytree(static_ckpt, d)
    path = _corrupt(d, how)
    with pytest.raises(MixprecError) as e:
        mixprec.load_quantized(d)
    assert f"malformed scales file {path}" in str(e.value)
    assert says in str(e.value)


def test_scales_given_by_hand_are_checked_too(static_ckpt):
    with pytest.raises(
        MixprecError, match=r"scales=: .*no Linear weight model\.layers\.0\.mlp\.nope\.weight"
    ):
        mixprec.load_quantized(static_ckpt, scales={"model.layers.0.mlp.nope": {"weight_scale": 0.1}})


def test_evaluate_exits_2_on_a_corrupt_candidate_file(llama_dir, plain_with_scales, calib_file, capsys):
    path = _corrupt(plain_with_scales, _set(["layers", LAYER, "weight", "scale", 0], -0.5))
    argv = ["evaluate", "--reference", str(llama_dir), "--candidate", str(plain_with_scales),
            "--data", str(calib_file), "--samples", "2", "--seq-len", "16", "--no-progress"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert str(path) in err and f"layers['{LAYER}'].weight.scale[0]" in err
