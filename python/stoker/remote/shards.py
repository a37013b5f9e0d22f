"""One dataset's remote shards: URLs, what a manifest promises of each, where each lives
in the cache, and acquire/release by shard number."""

from __future__ import annotations

import concurrent.futures
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stoker._process import daemon_pool, wait_result
from stoker.errors import FetchError, ShardFormatError, located
from stoker.remote.cache import Hold, NoRoom, ShardCache, cache_for, cache_name, default_cache_root
from stoker.remote.http import Fetcher, FetchOptions, fetcher_for

log = logging.getLogger("stoker.remote")

# -- one dataset's remote shards ----------------------------------------------------


@dataclass
class RemoteShard:
    url: str
    format: str
    size: int | None = None
    sha256: str | None = None
    samples: int | None = None
    fields: list[str] | None = None
    name: str = ""  # where it lives under the cache root, once size and sha256 are known


#: Read-ahead of the header walk over a tar shard that has no manifest entry.
PROBE_WINDOW = 64 * 1024


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
    def _threads(self) -> int:
        # More threads than connections: a thread finishing one shard (fsync, rename,
        # index) or making room for the next must not keep a connection idle; aiohttp's
        # connector is what bounds the transfers.
        return 2 * self.options.connections + 4

    def path_of(self, i: int) -> str:
        return self.cache.path_of(self.shards[i].name)

    def describe(self) -> None:
        """Learn each shard's size and samples that no manifest gave: from a manifest beside
        the shards if there is one, else from their headers, read with range requests."""
        missing = [s for s in self.shards if s.size is None or s.samples is None]
        if missing:
            self._adopt_manifests(missing)
            missing = [s for s in missing if s.size is None or s.samples is None]
        if missing:
            log.info(
                "%d remote shard(s) have no manifest entry: reading their headers with range "
                "requests (a stoker.json beside them saves this)",
                len(missing),
            )
            pool = daemon_pool(self._threads, "stoker-shards")
            for future in [pool.submit(lambda s=s: self._probe(s)) for s in missing]:
                wait_result(future)
        for shard in self.shards:
            shard.name = cache_name(shard.url, shard.sha256)

    def _probe(self, shard: RemoteShard) -> None:
        from stoker import _core

        fetcher = self.fetcher
        if shard.size is None:
            shard.size = fetcher.call(fetcher.size_of(shard.url))
            if shard.size is None:
                raise located(FetchError, shard.url, 0, "the server does not say its size")

        def read(offset: int, length: int) -> bytes:
            return fetcher.call(fetcher.read_range(shard.url, offset, length))

        index = _core.index_remote(shard.url, shard.size, shard.format, read, PROBE_WINDOW)
        if shard.format == "npy":
            shard.samples, shard.fields = int(index["shape"][0]), ["npy"]
        else:
            shard.samples, shard.fields = len(index["keys"]), list(index["field_names"])

    def _adopt_manifests(self, shards: list[RemoteShard]) -> None:
        """Use the ``stoker.json`` beside the shards, where there is one that lists them:
        one request per folder instead of a look at every shard."""
        from stoker.manifest import MANIFEST_NAME, parse_manifest

        fetcher = self.fetcher
        folders: dict[str, list[RemoteShard]] = {}
        for shard in shards:
            folders.setdefault(shard.url.rsplit("/", 1)[0] + "/", []).append(shard)
        for folder, members in folders.items():
            url = folder + MANIFEST_NAME
            try:
                listed = dict(parse_manifest(fetcher.call(fetcher.read_all(url)), url))
            except FetchError as e:
                if getattr(e, "transport", False):
                    # The server is not answering: the shards would fail too. Said of the
                    # shard the user named, not of a manifest they never typed.
                    what = getattr(e, "detail", str(e))
                    raise located(
                        FetchError,
                        members[0].url,
                        0,
                        f"{what} (while looking for a {MANIFEST_NAME} beside it)",
                    ) from e
                log.debug("%s: no manifest (%s)", url, e)
                continue
            except ShardFormatError as e:  # something else answers to that name: a web page
                log.debug("%s: not a manifest (%s)", url, e)
                continue
            for shard in members:
                entry = listed.get(shard.url)
                if entry is not None:
                    apply_entry(shard, entry)

    # -- acquire / release --------------------------------------------------------

    def acquire(
        self,
        i: int,
        progress: Callable[[int], None] | None = None,
        wait_for_room: bool = True,
        priority: tuple[int, int] = (0, 0),
    ) -> Hold:
        """Hold shard `i` in the cache, fetching it if needed (blocks). A download waiting
        for a connection goes before those of higher `priority`."""
        shard = self.shards[i]
        assert shard.size is not None
        return self.cache.fetch(
            shard.url,
            self.path_of(i),
            shard.size,
            shard.sha256,
            self.fetcher,
            self.limit,
            progress,
            wait_for_room,
            priority,
        )

    def start(
        self,
        i: int,
        then: Callable[[Hold], Any] | None = None,
        priority: tuple[int, int] = (0, 0),
    ) -> concurrent.futures.Future:
        """acquire(i) (then `then(hold)`) on the process's shard threads."""

        def task() -> Any:
            hold = self.acquire(i, priority=priority)
            return then(hold) if then is not None else hold

        return daemon_pool(self._threads, "stoker-shards").submit(task)

    def warm(self, i: int, priority: tuple[int, int] = (1, 0)) -> concurrent.futures.Future:
        """Fetch shard `i` into the cache without holding it, if there is room now: a
        prefetch that never crowds out the shards being read."""

        def task() -> bool:
            try:
                self.acquire(i, wait_for_room=False, priority=priority)
            except NoRoom:
                return False
            self.release(i)
            return True

        return daemon_pool(self._threads, "stoker-shards").submit(task)

    def release(self, i: int) -> bool:
        return self.cache.release(self.path_of(i))


def apply_entry(shard: RemoteShard, entry: dict) -> None:
    """What a manifest entry says of a shard: bytes, samples, sha256, fields."""
    shard.size = entry.get("bytes", shard.size)
    shard.samples = entry.get("samples", shard.samples)
    shard.sha256 = entry.get("sha256", shard.sha256)
    if isinstance(entry.get("fields"), list):
        shard.fields = [str(f) for f in entry["fields"]]
