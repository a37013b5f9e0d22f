"""The arrays of a source as fields: which arrays are chosen, their rows, and their dtypes.

What every array format shares once it has found its arrays; nothing here opens a file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

import stoker._core as _core
from stoker._columns import ComputedColumn
from stoker.errors import ShardFormatError, StokerError, UsageError, located


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
    offsets: np.ndarray | ComputedColumn | None = None
    storage: str = ""  # how it is stored, for `stoker inspect`

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize


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


def in_place_offsets(base: int, rows: int, row_bytes: int) -> ComputedColumn:
    """Byte offsets of `rows` rows stored back to back from `base` (worked out as they are
    asked for: a billion rows are not made at open)."""
    return ComputedColumn(rows, base, row_bytes, np.uint64)


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
