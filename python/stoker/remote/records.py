"""What a node remembers of remote shards, for every process and later run on it: what
opening a shard without a manifest learnt (its samples and fields, keyed by URL, size and
ETag or Last-Modified), which servers ignore range requests, which version of its object
each cached copy is, and what a copy in part holds. Records are small JSON files in the
cache's ``.index/``; a record is only ever a saving, so one that is damaged or missing is
looked up again (a copy in part whose record is lost is fetched again)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading

from stoker.remote.locks import private_dirs

log = logging.getLogger("stoker.remote")

#: The folder of the cache root that holds the records.
RECORDS_FOLDER = ".index"
_COPY = "copy: "


class NodeRecords:
    """The records of the cache at `root`, one a key."""

    def __init__(self, root: str) -> None:
        self.root = root

    def _path(self, key: str) -> str:
        name = hashlib.sha1(key.encode()).hexdigest()[:32] + ".json"
        return os.path.join(self.root, RECORDS_FOLDER, name)

    def read(self, key: str) -> dict | None:
        """What was remembered under `key`, or None (also for a damaged record)."""
        try:
            with open(self._path(key), encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) and record.get("key") == key else None

    def write(self, key: str, record: dict) -> None:
        """Remember `record` under `key`, atomically (a reader sees the old or the new)."""
        path = self._path(key)
        private_dirs(os.path.dirname(path))
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                json.dump({**record, "key": key}, f)
            os.replace(tmp, path)
        except OSError as e:  # a full disk: the shard is looked into again next time
            log.debug("%s: record not written: %s", key, e)
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def copy_version(self, path: str) -> str | None:
        """The ETag or Last-Modified of the object the copy at `path` was downloaded from,
        where the download was told one."""
        record = self.read(_COPY + os.path.relpath(path, self.root))
        version = (record or {}).get("version")
        return version if isinstance(version, str) else None

    def copy_ranges(self, path: str) -> list[tuple[int, int]] | None:
        """The (start, end) byte ranges the copy at `path` holds, where it is a file
        cached in part (see stoker.remote.sparse); None where none are remembered."""
        record = self.read(_COPY + os.path.relpath(path, self.root))
        ranges = (record or {}).get("ranges")
        if not isinstance(ranges, list):
            return None
        try:
            return [(int(a), int(b)) for a, b in ranges]
        except (TypeError, ValueError):
            return None

    def remember_copy(
        self, path: str, version: str | None, ranges: list[tuple[int, int]] | None = None
    ) -> None:
        """Which version of its object the copy at `path` is (a copy is trusted for what
        is remembered of that version only), and, for a copy in part, which byte ranges
        it holds."""
        record: dict = {"version": version}
        if ranges is not None:
            record["ranges"] = [list(r) for r in ranges]
        self.write(_COPY + os.path.relpath(path, self.root), record)
