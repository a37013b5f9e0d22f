"""One dataset's remote shards: what is known of each, where each lives in the cache, and
acquire/release by shard number, on the process's shard threads."""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable, Sequence
from typing import Any

from stoker._files import default_cache_root
from stoker._process import DaemonPool, daemon_pool
from stoker.remote.cache import Hold, NoRoom, ShardCache, cache_for
from stoker.remote.describe import ShardDescriber, adopt_manifests, name_shards
from stoker.remote.fetching import Arrival, IndexStep, arrive, hold_shard
from stoker.remote.http import Fetcher, fetcher_for
from stoker.remote.options import FetchOptions
from stoker.remote.shard import RemoteShard


class RemoteShards:
    """The remote shards of one dataset: what is known of each and where it is cached."""

    def __init__(
        self,
        shards: list[RemoteShard],
        cache_dir: str | os.PathLike[str] | None,
        cache_limit: int | None,
        options: FetchOptions | None,
    ) -> None:
        self.options = options or FetchOptions()
        # Resolved now: a child process may run in another working directory.
        self.cache_dir = os.path.abspath(os.fspath(cache_dir or default_cache_root()))
        self.cache_limit = cache_limit
        self.shards = shards
        self._limit: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_limit"] = None
        return state

    @property
    def cache(self) -> ShardCache:
        """This process's view of the cache (a forked child has its own: its parent's
        holds and locks are not its own)."""
        return cache_for(self.cache_dir)

    @property
    def limit(self) -> int:
        if self._limit is None:
            given = self.cache_limit
            self._limit = int(given) if given is not None else self.cache.default_limit()
        return self._limit

    @property
    def fetcher(self) -> Fetcher:
        return fetcher_for(self.options)

    @property
    def _pool(self) -> DaemonPool:
        # More threads than connections: a thread finishing one shard (fsync, rename,
        # index) or making room for the next must not keep a connection idle; aiohttp's
        # connector is what bounds the transfers.
        return daemon_pool(2 * self.options.connections + 4, "stoker-shards")

    def path_of(self, i: int) -> str:
        return self.cache.path_of(self.shards[i].name)

    def describe(self, only: Sequence[int] | None = None) -> None:
        """Learn each shard's size and samples that no manifest gave: from a manifest beside
        the shards if there is one, else from what this node remembers of them (in the
        cache), else by looking into them once per node (see :mod:`.describe`). With
        `only`, every size but the samples of those shards only (the rest: see
        `undescribed`)."""
        missing = [s for s in self.shards if s.size is None or s.samples is None]
        if missing:
            adopt_manifests(missing, self.fetcher)
            missing = [s for s in missing if s.size is None or s.samples is None]
        name_shards(self.shards, self.fetcher)
        if missing:
            describer = ShardDescriber(self.cache, self.fetcher, self.limit, self._pool)
            describer.describe(self.shards, missing, only)

    def undescribed(self) -> list[int]:
        """The shards whose samples are not known yet."""
        return [i for i, s in enumerate(self.shards) if s.samples is None]

    # -- acquire / release --------------------------------------------------------

    def acquire(
        self,
        i: int,
        progress: Callable[[int], None] | None = None,
        wait_for_room: bool = True,
        priority: tuple[int, int] = (0, 0),
        columns: frozenset[str] | None = None,
    ) -> Hold:
        """Hold shard `i` in the cache, fetching it if needed (blocks). A download waiting
        for a connection goes before those of higher `priority`. Of a Parquet file, the
        fields `columns` are enough (None: all of it)."""
        request = self.shards[i].request(priority, wait_for_room, progress, columns=columns)
        return hold_shard(request, self.cache, self.fetcher, self.limit)

    def start(
        self,
        i: int,
        priority: tuple[int, int] = (0, 0),
        index: IndexStep | None = None,
        columns: frozenset[str] | None = None,
    ) -> concurrent.futures.Future:
        """acquire(i) on the process's shard threads, then the `index` step there; the
        future's result is an Arrival."""
        return self._pool.submit(lambda: self._arrive(i, priority, index, columns))

    def _arrive(
        self,
        i: int,
        priority: tuple[int, int],
        index: IndexStep | None,
        columns: frozenset[str] | None,
    ) -> Arrival:
        request = self.shards[i].request(priority, index=index, columns=columns)
        return arrive(request, self.cache, self.fetcher, self.limit)

    def warm(
        self, i: int, priority: tuple[int, int] = (1, 0), columns: frozenset[str] | None = None
    ) -> concurrent.futures.Future:
        """Fetch shard `i` into the cache without holding it, if there is room now: a
        prefetch that never crowds out the shards being read."""

        def task() -> bool:
            try:
                self.acquire(i, wait_for_room=False, priority=priority, columns=columns)
            except NoRoom:
                return False
            self.release(i)
            return True

        return self._pool.submit(task)

    def release(self, i: int) -> bool:
        return self.cache.release(self.path_of(i))
