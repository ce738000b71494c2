"""What each fused group really costs on held-out text, against what `--scheme auto` predicted: the
diagnostic behind docs/auto.md's "Measured on a bf16 model trained by compare".

    python bench/auto_group_truth.py MODEL_DIR HELDOUT SCORES_JSON --blocks 400 --budgets 5.70 6.30 \
        --heuristics 1+1 2+1 --json truth.json

For every fused group (mixprec.select.fused_groups) and candidate of SCORES_JSON (an auto_scores.json
written by `mixprec quantize --scheme auto`), the model runs with that one group quantized (the
inference layers the checkpoint would hold: sensitivity.scores.candidate_layers) on BLOCKS windows of
128 tokens of HELDOUT: the change of the mean next-token NLL against the unquantized model, with a 95 %
normal interval over the blocks, and the mean KL from it. Then, for each budget, four choices of one
scheme per group: the heuristic of the same size (bench/auto_heuristic.py's: first/last blocks in
--high, the rest in --low), the automatic choice from the scores, and the exact choices that minimise
the measured held-out KL and the measured held-out NLL change (negative changes counted as 0): the
summed per-group figures of each and, run together, the measured NLL change and KL of the whole
configuration.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from transformers import AutoModelForCausalLM

from auto_heuristic import heuristic  # the same heuristic bench/auto_heuristic.py writes
from mixprec.hf import load_tokenizer
from mixprec.inference.calibration.data import load_texts, token_batches
from mixprec.sensitivity.allocation import allocate
from mixprec.sensitivity.automatic import read_scores
from mixprec.sensitivity.scores import KEPT, candidate_layers, candidate_schemes, run_instead


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("heldout")
    ap.add_argument("scores")
    ap.add_argument("--blocks", type=int, default=400)
    ap.add_argument("--budgets", type=float, nargs="+", required=True)
    ap.add_argument("--heuristics", nargs="+", required=True, help="K_FIRST+K_LAST per budget, e.g. 1+1")
    ap.add_argument("--high", default="fp8-dynamic", help="the heuristic's scheme for the first/last blocks")
    ap.add_argument("--low", default="nvfp4a16", help="the heuristic's scheme for the other blocks")
    ap.add_argument("--json")
    args = ap.parse_args()
    if len(args.budgets) != len(args.heuristics):
        raise SystemExit("give one --heuristics entry per --budgets entry")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    batches = token_batches(
        load_texts(args.heldout), load_tokenizer(args.model), args.blocks, 128, batch_size=25
    )
    scores = read_scores(args.scores)
    groups = scores.groups()
    candidates = [c for c in scores.candidates if c != KEPT]
    layers = candidate_layers(
        model, list(scores.shapes), candidate_schemes(candidates), {}, weight_dtype=torch.bfloat16
    )
    modules = dict(model.named_modules())
    with torch.no_grad():
        refs = [torch.log_softmax(model(input_ids=b).logits.float()[:, :-1], -1) for b in batches]
    tokens = sum(b[:, 1:].numel() for b in batches)

    @torch.no_grad()
    def run(assign: dict[str, str]) -> tuple[torch.Tensor, float]:
        """Per-block summed NLL and the mean KL with the Linears of `assign` in their schemes."""
        hooks = [run_instead(modules[m], layers.layer(m, c)) for m, c in assign.items() if c != KEPT]
        try:
            nll, kl = [], 0.0
            for b, ref in zip(batches, refs):
                logp = torch.log_softmax(model(input_ids=b).logits.float()[:, :-1], -1)
                nll.append(-logp.gather(-1, b[:, 1:, None])[..., 0].sum(1).double())
                kl += float((ref.exp() * (ref - logp)).sum())
            return torch.cat(nll), kl / tokens
        finally:
            for h in hooks:
                h.remove()

    base, _ = run({})
    truth: dict[str, dict[str, dict[str, float]]] = {}
    for g, members in groups.items():
        truth[g] = {}
        for c in candidates:
            nll, kl = run(dict.fromkeys(members, c))
            d = nll - base
            half = 1.96 * float(d.std()) * math.sqrt(len(d)) / tokens
            truth[g][c] = {"dnll": float(d.sum()) / tokens, "dnll_halfwidth": half, "kl": kl}
            print(f"{g}  {c}: dNLL {truth[g][c]['dnll']:+.2e} ± {half:.1e}  KL {kl:.2e}", flush=True)

    def measured_as_scores(key: str):
        out = read_scores(args.scores)
        for g, members in groups.items():
            sizes = [out.shapes[m][0] * out.shapes[m][1] for m in members]
            for c in candidates:
                for m, size in zip(members, sizes):
                    out.layers[m][c] = max(truth[g][c][key], 0.0) * size / sum(sizes)
        return out

    by_kl, by_nll = measured_as_scores("kl"), measured_as_scores("dnll")
    results = []
    for budget, heur in zip(args.budgets, args.heuristics):
        first, last = (int(k) for k in heur.split("+"))
        per_linear, _ = heuristic(args.model, first, last, args.high, args.low)
        choices = {
            f"heuristic {heur}": {g: per_linear[members[0]] for g, members in groups.items()},
            "auto (scores)": allocate(scores, budget).groups,
            "least measured KL": allocate(by_kl, budget).groups,
            "least measured dNLL": allocate(by_nll, budget).groups,
        }
        for name, chosen in choices.items():
            summed = {k: sum(truth[g][c][k] for g, c in chosen.items() if c != KEPT) for k in ("dnll", "kl")}
            nll, kl = run({m: chosen[g] for g, ms in groups.items() for m in ms})
            row = {"budget": budget, "choice": name, "summed_dnll": summed["dnll"], "summed_kl": summed["kl"],
                   "measured_dnll": float((nll - base).sum()) / tokens, "measured_kl": kl, "groups": chosen}  # fmt: skip
            results.append(row)
            print(f"budget {budget:.3f} {name:20s} summed dNLL {summed['dnll']:+.2e} KL {summed['kl']:.2e} | "
                  f"together dNLL {row['measured_dnll']:+.2e} KL {kl:.2e}", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"tokens": tokens, "blocks": len(base), "groups": truth, "choices": results}, f, indent=1
            )


if __name__ == "__main__":
    main()
