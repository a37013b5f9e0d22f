"""Tiled TIFF, whole-slide images among them, as 2-D arrays whose tiles patches read.

The directories (IFDs) are parsed by the C++ core (``_core.read_tiff``; no libtiff): each
level's tile offsets and byte counts become an ArrayLayout whose chunks are the tiles, so
a patch reads and decodes only the tiles it covers, uncompressed, deflate (with or without
the horizontal predictor), Zstandard or JPEG (with the file's shared JPEG tables, in
YCbCr or, as Aperio's .svs stores it, RGB). Strips are chunks too.

Pyramid levels, largest first: the first directory, then its SubIFDs (as tifffile and
OME-TIFF write pyramids); without SubIFDs, the later tiled directories of the main chain
each smaller than the one before (as .svs files keep them; their thumbnail is stripped and
their label and macro images are not smaller, so neither is taken for a level).
"""

from __future__ import annotations

import numpy as np

import stoker._core as _core
from stoker.errors import ShardFormatError, UsageError, located
from stoker.volumes.arrays import VolumeArray

_F = _core.ChunkFilter
_MISSING = np.uint64(2**64 - 1)

# TIFF compression codes (tag 259) stoker decodes.
_NONE, _JPEG, _DEFLATE, _ADOBE_DEFLATE, _ZSTD = 1, 7, 8, 32946, 50000
_NAMES = {
    2: "CCITT RLE",
    3: "CCITT group 3",
    4: "CCITT group 4",
    5: "LZW",
    6: "old-style JPEG",
    32773: "PackBits",
    33003: "JPEG 2000 (Aperio YCbCr)",
    33005: "JPEG 2000 (Aperio RGB)",
    34712: "JPEG 2000",
    34887: "LERC",
    34925: "LZMA",
    34933: "PNG",
    34934: "JPEG XR",
    50001: "WebP",
    50002: "JPEG XL",
}
_WAY_OUT = (
    "rewrite it with tiles stoker decodes: uncompressed, deflate, zstd or JPEG, e.g. "
    "tifffile.imwrite(out, data, tile=(256, 256), compression='jpeg') or "
    "vips tiffsave in.svs out.tif --tile --pyramid --compression jpeg"
)
_SAMPLE_KINDS = {1: "u", 2: "i", 3: "f"}
_PHOTOMETRIC_RGB, _PHOTOMETRIC_YCBCR = 2, 6


def tiff_levels(path: str) -> list[_core.TiffDirectory]:
    """The pyramid's levels of the TIFF at `path`, largest first (see the module's rule)."""
    directories = _core.read_tiff(path)
    if not directories:
        raise located(ShardFormatError, path, 0, "a TIFF with no image directory")
    first = directories[0]
    subs = [d for d in first.sub_directories if d.tiled]
    if subs:
        return [first, *subs]
    levels = [first]
    for d in directories[1:]:
        last = levels[-1]
        smaller = d.width < last.width and d.length < last.length
        if d.tiled and smaller and d.samples_per_pixel == first.samples_per_pixel:
            levels.append(d)
    return levels


def open_tiff_level(path: str, spatial_dims: int, level: int) -> VolumeArray:
    """Level `level` of the TIFF at `path` as an array of (rows, columns, samples), or
    (samples, rows, columns, 1) when its samples are stored in planes."""
    if spatial_dims != 2:
        raise UsageError(
            f"{path}: a TIFF is read as 2-D images (Volumes(spatial_dims=2)), not "
            f"{spatial_dims}-D volumes"
        )
    levels = tiff_levels(path)
    if not 0 <= level < len(levels):
        sizes = ", ".join(f"{i}: {d.width}x{d.length}" for i, d in enumerate(levels))
        raise UsageError(f"{path}: level={level}, but its pyramid has levels {sizes}")
    d = levels[level]
    dtype = _dtype(path, d)
    samples = d.samples_per_pixel
    tile_rows = d.tile_length if d.tiled else min(d.rows_per_strip, d.length)
    tile_cols = d.tile_width if d.tiled else d.width
    if d.planar_config == 2:  # each sample in its own plane of tiles, plane by plane
        # A last axis of one sample, so that a tile's rows are [width, samples] as the
        # predictor undoes them.
        shape: tuple[int, ...] = (samples, d.length, d.width, 1)
        chunks: tuple[int, ...] = (1, tile_rows, tile_cols, 1)
        spatial = (1, 2)
    else:
        shape, chunks, spatial = (
            (d.length, d.width, samples),
            (tile_rows, tile_cols, samples),
            (0, 1),
        )
    offsets = np.asarray(d.offsets, np.uint64).copy()
    counts = np.asarray(d.byte_counts, np.uint64)
    offsets[(offsets == 0) & (counts == 0)] = _MISSING  # a sparse file's tile never written
    n = offsets.size
    layout = _core.ArrayLayout(
        f"{path} (level {level})",
        shape,
        chunks,
        dtype.itemsize,
        np.zeros(1, dtype).tobytes(),
        _steps(path, d, dtype),
        [path],
        np.zeros(n, np.uint32),
        offsets,
        counts,
        np.zeros(n, np.uint32),
        byteswap=d.big_endian and dtype.itemsize > 1,
        jpeg_tables=d.jpeg_tables,
        clipped_edge=not d.tiled,  # a last strip holds only the rows that are left
    )
    return VolumeArray(
        path=path,
        data_path=path,
        offset=0,
        dtype=dtype,
        stored_shape=shape,
        spatial_axes=spatial,
        affine=None,
        spacing=(1.0, 1.0),
        swap_unit=0,
        layout=layout,
        identity_path=path,
    )


def _dtype(path: str, d: _core.TiffDirectory) -> np.dtype:
    bits = set(d.bits_per_sample)
    kind = _SAMPLE_KINDS.get(d.sample_format)
    if len(bits) != 1 or kind is None or next(iter(bits)) not in (8, 16, 32, 64):
        raise located(
            ShardFormatError,
            path,
            d.offset,
            f"samples of {d.bits_per_sample} bits, sample format {d.sample_format}: stoker "
            "reads 8, 16, 32 or 64-bit integer or floating-point samples",
        )
    return np.dtype(f"{kind}{next(iter(bits)) // 8}")


def _steps(
    path: str, d: _core.TiffDirectory, dtype: np.dtype
) -> list[tuple[_core.ChunkFilter, int]]:
    """The directory's tiles' filter pipeline, in the order the writer applied it."""
    steps: list[tuple[_core.ChunkFilter, int]] = []
    if d.predictor == 2:
        steps.append((_F.HORIZONTAL_PREDICTOR, dtype.itemsize))
    elif d.predictor != 1:
        raise located(
            ShardFormatError,
            path,
            d.offset,
            f"tiles with predictor {d.predictor} (floating-point differencing): {_WAY_OUT}",
        )
    code = d.compression
    if code in (_DEFLATE, _ADOBE_DEFLATE):
        steps.append((_F.ZLIB, 0))
    elif code == _ZSTD:
        steps.append((_F.ZSTD, 0))
    elif code == _JPEG:
        if dtype != np.uint8:
            raise located(ShardFormatError, path, d.offset, f"JPEG tiles of {dtype}: {_WAY_OUT}")
        rgb = d.photometric == _PHOTOMETRIC_RGB and d.samples_per_pixel == 3
        steps.append((_F.JPEG, 1 if rgb else 0))
    elif code != _NONE:
        name = _NAMES.get(code, "an unknown")
        raise located(
            ShardFormatError,
            path,
            d.offset,
            f"tiles compressed with {name} compression (TIFF compression {code}), which "
            f"stoker does not decode: {_WAY_OUT}",
        )
    return steps
