"""Offline quantization of a Hugging Face safetensors checkpoint: `quantize_checkpoint`.

Calibration-free schemes (fp8-dynamic, fp8-block) never instantiate the model: Linear weights are
recognised by name and 2-D shape (linear_weights.py: confirmed against the model built on the meta
device, per-expert MoE weights and tied heads included), and every tensor streams from the input
shards to planned output shards, a few Linear weights in memory at a time (reused buffers; see
_stream_tensors). Calibration (fp8-static, --kv-cache fp8) loads the model once to observe
activations, frees it, then streams the weights the same way.

Every 2-D floating weight is accounted for: quantized, kept by an ignore pattern, or kept for a
reason the report gives with a warning (a Linear whose dims do not suit FP8 kernels, a tied head,
a weight that is no Linear's, fused 3-D experts).
"""

from __future__ import annotations

import gc
import math
import os
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from mixprec.conversion import ConversionReport
from mixprec.errors import MixprecError
from mixprec.formats import E4M3
from mixprec.hf import load_model, load_tokenizer, read_config
from mixprec.inference.calibration.data import load_texts, token_batches
from mixprec.inference.calibration.layerwise import calibrate_layerwise
from mixprec.inference.calibration.observers import make_observer
from mixprec.inference.calibration.run import NothingObserved, StopRule, calibrate
from mixprec.inference.checkpoint import configs, layout
from mixprec.inference.checkpoint.layout import INPUT_SCALE, K_SCALE, V_SCALE, WEIGHT_SCALE, planned_tensors
from mixprec.inference.checkpoint.linear_weights import FLOAT_DTYPES, LinearWeights, find_linear_weights
from mixprec.inference.checkpoint.publish import DEFAULT_MAX_SHARD_SIZE, parse_size, publish
from mixprec.inference.checkpoint.safetensors_io import (
    Checkpoint,
    PlannedShardWriter,
    PlannedTensor,
    ShardReader,
    check_output,
    copy_side_files,
    open_checkpoint,
)
from mixprec.inference.checkpoint.scales_file import build_document, layer_entry
from mixprec.inference.mixed import KEPT_BY_ASSIGNMENT, MIXED, PLAIN, apply_assignment, mixed_assignment
from mixprec.inference.producers.quantize_blocks import quantize_block_task, weight_global_scales
from mixprec.inference.runtime.experts import unfuse_for_calibration
from mixprec.inference.schemes import (
    InferenceScheme,
    check_finite,
    quantize_weight,
    resolve_ignore,
    serving_reasons,
    skip_reason,
    transformers_dequantize_reason,
)
from mixprec.progress import ProgressBars, progress_bar
from mixprec.scaling import compute_scale
from mixprec.select import selects_any


def read_source_config(model_dir: Path) -> dict[str, Any]:
    """The input's config.json (mixprec.hf.read_config), refused when it is already quantized."""
    cfg = read_config(model_dir)
    if "quantization_config" in cfg:
        raise MixprecError(f"{model_dir / 'config.json'} already has a quantization_config "
                           f"({cfg['quantization_config'].get('quant_method')}): the checkpoint is already quantized")  # fmt: skip
    return cfg


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def quantize_checkpoint(
    model_dir: str | Path,
    output_dir: str | Path,
    scheme: str | InferenceScheme | Mapping[str, str | InferenceScheme] = "fp8-dynamic",
    *,
    ignore: Sequence[str] | None = None,
    default_ignore: bool = True,
    calib_data: str | Path | None = None,
    calib_samples: int = 512,
    calib_seq_len: int = 512,
    observer: str = "max",
    calib_stop: StopRule | None = None,
    format: str = "compressed-tensors",
    kv_cache: str | None = None,
    force: bool = False,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    layer_by_layer: bool | None = None,
    progress: bool = True,
    strict: bool = False,
) -> ConversionReport:
    """Quantize a local Hugging Face safetensors checkpoint to FP8 or FP4 (the scheme's format); write
    it to output_dir atomically.

    Only what the serving engines accept is written (schemes.serving_reasons): a Linear whose dims no
    FP8 kernel takes, or a fused group (q/k/v, gate/up, experts) that vLLM would refuse, stays in high
    precision and goes into the checkpoint's ignore list, with its reason in the report. strict: raise
    MixprecError instead, before anything is read or written.

    calib_stop (calibration only): when calibration may stop before `calib_samples` (the cap) have run
    (default StopRule(): over the last 4 batches no Linear input carried more than 1e-5 of its energy above
    the amax held before each batch, after 16384 tokens);
    the report's and scales file's `calibration` say how many samples ran and why it stopped.

    layer_by_layer (calibration only): run the model one transformer block at a time (True), the
    whole model at once (False), or decide by memory (None: when the checkpoint exceeds half of the
    available RAM).

    scheme as a mapping {Linear name: scheme}: a mixed-precision checkpoint (what `--scheme auto`
    chooses), one compressed-tensors config group per scheme whose targets name its Linears; every
    Linear the mapping does not name stays in high precision.
    """
    from mixprec import __version__

    mixed = mixed_assignment(scheme)
    sch = InferenceScheme.from_name(scheme) if mixed is None else MIXED
    if format not in layout.LAYOUTS:
        raise MixprecError(f"unknown checkpoint format {format!r}; known: {', '.join(layout.LAYOUTS)}")
    if kv_cache not in (None, "fp8", "fp8_e4m3", "e4m3"):
        raise MixprecError(f"--kv-cache takes 'fp8', got {kv_cache!r}")
    if format == "hf-fp8":
        if mixed is not None:
            raise MixprecError(
                "a mixed-precision checkpoint is written in the compressed-tensors layout only"
            )
        configs.hf_fp8_quantization_config(sch, [])  # refuses non-block schemes
        if kv_cache:
            raise MixprecError("--kv-cache fp8 scales are written in the compressed-tensors layout only")
    model_dir, output_dir = Path(model_dir), Path(output_dir)
    ckpt = open_checkpoint(model_dir)
    check_output(model_dir, output_dir, force)
    config = read_source_config(model_dir)
    max_bytes = parse_size(max_shard_size)
    calibrated = [s for s in (mixed or {sch.name: sch}).values() if s.needs_calibration]
    if calibrated or kv_cache:
        if calib_data is None:
            raise MixprecError(f"{'scheme ' + calibrated[0].name if calibrated else '--kv-cache fp8'} needs "
                               "--calib-data (a .txt, a folder of .txt, or a .jsonl with 'text')")  # fmt: skip
        make_observer(observer)  # fail on a bad name before any work
        texts = load_texts(calib_data)

    report = ConversionReport(
        recipe=sch.name, kind=sch.family, device="cpu", param_dtype=str(config.get("dtype") or config.get("torch_dtype")),
        scheme=sch.name, output=str(output_dir),
    )  # fmt: skip
    patterns = resolve_ignore(ignore, defaults=default_ignore)
    lw = find_linear_weights(ckpt, model_dir, config)
    if lw.warning:
        report.warn(lw.warning)
    targets, skipped, kept = _select(
        lw, patterns, sch if mixed is None else InferenceScheme.from_name(PLAIN), format, strict=strict
    )
    schemes = (
        dict.fromkeys(targets, sch)
        if mixed is None
        else apply_assignment(mixed, lw.linears, targets, skipped, kept, format)
    )
    if not targets:
        report.warn(f"no Linear weight of {model_dir} is quantized (all ignored or none recognised)")
    unnamed = {
        n: why for n, (_, why) in kept.items() if why not in ("ignored by pattern", KEPT_BY_ASSIGNMENT)
    }
    if unnamed:
        listed = "; ".join(f"{n}: {why.split(' (')[0]}" for n, why in list(unnamed.items())[:3])
        report.warn(
            f"{len(unnamed)} weight tensor(s) stay in high precision although no ignore pattern names them "
            f"(e.g. {listed}{'; ...' if len(unnamed) > 3 else ''}); the report lists each with its reason"
        )
    dequantize_refused = {
        n: why
        for n, dims in targets.items()
        if (why := transformers_dequantize_reason(format, schemes[n].weight_block, *dims))
    }
    if dequantize_refused:
        name, why = next(iter(dequantize_refused.items()))
        report.warn(
            f"{len(dequantize_refused)} Linear layer(s) load in vLLM and on FP8 GPUs but not in transformers on a "
            f"CPU (e.g. {name}: {why}); the compressed-tensors layout has no such limit"
        )

    input_amax: dict[str, float] = {}
    kv_amax: dict[int, tuple[float, float]] = {}
    calibration_info = None
    if calibrated or kv_cache:
        tok = load_tokenizer(model_dir)
        batches = token_batches(texts, tok, calib_samples, calib_seq_len)
        names = [n for n in targets if schemes[n].needs_calibration]
        if layer_by_layer is None:  # decide by memory: the whole model must fit with room to spare
            layer_by_layer = ckpt.total_bytes > 0.5 * _available_memory()
        if layer_by_layer:
            n_blocks = int(config.get("num_hidden_layers") or 0)
            with progress_bar(progress, "calibrating layer by layer", n_blocks or None) as advance:
                result, model = calibrate_layerwise(
                    model_dir, config, ckpt, batches, names, observer=observer, kv_cache=bool(kv_cache),
                    progress=advance,
                )  # fmt: skip
            input_amax = result.input_amax
        else:
            model = load_model(model_dir, dtype="auto").eval()
            paths = _calibration_modules(model, names, lw)
            try:
                # the bar's total is the cap; the stop rule usually ends it early (time left: to the cap)
                with ProgressBars(progress, time_remaining=True) as bars:
                    advance = bars.add("calibrating (stops once the scales settle)", len(batches)).advance
                    result = calibrate(
                        model, batches, list(paths.values()), observer=observer, kv_cache=bool(kv_cache),
                        stop=calib_stop, progress=advance,
                    )  # fmt: skip
            except NothingObserved as e:  # an unfused expert: name it as the checkpoint does, and say why
                unseen = [n for n, p in paths.items() if p == e.module and p != n]
                if not unseen:
                    raise
                raise MixprecError(
                    f"calibration routed no token to MoE expert weight {unseen[0]!r}: use more --calib-samples, "
                    "or keep it in high precision with --ignore"
                ) from None
            input_amax = {n: result.input_amax[p] for n, p in paths.items()}
        kv_amax = result.kv_amax
        calibration_info = {"data": str(calib_data), "seq_len": int(batches[0].shape[1]), "observer": observer,
                            "samples_requested": calib_samples, **result.run.to_dict()}  # fmt: skip
        calibration_info["layer_by_layer"] = bool(layer_by_layer)
        report.calibration = calibration_info
        report.notes.append(f"calibration: {result.run.samples} samples, {result.run.reason}")
        kv_names = {i: _attention_module_name(model, i) for i in kv_amax}
        del model
        gc.collect()

    # ---- plan every output tensor --------------------------------------------------------------
    names = layout.tensor_names(format)
    planned: list[PlannedTensor] = []
    for n, info in ckpt.tensors.items():
        module = n[: -len(".weight")] if n.endswith(".weight") else None
        if module in targets and not schemes[module].is_fp8:  # NVFP4 / MX: the layout table's tensors
            planned += [PlannedTensor(*t) for t in planned_tensors(module, targets[module], schemes[module])]
        elif module in targets:
            out_f, in_f = targets[module]
            planned.append(PlannedTensor(n, torch.float8_e4m3fn, info.shape))
            planned.append(
                PlannedTensor(
                    f"{module}.{names[WEIGHT_SCALE]}",
                    torch.float32,
                    schemes[module].scale_shape(out_f, in_f),
                )
            )
            if schemes[module].needs_calibration:
                planned.append(PlannedTensor(f"{module}.{names[INPUT_SCALE]}", torch.float32, (1,)))
        else:
            planned.append(PlannedTensor(n, info.dtype, info.shape))
    kv_tensors: dict[str, torch.Tensor] = {}
    kv_doc: dict[str, dict[str, float]] = {}
    for i, (ka, va) in kv_amax.items():
        attn = kv_names[i]
        ks, vs = compute_scale(ka, E4M3).reshape(1), compute_scale(va, E4M3).reshape(1)
        kv_tensors[f"{attn}.{K_SCALE}"], kv_tensors[f"{attn}.{V_SCALE}"] = ks, vs
        kv_doc[attn] = {K_SCALE: float(ks), V_SCALE: float(vs), "k_amax": ka, "v_amax": va}
    planned += [PlannedTensor(n, torch.float32, (1,)) for n in kv_tensors]

    layers: dict[str, dict[str, Any]] = {}
    total = sum(t.nbytes for t in planned)
    ignored_linears = sorted(skipped)

    def write_tensors(writer: PlannedShardWriter) -> None:
        _stream_tensors(
            ckpt, writer, targets, schemes, names, input_amax, layers, report, progress,
            weight_global_scales(ckpt, targets, schemes),
        )  # fmt: skip
        for n, t in kv_tensors.items():
            writer.write(n, t)

    def out_config() -> dict[str, Any]:
        out_cfg = dict(config)
        if mixed is not None:
            out_cfg["quantization_config"] = configs.ct_mixed_quantization_config(
                {n: schemes[n] for n in targets}, ignored_linears, bool(kv_cache)
            )
        elif format == "compressed-tensors":
            out_cfg["quantization_config"] = configs.ct_quantization_config(
                sch, ignored_linears, bool(kv_cache)
            )
        else:
            out_cfg["quantization_config"] = configs.hf_fp8_quantization_config(sch, ignored_linears)
        return out_cfg

    def scales() -> dict[str, Any]:
        return build_document(
            # block-format layers stay out: their scales are in the checkpoint, millions of them
            scheme=sch.name, layout=format, layers={n: e for n, e in layers.items() if schemes[n].is_fp8},
            kv_cache=kv_doc, ignored=skipped,
            calibration=calibration_info, producer=f"mixprec {__version__}",
        )  # fmt: skip

    copied = publish(
        output_dir, force=force, planned=planned, max_shard_size=max_bytes, producer=f"mixprec {__version__}",
        write_tensors=write_tensors, config=out_config, side_files=lambda tmp: copy_side_files(model_dir, tmp, skip=set()),
        scales=scales,
    )  # fmt: skip
    report.weight_bytes_after = total
    for name, (kind, why) in kept.items():
        info = ckpt.tensors.get(name) or ckpt.tensors.get(f"{name}.weight")
        numel = info.nbytes // info.dtype.itemsize if info is not None else 0
        role = {"Linear": "linear", "experts": "experts"}.get(
            kind, "embedding" if name in lw.embeddings else "other"
        )
        report.add_skipped(name, kind, numel, why, role=role)
    report.notes.append(f"copied {', '.join(copied) or 'no side files'}")
    return report


def _select(lw: LinearWeights, patterns: Sequence[str], sch: InferenceScheme, layout: str, *, strict: bool = False) -> tuple[dict[str, tuple[int, int]], dict[str, str], dict[str, tuple[str, str]]]:  # fmt: skip
    """(targets: Linears to quantize, skipped: the Linear modules a reader must leave alone (the
    checkpoint's ignore list) with reasons, kept: every weight left in high precision -> (kind, reason)).
    strict: MixprecError when a Linear no ignore pattern names stays in high precision for a shape rule."""
    targets: dict[str, tuple[int, int]] = {}
    skipped: dict[str, str] = {}
    kept: dict[str, tuple[str, str]] = {}
    for name, (out_f, in_f) in lw.linears.items():
        why = skip_reason(name, out_f, in_f, patterns, sch)
        if why:
            skipped[name] = why
            kept[name] = ("Linear", why)
        else:
            targets[name] = (out_f, in_f)
    for name, why in serving_reasons(sch, layout, lw.linears, skipped).items():
        del targets[name]
        skipped[name] = why
        kept[name] = ("Linear", why)
    if strict:
        broken = {n: why for n, why in skipped.items() if n in lw.linears and why != "ignored by pattern"}
        if broken:
            name, why = next(iter(broken.items()))
            raise MixprecError(
                f"--strict: {len(broken)} Linear layer(s) would stay in high precision for the serving engines' "
                f"shape rules, e.g. {name}: {why}; name them with --ignore to keep them in high precision, "
                "or drop --strict"
            )
    # tied heads: readers see the module, the checkpoint lacks its weight
    for name, why in lw.unstored.items():
        why = "ignored by pattern" if selects_any(name, patterns) else why
        skipped[name] = why
        kept[name] = ("Linear", why)
    for name, what in lw.not_linear.items():
        if not selects_any(name, patterns):
            kept[name] = ("weight", f"{what}, not quantized")
        elif name not in lw.embeddings:  # e.g. MoE routers: Linear layers to readers such as vLLM
            skipped[name] = "ignored by pattern"
            kept[name] = ("weight", "ignored by pattern")
    for name in lw.fused_experts:
        kept[name] = ("experts", "fused 3-D expert weights: mixprec quantizes per-expert 2-D weights only")
    return targets, skipped, kept


def _calibration_modules(model: Any, names: Sequence[str], lw: LinearWeights) -> dict[str, str]:
    """{checkpoint name: module path in the loaded model} of the Linears whose inputs are observed;
    fused experts are unfused first (experts.py) so that each expert's inputs can be seen."""
    paths = unfuse_for_calibration(model, lw.experts) if any(n in lw.experts for n in names) else {}
    modules = dict(model.named_modules())
    out = {}
    for n in names:
        path = paths.get(n, n)
        if path not in modules:
            raise MixprecError(f"calibration: the loaded model has no module {n!r} (a checkpoint name)")
        out[n] = path
    return out


# Bytes of a tensor written unchanged that are read, checked and written at a time.
_COPY_CHUNK_BYTES = 16 << 20


def _stream_tensors(
    ckpt: Checkpoint,
    writer: PlannedShardWriter,
    targets: dict[str, tuple[int, int]],
    schemes: dict[str, InferenceScheme],
    names: dict[str, str],
    input_amax: dict[str, float],
    layers: dict[str, dict[str, Any]],
    report: ConversionReport,
    progress: bool,
    weight_globals: dict[str, torch.Tensor] | None = None,
) -> None:
    """Every input tensor to the writer, in plan order (weight_globals: NVFP4's shared global scales).

    Linear weights are read and quantized on worker threads (one intra-op thread each: torch releases
    the GIL, and small per-op parallel regions are slow on a busy machine), a few ahead of the writer;
    this thread writes them in order, and streams the tensors kept unchanged through a small buffer
    (read, checked for NaN/inf, written). Read and payload buffers are reused, so memory stays at a few
    Linear weights and pages are not faulted in again for every tensor.
    """
    workers = max(1, min(4, os.cpu_count() or 1))
    depth = workers + 1  # quantize tasks in flight
    weight_bytes = max((ckpt.tensors[f"{m}.weight"].nbytes for m in targets), default=0)
    payload_elems = max((o * i for o, i in targets.values()), default=0)
    in_pool = _BufferPool(weight_bytes)
    out_pool = _BufferPool(payload_elems)
    chunk = torch.empty(_COPY_CHUNK_BYTES, dtype=torch.uint8)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with (
            ShardReader() as reader,
            ThreadPoolExecutor(max_workers=workers) as pool,
            progress_bar(
                progress,
                f"quantizing ({'+'.join(dict.fromkeys(s.name for s in schemes.values()))})",
                len(ckpt.tensors),
            ) as advance,
        ):
            todo = iter(ckpt.tensors.items())
            pending: deque = deque()  # (info, module, future or None), in plan order
            in_flight = 0

            def submit() -> bool:
                nonlocal in_flight
                for n, info in todo:
                    module = n[: -len(".weight")] if n.endswith(".weight") else None
                    if module in targets:
                        fut = pool.submit(
                            _quantize_task, reader, info, module, targets[module], schemes[module], names,
                            input_amax.get(module), in_pool, out_pool, (weight_globals or {}).get(module),
                        )  # fmt: skip
                        pending.append((info, module, fut))
                        in_flight += 1
                        return True
                    pending.append((info, None, None))
                return False

            while in_flight < depth and submit():
                pass
            while pending:
                info, module, fut = pending.popleft()
                if fut is None:
                    _copy_through(reader, writer, info, chunk)
                else:
                    in_flight -= 1
                    out, entry, payload = fut.result()
                    for name, tensor in out:
                        writer.write(name, tensor)
                    out_pool.release(payload)
                    layers[module] = entry
                    report.add_quantized_linear(
                        module,
                        "Linear",
                        info.nbytes // info.dtype.itemsize,
                        entry,
                        schemes[module].family,
                        schemes[module].family,
                    )
                    while in_flight < depth and submit():
                        pass
                report.weight_bytes_before += info.nbytes
                advance()
    except BaseException:
        for item in pending:  # let running tasks finish before their buffers go away
            if item[2] is not None:
                item[2].cancel()
        raise
    finally:
        torch.set_num_threads(threads)


class _BufferPool:
    """Reusable flat buffers of `size` elements (uint8), handed out one per task in flight."""

    def __init__(self, size: int):
        self.size = size
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def get(self) -> torch.Tensor:
        with self._lock:
            if self._free:
                return self._free.pop()
        return torch.empty(self.size, dtype=torch.uint8)

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)


def _copy_through(reader: ShardReader, writer: PlannedShardWriter, info, chunk: torch.Tensor) -> None:
    """A tensor written unchanged: streamed through `chunk`, floating ones checked for NaN/inf."""
    step = len(chunk) - len(chunk) % max(1, info.dtype.itemsize)
    check = info.dtype in FLOAT_DTYPES

    def pieces():
        for start in range(0, info.nbytes, step):
            n = min(step, info.nbytes - start)
            mv = memoryview(chunk.numpy())[:n]
            reader.read_range(info, start, mv)
            if check and n:
                values = chunk[:n].view(info.dtype)
                lo, hi = torch.aminmax(values)  # NaN propagates; an inf shows in lo or hi
                if not (math.isfinite(float(lo)) and math.isfinite(float(hi))):
                    check_finite(reader.get(info), info.name)  # the whole tensor: the exact count
            yield mv

    writer.write_chunks(info.name, info.dtype, info.shape, pieces())


def _quantize_task(
    reader: ShardReader,
    info,
    module: str,
    shape: tuple[int, int],
    sch: InferenceScheme,
    names: dict[str, str],
    in_amax: float | None,
    in_pool: _BufferPool,
    out_pool: _BufferPool,
    global_scale: torch.Tensor | None = None,
) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any], torch.Tensor]:
    """Read and quantize one Linear weight (on a worker thread): the output tensors in plan order, its
    scales-file entry, and the payload buffer to release once written."""
    if not sch.is_fp8:
        return quantize_block_task(reader, info, module, shape, sch, in_amax, in_pool, out_pool, global_scale)
    buf = in_pool.get()
    try:
        w = reader.get(info, out=buf)
        payload = out_pool.get()
        data = payload[: w.numel()].view(torch.float8_e4m3fn).view(shape)
        q, stats = quantize_weight(w, sch, name=info.name, out=data)
    finally:
        in_pool.release(buf)
    out = [
        (info.name, q.data),
        (f"{module}.{names[WEIGHT_SCALE]}", q.scale.reshape(sch.scale_shape(*shape))),
    ]
    in_scale = None
    if sch.needs_calibration:
        in_scale = compute_scale(in_amax, E4M3).reshape(1)
        out.append((f"{module}.{names[INPUT_SCALE]}", in_scale))
    entry = layer_entry(
        scheme=sch.name, weight_granularity=sch.weight_granularity.name, weight_scale=q.scale,
        weight_amax=stats.amax, relative_weight_error=stats.relative_error, shape=tuple(q.shape),
        input_scale=in_scale, input_amax=in_amax, input_dynamic=sch.input_dynamic,
        input_granularity=sch.input_granularity.name,
    )  # fmt: skip
    return out, entry, payload


def _attention_module_name(model: Any, layer_idx: int) -> str:
    for name, m in model.named_modules():
        if getattr(m, "layer_idx", None) == layer_idx and hasattr(m, "k_proj"):
            return name
    raise MixprecError(f"no attention module with layer_idx {layer_idx} and a k_proj for the KV-cache scales")
