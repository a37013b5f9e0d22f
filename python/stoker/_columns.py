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
            i, j = divmod(row, self.period)
            return self.dtype.type(self.base[j] + self.step[j] * self.dtype.type(i))
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
        if self.period == 1:
            return self.base[0] + self.step[0] * rows.astype(self.dtype)
        i, j = np.divmod(rows, self.period)
        return self.base[j] + self.step[j] * i.astype(self.dtype)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        values = self._at(np.arange(self.rows, dtype=np.int64))
        return values if dtype is None else values.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return (
            f"ComputedColumn(rows={self.rows}, base={self.base.tolist()}, "
            f"step={self.step.tolist()}, dtype={self.dtype})"
        )
