#!/usr/bin/env bash
# Issue 8: every GPU check and benchmark in about 5 minutes on one H200, nothing downloaded.
#
#     bench/gpu.sh OUTDIR
#
# Writes OUTDIR/log.txt (versions, kernel report), OUTDIR/pytest_gpu.txt (the tests marked gpu),
# OUTDIR/summary.md (the tables for docs/benchmarks.md) and OUTDIR/results.json. Uses the machine's
# python3 with its torch/triton/transformers; mixprec runs from src/ (no install). Packages missing
# there (compressed-tensors, torchao, rouge-score) are not needed; wheels placed in .whl/ are
# installed into /tmp/site first (see the device README), for tests of other issues that want them.
set -u -o pipefail
OUT=${1:?usage: bench/gpu.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
start=$(date +%s)

{
    echo "== versions ($(date -u '+%Y-%m-%d %H:%M UTC'))"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
    $PY -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| gpu', torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
    $PY -c "import triton; print('triton', triton.__version__)" || echo "triton: not importable"
    $PY -c "import transformers; print('transformers', transformers.__version__)" || echo "transformers: not importable"
    echo "== mixprec doctor"
    $PY -c "from mixprec.cli import main; raise SystemExit(main(['doctor']))" || true
    echo "== native kernel report"
    $PY -c "import json; from mixprec.kernels import native_kernel_report; print(json.dumps(native_kernel_report(), indent=1))" || true
} 2>&1 | tee "$OUT/log.txt"

echo "== GPU tests (pytest -m gpu): issue 8's first, then the other packages' GPU tests" | tee -a "$OUT/log.txt"
timeout 140 $PY -m pytest -m gpu tests/kernels -q -rsx -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.txt"
echo "pytest tests/kernels exit: ${PIPESTATUS[0]} (124 = timed out)" | tee -a "$OUT/log.txt" "$OUT/pytest_gpu.txt"
timeout 60 $PY -m pytest -m gpu tests --ignore=tests/kernels -q -rsx -p no:cacheprovider --continue-on-collection-errors \
    2>&1 | tee -a "$OUT/pytest_gpu.txt"
echo "pytest other GPU tests exit: ${PIPESTATUS[0]} (124 = timed out)" | tee -a "$OUT/log.txt" "$OUT/pytest_gpu.txt"

echo "== benchmarks" | tee -a "$OUT/log.txt"
timeout 330 $PY bench/gpu_bench.py "$OUT" --budget-s 190 2>&1 | tee -a "$OUT/log.txt"
echo "gpu_bench exit: ${PIPESTATUS[0]} (124 = timed out)" | tee -a "$OUT/log.txt"
echo "== done in $(( $(date +%s) - start )) s; tables in $OUT/summary.md" | tee -a "$OUT/log.txt"
