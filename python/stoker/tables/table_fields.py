"""The columns of a table source (a Parquet or Arrow IPC file) as fields: what every table
format shares once it has read its file's metadata; nothing here opens a file."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stoker.errors import StokerError

#: A Parquet column's decoding, as _core.ColumnLayout takes it: (physical type, type length,
#: max definition level, max repetition level, a list's element definition level, codec).
ParquetSpec = tuple[int, int, int, int, int, int]


@dataclass
class TableField:
    """One leaf column of a table file as a field.

    Its values are either decoded by the reader from the column's units (`units`, `spec`:
    a Parquet column; COLUMN_VALUE members) or read in place (`offsets`, `lengths`: an
    Arrow IPC file's buffers).
    """

    name: str  # dotted path of the leaf, as a field is named ("image.bytes", "label")
    dtype: np.dtype | None  # the values' type; None: bytes (binary, text)
    listed: bool = False  # each value is a list of `dtype` elements (a list column)
    width: int = 0  # bytes of each value; 0: they vary
    integer: int = 0  # 1: signed, 2: unsigned integers of `width` bytes (Int() widens them)
    units: np.ndarray | None = None  # (n, 7) uint64: see _core.ColumnLayout
    spec: ParquetSpec | None = None
    offsets: np.ndarray | None = None  # in place: each row's byte offset in the file
    lengths: np.ndarray | None = None  # in place: each row's bytes
    nulls: np.ndarray | None = None  # in place: rows whose value is null (bool), or None
    storage: str = ""  # how it is stored, for `stoker inspect` ("snappy, dictionary")
    stored_bytes: int = 0  # the column's bytes in the file
    unusable: str = ""  # why it cannot be read ("": it can)

    @property
    def row_shape(self) -> tuple[int, ...]:
        """A value's shape once typed: () for a scalar, (-1,) for a list."""
        return (-1,) if self.listed else ()

    def check_usable(self, path: str) -> None:
        if self.unusable:
            raise StokerError(f"{path}: column {self.name!r} {self.unusable}")
