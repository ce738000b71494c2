"""NVFP4 and MXFP4 scales and payloads, bit-identical to compressed-tensors (the independent oracle).

compressed-tensors computes the scales (`generate_gparam`, `calculate_qparams`) and, given those
scales, the packed payloads (its NVFP4 / MXFP4 packed compressors); mixprec computes both itself.
"""

from __future__ import annotations

import pytest
import torch

from mixprec.errors import MixprecError
from mixprec.formats import E2M1, E8M0, decode, encode, pack_nibbles, unpack_nibbles
from mixprec.quantization import quantize
from mixprec.scaling import Granularity, compute_mx_scale, global_scale_from_amax

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor  # noqa: E402
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor  # noqa: E402
from compressed_tensors.quantization import preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam  # noqa: E402

NV = Granularity.nvfp4(scale_math="input")
MX = Granularity.mx(32, rounding="even")


def _hard_weight(dtype: torch.dtype, rows: int = 8, cols: int = 64) -> torch.Tensor:
    """Blocks that stress the scale rules: zeros, all-equal, amax at powers of two, E4M3 subnormal
    block scales (blocks far below the tensor's amax), ties of the E2M1 grid, random rows."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[0, :32] = 0.0  # zero blocks (16 and 32 wide)
    w[1, :16] = 0.375  # all equal
    w[1, 16:32] = -2.0  # all equal, a power of two
    w[2, :16] = torch.linspace(-4.0, 4.0, 16)  # amax a power of two
    w[2, 16:48] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4) / 3  # E2M1 ties
    w[3, :16] = torch.randn(16, generator=g) * 2e-3  # block scale in E4M3's subnormals
    w[3, 16:32] = torch.randn(16, generator=g) * 1e-6  # block scale rounds to 0 -> 0.125
    w[4, :] = 100.0 * torch.randn(cols, generator=g)  # sets the tensor's amax
    w[5, :32] = 1.75  # MX: even rounds the scale up
    w[5, 32:] = -6.5
    return w.to(dtype)


def _ct_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    blocks = w.unflatten(-1, (w.shape[-1] // 16, 16))
    gscale = generate_gparam(w.min(), w.max())
    scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights, global_scale=gscale)
    out = NVFP4PackedCompressor.compress(
        {"weight": w, "weight_scale": scale, "weight_global_scale": gscale}, scheme
    )
    return out["weight_packed"], out["weight_scale"], gscale


def _ct_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scheme = preset_name_to_scheme("MXFP4A16", ["Linear"])
    blocks = w.unflatten(-1, (w.shape[-1] // 32, 32))
    scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights)
    out = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    return out["weight_packed"], out["weight_scale"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("seed", [None, 1, 2])
def test_nvfp4_matches_compressed_tensors(dtype, seed):
    if seed is None:
        w = _hard_weight(dtype)
    else:
        g = torch.Generator().manual_seed(seed)
        w = (torch.randn(32, 128, generator=g) * torch.rand(32, 1, generator=g) * 3).to(dtype)
    packed, scale, gscale = _ct_nvfp4(w)
    q = quantize(w, "e2m1", NV)
    if seed is None:  # the hard cases are there: a subnormal E4M3 block scale, zero scales stored as 1/8
        assert ((q.scale < 2**-6) & (q.scale != 0.125)).any() and (q.scale == 0.125).any()
    assert torch.equal(q.global_scale, gscale.float())
    assert torch.equal(q.scale_e4m3().view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(pack_nibbles(q.data), packed)
    # and the payload computed from compressed-tensors' scales is the same
    given = quantize(w, "e2m1", NV, scale=scale.float(), global_scale=gscale)
    assert torch.equal(pack_nibbles(given.data), packed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_matches_compressed_tensors(dtype):
    w = _hard_weight(dtype)
    packed, scale = _ct_mxfp4(w)
    q = quantize(w, "e2m1", MX)
    assert torch.equal(q.scale_e8m0(), scale)
    assert torch.equal(pack_nibbles(q.data), packed)


def test_global_scale_in_the_weights_dtype():
    amax = torch.tensor(3.40625)  # representable in bf16
    assert float(global_scale_from_amax(amax, E2M1, torch.bfloat16)) == 788.0
    assert float(global_scale_from_amax(amax, E2M1)) == pytest.approx(789.14, abs=0.01)
    assert float(global_scale_from_amax(torch.tensor(0.0), E2M1)) == 1.0
    # compressed-tensors' 2688 / amax is amax.reciprocal() * 2688: not the correctly rounded quotient
    assert float(global_scale_from_amax(torch.tensor(0.08447265625), E2M1, torch.bfloat16)) == 31744.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_global_scale_matches_generate_gparam(dtype):
    g = torch.Generator().manual_seed(3)
    amax = (torch.rand(400, generator=g) * 10.0 ** torch.randint(-4, 4, (400,), generator=g)).to(dtype)
    ours = torch.cat([global_scale_from_amax(a.float(), E2M1, dtype) for a in amax])
    theirs = torch.cat([generate_gparam(-a, a) for a in amax])
    assert torch.equal(ours, theirs)


def test_mx_scale_rules_on_the_issues_examples():
    codes = {
        r: encode(compute_mx_scale(torch.tensor([1.75, 6.5, 0.0]), E2M1, r), E8M0).view(torch.uint8).tolist()
        for r in ("floor", "rceil", "even")
    }
    assert codes == {"floor": [125, 127, 0], "rceil": [126, 128, 0], "even": [126, 127, 0]}


def test_nvfp4_dequantize_is_payload_times_scale_over_global():
    w = _hard_weight(torch.float32)
    q = quantize(w, "e2m1", NV)
    ref = unpack_nibbles(pack_nibbles(q.data))
    assert torch.equal(ref, q.data)
    per_element = (q.scale / q.global_scale).repeat_interleave(16, dim=1)
    assert torch.equal(q.dequantize(), decode(q.data, E2M1) * per_element)


def test_two_d_blocks_and_mxfp6_granularities():
    w = torch.randn(32, 64)
    q = quantize(w, "e2m1", Granularity.nvfp4(16, 16))
    assert q.scale.shape == (2, 4) and q.global_scale.shape == (1,)
    for fmt in ("e3m2", "e2m3"):
        q6 = quantize(w, fmt, Granularity.mx(32, rounding="even"))
        assert q6.scale.shape == (32, 2)
        assert (q6.dequantize() - w).abs().max() <= w.abs().max() / 4


def test_shared_global_scale_and_refusals():
    w = torch.randn(4, 32)
    q = quantize(w, "e2m1", NV, global_scale=torch.tensor([100.0]))
    assert float(q.global_scale) == 100.0
    with pytest.raises(MixprecError, match="global scale"):
        quantize(w, "e2m1", Granularity.rows(), global_scale=1.0)
    with pytest.raises(MixprecError, match="eager"):
        quantize(w, "e2m1", NV, backend="traceable")
