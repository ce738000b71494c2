"""Streaming the tensors of an offline quantization: every input tensor to the planned shard writer,
in plan order. Linear weights are read and quantized on worker threads (one intra-op thread each:
torch releases the GIL, and small per-op parallel regions are slow on a busy machine), a few ahead of
the writer; the calling thread writes them in order, and streams the tensors kept unchanged through a
small buffer (read, checked for NaN/inf, written). Read and payload buffers are reused, so memory stays
at a few Linear weights and pages are not faulted in again for every tensor.
"""

from __future__ import annotations

import math
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from mixprec.conversion import ConversionReport
from mixprec.formats import E4M3
from mixprec.inference.algorithms.gptq_pass import rounding_stats
from mixprec.inference.checkpoint.layout import planned_tensors
from mixprec.inference.checkpoint.linear_weights import FLOAT_DTYPES
from mixprec.inference.checkpoint.safetensors_io import (
    Checkpoint,
    ComputedTensor,
    PlannedShardWriter,
    ShardReader,
)
from mixprec.inference.checkpoint.scales_file import layer_entry
from mixprec.inference.producers.quantize_blocks import (
    block_outputs,
    payload_bytes,
    payload_view,
    quantize_block_task,
    quantize_group_task,
)
from mixprec.inference.schemes import InferenceScheme, check_finite, quantize_weight
from mixprec.kernels import allocator
from mixprec.progress import progress_bar
from mixprec.quantization import QuantizationStats
from mixprec.scaling import QuantizedTensor, compute_scale

# Bytes of a tensor written unchanged that are read, checked and written at a time.
COPY_CHUNK_BYTES = 16 << 20
# Weights submitted for quantizing beyond one per worker: the next is read while one is written.
WEIGHTS_AHEAD = 1


def stream_workers() -> int:
    """Threads that read and quantize Linear weights (each with one intra-op thread)."""
    return max(1, min(4, os.cpu_count() or 1))


@dataclass(frozen=True)
class StreamPlan:
    """What streaming needs to know: the Linears quantized ({name: (out, in)}) and their schemes, the
    checkpoint layout they are written in, calibrated input amax, NVFP4's weights grouped by shared
    global scale with the dtype it is computed in (quantize_blocks.nvfp4_groups), and the weights an
    algorithm rounded."""

    targets: dict[str, tuple[int, int]]
    schemes: dict[str, InferenceScheme]
    layout: str
    input_amax: dict[str, float]
    nvfp4_groups: dict[str, tuple[str, ...]]
    global_dtype: torch.dtype = torch.float32
    # Linears an algorithm (GPTQ) has already rounded: written as they are, the weight read for statistics
    prequantized: dict[str, QuantizedTensor] = field(default_factory=dict)
    scale_search: bool = False  # block scales from the scale search (--algorithm scale-search)
    # input tensors whose outputs a resumed run already holds (producers/resume.py): not read again;
    # a Linear's weight maps to its recorded scales-file entry, any other tensor to None
    done: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    # input tensors whose outputs other ranks write (a run split across ranks): not read, not recorded
    elsewhere: frozenset[str] = frozenset()

    def reads(self, name: str) -> bool:
        """Whether this process reads the input tensor `name`."""
        return name not in self.done and name not in self.elsewhere


def stream_tensors(
    ckpt: Checkpoint,
    writer: PlannedShardWriter,
    plan: StreamPlan,
    layers: dict[str, dict[str, Any]],
    report: ConversionReport,
    progress: bool,
) -> None:
    """Every input tensor to the writer, in plan order; the scales-file entry of each quantized Linear
    this process holds (quantized, or recorded by a resumed run) into `layers` (record_layers puts
    them into the report)."""
    workers = stream_workers()
    weight_bytes = max((ckpt.tensors[f"{m}.weight"].nbytes for m in plan.targets), default=0)
    payload = max((payload_bytes(d, plan.schemes[m]) for m, d in plan.targets.items()), default=0)
    chunk = torch.empty(COPY_CHUNK_BYTES, dtype=torch.uint8)
    title = f"quantizing ({'+'.join(dict.fromkeys(s.name for s in plan.schemes.values()))})"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    queue = None
    try:
        with (
            allocator.large_blocks_returned(),
            ShardReader() as reader,
            ThreadPoolExecutor(max_workers=workers) as pool,
            progress_bar(progress, title, len(ckpt.tensors)) as advance,
        ):
            queue = _TaskQueue(ckpt, plan, reader, pool, _BufferPool(weight_bytes), _BufferPool(payload))
            depth = workers + WEIGHTS_AHEAD  # weights in flight (a fused group's task counts its members)
            queue.fill(depth)
            while queue.pending:
                info, module, fut = queue.pending.popleft()
                if fut is _DONE:
                    if module is not None:
                        layers[module] = plan.done[info.name]
                elif fut is None:
                    _copy_through(reader, writer, info, chunk)
                else:
                    out, entry, payload = fut.result()[module]
                    for name, tensor in out:
                        writer.write(name, tensor)
                    if payload is not None:
                        queue.out_pool.release(payload)
                    layers[module] = entry
                    queue.written(fut)
                queue.fill(depth)
                report.weight_bytes_before += info.stored_nbytes
                advance()
    except BaseException:
        if queue is not None:
            queue.cancel()
        raise
    finally:
        torch.set_num_threads(threads)


_DONE = object()  # in place of a task: the tensor's outputs are already written (a resumed run)


def record_layers(ckpt: Checkpoint, plan: StreamPlan, layers: dict[str, dict[str, Any]],
                  report: ConversionReport) -> None:  # fmt: skip
    """Every quantized Linear's entry of `layers` into the report, in the input's order."""
    for n, info in ckpt.tensors.items():
        module = n[: -len(".weight")] if n.endswith(".weight") else None
        if module in plan.targets and module in layers:
            family = plan.schemes[module].family
            numel = info.nbytes // info.dtype.itemsize
            report.add_quantized_linear(module, "Linear", numel, layers[module], family, family)


class _TaskQueue:
    """The input tensors in plan order, each with its quantize task (a future) when it is a target
    Linear's weight: submitted ahead of the writer, at most `depth` weights in flight (submitted, their
    outputs not yet written), and always enough for the writer to have something to wait for. The NVFP4
    shards of a fused GEMM share one task (a future per group, submitted at its first member): each
    weight is read once, the group's amax giving the shared global scale."""

    def __init__(self, ckpt: Checkpoint, plan: StreamPlan, reader: ShardReader, pool: ThreadPoolExecutor,
                 in_pool: _BufferPool, out_pool: _BufferPool) -> None:  # fmt: skip
        self.ckpt = ckpt
        self.todo = iter(ckpt.tensors.items())
        self.plan, self.reader, self.pool = plan, reader, pool
        self.in_pool, self.out_pool = in_pool, out_pool
        self.pending: deque[tuple[Any, str | None, Future | None]] = deque()
        # tasks in flight: {future: its weights whose outputs are still to be written}
        self.unwritten: dict[Future, int] = {}
        # NVFP4 groups submitted whose later members are still to come: [the future, members to come].
        # A group leaves once its last member is queued: the future's results (each member's packed
        # payload, scales) then live only as long as the writer needs them, not to the end of the run.
        self.groups: dict[tuple[str, ...], list] = {}

    def _submit(self) -> bool:
        p = self.plan
        for n, info in self.todo:
            module = n[: -len(".weight")] if n.endswith(".weight") else None
            if n in p.elsewhere:
                self.pending.append((info, None, _DONE))
                continue
            if n in p.done:
                self.pending.append((info, module if module in p.targets else None, _DONE))
                continue
            if module not in p.targets:
                self.pending.append((info, None, None))
                continue
            if module in p.prequantized:
                fut = self.pool.submit(
                    _prequantized_task, self.reader, info, module, p.targets[module], p.schemes[module],
                    p.layout, p.input_amax.get(module), p.prequantized[module], self.in_pool,
                )  # fmt: skip
                self.pending.append((info, module, fut))
                self.unwritten[fut] = 1
                return True
            group = p.nvfp4_groups.get(module)
            if group in self.groups:  # a later shard of a group already submitted
                entry = self.groups[group]
                self.pending.append((info, module, entry[0]))
                entry[1] -= 1
                if not entry[1]:
                    del self.groups[group]
                continue
            if group is not None:
                fut = self.pool.submit(
                    quantize_group_task, self.reader, [self.ckpt.tensors[f"{m}.weight"] for m in group],
                    [p.targets[m] for m in group], [p.schemes[m] for m in group],
                    [p.input_amax.get(m) for m in group], self.in_pool, self.out_pool, p.global_dtype,
                    p.scale_search,
                )  # fmt: skip
                later = sum(p.reads(f"{m}.weight") for m in group) - 1  # the members this process writes
                if later:
                    self.groups[group] = [fut, later]
            else:
                fut = self.pool.submit(
                    _quantize_task, self.reader, info, module, p.targets[module], p.schemes[module], p.layout,
                    p.input_amax.get(module), self.in_pool, self.out_pool, p.scale_search,
                )  # fmt: skip
            self.pending.append((info, module, fut))
            # the members this process writes (a resumed run may hold the first ones already)
            self.unwritten[fut] = sum(p.reads(f"{m}.weight") for m in group) if group is not None else 1
            return True
        return False

    def fill(self, depth: int) -> None:
        # a group counts all of its members, some of which may come after other tensors in plan order:
        # with nothing queued for the writer, the next task is submitted whatever the depth
        while (sum(self.unwritten.values()) < depth or not self.pending) and self._submit():
            pass

    def written(self, fut: Future) -> None:
        """One weight of task `fut` written: the task leaves once all of its weights are."""
        self.unwritten[fut] -= 1
        if not self.unwritten[fut]:
            del self.unwritten[fut]

    def cancel(self) -> None:
        """Let running tasks finish before their buffers go away."""
        for _, _, fut in self.pending:
            if isinstance(fut, Future):
                fut.cancel()


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
    """A tensor written unchanged: streamed through `chunk`, floating ones checked for NaN/inf. A
    computed one (an FP8 input weight kept in high precision: written dequantized to bf16, never as FP8
    without its scales) is read whole, one weight at a time."""
    if isinstance(info, ComputedTensor):
        w = reader.get(info)
        check_finite(w, info.name)
        writer.write(info.name, w)
        return
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
    layout: str,
    in_amax: float | None,
    in_pool: _BufferPool,
    out_pool: _BufferPool,
    search: bool = False,
) -> dict[str, tuple[list[tuple[str, torch.Tensor]], dict[str, Any], torch.Tensor]]:
    """Read and quantize one Linear weight (on a worker thread): {module: (the output tensors in plan
    order, its scales-file entry, the payload buffer to release once written)}."""
    if not sch.is_fp8:
        return quantize_block_task(reader, info, module, shape, sch, in_amax, in_pool, out_pool, search)
    buf = in_pool.get()
    try:
        w = reader.get(info, out=buf)
        payload = out_pool.get()
        q, stats = quantize_weight(w, sch, name=info.name, out=payload_view(payload, shape, sch))
    finally:
        in_pool.release(buf)
    return {module: (*_fp8_outputs(q, stats, module, shape, sch, layout, in_amax), payload)}


def _prequantized_task(reader: ShardReader, info, module: str, shape: tuple[int, int], sch: InferenceScheme,
                       layout: str, in_amax: float | None, q: QuantizedTensor, in_pool: _BufferPool):  # fmt: skip
    """A weight an algorithm rounded: its tensors as given; the original weight is read for the
    statistics (amax, and the relative error of the rounded weight against it)."""
    buf = in_pool.get()
    try:
        # .float() of an fp32 weight is the buffer itself: the statistics before another thread reuses it
        w = reader.get(info, out=buf).float()
        check_finite(w, info.name)
        stats = rounding_stats(w, q)
    finally:
        in_pool.release(buf)
    if sch.is_fp8:
        return {module: (*_fp8_outputs(q, stats, module, shape, sch, layout, in_amax), None)}
    return {module: (*block_outputs(q, stats, info, module, shape, sch, in_amax), None)}


def _fp8_outputs(q: QuantizedTensor, stats: QuantizationStats, module: str, shape: tuple[int, int],
                 sch: InferenceScheme, layout: str, in_amax: float | None):  # fmt: skip
    """An FP8 weight's output tensors in plan order and its scales-file entry."""
    # named as the layout table planned them: payload, weight scale, input scale
    names = [name for name, _, _ in planned_tensors(module, shape, sch, layout)]
    out = [(names[0], q.data), (names[1], q.scale.reshape(sch.scale_shape(*shape)))]
    in_scale = None
    if sch.needs_calibration:
        in_scale = compute_scale(in_amax, E4M3).reshape(1)
        out.append((names[2], in_scale))
    entry = layer_entry(
        scheme=sch.name, weight_granularity=sch.weight_granularity.name, weight_scale=q.scale,
        weight_amax=stats.amax, relative_weight_error=stats.relative_error, shape=tuple(q.shape),
        input_scale=in_scale, input_amax=in_amax, input_dynamic=sch.input_dynamic,
        input_granularity=sch.input_granularity.name,
    )  # fmt: skip
    return out, entry


__all__ = ["COPY_CHUNK_BYTES", "StreamPlan", "record_layers", "stream_tensors", "stream_workers"]
