"""What quantizing one tensor does to it: clipped and flushed elements, and the quantization SNR.

Pure tensor functions (no modules): the what-if profile scores every (layer, role, recipe) with them,
and per-layer sensitivity scoring for inference schemes can score a weight the same way.

Every figure comes from an actual quantization by THE quantizer (mixprec.quantization.quantize) with
the scales it used, so a profile's counts are those of the FP8 run it stands for:
- saturated: elements whose |x / scale| exceeds the format's max (clipped by the saturating cast)
  by more than the block scales' own rounding clips (Granularity.clip_headroom; 1 for fp32 scales);
  x / scale is the quantizer's own fp32 division, redone for the payloads at the max; inf and NaN
  count too;
- underflowed: non-zero elements whose payload is zero (flushed to zero);
- SNR: 10 log10(sum x^2 / sum (x - dequantize(q))^2) over the finite elements (sums as fp32 dot
  products: the figure is good to about 1e-4 dB, not bit-exact).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from mixprec.formats import Format, decode, get_format
from mixprec.quantization import quantize
from mixprec.scaling import Granularity, QuantizedTensor, apply_blockwise, as_2d


@dataclass
class Counts:
    """Sums over the elements of one tensor (or several: `merge` adds them)."""

    numel: int = 0
    nonzero: int = 0
    saturated: int = 0
    underflowed: int = 0
    signal: float = 0.0  # sum x^2 (float64)
    noise: float = 0.0  # sum (x - q(x))^2

    def merge(self, other: Counts) -> Counts:
        return Counts(
            self.numel + other.numel, self.nonzero + other.nonzero, self.saturated + other.saturated,
            self.underflowed + other.underflowed, self.signal + other.signal, self.noise + other.noise,
        )  # fmt: skip

    @property
    def saturation(self) -> float:
        """Share of the elements clipped at the format's max."""
        return self.saturated / self.numel if self.numel else 0.0

    @property
    def underflow(self) -> float:
        """Share of the non-zero elements flushed to zero (the monitor's definition)."""
        return self.underflowed / self.nonzero if self.nonzero else 0.0

    @property
    def snr_db(self) -> float:
        """inf when quantization was exact, -inf for an all-zero signal that quantized with error."""
        if self.noise == 0:
            return math.inf
        if self.signal == 0:
            return -math.inf
        return 10 * math.log10(self.signal / self.noise)

    def to_dict(self) -> dict:
        return asdict(self)


def quantization_counts(
    x: torch.Tensor,
    fmt: str | Format,
    granularity: Granularity | None = None,
    *,
    scale: torch.Tensor | float | None = None,
    margin: int = 0,
    power_of_two: bool = False,
    rounding_key: int | None = None,
) -> tuple[Counts, QuantizedTensor]:
    """Quantize x (quantization.quantize, same arguments) and count what it did; x is not modified.
    NVFP4 scales count through their dequantization multiplier (QuantizedTensor.effective_scale)."""
    fmt = get_format(fmt)
    x2 = as_2d(x.detach())
    q = quantize(
        x2, fmt, granularity, scale=scale, margin=margin, power_of_two=power_of_two, rounding_key=rounding_key
    )
    with torch.no_grad():
        xf = x2.float()
        values = decode(q.data, fmt)  # the payload's values (fp32, exact)
        saturated = _saturated(xf, values, q, fmt)
        nonzero = xf != 0
        underflowed = int((nonzero & (values == 0)).sum())
        error = apply_blockwise(
            values, q.effective_scale(), q.granularity, torch.mul
        )  # = dequantize(q), in place below
        torch.sub(xf, error, out=error)
        # fp32 dot products (BLAS, fast); float64 over the finite elements when one overflows or x has inf/NaN
        signal = float(xf.reshape(-1) @ xf.reshape(-1))
        noise = float(error.reshape(-1) @ error.reshape(-1))
        if not (math.isfinite(signal) and math.isfinite(noise)):
            finite = torch.isfinite(xf)
            signal = float(xf[finite].double().square().sum())
            noise = float(error[finite].double().square().sum())
    counts = Counts(xf.numel(), int(torch.count_nonzero(nonzero)), saturated, underflowed, signal, noise)
    return counts, q


def _saturated(xf: torch.Tensor, values: torch.Tensor, q: QuantizedTensor, fmt: Format) -> int:
    """Elements with |x / scale| > fmt.max: the saturating cast clipped them to +-max. Only payloads at
    +-max (or NaN) can be clipped ones, so the quantizer's division x / scale is redone for those alone."""
    candidates = ~(values.abs() < fmt.max)  # at max, or NaN
    if not bool(candidates.any()):
        return 0
    rows, cols = torch.nonzero(candidates, as_tuple=True)
    br, bc = q.granularity.block_shape(*xf.shape)
    scale = q.effective_scale()[rows // br, cols // bc]
    scaled = xf[rows, cols] / scale
    limit = fmt.max * q.granularity.clip_headroom(fmt)  # block scales' own rounding is not saturation
    return int((~(scaled.abs() <= limit)).sum())  # NaN and inf are not <= limit


__all__ = ["Counts", "quantization_counts"]
