"""Which algorithms a quantization runs and with what parameters (`--algorithm gptq`, the API's
`algorithm=`): parsed and checked before any work, recorded in the report and the checkpoint's side
file.

Whatever order the user writes, they run as: folds (model-wide transforms of the weights) ->
activation / KV-cache calibration (observed after the folds) -> GPTQ (the rounding itself). `rtn`
(round to nearest, every scheme's own rule) is what runs when no algorithm is named.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from mixprec.errors import MixprecError
from mixprec.inference.algorithms.scale_search import SCALE_FACTORS, searchable
from mixprec.inference.algorithms.smoothquant import smoothquant_applies

RTN = "rtn"
GPTQ = "gptq"
SCALE_SEARCH = "scale-search"
ROTATE = "rotate"
SMOOTHQUANT = "smoothquant"
AWQ = "awq"
AWQ_SCALES = ("duo", "activation", "both")  # the families of scales AWQ searches (algorithms/awq.py)
FOLDS = (ROTATE, SMOOTHQUANT, AWQ)  # model-wide transforms written into the weights before calibration
# Each name with its place in the run order (lower runs first): the folds, then the scale search
# that chooses the block scales GPTQ then rounds with.
RUN_ORDER: dict[str, int] = {ROTATE: 10, SMOOTHQUANT: 20, AWQ: 30, RTN: 90, SCALE_SEARCH: 80, GPTQ: 90}
DATA_FREE = (SCALE_SEARCH, ROTATE)  # algorithms that need no calibration data
ALGORITHMS = tuple(RUN_ORDER)


@dataclass(frozen=True)
class GptqParams:
    """damp: added to the Hessian's diagonal, as a fraction of its mean (1 %: llm-compressor's
    dampening_frac); block: columns per lazy update; act_order: columns by decreasing Hessian
    diagonal, group scales fixed up front (llm-compressor's actorder="static"); sequential: block l+1
    is calibrated on the outputs of block l with its weights already rounded (activations are not
    quantized on the way, as in llm-compressor's sequential pipeline) — False: on the original outputs."""

    damp: float = 0.01
    block: int = 128
    act_order: bool = True
    sequential: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.damp <= 10.0:
            raise MixprecError(
                f"GPTQ dampening must be between 0 and 10 (a fraction of the mean diagonal), got {self.damp}"
            )
        if self.block < 1:
            raise MixprecError(f"GPTQ block must be at least 1 column, got {self.block}")


@dataclass(frozen=True)
class FoldParams:
    """seed: of the rotation's random signs / orthogonal factor (R1 from seed, R2 from seed + 1); r2:
    rotate each head's value/output too; alpha: SmoothQuant's migration strength; n_grid: AWQ's grid
    points for its exponent in [0, 1); awq_scales: the family of scales AWQ searches ("duo": activation
    and weight magnitudes, "activation", or "both")."""

    seed: int = 0
    r2: bool = True
    alpha: float = 0.5
    n_grid: int = 20
    awq_scales: str = "duo"

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise MixprecError(f"SmoothQuant alpha must be in [0, 1], got {self.alpha}")
        if self.n_grid < 1:
            raise MixprecError(f"AWQ grid must have at least 1 point, got {self.n_grid}")
        if self.awq_scales not in AWQ_SCALES:
            raise MixprecError(f"AWQ scales must be one of {', '.join(AWQ_SCALES)}, got {self.awq_scales!r}")


@dataclass(frozen=True)
class AlgorithmSpec:
    """The algorithms of one quantization in run order (empty: round to nearest) and their parameters."""

    names: tuple[str, ...] = ()
    gptq: GptqParams = field(default_factory=GptqParams)
    folds: FoldParams = field(default_factory=FoldParams)

    @classmethod
    def parse(cls, algorithm: str | Sequence[str] | AlgorithmSpec | None, **params: Any) -> AlgorithmSpec:
        """From "gptq", "rtn", a comma list or a sequence of names (None: rtn); `params`: GptqParams and
        FoldParams fields. MixprecError for an unknown or repeated name, or rtn named beside another
        algorithm."""
        if isinstance(algorithm, AlgorithmSpec):
            return algorithm
        if algorithm is None:
            words: list[str] = []
        elif isinstance(algorithm, str):
            words = [w.strip().lower() for w in algorithm.split(",") if w.strip()]
        else:
            words = [str(w).strip().lower() for w in algorithm]
        unknown = [w for w in words if w not in RUN_ORDER]
        if unknown:
            raise MixprecError(f"unknown algorithm {unknown[0]!r}; known: {', '.join(ALGORITHMS)}")
        if len(set(words)) != len(words):
            raise MixprecError(f"an algorithm is named twice in {','.join(words)}")
        if RTN in words and len(words) > 1:
            raise MixprecError(
                f"'rtn' is round to nearest alone; it cannot run beside {', '.join(w for w in words if w != RTN)}"
            )
        names = tuple(sorted((w for w in words if w != RTN), key=lambda w: RUN_ORDER[w]))
        given = {k: v for k, v in params.items() if v is not None}
        fold_keys = {f.name for f in dataclasses.fields(FoldParams)}
        unknown_keys = set(given) - fold_keys - {f.name for f in dataclasses.fields(GptqParams)}
        if unknown_keys:
            raise MixprecError(f"unknown algorithm parameter(s): {', '.join(sorted(unknown_keys))}")
        return cls(
            names,
            GptqParams(**{k: v for k, v in given.items() if k not in fold_keys}),
            FoldParams(**{k: v for k, v in given.items() if k in fold_keys}),
        )

    @property
    def uses_gptq(self) -> bool:
        return GPTQ in self.names

    @property
    def uses_scale_search(self) -> bool:
        return SCALE_SEARCH in self.names

    @property
    def needs_data(self) -> bool:
        """Every algorithm but round to nearest and the scale search learns from calibration data."""
        return any(n not in DATA_FREE for n in self.names)

    def check_scheme(self, scheme: Any) -> None:
        """MixprecError when an algorithm does not apply to `scheme` (an InferenceScheme)."""
        if SMOOTHQUANT in self.names and (why := smoothquant_applies(scheme)):
            raise MixprecError(f"--algorithm {SMOOTHQUANT}: {why}")
        if self.uses_scale_search and not searchable(scheme.weight_granularity):
            raise MixprecError(
                f"--algorithm {SCALE_SEARCH} chooses FP4 / MX block scales; scheme {scheme.name} has "
                f"{scheme.weight_granularity.name} weight scales (use nvfp4, nvfp4a16, mxfp4, mxfp4a16 or mxfp8)"
            )

    @property
    def label(self) -> str:
        return "+".join(self.names) or RTN

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"names": list(self.names) or [RTN]}
        if self.uses_scale_search:
            out["scale_search"] = {"nvfp4_factors": list(SCALE_FACTORS), "nvfp4_global_scale_for": 256.0,
                                   "mx_exponents": [-1, 0, 1]}  # fmt: skip
        if self.uses_gptq:
            out["gptq"] = asdict(self.gptq)
        fold = asdict(self.folds)
        params = {ROTATE: ("seed", "r2"), SMOOTHQUANT: ("alpha",), AWQ: ("n_grid", "awq_scales")}
        for name in self.names:
            if name in params:
                out[name.replace("-", "_")] = {k: fold[k] for k in params[name]}
        return out


__all__ = [
    "ALGORITHMS",
    "AWQ_SCALES",
    "DATA_FREE",
    "GPTQ",
    "RTN",
    "RUN_ORDER",
    "SCALE_SEARCH",
    "AlgorithmSpec",
    "GptqParams",
]
