"""The `mixprec` command's own rules: `python -m mixprec` is the command; compare, demo and evaluate check
their optional packages before any work (a missing one is simulated: blocked in sys.modules, never
uninstalled); a command that does not run data-parallel refuses a multi-process torchrun launch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mixprec import __version__
from mixprec.cli import main
from mixprec.commands import compare as compare_cmd
from mixprec.commands import convert as convert_cmd
from mixprec.commands import demo as demo_cmd
from mixprec.commands import evaluate as evaluate_cmd


def _no_work(*args, **kwargs):
    raise AssertionError("the command started its work before checking its optional packages")


def _block(monkeypatch, *modules: str) -> None:
    """`import <module>` fails and importlib.util.find_spec finds nothing: as on a base install."""
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)


def test_python_dash_m_mixprec_is_the_command():
    out = subprocess.run(
        [sys.executable, "-m", "mixprec", "--version"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == f"mixprec {__version__}", out.stderr[-2000:]


@pytest.mark.parametrize(
    "blocked, argv, named",
    [
        (
            ("matplotlib",),
            ["--out", "OUT"],
            ["matplotlib", "the plots of report.html", "pip install 'mixprec[report]'"],
        ),
        (("transformers",), ["--out", "OUT"], ["transformers for the model", "pip install 'mixprec[hf]'"]),
        (
            ("tokenizers", "matplotlib"),
            ["--out", "OUT"],
            ["tokenizers", "matplotlib", "'mixprec[hf,report]'"],
        ),
    ],
)
def test_compare_names_a_missing_extra_before_any_work(tmp_path, monkeypatch, capsys, blocked, argv, named):
    out = tmp_path / "out"
    monkeypatch.setattr(compare_cmd, "compare", _no_work)
    _block(monkeypatch, *blocked)
    argv = [str(out) if a == "OUT" else a for a in argv]
    assert main(["compare", "--steps", "2", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mixprec compare: error: mixprec compare needs ")
    for text in named:
        assert text in err, err
    assert not out.exists()  # nothing written: no INCOMPLETE.json, no report


def test_compare_without_out_needs_no_plots(monkeypatch):
    """No --out, no report: matplotlib is not asked for (the check reaches the comparison itself)."""

    class Reached(Exception):
        pass

    def reached(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(compare_cmd, "compare", reached)
    _block(monkeypatch, "matplotlib")
    with pytest.raises(Reached):
        main(["compare", "--steps", "2"])


def test_demo_names_a_missing_extra_before_any_work(tmp_path, monkeypatch, capsys):
    out = tmp_path / "demo"
    monkeypatch.setattr(demo_cmd, "run_demo", _no_work)
    _block(monkeypatch, "tokenizers")
    assert main(["demo", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "tokenizers for the tokenizer trained on the spot" in err and "pip install 'mixprec[hf]'" in err
    assert not out.exists()


@pytest.mark.parametrize(
    "blocked, extra_argv, named",
    [
        (("sacrebleu",), ["--task", "generate"], ["sacrebleu", "pip install 'mixprec[eval]'"]),
        (("rouge_score",), ["--task", "lm", "generate"], ["rouge-score", "pip install 'mixprec[eval]'"]),
        (("matplotlib",), ["--out", "REPORT"], ["matplotlib", "pip install 'mixprec[report]'"]),
        (("transformers",), [], ["transformers for loading the models", "pip install 'mixprec[hf]'"]),
    ],
)
def test_evaluate_names_a_missing_extra_before_any_work(
    tmp_path, monkeypatch, capsys, blocked, extra_argv, named
):
    monkeypatch.setattr(evaluate_cmd, "evaluate", _no_work)
    _block(monkeypatch, *blocked)
    report = tmp_path / "report"
    extra_argv = [str(report) if a == "REPORT" else a for a in extra_argv]
    argv = ["evaluate", "--reference", str(tmp_path), "--candidate-scheme", "bf16", "--data", str(tmp_path),
            "--json", str(tmp_path / "e.json"), *extra_argv]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    for text in named:
        assert text in err, err
    assert not report.exists() and not (tmp_path / "e.json").exists()


def test_evaluate_lm_needs_no_bleu(tmp_path, monkeypatch):
    class Reached(Exception):
        pass

    def reached(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(evaluate_cmd, "evaluate", reached)
    _block(monkeypatch, "sacrebleu", "rouge_score", "matplotlib")
    with pytest.raises(Reached):
        main(["evaluate", "--reference", str(tmp_path), "--candidate-scheme", "bf16", "--data", str(tmp_path),
              "--task", "lm"])  # fmt: skip


@pytest.mark.parametrize("rank, prints, code", [("0", True, 2), ("1", False, 0)])
def test_a_command_that_is_not_data_parallel_refuses_torchrun(
    tmp_path, monkeypatch, capsys, rank, prints, code
):
    """Two torchrun processes of `mixprec convert` would write the same output: no rank does any work;
    rank 0 prints the reason once and exits 2; the others leave quietly (exit 0), so that torchrun does
    not kill rank 0 before it has printed, and the job fails with rank 0's code."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("LOCAL_RANK", rank)
    monkeypatch.setattr(convert_cmd, "run", _no_work)
    out = tmp_path / "fp8"
    assert main(["convert", str(tmp_path), str(out), "--to", "hf-fp8"]) == code
    err = capsys.readouterr().err
    if prints:
        assert "mixprec convert: error: `mixprec convert` does not run data-parallel" in err
        assert "with 2 processes" in err and "--nproc-per-node 1" in err
    else:
        assert err == ""
    assert not out.exists()


def test_one_torchrun_process_is_a_plain_run(tmp_path, monkeypatch):
    """`torchrun --nproc-per-node 1` (WORLD_SIZE=1) is not refused: one process writes alone."""

    class Reached(Exception):
        pass

    def reached(args):
        raise Reached

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(convert_cmd, "run", reached)
    with pytest.raises(Reached):
        main(["convert", str(tmp_path), str(tmp_path / "fp8"), "--to", "hf-fp8"])


def test_quantize_help_names_every_format_it_writes_and_keeps_its_options(capsys):
    """`mixprec quantize` writes FP8, NVFP4 and MX checkpoints: its help says so (it once said "to FP8"),
    and the options, grouped by topic, are all still there."""
    with pytest.raises(SystemExit):
        main(["quantize", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "to FP8, NVFP4 or MXFP4/MXFP8" in text
    options = ["--model", "--output", "--scheme", "--dtype", "--format", "--kv-cache", "--max-shard-size",
               "--calib-data", "--calib-samples", "--calib-tolerance", "--calib-window", "--calib-min-tokens",
               "--calib-seq-len", "--observer", "--layer-by-layer", "--ignore", "--no-default-ignore", "--strict",
               "--budget", "--target-ppl-increase", "--score", "--candidates", "--scores", "--eval-data",
               "--eval-samples", "--eval-seq-len", "--search-steps", "--force", "--json", "--quiet"]  # fmt: skip
    assert [o for o in options if f"{o} " not in text] == []
