"""LoRA gradients over a quantized SmolLM2 against the dequantized fp32 reference (issue 29's acceptance).

    python bench/lora_gradients.py --model /tmp/realmodels/smol-hf --schemes fp8-dynamic nvfp4a16 mxfp4a16

For each scheme: the model (fp32) quantized online, LoRA (r=8, q/k/v/o/gate/up/down, non-zero B) added with
mixprec.finetune.lora.add_lora, and a copy whose quantized bases are tests/inference's ReferenceLinear (F.linear
over the dequantized weight, inputs fake-quantized straight-through). One forward/backward of Σ logits · r on
the same tokens; prints the max over LoRA tensors of ‖g − g_ref‖ / ‖g_ref‖, the same for the gradient of the
hidden states entering layer 0, and whether check_gradient_flow passes.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.inference.inference_helpers
from tests.inference.inference_helpers import ReferenceLinear, rel_err

from mixprec.finetune.lora import add_lora
from mixprec.hf import load_tokenizer
from mixprec.inference.runtime.linear import QuantizedLinear
from mixprec.inference.runtime.online import apply_scheme_
from mixprec.training.gradient_flow import check_gradient_flow

TEXT = (
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion about "
    "maintenance costs, the members agreed to postpone the new library wing and to repair the roof first."
)


def grads(model, ids, weights):
    held = {}

    def trainable(module, args, out):
        held["h"] = out.detach().requires_grad_()
        return held["h"]

    handle = model.get_input_embeddings().register_forward_hook(trainable)
    try:
        model.zero_grad(set_to_none=True)
        (model(ids).logits.float() * weights).sum().backward()
    finally:
        handle.remove()
    return {n: p.grad for n, p in model.named_parameters() if "lora_" in n}, held["h"].grad


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/realmodels/smol-hf")
    ap.add_argument("--schemes", nargs="+", default=["fp8-dynamic", "nvfp4a16", "mxfp4a16"])
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(args.model)
    ids = torch.tensor([tok.encode(TEXT)[:48]])
    original = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    for scheme in args.schemes:
        t0 = time.time()
        torch.manual_seed(0)
        model = copy.deepcopy(original)
        apply_scheme_(model, scheme, calib_data=[ids] if scheme in ("fp8-static", "nvfp4") else None)
        lora = add_lora(model, r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
        ref = copy.deepcopy(lora)
        for name, m in list(ref.named_modules()):
            if isinstance(m, QuantizedLinear):
                parent, _, child = name.rpartition(".")
                setattr(ref.get_submodule(parent), child, ReferenceLinear(m))
        weights = torch.randn(
            *ids.shape, original.config.vocab_size, generator=torch.Generator().manual_seed(1)
        )
        g, h = grads(lora, ids, weights)
        g_ref, h_ref = grads(ref, ids, weights)
        worst = max(rel_err(g[n], g_ref[n]) for n in g)
        flow = check_gradient_flow(lora, ids)
        print(
            f"{scheme}: {len(g)} LoRA tensors, max relative gradient error {worst:.2e}; layer-0 hidden-state "
            f"gradient: |g| max {float(h.abs().max()):.3g}, relative error {rel_err(h, h_ref):.2e}; "
            f"gradient flow ok: {flow.ok}; {time.time() - t0:.0f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
