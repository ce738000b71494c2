"""mixprec.sensitivity: how sensitive each layer of a model is to a low-precision recipe — scored from
actual quantizations by THE quantizer — and the policies drawn from it.

- statistics: what quantizing one tensor does (clipped share, flushed share, SNR in dB);
- simulate: the scales each recipe would use, pass after pass (delayed scaling from the amax history);
- profile: `profile_model`, the what-if profile of every quantizing recipe from high-precision passes;
- policy: `automatic_policy`, the layers to keep in bf16 for a recipe, as an ordinary training Policy;
- limits: the saturation / underflow / SNR limits that compare, profile and policy share;
- report: profile.json and the HTML heat maps.
- scores: per-layer sensitivity of the inference schemes (gradient-weighted output error, or KL);
- allocation: the exact choice of one scheme per fused group under a size budget;
- automatic: `--scheme auto` (score, choose, write one mixed-precision checkpoint) and the
  `quantize_model_` that dispatches scheme "auto"; auto_report: its JSON and HTML report.
"""

from mixprec.sensitivity.allocation import Allocation, Budget, allocate
from mixprec.sensitivity.automatic import AutoResult, auto_quantize_checkpoint
from mixprec.sensitivity.limits import (
    FP4_MIN_SNR_DB,
    FP4_UNDERFLOW_LIMIT,
    MIN_SNR_DB,
    SATURATION_LIMIT,
    UNDERFLOW_LIMIT,
    Limits,
)
from mixprec.sensitivity.policy import AutomaticPolicy, KeptLayer, automatic_policy
from mixprec.sensitivity.profile import (
    PRECISIONS,
    SCHEMA_VERSION,
    Cell,
    Profile,
    profile_model,
    profiled_linears,
    quantizing_recipes,
    resolve_recipes,
)
from mixprec.sensitivity.report import policy_section, profile_document, write_profile
from mixprec.sensitivity.scores import KEPT, Scores, score_model
from mixprec.sensitivity.simulate import RecipeScales, is_quantizing
from mixprec.sensitivity.statistics import Counts, quantization_counts

__all__ = [
    "FP4_MIN_SNR_DB",
    "FP4_UNDERFLOW_LIMIT",
    "KEPT",
    "MIN_SNR_DB",
    "PRECISIONS",
    "SATURATION_LIMIT",
    "SCHEMA_VERSION",
    "UNDERFLOW_LIMIT",
    "Allocation",
    "AutoResult",
    "AutomaticPolicy",
    "Budget",
    "Cell",
    "Counts",
    "KeptLayer",
    "Limits",
    "Profile",
    "RecipeScales",
    "Scores",
    "allocate",
    "auto_quantize_checkpoint",
    "automatic_policy",
    "is_quantizing",
    "policy_section",
    "profile_document",
    "profile_model",
    "profiled_linears",
    "quantization_counts",
    "quantizing_recipes",
    "resolve_recipes",
    "score_model",
    "write_profile",
]
