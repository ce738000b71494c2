"""The calibration run: text data -> token batches -> a forward pass with hooks on Linear inputs (and on the
attention's key/value states for an FP8 KV cache) -> per-layer activation amax, through an observer.

The data come from calibration/data.py, the observers (max, percentile, mse) from observers.py.

When to stop (StopRule): calibration runs batch after batch until, for every observer, the inputs of
the last `window` batches carried at most `tolerance` of their energy above the amax held before each
batch (what stopping earlier would have clipped), once at least `min_tokens` tokens have been seen
(rare outlier tokens arrive late: a short run can look settled before one shows), or until the batches
run out (the cap, `--calib-samples`). The amax itself is not the test: a `max` observer's amax is a
sample maximum, and on heavy-tailed activations it keeps growing with the number of tokens (measured on
SmolLM2-135M: some of 210 amaxes still grew by more than 2 % every 4 batches after 31 batches) while
the share of the signal it would clip is already negligible. The result says how many samples it used
and why it stopped (CalibrationRun).

Compute: on a CPU without AVX-512-BF16 / AMX the forward's bf16/fp16 GEMMs run in fp32 and are rounded
once to the model's dtype (mixprec.kernels.bf16_cpu.gemms_in_fp32, the path training uses): a native
bf16 matmul is several times slower there. The observers still see the model's dtype: each Linear input
is what a bf16 GEMM (fp32 accumulation, one rounding) produces, as on a GPU, up to the order of the fp32
sums (docs/quantize.md, "Calibration compute").
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec.errors import MixprecError
from mixprec.inference.calibration.attention import route_attention
from mixprec.inference.calibration.observers import MaxObserver, Observer, make_observer
from mixprec.kernels.bf16_cpu import gemms_in_fp32

# ---------------------------------------------------------------------------------------------------
# Running the model


def kv_attention_patch(model: nn.Module, kv_observers: dict[int, tuple[Observer, Observer]]):
    """Route attention through a wrapper that observes key/value states as the attention sees them
    (after RoPE): what an FP8 KV cache stores. Returns an undo function, or None if unsupported."""

    def wrap(inner):
        def observed(module, query, key, value, *args, **kwargs):
            idx = getattr(module, "layer_idx", None)
            if idx is not None:
                ko, vo = kv_observers.setdefault(idx, (MaxObserver(), MaxObserver()))
                ko.observe(key)
                vo.observe(value)
            return inner(module, query, key, value, *args, **kwargs)

        return observed

    return route_attention(model, "mixprec_kv_calibration", wrap)


# ---------------------------------------------------------------------------------------------------
# When to stop

# Defaults (docs/quantize.md, "When calibration stops", has the measurement on SmolLM2-135M). 1e-5 of
# the inputs' energy is -50 dB: under 2 % of the energy of E4M3's own rounding noise (about -32 dB for
# values spread over the normal range: a relative step of 2^-3, uniform error ulp^2/12), so what a
# scale fixed one window earlier would have clipped is small beside what FP8 costs anyway. 4 batches
# of 4 sequences; at least 32 sequences of 512 tokens before the first chance to stop.
DEFAULT_TOLERANCE = 1e-5
DEFAULT_WINDOW = 4
DEFAULT_MIN_TOKENS = 16384


@dataclass(frozen=True)
class StopRule:
    """Stop once, for every observer, the inputs of the last `window` batches carried at most
    `tolerance` of their energy (sum of x^2) above the amax held before each batch, and at least
    `min_tokens` tokens were seen. tolerance=0 never stops early (every batch runs: the cap decides)."""

    tolerance: float = DEFAULT_TOLERANCE
    window: int = DEFAULT_WINDOW
    min_tokens: int = DEFAULT_MIN_TOKENS

    def __post_init__(self) -> None:
        if not (
            isinstance(self.tolerance, (int, float))
            and math.isfinite(self.tolerance)
            and 0 <= self.tolerance < 1
        ):
            raise MixprecError(
                f"--calib-tolerance must be a share of the inputs' energy in [0, 1), got {self.tolerance!r}"
            )
        if not isinstance(self.window, int) or self.window < 1:
            raise MixprecError(f"--calib-window must be a positive number of batches, got {self.window!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise MixprecError(f"--calib-min-tokens must be a whole number >= 0, got {self.min_tokens!r}")


NEVER_STOP_EARLY = StopRule(tolerance=0.0, window=1, min_tokens=0)


@dataclass
class CalibrationRun:
    """What a calibration ran and why it stopped (the quantize report's and scales file's `calibration`)."""

    samples: int  # sequences run through the model
    tokens: int
    batches: int
    samples_available: int  # the cap: sequences that were ready to run
    stopped: str  # "converged" | "cap" (every available batch ran)
    reason: str  # the same in words, with the figures
    clipped: float | None  # largest share of an observer's window energy above its earlier amax, at the stop
    max_change: float | None  # largest relative amax change over the last window when it stopped
    seconds: float
    clipped_by_batch: list = field(default_factory=list)  # `clipped` after every batch (None: too early)
    max_change_by_batch: list = field(default_factory=list)  # the same for `max_change`
    rule: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _finite_or_none(v: float | None, digits: int) -> float | None:
    return None if v is None or not math.isfinite(v) else float(f"{v:.{digits}g}")


class _Convergence:
    """The stop rule applied to a stream of per-batch observer readings."""

    def __init__(self, rule: StopRule, observers: Callable[[], list[Observer]]):
        self.rule, self.observers = rule, observers
        self.amax: deque[torch.Tensor] = deque(maxlen=rule.window + 1)
        # per batch: [observer, (clipped energy, energy)]
        self.clips: deque[torch.Tensor] = deque(maxlen=rule.window)
        self.tokens = 0
        self.clipped: float | None = None
        self.max_change: float | None = None
        self.clipped_trace: list[float | None] = []
        self.change_trace: list[float | None] = []

    def after_batch(self, tokens: int) -> bool:
        """Record the batch; True when calibration may stop."""
        self.tokens += tokens
        watched = self.observers()
        now = torch.tensor([o.tracked() for o in watched], dtype=torch.float64)
        self.amax.append(now)
        self.clips.append(
            torch.tensor([o.take_energies() for o in watched], dtype=torch.float64).reshape(-1, 2)
        )
        then = self.amax[0]
        same_observers = then.shape == now.shape and all(len(c) == len(now) for c in self.clips)
        # too early, or observers still appearing (e.g. KV states of later layers)
        if len(self.amax) <= self.rule.window or now.numel() == 0 or not same_observers:
            self.clipped_trace.append(None)
            self.change_trace.append(None)
            return False
        window = torch.stack(list(self.clips)).sum(0)
        share = torch.where(window[:, 1] > 0, window[:, 0] / window[:, 1].clamp_min(1e-300), 0.0)
        # an observer that has seen nothing yet (amax 0) has not settled: an unrouted MoE expert keeps running
        share = torch.where(now > 0, share, torch.inf)
        change = torch.where(now > 0, (now - then).abs() / now.clamp_min(1e-30), torch.inf)
        self.clipped, self.max_change = float(share.max()), float(change.max())
        self.clipped_trace.append(_finite_or_none(self.clipped, 4))
        self.change_trace.append(_finite_or_none(self.max_change, 6))
        return (
            self.rule.tolerance > 0
            and self.tokens >= self.rule.min_tokens
            and self.clipped <= self.rule.tolerance
        )


def _batch_tokens(b: Any) -> tuple[int, int]:
    """(samples, tokens) of one batch: token ids [batch, seq] are `batch` samples of `seq` tokens; a
    float input [..., features] has one token per leading position (samples: its first dimension)."""
    if isinstance(b, dict):
        x = b.get("input_ids", next(iter(b.values()), None))
    elif isinstance(b, (list, tuple)):
        x = b[0] if b else None
    else:
        x = b
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return 1, 1
    if not x.is_floating_point():
        return (x.shape[0] if x.dim() > 1 else 1), x.numel()
    lead = x.shape[:-1]
    return (lead[0] if lead else 1), max(1, math.prod(lead))


def _run(
    model: nn.Module,
    batches: Iterable[Any],
    rule: StopRule,
    observers: Callable[[], list[Observer]],
    progress: Any = None,
) -> CalibrationRun:
    started = time.perf_counter()
    batches = list(batches) if not isinstance(batches, Sequence) else batches
    available = sum(_batch_tokens(b)[0] for b in batches)
    conv = _Convergence(rule, observers)
    samples = done = 0
    stopped = "cap"
    with torch.no_grad(), gemms_in_fp32(model):
        for b in batches:
            if isinstance(b, dict):
                model(**b)
            elif isinstance(b, torch.Tensor):
                model(input_ids=b) if b.dtype == torch.long else model(b)
            elif isinstance(b, (list, tuple)):
                model(*b)
            else:
                raise MixprecError(
                    f"calibration batches must be tensors, dicts or tuples, got {type(b).__name__}"
                )
            rows, tokens = _batch_tokens(b)
            samples, done = samples + rows, done + 1
            if progress is not None:
                progress()
            if conv.after_batch(tokens):
                stopped = "converged"
                break
    clipped = "n/a" if conv.clipped is None else f"{conv.clipped:.2g}"
    change = "n/a" if conv.max_change is None else f"{conv.max_change:.2%}"
    if stopped == "converged":
        reason = (
            f"converged: over the last {rule.window} batches no input carried more than {rule.tolerance:.2g} of "
            f"its energy above the amax held before (largest {clipped}) after {conv.tokens} tokens (at least "
            f"{rule.min_tokens}); the largest amax still moved {change} over those batches"
        )
    else:
        reason = (
            f"cap: every available sample ran ({samples}; --calib-samples and the text bound it); over the last "
            f"{rule.window} batches the largest share of an input's energy above its earlier amax was {clipped} "
            f"(tolerance {rule.tolerance:.2g}), the largest amax change {change}"
        )
    return CalibrationRun(
        samples=samples, tokens=conv.tokens, batches=done, samples_available=available, stopped=stopped,
        reason=reason, clipped=_finite_or_none(conv.clipped, 4), max_change=_finite_or_none(conv.max_change, 6),
        seconds=round(time.perf_counter() - started, 3), rule=asdict(rule),
        clipped_by_batch=conv.clipped_trace, max_change_by_batch=conv.change_trace,
    )  # fmt: skip


class NothingObserved(MixprecError):
    """Calibration saw no nonzero input for a Linear; `module` names it (its path in the model)."""

    def __init__(self, module: str):
        super().__init__(
            f"calibration never saw a nonzero input for {module!r}; is the calibration data empty?"
        )
        self.module = module


def check_observed(amax: Mapping[str, float], may_be_unseen: Collection[str] = ()) -> None:
    """Raise NothingObserved for the first Linear that saw no nonzero input, unless it may (an expert)."""
    for n, a in amax.items():
        if a == 0 and n not in may_be_unseen:
            raise NothingObserved(n)


def unseen_take_group_max(
    amax: Mapping[str, float], group_of: Mapping[str, str]
) -> tuple[dict[str, float], list[str]]:
    """(amax with each Linear of `group_of` that saw nothing (amax 0) given the largest amax of its group,
    those Linears). For MoE experts the group is the layer's fused parameter (gate/up or down): vLLM
    serves a static FP8 MoE layer with the largest input scale of its experts anyway. A group none of
    whose Linears saw anything is a MixprecError."""
    unseen = [n for n, a in amax.items() if a == 0 and n in group_of]
    if not unseen:
        return dict(amax), []
    largest: dict[str, float] = {}
    for n, a in amax.items():
        if n in group_of:
            largest[group_of[n]] = max(largest.get(group_of[n], 0.0), a)
    out = dict(amax)
    for n in unseen:
        out[n] = largest[group_of[n]]
        if out[n] == 0:
            raise MixprecError(
                f"calibration routed no token to any expert of {group_of[n]!r} (e.g. {n!r}): use more "
                "calibration samples, or keep them in high precision (ignore)"
            )
    return out, unseen


def unseen_experts_warning(unseen: Sequence[str]) -> str:
    """What a run says of the expert weights unseen_take_group_max gave their layer's largest amax."""
    shown = ", ".join(repr(n) for n in unseen[:3]) + (
        f" and {len(unseen) - 3} more" if len(unseen) > 3 else ""
    )
    return (
        f"calibration routed no token to {len(unseen)} MoE expert weight(s) ({shown}): each takes the largest "
        "input scale of its layer's other experts (what vLLM serves a static FP8 MoE layer with); more "
        "calibration samples would calibrate them on their own tokens"
    )


@dataclass
class CalibrationResult:
    input_amax: dict[str, float]  # Linear name -> input amax
    kv_amax: dict[int, tuple[float, float]]  # layer index -> (key amax, value amax)
    run: CalibrationRun


def calibrate(
    model: nn.Module,
    batches: Iterable[Any],
    linear_names: Sequence[str],
    *,
    observer: str = "max",
    kv_cache: bool = False,
    stop: StopRule | None = None,
    progress: Any = None,
    may_be_unseen: Collection[str] = (),
) -> CalibrationResult:
    """Run `batches` through `model` until the stop rule holds (default StopRule()) or they run out:
    the observed amax of every Linear's input (and of keys and values with kv_cache), and the run.
    may_be_unseen: Linears whose amax may stay 0 (MoE experts the router never picked); any other
    Linear that saw nothing raises NothingObserved."""
    rule = StopRule() if stop is None else stop
    modules = dict(model.named_modules())
    observers: dict[str, Observer] = {n: make_observer(observer) for n in linear_names}
    handles = []
    for n in linear_names:

        def hook(_mod, args, _obs=observers[n]):
            if args and isinstance(args[0], torch.Tensor):
                _obs.observe(args[0])

        handles.append(modules[n].register_forward_pre_hook(hook))
    kv_obs: dict[int, tuple[Observer, Observer]] = {}
    undo = None
    if kv_cache:
        undo = kv_attention_patch(model, kv_obs)
        if undo is None:
            raise MixprecError(
                "--kv-cache fp8 needs a transformers attention model (key/value states to observe)"
            )

    def watched() -> list[Observer]:
        return [*observers.values(), *(o for pair in kv_obs.values() for o in pair)]

    was_training = model.training
    model.eval()
    try:
        run = _run(model, batches, rule, watched, progress)
    finally:
        for h in handles:
            h.remove()
        if undo is not None:
            undo()
        model.train(was_training)
    amax = {n: o.amax() for n, o in observers.items()}
    check_observed(amax, may_be_unseen)
    kv_amax = {i: (k.amax(), v.amax()) for i, (k, v) in sorted(kv_obs.items())}
    return CalibrationResult(amax, kv_amax, run)
