"""The same-size heuristic `--scheme auto` is measured against (docs/auto.md): the first and last blocks
of a Llama-family model in the higher-precision scheme, every other block in the lower one.

    python bench/auto_heuristic.py MODEL_DIR OUT_DIR K_FIRST K_LAST [--high fp8-dynamic] [--low nvfp4a16]
    python bench/auto_heuristic.py MODEL_DIR - K_FIRST K_LAST      # print its bits per weight only

Written by mixprec.quantize_checkpoint with a {Linear: scheme} mapping (one mixed-precision checkpoint,
as --scheme auto writes); prints the bits per weight of the quantized Linears, scales counted
(InferenceScheme.stored_bits, the count --budget uses), so an automatic checkpoint can be given exactly
that budget.
"""

from __future__ import annotations

import argparse

from mixprec.hf import read_config
from mixprec.inference import quantize_checkpoint
from mixprec.inference.schemes import SCHEMES

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def heuristic(model_dir: str, k_first: int, k_last: int, high: str, low: str) -> tuple[dict[str, str], float]:
    """({Linear: scheme} with the first k_first and last k_last blocks in `high`, the rest in `low`;
    its bits per weight, scales counted)."""
    cfg = read_config(model_dir)
    n, h, i = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = (
        cfg["num_attention_heads"] * head_dim,
        cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim,
    )
    shapes = dict(zip(LINEARS, [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]))
    kept_high = set(range(k_first)) | set(range(n - k_last, n))
    assignment = {
        f"model.layers.{b}.{name}": (high if b in kept_high else low) for b in range(n) for name in LINEARS
    }
    bits = sum(SCHEMES[s].stored_bits(*shapes[name.split(".", 3)[3]]) for name, s in assignment.items())
    return assignment, bits / (n * sum(o * k for o, k in shapes.values()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("out", help="output directory, or - to print the bits per weight only")
    ap.add_argument("k_first", type=int)
    ap.add_argument("k_last", type=int)
    ap.add_argument("--high", default="fp8-dynamic")
    ap.add_argument("--low", default="nvfp4a16")
    args = ap.parse_args()
    assignment, bits = heuristic(args.model, args.k_first, args.k_last, args.high, args.low)
    print(f"{bits!r}")
    if args.out != "-":
        quantize_checkpoint(args.model, args.out, assignment, progress=False)


if __name__ == "__main__":
    main()
