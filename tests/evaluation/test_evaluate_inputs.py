"""Samples as users give them, bad inputs refused before any model loads, honest labels, quiet output."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import mixprec.evaluation.runner as runner
from mixprec.cli import main
from mixprec.errors import MixprecError
from mixprec.evaluation import evaluate
from mixprec.texts import read_texts


def test_text_files_give_one_sample_per_line_or_paragraph(tmp_path):
    f = tmp_path / "s.txt"
    f.write_text("one two\n\n  three \r\nfour five six\n\n\nseven\n", encoding="utf-8")
    lines = read_texts(f, unit="line")
    assert lines.documents == ("one two", "three", "four five six", "seven")
    assert lines.names == ("line 1", "line 3", "line 4", "line 7")
    assert len(read_texts(f).documents) == 3  # paragraphs: the default, for corpora
    j = tmp_path / "s.jsonl"
    j.write_text('{"text": "a b"}\n\n{"text": "c\\nd"}\n', encoding="utf-8")
    assert read_texts(j, unit="line").documents == ("a b", "c\nd")  # a record is one sample, newlines and all
    folder = tmp_path / "dir"
    folder.mkdir()
    (folder / "a.txt").write_text("x\ny\n", encoding="utf-8")
    assert read_texts(folder, unit="line", split_folder_files=True).documents == ("x", "y")
    with pytest.raises(ValueError, match="unit"):
        read_texts(f, unit="word")


def test_embed_counts_every_line_and_refuses_fewer_than_asked(eval_env, tmp_path):
    lines = tmp_path / "lines.txt"
    lines.write_text(
        "\n".join(f"the model weights {w} scale" for w in ("a", "bit", "row", "sum", "grid")) + "\n"
    )
    bert = eval_env["bert"]
    r = evaluate(bert, bert, data=lines, samples=5, seq_len=16, progress=False)
    assert r.data["samples_used"] == {"embed": 5} and len(r.per_sample["embed.cosine"]) == 5
    assert r.data["unit"] == "line" and r.data["documents"] == 5
    with pytest.raises(MixprecError, match=r"gives 5 texts .* fewer than --samples 6"):
        evaluate(bert, bert, data=lines, samples=6, seq_len=16, progress=False)
    fewer = evaluate(bert, bert, data=lines, samples=6, seq_len=16, progress=False, allow_fewer=True)
    assert fewer.data["samples_used"] == {"embed": 5} and any("fewer" in w for w in fewer.warnings)
    whole = evaluate(bert, bert, data=lines, samples=1, seq_len=16, progress=False, paragraphs=True)
    assert whole.data["samples_used"] == {"embed": 1} and whole.data["documents"] == 1


@pytest.fixture
def no_model_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before every argument was checked")

    monkeypatch.setattr(runner, "as_side", refuse)


def test_bad_inputs_fail_in_one_line_before_any_model_loads(eval_env, tmp_path, capsys, no_model_loads):
    ref, corpus = str(eval_env["llama"]), str(eval_env["corpus"])  # tiny Llama: 128 positions
    base = ["evaluate", "--reference", ref, "--candidate", ref, "--data", corpus, "--no-progress",
            "--samples", "2", "--seq-len", "16"]  # fmt: skip
    cases = [
        (["--reference", corpus], "is a file, not a model directory"),
        (["--candidate", corpus], "is a file, not a model directory"),
        (["--seq-len", "129"], "--seq-len 129 is longer than the 128 positions"),
        (["--task", "generate", "--prompt-len", "100", "--max-new-tokens", "64"], "128 positions"),
        (["--calib-samples", "-3"], "--calib-samples must be at least 1, got -3"),
        (["--batch-size", "0"], "--batch-size must be at least 1"),
        (["--samples", "-1"], "--samples must be at least 1"),
        (["--samples", "100000"], "fewer than --samples 100000"),
        (["--level", "1.5"], "--level"),
        (["--resamples", "10"], "--resamples"),
        (["--task", "clip"], "does not apply"),
        (["--candidate", str(eval_env["bert"])], "architecture mismatch"),
        (["--data", str(tmp_path / "missing.txt")], "does not exist"),
    ]
    for extra, message in cases:
        capsys.readouterr()
        assert main([*base, *extra]) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("mixprec evaluate: error:") and message in err[0], (
            extra,
            err,
        )


def test_checkpoint_candidate_is_labelled_and_quiet(eval_env, tmp_path, capfd):
    """A checkpoint's scheme comes from its quantization_config; the emulation caveat is there; no warning
    about a buffer copy the checkpoint carries; --no-progress silences transformers' loading bars too."""
    import mixprec

    q = tmp_path / "bert-fp8"
    mixprec.inference.quantize_checkpoint(eval_env["bert"], q, scheme="fp8-dynamic")
    shard = next(q.glob("*.safetensors"))
    tensors = load_file(shard)
    tensors["embeddings.position_ids"] = torch.arange(128).unsqueeze(0)  # as older files hold it
    save_file(tensors, shard, metadata={"format": "pt"})
    out = tmp_path / "r.json"
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = main(["evaluate", "--reference", str(eval_env["bert"]), "--candidate", str(q), "--data",
                     str(eval_env["corpus"]), "--samples", "3", "--seq-len", "16", "--no-progress", "--json", str(out)])  # fmt: skip
    assert code == 0
    assert not [w for w in caught if "not used by the model" in str(w.message)]
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "it/s" not in err, err
    doc = json.loads(out.read_text())
    cand = doc["candidate"]
    assert cand["scheme"] == "fp8-dynamic" and cand["checkpoint_layout"] == "compressed-tensors"
    assert cand["tensor_bytes_by_dtype"]["float8_e4m3fn"] > 0
    assert any("emulated" in w for w in doc["warnings"])
