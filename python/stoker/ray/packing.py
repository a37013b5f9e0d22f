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
sees (a shared folder). A task that dies is run again by Ray and writes its shard again
from the start; nothing of the pack is in the output folder until every shard is
written, the manifest last.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from stoker.dataset import Dataset
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
) -> None:
    """Shard `paths[i]` of the samples `plan[i]` of `ds`, each written by a Ray task (see
    stoker.writer.write_shards, which does the same on threads); `progress` is told the
    samples of each shard as it is written. A shard whose task keeps failing raises here,
    with the task's error."""
    kill_once = os.environ.get(KILL_ONCE_ENV)  # (read here: the workers' is not the test's)

    def write(i: int) -> str:
        samples = plan[i]
        if kill_once and len(samples) > 1 and die_once(kill_once):
            write_shard(ds, samples[: len(samples) // 2], paths[i], transform=transform)
            os._exit(1)  # the worker dies mid-pack, its shard half-written
        write_shard(ds, samples, paths[i], transform=transform)
        return str(len(samples))

    for _, samples in run_each(len(plan), write, address):
        if progress is not None:
            progress(int(samples))
