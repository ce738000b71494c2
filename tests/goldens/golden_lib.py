"""Golden numbers of behaviour that refactors must keep: quantized checkpoints byte for byte, training
steps bit for bit. `python tests/goldens/golden_lib.py` writes goldens.json; it was run at the commit
before the "Second floor" rewrite (issue 26), so the tests compare every later commit against it.

A checkpoint's digest covers every byte of its safetensors shards and index, config.json and the other
side files, and the scales file with its run-dependent fields (calibration seconds, the calibration data's
path, the producer's version) removed. A training run's digest covers every number it logs (losses, held-out
losses, gradient norms, precision rows) and the final weights, as float bit patterns.

Which numbers depend on the CPU: float32 GEMMs, reductions and random initialisation take paths chosen by
the instruction set (AVX2, AVX-512, AMX), so activation scales, error statistics and losses differ in their
last bits between CPU kinds (with the forced-SSE paths of ATEN_CPU_CAPABILITY=default, not one case on
the AVX2 kind kept its digest). goldens.json therefore holds digests per CPU kind, and the tests check the
kind they run on. The base commit is recorded in the file; to add a kind, run on a machine of that kind
at the base commit (git worktree add /tmp/base <base_commit>; PYTHONPATH=/tmp/base/src python
tests/goldens/golden_lib.py), with this file as committed next to goldens.json.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).parent
GOLDENS = HERE / "goldens.json"
SCALES_FILE = "model.fp8_scales.json"
RUN_DEPENDENT = ("seconds", "data", "producer")


def cpu_kind() -> str:
    """The CPU features that choose torch's kernels: AMX, AVX-512 BF16, AVX-512, AVX2."""
    try:
        flags = next(
            ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")
        ).split()
    except (OSError, StopIteration):
        return "unknown"
    for flag, kind in (
        ("amx_bf16", "amx"),
        ("avx512_bf16", "avx512-bf16"),
        ("avx512f", "avx512"),
        ("avx2", "avx2"),
    ):
        if flag in flags:
            return kind
    return "other"


def _strip(doc, keys=RUN_DEPENDENT):
    if isinstance(doc, dict):
        return {k: _strip(v, keys) for k, v in doc.items() if k not in keys}
    if isinstance(doc, list):
        return [_strip(v, keys) for v in doc]
    return doc


def directory_digests(directory: Path) -> dict[str, str]:
    """{file name: sha256} of a checkpoint directory; the scales file without its run-dependent fields, and
    the safetensors header's `producer` (mixprec's version) left out of the shard's digest."""
    out = {}
    for p in sorted(Path(directory).iterdir()):
        if p.name == SCALES_FILE:
            data = json.dumps(_strip(json.loads(p.read_text())), sort_keys=True).encode()
        elif p.suffix == ".safetensors":
            data = _safetensors_without_producer(p.read_bytes())
        else:
            data = p.read_bytes()
        out[p.name] = hashlib.sha256(data).hexdigest()
    return out


def _safetensors_without_producer(raw: bytes) -> bytes:
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header.get("__metadata__", {}).pop("producer", None)
    return json.dumps(header, sort_keys=True).encode() + raw[8 + n :]


# ---- checkpoint cases ------------------------------------------------------------------------------
# (case name, producer, arguments). Producers: quantize (quantize_checkpoint), save (quantize_model_ then
# save_quantized), convert (quantize, then convert_checkpoint to another layout).
MIXED = {
    **{f"model.layers.{i}.self_attn.{p}_proj": "fp8-dynamic" for i in (0, 1) for p in "qkvo"},
    **{f"model.layers.{i}.mlp.{p}_proj": "nvfp4a16" for i in (0, 1) for p in ("gate", "up", "down")},
}
CHECKPOINT_CASES = [
    ("quantize-fp8-dynamic-ct", "quantize", {"scheme": "fp8-dynamic"}),
    ("quantize-fp8-block-ct", "quantize", {"scheme": "fp8-block"}),
    ("quantize-fp8-block-hf", "quantize", {"scheme": "fp8-block", "format": "hf-fp8"}),
    ("quantize-fp8-static-kv-ct", "quantize", {"scheme": "fp8-static", "kv_cache": "fp8", "calib": True}),
    (
        "quantize-fp8-static-layerwise-ct",
        "quantize",
        {"scheme": "fp8-static", "calib": True, "layer_by_layer": True},
    ),
    ("quantize-nvfp4-ct", "quantize", {"scheme": "nvfp4", "calib": True}),
    ("quantize-nvfp4a16-ct", "quantize", {"scheme": "nvfp4a16"}),
    ("quantize-mxfp4-ct", "quantize", {"scheme": "mxfp4"}),
    ("quantize-mxfp4a16-ct", "quantize", {"scheme": "mxfp4a16"}),
    ("quantize-mxfp8-ct", "quantize", {"scheme": "mxfp8"}),
    ("quantize-mixed-ct", "quantize", {"scheme": MIXED}),
    ("quantize-fp8-dynamic-shards", "quantize", {"scheme": "fp8-dynamic", "max_shard_size": "150KB"}),
    ("save-fp8-dynamic-ct", "save", {"scheme": "fp8-dynamic"}),
    ("save-fp8-static-ct", "save", {"scheme": "fp8-static", "calib": True}),
    ("save-fp8-block-hf", "save", {"scheme": "fp8-block", "format": "hf-fp8"}),
    ("save-nvfp4a16-ct", "save", {"scheme": "nvfp4a16"}),
    ("save-mixed-ct", "save", {"scheme": MIXED}),
    ("convert-fp8-static-modelopt", "convert", {"scheme": "fp8-static", "calib": True, "to": "modelopt"}),
    ("convert-fp8-dynamic-modelopt", "convert", {"scheme": "fp8-dynamic", "to": "modelopt"}),
    ("convert-nvfp4-modelopt", "convert", {"scheme": "nvfp4", "calib": True, "to": "modelopt"}),
    ("convert-fp8-block-hf", "convert", {"scheme": "fp8-block", "to": "hf-fp8"}),
]


def _source_model(tmp: Path) -> tuple[Path, Path]:
    sys.path.insert(0, str(HERE.parent / "inference"))
    from inference_helpers import CALIB_TEXTS, save_with_tokenizer, tiny_llama

    calib = tmp / "calib.txt"
    calib.write_text("\n\n".join(CALIB_TEXTS))
    return save_with_tokenizer(tiny_llama(), tmp / "model"), calib


def run_checkpoint_case(name: str, tmp: Path, source: Path, calib: Path) -> dict[str, str]:
    _, producer, args = next(c for c in CHECKPOINT_CASES if c[0] == name)
    args = dict(args)
    out = tmp / name
    calib_kw = (
        {"calib_data": calib, "calib_samples": 16, "calib_seq_len": 32} if args.pop("calib", False) else {}
    )
    to = args.pop("to", None)
    if producer == "save":
        return _save_case(source, out, calib_kw, **args)
    import mixprec
    from mixprec.cli import main as cli

    first = out if to is None else tmp / f"{name}-source"
    mixprec.quantize_checkpoint(source, first, progress=False, **calib_kw, **args)
    if to is not None and cli(["convert", str(first), str(out), "--to", to, "--quiet"]) != 0:
        raise RuntimeError(f"mixprec convert {first} --to {to} failed")
    return directory_digests(out)


def _save_case(
    source: Path, out: Path, calib_kw: dict, scheme, format: str = "compressed-tensors"
) -> dict[str, str]:
    import transformers

    from mixprec import quantize_model_, save_quantized
    from mixprec.hf import load_tokenizer

    model = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    tok = load_tokenizer(source)
    if isinstance(scheme, dict):
        groups: dict[str, list[str]] = {}
        for n, s in scheme.items():
            groups.setdefault(s, []).append(n)
        every = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        for s, names in groups.items():
            quantize_model_(model, s, ignore=[f"re:^{n}$" for n in every if n not in names])
    else:
        kw = (
            {"calib_data": calib_kw["calib_data"], "tokenizer": tok, "calib_samples": 16, "calib_seq_len": 32}
            if calib_kw
            else {}
        )
        quantize_model_(model, scheme, **kw)
    save_quantized(model, out, format=format, tokenizer=tok)
    return directory_digests(out)


# ---- training cases ---------------------------------------------------------------------------------
TRAINING_MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 4}  # fmt: skip
TRAINING_DATA = dict(seq_len=32, vocab_size=320, max_chars=40_000, val_blocks=4)
TRAINING_RECIPES = ("fp32", "bf16", "fp16-amp", "fp8-delayed", "fp8-current", "fp8-unscaled", "fp4-nvfp4")


def _float_bits(x) -> str:
    return (
        "nan"
        if x is None
        else torch.tensor(float(x), dtype=torch.float64).view(torch.int64).item().__format__("x")
    )


def run_training_case(recipe: str) -> str:
    """sha256 of every number a 12-step comparison run of `recipe` logs and of its final weights."""
    from mixprec.comparison.training_run import RunSpec, train_run
    from mixprec.data import load_corpus, prepare_data
    from mixprec.models import ReferenceModelConfig, build_reference_model

    data = prepare_data(load_corpus(None, TRAINING_DATA["max_chars"]), seq_len=TRAINING_DATA["seq_len"],
                        vocab_size=TRAINING_DATA["vocab_size"], max_val_blocks=TRAINING_DATA["val_blocks"])  # fmt: skip
    model = build_reference_model(data.vocab_size, 0, ReferenceModelConfig(**TRAINING_MODEL))
    spec = RunSpec(name=recipe, recipe=recipe, order_seed=0, steps=12, batch_size=4, lr=3e-3, warmup=2,
                   eval_every=4, monitor_every=4, checkpoint_every=100, weight_decay=0.01, max_grad_norm=1.0)  # fmt: skip
    result = train_run(spec, model, data)
    h = hashlib.sha256()
    for row in result.records:
        h.update(
            json.dumps(
                {k: (_float_bits(v) if isinstance(v, float) else v) for k, v in sorted(row.items())},
                sort_keys=True,
                default=str,
            ).encode()
        )
    for k, v in sorted(result.model.state_dict().items()):
        h.update(k.encode())
        h.update(_tensor_bytes(v))
    return h.hexdigest()


def _tensor_bytes(v: torch.Tensor) -> bytes:
    v = v.detach().reshape(-1).contiguous()
    return (v.to(torch.uint8) if v.dtype == torch.bool else v).view(torch.uint8).numpy().tobytes()


def run_step_case(recipe: str) -> str:
    """sha256 of the losses, loss scales and final weights of 6 optimizer steps of TrainingStep (2
    micro-batches each, clipped) over a model converted with `recipe`."""
    from mixprec.data import load_corpus, prepare_data, train_batch
    from mixprec.models import ReferenceModelConfig, build_reference_model, lm_loss
    from mixprec.training import TrainingStep, convert_for_training
    from mixprec.training.optim import AdamW

    data = prepare_data(load_corpus(None, TRAINING_DATA["max_chars"]), seq_len=TRAINING_DATA["seq_len"],
                        vocab_size=TRAINING_DATA["vocab_size"], max_val_blocks=TRAINING_DATA["val_blocks"])  # fmt: skip
    model = build_reference_model(data.vocab_size, 1, ReferenceModelConfig(**TRAINING_MODEL))
    convert_for_training(model, recipe)
    step = TrainingStep(
        model, AdamW(model.parameters(), lr=2e-3), grad_accumulation_steps=2, max_grad_norm=0.5
    )
    h = hashlib.sha256()
    for micro in range(12):
        loss = lm_loss(model, train_batch(data, 2, micro, 3))
        h.update(_float_bits(float(loss.detach())).encode())
        info = step.backward(loss)
        h.update(json.dumps({k: _float_bits(v) for k, v in sorted((info or {}).items())}).encode())
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(_tensor_bytes(v))
    return h.hexdigest()


# ---- producing and checking -----------------------------------------------------------------------
def all_digests() -> dict[str, dict[str, str]]:
    torch.set_num_threads(1)  # GEMMs split by thread count would make the numbers depend on it
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        source, calib = _source_model(tmp)
        ckpt = {name: run_checkpoint_case(name, tmp, source, calib) for name, _, _ in CHECKPOINT_CASES}
    training = {r: run_training_case(r) for r in TRAINING_RECIPES}
    steps = {r: run_step_case(r) for r in TRAINING_RECIPES}
    return {"checkpoints": ckpt, "training": training, "step": steps}


def main() -> None:
    """Add (or replace) this CPU kind's digests in goldens.json, produced by the code on PYTHONPATH."""
    import mixprec

    doc = json.loads(GOLDENS.read_text()) if GOLDENS.exists() else {"kinds": {}}
    src = Path(mixprec.__file__).resolve().parents[1]
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=src
    ).stdout.strip()
    if doc.setdefault("base_commit", commit) != commit:
        sys.exit(f"goldens.json holds digests of {doc['base_commit']}; mixprec here is {commit}")
    doc["torch"] = torch.__version__
    digests = all_digests()
    doc["kinds"][cpu_kind()] = {f"{g}/{n}": d for g, cases in digests.items() for n, d in cases.items()}
    GOLDENS.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDENS}: {len(doc['kinds'][cpu_kind()])} digests for {cpu_kind()}")


if __name__ == "__main__":
    main()
