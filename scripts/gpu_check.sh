#!/usr/bin/env bash
# The GPU check, in one command, on a machine with a GPU: build stoker against the tools
# already installed there, run the real-GPU tests (tests/gpu), the CUDA stand-in tests, both
# GPU benchmarks in their --quick form, and print a short table LAST.
#
#   bash scripts/gpu_check.sh        # everything also lands in $OUT (else gpu-check-out/)
#
# GPU nodes are often offline, so nothing is downloaded unless it is missing: the build uses
# `pip install --no-build-isolation --no-deps .` with the scikit-build-core, pybind11, cmake
# and ninja already there (a missing one is named and `pip install`ed on its own, from .whl/
# when that folder exists); the torch already there is used and never installed; pytest and
# numpy are installed only if missing; optional packages (kvikio) are skipped with a line.
# Every step has a time limit, and all of them together stay under 8 minutes (the budget
# below; the stand-in tests, which CI runs anyway, go last, so a slow build costs them and
# not the GPU measurements); a failing step does not stop the others. Exit status: 0 when
# the build and every test passed on a usable GPU, 1 otherwise (the benchmarks' numbers do
# not change it).
# $OUT gets 8 files (the most the device tool brings back): nvidia-smi.txt, build.txt,
# cuda_status.json, tests-gpu.txt, tests-standin.txt, h2d.txt, gds.txt, summary.md.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-check-out}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
budget=${GPU_CHECK_SECONDS:-470}  # the whole run, in seconds: under 8 minutes
start=$SECONDS
summary=()   # rows of the closing table: "what|result"
failed=0

row() { summary+=("$1|$2"); }
step() { printf '\n==== %s (%d s in)\n' "$1" $((SECONDS - start)); }

# run_step [-q] LOG LIMIT COMMAND...: run with a time limit (cut to what is left of the
# budget), output to the terminal (not with -q) and to $out/LOG; sets $rc (124: timed out)
# and $took.
run_step() {
  local quiet=0
  if [ "$1" = -q ]; then quiet=1; shift; fi
  local log=$1 limit=$2 left
  shift 2
  left=$((budget - (SECONDS - start) - 10))
  if [ "$left" -lt "$limit" ]; then limit=$left; fi
  if [ "$limit" -lt 15 ]; then
    echo "skipped: out of time (the whole check is limited to $budget s)" | tee "$out/$log"
    rc=125 took=0
    return
  fi
  local t0=$SECONDS
  if [ "$quiet" = 1 ]; then
    timeout --kill-after=10 "$limit" "$@" >"$out/$log" 2>&1
    rc=$?
  else
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/$log"
    rc=${PIPESTATUS[0]}
  fi
  took=$((SECONDS - t0))
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then echo "timed out after $limit s"; fi
}

# What a step's $rc says, for the table.
outcome() {
  case "$rc" in
    0) echo "ok" ;;
    124 | 137) echo "timed out" ;;
    125) echo "skipped: out of time" ;;
    *) echo "failed (exit status $rc)" ;;
  esac
}

pip_install() {
  if [ -d .whl ]; then
    "$py" -m pip install -q --no-index --find-links .whl "$@"
  else
    "$py" -m pip install -q "$@"
  fi
}

have_module() { "$py" -c "import $1" >/dev/null 2>&1; }

# pytest's closing line ("3 failed, 120 passed, 2 skipped in 40.1s"), or why there is none.
pytest_line() {
  local line
  line=$(grep -E '^=+ .*(passed|failed|error|skipped|deselected|no tests ran).* in [0-9.]+s' "$1" |
    tail -1 | sed -E 's/^=+ //; s/ =+$//')
  echo "${line:-no pytest summary (see $1)}"
}

# ---- the machine ----------------------------------------------------------------------------
step "machine"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi 2>&1 | tee "$out/nvidia-smi.txt"
  gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null |
    head -1)
else
  echo "nvidia-smi: not found" | tee "$out/nvidia-smi.txt"
  gpu="nvidia-smi not found"
fi
row "GPU (name, driver, memory)" "${gpu:-unknown}"
echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo 'unknown (no git here)')"
echo "cores: $(nproc); python: $("$py" --version 2>&1)"
cuda_ok=0
if have_module torch; then
  torch_line=$("$py" -c "import torch; print(torch.__version__, 'CUDA', torch.version.cuda, \
'available' if torch.cuda.is_available() else 'NOT available')" 2>&1 | tail -1)
  "$py" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null && cuda_ok=1
else
  torch_line="not installed (this check never installs torch: use the machine's CUDA build)"
fi
echo "torch: $torch_line"
row "torch" "$torch_line"

# ---- build tools, then the build ------------------------------------------------------------
step "build tools"
missing=()
have_module scikit_build_core || missing+=(scikit-build-core)
have_module pybind11 || missing+=(pybind11)
command -v cmake >/dev/null || have_module cmake || missing+=(cmake)
command -v ninja >/dev/null || have_module ninja || missing+=(ninja)
for module in numpy aiohttp tqdm; do  # stoker's own dependencies (--no-deps installs none)
  have_module "$module" || missing+=("$module")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "missing: ${missing[*]}; installing just those"
  pip_install "${missing[@]}" ||
    echo "could not install ${missing[*]} (offline? carry their wheels in .whl/)"
else
  echo "scikit-build-core, pybind11, cmake, ninja, numpy, aiohttp, tqdm: all here"
fi
if ! printf '#include <zlib.h>\n' | "${CXX:-c++}" -x c++ -E - >/dev/null 2>&1; then
  echo "warning: zlib.h not found by ${CXX:-c++}: the build needs zlib's headers (zlib1g-dev)"
fi

step "build: pip install --no-build-isolation --no-deps ."
run_step -q build.txt 300 "$py" -m pip install --no-build-isolation --no-deps -v .
if [ "$rc" = 0 ] && (cd "$out" && "$py" -c "import stoker._core" 2>/dev/null); then
  build_ok=1
  row "build" "ok (${took} s)"
else
  build_ok=0 failed=1
  echo "the build failed; its log ends:"
  tail -40 "$out/build.txt"
  row "build" "FAILED: $(outcome) after ${took} s; see build.txt"
fi

# ---- what the tests need ----------------------------------------------------------------
step "test dependencies"
for module in pytest numpy; do
  if ! have_module "$module"; then
    echo "$module is missing: installing it"
    pip_install "$module" || echo "could not install $module"
  fi
done
if have_module kvikio; then
  echo "kvikio: installed (benchmarks/gds.py includes it)"
  row "kvikio" "installed"
else
  echo "kvikio: not installed: benchmarks/gds.py skips its row (optional)"
  row "kvikio" "not installed: skipped (optional)"
fi

# ---- status -----------------------------------------------------------------------------
step "stoker.cuda_status()"
mode="unknown"
if [ "$build_ok" = 1 ]; then
  (cd "$out" && "$py" -c "import json, stoker; print(json.dumps(stoker.cuda_status(), indent=1))") \
    >"$out/cuda_status.json" 2>&1
  cat "$out/cuda_status.json"
  mode=$("$py" -c "import json, sys; s = json.load(open(sys.argv[1])); \
print(s['mode'] + ': ' + s['reason'])" "$out/cuda_status.json" 2>/dev/null || echo "unknown")
fi
row "stoker.cuda_status() mode" "$mode"

# ---- tests ------------------------------------------------------------------------------
step "tests/gpu (real GPU)"
if [ "$build_ok" = 1 ]; then
  run_step tests-gpu.txt 240 "$py" -m pytest tests/gpu -v -p no:cacheprovider
  [ "$rc" = 0 ] || failed=1
  note=""
  if [ "$cuda_ok" = 0 ]; then  # every GPU test skipped: nothing was verified
    note=", torch sees no CUDA device here: NOTHING was verified on a GPU"
    failed=1
  fi
  [ "$rc" = 0 ] || note=", $(outcome)$note"
  row "tests/gpu" "$(pytest_line "$out/tests-gpu.txt") (${took} s)$note"
else
  row "tests/gpu" "not run (no build)"
  failed=1
fi

# ---- benchmarks -----------------------------------------------------------------------------
step "benchmarks/h2d.py --quick"
if [ "$build_ok" = 1 ]; then
  run_step h2d.txt 150 "$py" benchmarks/h2d.py --quick
  line=$(grep -E '^stoker / ceiling \(large\)' "$out/h2d.txt" | tail -1)
  skip=$(grep -E '^h2d: skipped' "$out/h2d.txt" | tail -1)
  result="${line#stoker / ceiling (large): }${skip}"
  row "h2d: stoker / ceiling (large)" "${result:-$(outcome); see h2d.txt}"
else
  row "h2d: stoker / ceiling (large)" "not run (no build)"
fi

step "benchmarks/gds.py --quick"
if [ "$build_ok" = 1 ]; then
  run_step gds.txt 130 "$py" benchmarks/gds.py --quick
  line=$(grep -E '^headline \(cold' "$out/gds.txt" | tail -1)
  skip=$(grep -E '^gds: skipped' "$out/gds.txt" | tail -1)
  result="${line#headline (cold, np.save file): }${skip}"
  row "gds: cold, np.save file" "${result:-$(outcome); see gds.txt}"
else
  row "gds: cold, np.save file" "not run (no build)"
fi

# ---- the stand-in tests: CPU logic that CI runs too, so they come after the benchmarks
step "stand-in tests (ordering and logic only, not GPU verification)"
standins=()
for f in tests/test_cuda_standin.py tests/test_gds_cpu.py; do
  if [ -e "$f" ]; then standins+=("$f"); else echo "$f: not in this tree, skipped"; fi
done
if [ "$build_ok" = 1 ] && [ ${#standins[@]} -gt 0 ]; then
  run_step tests-standin.txt 150 "$py" -m pytest "${standins[@]}" -v -p no:cacheprovider
  [ "$rc" = 0 ] || failed=1
  note=""
  [ "$rc" = 0 ] || note=", $(outcome)"
  row "stand-in + CPU GDS tests" "$(pytest_line "$out/tests-standin.txt") (${took} s)$note"
else
  row "stand-in + CPU GDS tests" "not run"
  [ "$build_ok" = 1 ] || failed=1
fi

# ---- the table, last ------------------------------------------------------------------------
{
  printf '\n==== gpu_check summary (%d s; logs in %s)\n' $((SECONDS - start)) "$out"
  echo "| what | result |"
  echo "|---|---|"
  for r in "${summary[@]}"; do
    echo "| ${r%%|*} | ${r#*|} |"
  done
  if [ "$failed" = 0 ]; then
    echo "result: PASS (build and tests)"
  else
    echo "result: FAIL (build or tests; see the logs above)"
  fi
} | tee "$out/summary.md"
exit "$failed"
