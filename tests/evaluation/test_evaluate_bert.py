"""The embed task end to end on a tiny BERT-style encoder built from a config."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from mixprec.cli import main
from mixprec.evaluation import evaluate
from mixprec.evaluation.samples import embed_samples, read_documents
from mixprec.hf import Tokenizer


def test_embed_cli_against_itself(eval_env, tmp_path):
    out = tmp_path / "bert.json"
    argv = ["evaluate", "--reference", str(eval_env["bert"]), "--candidate", str(eval_env["bert"]), "--data",
            str(eval_env["corpus"]), "--samples", "6", "--seq-len", "24", "--no-progress", "--json", str(out),
            "--min-cosine", "0.999999", "--out", str(tmp_path / "rep")]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["settings"]["tasks"] == ["embed"]  # the default for encoders
    assert doc["tasks"]["embed"]["cosine_mean"] == 1.0 and doc["tasks"]["embed"]["cosine_min"] == 1.0
    assert doc["reference"]["kind"] == "encoder" and doc["gates"][0]["passed"] is True
    assert (tmp_path / "rep" / "report.html").is_file()
    assert main([*argv[:-4], "--task", "lm"]) == 2  # perplexity needs a causal LM


def test_embed_fp8_candidate_matches_independent_pooling(eval_env):
    pytest.importorskip("mixprec.gemm")
    from transformers import AutoModel

    import mixprec

    r = evaluate(eval_env["bert"], candidate_scheme="fp8-dynamic", data=eval_env["corpus"], samples=6, seq_len=24,
                 progress=False, batch_size=4)  # fmt: skip
    emb = r.tasks["embed"]
    assert 0.9 < emb["cosine_min"] <= emb["cosine_mean"] < 1.0 and emb["samples"] == 6
    # independent: each sample alone (no padding), mean over its tokens, cosine with torch
    ref = AutoModel.from_pretrained(eval_env["bert"]).eval()
    cand = AutoModel.from_pretrained(eval_env["bert"]).eval()
    mixprec.quantize_model_(cand, "fp8-dynamic")
    docs, _ = read_documents(eval_env["corpus"])
    cos = []
    with torch.no_grad():
        for ids in embed_samples(docs, Tokenizer(eval_env["tokenizer"], "t"), 24, 6):
            x = torch.tensor([ids])
            a, b = ref(input_ids=x).last_hidden_state.mean(1), cand(input_ids=x).last_hidden_state.mean(1)
            cos.append(F.cosine_similarity(a, b).item())
    assert emb["cosine_mean"] == pytest.approx(sum(cos) / len(cos), abs=1e-5)
    assert emb["cosine_min"] == pytest.approx(min(cos), abs=1e-5)
    assert r.per_sample["embed.cosine"] == pytest.approx(cos, abs=1e-5)
