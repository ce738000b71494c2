"""The settings of one comparison, checked before anything is written, and the baseline/threshold rules."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from mixprec.errors import MixprecError
from mixprec.hf import check_model_dir
from mixprec.recipes import from_name
from mixprec.sensitivity import SATURATION_LIMIT, UNDERFLOW_LIMIT
from mixprec.verdicts import FP8_MARGIN, HALF_MARGIN

DEFAULT_RECIPES = ("fp32", "bf16", "fp8-delayed", "fp8-blockwise")
# The default comparison: these 4 recipes plus 3 null runs of each baseline (fp32, bf16) = 10 runs of the
# built-in 4-layer Llama. 500 steps (the short end of the guide's 500-1000-step runs) keeps it near 16
# minutes on an idle 2-core CPU, estimated from the measured 0.14 / 0.2 / 0.3 s per step of fp32 / bf16 /
# FP8 at this size (docs/compare.md); 3 null runs are the fewest that allow the leave-one-out null check.
DEFAULT_STEPS = 500
# Margins of the loss gap (mixprec.verdicts): the guide's 0.1 % (16-bit vs fp32); DeepSeek-V3's 0.25 %
# (FP8 vs BF16). Precision statistics: the largest share of a tensor that may saturate / underflow (peak
# over the run) before it counts as evidence of a precision problem where the loss gap alone cannot tell
# (see summary._verdict).
DEFAULT_THRESHOLDS = {
    "bf16": HALF_MARGIN,
    "fp8": FP8_MARGIN,
    "saturation": SATURATION_LIMIT,
    "underflow": UNDERFLOW_LIMIT,
}
NOISE_SUFFIX = "~reorder"  # run name of a baseline re-run with only the data order changed
NULL_SUFFIX = "~null"  # + k (1-based): a baseline re-run from weights perturbed at rounding level
DEFAULT_NULL_RUNS = 3
VERDICT_LOSSES = ("val", "train")
# "default": the guide's training policy; "auto": per FP8 recipe, the layers a profile of the initial
# model finds beyond the saturation / underflow thresholds (or the SNR limit) stay in bf16
# (mixprec.sensitivity.automatic_policy; docs/profile.md)
POLICIES = ("default", "auto")


@dataclass(frozen=True)
class CompareConfig:
    """Everything that decides the numbers of a comparison (so --resume can check it is the same run)."""

    recipes: tuple[str, ...] = DEFAULT_RECIPES
    steps: int = DEFAULT_STEPS
    eval_every: int | None = None  # None: steps // 20 (at least 1)
    eval_last: int = 3  # final validation loss = mean of the last `eval_last` evaluations
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 2e-3
    warmup_steps: int | None = None  # None: 5 % of steps
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    seed: int = 0
    baseline: str | None = None  # override: every recipe is judged against this one
    thresholds: dict = field(default_factory=lambda: dict(DEFAULT_THRESHOLDS))
    # the train loss: over the last 10 % of steps every recipe saw the same batches (a paired comparison of
    # ~200k tokens at the defaults), while the validation set is small; measured at the default size, the
    # validation gap of a correct bf16 run was +0.33 % (train -0.03 %), see docs/compare.md
    verdict_loss: str = "train"
    # K rounding-level null runs per baseline: the same batches from initial weights moved by one ulp
    # at random positions (training_run.perturb_weights); their gaps to the baseline make the band
    null_runs: int = DEFAULT_NULL_RUNS
    noise: bool = False  # also re-run each baseline with a changed data order (reported, not judged)
    policy: str = "default"  # one of POLICIES
    monitor_every: int | None = None  # None: min(100, steps // 20)
    checkpoint_every: int | None = None  # None: every evaluation
    model_dir: str | None = None
    model_config: dict | None = None  # built-in model dims (ReferenceModelConfig fields)
    data: str | None = None
    tokenizer: str | None = None
    vocab_size: int = 1024
    max_chars: int | None = None  # cap on corpus characters (None: the data module's default for stdlib)
    val_blocks: int = 64
    device: str = "cpu"  # "cpu", "cuda", "cuda:N" (bit-identical repeats are promised on CPU only)

    def __post_init__(self) -> None:
        object.__setattr__(self, "recipes", tuple(self.recipes))
        object.__setattr__(self, "thresholds", {**DEFAULT_THRESHOLDS, **dict(self.thresholds or {})})

    # derived settings ------------------------------------------------------------------------------
    @property
    def eval_interval(self) -> int:
        return self.eval_every or max(1, self.steps // 20)

    @property
    def monitor_interval(self) -> int:
        return self.monitor_every or max(1, min(100, self.steps // 20))

    @property
    def checkpoint_interval(self) -> int:
        return self.checkpoint_every or self.eval_interval

    @property
    def warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else max(1, self.steps // 20)

    def to_dict(self) -> dict:
        return asdict(self) | {"recipes": list(self.recipes)}

    @classmethod
    def from_dict(cls, d: dict) -> CompareConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: (tuple(v) if k == "recipes" else v) for k, v in d.items() if k in names})

    # checks (no file is written before these pass) -------------------------------------------------
    def validate(self) -> None:
        if not self.recipes:
            raise MixprecError("no recipes to compare")
        if len(set(self.recipes)) != len(self.recipes):
            raise MixprecError(f"recipes listed twice: {', '.join(self.recipes)}")
        for name in (*self.recipes, *([self.baseline] if self.baseline else [])):
            from_name(name)  # raises MixprecError naming the unknown recipe
        if self.baseline and self.baseline not in self.recipes:
            raise MixprecError(
                f"--baseline {self.baseline} is not one of the compared recipes ({', '.join(self.recipes)})"
            )
        for key, value, low in (
            ("steps", self.steps, 1), ("batch_size", self.batch_size, 1), ("seq_len", self.seq_len, 8),
            ("eval_last", self.eval_last, 1), ("vocab_size", self.vocab_size, 300), ("val_blocks", self.val_blocks, 1),
            ("null_runs", self.null_runs, 0),
        ):  # fmt: skip
            if not isinstance(value, int) or value < low:
                raise MixprecError(f"{key} must be an integer >= {low}, got {value!r}")
        for key in ("eval_every", "monitor_every", "checkpoint_every", "warmup_steps"):
            v = getattr(self, key)
            if v is not None and (not isinstance(v, int) or v < (0 if key == "warmup_steps" else 1)):
                raise MixprecError(f"{key} must be a positive integer, got {v!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise MixprecError(f"lr must be positive, got {self.lr}")
        for key, t in self.thresholds.items():
            if key not in DEFAULT_THRESHOLDS:
                raise MixprecError(f"unknown threshold {key!r} (known: {', '.join(DEFAULT_THRESHOLDS)})")
            if not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
                raise MixprecError(f"threshold {key} must be a non-negative fraction, got {t!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise MixprecError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise MixprecError(f"device {self.device}: CUDA is not available on this machine")
        if self.null_runs == 1:
            raise MixprecError("null_runs must be 0 (no band) or at least 2 (a band needs a spread)")
        if self.verdict_loss not in VERDICT_LOSSES:
            raise MixprecError(f"verdict_loss must be one of {VERDICT_LOSSES}, got {self.verdict_loss!r}")
        if self.policy not in POLICIES:
            raise MixprecError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        self.baselines()  # every non-baseline recipe must have a baseline in the run
        if self.data is not None and not Path(self.data).exists():
            raise MixprecError(f"data path {self.data} does not exist")
        if self.tokenizer is not None and not Path(self.tokenizer).is_dir():
            raise MixprecError(f"tokenizer directory {self.tokenizer} does not exist")
        if self.model_dir is not None:
            check_model_dir(self.model_dir)

    # baselines and thresholds ----------------------------------------------------------------------
    def baselines(self) -> dict[str, str | None]:
        """recipe -> the recipe it is judged against (None for the root baseline)."""
        out: dict[str, str | None] = {}
        for r in self.recipes:
            if self.baseline:
                out[r] = None if r == self.baseline else self.baseline
                continue
            kind = from_name(r).kind
            if kind == "fp32":
                out[r] = None
            elif kind == "fp8":
                out[r] = "bf16" if "bf16" in self.recipes else ("fp32" if "fp32" in self.recipes else "")
            else:  # bf16, bf16-amp, fp16-amp
                out[r] = "fp32" if "fp32" in self.recipes else ""
            if out[r] == "":
                need = "bf16 or fp32" if kind == "fp8" else "fp32"
                raise MixprecError(
                    f"recipe {r} needs a baseline in the run: add {need} to the recipes, or pass --baseline"
                )
        return out

    def threshold_for(self, recipe: str) -> float:
        """FP8 recipes are judged with the fp8 threshold, every other kind with the 16-bit one."""
        return self.thresholds["fp8" if from_name(recipe).kind == "fp8" else "bf16"]


def null_run_name(baseline: str, k: int) -> str:
    """The run name of null run k (1-based) of `baseline`."""
    return f"{baseline}{NULL_SUFFIX}{k}"


def is_extra_run(name: str) -> bool:
    """A run that re-runs a baseline (null or data-order noise), not a recipe of the comparison."""
    return NULL_SUFFIX in name or name.endswith(NOISE_SUFFIX)


def parse_fraction(text: str | float) -> float:
    """ "0.25%" -> 0.0025; "0.0025" -> 0.0025."""
    if isinstance(text, (int, float)):
        return float(text)
    s = text.strip()
    try:
        return float(s[:-1]) / 100 if s.endswith("%") else float(s)
    except ValueError:
        raise MixprecError(f"not a fraction or percentage: {text!r}") from None
