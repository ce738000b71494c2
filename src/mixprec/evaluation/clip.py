"""The `clip` task: image-caption pairs through two image-text models (CLIPModel and look-alikes).

Pairs come from a folder of images with a captions file (`captions.jsonl`: {"image": NAME, "text": ...}
per line; or `captions.tsv` / `captions.txt`: `NAME<TAB>caption` per line), or from a `.jsonl` file whose
records name their image (relative to the file). For each pair both models give an image and a text
embedding (`get_image_features`, `get_text_features`); the figures are

- the image-text cosine similarity of each model and its CLIPScore, 100 * max(cos, 0) (Hessel et al. 2021
  with w = 100, as torchmetrics reports it), and their change (candidate - reference) per pair;
- the cosine between the reference's and the candidate's image embeddings, and between their text embeddings.

Pillow reads the images; the model directory's image processor settings are used when it has a
`preprocessor_config.json`, else CLIP's (resize the short side, centre crop to the model's image size,
CLIP's mean and std).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mixprec.errors import MixprecError
from mixprec.evaluation.metrics import cosine_per_sample
from mixprec.evaluation.samples import pad_batch
from mixprec.evaluation.throughput import Throughput
from mixprec.hf import Tokenizer, transformers_module

CAPTION_FILES = ("captions.jsonl", "captions.tsv", "captions.txt")


@dataclass(frozen=True)
class Pair:
    image: Path
    caption: str
    where: str  # "captions.tsv:3": named in error messages


def is_image_text(config: dict) -> bool:
    """A config with both a vision and a text tower (CLIP, SigLIP and look-alikes)."""
    return isinstance(config.get("vision_config"), dict) and isinstance(config.get("text_config"), dict)


def _pillow():
    try:
        from PIL import Image
    except ImportError:
        raise MixprecError("--task clip reads images with Pillow: pip install pillow") from None
    return Image


def read_pairs(path: str | os.PathLike) -> tuple[list[Pair], str]:
    """The image-caption pairs of `path` (see the module docstring) and where they came from; every image
    is opened (its header read) here, so a missing or unreadable image fails before any model loads."""
    p = Path(path)
    if not p.exists():
        raise MixprecError(f"data path {p} does not exist")
    if p.is_dir():
        found = [p / name for name in CAPTION_FILES if (p / name).is_file()]
        if not found:
            raise MixprecError(
                f"data folder {p} has no captions file: --task clip needs {' or '.join(CAPTION_FILES)} beside "
                "the images (captions.tsv: one 'image-file<TAB>caption' per line)"
            )
        captions, base = found[0], p
    elif p.suffix.lower() == ".jsonl":
        captions, base = p, p.parent
    else:
        raise MixprecError(
            f"data path {p}: --task clip needs a folder of images with a captions file, or a .jsonl file "
            '({"image": path, "text": caption} per line)'
        )
    pairs = _jsonl_pairs(captions, base) if captions.suffix == ".jsonl" else _tsv_pairs(captions, base)
    if not pairs:
        raise MixprecError(f"{captions} holds no image-caption pair")
    image = _pillow()
    for pair in pairs:
        if not pair.image.is_file():
            raise MixprecError(f"{pair.where}: image {pair.image} does not exist")
        try:
            with image.open(pair.image) as im:
                im.size  # noqa: B018 - the header is read: an unreadable file fails here
        except (OSError, ValueError) as exc:
            raise MixprecError(f"{pair.where}: {pair.image} is not an image Pillow reads ({exc})") from None
    return pairs, str(p)


def _lines(path: Path) -> list[tuple[int, str]]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise MixprecError(f"{path}: not UTF-8 text ({exc.reason})") from None
    return [(n, line) for n, line in enumerate(text.split("\n"), 1) if line.strip()]


def _jsonl_pairs(path: Path, base: Path) -> list[Pair]:
    pairs = []
    for n, line in _lines(path):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise MixprecError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
        text = row.get("text", row.get("caption")) if isinstance(row, dict) else None
        if not isinstance(row, dict) or not isinstance(row.get("image"), str) or not isinstance(text, str):
            raise MixprecError(f'{path}:{n}: each line must be a JSON object with "image" and "text" strings')
        pairs.append(Pair(base / row["image"], text.strip(), f"{path.name}:{n}"))
    return pairs


def _tsv_pairs(path: Path, base: Path) -> list[Pair]:
    pairs = []
    for n, line in _lines(path):
        name, tab, caption = line.partition("\t")
        if not tab or not name.strip() or not caption.strip():
            raise MixprecError(f"{path}:{n}: expected 'image-file<TAB>caption'")
        pairs.append(Pair(base / name.strip(), caption.strip(), f"{path.name}:{n}"))
    return pairs


def image_processor(directory: Path | None, model: nn.Module):
    """The model directory's image processor, else CLIP's preprocessing at the model's image size."""
    transformers = transformers_module("--task clip")
    if directory is not None and (directory / "preprocessor_config.json").is_file():
        try:
            return transformers.AutoImageProcessor.from_pretrained(str(directory), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise MixprecError(f"cannot load the image processor of {directory}: {exc}") from None
    vision = getattr(getattr(model, "config", None), "vision_config", None)
    size = int(getattr(vision, "image_size", 224))
    # the Pillow implementation: the default one wants torchvision, and warns when it is missing
    cls = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    return cls(size={"shortest_edge": size}, crop_size={"height": size, "width": size})


def _features(out) -> torch.Tensor:
    """get_*_features returns the projected embeddings, or (transformers 5) an output whose pooler holds them."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def clip_embeddings(model: nn.Module, pixels: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor):
    image = _features(model.get_image_features(pixel_values=pixels))
    text = _features(model.get_text_features(input_ids=ids, attention_mask=mask))
    return image.float(), text.float()


def clip_score(image: torch.Tensor, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cosine, CLIPScore = 100 * max(cosine, 0)) per row."""
    cos = cosine_per_sample(image, text)
    return cos, 100 * cos.clamp_min(0)


def run_clip(ref: nn.Module, cand: nn.Module, pairs: list[Pair], processor, tok: Tokenizer, max_tokens: int,
             batch_size: int, device: torch.device, advance) -> tuple[dict, dict, dict]:  # fmt: skip
    """Both models on every pair; figures, throughput (pairs/s) and the per-pair quantities."""
    image = _pillow()
    tp = Throughput()
    rows: dict[str, list[float]] = {k: [] for k in ("reference_similarity", "candidate_similarity",
                                                    "reference_clip_score", "candidate_clip_score",
                                                    "image_cosine", "text_cosine")}  # fmt: skip
    for i, start in enumerate(range(0, len(pairs), batch_size)):
        batch = pairs[start : start + batch_size]
        pictures = []
        for pair in batch:
            with image.open(pair.image) as im:
                pictures.append(im.convert("RGB"))
        pixels = processor(images=pictures, return_tensors="pt")["pixel_values"].to(device)
        ids, mask = pad_batch([tok.encode(p.caption, special=True)[:max_tokens] or [tok.pad_id] for p in batch],
                              tok.pad_id)  # fmt: skip
        ids, mask = ids.to(device), mask.to(device)
        if i == 0:  # first-call costs are not timed
            clip_embeddings(ref, pixels, ids, mask), clip_embeddings(cand, pixels, ids, mask)
        out = {}
        for which, model in (("reference", ref), ("candidate", cand)) if i % 2 == 0 else (
            ("candidate", cand), ("reference", ref)):  # fmt: skip
            with tp.time(which, len(batch), device):
                out[which] = clip_embeddings(model, pixels, ids, mask)
        (ri, rt), (ci, ct) = (tuple(t.cpu() for t in out[w]) for w in ("reference", "candidate"))
        for who, (im_emb, tx_emb) in (("reference", (ri, rt)), ("candidate", (ci, ct))):
            cos, score = clip_score(im_emb, tx_emb)
            rows[f"{who}_similarity"] += cos.tolist()
            rows[f"{who}_clip_score"] += score.tolist()
        rows["image_cosine"] += cosine_per_sample(ri, ci).tolist()
        rows["text_cosine"] += cosine_per_sample(rt, ct).tolist()
        advance(len(batch))

    def avg(key: str) -> float:
        return sum(rows[key]) / len(rows[key])

    n = len(rows["image_cosine"])
    figures = {
        "reference_similarity": avg("reference_similarity"),
        "candidate_similarity": avg("candidate_similarity"),
        "similarity_change": avg("candidate_similarity") - avg("reference_similarity"),
        "reference_clip_score": avg("reference_clip_score"),
        "candidate_clip_score": avg("candidate_clip_score"),
        "clip_score_change": avg("candidate_clip_score") - avg("reference_clip_score"),
        "image_embedding_cosine": avg("image_cosine"),
        "image_embedding_cosine_min": min(rows["image_cosine"]),
        "text_embedding_cosine": avg("text_cosine"),
        "text_embedding_cosine_min": min(rows["text_cosine"]),
        "pairs": n,
    }
    return figures, tp.summary("clip: image-caption pairs/s"), rows


__all__ = [
    "CAPTION_FILES",
    "Pair",
    "clip_score",
    "image_processor",
    "is_image_text",
    "read_pairs",
    "run_clip",
]
