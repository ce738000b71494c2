"""Session fixture for the evaluation tests (helpers in evaluation_fixtures.py)."""

from __future__ import annotations

import pytest
from evaluation_fixtures import make_corpus, make_tokenizer, save, tiny_bert, tiny_llama


@pytest.fixture(scope="session")
def eval_env(tmp_path_factory):
    """corpus, llama dir, bert dir (session-wide: built once)."""
    root = tmp_path_factory.mktemp("evalenv")
    tok = make_tokenizer()
    corpus = make_corpus(root / "corpus.txt")
    llama = save(tiny_llama(len(tok)), tok, root / "llama")
    bert = save(tiny_bert(len(tok)), tok, root / "bert")
    return {"root": root, "corpus": corpus, "llama": llama, "bert": bert, "tokenizer": tok}
