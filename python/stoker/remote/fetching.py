"""A shard's way into the node cache, in steps: fetch it (its length and sha256 verified
as it streams), or fetch it compressed, verify the writer's hashes and unpack it; place
it in the cache, held; index the copy that arrived, where the caller asks. The cache
(:mod:`.cache`) only locks, places and evicts; what is fetched is a FetchRequest.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import stoker._core as _core
from stoker.errors import FetchError, located
from stoker.formats import TABLE_SOURCES
from stoker.remote import sparse
from stoker.remote.cache import Hold, Reservation, ShardCache
from stoker.remote.http import Fetcher, write_all_at
from stoker.tables import index_table_source
from stoker.unpack import check_hashes, unpack_bytes


@dataclass(frozen=True)
class IndexStep:
    """The step after a shard arrived: its member index, in `format` (a shard format's
    name), unless the copy held is `unless_copy` (inode, size, mtime_ns), whose index the
    caller has already (a cached file changes only by a new download)."""

    format: str
    unless_copy: tuple[int, ...] | None = None


@dataclass(frozen=True)
class FetchRequest:
    """What fetching one shard into the cache asks.

    `url` is the shard (or, with `unpack`, the shard compressed as a whole: the peer
    index's spec of its compression, see stoker.unpack.unpack_bytes); it is `size` bytes
    as cached, named `name` under the cache root. `sha256` is checked where known;
    `version` is the object's ETag or Last-Modified when it was looked at (see
    Fetcher.download). A download waiting for a connection goes before those of higher
    `priority`; without `wait_for_room`, NoRoom when the cache is full. `progress` is told
    the bytes as they come; `index`, what to do once the shard is held. `format` is the
    shard's; of a Parquet file, only the fields `columns` may be fetched (see
    stoker.remote.sparse), and None asks for the whole file."""

    url: str
    name: str
    size: int
    sha256: str | None = None
    version: str | None = None
    unpack: Mapping[str, Any] | None = None
    priority: tuple[int, int] = (0, 0)
    wait_for_room: bool = True
    progress: Callable[[int], None] | None = None
    index: IndexStep | None = None
    format: str = ""
    columns: frozenset[str] | None = None


class Arrival(NamedTuple):
    """A shard fetched and held, and its index where the request's IndexStep made one."""

    hold: Hold
    # The field's name shadows tuple.index (mypy's complaint), a method no caller uses.
    index: dict | None  # type: ignore[assignment]


def hold_shard(request: FetchRequest, cache: ShardCache, fetcher: Fetcher, limit: int) -> Hold:
    """Hold the shard `request` names, downloading it if no one has: one download per
    node; whoever else wants it waits for that one (for as long as its process lives: the
    lock dies with it). `limit`: the bytes the cache may hold."""
    path = cache.path_of(request.name)
    hold = cache.hold(path, request.size)
    if hold is not None and sparse.has_all(hold, request, cache):
        return hold
    with cache.shard_lock(path, request.url):  # a download in flight: wait for it, then look
        if hold is None:
            hold = cache.hold(path, request.size)
        if hold is not None:
            hold = sparse.complete(hold, request, cache, fetcher, limit)
            if hold is not None:
                return hold
        return download(request, cache, fetcher, limit)


def download(request: FetchRequest, cache: ShardCache, fetcher: Fetcher, limit: int) -> Hold:
    """hold_shard for a caller that holds the shard's lock (see ShardCache.shard_lock) and
    found no copy: the shard downloaded into the cache, placed and held."""
    path = cache.path_of(request.name)
    in_part = sparse.plan_copy(request, fetcher)
    if in_part is not None:
        return sparse.fetch_in_part(request, in_part, cache, fetcher, limit)
    wait = fetcher.options.cache_wait
    with cache.reserved(
        path, request.size, limit, request.url, wait, request.wait_for_room
    ) as room:
        if request.unpack is None:
            version = _fetch(request, room.fd, fetcher)
        else:
            version = _fetch_unpacked(request, room, fetcher)
        if request.sha256 is None:  # (with a sha256, the cache name says which copy it is)
            cache.records.remember_copy(path, version)
        return cache.place(room, wait)


def arrive(request: FetchRequest, cache: ShardCache, fetcher: Fetcher, limit: int) -> Arrival:
    """hold_shard, then the request's IndexStep; on an error after the shard is held, the
    hold is let go of."""
    hold = hold_shard(request, cache, fetcher, limit)
    step = request.index
    if step is None or hold.identity == step.unless_copy:
        return Arrival(hold, None)
    try:
        return Arrival(hold, index_copy(hold.path, step.format))
    except BaseException:
        cache.release(hold.path)
        raise


def index_copy(path: str, shard_format: str) -> dict:
    """The member index of the shard cached at `path`, read as `shard_format`."""
    if shard_format in TABLE_SOURCES:
        return index_table_source(path, shard_format)
    return _core.index_shards([path], [shard_format], 1)[0]


# -- the steps -------------------------------------------------------------------------


def _fetch(request: FetchRequest, fd: int, fetcher: Fetcher) -> str | None:
    """The shard's bytes written into `fd`, their length and sha256 checked; what
    identifies the version written."""
    return fetcher.call(
        fetcher.download(
            request.url,
            fd,
            request.size,
            request.sha256,
            request.progress,
            request.priority,
            request.version,
        )
    )


def _fetch_unpacked(request: FetchRequest, room: Reservation, fetcher: Fetcher) -> str | None:
    """The shard fetched compressed, its hashes verified, unpacked into `room`."""
    assert request.unpack is not None
    data, version = _fetch_packed(request, room.part + ".packed", fetcher)
    check_hashes(data, request.unpack.get("hashes") or {}, request.url)
    _write_parts(room.fd, unpack_bytes(request.unpack, data, request.size, request.url))
    return version


def _fetch_packed(request: FetchRequest, packed: str, fetcher: Fetcher) -> tuple[bytes, str | None]:
    """The compressed shard, fetched through the file `packed` (beside the partial shard,
    outside the cache's accounting: it lives only while this runs), and its version."""
    assert request.unpack is not None
    packed_size = request.unpack.get("bytes")
    if packed_size is None:
        packed_size = fetcher.call(fetcher.stat(request.url)).size
    fd = os.open(packed, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        version = fetcher.call(
            fetcher.download(
                request.url, fd, packed_size, None, None, request.priority, request.version
            )
        )
        data = bytearray()
        while len(data) < packed_size:
            piece = os.pread(fd, min(packed_size - len(data), 1 << 30), len(data))
            if not piece:
                raise located(FetchError, request.url, len(data), f"{packed} ends early")
            data += piece
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(packed)
    return bytes(data), version


def _write_parts(fd: int, parts: Iterable[bytes | memoryview]) -> None:
    at = 0
    for part in parts:
        view = memoryview(part).cast("B")
        write_all_at(fd, view, at)
        at += len(view)
