"""Wall time and peak RSS of a child process, its own and nothing else's (shared by the bench scripts).

Linux starts a child's peak RSS at its parent's RSS: fork copies the memory map's high-water mark and exec
keeps it in the process's maximum. So wait4 on a child of a large process (pytest, or a bench that has
built a model) reports at least the parent's size. The command is therefore started from a small launcher
process, whose own small RSS is all its child inherits, and the launcher hands back wait4's figure.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

_LAUNCHER = """import os, subprocess, sys
proc = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(proc.pid, 0)
open(sys.argv[1], "w").write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def run_measured(cmd: list[str], stdout: Path, stderr_to_stdout: bool = True) -> tuple[float, int, int]:
    """Run cmd with its output to the file stdout; (wall seconds, exit code, the child's peak RSS in bytes)."""
    rss_file = stdout.with_name(stdout.name + ".maxrss")
    start = time.perf_counter()
    with open(stdout, "w") as fh:
        stderr = subprocess.STDOUT if stderr_to_stdout else None
        code = subprocess.run([sys.executable, "-c", _LAUNCHER, str(rss_file), *cmd], stdout=fh,
                              stderr=stderr).returncode  # fmt: skip
    seconds = time.perf_counter() - start
    peak_kib = int(rss_file.read_text()) if rss_file.exists() else 0
    rss_file.unlink(missing_ok=True)
    return seconds, code, peak_kib * 1024
