"""`mixprec quantize --dry-run` / plan_quantize: the plan's layers and output size equal what a real
quantize writes; header-only checkpoints (a header and a sparse body) plan without their bodies being
read; bad input gives quantize's one-line errors; a plan writes nothing."""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import pytest
import torch

from mixprec.cli import main
from mixprec.errors import MixprecError
from mixprec.inference import quantize_checkpoint
from mixprec.inference.checkpoint import safetensors_io
from mixprec.inference.checkpoint.safetensors_io import PlannedTensor, shard_header
from mixprec.inference.producers import quantize_plan
from mixprec.inference.producers.quantize_estimates import GptqProbe, gptq_flops
from mixprec.inference.producers.quantize_plan import plan_quantize


def _header_only(path: Path, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
    """A valid safetensors header followed by a sparse (never written) body of the right length."""
    planned = [PlannedTensor(n, d, s) for n, (d, s) in tensors.items()]
    raw = shard_header(planned, {"format": "pt"})
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
    os.truncate(path, 8 + len(raw) + sum(t.nbytes for t in planned))


def _llama_shapes(hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int):
    hd = hidden // heads
    t = {"model.embed_tokens.weight": (torch.bfloat16, (vocab, hidden))}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in {"self_attn.q_proj": (heads * hd, hidden), "self_attn.k_proj": (kv * hd, hidden),
                            "self_attn.v_proj": (kv * hd, hidden), "self_attn.o_proj": (hidden, heads * hd),
                            "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
                            "mlp.down_proj": (hidden, inter)}.items():  # fmt: skip
            t[f"{p}{name}.weight"] = (torch.bfloat16, shape)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            t[f"{p}{norm}.weight"] = (torch.bfloat16, (hidden,))
    t["model.norm.weight"] = (torch.bfloat16, (hidden,))
    t["lm_head.weight"] = (torch.bfloat16, (vocab, hidden))
    return t


@pytest.fixture
def header_only(tmp_path) -> Path:
    """A Llama-shaped bf16 checkpoint of 1.3 GB declared, about 20 kB on disk."""
    d = tmp_path / "big"
    d.mkdir()
    hidden, inter, layers, heads, kv, vocab = 2048, 5632, 4, 16, 4, 32000
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv, "vocab_size": vocab, "tie_word_embeddings": False, "dtype": "bfloat16"}  # fmt: skip
    (d / "config.json").write_text(json.dumps(cfg))
    _header_only(d / "model.safetensors", _llama_shapes(hidden, inter, layers, heads, kv, vocab))
    return d


def _written(out: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in out.iterdir()}


@pytest.mark.parametrize(
    ("scheme", "shard"), [("fp8-dynamic", "2GB"), ("nvfp4a16", "150KB"), ("fp8-block", "90KB")]
)
def test_plan_equals_the_written_checkpoint(llama_dir, tmp_path, scheme, shard):
    out = tmp_path / "out"
    plan = plan_quantize(llama_dir, out, scheme, max_shard_size=shard, probe=False)
    assert not out.exists() and list(tmp_path.iterdir()) == []  # the plan wrote nothing
    report = quantize_checkpoint(llama_dir, out, scheme, max_shard_size=shard, progress=False)
    written = _written(out)
    shards = sorted(n for n in written if n.endswith(".safetensors"))
    assert plan.shard_bytes == [written[n] for n in shards]  # every shard's bytes, exactly
    assert (len(shards) > 1) == (shard != "2GB")
    exact = {n: b for n, b in plan.files.items() if "(estimated)" not in n}
    assert exact == {n: b for n, b in written.items() if n in exact}
    scales = "model.fp8_scales.json"
    assert set(written) == set(shards) | set(exact) | {scales}
    estimated = plan.files[f"{scales} (estimated)"]
    assert abs(estimated - written[scales]) <= 0.2 * written[scales] + 200
    quantized = {e.name for e in report.entries if e.precision.startswith(("fp8", "fp4"))}
    assert set(plan.layers) == quantized and len(quantized) == 14
    assert all(e["scheme"] == scheme for e in plan.layers.values())
    assert set(plan.kept) == {e.name for e in report.entries if e.precision.startswith("skipped")}


def test_header_only_plans_without_reading_bodies(header_only, tmp_path, monkeypatch):
    def no_reads(*_a, **_k):
        raise AssertionError("a tensor body was read")

    monkeypatch.setattr(safetensors_io.ShardReader, "read_range", no_reads)
    monkeypatch.setattr(os, "preadv", no_reads)
    shard = header_only / "model.safetensors"
    assert shard.stat().st_blocks * 512 < 1 << 20 < shard.stat().st_size  # sparse: nothing to read
    plan = plan_quantize(header_only, tmp_path / "out", "fp8-dynamic", probe=False)
    assert len(plan.layers) == 4 * 7 and set(plan.kept) == {"lm_head"}
    # independent size: each Linear [o, i] -> o*i e4m3 bytes + o fp32 scales; the rest unchanged
    shapes = _llama_shapes(2048, 5632, 4, 16, 4, 32000)
    data = sum(
        math.prod(s) + 4 * s[0] if n.endswith("_proj.weight") else math.prod(s) * 2
        for n, (_, s) in shapes.items()
    )
    (size,) = plan.shard_bytes
    header = size - 8 - data
    assert 0 < header < 64 * len(plan.layers) * 3 + 64 * len(shapes)
    assert plan.input_bytes == shard.stat().st_size and plan.disk["fits"]


def test_layer_by_layer_memory_terms(header_only, tmp_path):
    """GPTQ's block-by-block terms from the shapes: one copy of the hidden states, the embedding rows of
    the calibration tokens (not the embeddings and head whole), one block, its Hessians, its results."""
    plan = plan_quantize(header_only, tmp_path / "out", "nvfp4a16", algorithm="gptq", calib_data="unused.txt",
                         calib_samples=8, calib_seq_len=64, probe=False)  # fmt: skip
    assert plan.path == "layer-by-layer" and plan.time is None
    terms = plan.memory.terms if "calibration" in plan.memory.formula else None
    assert terms is not None, plan.memory.formula
    hidden, inter = 2048, 5632
    assert terms["calibration hidden states: tokens x hidden x dtype"] == 8 * 64 * hidden * 2
    assert (
        terms["embedding rows of the calibration tokens (at most tokens x hidden x dtype)"]
        == 8 * 64 * hidden * 2
    )
    assert not any("head" in term for term in terms)
    block = (2 * hidden * hidden + 2 * 512 * hidden + 3 * inter * hidden + 2 * hidden) * 2
    assert terms["the largest block's weights"] == block
    # input groups of a block: q/k/v (hidden), o (hidden), gate/up (hidden), down (inter)
    assert (
        terms["GPTQ: the Hessians of one block (in^2 fp32 per input group)"] == (3 * hidden**2 + inter**2) * 4
    )


def test_rotation_memory_terms(header_only, tmp_path):
    """The rotation alone streams the checkpoint: one block and a chunk of embedding rows, not the model."""
    from mixprec.inference.algorithms.rotation import CHUNK_ROWS

    plan = plan_quantize(header_only, tmp_path / "out", "nvfp4a16", algorithm="rotate", probe=False)
    terms = plan.memory.terms if "rotation" in plan.memory.formula else None
    assert terms is not None, plan.memory.formula
    hidden, inter = 2048, 5632
    block = (2 * hidden * hidden + 2 * 512 * hidden + 3 * inter * hidden + 2 * hidden) * 2
    assert terms["the largest block's weights"] == block
    assert (
        terms["fp64 working copies of the largest weight (the weight and its product)"] == 16 * inter * hidden
    )
    assert terms["a chunk of embedding / head rows: read, fp64 and its product"] == CHUNK_ROWS * hidden * 18
    assert not any("load the whole model" in note for note in plan.memory.notes)


def test_awq_memory_terms(header_only, tmp_path):
    """AWQ streams the checkpoint too: the calibration walk and the block's cached inputs; so does
    SmoothQuant (the calibration walk's terms)."""
    plan = plan_quantize(header_only, tmp_path / "out", "nvfp4a16", algorithm="rotate,awq", calib_data="unused.txt",
                         calib_samples=64, calib_seq_len=512, probe=False)  # fmt: skip
    assert any(n.startswith("rotation, block by block") for n in plan.memory.notes)
    assert "AWQ, block by block" in plan.memory.formula  # the peak: 64 x 512 tokens' cached inputs
    cached = plan.memory.terms["AWQ: the block's cached inputs (tokens x (3 hidden + intermediate) x dtype)"]
    assert cached == 64 * 512 * (3 * 2048 + 5632) * 2
    smooth = plan_quantize(header_only, tmp_path / "out", "fp8-dynamic", algorithm="smoothquant",
                           calib_data="unused.txt", probe=False)  # fmt: skip
    assert any(n.startswith("SmoothQuant, block by block") for n in smooth.memory.notes)
    assert not any("whole model" in n for n in smooth.memory.notes)


def _cli(model: Path, out: Path, *extra: str) -> int:
    return main(["quantize", "--model", str(model), "--output", str(out), "--dry-run", "--quiet", *extra])


def test_cli_json_and_nothing_written(llama_dir, tmp_path, capsys):
    out = tmp_path / "deep" / "out"
    assert _cli(llama_dir, out, "--json", "--scheme", "nvfp4a16") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema_version"] == 1 and doc["path"] == "streaming" and len(doc["layers"]) == 14
    assert doc["output_bytes"] == sum(doc["shards"]) + sum(doc["files"].values())
    assert doc["time"]["total"] > 0 and doc["memory"]["total"] > doc["memory"]["terms"]["process baseline"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("setup", "match"),
    [("no-config", "has no config.json"), ("no-safetensors", "no .safetensors files"), ("exists", "exists")],
)
def test_bad_input_one_line_errors(llama_dir, tmp_path, capsys, setup, match):
    model = tmp_path / "m"
    model.mkdir()
    out = tmp_path / "out"
    if setup == "no-config":
        (model / "model.safetensors").write_bytes((llama_dir / "model.safetensors").read_bytes())
    elif setup == "no-safetensors":
        (model / "config.json").write_text("{}")
    else:
        model, out = llama_dir, tmp_path
    assert _cli(model, out) == 2
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(MixprecError) as quantize_err:
        quantize_checkpoint(model, out, progress=False)
    assert str(quantize_err.value) in err  # the very error quantize gives


def test_disk_that_will_not_fit(llama_dir, tmp_path, capsys, monkeypatch):
    usage = quantize_plan.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(quantize_plan.shutil, "disk_usage", lambda _p: usage._replace(free=1000))
    assert _cli(llama_dir, tmp_path / "out") == 2
    captured = capsys.readouterr()
    assert "WILL NOT FIT" in captured.out  # the plan is printed, then the refusal
    assert "will not fit" in captured.err and not (tmp_path / "out").exists()


def test_streaming_memory_terms(header_only, tmp_path):
    """NVFP4 reads a fused GEMM's shards together (q/k/v: 3): q/k/v (2048 + 2 x 512 rows of 2048) share
    one buffer of the largest weight (5632 x 2048), gate/up take two, so the read buffers are workers - 1
    + 2 of the largest weight; the payload buffers workers + 3 of its out x in / 2 bytes (codes packed
    two a byte), and as many of its E4M3 block scales (one per 16)."""
    plan = plan_quantize(header_only, tmp_path / "out", "nvfp4a16", probe=False)
    workers = max(1, min(4, os.cpu_count() or 1))
    largest = 5632 * 2048
    terms = plan.memory.terms
    reads = workers + 1
    assert terms[f"read buffers: {reads} x the largest Linear weight"] == reads * largest * 2
    assert terms[f"payload buffers: {workers + 3} x the largest payload"] == (workers + 3) * largest // 2
    scales = f"4-bit block scales waiting for the writer: {workers + 3} x the largest"
    assert terms[scales] == (workers + 3) * largest // 16
    assert terms["copy buffer"] == 16 << 20 and plan.time is None
    assert terms["the writer's staging buffer (direct writes)"] == 8 << 20


def test_gptq_probe_scaling_rule():
    """The scaled-down probe reproduces itself at its own size, and the column loop grows as in x out."""
    rate = 1e10
    probe = GptqProbe(out_features=1024, inputs=512, seconds=gptq_flops(1024, 512) / rate + 0.5, rate=rate)
    assert probe.seconds_for(1024, 512) == pytest.approx(probe.seconds)
    loop = probe.seconds_for(2048, 4096) - gptq_flops(2048, 4096) / rate
    assert loop == pytest.approx(0.5 * (4096 / 512) * (2048 / 1024))


def test_plan_of_a_calibrated_run_with_kv_scales(llama_dir, calib_file, tmp_path):
    """fp8-static with --kv-cache fp8: the k_scale / v_scale tensors are planned where the run writes them."""
    kw = dict(calib_data=calib_file, calib_samples=4, calib_seq_len=16, kv_cache="fp8")
    plan = plan_quantize(llama_dir, tmp_path / "out", "fp8-static", probe=False, **kw)
    assert plan.path in ("whole-model", "layer-by-layer") and plan.calibration["tokens_at_most"] == 64
    quantize_checkpoint(llama_dir, tmp_path / "out", "fp8-static", progress=False, **kw)
    assert plan.shard_bytes == [(tmp_path / "out" / "model.safetensors").stat().st_size]
