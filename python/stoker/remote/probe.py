"""A look into a remote shard that no manifest describes: its headers walked with range
requests, the few bytes the indexer asks for read ahead, until reading on would cost more
than downloading the shard whole."""

from __future__ import annotations

from typing import TypedDict

import stoker._core as _core
from stoker.remote.http import Fetcher
from stoker.remote.shard import RemoteShard
from stoker.remote.sparse import remember_footer
from stoker.remote.transport import host_of
from stoker.tables import remote_table_index

#: The first read of a probe. Reads that follow each other closely (small members) double
#: the read-ahead, up to PROBE_READ_AHEAD, so a dense walk takes few requests.
PROBE_WINDOW = 16 * 1024
PROBE_READ_AHEAD = 4 << 20
#: A probe that has read, or is about to read, more than this share of the bytes it has
#: walked over stops; the shard is downloaded whole instead, where the cache has room.
PROBE_SHARE = 1 / 8


class _ReadAhead(TypedDict):
    """What a probe has read: the bytes held, from `start`; the next read-ahead; the bytes
    read in all."""

    start: int
    data: bytes
    ahead: int
    read: int


class WholeIsCheaper(Exception):
    """A probe stopped: downloading the shard costs less than walking on."""


def probe_index(shard: RemoteShard, fetcher: Fetcher, give_up: bool) -> dict:
    """The index of a shard's headers, read with range requests. With `give_up`,
    WholeIsCheaper once the walk reads more than PROBE_SHARE of what it walks over, or
    once its server turns out to ignore ranges."""
    size = shard.size
    assert size is not None
    host = host_of(shard.url)
    buffer: _ReadAhead = {"start": 0, "data": b"", "ahead": PROBE_WINDOW, "read": 0}

    def read(offset: int, length: int) -> bytes:
        start, data = buffer["start"], buffer["data"]
        if start <= offset and offset + length <= start + len(data):
            return data[offset - start : offset + length - start]
        if buffer["read"] and host in fetcher.rangeless:
            raise WholeIsCheaper  # each read would be the whole body up to it
        walked = min(offset + length, size)
        if give_up and buffer["read"] and buffer["read"] + length > PROBE_SHARE * walked:
            raise WholeIsCheaper
        ahead = buffer["ahead"]
        if data and offset <= start + len(data) + ahead:  # close behind: a dense walk
            ahead = buffer["ahead"] = min(2 * ahead, PROBE_READ_AHEAD)
        want = min(max(length, ahead), size - offset)
        got = fetcher.call(fetcher.read_range(shard.url, offset, want, shard.validator))
        buffer.update({"start": offset, "data": got, "read": buffer["read"] + len(got)})
        return got[:length]

    if shard.format == "arrow":  # its metadata is spread through it: read it whole
        raise WholeIsCheaper
    if shard.format == "parquet":  # the footer says it all: one or two range reads
        pieces: dict[int, bytes] = {}

        def kept(offset: int, length: int) -> bytes:
            pieces[offset] = read(offset, length)
            return pieces[offset]

        index = remote_table_index(shard.url, size, kept)
        remember_footer(shard.url, size, shard.validator, pieces)  # for its fetch
        return index
    return _core.index_remote(shard.url, size, shard.format, read, PROBE_WINDOW)
