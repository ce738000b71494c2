"""Forward tokens/s of `load_quantized` models against their bf16 model, interleaved in one process.

    python bench/bench_quantized_forward.py --reference smol-hf --candidate smol-fp8 smol-nvfp4a16
    python bench/bench_quantized_forward.py ... --batch 8 --seq-len 128 --rounds 5 --decode-batch 8

Each candidate runs three ways: the bf16 forward with its decoded-weight cache (bf16 weights kept after
the first call), the bf16 forward decoding per call (cache off), and the fp32 emulation that was the
only path before (`bf16_gemm = "never"`). Rows: a prefill-like forward of batch x seq-len tokens (what
`mixprec evaluate --task lm` times) and, with --decode-batch, a one-token forward of that many rows
(decode of small batches; no KV cache, so it is the Linears' cost plus a short attention). Every
configuration runs once per round, in turn (round-robin), after one untimed warm-up; the table gives
the median tokens/s and its ratio to the bf16 model's in the same rounds. Weights in memory count
every tensor the model holds, decoded caches included (mixprec.evaluation.memory).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def machine() -> str:
    from mixprec.kernels.hardware import describe_machine, detect

    caps = detect()
    isa = [n for n, on in (("avx512_bf16", caps.cpu_flags_bf16), ("amx", caps.cpu_flags_amx)) if on]
    return f"{describe_machine(caps)}; ISA: {', '.join(isa) or 'no native bf16'}; threads {torch.get_num_threads()}"


def load(reference: str, candidates: list[str]):
    from mixprec.hf import load_model
    from mixprec.inference.readers.load import load_quantized
    from mixprec.inference.runtime.linear import QuantizedLinear

    models = {"bf16 reference": load_model(reference, head="causal-lm", role="reference").eval()}
    for path in candidates:
        name = path.rstrip("/").rsplit("/", 1)[-1]
        for label, cache, mode in (("cache on", True, "auto"), ("cache off", False, "auto"),
                                   ("fp32 emulation", False, "never")):  # fmt: skip
            model = load_quantized(path, decoded_cache=cache)
            for m in model.modules():
                if isinstance(m, QuantizedLinear):
                    m.bf16_gemm = mode
            models[f"{name}, {label}"] = model
    return models


def run(models: dict, ids: torch.Tensor, rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in models}
    with torch.inference_mode():
        for model in models.values():
            model(ids)  # warm-up: fills the caches of "cache on"
        for _ in range(rounds):
            for name, model in models.items():
                start = time.perf_counter()
                model(ids)
                times[name].append(time.perf_counter() - start)
    return times


def table(title: str, times: dict[str, list[float]], tokens: int, memory: dict[str, int]) -> None:
    ref = statistics.median(times["bf16 reference"])
    print(f"\n{title}\n| model | tokens/s (median) | vs bf16 | weights in memory |\n|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {tokens / med:,.0f} | {ref / med:.2f}x | {memory[name] / 1e6:.1f} MB |")


def main() -> None:
    from mixprec.evaluation.memory import weight_bytes_in_memory

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reference", required=True)
    p.add_argument("--candidate", nargs="+", required=True)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--decode-batch", type=int, default=0)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    from mixprec.kernels import allocator

    print(machine(), f"allocator: {allocator.keep_freed_memory()}", sep="\n")  # as mixprec evaluate does
    models = load(args.reference, args.candidate)
    vocab = models["bf16 reference"].config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (args.batch, args.seq_len), generator=gen)
    times = run(models, ids, args.rounds)
    memory = {k: weight_bytes_in_memory(m) for k, m in models.items()}
    table(
        f"forward of {args.batch} x {args.seq_len} tokens, {args.rounds} rounds", times, ids.numel(), memory
    )
    if args.decode_batch:
        ids = torch.randint(0, vocab, (args.decode_batch, 1), generator=gen)
        times = run(models, ids, args.rounds * 4)
        table(
            f"forward of {args.decode_batch} x 1 tokens, {args.rounds * 4} rounds", times, ids.numel(), memory
        )


if __name__ == "__main__":
    main()
