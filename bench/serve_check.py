"""Serve mixprec's checkpoints in a real vLLM and compare its log-probabilities with mixprec's emulation.

Three phases in two virtual environments (vLLM's CPU build pins compressed-tensors and transformers
versions of its own, so it cannot share the project's environment); bench/serve_check.sh runs them all:

    prepare  (project venv)  build a tiny Llama, quantize it and a real model with every scheme and
                             layout through `mixprec quantize`, tokenize the prompts: WORK/plan.json
    serve    (vLLM venv)     for each checkpoint, in a fresh process: vllm.LLM(...), greedy generation
                             with the log-probability of every prompt and generated token, load time,
                             or the engine's own error: WORK/vllm/<id>.json
    compare  (project venv)  the same token sequences through mixprec (load_quantized) and transformers:
                             |vLLM - mixprec| log-prob differences of each quantized checkpoint against
                             the floor |vLLM - transformers| of the unquantized model; where vLLM could
                             not serve a checkpoint, transformers with compressed-tensors' loader
                             dequantizes it instead (weights compared bit for bit with mixprec's).
                             WORK/serve_check.json and WORK/serve_check.md (the table in docs/serving.md)

`prepare --only GLOB[,GLOB]` (serve_check.sh: ONLY=...) keeps the variants whose id matches one of the
globs, e.g. ONLY='*gptq*,*smoothquant,*awq' for the checkpoints written with an algorithm; the ids are
<model>-<scheme>-<layout>[-kv][-<algorithm>] (tiny-fp8-dynamic-compressed-tensors-rotate+gptq). The
plan then holds those and the unquantized models (the floor), and the later phases run what it holds.
The full list takes about 25 minutes on 2 busy cores (docs/serving.md).

Nothing here imports mixprec or vllm at module level: each phase imports what its environment has.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

# (scheme, layout, extra `mixprec quantize` arguments): every scheme and layout mixprec writes
VARIANTS = (
    ("fp8-dynamic", "compressed-tensors", ()),
    ("fp8-static", "compressed-tensors", ("--calib",)),
    ("fp8-block", "compressed-tensors", ()),
    ("fp8-block", "hf-fp8", ()),
    ("fp8-dynamic", "compressed-tensors", ("--calib", "--kv-cache", "fp8")),
    # the FP4 / MX schemes (vLLM's CPU build has no kernel for them: the engine's reason is recorded and
    # compressed-tensors' loader checks the checkpoint instead)
    ("nvfp4a16", "compressed-tensors", ()),
    ("nvfp4", "compressed-tensors", ("--calib",)),
    ("mxfp4a16", "compressed-tensors", ()),
    ("mxfp4", "compressed-tensors", ()),
    ("mxfp8", "compressed-tensors", ()),
    # a mixed-precision checkpoint of what this engine runs on a CPU without AMX: bf16 and fp8-dynamic
    # (`--scheme auto` at 12 bits per weight: about half the Linears in each)
    ("auto", "compressed-tensors", ("--calib", "--budget", "12", "--candidates", "fp8-dynamic")),
    # checkpoints written with the algorithms (docs/algorithms.md): the same layout as round to nearest,
    # so they should serve unchanged. rotate folds the norms into the Linears and rotates the embeddings
    # and head: the engine sees norms of 1 and other weights, not another format. 16 x 128 calibration
    # tokens, so that GPTQ's largest Hessian (SmolLM2's down_proj, 1536 inputs) sees more tokens than inputs
    ("fp8-dynamic", "compressed-tensors", ("--calib", "--calib-samples", "16", "--algorithm", "gptq")),
    ("fp8-dynamic", "compressed-tensors", ("--calib", "--calib-samples", "16", "--algorithm", "rotate,gptq")),
    ("fp8-dynamic", "compressed-tensors", ("--calib", "--calib-samples", "16", "--algorithm", "smoothquant")),
    ("fp8-dynamic", "compressed-tensors", ("--calib", "--calib-samples", "16", "--algorithm", "awq")),
)
N_PROMPTS = 8
PROMPT_TOKENS = 32
NEW_TOKENS = 8


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return platform.machine()
    keep = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return " ".join(f for f in keep if f in flags) or "no AVX2"


# ---------------------------------------------------------------------------------------------------
# prepare (project venv)


def _tiny_llama(directory: Path, texts: list[str]) -> None:
    """A 2-layer Llama from a config (fp32, random weights) with a BPE tokenizer trained on `texts`."""
    import torch
    import transformers

    from mixprec.data import save_tokenizer, train_bpe_tokenizer

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(directory)
    save_tokenizer(train_bpe_tokenizer(texts, vocab_size=512), directory)


def variant_id(model: str, scheme: str, layout: str, extra: tuple[str, ...]) -> str:
    """tiny-fp8-dynamic-compressed-tensors[-kv][-rotate+gptq]: the algorithm is part of the id, so a
    scheme written with and without one keeps two checkpoints and two results."""
    vid = f"{model}-{scheme}-{layout}" + ("-kv" if "--kv-cache" in extra else "")
    if "--algorithm" in extra:
        vid += "-" + extra[extra.index("--algorithm") + 1].replace(",", "+")
    return vid


def selected(vid: str, only: str | None) -> bool:
    """--only: comma-separated globs over the variant ids (fnmatch); none given, every variant."""
    return only is None or any(fnmatch.fnmatchcase(vid, pattern) for pattern in only.split(","))


def prepare(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    texts = [t for t in Path(args.texts).read_text().splitlines() if t.strip()]
    calib = work / "calib.txt"
    calib.write_text("\n".join(texts[100:400]))
    models = {"tiny": (work / "tiny", "tiny Llama (random weights, fp32)")}
    if not (work / "tiny" / "config.json").exists():
        _tiny_llama(work / "tiny", texts)
    if args.real and (Path(args.real) / "config.json").exists():
        models["smol"] = (Path(args.real), "SmolLM2-135M-Instruct (Q4_1-derived, bf16)")
    plan = []
    for key, (src, label) in models.items():
        tok = AutoTokenizer.from_pretrained(src)
        prompts = [tok(t)["input_ids"][:PROMPT_TOKENS] for t in texts[:N_PROMPTS]]
        # the unquantized model is always in the plan: it is the floor of every row
        plan.append(dict(id=f"{key}-original", model=key, label=label, scheme="none", layout="original",
                         dir=str(src), prompts=prompts, kept={}, quantize_s=0.0))  # fmt: skip
        for scheme, layout, extra in VARIANTS:
            vid = variant_id(key, scheme, layout, extra)
            if "--kv-cache" in extra and key != "tiny":
                continue  # the engine's FP8 KV-cache support depends on the CPU, not the model: once is enough
            if not selected(vid, args.only):
                continue
            entry = dict(id=vid, model=key, label=label, scheme=scheme, dir=str(work / "ckpt" / vid),
                         layout=layout + (" + fp8 KV cache" if "--kv-cache" in extra else ""),
                         prompts=prompts, kv_cache="--kv-cache" in extra)  # fmt: skip
            if "--algorithm" in extra:
                entry["algorithm"] = extra[extra.index("--algorithm") + 1]
            _quantize_variant(entry, src, layout, extra, calib)
            plan.append(entry)
            print(f"quantized {vid} in {entry.get('quantize_s')} s", flush=True)
    (work / "plan.json").write_text(json.dumps(plan, indent=1))


def _quantize_variant(entry: dict, src: Path, layout: str, extra: tuple[str, ...], calib: Path) -> None:
    """`mixprec quantize` into entry["dir"] (or the checkpoint a previous run left there), and what its
    report says into `entry`: the time, the Linears kept in high precision, or the error."""
    out = Path(entry["dir"])
    cmd = [sys.executable, "-m", "mixprec", "quantize", "--model", str(src), "--output", str(out),
           "--scheme", entry["scheme"], "--format", layout, "--json", "--force"]  # fmt: skip
    rest = list(extra)
    if "--calib" in rest:
        rest.remove("--calib")
        # static scales from 8 x 128 tokens: enough for a serving check (not a quality figure); a
        # variant's own --calib-samples comes later on the command line and wins
        cmd += ["--calib-data", str(calib), "--calib-samples", "8", "--calib-seq-len", "128"]
    saved = out.parent / f"{entry['id']}.report.json"  # a rerun reuses what is already quantized
    t0 = time.perf_counter()
    if saved.exists() and (out / "config.json").exists():
        stdout = saved.read_text()
    else:
        done = subprocess.run(cmd + rest, capture_output=True, text=True)
        if done.returncode:
            entry["quantize_error"] = (done.stderr.strip().splitlines() or ["?"])[-1]
            return
        saved.write_text(json.dumps({**json.loads(done.stdout), "quantize_s": time.perf_counter() - t0}))
        stdout = saved.read_text()
    report = json.loads(stdout)
    entry["quantize_s"] = round(report["quantize_s"], 1)
    entry["kept"] = {}
    if entry["scheme"] == "auto":  # --json prints the auto report: the chosen scheme of every Linear
        chosen = report["chosen"]
        entry["scheme"] = "auto: " + ", ".join(f"{s} {n}" for s, n in chosen["schemes"].items())
        entry["scheme"] += f" ({chosen['bits_per_weight']:.2f} bits/weight)"
    else:
        entry["kept"] = {
            e["name"]: e["reason"]
            for e in report["modules"]
            if e["precision"].startswith("skipped") and e["reason"] != "ignored by pattern"
        }


# ---------------------------------------------------------------------------------------------------
# serve (vLLM venv)


def serve(args: argparse.Namespace) -> None:
    """All checkpoints in one child process (vLLM's import and start-up cost a minute or more on a small
    CPU; its engine then runs in-process, VLLM_ENABLE_V1_MULTIPROCESSING=0). A checkpoint that kills the
    process (a C++ abort) is recorded with the last error line and the rest run in a new child."""
    work = Path(args.work)
    plan = [e for e in json.loads((work / "plan.json").read_text()) if "quantize_error" not in e]
    (work / "vllm").mkdir(exist_ok=True)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               VLLM_ENABLE_V1_MULTIPROCESSING="0")  # fmt: skip
    marker = work / "vllm" / "in_flight"
    todo = [e for e in plan if not (work / "vllm" / f"{e['id']}.json").exists()]
    while todo:
        marker.unlink(missing_ok=True)
        (work / "vllm" / "todo.json").write_text(json.dumps(todo))
        done = subprocess.run([sys.executable, __file__, "serve-batch", "--work", str(work)],
                              capture_output=True, text=True, env=env, timeout=args.timeout)  # fmt: skip
        (work / "vllm" / "serve.log").open("a").write(done.stdout + done.stderr)
        if marker.exists():  # the engine died without a Python exception
            crashed = marker.read_text()
            lines = [ln for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
            errors = [ln for ln in lines if "rror" in ln or "bort" in ln] or lines or ["no output"]
            reason = {"ok": False, "reason": f"process died (rc {done.returncode}): {errors[-1][-300:]}"}
            (work / "vllm" / f"{crashed}.json").write_text(json.dumps(reason))
        left = [e for e in todo if not (work / "vllm" / f"{e['id']}.json").exists()]
        if len(left) == len(todo):
            raise SystemExit(
                f"vLLM child made no progress (rc {done.returncode}); see {work / 'vllm' / 'serve.log'}"
            )
        todo = left
    for e in plan:
        r = json.loads((work / "vllm" / f"{e['id']}.json").read_text())
        print(f"{e['id']}: {'served' if r['ok'] else r['reason'][:200]} (load {r.get('load_s', '-')} s)")


def serve_batch(args: argparse.Namespace) -> None:
    work = Path(args.work)
    for entry in json.loads((work / "vllm" / "todo.json").read_text()):
        (work / "vllm" / "in_flight").write_text(entry["id"])
        result = serve_one(entry)
        (work / "vllm" / f"{entry['id']}.json").write_text(json.dumps(result))
        (work / "vllm" / "in_flight").unlink()
        print(f"{entry['id']}: {'served' if result['ok'] else result['reason'][:200]}", flush=True)


def serve_one(entry: dict) -> dict:
    """Load one checkpoint in vLLM, generate greedily, and return every token's log-probability."""
    import gc

    import vllm
    from vllm.inputs import TokensPrompt

    result: dict = {"vllm": vllm.__version__, "cpu": _cpu_flags()}
    llm = None
    try:
        t0 = time.perf_counter()
        llm = vllm.LLM(model=entry["dir"], dtype="auto", max_model_len=128, max_num_seqs=N_PROMPTS, enforce_eager=True,
                       seed=0, kv_cache_dtype="fp8" if entry.get("kv_cache") else "auto")  # fmt: skip
        result["load_s"] = round(time.perf_counter() - t0, 1)
        # the dtype vLLM computes in: "auto" downcasts an fp32 checkpoint to bf16 (the compare phase
        # runs the other engines in the same dtype)
        result["dtype"] = str(llm.model_config.dtype).replace("torch.", "")
        params = vllm.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0, prompt_logprobs=0)
        t0 = time.perf_counter()
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in entry["prompts"]], params, use_tqdm=False
        )
        result["generate_s"] = round(time.perf_counter() - t0, 2)
        seqs, lps = [], []
        for o in outs:
            gen = o.outputs[0]
            tokens = list(o.prompt_token_ids) + list(gen.token_ids)
            lp = [o.prompt_logprobs[i][tokens[i]].logprob for i in range(1, len(o.prompt_token_ids))]
            lp += [gen.logprobs[j][t].logprob for j, t in enumerate(gen.token_ids)]
            seqs.append(tokens)
            lps.append(lp)
        result.update(ok=True, sequences=seqs, logprobs=lps)
    except Exception as e:  # the engine's own reason is the result
        text = str(e).strip()
        result.update(ok=False, reason=f"{type(e).__name__}: {text.splitlines()[-1] if text else ''}")
    finally:
        del llm
        gc.collect()
    return result


# ---------------------------------------------------------------------------------------------------
# compare (project venv)


def _token_logprobs(model, sequences: list[list[int]]) -> list[list[float]]:
    """log p(token_i | tokens_<i) for i >= 1 of each sequence (teacher forcing), fp32 log-softmax."""
    import torch

    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq])
            logits = model(ids).logits[0, :-1].float()
            lp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
            out.append(lp.tolist())
    return out


def _in_fp32(model):
    """Floating parameters and buffers outside the FP8 Linears in fp32: a bf16 matmul is 4-25x slower
    than fp32 on CPUs without AVX-512-BF16 (the bf16 values upcast exactly; sums in fp32, as a GPU's)."""
    import torch

    from mixprec.inference.runtime.linear import QuantizedLinear

    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.out_dtype = torch.float32  # the GEMM's fp32 result, not rounded to bf16
            continue
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if t.dtype in (torch.bfloat16, torch.float16):
                t.data = t.data.float()
    return model


def _in_dtype(model, dtype: str):
    """The model computing in vLLM's dtype: fp32 as `_in_fp32`; bf16/fp16 with every parameter in that
    dtype (an fp32 checkpoint rounded, as vLLM's "auto" does), QuantizedLinears returning it, the
    rotary inverse frequencies in fp32."""
    import torch

    if dtype == "float32":
        return _in_fp32(model)
    # rotary inverse frequencies stay fp32, as from_pretrained(dtype=...) and vLLM keep them (their
    # cos/sin are computed in fp32 and rounded once); .to() alone would round the frequencies
    kept = {(m, n): b for m in model.modules() for n, b in m.named_buffers(recurse=False) if "inv_freq" in n}
    model.to(getattr(torch, dtype))
    for (m, n), b in kept.items():
        setattr(m, n, b)
    return model


def _scored(model, sequences: list[list[int]]) -> list[list[float]]:
    """_token_logprobs with bf16/fp16 GEMMs computed in fp32 and rounded once on CPUs without fast bf16
    (mixprec.kernels.bf16_cpu: what a bf16 GEMM gives, up to the order of the fp32 sums; a native
    bf16 matmul is several times slower on such a CPU)."""
    from mixprec.kernels.bf16_cpu import gemms_in_fp32

    with gemms_in_fp32(model):
        return _token_logprobs(model, sequences)


def _difference(a: list[list[float]], b: list[list[float]]) -> dict:
    flat = [abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return {"mean_abs": sum(flat) / len(flat), "max_abs": max(flat), "tokens": len(flat)}


def _nll(lps: list[list[float]]) -> float:
    flat = [x for r in lps for x in r]
    return -sum(flat) / len(flat)


def compare(args: argparse.Namespace) -> None:
    """Each engine in the dtype vLLM computed in (bf16 for these models: vLLM's "auto" downcasts an fp32
    checkpoint). FP8 activation quantization amplifies small input differences (an input that moves
    across an FP8 rounding boundary changes by a whole FP8 step), so the unquantized floor is scaled by
    the amplification measured within one engine: how much the fp32 -> vLLM-dtype change of the
    activations moves the log-probabilities of the quantized model (mixprec) against the unquantized
    one (transformers)."""
    work = Path(args.work)
    plan = json.loads((work / "plan.json").read_text())
    rows, floors, originals = [], {}, {}
    previous = {}
    if args.reuse_fallbacks and (work / "serve_check.json").exists():
        # the rows of checkpoints vLLM could not serve, from the last compare (fp32, unchanged here)
        previous = {r["id"]: r for r in json.loads((work / "serve_check.json").read_text())["rows"]}
    for entry in plan:
        vres_path = work / "vllm" / f"{entry['id']}.json"
        vres = json.loads(vres_path.read_text()) if vres_path.exists() else {"ok": False, "reason": "not run"}
        # results recorded before the check kept vLLM's dtype: vLLM 0.32's CPU "auto" ran bf16 (its log)
        dtype = vres.get("dtype", "bfloat16")
        row = {
            k: entry.get(k)
            for k in ("id", "model", "label", "scheme", "algorithm", "layout", "quantize_s", "kept")
        }
        row.update(
            vllm=vres.get("vllm"), cpu=vres.get("cpu"), served=bool(vres.get("ok")), load_s=vres.get("load_s"),
            dtype=dtype,
        )  # fmt: skip
        if "quantize_error" in entry:
            row.update(served=False, reason=f"mixprec quantize: {entry['quantize_error']}")
        elif entry["layout"] == "original":
            _original_row(entry, vres, dtype, row, floors, originals)
        elif vres.get("ok"):
            _served_row(
                entry, vres, dtype, row, floors.get(entry["model"]), originals.get(entry["model"], {})
            )
        elif previous.get(entry["id"], {}).get("fallback") and not previous[entry["id"]].get("served"):
            row.update(reason=vres.get("reason"), fallback=previous[entry["id"]]["fallback"])
        else:
            row["reason"] = vres.get("reason")
            row["fallback"] = _fallback(entry)
        rows.append(row)
        if "quantize_error" not in entry and entry["layout"] != "original":
            print(f"compared {entry['id']}", flush=True)
    doc = {"schema_version": 2, "machine": {"cpu": _cpu_flags(), "cores": os.cpu_count()}, "rows": rows}
    (work / "serve_check.json").write_text(json.dumps(doc, indent=1))
    (work / "serve_check.md").write_text(markdown(doc))
    print(markdown(doc))


def _original_row(entry: dict, vres: dict, dtype: str, row: dict, floors: dict, originals: dict) -> None:
    """The unquantized model: vLLM against transformers in vLLM's dtype is the floor of every comparison."""
    import transformers

    if not vres.get("ok"):
        row["reason"] = vres.get("reason")
        return
    seqs = vres["sequences"]
    ref32 = _token_logprobs(
        _in_fp32(transformers.AutoModelForCausalLM.from_pretrained(entry["dir"]).eval()), seqs
    )
    ref = _scored(
        _in_dtype(transformers.AutoModelForCausalLM.from_pretrained(entry["dir"]).eval(), dtype), seqs
    )
    floors[entry["model"]] = _difference(vres["logprobs"], ref)
    originals[entry["model"]] = {"dtype_change": _difference(ref32, ref), "nll": _nll(vres["logprobs"])}
    row.update(floor=floors[entry["model"]], floor_fp32=_difference(vres["logprobs"], ref32),
               dtype_change=originals[entry["model"]]["dtype_change"], vllm_nll=_nll(vres["logprobs"]))  # fmt: skip


def _dequantizing_loader_kwargs(entry: dict) -> dict:
    """compressed-tensors' loader (through transformers) dequantizes the weights: the same model with
    unquantized activations. transformers 5.24's dequantizing loader gives every Linear the first config
    group's scheme, so a mixed-precision checkpoint is read as stored (each Linear in its group's scheme;
    docs/auto.md)."""
    import transformers

    if entry["layout"].startswith("compressed-tensors") and not entry["scheme"].startswith("auto"):
        return {"quantization_config": transformers.CompressedTensorsConfig(dequantize=True)}
    return {}


def _served_row(entry: dict, vres: dict, dtype: str, row: dict, floor: dict | None, orig: dict) -> None:
    """A checkpoint vLLM served: its log-probabilities against mixprec's and against transformers'."""
    import transformers

    import mixprec

    seqs = vres["sequences"]
    ours = _scored(_in_dtype(mixprec.load_quantized(entry["dir"]).eval(), dtype), seqs)
    ours32 = _token_logprobs(_in_fp32(mixprec.load_quantized(entry["dir"]).eval()), seqs)
    row.update(vs_mixprec=_difference(vres["logprobs"], ours), floor=floor,
               vs_mixprec_fp32=_difference(vres["logprobs"], ours32), dtype_change=_difference(ours32, ours),
               vllm_nll=_nll(vres["logprobs"]), mixprec_nll=_nll(ours), vllm_nll_original=orig.get("nll"))  # fmt: skip
    if row["floor"] and orig.get("dtype_change") and orig["dtype_change"]["mean_abs"] > 0:
        amp = row["dtype_change"]["mean_abs"] / orig["dtype_change"]["mean_abs"]
        row["amplification"] = amp
        row["floor_quantized"] = {k: v * amp if k != "tokens" else v for k, v in row["floor"].items()}
        row["within_floor"] = row["vs_mixprec"]["mean_abs"] <= row["floor_quantized"]["mean_abs"]
    try:
        kw = _dequantizing_loader_kwargs(entry)
        hf = _in_dtype(transformers.AutoModelForCausalLM.from_pretrained(entry["dir"], **kw).eval(), dtype)
        theirs = _scored(hf, seqs)
        row["vs_weights_only"] = _difference(vres["logprobs"], theirs)
        row["mixprec_vs_weights_only"] = _difference(ours, theirs)
    except Exception as e:  # recorded, not hidden
        row["transformers_error"] = f"{type(e).__name__}: {e}"[:300]


def _fallback(entry: dict) -> dict:
    """What vLLM cannot run here: checked with compressed-tensors' loader instead (fp32 compute)."""
    import compressed_tensors
    import torch
    import transformers

    import mixprec
    from mixprec.inference.runtime.linear import QuantizedLinear

    try:
        kw = _dequantizing_loader_kwargs(entry)
        hf = _in_fp32(transformers.AutoModelForCausalLM.from_pretrained(entry["dir"], **kw).eval())
        mine = _in_fp32(mixprec.load_quantized(entry["dir"]).eval())
        same = total = 0
        for name, m in mine.named_modules():
            if isinstance(m, QuantizedLinear):
                total += 1
                # transformers dequantizes into the model's dtype: compare in that dtype
                wdtype = getattr(hf.config, "dtype", None) or torch.float32
                wdtype = getattr(torch, wdtype) if isinstance(wdtype, str) else wdtype
                theirs = hf.get_submodule(name).weight.detach().to(wdtype)
                same += torch.equal(theirs, m.dequantized_weight().to(wdtype))
        seqs = list(entry["prompts"])
        return {
            "loader": f"transformers {transformers.__version__} + compressed-tensors {compressed_tensors.__version__}",
            "weights_bit_identical": f"{same}/{total}",
            "vs_mixprec": _difference(_token_logprobs(hf, seqs), _token_logprobs(mine, seqs)),
        }
    except Exception as e:  # recorded, not hidden
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def _fmt(d: dict | None) -> str:
    return "-" if not d else f"{d['mean_abs']:.2e} (max {d['max_abs']:.2e})"


def markdown(doc: dict) -> str:
    rows = doc["rows"]
    first = next((r for r in rows if r.get("vllm")), {})
    lines = [
        f"vLLM {first.get('vllm', '?')} (vllm-cpu), CPU flags: {doc['machine']['cpu']}, {doc['machine']['cores']} cores.",
        "",
        "Every engine computes in the dtype vLLM ran (column vLLM); \\|Δ\\| is the mean over all scored tokens of "
        "\\|log p(vLLM) − log p(other)\\| (max in brackets). Amplification: how much more the quantized model's "
        "log-probabilities move than the unquantized model's when the activations change from fp32 to that dtype "
        "(mixprec's emulation; transformers); the floor for a quantized row is the unquantized floor times it.",
        "",
        "| model | scheme | layout | vLLM | \\|Δ\\| vLLM vs mixprec | floor: unquantized, vLLM vs transformers | FP8 amplification | floor × amplification | within | \\|Δ\\| vLLM vs dequantized weights, unquantized activations (transformers) | NLL vLLM (original → quantized) | load s | kept in high precision by the shape rules |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        if r["served"]:
            served = f"served ({r.get('dtype', '?')})"
        else:
            served = f"not served: `{(r.get('reason') or '?')[:150]}`"
            fb = r.get("fallback")
            if fb and "error" not in fb:
                served += (f"; checked instead with {fb['loader']}: weights bit-identical {fb['weights_bit_identical']}, "
                           f"\\|Δ logprob\\| vs mixprec {_fmt(fb['vs_mixprec'])}")  # fmt: skip
            elif fb:
                served += f"; fallback failed: `{fb['error'][:120]}`"
        nll = "-"
        if r.get("vllm_nll") is not None:
            orig = r.get("vllm_nll_original")
            nll = f"{r['vllm_nll']:.4f}" if orig is None else f"{orig:.4f} → {r['vllm_nll']:.4f}"
        amp = f"{r['amplification']:.1f}x" if r.get("amplification") else "-"
        within = {True: "yes", False: "**no**", None: "-"}[r.get("within_floor")]
        kept = r.get("kept") or {}
        groups = sorted({n.rsplit(".", 1)[0] + "." + n.rsplit(".", 1)[1] for n in kept})
        kept_s = f"{len(kept)} Linears ({kept[groups[0]].split(' (')[0]})" if kept else "none"
        scheme = r["scheme"] + (f" + `--algorithm {r['algorithm']}`" if r.get("algorithm") else "")
        lines.append(
            f"| {r['model']} | {scheme} | {r['layout']} | {served} | {_fmt(r.get('vs_mixprec'))} | "
            f"{_fmt(r.get('floor'))} | {amp} | {_fmt(r.get('floor_quantized'))} | {within} | "
            f"{_fmt(r.get('vs_weights_only')) if 'transformers_error' not in r else 'transformers failed: `' + r['transformers_error'][:100] + '`'} | "
            f"{nll} | {r.get('load_s') or '-'} | {kept_s} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="phase", required=True)
    a = sub.add_parser("prepare")
    a.add_argument("--work", required=True)
    a.add_argument("--texts", required=True, help="prompts and calibration text, one per line")
    a.add_argument("--real", help="a real Hugging Face model directory (optional)")
    a.add_argument("--only", metavar="GLOB[,GLOB]",
                   help="only the variants whose id matches (e.g. '*gptq*,*awq'); the unquantized models always")  # fmt: skip
    a = sub.add_parser("serve")
    a.add_argument("--work", required=True)
    a.add_argument("--timeout", type=int, default=3600, help="seconds for one child process")
    a = sub.add_parser("serve-batch")  # internal: the child process of `serve`
    a.add_argument("--work", required=True)
    a = sub.add_parser("compare")
    a.add_argument("--work", required=True)
    a.add_argument("--reuse-fallbacks", action="store_true",
                   help="take the rows of checkpoints vLLM did not serve from the last serve_check.json")  # fmt: skip
    args = p.parse_args()
    {"prepare": prepare, "serve": serve, "serve-batch": serve_batch, "compare": compare}[args.phase](args)


if __name__ == "__main__":  # vLLM's engine starts worker processes: create vllm.LLM only under this guard
    main()
