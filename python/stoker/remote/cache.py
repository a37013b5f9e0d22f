"""The node-local shard cache: a directory shared by every process on the node. It holds,
places and evicts; what comes into it is fetched by :mod:`.fetching`.

A shard appears there only by rename, after its length (and sha256, when known) matched.
Coordination uses the locks of :mod:`.locks`, which die with their process:

- ``.locks/<name>`` held exclusively while a shard downloads: one download per node;
- a shared lock on a shard's own file while a reader holds it: eviction takes an
  exclusive lock first, so a shard in use is never deleted;
- ``.locks/cache`` around accounting, so the directory (partial downloads included, each
  preallocated to its full size) never holds more than the limit.

``.index/`` keeps what the node remembers of its shards (:mod:`.records`). Each record is
written under its shard's download lock, so a shard is looked into once per node.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import logging
import math
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from stoker._process import per_process
from stoker.errors import FetchError, StokerError, located
from stoker.remote.locks import (
    close_locked_fd,
    open_locked_fd,
    private_dirs,
    try_lock,
    wait_for_lock,
)
from stoker.remote.records import RECORDS_FOLDER, NodeRecords

log = logging.getLogger("stoker.remote")

_PART = ".part"
#: The partial file of a copy in part (see stoker.remote.sparse): counted by the blocks it
#: has, not by its length, which is the whole file's.
_SPARSE_PART = ".sparse.part"
_LOCKS = ".locks"
_MARKER = ".stoker-cache"  # a folder stoker may evict from has this file


class NoRoom(StokerError):
    """The cache has no room for a shard right now and the caller chose not to wait."""


@dataclass
class Hold:
    """A shard this process holds: a descriptor with a shared lock, so nobody evicts it."""

    path: str
    fd: int
    identity: tuple[int, int, int]  # (inode, size, mtime_ns), as the reader checks them
    count: int = 1


@dataclass
class Reservation:
    """Room taken in the cache for one shard while it is written: `part`, its partial file
    beside `path`, made at the shard's full size (or with the blocks of the ranges a copy
    in part holds) so that every process counts it, open as `fd` until the shard is
    placed (see ShardCache.place)."""

    path: str
    part: str
    fd: int = -1
    placed: bool = False


class ShardCache:
    """A cache folder shared by every process on the node; each keeps it within the limit
    it is given. Only a folder stoker made (it has a ``.stoker-cache`` file) is used, so
    eviction never touches anyone else's files. Within a process there is one object per
    folder (see :func:`cache_for`), which counts holds."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        marker = os.path.join(self.root, _MARKER)
        if not os.path.exists(marker):
            # One listing decides: another process may be making this cache right now,
            # and it writes the marker before anything else.
            entries = os.listdir(self.root) if os.path.isdir(self.root) else []
            if entries and _MARKER not in entries:
                raise StokerError(
                    f"{self.root}: not a stoker cache (no {_MARKER} in it) and not empty; "
                    "stoker evicts files from its cache folder, so give it one of its own"
                )
            private_dirs(self.root)
            with open(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600), "w") as f:
                f.write("a stoker shard cache: files here are evicted as needed\n")
        private_dirs(os.path.join(self.root, _LOCKS))
        self.records = NodeRecords(self.root)
        self._holds: dict[str, Hold] = {}
        self._mutex = threading.Lock()

    def default_limit(self) -> int:
        """With no cache_limit: what is cached now plus the disk's free space, less a tenth
        of the disk, so the cache never fills it."""
        st = os.statvfs(self.root)
        reserve = st.f_blocks * st.f_frsize // 10
        return max(self.usage() + st.f_bavail * st.f_frsize - reserve, 0)

    def path_of(self, name: str) -> str:
        path = os.path.normpath(os.path.join(self.root, name))
        if not path.startswith(self.root + os.sep):
            raise StokerError(f"{name}: not a name inside the cache {self.root}")
        return path

    def _lock_file(self, path: str) -> str:
        rel = os.path.relpath(path, self.root)
        return os.path.join(self.root, _LOCKS, hashlib.sha1(rel.encode()).hexdigest()[:24])

    @contextlib.contextmanager
    def shard_lock(self, path: str, what: str) -> Iterator[None]:
        """The node-wide lock of the shard cached at `path`, held for the block (waiting
        for whoever holds it, for as long as their process lives): one download, and
        one look into a shard, per node."""
        fd = open_locked_fd(self._lock_file(path), os.O_RDWR | os.O_CREAT)
        try:
            wait_for_lock(fd, True, math.inf, what)
            yield
        finally:
            close_locked_fd(fd)

    # -- holding ------------------------------------------------------------------

    def hold(self, path: str, size: int | None) -> Hold | None:
        """Hold the complete shard at `path` if it is there (and `size` bytes); None if not.
        A file of another size is stale (a shard that changed): removed if no one holds it."""
        with self._mutex:
            held = self._holds.get(path)
            if held is not None:
                held.count += 1
                return held
        try:
            fd = open_locked_fd(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            wait_for_lock(fd, False, time.monotonic() + 60, path)  # evictors lock briefly
            st = os.fstat(fd)
            try:
                now = os.stat(path)
            except FileNotFoundError:
                now = None
            # Evicted between our open and our lock: it is gone, whatever fd says.
            if now is None or (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):
                close_locked_fd(fd)
                return None
            if size is not None and st.st_size != size:
                close_locked_fd(fd)
                if not self.evict(path):
                    raise located(
                        FetchError,
                        path,
                        min(st.st_size, size),
                        f"cached shard has {st.st_size} bytes, {size} expected, and another "
                        "process is reading it: the shard changed on the server",
                    )
                return None
            # atime orders eviction (mtime is part of the identity reads check).
            os.utime(fd, ns=(time.time_ns(), st.st_mtime_ns))
        except BaseException:
            with contextlib.suppress(OSError):
                close_locked_fd(fd)
            raise
        return self._keep(path, fd, st)

    def _keep(self, path: str, fd: int, st: os.stat_result) -> Hold:
        hold = Hold(path, fd, (st.st_ino, st.st_size, st.st_mtime_ns))
        with self._mutex:
            held = self._holds.get(path)
            if held is not None:  # another thread got there first: keep one lock
                held.count += 1
                close_locked_fd(fd)
                return held
            self._holds[path] = hold
        return hold

    def release(self, path: str) -> bool:
        """Let go of one hold of `path`; True when this process no longer holds it."""
        with self._mutex:
            held = self._holds.get(path)
            if held is None:
                return True
            held.count -= 1
            if held.count > 0:
                return False
            del self._holds[path]
        close_locked_fd(held.fd)
        return True

    def held(self) -> list[str]:
        with self._mutex:
            return list(self._holds)

    # -- placing ------------------------------------------------------------------

    @contextlib.contextmanager
    def reserved(
        self,
        path: str,
        size: int,
        limit: int,
        url: str,
        wait: float,
        wait_for_room: bool = True,
        ranges: list[tuple[int, int]] | None = None,
    ) -> Iterator[Reservation]:
        """Room for the `size` bytes of the shard at `path` (from `url`), or for its byte
        `ranges` only (a copy in part), while the block writes them into the reservation's
        file, for a caller that holds the shard's lock (see shard_lock). Waits up to `wait`
        seconds for room; without `wait_for_room`, NoRoom at once. What place() did not
        take is removed after the block."""
        room = Reservation(path, path + (_PART if ranges is None else _SPARSE_PART))
        try:
            for part in (path + _PART, path + _SPARSE_PART):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(part)  # a dead downloader's: we hold this shard's lock now
            room.fd = self._reserve(room.part, size, limit, url, wait, wait_for_room, ranges)
            yield room
        except OSError as e:
            if isinstance(e, StokerError):
                raise
            what = f"cannot write the cache file {room.part}: {e.strerror or e}"
            raise located(FetchError, url, 0, what) from e
        finally:
            if room.fd >= 0:
                os.close(room.fd)
            if not room.placed:
                with contextlib.suppress(OSError):
                    os.unlink(room.part)

    def place(self, room: Reservation, wait: float) -> Hold:
        """The shard written into `room` under its name, and held."""
        os.fsync(room.fd)  # a cached shard survives a crash whole, or not at all
        os.close(room.fd)
        room.fd = -1
        held = open_locked_fd(room.part, os.O_RDONLY)
        try:  # held before it has its name, so no one can evict it in between
            if not try_lock(held, False):  # pragma: no cover - no one else knows it
                raise StokerError(f"{room.part}: locked while being downloaded")
            with self._cache_locked(time.monotonic() + wait):
                os.rename(room.part, room.path)
        except BaseException:
            close_locked_fd(held)
            raise
        room.placed = True
        return self._keep(room.path, held, os.fstat(held))

    @contextlib.contextmanager
    def _cache_locked(self, deadline: float) -> Iterator[None]:
        """The node-wide lock over the cache's accounting: reservations, evictions, and
        renames (a directory scan racing a rename can miss the file under both names)."""
        lock = open_locked_fd(os.path.join(self.root, _LOCKS, "cache"), os.O_RDWR | os.O_CREAT)
        try:
            wait_for_lock(lock, True, deadline, self.root)
            yield
        finally:
            close_locked_fd(lock)

    def _reserve(
        self,
        part: str,
        size: int,
        limit: int,
        url: str,
        wait: float,
        wait_for_room: bool,
        ranges: list[tuple[int, int]] | None = None,
    ) -> int:
        """Make room for `size` bytes, or for the bytes of `ranges` (evicting least
        recently used shards no one holds), and create `part` at its full size with those
        bytes allocated, so that every process counts them."""
        need = size if ranges is None else sum(b - a for a, b in ranges)
        if need > limit:
            raise StokerError(f"{url}: the shard is {need} bytes, more than cache_limit={limit}")
        started = time.monotonic()
        waited = False
        while True:
            with self._cache_locked(started + wait):
                used = self.evict_for(need, limit)
                if used + need <= limit:
                    private_dirs(os.path.dirname(part))
                    fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                    try:
                        _preallocate(fd, size, ranges)
                    except OSError as e:
                        os.close(fd)
                        os.unlink(part)
                        raise located(
                            FetchError,
                            url,
                            0,
                            f"no room for {need} bytes in the cache {self.root}: {e.strerror or e}",
                        ) from e
                    return fd
            if not wait_for_room:
                raise NoRoom(f"{url}: no room in the cache now")
            if time.monotonic() - started > wait:
                raise StokerError(
                    f"{url}: cache {self.root} is full ({used} of {limit} bytes) of shards "
                    f"in use; waited {time.monotonic() - started:.0f} s for room for {need} "
                    "bytes: raise cache_limit, or run fewer processes on it"
                )
            if not waited:
                log.info("%s: cache full of shards in use; waiting for room", self.root)
                waited = True
            time.sleep(0.1)

    def grow(
        self, path: str, ranges: list[tuple[int, int]], limit: int, url: str, wait: float
    ) -> int:
        """Room for byte `ranges` more of the copy in part at `path`, which the caller
        holds, and holds the lock of: a descriptor to write them with, the blocks
        allocated so that every process counts them."""
        need = sum(b - a for a, b in ranges)
        with self._cache_locked(time.monotonic() + wait):
            used = self.evict_for(need, limit)
            if used + need > limit:
                raise StokerError(
                    f"{url}: cache {self.root} is full ({used} of {limit} bytes) of shards in "
                    f"use; {need} bytes more of the file are needed: raise cache_limit"
                )
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            try:
                _preallocate(fd, -1, ranges)
            except OSError as e:
                os.close(fd)
                what = f"no room for {need} bytes in the cache {self.root}: {e.strerror or e}"
                raise located(FetchError, url, ranges[0][0], what) from e
            return fd

    # -- eviction -----------------------------------------------------------------

    def usage(self) -> int:
        """Bytes in the cache: complete shards (a copy in part: the blocks it has) and
        downloads in flight."""
        return sum(size for _, size, _ in self._files())

    def _files(self) -> list[tuple[str, int, int]]:
        out = []
        for folder, dirs, files in os.walk(self.root):
            if folder == self.root:
                dirs[:] = [d for d in dirs if d not in (_LOCKS, RECORDS_FOLDER)]
                files = [f for f in files if f != _MARKER]
            for name in files:
                path = os.path.join(folder, name)
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    continue
                # A whole download in flight counts at its length, whatever its blocks (a
                # file system without fallocate); any other file, by its blocks (a copy in
                # part is as long as the whole file).
                counted = st.st_size
                if not path.endswith(_PART) or path.endswith(_SPARSE_PART):
                    counted = min(st.st_size, st.st_blocks * 512)
                out.append((path, counted, st.st_atime_ns))
        return out

    def evict_for(self, size: int, limit: int) -> int:
        """Under the cache lock: remove downloads whose downloader died, then the least
        recently used shards no one holds, until `size` more bytes fit. Returns the bytes
        then in the cache."""
        files = self._files()
        used = sum(s for _, s, _ in files)
        for path, s, _ in files:
            if path.endswith(_PART) and self._orphaned(path):
                used -= s
        if used + size <= limit:
            return used
        held = set(self.held())
        complete = [f for f in files if not f[0].endswith(_PART)]
        for path, s, _ in sorted(complete, key=lambda f: f[2]):  # least recently used first
            if used + size <= limit:
                break
            if path not in held and self.evict(path):
                used -= s
        return used

    def _orphaned(self, part: str) -> bool:
        """Remove a partial download whose downloader is gone; True if it was removed."""
        suffix = _SPARSE_PART if part.endswith(_SPARSE_PART) else _PART
        fd = open_locked_fd(self._lock_file(part[: -len(suffix)]), os.O_RDWR | os.O_CREAT)
        try:
            if not try_lock(fd, True):
                return False
            try:
                os.unlink(part)
            except FileNotFoundError:  # finished and renamed meanwhile: not an orphan
                return False
            log.info("removed %s, left by a download that did not finish", part)
            return True
        finally:
            close_locked_fd(fd)

    def evict(self, path: str) -> bool:
        """Remove the shard at `path` unless some process holds it; True if it is gone."""
        try:
            fd = open_locked_fd(path, os.O_RDWR)
        except FileNotFoundError:
            return True
        try:
            if not try_lock(fd, True):  # some process holds it
                return False
            os.unlink(path)
            log.debug("evicted %s", path)
            return True
        finally:
            close_locked_fd(fd)


def _preallocate(fd: int, size: int, ranges: list[tuple[int, int]] | None = None) -> None:
    """`fd` made `size` bytes long (-1: as it is), its blocks allocated: all of them, or
    those of byte `ranges` only."""
    if size >= 0 and ranges is not None:
        os.ftruncate(fd, size)
    for start, end in [(0, size)] if ranges is None else ranges:
        if end <= start:
            continue
        try:
            os.posix_fallocate(fd, start, end - start)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            if ranges is None:
                os.ftruncate(fd, size)


def cache_for(root: str) -> ShardCache:
    """The process's ShardCache for `root`: one per folder, so holds are counted once (a
    forked child has its own, holding nothing: its parent's holds are its parent's)."""
    root = _absolute(root)
    return per_process(("shard-cache", root), lambda: ShardCache(root))


@functools.lru_cache(maxsize=64)
def _absolute(root: str) -> str:
    return os.path.abspath(root)  # (asked once a shard: a hundred thousand times)
