# Sourced by the GPU check scripts (gpu_check.sh, gpu_fidelity.sh) after they set PY, OUT and
# a title: starts OUT/summary.txt, defines say (echo and append to the summary), records the
# GPU and torch, and exits 1 when torch sees no CUDA device.
mkdir -p "$OUT"
summary="$OUT/summary.txt"
: > "$summary"
say() { echo "$*" | tee -a "$summary"; }

say "$TITLE $(date -u +%FT%TZ) on $(hostname) at $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$summary"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    say "no CUDA device visible to $PY (torch.cuda.is_available() is false): nothing to check"
    exit 1
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$summary"
