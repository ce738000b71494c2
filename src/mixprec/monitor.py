"""PrecisionMonitor: what FP8 does to each tensor, and a NaN/inf guard any training loop can attach.

Every `every` steps, for each quantizing layer and tensor role ("input", "weight", "grad_output"), it
records the amax, the scale in use, the saturation rate (share of elements whose |x / scale| exceeds
the format's max, i.e. clipped, by more than block scales clip by their own rounding:
Granularity.clip_headroom, 1 for fp32 scales), the underflow rate (share of non-zero elements that
round to zero)
and a histogram of log2|x / scale| on fixed power-of-two bins around the format's representable range.
Every step it checks the loss and the gradients (and, when asked, every module's output) for NaN/inf,
names the first layer and tensor where one appeared, and tells the loop to skip the step.

It reads layer statistics only through the observer protocol: any module with
`set_precision_observer(fn | None)` calls fn(name, role, tensor_hp, scale, fmt) for each tensor it
quantizes, and `precision_layout()` gives role -> Granularity. No layer class is imported here.
Observers are installed only on statistics steps, so other steps cost the layers nothing.

    monitor = PrecisionMonitor(model, every=100, jsonl_path="precision.jsonl")
    for step in range(steps):
        monitor.begin_step(step)
        loss = model(batch).loss
        loss.backward()
        health = monitor.check_step(loss)
        if health.ok:
            optimizer.step()
        optimizer.zero_grad()
        monitor.end_step()
    monitor.close()
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from mixprec.errors import MixprecError
from mixprec.formats import Format, get_format
from mixprec.ranks import is_main_process
from mixprec.scaling import Granularity, apply_blockwise, as_2d

ROLES = ("input", "weight", "grad_output")
# 2: `saturated` leaves out what block scales clip by their own rounding (Granularity.clip_headroom)
MONITOR_SCHEMA_VERSION = 2
# histogram edges reach this many octaves below the smallest subnormal and above the max, so the
# part of a distribution that underflows or saturates stays visible
_HIST_MARGIN_BELOW = 8
_HIST_MARGIN_ABOVE = 4


@dataclass(frozen=True)
class BadTensor:
    """Where a NaN/inf was first seen in a step."""

    step: int
    layer: str  # qualified module name, "" for the loss
    tensor: str  # "loss", "output", "input", "weight", "grad_output", "<param>.grad"
    kind: str  # "nan" or "inf"

    def describe(self) -> str:
        where = f"{self.layer}." if self.layer else ""
        return f"step {self.step}: {self.kind} in {where}{self.tensor}"


@dataclass(frozen=True)
class StepHealth:
    ok: bool
    step: int
    first_bad: BadTensor | None = None


@dataclass
class TensorStats:
    """Statistics of one (layer, role) at one step; counts are merged when a role is seen twice."""

    step: int
    layer: str
    role: str
    fmt: str
    granularity: str
    amax: float
    scale_min: float
    scale_max: float
    numel: int
    nonzero: int
    saturated: int
    underflowed: int
    hist_edges_log2: tuple[int, int]  # [lo, hi) in log2 units, cut into hist_bins_per_octave bins per octave
    hist: list[int]  # [below lo, the bins of [lo, hi) ..., at/above hi]
    hist_bins_per_octave: int
    range_log2: tuple[float, float]  # the format's representable magnitudes: log2(min_subnormal), log2(max)

    @property
    def saturation(self) -> float:
        return self.saturated / self.numel if self.numel else 0.0

    @property
    def underflow(self) -> float:
        return self.underflowed / self.nonzero if self.nonzero else 0.0

    def to_record(self) -> dict:
        d = asdict(self)
        d["saturation"] = self.saturation
        d["underflow"] = self.underflow
        d["hist_edges_log2"] = list(self.hist_edges_log2)
        d["range_log2"] = list(self.range_log2)
        return d


def _hist_edges(fmt: Format) -> tuple[int, int]:
    lo = math.floor(math.log2(fmt.min_subnormal)) - _HIST_MARGIN_BELOW
    hi = math.ceil(math.log2(fmt.max)) + _HIST_MARGIN_ABOVE
    return lo, hi


def _granularity_for(layout: Granularity | None, rows: int, cols: int, scale_shape: tuple) -> Granularity:
    """The granularity whose scale grid matches the scale actually used (a layer may re-quantize a
    transposed operand for a backward GEMM; its layout then reads transposed)."""
    candidates = [layout, layout.transposed()] if layout is not None else []
    for g in candidates:
        if g.scale_shape(rows, cols) == tuple(scale_shape):
            return g
    # infer from the grid: a dimension with one scale is whole, otherwise blocks of ceil(n / grid)
    sr, sc = scale_shape if len(scale_shape) == 2 else (1, 1)
    br = None if sr == 1 else math.ceil(rows / sr)
    bc = None if sc == 1 else math.ceil(cols / sc)
    return Granularity(br, bc)


def tensor_stats(
    x: torch.Tensor,
    scale: torch.Tensor,
    fmt: Format,
    granularity: Granularity | None,
    step: int,
    layer: str,
    role: str,
    bins_per_octave: int = 1,
) -> TensorStats:
    """Saturation, underflow and the log2 histogram of x as the format sees it (x / scale)."""
    fmt = get_format(fmt)
    with torch.no_grad():
        x2 = as_2d(x.detach()).float()
        scale = torch.as_tensor(scale, dtype=torch.float32, device=x2.device)
        grid = (
            tuple(scale.shape) if scale.dim() == 2 else ((1, 1) if scale.numel() == 1 else (scale.numel(), 1))
        )
        g = _granularity_for(granularity, *x2.shape, grid)
        scale2 = scale.reshape(g.scale_shape(*x2.shape)) if scale.numel() > 1 else scale.reshape(1, 1)
        finite = torch.isfinite(x2)
        ax = torch.where(finite, x2.abs(), 0.0)
        scaled = apply_blockwise(ax, scale2, g, torch.div)
        nonzero = ax > 0
        # block scales that round down clip a block's maximum a little by construction: not a range problem
        saturated = int((scaled > fmt.max * g.clip_headroom(fmt)).sum()) + int((~finite).sum())
        # round-to-nearest-even sends |v| <= min_subnormal / 2 to zero (the tie goes to the even code, 0)
        underflowed = int((nonzero & (scaled <= fmt.min_subnormal / 2)).sum())
        lo, hi = _hist_edges(fmt)
        mags = scaled[nonzero]
        k = bins_per_octave
        nbins = (hi - lo) * k
        idx = (torch.floor((torch.log2(mags) - lo) * k) + 1).clamp(0, nbins + 1)
        hist = torch.bincount(idx.long(), minlength=nbins + 2).tolist()
        amax = float(ax.max()) if ax.numel() else 0.0
    return TensorStats(
        step=step, layer=layer, role=role, fmt=fmt.name, granularity=g.name, amax=amax,
        scale_min=float(scale.min()), scale_max=float(scale.max()), numel=x2.numel(), nonzero=int(nonzero.sum()),
        saturated=saturated, underflowed=underflowed, hist_edges_log2=(lo, hi), hist=hist, hist_bins_per_octave=k,
        range_log2=(math.log2(fmt.min_subnormal), math.log2(fmt.max)),
    )  # fmt: skip


def _merge(a: TensorStats, b: TensorStats) -> TensorStats:
    if a.hist_edges_log2 != b.hist_edges_log2:  # different formats for one role: keep the first
        return a
    a.amax = max(a.amax, b.amax)
    a.scale_min, a.scale_max = min(a.scale_min, b.scale_min), max(a.scale_max, b.scale_max)
    a.numel += b.numel
    a.nonzero += b.nonzero
    a.saturated += b.saturated
    a.underflowed += b.underflowed
    a.hist = [p + q for p, q in zip(a.hist, b.hist)]
    return a


def _bad_kind(t: torch.Tensor) -> str:
    return "nan" if bool(torch.isnan(t).any()) else "inf"


@dataclass
class PrecisionMonitor:
    """Attach to a model; see the module docstring for the loop it expects."""

    model: torch.nn.Module
    every: int = 100
    histogram_bins: int = 1  # bins per power of two; fixed edges, so histograms line up across steps
    tensorboard_dir: str | os.PathLike | None = None
    jsonl_path: str | os.PathLike | None = None
    watch_activations: bool = False
    check_gradients: bool = True
    # where gradients live: an optimizer with .grad(p) (mixprec.AdamW keeps the gradients of bf16
    # parameters in fp32 buffers, p.grad is None) — or None for p.grad
    optimizer: Any = None
    records: list[dict] = field(default_factory=list, repr=False)  # precision records, in memory
    nan_events: list[BadTensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.every < 1 or self.histogram_bins < 1:
            raise ValueError("every and histogram_bins must be >= 1")
        self.layers = {
            name: m
            for name, m in self.model.named_modules()
            if callable(getattr(m, "set_precision_observer", None))
        }
        self._layouts = {name: self._layout(m) for name, m in self.layers.items()}
        self.step = 0
        self._armed = False
        self._pending: dict[tuple[str, str], TensorStats] = {}
        self._first_activation: BadTensor | None = None
        self._hooks: list[Any] = []
        self._jsonl = None
        self._tb = None
        self._main = is_main_process()
        self._params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        if self.watch_activations:
            self._install_activation_hooks()

    @staticmethod
    def _layout(module) -> dict:
        fn = getattr(module, "precision_layout", None)
        try:
            return dict(fn()) if callable(fn) else {}
        except Exception:  # a layer without a layout still reports; its granularity is inferred
            return {}

    # -- statistics (every N steps) ------------------------------------------------------------------
    def is_stats_step(self, step: int | None = None) -> bool:
        return (self.step if step is None else step) % self.every == 0

    def begin_step(self, step: int | None = None) -> None:
        """Call before the forward: arms the observers on statistics steps, disarms them otherwise."""
        self.step = self.step if step is None else int(step)
        self._first_activation = None
        arm = self.is_stats_step() and bool(self.layers)
        if arm != self._armed:
            for name, module in self.layers.items():
                module.set_precision_observer(self._observer_for(name) if arm else None)
            self._armed = arm

    def _observer_for(self, qualified: str):
        layout = self._layouts.get(qualified, {})

        def observe(_name, role, tensor_hp, scale, fmt) -> None:
            if not self._armed:
                return
            st = tensor_stats(
                tensor_hp, scale, fmt, layout.get(role), self.step, qualified, role, self.histogram_bins
            )
            key = (qualified, role)
            self._pending[key] = _merge(self._pending[key], st) if key in self._pending else st
            if (
                self.watch_activations
                and self._first_activation is None
                and not bool(torch.isfinite(tensor_hp).all())
            ):
                self._first_activation = BadTensor(self.step, qualified, role, _bad_kind(tensor_hp))

        return observe

    def end_step(self) -> list[dict]:
        """Call after the optimizer step: writes this step's statistics; returns their records."""
        if self._armed:  # disarm: forwards outside the step (evaluation) are not this step's statistics
            for module in self.layers.values():
                module.set_precision_observer(None)
            self._armed = False
        out = [s.to_record() for s in self._pending.values()]
        self._pending.clear()
        if out:
            self.records.extend(out)
            self._write(out)
        self.step += 1
        return out

    # -- NaN / inf guard (every step) ----------------------------------------------------------------
    def _install_activation_hooks(self) -> None:
        def hook_for(name: str):
            def hook(_module, _inputs, output) -> None:
                if self._first_activation is not None:
                    return
                t = output[0] if isinstance(output, (tuple, list)) else getattr(output, "logits", output)
                if (
                    isinstance(t, torch.Tensor)
                    and t.is_floating_point()
                    and not bool(torch.isfinite(t).all())
                ):
                    self._first_activation = BadTensor(self.step, name, "output", _bad_kind(t))

            return hook

        for name, module in self.model.named_modules():
            if name and not any(True for _ in module.children()):  # leaves, in forward order of registration
                self._hooks.append(module.register_forward_hook(hook_for(name)))

    def check_step(
        self, loss: torch.Tensor | float | None = None, grad_norm: torch.Tensor | float | None = None
    ) -> StepHealth:
        """After backward: is this step's loss, every gradient (and activation, when watched) finite?
        On failure, names the first bad tensor: an activation in forward order, else the loss, else the
        first gradient in backward order (parameters in reverse registration order).

        grad_norm: the total norm of this step's gradients when the loop has computed it already
        (before clipping changed them): a finite total norm means every gradient is finite, so the guard
        then costs no pass over the gradients at all."""
        bad = self._first_activation
        loss_t = None if loss is None else torch.as_tensor(loss).detach()
        if self.check_gradients and grad_norm is None:
            grad_norm = self._total_gradient_norm()
        # one host sync for the loss and the gradients together
        checks = [] if loss_t is None else [loss_t.reshape(-1).float()]
        if grad_norm is not None:
            device = checks[0].device if checks else None
            checks.append(torch.as_tensor(grad_norm, dtype=torch.float32, device=device).reshape(-1))
        all_finite = bool(torch.isfinite(torch.cat(checks)).all()) if checks else True
        if bad is None and loss_t is not None and not all_finite and not bool(torch.isfinite(loss_t).all()):
            bad = BadTensor(self.step, "", "loss", _bad_kind(loss_t))
        if bad is None and self.check_gradients and not all_finite:
            bad = self._first_bad_gradient()
        if bad is not None:
            self.nan_events.append(bad)
            self._write(
                [
                    {
                        "kind": "nan_event",
                        "step": bad.step,
                        "layer": bad.layer,
                        "tensor": bad.tensor,
                        "type": bad.kind,
                    }
                ]
            )
        return StepHealth(ok=bad is None, step=self.step, first_bad=bad)

    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        getter = getattr(self.optimizer, "grad", None)
        return getter(p) if callable(getter) else p.grad

    def _gradients(self) -> list[torch.Tensor]:
        getter = getattr(self.optimizer, "grad", None)
        if callable(getter):
            return [g for _, p in self._params if (g := getter(p)) is not None]
        return [p.grad for _, p in self._params if p.grad is not None]

    def _total_gradient_norm(self) -> torch.Tensor | None:
        """One fused norm over every gradient (fp32 buffers or .grad), summed into one number: finite
        exactly when every gradient is (a square that overflows fp32, |g| > 1.8e19, counts as bad)."""
        grads = self._gradients()
        if not grads:
            return None
        return torch.stack(torch._foreach_norm(grads)).float().sum()

    def _first_bad_gradient(self) -> BadTensor | None:
        """The per-tensor scan, run only once the total says something is not finite."""
        named = [(n, g) for n, p in self._params if (g := self._grad(p)) is not None]
        for name, g in reversed(named):
            if not bool(torch.isfinite(g).all()):
                layer, _, leaf = name.rpartition(".")
                return BadTensor(self.step, layer, f"{leaf}.grad", _bad_kind(g))
        return None

    # -- output ----------------------------------------------------------------------------------------
    def _write(self, rows: list[dict]) -> None:
        if not self._main:
            return
        if self.jsonl_path is not None:
            if self._jsonl is None:
                Path(self.jsonl_path).parent.mkdir(parents=True, exist_ok=True)
                self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")  # noqa: SIM115 (kept open across steps)
            for r in rows:
                self._jsonl.write(
                    json.dumps({"schema_version": MONITOR_SCHEMA_VERSION, "kind": "precision", **r}) + "\n"
                )
            self._jsonl.flush()
        if self.tensorboard_dir is not None:
            self._write_tensorboard(rows)

    def _write_tensorboard(self, rows: list[dict]) -> None:
        if self._tb is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise MixprecError(
                    "tensorboard_dir needs the 'report' extra: pip install 'mixprec[report]'"
                ) from None
            self._tb = SummaryWriter(str(self.tensorboard_dir))
        for r in rows:
            if r.get("kind") == "nan_event":
                bad = BadTensor(r["step"], r["layer"], r["tensor"], r["type"])
                self._tb.add_text("nan_events", bad.describe(), r["step"])
                continue
            tag = f"{r['layer']}/{r['role']}"
            for key in ("amax", "saturation", "underflow", "scale_max"):
                self._tb.add_scalar(f"{tag}/{key}", r[key], r["step"])
            lo, _ = r["hist_edges_log2"]
            k = r["hist_bins_per_octave"]
            # the histogram is already binned: hand TensorBoard bin centres repeated by their counts
            centres = torch.tensor([lo + (i - 0.5) / k for i in range(len(r["hist"]))], dtype=torch.float64)
            counts = torch.tensor(r["hist"], dtype=torch.float64)
            if counts.sum() > 0:
                self._tb.add_histogram(
                    f"{tag}/log2_abs_scaled",
                    centres.repeat_interleave(counts.long().clamp(max=10_000)),
                    r["step"],
                )
        self._tb.flush()

    def summary(self) -> dict:
        """Peaks over the run: per role, the largest saturation and underflow with where and when."""
        out: dict[str, Any] = {"nan_events": [asdict(e) for e in self.nan_events]}
        for role in ROLES:
            rows = [r for r in self.records if r["role"] == role]
            if rows:
                sat = max(rows, key=lambda r: r["saturation"])
                und = max(rows, key=lambda r: r["underflow"])
                out[role] = {
                    "max_saturation": sat["saturation"], "max_saturation_at": [sat["step"], sat["layer"]],
                    "max_underflow": und["underflow"], "max_underflow_at": [und["step"], und["layer"]],
                    "max_amax": max(r["amax"] for r in rows),
                }  # fmt: skip
        return out

    def close(self) -> None:
        if self._armed:
            for module in self.layers.values():
                module.set_precision_observer(None)
            self._armed = False
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> PrecisionMonitor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["ROLES", "BadTensor", "PrecisionMonitor", "StepHealth", "TensorStats", "tensor_stats"]
