"""One dataset's remote shards: URLs, what a manifest promises of each, where each lives
in the cache, and acquire/release by shard number."""

from __future__ import annotations

import concurrent.futures
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from stoker._files import default_cache_root
from stoker._process import daemon_pool, wait_result
from stoker.errors import FetchError, ShardFormatError, located
from stoker.formats import samples_and_fields
from stoker.remote.cache import (
    Hold,
    NoRoom,
    ShardCache,
    Unpack,
    cache_for,
    cache_name,
)
from stoker.remote.http import Fetcher, FetchOptions, fetcher_for, host_of
from stoker.remote.stores import AUTH_CODES, is_object_url

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
    validator: str | None = None  # its ETag or Last-Modified, where known
    ranges: bool | None = None  # whether its server said it takes range requests
    listed: bool = False  # found by listing a store prefix
    # A peer's shard compressed as a whole: fetched as it is, decompressed on its way into
    # the cache (stoker.peers.unpack_bytes; "bytes": its compressed size, where known).
    unpack: dict | None = None


#: The first read of a probe (the header walk over a shard that has no manifest entry).
#: Reads that follow each other closely (small members) double the read-ahead, up to
#: PROBE_READ_AHEAD, so a dense walk takes few requests.
PROBE_WINDOW = 16 * 1024
PROBE_READ_AHEAD = 4 << 20
#: A shard this small is downloaded whole, where the cache has room for it, rather than
#: probed: a probe would read a good share of it, and read it again when it is fetched.
SMALL_SHARD = 256 * 1024
#: A probe that has read, or is about to read, more than this share of the bytes it has
#: walked over stops; the shard is downloaded whole instead, where the cache has room.
PROBE_SHARE = 1 / 8


class _WholeIsCheaper(Exception):
    """A probe stopped: downloading the shard costs less than walking on."""


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

    def describe(self, only: Sequence[int] | None = None) -> None:
        """Learn each shard's size and samples that no manifest gave: from a manifest beside
        the shards if there is one, else from what this node remembers of them (in the
        cache), else by looking into them once per node (see _describe_one). With `only`,
        every size but the samples of those shards only (the rest: see `undescribed`)."""
        missing = [s for s in self.shards if s.size is None or s.samples is None]
        if missing:
            self._adopt_manifests(missing)
            missing = [s for s in missing if s.size is None or s.samples is None]
        fetcher = self.fetcher
        for shard in self.shards:
            if not shard.name:  # (a second call, after a swap: named already)
                shard.name = cache_name(fetcher.cache_url(shard.url), shard.sha256)
            if is_object_url(shard.url) and shard.ranges is None:
                shard.ranges = True  # every store takes ranges
        if not missing:
            return
        pool = daemon_pool(self._threads, "stoker-shards")
        cache = self.cache
        for host in {host_of(s.url) for s in missing}:
            if cache.read_record(_RANGELESS + host) is not None:
                fetcher.rangeless.add(host)
        # First a look at each (size, version), so that what is remembered can be
        # checked and whether the whole dataset fits in the cache is known.
        looks = [s for s in missing if s.size is None or s.validator is None]
        for future in [pool.submit(lambda s=s: self._look(s)) for s in looks]:
            wait_result(future)
        for host in fetcher.rangeless - {host_of(s.url) for s in missing if s.ranges}:
            cache.write_record(_RANGELESS + host, {"ranges": False})
        fits = sum(s.size or 0 for s in self.shards) <= self.limit
        todo = [i for i, s in enumerate(self.shards) if s.samples is None]
        if only is not None:
            todo = sorted(set(todo) & {int(i) for i in only})
        futures = [pool.submit(lambda i=i: self._describe_one(i, fits)) for i in todo]
        for future in futures:
            wait_result(future)

    def undescribed(self) -> list[int]:
        """The shards whose samples are not known yet."""
        return [i for i, s in enumerate(self.shards) if s.samples is None]

    def _look(self, shard: RemoteShard) -> None:
        fetcher = self.fetcher
        found = fetcher.call(fetcher.stat(shard.url))
        if found.size is None:
            raise located(FetchError, shard.url, 0, "the server does not say its size")
        if shard.size is not None and found.size != shard.size:
            raise located(
                FetchError,
                shard.url,
                min(found.size, shard.size),
                f"the server has {found.size} bytes but {shard.size} were expected: the "
                "shard changed",
            )
        shard.size, shard.validator, shard.ranges = found.size, found.validator, found.ranges

    def _describe_one(self, i: int, fits: bool) -> None:
        """Samples and fields of shard `i`: remembered by this node (for this size and
        version of it), else indexed from its copy in the cache, else looked into, once
        per node (under its lock, so others wait and then read the record). A shard
        whose probe would read a good share of it (small, or small members), or whose
        server ignores ranges, is downloaded whole instead, where the cache has room, and
        indexed locally: its bytes then cross the network once."""
        shard, cache, fetcher = self.shards[i], self.cache, self.fetcher
        key = fetcher.cache_url(shard.url)
        if self._remembered(shard, cache.read_record(key)):
            return
        path = self.path_of(i)
        with cache.shard_lock(path, shard.url):
            record = cache.read_record(key)
            if self._remembered(shard, record):
                return
            if record is not None and not cache.evict(path):  # the object changed
                what = "the shard changed on the server while a process reads its cached copy"
                raise located(FetchError, shard.url, 0, what)
            assert shard.size is not None
            hold = cache.hold(path, shard.size)
            if hold is not None and _version(cache.copy_version(path)) != _version(shard.validator):
                # A copy of another (or an unknown) version of the object: not this one.
                cache.release(path)
                hold = None
                if not cache.evict(path):
                    what = "the shard changed on the server while a process reads its cached copy"
                    raise located(FetchError, shard.url, 0, what)
            try:
                rangeless = host_of(shard.url) in fetcher.rangeless
                small = shard.size <= SMALL_SHARD or shard.ranges is None
                if hold is None and (rangeless or (fits and small)):
                    hold = self._download_now(i, wait=rangeless)
                if hold is None:
                    try:
                        index = self._probe(shard, give_up=fits)
                    except _WholeIsCheaper:
                        rangeless = host_of(shard.url) in fetcher.rangeless
                        hold = self._download_now(i, wait=rangeless)
                        if hold is None:  # no room now: walk on (it gives up only if the
                            try:  # server turned out to ignore ranges: then wait for room)
                                index = self._probe(shard, give_up=False)
                            except _WholeIsCheaper:
                                hold = self._download_now(i, wait=True)
                if hold is not None:
                    index = self._index_cached(hold.path, shard)
            finally:
                if hold is not None:
                    cache.release(path)
            shard.samples, shard.fields = samples_and_fields(index, shard.format)
            cache.write_record(
                key,
                {
                    "bytes": shard.size,
                    "version": _version(shard.validator),
                    "format": shard.format,
                    "samples": shard.samples,
                    "fields": shard.fields,
                },
            )

    @staticmethod
    def _remembered(shard: RemoteShard, record: dict | None) -> bool:
        """Take samples and fields from `record` if it is of this size and version of
        the shard."""
        if (
            record is None
            or record.get("bytes") != shard.size
            or record.get("version") != _version(shard.validator)
            or record.get("format") != shard.format
            or not isinstance(record.get("samples"), int)
        ):
            return False
        shard.samples = record["samples"]
        fields = record.get("fields")
        shard.fields = [str(f) for f in fields] if isinstance(fields, list) else None
        return True

    def _download_now(self, i: int, wait: bool) -> Hold | None:
        """Shard `i` downloaded into the cache and held, for a caller that holds its
        lock; None if the cache has no room now (and `wait` is False)."""
        shard = self.shards[i]
        assert shard.size is not None
        fetcher = self.fetcher
        try:
            return self.cache.fetch(
                shard.url,
                self.path_of(i),
                shard.size,
                shard.sha256,
                fetcher,
                self.limit,
                wait_for_room=wait,
                locked=True,
                version=shard.validator,
                unpack=self._unpacker(shard),
            )
        except NoRoom:
            return None

    @staticmethod
    def _index_cached(path: str, shard: RemoteShard) -> dict:
        from stoker import _core

        return _core.index_shards([path], [shard.format], 1)[0]

    def _probe(self, shard: RemoteShard, give_up: bool) -> dict:
        """The index of a shard's headers, read with range requests. With `give_up`,
        _WholeIsCheaper once the walk reads more than PROBE_SHARE of what it walks over,
        or once its server turns out to ignore ranges."""
        from stoker import _core

        fetcher = self.fetcher
        size = shard.size
        assert size is not None
        host = host_of(shard.url)
        buffer = {"start": 0, "data": b"", "ahead": PROBE_WINDOW, "read": 0}

        def read(offset: int, length: int) -> bytes:
            start, data = buffer["start"], buffer["data"]
            if start <= offset and offset + length <= start + len(data):
                return data[offset - start : offset + length - start]
            if buffer["read"] and host in fetcher.rangeless:
                raise _WholeIsCheaper  # each read would be the whole body up to it
            walked = min(offset + length, size)
            if give_up and buffer["read"] and buffer["read"] + length > PROBE_SHARE * walked:
                raise _WholeIsCheaper
            ahead = buffer["ahead"]
            if data and offset <= start + len(data) + ahead:  # close behind: a dense walk
                ahead = buffer["ahead"] = min(2 * ahead, PROBE_READ_AHEAD)
            want = min(max(length, ahead), size - offset)
            got = fetcher.call(fetcher.read_range(shard.url, offset, want, shard.validator))
            buffer.update(start=offset, data=got, read=buffer["read"] + len(got))
            return got[:length]

        return _core.index_remote(shard.url, size, shard.format, read, PROBE_WINDOW)

    def _adopt_manifests(self, shards: list[RemoteShard]) -> None:
        """Use the ``stoker.json`` beside the shards, where there is one that lists them:
        one request per folder instead of a look at every shard."""
        from stoker.manifest import MANIFEST_NAME, parse_manifest

        fetcher = self.fetcher
        folders: dict[str, list[RemoteShard]] = {}
        for shard in shards:
            if "?" in shard.url or shard.listed:
                # A signed URL: a manifest beside it would need its own signature. A listed
                # shard: the listing showed whether there is one.
                continue
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
                if getattr(e, "code", None) in AUTH_CODES or getattr(e, "status", None) == 401:
                    # Wrong credentials: said now, of the shard the user named, with no
                    # further request that would fail the same way.
                    what = getattr(e, "detail", str(e))
                    raise located(FetchError, members[0].url, 0, what) from None
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
            version=shard.validator,
            unpack=self._unpacker(shard),
        )

    @staticmethod
    def _unpacker(shard: RemoteShard) -> Unpack | None:
        if shard.unpack is None:
            return None
        from stoker.peers import unpack_bytes

        spec, size, url = shard.unpack, shard.size, shard.url

        def unpack(data: bytes) -> list:
            return unpack_bytes(spec, data, size, url)

        return Unpack(spec.get("bytes"), unpack)

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
    shard.validator = entry.get("etag", shard.validator)
    shard.listed = bool(entry.get("listed", shard.listed))
    if isinstance(entry.get("unpack"), dict):
        shard.unpack = entry["unpack"]
    if isinstance(entry.get("fields"), list):
        shard.fields = [str(f) for f in entry["fields"]]


#: The record that says a host ignores range requests.
_RANGELESS = "no ranges: "


def _version(validator: str | None) -> str | None:
    """An ETag or Last-Modified as compared: a listing and a response may quote an ETag
    differently, or mark it weak."""
    if validator is None:
        return None
    return (validator[2:] if validator.startswith("W/") else validator).strip().strip('"')
