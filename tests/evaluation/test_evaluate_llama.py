"""`evaluate` on a tiny Llama built from a config: against itself, against FP8 versions, gates, bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from evaluation_fixtures import make_tokenizer, save, tiny_bert, tiny_llama

from mixprec.cli import main
from mixprec.errors import MixprecError
from mixprec.evaluation import Gates, evaluate
from mixprec.evaluation.gates import check_gates
from mixprec.evaluation.samples import read_documents
from mixprec.formats import E4M3
from mixprec.hf import Tokenizer, lm_blocks
from mixprec.quantization import fake_quantize
from mixprec.scaling import Granularity
from mixprec.verdicts import Interval

SAMPLES, SEQ = 8, 32


def _fp8_weights_copy(src_dir, dst_dir):
    """The same Llama with every Linear weight but lm_head rounded to FP8 E4M3 (per output channel)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src_dir)
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear) and "lm_head" not in name:
                mod.weight.copy_(fake_quantize(mod.weight, E4M3, Granularity.rows()))
    return save(model, make_tokenizer(), dst_dir)


@pytest.fixture(scope="module")
def fp8_dir(eval_env):
    return _fp8_weights_copy(eval_env["llama"], eval_env["root"] / "llama_fp8w")


def test_model_against_itself_is_exact(eval_env, tmp_path):
    d = eval_env["llama"]
    r = evaluate(d, d, data=eval_env["corpus"], task="lm,generate,embed", samples=SAMPLES, seq_len=SEQ,
                 max_new_tokens=24, progress=False)  # fmt: skip
    lm, gen, emb = r.tasks["lm"], r.tasks["generate"], r.tasks["embed"]
    assert lm["perplexity_relative_change"] == 0.0
    assert lm["reference_perplexity"] == lm["candidate_perplexity"]
    assert lm["top1_agreement"] == 1.0 and lm["kl_mean"] == 0.0
    assert gen["bleu"] == pytest.approx(100.0, abs=1e-9) and gen["rouge_l"] == 1.0
    assert gen["identical_outputs"] == 1.0 and gen["new_tokens"] == 24
    assert emb["cosine_mean"] == 1.0 and emb["cosine_min"] == 1.0
    assert r.memory["weight_saving_bytes"] == 0 and r.memory["reference_weight_bytes_disk"] > 0
    assert r.throughput["reference_tokens_per_s"] > 0 and r.throughput["candidate_tokens_per_s"] > 0
    assert r.machine["description"] and r.passed
    # identical models: every interval is the point itself
    for task, figure, value in (("lm", "perplexity_relative_change", 0.0), ("lm", "top1_agreement", 1.0),
                                ("lm", "kl_mean", 0.0), ("generate", "rouge_l", 1.0), ("embed", "cosine_mean", 1.0)):  # fmt: skip
        iv = r.tasks[task]["intervals"][figure]
        assert iv["low"] == iv["estimate"] == iv["high"] == pytest.approx(value) and iv["level"] == 0.95
    assert r.data["samples_used"] == {"lm": SAMPLES, "generate": SAMPLES, "embed": SAMPLES}
    d = r.to_dict()
    assert d["schema_version"] == 2 and json.loads(json.dumps(d)) == d


def _independent_lm(ref_dir, cand_dir, corpus, tok_hf):
    """Perplexities, KL and top-1 computed here with plain torch on the same blocks."""
    from transformers import AutoModelForCausalLM

    docs, _ = read_documents(corpus)
    blocks = lm_blocks(docs, Tokenizer(tok_hf, "t"), SEQ, SAMPLES)
    out = []
    for d in (ref_dir, cand_dir):
        m = AutoModelForCausalLM.from_pretrained(d).eval()
        with torch.no_grad():
            out.append(m(input_ids=blocks).logits[:, :-1].reshape(-1, m.config.vocab_size))
    targets = blocks[:, 1:].reshape(-1)
    ppl = [math.exp(F.cross_entropy(lg, targets).item()) for lg in out]
    kl = F.kl_div(
        F.log_softmax(out[1], -1), F.log_softmax(out[0], -1), log_target=True, reduction="batchmean"
    ).item()
    top1 = (out[0].argmax(-1) == out[1].argmax(-1)).float().mean().item()
    return ppl, kl, top1


def test_fp8_weights_candidate_agrees_with_independent_computation(eval_env, fp8_dir, tmp_path):
    r = evaluate(eval_env["llama"], fp8_dir, data=eval_env["corpus"], task=["lm", "generate"], samples=SAMPLES,
                 seq_len=SEQ, max_new_tokens=16, progress=False)  # fmt: skip
    lm, gen = r.tasks["lm"], r.tasks["generate"]
    (p_ref, p_cand), kl, top1 = _independent_lm(
        eval_env["llama"], fp8_dir, eval_env["corpus"], eval_env["tokenizer"]
    )
    assert lm["reference_perplexity"] == pytest.approx(p_ref, rel=1e-5)
    assert lm["candidate_perplexity"] == pytest.approx(p_cand, rel=1e-5)
    assert lm["kl_mean"] == pytest.approx(kl, rel=1e-3)
    assert lm["top1_agreement"] == pytest.approx(top1)
    # plausible: FP8 weights move a random tiny model a little, not a lot
    assert 0 < abs(lm["perplexity_relative_change"]) < 0.05 and 0 < lm["kl_mean"] < 0.05 and top1 > 0.8
    assert 0 <= gen["bleu"] <= 100 and 0 <= gen["rouge_l"] <= 1 and math.isfinite(gen["bleu"])
    # independent: greedy continuations generated here, scored with sacrebleu directly
    import sacrebleu
    from transformers import AutoModelForCausalLM

    # one prompt per line of the corpus: its first SEQ // 2 tokens, each generated alone (no batching)
    lines = [line.strip() for line in eval_env["corpus"].read_text().splitlines() if line.strip()][:SAMPLES]
    tok = eval_env["tokenizer"]
    texts = []
    for d in (eval_env["llama"], fp8_dir):
        m = AutoModelForCausalLM.from_pretrained(d).eval()
        outs = []
        for line in lines:
            prompt = torch.tensor([tok(line, add_special_tokens=False)["input_ids"][: SEQ // 2]])
            with torch.no_grad():
                out = m.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=16,
                                 min_new_tokens=16, pad_token_id=0)  # fmt: skip
            outs.append(tok.decode(out[0, prompt.shape[1] :], skip_special_tokens=True))
        texts.append(outs)
    assert gen["prompts"] == SAMPLES
    assert gen["bleu"] == pytest.approx(sacrebleu.corpus_bleu(texts[1], [texts[0]]).score, abs=1e-9)
    iv = gen["intervals"]["bleu"]
    assert iv["low"] <= gen["bleu"] <= iv["high"] and iv["samples"] == SAMPLES


def test_fp8_dynamic_online_and_checkpoint_candidates(eval_env, tmp_path):
    pytest.importorskip("mixprec.gemm")
    import mixprec

    common = {
        "data": eval_env["corpus"],
        "samples": SAMPLES,
        "seq_len": SEQ,
        "task": "lm,embed",
        "progress": False,
    }
    online = evaluate(eval_env["llama"], candidate_scheme="fp8-dynamic", **common)
    lm = online.tasks["lm"]
    assert all(
        math.isfinite(v)
        for v in (lm["candidate_perplexity"], lm["kl_mean"], online.tasks["embed"]["cosine_mean"])
    )
    assert 0 < abs(lm["perplexity_relative_change"]) < 0.05 and lm["top1_agreement"] > 0.8
    assert 0.9 < online.tasks["embed"]["cosine_mean"] < 1.0
    # the FP8 payloads replace the fp32 Linear weights: memory really drops
    assert online.memory["weight_saving_fraction"] > 0.3 and online.candidate["weight_bytes_disk"] is None

    # independent: quantize a copy here and compute its perplexity with plain torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(eval_env["llama"]).eval()
    mixprec.quantize_model_(model, "fp8-dynamic")
    docs, _ = read_documents(eval_env["corpus"])
    blocks = lm_blocks(docs, Tokenizer(eval_env["tokenizer"], "t"), SEQ, SAMPLES)
    with torch.no_grad():
        logits = model(input_ids=blocks).logits[:, :-1]
    ppl = math.exp(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), blocks[:, 1:].reshape(-1)).item())
    assert lm["candidate_perplexity"] == pytest.approx(ppl, rel=1e-5)

    # the same scheme written to a checkpoint and loaded back gives the same figures
    mixprec.inference.quantize_checkpoint(eval_env["llama"], tmp_path / "q", scheme="fp8-dynamic")
    offline = evaluate(eval_env["llama"], tmp_path / "q", **common)
    assert offline.tasks["lm"]["candidate_perplexity"] == pytest.approx(lm["candidate_perplexity"], rel=1e-6)
    assert (
        0
        < offline.memory["candidate_weight_bytes_disk"]
        < 0.5 * offline.memory["reference_weight_bytes_disk"]
    )


def test_gates_fail_beyond_the_measured_figures(eval_env, fp8_dir, tmp_path):
    r = evaluate(eval_env["llama"], fp8_dir, data=eval_env["corpus"], task="lm,generate,embed", samples=4,
                 seq_len=SEQ, max_new_tokens=12, progress=False)  # fmt: skip
    change, bleu_ = r.tasks["lm"]["perplexity_relative_change"], r.tasks["generate"]["bleu"]
    cos, speedup = r.tasks["embed"]["cosine_mean"], r.throughput["speedup"]

    # intervals shrunk to their points: the comparison's direction at the boundary, without sampling spread
    points = {task: {k: Interval(v, v, v, 0.95, 4)} for task, k, v in
              (("lm", "perplexity_relative_change", change), ("generate", "bleu", bleu_), ("embed", "cosine_mean", cos))}  # fmt: skip

    def verdicts(**kw):
        return [g.passed for g in check_gates(Gates(**kw), r.tasks, r.memory, r.throughput, points)]

    at = {"max_ppl_increase": change, "min_bleu": bleu_, "min_cosine": cos, "min_speedup": speedup}
    assert verdicts(**at, min_memory_saving="0%") == [True] * 5
    assert verdicts(max_ppl_increase=change - 1e-6, min_bleu=bleu_ + 0.01, min_cosine=cos + 1e-9,
                    min_speedup=speedup * 1.01, min_memory_saving="1B") == [False] * 5  # fmt: skip

    # the command: exit 0 when the gates hold, 1 when one fails; --json records the verdicts
    base = ["evaluate", "--reference", str(eval_env["llama"]), "--candidate", str(fp8_dir), "--data",
            str(eval_env["corpus"]), "--samples", "4", "--seq-len", str(SEQ), "--no-progress"]  # fmt: skip
    out = tmp_path / "r.json"
    assert main([*base, "--max-ppl-increase", str(abs(change) + 0.01), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["tasks"]["lm"]["perplexity_relative_change"] == change
    assert main([*base, "--max-ppl-increase", str(change - 1e-6), "--min-memory-saving", "1MB", "--json",
                 str(out), "--force"]) == 1  # fmt: skip
    doc = json.loads(out.read_text())
    # a threshold just under the estimate lies inside its interval: inconclusive, which passes unless --strict
    ppl, mem = doc["gates"]
    assert ppl["verdict"] == "inconclusive" and ppl["passed"] is True and ppl["samples_to_settle"] > 4
    assert ppl["interval"]["low"] < ppl["threshold"] < ppl["interval"]["high"]
    assert mem["verdict"] == "worse" and mem["passed"] is False and mem["measured"] == 0
    assert doc["passed"] is False
    assert main([*base, "--max-ppl-increase", str(change - 1e-6), "--strict"]) == 1


def test_library_gates_and_report(eval_env, tmp_path):
    from mixprec.evaluation import write_report

    d = eval_env["llama"]
    r = evaluate(
        d,
        d,
        data=eval_env["corpus"],
        samples=4,
        seq_len=SEQ,
        gates=Gates(min_memory_saving="1%"),
        progress=False,
    )
    assert not r.passed and r.gates[0].measured == 0.0
    html = write_report(r, tmp_path / "rep")
    assert html.name == "report.html" and "min_memory_saving" in html.read_text()
    assert (tmp_path / "rep" / "evaluation.json").is_file() and (
        tmp_path / "rep" / "memory_speed.png"
    ).is_file()


def test_bad_input_exits_2(eval_env, tmp_path, capsys):
    tok = make_tokenizer()
    other_vocab = save(tiny_llama(len(tok) + 16), tok, tmp_path / "vocab")
    other_arch = save(tiny_llama(len(tok), hidden=32), tok, tmp_path / "arch")
    bert = save(tiny_bert(len(tok)), tok, tmp_path / "bert")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    ref, corpus = str(eval_env["llama"]), str(eval_env["corpus"])
    cases = [
        (["--candidate", str(other_vocab), "--data", corpus], "vocabulary mismatch"),
        (["--candidate", str(other_arch), "--data", corpus], "architecture mismatch"),
        (["--candidate", str(bert), "--data", corpus], "architecture mismatch"),
        (["--candidate", ref, "--data", str(empty)], "empty"),
        (["--candidate", ref, "--data", corpus, "--samples", "0"], "--samples"),
        (["--candidate", str(tmp_path / "missing"), "--data", corpus], "does not exist"),
        (["--candidate", ref, "--data", corpus, "--task", "bogus"], "unknown task"),
        (["--candidate", ref, "--data", corpus, "--min-bleu", "10", "--task", "lm"], "needs task"),
        (["--candidate", ref, "--data", corpus, "--min-memory-saving", "lots"], "min-memory-saving"),
    ]
    for extra, message in cases:
        capsys.readouterr()
        assert (
            main(
                ["evaluate", "--reference", ref, "--no-progress", "--samples", "2", "--seq-len", "16", *extra]
            )
            == 2
        ), extra
        last = capsys.readouterr().err.strip().splitlines()[-1]  # transformers may print loading bars first
        assert last.startswith("mixprec evaluate: error:") and message in last, (extra, last)
    with pytest.raises(MixprecError, match="exactly one"):
        evaluate(ref, ref, candidate_scheme="bf16", data=corpus)


def test_modules_and_byte_fallback(eval_env, tmp_path):
    """Modules instead of directories; a directory without a tokenizer reads the data as UTF-8 bytes."""
    model = tiny_llama(256, seed=1)
    model.save_pretrained(tmp_path / "bytes")  # no tokenizer saved
    r = evaluate(tmp_path / "bytes", model, data=eval_env["corpus"], samples=3, seq_len=16, progress=False)
    assert (
        r.data["tokenizer"].startswith("utf-8 bytes") and r.tasks["lm"]["perplexity_relative_change"] == 0.0
    )
    assert r.data["samples_used"] == {"lm": 3} and r.candidate["weight_bytes_disk"] is None
    small = tiny_llama(64)
    small.save_pretrained(tmp_path / "small")
    with pytest.raises(MixprecError, match="no tokenizer"):
        evaluate(tmp_path / "small", small, data=eval_env["corpus"], samples=2, seq_len=16, progress=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_run_reports_cuda_peak(eval_env):
    r = evaluate(eval_env["llama"], candidate_scheme="fp8-dynamic", data=eval_env["corpus"], samples=8,
                 seq_len=SEQ, device="cuda", progress=False)  # fmt: skip
    assert r.memory["peak_cuda_bytes"] > 0 and r.machine["cuda_device"]
    assert abs(r.tasks["lm"]["perplexity_relative_change"]) < 0.05


def test_bf16_candidate_checks_the_guides_claim(eval_env):
    """The guide: the same BF16 weights serve inference with under 0.1% loss."""
    r = evaluate(eval_env["llama"], candidate_scheme="bf16", data=eval_env["corpus"], samples=4, seq_len=SEQ,
                 gates=Gates(max_ppl_increase="0.1%", min_memory_saving="50%"), progress=False)  # fmt: skip
    assert r.passed, [g.to_dict() for g in r.gates]
    assert r.candidate["parameter_dtypes"] == ["bfloat16"] and r.memory["weight_saving_fraction"] == 0.5
    assert abs(r.tasks["lm"]["perplexity_relative_change"]) < 1e-3 and r.tasks["lm"]["kl_mean"] > 0


def _bf16_pair(eval_env):
    """The tiny Llama in bf16 and a copy quantized online to fp8-dynamic, its layers forced onto the bf16
    forward (any CPU: runtime/bf16_forward.py) so that their decoded-weight caches fill."""
    import copy

    from transformers import AutoModelForCausalLM

    import mixprec
    from mixprec.inference import QuantizedLinear

    ref = AutoModelForCausalLM.from_pretrained(eval_env["llama"]).bfloat16()
    cand = copy.deepcopy(ref)
    mixprec.quantize_model_(cand, "fp8-dynamic")
    layers = [m for m in cand.modules() if isinstance(m, QuantizedLinear)]
    for m in layers:
        m.bf16_gemm = "always"
    return ref, cand, sum(2 * m.in_features * m.out_features for m in layers)


def test_decoded_weight_cache_counted_in_weights_in_memory(eval_env):
    """With the cache on, the candidate's weights in memory include its bf16 copies of the quantized
    weights (2 bytes per weight), exactly; off, none are held and the figure is the payloads' alone."""
    runs = {}
    for cache in (True, False):
        ref, cand, cache_bytes = _bf16_pair(eval_env)
        runs[cache] = evaluate(ref, cand, data=eval_env["corpus"], task="lm", samples=4, seq_len=16,
                               progress=False, decoded_cache=cache, tokenizer=eval_env["tokenizer"])  # fmt: skip
    on, off = runs[True], runs[False]
    assert on.candidate["decoded_weight_cache_bytes"] == cache_bytes
    assert off.candidate["decoded_weight_cache_bytes"] == 0
    assert on.candidate["decoded_weight_cache"] is True and off.candidate["decoded_weight_cache"] is False
    mem_on, mem_off = on.memory["candidate_weight_bytes_memory"], off.memory["candidate_weight_bytes_memory"]
    assert mem_on == mem_off + cache_bytes
    assert on.memory["weight_saving_bytes"] == off.memory["weight_saving_bytes"] - cache_bytes
    assert on.settings["decoded_cache"] is True and off.settings["decoded_cache"] is False
    assert on.tasks["lm"]["candidate_perplexity"] == off.tasks["lm"]["candidate_perplexity"]  # same bits


def test_no_decoded_cache_flag(eval_env, tmp_path):
    out = tmp_path / "r.json"
    code = main(["evaluate", "--reference", str(eval_env["llama"]), "--candidate-scheme", "fp8-dynamic", "--data",
                 str(eval_env["corpus"]), "--samples", "2", "--seq-len", "16", "--no-progress",
                 "--no-decoded-cache", "--json", str(out)])  # fmt: skip
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["settings"]["decoded_cache"] is False and doc["candidate"]["decoded_weight_cache"] is False
    assert doc["candidate"]["decoded_weight_cache_bytes"] == 0


def _independent_perplexity(eval_env, calib: int, algorithm: str) -> float:
    """The nvfp4a16 candidate made here by quantize_model_(..., algorithm=) on the `calib` blocks after
    the SAMPLES evaluated ones (as evaluate takes them), and its perplexity on those."""
    from transformers import AutoModelForCausalLM

    import mixprec

    docs, _ = read_documents(eval_env["corpus"])
    blocks = lm_blocks(docs, Tokenizer(eval_env["tokenizer"], "t"), SEQ, SAMPLES + calib)
    model = AutoModelForCausalLM.from_pretrained(eval_env["llama"]).eval()
    mixprec.quantize_model_(
        model, "nvfp4a16", calib_data=[b[None] for b in blocks[SAMPLES:]], algorithm=algorithm
    )
    with torch.no_grad():
        logits = model(input_ids=blocks[:SAMPLES]).logits[:, :-1]
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), blocks[:SAMPLES, 1:].reshape(-1))
    return math.exp(nll.item())


def test_fp4_candidate_scheme_rounded_by_gptq_matches_an_independent_run(eval_env):
    """--candidate-scheme nvfp4a16 --algorithm gptq: GPTQ calibrates on the blocks after the evaluated
    ones; the same quantize_model_ call made here on those blocks gives the same perplexity."""
    calib = 4
    r = evaluate(eval_env["llama"], candidate_scheme="nvfp4a16", algorithm="gptq", calib_samples=calib,
                 data=eval_env["corpus"], samples=SAMPLES, seq_len=SEQ, task="lm", progress=False)  # fmt: skip
    assert r.candidate["source"].startswith("online:nvfp4a16+gptq of ")
    alg = r.candidate["algorithm"]
    assert alg["names"] == ["gptq"] and alg["tokens"] == calib * SEQ and alg["median_output_error_vs_rtn"] < 1
    assert r.tasks["lm"]["candidate_perplexity"] == pytest.approx(
        _independent_perplexity(eval_env, calib, "gptq"), rel=1e-5
    )


def test_algorithm_needs_a_derived_candidate(eval_env):
    with pytest.raises(
        MixprecError, match="--algorithm gptq rounds a candidate derived with --candidate-scheme"
    ):
        evaluate(
            eval_env["llama"], eval_env["llama"], algorithm="gptq", data=eval_env["corpus"], samples=SAMPLES
        )
    with pytest.raises(MixprecError, match="unknown algorithm"):
        evaluate(eval_env["llama"], candidate_scheme="nvfp4a16", algorithm="gtpq", data=eval_env["corpus"])
    with pytest.raises(MixprecError, match=r"--algorithm smoothquant: .* nvfp4a16 quantizes weights only"):
        evaluate(
            eval_env["llama"], candidate_scheme="nvfp4a16", algorithm="smoothquant", data=eval_env["corpus"]
        )


def test_fp4_candidate_scheme_folded_by_awq_matches_an_independent_run(eval_env):
    """--candidate-scheme nvfp4a16 --algorithm awq: the fold runs on the evaluated copy of the reference
    (the reference itself is left as it is), on the blocks after the evaluated ones."""
    calib = 4
    r = evaluate(eval_env["llama"], candidate_scheme="nvfp4a16", algorithm="awq", calib_samples=calib,
                 data=eval_env["corpus"], samples=SAMPLES, seq_len=SEQ, task="lm", progress=False)  # fmt: skip
    assert r.candidate["source"].startswith("online:nvfp4a16+awq of ")
    assert (
        r.candidate["algorithm"]["names"] == ["awq"]
        and r.candidate["algorithm"]["folds"]["awq"]["folded"] >= 1
    )
    assert r.tasks["lm"]["candidate_perplexity"] == pytest.approx(
        _independent_perplexity(eval_env, calib, "awq"), rel=1e-5
    )
    plain = evaluate(eval_env["llama"], candidate_scheme="nvfp4a16", calib_samples=calib, data=eval_env["corpus"],
                     samples=SAMPLES, seq_len=SEQ, task="lm", progress=False)  # fmt: skip
    assert r.tasks["lm"]["reference_perplexity"] == plain.tasks["lm"]["reference_perplexity"]
