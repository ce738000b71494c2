"""Bad inputs: each gives a MixprecError saying what and where, `mixprec quantize` exits 2, and no
output directory (nor temporary directory) is left behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import mixprec
from mixprec.cli import main
from mixprec.errors import MixprecError
from mixprec.inference import quantize_checkpoint


def _cli(model: Path, out: Path, *extra: str) -> int:
    return main(["quantize", "--model", str(model), "--output", str(out), "--quiet", *extra])


def _assert_refused(capsys, model: Path, out: Path, match: str, *extra: str) -> None:
    parent_before = set(out.parent.iterdir()) if out.parent.exists() else set()
    assert _cli(model, out, *extra) == 2
    err = capsys.readouterr().err
    assert match in err, err
    assert len(err.strip().splitlines()) == 1  # one line
    if not (out.exists() and out in parent_before):
        assert not out.exists()
    leftovers = set(out.parent.iterdir()) - parent_before if out.parent.exists() else set()
    assert not leftovers, leftovers


@pytest.fixture
def copy_of(llama_dir, tmp_path):
    def make(name: str = "m") -> Path:
        dst = tmp_path / name
        shutil.copytree(llama_dir, dst)
        return dst

    return make


def test_missing_directory(tmp_path, capsys):
    _assert_refused(capsys, tmp_path / "nope", tmp_path / "out", "does not exist")


def test_no_safetensors(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    _assert_refused(capsys, tmp_path / "m", tmp_path / "out", "no .safetensors files")


def test_pickle_only_checkpoint_refused_never_unpickled(copy_of, tmp_path, capsys):
    m = copy_of()
    (m / "model.safetensors").unlink()
    # a pickle that would run code when unpickled: refusing without reading it is the only safe answer
    (m / "pytorch_model.bin").write_bytes(b"\x80\x04cos\nsystem\n(S'touch /tmp/pwned_mixprec'\ntR.")
    _assert_refused(capsys, m, tmp_path / "out", "only pickle checkpoints")
    assert not Path("/tmp/pwned_mixprec").exists()


def test_truncated_shard(copy_of, tmp_path, capsys):
    m = copy_of()
    f = m / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    _assert_refused(capsys, m, tmp_path / "out", "truncated safetensors file")


def test_corrupt_shard(copy_of, tmp_path, capsys):
    m = copy_of()
    (m / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}" + b"\0" * 64)
    _assert_refused(capsys, m, tmp_path / "out", "corrupt header")


def test_nan_in_weight_names_the_tensor(copy_of, tmp_path, capsys):
    m = copy_of()
    sd = load_file(m / "model.safetensors")
    sd["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(sd, m / "model.safetensors", metadata={"format": "pt"})
    _assert_refused(capsys, m, tmp_path / "out", "model.layers.1.mlp.up_proj.weight")


def test_inf_in_unquantized_tensor_names_it(copy_of, tmp_path, capsys):
    m = copy_of()
    sd = load_file(m / "model.safetensors")
    sd["model.norm.weight"][0] = float("inf")
    save_file(sd, m / "model.safetensors", metadata={"format": "pt"})
    _assert_refused(capsys, m, tmp_path / "out", "model.norm.weight")


def test_output_equal_to_input(llama_dir, capsys):
    _assert_refused(capsys, llama_dir, llama_dir, "is the input directory")


def test_unknown_scheme(llama_dir, tmp_path, capsys):
    _assert_refused(capsys, llama_dir, tmp_path / "out", "unknown inference scheme", "--scheme", "fp8-magic")


def test_existing_output_needs_force(llama_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    _assert_refused(capsys, llama_dir, out, "already exists")
    assert (out / "keep.txt").exists()
    assert _cli(llama_dir, out, "--force") == 0
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()


def test_static_without_calibration_data(llama_dir, tmp_path, capsys):
    _assert_refused(capsys, llama_dir, tmp_path / "out", "needs --calib-data", "--scheme", "fp8-static")


def test_well_known_dataset_needs_local_copy(llama_dir, tmp_path, capsys):
    _assert_refused(
        capsys, llama_dir, tmp_path / "out", "downloads nothing",
        "--scheme", "fp8-static", "--calib-dataset", "wikitext-2-raw", "--dtype", "fp8_e4m3",
    )  # fmt: skip


def test_hf_fp8_needs_block_scheme(llama_dir, tmp_path, capsys):
    _assert_refused(capsys, llama_dir, tmp_path / "out", "128x128 block", "--format", "hf-fp8")


def test_error_mid_write_leaves_nothing(copy_of, tmp_path):
    """A NaN in the last tensor is found after shards were started: the temp dir is removed."""
    m = copy_of()
    sd = load_file(m / "model.safetensors")
    last = list(sd)[-1]
    sd[last].view(-1)[0] = float("nan")
    save_file(sd, m / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MixprecError, match=last.replace(".", r"\.")):
        quantize_checkpoint(m, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_failure_removes_the_parent_folders_it_created(copy_of, tmp_path, capsys):
    """`--output a/new/parent/out` creates the missing parents; a failure removes them again, but not a
    parent that existed before."""
    m = copy_of()
    sd = load_file(m / "model.safetensors")
    sd["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(sd, m / "model.safetensors", metadata={"format": "pt"})
    assert _cli(m, tmp_path / "a" / "new" / "parent" / "out") == 2
    assert "model.layers.1.mlp.down_proj.weight" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
    (tmp_path / "kept").mkdir()
    assert _cli(m, tmp_path / "kept" / "new" / "out") == 2
    assert list((tmp_path / "kept").iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept", "m"]


# ---- scales files and loading ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def static_out(llama_dir, calib_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("static") / "q"
    quantize_checkpoint(llama_dir, out, "fp8-static", calib_data=calib_file, calib_samples=4, calib_seq_len=32,
                        progress=False)  # fmt: skip
    return out


@pytest.mark.parametrize(
    "content, match",
    [
        ("not json", "not valid JSON"),
        ("[]", "top level must be a JSON object"),
        ('{"layers": {}}', "schema_version"),
        ('{"schema_version": 99, "layers": {}}', "newer"),
        ('{"schema_version": 1, "layers": []}', "'layers' must be"),
        ('{"schema_version": 1, "layers": {"a": {"weight": {"scale": [1.0, -2.0]}}}}', "weight.scale[1]"),
        ('{"schema_version": 1, "layers": {"a": {"input": {"scale": "x"}}}}', "input.scale"),
        (
            '{"schema_version": 1, "layers": {"a": {"weight": {"scale": [1.0], "scale_shape": [2]}}}}',
            "scale_shape",
        ),
    ],
)
def test_malformed_scales_file(static_out, tmp_path, content, match):
    d = tmp_path / "q"
    shutil.copytree(static_out, d)
    (d / "model.fp8_scales.json").write_text(content)
    with pytest.raises(MixprecError, match="malformed scales file") as e:
        mixprec.load_quantized(d)
    assert match in str(e.value)


def test_missing_weight_scale_taken_from_scales_file(static_out, tmp_path, input_ids):
    d = tmp_path / "q"
    shutil.copytree(static_out, d)
    sd = load_file(d / "model.safetensors")
    del sd["model.layers.0.self_attn.q_proj.weight_scale"], sd["model.layers.0.self_attn.q_proj.input_scale"]
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    (d / "model.fp8_scales.json").rename(d / "fp8_scales.json")  # the other accepted name
    with pytest.warns(UserWarning, match="taken from fp8_scales.json"):
        model = mixprec.load_quantized(d)
    ref = mixprec.load_quantized(static_out)
    with torch.no_grad():
        assert torch.equal(model(input_ids).logits, ref(input_ids).logits)
    assert any("q_proj" in w for w in model.mixprec_report.warnings)


def test_missing_scale_without_file_is_an_error_or_recomputed(static_out, tmp_path, input_ids):
    d = tmp_path / "q"
    shutil.copytree(static_out, d)
    (d / "model.fp8_scales.json").unlink()
    sd = load_file(d / "model.safetensors")
    name = "model.layers.1.mlp.down_proj"
    del sd[f"{name}.weight_scale"]
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MixprecError, match="cannot be recomputed"):
        mixprec.load_quantized(d)
    # by hand: scales= supplies it
    ref = mixprec.load_quantized(static_out)
    scale = ref.get_submodule(name).weight_scale.clone()
    model = mixprec.load_quantized(d, scales={name: {"weight_scale": scale}})
    with torch.no_grad():
        assert torch.equal(model(input_ids).logits, ref(input_ids).logits)
    # a high-precision weight with its scale gone: recomputed, and said so
    sd[f"{name}.weight"] = ref.get_submodule(name).dequantized_weight()
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match="recomputed"):
        model = mixprec.load_quantized(d)
    assert torch.equal(
        model.get_submodule(name).weight_scale, scale
    )  # FP8 values dequantize and requantize exactly
    assert model.mixprec_report.layers[name]["weight"]["scale_source"] == "recomputed"


def test_missing_static_input_scale_falls_back_to_dynamic(static_out, tmp_path, input_ids):
    d = tmp_path / "q"
    shutil.copytree(static_out, d)
    (d / "model.fp8_scales.json").unlink()
    sd = load_file(d / "model.safetensors")
    del sd["model.layers.0.mlp.gate_proj.input_scale"]
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match="dynamic per-tensor"):
        model = mixprec.load_quantized(d)
    assert model.model.layers[0].mlp.gate_proj.input_scale is None
    with torch.no_grad():
        model(input_ids)


def test_plain_checkpoint_with_scales_file_loads_quantized(llama_dir, static_out, tmp_path, input_ids):
    """The guide's case: a high-precision model with model.fp8_scales.json beside it."""
    d = tmp_path / "plain"
    shutil.copytree(llama_dir, d)
    shutil.copy(static_out / "model.fp8_scales.json", d / "model.fp8_scales.json")
    model = mixprec.load_quantized(d)
    ref = mixprec.load_quantized(static_out)
    with torch.no_grad():
        assert torch.equal(model(input_ids).logits, ref(input_ids).logits)


def test_not_quantized_checkpoint_is_refused(llama_dir):
    with pytest.raises(MixprecError, match="not a quantized checkpoint"):
        mixprec.load_quantized(llama_dir)


def test_already_quantized_input_refused(static_out, tmp_path):
    with pytest.raises(MixprecError, match="already quantized"):
        quantize_checkpoint(static_out, tmp_path / "again", progress=False)
    assert json.loads((static_out / "config.json").read_text())["quantization_config"]


def test_dtype_other_than_e4m3_refused(llama_dir, tmp_path, capsys):
    _assert_refused(capsys, llama_dir, tmp_path / "out", "only fp8_e4m3", "--dtype", "fp8_e5m2")


def test_cli_json_report(llama_dir, tmp_path, capsys):
    assert _cli(llama_dir, tmp_path / "out", "--json", "--scheme", "fp8-block", "--ignore", "down_proj") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["scheme"] == "fp8-block" and report["schema_version"] == 6
    assert report["summary"] == {"fp8:fp8-block": 12, "skipped: ignored by pattern": 3}
    assert report["weight_bytes_after"] < report["weight_bytes_before"]
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]


def test_loads_llm_compressor_style_scale_variants(llama_dir, tmp_path, input_ids):
    """Producers store scales differently: llm-compressor keeps them in the model dtype (bf16) and some
    checkpoints flatten per-channel scales to (out,) and per-tensor ones to (). All load."""
    out = tmp_path / "q"
    quantize_checkpoint(llama_dir, out, "fp8-dynamic", progress=False)
    (out / "model.fp8_scales.json").unlink()
    sd = load_file(out / "model.safetensors")
    expected = {}
    for k in [k for k in sd if k.endswith(".weight_scale")]:
        bf = sd[k].to(torch.bfloat16)
        sd[k] = bf.flatten() if "mlp" in k else bf
        expected[k[: -len(".weight_scale")]] = bf.float()
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    model = mixprec.load_quantized(out)
    for name, scale in expected.items():
        m = model.get_submodule(name)
        assert torch.equal(m.weight_scale, scale.reshape(-1, 1)), name
        assert torch.equal(m.dequantized_weight(), m.weight.float() * scale.reshape(-1, 1)), name
    with torch.no_grad():
        model(input_ids)
