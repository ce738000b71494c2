"""The scores file of `--scheme auto` (auto_scores.json, schema docs/schemas/auto.md) and the fingerprint
that says what the scores were computed from (the model's files, the calibration tokens, the
candidates, the method, the ignore list, the algorithm): a file whose fingerprint matches a new run's
is reused, so a new budget costs a solve and a write, not a scoring run."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from mixprec.errors import MixprecError
from mixprec.files import write_json_atomic
from mixprec.inference.algorithms.spec import AlgorithmSpec
from mixprec.sensitivity.scores import Scores

SCORES_NAME = "auto_scores.json"


def model_fingerprint(model_dir: Path) -> str:
    """sha256 of config.json and every safetensors file's bytes (a changed weight is a new model)."""
    h = hashlib.sha256()
    for p in [model_dir / "config.json", *sorted(model_dir.glob("*.safetensors"))]:
        h.update(p.name.encode())
        with open(p, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def data_fingerprint(batches: Sequence[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for b in batches:
        h.update(str(tuple(b.shape)).encode())
        h.update(b.to(torch.int64).contiguous().numpy().tobytes())
    return h.hexdigest()


def fingerprint(model: str, data: str, candidates: Sequence[str], method: str, ignore: Sequence[str],
                algorithm: AlgorithmSpec | None = None) -> dict[str, str]:  # fmt: skip
    """What scores come from; `algorithm` (what rounded the candidates, with its parameters) only when it
    is not round to nearest, so that the scores files written before it existed still match."""
    fp = {"model": model, "data": data, "candidates": ",".join(candidates), "method": method,
          "ignore": ",".join(ignore)}  # fmt: skip
    if algorithm is not None and algorithm.names:
        fp["algorithm"] = json.dumps(algorithm.to_dict(), sort_keys=True)
    return fp


def read_scores(path: str | Path) -> Scores:
    p = Path(path)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MixprecError(f"scores file {p} does not exist") from None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise MixprecError(f"{p}: not a JSON scores file ({e})") from None
    return Scores.from_dict(doc, str(p))


def write_scores(path: Path, scores: Scores) -> None:
    write_json_atomic(path, scores.to_dict())


__all__ = [
    "SCORES_NAME",
    "data_fingerprint",
    "fingerprint",
    "model_fingerprint",
    "read_scores",
    "write_scores",
]
