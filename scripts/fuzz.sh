#!/usr/bin/env bash
# Builds the libFuzzer target (tests/fuzz, clang with AddressSanitizer and
# UndefinedBehaviorSanitizer) and fuzzes the tar, zip and npy parsers and the
# reader on what they index, the member index sidecars, the JPEG and PNG
# decoders behind stoker.Image(), the chunk decoders and row gathering of array
# sources (HDF5, Zarr), gzip streams as NIfTI volumes are read, MDS shards and
# LitData chunks, TIFF / BigTIFF directories, and Parquet footers and pages, for
# SECONDS each (default 60).
#
#   scripts/fuzz.sh [SECONDS]
#
# Each format has its own corpus, build-fuzz/corpus-<format>, kept between runs
# and seeded from tests/data/seeds, tests/data/malformed, tests/data/index-seeds,
# tests/data/image-seeds and the other *-seeds folders (each file with the
# format byte the target expects in front). Crashes, leaks, timeouts and
# out-of-memory inputs land in build-fuzz/artifacts; the script exits non-zero
# when a run found one and prints how to reproduce it. Formats are fuzzed side by
# side, one per core (FUZZ_JOBS sets how many at once).
set -euo pipefail

seconds=${1:-60}
if ! [[ $seconds =~ ^[0-9]+$ ]] || ((seconds < 1)); then
  echo "usage: $0 [SECONDS]  (seconds of fuzzing per format, default 60)" >&2
  exit 2
fi

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build="$root/build-fuzz"
cd "$root"

# Another build may share this machine: builds take turns on one lock.
lock=/tmp/stoker-build.lock
CC=clang CXX=clang++ flock "$lock" cmake -S . -B "$build" -DSTOKER_PYTHON=OFF -DSTOKER_FUZZ=ON \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
flock "$lock" cmake --build "$build" --target fuzz_shard -j 2
fuzzer="$build/tests/fuzz/fuzz_shard"

# Tokens the formats are made of, so that mutations can put them in whole.
dict="$build/stoker.dict"
cat >"$dict" <<'EOF'
"ustar\x00"
"ustar  \x00"
"00"
"0000644\x00"
"././@LongLink"
"PaxHeaders"
" path="
" size="
" linkpath="
"\x0a"
"PK\x03\x04"
"PK\x01\x02"
"PK\x05\x06"
"PK\x06\x06"
"PK\x06\x07"
"\x01\x00"
"\xff\xff\xff\xff"
"\x08\x00"
"\x93NUMPY"
"\x78\x01"
"\x78\x9c"
"\x1f\x8b\x08"
"\x28\xb5\x2f\xfd"
"\xff\xff"
"mds|"
"litdata|"
":v"
":v:numpy"
":8"
"\x01\x00"
"\x02\x00"
"\x03\x00"
"'descr'"
"'fortran_order'"
"'shape'"
"True"
"False"
"'<f4'"
"'<M8[ns]'"
"'|O'"
"'<U10'"
"II*\x00"
"MM\x00*"
"II+\x00"
"MM\x00+"
"\x08\x00\x00\x00"
"\x00\x01"
"\x01\x01"
"\x16\x01"
"\x17\x01"
"\x11\x01"
"\x42\x01"
"\x43\x01"
"\x44\x01"
"\x45\x01"
"\x4a\x01"
"\x5b\x01"
"\x10\x00"
"\x0d\x00"
"(1,)"
"()"
".cls"
".json"
"PAR1"
"PARE"
"\x15\x00\x15"
"\x19\x1c"
"\x19\x0c"
"\x2c\x15"
EOF

artifacts="$build/artifacts"
mkdir -p "$artifacts"

# Fuzzes one format for $seconds into its own corpus and log; its artifacts are named
# "$format-...", so formats fuzzed side by side tell theirs apart.
fuzz_format() {
  local format=$1 byte corpus log rc=0
  case $format in
    tar) byte='\x00' ;;
    zip) byte='\x01' ;;
    npy) byte='\x02' ;;
    idx) byte='\x03' ;;    # member index sidecars (seeds: tests/data/index-seeds)
    image) byte='\x04' ;;  # JPEG and PNG members for Image() (seeds: tests/data/image-seeds)
    chunk) byte='\x05' ;;  # array sources' chunks (seeds: tests/data/chunk-seeds)
    gzip) byte='\x06' ;;   # gzip streams as .nii.gz volumes are read (seeds: tests/data/gzip-seeds)
    record) byte='\x07' ;; # MDS shards and LitData chunks (seeds: tests/data/record-seeds)
    tiff) byte='\x08' ;;   # TIFF / BigTIFF directories (seeds: tests/data/tiff-seeds)
    parquet) byte='\x09' ;; # Parquet footers and pages (seeds: tests/data/parquet-seeds)
  esac
  corpus="$build/corpus-$format"
  mkdir -p "$corpus"
  local seeds=(tests/data/seeds/*."$format" tests/data/malformed/*."$format"
    tests/data/index-seeds/*."$format")
  [[ $format == image ]] && seeds=(tests/data/image-seeds/*)
  [[ $format == chunk ]] && seeds=(tests/data/chunk-seeds/*)
  [[ $format == gzip ]] && seeds=(tests/data/gzip-seeds/*)
  [[ $format == record ]] && seeds=(tests/data/record-seeds/*)
  [[ $format == tiff ]] && seeds=(tests/data/tiff-seeds/*.tif)
  [[ $format == parquet ]] && seeds=(tests/data/parquet-seeds/*.parquet)
  local file name
  for file in "${seeds[@]}"; do
    [[ -e $file ]] || continue
    name="seed-$(basename "$(dirname "$file")")-$(basename "$file")"
    { printf "$byte"; cat "$file"; } >"$corpus/$name"
  done
  log="$build/fuzz-$format.log"
  find "$artifacts" -type f -name "$format-*" | sort >"$build/fuzz-$format.before"
  ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=0 \
    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    "$fuzzer" "$corpus" -dict="$dict" -max_total_time="$seconds" -rss_limit_mb=2048 \
    -timeout=10 -max_len=65536 -artifact_prefix="$artifacts/$format-" -print_final_stats=1 \
    >"$log" 2>&1 || rc=$?
  echo "$rc" >"$build/fuzz-$format.rc"
}

# One fuzzer per core at a time (each is single-threaded): every format still gets its
# full $seconds, in less wall time. FUZZ_JOBS overrides the count.
jobs=${FUZZ_JOBS:-$(nproc)}
formats=(tar zip npy idx image chunk gzip record tiff parquet)
running=0
for format in "${formats[@]}"; do
  echo "== fuzzing $format for ${seconds}s (corpus $build/corpus-$format, log $build/fuzz-$format.log)"
  fuzz_format "$format" &
  running=$((running + 1))
  if ((running >= jobs)); then
    wait -n || true
    running=$((running - 1))
  fi
done
wait

status=0
found=()
for format in "${formats[@]}"; do
  log="$build/fuzz-$format.log"
  rc=$(cat "$build/fuzz-$format.rc" 2>/dev/null || echo 1)
  echo "== $format"
  grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1 || true
  grep -E '^stat::(number_of_executed_units|average_exec_per_sec|new_units_added|peak_rss_mb)' \
    "$log" || true
  echo "corpus: $(find "$build/corpus-$format" -type f | wc -l) inputs"
  new=$(comm -13 "$build/fuzz-$format.before" \
    <(find "$artifacts" -type f -name "$format-*" ! -name "$format-slow-unit-*" | sort) || true)
  if ((rc != 0)) || [[ -n $new ]]; then
    status=1
    echo "!! the $format run failed (exit $rc); the end of its log:"
    grep -E 'ERROR|BUG|SUMMARY|==stoker-fuzz==|Test unit written' "$log" | head -20 || tail -20 "$log"
    while IFS= read -r artifact; do
      [[ -n $artifact ]] && found+=("$artifact")
    done <<<"$new"
  fi
done

if ((status != 0)); then
  echo
  echo "fuzzing found a problem. Reproduce with:"
  for artifact in "${found[@]}"; do
    echo "  $fuzzer $artifact"
  done
  exit 1
fi
echo "no crash, leak or timeout"
