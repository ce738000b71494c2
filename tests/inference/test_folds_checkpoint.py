"""`quantize_checkpoint(..., algorithm="rotate" / "awq" / "smoothquant")`: the fold stage writes the folded
model to a temporary directory beside the output, the rest of the pipeline reads it, and it is gone
afterwards; each fold keeps the unquantized fp32 model's logits."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from inference_helpers import assert_same_quantized

import mixprec
from mixprec.conversion import ConversionReport
from mixprec.errors import MixprecError
from mixprec.inference.checkpoint.algorithm_file import read_algorithm_file
from mixprec.inference.producers import quantize as quantize_module
from mixprec.inference.producers.quantize import _scratch_selection, quantize_checkpoint
from mixprec.inference.producers.quantize_folds import folded
from mixprec.inference.producers.quantize_job import QuantizeJob, resolve
from mixprec.inference.runtime.linear import QuantizedLinear

transformers = pytest.importorskip("transformers")
CALIB = dict(calib_samples=8, calib_seq_len=32)


def _job(src, out, scheme, calib, algorithm):
    return QuantizeJob.build(src, out, scheme, ignore=None, default_ignore=True, kv_cache=None,
                             max_shard_size="5GB", calib_data=calib, observer="max", calib_stop=None,
                             format="compressed-tensors", force=False, layer_by_layer=None, progress=False,
                             strict=False, algorithm=algorithm, **CALIB)  # fmt: skip


def _logits(directory, ids):
    model = transformers.LlamaForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize(("algorithm", "scheme"), [("rotate", "nvfp4a16"), ("awq", "nvfp4a16"),
                                                   ("smoothquant", "fp8-dynamic"), ("rotate,smoothquant,awq", "nvfp4")])  # fmt: skip
def test_folded_model_keeps_the_fp32_logits(llama_dir, calib_file, tmp_path, input_ids, algorithm, scheme):
    job = _job(llama_dir, tmp_path / "q", scheme, calib_file, algorithm)
    source = resolve(job)
    report = ConversionReport(recipe="", kind="", device="cpu", param_dtype="")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with folded(job, source, report, _scratch_selection) as (folded_job, _):
            tmp = folded_job.model_dir
            assert tmp.parent == tmp_path and tmp.name.startswith(".q.folded-")
            after = _logits(tmp, input_ids)
    assert not tmp.exists()
    before = _logits(llama_dir, input_ids)
    assert float((after - before).norm() / before.norm()) < 1e-5
    assert list(report.algorithm["folds"]) == [n for n in ("rotate", "smoothquant", "awq") if n in algorithm]


def test_rotated_checkpoint_is_untied_recorded_and_loads_the_same(llama_dir, calib_file, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = quantize_checkpoint(llama_dir, tmp_path / "q", "nvfp4a16", algorithm="rotate,gptq",
                                     calib_data=calib_file, progress=False, **CALIB)  # fmt: skip
    doc = read_algorithm_file(tmp_path / "q")
    assert doc["names"] == ["rotate", "gptq"] and doc["rotate"] == {"seed": 0, "r2": True}
    assert doc["folds"]["rotate"]["untied_lm_head"] is not None and "matrices" not in doc["folds"]["rotate"]
    assert json.loads((tmp_path / "q" / "config.json").read_text())["tie_word_embeddings"] is False
    assert report.algorithm["layers"] and [p.name for p in tmp_path.iterdir()] == ["q"]
    mine = mixprec.load_quantized(tmp_path / "q")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "q", quantization_config=transformers.CompressedTensorsConfig(dequantize=True)
    )
    for name, m in mine.named_modules():
        if isinstance(m, QuantizedLinear):
            w = hf.get_submodule(name).weight.detach().to(torch.bfloat16)
            assert torch.equal(w, m.dequantized_weight(torch.bfloat16)), name


def test_nothing_left_behind_when_a_later_stage_fails(llama_dir, calib_file, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise MixprecError("calibration broke")

    monkeypatch.setattr(quantize_module, "calibrate_job", broken)
    with pytest.raises(MixprecError, match="calibration broke"):
        quantize_checkpoint(llama_dir, tmp_path / "q", "nvfp4a16", algorithm="awq", calib_data=calib_file,
                            progress=False, **CALIB)  # fmt: skip
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("algorithm", "scheme", "message"), [
    ("smoothquant", "nvfp4a16", "smoothquant: smoothquant moves activation outliers"),
    ("awq", "fp8-dynamic", "--algorithm awq needs --calib-data"),
])  # fmt: skip
def test_folds_refused_before_any_work(llama_dir, tmp_path, algorithm, scheme, message):
    with pytest.raises(MixprecError, match=message):
        quantize_checkpoint(llama_dir, tmp_path / "q", scheme, algorithm=algorithm, progress=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("algorithm", "scheme"),
    [
        ("rotate", "nvfp4a16"),
        ("awq", "nvfp4a16"),
        ("rotate,awq", "nvfp4a16"),
        ("rotate,smoothquant,awq,gptq", "nvfp4"),
    ],
)
def test_online_folds_equal_the_checkpoints_bit_for_bit(llama_dir, calib_file, tmp_path, algorithm, scheme):
    """mixprec.quantize_model_(..., algorithm=<folds>) folds the live model as quantize_checkpoint folds the
    model it writes (one fold stage, the same tokens): the same rounded weights and the same weights
    kept in high precision (the rotated embeddings, the untied head, the norms)."""
    from mixprec.hf import load_tokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        written = quantize_checkpoint(llama_dir, tmp_path / "q", scheme, algorithm=algorithm, calib_data=calib_file,
                                      progress=False, **CALIB)  # fmt: skip
        model = transformers.LlamaForCausalLM.from_pretrained(llama_dir).eval()
        report = mixprec.quantize_model_(model, scheme, calib_data=calib_file, tokenizer=load_tokenizer(llama_dir),
                                         algorithm=algorithm, **CALIB)  # fmt: skip
    assert list(report.algorithm["folds"]) == list(written.algorithm["folds"])
    # a weight-only scheme after the folds alone has nothing left to observe: no calibration pass
    assert (written.calibration is None) == (scheme == "nvfp4a16")
    digests = {f: r.get("data_sha256") for f, r in written.algorithm["folds"].items()}
    assert digests.pop("rotate", None) is None  # the rotation reads no tokens
    assert len(set(digests.values())) == min(1, len(digests))  # the data folds' tokens
    if "gptq" in algorithm:  # GPTQ walks the same tokens
        assert written.algorithm["data_sha256"] in digests.values()
    assert report.algorithm["names"] == algorithm.split(",")
    offline = mixprec.load_quantized(tmp_path / "q")
    assert assert_same_quantized(model, offline) == 14
    kept = dict(offline.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p.float(), kept[name].float()), name


@pytest.mark.parametrize(("flags", "scales"), [([], "duo"), (["--awq-scales", "activation"], "activation")])
def test_awq_parameters_from_the_command_line_are_recorded(llama_dir, calib_file, tmp_path, flags, scales):
    from mixprec.cli import main

    out = tmp_path / "q"
    argv = ["quantize", "--model", str(llama_dir), "--output", str(out), "--scheme", "nvfp4a16", "--algorithm",
            "awq", "--awq-grid", "4", "--calib-data", str(calib_file), "--calib-samples", "8",
            "--calib-seq-len", "32", "--quiet", *flags]  # fmt: skip
    assert main(argv) == 0
    doc = read_algorithm_file(out)
    assert doc["schema_version"] == 3 and doc["awq"] == {"n_grid": 4, "awq_scales": scales}
    record = doc["folds"]["awq"]
    assert record["scales"] == scales and record["mappings"]
    for r in record["mappings"].values():
        assert r["scales"] == (scales if r["alpha"] is not None else None)
        assert r["alpha"] is None or r["alpha"] in (0.0, 0.25, 0.5, 0.75)
