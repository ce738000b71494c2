"""Corpora, tokenization and the deterministic data order of `mixprec compare`.

Default corpus: the Python standard library's own .py source files (present on every machine, no
download). Or a user path: a .txt file, a folder of .txt/.md files, or a .jsonl file with a "text" field.
Documents are split into train / validation by document (never the same document in both), tokenized
by a byte-level BPE tokenizer trained on the spot on the training documents (or a Hugging Face
tokenizer from --tokenizer DIR), concatenated with an end-of-text token and cut into fixed-length blocks.

The data order is a pure function of (seed, step): batch `s` holds the blocks at positions
s*B .. s*B+B-1 of a stream of per-epoch permutations drawn from a generator seeded with (seed, epoch).
So a resumed run needs no iterator state, and two recipes see exactly the same batches.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mixprec.errors import MixprecError
from mixprec.files import staged_files
from mixprec.hf import load_tokenizer, transformers_module
from mixprec.texts import Corpus, read_texts

EOT = "<|endoftext|>"
DEFAULT_VOCAB = 1024
# The default corpus is capped: the whole standard library is ~30 MB of source, far more than a
# comparison of a small model needs, and tokenizing it would dominate the run time.
DEFAULT_MAX_CHARS = 3_000_000


@dataclass
class TokenizedData:
    """Train / validation token blocks [N, seq_len] (int64) plus the tokenizer that made them."""

    train: torch.Tensor
    val: torch.Tensor
    vocab_size: int
    seq_len: int
    tokenizer: Any = field(repr=False)  # a tokenizers.Tokenizer or a transformers tokenizer
    source: str = ""
    tokenizer_kind: str = ""  # "bpe-trained" or the --tokenizer dir
    fingerprint: str = ""  # hash of the blocks: two runs with the same fingerprint saw the same data

    def describe(self) -> dict:
        return {
            "source": self.source,
            "tokenizer": self.tokenizer_kind,
            "vocab_size": self.vocab_size,
            "seq_len": self.seq_len,
            "train_blocks": int(self.train.shape[0]),
            "val_blocks": int(self.val.shape[0]),
            "train_tokens": int(self.train.numel()),
            "val_tokens": int(self.val.numel()),
            "fingerprint": self.fingerprint,
        }


def stdlib_dir() -> Path:
    """The directory of the standard library's .py files (where `os` lives)."""
    return Path(sysconfig.get_paths().get("stdlib") or os.path.dirname(os.__file__))


def _stdlib_corpus(max_chars: int) -> Corpus:
    root = stdlib_dir()
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    docs, names, total = [], [], 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # an unreadable stdlib file is skipped: the corpus stays deterministic per machine
        if not text.strip():
            continue
        docs.append(text)
        names.append(str(path.relative_to(root)))
        total += len(text)
        if total >= max_chars:
            break
    if not docs:
        raise MixprecError(f"no readable .py files in the standard library directory {root}")
    return Corpus(tuple(docs), f"python-stdlib:{root}", tuple(names))


def load_corpus(path: str | os.PathLike | None = None, max_chars: int | None = None) -> Corpus:
    """The documents of `path` (a .txt file split at blank lines, a .jsonl file, or a folder of .txt/.md
    files, each one document: mixprec.texts.read_texts), or the stdlib sources if None."""
    if path is None:
        return _stdlib_corpus(max_chars or DEFAULT_MAX_CHARS)
    corpus = read_texts(path)
    if max_chars is None:
        return corpus
    kept, total = [], 0
    for doc, name in zip(corpus.documents, corpus.names):
        kept.append((doc, name))
        total += len(doc)
        if total >= max_chars:
            break
    return Corpus(tuple(d for d, _ in kept), corpus.source, tuple(n for _, n in kept))


def split_documents(corpus: Corpus, val_fraction: float = 0.05) -> tuple[list[str], list[str]]:
    """Split by document, never inside one: a document goes to validation when the hash of its index
    falls in the validation share (stable, spread over the corpus, independent of the training seed)."""
    docs = list(corpus.documents)
    if len(docs) == 1:
        # a single document: its last share is the validation text (still no overlap)
        text = docs[0]
        cut = int(len(text) * (1 - val_fraction))
        return [text[:cut]], [text[cut:]]
    val_idx = [i for i in range(len(docs)) if _unit_hash(i) < val_fraction]
    if not val_idx:
        val_idx = [len(docs) - 1]
    if len(val_idx) == len(docs):
        val_idx = val_idx[:1]
    chosen = set(val_idx)
    return [d for i, d in enumerate(docs) if i not in chosen], [docs[i] for i in val_idx]


def _unit_hash(i: int) -> float:
    return int(hashlib.sha256(str(i).encode()).hexdigest()[:8], 16) / 2**32


def train_bpe_tokenizer(documents: list[str], vocab_size: int = DEFAULT_VOCAB):
    """A byte-level BPE tokenizer trained on `documents` (deterministic for the same input)."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise MixprecError("training a tokenizer needs the 'hf' extra: pip install 'mixprec[hf]'") from None
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer)
    return tok


def _encode_all(tokenizer, documents: list[str]) -> tuple[list[int], int]:
    """Token ids of the documents joined by an end-of-text id, and the vocabulary size."""
    if hasattr(tokenizer, "encode_batch"):  # tokenizers.Tokenizer
        eot = tokenizer.token_to_id(EOT)
        encoded = [e.ids for e in tokenizer.encode_batch(documents)]
        vocab = tokenizer.get_vocab_size()
    else:  # transformers tokenizer
        eot = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
        encoded = tokenizer(documents, add_special_tokens=False)["input_ids"]
        vocab = len(tokenizer)
    ids: list[int] = []
    for e in encoded:
        ids.extend(e)
        if eot is not None:
            ids.append(eot)
    return ids, vocab


def _blocks(ids: list[int], seq_len: int) -> torch.Tensor:
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.int64).reshape(n, seq_len)


def prepare_data(
    corpus: Corpus,
    *,
    seq_len: int = 128,
    vocab_size: int = DEFAULT_VOCAB,
    tokenizer_dir: str | os.PathLike | None = None,
    val_fraction: float = 0.05,
    max_val_blocks: int | None = 64,
    min_train_blocks: int = 8,
) -> TokenizedData:
    """Split, tokenize and block the corpus. Raises MixprecError when too little text is left."""
    train_docs, val_docs = split_documents(corpus, val_fraction)
    if tokenizer_dir is not None:
        tokenizer, kind = load_tokenizer(tokenizer_dir), str(tokenizer_dir)
    else:
        tokenizer, kind = (
            train_bpe_tokenizer(train_docs, vocab_size),
            f"byte-level BPE trained on the spot ({vocab_size})",
        )
    train_ids, vocab = _encode_all(tokenizer, train_docs)
    val_ids, _ = _encode_all(tokenizer, val_docs)
    train, val = _blocks(train_ids, seq_len), _blocks(val_ids, seq_len)
    if max_val_blocks is not None:
        val = val[:max_val_blocks]
    if train.shape[0] < min_train_blocks or val.shape[0] < 1:
        raise MixprecError(
            f"corpus {corpus.source} is too small: {train.shape[0]} training and {val.shape[0]} validation "
            f"blocks of {seq_len} tokens (need at least {min_train_blocks} and 1)"
        )
    digest = hashlib.sha256(train.numpy().tobytes() + b"|" + val.numpy().tobytes()).hexdigest()[:16]
    return TokenizedData(train, val, vocab, seq_len, tokenizer, corpus.source, kind, digest)


def batch_indices(num_blocks: int, batch_size: int, step: int, seed: int) -> torch.Tensor:
    """Block indices of batch `step` (0-based): a pure function of (num_blocks, batch_size, step, seed)."""
    start = step * batch_size
    out = []
    while len(out) < batch_size:
        pos = start + len(out)
        epoch, offset = divmod(pos, num_blocks)
        perm = _epoch_permutation(num_blocks, seed, epoch)
        take = min(batch_size - len(out), num_blocks - offset)
        out.extend(perm[offset : offset + take].tolist())
    return torch.tensor(out, dtype=torch.int64)


def _epoch_permutation(num_blocks: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(epoch))
    return torch.randperm(num_blocks, generator=g)


def train_batch(data: TokenizedData, batch_size: int, step: int, seed: int) -> torch.Tensor:
    return data.train[batch_indices(data.train.shape[0], batch_size, step, seed)]


def save_tokenizer(tokenizer, directory: str | os.PathLike) -> None:
    """Write the tokenizer where a Hugging Face loader finds it (tokenizer.json + config), beside what
    the directory already holds (e.g. a model's weights); each file appears whole or not at all."""
    if not hasattr(tokenizer, "save_pretrained"):  # a tokenizers.Tokenizer trained on the spot
        fast = transformers_module("saving a tokenizer").PreTrainedTokenizerFast
        tokenizer = fast(tokenizer_object=tokenizer, eos_token=EOT, bos_token=EOT, unk_token=EOT)
    with staged_files(directory) as tmp:
        tokenizer.save_pretrained(str(tmp))


__all__ = [
    "TokenizedData",
    "batch_indices",
    "load_corpus",
    "prepare_data",
    "save_tokenizer",
    "split_documents",
    "stdlib_dir",
    "train_batch",
    "train_bpe_tokenizer",
]
