"""Array sources: HDF5 files and Zarr stores, whose arrays' rows are samples.

At open, the layout of each array is learnt once (HDF5's through h5py, Zarr's from its
JSON): where its bytes are, in one contiguous block or in chunks, and which filters
encode the chunks. Reads then go through the C++ reader like any shard's members, with
no HDF5 or Zarr call per batch and no lock: rows stored as they are used are read in
place; rows of encoded chunks (``ARRAY_ROW`` members) are grouped by chunk, each chunk
of a batch read and decoded once by the reader's threads, and the rows copied out.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from stoker import _core
from stoker.errors import ShardFormatError, StokerError, UsageError, located


#: File name endings of array sources, and their format.
@dataclass
class ArrayField:
    """One array of a source as a field: its rows are the samples' values.

    Rows are either read in place (`offsets`: each row's byte offset in the source's
    file, rows stored as they are used) or by chunk (`layout`: ARRAY_ROW members).
    """

    name: str  # the array's path in its file or store ("images", "grp/labels")
    dtype: np.dtype  # native byte order
    row_shape: tuple[int, ...]
    layout: _core.ArrayLayout | None = None
    offsets: np.ndarray | None = None
    storage: str = ""  # how it is stored, for `stoker inspect`

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize


def index_array_source(path: str, fmt: str, arrays: Sequence[str] | None = None) -> dict:
    """The index of an array source: ``{"format": "array", "rows", "fields", "identity"}``
    with one ArrayField per array whose first axis has the source's length (or each of
    `arrays`)."""
    if fmt == "hdf5":
        from stoker.arrays.hdf5 import hdf5_arrays

        rows, fields = hdf5_arrays(path, arrays)
        st = os.stat(path)
        identity = (st.st_ino, st.st_size, st.st_mtime_ns)
    else:
        from stoker.arrays.zarr import zarr_arrays

        rows, fields = zarr_arrays(path, arrays)
        identity = (0, 0, 0)  # a folder: each chunk file is checked as it is read
    return {"format": "array", "rows": rows, "fields": fields, "identity": identity}


def pick_arrays(
    path: str,
    shapes: dict[str, tuple[int, ...]],
    usable: dict[str, bool],
    arrays: Sequence[str] | None,
) -> tuple[int, list[str]]:
    """The source's length and the arrays that are its fields: each of `arrays` (which
    must exist and share a length), else every `usable` one (a tensor type) of the
    length most arrays have."""
    if arrays is not None:
        missing = [a for a in arrays if a.strip("/") not in shapes]
        if missing:
            raise StokerError(
                f"{path}: no array {missing[0]!r} (it has {', '.join(sorted(shapes))})"
            )
        chosen = {a.strip("/"): shapes[a.strip("/")] for a in arrays}
    else:  # text, records and references have no tensor type: left out unless asked for
        chosen = {name: shape for name, shape in shapes.items() if usable[name]}
    rows = rows_of(path, chosen, arrays is not None)
    return rows, [name for name, shape in chosen.items() if shape[0] == rows]


def rows_of(path: str, shapes: dict[str, tuple[int, ...]], chosen: bool) -> int:
    """The source's length: the first axis the `chosen` arrays share; else the length most
    arrays have (the longer on a tie)."""
    counts: dict[int, int] = {}
    for shape in shapes.values():
        counts[shape[0]] = counts.get(shape[0], 0) + 1
    if not counts:
        raise located(ShardFormatError, path, 0, "holds no arrays of rank 1 or more")
    if chosen and len(counts) > 1:
        listed = ", ".join(f"{n} ({shape[0]} rows)" for n, shape in shapes.items())
        raise UsageError(f"{path}: arrays= names arrays of different lengths: {listed}")
    return max(counts, key=lambda n: (counts[n], n))


def field_names_of(path: str, names: Sequence[str]) -> list[str]:
    """Field names for arrays `names`: as fields are looked up lower-cased, two arrays
    whose names differ only in case are refused."""
    seen: dict[str, str] = {}
    for name in names:
        lower = name.lower()
        if lower in seen:
            raise UsageError(
                f"{path}: arrays {seen[lower]!r} and {name!r} differ only in case, and field "
                "names are matched without case: choose one with arrays="
            )
        seen[lower] = name
    return [n.lower() for n in names]


def in_place_offsets(base: int, rows: int, row_bytes: int) -> np.ndarray:
    """Byte offsets of `rows` rows stored back to back from `base`."""
    return np.uint64(base) + np.arange(rows, dtype=np.uint64) * np.uint64(row_bytes)


def has_tensor_type(dtype: np.dtype) -> bool:
    """Whether values of `dtype` can be a tensor's (numbers and booleans)."""
    return dtype.kind in "biufc" and dtype.fields is None and dtype.subdtype is None


def check_dtype(path: str, name: str, dtype: np.dtype) -> np.dtype:
    """`dtype` in native byte order, or a clear error for one with no tensor equivalent."""
    if not has_tensor_type(dtype):
        what = {"S": "byte strings", "U": "text", "O": "variable-length values", "V": "records"}
        raise located(
            ShardFormatError,
            path,
            0,
            f"array {name!r} holds {what.get(dtype.kind, 'values')} ({dtype}), which have no "
            "tensor type: read them through map= with h5py or zarr, or leave them out with "
            "arrays=",
        )
    return dtype.newbyteorder("=")


#: The codecs whose libraries are opened at run time (never linked).
RUNTIME_CODECS = {"zstd": _core.ChunkFilter.ZSTD, "blosc": _core.ChunkFilter.BLOSC}


def codec_library_dirs(packages: Sequence[str] = ("blosc",)) -> list[str]:
    """The folders where the installed `packages` put their shared libraries.

    Each is found from where the package itself is imported from, and the record of
    files its installer left beside it (``<name>-<version>.dist-info/RECORD``), so a
    package installed anywhere Python imports from (a venv, ``pip install --user``, a
    folder another environment links in with a .pth file) is found, not only one under
    ``sys.prefix``. (Not importlib.metadata: importing it costs every ``import stoker``
    40 ms.)"""
    found: list[str] = []
    for name in packages:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.origin:
            continue
        site = os.path.dirname(os.path.dirname(spec.origin))
        for record in glob.glob(os.path.join(site, f"{name}-*.dist-info", "RECORD")):
            with open(record, encoding="utf-8", errors="replace") as f:
                for line in f:
                    file = line.split(",", 1)[0]
                    base = os.path.basename(file)
                    if base.startswith("lib") and ".so" in base:
                        folder = os.path.dirname(os.path.realpath(os.path.join(site, file)))
                        if folder not in found and os.path.isdir(folder):
                            found.append(folder)
    return found


def codec_status() -> dict[str, dict[str, Any]]:
    """Each codec library stoker opens at run time (``zstd``, ``blosc``): whether it can be
    used, the file it was loaded from, and else why not and what to install.

    libblosc is looked for first beside the ``blosc`` package Python imports, then on the
    system's loader path.

    Returns:
        For each codec's name, a dict of ``available`` (bool), ``library`` (the file it was
        loaded from) and ``reason`` (why it cannot be used, or ``""``).
    """
    status = {}
    for name, codec in RUNTIME_CODECS.items():
        reason = _core.codec_unavailable(codec)
        status[name] = {
            "available": not reason,
            "library": _core.codec_library(codec),
            "reason": reason,
        }
    return status


_core.set_codec_search_dirs(codec_library_dirs())
