"""Quantized checkpoints judged against one original on the same held-out windows, in one table (issue 29).

    python bench/score_checkpoints.py --model /tmp/realmodels/smol-hf --scheme nvfp4a16 \
        --data /tmp/realmodels/stdlib.txt --windows 32 --seq-len 256 \
        gptq=/tmp/runs/gptq gptq-then-qat=/tmp/runs/gptq-qat qat=/tmp/runs/qat

`mixprec finetune` judges one run against its own starting point; this puts several runs (GPTQ, QAT from
the original, GPTQ-then-QAT) on one footing: the original model, round to nearest of `--scheme` (computed
here from the original) and every NAME=DIR checkpoint are scored on the same `--windows` windows of
`--data` (mixprec.finetune.verdict.score), and the verdict gives each checkpoint's perplexity change
against the original and the share of RTN's gap it closes, with paired 95 % intervals over windows.
The windows are the ones `mixprec finetune --eval-data` scores (mixprec.finetune.data.text_windows), so
the rows line up with a fine-tune's report; bench/gap_closed.py does the same from `mixprec evaluate`
files, on evaluate's blocks.
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

from mixprec.evaluation.models import load_dir
from mixprec.finetune.data import text_windows
from mixprec.finetune.verdict import recovery, score, table
from mixprec.hf import load_tokenizer
from mixprec.inference.runtime.online import apply_scheme_


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, type=Path, help="the original model")
    ap.add_argument("--scheme", required=True, help="the scheme whose RTN is the baseline")
    ap.add_argument("--data", required=True, type=Path, help="held-out text")
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--margin", type=float, default=0.01)
    ap.add_argument("checkpoints", nargs="+", help="NAME=DIR of each quantized checkpoint")
    args = ap.parse_args()
    named = [item.split("=", 1) for item in args.checkpoints]
    if any(len(pair) != 2 for pair in named):
        ap.error("each checkpoint is NAME=DIR")
    began = time.perf_counter()
    windows = text_windows(
        args.data, load_tokenizer(args.model), args.seq_len, what="--data", limit=args.windows
    )
    original = load_dir(args.model, "reference").model.float()
    rtn = copy.deepcopy(original)
    apply_scheme_(rtn, args.scheme)
    reference = score("original", original, windows)
    baseline = score(f"{args.scheme} RTN", rtn, windows)
    del rtn
    candidates = [
        score(name, load_dir(Path(path), "candidate").model.float(), windows) for name, path in named
    ]
    print(
        f"{args.data}: {windows.shape[0]} windows of {args.seq_len} tokens ({time.perf_counter() - began:.0f} s)"
    )
    print(table(recovery(reference, baseline, candidates, margin=args.margin)))


if __name__ == "__main__":
    main()
