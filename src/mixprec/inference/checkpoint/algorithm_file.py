"""The algorithm side file of a checkpoint (mixprec_algorithm.json): what ran beyond round to nearest
(GPTQ: its parameters, the calibration data and its digest, per layer the calibration output error
of round to nearest and of the algorithm). Kept out of config.json's quantization_config, which the
serving engines parse; readers that do not know the file ignore it. Schema in docs/algorithms.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mixprec.errors import MixprecError

ALGORITHM_FILE = "mixprec_algorithm.json"
# 2: an MoE expert weight rounded to nearest for too few tokens (fallback: "rtn"); 3: AWQ's families of
# scales (`awq.awq_scales`, per mapping `scales`) and a mapping AWQ left alone has `alpha` null (2: alpha 0)
SCHEMA_VERSION = 3


def algorithm_document(record: dict[str, Any], producer: str) -> dict[str, Any]:
    """The file's document from a report's `algorithm` record."""
    return {"schema_version": SCHEMA_VERSION, "kind": "mixprec-algorithm", "producer": producer, **record}


def write_algorithm_file(directory: Path, document: dict[str, Any]) -> str:
    (Path(directory) / ALGORITHM_FILE).write_text(json.dumps(document, indent=2) + "\n")
    return ALGORITHM_FILE


def read_algorithm_file(directory: Path) -> dict[str, Any] | None:
    """The document, or None when the checkpoint has none; MixprecError naming the file when it is
    not a version this mixprec reads."""
    path = Path(directory) / ALGORITHM_FILE
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise MixprecError(f"{path}: not a readable JSON document ({e})") from None
    version = doc.get("schema_version") if isinstance(doc, dict) else None
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise MixprecError(
            f"{path}: schema_version {version!r} is not one this mixprec reads (<= {SCHEMA_VERSION})"
        )
    return doc


__all__ = [
    "ALGORITHM_FILE",
    "SCHEMA_VERSION",
    "algorithm_document",
    "read_algorithm_file",
    "write_algorithm_file",
]
