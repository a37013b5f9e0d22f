#!/usr/bin/env bash
# Sanitizer checks of stoker's C++ core.
#
#   scripts/sanitize.sh [--asan-only | --tsan-only] [SECONDS]
#
# 1. ASan + UBSan: the Python extension built with gcc's -fsanitize=address,undefined
#    into build-asan/ (its own CMake build folder, its own wheel, a throwaway venv:
#    the developer's editable install is never touched), then the tests that drive
#    the C++ (tar, zip, npy, reader, dataset, loader, malformed shards, the CUDA path
#    through the host-memory stand-in driver, GDS on the CPU, patches of volumes) run
#    on it, at -Og; then tests/cpp/stress.cpp, built with the same sanitizers in the
#    same build folder, runs for SECONDS.
# 2. TSan: the core and tests/cpp/stress.cpp built with -fsanitize=thread into
#    build-tsan/, then the stress program runs for SECONDS (default 20) under TSan.
# Any sanitizer report fails the script. Known reports are suppressed, narrowly and
# with the reason, in tests/cpp/tsan.supp; there are none for ASan/UBSan.
#
# Runs from any folder. Every compile step takes /tmp/stoker-build.lock (flock), so it
# never builds at the same time as anything else that takes that lock. PYTHON picks
# the interpreter whose packages (numpy, torch, pytest, pybind11, scikit-build-core)
# the ASan part uses; default python3. pytest reads extra options from PYTEST_ADDOPTS
# (e.g. --deselect tests/test_x.py::test_y for a test that fails without sanitizers too).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
LOCK=/tmp/stoker-build.lock
JOBS=2
ASAN_DIR="$ROOT/build-asan"
TSAN_DIR="$ROOT/build-tsan"
# gcc's sanitizers: the runtimes preloaded below are gcc's (a build folder keeps the
# compiler it was first configured with).
export CC=gcc CXX=g++

do_asan=1
do_tsan=1
seconds=20
for arg in "$@"; do
  case "$arg" in
    --asan-only) do_tsan=0 ;;
    --tsan-only) do_asan=0 ;;
    -h | --help)
      awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
      exit 0
      ;;
    *[!0-9.]* | '')
      echo "sanitize.sh: unknown argument '$arg' (try --help)" >&2
      exit 2
      ;;
    *) seconds="$arg" ;;
  esac
done

# Prints a command, then runs it.
run() {
  printf '+' >&2
  printf ' %q' "$@" >&2
  printf '\n' >&2
  "$@"
}

section() { printf '\n=== %s\n' "$*" >&2; }

# Build folders hold wheels and binaries of tens of MB: keep them out of git even
# where the repository's .gitignore does not name them.
mark_build_dir() {
  mkdir -p "$1"
  [[ -e "$1/.gitignore" ]] || printf '# written by scripts/sanitize.sh\n*\n' >"$1/.gitignore"
}

# ---------------------------------------------------------------- ASan + UBSan
# Fails on any ASan/UBSan report in `log` (a report in a child process may not fail
# the test that started it, so the log is searched), then on a non-zero `status`.
asan_verdict() {
  local log=$1 status=$2 what=$3
  if grep -nE 'ERROR: AddressSanitizer|AddressSanitizer: CHECK|runtime error:|ERROR: LeakSanitizer' \
    "$log" >&2; then
    echo "sanitize.sh: ASan/UBSan reported the above (full log: $log)" >&2
    exit 1
  fi
  if [[ $status -ne 0 ]]; then
    echo "sanitize.sh: $what failed under ASan/UBSan (exit $status; log: $log)" >&2
    exit "$status"
  fi
}

asan() {
  local start=$SECONDS
  section "ASan + UBSan: build the extension into $ASAN_DIR"
  mark_build_dir "$ASAN_DIR"
  rm -rf "$ASAN_DIR/wheel"
  # install.strip=false keeps the debug info, so reports name file:line. -Og, not
  # RelWithDebInfo's -O2: under both sanitizers gcc takes about 2.5x longer to compile at
  # -O2 (73 s against 29 s for bindings/reader.cpp), for checks that find the same bugs.
  # The stress program is built in the same CMake folder, from the same objects of the core.
  run env CMAKE_BUILD_PARALLEL_LEVEL=$JOBS flock "$LOCK" "$PYTHON" -m pip wheel \
    --no-build-isolation --no-deps -w "$ASAN_DIR/wheel" "$ROOT" \
    -Cbuild-dir="$ASAN_DIR/cmake" \
    -Ccmake.define.STOKER_SANITIZE=address,undefined \
    -Ccmake.define.STOKER_STRESS=ON \
    -Ccmake.build-type=RelWithDebInfo \
    "-Ccmake.define.CMAKE_CXX_FLAGS_RELWITHDEBINFO=-Og -g -DNDEBUG" \
    -Cinstall.strip=false
  local wheels=("$ASAN_DIR"/wheel/stoker-*.whl)
  [[ ${#wheels[@]} -eq 1 && -f "${wheels[0]}" ]] || {
    echo "sanitize.sh: expected one wheel in $ASAN_DIR/wheel" >&2
    exit 1
  }
  local built=$SECONDS

  section "ASan + UBSan: a throwaway venv with the sanitized wheel"
  # Not --system-site-packages: the system site-packages' .pth files would run, and
  # the editable install's (_editable_skbc_stoker.pth) puts a finder at the front of
  # sys.meta_path that sends `import stoker` to the source tree and its unsanitized
  # _core. Instead the venv sees the system packages (numpy, torch, pytest) through
  # a plain path line in a .pth of its own, which runs no other .pth files, and its
  # own site-packages comes first.
  local venv="$ASAN_DIR/venv"
  rm -rf "$venv"
  run "$PYTHON" -m venv --without-pip "$venv"
  local system_site venv_site
  system_site="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  venv_site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  printf '%s\n' "$system_site" >"$venv_site/_stoker_system_site.pth"
  # pip comes from the system packages; --ignore-installed installs into the venv
  # without uninstalling (or even looking at) the developer's stoker.
  run "$venv/bin/python" -m pip install --no-deps --no-index --ignore-installed \
    --disable-pip-version-check --no-warn-script-location "${wheels[0]}"
  local core
  core="$(echo "$venv_site"/stoker/_core*.so)"
  if ! readelf -d "$core" | grep -q 'NEEDED.*libasan'; then
    echo "sanitize.sh: $core is not built with ASan" >&2
    exit 1
  fi

  # libasan must be the first library of the process (python is not built with it).
  # libstdc++ is preloaded too: python does not link it, and ASan resolves the real
  # __cxa_throw when it starts; without libstdc++ loaded by then, the first C++
  # exception dies in "CHECK failed: ... real___cxa_throw != 0". libubsan is what
  # the extension links as well (it needs libstdc++ itself).
  local preload
  preload="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so.6)"
  preload+=" $(gcc -print-file-name=libubsan.so)"
  local -a sanitizer_env=(
    LD_PRELOAD="$preload"
    # Python and torch leak by design at exit: no leak checking.
    ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1
    UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
    PYTHONDONTWRITEBYTECODE=1
    STOKER_SANITIZED_SITE="$venv_site"
    PYTHONPATH="$ASAN_DIR/plugin"
  )

  # A pytest plugin that fails the session unless the stoker it imports is the
  # sanitized copy in the venv (and says which it is).
  mkdir -p "$ASAN_DIR/plugin"
  cat >"$ASAN_DIR/plugin/stoker_sanitized_check.py" <<'EOF'
"""Written by scripts/sanitize.sh: the tests must import the sanitized stoker."""

import os

import pytest


def pytest_sessionstart(session):
    import stoker
    import stoker._core

    want = os.path.realpath(os.environ["STOKER_SANITIZED_SITE"]) + os.sep
    for path in (stoker.__file__, stoker._core.__file__):
        print(f"sanitize.sh: pytest imports {path}")
        if not os.path.realpath(path).startswith(want):
            raise pytest.UsageError(f"stoker comes from {path}, not the sanitized copy in {want}")
EOF

  section "ASan + UBSan: which stoker the venv imports"
  # From inside build-asan: the current folder holds no stoker package.
  cd "$ASAN_DIR"
  run env "${sanitizer_env[@]}" "$venv/bin/python" -c '
import os, sys
import stoker, stoker._core
print("stoker        ", stoker.__file__)
print("stoker._core  ", stoker._core.__file__)
want = os.path.realpath(os.environ["STOKER_SANITIZED_SITE"]) + os.sep
if not all(os.path.realpath(p).startswith(want) for p in (stoker.__file__, stoker._core.__file__)):
    sys.exit("sanitize.sh: not the sanitized stoker")
'

  section "ASan + UBSan: the tests that drive the C++"
  local -a tests=()
  local name found
  for name in test_tar test_zip test_npy test_reader test_dataset test_loader test_malformed \
    test_member_index test_index_memory test_grouping test_image test_hdf5 test_zarr test_nifti \
    test_cuda_standin test_gds_cpu test_patches test_tiff test_array_boxes test_stores \
    test_slides test_parquet_pages test_parquet_dataset test_table_pieces test_tables_damaged \
    test_sampler test_computed_columns; do
    found=$(find "$ROOT/tests" -name "$name.py" -print -quit)
    if [[ -n $found ]]; then
      tests+=("$found")
    else
      echo "sanitize.sh: $name.py is not under tests/, skipped" >&2
    fi
  done
  if [[ ${#tests[@]} -eq 0 ]]; then
    echo "sanitize.sh: none of the tests are there" >&2
    exit 1
  fi
  # Nothing is deselected: fork()ed children (run_in_fork, DataLoader "fork" workers)
  # and spawned ones (DataLoader "spawn" workers, subprocess) all run under ASan, the
  # latter through the inherited LD_PRELOAD and *SAN_OPTIONS.
  # One pytest worker per core where pytest-xdist is installed.
  local -a parallel=()
  if "$venv/bin/python" -c 'import xdist' 2>/dev/null; then parallel=(-n "$JOBS"); fi
  local log="$ASAN_DIR/pytest.log" status=0
  run env "${sanitizer_env[@]}" "$venv/bin/python" -m pytest -p no:cacheprovider "${parallel[@]}" \
    -p stoker_sanitized_check --rootdir "$ROOT" -c "$ROOT/pyproject.toml" "${tests[@]}" \
    2>&1 | tee "$log" || status=$?
  cd "$ROOT"
  asan_verdict "$log" "$status" "the tests"
  local tested=$SECONDS

  section "ASan + UBSan: the C++ stress program for $seconds s"
  # The same program TSan runs: batches dropped, cancelled and outliving their
  # reader are where a use-after-free would be. No Python here, so leaks count.
  # (Built with the extension above: this only checks that it is up to date.)
  run flock "$LOCK" cmake --build "$ASAN_DIR/cmake" -j"$JOBS" --target stoker_stress
  log="$ASAN_DIR/stress.log"
  status=0
  run env ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:halt_on_error=1 \
    UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    "$ASAN_DIR/cmake/tests/cpp/stoker_stress" "$seconds" "$ASAN_DIR/shards" 2>&1 |
    tee "$log" || status=$?
  asan_verdict "$log" "$status" "the stress program"
  printf 'sanitize.sh: ASan + UBSan clean (extension build %ds, tests %ds, stress %ds)\n' \
    $((built - start)) $((tested - built)) $((SECONDS - tested)) >&2
}

# ---------------------------------------------------------------- TSan
tsan() {
  local start=$SECONDS
  section "TSan: build the core and the stress program into $TSAN_DIR"
  mark_build_dir "$TSAN_DIR"
  run flock "$LOCK" cmake -S "$ROOT" -B "$TSAN_DIR" -DSTOKER_PYTHON=OFF -DSTOKER_STRESS=ON \
    -DSTOKER_SANITIZE=thread -DCMAKE_BUILD_TYPE=RelWithDebInfo
  run flock "$LOCK" cmake --build "$TSAN_DIR" -j"$JOBS" --target stoker_stress
  local built=$SECONDS

  section "TSan: the stress program for $seconds s"
  local log="$TSAN_DIR/stress.log" status=0
  run env TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:print_suppressions=1:suppressions=$ROOT/tests/cpp/tsan.supp" \
    "$TSAN_DIR/tests/cpp/stoker_stress" "$seconds" "$TSAN_DIR/shards" 2>&1 |
    tee "$log" || status=$?
  if grep -nE 'WARNING: ThreadSanitizer|ERROR: ThreadSanitizer|ThreadSanitizer: CHECK' "$log" >&2; then
    echo "sanitize.sh: TSan reported the above (full log: $log)" >&2
    exit 1
  fi
  if [[ $status -ne 0 ]]; then
    echo "sanitize.sh: the stress program failed under TSan (exit $status; log: $log)" >&2
    exit "$status"
  fi
  printf 'sanitize.sh: TSan clean (build %ds, stress %ds)\n' $((built - start)) $((SECONDS - built)) >&2
}

total=$SECONDS
if [[ $do_asan -eq 1 ]]; then asan; fi
if [[ $do_tsan -eq 1 ]]; then tsan; fi
printf '\nsanitize.sh: all sanitizer checks passed (%ds)\n' $((SECONDS - total)) >&2
