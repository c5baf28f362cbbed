#!/usr/bin/env bash
# The CUDA path on a CUDA machine, in under 8 minutes: install the wheels of .whl/ (the
# dependencies the machine lacks, see benchmark/gpu_wheels.sh), build the extension against the
# machine's torch, run the `gpu`-marked tests, then a short GPU benchmark (capture / plain on
# the toy model and a transformer, pinned asynchronous copies against the copy engine alone;
# see benchmark/gpu_bench.py). Run from anywhere: bash benchmark/gpu_check.sh
#
#   PY                 python to use (default: .venv/bin/python if present, else python3, else python)
#   OUT                folder for the JSON and the logs (default: benchmark/results)
#   WHEELS             folder of wheels to install first when it holds any (default: .whl)
#   ACS_SITE           where those wheels are installed, put on PYTHONPATH (default: a new temporary folder
#                      in $TMPDIR, removed at exit)
#   ACS_GPU_DRY_RUN=1  run every step on the CPU except those that need CUDA: the wheel install,
#                      the build, the collection of the gpu-marked tests (they skip without
#                      CUDA) and the benchmark script with --device cpu and small sizes; proves
#                      the plumbing on a machine without a GPU (no GPU figure comes out of it)
#   ACS_BUILD_TIMEOUT_S  the build step's limit (default 210; a 2-core machine needs about 15 minutes)
#
# Each step has its own time limit (wheels 30 s, build 210 s, tests 120 s, benchmark 120 s:
# 8 minutes at the very worst). The device and build steps stop
# the script at a failure; the tests and the benchmark run whatever the other's outcome, and
# the script exits with the first failing step's status. Whatever happens, it ends with a
# summary (each step: ok or its exit status, seconds, what it found), also written to
# $OUT/gpu-steps-DATE.json.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python
  elif command -v python3 >/dev/null; then PY=python3
  else PY=python
  fi
fi
DRY=${ACS_GPU_DRY_RUN:-0}
OUT=${OUT:-benchmark/results}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
STAMP=$(date +%Y-%m-%d)
start=$(date +%s)
status=0
STEPS=()  # "name|exit status|seconds|detail" of each step that ran, for the summary
current=""
current_t0=$start
step() {  # step NAME TEXT: a step begins (the one before it ended ok unless done said otherwise)
  [ -z "$current" ] || done_step 0 ""
  current=$1
  current_t0=$(date +%s)
  echo "== [$(( current_t0 - start )) s] $2"
}
done_step() {  # done_step STATUS DETAIL: the current step ended
  [ -n "$current" ] || return 0
  STEPS+=("$current|$1|$(( $(date +%s) - current_t0 ))|$2")
  current=""
}
fail() {  # fail STATUS WHAT: the current step failed; remember the first failure
  echo "!! $2 failed (exit status $1)"
  [ "$status" -ne 0 ] || status=$1
  done_step "$1" "$2"
}
json_str() { printf '"%s"' "$(printf '%s' "$1" | sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' | tr -d '\000-\037')"; }
summary() {  # at exit, whatever the cause: one line per step, and the same as JSON
  done_step 0 ""
  echo "== summary (exit status $status; dry run: $DRY)"
  local json="" sep="" name rc secs detail
  for s in ${STEPS[@]+"${STEPS[@]}"}; do
    IFS='|' read -r name rc secs detail <<<"$s"
    printf '  %-10s %-16s %5s s  %s\n' "$name" "$([ "$rc" = 0 ] && echo ok || echo "FAILED ($rc)")" "$secs" "$detail"
    json+="$sep{\"step\": $(json_str "$name"), \"exit_status\": $rc, \"seconds\": $secs, \"detail\": $(json_str "$detail")}"
    sep=", "
  done
  printf '{"exit_status": %s, "dry_run": %s, "steps": [%s]}\n' "$status" "$([ "$DRY" = 1 ] && echo true || echo false)" \
    "$json" >"$OUT/gpu-steps-$STAMP.json"
  echo "  (also $OUT/gpu-steps-$STAMP.json)"
  [ -z "${MADE_SITE:-}" ] || rm -rf "$MADE_SITE"
}
trap summary EXIT

step python "python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])' 2>&1))$([ "$DRY" = 1 ] && echo ', dry run on the CPU')"

if compgen -G "$WHEELS/*.whl" >/dev/null; then
  if [ -n "${ACS_SITE:-}" ]; then
    SITE=$ACS_SITE
  else  # (made here: removed at exit, by summary)
    SITE=$(mktemp -d "${TMPDIR:-/tmp}/acs-site.XXXXXX")
    MADE_SITE=$SITE
  fi
  n_wheels=$(find "$WHEELS" -maxdepth 1 -name '*.whl' | wc -l)
  step wheels "install $n_wheels wheels of $WHEELS into $SITE"
  timeout 30 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --disable-pip-version-check --target "$SITE" "$WHEELS"/*.whl || { fail $? "wheel install"; exit "$status"; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

step deps "runtime dependencies"
"$PY" - <<'PYEOF' || { fail $? "dependency check"; exit "$status"; }
import importlib, sys
missing = []
for name in ("torch", "numpy", "zarr", "numcodecs", "google_crc32c", "donfig", "pyarrow", "fsspec", "tqdm", "pytest"):
    try:
        mod = importlib.import_module(name)
        print(f"  {name} {getattr(mod, '__version__', '')} ({mod.__file__})")
    except ImportError as e:
        missing.append(f"{name} ({e})")
if missing:
    sys.exit(f"missing: {', '.join(missing)}: run `bash benchmark/gpu_wheels.sh` where pip works, and bring .whl/ along")
PYEOF

step device "device"
if [ "$DRY" = 1 ]; then
  echo "  dry run: no CUDA needed"
else
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  "$PY" -c "import torch, sys; ok = torch.cuda.is_available(); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', ok, 'devices', torch.cuda.device_count()); sys.exit(0 if ok else 3)" \
    || { fail $? "CUDA check (torch.cuda.is_available() is False; ACS_GPU_DRY_RUN=1 runs the CPU steps)"; exit "$status"; }
fi

step build "build the extension against torch $("$PY" -c 'import torch; print(torch.__version__)') (setup.py build_ext --inplace, MAX_JOBS=$(nproc))"
MAX_JOBS=$(nproc) timeout "${ACS_BUILD_TIMEOUT_S:-210}" "$PY" setup.py -q build_ext --inplace >"$OUT/gpu-build-$STAMP.log" 2>&1
rc=$?
tail -5 "$OUT/gpu-build-$STAMP.log"
[ $rc -eq 0 ] || { fail $rc "build (log: $OUT/gpu-build-$STAMP.log)"; exit "$status"; }
"$PY" -c "from activationscope.capture import _native; m = _native.load(); print('  loaded', m.__file__, 'built against torch', m.TORCH_VERSION)" \
  || { fail $? "loading the extension"; exit "$status"; }

# Collecting `tests` imports every test module; those that need packages missing here (dask,
# moto, transformer_lens, ...) import them inside the tests (pytest.importorskip), so the
# gpu-marked tests are collected with the rest. Without CUDA every gpu-marked test skips.
# -v: the log names each test as it ends, so a run stopped at its limit still shows how far it
# got; faulthandler_timeout: a test stuck past 60 s (a copy that never completes) prints every
# thread's stack into the log; -rfEs: failures, errors and skips in the short summary.
step tests "gpu-marked tests"
timeout 120 "$PY" -m pytest -v -rfEs -p no:cacheprovider -o faulthandler_timeout=60 -m gpu tests \
  >"$OUT/gpu-tests-$STAMP.log" 2>&1
rc=$?
grep -E '^(FAILED|ERROR|SKIPPED) ' "$OUT/gpu-tests-$STAMP.log" | head -40
counts=$(grep -E '^=+ .*(passed|failed|skipped|error|deselected|no tests ran).* =+$' "$OUT/gpu-tests-$STAMP.log" | tail -1 | tr -d '=' | sed 's/^ *//; s/ *$//')
[ -n "$counts" ] || counts="no pytest summary (stopped at its limit? the log shows the last test that ended)"
echo "  $counts"
if [ $rc -ne 0 ]; then
  fail $rc "gpu-marked tests: $counts"
elif [ "$DRY" = 1 ] && ! grep -q -E '[0-9]+ skipped' <<<"$counts"; then
  fail 1 "gpu-marked tests (the dry run expects them collected and skipped): $counts"
else
  done_step 0 "$counts"
fi

step bench "GPU benchmark"
if [ "$DRY" = 1 ]; then
  BENCH=(--device cpu --forwards 5 --repeats 1)
else
  BENCH=()
fi
timeout 120 "$PY" -m benchmark.gpu_bench ${BENCH[@]+"${BENCH[@]}"} --json "$OUT/gpu-$STAMP.json" \
  >"$OUT/gpu-bench-$STAMP.log" 2>&1
rc=$?
cat "$OUT/gpu-bench-$STAMP.log"
if [ $rc -ne 0 ]; then
  fail $rc "GPU benchmark (log: $OUT/gpu-bench-$STAMP.log)"
else
  done_step 0 "$OUT/gpu-$STAMP.json"
fi

echo "== [$(( $(date +%s) - start )) s] done (exit status $status): $OUT/gpu-$STAMP.json and the logs gpu-*-$STAMP.log"
exit "$status"
