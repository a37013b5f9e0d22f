"""Describing bare remote shards once across ranks (stoker.dataset.shared): each rank looks
into the shards it will likely read and the ranks swap counts through torch.distributed's
key-value store. Here two ranks are two threads over one in-process store; the torchrun
test (test_multinode.py) runs it across processes and nodes."""

from __future__ import annotations

import os
import threading

import pytest

import stoker
import stoker.dataset as dataset_module
from stoker.dataset import shared
from stoker.errors import StokerError
from tests.support.server import ShardServer
from tests.support.shards import make_samples, write_tar

torch_dist = pytest.importorskip("torch.distributed")

SHARDS = 12


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """SHARDS small tars, no manifest and no member index: opening must look into them."""
    folder = tmp_path_factory.mktemp("bare")
    for s in range(SHARDS):
        samples = [(f"s{s:02d}-{key}", fields) for key, fields in make_samples(30, seed=s)]
        write_tar(folder / f"part-{s:02d}.tar", samples)
    with ShardServer(str(folder)) as server:
        yield server, f"{server.url}/part-{{00..{SHARDS - 1:02d}}}.tar"


def _ranks(monkeypatch, store, world: int) -> threading.local:
    """Each thread a rank of `world` over `store`, as torch.distributed would give it."""
    local = threading.local()

    def fake(urls, sizes):
        return shared.SharedDescribe(store, local.rank, world, "test")

    monkeypatch.setattr(dataset_module, "shared_describe", fake)
    return local


def _cached(cache) -> int:
    return sum(1 for _, _, files in os.walk(cache) for f in files if f.endswith(".tar"))


def test_ranks_look_into_their_own_shards_and_swap_counts(bare, tmp_path, monkeypatch):
    server, source = bare
    local = _ranks(monkeypatch, torch_dist.HashStore(), 2)
    results: dict[int, object] = {}

    def rank(r: int) -> None:
        try:
            local.rank = r
            ds = stoker.Dataset(source, cache_dir=tmp_path / f"node{r}")
            if r == 1:
                assert len(ds) == SHARDS * 30  # used before its Loader: opened on its own
            loader = stoker.Loader(ds, 16, rank=r, world_size=2, drop_last=True, seed=3)
            results[r] = (len(ds), len(loader), [k for b in loader for k in b["__key__"]])
        except BaseException as e:  # (reported by the main thread)
            results[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for r in (0, 1):
        if isinstance(results[r], BaseException):
            raise results[r]
    (n0, b0, keys0), (n1, b1, keys1) = results[0], results[1]
    assert n0 == n1 == SHARDS * 30 and b0 == b1
    assert not set(keys0) & set(keys1)
    # Rank 1 looked into every shard by itself; rank 0 only into its share (then read the
    # rest of its stretch).
    assert _cached(tmp_path / "node1") == SHARDS
    assert _cached(tmp_path / "node0") < SHARDS


def test_a_rank_that_never_makes_its_loader_is_named(bare, tmp_path, monkeypatch):
    server, source = bare
    local = _ranks(monkeypatch, torch_dist.HashStore(), 2)
    local.rank = 0
    monkeypatch.setattr(shared, "WAIT_SECONDS", 0.3)
    ds = stoker.Dataset(source, cache_dir=tmp_path / "node0")
    with pytest.raises(StokerError, match=r"ranks \[1\] to describe"):
        stoker.Loader(ds, 16, rank=0, world_size=2)


def test_without_torch_distributed_a_dataset_opens_at_once(bare, tmp_path):
    server, source = bare
    assert shared.shared_describe(["u"], [1]) is None  # (no process group here)
    ds = stoker.Dataset(source, cache_dir=tmp_path / "alone")
    assert ds.shard_weights() is None and len(ds) == SHARDS * 30


def test_a_rank_whose_shard_is_damaged_stops_every_rank(bare, tmp_path, monkeypatch):
    server, source = bare
    store = torch_dist.HashStore()
    local = _ranks(monkeypatch, store, 2)
    local.rank = 0
    ds = stoker.Dataset(source, cache_dir=tmp_path / "node0")
    # Rank 1 failed on one of its shards (a truncated tar, say) and said so.
    shared.SharedDescribe(store, 1, 2, "test").fail(
        StokerError("part-03.tar: offset 512: cut short")
    )
    with pytest.raises(StokerError, match=r"rank 1 could not describe.*part-03.tar: offset 512"):
        stoker.Loader(ds, 16, rank=0, world_size=2)
