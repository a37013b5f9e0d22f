"""Describing a remote dataset once across the ranks of a job, not once per node.

A shard with no manifest entry and no member index beside it must be looked into to count
its samples, and a small dense one is downloaded whole for that (its headers are most of
its bytes). Every rank needs every shard's count to plan an epoch, so without help each
node would download the whole dataset when it opens it. Instead, when torch.distributed is
initialised, opening stops at the shards' sizes; the Loader then has each rank describe the
shards it will most likely read in its first epoch (the plan, with each shard's bytes in
place of its samples), and the ranks swap what they found through torch.distributed's
key-value store. A node so downloads, when the dataset opens, about what its ranks then
read from its cache; the counts every rank plans with are still the true ones.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from typing import Any

from stoker.errors import StokerError

#: How long a rank waits for the others' descriptions (torch.distributed's own default
#: for a collective).
WAIT_SECONDS = 1800.0

_opened: dict[str, int] = {}  # how many datasets of each shard list this process shared


class SharedDescribe:
    """One dataset's place in the swap: the store, this process's rank among the job's,
    and the keys this dataset's descriptions go under."""

    def __init__(self, store: Any, rank: int, world_size: int, token: str) -> None:
        self.store, self.rank, self.world_size, self.token = store, rank, world_size, token

    def fail(self, error: BaseException) -> None:
        """Tell the other ranks this one could not describe its share (they raise too,
        rather than wait)."""
        self.store.set(self._key(self.rank), json.dumps({"error": str(error)}))

    def swap(self, found: dict[int, tuple[int, list[str] | None]]) -> dict[int, tuple]:
        """Publish what this rank `found` (shard: (samples, fields)) and return what every
        rank found, waiting for all of them."""
        shards = {str(k): v for k, v in found.items()}
        self.store.set(self._key(self.rank), json.dumps({"shards": shards}))
        keys = [self._key(r) for r in range(self.world_size)]
        started, pause = time.monotonic(), 0.005
        while not self.store.check(keys):
            waited = time.monotonic() - started
            if waited > WAIT_SECONDS:
                absent = [r for r, k in enumerate(keys) if not self.store.check([k])]
                raise StokerError(
                    f"rank {self.rank} waited {waited:.0f} s for ranks {absent[:8]} to describe "
                    "their share of the dataset's shards: every rank must make its Loader of "
                    "this dataset (the ranks swap shard descriptions when they do)"
                )
            time.sleep(pause)  # short sleeps: Ctrl-C gets through
            pause = min(2 * pause, 0.1)
        getter = getattr(self.store, "multi_get", None)
        values = getter(keys) if getter is not None else [self.store.get(k) for k in keys]
        merged: dict[int, tuple] = {}
        for r, value in enumerate(values):
            told = json.loads(value)
            if "error" in told:
                raise StokerError(
                    f"rank {r} could not describe its share of the shards: " + told["error"]
                )
            for shard, (samples, fields) in told["shards"].items():
                merged[int(shard)] = (int(samples), fields)
        return merged

    def _key(self, rank: int) -> str:
        return f"stoker/describe/{self.token}/{rank}"


def shared_describe(urls: Sequence[str], sizes: Sequence[int]) -> SharedDescribe | None:
    """The swap for a dataset of these shards, where torch.distributed is initialised with
    more than one rank; else None (each node describes every shard itself)."""
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d
    except ImportError:  # pragma: no cover - torch is installed with stoker's Loader
        return None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    get_store = getattr(distributed_c10d, "_get_default_store", None)
    if get_store is None:  # pragma: no cover - a torch without it: describe locally
        return None
    digest = hashlib.sha256()
    for url, size in zip(urls, sizes):
        digest.update(f"{url}\0{size}\n".encode())
    name = digest.hexdigest()[:24]
    # The n-th dataset of these shards opened in this process meets every other rank's n-th.
    seq = _opened.get(name, 0)
    _opened[name] = seq + 1
    return SharedDescribe(get_store(), dist.get_rank(), dist.get_world_size(), f"{name}/{seq}")
