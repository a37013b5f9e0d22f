"""Learning what no manifest said of a dataset's remote shards: from a manifest beside
them, else a look at each (size, version), then their samples and fields from what the
node remembers, else by looking into each once per node."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

from stoker._process import DaemonPool, wait_result
from stoker.errors import FetchError, ShardFormatError, located
from stoker.formats import samples_and_fields
from stoker.manifest import MANIFEST_NAME, parse_manifest
from stoker.remote.cache import Hold, NoRoom, ShardCache
from stoker.remote.fetching import download, index_copy
from stoker.remote.http import Fetcher, comparable_version
from stoker.remote.names import cache_name
from stoker.remote.probe import WholeIsCheaper, probe_index
from stoker.remote.shard import RemoteShard, apply_entry
from stoker.remote.stores import AUTH_CODES, is_object_url
from stoker.remote.transport import host_of

log = logging.getLogger("stoker.remote")

#: A shard this small is downloaded whole, where the cache has room for it, rather than
#: probed: a probe would read a good share of it, and read it again when it is fetched.
SMALL_SHARD = 256 * 1024
#: The record that says a host ignores range requests.
_RANGELESS = "no ranges: "
_CHANGED = "the shard changed on the server while a process reads its cached copy"


def adopt_manifests(shards: list[RemoteShard], fetcher: Fetcher) -> None:
    """Use the ``stoker.json`` beside the shards, where there is one that lists them:
    one request per folder instead of a look at every shard."""
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


def name_shards(shards: list[RemoteShard], fetcher: Fetcher) -> None:
    """Where each shard lives under the cache root, and that a store's shards take ranges."""
    for shard in shards:
        if not shard.name:  # (a second call, after a swap: named already)
            shard.name = cache_name(fetcher.cache_url(shard.url), shard.sha256)
        if is_object_url(shard.url) and shard.ranges is None:
            shard.ranges = True  # every store takes ranges


class ShardDescriber:
    """Describes shards cached in `cache` (of `limit` bytes at most), on `pool`."""

    def __init__(
        self,
        cache: ShardCache,
        fetcher: Fetcher,
        limit: int,
        pool: DaemonPool,
    ) -> None:
        self.cache = cache
        self.fetcher = fetcher
        self.limit = limit
        self.pool = pool

    def describe(
        self, shards: list[RemoteShard], missing: list[RemoteShard], only: Sequence[int] | None
    ) -> None:
        """The size of each of `missing` (of `shards`), then the samples of each shard that
        has none, or of those of them numbered in `only`."""
        cache, fetcher = self.cache, self.fetcher
        for host in {host_of(s.url) for s in missing}:
            if cache.records.read(_RANGELESS + host) is not None:
                fetcher.rangeless.add(host)
        # First a look at each (size, version), so that what is remembered can be
        # checked and whether the whole dataset fits in the cache is known.
        looks = [s for s in missing if s.size is None or s.validator is None]
        for future in [self.pool.submit(functools.partial(self._look, s)) for s in looks]:
            wait_result(future)
        for host in fetcher.rangeless - {host_of(s.url) for s in missing if s.ranges}:
            cache.records.write(_RANGELESS + host, {"ranges": False})
        fits = sum(s.size or 0 for s in shards) <= self.limit
        todo = [i for i, s in enumerate(shards) if s.samples is None]
        if only is not None:
            todo = sorted(set(todo) & {int(i) for i in only})
        futures = [
            self.pool.submit(functools.partial(self._describe_one, shards[i], fits)) for i in todo
        ]
        for future in futures:
            wait_result(future)

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

    def _describe_one(self, shard: RemoteShard, fits: bool) -> None:
        """Samples and fields of `shard`: remembered by this node (for this size and
        version of it), else indexed from its copy in the cache, else looked into, once
        per node (under its lock, so others wait and then read the record)."""
        cache = self.cache
        key = self.fetcher.cache_url(shard.url)
        if _remembered(shard, cache.records.read(key)):
            return
        path = cache.path_of(shard.name)
        with cache.shard_lock(path, shard.url):
            record = cache.records.read(key)
            if _remembered(shard, record):
                return
            if record is not None and not cache.evict(path):  # the object changed
                raise located(FetchError, shard.url, 0, _CHANGED)
            assert shard.size is not None
            version = comparable_version(shard.validator)
            hold = cache.hold(path, shard.size)
            if hold is not None and comparable_version(cache.records.copy_version(path)) != version:
                # A copy of another (or an unknown) version of the object: not this one.
                cache.release(path)
                hold = None
                if not cache.evict(path):
                    raise located(FetchError, shard.url, 0, _CHANGED)
            index = self._index(shard, hold, fits)
            shard.samples, shard.fields = samples_and_fields(index, shard.format)
            cache.records.write(
                key,
                {
                    "bytes": shard.size,
                    "version": version,
                    "format": shard.format,
                    "samples": shard.samples,
                    "fields": shard.fields,
                },
            )

    def _index(self, shard: RemoteShard, hold: Hold | None, fits: bool) -> dict:
        """The index of `shard`, for a caller that holds its lock (and `hold`, its copy in
        the cache, if there is one: let go of here). A shard whose probe would read a
        good share of it (small, or small members), or whose server ignores ranges, is
        downloaded whole instead, where the cache has room, and indexed locally: its
        bytes then cross the network once."""
        assert shard.size is not None
        rangeless = self.fetcher.rangeless
        try:
            small = shard.size <= SMALL_SHARD or shard.ranges is None
            ignores_ranges = host_of(shard.url) in rangeless
            if hold is None and (ignores_ranges or (fits and small)):
                hold = self._download_now(shard, wait=ignores_ranges)
            if hold is None:
                try:
                    return probe_index(shard, self.fetcher, give_up=fits)
                except WholeIsCheaper:
                    hold = self._download_now(shard, wait=host_of(shard.url) in rangeless)
                    if hold is None:  # no room now: walk on (it gives up only if the
                        try:  # server turned out to ignore ranges: then wait for room)
                            return probe_index(shard, self.fetcher, give_up=False)
                        except WholeIsCheaper:
                            hold = self._download_now(shard, wait=True)
            assert hold is not None  # (waiting for room, it comes or the wait fails)
            return index_copy(hold.path, shard.format)
        finally:
            if hold is not None:
                self.cache.release(hold.path)

    def _download_now(self, shard: RemoteShard, wait: bool) -> Hold | None:
        """`shard` downloaded into the cache and held, for a caller that holds its lock;
        None if the cache has no room now (and `wait` is False)."""
        try:
            return download(shard.request(wait_for_room=wait), self.cache, self.fetcher, self.limit)
        except NoRoom:
            return None


def _remembered(shard: RemoteShard, record: dict | None) -> bool:
    """Take samples and fields from `record` if it is of this size and version of the
    shard."""
    if (
        record is None
        or record.get("bytes") != shard.size
        or record.get("version") != comparable_version(shard.validator)
        or record.get("format") != shard.format
        or not isinstance(record.get("samples"), int)
    ):
        return False
    shard.samples = record["samples"]
    fields = record.get("fields")
    shard.fields = [str(f) for f in fields] if isinstance(fields, list) else None
    return True
