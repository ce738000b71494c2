"""Quality metrics between a reference and a candidate model: pure functions on tensors and strings.

Perplexity, top-1 agreement and KL divergence are accumulated over batches of next-token logits;
BLEU (sacrebleu) and ROUGE-L (rouge-score) score generated text with the reference model's outputs as
references; cosine similarity compares mean-pooled embeddings. Nothing here knows about models or files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from mixprec.errors import MixprecError


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of each target token. logits [B, T, V] predict targets [B, T]."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def next_token_kl(ref_logits: torch.Tensor, cand_logits: torch.Tensor) -> torch.Tensor:
    """KL(P_ref || P_cand) of the next-token distributions at each position, in nats: [B, T]."""
    ref_logp = F.log_softmax(ref_logits.float(), dim=-1)
    cand_logp = F.log_softmax(cand_logits.float(), dim=-1)
    return (ref_logp.exp() * (ref_logp - cand_logp)).sum(-1).clamp_min(0.0)


@dataclass
class LMAccumulator:
    """Sums over batches, so perplexity is exp(total NLL / total tokens) over the whole held-out text."""

    ref_nll: float = 0.0
    cand_nll: float = 0.0
    tokens: int = 0
    top1_matches: int = 0
    kl_sum: float = 0.0
    kl_max: float = 0.0
    ref_sample_nll: list[float] = field(default_factory=list)  # mean NLL per sample, for plots
    cand_sample_nll: list[float] = field(default_factory=list)
    # per block (sample) sums: the bootstrap resamples blocks, so every figure is rebuilt from these
    block_ref_nll: list[float] = field(default_factory=list)
    block_cand_nll: list[float] = field(default_factory=list)
    block_tokens: list[int] = field(default_factory=list)
    block_top1: list[int] = field(default_factory=list)
    block_kl: list[float] = field(default_factory=list)

    def add(self, ref_logits: torch.Tensor, cand_logits: torch.Tensor, input_ids: torch.Tensor) -> None:
        """Logits [B, T, V] of both models on input_ids [B, T]; position t predicts token t + 1."""
        if ref_logits.shape != cand_logits.shape:
            raise MixprecError(
                f"reference and candidate logits differ in shape: {tuple(ref_logits.shape)} vs "
                f"{tuple(cand_logits.shape)} (different vocabularies?)"
            )
        targets = input_ids[:, 1:]
        ref, cand = ref_logits[:, :-1], cand_logits[:, :-1]
        ref_nll, cand_nll = token_nll(ref, targets).double(), token_nll(cand, targets).double()
        kl = next_token_kl(ref, cand).double()
        self.ref_nll += float(ref_nll.sum())
        self.cand_nll += float(cand_nll.sum())
        self.tokens += targets.numel()
        self.top1_matches += int((ref.argmax(-1) == cand.argmax(-1)).sum())
        self.kl_sum += float(kl.sum())
        self.kl_max = max(self.kl_max, float(kl.max()))
        self.ref_sample_nll += ref_nll.mean(-1).tolist()
        self.cand_sample_nll += cand_nll.mean(-1).tolist()
        self.block_ref_nll += ref_nll.sum(-1).tolist()
        self.block_cand_nll += cand_nll.sum(-1).tolist()
        self.block_tokens += [targets.shape[1]] * targets.shape[0]
        self.block_top1 += (ref.argmax(-1) == cand.argmax(-1)).sum(-1).tolist()
        self.block_kl += kl.sum(-1).tolist()

    def per_block(self) -> dict[str, torch.Tensor]:
        """The per-block sums (fp64) that every summary figure is a function of."""
        names = {"reference_nll": self.block_ref_nll, "candidate_nll": self.block_cand_nll,
                 "tokens": self.block_tokens, "top1_matches": self.block_top1, "kl": self.block_kl}  # fmt: skip
        return {k: torch.tensor(v, dtype=torch.float64) for k, v in names.items()}

    def summary(self) -> dict:
        if self.tokens == 0:
            raise MixprecError("no tokens were scored (samples shorter than 2 tokens?)")
        ref_ppl = math.exp(self.ref_nll / self.tokens)
        cand_ppl = math.exp(self.cand_nll / self.tokens)
        return {
            "reference_perplexity": ref_ppl,
            "candidate_perplexity": cand_ppl,
            # Relative change, + means the candidate is worse; exactly 0 for identical logits.
            "perplexity_relative_change": (cand_ppl - ref_ppl) / ref_ppl,
            "top1_agreement": self.top1_matches / self.tokens,
            "kl_mean": self.kl_sum / self.tokens,
            "kl_max": self.kl_max,
            "tokens_scored": self.tokens,
        }


def bleu(hypotheses: list[str], references: list[str]) -> float:
    """Corpus BLEU (sacrebleu defaults: 13a tokenization, 4-grams), 0..100."""
    try:
        import sacrebleu
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise MixprecError("BLEU needs sacrebleu: pip install 'mixprec[eval]'") from err
    if len(hypotheses) != len(references):
        raise MixprecError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    return float(sacrebleu.corpus_bleu(hypotheses, [references]).score)


def bleu_statistics(hypotheses: list[str], references: list[str]) -> dict[str, torch.Tensor]:
    """Per-sentence BLEU sufficient statistics (sacrebleu, same tokenization as `bleu`), fp64 [n] each:
    `sys_len`, `ref_len`, `correct_1..4`, `total_1..4`. Their sums give corpus BLEU (`bleu_of_statistics`):
    sacrebleu sums exactly these to score a corpus, so resampling sentences is Koehn's (2004) bootstrap."""
    try:
        from sacrebleu.metrics import BLEU
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise MixprecError("BLEU needs sacrebleu: pip install 'mixprec[eval]'") from err
    scorer = BLEU(effective_order=True)  # effective_order changes sentence scores only, not the counts
    rows = [scorer.sentence_score(h, [r]) for h, r in zip(hypotheses, references)]
    out = {"sys_len": [s.sys_len for s in rows], "ref_len": [s.ref_len for s in rows]}
    for n in range(BLEU_ORDER):
        out[f"correct_{n + 1}"] = [s.counts[n] for s in rows]
        out[f"total_{n + 1}"] = [s.totals[n] for s in rows]
    return {k: torch.tensor(v, dtype=torch.float64) for k, v in out.items()}


BLEU_ORDER = 4
BLEU_STATISTICS = ("sys_len", "ref_len", *(f"{k}_{n}" for k in ("correct", "total") for n in range(1, 5)))


def bleu_of_statistics(*stats: torch.Tensor) -> torch.Tensor:
    """Statistic for mixprec.verdicts.paired_bootstrap: corpus BLEU per row of per-sentence statistics
    [B, n] given in the order of BLEU_STATISTICS, scored by sacrebleu itself (its default corpus smoothing)."""
    from sacrebleu.metrics import BLEU

    totals = torch.stack([s.sum(dim=-1) for s in stats], dim=-1).round().long().tolist()  # [B, 10]
    scores = []
    for row in totals:
        sys_len, ref_len, counts = row[0], row[1], row[2:]
        correct, total = counts[:BLEU_ORDER], counts[BLEU_ORDER:]
        scores.append(BLEU.compute_bleu(correct, total, sys_len, ref_len, smooth_method="exp").score)
    return torch.tensor(scores, dtype=torch.float64)


def rouge_l(hypotheses: list[str], references: list[str]) -> list[float]:
    """ROUGE-L F-measure per pair (rouge-score), 0..1. Two empty texts count as identical (1.0)."""
    try:
        from rouge_score import rouge_scorer
    except ImportError as err:  # pragma: no cover
        raise MixprecError("ROUGE-L needs rouge-score: pip install 'mixprec[eval]'") from err
    scorer = rouge_scorer.RougeScorer(["rougeL"])
    out = []
    for hyp, ref in zip(hypotheses, references):
        if hyp.strip() == ref.strip():
            out.append(1.0)  # rouge-score gives 0 when its tokenizer keeps no token from either
        else:
            out.append(float(scorer.score(ref, hyp)["rougeL"].fmeasure))
    return out


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of hidden [B, T, H] over the positions where attention_mask [B, T] is 1: [B, H] in fp32."""
    mask = attention_mask.to(torch.float32).unsqueeze(-1)
    return (hidden.float() * mask).sum(1) / mask.sum(1).clamp_min(1.0)


def cosine_per_sample(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of each row pair of a, b [B, H], computed in fp64 so identical rows give 1."""
    a, b = a.double(), b.double()
    num = (a * b).sum(-1)
    den = a.norm(dim=-1) * b.norm(dim=-1)
    # Identical rows are exactly 1 even when rounding would put the quotient a hair off.
    return torch.where(torch.all(a == b, dim=-1), torch.ones_like(num), num / den.clamp_min(1e-300))


__all__ = [
    "BLEU_STATISTICS",
    "LMAccumulator",
    "bleu",
    "bleu_of_statistics",
    "bleu_statistics",
    "cosine_per_sample",
    "mean_pool",
    "next_token_kl",
    "rouge_l",
    "token_nll",
]
