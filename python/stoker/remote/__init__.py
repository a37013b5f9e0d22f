"""Remote shards: fetched whole over HTTP (:mod:`.http`, on :mod:`.transport`) into a
node-local cache shared by every process on the node (:mod:`.cache`), in the steps of
:mod:`.fetching`, or, for a Parquet file a loader reads some columns of, in part
(:mod:`.sparse`); one dataset's view of them in :mod:`.shards`."""

from stoker.remote.cache import Hold, NoRoom, ShardCache, cache_for
from stoker.remote.fetching import Arrival, FetchRequest, IndexStep, index_copy
from stoker.remote.http import Fetcher, fetcher_for
from stoker.remote.names import cache_name
from stoker.remote.options import FetchOptions
from stoker.remote.shard import RemoteShard, apply_entry
from stoker.remote.shards import RemoteShards

__all__ = [
    "Arrival",
    "FetchOptions",
    "FetchRequest",
    "Fetcher",
    "Hold",
    "IndexStep",
    "NoRoom",
    "RemoteShard",
    "RemoteShards",
    "ShardCache",
    "apply_entry",
    "cache_for",
    "cache_name",
    "fetcher_for",
    "index_copy",
]
