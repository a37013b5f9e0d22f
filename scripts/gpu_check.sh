#!/usr/bin/env bash
# The GPU check, in one command, on a machine with a GPU: build stoker against the tools
# already installed there, run the real-GPU tests (tests/gpu), the GPU benchmarks (h2d.py,
# gds.py, gpu_patches.py) in their --quick form, the CUDA stand-in tests, and print a short
# table LAST.
#
#   bash scripts/gpu_check.sh        # everything also lands in $OUT (else gpu-check-out/)
#
# GPU nodes are often offline, so nothing is downloaded unless it is missing: the build uses
# `pip install --no-build-isolation --no-deps .` with the scikit-build-core, pybind11, cmake
# and ninja already there (a missing one is named and `pip install`ed on its own, from .whl/
# when that folder exists); the torch already there is used and never installed; pytest and
# numpy are installed only if missing; optional packages (kvikio, nibabel, monai) are skipped
# with a line.
# Missing C headers the build needs (zlib.h, Python.h) stop it up front with a clear line.
#
# Time: the whole run stays under 8 minutes ($budget below). Each step has a time limit,
# and the steps after it are promised their share, which no earlier step can eat into: the
# build gets at most 150 s, tests/gpu 110 s or more, h2d.py 70 s or more, gds.py (the .npy
# and the NIfTI volumes) 90 s or more, gpu_patches.py (patches into device memory: the
# cuFile gather, PatchLoader's pinned path, MONAI) 40 s or more, at most 60 (the benchmarks
# stop themselves inside their limits and print tables from what finished), the stand-in
# tests (CPU logic, which CI runs anyway) whatever is left. A failing step does not stop
# the others.
# Exit status: 0 when the build and every test passed on a usable GPU, 1 otherwise (the
# benchmarks' numbers do not change it).
#
# $OUT gets at most 8 files (the most the device tool brings back): nvidia-smi.txt,
# build.txt, cuda_status.json, tests-gpu.txt, h2d.txt, gds.txt (gpu_patches.py's output is
# appended to it), tests-standin.txt, summary.md. Nothing runs with $OUT as its working
# directory (cuFile, without nvidia-fs, writes cufile.log into the working directory:
# CUFILE_LOGFILE_PATH sends it to /tmp/cufile.log, whose tail is appended to gds.txt).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-check-out}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
export CUFILE_LOGFILE_PATH=/tmp/cufile.log
rm -f "$CUFILE_LOGFILE_PATH"
budget=${GPU_CHECK_SECONDS:-470} # the whole run, in seconds: under 8 minutes
# Seconds promised to the steps that come later, whatever the earlier ones take.
share_status=10 share_tests_gpu=110 share_h2d=70 share_gds=90 share_patches=40
build_max=150
bench_dir=bench-data/gds # benchmarks/gds.py's default --dir
start=$SECONDS
summary=() # rows of the closing table: "what|result"
failed=0
build_ok=0

row() { summary+=("$1|$2"); }
step() { printf '\n==== %s (%d s in)\n' "$1" $((SECONDS - start)); }

# limit_for CAP PROMISED: the seconds a step may take: at most CAP, and never any of the
# PROMISED seconds the steps after it are owed.
limit_for() {
  local left=$((budget - (SECONDS - start) - $2 - 3))
  if [ "$left" -lt "$1" ]; then echo "$left"; else echo "$1"; fi
}

# run_step [-q] [-a] LOG LIMIT COMMAND...: run COMMAND (from the repository root) for at
# most LIMIT seconds, output to the terminal (not with -q) and to $out/LOG (appended to it
# with -a); sets $rc (124: timed out, 125: no time left to start it) and $took.
run_step() {
  local quiet=0 append=()
  while [ "$1" = -q ] || [ "$1" = -a ]; do
    if [ "$1" = -q ]; then quiet=1; else append=(-a); fi
    shift
  done
  local log=$1 limit=$2
  shift 2
  if [ "$limit" -lt 15 ]; then
    echo "skipped: out of time (the whole check is limited to $budget s)" |
      tee ${append[@]+"${append[@]}"} "$out/$log"
    rc=125 took=0
    return
  fi
  local t0=$SECONDS
  if [ "$quiet" = 1 ]; then
    if [ ${#append[@]} = 0 ]; then
      timeout --kill-after=10 "$limit" "$@" >"$out/$log" 2>&1
    else
      timeout --kill-after=10 "$limit" "$@" >>"$out/$log" 2>&1
    fi
    rc=$?
  else
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee ${append[@]+"${append[@]}"} "$out/$log"
    rc=${PIPESTATUS[0]}
  fi
  took=$((SECONDS - t0))
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then echo "timed out after $limit s" | tee -a "$out/$log"; fi
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
  local limit
  limit=$(limit_for 90 $((share_status + share_tests_gpu + share_h2d + share_gds + share_patches)))
  if [ "$limit" -lt 15 ]; then
    echo "no time left to install $*"
    return 1
  fi
  if [ -d .whl ]; then
    timeout "$limit" "$py" -m pip install -q --no-index --find-links .whl "$@"
  else
    timeout "$limit" "$py" -m pip install -q "$@"
  fi
}

have_module() { "$py" -c "import $1" >/dev/null 2>&1; }

# pytest's closing line ("3 failed, 120 passed, 2 skipped in 40.1s"), or why there is none.
pytest_line() {
  local line
  line=$(grep -E '^=+ .*(passed|failed|error|skipped|deselected|no tests ran).* in [0-9.]+s' "$1" |
    tail -1 | sed -E 's/^=+ //; s/ =+$//')
  echo "${line:-no pytest summary (see $(basename "$1"))}"
}

# ---- the machine ----------------------------------------------------------------------------
step "machine"
if command -v nvidia-smi >/dev/null; then
  timeout 30 nvidia-smi 2>&1 | tee "$out/nvidia-smi.txt"
  gpu=$(timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
    2>/dev/null | head -1)
else
  echo "nvidia-smi: not found" | tee "$out/nvidia-smi.txt"
  gpu="nvidia-smi not found"
fi
row "GPU (name, driver, memory)" "${gpu:-unknown}"
echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo 'unknown (no git here)')"
echo "cores: $(nproc); python: $("$py" --version 2>&1)"
cuda_ok=0
torch_line=$(timeout 60 "$py" -c "import torch; print(torch.__version__, 'CUDA', \
torch.version.cuda, 'available' if torch.cuda.is_available() else 'NOT available')" 2>&1 | tail -1)
case "$torch_line" in
  *"NOT available") ;;
  *" available") cuda_ok=1 ;;
  *) torch_line="does not import (this check never installs torch: use the machine's CUDA \
build): ${torch_line:-no output}" ;;
esac
echo "torch: $torch_line"
row "torch" "$torch_line"

# ---- what the build cannot do without: fatal up front -----------------------------------------
step "build prerequisites (C++ compiler, zlib.h, Python.h)"
fatal=()
cxx=""
for candidate in "${CXX:-}" c++ g++ clang++; do
  if [ -n "$candidate" ] && command -v "$candidate" >/dev/null; then
    cxx=$candidate
    break
  fi
done
if [ -z "$cxx" ]; then
  fatal+=("no C++ compiler (looked for \$CXX, c++, g++, clang++): install g++ (build-essential)")
else
  echo "compiler: $cxx ($("$cxx" --version 2>&1 | head -1))"
  if printf '#include <zlib.h>\n' | "$cxx" -x c++ -E - >/dev/null 2>&1; then
    echo "zlib.h: found"
  else
    fatal+=("zlib.h not found by $cxx: the build needs zlib's headers (apt-get install zlib1g-dev, or yum install zlib-devel)")
  fi
  py_dirs=$("$py" -c "import sysconfig; p = sysconfig.get_paths(); \
print(p['include']); print(p['platinclude'])" 2>/dev/null)
  py_version=$("$py" -c "import sys; print('%d.%d' % sys.version_info[:2])" 2>/dev/null)
  py_flags=() # the headers of $py itself (the build's), each folder once
  while IFS= read -r d; do
    case " ${py_flags[*]:-} " in *" -I$d "*) ;; *) [ -n "$d" ] && py_flags+=("-I$d") ;; esac
  done <<<"$py_dirs"
  if [ ${#py_flags[@]} = 0 ] && command -v python3-config >/dev/null; then
    for f in $(python3-config --includes 2>/dev/null); do py_flags+=("$f"); done
  fi
  if [ ${#py_flags[@]} -gt 0 ] &&
    printf '#include <Python.h>\n' | "$cxx" -x c++ -E "${py_flags[@]}" - >/dev/null 2>&1; then
    echo "Python.h: found (${py_flags[*]})"
  else
    fatal+=("Python.h not found for $py ${py_version:-?} (looked in: ${py_flags[*]:-nothing: $py did not answer}): the build needs Python's headers (apt-get install python${py_version:-3}-dev, or yum install python3-devel)")
  fi
fi
if [ ${#fatal[@]} -gt 0 ]; then
  for f in "${fatal[@]}"; do echo "FATAL: $f"; done
  echo "FATAL: stoker cannot be built here; nothing else runs (the table follows)" |
    tee "$out/build.txt"
  printf '%s\n' "${fatal[@]}" >>"$out/build.txt"
  failed=1
  row "build" "NOT RUN: $(IFS=';'; echo "${fatal[*]}")"
else
  # ---- build tools, then the build ----------------------------------------------------------
  step "build tools"
  missing=()
  have_module scikit_build_core || missing+=(scikit-build-core)
  have_module pybind11 || missing+=(pybind11)
  command -v cmake >/dev/null || have_module cmake || missing+=(cmake)
  command -v ninja >/dev/null || have_module ninja || missing+=(ninja)
  for module in numpy aiohttp tqdm; do # stoker's own dependencies (--no-deps installs none)
    have_module "$module" || missing+=("$module")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "missing: ${missing[*]}; installing just those"
    pip_install "${missing[@]}" ||
      echo "could not install ${missing[*]} (offline? carry their wheels in .whl/)"
  else
    echo "scikit-build-core, pybind11, cmake, ninja, numpy, aiohttp, tqdm: all here"
  fi

  step "build: pip install --no-build-isolation --no-deps ."
  limit=$(limit_for "$build_max" \
    $((share_status + share_tests_gpu + share_h2d + share_gds + share_patches)))
  run_step -q build.txt "$limit" "$py" -m pip install --no-build-isolation --no-deps -v .
  # imported from the repository root, where no stoker/ folder shadows the installed one
  if [ "$rc" = 0 ] && "$py" -c "import stoker._core" 2>/dev/null; then
    build_ok=1
    row "build" "ok (${took} s)"
  else
    failed=1
    echo "the build failed; its log ends:"
    tail -40 "$out/build.txt"
    row "build" "FAILED: $(outcome) after ${took} s; see build.txt"
  fi
fi

# ---- what the tests need ----------------------------------------------------------------
if [ "$build_ok" = 1 ]; then
  step "test dependencies"
  for module in pytest numpy; do
    if ! have_module "$module"; then
      echo "$module is missing: installing it"
      pip_install "$module" || echo "could not install $module"
    fi
  done
fi
if have_module kvikio; then
  echo "kvikio: installed (benchmarks/gds.py includes it)"
  row "kvikio" "installed"
else
  echo "kvikio: not installed: benchmarks/gds.py skips its row (optional)"
  row "kvikio" "not installed: skipped (optional)"
fi
if have_module nibabel; then
  echo "nibabel: installed (benchmarks/gds.py includes its NIfTI baselines)"
  row "nibabel" "installed"
else
  echo "nibabel: not installed: benchmarks/gds.py skips its NIfTI baselines (optional)"
  row "nibabel" "not installed: NIfTI baselines skipped (optional)"
fi
if have_module monai; then
  echo "monai: installed (benchmarks/gpu_patches.py includes it)"
  row "monai" "installed"
else
  echo "monai: not installed: benchmarks/gpu_patches.py skips its MONAI rows (optional)"
  row "monai" "not installed: gpu_patches MONAI rows skipped (optional)"
fi

# ---- status -----------------------------------------------------------------------------
mode="not run (no build)"
bench_mode="not run (no build)"
if [ "$build_ok" = 1 ]; then
  step "stoker.cuda_status(), stoker.gds.read_mode()"
  mkdir -p "$bench_dir"
  limit=$(limit_for 60 $((share_tests_gpu + share_h2d + share_gds + share_patches)))
  [ "$limit" -lt 15 ] && limit=15
  # stdout (the JSON) to the file, stderr kept aside: appended only if there is no JSON
  status_err=$(timeout "$limit" "$py" - "$bench_dir" 2>&1 >"$out/cuda_status.json" <<'EOF'
import json, os, subprocess, sys, warnings
import stoker

def fs(path):
    done = subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    report = {"cuda_status": stoker.cuda_status(), "read_mode": {}}
    for path in (sys.argv[1], "/tmp"):
        where = f"{os.path.abspath(path)} ({fs(path)})"
        try:
            report["read_mode"][where] = stoker.gds.read_mode(path)
        except Exception as e:
            report["read_mode"][where] = f"error: {type(e).__name__}: {e}"
report["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
print(json.dumps(report, indent=1))
EOF
  )
  status_rc=$?
  if [ "$status_rc" != 0 ]; then printf '%s\n' "$status_err" >>"$out/cuda_status.json"; fi
  cat "$out/cuda_status.json"
  [ -z "$status_err" ] || printf 'its stderr:\n%s\n' "$status_err"
  if [ "$status_rc" = 0 ]; then
    mode=$("$py" -c "import json, sys; s = json.load(open(sys.argv[1]))['cuda_status']; \
print(s['mode'] + ': ' + s['reason'])" "$out/cuda_status.json" 2>/dev/null || echo "unknown")
    bench_mode=$("$py" -c "import json, sys; m = json.load(open(sys.argv[1]))['read_mode']; \
print('; '.join(f'{k}: {v}' for k, v in m.items()))" "$out/cuda_status.json" 2>/dev/null ||
      echo "unknown")
  else
    mode="failed (exit status $status_rc; see cuda_status.json)"
    bench_mode="$mode"
  fi
fi
row "stoker.cuda_status() mode" "$mode"
row "stoker.gds.read_mode (benchmark folder; /tmp)" "$bench_mode"

# ---- tests on the GPU -----------------------------------------------------------------------
if [ "$build_ok" = 1 ]; then
  step "tests/gpu (real GPU)"
  limit=$(limit_for 600 $((share_h2d + share_gds + share_patches)))
  run_step tests-gpu.txt "$limit" "$py" -m pytest tests/gpu -v -p no:cacheprovider
  [ "$rc" = 0 ] || failed=1
  note=""
  if [ "$cuda_ok" = 0 ]; then # every GPU test skipped: nothing was verified
    note=", torch sees no CUDA device here: NOTHING was verified on a GPU"
    failed=1
  fi
  [ "$rc" = 0 ] || note=", $(outcome)$note"
  row "tests/gpu" "$(pytest_line "$out/tests-gpu.txt") (${took} s)$note"
else
  row "tests/gpu" "not run (no build)"
  failed=1
fi

# ---- benchmarks: each stops itself inside its limit and prints its tables ------------------
# bench_step [-a] NAME LOG CAP PROMISED ARGS...: the benchmark's --quick run, its output in
# $out/LOG (appended to it with -a).
bench_step() {
  local append=()
  if [ "$1" = -a ]; then
    append=(-a)
    shift
  fi
  local name=$1 log=$2 cap=$3 promised=$4 limit
  shift 4
  step "benchmarks/$name --quick"
  limit=$(limit_for "$cap" "$promised")
  run_step ${append[@]+"${append[@]}"} "$log" "$limit" "$py" "benchmarks/$name" --quick \
    --budget $((limit - 12)) "$@"
}

if [ "$build_ok" = 1 ]; then
  bench_step h2d.py h2d.txt 120 $((share_gds + share_patches)) --timeout 45
  for config in large small; do
    line=$(grep -E "^stoker / ceiling \($config\)" "$out/h2d.txt" | tail -1)
    skip=$(grep -E '^h2d: skipped' "$out/h2d.txt" | tail -1)
    result="${line#stoker / ceiling ($config): }${skip}"
    row "h2d: stoker / ceiling ($config)" "${result:-$(outcome); see h2d.txt}"
  done

  bench_step gds.py gds.txt 150 "$share_patches" --timeout 50
  line=$(grep -E '^headline \(cold' "$out/gds.txt" | tail -1)
  skip=$(grep -E '^gds: skipped' "$out/gds.txt" | tail -1)
  result="${line#headline (cold, np.save file): }${skip}"
  row "gds: cold, np.save file" "${result:-$(outcome); see gds.txt}"
  line=$(grep -E '^headline NIfTI' "$out/gds.txt" | tail -1)
  result="${line#headline NIfTI (cold .nii, warm .nii.gz): }${skip}"
  row "gds: NIfTI, cold .nii and warm .nii.gz" "${result:-$(outcome); see gds.txt}"

  # Folded into gds.txt: $out holds at most 8 files.
  printf '\n==== benchmarks/gpu_patches.py --quick\n' >>"$out/gds.txt"
  bench_step -a gpu_patches.py gds.txt 60 0 --timeout 25
  skip=$(grep -E '^gpu_patches: skipped' "$out/gds.txt" | tail -1)
  for fmt in npy nii; do
    line=$(grep -E "^headline gpu_patches \($fmt\)" "$out/gds.txt" | tail -1)
    result="${line#headline gpu_patches ($fmt): }${skip}"
    row "gpu_patches ($fmt): patches/s into device memory" "${result:-$(outcome); see gds.txt}"
  done
else
  row "h2d: stoker / ceiling (large)" "not run (no build)"
  row "gds: cold, np.save file" "not run (no build)"
  row "gds: NIfTI, cold .nii and warm .nii.gz" "not run (no build)"
  row "gpu_patches: patches/s into device memory" "not run (no build)"
fi

# ---- the stand-in tests: CPU logic that CI runs too, so they come last ------------------------
standins=()
for f in tests/cuda/test_cuda_standin.py tests/cuda/test_gather_standin.py \
  tests/cuda/test_gds_cpu.py; do
  if [ -e "$f" ]; then standins+=("$f"); else echo "$f: not in this tree, skipped"; fi
done
if [ "$build_ok" = 1 ] && [ ${#standins[@]} -gt 0 ]; then
  step "stand-in tests (ordering and logic only, not GPU verification)"
  run_step tests-standin.txt "$(limit_for 300 0)" "$py" -m pytest "${standins[@]}" -v \
    -p no:cacheprovider
  [ "$rc" = 0 ] || failed=1
  note=""
  [ "$rc" = 0 ] || note=", $(outcome)"
  row "stand-in + CPU GDS tests" "$(pytest_line "$out/tests-standin.txt") (${took} s)$note"
else
  row "stand-in + CPU GDS tests" "not run"
  [ "$build_ok" = 1 ] || failed=1
fi

# ---- cuFile's own log (never a file of its own in $out) --------------------------------------
cufile_note="none written"
for log in "$CUFILE_LOGFILE_PATH" cufile.log; do
  if [ -s "$log" ]; then
    {
      printf '\n==== the last 60 lines of %s (cuFile'"'"'s log, %d lines)\n' "$log" "$(wc -l <"$log")"
      tail -60 "$log"
    } >>"$out/gds.txt"
    cufile_note="$log: $(wc -l <"$log") lines, its tail appended to gds.txt"
    if [ "$log" = cufile.log ]; then cufile_note+=" (CUFILE_LOGFILE_PATH was not honoured)"; fi
  fi
done
row "cufile.log" "$cufile_note"

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
