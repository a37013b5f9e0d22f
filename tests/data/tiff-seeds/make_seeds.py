"""Writes the TIFF seeds of the fuzzer (scripts/fuzz.sh, format "tiff") and of
tests/formats/test_tiff.py with tifffile: small files, each under 16 KiB, covering the
layouts the directory parser reads. Deterministic; run from the repository root:

    python tests/data/tiff-seeds/make_seeds.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tifffile

HERE = Path(__file__).resolve().parent
# The smallest JPEG tables stream (SOI, EOI): the tag's bytes matter here, not the codec's.
JPEG_TABLES = b"\xff\xd8\xff\xd9"


def _image(shape: tuple[int, ...], dtype: str = "uint8", seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 200, shape).astype(dtype)


def _pyramid(path: Path, levels: int, **kwargs: object) -> None:
    data = _image((48, 48, 3))
    with tifffile.TiffWriter(path, **kwargs) as tif:  # type: ignore[arg-type]
        tif.write(data, subifds=levels - 1, tile=(16, 16), compression="zlib")
        for k in range(1, levels):
            step = 2**k
            tif.write(data[::step, ::step], subfiletype=1, tile=(16, 16), compression="zlib")


def write_seeds(folder: Path = HERE) -> list[Path]:
    seeds = {
        "tiled.tif": lambda p: tifffile.imwrite(p, _image((40, 36, 3)), tile=(16, 16)),
        "stripped.tif": lambda p: tifffile.imwrite(p, _image((30, 20)), rowsperstrip=7),
        "planar.tif": lambda p: tifffile.imwrite(
            p,
            _image((3, 24, 20), "uint16"),
            planarconfig="separate",
            photometric="rgb",
            rowsperstrip=8,
            compression="zlib",
            predictor=True,
        ),
        "bigtiff.tif": lambda p: tifffile.imwrite(
            p, _image((40, 40)), tile=(16, 16), compression="zlib", bigtiff=True
        ),
        "big-endian.tif": lambda p: tifffile.imwrite(
            p, _image((40, 24), "float32"), tile=(16, 16), byteorder=">"
        ),
        "jpeg-tables.tif": lambda p: tifffile.imwrite(
            p,
            _image((32, 32, 3)),
            tile=(16, 16),
            compression="jpeg",
            photometric="rgb",
            jpegtables=JPEG_TABLES,
        ),
        "subifds.tif": lambda p: _pyramid(p, 3),
        "bigtiff-big-endian-subifds.tif": lambda p: _pyramid(p, 2, bigtiff=True, byteorder=">"),
    }
    written = []
    for name, write in seeds.items():
        path = folder / name
        write(path)
        assert path.stat().st_size < 16 * 1024, (name, path.stat().st_size)
        written.append(path)
    path = folder / "multipage.tif"
    with tifffile.TiffWriter(path) as tif:
        for k in range(3):
            tif.write(_image((16 + 8 * k, 16), seed=k), description=f"page {k}")
    written.append(path)
    return written


if __name__ == "__main__":
    for path in write_seeds():
        print(path.name, path.stat().st_size)
