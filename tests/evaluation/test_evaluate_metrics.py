"""Metric, memory and gate functions against simple independent computations."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mixprec.errors import MixprecError
from mixprec.evaluation.gates import Gates, check_gates, parse_fraction, parse_memory_saving
from mixprec.evaluation.memory import weight_bytes_in_memory
from mixprec.evaluation.metrics import LMAccumulator, bleu, cosine_per_sample, mean_pool, rouge_l
from mixprec.verdicts import Interval


def test_lm_accumulator_matches_cross_entropy_and_kl_div():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 11, (3, 9), generator=g)
    a, b = torch.randn(3, 9, 11, generator=g), torch.randn(3, 9, 11, generator=g)
    acc = LMAccumulator()
    acc.add(a[:2], b[:2], ids[:2])
    acc.add(a[2:], b[2:], ids[2:])  # two batches sum to the same as one
    s = acc.summary()
    ppl_a = math.exp(F.cross_entropy(a[:, :-1].reshape(-1, 11), ids[:, 1:].reshape(-1)).item())
    ppl_b = math.exp(F.cross_entropy(b[:, :-1].reshape(-1, 11), ids[:, 1:].reshape(-1)).item())
    kl = (
        F.kl_div(F.log_softmax(b[:, :-1], -1), F.log_softmax(a[:, :-1], -1), log_target=True, reduction="sum")
        / 24
    )
    assert s["reference_perplexity"] == pytest.approx(ppl_a, rel=1e-5)
    assert s["candidate_perplexity"] == pytest.approx(ppl_b, rel=1e-5)
    assert s["perplexity_relative_change"] == pytest.approx((ppl_b - ppl_a) / ppl_a, rel=1e-4)
    assert s["kl_mean"] == pytest.approx(kl.item(), rel=1e-4)
    assert s["top1_agreement"] == pytest.approx(
        (a[:, :-1].argmax(-1) == b[:, :-1].argmax(-1)).float().mean().item()
    )
    assert s["tokens_scored"] == 24


def test_identical_logits_give_exact_zero_change():
    a = torch.randn(2, 5, 7)
    ids = torch.randint(0, 7, (2, 5))
    acc = LMAccumulator()
    acc.add(a, a.clone(), ids)
    s = acc.summary()
    assert s["perplexity_relative_change"] == 0.0 and s["kl_mean"] == 0.0 and s["top1_agreement"] == 1.0


def test_text_scores():
    hyp = ["the cat sat on the mat today", "a b c d e"]
    assert bleu(hyp, hyp) == pytest.approx(100.0)
    assert rouge_l(hyp, hyp) == [1.0, 1.0]
    assert bleu(["x y z w v"], ["a b c d e"]) == 0.0
    assert 0 < rouge_l(["the cat sat"], ["the cat ran"])[0] < 1


def test_cosine_and_pooling():
    h = torch.tensor([[[1.0, 0.0], [3.0, 0.0], [100.0, 100.0]]])
    mask = torch.tensor([[1, 1, 0]])
    assert mean_pool(h, mask).tolist() == [[2.0, 0.0]]
    a = torch.randn(4, 8)
    assert cosine_per_sample(a, a.clone()).tolist() == [1.0] * 4
    assert cosine_per_sample(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 2.0]])).item() == 0.0
    b = a + 0.1 * torch.randn(4, 8)
    assert torch.allclose(cosine_per_sample(a, b).float(), F.cosine_similarity(a, b), atol=1e-6)


def test_weight_bytes_counts_tied_weights_once():
    m = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    m[1].weight = m[0].weight
    assert weight_bytes_in_memory(m) == 10 * 4 * 4
    m.register_buffer("codes", torch.zeros(8, dtype=torch.uint8))
    assert weight_bytes_in_memory(m) == 10 * 4 * 4 + 8


@pytest.mark.parametrize(
    ("text", "value", "kind"),
    [("1.8GB", 1.8e9, "bytes"), ("500MiB", 500 * 2**20, "bytes"), ("2000000", 2e6, "bytes"),
     ("0.4", 0.4, "fraction"), ("40%", 0.4, "fraction"), (0.25, 0.25, "fraction")],
)  # fmt: skip
def test_parse_memory_saving(text, value, kind):
    v, k = parse_memory_saving(text)
    assert k == kind and v == pytest.approx(value)


def test_parse_errors():
    with pytest.raises(MixprecError):
        parse_memory_saving("lots")
    with pytest.raises(MixprecError):
        parse_memory_saving("3 parsecs")
    assert parse_fraction("0.1%", "x") == pytest.approx(0.001)
    with pytest.raises(MixprecError):
        parse_fraction("small", "--max-ppl-increase")


def test_gates_pass_and_fail_at_the_boundary():
    tasks = {
        "lm": {"perplexity_relative_change": 0.002},
        "generate": {"bleu": 80.0},
        "embed": {"cosine_mean": 0.99},
    }
    memory = {"weight_saving_bytes": 1000, "weight_saving_fraction": 0.5}
    tp = {"speedup": 1.2}
    points = {t: {k: Interval(v, v, v, 0.95, 10)} for t, figs in tasks.items() for k, v in figs.items()}
    ok = check_gates(Gates(0.002, 80.0, 0.99, "1000", 1.2), tasks, memory, tp, points)
    assert all(g.passed for g in ok) and len(ok) == 5
    bad = check_gates(Gates("0.1%", 80.1, 0.991, "60%", 1.3), tasks, memory, tp, points)
    assert not any(g.passed for g in bad)
    # a quality figure without an interval (one sample) settles nothing: inconclusive
    one = check_gates(Gates("0.1%", 80.1, 0.991), tasks, memory, tp)
    assert [g.verdict for g in one] == ["inconclusive"] * 3 and all(g.passed for g in one)
    assert not any(g.passed for g in check_gates(Gates("0.1%", 80.1, 0.991), tasks, memory, tp, strict=True))
    assert check_gates(Gates(min_speedup=1.0), tasks, memory, {"speedup": None})[0].passed is False


def test_bleu_from_sentence_statistics_is_sacrebleus_corpus_bleu():
    import random

    import sacrebleu

    from mixprec.evaluation.metrics import BLEU_STATISTICS, bleu_of_statistics, bleu_statistics

    rng = random.Random(0)
    words = ["the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "rug", "today"]
    for n in (1, 3, 20):
        refs = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 9))) for _ in range(n)]
        hyps = [" ".join(w if rng.random() < 0.7 else rng.choice(words) for w in r.split()) for r in refs]
        stats = bleu_statistics(hyps, refs)
        got = float(bleu_of_statistics(*[stats[k].unsqueeze(0) for k in BLEU_STATISTICS])[0])
        assert got == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score, abs=1e-9)


def test_lm_intervals_rest_on_the_figures():
    """Each lm interval's estimate is the accumulated figure: the per-block sums rebuild it exactly."""
    from mixprec.evaluation.intervals import Bootstrap, task_intervals

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 11, (12, 9), generator=g)
    a = torch.randn(12, 9, 11, generator=g)
    b = a + 0.3 * torch.randn(12, 9, 11, generator=g)
    acc = LMAccumulator()
    acc.add(a, b, ids)
    s = acc.summary()
    ivs = task_intervals(
        "lm", {f"block_{k}": v for k, v in acc.per_block().items()}, Bootstrap(resamples=200)
    )
    for figure in ("perplexity_relative_change", "top1_agreement", "kl_mean"):
        iv = ivs[figure]
        assert iv.estimate == pytest.approx(s[figure], rel=1e-9) and iv.low <= iv.estimate <= iv.high
        assert iv.samples == 12 and iv.level == 0.95
    assert ivs["top1_agreement"].high <= 1 and ivs["kl_mean"].low > 0


def test_quality_gates_read_the_interval():
    from mixprec.evaluation.gates import judge
    from mixprec.verdicts import Interval

    iv = Interval(estimate=0.004, low=0.002, high=0.006, level=0.95, samples=32)
    at_most = {t: judge("g", t, 0.004, iv, "relative", at_least=False) for t in (0.01, 0.005, 0.001)}
    assert [g.verdict for g in at_most.values()] == ["equivalent", "inconclusive", "worse"]
    assert [g.passed for g in at_most.values()] == [True, True, False]
    assert at_most[0.005].samples_to_settle == 128  # the half-width must halve: 4x the samples
    assert judge("g", 0.005, 0.004, iv, "relative", at_least=False, strict=True).passed is False
    cos = Interval(estimate=0.995, low=0.993, high=0.997, level=0.95, samples=100)
    at_least = [judge("c", t, 0.995, cos, "cosine", at_least=True).verdict for t in (0.99, 0.996, 0.998)]
    assert at_least == ["equivalent", "inconclusive", "worse"]
    assert judge("m", 0.4, None, None, "fraction", at_least=True).verdict == "worse"  # not measured
