"""The optional packages a command needs, checked before the command does any work.

The extras of pyproject.toml stay optional: `compare`, `demo` and `evaluate` need transformers (the
`hf` extra, a large dependency tree) for their models anyway, so no core dependency could make them
run on a base install; `formats`, `doctor`, a streaming `quantize` and the library's numerics run
without any extra. What makes a base install safe is that these commands name the missing package and its extra
before they train or load anything, rather than after a whole comparison (exit 2, nothing written).
"""

from __future__ import annotations

import importlib.util

from mixprec.errors import MixprecError

# import name -> (the distribution pip installs, the extra of pyproject.toml that brings it)
PROVIDERS = {
    "transformers": ("transformers", "hf"),
    "tokenizers": ("tokenizers", "hf"),
    "matplotlib": ("matplotlib", "report"),
    "sacrebleu": ("sacrebleu", "eval"),
    "rouge_score": ("rouge-score", "eval"),
    "peft": ("peft", "finetune"),
}


def installed(module: str) -> bool:
    """Whether `module` can be found, without importing it (a module blocked in sys.modules is not)."""
    return importlib.util.find_spec(module) is not None


def require(command: str, needs: dict[str, str]) -> None:
    """Raise MixprecError naming every missing package of `needs` ({import name: what for}) and the
    extras that install them."""
    missing = [module for module in needs if not installed(module)]
    if not missing:
        return
    what = "; ".join(f"{PROVIDERS[m][0]} for {needs[m]} (the '{PROVIDERS[m][1]}' extra)" for m in missing)
    extras = ",".join(sorted({PROVIDERS[m][1] for m in missing}))
    raise MixprecError(f"mixprec {command} needs {what}: pip install 'mixprec[{extras}]'")
