"""The "compiled" quantize backend (torch.compile'd traceable quantize), a compiled emulated cast, and
graph-break checks for layers.

    from mixprec.kernels.compiled import compiled_quantize, cast_to_format, graph_break_report

Eager quantization makes one memory pass per operation (amax, divide, clamp, cast, and for the
emulated formats a dozen more); Inductor fuses them into one pass for the amax and one for the
payload. What it compiles is mixprec.kernels.traceable's quantize_traceable (the same scale rule,
division and rounding as every backend), so the results are the eager backend's, bit for bit.

- `compiled_quantize(fmt, granularity, margin, power_of_two, given)` -> a compiled
  (x2, scale) -> (payload, scale, has_nan) function, one per configuration (and shape: each compiles
  once, seconds to tens of seconds on 2 cores; torch.compile's recompile limit applies). With Inductor
  on a GPU, fp32 `/` becomes Triton's approximate division unless the "eager division" option is on:
  `division_rounding_option()` finds its name in the installed torch (it moved between versions) and
  `compile_options()` passes it, so the compiled payloads stay bit-identical.
- `quantize_compiled(x2, ...)`: the backend mixprec.quantization runs for backend="compiled" (CPU),
  where `unsupported_reason` is None. The last-dim rule there is deliberate: torch 2.13's CPU
  Inductor was seen (2026-11-30) to write wrong fp8 payloads in the partial last vector of each row
  (division by an expanded per-block scale, clamp, fp8 cast, 300 columns) while eager and the Triton
  interpreter were right; whole vectors and whole blocks only avoid that code path, and
  tests/test_quantization.py checks bit-identity.
- `cast_to_format(x, fmt)`: formats.cast_to_format (bit-identical), compiled for saturating casts
  into TF32, FP6 and FP4 (formats.round_saturating, out of place).
- `graph_break_report(module, *inputs)` runs torch._dynamo.explain on module(*inputs) and returns the
  graph count, the breaks and their reasons (no graph breaks in an FP8 Linear's forward).
  `assert_compiles_fullgraph` compiles with fullgraph=True and runs it, which fails loudly at the
  first break. Both default to the cheap "eager" backend (tracing only, no code generation).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch

from mixprec.formats import Format, check_float_tensor, get_format, round_saturating
from mixprec.formats import cast_to_format as eager_cast_to_format
from mixprec.kernels.traceable import quantize_traceable
from mixprec.scaling import Granularity

VECTOR = 16  # fp32 lanes of one AVX-512 vector: the CPU backend only runs on whole vectors per row
_DIVISION_KEYS = ("eager_numerics.division_rounding", "emulate_divison_rounding", "emulate_division_rounding")


@cache
def division_rounding_option() -> dict[str, bool]:
    """{inductor config key: True} that makes compiled fp32 division round like eager, or {} if none."""
    try:
        import torch._inductor.config as inductor_config

        keys = set(inductor_config.get_config_copy())
    except Exception:
        return {}
    for key in _DIVISION_KEYS:
        if key in keys:
            return {key: True}
    return {}


def compile_options() -> dict[str, bool]:
    """Inductor options mixprec compiles with (eager-exact division)."""
    return dict(division_rounding_option())


def available() -> bool:
    """Whether torch.compile can build CPU code here (a C++ compiler is found); probed once."""
    return _probe()


@cache
def _probe() -> bool:
    try:
        fn = torch.compile(lambda t: t * 2.0 + 1.0, dynamic=False, fullgraph=True)
        return bool(torch.equal(fn(torch.ones(VECTOR)), torch.full((VECTOR,), 3.0)))
    except Exception:  # no compiler, unsupported platform: the eager backend remains
        return False


@cache
def compiled_quantize(
    fmt: str | Format,
    granularity: Granularity | None = None,
    margin: int = 0,
    power_of_two: bool = False,
    given: bool = False,
    *,
    backend: str = "inductor",
    dynamic: bool | None = False,
) -> Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A compiled (x2, scale or None) -> (payload [R, C], scale grid, has_nan) for one configuration
    (given: whether a scale is passed in); has_nan is False for formats with a NaN code."""
    fmt = get_format(fmt)
    g = granularity or Granularity.tensor()

    def run(x2: torch.Tensor, scale: torch.Tensor | None):
        data, scale, has_nan = quantize_traceable(
            x2, fmt, g, scale=scale if given else None, margin=margin, power_of_two=power_of_two
        )
        return data, scale, torch.zeros((), dtype=torch.bool) if has_nan is None else has_nan

    options = compile_options() if backend == "inductor" else None
    return torch.compile(run, backend=backend, fullgraph=True, dynamic=dynamic, options=options)


def unsupported_reason(x2: torch.Tensor, g: Granularity) -> str | None:
    """Why the CPU-compiled backend does not take this 2-D input (then use another), or None."""
    rows, cols = x2.shape
    br, bc = g.block_shape(rows, cols)
    if x2.device.type != "cpu":
        return "the compiled backend is built for the CPU (on CUDA the Triton kernels run)"
    if x2.dtype == torch.float64:
        return "fp64 input"
    if cols % VECTOR or rows % br or cols % bc:
        return f"the last dim is not a multiple of {VECTOR}, or the shape not a multiple of the block"
    if not available():
        return "torch.compile cannot build CPU code here (no C++ compiler found)"
    return None


def quantize_compiled(
    x2: torch.Tensor,
    fmt: Format,
    g: Granularity,
    *,
    scale: torch.Tensor | None = None,
    margin: int = 0,
    power_of_two: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(payload, scale, has_nan) of x2 (see unsupported_reason) by its compiled configuration."""
    fn = compiled_quantize(fmt, g, margin, power_of_two, scale is not None)
    return fn(x2.float(), scale)


@cache
def _compiled_cast(fmt: Format) -> Callable:
    def run(x: torch.Tensor) -> torch.Tensor:
        return round_saturating(x, fmt)

    return torch.compile(run, dynamic=False, fullgraph=True)


def cast_to_format(x: torch.Tensor, fmt: str | Format, saturate: bool = True) -> torch.Tensor:
    """formats.cast_to_format (bit-identical), compiled for saturating casts into TF32, FP6 and FP4."""
    fmt = get_format(fmt)
    check_float_tensor(x, "x")
    # Only the emulated formats: for torch's own dtypes, Inductor drops the round trip
    # x.to(bf16).float() unless emulate_precision_casts is set (seen for bf16 on torch 2.13), and eager
    # is one torch cast there anyway.
    usable = (
        saturate and x.dtype != torch.float64 and fmt.torch_dtype is None and fmt.special in ("ieee", "none")
    )
    if not usable or x.dim() == 0 or x.numel() == 0 or x.shape[-1] % VECTOR != 0 or not available():
        return eager_cast_to_format(x, fmt, saturate)
    return _compiled_cast(fmt)(x.float())


def graph_break_report(fn: Callable, *args, **kwargs) -> dict:
    """torch._dynamo.explain(fn)(*args): {"graphs", "graph_breaks", "reasons", "ops"} (reasons as strings)."""
    import torch._dynamo

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(*args, **kwargs)
    reasons = []
    for br in explanation.break_reasons:
        where = ""
        if getattr(br, "user_stack", None):
            frame = br.user_stack[-1]
            where = f" ({frame.filename.rsplit('/', 1)[-1]}:{frame.lineno})"
        reasons.append(f"{br.reason}{where}")
    return {
        "graphs": explanation.graph_count,
        "graph_breaks": explanation.graph_break_count,
        "reasons": reasons,
        "ops": explanation.op_count,
    }


def assert_compiles_fullgraph(fn: Callable, *args, backend: str = "eager", **kwargs):
    """Compile fn with fullgraph=True (raises at the first graph break) and return its output."""
    import torch._dynamo

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    return compiled(*args, **kwargs)


__all__ = [
    "assert_compiles_fullgraph",
    "available",
    "cast_to_format",
    "compile_options",
    "compiled_quantize",
    "division_rounding_option",
    "graph_break_report",
    "quantize_compiled",
    "unsupported_reason",
]
