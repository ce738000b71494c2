"""mixprec's algorithms beside llm-compressor's on one model and the same tokens (issue 28), in one go:

    python bench/algorithms_side_by_side.py --model /tmp/realmodels/smol-hf --calib /tmp/realmodels/calib.txt \\
        --data /tmp/realmodels/stdlib.txt --work /tmp/side --schemes nvfp4a16 \\
        --mixprec rtn gptq --llmc rtn gptq [--llmc-python /work/llmc-venv/bin/python] [--reuse]

For each scheme: `mixprec quantize --algorithm R` for each --mixprec recipe (calibrated on --samples x --seq-len
tokens of --calib), then bench/anchor_llmcompressor.py in llm-compressor's venv for each --llmc recipe, on the
same calibration tokens (mixprec's own windows; the token hashes are compared) and with the modules mixprec kept
in high precision as its ignore list; then `mixprec evaluate --task lm` scores every checkpoint against the
bf16 model on --eval-samples x --eval-seq-len tokens of --data (held out from --calib: a different file), with
paired 95 % bootstrap intervals. Prints a markdown table: tool, recipe, scheme, bits per weight (over the
quantized Linears), file size, perplexity change [interval], quantize wall time (the anchor's from after
its imports), the whole process's wall time, and peak RSS.

WORK/runs/NAME.json holds each quantize run's record and WORK/eval/NAME.json its evaluate report (NAME is
tool-recipe-scheme); --reuse takes those that exist instead of running again. --adopt NAME=DIR,TIMELOG[,EVAL]
takes a checkpoint made earlier, its wall time and peak RSS read from a GNU `/usr/bin/time -v` log, and
optionally its evaluate JSON, made with the same evaluate settings.

--val-data (bench/make_smollm2.py writes val.txt, disjoint from the windows scored on stdlib.txt) also scores
every checkpoint on --val-samples x --val-seq-len tokens of that validation split (WORK/val/NAME.json); each
tool's best recipe per scheme is the one of least validation perplexity change, and a second table gives, on
the held-out split, mixprec's best minus llm-compressor's best with its paired interval beside a tenth of
mixprec's RTN gap (issue 28's bound: an upper end at most that reads "no worse").
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from anchor_llmcompressor import RECORD, checkpoint_stats
from child_rss import run_measured
from gap_closed import blocks, change_minus, same_blocks
from mixprec.verdicts import paired_bootstrap
from mixprec.verdicts import perplexity_change as ppl_change

ANCHOR = Path(__file__).resolve().parent / "anchor_llmcompressor.py"
MIXPREC_RECIPES = (
    "rtn",
    "gptq",
)  # the default; any value of `mixprec quantize --algorithm` ("awq,gptq") goes
LLMC_RECIPES = ("rtn", "gptq", "awq", "awq+gptq")


@dataclass
class Run:
    tool: str  # "mixprec" | "llm-compressor"
    recipe: str
    scheme: str
    output: str
    wall_seconds: float | None
    peak_rss_mib: float | None
    bits_per_weight: float | None = None
    file_bytes: int | None = None
    tokens_sha256: str | None = None  # the calibration token ids' hash (None: no calibration run)
    # the whole process, start-up and imports included (mixprec's wall_seconds is already that; the
    # anchor's wall_seconds starts after its imports)
    process_seconds: float | None = None

    @property
    def name(self) -> str:
        return f"{'llmc' if self.tool == 'llm-compressor' else 'mixprec'}-{slug(self.recipe)}-{self.scheme}"


def slug(recipe: str) -> str:
    """A recipe in a file name: awq+gptq (llm-compressor) and awq,gptq (mixprec) both read awq-gptq."""
    return recipe.replace("+", "-").replace(",", "-")


def parse_time_v(text: str) -> tuple[float, float]:
    """(wall seconds, peak RSS in MiB) from GNU time's -v report."""
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", text)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    if not wall or not rss:
        raise ValueError("not a GNU `time -v` report: no wall clock time or maximum resident set size line")
    seconds = 0.0
    for part in wall.group(1).split(":"):
        seconds = seconds * 60 + float(part)
    return seconds, int(rss.group(1)) / 1024


def timed(cmd: list[str], log: Path) -> tuple[float, float]:
    """Run cmd (output to log); (wall seconds, the child's own peak RSS in MiB)."""
    wall, code, peak = run_measured(cmd, log)
    if code:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed ({code}); see {log}")
    return wall, peak / 2**20


def calibration_hash(directory: Path) -> str | None:
    """The calibration tokens' sha256 a checkpoint records: mixprec's mixprec_algorithm.json `data_sha256`
    (sha256 over its batches' int64 ids; a fold-only run's in its folds' records), or the anchor's
    `tokens_sha256` (the same bytes); None if none."""
    mixprec_side, anchor_side = directory / "mixprec_algorithm.json", directory / RECORD
    if mixprec_side.exists():
        doc = json.loads(mixprec_side.read_text())
        folds = [f.get("data_sha256") for f in (doc.get("folds") or {}).values()]
        return doc.get("data_sha256") or next((h for h in folds if h), None)
    return json.loads(anchor_side.read_text()).get("tokens_sha256") if anchor_side.exists() else None


def kept_by(directory: Path) -> list[str]:
    """The modules a quantized checkpoint kept in high precision (its compressed-tensors ignore list)."""
    config = json.loads((directory / "config.json").read_text()).get("quantization_config") or {}
    return list(config.get("ignore") or ["lm_head"])


def quantize_mixprec(args: argparse.Namespace, recipe: str, scheme: str) -> Run:
    out = args.work / f"mixprec-{recipe}-{scheme}"
    cmd = [sys.executable, "-m", "mixprec", "quantize", "--model", str(args.model), "--output", str(out),
           "--scheme", scheme, "--algorithm", recipe, "--force", "--quiet", "--json"]  # fmt: skip
    if recipe != "rtn" or not scheme.endswith("a16"):  # activation scales (nvfp4) are calibrated too
        cmd += ["--calib-data", str(args.calib), "--calib-samples", str(args.samples),
                "--calib-seq-len", str(args.seq_len)]  # fmt: skip
    wall, rss = timed(cmd, args.work / "runs" / f"mixprec-{recipe}-{scheme}.log")
    return Run(
        "mixprec",
        recipe,
        scheme,
        str(out),
        round(wall, 2),
        round(rss, 1),
        tokens_sha256=calibration_hash(out),
        process_seconds=round(wall, 2),
    )


def quantize_llmc(args: argparse.Namespace, recipe: str, scheme: str, ignore: list[str]) -> Run:
    run = Run("llm-compressor", recipe, scheme, "", None, None)
    out, record = args.work / run.name, args.work / "runs" / f"{run.name}.anchor.json"
    cmd = [str(args.llmc_python), str(ANCHOR), "--model", str(args.model), "--output", str(out),
           "--scheme", scheme, "--recipe", recipe, "--calib", str(args.calib), "--samples", str(args.samples),
           "--seq-len", str(args.seq_len), "--json", str(record), "--ignore", *ignore]  # fmt: skip
    process, _ = timed(cmd, args.work / "runs" / f"{run.name}.log")
    line = json.loads(record.read_text())
    run.output, run.wall_seconds, run.peak_rss_mib = str(out), line["wall_seconds"], line["peak_rss_mib"]
    run.process_seconds = round(process, 2)
    run.tokens_sha256 = line["tokens_sha256"]
    return run


def evaluate(args: argparse.Namespace, run: Run, split: str = "eval") -> Path:
    """Score run's checkpoint on the held-out split ("eval": --data) or the validation split ("val")."""
    data, samples, seq_len = (
        (args.data, args.eval_samples, args.eval_seq_len)
        if split == "eval"
        else (args.val_data, args.val_samples, args.val_seq_len)
    )
    report = args.work / split / f"{run.name}.json"
    if args.reuse and report.exists():
        return report
    cmd = [sys.executable, "-m", "mixprec", "evaluate", "--reference", str(args.model), "--candidate", run.output,
           "--data", str(data), "--task", "lm", "--samples", str(samples),
           "--seq-len", str(seq_len), "--json", str(report), "--force", "--no-progress"]  # fmt: skip
    timed(cmd, args.work / split / f"{run.name}.log")
    return report


def perplexity_change(report: dict) -> tuple[float, float, float]:
    iv = report["tasks"]["lm"]["intervals"]["perplexity_relative_change"]
    return iv["estimate"], iv["low"], iv["high"]


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def table(rows: list[tuple[Run, dict | None]]) -> str:
    """The markdown table, one line per run (its evaluate report, or None when not scored)."""
    lines = ["| tool | recipe | scheme | bits/weight | file size | perplexity change [95 %] | wall | process | peak RSS |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for run, report in rows:
        if report is None:
            change = "(not scored)"
        else:
            est, low, high = perplexity_change(report)
            change = f"{est:+.2%} [{low:+.2%}, {high:+.2%}]"
        bits = f"{run.bits_per_weight:.3f}" if run.bits_per_weight else "-"
        size = f"{run.file_bytes / 2**20:.1f} MiB" if run.file_bytes else "-"
        wall = "-" if run.wall_seconds is None else _duration(run.wall_seconds)
        process = "-" if run.process_seconds is None else _duration(run.process_seconds)
        rss = f"{run.peak_rss_mib / 1024:.2f} GiB" if run.peak_rss_mib is not None else "-"
        lines.append(
            f"| {run.tool} | {run.recipe} | {run.scheme} | {bits} | {size} | {change} | {wall} | {process} | {rss} |"
        )
    return "\n".join(lines)


def adopt(spec: str, work: Path) -> Run:
    """--adopt NAME=DIR,TIMELOG[,EVAL]: an earlier checkpoint's run record (and evaluate report) in WORK."""
    name, _, rest = spec.partition("=")
    parts = rest.split(",")
    tool, _, rest = name.partition("-")
    recipe, _, scheme = rest.rpartition("-")
    recipe = recipe.replace("-", "+" if tool == "llmc" else ",")  # llmc-awq-gptq-nvfp4a16: awq+gptq
    if tool not in ("mixprec", "llmc") or len(parts) not in (2, 3):
        raise SystemExit(f"--adopt {spec}: expected (mixprec|llmc)-RECIPE-SCHEME=DIR,TIMELOG[,EVAL]")
    wall, rss = parse_time_v(Path(parts[1]).read_text())
    run = Run("mixprec" if tool == "mixprec" else "llm-compressor", recipe, scheme, parts[0], round(wall, 2),
              round(rss, 1), tokens_sha256=calibration_hash(Path(parts[0])))  # fmt: skip
    if len(parts) == 3:
        (work / "eval" / f"{run.name}.json").write_text(Path(parts[2]).read_text())
    return run


def collect(args: argparse.Namespace) -> list[Run]:
    runs: list[Run] = []
    adopted = {r.name: r for r in (adopt(spec, args.work) for spec in args.adopt)}
    for scheme in args.schemes:
        ignore = ["lm_head"]
        todo = [("mixprec", r) for r in args.mixprec] + [("llmc", r) for r in args.llmc]
        for tool, recipe in todo:
            name = f"{tool}-{slug(recipe)}-{scheme}"
            record = args.work / "runs" / f"{name}.json"
            if name in adopted:
                run = adopted[name]
            elif args.reuse and record.exists():
                run = Run(**json.loads(record.read_text()))
            elif tool == "mixprec":
                run = quantize_mixprec(args, recipe, scheme)
            else:
                run = quantize_llmc(args, recipe, scheme, ignore)
            stats = checkpoint_stats(run.output)
            run.bits_per_weight, run.file_bytes = stats["bits_per_weight"], stats["file_bytes"]
            record.write_text(json.dumps(asdict(run), indent=1))
            if tool == "mixprec":
                ignore = kept_by(Path(run.output))  # llm-compressor keeps what mixprec kept
            runs.append(run)
    return runs


def same_tokens(runs: list[Run]) -> str:
    hashes = {r.tokens_sha256 for r in runs if r.tokens_sha256}
    if not hashes:
        return "no calibration run"
    return "identical calibration tokens (one sha256)" if len(hashes) == 1 else f"DIFFERENT calibration tokens: {sorted(hashes)}"  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--calib", type=Path, required=True, help="calibration text")
    p.add_argument("--data", type=Path, required=True, help="evaluation text, held out from --calib")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--schemes", nargs="+", default=["nvfp4a16"], choices=["nvfp4a16", "nvfp4", "mxfp4a16"])
    p.add_argument("--mixprec", nargs="*", default=list(MIXPREC_RECIPES), help="--algorithm values")
    p.add_argument("--llmc", nargs="*", default=["rtn", "gptq"], choices=LLMC_RECIPES)
    p.add_argument("--llmc-python", type=Path, default=Path("/work/llmc-venv/bin/python"))
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--eval-samples", type=int, default=64)
    p.add_argument("--eval-seq-len", type=int, default=512)
    p.add_argument(
        "--val-data",
        type=Path,
        help="validation text (another file): each tool's best recipe "
        "per scheme is the one of least perplexity change on it, reported on --data",
    )
    p.add_argument("--val-samples", type=int, default=32)
    p.add_argument("--val-seq-len", type=int, default=512)
    p.add_argument("--adopt", nargs="*", default=[], metavar="NAME=DIR,TIMELOG[,EVAL]")
    p.add_argument("--reuse", action="store_true", help="take runs and reports already in --work")
    p.add_argument("--no-eval", action="store_true", help="quantize only; the table has no perplexity")
    args = p.parse_args(argv)
    if args.calib.resolve() == args.data.resolve():
        p.error("--data must be held out from --calib (another file)")
    if args.val_data and args.val_data.resolve() in (args.calib.resolve(), args.data.resolve()):
        p.error("--val-data must be another file than --calib and --data")
    if args.eval_samples * args.eval_seq_len < 64 * 128:
        p.error("the held-out split needs at least 64 x 128 tokens")
    if args.llmc and not args.llmc_python.exists():
        p.error(f"--llmc-python {args.llmc_python} not found (llm-compressor's own venv)")
    return args


def best_by_validation(runs: list[Run], val: dict[str, dict]) -> dict[tuple[str, str], Run]:
    """{(scheme, tool): the run of least validation perplexity change}: each tool's best recipe."""
    best: dict[tuple[str, str], Run] = {}
    for run in runs:
        key = (run.scheme, run.tool)
        if key not in best or perplexity_change(val[run.name])[0] < perplexity_change(val[best[key].name])[0]:
            best[key] = run
    return best


def best_table(args: argparse.Namespace, runs: list[Run], val: dict[str, dict]) -> str:
    """Per scheme: each tool's recipe chosen on the validation split, its held-out change, and mixprec's best
    minus llm-compressor's best on the held-out split (paired interval) beside a tenth of RTN's gap."""
    best = best_by_validation(runs, val)
    lines = ["| scheme | mixprec's best (validation change) | llm-compressor's best (validation change) | "
             "held-out: mixprec's best minus llm-compressor's [95 %] | a tenth of RTN's gap |",
             "|---|---|---|---:|---:|"]  # fmt: skip
    for scheme in args.schemes:
        mine, theirs = best.get((scheme, "mixprec")), best.get((scheme, "llm-compressor"))
        rtn = next(
            (r for r in runs if r.scheme == scheme and r.tool == "mixprec" and r.recipe == "rtn"), None
        )
        if mine is None or theirs is None or rtn is None:
            continue
        held = {r.name: args.work / "eval" / f"{r.name}.json" for r in (mine, theirs, rtn)}
        ref, base, tokens, _ = blocks(held[rtn.name])
        _, cand = same_blocks(held[mine.name], ref, tokens, held[rtn.name])
        _, anchor = same_blocks(held[theirs.name], ref, tokens, held[rtn.name])
        d = paired_bootstrap(change_minus, ref, anchor, cand, tokens)
        tenth = float(ppl_change(ref, base, tokens)) / 10  # as gap_closed.py states the bound
        chosen = [f"{r.recipe} ({perplexity_change(val[r.name])[0]:+.2%})" for r in (mine, theirs)]
        lines.append(f"| {scheme} | {chosen[0]} | {chosen[1]} | "
                     f"{d.estimate:+.2%} [{d.low:+.2%}, {d.high:+.2%}] | {tenth:.2%} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for sub in ("runs", "eval", "val"):
        (args.work / sub).mkdir(parents=True, exist_ok=True)
    runs = collect(args)
    rows = [(r, None if args.no_eval else json.loads(evaluate(args, r).read_text())) for r in runs]
    print(table(rows))
    print(
        f"\n{same_tokens(runs)}; evaluated on {args.eval_samples} x {args.eval_seq_len} tokens of {args.data}"
    )
    if args.val_data and not args.no_eval:
        val = {r.name: json.loads(evaluate(args, r, "val").read_text()) for r in runs}
        print(
            f"\nBest recipes, chosen on {args.val_samples} x {args.val_seq_len} tokens of {args.val_data}:\n"
        )
        print(best_table(args, runs, val))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
