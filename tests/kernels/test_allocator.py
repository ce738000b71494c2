"""mixprec.kernels.allocator: the compute commands keep freed memory in the process (glibc mallopt), the
streaming quantize does not, and $MIXPREC_MALLOC is checked before any work."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mixprec.cli import build_parser, main
from mixprec.commands import demo as demo_cmd
from mixprec.errors import MixprecError
from mixprec.kernels import allocator

# 20 rounds of four 8 MiB buffers written once and freed, as an emulated GEMM's operands and results
# are: the page faults they cost (ru_minflt)
_FAULTS = """
import resource, torch
from mixprec.kernels import allocator
print(allocator.keep_freed_memory())
def round_of_buffers():
    buffers = [torch.empty(1 << 21).fill_(1.0) for _ in range(4)]
    del buffers
round_of_buffers()  # the first round faults whatever the setting
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    round_of_buffers()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(setting: str) -> tuple[str, int]:
    env = dict(os.environ, MIXPREC_MALLOC=setting)
    out = subprocess.run([sys.executable, "-c", _FAULTS], env=env, capture_output=True, text=True, check=True)
    said, faults = out.stdout.strip().splitlines()
    return said, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator only")
def test_kept_freed_memory_spares_the_page_faults_of_each_new_buffer():
    default_said, default_faults = _faults("default")
    kept_said, kept_faults = _faults("keep")
    assert "default" in default_said
    if allocator._glibc() is None:
        pytest.skip("not glibc: " + kept_said)
    assert kept_said.startswith("freed memory kept")
    # kept: the same pages again, at most two rounds' worth (4 x 2048 faults of 4 KiB pages a round)
    # while the heap settles (one round, 8192, in 12 of 12 runs on the EPYC; 10240 once in a CI run).
    # glibc's defaults mostly trim the freed top of the heap, so each round's buffers are fresh pages
    # (2048 faults per 8 MiB: 163k over the 20 rounds), but its dynamic mmap threshold sometimes keeps
    # them after a round or two (16k faults in 3 runs of 8 on the AMX Xeon), so only the order between
    # the two settings is asserted of the default
    assert kept_faults <= 2 * 4 * 2048 + 256
    assert default_faults > kept_faults


def test_a_bad_setting_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv(allocator.ENV_VAR, "jemalloc")
    with pytest.raises(MixprecError, match=r"MIXPREC_MALLOC='jemalloc'.*keep, default"):
        allocator.requested()


def test_the_command_checks_the_setting_before_any_work(monkeypatch, capsys):
    monkeypatch.setenv(allocator.ENV_VAR, "jemalloc")
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: pytest.fail("applied a bad setting"))
    monkeypatch.setattr(demo_cmd, "run", lambda args: pytest.fail("the demo started"))
    assert main(["demo"]) == 2
    assert "MIXPREC_MALLOC" in capsys.readouterr().err


def test_only_the_compute_commands_keep_freed_memory():
    parser = build_parser()
    keeps = {
        name
        for name in ("compare", "demo", "profile", "evaluate", "finetune", "quantize", "inspect", "convert")
        if parser.parse_args([name, *_required(name)])._keep_freed
    }
    assert keeps == {"compare", "demo", "profile", "evaluate", "finetune"}


def _required(name: str) -> list[str]:
    """The fewest arguments each command parses with (nothing runs)."""
    return {
        "quantize": ["--model", "m", "--output", "o"],
        "inspect": ["ckpt"],
        "convert": ["ckpt", "out", "--to", "hf-fp8"],
        "evaluate": ["--reference", "r", "--candidate", "c", "--data", "d"],
        "finetune": ["--model", "m", "--scheme", "nvfp4a16", "--mode", "qat", "--data", "d", "--output", "o"],
    }.get(name, [])


# 200 buffers of 1 MiB from the heap (a freed 20 MiB buffer first raises glibc's mmap threshold past
# them), all freed but the last, which pins the heap's top so that free() alone trims nothing
_TRIM = """
import torch
from mixprec.kernels import allocator
def anon():
    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('RssAnon')) * 1024
big = torch.empty(5 << 20).fill_(1.0)  # 20 MiB
del big
buffers = [torch.empty(1 << 18).fill_(1.0) for _ in range(200)]
last = buffers[-1]
del buffers
before = anon()
allocator.release_free_memory()
print((before - anon()) / (1 << 20))
"""


def test_free_memory_goes_back_to_the_kernel_between_blocks():
    """release_free_memory (called after each block of the layer-by-layer walk and each GPTQ solve)
    hands the heap's free pages back: the resident size drops by the freed buffers."""
    if not os.path.exists("/proc/self/status") or allocator._glibc() is None:
        pytest.skip("glibc on Linux")
    env = {**os.environ, allocator.ENV_VAR: "default"}
    out = subprocess.run([sys.executable, "-c", _TRIM], capture_output=True, text=True, check=True, env=env)
    assert float(out.stdout) > 150  # MiB of the 200 freed


class _RecordingLibc:
    def __init__(self):
        self.calls = []

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return 1


def test_large_blocks_go_back_while_streaming_and_the_threshold_is_left_at_its_largest(monkeypatch):
    """Within large_blocks_returned (the streaming quantize) glibc's mmap threshold is fixed at 4 MiB; after
    it, at 32 MiB; nothing is set where freed memory is kept, or off glibc."""
    libc = _RecordingLibc()
    monkeypatch.setattr(allocator, "_glibc", lambda: libc)
    monkeypatch.setattr(allocator, "_state", [])
    with allocator.large_blocks_returned():
        assert libc.calls == [(allocator._M_MMAP_THRESHOLD, 4 << 20)]
    assert libc.calls[-1] == (allocator._M_MMAP_THRESHOLD, 32 << 20)
    with pytest.raises(RuntimeError), allocator.large_blocks_returned():  # restored on an error too
        raise RuntimeError("stream failed")
    assert libc.calls[-1] == (allocator._M_MMAP_THRESHOLD, 32 << 20) and len(libc.calls) == 4
    monkeypatch.setattr(allocator, "_state", [allocator._KEPT])
    with allocator.large_blocks_returned():
        pass
    monkeypatch.setattr(allocator, "_glibc", lambda: None)
    monkeypatch.setattr(allocator, "_state", [])
    with allocator.large_blocks_returned():
        pass
    assert len(libc.calls) == 4
