"""Remote shards for one epoch of a Loader, fetched in the order its batches need them."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os

import numpy as np

from stoker._process import wait_result
from stoker.dataset import Dataset
from stoker.dataset.holds import ShardHolds
from stoker.loader.sampler import EpochPlan

#: Remote shards fetched ahead beyond one per connection.
EXTRA_SHARDS = 2


def shard_spans(
    ds: Dataset, holds: ShardHolds, plan: EpochPlan, start: int
) -> tuple[list[int], dict[int, int], dict[int, int]]:
    """This rank's remote shards from batch `start` on: in the order batches first read
    them, and the first and last batch that reads each (from the plan's make-up: no
    sample of the epoch is listed to find them)."""
    groups, first_batch, last_batch = plan.group_spans(start)
    shards = ds.shards_of_groups(groups)
    keep = holds.is_remote[shards]
    order: list[int] = []
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    # Groups come in the order batches first read them; a shard cut into several groups
    # (never a remote one today) spans all of them.
    for shard, a, b in zip(
        shards[keep].tolist(), first_batch[keep].tolist(), last_batch[keep].tolist()
    ):
        if shard not in first:
            order.append(shard)
            first[shard], last[shard] = a, b
        else:
            first[shard], last[shard] = min(first[shard], a), max(last[shard], b)
    return order, first, last


def check_cache_room(
    ds: Dataset, holds: ShardHolds, plan: EpochPlan, prefetch: int, what: str
) -> None:
    """Refuse, now, a cache too small for what a loader holds at once (the shards of the
    batches being read, `prefetch` read ahead; `what` says what decides them); it would wait
    for room that never comes, later."""
    _, first, last = shard_spans(ds, holds, plan, 0)
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # each rank reads its own
    holds.check_room(
        first, last, prefetch, processes, f"{what}, {processes} process(es) on the node"
    )


class ShardPrefetch:
    """One epoch's remote shards for this rank. The shards of the batches being read are
    held (fetched first if need be) until the last batch that reads them is done; the next
    few in the order batches first need them are fetched ahead, unheld and only into free
    room, so read-ahead never crowds out what is being read."""

    def __init__(
        self,
        ds: Dataset,
        holds: ShardHolds,
        plan: EpochPlan,
        start: int,
        columns: frozenset[str] | None = None,
    ) -> None:
        self.ds = ds
        self.columns = columns  # the fields batches read (None: all), see ShardHolds.start
        self.holds = holds
        self.plan = plan
        self.order, _, self.last = shard_spans(ds, holds, plan, start)
        # Enough fetched ahead to keep every connection busy while batches are read.
        self.ahead = holds.connections + EXTRA_SHARDS
        self.rank = {shard: i for i, shard in enumerate(self.order)}  # download priority
        self.started: dict[int, concurrent.futures.Future] = {}  # held, or on the way
        self.arrived: set[int] = set()  # held and indexed
        self.warming: dict[int, concurrent.futures.Future] = {}  # fetched ahead, unheld
        self.next = 0  # the first shard of self.order neither held nor warming

    def _batch_shards(self, k: int) -> list[int]:
        return self.holds.remote_among(np.unique(self.ds.shards_of(self.plan.batch(k))))

    def pump(self, next_batch: int) -> None:
        """Hold the shards batch `next_batch` reads, and warm the next ones in order, so
        that ``ahead`` are warming (or warm and not needed yet)."""
        if next_batch < len(self.plan):
            for shard in self._batch_shards(next_batch):
                self._start(shard)
        while self.next < len(self.order) and len(self.warming) < self.ahead:
            shard = self.order[self.next]
            self.next += 1
            if shard not in self.started:
                self.warming[shard] = self.holds.warm(shard, (1, self.rank[shard]), self.columns)

    def _start(self, shard: int) -> None:
        self.warming.pop(shard, None)  # its download, if running, is waited for by lock
        if shard not in self.started:
            self.started[shard] = self.holds.start(shard, (0, self.rank[shard]), self.columns)

    def ready(self, k: int) -> bool:
        """Whether every fetch batch `k` needs has ended (well or not)."""
        return all(self.started[s].done() for s in self._batch_shards(k))

    def wait(self, k: int) -> None:
        for shard in self._batch_shards(k):
            with contextlib.suppress(Exception):  # arrive() raises it, at its batch
                wait_result(self.started[shard])

    def arrive(self, k: int) -> None:
        """Index batch `k`'s shards that arrived; a fetch that failed raises here (and is
        forgotten, so a later batch that needs the shard tries again)."""
        for shard in self._batch_shards(k):
            if shard in self.arrived:
                continue
            future = self.started.pop(shard)
            arrival = future.result()  # a failed fetch holds nothing
            try:
                self.holds.arrived(shard, arrival)
            except BaseException:
                self.holds.release(shard, arrived=False)
                raise
            self.started[shard] = future
            self.arrived.add(shard)

    def finished(self, k: int) -> None:
        """Batch `k` is read: let go of the shards no later batch reads."""
        for shard in self._batch_shards(k):
            if self.last.get(shard) == k and shard in self.arrived:
                self.arrived.discard(shard)
                del self.started[shard]
                self.holds.release(shard)

    def close(self) -> None:
        """Let go of everything: held shards now, fetches still running when they end."""
        for shard, future in self.started.items():
            if shard in self.arrived:
                self.holds.release(shard)
            elif not future.cancel():
                future.add_done_callback(self.holds.release_when_done(shard))
        self.started.clear()
        self.arrived.clear()
        self.warming.clear()  # unheld: nothing to let go
