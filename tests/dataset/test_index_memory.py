"""The member index costs memory for the shards in use, not for the dataset: no array of
every sample at open, a bounded number of shards indexed at once under a Loader, indexes
let go of and made again (from the sidecars) with the same members and keys, and the same
under threads and DataLoader workers."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import stoker
from stoker.dataset.members import DEFAULT_RESIDENT
from stoker.tools.cli import main as cli
from tests.support.shards import make_samples, write_tar

SHARDS = 120
PER_SHARD = 25


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory):
    """SHARDS tar shards (tarfile) of PER_SHARD samples, with the manifest and member index
    sidecars `stoker index` writes."""
    folder = tmp_path_factory.mktemp("many")
    samples = make_samples(SHARDS * PER_SHARD, seed=4, size=40)
    for s in range(SHARDS):
        write_tar(folder / f"shard-{s:04d}.tar", samples[s * PER_SHARD : (s + 1) * PER_SHARD])
    assert cli(["index", str(folder)]) == 0
    return str(folder / "stoker.json"), samples


def _arrays(obj, seen=None):
    """Every numpy array reachable from `obj`'s attributes (dicts, lists, objects)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _arrays(value, seen)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _arrays(value, seen)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("stoker"):
        yield from _arrays(vars(obj), seen)


def test_opening_holds_no_array_of_every_sample(many_shards):
    manifest, _ = many_shards
    ds = stoker.Dataset(manifest)
    assert len(ds) == SHARDS * PER_SHARD
    longest = max(len(a) for a in _arrays(ds.members))
    assert longest <= SHARDS + 1  # per shard, not per sample
    assert ds.members.resident_count == 0


def test_a_loader_holds_a_bounded_number_of_shards(many_shards):
    manifest, samples = many_shards
    ds = stoker.Dataset(manifest)
    loader = stoker.Loader(
        ds, batch_size=16, shuffle=True, seed=1, shuffle_window=4, drop_last=False,
        fields={"raw": stoker.Bytes(), "cls": stoker.Int()},
    )  # fmt: skip
    truth = dict(samples)
    most, seen = 0, 0
    for epoch in range(2):
        loader.set_epoch(epoch)
        for batch in loader:
            most = max(most, ds.members.resident_count)
            for key, raw in zip(batch["__key__"], batch["raw"]):
                assert bytes(raw) == truth[key]["raw"]
            seen += len(batch["__key__"])
    assert seen == 2 * len(samples)
    # Every shard was read, but no more than the loader's working set was indexed at once.
    assert ds.members.known.all()
    assert most <= max(DEFAULT_RESIDENT, ds.members.capacity) < SHARDS


def test_an_index_let_go_of_comes_back_the_same(many_shards):
    manifest, samples = many_shards
    ds = stoker.Dataset(manifest)
    ds.members.capacity = 2  # let go of everything but the last two
    first = ds.get_batch(range(PER_SHARD))  # shard 0
    for s in range(1, 6):
        ds.get_batch([s * PER_SHARD])
    assert ds.members.resident(0) is None and ds.members.known[0]
    again = ds.get_batch(range(PER_SHARD))
    assert [x["__key__"] for x in again] == [x["__key__"] for x in first]
    assert [bytes(x["raw"]) for x in again] == [samples[i][1]["raw"] for i in range(PER_SHARD)]
    assert ds.members.resident_count <= 2


def test_a_batch_wider_than_the_capacity(many_shards):
    """One batch may read more shards than are kept: they are all held while it is read."""
    manifest, samples = many_shards
    ds = stoker.Dataset(manifest)
    ds.members.capacity = 3
    every = ds.get_batch(range(len(ds)))
    assert [x["__key__"] for x in every] == [k for k, _ in samples]
    assert ds.keys([0, len(ds) - 1]) == [samples[0][0], samples[-1][0]]
    assert ds.members.resident_count <= 3


def test_threads_reading_while_indexes_come_and_go(many_shards):
    manifest, samples = many_shards
    ds = stoker.Dataset(manifest)
    ds.members.capacity = 4
    errors = []

    def read(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(40):
                idx = rng.integers(0, len(ds), 12)
                for i, sample in zip(idx.tolist(), ds.get_batch(idx)):
                    assert sample["__key__"] == samples[i][0]
                    assert bytes(sample["raw"]) == samples[i][1]["raw"]
        except Exception as e:  # raised in the test's thread below
            errors.append(e)

    threads = [threading.Thread(target=read, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def _collate(batch):
    return [(s["__key__"], bytes(s["raw"])) for s in batch]


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_over_a_lazily_indexed_dataset(many_shards, context):
    import torch

    manifest, samples = many_shards
    ds = stoker.Dataset(manifest)
    ds.members.capacity = 4  # workers index their own shards, a few at a time
    loader = torch.utils.data.DataLoader(
        ds, batch_size=50, num_workers=2, collate_fn=_collate, multiprocessing_context=context
    )
    got = [pair for batch in loader for pair in batch]
    assert got == [(k, f["raw"]) for k, f in samples]


def test_the_fields_plan_after_indexes_were_let_go_of(many_shards):
    """A Loader over a dataset whose every shard was indexed and let go of before: the
    plan indexes them again as its batches need them."""
    manifest, samples = many_shards
    ds = stoker.Dataset(manifest)
    ds.members.capacity = 2
    for s in range(SHARDS):
        ds.get_batch([s * PER_SHARD])
    loader = stoker.Loader(ds, batch_size=64, shuffle=False, fields={"cls": stoker.Int()})
    cls = np.concatenate([b["cls"].numpy() for b in loader])
    assert cls.tolist() == [int(f["cls"]) for _, f in samples]
    assert os.path.exists(manifest)


def _sparse_npy(path, rows: int, picks: list[int]) -> np.ndarray:
    """A .npy of `rows` (2,) uint16 rows written by numpy, its data a hole but for the rows
    `picks`; returns their values."""
    values = np.stack([np.array(picks) % 65521, np.array(picks) // 65521 % 65521], 1)
    array = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint16, shape=(rows, 2))
    array[picks] = values
    array.flush()
    del array
    return values.astype(np.uint16)


def test_a_large_npy_is_indexed_by_rule_not_row_by_row(tmp_path):
    """A .npy's rows follow a rule (offset = data start + row * row bytes): opening one of
    5M rows makes no array of them (it made ten columns of 5M, 50 bytes a row), and rows at
    both ends and in the middle read back through the sample path and the fields= plan."""
    import tracemalloc

    torch = pytest.importorskip("torch")
    rows = 5_000_000
    picks = [0, 1, 2, 3, 2_345_678, rows - 1]
    values = _sparse_npy(tmp_path / "rows.npy", rows, picks)
    tracemalloc.start()
    try:
        ds = stoker.Dataset(str(tmp_path / "rows.npy"))
        got = ds.get_batch(np.array(picks))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(ds) == rows
    assert peak < 2_000_000, peak
    assert max(len(a) for a in _arrays(ds.members)) < 100
    for sample, want in zip(got, values):
        assert sample["npy"].tolist() == want.tolist()
    assert [s["__key__"] for s in got] == [f"rows/{i}" for i in picks]
    loader = stoker.Loader(ds, batch_size=4, shuffle=False, fields={"npy": stoker.Npy()})
    first = next(iter(loader))
    assert torch.equal(first["npy"], torch.from_numpy(values[:4]))
    assert first["__key__"] == [f"rows/{i}" for i in range(4)]


def test_a_npy_cut_short_after_open_names_the_file_and_offset(tmp_path):
    """Rows read by rule from a file cut short since it was opened: the error names the
    file and the offset of the first row it could not read."""
    path = tmp_path / "short.npy"
    np.save(path, np.arange(1000, dtype=np.int64).reshape(500, 2))
    ds = stoker.Dataset(str(path))
    loader = stoker.Loader(ds, batch_size=500, shuffle=False, fields={"npy": stoker.Npy()})
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 16 * 10)  # the last 10 rows gone
    with pytest.raises(stoker.StokerError) as e:
        next(iter(loader))
    assert str(path) in str(e.value), e.value
    assert "offset" in str(e.value), e.value


def test_a_npy_of_more_rows_than_a_shard_may_hold_is_refused_clearly(tmp_path):
    path = tmp_path / "huge.npy"
    rows = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(2**32 + 1,))
    del rows  # (a hole: no disk)
    with pytest.raises(stoker.ShardFormatError) as e:
        stoker.Dataset(str(path))
    assert str(path) in str(e.value) and "4,294,967,297 members" in str(e.value)
    assert "split it" in str(e.value)
