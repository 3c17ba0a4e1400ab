#!/usr/bin/env bash
# The GPU fidelity check (issue 37, part 4): one prepared script of about 7 minutes for an
# NVIDIA machine. Run from the repository root:  bash benchmarks/gpu_fidelity.sh [OUT_DIR]
#
# 1. benchmarks/gpu_replay.py: 12 real sessions on the embedded engine on CUDA (Qwen2.5-7B,
#    Llama-3.1-8B, Qwen2.5-14B, random weights), talaria and round, priced by the shipped
#    h200 profile: SCTs, the simulator's error, every executed step in steps.json;
# 2. benchmarks/gpu_steps.py: a sample of those steps rebuilt and timed alone on the bare
#    engine (inside / alone per step kind), the step prices they fit, a profiler table;
# 3. the embedded engine's gpu tests (pytest -m gpu).
#
# Needs a Python ($PYTHON, default python3) with CUDA torch, pytest, transformers and
# Talaria's dependencies on its path (PYTHONPATH=$PWD; llguidance as a wheel where the
# image lacks it). At most 8 files land in OUT_DIR, two folders deep.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${1:-${OUT:-runs/gpu-fidelity}}
TITLE="gpu fidelity check"
mkdir -p "$OUT/replay"
. benchmarks/gpu_common.sh

start=$SECONDS
timeout ${REPLAY_TIMEOUT:-330} "$PY" benchmarks/gpu_replay.py --out "$OUT/replay" ${GPU_REPLAY_ARGS:-} \
    > "$OUT/replay/table.txt" 2> "$OUT/replay/log.txt"
say "gpu_replay: exit $? in $((SECONDS - start)) s (table $OUT/replay/table.txt)"
rm -f "$OUT/replay/policies.json"

start=$SECONDS
if [ -s "$OUT/replay/steps.json" ]; then
    timeout ${STEPS_TIMEOUT:-150} "$PY" benchmarks/gpu_steps.py --steps "$OUT/replay/steps.json" \
        --out "$OUT/steps_alone.json" > "$OUT/steps_alone.txt" 2>&1
    say "gpu_steps: exit $? in $((SECONDS - start)) s"
else
    say "gpu_steps: skipped (the replay wrote no steps.json)"
fi

start=$SECONDS
if "$PY" -c "import pytest, transformers" 2>/dev/null; then
    timeout ${PYTEST_TIMEOUT:-120} "$PY" -m pytest -q -p no:cacheprovider -m gpu \
        tests/engine/test_model.py tests/engine/test_runner.py tests/engine/test_staging.py \
        tests/engine/test_attention.py > "$OUT/pytest_gpu.log" 2>&1
    say "pytest -m gpu: exit $? in $((SECONDS - start)) s: $(tail -1 "$OUT/pytest_gpu.log")"
    tail -30 "$OUT/pytest_gpu.log" >> "$summary"
    rm -f "$OUT/pytest_gpu.log"
else
    say "pytest -m gpu: skipped (pytest or transformers missing in $PY)"
fi
cat "$OUT/replay/table.txt" "$OUT/steps_alone.txt" 2>/dev/null | tail -80
