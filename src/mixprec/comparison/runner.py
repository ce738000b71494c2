"""`mixprec.compare`: the same model, initial weights and data order under several recipes, judged.

    summary = mixprec.compare(["fp32", "bf16", "fp8-delayed"], steps=500, out="cmp")
    summary.passed, summary.recipes["fp8-delayed"].val_gap, summary.exit_code

Each recipe trains a copy of one initial model on the same batches; each baseline (fp32 for bf16,
bf16 for fp8 when present) is also re-run `null_runs` times on the same batches from initial weights
moved by one ulp at random positions, and so is every recipe judged against fp32 (fp32's runs barely
scatter, so the recipe's own scatter must be measured): the spread of these equally good runs is what
every verdict is read against (mixprec.comparison.summary). `noise=True` adds the old yardstick, a re-run with another data
order (reported only). The verdict requires the train loss (the last 10 % of steps, the same batches for
every run) and the held-out loss to be equivalent, and calls a loss lower than the baseline's by more than
the margin `different` (it fails like `worse`); `verdict_loss="train"` or `"val"` judges one alone. See
docs/compare.md and docs/schemas/compare.md.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from mixprec import ranks
from mixprec.comparison import outdir
from mixprec.comparison.config import (
    DEFAULT_RECIPES,
    DEFAULT_STEPS,
    NOISE_SUFFIX,
    CompareConfig,
    null_run_name,
)
from mixprec.comparison.page import compare_sections
from mixprec.comparison.summary import METRICS_SCHEMA_VERSION, ComparisonSummary, json_safe, summarize
from mixprec.comparison.training_run import RunResult, RunSpec, train_run
from mixprec.data import TokenizedData, load_corpus, prepare_data, train_batch
from mixprec.errors import MixprecError
from mixprec.files import write_text_atomic
from mixprec.hf import has_tokenizer, load_model, vocab_size
from mixprec.kernels import emulation
from mixprec.kernels.hardware import describe_machine, detect
from mixprec.models import ReferenceModelConfig, build_reference_model
from mixprec.pages import write_html_report
from mixprec.progress import ProgressBars
from mixprec.recipes import from_name
from mixprec.sensitivity import automatic_policy, is_quantizing, policy_section, profile_model


def run_specs(config: CompareConfig) -> list[RunSpec]:
    """The runs of a comparison: every recipe, then each baseline again with another data order."""
    common = dict(
        steps=config.steps, batch_size=config.batch_size, lr=config.lr, warmup=config.warmup,
        eval_every=config.eval_interval, monitor_every=config.monitor_interval,
        checkpoint_every=config.checkpoint_interval, weight_decay=config.weight_decay,
        max_grad_norm=config.max_grad_norm, device=config.device,
    )  # fmt: skip
    specs = [RunSpec(name=r, recipe=r, order_seed=config.seed, **common) for r in config.recipes]
    bases = [b for b in dict.fromkeys(config.baselines().values()) if b]
    for b in config.null_run_targets():
        # null run k of every baseline draws its perturbation from (seed, k): the same across baselines
        specs += [
            RunSpec(name=null_run_name(b, k), recipe=b, order_seed=config.seed,
                    perturb_seed=config.seed * 1000 + k, **common)
            for k in range(1, config.null_runs + 1)
        ]  # fmt: skip
    if config.noise:
        specs += [
            RunSpec(name=b + NOISE_SUFFIX, recipe=b, order_seed=config.seed + 1, **common) for b in bases
        ]
    return specs


def load_inputs(config: CompareConfig):
    """Corpus -> tokenized data, and the base model (same initial weights for every run)."""
    tokenizer_dir = config.tokenizer
    if config.model_dir is not None and tokenizer_dir is None and has_tokenizer(config.model_dir):
        tokenizer_dir = config.model_dir
    corpus = load_corpus(config.data, config.max_chars)
    data = prepare_data(
        corpus, seq_len=config.seq_len, vocab_size=config.vocab_size, tokenizer_dir=tokenizer_dir,
        max_val_blocks=config.val_blocks, min_train_blocks=config.batch_size,
    )  # fmt: skip
    if config.model_dir is not None:
        model = load_model(config.model_dir, head="causal-lm", dtype=torch.float32).float()
        if hasattr(model.config, "use_cache"):
            model.config.use_cache = False  # training: no KV cache
        vocab = vocab_size(model)
        if data.vocab_size > vocab or int(data.train.max()) >= vocab:
            raise MixprecError(
                f"the tokenizer ({data.vocab_size} ids) does not fit the model's embedding ({vocab} rows): "
                f"pass --tokenizer with the model's tokenizer"
            )
        info = {"source": config.model_dir}
    else:
        mcfg = ReferenceModelConfig(**(config.model_config or {}))
        mcfg = replace(mcfg, max_position_embeddings=max(mcfg.max_position_embeddings, config.seq_len))
        model = build_reference_model(data.vocab_size, config.seed, mcfg)
        info = {"source": "built-in reference Llama", "config": mcfg.to_dict()}
    info["parameters"] = sum(p.numel() for p in model.parameters())
    info["class"] = type(model).__name__
    return data, model, info


def compare(
    recipes: Sequence[str] = DEFAULT_RECIPES,
    *,
    steps: int = DEFAULT_STEPS,
    out: str | os.PathLike | None = None,
    model: str | os.PathLike | None = None,
    data: str | os.PathLike | None = None,
    tokenizer: str | os.PathLike | None = None,
    seed: int = 0,
    resume: bool = False,
    force: bool = False,
    progress: bool = True,
    keep_models: Sequence[str] = (),
    config: CompareConfig | None = None,
    prepare: Callable | None = None,
    stop_after: int | None = None,
    **settings,
) -> ComparisonSummary:
    """Train every recipe from the same initial weights on the same data order; return the summary.

    settings: any other CompareConfig field (eval_every, batch_size, lr, baseline, thresholds,
    verdict_loss, noise, monitor_every, ...). config: a whole CompareConfig instead. keep_models:
    recipes whose trained model is returned in summary.trained_models. stop_after: interrupt every run
    after that many steps (tests of --resume). Raises MixprecError on bad input before writing anything.
    """
    config = config or _config_of(recipes, steps, seed, model, data, tokenizer, settings)
    config.validate()
    out_path = Path(out) if out is not None else None
    if out_path is not None:
        # every rank checks (read-only, same answer everywhere), so no rank waits alone in a collective
        outdir.check_out_dir(out_path, config, resume=resume, force=force)
    elif resume:
        raise MixprecError("--resume needs --out (the directory of the interrupted comparison)")
    data_t, base_model, model_info = load_inputs(config)
    ckpt_dir = _checkpoint_dir(out_path, config, resume, force)
    specs = run_specs(config)
    if config.policy == "auto":
        specs = with_automatic_policies(config, specs, base_model, data_t, model_info)
    results = _train_all(specs, base_model, data_t, ckpt_dir, progress=progress, prepare=prepare,
                         stop_after=stop_after, keep_models=keep_models)  # fmt: skip
    records = [r for res in results for r in res.records]
    summary = summarize(records, config)
    summary.data = data_t.describe()
    summary.model = model_info
    summary.speed = speed_figures(results)
    summary.machine = f"{describe_machine()}; {emulation.describe(config.device)}"
    summary.trained_models = {res.name: res.model for res in results if res.model is not None}
    summary.tokenizer = data_t.tokenizer
    if out_path is not None and ranks.is_main_process():
        write_artefacts(out_path, summary, records)
        outdir.finish(out_path)
    return summary


def _config_of(recipes, steps, seed, model, data, tokenizer, settings: dict) -> CompareConfig:
    """The CompareConfig of compare()'s keyword arguments; an unknown setting is the user's error."""
    try:
        return CompareConfig(
            recipes=tuple(recipes), steps=steps, seed=seed, model_dir=None if model is None else str(model),
            data=None if data is None else str(data), tokenizer=None if tokenizer is None else str(tokenizer),
            **settings,
        )  # fmt: skip
    except TypeError as exc:
        raise MixprecError(f"compare: {exc}") from None


def _checkpoint_dir(out_path: Path | None, config: CompareConfig, resume: bool, force: bool) -> Path | None:
    """The run checkpoints' folder under --out (None without --out): rank 0 creates it, every rank
    checkpoints its own shard there and resumes from it."""
    if out_path is None:
        return None
    world = ranks.world_size()
    _barrier(world)  # every rank has checked --out before rank 0 writes into it
    if ranks.is_main_process():
        outdir.start(out_path, config, resume=resume, force=force)
    _barrier(world)  # ... and the checkpoint folder exists before any rank uses it
    ckpt_dir = out_path / outdir.CHECKPOINTS
    if resume:
        _check_checkpoint_kind(ckpt_dir, world)
    return ckpt_dir


def _train_all(specs, base_model, data_t, ckpt_dir: Path | None, *, progress: bool, prepare, stop_after,
               keep_models: Sequence[str]) -> list[RunResult]:  # fmt: skip
    """Every run in turn, one progress bar each (on the main process); trained models dropped unless kept."""
    results: list[RunResult] = []
    with ProgressBars(progress and ranks.is_main_process(), time_remaining=True, label_width=22) as bars:
        runs = {s.name: bars.add(s.name, total=s.steps) for s in specs}

        def on_step(name: str, step: int) -> None:
            runs[name].update(completed=step)

        for spec in specs:
            ckpt = outdir.checkpoint_path(ckpt_dir, spec.name) if ckpt_dir is not None else None
            result = train_run(spec, base_model, data_t, checkpoint_path=ckpt, on_step=on_step, prepare=prepare,
                               stop_after=stop_after)  # fmt: skip
            if spec.name not in keep_models:
                result.model = None
            results.append(result)
            on_step(spec.name, spec.steps)
    return results


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _check_checkpoint_kind(ckpt_dir: Path, world: int) -> None:
    """A single-process run checkpoints into <run>.pt, a multi-rank one into <run>.dist/ (per-rank
    shards): resuming one kind with the other would silently start over, so refuse it."""
    if not ckpt_dir.is_dir():
        return
    single = sorted(p.name for p in ckpt_dir.glob("*.pt"))
    multi = sorted(p.name for p in ckpt_dir.glob("*.dist"))
    if world > 1 and single:
        raise MixprecError(
            f"--resume: {ckpt_dir} holds single-process checkpoints ({', '.join(single)}); "
            "resume it without torchrun"
        )
    if world == 1 and multi:
        raise MixprecError(
            f"--resume: {ckpt_dir} holds multi-rank checkpoints ({', '.join(multi)}); resume it under "
            "torchrun with the same number of ranks"
        )


def speed_figures(results: list[RunResult]) -> dict:
    """Wall time per training step and the ratio to fp32; gated nowhere on CPU (emulated FP8)."""
    per = {r.name: r.seconds_per_step for r in results}
    ref = per.get("fp32")
    native = bool(detect().fp8_native)
    return {
        "seconds_per_step": per,
        "ratio_vs_fp32": {k: (v / ref if ref else None) for k, v in per.items()},
        "native_fp8": native,
        "gated": False,
        "note": (
            "native FP8 kernels present: ratios are real speed-ups (reported; a small model is not a speed test)"
            if native
            else "no native FP8 kernels: FP8 runs emulated, ratios are reported, not gated"
        ),
    }


# forward/backward passes of the initial model that the automatic policy's profile takes
AUTO_POLICY_PASSES = 4


def with_automatic_policies(
    config: CompareConfig, specs: list[RunSpec], base_model, data: TokenizedData, model_info: dict
) -> list[RunSpec]:
    """--policy auto: profile the initial model on the first batches (mixprec.sensitivity), and give every
    quantizing recipe's run the policy that keeps its layers beyond the thresholds in bf16. The kept
    layers and why go to model_info["automatic_policy"] (summary.json's `model`, and the report)."""
    recipes = [r for r in config.recipes if is_quantizing(from_name(r))]
    if not recipes:
        return specs
    batches = [train_batch(data, config.batch_size, step, config.seed) for step in range(AUTO_POLICY_PASSES)]
    profile = profile_model(base_model, batches, recipes=recipes, device=config.device)
    # each recipe held to its kind's limits (CompareConfig.limits_for, Limits.for_kind)
    policies = {r: automatic_policy(profile, r, config.limits_for(r)) for r in recipes}
    model_info["automatic_policy"] = {
        "passes": profile.passes,
        "seconds": profile.seconds,
        "policies": {r: p.to_dict() for r, p in policies.items()},
    }
    return [replace(s, policy=policies[s.recipe].policy) if s.recipe in policies else s for s in specs]


def write_artefacts(out: Path, summary: ComparisonSummary, records: list[dict]) -> None:
    outdir.write_jsonl(
        out / "metrics.jsonl", [json_safe({"schema_version": METRICS_SCHEMA_VERSION, **r}) for r in records]
    )
    summary.out_dir = str(out)
    summary.report_path = str(out / "report.html")
    write_text_atomic(out / "summary.json", json.dumps(summary.to_dict(), indent=1))
    sections = compare_sections(summary, records)
    auto = summary.model.get("automatic_policy")
    if auto:  # --policy auto: the layers each FP8 recipe kept in bf16, and why
        sections.append(policy_section(list(auto["policies"].values())))
    write_html_report(out, "mixprec compare", sections, subtitle=summary.machine)


__all__ = ["CompareConfig", "ComparisonSummary", "compare", "load_inputs", "run_specs", "write_artefacts"]
