"""`mixprec.compare` on 2 ranks (spawned by tests/distributed/harness.py): FSDP2, interrupted then resumed."""

from __future__ import annotations

from pathlib import Path

RECIPES = ["bf16", "fp8-delayed"]  # delayed scaling: its amax histories must survive the resume
SETTINGS = dict(
    steps=6, batch_size=4, seq_len=32, vocab_size=320, max_chars=40_000, val_blocks=4, eval_every=2,
    monitor_every=2, checkpoint_every=2, noise=False, null_runs=0, lr=3e-3, baseline="bf16",
    model_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 4},
)  # fmt: skip


def resume_fsdp2(rank: int, world: int, tmp: str) -> dict:
    """Interrupt after step 3 (last checkpoint: step 2), resume, and run uninterrupted into another folder."""
    import mixprec.comparison.page as plots
    from mixprec.comparison.runner import compare
    from mixprec.distributed import DataParallel

    plots.compare_sections = lambda summary, records: []  # the report's plots take seconds; tested elsewhere
    tmp_path = Path(tmp)
    dp = DataParallel("fsdp2")
    interrupted = False
    try:
        compare(RECIPES, out=tmp_path / "c", progress=False, prepare=dp, stop_after=3, **SETTINGS)
    except KeyboardInterrupt:
        interrupted = True
    left = sorted(p.name for p in (tmp_path / "c" / "checkpoints").iterdir())
    compare(RECIPES, out=tmp_path / "c", progress=False, prepare=dp, resume=True, **SETTINGS)
    compare(RECIPES, out=tmp_path / "a", progress=False, prepare=dp, **SETTINGS)
    return {"interrupted": interrupted, "left": left}
