"""Remote shards: fetched whole over HTTP (:mod:`.http`) into a node-local cache shared by
every process on the node (:mod:`.cache`), one dataset's view of them in :mod:`.shards`."""

from stoker.remote.cache import Hold, NoRoom, ShardCache, cache_for, cache_name
from stoker.remote.http import Fetcher, FetchOptions, fetcher_for
from stoker.remote.shards import RemoteShard, RemoteShards, apply_entry

__all__ = [
    "FetchOptions",
    "Fetcher",
    "Hold",
    "NoRoom",
    "RemoteShard",
    "RemoteShards",
    "ShardCache",
    "apply_entry",
    "cache_for",
    "cache_name",
    "fetcher_for",
]
