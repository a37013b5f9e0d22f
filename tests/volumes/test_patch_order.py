"""PatchOrder: an epoch's patches by rank and batch, worked out for the batches asked for
only, against the same split made from a list of every patch."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import stoker
from stoker.loader.sample_orders import KeyedPermutation
from stoker.volumes.patch_order import PatchOrder
from tests.support.patches import expected_patch


def listed_batches(counts, seed, epoch, shuffle, rank, world, batch, drop_last):
    """The split made the plain way: every (subject, patch number) in a list, shuffled,
    wrapped around to fill the last ranks' share, cut into batches."""
    line = [(s, k) for s, count in enumerate(counts) for k in range(count)]
    n = len(line)
    if shuffle and n:
        line = [line[i] for i in KeyedPermutation(n, seed, epoch, 0x9A7C).at(np.arange(n))]
    share = n // world if drop_last else -(-n // world)
    if share == 0:
        return []
    wrapped = (line * -(-share * world // n))[: share * world]
    mine = wrapped[rank * share : (rank + 1) * share]
    batches = [mine[i : i + batch] for i in range(0, len(mine), batch)]
    if drop_last and batches and len(batches[-1]) < batch:
        batches.pop()
    return batches


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_batches_equal_the_split_of_a_list(shuffle, drop_last):
    rng = np.random.default_rng(3)
    for trial in range(40):
        counts = rng.integers(0, 9, size=int(rng.integers(1, 7)))
        world, batch = int(rng.integers(1, 6)), int(rng.integers(1, 6))
        for rank in range(world):
            args = (counts, trial, 2, shuffle, rank, world, batch, drop_last)
            want = listed_batches(*args)
            plan = PatchOrder(*args)
            assert len(plan) == len(want)
            assert [plan.batch(n) for n in range(len(plan))] == want
            numbers = list(range(len(plan)))[::2]
            together = plan.entries(numbers).tolist()
            assert together == [list(entry) for n in numbers for entry in want[n]]
            assert plan.sizes(numbers).tolist() == [len(want[n]) for n in numbers]


def test_an_epoch_is_every_patch_once_and_each_epoch_its_own_order():
    counts = np.array([5, 0, 7, 3])
    epochs = []
    for epoch in range(3):
        plan = PatchOrder(counts, 11, epoch, True, 0, 1, 4, False)
        entries = plan.entries(range(len(plan))).tolist()
        assert sorted(map(tuple, entries)) == [(s, k) for s in (0, 2, 3) for k in range(counts[s])]
        epochs.append(entries)
    assert epochs[0] != epochs[1] != epochs[2]


def test_a_billion_patches_on_256_ranks_cost_nothing_per_patch():
    """The plan holds the subjects' counts, not the epoch's patches: a list of a billion
    (subject, patch number) pairs would be tens of GB, and built again each epoch."""
    counts = np.full(1_000, 1_000_000, np.int64)
    tracemalloc.start()
    try:
        plan = PatchOrder(counts, 0, 5, True, 255, 256, 256, True)
        last = plan.entries([len(plan) - 1])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(plan) == 10**9 // 256 // 256
    assert peak < 1 << 20
    assert last.shape == (256, 2) and len({tuple(e) for e in last.tolist()}) == 256
    assert last[:, 0].max() < 1_000 and last[:, 1].max() < 1_000_000


def test_a_loader_of_a_billion_patches_has_its_length_and_first_batch_at_once(tmp_path):
    data = np.arange(24**3, dtype=np.int32).reshape(24, 24, 24)
    np.save(tmp_path / "v.npy", data)
    volumes = stoker.Volumes([{"image": str(tmp_path / "v.npy")}])
    loader = stoker.PatchLoader(
        volumes, 8, 4, patches_per_subject=10**9, rank=7, world_size=256, seed=1
    )
    share = -(-(10**9) // 256)  # each rank's patches
    tracemalloc.start()
    try:
        assert len(loader) == -(-share // 4)
        batch = next(iter(loader))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20
    for b, start in enumerate(batch["location"].tolist()):
        want = expected_patch(data, tuple(start), (8, 8, 8))
        np.testing.assert_array_equal(batch["image"][b, 0].numpy(), want)
