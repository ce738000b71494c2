"""Cost of the PrecisionMonitor per training step, against the same loop without it (same run).

    python bench/monitor_cost.py [--recipe fp8-delayed] [--steps 12] [--runs 5] [--hidden 128] [--layers 2]

Prints a markdown table: median wall and CPU time per step of the built-in Llama under an FP8 recipe
with no monitor, with the monitor on an ordinary step (NaN/inf guard only), on a statistics step,
and with activation watching; and the ratio to the step without monitor. `--runs N` repeats the whole
interleaved measurement N times (fresh model each time) and reports the median over the runs of each
run's median, so one disturbed run on a shared machine does not decide the figure.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mixprec.models import ReferenceModelConfig, build_reference_model, lm_loss
from mixprec.monitor import PrecisionMonitor
from mixprec.training import advance_scaling_state, convert_for_training
from mixprec.training.optim import AdamW


def one_step(
    model, optimizer, batch, monitor: PrecisionMonitor | None, stats: bool
) -> tuple[float, float, float]:
    """(wall, CPU, wall spent inside the monitor's own calls) of one training step."""
    w0, c0 = time.perf_counter(), time.process_time()
    inside = 0.0
    if monitor is not None:
        t = time.perf_counter()
        monitor.begin_step(0 if stats else 1)  # every=1000: step 0 is a statistics step, 1 is not
        inside += time.perf_counter() - t
    loss = lm_loss(model, batch)
    loss.backward()
    ok = True
    if monitor is not None:
        t = time.perf_counter()
        ok = monitor.check_step(loss).ok
        inside += time.perf_counter() - t
    if ok:
        optimizer.step()
    optimizer.zero_grad()
    advance_scaling_state(model)
    if monitor is not None:
        t = time.perf_counter()
        monitor.end_step()
        inside += time.perf_counter() - t
    return time.perf_counter() - w0, time.process_time() - c0, inside


def measure(args) -> list[tuple[str, float, float, float]]:
    """One interleaved run: (configuration, median wall, median CPU, median monitor's own time) per step."""
    cfg = ReferenceModelConfig(
        hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers
    )
    model = build_reference_model(1024, 0, cfg)
    convert_for_training(model, args.recipe)
    optimizer = AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(0, 1024, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))

    plain = PrecisionMonitor(model, every=1000, optimizer=optimizer)
    configs = {
        "no monitor": (None, False),
        "monitor, ordinary step (NaN/inf guard)": (plain, False),
        "monitor, statistics step": (plain, True),
        "monitor + watch_activations, ordinary step": ("watch", False),
    }
    times: dict[str, list[tuple[float, float, float]]] = {k: [] for k in configs}
    # round-robin, so a change in machine load hits every configuration alike
    for round_ in range(args.steps + 2):
        for name, (mon, stats) in configs.items():
            if mon == "watch":
                mon = PrecisionMonitor(model, every=1000, optimizer=optimizer, watch_activations=True)
                t = one_step(model, optimizer, batch, mon, stats)
                mon.close()
            else:
                t = one_step(model, optimizer, batch, mon, stats)
            if round_ >= 2:
                times[name].append(t)
    plain.close()
    return [
        (
            k,
            statistics.median(w for w, _, _ in v),
            statistics.median(c for _, c, _ in v),
            statistics.median(m for _, _, m in v),
        )
        for k, v in times.items()
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="fp8-delayed")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--runs", type=int, default=5, help="interleaved runs; medians over them (default 5)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    runs = [measure(args) for _ in range(args.runs)]
    rows = [
        (name, *(statistics.median(run[i][j] for run in runs) for j in (1, 2, 3)))
        for i, name in enumerate(r[0] for r in runs[0])
    ]
    base_wall = rows[0][1]
    every = 100
    # the guard's own time every step, plus the statistics step's extra wall time (its statistics are
    # computed inside the layers' forward/backward, so its own-calls time misses them) once per `every`
    amortized = rows[1][3] + (rows[2][1] - rows[1][1]) / every
    print(f"Monitor cost, {args.recipe}, built-in Llama hidden {args.hidden} x {args.layers} layers, "
          f"batch {args.batch}x{args.seq}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"median of {args.runs} interleaved runs of {args.steps} steps\n")  # fmt: skip
    print(
        "The monitor's own time is measured around its calls (begin_step, check_step, end_step): the NaN/inf "
        "guard's cost. Statistics and activation watching run inside the layers' forward/backward: their cost "
        "is the step's wall time against the step without monitor.\n"
    )
    print("| step | wall ms | CPU ms | wall vs no monitor | monitor's own ms | own / step without monitor |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, wall, cpu, own in rows:
        print(
            f"| {name} | {wall * 1e3:.1f} | {cpu * 1e3:.1f} | {wall / base_wall:.3f}x | {own * 1e3:.2f} "
            f"| {own / base_wall * 100:.1f} % |"
        )
    print(
        f"| amortized at every={every} (guard + statistics) |  |  |  | {amortized * 1e3:.2f} | {amortized / base_wall * 100:.1f} % |"
    )
    print("\nper run, guard's own ms / step without monitor ms: " + ", ".join(
        f"{run[1][3] * 1e3:.2f}/{run[0][1] * 1e3:.0f}" for run in runs))  # fmt: skip


if __name__ == "__main__":
    main()
