"""Weight memory of a model (on disk and in memory) and the process's peak memory."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch
from torch import nn

# Files that hold weights in the checkpoint layouts mixprec reads.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".onnx", ".onnx_data")


def weight_bytes_on_disk(path: str | Path | None) -> int | None:
    """Total size of the weight files of a model directory (or of one weight file); None for online models."""
    if path is None:
        return None
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    if not path.is_dir():
        return None
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES))


def _tensors_of(module: nn.Module):
    """Parameters, buffers, and tensors a quantized layer may keep as plain attributes (payload + scales)."""
    yield from module.parameters(recurse=False)
    yield from module.buffers(recurse=False)
    for value in vars(module).values():
        if isinstance(value, torch.Tensor):
            yield value
        elif hasattr(value, "data") and hasattr(value, "scale"):  # a QuantizedTensor kept as an attribute
            for part in (value.data, value.scale):
                if isinstance(part, torch.Tensor):
                    yield part


def weight_bytes_in_memory(model: nn.Module) -> int:
    """Bytes of every distinct tensor the model holds (tied weights counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for module in model.modules():
        for t in _tensors_of(module):
            if t.device.type == "meta":
                continue
            key = (t.untyped_storage().data_ptr(), t.storage_offset())
            if key in seen:
                continue
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def tensor_bytes_by_dtype(model: nn.Module) -> dict[str, int]:
    """Bytes of every distinct tensor the model holds, per dtype ("float8_e4m3fn": 1234, ...)."""
    seen: set[tuple[int, int]] = set()
    out: dict[str, int] = {}
    for module in model.modules():
        for t in _tensors_of(module):
            key = (t.untyped_storage().data_ptr(), t.storage_offset())
            if t.device.type == "meta" or key in seen:
                continue
            seen.add(key)
            name = str(t.dtype).replace("torch.", "")
            out[name] = out.get(name, 0) + t.numel() * t.element_size()
    return dict(sorted(out.items()))


def peak_rss_bytes() -> int:
    """Peak resident memory of this process so far, as the OS reports it."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def current_rss_bytes() -> int | None:
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * resource.getpagesize()


def peak_cuda_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))


def reset_peak_cuda(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


__all__ = [
    "current_rss_bytes",
    "peak_cuda_bytes",
    "peak_rss_bytes",
    "reset_peak_cuda",
    "tensor_bytes_by_dtype",
    "weight_bytes_in_memory",
    "weight_bytes_on_disk",
]
