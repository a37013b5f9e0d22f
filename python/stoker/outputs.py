"""Where written shards go: a folder every node sees, or an ``s3://`` or ``gs://`` prefix.

A writer (``stoker pack``, ``stoker.ray.write_shards``) makes each shard in a folder of its
own (a hidden one inside an output folder; a local temporary one for a prefix), then puts
it whole at its name: a rename in the folder, one signed PUT to the store, either of which
shows a reader the whole shard or nothing. Its member index goes first, so that a shard is
never seen without it, and the manifest goes last, once every shard is in place.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from typing import Any

from stoker import _core
from stoker.errors import StokerError
from stoker.manifest import MANIFEST_NAME, shard_entry, write_entries
from stoker.remote import FetchOptions
from stoker.remote.http import fetcher_for

#: The name a writer's own folders begin with: what a dead writer left is known by it.
TASK_FOLDER = ".stoker-ray-task-"


class Folder:
    """A folder every node sees: each task writes in a hidden folder inside it, and a
    finished shard is renamed into place."""

    def __init__(self, out: str) -> None:
        self.out = os.path.abspath(out)

    def path_of(self, name: str) -> str:
        return os.path.join(self.out, name)

    def prepare(self) -> None:
        os.makedirs(self.out, exist_ok=True)

    def names(self) -> list[str]:
        return os.listdir(self.out)

    def task_folder(self, task: int) -> str:
        return os.path.join(self.out, f"{TASK_FOLDER}{task:06d}-{uuid.uuid4().hex[:8]}")

    def put(self, folder: str, name: str) -> None:
        os.replace(os.path.join(folder, name), self.path_of(name))

    def remove(self, name: str) -> None:
        path = self.path_of(name)
        if name.startswith(TASK_FOLDER):  # a task's that died
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)

    def put_manifest(self, entries: list[dict], extra: dict | None = None) -> None:
        write_entries(self.path_of(MANIFEST_NAME), entries, extra)


class Prefix:
    """An ``s3://`` or ``gs://`` prefix: each task writes in a temporary folder of its
    node, and a finished shard is put in one request, signed as stoker signs its reads
    (with the node's own credentials)."""

    def __init__(self, out: str, options: FetchOptions) -> None:
        self.out = out.rstrip("/") + "/"
        self.options = options

    def path_of(self, name: str) -> str:
        return self.out + name

    def _call(self, work: Any) -> Any:
        return fetcher_for(self.options).call(work)

    def prepare(self) -> None:
        pass  # (a prefix needs no making)

    def names(self) -> list[str]:
        listed = self._call(fetcher_for(self.options).list_objects(self.out))
        names = [url[len(self.out) :] for url, _, _ in listed if url.startswith(self.out)]
        return [n for n in names if "/" not in n]

    def task_folder(self, task: int) -> str:
        # Named for the output and the task: a run again after its worker died clears
        # what the dead one left on this node.
        digest = hashlib.sha256(self.out.encode()).hexdigest()[:12]
        folder = os.path.join(tempfile.gettempdir(), f"{TASK_FOLDER}{digest}-{task:06d}")
        shutil.rmtree(folder, ignore_errors=True)
        return folder

    def put(self, folder: str, name: str) -> None:
        self._call(fetcher_for(self.options).upload(self.path_of(name), os.path.join(folder, name)))

    def remove(self, name: str) -> None:
        self._call(fetcher_for(self.options).delete(self.path_of(name)))

    def put_manifest(self, entries: list[dict], extra: dict | None = None) -> None:
        folder = tempfile.mkdtemp(prefix=TASK_FOLDER)
        try:
            write_entries(os.path.join(folder, MANIFEST_NAME), entries, extra)
            self.put(folder, MANIFEST_NAME)
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def refuse_unless_free(target: Folder | Prefix, ours: Callable[[str], bool]) -> None:
    """A StokerError unless `target` is new, empty, or holds only what an unfinished run
    of this writer left (the names `ours` owns), which the run then replaces."""
    target.prepare()
    names = target.names()
    if MANIFEST_NAME in names:
        raise StokerError(
            f"{target.out}: holds a finished dataset ({MANIFEST_NAME}): write into another "
            "folder or prefix"
        )
    others = [n for n in names if not ours(n)]
    if others:
        raise StokerError(
            f"{target.out}: the output holds other files ({others[0]!r}, ...): give a new "
            "or empty folder or prefix"
        )


def is_shard_name(name: str, prefix: str) -> bool:
    """A name a writer of shards `prefix`-N leaves: a shard, its index, a task's folder."""
    shard = name.removesuffix(_core.SIDECAR_SUFFIX)
    return name.startswith(TASK_FOLDER) or (
        shard.startswith(prefix + "-") and shard.endswith(".tar")
    )


def put_shard(target: Folder | Prefix, path: str) -> dict:
    """The finished tar shard at `path` (in a folder of its own) put at its name in
    `target`, its member index first: its manifest entry, reckoned before it moves."""
    folder, name = os.path.split(path)
    failed = _core.write_member_index([path], ["tar"], 1)[0]
    if failed:
        raise StokerError(f"{path}: cannot write its member index: {failed}")
    entry = shard_entry(path, folder)
    target.put(folder, name + _core.SIDECAR_SUFFIX)
    target.put(folder, name)
    return entry


def remove_stale(target: Folder | Prefix, listed: set[str], prefix: str) -> None:
    """What an earlier run (or a dead task) left in `target` that the manifest of this
    run, `listed`, does not name: removed before the manifest is put."""
    for name in target.names():
        if name.startswith(TASK_FOLDER) or (
            is_shard_name(name, prefix) and name.removesuffix(_core.SIDECAR_SUFFIX) not in listed
        ):
            target.remove(name)
