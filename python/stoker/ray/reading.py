"""stoker datasets as a Ray Data source: ``stoker.ray.read(source, fields=...)`` is a Ray
Dataset whose blocks are batches read by stoker's C++ reader, each read task a stretch of
the samples in their natural order (whole shards, but at the stretches' two ends).

The driver opens the dataset once, as a Loader's process would (its member table; remote
shards described, not fetched), and puts it, pickled, in Ray's object store. Read task k of n is a
`stoker.Loader` over it as rank k of n without shuffling: the same batches a Loader of
that rank reads, remote shards fetched into the node cache of the node the task runs on,
with the Loader's prefetch. Its batches become Arrow blocks: tensors as Ray's tensor
columns (numbers as plain columns), `Bytes` values as binary, keys as strings.
"""

from __future__ import annotations

import functools
import os
import pickle
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from stoker.dataset import Dataset
from stoker.dataset.mix import Mix
from stoker.errors import UsageError
from stoker.fields import FieldSpec
from stoker.loader import Loader
from stoker.loader.plan import check_fields_argument
from stoker.loader.sampler import rank_stretch
from stoker.ray.tasks import require_ray
from stoker.remote import FetchOptions
from stoker.sources import Source


def read(
    source: Source | Dataset,
    *,
    fields: Mapping[str, FieldSpec],
    batch_size: int = 256,
    num_threads: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    fetch: FetchOptions | None = None,
    arrays: Sequence[str] | None = None,
    override_num_blocks: int | None = None,
) -> Any:
    """A Ray Dataset of the samples of `source`, read by stoker on the cluster: one row a
    sample, in the source's order, a column per field of `fields` plus ``__key__``.

    Each Ray read task is a `stoker.Loader` (no shuffle) over its own stretch of the
    samples, whole shards but at its ends, and each of its batches is one block: shuffle
    with Ray (``random_shuffle``, ``randomize_block_order``) and split with
    ``streaming_split`` as for any Ray Dataset.

    Args:
        source: Anything `stoker.Dataset` opens (folders, manifests, URLs, Parquet,
            HDF5, ...), or an open Dataset.
        fields: Field name to decoder, as for `stoker.Loader`: `Raw`, `Row`, `Npy`
            and `Image` give tensor columns, `Int` a column of integers, `Bytes` a
            binary column.
        batch_size: Samples per block.
        num_threads: Each read task's reader threads (None: one fewer than its node's
            cores).
        cache_dir: The node cache for remote shards, on every node (default as for
            `stoker.Dataset`).
        fetch: How remote shards are fetched.
        arrays: For HDF5 and Zarr sources, the arrays to read.
        override_num_blocks: Read tasks: default, one a shard (or a group of chunks, for
            an array source), four per CPU of the cluster at most; never more than the
            samples.

    Returns:
        A ``ray.data.Dataset``.

    Raises:
        UsageError: Ray is not installed, `fields` is not a mapping of decoders, or
            `source` is a Mix.
        StokerError: `source` cannot be opened; a task's read error (a corrupt shard,
            named with its offset) is raised where the Ray Dataset is consumed.
    """
    ray = require_ray()
    if not check_fields_argument(fields):
        raise UsageError("stoker.ray.read needs fields=, the fields to read and their decoders")
    if isinstance(source, Mix):
        raise UsageError("stoker.ray.read reads one Dataset, not a Mix: read each, then union")
    if batch_size < 1:
        raise UsageError(f"batch_size is a number of samples, at least 1, not {batch_size}")
    ds = (
        source
        if isinstance(source, Dataset)
        else Dataset(source, cache_dir=cache_dir, fetch=fetch, arrays=arrays)
    )
    # Pickled here, not by Ray: Ray's zero-copy arrays are read-only, and a Dataset's
    # member table is written to as shards are indexed.
    held = ray.put(pickle.dumps(ds, protocol=pickle.HIGHEST_PROTOCOL))
    datasource = _datasource_class()(held, len(ds), dict(fields), batch_size, num_threads)
    if override_num_blocks is None:
        override_num_blocks = default_tasks(ds, ray)
    return ray.data.read_datasource(datasource, override_num_blocks=override_num_blocks)


def default_tasks(ds: Dataset, ray: Any) -> int:
    """A task a shard (or group of chunks), up to four per CPU of the cluster: Ray's own
    default knows no sizes, and cuts a small dataset into hundreds of tasks."""
    groups = int(np.count_nonzero(ds.group_sizes()))
    cpus = int(ray.cluster_resources().get("CPU", 1))
    return max(1, min(groups, 4 * cpus))


def _datasource_class() -> type:
    """The Datasource, defined once Ray is imported (importing this module must not need
    Ray)."""
    from ray.data import Datasource
    from ray.data.block import BlockMetadata
    from ray.data.datasource import ReadTask

    class StokerDatasource(Datasource):
        """Read tasks over stretches of an open Dataset held in the object store."""

        def __init__(
            self,
            dataset: Any,
            samples: int,
            fields: dict[str, FieldSpec],
            batch_size: int,
            num_threads: int | None,
        ) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self.dataset, self.samples, self.fields = dataset, samples, fields
            self.batch_size, self.num_threads = batch_size, num_threads

        def get_name(self) -> str:
            return "stoker"

        def estimate_inmemory_data_size(self) -> int | None:
            return None

        def get_read_tasks(
            self,
            parallelism: int,
            per_task_row_limit: int | None = None,
            data_context: Any = None,
        ) -> list[Any]:
            tasks = max(1, min(int(parallelism), self.samples))
            made = []
            for k in range(tasks):
                begin, end = rank_stretch(self.samples, k, tasks, False)
                rows = max(0, min(end, self.samples) - begin)
                if rows == 0:
                    continue  # a stretch wholly past the end: the others hold every sample
                read_fn = functools.partial(
                    read_stretch,
                    self.dataset,
                    k,
                    tasks,
                    rows,
                    self.fields,
                    self.batch_size,
                    self.num_threads,
                )
                metadata = BlockMetadata(
                    num_rows=rows, size_bytes=None, exec_stats=None, input_files=None
                )
                made.append(ReadTask(read_fn, metadata, per_task_row_limit=per_task_row_limit))
            return made

    return StokerDatasource


def read_stretch(
    dataset: Any,
    rank: int,
    ranks: int,
    rows: int,
    fields: dict[str, FieldSpec],
    batch_size: int,
    num_threads: int | None,
) -> Iterator[Any]:
    """The blocks of read task `rank` of `ranks`: its Loader's batches, the first `rows`
    samples of them (past those, the last stretch wraps around to the start)."""
    import ray
    from ray.data.block import BlockAccessor

    ds = pickle.loads(ray.get(dataset))
    loader = Loader(
        ds,
        batch_size,
        shuffle=False,
        rank=rank,
        world_size=ranks,
        fields=fields,
        num_threads=num_threads,
    )
    left = rows
    for batch in loader:
        n = min(left, len(batch["__key__"]))
        yield BlockAccessor.batch_to_block({name: _column(v, n) for name, v in batch.items()})
        left -= n
        if left == 0:
            break


def _column(values: Any, n: int) -> np.ndarray:
    """The first `n` of a batch entry as a column Ray takes: tensors as numpy arrays (Ray
    makes one of more than one axis a tensor column), bytes as Python bytes, keys as str."""
    if isinstance(values, list):
        first = values[0] if values else None
        if isinstance(first, np.ndarray) and first.dtype == np.uint8 and first.ndim == 1:
            return np.array([v.tobytes() for v in values[:n]], dtype=object)
        if isinstance(first, str):
            return np.array(values[:n], dtype=object)
        out = np.empty(n, dtype=object)  # variable-length typed arrays, one per sample
        out[:] = [np.asarray(v) for v in values[:n]]
        return out
    return values[:n].numpy() if hasattr(values, "numpy") else np.asarray(values[:n])
