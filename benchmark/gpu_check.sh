#!/usr/bin/env bash
# The CUDA path on a CUDA machine, in under 8 minutes: build the extension, run the
# `gpu`-marked tests, then a short GPU benchmark (capture / plain on the toy model and a
# transformer, pinned asynchronous copies against the copy engine alone; see
# benchmark/gpu_bench.py). Run from anywhere: bash benchmark/gpu_check.sh
#
#   PY      python to use (default: .venv/bin/python if present, else python)
#   OUT     folder for the JSON and the logs (default: benchmark/results)
#
# Each step has its own time limit (build 300 s, tests 120 s, benchmark 120 s); the script
# stops at the first failure with that step's exit status.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
OUT=${OUT:-benchmark/results}
mkdir -p "$OUT"
STAMP=$(date +%Y-%m-%d)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
step() { echo "== [$(( $(date +%s) - start )) s] $*"; }

step "device"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" -c "import torch, sys; ok = torch.cuda.is_available(); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', ok); sys.exit(0 if ok else 3)"

step "build the extension (setup.py build_ext --inplace, MAX_JOBS=$(nproc))"
MAX_JOBS=$(nproc) timeout 300 "$PY" setup.py -q build_ext --inplace 2>&1 | tail -5
"$PY" -c "import activationscope._C"

step "gpu-marked tests"
timeout 120 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee "$OUT/gpu-tests-$STAMP.log" | tail -15

step "GPU benchmark"
timeout 120 "$PY" -m benchmark.gpu_bench --json "$OUT/gpu-$STAMP.json" 2>&1 | tee "$OUT/gpu-bench-$STAMP.log"

step "done: $OUT/gpu-$STAMP.json"
