"""One training step of a small Llama in bf16 on CPU: fp32-compute path vs native bf16 GEMMs, vs fp32.

    python bench/bench_bf16_llama_step.py            # hidden 256, 4 layers, batch 8 x 128 tokens
    python bench/bench_bf16_llama_step.py --quick

On CPUs without AVX-512-BF16 / AMX, torch's native bf16 GEMMs are several times slower than fp32;
mixprec.convert_for_training("bf16" / "bf16-amp") computes every bf16 GEMM of the model (Linear,
attention, batched matmuls) in fp32 and rounds to bf16. Configurations run interleaved round-robin in
one process; the table gives the median step (forward + backward + optimizer) and the ratio to fp32.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def build(hidden: int, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 16 * 16,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1),
        num_key_value_heads=max(hidden // 128, 1),
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def configs(hidden: int, layers: int):
    import mixprec
    from mixprec.training.optim import AdamW

    out = {}
    m = build(hidden, layers)
    out["fp32"] = (m, torch.optim.AdamW(m.parameters(), lr=1e-4), None)
    m = build(hidden, layers)
    mixprec.convert_for_training(m, "bf16", cpu_bf16_gemm="fp32")
    out["bf16, fp32-compute GEMMs"] = (m, AdamW(m.parameters(), lr=1e-4), None)
    m = build(hidden, layers)
    mixprec.convert_for_training(m, "bf16", cpu_bf16_gemm="native")
    out["bf16, native GEMMs"] = (m, AdamW(m.parameters(), lr=1e-4), None)
    m = build(hidden, layers)
    mixprec.convert_for_training(m, "bf16-amp", cpu_bf16_gemm="fp32")
    out["bf16-amp, fp32-compute GEMMs"] = (m, AdamW(m.parameters(), lr=1e-4), None)
    m = build(hidden, layers)
    mixprec.convert_for_training(m, "bf16-amp", cpu_bf16_gemm="native")
    out["bf16-amp, native GEMMs"] = (m, AdamW(m.parameters(), lr=1e-4), None)
    return out


def step(model, opt, autocast_dtype, ids) -> None:
    if autocast_dtype is not None:
        with torch.autocast("cpu", dtype=autocast_dtype):
            loss = model(input_ids=ids, labels=ids).loss
    else:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    rounds = 3 if args.quick else args.rounds
    if args.threads:
        torch.set_num_threads(args.threads)
    ids = torch.randint(0, 512, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    cases = configs(args.hidden, args.layers)
    times: dict[str, list[float]] = {k: [] for k in cases}
    for m, o, a in cases.values():  # warm-up
        step(m, o, a, ids)
    for _ in range(rounds):
        for k, (m, o, a) in cases.items():
            t = time.perf_counter()
            step(m, o, a, ids)
            times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    from mixprec.kernels.hardware import detect

    print(f"CPU {detect().cpu_model}; AVX-512-BF16/AMX: {detect().cpu_bf16_native}")
    print(
        f"Llama hidden {args.hidden}, {args.layers} layers, {args.batch}x{args.seq} tokens, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, median of {rounds}\n"
    )
    print("| configuration | median ms / step | vs fp32 | best ms / step | vs fp32 |")
    print("|---|---|---|---|---|")
    for k, v in med.items():
        print(
            f"| {k} | {v * 1e3:.0f} | {v / med['fp32']:.2f}x | {best[k] * 1e3:.0f} | {best[k] / best['fp32']:.2f}x |"
        )


if __name__ == "__main__":
    main()
