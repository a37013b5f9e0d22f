"""The node-local shard cache: a directory shared by every process on the node.

A shard appears there only by rename, after its length (and sha256, when known) matched.
Coordination uses open-file-description locks (``F_OFD_SETLK``), which die with their
process and are not dropped when some other descriptor of the same file is closed:

- ``.locks/<name>`` held exclusively while a shard downloads: one download per node;
- a shared lock on a shard's own file while a reader holds it: eviction takes an
  exclusive lock first, so a shard in use is never deleted;
- ``.locks/cache`` around accounting, so the directory (partial downloads included, each
  preallocated to its full size) never holds more than the limit.

``.index/`` remembers, for every process and later run on the node, what opening a
remote shard without a manifest learnt (its samples and fields, keyed by URL, size and
ETag or Last-Modified) and which servers ignore range requests. Each record is written
under its shard's download lock, so a shard is looked into once per node.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import logging
import math
import os
import re
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from stoker._process import in_forked_child, per_process
from stoker.errors import FetchError, StokerError, located
from stoker.remote.http import Fetcher

log = logging.getLogger("stoker.remote")

_PART = ".part"
_LOCKS = ".locks"
_RECORDS = ".index"
_COPY = "copy: "
_MARKER = ".stoker-cache"  # a folder stoker may evict from has this file


class NoRoom(StokerError):
    """The cache has no room for a shard right now and the caller chose not to wait."""


@dataclass(frozen=True)
class Unpack:
    """How a shard fetched compressed becomes the shard cached: its compressed size (None:
    asked of the server) and the function from its bytes to the shard's, in parts."""

    packed_size: int | None
    transform: Callable[[bytes], list]


# -- the cache ---------------------------------------------------------------------


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def cache_name(url: str, sha256: str | None = None) -> str:
    """Where `url` lives under a cache root: ``host_port/its/path``, of safe names only,
    so no URL can point outside the cache. Where making it safe changed the path (or the
    URL has a query) a hash of the exact URL keeps two URLs from sharing a file; with a
    known sha256 the name carries it, so a republished shard is a new file."""
    folder, _, leaf = url.rpartition("/")
    if "?" in url or "#" in url or leaf in ("", ".", "..") or folder.endswith(":/"):
        host, pieces, changed = _safe_path(url)
    else:  # a manifest's shards share a few folders: each made safe once
        host, folder_pieces, changed = _safe_folder(folder)
        piece = _safe_piece(leaf)
        pieces, changed = [*folder_pieces, piece], changed or piece != leaf
    return _named(url, sha256, host, pieces, changed)


@functools.lru_cache(maxsize=256)
def _safe_folder(folder: str) -> tuple[str, tuple[str, ...], bool]:
    """_safe_path of a folder URL (no query), for the names of the files in it."""
    parts = urllib.parse.urlsplit(folder)
    host = _safe_host(parts)
    pieces = tuple(_safe_piece(p) for p in parts.path.split("/") if p not in ("", ".", ".."))
    return host, pieces, "/".join(pieces) != parts.path.lstrip("/")


def _safe_host(parts: urllib.parse.SplitResult) -> str:
    return _UNSAFE.sub("_", parts.hostname or "host") + (f"_{parts.port}" if parts.port else "")


def _safe_piece(piece: str) -> str:
    piece = _UNSAFE.sub("_", piece)
    return "_" + piece[1:] if piece.startswith(".") else piece


def _safe_path(url: str) -> tuple[str, list[str], bool]:
    parts = urllib.parse.urlsplit(url)
    host = _safe_host(parts)
    pieces = [_safe_piece(p) for p in parts.path.split("/") if p not in ("", ".", "..")]
    pieces = pieces or ["index"]
    changed = "/".join(pieces) != parts.path.strip("/") or bool(parts.query)
    return host, pieces, changed


def _named(url: str, sha256: str | None, host: str, pieces: list[str], changed: bool) -> str:
    tags = []
    if changed:
        tags.append(hashlib.sha1(url.encode()).hexdigest()[:12])
    if sha256:
        tags.append(sha256[:16])
    stem, ext = os.path.splitext(pieces[-1])
    if len(stem) > 120:
        tags.insert(0, hashlib.sha1(stem.encode()).hexdigest()[:12])
        stem = stem[:100]
    pieces[-1] = "-".join([stem, *tags]) + ext[:40]
    pieces = [
        p if len(p) <= 200 else p[:180] + hashlib.sha1(p.encode()).hexdigest()[:12] for p in pieces
    ]
    return os.path.join(host, *pieces)


def _flock(kind: int) -> bytes:
    # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks)
    return struct.pack("hhqqi4x", kind, os.SEEK_SET, 0, 0, 0)


def _try_lock(fd: int, exclusive: bool) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK))
        return True
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def _lock_polling(fd: int, exclusive: bool, deadline: float, what: str) -> None:
    delay = 0.002
    while not _try_lock(fd, exclusive):
        if time.monotonic() > deadline:
            raise StokerError(f"{what}: still locked by another process after waiting")
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


# Every descriptor that carries a lock, so a forked child can close its copies: a lock
# on an open file description lasts while any copy of it is open, and a child that kept
# one would keep the parent's lock after the parent let go.
_lock_fds: set[int] = set()
_lock_fds_lock = threading.Lock()


def _open_locked_fd(path: str, flags: int) -> int:
    fd = os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    with _lock_fds_lock:
        _lock_fds.add(fd)
    return fd


def _close_locked_fd(fd: int) -> None:
    with _lock_fds_lock:
        _lock_fds.discard(fd)
    os.close(fd)


@in_forked_child
def _close_parents_lock_fds() -> None:
    global _lock_fds_lock
    _lock_fds_lock = threading.Lock()
    for fd in _lock_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    _lock_fds.clear()


@dataclass
class Hold:
    """A shard this process holds: a descriptor with a shared lock, so nobody evicts it."""

    path: str
    fd: int
    identity: tuple[int, int, int]  # (inode, size, mtime_ns), as the reader checks them
    count: int = 1


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
            _private_dirs(self.root)
            with open(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600), "w") as f:
                f.write("a stoker shard cache: files here are evicted as needed\n")
        _private_dirs(os.path.join(self.root, _LOCKS))
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
        fd = _open_locked_fd(self._lock_file(path), os.O_RDWR | os.O_CREAT)
        try:
            _lock_polling(fd, True, math.inf, what)
            yield
        finally:
            _close_locked_fd(fd)

    # -- records -------------------------------------------------------------------

    def _record_path(self, key: str) -> str:
        name = hashlib.sha1(key.encode()).hexdigest()[:32] + ".json"
        return os.path.join(self.root, _RECORDS, name)

    def copy_version(self, path: str) -> str | None:
        """The ETag or Last-Modified of the object the copy at `path` was downloaded from,
        where the download was told one."""
        record = self.read_record(_COPY + os.path.relpath(path, self.root))
        version = (record or {}).get("version")
        return version if isinstance(version, str) else None

    def read_record(self, key: str) -> dict | None:
        """What was remembered under `key`, or None (also for a damaged record: it is
        only ever a saving)."""
        try:
            with open(self._record_path(key), encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) and record.get("key") == key else None

    def write_record(self, key: str, record: dict) -> None:
        """Remember `record` under `key`, atomically (a reader sees the old or the new)."""
        path = self._record_path(key)
        _private_dirs(os.path.dirname(path))
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                json.dump({**record, "key": key}, f)
            os.replace(tmp, path)
        except OSError as e:  # a full disk: the shard is looked into again next time
            log.debug("%s: record not written: %s", key, e)
            with contextlib.suppress(OSError):
                os.unlink(tmp)

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
            fd = _open_locked_fd(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            _lock_polling(fd, False, time.monotonic() + 60, path)  # evictors lock briefly
            st = os.fstat(fd)
            try:
                now = os.stat(path)
            except FileNotFoundError:
                now = None
            # Evicted between our open and our lock: it is gone, whatever fd says.
            if now is None or (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):
                _close_locked_fd(fd)
                return None
            if size is not None and st.st_size != size:
                _close_locked_fd(fd)
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
                _close_locked_fd(fd)
            raise
        return self._keep(path, fd, st)

    def _keep(self, path: str, fd: int, st: os.stat_result) -> Hold:
        hold = Hold(path, fd, (st.st_ino, st.st_size, st.st_mtime_ns))
        with self._mutex:
            held = self._holds.get(path)
            if held is not None:  # another thread got there first: keep one lock
                held.count += 1
                _close_locked_fd(fd)
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
        _close_locked_fd(held.fd)
        return True

    def held(self) -> list[str]:
        with self._mutex:
            return list(self._holds)

    # -- fetching -----------------------------------------------------------------

    def fetch(
        self,
        url: str,
        path: str,
        size: int,
        sha256: str | None,
        fetcher: Fetcher,
        limit: int,
        progress: Callable[[int], None] | None = None,
        wait_for_room: bool = True,
        priority: tuple[int, int] = (0, 0),
        locked: bool = False,
        version: str | None = None,
        unpack: Unpack | None = None,
    ) -> Hold:
        """Hold the shard `url` at `path`, downloading it if no one has: one download per
        node; whoever else wants it waits for that one (for as long as its process lives:
        the lock dies with it). Without `wait_for_room`, NoRoom when the cache is full.
        `locked`: the caller holds the shard's lock already (see shard_lock). `version`:
        the object's ETag when it was looked at, where known (see Fetcher.download).
        `unpack`: `url` is the shard compressed; it is decompressed on its way in."""
        hold = self.hold(path, size)
        if hold is not None:
            return hold
        what = (url, path, size, sha256, fetcher, limit, progress, wait_for_room, priority)
        if locked:
            return self._download(*what, version, unpack)
        with self.shard_lock(path, url):  # a download in flight: wait for it, then look
            return self.fetch(*what, True, version, unpack)

    def _download(
        self,
        url: str,
        path: str,
        size: int,
        sha256: str | None,
        fetcher: Fetcher,
        limit: int,
        progress: Callable[[int], None] | None,
        wait_for_room: bool,
        priority: tuple[int, int],
        version: str | None,
        unpack: Unpack | None = None,
    ) -> Hold:
        part = path + _PART
        fd = -1  # the part being written
        done = False
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(part)  # a dead downloader's: we hold this shard's lock now
            fd = self._reserve(part, size, limit, url, fetcher.options.cache_wait, wait_for_room)
            if unpack is None:
                got = fetcher.call(
                    fetcher.download(url, fd, size, sha256, progress, priority, version)
                )
            else:
                got = self._download_unpacked(url, fd, part, fetcher, unpack, priority, version)
            if sha256 is None:
                # Which version of the object this copy is: a copy is trusted for what is
                # remembered of that version only. (With a sha256, the name says it.)
                self.write_record(_COPY + os.path.relpath(path, self.root), {"version": got})
            os.fsync(fd)  # a cached shard survives a crash whole, or not at all
            os.close(fd)
            fd = -1
            held = _open_locked_fd(part, os.O_RDONLY)
            try:  # held before it has its name, so no one can evict it in between
                if not _try_lock(held, False):  # pragma: no cover - no one else knows it
                    raise StokerError(f"{part}: locked while being downloaded")
                with self._cache_locked(time.monotonic() + fetcher.options.cache_wait):
                    os.rename(part, path)
            except BaseException:
                _close_locked_fd(held)
                raise
            done = True
            return self._keep(path, held, os.fstat(held))
        except OSError as e:
            if isinstance(e, StokerError):
                raise
            raise located(
                FetchError, url, 0, f"cannot write the cache file {part}: {e.strerror or e}"
            ) from e
        finally:
            if fd >= 0:
                os.close(fd)
            if not done:
                with contextlib.suppress(OSError):
                    os.unlink(part)

    @staticmethod
    def _download_unpacked(
        url: str,
        fd: int,
        part: str,
        fetcher: Fetcher,
        unpack: Unpack,
        priority: tuple[int, int],
        version: str | None,
    ) -> str | None:
        """Fetch the compressed `url` beside `part`, then write what it decompresses to
        into `fd`. (The compressed copy is not in the cache's accounting: it lives only
        while this runs.)"""
        packed_size = unpack.packed_size
        if packed_size is None:
            packed_size = fetcher.call(fetcher.stat(url)).size
        packed = part + ".packed"
        packed_fd = os.open(packed, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            got = fetcher.call(
                fetcher.download(url, packed_fd, packed_size, None, None, priority, version)
            )
            data = bytearray()
            while len(data) < packed_size:
                piece = os.pread(packed_fd, min(packed_size - len(data), 1 << 30), len(data))
                if not piece:
                    raise located(FetchError, url, len(data), f"{packed} ends early")
                data += piece
        finally:
            os.close(packed_fd)
            with contextlib.suppress(OSError):
                os.unlink(packed)
        at = 0
        for chunk in unpack.transform(bytes(data)):
            view = memoryview(chunk).cast("B")
            while len(view):
                written = os.pwrite(fd, view, at)
                at += written
                view = view[written:]
        return got

    @contextlib.contextmanager
    def _cache_locked(self, deadline: float) -> Iterator[None]:
        """The node-wide lock over the cache's accounting: reservations, evictions, and
        renames (a directory scan racing a rename can miss the file under both names)."""
        lock = _open_locked_fd(os.path.join(self.root, _LOCKS, "cache"), os.O_RDWR | os.O_CREAT)
        try:
            _lock_polling(lock, True, deadline, self.root)
            yield
        finally:
            _close_locked_fd(lock)

    def _reserve(
        self, part: str, size: int, limit: int, url: str, wait: float, wait_for_room: bool
    ) -> int:
        """Make room for `size` bytes (evicting least recently used shards no one holds)
        and create `part` at its full size, so that every process counts it."""
        if size > limit:
            raise StokerError(f"{url}: the shard is {size} bytes, more than cache_limit={limit}")
        started = time.monotonic()
        waited = False
        while True:
            with self._cache_locked(started + wait):
                used = self.evict_for(size, limit)
                if used + size <= limit:
                    _private_dirs(os.path.dirname(part))
                    fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                    try:
                        _preallocate(fd, size)
                    except OSError as e:
                        os.close(fd)
                        os.unlink(part)
                        raise located(
                            FetchError,
                            url,
                            0,
                            f"no room for {size} bytes in the cache {self.root}: {e.strerror or e}",
                        ) from e
                    return fd
            if not wait_for_room:
                raise NoRoom(f"{url}: no room in the cache now")
            if time.monotonic() - started > wait:
                raise StokerError(
                    f"{url}: cache {self.root} is full ({used} of {limit} bytes) of shards "
                    f"in use; waited {time.monotonic() - started:.0f} s for room for {size} "
                    "bytes: raise cache_limit, or run fewer processes on it"
                )
            if not waited:
                log.info("%s: cache full of shards in use; waiting for room", self.root)
                waited = True
            time.sleep(0.1)

    def usage(self) -> int:
        """Bytes in the cache: complete shards and downloads in flight."""
        return sum(size for _, size, _ in self._files())

    def _files(self) -> list[tuple[str, int, int]]:
        out = []
        for folder, dirs, files in os.walk(self.root):
            if folder == self.root:
                dirs[:] = [d for d in dirs if d not in (_LOCKS, _RECORDS)]
                files = [f for f in files if f != _MARKER]
            for name in files:
                path = os.path.join(folder, name)
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    continue
                out.append((path, st.st_size, st.st_atime_ns))
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
        fd = _open_locked_fd(self._lock_file(part[: -len(_PART)]), os.O_RDWR | os.O_CREAT)
        try:
            if not _try_lock(fd, True):
                return False
            try:
                os.unlink(part)
            except FileNotFoundError:  # finished and renamed meanwhile: not an orphan
                return False
            log.info("removed %s, left by a download that did not finish", part)
            return True
        finally:
            _close_locked_fd(fd)

    def evict(self, path: str) -> bool:
        """Remove the shard at `path` unless some process holds it; True if it is gone."""
        try:
            fd = _open_locked_fd(path, os.O_RDWR)
        except FileNotFoundError:
            return True
        try:
            if not _try_lock(fd, True):  # some process holds it
                return False
            os.unlink(path)
            log.debug("evicted %s", path)
            return True
        finally:
            _close_locked_fd(fd)


def _preallocate(fd: int, size: int) -> None:
    if size == 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)


def cache_for(root: str) -> ShardCache:
    """The process's ShardCache for `root`: one per folder, so holds are counted once (a
    forked child has its own, holding nothing: its parent's holds are its parent's)."""
    root = _absolute(root)
    return per_process(("shard-cache", root), lambda: ShardCache(root))


@functools.lru_cache(maxsize=64)
def _absolute(root: str) -> str:
    return os.path.abspath(root)  # (asked once a shard: a hundred thousand times)


def _private_dirs(path: str) -> None:
    """makedirs with every folder it makes private to the user (makedirs' own mode only
    reaches the last one)."""
    if os.path.isdir(path):
        return
    _private_dirs(os.path.dirname(path))
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
