#!/usr/bin/env bash
# On a machine with a GPU: build stoker, run the GPU tests and the GPU benchmarks in one go.
# Usage: bash scripts/gpu_check.sh   (results also land in $OUT when that is set)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-check-out}
mkdir -p "$out"
nvidia-smi | tee "$out/nvidia-smi.txt" || true
python3 -m pip install -q ".[test]"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" | tee "$out/torch.txt"
status=0
python3 -m pytest tests/gpu -v 2>&1 | tee "$out/gpu-tests.txt" || status=$?
# GPU benchmarks join here as they are written (benchmarks/*_gpu.py).
for bench in benchmarks/*_gpu.py; do
  [ -e "$bench" ] || continue
  python3 "$bench" 2>&1 | tee "$out/$(basename "$bench" .py).txt" || status=$?
done
exit "$status"
