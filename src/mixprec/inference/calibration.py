"""Calibration: text data -> token batches -> a forward pass with hooks on Linear inputs (and on the
attention's key/value states for an FP8 KV cache) -> per-layer activation amax, through an observer.

Observers (what amax a static scale is built from):
  max         the largest |x| seen (default; nothing saturates on the calibration data)
  percentile  the mean over batches of the 99.99th percentile of |x| (clips rare outliers)
  mse         the clipping threshold, among fractions of the max, that minimises the mean squared
              FP8 quantization error over a bounded sample of the inputs (plus their largest values)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.errors import MixprecError
from mixprec.formats import E4M3
from mixprec.quantization import fake_quantize
from mixprec.scaling import Granularity, compute_scale
from mixprec.texts import read_texts

OBSERVERS = ("max", "percentile", "mse")

# Names that look like datasets people download; mixprec downloads nothing, so they must be local.
WELL_KNOWN_DATASETS = (
    "wikitext-2-raw",
    "wikitext-2-raw-v1",
    "wikitext-2",
    "wikitext2",
    "wikitext-103-raw",
    "wikitext-103-raw-v1",
    "c4",
    "pile-val",
    "pileval",
    "ultrachat",
    "ultrachat-200k",
    "open-platypus",
)
LOCAL_DATASET_ROOT = Path("~/.cache/mixprec/datasets")


# ---------------------------------------------------------------------------------------------------
# Data


def resolve_calib_source(spec: str | Path) -> Path:
    """A path to calibration text, or a well-known name with a local copy."""
    p = Path(spec).expanduser()
    if p.exists():
        return p
    key = str(spec).strip().lower()
    if key in WELL_KNOWN_DATASETS:
        root = LOCAL_DATASET_ROOT.expanduser() / key
        if root.exists():
            return root
        raise MixprecError(
            f"calibration dataset {spec!r} is a well-known name, but mixprec downloads nothing. Provide a local "
            f"copy: put its text (.txt files, or .jsonl with a 'text' field) in {root}/, or pass --calib-data PATH. "
            f"For example, where the 'datasets' package and network are available: "
            f"python -c \"import datasets; d=datasets.load_dataset('wikitext','wikitext-2-raw-v1',split='train'); "
            f"open('wiki.train.txt','w').write(''.join(d['text']))\""
        )
    raise MixprecError(
        f"calibration data {spec} not found (expected a .txt, a .jsonl with 'text', or a folder of them)"
    )


CALIBRATION_SUFFIXES = (".txt", ".raw", ".jsonl")


def load_texts(spec: str | Path) -> list[str]:
    """The calibration texts of a path or well-known name (mixprec.texts.read_texts): a .txt file's
    paragraphs, a .jsonl file's "text" fields, or those of every .txt/.raw/.jsonl file in a folder."""
    path = resolve_calib_source(spec)
    corpus = read_texts(path, suffixes=CALIBRATION_SUFFIXES, split_folder_files=True, what="calibration data")
    return list(corpus.documents)


def token_batches(
    texts: Sequence[str], tokenizer: Any, samples: int, seq_len: int, batch_size: int = 4
) -> list[torch.Tensor]:
    """Concatenate tokenized texts and cut `samples` windows of `seq_len` tokens; batches of ids."""
    if samples < 1 or seq_len < 1:
        raise MixprecError("--calib-samples and --calib-seq-len must be positive")
    ids: list[int] = []
    sep = getattr(tokenizer, "eos_token_id", None)
    for t in texts:
        ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
        if sep is not None:
            ids.append(sep)
        if len(ids) >= samples * seq_len:
            break
    if not ids:
        raise MixprecError("calibration text tokenized to nothing")
    n = max(1, min(samples, len(ids) // seq_len))
    length = min(seq_len, len(ids))
    rows = torch.tensor(ids[: n * length], dtype=torch.long).reshape(n, length)
    return list(rows.split(batch_size))


# ---------------------------------------------------------------------------------------------------
# Observers


class Observer:
    def update(self, x: torch.Tensor) -> None:
        raise NotImplementedError

    def amax(self) -> float:
        raise NotImplementedError


class MaxObserver(Observer):
    def __init__(self) -> None:
        self._max = 0.0

    def update(self, x: torch.Tensor) -> None:
        x = x.detach()
        m = float(x[torch.isfinite(x)].abs().max()) if x.numel() else 0.0
        self._max = max(self._max, m)

    def amax(self) -> float:
        return self._max


class PercentileObserver(MaxObserver):
    def __init__(self, percentile: float = 99.99, max_elements: int = 1 << 22) -> None:
        super().__init__()
        self.q = percentile / 100.0
        self.max_elements = max_elements
        self._values: list[float] = []

    def update(self, x: torch.Tensor) -> None:
        super().update(x)
        a = x.detach().float().abs().flatten()
        if a.numel() > self.max_elements:  # a strided subset keeps torch.quantile within its size limit
            a = a[:: math.ceil(a.numel() / self.max_elements)]
        self._values.append(float(torch.quantile(a, self.q)))

    def amax(self) -> float:
        return min(self._max, sum(self._values) / len(self._values)) if self._values else 0.0


class MseObserver(MaxObserver):
    def __init__(self, sample_per_batch: int = 4096, top_per_batch: int = 128, grid: int = 32) -> None:
        super().__init__()
        self.sample_per_batch, self.top_per_batch, self.grid = sample_per_batch, top_per_batch, grid
        self._samples: list[torch.Tensor] = []
        self._gen = torch.Generator().manual_seed(0)

    def update(self, x: torch.Tensor) -> None:
        super().update(x)
        v = x.detach().float().flatten()
        v = v[torch.isfinite(v)]
        if v.numel() == 0:
            return
        idx = torch.randint(v.numel(), (min(self.sample_per_batch, v.numel()),), generator=self._gen)
        top = v.abs().topk(min(self.top_per_batch, v.numel())).indices
        self._samples.append(torch.cat([v[idx], v[top]]))

    def amax(self) -> float:
        if not self._samples or self._max == 0:
            return self._max
        sample = torch.cat(self._samples)
        best, best_err = self._max, math.inf
        for i in range(self.grid):
            clip = self._max * (0.3 + 0.7 * (i + 1) / self.grid)
            q = fake_quantize(
                sample, E4M3, Granularity.tensor(), scale=compute_scale(clip, E4M3).reshape(1, 1)
            )
            err = float((sample - q).pow(2).mean())
            if err < best_err:
                best, best_err = clip, err
        return best


def make_observer(name: str) -> Observer:
    key = name.strip().lower()
    if key == "max":
        return MaxObserver()
    if key == "percentile":
        return PercentileObserver()
    if key == "mse":
        return MseObserver()
    raise MixprecError(f"unknown observer {name!r}; known: {', '.join(OBSERVERS)}")


# ---------------------------------------------------------------------------------------------------
# Running the model


def kv_attention_patch(model: nn.Module, kv_observers: dict[int, tuple[Observer, Observer]]):
    """Route attention through a wrapper that observes key/value states as the attention sees them
    (after RoPE): what an FP8 KV cache stores. Returns an undo function, or None if unsupported."""
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        return None
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if config is None or impl is None:
        return None
    inner = ALL_ATTENTION_FUNCTIONS.get_interface(impl, None)
    if inner is None:
        return None

    def observed(module, query, key, value, *args, **kwargs):
        idx = getattr(module, "layer_idx", None)
        if idx is not None:
            ko, vo = kv_observers.setdefault(idx, (MaxObserver(), MaxObserver()))
            ko.update(key)
            vo.update(value)
        return inner(module, query, key, value, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS.register("mixprec_kv_calibration", observed)
    configs = [m.config for m in model.modules() if getattr(m, "config", None) is not None]
    previous = [(c, c._attn_implementation) for c in {id(c): c for c in configs}.values()]
    for c, _ in previous:
        c._attn_implementation = "mixprec_kv_calibration"

    def undo() -> None:
        for c, v in previous:
            c._attn_implementation = v

    return undo


def _run(model: nn.Module, batches: Iterable[Any], progress: Any = None) -> None:
    with torch.no_grad():
        for b in batches:
            if isinstance(b, dict):
                model(**b)
            elif isinstance(b, torch.Tensor):
                model(input_ids=b) if b.dtype == torch.long else model(b)
            elif isinstance(b, (list, tuple)):
                model(*b)
            else:
                raise MixprecError(
                    f"calibration batches must be tensors, dicts or tuples, got {type(b).__name__}"
                )
            if progress is not None:
                progress()


class NothingObserved(MixprecError):
    """Calibration saw no nonzero input for a Linear; `module` names it (its path in the model)."""

    def __init__(self, module: str):
        super().__init__(
            f"calibration never saw a nonzero input for {module!r}; is the calibration data empty?"
        )
        self.module = module


def calibrate(
    model: nn.Module,
    batches: Iterable[Any],
    linear_names: Sequence[str],
    *,
    observer: str = "max",
    kv_cache: bool = False,
    progress: Any = None,
) -> tuple[dict[str, float], dict[int, tuple[float, float]]]:
    """Run `batches` through `model`; returns ({linear name: input amax}, {layer idx: (k amax, v amax)})."""
    modules = dict(model.named_modules())
    observers: dict[str, Observer] = {n: make_observer(observer) for n in linear_names}
    handles = []
    for n in linear_names:

        def hook(_mod, args, _obs=observers[n]):
            if args and isinstance(args[0], torch.Tensor):
                _obs.update(args[0])

        handles.append(modules[n].register_forward_pre_hook(hook))
    kv_obs: dict[int, tuple[Observer, Observer]] = {}
    undo = None
    if kv_cache:
        undo = kv_attention_patch(model, kv_obs)
        if undo is None:
            raise MixprecError(
                "--kv-cache fp8 needs a transformers attention model (key/value states to observe)"
            )
    was_training = model.training
    model.eval()
    try:
        _run(model, batches, progress)
    finally:
        for h in handles:
            h.remove()
        if undo is not None:
            undo()
        model.train(was_training)
    amax = {n: o.amax() for n, o in observers.items()}
    for n, a in amax.items():
        if a == 0:
            raise NothingObserved(n)
    return amax, {i: (k.amax(), v.amax()) for i, (k, v) in sorted(kv_obs.items())}
