"""Input checkpoints stored in Hugging Face's `quant_method: "fp8"` layout with block scales, as
DeepSeek-V3/R1 and Qwen3-*-FP8 are released: config.json's quantization_config is
`{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [bn, bk]}`
and each quantized Linear stores `X.weight` float8_e4m3fn [N, K] with `X.weight_scale_inv` (a multiplier
despite its name) [ceil(N/bn), ceil(K/bk)]. The weight is `weight.float() * scale_inv` expanded per
block, cast to bf16, exactly as DeepSeek's reference `weight_dequant` computes it.

`fp8_block_view` presents such a checkpoint as the bf16 checkpoint it stands for: each FP8 weight
becomes an Fp8BlockWeight (bf16, computed when the reader reads it, into the reader's own buffer) and
the `weight_scale_inv` tensors disappear. Everything downstream (Linear recognition, the output plan,
streaming) then treats it as a bf16 input, one weight dequantized at a time. Tensors the input holds in
bf16 already (norms, embeddings, routers, `modules_to_not_convert`) are left as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mixprec.errors import MixprecError
from mixprec.inference.checkpoint.layout import TENSOR_NAMES, WEIGHT, WEIGHT_SCALE_INV
from mixprec.inference.checkpoint.safetensors_io import (
    Checkpoint,
    ComputedTensor,
    ShardReader,
    TensorInfo,
    read_buffer,
)

FP8_METHOD = "fp8"
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class Fp8BlockInput:
    """What the input's quantization_config says: the weight block (rows, cols) and the modules it
    keeps in high precision (informational: they are stored bf16 and read as they are)."""

    block: tuple[int, int]
    not_converted: tuple[str, ...] = ()


def already_quantized(where: Path, method: Any) -> MixprecError:
    return MixprecError(f"{where} already has a quantization_config ({method}): the checkpoint is already quantized")  # fmt: skip


def fp8_block_input(config: dict[str, Any], where: Path) -> Fp8BlockInput | None:
    """The input's FP8-block description from config.json (None: no quantization_config); MixprecError
    for any other quantization (`where` names config.json) or an FP8 config mixprec cannot read."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method != FP8_METHOD:
        raise already_quantized(where, method)
    fmt, activations = qc.get("fmt", "e4m3"), qc.get("activation_scheme", "dynamic")
    if fmt != "e4m3":
        raise MixprecError(f"{where}: quantization_config fmt {fmt!r}: only e4m3 FP8 inputs are read")
    if activations != "dynamic":
        # static activations come with input_scale tensors, a layout not documented for block weights
        raise MixprecError(f"{where}: quantization_config activation_scheme {activations!r}: only 'dynamic' "
                           "FP8 block inputs (DeepSeek-V3 / Qwen3-FP8 style) are read")  # fmt: skip
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise MixprecError(f"{where}: quantization_config weight_block_size is {block!r}; mixprec reads FP8 "
                           "inputs with block scales only ([rows, cols], e.g. [128, 128])")  # fmt: skip
    kept = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or []
    return Fp8BlockInput((block[0], block[1]), tuple(str(m) for m in kept))


@dataclass(frozen=True)
class Fp8BlockWeight(ComputedTensor):
    """An FP8 weight with its block scales, read as the bf16 weight they stand for."""

    stored: TensorInfo | None = None  # the float8_e4m3fn weight [N, K]
    scale: TensorInfo | None = None  # its weight_scale_inv [ceil(N/bn), ceil(K/bk)]
    block: tuple[int, int] = (128, 128)

    @property
    def stored_nbytes(self) -> int:
        return self.stored.nbytes + self.scale.nbytes

    def compute(self, reader: ShardReader, out: torch.Tensor | None = None) -> torch.Tensor:
        """The bf16 weight, in `out` (a uint8 buffer of at least self.nbytes) or in new memory: the FP8
        bytes are read into the buffer's upper half and dequantized downwards over it, block row by
        block row, so no second weight-sized buffer is needed."""
        nbytes = self.nbytes
        buf = read_buffer(nbytes, out, self.name)
        q = reader.get(self.stored, out=buf[nbytes - self.stored.nbytes :])
        scale = reader.get(self.scale).float()
        w = buf.view(torch.bfloat16).view(self.shape)
        dequantize_blocks(q, scale, self.block, out=w)
        return w


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], out: torch.Tensor) -> None:  # fmt: skip
    """out[r, c] = bf16(float(q[r, c]) * scale[r // bn, c // bk]), one block row at a time. `out` may
    overlap q when q lies in the upper half of out's bytes: each block row of q is read whole (into
    fp32) before its bf16 rows are written, and those end where q's next block row begins or before."""
    bn, bk = block
    n, k = q.shape
    for i, r0 in enumerate(range(0, n, bn)):
        rows = q[r0 : r0 + bn].float()
        rows.mul_(scale[i].repeat_interleave(bk)[:k])
        out[r0 : r0 + bn].copy_(rows)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_weight(name: str, info: TensorInfo, scale: TensorInfo | None, block: tuple[int, int], where: Path) -> None:  # fmt: skip
    """MixprecError naming the tensor when an FP8 tensor is not an FP8 block weight with its scales."""
    if not name.endswith(f".{WEIGHT}") or len(info.shape) != 2:
        raise MixprecError(f"{where}: tensor {name} is FP8 {list(info.shape)} but not a 2-D Linear `.weight`; "
                           "mixprec reads FP8 block inputs whose FP8 tensors are 2-D Linear weights only")  # fmt: skip
    if info.dtype != torch.float8_e4m3fn:
        raise MixprecError(
            f"{where}: tensor {name} is {info.dtype}; FP8 block inputs hold float8_e4m3fn weights"
        )
    scale_name = f"{name[: -len(WEIGHT)]}{WEIGHT_SCALE_INV}"
    if scale is None:
        raise MixprecError(f"{where}: FP8 weight {name} has no {scale_name} (its block scales); the checkpoint "
                           "is incomplete")  # fmt: skip
    grid = [_cdiv(info.shape[0], block[0]), _cdiv(info.shape[1], block[1])]
    if list(scale.shape) != grid:
        raise MixprecError(
            f"{where}: {scale_name} has shape {list(scale.shape)}; FP8 weight {name} {list(info.shape)} in "
            f"{block[0]}x{block[1]} blocks (config weight_block_size) has {grid} scales"
        )
    if scale.dtype not in SCALE_DTYPES:
        raise MixprecError(f"{where}: {scale_name} is {scale.dtype}; block scales are float32 (or bf16/fp16)")


def fp8_block_view(ckpt: Checkpoint, fp8: Fp8BlockInput, where: Path) -> Checkpoint:
    """The checkpoint as the bf16 checkpoint it stands for (see the module docstring); MixprecError
    naming the tensor, before any tensor is read, for an FP8 weight without its scales, scales of the
    wrong shape (a block size other than the config's), scales without an FP8 weight, or another
    quantized tensor (input_scale, weight_scale, ...) this layout does not have."""
    tensors: dict[str, TensorInfo] = {}
    suffix = f".{WEIGHT_SCALE_INV}"
    others = tuple(f".{s}" for s in TENSOR_NAMES if s != WEIGHT_SCALE_INV)  # other layouts' tensors
    for name, info in ckpt.tensors.items():
        if name.endswith(suffix):
            owner = ckpt.tensors.get(f"{name[: -len(suffix)]}.{WEIGHT}")
            if owner is None or owner.dtype not in _FP8_DTYPES:
                raise MixprecError(f"{where}: {name} scales no FP8 weight ({name[: -len(suffix)]}.{WEIGHT} is "
                                   f"{'missing' if owner is None else owner.dtype})")  # fmt: skip
            continue  # read with its weight, never written
        if name.endswith(others):
            raise MixprecError(f"{where}: tensor {name} is not part of the FP8 block layout (weight + "
                               f"{WEIGHT_SCALE_INV}); mixprec does not read this quantized checkpoint")  # fmt: skip
        if info.dtype in _FP8_DTYPES:
            scale = ckpt.tensors.get(f"{name[: -len(WEIGHT)]}{WEIGHT_SCALE_INV}")
            _check_weight(name, info, scale, fp8.block, where)
            info = Fp8BlockWeight(name, torch.bfloat16, info.shape, info.shard, -1, info, scale, fp8.block)
        tensors[name] = info
    if not any(isinstance(t, Fp8BlockWeight) for t in tensors.values()):
        raise MixprecError(f"{where}: quantization_config says FP8 ({FP8_METHOD}) but no tensor of "
                           f"{ckpt.root} is float8_e4m3fn")  # fmt: skip
    return Checkpoint(ckpt.root, ckpt.shards, tensors, dict(ckpt.metadata))


def fp8_weights(ckpt: Checkpoint) -> list[str]:
    """The names of the FP8 block weights of a checkpoint view (fp8_block_view)."""
    return [n for n, t in ckpt.tensors.items() if isinstance(t, Fp8BlockWeight)]


__all__ = [
    "FP8_METHOD",
    "Fp8BlockInput",
    "Fp8BlockWeight",
    "already_quantized",
    "dequantize_blocks",
    "fp8_block_input",
    "fp8_block_view",
    "fp8_weights",
]
