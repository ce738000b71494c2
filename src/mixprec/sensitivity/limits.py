"""The limits a tensor's FP8 statistics are judged against: one home for compare, profile and policy.

saturation: the largest share of a tensor's elements that may be clipped at the format's max
(|x / scale| > max), as a peak over steps (compare) or passes (profile). underflow: the largest share
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
from dataclasses import asdict, dataclass

from mixprec.errors import MixprecError

SATURATION_LIMIT = 0.01
UNDERFLOW_LIMIT = 0.05
MIN_SNR_DB = 20.0


@dataclass(frozen=True)
class Limits:
    saturation: float = SATURATION_LIMIT
    underflow: float = UNDERFLOW_LIMIT
    min_snr_db: float = MIN_SNR_DB

    def __post_init__(self) -> None:
        for key in ("saturation", "underflow"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and 0 <= value <= 1):
                raise MixprecError(f"limit {key} must be a fraction in [0, 1], got {value!r}")
        if not (isinstance(self.min_snr_db, (int, float)) and math.isfinite(self.min_snr_db)):
            raise MixprecError(f"limit min_snr_db must be a finite number of dB, got {self.min_snr_db!r}")

    def to_dict(self) -> dict:
        return asdict(self)


__all__ = ["MIN_SNR_DB", "SATURATION_LIMIT", "UNDERFLOW_LIMIT", "Limits"]
