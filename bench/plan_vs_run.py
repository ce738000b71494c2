"""`mixprec quantize --dry-run` against the run it plans: peak RSS, wall time, output bytes (issue 30).

    python bench/plan_vs_run.py MODEL[,MODEL...] SCHEME[,SCHEME...] [WORKDIR]

For each model and scheme: the plan (`--dry-run --json`), then the same command without `--dry-run` in a
subprocess (peak RSS from wait4 through bench/child_rss.py, wall time), its output measured and deleted.
One JSON line per pair, with the load average at the start of the run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child_rss import run_measured


def compare(model: str, scheme: str, root: Path) -> dict:
    out = root / f"out-{scheme}"
    base = [sys.executable, "-m", "mixprec", "quantize", "--model", model, "--output", str(out),
            "--scheme", scheme, "--json", "--quiet"]  # fmt: skip
    plan = json.loads(subprocess.run([*base, "--dry-run"], capture_output=True, text=True, check=True).stdout)
    load = os.getloadavg()[0]
    seconds, code, peak = run_measured(base, root / "run.json", stderr_to_stdout=False)
    if code != 0:
        raise SystemExit(f"mixprec quantize failed: {' '.join(base)}")
    size = sum(p.stat().st_size for p in out.iterdir())
    shutil.rmtree(out)
    return {
        "model": model, "scheme": scheme, "load": round(load, 1),
        "plan_seconds": round(plan["time"]["total"], 1), "run_seconds": round(seconds, 1),
        "plan_mib": round(plan["memory"]["total"] / 2**20), "run_mib": round(peak / 2**20),
        "plan_bytes": plan["output_bytes"], "run_bytes": size,
        "time_error": f"{plan['time']['total'] / seconds - 1:+.0%}",
        "memory_error": f"{plan['memory']['total'] / peak - 1:+.0%}",
    }  # fmt: skip


def main() -> int:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    with tempfile.TemporaryDirectory(
        prefix="plan-vs-run-", dir=sys.argv[3] if len(sys.argv) > 3 else None
    ) as tmp:
        for model in sys.argv[1].split(","):
            for scheme in sys.argv[2].split(","):
                print(json.dumps(compare(model, scheme, Path(tmp))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
