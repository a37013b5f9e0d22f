"""HDF5 files as array sources: each dataset's layout, learnt once through h5py.

h5py is used at open only (``pip install 'stoker[hdf5]'``): the file is closed before
any batch is read, so nothing of HDF5's (its global lock, its handles that do not
survive a fork) is left for readers to trip on.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

import stoker._core as _core
from stoker._columns import ComputedColumn
from stoker.arrays.array_fields import (
    ArrayField,
    check_dtype,
    field_names_of,
    has_tensor_type,
    in_place_offsets,
    pick_arrays,
)
from stoker.arrays.registry import ArrayFormat, Identity, register
from stoker.errors import ShardFormatError, StokerError, located

# HDF5's filter ids, and what stoker decodes them with.
_DEFLATE, _SHUFFLE, _FLETCHER32 = 1, 2, 3
_FILTERS = {
    _DEFLATE: _core.ChunkFilter.ZLIB,
    _SHUFFLE: _core.ChunkFilter.SHUFFLE,
    _FLETCHER32: _core.ChunkFilter.FLETCHER32,
}
_KNOWN_NAMES = {
    4: "szip",
    5: "nbit",
    6: "scaleoffset",
    32000: "lzf",
    32001: "blosc",
    32004: "lz4",
    32008: "bitshuffle",
    32015: "zstd",
    32026: "blosc2",
}
_NAMES = {_DEFLATE: "gzip", _SHUFFLE: "shuffle", _FLETCHER32: "fletcher32"}
_COMPACT, _CONTIGUOUS, _CHUNKED, _VIRTUAL = 0, 1, 2, 3
_DONT_FILTER_PARTIAL_CHUNKS = 2  # H5Pset_chunk_opts
_MISSING = np.uint64(2**64 - 1)


def _h5py() -> Any:  # the h5py module, which has no type information
    try:
        import h5py
    except ImportError:
        raise StokerError(
            "reading HDF5 files needs h5py, to learn their layout when they are opened: "
            "pip install 'stoker[hdf5]'"
        ) from None
    return h5py


def hdf5_arrays(path: str, arrays: Sequence[str] | None) -> tuple[int, list[ArrayField]]:
    """The rows of `path` and its fields: every dataset of rank 1 or more whose first axis
    has that length (or each of `arrays`)."""
    h5py = _h5py()
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise located(ShardFormatError, path, 0, f"not an HDF5 file h5py can open ({e})") from e
    with f:
        found: dict[str, Any] = {}  # h5py.Dataset (h5py has no type information)

        def visit(name: str, item: object) -> None:
            if isinstance(item, h5py.Dataset) and item.ndim >= 1:
                found[name] = item

        f.visititems(visit)
        shapes = {name: d.shape for name, d in found.items()}
        usable = {name: has_tensor_type(d.dtype) for name, d in found.items()}
        rows, names = pick_arrays(path, shapes, usable, arrays)
        return rows, [
            ArrayField(field, *_layout(path, name, found[name]))
            for field, name in zip(field_names_of(path, names), names)
        ]


def _layout(
    path: str, name: str, d: Any
) -> tuple[
    np.dtype, tuple[int, ...], _core.ArrayLayout | None, np.ndarray | ComputedColumn | None, str
]:
    """(dtype, row shape, ArrayLayout or None, in-place offsets or None, storage text) of
    the h5py.Dataset `d`."""
    where = f"{path}:/{name}"
    if d.is_virtual:
        raise located(
            ShardFormatError,
            path,
            0,
            f"dataset '/{name}' is virtual (it maps other files' data): stoker reads "
            f"stored data only; copy it into one file (h5repack {path} out.h5) or read it "
            "through map= with h5py",
        )
    dtype = check_dtype(path, "/" + name, d.dtype)
    byteswap = d.dtype.byteorder == ">" or (d.dtype.byteorder == "=" and np.little_endian is False)
    shape = tuple(int(s) for s in d.shape)
    row_shape = shape[1:]
    row_bytes = int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize
    dcpl = d.id.get_create_plist()
    if dcpl.get_external_count() > 0:
        raise located(
            ShardFormatError,
            path,
            0,
            f"dataset '/{name}' keeps its data in external files: copy it into the file "
            f"(h5repack {path} out.h5) or read it through map= with h5py",
        )
    fill = np.zeros(1, dtype)
    if d.fillvalue is not None:
        fill[0] = d.fillvalue
    layout_kind = dcpl.get_layout()
    if layout_kind == _COMPACT:
        raise located(
            ShardFormatError,
            path,
            0,
            f"dataset '/{name}' has the compact layout (its bytes are in its header): "
            f"rewrite it contiguous (h5repack -l /{name}:CONTI {path} out.h5)",
        )
    if layout_kind == _CONTIGUOUS:
        offset = d.id.get_offset()
        if offset is not None and not byteswap:
            return (
                dtype,
                row_shape,
                None,
                in_place_offsets(offset, shape[0], row_bytes),
                "contiguous",
            )
        rows = max(1, min(shape[0], (1 << 20) // max(row_bytes, 1)))
        chunks = (rows, *row_shape)
        if offset is None:  # never written: every value is the fill value
            n = -(-shape[0] // rows)
            table = (np.full(n, _MISSING), np.zeros(n, np.uint64))
            storage = "contiguous, never written (fill value)"
        else:  # big-endian: read by chunks of rows, to be swapped
            starts = np.arange(0, shape[0], rows, dtype=np.uint64)
            table = (
                np.uint64(offset) + starts * np.uint64(row_bytes),
                np.full(len(starts), rows * row_bytes, np.uint64),
            )
            storage = "contiguous, big-endian"
        layout = _chunked(where, path, shape, chunks, dtype, fill, [], *table, byteswap)
        return dtype, row_shape, layout, None, storage
    if layout_kind != _CHUNKED:
        raise located(ShardFormatError, path, 0, f"dataset '/{name}' has an unknown layout")
    steps = _steps(path, name, dcpl)
    chunks = tuple(int(c) for c in d.chunks)
    grid = [-(-s // c) for s, c in zip(shape, chunks)]
    n = int(np.prod(grid, dtype=np.int64))
    offsets = np.full(n, _MISSING)
    sizes = np.zeros(n, np.uint64)
    masks = np.zeros(n, np.uint32)
    strides = np.cumprod([1, *grid[::-1]])[:-1][::-1]

    def note(info: Any) -> None:  # an h5py StoreInfo
        if info.byte_offset is None:
            return
        index = sum(int(o) // c * int(s) for o, c, s in zip(info.chunk_offset, chunks, strides))
        offsets[index] = info.byte_offset
        sizes[index] = info.size
        masks[index] = info.filter_mask

    if hasattr(d.id, "chunk_iter"):
        d.id.chunk_iter(note)
    else:  # HDF5 before 1.10.10: one lookup per chunk
        for i in range(d.id.get_num_chunks()):
            note(d.id.get_chunk_info(i))
    written = offsets != _MISSING
    beyond = written & (offsets + sizes > np.uint64(os.path.getsize(path)))
    if beyond.any():
        i = int(np.flatnonzero(beyond)[0])
        at = tuple(int(g) for g in np.unravel_index(i, grid))
        raise located(
            ShardFormatError,
            path,
            int(offsets[i]),
            f"dataset '/{name}': chunk {at} of {int(sizes[i])} bytes runs past the end of the "
            f"file ({os.path.getsize(path)} bytes): the file is truncated or damaged",
        )
    if steps and _partial_chunks_unfiltered(dcpl):
        # Edge chunks were stored unfiltered, though their mask says they were not.
        edge = np.zeros(grid, bool)
        for axis, (s, c) in enumerate(zip(shape, chunks)):
            if s % c:
                index: list[slice | int] = [slice(None)] * len(grid)
                index[axis] = -1
                edge[tuple(index)] = True
        masks[edge.reshape(-1)] = (1 << len(steps)) - 1
    whole_rows = chunks[1:] == row_shape
    if not steps and whole_rows and not byteswap and (offsets != _MISSING).all():
        # Whole rows stored as they are used: each row is read in place.
        row = np.arange(shape[0], dtype=np.uint64)
        in_place = offsets[row // np.uint64(chunks[0])] + (row % np.uint64(chunks[0])) * np.uint64(
            row_bytes
        )
        return dtype, row_shape, None, in_place, f"chunked {chunks}"
    pipeline = [(_FILTERS[code], param) for code, param in steps]
    layout = _chunked(
        where, path, shape, chunks, dtype, fill, pipeline, offsets, sizes, byteswap, masks
    )
    names = "+".join(_NAMES[code] for code, _ in steps)
    storage = f"chunked {chunks}" + (f", {names}" if names else "")
    return dtype, row_shape, layout, None, storage


def _chunked(
    where: str,
    path: str,
    shape: tuple[int, ...],
    chunks: tuple[int, ...],
    dtype: np.dtype,
    fill: np.ndarray,
    pipeline: list[tuple[_core.ChunkFilter, int]],
    offsets: np.ndarray,
    sizes: np.ndarray,
    byteswap: bool,
    masks: np.ndarray | None = None,
) -> _core.ArrayLayout:
    """The layout of chunks of `path` (`offsets`, `sizes`: one of each per chunk)."""
    n = len(offsets)
    return _core.ArrayLayout(
        where,
        shape,
        chunks,
        dtype.itemsize,
        fill.tobytes(),
        pipeline,
        [path],
        np.zeros(n, np.uint32),
        offsets,
        sizes,
        np.zeros(n, np.uint32) if masks is None else masks,
        byteswap=byteswap,
    )


def _steps(path: str, name: str, dcpl: Any) -> list[tuple[int, int]]:
    """The dataset's filter pipeline as (filter id, parameter), in the order applied."""
    steps = []
    for i in range(dcpl.get_nfilters()):
        code, _flags, values, label = dcpl.get_filter(i)
        if code not in _FILTERS:
            label = label.decode(errors="replace") if isinstance(label, bytes) else str(label)
            known = _KNOWN_NAMES.get(code, label or "an unknown")
            raise located(
                ShardFormatError,
                path,
                0,
                f"dataset '/{name}' is compressed with the {known} filter (HDF5 filter id "
                f"{code}), which stoker does not decode: rewrite it with gzip or no "
                f"compression (h5repack -f /{name}:GZIP=1 {path} out.h5), or read it through "
                "map= with h5py",
            )
        steps.append((code, int(values[0]) if code == _SHUFFLE and values else 0))
    return steps


def _partial_chunks_unfiltered(dcpl: Any) -> bool:  # dcpl: an h5py PropDCID
    """Whether the dataset was written with H5D_CHUNK_DONT_FILTER_PARTIAL_CHUNKS, which
    h5py does not expose: asked of the HDF5 library h5py loaded."""
    library = _hdf5_library()
    if library is None:
        return False
    opts = ctypes.c_uint(0)
    if library.H5Pget_chunk_opts(ctypes.c_int64(dcpl.id), ctypes.byref(opts)) < 0:
        return False
    return bool(opts.value & _DONT_FILTER_PARTIAL_CHUNKS)


_library: list[ctypes.CDLL | None] = []  # [] until looked for, then [the library or None]


def _hdf5_library() -> ctypes.CDLL | None:
    if not _library:
        found = None
        try:
            with open("/proc/self/maps") as maps:
                for line in maps:
                    path = line.split()[-1]
                    if "libhdf5" in path and "hl" not in path.rsplit("/", 1)[-1]:
                        found = ctypes.CDLL(path)
                        found.H5Pget_chunk_opts.argtypes = [
                            ctypes.c_int64,
                            ctypes.POINTER(ctypes.c_uint),
                        ]
                        found.H5Pget_chunk_opts.restype = ctypes.c_int
                        break
        except (OSError, AttributeError):
            found = None
        _library.append(found)
    return _library[0]


def _file_identity(path: str) -> Identity:
    st = os.stat(path)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


register(ArrayFormat("hdf5", hdf5_arrays, _file_identity))
