"""The sampler: a pure function of (seed, epoch, rank, world size); no data read."""

import numpy as np
import pytest

from stoker.loader.sampler import global_order, plan_epoch


def _sizes(n_shards, seed=0):
    return np.random.default_rng(seed).integers(1, 60, n_shards)


def _plans(sizes, world, **kw):
    args = dict(batch_size=8, shuffle=True, seed=3, epoch=0, drop_last=False)
    args.update(kw)
    return [plan_epoch(sizes, rank=r, world_size=world, **args) for r in range(world)]


def test_natural_order_without_shuffle():
    plan = plan_epoch(
        [3, 4], batch_size=3, shuffle=False, seed=0, epoch=5, rank=0, world_size=1, drop_last=False
    )
    assert plan.indices.tolist() == list(range(7))
    assert [plan.batch(k).tolist() for k in range(len(plan))] == [[0, 1, 2], [3, 4, 5], [6]]


def test_same_arguments_same_order():
    sizes = _sizes(30)
    a = global_order(sizes, shuffle=True, seed=1, epoch=2)[0]
    b = global_order(sizes, shuffle=True, seed=1, epoch=2)[0]
    assert np.array_equal(a, b)


def test_epochs_and_seeds_differ_but_cover_the_same_samples():
    sizes = _sizes(30)
    orders = [
        global_order(sizes, shuffle=True, seed=s, epoch=e)[0] for s, e in [(0, 0), (0, 1), (1, 0)]
    ]
    for order in orders:
        assert sorted(order.tolist()) == list(range(int(sizes.sum())))
    assert not np.array_equal(orders[0], orders[1])
    assert not np.array_equal(orders[0], orders[2])


@pytest.mark.parametrize("window", [1, 2, 5])
def test_samples_come_from_a_window_of_shards(window):
    sizes = np.full(40, 25)
    order, shard_order = global_order(sizes, shuffle=True, seed=7, epoch=0, shuffle_window=window)
    starts = np.concatenate([[0], np.cumsum(sizes)])[:-1]
    shard_of = np.searchsorted(starts, order, side="right") - 1
    position = np.empty(len(sizes), np.int64)
    position[shard_order] = np.arange(len(sizes))
    pos = position[shard_of]
    # Reading in order, a shard in use never lies `window` or more shards behind
    # the newest one started: at most window + 1 shards are open at once.
    newest = np.maximum.accumulate(pos)
    assert (newest - pos).max() <= window
    # and the window really mixes: with window > 1, consecutive samples change shard often
    if window > 1:
        assert (np.diff(shard_of) != 0).mean() > 0.3


@pytest.mark.parametrize("n_shards", [1, 7, 50])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_ranks_balanced_and_covering(n_shards, world):
    sizes = _sizes(n_shards, seed=n_shards)
    total = int(sizes.sum())
    plans = _plans(sizes, world)
    assert len({len(p) for p in plans}) == 1  # same number of batches on every rank
    assert len({len(p.indices) for p in plans}) == 1
    union = np.concatenate([p.indices for p in plans])
    assert set(union.tolist()) == set(range(total))  # nothing lost
    assert len(union) - total < world  # padding by wrap-around is at most world - 1


@pytest.mark.parametrize("world", [2, 3, 8])
def test_ranks_disjoint_with_drop_last(world):
    sizes = _sizes(23, seed=world)
    total = int(sizes.sum())
    plans = _plans(sizes, world, drop_last=True)
    union = np.concatenate([p.indices for p in plans])
    assert len(set(union.tolist())) == len(union)  # disjoint
    assert total - len(union) < world
    assert len({len(p) for p in plans}) == 1
    for p in plans:  # the partial last batch is dropped
        assert all(len(p.batch(k)) == p.batch_size for k in range(len(p)))


def test_each_rank_touches_a_share_of_the_shards():
    sizes = np.full(64, 100)
    starts = np.concatenate([[0], np.cumsum(sizes)])[:-1]
    for p in _plans(sizes, 8, shuffle_window=4):
        touched = np.unique(np.searchsorted(starts, p.indices, side="right") - 1)
        assert len(touched) <= 64 // 8 + 4  # its stretch, plus the window at its edges


def test_more_ranks_than_samples():
    plans = _plans([2], 5)
    assert all(len(p.indices) == 1 for p in plans)
    assert {int(p.indices[0]) for p in plans} == {0, 1}


def test_empty_dataset_and_bad_arguments():
    plan = plan_epoch(
        [], batch_size=4, shuffle=True, seed=0, epoch=0, rank=0, world_size=2, drop_last=False
    )
    assert len(plan) == 0
    with pytest.raises(ValueError, match="rank 2"):
        plan_epoch(
            [3], batch_size=4, shuffle=True, seed=0, epoch=0, rank=2, world_size=2, drop_last=False
        )
    with pytest.raises(ValueError, match="batch_size"):
        plan_epoch(
            [3], batch_size=0, shuffle=True, seed=0, epoch=0, rank=0, world_size=1, drop_last=False
        )
