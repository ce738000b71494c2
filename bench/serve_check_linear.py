"""One Linear, the same activations, through vLLM's fp8-dynamic path and through mixprec's emulation.

The end-to-end log-probabilities of bench/serve_check.py mix two things: whether the quantized Linear
computes the same thing, and how the two engines' other differences (bf16 rounding of norms,
attention, ...) propagate through a network whose activations are quantized. This isolates the first.
Three phases, run by bench/serve_check.sh after serve_check.py's `serve`:

    capture  (project venv)  real activations: the inputs of a few Linears of each served fp8-dynamic
                             checkpoint, from mixprec's model run in vLLM's dtype on the check's first
                             prompts; with the checkpoint's FP8 weight and scales: WORK/linear/<id>.in.safetensors
    vllm     (vLLM venv)     vLLM's own code on them: QuantFP8 (per-token dynamic, the method its CustomOp
                             dispatches to on this platform) and the GEMM + dequantization of the kernel it
                             chose for these checkpoints (ChannelWiseTorchFP8ScaledMMLinearKernel):
                             WORK/linear/<id>.vllm.safetensors
    compare  (project venv)  mixprec's QuantizedLinear on the same inputs, and mixprec's arithmetic with
                             vLLM's quantizer rule; WORK/linear.json and WORK/linear.md

Nothing here imports mixprec or vllm at module level: each phase imports what its environment has.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FP8_MAX = 448.0
N_CAPTURE_PROMPTS = 2


def _linears(names: list[str]) -> list[str]:
    """q_proj and down_proj of the first block and down_proj of the last: a narrow input (the
    normalized residual), a wide one (after SiLU-and-mul), and the deepest."""
    blocks = sorted({int(n.split(".")[2]) for n in names if n.startswith("model.layers.")})
    want = [f"model.layers.{blocks[0]}.self_attn.q_proj", f"model.layers.{blocks[0]}.mlp.down_proj",
            f"model.layers.{blocks[-1]}.mlp.down_proj"]  # fmt: skip
    return [n for n in want if n in names]


def _served_fp8_dynamic(work: Path) -> list[dict]:
    plan = json.loads((work / "plan.json").read_text())
    out = []
    for e in plan:
        # plain round to nearest: the algorithms change the weights, not the Linear's computation
        if e["scheme"] != "fp8-dynamic" or e.get("kv_cache") or e.get("algorithm") or "quantize_error" in e:
            continue
        res = work / "vllm" / f"{e['id']}.json"
        if res.exists() and json.loads(res.read_text()).get("ok"):
            out.append(e)
    return out


def capture(args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import save_file

    import mixprec
    from mixprec.inference.runtime.linear import QuantizedLinear
    from mixprec.kernels.bf16_cpu import gemms_in_fp32

    work = Path(args.work)
    (work / "linear").mkdir(exist_ok=True)
    for e in _served_fp8_dynamic(work):
        vres = json.loads((work / "vllm" / f"{e['id']}.json").read_text())
        dtype = getattr(torch, vres.get("dtype", "bfloat16"))
        model = mixprec.load_quantized(e["dir"]).eval().to(dtype)
        modules = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
        tensors: dict[str, torch.Tensor] = {}
        handles = []
        for name in _linears(list(modules)):
            m = modules[name]
            tensors[f"w.{name}"], tensors[f"ws.{name}"] = m.weight.contiguous(), m.weight_scale.contiguous()

            def hook(_m, a, _n=name, _t=tensors):
                x = a[0].detach().reshape(-1, a[0].shape[-1])
                prev = _t.get(f"x.{_n}")
                _t[f"x.{_n}"] = x if prev is None else torch.cat([prev, x])

            handles.append(m.register_forward_pre_hook(hook))
        with torch.no_grad(), gemms_in_fp32(model):
            for seq in vres["sequences"][:N_CAPTURE_PROMPTS]:
                model(torch.tensor([seq]))
        for h in handles:
            h.remove()
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, work / "linear" / f"{e['id']}.in.safetensors"
        )
        print(f"captured {e['id']}: {len(handles)} Linears", flush=True)


def vllm_phase(args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.kernels.linear.scaled_mm.pytorch import ChannelWiseTorchFP8ScaledMMLinearKernel
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    work = Path(args.work)
    for path in sorted((work / "linear").glob("*.in.safetensors")):
        inp = load_file(path)
        out: dict[str, torch.Tensor] = {}
        with set_current_vllm_config(VllmConfig()):
            # the padding the kernel asks for without torch.compile (enforce_eager, as the check runs)
            quant = QuantFP8(static=False, group_shape=GroupShape.PER_TOKEN, num_token_padding=17)
            method = getattr(getattr(quant, "_forward_method", None), "__name__", "?")
            for key in [k for k in inp if k.startswith("x.")]:
                name = key[2:]
                x, w, ws = inp[key], inp[f"w.{name}"], inp[f"ws.{name}"]
                xq, xs = quant(x, None, None)
                # vLLM keeps the weight transposed ([K, N]) after loading; the kernel's `self` is unused
                y = ChannelWiseTorchFP8ScaledMMLinearKernel.apply_scaled_mm(
                    None, A=xq, B=w.t(), out_dtype=x.dtype, As=xs, Bs=ws, bias=None,
                    output_shape=[x.shape[0], w.shape[0]],
                )  # fmt: skip
                rows = x.shape[0]
                out[f"xq.{name}"] = xq[:rows].view(torch.uint8).contiguous()
                out[f"xs.{name}"] = xs[:rows].reshape(-1).contiguous()
                out[f"y.{name}"] = y.contiguous()
        save_file(out, str(path).replace(".in.", ".vllm."), metadata={"quant_fp8_method": method})
        print(f"vLLM ran {path.name} (QuantFP8.{method})", flush=True)


def vllm_rule_quantize(x2, fmt_max: float = FP8_MAX):
    """vLLM CPU's QuantFP8.forward_native, per token: scale = amax / 448 clamped at >= 1 / (448 * 512),
    payload = fp8(clamp(x * (1 / scale))) — a multiplication by the reciprocal, where mixprec divides."""
    import torch

    amax = x2.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    scale = (amax / fmt_max).clamp(min=1.0 / (fmt_max * 512.0))
    q = (x2.to(torch.float32) * scale.reciprocal()).clamp(-fmt_max, fmt_max).to(torch.float8_e4m3fn)
    return q, scale


def compare(args: argparse.Namespace) -> None:
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    from mixprec.formats import E4M3
    from mixprec.gemm import scaled_mm
    from mixprec.inference.runtime.linear import QuantizedLinear
    from mixprec.inference.schemes import SCHEMES
    from mixprec.quantization import quantize
    from mixprec.scaling import Granularity, QuantizedTensor

    work = Path(args.work)
    sch = SCHEMES["fp8-dynamic"]
    rows = []
    for path in sorted((work / "linear").glob("*.in.safetensors")):
        theirs_path = Path(str(path).replace(".in.", ".vllm."))
        if not theirs_path.exists():
            continue
        inp, theirs = load_file(path), load_file(theirs_path)
        with safe_open(theirs_path, "pt") as f:
            method = (f.metadata() or {}).get("quant_fp8_method", "?")
        for key in [k for k in inp if k.startswith("x.")]:
            name = key[2:]
            x, w, ws = inp[key], inp[f"w.{name}"], inp[f"ws.{name}"]
            n, k = w.shape
            qw = QuantizedTensor(w, ws, E4M3, Granularity.rows(), torch.Size((n, k)))
            lin = QuantizedLinear(qw, None, sch, out_dtype=x.dtype)
            mine_q = quantize(x, E4M3, sch.input_granularity)
            y = lin(x)
            vq, vs, vy = theirs[f"xq.{name}"], theirs[f"xs.{name}"], theirs[f"y.{name}"]
            # mixprec's own arithmetic (its GEMM seam) on payloads quantized by vLLM's rule
            rq, rs = vllm_rule_quantize(x)
            yr = scaled_mm(QuantizedTensor(rq, rs, E4M3, Granularity.rows(), x.shape), qw, out_dtype=x.dtype)
            rel = ((y.float() - vy.float()).abs() / vy.float().abs().clamp_min(1e-30))[y != vy]
            rows.append({
                "checkpoint": path.name.split(".in.")[0], "linear": name, "tokens": x.shape[0], "in": k, "out": n,
                "quant_fp8_method": method,
                "scales_equal": bool(torch.equal(mine_q.scale.reshape(-1).float(), vs)),
                "payload_differs": int((mine_q.data.view(torch.uint8) != vq).sum()), "payload_elements": vq.numel(),
                "vllm_rule_payload_equal": bool(torch.equal(rq.view(torch.uint8), vq)),
                "outputs_differ": int((y != vy).sum()), "outputs": vy.numel(),
                "max_rel_diff": float(rel.max()) if rel.numel() else 0.0,
                "vllm_rule_outputs_differ": int((yr != vy).sum()),
            })  # fmt: skip
    doc = {"schema_version": 1, "rows": rows}
    (work / "linear.json").write_text(json.dumps(doc, indent=1))
    (work / "linear.md").write_text(markdown(doc))
    print(markdown(doc))


def markdown(doc: dict) -> str:
    lines = [
        "| checkpoint | Linear | tokens x in → out | per-token scales equal | FP8 payload elements that differ (mixprec divides, vLLM multiplies by 1/scale) | outputs that differ (bf16) | with vLLM's quantizer rule in mixprec: payload equal / outputs that differ |",
        "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in doc["rows"]:
        lines.append(
            f"| {r['checkpoint']} | {r['linear']} | {r['tokens']} x {r['in']} → {r['out']} | {r['scales_equal']} | "
            f"{r['payload_differs']} / {r['payload_elements']} ({r['payload_differs'] / r['payload_elements']:.3%}) | "
            f"{r['outputs_differ']} / {r['outputs']} | {r['vllm_rule_payload_equal']} / {r['vllm_rule_outputs_differ']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("phase", choices=("capture", "vllm", "compare"))
    p.add_argument("--work", required=True)
    args = p.parse_args()
    {"capture": capture, "vllm": vllm_phase, "compare": compare}[args.phase](args)


if __name__ == "__main__":
    sys.exit(main())
