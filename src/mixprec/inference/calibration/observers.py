"""Observers: what amax a static scale is built from (calibration/run.py drives them).

  max         the largest |x| seen (default; nothing saturates on the calibration data)
  percentile  the mean over batches of the 99.99th percentile of |x| (clips rare outliers)
  mse         the clipping threshold, among fractions of the max, that minimises the mean squared
              FP8 quantization error over a bounded sample of the inputs (plus their largest values)

Each observer also accounts, batch by batch, the energy an amax fixed before the batch would have
clipped: what the stop rule (calibration/run.py, StopRule) reads.
"""

from __future__ import annotations

import math

import torch

from mixprec.errors import MixprecError
from mixprec.formats import E4M3
from mixprec.quantization import fake_quantize
from mixprec.scaling import Granularity, as_2d, block_amax, compute_scale

OBSERVERS = ("max", "percentile", "mse")


class Observer:
    # what the stop rule reads after each batch (and resets): the squared excess of this batch's |x| over
    # the amax held before it, beyond what the amax after it still clips; and the batch's energy sum x^2
    clipped_energy = 0.0
    energy = 0.0

    def update(self, x: torch.Tensor) -> None:
        raise NotImplementedError

    def observe(self, x: torch.Tensor) -> None:
        """update(x), and account what an amax fixed before this call would have clipped of x."""
        before = self.tracked()
        self.update(x)
        x = x.detach()
        if x.numel() == 0:
            return
        energy = float(torch.linalg.vector_norm(x, dtype=torch.float32)) ** 2
        if not math.isfinite(energy):  # inf/nan entries are not signal (the observers skip them too)
            x = torch.nan_to_num(x.float(), nan=0.0, posinf=0.0, neginf=0.0)
            energy = float(x.square().sum())
        self.energy += energy
        after = self.tracked()
        # an amax that did not grow clips nothing this one does not (a max observer: most batches)
        if after > before:
            a = x.float().abs()  # finite here: the non-finite case was replaced above
            self.clipped_energy += max(0.0, _excess(a, before) - _excess(a, after))

    def take_energies(self) -> tuple[float, float]:
        """(clipped energy, energy) since the last call."""
        out = (self.clipped_energy, self.energy)
        self.clipped_energy = self.energy = 0.0
        return out

    def amax(self) -> float:
        raise NotImplementedError

    def tracked(self) -> float:
        """The value the stop rule watches after every batch: the amax, where that is cheap."""
        return self.amax()


def _excess(a: torch.Tensor, threshold: float) -> float:
    """Sum of (a - threshold)^2 over the entries of a above threshold: the squared error of saturating them."""
    return float((a - threshold).clamp_min_(0.0).square().sum())


class MaxObserver(Observer):
    def __init__(self) -> None:
        self._max = 0.0

    def update(self, x: torch.Tensor) -> None:
        # max |x| over the finite entries: one min/max pass, the masked one only where inf/NaN is there.
        # (Boolean indexing, x[isfinite(x)], copied the entries first: 25 ms for a [2048, 576] bf16 input
        # against 0.1 ms, which made the observers most of a static scheme's calibration.)
        x = x.detach()
        if x.numel():
            self._max = max(self._max, float(block_amax(as_2d(x), Granularity.tensor())))

    def amax(self) -> float:
        return self._max


class PercentileObserver(MaxObserver):
    def __init__(self, percentile: float = 99.99, max_elements: int = 1 << 22) -> None:
        super().__init__()
        self.q = percentile / 100.0
        self.max_elements = max_elements
        self._values: list[float] = []

    def update(self, x: torch.Tensor) -> None:
        super().update(x)
        a = x.detach().float().abs().flatten()
        if a.numel() > self.max_elements:  # a strided subset keeps torch.quantile within its size limit
            a = a[:: math.ceil(a.numel() / self.max_elements)]
        self._values.append(float(torch.quantile(a, self.q)))

    def amax(self) -> float:
        return min(self._max, sum(self._values) / len(self._values)) if self._values else 0.0


class MseObserver(MaxObserver):
    def __init__(self, sample_per_batch: int = 4096, top_per_batch: int = 128, grid: int = 32) -> None:
        super().__init__()
        self.sample_per_batch, self.top_per_batch, self.grid = sample_per_batch, top_per_batch, grid
        self._samples: list[torch.Tensor] = []
        self._gen = torch.Generator().manual_seed(0)

    def update(self, x: torch.Tensor) -> None:
        super().update(x)
        v = x.detach().float().flatten()
        v = v[torch.isfinite(v)]
        if v.numel() == 0:
            return
        idx = torch.randint(v.numel(), (min(self.sample_per_batch, v.numel()),), generator=self._gen)
        top = v.abs().topk(min(self.top_per_batch, v.numel())).indices
        self._samples.append(torch.cat([v[idx], v[top]]))

    def tracked(self) -> float:
        # its amax is a fraction of the running max chosen by a search over every sample kept so far:
        # too dear to run after each batch, and the candidates it picks from move with the max
        return self._max

    def amax(self) -> float:
        if not self._samples or self._max == 0:
            return self._max
        sample = torch.cat(self._samples)
        best, best_err = self._max, math.inf
        for i in range(self.grid):
            clip = self._max * (0.3 + 0.7 * (i + 1) / self.grid)
            q = fake_quantize(
                sample, E4M3, Granularity.tensor(), scale=compute_scale(clip, E4M3).reshape(1, 1)
            )
            err = float((sample - q).pow(2).mean())
            if err < best_err:
                best, best_err = clip, err
        return best


def make_observer(name: str) -> Observer:
    key = name.strip().lower()
    if key == "max":
        return MaxObserver()
    if key == "percentile":
        return PercentileObserver()
    if key == "mse":
        return MseObserver()
    raise MixprecError(f"unknown observer {name!r}; known: {', '.join(OBSERVERS)}")
