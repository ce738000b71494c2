"""`--scheme auto`: score every Linear for every scheme, choose one scheme per fused group under a
budget, write one mixed-precision checkpoint.

    result = auto_quantize_checkpoint("smol-hf", "smol-auto", budget="10", calib_data="calib.txt")
    result.allocation.layers                       # {Linear: scheme}
    report = mixprec.quantize_model_(model, "auto", budget="10", calib_data=batches)   # online

The scores (sensitivity.scores; block by block where that applies, sensitivity.layerwise_scores) are
written beside the checkpoint (auto_scores.json, schema docs/schemas/auto.md) with the fingerprint of
what they were computed from (scores_cache.py): given back with `scores=`, they are reused when the
fingerprint matches, so a new budget costs a solve and a write, not a scoring run. The choice across
budgets (the curve, the perplexity target's bisection) is budget_search.py.

Measured perplexity (the budget curve's measured points, `target_ppl_increase`) needs an evaluation
of a written checkpoint; the evaluation workflow sits on a floor above this package, so the caller
passes it in as `measure(checkpoint_dir) -> {"reference_perplexity", "candidate_perplexity", ...}`
(`mixprec quantize` passes `mixprec evaluate`'s language-model task).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.conversion import ConversionReport
from mixprec.errors import MixprecError
from mixprec.hf import config_dtype, load_model, load_tokenizer, read_config
from mixprec.inference.algorithms.spec import AlgorithmSpec
from mixprec.inference.calibration.data import load_texts, token_batches
from mixprec.inference.checkpoint.safetensors_io import open_checkpoint
from mixprec.inference.producers.quantize import quantize_checkpoint
from mixprec.inference.producers.quantize_calibration import available_memory
from mixprec.inference.runtime.online import apply_scheme_ as quantize_one_scheme
from mixprec.inference.schemes import InferenceScheme
from mixprec.progress import ProgressBars
from mixprec.select import REGEX_PREFIX
from mixprec.sensitivity.algorithm_candidates import (
    check_auto_algorithm,
    rounded_candidates,
    rounded_candidates_on_checkpoint,
)
from mixprec.sensitivity.allocation import Allocation, Budget, allocate
from mixprec.sensitivity.budget_search import (
    Measure,
    budget_curve,
    count_schemes,
    search_budget,
    uniform_table,
)
from mixprec.sensitivity.layerwise_scores import ScoringSkeleton, layerwise_gradient_scores, scoring_skeleton
from mixprec.sensitivity.scores import (
    KEPT,
    Scores,
    candidate_schemes,
    scorable_linears,
    score_model,
    scores_of,
)
from mixprec.sensitivity.scores_cache import (
    SCORES_NAME,
    data_fingerprint,
    fingerprint,
    model_fingerprint,
    read_scores,
    write_scores,
)

AUTO = "auto"


# ---------------------------------------------------------------------------------------------------
# The result


@dataclass
class AutoResult:
    """What `--scheme auto` chose and why; `to_dict` is auto_report.json (docs/schemas/auto.md)."""

    scores: Scores
    budget: Budget | None
    allocation: Allocation
    dtype_bits: int
    curve: list[dict[str, Any]]  # predicted (and measured, where run) points against bits per weight
    uniform: dict[str, dict[str, Any]]  # each candidate alone, for comparison
    scores_reused: bool = False
    measured: dict[str, Any] | None = None  # the chosen checkpoint's perplexity
    search: list[dict[str, Any]] = field(default_factory=list)  # target_ppl_increase's evaluations
    target_ppl_increase: float | None = None
    report: ConversionReport | None = None
    output: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        alloc = self.allocation
        return {
            "schema_version": REPORT_SCHEMA_VERSION,
            "output": self.output,
            "method": self.scores.method,
            "candidates": list(self.scores.candidates),
            "budget": None if self.budget is None else {"bits": self.budget.bits, "bytes": self.budget.bytes},
            "target_ppl_increase": self.target_ppl_increase,
            "scores_reused": self.scores_reused,
            "scoring": {
                "batches": self.scores.batches,
                "tokens": self.scores.tokens,
                "seconds": round(self.scores.seconds, 3),
                "fingerprint": self.scores.fingerprint,
            },
            "chosen": {
                "bits_per_weight": alloc.bits_per_weight,
                "bits": alloc.bits,
                "weights": alloc.weights,
                "predicted_score": alloc.predicted,
                "schemes": count_schemes(alloc.layers.values()),
                "measured": self.measured,
            },
            "layers": {
                n: {
                    "group": g,
                    "shape": list(self.scores.shapes[n]),
                    "chosen": alloc.layers[n],
                    "scores": self.scores.layers[n],
                }
                for g, members in self.scores.groups().items()
                for n in members
            },
            "curve": self.curve,
            "uniform": self.uniform,
            "search": self.search,
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
        }


REPORT_SCHEMA_VERSION = 1


# ---------------------------------------------------------------------------------------------------
# Checkpoints


def _dtype_bits(config: dict) -> int:
    return torch.finfo(config_dtype(config)).bits


def _parse_increase(value: str | float | None) -> float | None:
    if value is None:
        return None
    text = str(value).strip()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(%?)", text)
    if not m:
        raise MixprecError(f"--target-ppl-increase {value!r}: give a relative increase such as 1% or 0.01")
    x = float(m.group(1)) / (100 if m.group(2) else 1)
    if not 0 < x < 10:
        raise MixprecError(f"--target-ppl-increase {value!r} must be above 0")
    return x


def auto_quantize_checkpoint(
    model_dir: str | Path,
    output_dir: str | Path,
    *,
    budget: str | float | Budget | None = None,
    target_ppl_increase: str | float | None = None,
    calib_data: str | Path,
    calib_samples: int = 32,
    calib_seq_len: int = 256,
    candidates: Sequence[str] | None = None,
    score: str = "gradient",
    scores: str | Path | None = None,
    ignore: Sequence[str] | None = None,
    default_ignore: bool = True,
    measure: Measure | None = None,
    search_steps: int = 5,
    force: bool = False,
    progress: bool = True,
    algorithm: str | Sequence[str] | AlgorithmSpec | None = None,
    layer_by_layer: bool | None = None,
    **quantize_kw: Any,
) -> AutoResult:
    """Score, choose under `budget` (or the smallest checkpoint whose measured perplexity increase is
    at most `target_ppl_increase`, by bisection over budgets, `search_steps` evaluations), and write
    the mixed-precision checkpoint to `output_dir` with auto_scores.json beside it.

    scores: a scores file of an earlier run, reused when its fingerprint matches this run's (model
    files, calibration tokens, candidates, method, ignore list), else refused. measure: see the module
    docstring; with it the chosen checkpoint's perplexity is measured. algorithm: "gptq" (or an
    AlgorithmSpec): every candidate is scored with the weights GPTQ gives it (algorithm_candidates.py)
    and the checkpoint is written with GPTQ. layer_by_layer: score one transformer block at a time
    (layerwise_scores.py: memory for one block, not the whole model in fp32 with its backward) and
    calibrate the written checkpoint so; None (default): decide by memory (block by block when the
    model in fp32 exceeds half the available memory, where the walk applies: the gradient score, with or
    without GPTQ, on a model whose logits are its final norm times its head); False: the whole model.
    quantize_kw: passed on to quantize_checkpoint (max_shard_size, observer, ...).
    """
    started = time.perf_counter()
    job = _auto_job(model_dir, output_dir, budget=budget, target_ppl_increase=target_ppl_increase,
                    calib_data=calib_data, calib_samples=calib_samples, calib_seq_len=calib_seq_len,
                    candidates=candidates, score=score, scores=scores, ignore=ignore, default_ignore=default_ignore,
                    measure=measure, search_steps=search_steps, force=force, progress=progress,
                    quantize_kw=quantize_kw, algorithm=algorithm, layer_by_layer=layer_by_layer)  # fmt: skip
    texts = load_texts(calib_data)
    batches = token_batches(texts, load_tokenizer(job.model_dir), calib_samples, calib_seq_len)
    timings: dict[str, float] = {}
    result_scores, reused = _scores(job, batches, timings)
    fixed_bits = _fixed_bits(job, result_scores)
    write = CheckpointWriter(job)
    t0 = time.perf_counter()
    plan, measured, search = _choose(job, result_scores, fixed_bits, write)
    timings["solve_and_search"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    report = write(plan, job.output_dir, job.force)
    timings["write"] = time.perf_counter() - t0
    if job.measure is not None and measured is None:
        t0 = time.perf_counter()
        measured = dict(job.measure(job.output_dir))
        timings["measure"] = time.perf_counter() - t0
    write_scores(job.output_dir / SCORES_NAME, result_scores)
    timings["total"] = time.perf_counter() - started
    result = AutoResult(
        scores=result_scores, budget=job.budget, allocation=plan, dtype_bits=job.dtype_bits,
        curve=budget_curve(result_scores, job.dtype_bits), uniform=uniform_table(result_scores, job.dtype_bits),
        scores_reused=reused, measured=measured, search=search, target_ppl_increase=job.target, report=report,
        output=str(job.output_dir), seconds=timings,
    )  # fmt: skip
    _add_measured_points(result, search, measured)
    return result


@dataclass(frozen=True)
class AutoJob:
    """One `--scheme auto` run with its arguments checked: what the steps of auto_quantize_checkpoint read."""

    model_dir: Path
    output_dir: Path
    config: dict  # the model's config.json
    budget: Budget | None  # exactly one of budget and target
    target: float | None  # the relative perplexity increase allowed
    candidates: tuple[InferenceScheme, ...]
    score: str  # the scoring method
    scores: str | Path | None  # a scores file of an earlier run
    ignore: Sequence[str] | None
    default_ignore: bool
    calib_data: str | Path
    calib_samples: int
    calib_seq_len: int
    measure: Measure | None  # a written checkpoint -> its perplexity figures (see the module docstring)
    search_steps: int  # evaluations of target_ppl_increase's bisection
    force: bool  # replace output_dir
    progress: bool
    quantize_kw: Mapping[str, Any]  # passed on to quantize_checkpoint
    algorithm: AlgorithmSpec  # what rounds the candidates and the checkpoint (empty: round to nearest)
    layer_by_layer: bool | None  # score (and calibrate) block by block; None: where the block walk applies

    @property
    def dtype_bits(self) -> int:
        """The bits of one weight kept in the checkpoint's dtype."""
        return _dtype_bits(self.config)

    @property
    def fingerprint_names(self) -> list[str]:
        """The choices scored: kept, then every candidate."""
        return [KEPT, *(c.name for c in self.candidates)]


def _auto_job(
    model_dir: str | Path,
    output_dir: str | Path,
    *,
    budget: str | float | Budget | None,
    target_ppl_increase: str | float | None,
    measure: Measure | None,
    candidates: Sequence[str] | None,
    force: bool,
    algorithm: str | Sequence[str] | AlgorithmSpec | None,
    **settings: Any,
) -> AutoJob:
    """The arguments checked (MixprecError on the first problem) and the model's config read; `settings`
    are the other fields of AutoJob, as given."""
    if (budget is None) == (target_ppl_increase is None):
        raise MixprecError("--scheme auto needs exactly one of --budget and --target-ppl-increase")
    plan_budget = None if budget is None else (budget if isinstance(budget, Budget) else Budget.parse(budget))
    target = _parse_increase(target_ppl_increase)
    if target is not None and measure is None:
        raise MixprecError("--target-ppl-increase needs evaluation data to measure perplexity (--eval-data)")
    cands = tuple(candidate_schemes(candidates))
    spec = AlgorithmSpec.parse(algorithm)
    check_auto_algorithm(spec, cands)
    model_dir, output_dir = Path(model_dir), Path(output_dir)
    config = read_config(model_dir)
    if "quantization_config" in config:  # an FP8 block input included: its scores need a model forward
        method = (config["quantization_config"] or {}).get("quant_method")
        raise MixprecError(
            f"{model_dir / 'config.json'} has a quantization_config ({method}): --scheme auto scores the layers "
            "with forwards of the model on its weights, which mixprec does not run on a quantized input; "
            "score the bf16 checkpoint, or quantize to one data-free scheme (docs/quantize.md)"
        )
    if output_dir.exists() and not force:
        raise MixprecError(f"output directory {output_dir} exists (use --force to replace it)")
    return AutoJob(
        model_dir, output_dir, config, plan_budget, target, cands, measure=measure, force=force, algorithm=spec,
        **settings,
    )  # fmt: skip


def _scores(job: AutoJob, batches: list[torch.Tensor], timings: dict[str, float]) -> tuple[Scores, bool]:
    """(the scores, whether they came from job.scores): the given file when its fingerprint is this
    run's (else refused), otherwise scored anew."""
    from_file = read_scores(job.scores) if job.scores is not None else None
    t0 = time.perf_counter()
    fp = fingerprint(model_fingerprint(job.model_dir), data_fingerprint(batches), job.fingerprint_names,
                     job.score, list(job.ignore or ()), job.algorithm)  # fmt: skip
    timings["fingerprint"] = time.perf_counter() - t0
    if from_file is not None:
        if from_file.fingerprint != fp:
            differ = [k for k in fp if from_file.fingerprint.get(k) != fp[k]]
            raise MixprecError(
                f"scores file {job.scores} was computed from a different {', '.join(differ)}: "
                "drop --scores to compute them anew"
            )
        return from_file, True
    t0 = time.perf_counter()
    with ProgressBars(job.progress) as bars:
        progress = lambda label, total: bars.add(label, total).advance  # noqa: E731
        skel = _block_by_block(job)
        if skel is not None:
            scored = _score_block_by_block(job, skel, batches, bars, progress)
        else:
            scored = _score_whole_model(job, batches, bars, progress)
    scored.fingerprint = fp
    timings["scoring"] = time.perf_counter() - t0
    return scored, False


def _block_by_block(job: AutoJob) -> ScoringSkeleton | None:
    """The skeleton to score block by block on, or None to score the whole model: layer_by_layer False;
    None and the model fits in memory in fp32 (_whole_model_fits); the kl score (a whole-model scorer),
    or a model the block walk does not take (refused when layer_by_layer is True,
    with the reason)."""
    if job.layer_by_layer is False or (job.layer_by_layer is None and _whole_model_fits(job.model_dir)):
        return None
    why = None
    if job.score != "gradient":
        why = f"the {job.score} score runs on the whole model"
    skel = None
    if why is None:
        skel, why = scoring_skeleton(job.model_dir, job.config, open_checkpoint(job.model_dir), job.ignore,
                                     job.default_ignore)  # fmt: skip
    if why is not None and job.layer_by_layer:
        raise MixprecError(f"--layer-by-layer scoring does not apply here: {why}; pass --no-layer-by-layer")
    return skel


def _whole_model_fits(model_dir: Path) -> bool:
    """Whether the model in fp32 (what the whole-model scorer loads) takes at most half the available
    memory: the rule calibration uses for the checkpoint in its own dtype."""
    ckpt = open_checkpoint(model_dir)
    params = sum(math.prod(info.shape) for info in ckpt.tensors.values())
    return 4 * params <= 0.5 * available_memory()


def _score_block_by_block(job: AutoJob, skel: ScoringSkeleton, batches: list[torch.Tensor], bars: ProgressBars,
                          progress) -> Scores:  # fmt: skip
    """The gradient scores block by block; with GPTQ, each candidate's GPTQ walk first, also block by
    block, its rounded weights on disk beside the output until the scoring ends."""
    started = time.perf_counter()
    ckpt, dtype, spill = open_checkpoint(job.model_dir), config_dtype(job.config), job.output_dir.parent
    rounded: dict = {}
    try:
        if job.algorithm.uses_gptq:
            advance = bars.add("GPTQ, one walk per candidate", len(job.candidates)).advance
            rounded = rounded_candidates_on_checkpoint(job.model_dir, job.config, ckpt, batches, list(skel.names),
                                                       job.candidates, job.algorithm, dtype, spill, advance)  # fmt: skip
        _, raw = layerwise_gradient_scores(skel, ckpt, batches, list(job.candidates), weight_dtype=dtype,
                                           spill_dir=spill, progress=progress, rounded=rounded)  # fmt: skip
    finally:
        for spilled in rounded.values():
            spilled.close()
    return scores_of(job.score, skel.names, job.candidates, raw, batches, time.perf_counter() - started)


def _score_whole_model(job: AutoJob, batches: list[torch.Tensor], bars: ProgressBars, progress) -> Scores:
    model = load_model(job.model_dir, dtype=torch.float32).eval()  # fp32: the CPU has no fast bf16
    rounded = None
    if job.algorithm.uses_gptq:
        names = list(scorable_linears(model, job.ignore, default_ignore=job.default_ignore))
        advance = bars.add("GPTQ, one walk per candidate", len(job.candidates)).advance
        rounded = rounded_candidates(model, batches, names, job.candidates, job.algorithm,
                                     config_dtype(job.config), advance)  # fmt: skip
    return score_model(
        model, batches, list(job.candidates), method=job.score, ignore=job.ignore,
        default_ignore=job.default_ignore, weight_dtype=config_dtype(job.config), progress=progress,
        rounded=rounded,
    )  # fmt: skip


def _fixed_bits(job: AutoJob, scores: Scores) -> int:
    """The checkpoint's bits that no choice changes (everything but the scored Linears' weights)."""
    total_bytes = open_checkpoint(job.model_dir).total_bytes
    return total_bytes * 8 - sum(job.dtype_bits * o * i for o, i in scores.shapes.values())


class CheckpointWriter:
    """Writes one allocation as a mixed-precision checkpoint (quantize_checkpoint with the job's
    calibration and ignore settings; without calibration when no chosen scheme needs it)."""

    def __init__(self, job: AutoJob):
        self.job = job
        self.settings = dict(calib_data=job.calib_data, calib_samples=max(job.calib_samples, 1),
                             calib_seq_len=job.calib_seq_len, ignore=job.ignore, default_ignore=job.default_ignore,
                             progress=job.progress, layer_by_layer=job.layer_by_layer, **job.quantize_kw)  # fmt: skip

    def __call__(self, plan: Allocation, out: Path, replace: bool) -> ConversionReport:
        schemes = plan.schemes()
        if not schemes:
            raise MixprecError(f"the budget keeps every Linear in high precision ({plan.bits_per_weight:.2f} bits "
                               "per weight): there is nothing to quantize; lower it")  # fmt: skip
        needs_calib = self.job.algorithm.needs_data or any(
            InferenceScheme.from_name(s).needs_calibration for s in schemes.values()
        )
        kw = (
            self.settings
            if needs_calib
            else {k: v for k, v in self.settings.items() if not k.startswith("calib")}
        )
        return quantize_checkpoint(
            self.job.model_dir, out, schemes, force=replace, algorithm=self.job.algorithm, **kw
        )


def _choose(
    job: AutoJob, scores: Scores, fixed_bits: int, write: CheckpointWriter
) -> tuple[Allocation, dict[str, Any] | None, list[dict[str, Any]]]:
    """(the allocation, its measurement, the search's evaluations): the exact choice under the budget,
    or the bisection over budgets for target_ppl_increase (which measures as it goes)."""
    if job.budget is not None:
        return allocate(scores, job.budget, dtype_bits=job.dtype_bits, fixed_bits=fixed_bits), None, []
    return search_budget(
        scores, job.dtype_bits, job.target, job.measure, write, job.output_dir, job.search_steps
    )  # type: ignore[arg-type]


def _add_measured_points(result: AutoResult, search: list[dict[str, Any]], measured: dict | None) -> None:
    """The search's evaluations and the chosen checkpoint's measurement are measured points of the curve."""
    for point in search:
        result.curve.append({"budget_bits": point["budget_bits"], "bits_per_weight": point["bits_per_weight"],
                             "predicted_score": point["predicted_score"], "measured": point["measured"]})  # fmt: skip
    if measured is not None:
        plan = result.allocation
        result.curve.append({"budget_bits": None, "bits_per_weight": plan.bits_per_weight,
                             "predicted_score": plan.predicted, "measured": measured, "chosen": True})  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Online: mixprec.quantize_model_(model, "auto", ...)


def _exact(name: str) -> str:
    return f"{REGEX_PREFIX}{re.escape(name)}$"


def quantize_model_(
    model: nn.Module,
    scheme: str | InferenceScheme = "fp8-dynamic",
    ignore: Sequence[str] | None = None,
    calib_data: Any = None,
    *,
    budget: str | float | Budget | None = None,
    candidates: Sequence[str] | None = None,
    score: str = "gradient",
    scores: Scores | None = None,
    **kwargs: Any,
) -> ConversionReport:
    """mixprec.quantize_model_: `scheme="auto"` scores the model's Linears on `calib_data` (token-id
    batches of a causal LM), chooses one scheme per fused group under `budget` and quantizes each in
    place; any other scheme is the inference wing's apply_scheme_ (mixprec.inference.runtime.online) unchanged. The automatic choice is
    `report.auto` (an AutoResult without a checkpoint)."""
    if not (isinstance(scheme, str) and scheme.strip().lower() == AUTO):
        if budget is not None:
            raise MixprecError("budget= is for scheme='auto'")
        return quantize_one_scheme(model, scheme, ignore, calib_data, **kwargs)
    if budget is None:
        raise MixprecError(
            "scheme='auto' needs budget= (average bits per weight such as 6.0, or bytes such as '1.2GB')"
        )
    if AlgorithmSpec.parse(kwargs.get("algorithm")).names:
        raise MixprecError("scheme='auto' with an algorithm writes a checkpoint: auto_quantize_checkpoint(..., "
                           "algorithm='gptq') or `mixprec quantize --scheme auto --algorithm gptq`")  # fmt: skip
    if scores is None:
        if calib_data is None:
            raise MixprecError("scheme='auto' needs calib_data= (batches of token ids) to score the layers")
        batches = [calib_data] if isinstance(calib_data, torch.Tensor) else list(calib_data)
        scores = score_model(model, batches, candidate_schemes(candidates), method=score, ignore=ignore)
    else:
        batches = None
    param = next((p for p in model.parameters()), None)
    dtype_bits = torch.finfo(param.dtype).bits if param is not None else 32
    total_bits = sum(
        t.numel() * t.element_size() * 8 for t in {p.data_ptr(): p for p in model.parameters()}.values()
    )
    fixed = total_bits - sum(dtype_bits * o * i for o, i in scores.shapes.values())
    plan = allocate(scores, budget, dtype_bits=dtype_bits, fixed_bits=fixed)
    by_scheme: dict[str, list[str]] = {}
    for name, s in plan.schemes().items():
        by_scheme.setdefault(s, []).append(name)
    reports = []
    for s, names in by_scheme.items():
        others = [_exact(n) for n in scores.shapes if n not in names]
        reports.append(quantize_one_scheme(model, s, [*(ignore or ()), *others], batches, **kwargs))
    if not reports:  # everything kept
        reports.append(
            quantize_one_scheme(model, "fp8-dynamic", [*(ignore or ()), *map(_exact, scores.shapes)])
        )
    combined = ConversionReport(recipe=AUTO, kind="fp8", device=reports[0].device, param_dtype=reports[0].param_dtype,
                                scheme="mixed-precision")  # fmt: skip
    for r in reports:
        combined.entries += [e for e in r.entries if not e.precision.startswith("skipped")]
        combined.layers.update(r.layers)
        combined.warnings += r.warnings
        combined.notes += r.notes
        combined.calibration = combined.calibration or r.calibration
    combined.entries += [e for e in reports[-1].entries if e.precision.startswith("skipped")]
    combined.weight_bytes_before = reports[0].weight_bytes_before
    combined.weight_bytes_after = reports[-1].weight_bytes_after
    combined.auto = AutoResult(  # type: ignore[attr-defined]
        scores=scores, budget=budget if isinstance(budget, Budget) else Budget.parse(budget), allocation=plan,
        dtype_bits=dtype_bits, curve=budget_curve(scores, dtype_bits), uniform=uniform_table(scores, dtype_bits),
    )  # fmt: skip
    model.mixprec_report = combined
    return combined


__all__ = [
    "AUTO",
    "REPORT_SCHEMA_VERSION",
    "SCORES_NAME",
    "AutoResult",
    "auto_quantize_checkpoint",
    "budget_curve",
    "data_fingerprint",
    "model_fingerprint",
    "quantize_model_",
    "read_scores",
]
