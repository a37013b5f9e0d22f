"""ComputedColumn, the member column worked out from the row: indexed as the numpy array of
its values is, for every kind of index the member table uses."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from stoker._columns import ComputedColumn


@pytest.mark.parametrize(
    ("base", "step", "dtype"),
    [
        (7, 3, np.uint64),
        ([0, 1, 2], [3, 3, 3], np.int64),
        ([5, 9], [0, 0], np.int32),
        (4, 0, np.uint8),
    ],
)
def test_indexed_as_its_values_are(base, step, dtype):
    column = ComputedColumn(60, base, step, dtype)
    period = len(np.atleast_1d(base))
    rows = np.arange(60)
    want = (
        np.atleast_1d(base)[rows % period] + np.atleast_1d(step)[rows % period] * (rows // period)
    ).astype(dtype)
    assert np.array_equal(np.asarray(column), want)
    assert np.asarray(column).dtype == np.dtype(dtype)
    assert len(column) == 60 and column.shape == (60,)
    for i in (0, 1, 59, -1, -60, np.int64(17)):
        got = column[i]
        assert got == want[i] and isinstance(got, np.generic) and got.dtype == np.dtype(dtype)
    for key in (slice(None), slice(3, 40, 7), slice(None, -1), slice(50, 10, -3)):
        assert np.array_equal(column[key], want[key])
    picks = np.array([5, 0, 59, -2, 5])
    assert np.array_equal(column[picks], want[picks])
    mask = rows % 4 == 1
    assert np.array_equal(column[mask], want[mask])
    assert np.array_equal(column[np.array([], np.int64)], want[:0])
    assert np.array_equal(np.asarray(column, np.float64), want.astype(np.float64))
    again = pickle.loads(pickle.dumps(column))
    assert np.array_equal(np.asarray(again), want)


def test_rows_outside_are_refused():
    column = ComputedColumn(10, 0, 1, np.int64)
    for key in (10, -11, np.array([3, 10]), np.array([-11])):
        with pytest.raises(IndexError):
            column[key]
    with pytest.raises(IndexError):
        column[np.ones(9, bool)]
    with pytest.raises(ValueError):
        ComputedColumn(10, [1, 2], [1], np.int64)


def test_narrow_columns_are_constant_and_read_past_their_range():
    codec = ComputedColumn(1000, 3, 0, np.uint8)
    assert codec[300] == 3 and codec[-1] == 3 and codec[np.array([999])].tolist() == [3]
    field = ComputedColumn(2**33, [4, 5], [0, 0], np.int32)
    assert field[2**32 + 1] == 5 and field[np.array([2**33 - 2])].tolist() == [4]
    with pytest.raises(ValueError, match="constant per member"):
        ComputedColumn(10, 0, 1, np.int32)


def test_a_comparison_is_refused_rather_than_answered_false():
    column = ComputedColumn(10, 0, 1, np.int64)
    with pytest.raises(TypeError, match="np.asarray"):
        column == 3  # noqa: B015
    assert (np.asarray(column) == 3).sum() == 1


def test_keyed_permutation_bounds():
    import stoker._core as _core

    keys = np.arange(6, dtype=np.uint64)
    assert _core.keyed_permutation(2**63, keys, np.array([0, 2**63 - 1])).min() >= 0
    with pytest.raises(ValueError, match="at most 2\\*\\*63"):
        _core.keyed_permutation(2**63 + 1, keys, np.array([0]))
    with pytest.raises(ValueError, match="outside"):
        _core.keyed_permutation(10, keys, np.array([10]))
    assert _core.keyed_permutation(0, keys, np.array([], np.int64)).tolist() == []
