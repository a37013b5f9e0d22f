"""Remote Parquet files cached in part: a loader that asks for some columns fetches their
column chunks, the offset index and the footer by range requests, into a file as long as
the whole one at the same offsets, so the reader reads it as it would the whole file. A
10 GB text column is never fetched for a loader that asks only for images.

A copy in part is told from a whole one by its first four bytes, never fetched (zero, not
``PAR1``): a record of its ranges that is lost cannot make it pass for whole. The node
records which ranges it holds (:meth:`NodeRecords.copy_ranges`); one that asks for more
columns later fetches what is lacking into the same file, under the shard's lock, its
identity (inode, size, mtime) unchanged for the readers that hold it, who never read
those bytes. Every range is checked to be of the version of the object the copy is of.

Fetched whole instead, as other shards are, where that is cheaper or where only a whole
copy can be checked: a file under WHOLE_BELOW, one of whose bytes the columns need
WHOLE_SHARE or more, a server that ignores ranges, an object with no version to pin the
ranges to, and a file a manifest gives a sha256 of (it covers the whole file).
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import TYPE_CHECKING

from stoker.errors import FetchError, located
from stoker.remote.cache import Hold, ShardCache
from stoker.remote.http import Fetcher, write_all_at
from stoker.remote.transport import host_of
from stoker.tables.parquet import column_byte_ranges, read_footer

if TYPE_CHECKING:
    from stoker.remote.fetching import FetchRequest

#: Wanted ranges closer than this are fetched as one: a request costs more than the bytes
#: between (and less than a column chunk of another column, at the sizes writers use).
RANGE_GAP = 256 * 1024
#: A file whose wanted ranges come to this share of it is fetched whole.
WHOLE_SHARE = 0.75
#: A file this small is fetched whole: one request beats several.
WHOLE_BELOW = 1 << 20
#: Bytes of footers read when datasets opened kept for the fetches that follow in this
#: process, so that a file's footer crosses the network once, not twice.
FOOTERS_KEPT = 32 << 20

_footers: collections.OrderedDict[tuple[str, int, str | None], dict[int, bytes]] = (
    collections.OrderedDict()
)
_footers_lock = threading.Lock()

_MAGIC = b"PAR1"

Ranges = list[tuple[int, int]]


def coalesce(ranges: Ranges, gap: int = 0) -> Ranges:
    """`ranges` (start, end) sorted, those that overlap or lie within `gap` bytes of each
    other joined."""
    out: Ranges = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if out and start <= out[-1][1] + gap:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def lacking(needed: Ranges, present: Ranges) -> Ranges:
    """The parts of `needed` that `present` does not cover."""
    out: Ranges = []
    have = coalesce(present)
    for start, end in coalesce(needed):
        at = start
        for a, b in have:
            if b <= at or a >= end:
                continue
            if a > at:
                out.append((at, a))
            at = max(at, b)
        if at < end:
            out.append((at, end))
    return out


def in_part(fd: int) -> bool:
    """Whether the cached Parquet file open as `fd` is a copy in part."""
    return os.pread(fd, len(_MAGIC), 0) != _MAGIC


def remember_footer(url: str, size: int, version: str | None, pieces: dict[int, bytes]) -> None:
    """The bytes (by offset) read of a remote Parquet file's end when its dataset opened,
    kept for plan_copy (the least recently kept go first, past FOOTERS_KEPT)."""
    with _footers_lock:
        _footers[(url, size, version)] = pieces
        _footers.move_to_end((url, size, version))
        kept = sum(len(d) for p in _footers.values() for d in p.values())
        while kept > FOOTERS_KEPT and len(_footers) > 1:
            _, gone = _footers.popitem(last=False)
            kept -= sum(len(d) for d in gone.values())


def _kept_bytes(url: str, size: int, version: str | None, offset: int, length: int) -> bytes | None:
    with _footers_lock:
        for at, data in _footers.get((url, size, version), {}).items():
            if at <= offset and offset + length <= at + len(data):
                return data[offset - at : offset - at + length]
    return None


def plan_copy(request: FetchRequest, fetcher: Fetcher) -> tuple[Ranges, dict[int, bytes]] | None:
    """The ranges to fetch of the Parquet file `request` names, for its columns, and the
    bytes reading its footer got (by offset); None where a whole copy is to be fetched."""
    url, size = request.url, request.size
    if (
        request.columns is None
        or request.sha256 is not None
        or request.unpack is not None
        or request.version is None
        or size < WHOLE_BELOW
        or host_of(url) in fetcher.rangeless
    ):
        return None
    got: dict[int, bytes] = {}

    def read(offset: int, length: int) -> bytes:
        data = _kept_bytes(url, size, request.version, offset, length)
        if data is None:
            data = fetcher.call(fetcher.read_range(url, offset, length, request.version))
        got[offset] = data
        return data

    meta = read_footer(url, read, size, tail=8)  # (just the footer: see parquet_footer)
    if host_of(url) in fetcher.rangeless:  # found out reading the footer
        return None
    needed = coalesce(column_byte_ranges(url, meta, request.columns), RANGE_GAP)
    if sum(b - a for a, b in needed) >= WHOLE_SHARE * size:
        return None
    return needed, got


def fetch_in_part(
    request: FetchRequest,
    plan: tuple[Ranges, dict[int, bytes]],
    cache: ShardCache,
    fetcher: Fetcher,
    limit: int,
) -> Hold:
    """The copy in part of `plan` (see plan_copy) fetched into the cache, placed and held,
    for a caller that holds the shard's lock and found no copy."""
    ranges, got = plan
    path = cache.path_of(request.name)
    wait = fetcher.options.cache_wait
    with cache.reserved(
        path, request.size, limit, request.url, wait, request.wait_for_room, ranges
    ) as room:
        pieces = [(offset, offset + len(data)) for offset, data in got.items() if offset > 0]
        for offset, data in got.items():
            if offset > 0:  # (the magic stays unwritten: see the module's words)
                write_all_at(room.fd, data, offset)
        todo = lacking(ranges, pieces)
        fetcher.call(
            fetcher.download_ranges(
                request.url,
                room.fd,
                todo,
                request.size,
                request.version,
                request.progress,
                request.priority,
            )
        )
        cache.records.remember_copy(path, request.version, coalesce(ranges + pieces))
        return cache.place(room, wait)


def has_all(hold: Hold, request: FetchRequest, cache: ShardCache) -> bool:
    """Whether the copy `hold` holds has every byte `request` reads: a whole copy, or a
    copy in part that holds its columns' ranges (all of them for a request of no
    columns)."""
    if request.format != "parquet":
        return True
    if not in_part(hold.fd):
        return True
    present = cache.records.copy_ranges(hold.path)
    return present is not None and not lacking(_needed(request, hold.path), present)


def complete(
    hold: Hold, request: FetchRequest, cache: ShardCache, fetcher: Fetcher, limit: int
) -> Hold | None:
    """`hold`, the copy of `request`'s file, with what `request` reads and it lacks
    fetched into it, for a caller that holds the shard's lock; None where the copy had
    to go (a copy in part whose record is lost): the caller fetches it anew. On an
    error, `hold` is let go of."""
    path = hold.path
    try:
        if has_all(hold, request, cache):
            return hold
        present = cache.records.copy_ranges(path)
        if present is not None:
            _grow(hold, present, request, cache, fetcher, limit)
            return hold
    except BaseException:
        cache.release(path)
        raise
    if cache.release(path) and cache.evict(path):
        return None
    raise located(
        FetchError,
        request.url,
        0,
        f"the node's record of what the cached part-copy {path} holds is lost, and another "
        "thread or process reads it: it is fetched anew once they let it go",
    )


def _grow(
    hold: Hold,
    present: Ranges,
    request: FetchRequest,
    cache: ShardCache,
    fetcher: Fetcher,
    limit: int,
) -> None:
    """What `request` reads and the copy in part `hold` (which holds `present`) lacks,
    fetched into it."""
    path, url = hold.path, request.url
    version = cache.records.copy_version(path)  # what is added must be of the same version
    todo = coalesce(lacking(_needed(request, path), present), RANGE_GAP)
    mtime = hold.identity[2]
    fd = cache.grow(path, todo, limit, url, fetcher.options.cache_wait)
    try:
        fetcher.call(
            fetcher.download_ranges(
                url, fd, todo, request.size, version, request.progress, request.priority
            )
        )
        os.fsync(fd)
        os.utime(fd, ns=(time.time_ns(), mtime))  # (mtime is in the identity reads check)
    finally:
        os.close(fd)
    cache.records.remember_copy(path, version, coalesce(present + todo))


def _needed(request: FetchRequest, path: str) -> Ranges:
    """What of the file cached at `path` `request` reads: its columns' ranges (read from
    the copy's own footer), or all of it."""
    if request.columns is None:
        return [(0, request.size)]
    meta = read_footer(path)
    return column_byte_ranges(path, meta, request.columns)
