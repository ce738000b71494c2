"""LoRA over a quantized base against LoRA over the high-precision model, same data, same steps (issue 29).

    python bench/lora_curves.py --model /tmp/realmodels/smol-hf --data /tmp/realmodels/calib.txt \
        --eval-data /tmp/realmodels/stdlib.txt --scheme fp8-dynamic --steps 60

Two runs of mixprec's fine-tuning loop (mixprec.finetune.loop.train: AdamW, warm-up and cosine learning rate,
next-token loss) on the same windows of `--data`, in the same order, with adapters of the same initial values
(peft's init under one seed): one over the model as loaded (fp32 compute of its weights), one over the model
quantized online with `--scheme`. Prints both loss curves (mean of every `--every` steps), then the held-out
verdict on `--eval-data`: each base before and after its adapters, and the quantized base + LoRA against the
high-precision base + LoRA (perplexity change with a paired 95 % interval, mixprec.finetune.verdict).
Then the quantized run's adapters merged into its base and rounded again (merge_lora: what merging costs),
and its adapter, saved in peft's format, loaded by plain peft on the high-precision model (what an adapter
trained on the quantized base does on the original) are scored too.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time

import torch
from peft import PeftModel

from mixprec.evaluation.models import load_dir
from mixprec.finetune.data import text_windows
from mixprec.finetune.loop import LoopSettings, train
from mixprec.finetune.lora import add_lora, merge_lora
from mixprec.finetune.verdict import recovery, score, table
from mixprec.hf import load_tokenizer
from mixprec.inference.runtime.online import apply_scheme_


def lora_run(base, windows, settings, rank: int, seed: int):
    for p in base.parameters():
        p.requires_grad_(False)
    torch.manual_seed(seed)  # peft draws lora_A from torch's generator: the same adapters on both bases
    model = add_lora(base, r=rank, lora_alpha=2 * rank, target_modules="all-linear")
    began = time.perf_counter()
    result = train(model, windows, settings, progress=False)
    return model, result.losses, time.perf_counter() - began


def curve(losses: list[float], every: int) -> list[float]:
    return [sum(losses[i : i + every]) / len(losses[i : i + every]) for i in range(0, len(losses), every)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--eval-data", required=True)
    ap.add_argument("--scheme", default="fp8-dynamic")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--held-out", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    tokenizer = load_tokenizer(args.model)
    windows = text_windows(args.data, tokenizer, args.seq_len)
    held = text_windows(args.eval_data, tokenizer, args.seq_len, what="--eval-data", limit=args.held_out)
    settings = LoopSettings(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed)
    original = load_dir(args.model, "reference").model.float()
    quantized = copy.deepcopy(original)
    apply_scheme_(quantized, args.scheme)
    scored_before = [score("original", original, held), score(f"{args.scheme} (no adapter)", quantized, held)]

    hp_model, hp_losses, hp_s = lora_run(copy.deepcopy(original), windows, settings, args.rank, args.seed)
    q_model, q_losses, q_s = lora_run(quantized, windows, settings, args.rank, args.seed)
    print(
        f"{args.steps} steps x {args.batch_size} windows of {args.seq_len} tokens, LoRA r={args.rank}, lr {args.lr}"
    )
    print(f"loop wall time: high precision {hp_s:.0f} s, {args.scheme} {q_s:.0f} s")
    print(f"| steps | high-precision base + LoRA | {args.scheme} base + LoRA |\n|---|---:|---:|")
    for i, (a, b) in enumerate(zip(curve(hp_losses, args.every), curve(q_losses, args.every))):
        print(f"| {i * args.every + 1}-{min((i + 1) * args.every, args.steps)} | {a:.4f} | {b:.4f} |")

    with tempfile.TemporaryDirectory() as tmp:
        q_model.save_pretrained(tmp)
        on_original = PeftModel.from_pretrained(copy.deepcopy(original), tmp)
        rows = [score(f"{args.scheme} + LoRA", q_model, held),
                score(f"{args.scheme} + LoRA merged, rounded again (merge_lora)", merge_lora(q_model), held),
                score(f"original + the {args.scheme} run's adapter (plain peft)", on_original, held)]  # fmt: skip
    reference = score("original + LoRA", hp_model, held)
    print("\nheld-out, against the high-precision base + LoRA:")
    print(table(recovery(reference, None, scored_before + rows, margin=0.01)))


if __name__ == "__main__":
    main()
