"""Corpora, the on-the-spot tokenizer, the train/validation split and the deterministic data order."""

from __future__ import annotations

import json

import pytest
import torch

from mixprec.data import (
    batch_indices,
    load_corpus,
    prepare_data,
    split_documents,
    stdlib_dir,
    train_bpe_tokenizer,
)
from mixprec.errors import MixprecError


def _docs(n: int = 40) -> list[str]:
    return [f"def function_{i}(x):\n    return x * {i} + {i % 7}  # document {i}\n" * 6 for i in range(n)]


def test_stdlib_corpus_is_the_standard_library_sources():
    corpus = load_corpus(None, max_chars=50_000)
    assert corpus.source.startswith("python-stdlib:")
    assert str(stdlib_dir()) in corpus.source
    assert sum(len(d) for d in corpus.documents) >= 50_000
    assert all(n.endswith(".py") for n in corpus.names)
    assert load_corpus(None, max_chars=50_000).documents == corpus.documents  # same order every time


def test_txt_folder_and_jsonl_inputs(tmp_path):
    (tmp_path / "one.txt").write_text("first paragraph\n\nsecond paragraph\n\n\n")
    assert load_corpus(tmp_path / "one.txt").documents == ("first paragraph", "second paragraph")
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.md").write_text("bee")
    (folder / "sub" / "a.txt").write_text("ay")
    (folder / "skip.json").write_text("{}")
    assert load_corpus(folder).documents == ("bee", "ay")  # sorted by path, only .txt/.md
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"text": "alpha"}) + "\n\n" + json.dumps({"text": "beta", "id": 2}) + "\n")
    assert load_corpus(rows).documents == ("alpha", "beta")


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda p: p / "missing.txt", "does not exist"),
        (lambda p: (p / "empty.txt").write_text("  \n\n") and p / "empty.txt", "empty corpus"),
        (lambda p: (p / "e").mkdir() or p / "e", "no .txt or .md"),
        (lambda p: (p / "bad.jsonl").write_text('{"txt": 1}\n') and p / "bad.jsonl", '"text" field'),
        (lambda p: (p / "x.csv").write_text("a,b") and p / "x.csv", "expected a .txt"),
    ],
)
def test_bad_corpora_are_clear_errors(tmp_path, setup, message):
    with pytest.raises(MixprecError, match=message):
        load_corpus(setup(tmp_path))


def test_split_has_no_overlap_and_is_stable(tmp_path):
    from mixprec.texts import Corpus

    corpus = Corpus(tuple(_docs(60)), "test")
    train, val = split_documents(corpus)
    assert val and train
    assert not set(train) & set(val)
    assert len(train) + len(val) == 60
    assert split_documents(corpus) == (train, val)


def test_tokenizer_is_deterministic_and_blocks_fixed_length():
    from mixprec.texts import Corpus

    corpus = Corpus(tuple(_docs(60)), "test")
    a = prepare_data(corpus, seq_len=16, vocab_size=300, min_train_blocks=4)
    b = prepare_data(corpus, seq_len=16, vocab_size=300, min_train_blocks=4)
    assert a.fingerprint == b.fingerprint and torch.equal(a.train, b.train)
    assert a.train.shape[1] == 16 and a.val.shape[1] == 16
    assert a.vocab_size <= 300 and int(a.train.max()) < a.vocab_size
    tok = train_bpe_tokenizer(["hello world"] * 10, 280)
    assert tok.decode(tok.encode("hello world").ids) == "hello world"


def test_too_small_corpus_is_an_error():
    from mixprec.texts import Corpus

    with pytest.raises(MixprecError, match="too small"):
        prepare_data(Corpus(("tiny text",), "test"), seq_len=64, vocab_size=300)


def test_data_order_is_a_function_of_seed_and_step():
    n, bs = 10, 4
    # consecutive batches walk through a permutation per epoch: every block once per epoch
    first_epochs = torch.cat([batch_indices(n, bs, s, seed=3) for s in range(5)])  # 20 = two epochs
    assert sorted(first_epochs[:10].tolist()) == list(range(n))
    assert sorted(first_epochs[10:].tolist()) == list(range(n))
    assert torch.equal(batch_indices(n, bs, 7, seed=3), batch_indices(n, bs, 7, seed=3))
    assert not torch.equal(
        torch.cat([batch_indices(n, bs, s, 3) for s in range(3)]),
        torch.cat([batch_indices(n, bs, s, 4) for s in range(3)]),
    )
