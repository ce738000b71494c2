"""Run the original and the FP8 graph in onnxruntime (CPU) on the same inputs and report the error."""

from __future__ import annotations

import math
import os

import numpy as np

from mixprec.errors import MixprecError
from mixprec.onnx.common import need_ort, run_session


def _session(path: str | os.PathLike):
    ort = need_ort()
    try:
        return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise MixprecError(f"onnxruntime cannot load {path}: {str(exc).splitlines()[0]}") from None


def check_fp8_onnx(
    original: str | os.PathLike, quantized: str | os.PathLike, feeds: list[dict[str, np.ndarray]]
) -> dict:
    """Per output: max |diff|, relative L2 error ||q - o|| / ||o||, SNR (dB), and for logits outputs the
    top-1 agreement over the last axis."""
    if not feeds:
        raise MixprecError("no inputs to check the FP8 graph on")
    a, b = _session(original), _session(quantized)
    names = [o.name for o in a.get_outputs()]
    acc = {
        n: {"diff2": 0.0, "ref2": 0.0, "max_abs_error": 0.0, "ref_max_abs": 0.0, "top1": 0, "rows": 0}
        for n in names
    }
    for feed in feeds:
        wanted = {i.name: feed[i.name] for i in a.get_inputs()}
        ref_out = run_session(a, wanted, f"the original graph {original}")
        q_out = run_session(b, wanted, "the FP8 graph")
        for n, r, q in zip(names, ref_out, q_out):
            r64, q64 = r.astype(np.float64), q.astype(np.float64)
            s = acc[n]
            s["diff2"] += float(((q64 - r64) ** 2).sum())
            s["ref2"] += float((r64**2).sum())
            s["max_abs_error"] = max(s["max_abs_error"], float(np.abs(q64 - r64).max()))
            s["ref_max_abs"] = max(s["ref_max_abs"], float(np.abs(r64).max()))
            if (
                "logits" in n.lower() and r.ndim >= 2 and r.shape[-1] > 1
            ):  # argmax means "next token" only there
                s["top1"] += int((r.argmax(-1) == q.argmax(-1)).sum())
                s["rows"] += int(np.prod(r.shape[:-1]))
    outputs = {}
    for n, s in acc.items():
        rel = math.sqrt(s["diff2"] / s["ref2"]) if s["ref2"] > 0 else (0.0 if s["diff2"] == 0 else math.inf)
        outputs[n] = {
            "max_abs_error": s["max_abs_error"],
            "relative_l2_error": rel,
            "snr_db": 10 * math.log10(s["ref2"] / s["diff2"]) if s["diff2"] > 0 else math.inf,
            "reference_max_abs": s["ref_max_abs"],
            "top1_agreement": s["top1"] / s["rows"] if s["rows"] else None,
        }
    worst = max(o["relative_l2_error"] for o in outputs.values())
    return {
        "batches": len(feeds),
        "outputs": outputs,
        "worst_relative_l2_error": worst,
        "provider": "CPUExecutionProvider",
    }


__all__ = ["check_fp8_onnx"]
