"""stoker tar shards written from any Ray Dataset (``read_images``, ``read_parquet``,
``read_webdataset``, ``from_items``), each Ray write task writing whole shards of its own
blocks, the manifest written by the driver last, once every task has succeeded.

A task writes its shards with a :class:`stoker.ShardWriter` into a folder of its own (a
hidden one inside a shared output folder; a local temporary one for an ``s3://`` prefix),
then puts each finished shard (and its member index) at its name,
``PREFIX-TTTTTT-SSSSSS.tar`` (T: the write task's number, S: the shard's in the task): a
rename in the folder, one PUT to the store, either of which shows a reader the whole shard
or nothing. It returns their manifest entries. Ray runs a task again when its worker dies;
the new run writes the same names. The manifest lists what the tasks that succeeded
returned: shards left by an earlier run that are not among them are removed first. A job
that dies before the end writes no ``stoker.json``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from typing import Any

import numpy as np

from stoker import _core
from stoker.errors import StokerError, UsageError
from stoker.formats import is_url
from stoker.manifest import MANIFEST_NAME
from stoker.outputs import Folder, Prefix, is_shard_name, refuse_unless_free, remove_stale
from stoker.ray.tasks import KILL_ONCE_ENV, die_once, require_ray
from stoker.remote import FetchOptions
from stoker.remote.stores import STORE_SCHEMES
from stoker.tools.pack import ImageResize, shrink_images
from stoker.writer import ShardWriter


def write_shards(
    dataset: Any,
    out: str | os.PathLike[str],
    *,
    max_bytes: int | None = None,
    max_samples: int | None = None,
    image_size: int | None = None,
    quality: int = 90,
    stratify_by: str | None = None,
    prefix: str = "shard",
    fetch: FetchOptions | None = None,
    ray_remote_args: dict[str, Any] | None = None,
) -> str:
    """Write the rows of the Ray Dataset `dataset` as stoker tar shards and a
    ``stoker.json`` in `out`, on the cluster.

    A row's ``__key__`` column names its sample (as in WebDataset and Ray's
    ``read_webdataset``); without one, keys are ``TTTTTTRRRRRRRRR``, the write task's
    number and the row's in the task, in the input's order. Every other column is a field,
    encoded as :class:`stoker.ShardWriter` encodes values (bytes as they are, text as
    UTF-8, numbers as ASCII, arrays as ``.npy``): name JPEG bytes' column ``jpg``.

    Args:
        dataset: A ``ray.data.Dataset``.
        out: A folder every node sees (a shared file system), or an ``s3://`` or
            ``gs://`` prefix: new, empty, or what a run of the same write that failed
            left (its shards are replaced).
        max_bytes: Start a new shard before one would pass this many bytes (default,
            when neither limit is given: 256 MiB).
        max_samples: Start a new shard once one holds this many samples.
        image_size: Re-encode JPEG values so that their shorter side is at most this many
            pixels, at `quality`, on stoker's C++ threads, as ``stoker pack --image-size``.
        stratify_by: A column of labels: each task deals its samples over its shards so
            that each label is spread evenly among them.
        prefix: The shards' names start with it.
        fetch: For an ``s3://`` or ``gs://`` `out`: the store's settings (endpoint,
            region, profile); each node signs with the credentials it finds itself.
        ray_remote_args: Given to Ray for the write tasks (``num_cpus``, ``memory``,
            ``runtime_env``...).

    Returns:
        The path (or URL) of the manifest.

    Raises:
        UsageError: Ray is not installed, or a limit is less than 1.
        StokerError: `out` holds a finished dataset, or other files.
    """
    ray = require_ray()
    if image_size is not None and image_size < 1:
        raise UsageError(f"image_size is a number of pixels, at least 1, not {image_size}")
    where = os.fspath(out)
    if is_url(where) and not where.startswith(STORE_SCHEMES):
        raise UsageError(f"{where}: write_shards writes to a folder or an s3:// or gs:// prefix")
    target = Prefix(where, fetch or FetchOptions()) if is_url(where) else Folder(where)
    sink = _sink_class()(
        target,
        max_bytes,
        max_samples,
        image_size,
        quality,
        stratify_by,
        prefix,
    )
    context = ray.data.DataContext.get_current()
    ordered = context.execution_options.preserve_order
    context.execution_options.preserve_order = True  # task numbers follow the input
    try:
        dataset.write_datasink(sink, ray_remote_args=ray_remote_args)
    finally:
        context.execution_options.preserve_order = ordered
    return target.path_of(MANIFEST_NAME)


def _sink_class() -> type:
    """The Datasink, defined once Ray is imported (importing this module must not need
    Ray)."""
    from ray.data import Datasink

    class ShardSink(Datasink):
        def __init__(
            self,
            out: Folder | Prefix,
            max_bytes: int | None,
            max_samples: int | None,
            image_size: int | None,
            quality: int,
            stratify_by: str | None,
            prefix: str,
        ) -> None:
            if max_samples is not None and max_samples < 1:
                raise UsageError(f"max_samples must be at least 1, not {max_samples}")
            if max_bytes is not None and max_bytes < 1:
                raise UsageError(f"max_bytes must be at least 1, not {max_bytes}")
            self.out = out
            self.max_bytes, self.max_samples = max_bytes, max_samples
            self.image_size, self.quality = image_size, quality
            self.stratify_by, self.prefix = stratify_by, prefix
            self.kill_once = os.environ.get(KILL_ONCE_ENV)  # (see stoker.ray.tasks)

        def get_name(self) -> str:
            return "StokerShards"

        def on_write_start(self, schema: Any = None) -> None:
            refuse_unless_free(self.out, lambda name: is_shard_name(name, self.prefix))

        def write(self, blocks: Iterable[Any], ctx: Any) -> list[dict]:
            from ray.data.block import BlockAccessor

            task = int(ctx.task_idx)
            folder = self.out.task_folder(task)
            resize = ImageResize(self.image_size, self.quality) if self.image_size else None
            writer = ShardWriter(
                folder,
                max_samples=self.max_samples,
                max_bytes=self.max_bytes,
                stratify_by=self.stratify_by,
                prefix=f"{self.prefix}-{task:06d}",
            )
            try:
                with writer:
                    row = 0
                    for block in blocks:
                        samples = []
                        rows: Iterable[Any] = BlockAccessor.for_block(block).iter_rows(True)
                        for values in rows:
                            sample = dict(values)
                            if "__key__" not in sample:
                                sample["__key__"] = f"{task:06d}{row:09d}"
                            samples.append(sample)
                            row += 1
                        if resize is not None:
                            _shrink(samples, resize, self.out.out)
                        for sample in samples:
                            writer.write(sample)
                        if self.kill_once and die_once(self.kill_once):
                            os._exit(1)  # the worker dies mid-write, a shard begun
                if not writer.samples:
                    return []
                with open(os.path.join(folder, MANIFEST_NAME), encoding="utf-8") as f:
                    entries = json.load(f)["shards"]
                for entry in entries:  # (the index first: a shard is never seen without it)
                    for name in (entry["path"] + _core.SIDECAR_SUFFIX, entry["path"]):
                        if os.path.exists(os.path.join(folder, name)):
                            self.out.put(folder, name)
                return entries
            except StokerError as e:
                if not writer.samples and "no samples were written" in str(e):
                    return []
                raise
            finally:
                shutil.rmtree(folder, ignore_errors=True)

        def on_write_complete(self, write_result: Any) -> None:
            entries = sorted(
                (e for returned in write_result.write_returns for e in returned),
                key=lambda e: e["path"],
            )
            # (a dead task's folder, or an earlier run's shards no task redid)
            remove_stale(self.out, {e["path"] for e in entries}, self.prefix)
            self.out.put_manifest(entries)

    return ShardSink


def _shrink(samples: list[dict], resize: ImageResize, where: str) -> None:
    """The JPEG values (bytes) of `samples` re-encoded as ``stoker pack --image-size``
    does, in place."""
    views = [
        {
            field: np.frombuffer(value, np.uint8) if isinstance(value, bytes) else value
            for field, value in sample.items()
            if field == "__key__" or isinstance(value, bytes)
        }
        for sample in samples
    ]
    before = [dict(view) for view in views]
    shrink_images(views, resize, where)
    for sample, view, old in zip(samples, views, before):
        for field, value in view.items():
            if value is not old[field]:
                sample[field] = value.tobytes()
