"""`--scheme auto` against uniform schemes and the first/last-blocks heuristic: the table and the
predicted-vs-measured curve of docs/auto.md, from `mixprec evaluate --json` files.

    python bench/auto_budget_curve.py --dir RUN_DIR --out curve.png > table.md

RUN_DIR holds the checkpoints and their evaluations, all against the same reference and text:
    auto-<budget>/            `mixprec quantize --scheme auto --budget <budget>` (its auto_report.json
                              gives the bits per weight and the predicted score)
    heur-<k_first>+<k_last>/  the heuristic: the first and last blocks in the higher-precision scheme
    <uniform>/                uniform schemes (e.g. nvfp4a16, fp8)
    ev-<name>.json            `mixprec evaluate --reference REF --candidate <name> --json ev-<name>.json`

Every figure is the evaluation's own (perplexity change against the reference with its 95 % paired
bootstrap interval). Each automatic checkpoint is also compared with every other checkpoint no larger
than its budget on the same blocks: the relative perplexity difference, exp(mean NLL_auto) /
exp(mean NLL_other) - 1 (mean over the scored tokens), and the difference of the mean next-token KL
from the reference, each with a paired bootstrap interval over the blocks (mixprec.verdicts).
Sizes are bits per weight of the scored Linears, scales counted (InferenceScheme.stored_bits), read
from the checkpoints' tensors.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from mixprec.inference.checkpoint.safetensors_io import open_checkpoint
from mixprec.verdicts import paired_bootstrap


def _evaluation(path: Path) -> dict:
    doc = json.loads(path.read_text())
    lm, per = doc["tasks"]["lm"], doc["per_sample"]
    return {
        "ppl_ref": lm["reference_perplexity"],
        "ppl": lm["candidate_perplexity"],
        "change": lm["intervals"]["perplexity_relative_change"],
        "kl": lm["kl_mean"],
        "nll": torch.tensor(per["lm.block_candidate_nll"], dtype=torch.float64),
        "ref_nll": torch.tensor(per["lm.block_reference_nll"], dtype=torch.float64),
        "tokens": torch.tensor(per["lm.block_tokens"], dtype=torch.float64),
        "block_kl": torch.tensor(per["lm.block_kl"], dtype=torch.float64),
    }


def _bits_per_weight(directory: Path) -> float:
    """Bits of every quantized Linear's weight* / input* tensors and every Linear left in high precision,
    per weight of those Linears (the count `--budget` uses: scales included, biases not)."""
    ckpt = open_checkpoint(directory)
    config = json.loads((directory / "config.json").read_text())["quantization_config"]
    linears = set(config.get("ignore", []))
    for group in config["config_groups"].values():
        linears |= set(t for t in group["targets"] if t != "Linear")
    names = ckpt.tensors
    if any(t == "Linear" for g in config["config_groups"].values() for t in g["targets"]):
        linears |= {n.rsplit(".", 1)[0] for n in names if n.endswith((".weight_scale", ".weight_packed"))}
    linears.discard("lm_head")
    bits = weights = 0
    for name in linears:
        stored = {k: v for k, v in names.items() if k.rsplit(".", 1)[0] == name}
        for key, info in stored.items():
            leaf = key.rsplit(".", 1)[1]
            if leaf.startswith(("weight", "input")):
                bits += info.nbytes * 8
            if leaf in ("weight", "weight_packed"):
                rows, cols = info.shape
                weights += rows * cols * (2 if leaf == "weight_packed" else 1)
    return bits / weights


def _relative(a: dict, b: dict):
    """exp(mean NLL a) / exp(mean NLL b) - 1 over the same blocks, with its paired bootstrap interval."""

    def stat(na, nb, tok):
        return torch.exp((na.sum(-1) - nb.sum(-1)) / tok.sum(-1)) - 1

    return paired_bootstrap(stat, a["nll"], b["nll"], a["tokens"])


def _kl_difference(a: dict, b: dict):
    """mean KL a - mean KL b (nats per token, against the same reference) over the same blocks, paired."""

    def stat(ka, kb, tok):
        return (ka.sum(-1) - kb.sum(-1)) / tok.sum(-1)

    return paired_bootstrap(stat, a["block_kl"], b["block_kl"], a["tokens"])


def _verdict(iv) -> str:
    return "yes" if iv.high < 0 else ("no" if iv.low > 0 else "not distinguishable")


def _read_rows(directory: Path) -> dict[str, dict]:
    """{checkpoint name: its evaluation, bits per weight and, for an automatic one, its predicted score}."""
    rows = {}
    for ev in sorted(directory.glob("ev-*.json")):
        name = ev.stem[3:]
        if not (directory / name / "config.json").exists():
            continue
        row = _evaluation(ev)
        row["bits"] = _bits_per_weight(directory / name)
        report = directory / name / "auto_report.json"
        if report.exists():
            doc = json.loads(report.read_text())
            row["predicted"] = doc["chosen"]["predicted_score"]
            row["schemes"] = doc["chosen"]["schemes"]
            row["budget"] = doc["budget"].get("bits") or row["bits"]
        rows[name] = row
    if not rows:
        raise SystemExit(f"{directory}: no ev-<name>.json beside a checkpoint folder <name>/config.json")
    return rows


def _print_tables(rows: dict[str, dict]) -> None:
    """The checkpoints by size, then each automatic one against every smaller non-automatic one."""
    refs = {round(r["ppl_ref"], 9) for r in rows.values()}
    if len(refs) != 1:
        raise SystemExit(
            f"the evaluations have different reference perplexities {sorted(refs)}: not comparable"
        )
    print(f"reference perplexity {refs.pop():.3f}; blocks {len(next(iter(rows.values()))['nll'])}\n")
    print(
        "| checkpoint | bits per weight | perplexity | change [95 % interval] | KL mean | predicted score | schemes |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in sorted(rows.items(), key=lambda kv: kv[1]["bits"]):
        c = r["change"]
        schemes = ", ".join(f"{k} {v}" for k, v in r.get("schemes", {}).items()) or "-"
        pred = f"{r['predicted']:.3e}" if "predicted" in r else "-"
        print(f"| {name} | {r['bits']:.3f} | {r['ppl']:.3f} | {c['estimate'] * 100:+.2f} % [{c['low'] * 100:+.2f} %, "
              f"{c['high'] * 100:+.2f} %] | {r['kl']:.4f} | {pred} | {schemes} |")  # fmt: skip
    print(
        "\nEach automatic checkpoint against every checkpoint that is not automatic and no larger than its budget "
        "(+ 0.01 bits; the heuristics' sizes were the budgets), paired on the same blocks:\n"
    )
    print("| automatic | other | bits (auto / other) | perplexity difference [95 % interval] | lower "
          "| KL mean difference (nats) [95 %] | lower KL |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, r in sorted(rows.items(), key=lambda kv: kv[1]["bits"]):
        if "predicted" not in r:
            continue
        for other, o in sorted(rows.items(), key=lambda kv: kv[1]["bits"]):
            if "predicted" in o or o["bits"] > r["budget"] + 0.01:
                continue
            iv, kl = _relative(r, o), _kl_difference(r, o)
            print(f"| {name} | {other} | {r['bits']:.3f} / {o['bits']:.3f} | {iv.estimate * 100:+.2f} % "
                  f"[{iv.low * 100:+.2f} %, {iv.high * 100:+.2f} %] | {_verdict(iv)} | {kl.estimate:+.5f} "
                  f"[{kl.low:+.5f}, {kl.high:+.5f}] | {_verdict(kl)} |")  # fmt: skip


def _plot(rows: dict[str, dict], directory: Path, out: Path) -> None:
    """Measured change against size (left) and predicted score against measured change (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for kind, marker in (("auto", "o"), ("heur", "s"), ("", "^")):
        pick = {
            n: r
            for n, r in rows.items()
            if (n.startswith(kind) if kind else not n.startswith(("auto", "heur")))
        }
        if not pick:
            continue
        xs = [r["bits"] for r in pick.values()]
        ys = [r["change"]["estimate"] * 100 for r in pick.values()]
        err = [[(r["change"]["estimate"] - r["change"]["low"]) * 100 for r in pick.values()],
               [(r["change"]["high"] - r["change"]["estimate"]) * 100 for r in pick.values()]]  # fmt: skip
        label = {"auto": "--scheme auto", "heur": "first/last blocks heuristic", "": "uniform"}[kind]
        left.errorbar(xs, ys, yerr=err, fmt=marker, capsize=3, label=label)
        for n, x, y in zip(pick, xs, ys):
            if kind != "auto":  # the automatic points are read off the x axis
                left.annotate(n, (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
    left.set_xlabel("bits per weight (scales counted)")
    left.set_ylabel("perplexity change vs bf16 (%)")
    left.set_title("measured (mixprec evaluate, 95 % intervals)")
    left.legend(fontsize=8)
    auto = sorted((r for r in rows.values() if "predicted" in r), key=lambda r: r["predicted"])
    right.plot([r["predicted"] for r in auto], [math.log(r["ppl"] / r["ppl_ref"]) for r in auto], "o-",
               label="--scheme auto")  # fmt: skip
    # the uniform schemes' predicted scores, from an automatic report (the same scores file)
    report = next(directory.glob("auto-*/auto_report.json"), None)
    uniform = json.loads(report.read_text())["uniform"] if report else {}
    names = {"fp8": "fp8-dynamic"}
    for name, r in rows.items():
        score = uniform.get(names.get(name, name), {}).get("predicted_score")
        if score is not None and "predicted" not in r:
            right.plot([score], [math.log(r["ppl"] / r["ppl_ref"])], "^", color="tab:green")
            right.annotate(f"uniform {name}", (score, math.log(r["ppl"] / r["ppl_ref"])), fontsize=7,
                           xytext=(-60, 4), textcoords="offset points")  # fmt: skip
    right.legend(fontsize=8)
    right.set_xlabel("predicted score (sum of gradient-weighted output errors)")
    right.set_ylabel("measured log(perplexity ratio)")
    right.set_title("--scheme auto: predicted vs measured")
    # scores are small: one exponent beside the axis instead of long, overlapping tick labels
    right.ticklabel_format(axis="x", style="sci", scilimits=(0, 0))
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, type=Path)
    ap.add_argument("--out", type=Path, help="PNG of measured change and predicted score against size")
    args = ap.parse_args()
    rows = _read_rows(args.dir)
    _print_tables(rows)
    if args.out:
        _plot(rows, args.dir, args.out)


if __name__ == "__main__":
    main()
