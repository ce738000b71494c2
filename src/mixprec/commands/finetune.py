"""`mixprec finetune`: QAT for a scheme, or LoRA adapters over its quantized form, then a verdict against
the original and round to nearest on held-out text (mixprec/finetune/runner.py says which --model and
--mode combinations do what). Under torchrun it runs data-parallel (--dp ddp or fsdp2): each rank trains its
share of every batch; rank 0 scores the verdict, prints and writes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mixprec.commands import torchrun
from mixprec.commands.extras import require
from mixprec.distributed.prepare import STRATEGIES
from mixprec.finetune.loop import LoopSettings
from mixprec.finetune.runner import MODES, REPORT_NAME, FinetuneJob, finetune
from mixprec.finetune.verdict import table
from mixprec.inference.schemes import SCHEMES
from mixprec.ranks import launched_rank

NAME = "finetune"
KEEPS_FREED_MEMORY = True  # its GEMM emulation runs faster so (mixprec.kernels.allocator)
TORCHRUN = True  # runs data-parallel under torchrun (mixprec.cli lets it through)
HELP = (
    "fine-tune for a quantization scheme (QAT) or LoRA adapters over the quantized model, with an optional "
    "teacher (distillation); judged against the original and round to nearest on held-out text"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", required=True, type=Path, help="the original model, or a quantized checkpoint"
    )
    parser.add_argument("--scheme", required=True, choices=sorted(SCHEMES), help="the scheme trained for")
    parser.add_argument("--mode", required=True, choices=MODES, help="qat: train the weights for the scheme; "
                        "lora: train adapters over the quantized model")  # fmt: skip
    parser.add_argument(
        "--data", required=True, type=Path, help="fine-tuning text (.txt, .jsonl or a folder)"
    )
    parser.add_argument(
        "--output", required=True, type=Path, help="qat: the quantized checkpoint; lora: the adapter"
    )
    parser.add_argument("--teacher", type=Path, default=None,
                        help="the original model: distil from it (KL on logits) and judge against it")  # fmt: skip
    parser.add_argument("--eval-data", type=Path, action="append", default=[],
                        help="another held-out text with its own verdict, e.g. another corpus (repeatable; the "
                        "last --held-out windows of --data, never trained on, are always scored)")  # fmt: skip
    parser.add_argument(
        "--held-out", type=int, default=16, help="windows the verdict scores (default: %(default)s)"
    )
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=4, help="windows per step (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per window (default: %(default)s)")
    parser.add_argument(
        "--lr", type=float, default=None, help="peak learning rate (default: 1e-5 qat, 1e-4 lora)"
    )
    parser.add_argument("--warmup-steps", type=int, default=10, help="linear warm-up (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=1.0, help="of the distillation (default: 1)")
    parser.add_argument("--save-every", type=int, default=50, help="steps between resumable states")
    parser.add_argument("--seed", type=int, default=0, help="the batches' order (default: %(default)s)")
    parser.add_argument("--lora-rank", type=int, default=16, help="LoRA rank r (default: %(default)s)")
    parser.add_argument("--lora-alpha", type=float, default=32.0, help="LoRA alpha (default: %(default)s)")
    parser.add_argument(
        "--lora-targets", default="all-linear", help="peft target_modules (default: %(default)s)"
    )
    parser.add_argument("--compare-gptq", action="store_true",
                        help="also score GPTQ (from an original --model) in the verdict")  # fmt: skip
    parser.add_argument("--margin", type=float, default=0.01,
                        help="perplexity change judged equivalent to the original (default: 1%%)")  # fmt: skip
    parser.add_argument(
        "--resume", action="store_true", help="continue a killed run from its last saved state"
    )
    parser.add_argument("--force", action="store_true", help="replace --output; discard an unfinished run")
    parser.add_argument("--dp", choices=[s for s in STRATEGIES if s != "none"], default="ddp",
                        help="under torchrun: DistributedDataParallel or FSDP2 (default: %(default)s)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def job_from_args(args: argparse.Namespace) -> FinetuneJob:
    lr = args.lr if args.lr is not None else (1e-5 if args.mode == "qat" else 1e-4)
    loop = LoopSettings(steps=args.steps, batch_size=args.batch_size, lr=lr, warmup_steps=args.warmup_steps,
                        seed=args.seed, save_every=args.save_every, temperature=args.temperature)  # fmt: skip
    return FinetuneJob(
        model=args.model, scheme=args.scheme, mode=args.mode, data=args.data, output=args.output,
        teacher=args.teacher, eval_data=tuple(args.eval_data), held_out=args.held_out, seq_len=args.seq_len,
        loop=loop, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, lora_targets=args.lora_targets,
        compare_gptq=args.compare_gptq, margin=args.margin, resume=args.resume, force=args.force,
        progress=not args.quiet, data_parallel=args.dp,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    needs = {"transformers": "the models"} | ({"peft": "LoRA adapters"} if args.mode == "lora" else {})
    require(NAME, needs)
    job = job_from_args(args)
    with torchrun.session() as world:
        torchrun.check_batch(args.batch_size, world)
        report = finetune(job)
    if launched_rank() != 0:  # rank 0 prints (the process group is gone by now)
        return 0
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    losses = report["training"]["losses"]
    print(f"{args.mode} for {args.scheme}: {len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f} "
          f"({report['seconds']:.0f} s); written to {args.output} ({REPORT_NAME})")  # fmt: skip
    if not report["verdicts"]:
        print("no verdict: a quantized --model needs --teacher (the original) to be judged against")
    for verdict in report["verdicts"]:
        print(f"\n{verdict['text']}\n{table(verdict)}")
    return 0
