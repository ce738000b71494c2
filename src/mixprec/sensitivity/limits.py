"""The limits a tensor's FP8 statistics are judged against: one home for compare, profile and policy.

saturation: the largest share of a tensor's elements that may be clipped at the format's max
(|x / scale| > max beyond the block scales' own rounding), as a peak over steps (compare) or passes (profile). underflow: the largest share
of its non-zero elements that may round to zero. Beyond either, a tensor counts as evidence of a
precision problem: compare fails a recipe on it even when the loss gap is small, and the automatic
policy keeps the layer in high precision.

min_snr_db: the lowest quantization signal-to-noise ratio, 10 log10(sum x^2 / sum (x - q(x))^2), a
tensor may have. 20 dB is a quantization noise of 1 % of the signal's power. A tensor in range
quantizes at about 31.5 dB in E4M3 and 25.6 dB in E5M2 (Gaussian values, per-tensor scales; MX
blocks of 32 about 1 dB less), so the limit leaves either format 5 dB or more and is crossed when a
large share of a tensor falls among the subnormals, underflows or saturates.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from mixprec.errors import MixprecError

SATURATION_LIMIT = 0.01
UNDERFLOW_LIMIT = 0.05
# FP4 (E2M1: 0.5 is its smallest step, 6 its max) zeroes every value below 1/24 of its block's
# maximum by design: on the compare demo's model in a healthy fp4-nvfp4 run (loss +0.1 % of bf16) the
# peaks were 10 % of weights (16x16 blocks), 24 % of gradients and 29 % of the SwiGLU outputs entering
# down_proj (docs/fp4.md). Half a tensor's values gone is beyond any of those.
FP4_UNDERFLOW_LIMIT = 0.5
# Gaussian values quantize at 20.4 dB in NVFP4 (1x16), 19.1 dB in its 16x16 weight blocks and 18.8 dB in
# MXFP4 (mixprec.sensitivity.statistics on a seeded 1024x1024 normal tensor): 13 dB leaves them 5.8 dB
# or more, as the FP8 limit does its formats.
FP4_MIN_SNR_DB = 13.0
MIN_SNR_DB = 20.0


@dataclass(frozen=True)
class Limits:
    saturation: float = SATURATION_LIMIT
    underflow: float = UNDERFLOW_LIMIT
    min_snr_db: float = MIN_SNR_DB
    fp4_underflow: float = FP4_UNDERFLOW_LIMIT  # FP4 recipes' own: see the constants above
    fp4_min_snr_db: float = FP4_MIN_SNR_DB

    def __post_init__(self) -> None:
        for key in ("saturation", "underflow", "fp4_underflow"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and 0 <= value <= 1):
                raise MixprecError(f"limit {key} must be a fraction in [0, 1], got {value!r}")
        for key in ("min_snr_db", "fp4_min_snr_db"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise MixprecError(f"limit {key} must be a finite number of dB, got {value!r}")

    def for_kind(self, kind: str) -> Limits:
        """The limits a recipe of this kind ("fp8", "fp4", ...) is held to: FP4's underflow and SNR
        limits replace the others for "fp4"; saturation is the same for every kind."""
        if kind != "fp4":
            return self
        return replace(self, underflow=self.fp4_underflow, min_snr_db=self.fp4_min_snr_db)

    def to_dict(self) -> dict:
        return asdict(self)


__all__ = [
    "FP4_MIN_SNR_DB",
    "FP4_UNDERFLOW_LIMIT",
    "MIN_SNR_DB",
    "SATURATION_LIMIT",
    "UNDERFLOW_LIMIT",
    "Limits",
]
