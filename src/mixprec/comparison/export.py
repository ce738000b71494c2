"""A comparison's trained models as Hugging Face directories, and its held-out text beside them.

`mixprec compare --export bf16` (and the demo) hand a trained model to the inference workflows:
quantize, evaluate and `--scheme auto` read a directory, not a model in memory. Each model is written
by mixprec.training.export_for_inference (safetensors, config.json, the recipe's dtype) with the
comparison's tokenizer; `heldout.jsonl` holds the validation documents the comparison never trained
on, as {"text": ...} lines that `mixprec evaluate --data` reads.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from mixprec.comparison.config import CompareConfig
from mixprec.data import load_corpus, save_tokenizer, split_documents
from mixprec.errors import MixprecError
from mixprec.files import write_text_atomic
from mixprec.recipes import from_name
from mixprec.training import export_for_inference

HELDOUT_NAME = "heldout.jsonl"


def model_dir_name(recipe: str) -> str:
    """The directory a recipe's trained model is exported to: model-<recipe> (':' and ',' of recipe
    options become '_')."""
    return "model-" + recipe.replace(":", "_").replace(",", "_").replace("=", "_")


def check_exportable(names: Sequence[str], config: CompareConfig) -> None:
    """MixprecError before any training when a name to export is not one of the comparison's recipes."""
    unknown = [n for n in names if n not in config.recipes]
    if unknown:
        raise MixprecError(
            f"--export {unknown[0]}: not a recipe of this comparison ({', '.join(config.recipes)})"
        )


def write_heldout(out: Path, config: CompareConfig) -> Path:
    """The comparison's validation documents as .jsonl (the evaluation reads text, not token ids)."""
    _, val_docs = split_documents(load_corpus(config.data, config.max_chars))
    path = out / HELDOUT_NAME
    write_text_atomic(path, "".join(json.dumps({"text": d}) + "\n" for d in val_docs))
    return path


def export_trained(summary, out: Path, names: Sequence[str]) -> dict[str, Path]:
    """Write each named recipe's trained model (summary.trained_models, kept by `keep_models`) to
    out/model-<recipe>, in fp32 for the fp32 recipe and in bf16 for every other (what serving starts
    from, as the demo hands it on). Returns {recipe: directory}."""
    written = {}
    for name in names:
        model = summary.trained_models.get(name)
        if model is None:
            raise MixprecError(f"the comparison kept no {name} model to export")
        dtype = "fp32" if from_name(name).kind == "fp32" else "bf16"
        target = out / model_dir_name(name)
        export_for_inference(model, target, dtype=dtype, force=True)
        save_tokenizer(summary.tokenizer, target)
        written[name] = target
    return written


__all__ = ["HELDOUT_NAME", "check_exportable", "export_trained", "model_dir_name", "write_heldout"]
