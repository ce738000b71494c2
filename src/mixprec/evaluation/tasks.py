"""The text evaluation tasks (lm, generate, embed; clip lives in clip.py). Each runs both models on the
same samples, batch by batch, times them, and returns its figures with the per-sample quantities its
confidence intervals are drawn from (mixprec.evaluation.intervals)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mixprec.evaluation.metrics import (
    LMAccumulator,
    bleu,
    bleu_statistics,
    cosine_per_sample,
    mean_pool,
    rouge_l,
)
from mixprec.evaluation.samples import pad_batch
from mixprec.evaluation.throughput import Throughput
from mixprec.hf import Tokenizer

Advance = Callable[[int], None]


def _is_hf(model: nn.Module) -> bool:
    return hasattr(model, "config") and hasattr(model, "get_input_embeddings")


def logits_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids, use_cache=False) if _is_hf(model) else model(ids)
    logits = getattr(out, "logits", out)
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    return logits.float()


def hidden_of(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Last hidden states [B, T, H]: last_hidden_state for encoders, hidden_states[-1] for LMs."""
    if not _is_hf(model):
        out = model(ids)
        return getattr(out, "last_hidden_state", out)
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    hidden = getattr(out, "last_hidden_state", None)
    if hidden is None:
        hidden = out.hidden_states[-1]
    return hidden


def _batches(n: int, batch_size: int):
    for start in range(0, n, batch_size):
        yield slice(start, min(n, start + batch_size))


def _timed_pair(
    i: int, tp: Throughput, tokens: int, device: torch.device, ref: nn.Module, cand: nn.Module, fn, *args
):
    """fn(model, *args) for both, alternating which goes first batch by batch so that cache or
    frequency effects do not favour one model."""
    out = {}
    order = (("reference", ref), ("candidate", cand))
    for which, model in order if i % 2 == 0 else order[::-1]:
        with tp.time(which, tokens, device):
            out[which] = fn(model, *args)
    return out["reference"], out["candidate"]


def _pooled(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return mean_pool(hidden_of(model, ids, mask), mask)


def run_lm(ref: nn.Module, cand: nn.Module, blocks: torch.Tensor, batch_size: int, device: torch.device,
           advance: Advance) -> tuple[dict, dict, dict]:  # fmt: skip
    """Perplexity of both on the same blocks, top-1 agreement and KL of next-token distributions."""
    acc, tp = LMAccumulator(), Throughput()
    warm = blocks[:batch_size].to(device)
    logits_of(ref, warm), logits_of(cand, warm)  # first-call costs (allocations, lazy init) are not timed
    for i, sl in enumerate(_batches(blocks.shape[0], batch_size)):
        ids = blocks[sl].to(device)
        ref_logits, cand_logits = _timed_pair(i, tp, ids.numel(), device, ref, cand, logits_of, ids)
        acc.add(ref_logits, cand_logits, ids)  # on the device: no vocab-sized copies to the host
        advance(ids.shape[0])
    per_sample = {"reference_nll": acc.ref_sample_nll, "candidate_nll": acc.cand_sample_nll}
    per_sample.update({f"block_{k}": v.tolist() for k, v in acc.per_block().items()})
    return acc.summary(), tp.summary("lm: forward tokens/s"), per_sample


def greedy(model: nn.Module, prompts: torch.Tensor, new_tokens: int, pad_id: int) -> torch.Tensor:
    """Exactly `new_tokens` greedy tokens after each prompt [B, P]; returns [B, new_tokens]."""
    if hasattr(model, "generate") and _is_hf(model):
        from transformers import GenerationConfig

        # min_new_tokens masks end-of-text, so both models always produce the full length and the
        # n-gram scores are not cut short by an early stop.
        config = GenerationConfig(
            do_sample=False, num_beams=1, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            pad_token_id=pad_id, use_cache=True,
        )  # fmt: skip
        out = model.generate(
            input_ids=prompts, attention_mask=torch.ones_like(prompts), generation_config=config
        )
        return out[:, prompts.shape[1] :]
    ids = prompts
    for _ in range(new_tokens):  # plain modules: no cache, recompute the prefix each step
        nxt = logits_of(model, ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids[:, prompts.shape[1] :]


def length_groups(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Indices batched by equal length (shortest first): prompts of one batch need no padding, so a plain
    module without an attention mask generates from them exactly as a padded HF model would."""
    by_length: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_length.setdefault(n, []).append(i)
    return [idx[s : s + batch_size] for n in sorted(by_length) for idx in [by_length[n]]
            for s in range(0, len(idx), batch_size)]  # fmt: skip


def run_generate(ref: nn.Module, cand: nn.Module, prompts: list[list[int]], tok: Tokenizer, new_tokens: int,
                 batch_size: int, device: torch.device, advance: Advance) -> tuple[dict, dict, dict]:  # fmt: skip
    """Greedy continuations by both of every prompt (token lists, any lengths); BLEU and ROUGE-L with the
    reference's outputs as references."""
    tp = Throughput()
    groups = length_groups([len(p) for p in prompts], batch_size)
    warm = torch.tensor([prompts[i] for i in groups[0]], dtype=torch.int64).to(device)
    greedy(ref, warm, 2, tok.pad_id), greedy(cand, warm, 2, tok.pad_id)
    ref_ids: list[list[int]] = [[] for _ in prompts]
    cand_ids: list[list[int]] = [[] for _ in prompts]
    for i, idx in enumerate(groups):
        p = torch.tensor([prompts[j] for j in idx], dtype=torch.int64).to(device)
        r, c = _timed_pair(
            i, tp, p.shape[0] * new_tokens, device, ref, cand, greedy, p, new_tokens, tok.pad_id
        )
        for j, rr, cc in zip(idx, r.cpu().tolist(), c.cpu().tolist()):
            ref_ids[j], cand_ids[j] = rr, cc
        advance(p.shape[0])
    ref_text = [tok.decode(r) for r in ref_ids]
    cand_text = [tok.decode(c) for c in cand_ids]
    rouge = rouge_l(cand_text, ref_text)
    same = [sum(a == b for a, b in zip(r, c)) for r, c in zip(ref_ids, cand_ids)]
    total = sum(len(r) for r in ref_ids)
    ref_words = [" ".join(map(str, r)) for r in ref_ids]
    cand_words = [" ".join(map(str, c)) for c in cand_ids]
    figures = {
        "bleu": bleu(cand_text, ref_text),
        # BLEU over token ids (each id one "word"): defined whatever the detokenized text looks like.
        "bleu_tokens": bleu(cand_words, ref_words),
        "rouge_l": sum(rouge) / len(rouge),
        "rouge_l_min": min(rouge),
        "token_agreement": sum(same) / total if total else None,
        "identical_outputs": sum(r == c for r, c in zip(ref_ids, cand_ids)) / len(ref_ids),
        "prompts": len(ref_ids),
        "prompt_tokens": int(max(len(p) for p in prompts)),
        "prompt_tokens_min": int(min(len(p) for p in prompts)),
        "new_tokens": new_tokens,
        "examples": [{"reference": r, "candidate": c} for r, c in zip(ref_text[:3], cand_text[:3])],
    }
    per_sample = {"rouge_l": rouge, "same_tokens": same, "new_tokens": [len(r) for r in ref_ids]}
    for prefix, (hyp, refs) in (("bleu", (cand_text, ref_text)), ("bleu_tokens", (cand_words, ref_words))):
        per_sample.update({f"{prefix}_{k}": v.tolist() for k, v in bleu_statistics(hyp, refs).items()})
    return figures, tp.summary("generate: new tokens/s (greedy, batch)"), per_sample


def run_embed(ref: nn.Module, cand: nn.Module, samples: list[list[int]], pad_id: int, batch_size: int,
              device: torch.device, advance: Advance) -> tuple[dict, dict, dict]:  # fmt: skip
    """Cosine similarity of the two models' mean-pooled last hidden states, per sample."""
    tp = Throughput()
    ids, mask = pad_batch(samples[:batch_size], pad_id)
    hidden_of(ref, ids.to(device), mask.to(device)), hidden_of(cand, ids.to(device), mask.to(device))
    cosines: list[float] = []
    for i, sl in enumerate(_batches(len(samples), batch_size)):
        ids, mask = pad_batch(samples[sl], pad_id)
        ids, mask = ids.to(device), mask.to(device)
        a, b = _timed_pair(i, tp, int(mask.sum()), device, ref, cand, _pooled, ids, mask)
        cosines += cosine_per_sample(a.cpu(), b.cpu()).tolist()
        advance(len(samples[sl]))
    figures = {
        "cosine_mean": sum(cosines) / len(cosines),
        "cosine_min": min(cosines),
        "samples": len(cosines),
        "pooling": "mean over non-padding tokens of the last hidden state",
    }
    return figures, tp.summary("embed: forward tokens/s"), {"cosine": cosines}


__all__ = ["greedy", "hidden_of", "length_groups", "logits_of", "run_embed", "run_generate", "run_lm"]
