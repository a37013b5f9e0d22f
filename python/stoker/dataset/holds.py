"""Holding a dataset's remote shards: fetched into the node cache (once per node), indexed
on arrival, kept from eviction while batches read them, let go after. The one way both
``Dataset.get_batch`` and the Loader's prefetch hold shards."""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable, Iterator

import numpy as np

from stoker._process import wait_result
from stoker.dataset.members import MemberTable, same_index
from stoker.dataset.reads import forget_everywhere
from stoker.errors import FetchError, StokerError, human, located
from stoker.remote import Arrival, IndexStep, RemoteShard, RemoteShards, index_copy


class ShardHolds:
    """The remote shards of one dataset (`remote_of`: dataset shard -> remote number)."""

    def __init__(self, remote: RemoteShards, remote_of: dict[int, int], table: MemberTable):
        self.remote = remote
        self.remote_of = remote_of
        self.table = table
        self.is_remote = np.zeros(len(table.known), bool)
        self.is_remote[list(remote_of)] = True
        self._on_notes: Callable[[list], None] = lambda notes: None

    def on_notes(self, report: Callable[[list], None]) -> None:
        """Where what indexing a shard found (MemberTable.add's notes) is reported when it
        arrives."""
        self._on_notes = report

    @property
    def connections(self) -> int:
        return self.remote.options.connections

    @property
    def limit(self) -> int:
        """Bytes the node cache may hold."""
        return self.remote.limit

    def _remote(self, shard: int) -> RemoteShard:
        return self.remote.shards[self.remote_of[shard]]

    def size_of(self, shard: int) -> int:
        return self._remote(shard).size or 0

    def url_of(self, shard: int) -> str:
        return self._remote(shard).url

    def remote_among(self, shards: np.ndarray) -> list[int]:
        """Those of `shards` that are remote."""
        return [s for s in shards.tolist() if self.is_remote[s]]

    # -- one shard ---------------------------------------------------------------------

    def start(
        self,
        shard: int,
        priority: tuple[int, int] = (0, 0),
        columns: frozenset[str] | None = None,
    ) -> concurrent.futures.Future:
        """Hold `shard` in the cache, fetching it if need be; the future's result is an
        Arrival, with the index made on the shard thread where this process needs one.
        Downloads start in `priority` order (lowest first). Of a table file, the fields
        `columns` are enough, where given (a Parquet file is then fetched in part)."""
        return self.remote.start(self.remote_of[shard], priority, self._index_step(shard), columns)

    def _index_step(self, shard: int) -> IndexStep | None:
        """What the arrival of `shard` needs indexed. Nothing where this process has its
        index and a sha256 pins its bytes; else the copy that arrives, unless it is the
        copy this process indexed (a cache file changes only by a new download): indexed
        again, it is compared with the first index (see arrived)."""
        remote = self._remote(shard)
        if not self.table.has_index(shard):
            return IndexStep(remote.format)
        if remote.sha256:
            return None
        indexed = tuple(int(v) for v in self.table.identities[shard])
        return IndexStep(remote.format, unless_copy=indexed)

    def arrived(self, shard: int, arrival: Arrival) -> None:
        """A fetched shard is held: index it (the first time) or check it is the same as
        before. On an error the hold stays the caller's to release."""
        hold, index = arrival
        table = self.table
        with table.lock:  # threads reading the dataset share its index
            # Held: its index stays until the hold is let go of. Pinned first, so that
            # adding it to a table full of pinned shards does not let it go at once.
            table.pin(shard)
            try:
                if index is None and not table.has_index(shard):  # let go of meanwhile
                    index = index_copy(hold.path, self._remote(shard).format)
                if index is not None:
                    if not table.has_index(shard):
                        self._on_notes(table.add([shard], [index]))
                    elif not same_index(table, shard, index):
                        raise located(
                            FetchError,
                            self.url_of(shard),
                            0,
                            "fetched again, the shard's members differ from the first time: "
                            "it changed on the server (a manifest with sha256 pins it)",
                        )
                table.set_identity(shard, hold.identity)
            except BaseException:
                table.unpin(shard)
                raise

    def warm(
        self,
        shard: int,
        priority: tuple[int, int] = (1, 0),
        columns: frozenset[str] | None = None,
    ) -> concurrent.futures.Future:
        """Fetch `shard` ahead, unheld, if the cache has room for it now."""
        return self.remote.warm(self.remote_of[shard], priority, columns)

    def release(self, shard: int, arrived: bool = True) -> None:
        """Let go of a hold of `shard`; `arrived`: arrived() took it (and kept its index)."""
        if arrived:
            self.table.unpin(shard)
        if self.remote.release(self.remote_of[shard]):
            # Close our cached descriptors too, or an evicted file's space stays in use.
            forget_everywhere(self.table.paths[shard])

    def release_when_done(self, shard: int) -> Callable[[concurrent.futures.Future], None]:
        """A callback for a fetch left behind (by an error, or a loop left early): whatever
        it held is let go when it ends."""

        def done(future: concurrent.futures.Future) -> None:
            if not future.cancelled() and future.exception() is None:
                self.release(shard, arrived=False)

        return done

    # -- many ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def holding(self, shards: list[int], columns: frozenset[str] | None = None) -> Iterator[None]:
        """`shards` (remote ones) held in the cache, fetched if need be, for the block
        (with `columns`, see start)."""
        futures = [self.start(s, columns=columns) for s in shards]
        held: list[tuple[int, bool]] = []  # ours to release from here on, and arrived
        try:
            for shard, future in zip(shards, futures):
                arrival = wait_result(future)
                held.append((shard, False))
                self.arrived(shard, arrival)
                held[-1] = (shard, True)
            yield
        finally:
            for shard, arrived in held:
                self.release(shard, arrived)
            for shard, future in zip(shards[len(held) :], futures[len(held) :]):
                future.add_done_callback(self.release_when_done(shard))

    def check_room(
        self, first: dict[int, int], last: dict[int, int], lead: int, processes: int, what: str
    ) -> None:
        """Refuse, now, a cache too small for what `processes` readers of the node hold at
        once, each holding shard s from batch ``first[s] - lead`` until batch ``last[s]``
        is done (`what` says whose needs they are): it would wait, later, for room that
        never comes."""
        if not first:
            return
        delta = np.zeros(max(last.values()) + 2, np.int64)
        for shard, begin in first.items():
            size = self.size_of(shard)
            delta[max(begin - lead, 0)] += size
            delta[last[shard] + 1] -= size
        need = int(np.cumsum(delta).max()) * processes
        if self.limit < need:
            raise StokerError(
                f"cache_limit={self.limit} bytes ({human(self.limit)}) is too small for this "
                f"loader: the shards it holds at once ({what}) need {need} bytes "
                f"({human(need)}); raise cache_limit to at least {need}, or lower "
                "shuffle_window or prefetch (fewer shards held at once)"
            )
