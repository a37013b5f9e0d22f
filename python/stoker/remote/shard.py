"""One remote shard: its URL and what is known of it (from a manifest, a listing, a look
at it, or what the node remembers), and the request that fetches it into the cache."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from stoker.remote.fetching import FetchRequest, IndexStep


@dataclass
class RemoteShard:
    """A shard at `url`, of shard format `format`, and what is known of it so far."""

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
    # the cache (stoker.unpack.unpack_bytes; "bytes": its compressed size, where known).
    unpack: dict | None = None

    def request(
        self,
        priority: tuple[int, int] = (0, 0),
        wait_for_room: bool = True,
        progress: Callable[[int], None] | None = None,
        index: IndexStep | None = None,
        columns: frozenset[str] | None = None,
    ) -> FetchRequest:
        """What fetching this shard into the cache asks, once its size and name are known
        (see RemoteShards.describe); of a Parquet file, the fields `columns` only, where
        given (None: all of it)."""
        assert self.size is not None
        return FetchRequest(
            self.url,
            self.name,
            self.size,
            self.sha256,
            self.validator,
            self.unpack,
            priority,
            wait_for_room,
            progress,
            index,
            self.format,
            columns if self.format == "parquet" else None,
        )


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
