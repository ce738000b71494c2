"""`--scheme auto --algorithm gptq`: each candidate scored with the weights GPTQ gives it.

For a fixed scheme an algorithm does not change the bits a Linear costs, only how well its weight is
rounded; so the choice under a budget should weigh each candidate by the error of the weights the
algorithm will write, not round to nearest's. Each candidate scheme gets one GPTQ walk of its own, as a
uniform quantization of the whole model to it would run: a copy of the model in the checkpoint's
dtype, block by block on the calibration tokens, each block calibrated on the outputs of the blocks
before it rounded to that scheme (sequential propagation). So a candidate's rounded weights are the
uniform GPTQ checkpoint's bit for bit (tested). The mixed checkpoint that is finally written runs one
GPTQ walk over the chosen schemes, where a block sees the blocks before it in their chosen schemes: its
weights can differ a little from the ones scored.

Cost: one GPTQ walk per candidate (SmolLM2-135M nvfp4a16, 64 x 512 tokens: about a minute on the AMX
Xeon) and every candidate's rounded weights held until the scoring ends (a byte per weight or less
each). Linears outside the transformer blocks (an unignored lm_head) are scored rounded to nearest,
as GPTQ's writer rounds them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.errors import MixprecError
from mixprec.inference.algorithms.gptq_pass import GptqPass
from mixprec.inference.algorithms.spec import GPTQ, AlgorithmSpec
from mixprec.inference.calibration.layerwise import calibrate_blockwise, calibrate_layerwise
from mixprec.inference.checkpoint.safetensors_io import Checkpoint
from mixprec.inference.checkpoint.spill import SpilledResults
from mixprec.inference.schemes import InferenceScheme
from mixprec.scaling import QuantizedTensor

AUTO_ALGORITHMS = (GPTQ,)  # what --scheme auto scores with: GPTQ's weights per candidate


def check_auto_algorithm(spec: AlgorithmSpec, candidates: Sequence[InferenceScheme]) -> None:
    """MixprecError for an algorithm --scheme auto cannot score with, or a candidate it does not apply to."""
    other = [n for n in spec.names if n not in AUTO_ALGORITHMS]
    if other:
        raise MixprecError(
            f"--scheme auto scores its candidates with --algorithm gptq; {', '.join(other)} is not scored per "
            "candidate (the folds change the whole model: quantize to one scheme with them, or fold first)"
        )
    for sch in candidates:
        spec.check_scheme(sch)


def rounded_candidates(
    model: nn.Module,
    batches: Sequence[torch.Tensor],
    names: Sequence[str],
    candidates: Sequence[InferenceScheme],
    spec: AlgorithmSpec,
    weight_dtype: torch.dtype,
    advance: Callable[[], None] | None = None,
) -> dict[str, dict[str, QuantizedTensor]]:
    """{candidate scheme: {Linear: its weight as GPTQ rounds it in a uniform run of that scheme}} for the
    Linears of `names` inside the transformer blocks; `model` is left as it is (each walk runs on a copy
    in `weight_dtype`). advance(): called after each candidate."""
    out: dict[str, dict[str, QuantizedTensor]] = {}
    for sch in candidates:
        walked = copy.deepcopy(model)
        # the parameters in the checkpoint's dtype, the buffers as they are: Module.to would round the rotary
        # tables' inverse frequencies to bf16 too, which `mixprec quantize`'s walk (a skeleton computing its
        # own buffers) does not, so its attention, and every GPTQ weight after the first q/k/v, would differ
        for param in walked.parameters():
            param.data = param.data.to(weight_dtype)
        gptq = GptqPass(dict.fromkeys(names, sch), spec.gptq, weight_dtype)
        calibrate_blockwise(walked, list(batches), [], block_pass=gptq)
        out[sch.name] = dict(gptq.results)
        del walked
        if advance is not None:
            advance()
    return out


def rounded_candidates_on_checkpoint(
    model_dir: Path,
    config: dict[str, Any],
    ckpt: Checkpoint,
    batches: Sequence[torch.Tensor],
    names: Sequence[str],
    candidates: Sequence[InferenceScheme],
    spec: AlgorithmSpec,
    weight_dtype: torch.dtype,
    spill_dir: Path | None = None,
    advance: Callable[[], None] | None = None,
) -> dict[str, SpilledResults]:
    """rounded_candidates without the model in memory: each candidate's GPTQ walk reads the checkpoint
    one block at a time (calibrate_layerwise, as `mixprec quantize --algorithm gptq` runs it), and its
    rounded weights wait on disk (SpilledResults in `spill_dir`: about a byte per weight or less for each
    candidate), read back when the scorer asks for them. The caller closes each mapping (removing its
    files)."""
    out: dict[str, SpilledResults] = {}
    try:
        for sch in candidates:
            out[sch.name] = SpilledResults(spill_dir)
            gptq = GptqPass(dict.fromkeys(names, sch), spec.gptq, weight_dtype, results=out[sch.name])
            calibrate_layerwise(model_dir, config, ckpt, list(batches), [], block_pass=gptq)
            if advance is not None:
                advance()
    except BaseException:
        for spilled in out.values():
            spilled.close()
        raise
    return out


__all__ = [
    "AUTO_ALGORITHMS",
    "check_auto_algorithm",
    "rounded_candidates",
    "rounded_candidates_on_checkpoint",
]
