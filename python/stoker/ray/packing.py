"""``stoker pack --ray``: the shards of a pack written by Ray tasks across a cluster.

The driver does what a pack on one machine does before and after writing: it opens the
source, assigns samples to shards (a pure function of the input and the options, so the
same shards with the same names and members as ``stoker pack`` without ``--ray``), and,
once every shard is written, writes the manifest and moves the whole into place. What it
holds is the plan (each shard's sample numbers) and the manifest, never the data.

Each shard is one Ray task (stoker.ray.tasks.run_each): the task opens the source itself
(the pickled Dataset: its member table, not its bytes, unpickled once per worker), reads
the shard's samples (re-encoding JPEGs at ``--image-size`` on stoker's C++ threads) and
writes the tar into the pack's hidden work folder, which must be on storage every node
sees (a shared folder); for an ``s3://`` or ``gs://`` output, into a temporary folder of
its node, from which it puts the shard (its member index first) in the store in one
signed request. A task that dies is run again by Ray and writes its shard again from the
start; nothing of the pack is in the output until every shard is written, the manifest
last.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable

import numpy as np

from stoker.dataset import Dataset
from stoker.outputs import Prefix, put_shard
from stoker.ray.tasks import KILL_ONCE_ENV, die_once, run_each
from stoker.writer import write_shard


def write_shards_on_ray(
    ds: Dataset,
    plan: list[np.ndarray],
    paths: list[str],
    *,
    address: str | None = None,
    progress: Callable[[int], None] | None = None,
    transform: Callable[[list[dict]], None] | None = None,
    store: Prefix | None = None,
) -> list[dict]:
    """Shard `paths[i]` of the samples `plan[i]` of `ds`, each written by a Ray task (see
    stoker.writer.write_shards, which does the same on threads); `progress` is told the
    samples of each shard as it is written. With a `store`, a task writes its shard in a
    temporary folder of its node and puts it in the store (its manifest entry returned,
    in `paths` order); `paths` then give only the names. A shard whose task keeps failing
    raises here, with the task's error."""
    kill_once = os.environ.get(KILL_ONCE_ENV)  # (read here: the workers' is not the test's)

    def write(i: int) -> str:
        samples = plan[i]
        path = paths[i]
        if store is not None:
            folder = store.task_folder(i)
            os.makedirs(folder)
            path = os.path.join(folder, os.path.basename(path))
        try:
            if kill_once and len(samples) > 1 and die_once(kill_once):
                write_shard(ds, samples[: len(samples) // 2], path, transform=transform)
                os._exit(1)  # the worker dies mid-pack, its shard half-written
            write_shard(ds, samples, path, transform=transform)
            entry = put_shard(store, path) if store is not None else None
        finally:
            if store is not None:
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        return json.dumps({"samples": len(samples), "entry": entry})

    entries: list[dict] = [{} for _ in plan]
    # The driver's store settings (endpoint, region, credentials) go with the tasks, so
    # that a node with none of its own signs as the driver does.
    env = {n: v for n, v in os.environ.items() if n.startswith(("AWS_", "S3_"))}
    for i, result in run_each(len(plan), write, address, env if store is not None else None):
        done = json.loads(result)
        entries[i] = done["entry"]
        if progress is not None:
            progress(int(done["samples"]))
    return entries if store is not None else []
