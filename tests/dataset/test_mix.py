"""stoker.Mix: datasets drawn from by weight, deterministically, with each source's own
shard-by-shard shuffle, exact and elastic resume, and counts per source."""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest

import stoker

FIELDS = {"cls": stoker.Int()}


def _source(folder, prefix: str, n: int, per_shard: int, base: int) -> stoker.Dataset:
    with stoker.ShardWriter(folder, max_samples=per_shard) as sink:
        for i in range(n):
            sink.write({"__key__": f"{prefix}{i:05d}", "cls": base + i})
    return stoker.Dataset(str(folder))


@pytest.fixture
def sources(tmp_path):
    big = _source(tmp_path / "big", "a", 2000, 100, 0)  # 20 shards
    small = _source(tmp_path / "small", "b", 300, 50, 100_000)  # 6 shards
    return big, small


def _values(loader) -> np.ndarray:
    return np.concatenate([batch["cls"].numpy() for batch in loader])


def test_exact_shares_and_batch_proportions(sources):
    big, small = sources
    mix = stoker.Mix([big, small], weights=[0.7, 0.3], epoch_samples=4000)
    loader = stoker.Loader(mix, batch_size=100, fields=FIELDS, seed=3)
    values = _values(loader)
    assert len(values) == 4000 and len(loader) == 40
    from_small = values >= 100_000
    assert from_small.sum() == 1200  # exactly 30% of the epoch
    assert loader.stats()["per_source"] == [2800, 1200]
    shares = from_small.reshape(40, 100).mean(axis=1)
    assert abs(shares.mean() - 0.3) < 1e-9
    assert shares.std() < np.sqrt(0.3 * 0.7 / 100) * 1.5  # about binomial, not clumped
    # The small source, 4 times over: each sample 4 times (a pass without repeats each).
    assert set(collections.Counter(values[from_small]).values()) == {4}
    # The big one, 2800 of 2000: a whole pass, then 800 of the next.
    counts = collections.Counter(values[~from_small])
    assert len(counts) == 2000 and sorted(set(counts.values())) == [1, 2]


def test_deterministic_and_epochs_differ(sources):
    mix = stoker.Mix(list(sources), weights=[1, 1], epoch_samples=1000)
    first = _values(stoker.Loader(mix, 50, fields=FIELDS, seed=1))
    assert np.array_equal(first, _values(stoker.Loader(mix, 50, fields=FIELDS, seed=1)))
    assert not np.array_equal(first, _values(stoker.Loader(mix, 50, fields=FIELDS, seed=2)))
    loader = stoker.Loader(mix, 50, fields=FIELDS, seed=1)
    loader.set_epoch(1)
    second = _values(loader)
    big = first[first < 100_000]
    # The big source goes on where epoch 0 stopped: no sample of epoch 0 again (1000 of 2000).
    assert not set(big) & set(second[second < 100_000])


def test_each_source_streams_shard_by_shard(sources):
    mix = stoker.Mix(list(sources), weights=[0.5, 0.5], epoch_samples=2000)
    loader = stoker.Loader(mix, 100, fields=FIELDS, seed=4, shuffle_window=2)
    for batch in loader:
        values = batch["cls"].numpy()
        big_shards = set((values[values < 100_000] // 100).tolist())
        small_shards = set(((values[values >= 100_000] - 100_000) // 50).tolist())
        assert len(big_shards) <= 4 and len(small_shards) <= 4  # about the window's shards


def test_without_weights_every_sample_once(sources):
    big, small = sources
    mix = stoker.Mix([big, small])
    values = _values(stoker.Loader(mix, 64, fields=FIELDS))
    assert sorted(values.tolist()) == list(range(2000)) + list(range(100_000, 100_300))
    assert len(mix) == 2300 and mix.offsets.tolist() == [0, 2000, 2300]
    assert mix[2000]["__key__"] == "b00000"


def test_exact_resume(sources):
    mix = stoker.Mix(list(sources), weights=[0.6, 0.4], epoch_samples=1500)
    whole = _values(stoker.Loader(mix, 50, fields=FIELDS, seed=9))
    loader = stoker.Loader(mix, 50, fields=FIELDS, seed=9)
    it = iter(loader)
    head = np.concatenate([next(it)["cls"].numpy() for _ in range(7)])
    state = json.loads(json.dumps(loader.state_dict()))
    again = stoker.Loader(mix, 50, fields=FIELDS, seed=9)
    again.load_state_dict(state)
    assert np.array_equal(np.concatenate([head, _values(again)]), whole)
    other = stoker.Loader(stoker.Mix(list(sources), weights=[0.5, 0.5], epoch_samples=1500),
                          50, fields=FIELDS, seed=9)  # fmt: skip
    with pytest.raises(stoker.StokerError, match="groups"):
        other.load_state_dict(state)


def test_elastic_resume(sources):
    mix = stoker.Mix(list(sources), weights=[0.6, 0.4], epoch_samples=1200)
    truth = collections.Counter(_values(stoker.Loader(mix, 1200, fields=FIELDS, seed=2)).tolist())
    kw = {"fields": FIELDS, "seed": 2, "drop_last": False}
    before, state = [], None
    for r in range(2):
        loader = stoker.Loader(mix, 20, rank=r, world_size=2, **kw)
        it = iter(loader)
        for _ in range(5):
            before.extend(next(it)["cls"].tolist())
        state = loader.state_dict()
    after = []
    for r in range(3):
        loader = stoker.Loader(mix, 20, rank=r, world_size=3, **kw)
        loader.load_state_dict(state)
        after.extend(_values(loader).tolist())
    read = collections.Counter(before + after)
    assert all(read[v] >= n for v, n in truth.items())  # nothing lost
    assert sum(read.values()) - sum(truth.values()) < 2 + 3  # padding only


def test_refusals(sources, tmp_path):
    big, small = sources
    with pytest.raises(stoker.UsageError, match="weights"):
        stoker.Mix([big, small], weights=[1.0])
    with pytest.raises(stoker.UsageError, match="non-negative"):
        stoker.Mix([big, small], weights=[1.0, -1.0])
    (tmp_path / "f.txt").write_text("x")
    loose = stoker.Dataset.from_files(tmp_path, ["f.txt"])
    with pytest.raises(stoker.UsageError, match="from_files"):
        stoker.Mix([big, loose])
    other = stoker.Dataset(big.source, cache_limit=1 << 30)
    with pytest.raises(stoker.UsageError, match="cache_limit"):
        stoker.Mix([other, small])
