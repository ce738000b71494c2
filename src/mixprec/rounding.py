"""Stochastic rounding fp32 -> bf16 with counter-based noise (pure tensor functions, no modules).

    stream = NoiseStream(seed=0)
    key = stream.next_key()                    # one draw: noise for two tensors (lanes 0 and 1)
    y = stochastic_round(x, key, lane=0)       # bf16, E[y] = x

A value rounds up or down with probability proportional to its distance to the two neighbouring bf16
values: uniform 16-bit noise is added below the 16 bits bf16 drops (on the sign-magnitude bit pattern)
and the result truncated. Values whose carry could reach the exponent of inf/NaN keep
round-to-nearest.

The noise is counter-based, not drawn from a torch.Generator: element i of draw c gets 16 bits of
lowbias32(i * 0x9E3779B1 + key_c) (a 32-bit integer hash, C. Wellons), key_c = hash(seed, c); the
low half is lane 0, the high half lane 1, so one hash serves a parameter's two moments.
Why: a generator draws one number at a time, serially (about 7 ns per element here, most of an
optimizer step with bf16 moments); the hash is a dozen vectorized int32 passes (about 5x cheaper), and
any slice of a tensor computes its own part of the noise from its global indices, so a sharded tensor
(FSDP2) rounds exactly like the whole tensor without drawing the whole tensor's noise on every rank.
The stream's state is one integer (the draw counter), saved in checkpoints so a resumed run continues
with the same noise.

Stochastic rounding onto a low-precision grid (FP4 E2M1 gradients of NVFP4 training):
`stochastic_round_to_grid(v, key, mantissa_bits=, emin=, max_value=)` rounds already-scaled fp32
values to one of their two neighbours on the grid of a binary format (normals and subnormals), up with
probability (v - lower) / step, from 24 bits of the same hash: unbiased up to 2^-24 of a grid step
(an fp32 value in [1, 4) has 22 bits below E2M1's one mantissa bit: exactly unbiased there). Its key is
`stream_key(seed, step, rank, tensor)`: a resumed run draws the same noise for the same step, and two
ranks never share a key (the rank enters last, through a bijection), so their noise differs at every
element index.
"""

from __future__ import annotations

import sys
import zlib
from dataclasses import dataclass

import torch

_GOLDEN = 0x9E3779B1  # spreads consecutive indices over the 32 bits
_MUL1, _MUL2 = 0x7FEB352D, 0x846CA68B  # lowbias32's two odd multipliers
CHUNK = 1 << 18  # elements per hashing pass (1 MiB of int32: stays in the L2 cache, measured best)
_LITTLE_ENDIAN = sys.byteorder == "little"
# |x| below the largest finite bf16 (bit pattern 0x7F7F0000): adding < 2**16 to the bits stays finite
_BF16_SAFE = float(torch.finfo(torch.bfloat16).max)


def _as_int32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def hash32(v: int) -> int:
    """lowbias32 of a Python integer (the reference the tensor code is tested against), as an int32."""
    v &= 0xFFFFFFFF
    v ^= v >> 16
    v = (v * _MUL1) & 0xFFFFFFFF
    v ^= v >> 15
    v = (v * _MUL2) & 0xFFFFFFFF
    v ^= v >> 16
    return _as_int32(v)


def _xor_shift_right_(h: torch.Tensor, k: int, tmp: torch.Tensor) -> None:
    """h ^= h >>> k (logical shift on int32: the arithmetic shift with the sign copies masked off)."""
    torch.bitwise_right_shift(h, k, out=tmp)
    tmp.bitwise_and_((1 << (32 - k)) - 1)
    h.bitwise_xor_(tmp)


def hash_(index: torch.Tensor, key: int, tmp: torch.Tensor | None = None) -> torch.Tensor:
    """In place: int32 element indices -> lowbias32(index * 0x9E3779B1 + key), 32 well-mixed bits.
    int32 multiplication wraps modulo 2^32 (tested against hash32)."""
    h = index
    tmp = torch.empty_like(h) if tmp is None else tmp
    h.mul_(_as_int32(_GOLDEN)).add_(_as_int32(key))
    _xor_shift_right_(h, 16, tmp)
    h.mul_(_as_int32(_MUL1))
    _xor_shift_right_(h, 15, tmp)
    h.mul_(_as_int32(_MUL2))
    _xor_shift_right_(h, 16, tmp)
    return h


def noise16_(index: torch.Tensor, key: int, lane: int, tmp: torch.Tensor | None = None) -> torch.Tensor:
    """In place: int32 indices -> uniform noise in [0, 2^16): the low (lane 0) or high (lane 1) half
    of hash_(index, key). One hash serves two tensors of the same shape (a parameter's two moments)."""
    h = hash_(index, key, tmp)
    if lane:
        h.bitwise_right_shift_(16)
    return h.bitwise_and_(0xFFFF)


@dataclass
class NoiseStream:
    """seed + draw counter: draw c's key is hash32(hash32(seed) + c). State: `counter` (checkpointed)."""

    seed: int = 0
    counter: int = 0

    def next_key(self) -> int:
        key = hash32(hash32(self.seed) + self.counter)
        self.counter += 1
        return key

    def state(self) -> dict:
        return {"seed": self.seed, "counter": self.counter}

    def load(self, state: dict) -> None:
        self.seed, self.counter = int(state["seed"]), int(state["counter"])


def flat_indices(
    shape: tuple[int, ...], slices: tuple[slice, ...] | None = None, device=None
) -> torch.Tensor:
    """int32 row-major indices, in the whole tensor of `shape`, of the elements of a slice of it
    (all of it when slices is None), laid out in the slice's shape."""
    if slices is None:
        n = 1
        for s in shape:
            n *= s
        return torch.arange(n, dtype=torch.int32, device=device).view(shape)
    idx = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    strides = []
    for s in reversed(shape):
        strides.append(stride)
        stride *= s
    for d, (sl, st) in enumerate(zip(slices, reversed(strides))):
        view = [1] * len(shape)
        view[d] = -1
        idx = idx + (torch.arange(sl.start, sl.stop, device=device) * st).view(view)
    return idx.to(torch.int32)


def _round_bits(x: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    rounded = ((x.view(torch.int32) + noise) & -65536).view(torch.float32)
    return torch.where(torch.isfinite(rounded), rounded, x).to(torch.bfloat16)


def stochastic_round(
    x: torch.Tensor, key: int, lane: int = 1, *, index: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 -> bf16, unbiased (reference form: allocates), with the noise of (key, lane).
    index (int32, x's shape): the elements' indices in the whole tensor, for a slice (a shard) of it."""
    x = x.float().contiguous()
    index = flat_indices(tuple(x.shape), device=x.device) if index is None else index.clone()
    return _round_bits(x, noise16_(index.reshape(x.shape).contiguous(), key, lane))


def stochastic_round_pair_into(
    xs: tuple[torch.Tensor, torch.Tensor],
    outs: tuple[torch.Tensor, torch.Tensor],
    key: int,
    noise: torch.Tensor,
    tmp: torch.Tensor,
) -> None:
    """``outs[i].copy_(stochastic_round(xs[i], key, lane=i))`` for two same-sized tensors, hashing once
    and without allocations: same bits as the reference.

    xs: contiguous fp32 scratch (DESTROYED: the noise is added into their bits); outs: bf16
    destinations; noise, tmp: int32 scratch of at least min(numel, one chunk) elements.
    """
    n = xs[0].numel()
    if xs[1].numel() != n:
        raise ValueError("stochastic_round_pair_into: the two tensors differ in size")
    safe = True
    for x in xs:
        lo, hi = torch.aminmax(x)  # NaN propagates: then the comparisons below are False
        safe = safe and bool(hi < _BF16_SAFE) and bool(lo > -_BF16_SAFE)
    if not safe:
        # rare: a carry could reach the exponent of inf/NaN: the reference's per-element rule
        for lane, (x, out) in enumerate(zip(xs, outs)):
            out.copy_(stochastic_round(x, key, lane).view(out.shape))
        return
    flats = [x.view(torch.int32).view(-1) for x in xs]
    # in chunks that stay in cache: the hash is a dozen passes, each memory-bound over a whole tensor
    for start in range(0, n, CHUNK):
        stop = min(n, start + CHUNK)
        h, t = noise[: stop - start], tmp[: stop - start]
        torch.arange(start, stop, dtype=torch.int32, out=h)
        hash_(h, key, t)
        flats[0][start:stop].add_(torch.bitwise_and(h, 0xFFFF, out=t))
        flats[1][start:stop].add_(h.bitwise_right_shift_(16).bitwise_and_(0xFFFF))
    for x, out in zip(xs, outs):
        bits = x.view(torch.int32)
        # truncation = the high 16 bits of each word, which is a bf16 bit pattern: one strided copy
        if _LITTLE_ENDIAN and out.is_contiguous():
            out.view(torch.int16).view(-1).copy_(bits.view(torch.int16).view(-1)[1::2])
        else:
            out.copy_((bits & -65536).view(torch.float32).view(out.shape))


def stream_key(seed: int, step: int, rank: int, tensor: int) -> int:
    """The noise key of one quantization: (seed, optimizer step, data-parallel rank, tensor id).
    hash32 is a bijection on 32 bits and the rank is added last, so for one (seed, step, tensor) two
    ranks (< 2^32) always get different keys."""
    return hash32(hash32(hash32(hash32(int(seed)) + int(step)) + int(tensor)) + int(rank))


def tensor_id(name: str) -> int:
    """A stable 32-bit id of a tensor's name (CRC-32: the same in every process, unlike hash())."""
    return zlib.crc32(name.encode("utf-8"))


def uniform24(index: torch.Tensor, key: int) -> torch.Tensor:
    """int32 element indices -> uniform integers in [0, 2^24) (the top 24 bits of hash_), a new tensor."""
    h = hash_(index.to(torch.int32).clone(), key)
    return h.bitwise_right_shift_(8).bitwise_and_(0xFFFFFF)


def stochastic_round_to_grid(
    v: torch.Tensor,
    key: int,
    *,
    mantissa_bits: int,
    emin: int,
    max_value: float,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 values -> fp32 values on the grid of a binary format, rounded stochastically (unbiased).

    The grid step at |v| is 2^(max(floor(log2|v|), emin) - mantissa_bits) (subnormals below 2^emin);
    |v| rounds up to the next grid value with probability (|v| - lower) / step, decided by
    u < frac with u = uniform24 / 2^24; values already on the grid stay. |v| >= max_value gives
    max_value (saturation); NaN stays NaN. Everything is exact fp32 arithmetic (powers of two).
    index: the elements' int32 indices in the whole tensor (default: row-major over v).

    Computed in chunks of CHUNK elements through reused buffers (a whole-tensor temporary per step
    faults its pages in again on every call), from the bits: |v| clamped to max_value first (max is on
    the grid, so it stays, and inf becomes it), the step and its reciprocal as exponent-field
    arithmetic instead of frexp / ldexp, u < frac as float(uniform24) < frac * 2^24 (both exact), the
    sign OR-ed back from the bits. The same values as that definition, bit for bit (tests/test_fp4_training.py
    keeps it written out as the reference).
    """
    x = v.float().contiguous()
    if x.numel() == 0:
        return x.clone()
    flat, n = x.view(-1), x.numel()
    idx = None if index is None else index.reshape(-1).to(torch.int32)
    out = torch.empty_like(x)
    size = min(n, CHUNK)
    bufs = [torch.empty(size, dtype=torch.int32) for _ in range(4)] + [torch.empty(size, dtype=torch.bool)]
    for start in range(0, n, size):
        stop = min(n, start + size)
        chunk, sub = flat[start:stop], [b[: stop - start] for b in bufs]
        noise = sub[3]
        if idx is None:
            torch.arange(start, stop, dtype=torch.int32, out=noise)
        else:
            noise.copy_(idx[start:stop])
        _grid_chunk(chunk, key, mantissa_bits, emin, max_value, out.view(-1)[start:stop], sub)
    return out


def _grid_chunk(x, key, m, emin, max_value, out, bufs) -> None:
    """One chunk of stochastic_round_to_grid into `out`; bufs: 4 int32 scratch (the last holding the
    elements' indices) and a bool one."""
    a, b, c, noise, up = bufs
    af, bf, cf = (t.view(torch.float32) for t in (a, b, c))
    bits = x.view(torch.int32)
    torch.bitwise_and(bits, 0x7FFFFFFF, out=a)
    has_nan = int(a.max()) > 0x7F800000  # NaN patterns lie above inf's
    a.clamp_(max=_f32_bits(max_value))  # max is on the grid: |v| >= max (and inf) gives max
    torch.bitwise_and(a, 0x7F800000, out=b).clamp_(min=(127 + emin) << 23)  # binade 2^max(e, emin)
    torch.sub(b, m << 23, out=c)  # step = binade * 2^-m
    b.neg_().add_((254 + m) << 23)  # 1 / step: exponent field 254 + m - the binade's
    af.mul_(bf)  # t = |v| / step, exact
    torch.floor(af, out=bf)  # lower
    af.sub_(bf).mul_(2.0**24)  # frac * 2^24, exact
    hash_(noise, key, out.view(torch.int32))  # out: the hash's scratch
    out.copy_(noise.bitwise_right_shift_(8).bitwise_and_(0xFFFFFF))  # float(uniform24), exact
    bf.add_(torch.lt(out, af, out=up))  # lower + (u < frac)
    bf.mul_(cf)  # (lower + up) * step: exact
    b.bitwise_or_(torch.bitwise_and(bits, -(2**31), out=a))  # the sign of v
    out.copy_(bf)
    if has_nan:
        torch.where(torch.isnan(x), x, out, out=out)


def _f32_bits(v: float) -> int:
    return int(torch.tensor(v, dtype=torch.float32).view(torch.int32))


__all__ = [
    "NoiseStream",
    "flat_indices",
    "hash32",
    "hash_",
    "noise16_",
    "stochastic_round",
    "stochastic_round_pair_into",
    "stochastic_round_to_grid",
    "stream_key",
    "tensor_id",
    "uniform24",
]
