"""stoker on Ray, the optional extra ``stoker[ray]``: preparing data past one machine on
Ray Data, and stoker datasets as a Ray Data source.

- :func:`write_shards`: stoker tar shards and their ``stoker.json`` written from any Ray
  Dataset, each write task its own shards, the manifest last and only once every task
  succeeded.
- ``stoker pack SRC OUT --ray [ADDRESS]`` (:mod:`.packing`): a pack's shards written by
  Ray tasks, the same shards as a pack on one machine.
- :func:`read`: a Ray Dataset whose blocks are batches stoker's reader read, each read
  task its own shards.

Ray is imported when one of them runs, not with this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stoker.ray.reading import read
    from stoker.ray.writing import write_shards

__all__ = ["read", "write_shards"]


def __getattr__(name: str) -> Any:
    # (stoker.ray.writing imports stoker's packing tools: not paid for by a reader)
    if name == "read":
        from stoker.ray.reading import read

        return read
    if name == "write_shards":
        from stoker.ray.writing import write_shards

        return write_shards
    raise AttributeError(f"module 'stoker.ray' has no attribute {name!r}")
