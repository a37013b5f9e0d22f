"""That an installed stoker wheel is whole: it imports, decodes a JPEG and a PNG and
uncompresses snappy (Parquet's pages: stoker's own decoder, no library), and the libjpeg
and libpng it maps to do so are the copies auditwheel put in the wheel
(``site-packages/stoker.libs/``), not the build machine's.

    python scripts/check_wheel.py IMAGE.jpg IMAGE.png   (tests/data/image-seeds/ has some)
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    import stoker
    from stoker import _core

    for path in sys.argv[1:]:
        with open(path, "rb") as f:
            image = _core.decode_rgb(f.read(), path)
        print(f"{os.path.basename(path)}: decoded, {image.shape}")
    # A snappy stream of b"stoker" * 100: a literal of 6 bytes, then copies of 64 and 18.
    snappy = bytes([0xD8, 0x04, 0x14]) + b"stoker" + bytes([0xFE, 0x06, 0x00]) * 9
    snappy += bytes([0x46, 0x06, 0x00])
    plain = _core.decompress(snappy, 600, _core.ChunkFilter.SNAPPY, "<check>").tobytes()
    if plain != b"stoker" * 100:
        print("check_wheel: snappy did not round-trip", file=sys.stderr)
        return 1
    print("snappy: uncompressed")
    package = os.path.dirname(os.path.realpath(stoker.__file__))
    bundled = os.path.join(os.path.dirname(package), "stoker.libs")
    with open("/proc/self/maps") as f:
        mapped = {line.split()[-1] for line in f if "/" in line}
    problems = []
    for name in ("libjpeg", "libpng"):
        found = sorted(p for p in mapped if os.path.basename(p).startswith(name))
        print(f"{name}: {', '.join(found) or 'not mapped'}")
        if not found or not all(p.startswith(bundled + os.sep) for p in found):
            problems.append(f"{name} is not (only) the wheel's own copy in {bundled}")
    print(f"stoker {stoker.__version__} from {package}")
    for problem in problems:
        print("check_wheel:", problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
