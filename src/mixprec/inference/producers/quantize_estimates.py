"""Peak-memory and time estimates of an offline quantization, from the checkpoint's headers, its
config.json and short probes on tensors of the real shapes (producers/quantize_plan.py prints them).

Each estimate is a sum of named terms (bytes or seconds) with its formula in words; the terms follow
what the code holds today (docs/quantize.md, "Plan before you run"):

- streaming (calibration-free schemes, and the writing stage of every path): the process baseline +
  the read buffers ((workers - 1 + the read buffers of one fused group's task) x the largest Linear
  weight) + the payload buffers ((workers + largest group) x the largest payload, 4-bit ones packed two
  codes a byte) + as many 4-bit block scales + each worker's quantize temporaries (measured by the
  probe) + the copy buffer + the writer's staging buffer.
- layer by layer (calibration with --layer-by-layer, and always with GPTQ): the baseline + the embedding
  rows the calibration tokens use (at most tokens x hidden; the head and final norm are never read) + the
  largest block's weights + the calibration hidden states (samples x seq_len x hidden in the model dtype,
  one copy: each block's outputs replace its inputs batch by batch) + one batch's forward temporaries +
  with GPTQ: the block's Hessians (in^2 fp32 per input group), the solve's temporaries for the largest
  Linear, and one block's rounded Linears (each block's results go to disk at its end and the writer reads
  them back one by one: calibration/layerwise.py, checkpoint/spill.py).
- whole model (calibration without --layer-by-layer): the baseline + the whole model + one batch's
  forward temporaries.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from mixprec.inference.algorithms.gptq import gptq_quantize
from mixprec.inference.checkpoint.direct_file import STAGING_BYTES, direct_writes_enabled
from mixprec.inference.producers.quantize_blocks import payload_bytes, payload_view
from mixprec.inference.schemes import InferenceScheme, quantize_weight

PROBE_ROUNDS = 2  # timed rounds of the quantize probe (after one warm-up round); the median call counts
GEMM_PROBE_ROWS = 512  # rows of the timed GEMM (tokens of one calibration sequence)
GPTQ_PROBE_INPUTS = 512  # inputs of the scaled-down GPTQ probe (its rule: estimate_gptq_seconds)
# Disk speeds, assumed: a plan reads no shard body and writes nothing, so it cannot time them. On the
# project's 2-CPU machine (2026-12-05) buffered writing ran at 325-360 MB/s (dd with 16 MiB blocks;
# quantize's own writes, profiled: 7.8 s for 2.54 GB); writes around the page cache
# (checkpoint/direct_file.py, 2026-12-07) at 1.33-1.69 GB/s (bench/write_speed.py).
WRITE_BYTES_PER_SECOND = 1.5e9  # shards written with O_DIRECT
BUFFERED_WRITE_BYTES_PER_SECOND = 330e6  # through the page cache (O_DIRECT switched off)
# Tensors kept unchanged (embeddings, head, norms) are read, checked for NaN/inf and written by the
# writer's thread, 16 MiB at a time: an assumed 1 GB/s for the read and the check (fitted to the runs
# of docs/benchmarks.md, "Direct shard writes"; their write is in the write term). The workers' reads
# of the Linear weights overlap their compute and are not counted.
KEPT_BYTES_PER_SECOND = 1e9


def write_bytes_per_second() -> float:
    """The assumed write speed of this process's shard files."""
    return WRITE_BYTES_PER_SECOND if direct_writes_enabled() else BUFFERED_WRITE_BYTES_PER_SECOND


@dataclass(frozen=True)
class Estimate:
    """A total and the terms it sums ({name: value}: bytes for memory, seconds for time)."""

    terms: dict[str, float]
    formula: str
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return float(sum(self.terms.values()))

    def to_dict(self) -> dict[str, Any]:
        return {"total": self.total, "terms": dict(self.terms), "formula": self.formula, "notes": self.notes}


def current_rss() -> int:
    """This process's resident set (bytes): the baseline a quantize process starts its work from."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM")


@contextlib.contextmanager
def _peak_rise() -> Iterator[list[int]]:
    """[bytes]: how far the peak RSS rose above the RSS at entry inside the block (0 where the
    kernel cannot reset the peak: /proc/self/clear_refs)."""
    out = [0]
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        start, ok = current_rss(), True
    except OSError:
        ok = False
    yield out
    if ok:
        out[0] = max(0, _peak_rss() - start)


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class QuantizeProbe:
    """One streaming quantize of a random weight of the largest Linear shape, on one thread as a
    streaming worker runs it: seconds, and the peak RSS above its read and payload buffers."""

    shape: tuple[int, int]
    seconds: float
    temporary_bytes: int

    @property
    def seconds_per_element(self) -> float:
        return self.seconds / max(1, math.prod(self.shape))


def probe_quantize(
    shape: tuple[int, int], dtype: torch.dtype, scheme: InferenceScheme, workers: int = 1
) -> QuantizeProbe:
    """`workers` quantizes of one random weight at once, each on a thread with one intra-op thread, as the
    streaming workers run (they slow each other: 1.2x (FP8) to 1.4x (NVFP4) a lone one's time on the
    project's 2-CPU machine): the median call's seconds after a warm-up, and the peak RSS rise per worker."""
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(shape, generator=gen) * 0.02).to(dtype)
    # the payloads the streaming tasks quantize into (4-bit codes packed), touched as a reused buffer is
    outs = [
        payload_view(torch.zeros(payload_bytes(shape, scheme), dtype=torch.uint8), shape, scheme)
        for _ in range(workers)
    ]

    def one(out: torch.Tensor) -> float:
        start = time.perf_counter()
        quantize_weight(w, scheme, name="probe", out=out)
        return time.perf_counter() - start

    with _threads(1), _peak_rise() as rise, ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(one, outs))  # warm-up: the first calls also allocate and fault in their buffers
        seconds = [t for _ in range(PROBE_ROUNDS) for t in pool.map(one, outs)]
    return QuantizeProbe(tuple(shape), statistics.median(seconds), rise[0] // workers)


def probe_hash_rate(nbytes: int = 16 << 20) -> float:
    """Bytes per second of sha256 on this CPU (the writer hashes every shard as it writes it)."""
    data = bytes(nbytes)
    start = time.perf_counter()
    hashlib.sha256(data).digest()
    return nbytes / max(time.perf_counter() - start, 1e-9)


def probe_gemm_rate(shape: tuple[int, int], threads: int | None = None) -> float:
    """fp32 GEMM flops per second of [GEMM_PROBE_ROWS, in] x [in, out] (the calibration forward's GEMMs
    run in fp32 on CPUs without fast bf16; GPTQ's updates and Hessians are fp32)."""
    out_f, in_f = shape
    x = torch.randn(GEMM_PROBE_ROWS, in_f)
    w = torch.randn(out_f, in_f)
    with _threads(threads or torch.get_num_threads()):
        torch.nn.functional.linear(x[:8], w)  # warm-up
        start = time.perf_counter()
        torch.nn.functional.linear(x, w)
        seconds = time.perf_counter() - start
    return 2.0 * GEMM_PROBE_ROWS * in_f * out_f / max(seconds, 1e-9)


def gptq_flops(out_f: int, in_f: int) -> float:
    """The GEMM work of one GPTQ solve: the lazy block updates (2 out in^2) and the solve factor: one
    Cholesky factor and one triangular inverse (about 2/3 in^3, gptq.solve_factor)."""
    return 2.0 * out_f * in_f**2 + 2.0 / 3.0 * in_f**3


@dataclass(frozen=True)
class GptqProbe:
    """A GPTQ solve of the real output rows on GPTQ_PROBE_INPUTS inputs: the per-column cost (the
    single-threaded column loop) once the GEMM work at `rate` is taken out."""

    out_features: int
    inputs: int
    seconds: float
    rate: float

    @property
    def seconds_per_column(self) -> float:
        return max(0.0, self.seconds - gptq_flops(self.out_features, self.inputs) / self.rate) / self.inputs

    def seconds_for(self, out_f: int, in_f: int) -> float:
        """The scaling rule: the column loop grows with in x out, the GEMM work as gptq_flops."""
        per_column = self.seconds_per_column * out_f / self.out_features
        return per_column * in_f + gptq_flops(out_f, in_f) / self.rate


def probe_gptq(out_f: int, scheme: InferenceScheme, rate: float) -> GptqProbe:
    k = GPTQ_PROBE_INPUTS
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(out_f, k, generator=gen) * 0.02
    x = torch.randn(4 * k, k, generator=gen)
    hessian = x.t() @ x * (2.0 / x.shape[0])
    start = time.perf_counter()
    gptq_quantize(w, hessian, scheme.fmt.name, scheme.weight_granularity)
    return GptqProbe(out_f, k, time.perf_counter() - start, rate)


@dataclass(frozen=True)
class Shapes:
    """What the formulas read from config.json and the headers (bytes are the checkpoint's)."""

    hidden: int
    intermediate: int
    heads: int
    layers: int
    act_bytes: int  # bytes per element of the model's dtype (the hidden states' dtype)
    outside_bytes: int  # every tensor outside the transformer blocks (embeddings, head, final norm)
    block_bytes: int  # the largest block's tensors
    block_linear_params: int  # the weights of one block's Linears (GEMM work per token / 2)
    total_bytes: int
    largest_weight_bytes: int  # of the quantized Linears (a read buffer)
    largest_payload_bytes: int  # the payload buffer a streaming task quantizes into (4-bit: packed)
    largest_block_scales_bytes: int  # a 4-bit weight's block scales (0 without 4-bit schemes)
    largest_group: int  # weights one streaming task reads at once (NVFP4's fused q/k/v: 3)
    group_buffers: int  # read buffers one such task takes (q/k/v may share one; gate/up: 2)
    workers: int


def stream_memory(s: Shapes, baseline: int, probe: QuantizeProbe | None, copy_chunk: int) -> dict[str, float]:
    """The streaming stage's terms (quantize_stream: buffers pooled, at most workers + 1 weights in flight;
    an NVFP4 fused group is read at once by one task)."""
    reads = s.workers - 1 + s.group_buffers  # a group task's buffers, one for each other worker
    payloads = s.workers + s.largest_group
    terms = {
        "process baseline": baseline,
        f"read buffers: {reads} x the largest Linear weight": reads * s.largest_weight_bytes,
        f"payload buffers: {payloads} x the largest payload": payloads * s.largest_payload_bytes,
    }
    if s.largest_block_scales_bytes:
        terms[f"4-bit block scales waiting for the writer: {payloads} x the largest"] = (
            payloads * s.largest_block_scales_bytes
        )
    return terms | {
        f"quantize temporaries: {s.workers} workers x the probe's": s.workers
        * (probe.temporary_bytes if probe else 0),
        "copy buffer": copy_chunk,
        "the writer's staging buffer (direct writes)": STAGING_BYTES,
    }


def forward_temporaries(s: Shapes, seq_len: int, batch: int = 4) -> dict[str, float]:
    """One calibration batch through one block: the MLP's intermediate activations (gate, up, their
    product) and attention scores in fp32, and the fp32 copy of a weight (GEMMs in fp32 on CPUs
    without fast bf16: kernels/bf16_cpu.py)."""
    mlp = 3 * batch * seq_len * s.intermediate * 4
    scores = batch * s.heads * seq_len * seq_len * 4
    return {"forward temporaries of one batch (MLP activations, attention scores; fp32)": mlp + scores}


def layerwise_memory(
    s: Shapes, baseline: int, tokens: int, seq_len: int, gptq: GptqMemory | None
) -> dict[str, float]:
    """The block-by-block calibration stage's terms (calibration/layerwise.py, algorithms/gptq_pass.py)."""
    terms = {
        "process baseline": baseline,
        "embedding rows of the calibration tokens (at most tokens x hidden x dtype)": min(
            tokens * s.hidden * s.act_bytes, s.outside_bytes
        ),
        "the largest block's weights": s.block_bytes,
        "calibration hidden states: tokens x hidden x dtype": tokens * s.hidden * s.act_bytes,
        "fp32 copy of the largest weight (GEMMs in fp32)": s.largest_weight_bytes // max(1, s.act_bytes) * 4,
        **forward_temporaries(s, seq_len),
    }
    if gptq is not None:
        terms |= {
            "GPTQ: the Hessians of one block (in^2 fp32 per input group)": gptq.block_hessian_bytes,
            "GPTQ: solve temporaries of the largest Linear": gptq.solve_bytes,
            "GPTQ: one block's rounded Linears (spilled to disk at the block's end)": gptq.results_bytes
            // max(1, s.layers),
        }
    return terms


def rotation_memory(s: Shapes, baseline: int, chunk_rows: int) -> dict[str, float]:
    """The rotation streamed over the checkpoint (algorithms/rotation_checkpoint.py): one block in its
    dtype with an fp64 product of its largest weight, or one chunk of the embedding's or head's rows."""
    largest = s.largest_weight_bytes // max(1, s.act_bytes)
    return {
        "process baseline": baseline,
        "the largest block's weights": s.block_bytes,
        "fp64 working copies of the largest weight (the weight and its product)": 2 * 8 * largest,
        "a chunk of embedding / head rows: read, fp64 and its product": chunk_rows
        * s.hidden
        * (s.act_bytes + 16),
    }


def awq_memory(s: Shapes, baseline: int, tokens: int, seq_len: int) -> dict[str, float]:
    """AWQ streamed over the checkpoint (algorithms/fold_checkpoint.py): the calibration walk, plus the
    inputs of the block's searched modules (attention, o_proj, the MLP, down_proj) cached for the search."""
    cached = tokens * (3 * s.hidden + s.intermediate) * s.act_bytes
    return {
        **layerwise_memory(s, baseline, tokens, seq_len, None),
        "AWQ: the block's cached inputs (tokens x (3 hidden + intermediate) x dtype)": cached,
    }


def whole_model_memory(s: Shapes, baseline: int, seq_len: int) -> dict[str, float]:
    """Whole-model calibration (quantize_calibration._calibrate_whole_model): the model loaded whole."""
    return {
        "process baseline": baseline,
        "the whole model": s.total_bytes,
        "fp32 copy of the largest weight (GEMMs in fp32)": s.largest_weight_bytes // max(1, s.act_bytes) * 4,
        **forward_temporaries(s, seq_len),
    }


@dataclass(frozen=True)
class GptqMemory:
    block_hessian_bytes: int
    # the weight's 4 fp32 copies, its groups' multipliers and a chunk of rows (the factor lives in the Hessian)
    solve_bytes: int
    results_bytes: int


def forward_seconds(s: Shapes, tokens: int, seq_len: int, rate: float, passes: int) -> float:
    """Every block's forward over the calibration tokens: 2 flops per Linear weight and token, and
    the attention's 2 x seq_len x hidden per token (causal: half of q.k and p.v), `passes` times."""
    per_token = 2 * s.block_linear_params + 2 * seq_len * s.hidden
    return passes * s.layers * tokens * per_token / rate


__all__ = [
    "KEPT_BYTES_PER_SECOND",
    "WRITE_BYTES_PER_SECOND",
    "Estimate",
    "GptqMemory",
    "GptqProbe",
    "QuantizeProbe",
    "Shapes",
    "current_rss",
    "forward_seconds",
    "gptq_flops",
    "layerwise_memory",
    "probe_gemm_rate",
    "probe_gptq",
    "probe_hash_rate",
    "probe_quantize",
    "stream_memory",
    "whole_model_memory",
    "write_bytes_per_second",
]
