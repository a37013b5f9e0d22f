"""Member columns worked out from the row instead of stored: the rows of a .npy, or of an
array source's arrays read in place or by chunk, follow a rule, so that a file of a billion
rows is indexed in a few numbers, not tens of gigabytes of columns."""

from __future__ import annotations

from typing import Any

import numpy as np


class ComputedColumn:
    """A read-only column of `rows` values with `period` members per sample: member j of
    sample i is row ``i * period + j``, and holds ``base[j] + step[j] * i``. Indexed as a
    numpy array is (a position, an array of them, a mask, a slice: a slice or an array of
    positions gives a numpy array); ``np.asarray`` makes every value. The C++ plan reads
    the same rule (``ShardColumns``), so nothing is made for it."""

    __slots__ = ("base", "dtype", "rows", "step")

    def __init__(self, rows: int, base: Any, step: Any, dtype: Any) -> None:
        self.dtype = np.dtype(dtype)
        self.rows = int(rows)
        self.base = np.array(base, self.dtype, ndmin=1)
        self.step = np.array(step, self.dtype, ndmin=1)
        if self.rows < 0 or not len(self.base) or self.base.shape != self.step.shape:
            raise ValueError("a computed column needs rows >= 0 and a step for each base")
        if self.dtype.itemsize < 8 and self.step.any():
            # (a sample's number times a step would wrap in a narrow type: only 64-bit
            # columns, offsets and rows, grow with the row)
            raise ValueError(f"a computed {self.dtype} column must be constant per member")

    @property
    def period(self) -> int:
        return len(self.base)

    @property
    def shape(self) -> tuple[int]:
        return (self.rows,)

    @property
    def ndim(self) -> int:
        return 1

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, (int, np.integer)):
            row = int(key) + (self.rows if key < 0 else 0)
            if not 0 <= row < self.rows:
                raise IndexError(f"row {int(key)} of a column of {self.rows}")
            return self._at(np.array([row], np.int64))[0]
        if isinstance(key, slice):
            return self._at(np.arange(*key.indices(self.rows), dtype=np.int64))
        rows = np.asarray(key)
        if rows.dtype == bool:
            if rows.shape != (self.rows,):
                raise IndexError(f"a mask of {rows.shape} for a column of {self.rows}")
            return self._at(np.flatnonzero(rows))
        rows = rows.astype(np.int64, copy=False)
        rows = np.where(rows < 0, rows + self.rows, rows)
        if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= self.rows):
            raise IndexError(f"rows out of a column of {self.rows}")
        return self._at(rows)

    def _at(self, rows: np.ndarray) -> np.ndarray:
        # In uint64, which wraps as the C++ plan's arithmetic does; then the column's type.
        i, j = np.divmod(rows, self.period)
        base, step = self.base.astype(np.uint64), self.step.astype(np.uint64)
        return (base[j] + step[j] * i.astype(np.uint64)).astype(self.dtype)

    def __eq__(self, other: object) -> bool:
        # (numpy's `column == value` would be an array; a column that is not one must not
        # quietly answer False)
        raise TypeError("compare np.asarray(column), not a ComputedColumn")

    __ne__ = __eq__
    __hash__ = None  # type: ignore[assignment]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        values = self._at(np.arange(self.rows, dtype=np.int64))
        return values if dtype is None else values.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return (
            f"ComputedColumn(rows={self.rows}, base={self.base.tolist()}, "
            f"step={self.step.tolist()}, dtype={self.dtype})"
        )
