"""The job of an offline quantization (QuantizeJob: quantize_checkpoint's arguments, frozen and
validated before any work) and the first steps of its pipeline: what `resolve` finds in the input
(Source) and what `select` makes of it (Selection) — producers/quantize.py runs the pipeline.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixprec.errors import MixprecError
from mixprec.hf import read_config
from mixprec.inference.algorithms.spec import FOLDS, AlgorithmSpec
from mixprec.inference.calibration.data import load_texts
from mixprec.inference.calibration.observers import make_observer
from mixprec.inference.calibration.run import StopRule
from mixprec.inference.checkpoint import configs, layout
from mixprec.inference.checkpoint.fp8_block_input import (
    Fp8BlockInput,
    already_quantized,
    fp8_block_input,
    fp8_block_view,
)
from mixprec.inference.checkpoint.linear_weights import LinearWeights
from mixprec.inference.checkpoint.publish import parse_size
from mixprec.inference.checkpoint.safetensors_io import Checkpoint, check_output, open_checkpoint
from mixprec.inference.mixed import MIXED, mixed_assignment
from mixprec.inference.schemes import InferenceScheme, resolve_ignore
from mixprec.ranks import world_size

KV_CACHE_WORDS = (None, "fp8", "fp8_e4m3", "e4m3")  # what --kv-cache takes


# what an FP8 block input can be quantized to: the schemes that need no model forward
FP8_INPUT_SCHEMES = "fp8-dynamic, fp8-block, nvfp4a16, mxfp4a16, mxfp4, mxfp8"


def read_source_config(model_dir: Path) -> dict[str, Any]:
    """The input's config.json (mixprec.hf.read_config), refused when it is already quantized."""
    cfg = read_config(model_dir)
    if "quantization_config" in cfg:
        raise already_quantized(model_dir / "config.json", cfg["quantization_config"].get("quant_method"))
    return cfg


def check_fp8_input_job(job: QuantizeJob, where: Path) -> None:
    """MixprecError, before any work, for what an FP8 block input cannot get: calibration (static
    input scales, --kv-cache fp8) and the algorithms other than the scale search need a forward of the
    model on dequantized weights, which mixprec does not build for such an input."""
    folds = [n for n in job.algorithm.names if n in FOLDS]
    if not (job.calibrates or folds):
        return
    if job.algorithm.needs_data or folds:
        what = f"--algorithm {job.algorithm.label}"
    elif job.calibrated_schemes:
        what = f"scheme {job.calibrated_schemes[0].name}"
    else:
        what = "--kv-cache fp8"
    raise MixprecError(
        f"{where} is an FP8 block checkpoint: {what} needs a forward of the model on its dequantized "
        f"weights, which mixprec does not run for FP8 inputs. The data-free schemes work "
        f"({FP8_INPUT_SCHEMES}; --algorithm scale-search too), or quantize the bf16 checkpoint"
    )


def open_source(job: QuantizeJob) -> tuple[Checkpoint, dict[str, Any], Fp8BlockInput | None]:
    """The input's tensors (headers), its config.json and, for an FP8 block input (DeepSeek-V3 /
    Qwen3-FP8 style), what its quantization_config says: its tensors then as the bf16 checkpoint they
    stand for (checkpoint/fp8_block_input.py), the config without the input's quantization_config
    (the output gets its own). MixprecError before any work for any other quantized input, a
    malformed FP8 one, or a job an FP8 input cannot run; the output's place is checked too."""
    ckpt = open_checkpoint(job.model_dir)
    check_output(job.model_dir, job.output_dir, job.force)
    config = read_config(job.model_dir)
    where = job.model_dir / "config.json"
    fp8 = fp8_block_input(config, where)
    if fp8 is None:
        return ckpt, config, None
    check_fp8_input_job(job, where)
    view = fp8_block_view(ckpt, fp8, job.model_dir)
    return view, {k: v for k, v in config.items() if k != "quantization_config"}, fp8


def check_observer_across_ranks(observer: str) -> None:
    """MixprecError, before any work, for an observer whose amax the ranks cannot combine: only a max
    over batches is the max of the ranks' maxima; a percentile or an MSE-chosen clip of all the inputs
    is not a function of the ranks' own."""
    if world_size() > 1 and observer != "max":
        raise MixprecError(
            f"--observer {observer} cannot be split across {world_size()} processes (only 'max' combines "
            "exactly across ranks): use --observer max, or run the command as one process"
        )


@dataclass(frozen=True)
class QuantizeJob:
    """One offline quantization: the arguments of quantize_checkpoint, resolved and validated (build)
    before anything is read or written. `scheme` is the one scheme, or MIXED with `assignment`
    ({Linear: scheme}) for a mixed-precision checkpoint."""

    model_dir: Path
    output_dir: Path
    scheme: InferenceScheme
    assignment: Mapping[str, InferenceScheme] | None
    ignore: tuple[str, ...]  # the patterns, user's and defaults
    calib_data: str | Path | None
    calib_samples: int
    calib_seq_len: int
    observer: str
    calib_stop: StopRule | None
    format: str
    kv_cache: bool
    force: bool
    max_shard_bytes: int
    layer_by_layer: bool | None
    progress: bool
    strict: bool
    algorithm: AlgorithmSpec = field(default_factory=AlgorithmSpec)
    resume: bool = False  # continue the partial run beside the output (producers/resume.py)

    @classmethod
    def build(cls, model_dir: str | Path, output_dir: str | Path, scheme: Any, *, ignore: Sequence[str] | None,
              default_ignore: bool, kv_cache: str | None, max_shard_size: str | int, **rest: Any) -> QuantizeJob:  # fmt: skip
        """The job of quantize_checkpoint's arguments (`rest`: the ones taken as they are); MixprecError
        for a bad scheme, layout, --kv-cache word, shard size, observer, or missing calibration data."""
        assignment = mixed_assignment(scheme)
        sch = InferenceScheme.from_name(scheme) if assignment is None else MIXED
        fmt = rest["format"]
        if fmt not in layout.LAYOUTS:
            raise MixprecError(f"unknown checkpoint format {fmt!r}; known: {', '.join(layout.LAYOUTS)}")
        if kv_cache not in KV_CACHE_WORDS:
            raise MixprecError(f"--kv-cache takes 'fp8', got {kv_cache!r}")
        if fmt == "hf-fp8":
            if assignment is not None:
                raise MixprecError(
                    "a mixed-precision checkpoint is written in the compressed-tensors layout only"
                )
            configs.hf_fp8_quantization_config(sch, [])  # refuses non-block schemes
            if kv_cache:
                raise MixprecError("--kv-cache fp8 scales are written in the compressed-tensors layout only")
        rest["algorithm"] = AlgorithmSpec.parse(rest.get("algorithm"))
        job = cls(Path(model_dir), Path(output_dir), sch, assignment, resolve_ignore(ignore, defaults=default_ignore),
                  kv_cache=bool(kv_cache), max_shard_bytes=parse_size(max_shard_size), **rest)  # fmt: skip
        for s in (assignment or {sch.name: sch}).values():
            job.algorithm.check_scheme(s)
        if job.calibrates:
            calibrated = job.calibrated_schemes
            if job.calib_data is None:
                who = (f"--algorithm {job.algorithm.label}" if job.algorithm.needs_data
                       else f"scheme {calibrated[0].name}" if calibrated else "--kv-cache fp8")  # fmt: skip
                raise MixprecError(
                    f"{who} needs --calib-data (a .txt, a folder of .txt, or a .jsonl with 'text')"
                )
            make_observer(job.observer)  # fail on a bad name before any work
            check_observer_across_ranks(job.observer)
        return job

    @property
    def calibrated_schemes(self) -> list[InferenceScheme]:
        return [
            s for s in (self.assignment or {self.scheme.name: self.scheme}).values() if s.needs_calibration
        ]

    @property
    def calibrates(self) -> bool:
        """The job reads calibration data (for the folds, the observers or GPTQ)."""
        return bool(self.calibrated_schemes) or self.kv_cache or self.algorithm.needs_data

    @property
    def observes(self) -> bool:
        """The job runs a calibration pass after the folds: static input or KV scales, or GPTQ's walk."""
        return bool(self.calibrated_schemes) or self.kv_cache or self.algorithm.uses_gptq


@dataclass(frozen=True)
class Source:
    """The input as resolved: its tensors (headers), its config.json, the calibration texts (or None)."""

    ckpt: Checkpoint
    config: dict[str, Any]
    texts: list[str] | None
    fp8_input: Fp8BlockInput | None = None  # an FP8 block input, read dequantized


def resolve(job: QuantizeJob) -> Source:
    """Open the input (refusing a quantized one but an FP8 block one: open_source) and the output's
    place; read the calibration texts."""
    ckpt, config, fp8 = open_source(job)
    return Source(ckpt, config, load_texts(job.calib_data) if job.calibrates else None, fp8)


@dataclass(frozen=True)
class Selection:
    """targets: the Linears quantized ({name: (out, in)}) and their schemes; skipped: the Linear
    modules a reader must leave alone (the checkpoint's ignore list), with reasons; kept: every weight
    left in high precision -> (kind, reason)."""

    lw: LinearWeights
    targets: dict[str, tuple[int, int]]
    skipped: dict[str, str]
    kept: dict[str, tuple[str, str]]
    schemes: dict[str, InferenceScheme]


__all__ = [
    "QuantizeJob",
    "Selection",
    "Source",
    "check_fp8_input_job",
    "check_observer_across_ranks",
    "open_source",
    "read_source_config",
    "resolve",
]
