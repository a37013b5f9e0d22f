"""Remote shards: fetched whole over HTTP into a node-local cache, ahead of the reader.

Three parts:

* :class:`Fetcher` runs aiohttp on one background event-loop thread per process. Every
  transfer retries connection errors, 5xx, 429 (after ``Retry-After``), stalls and short
  bodies with exponential backoff and jitter, and resumes a partial body with a Range
  request where the server allows it.
* :class:`ShardCache` is a directory shared by every process on the node. A shard appears
  there only by rename, after its length (and sha256, when known) matched. Coordination
  uses open-file-description locks (``F_OFD_SETLK``), which die with their process and are
  not dropped when some other descriptor of the same file is closed:

  - ``.locks/<name>`` held exclusively while a shard downloads: one download per node;
  - a shared lock on a shard's own file while a reader holds it: eviction takes an
    exclusive lock first, so a shard in use is never deleted;
  - ``.locks/cache`` around accounting, so the directory (partial downloads included,
    each preallocated to its full size) never holds more than the limit.

* :class:`RemoteShards` is one dataset's view: URLs, what the manifest promises, where
  each shard lives in the cache, and acquire/release by shard number.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import datetime
import email.utils
import errno
import fcntl
import hashlib
import heapq
import logging
import math
import os
import queue
import random
import re
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from stoker.errors import (
    ChecksumError,
    FetchError,
    ShardFormatError,
    StokerError,
    clip,
    located,
    plural,
)

log = logging.getLogger("stoker.remote")

_PART = ".part"
_LOCKS = ".locks"
_MARKER = ".stoker-cache"  # a folder stoker may evict from has this file

# Module state is guarded by one lock, replaced in a forked child.
_registry_lock = threading.Lock()


@dataclass(frozen=True)
class FetchOptions:
    """How remote shards are fetched. The defaults suit a data-centre link."""

    connections: int = 16  # transfers at once, per process
    retries: int = 6  # attempts after the first, per transfer
    backoff: float = 0.25  # first retry's delay (s); doubled each time, with full jitter
    max_backoff: float = 20.0
    max_retry_after: float = 120.0  # a server's Retry-After is honoured up to this (s)
    stall_timeout: float = 30.0  # no byte for this long: the transfer is retried
    connect_timeout: float = 10.0
    max_redirects: int = 5
    cache_wait: float = 600.0  # how long to wait for room in a full cache before failing


def _retry_delay(options: FetchOptions, attempt: int) -> float:
    # Full jitter: processes that failed together do not come back together.
    return random.uniform(0, min(options.max_backoff, options.backoff * 2**attempt))


def _retry_after(value: str | None, options: FetchOptions) -> float | None:
    """Seconds a Retry-After header asks for (delta or HTTP date), capped; None if absent
    or unreadable (then the usual backoff applies)."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:  # HTTP dates are GMT
            when = when.replace(tzinfo=datetime.timezone.utc)
        seconds = when.timestamp() - time.time()
    if not math.isfinite(seconds):
        return None
    return min(max(seconds, 0.0), options.max_retry_after)


def wait_result(future: concurrent.futures.Future) -> Any:
    """future.result(), waited in short slices so that Ctrl-C gets through."""
    while True:
        try:
            return future.result(timeout=0.05)
        except concurrent.futures.TimeoutError:
            continue


class _DaemonPool:
    """Threads that wait for shards (on locks, room, downloads). Daemons: a process that
    is exiting does not wait for a download it no longer needs (a .part it leaves is
    cleaned up by the next process that needs room)."""

    def __init__(self, workers: int, name: str) -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(workers):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._tasks.put((future, fn))
        return future

    def _work(self) -> None:
        while True:
            future, fn = self._tasks.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:
                future.set_exception(e)
            del future, fn


_pools: dict[int, tuple[int, _DaemonPool]] = {}


def shard_pool(workers: int) -> _DaemonPool:
    """The process's pool of `workers` shard threads (made again in a forked child)."""
    with _registry_lock:
        found = _pools.get(workers)
        if found is None or found[0] != os.getpid():
            found = _pools[workers] = (os.getpid(), _DaemonPool(workers, "stoker-shards"))
        return found[1]


class NoRoom(StokerError):
    """The cache has no room for a shard right now and the caller chose not to wait."""


class _Retryable(Exception):
    def __init__(self, cause: str, delay: float | None = None) -> None:
        super().__init__(cause)
        self.delay = delay


# -- the event loop thread -----------------------------------------------------------


class Fetcher:
    """aiohttp on a background event loop; blocking entry points for the threads that
    need a shard, coroutines for everything else."""

    def __init__(self, options: FetchOptions) -> None:
        import aiohttp

        self.options = options
        self._aiohttp = aiohttp
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="stoker-fetch")
        self._thread.daemon = True
        self._thread.start()
        self._session = self.call(self._open_session())
        # Whole-shard downloads take turns for the connections in priority order (loop
        # thread only): the shard a reader waits for goes before read-ahead.
        self._free = options.connections
        self._turns: list[tuple[tuple[int, int], int, asyncio.Future]] = []
        self._arrivals = 0
        atexit.register(self.close)

    async def _open_session(self) -> Any:
        aiohttp = self._aiohttp
        o = self.options
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=o.connections, limit_per_host=o.connections),
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=o.connect_timeout, sock_read=o.stall_timeout
            ),
            # Shards are bytes whose length and digest are known: no content coding may
            # change them on the way (and a compressed body could not be resumed by range).
            headers={"Accept-Encoding": "identity"},
            auto_decompress=False,
        )

    def submit(self, coro: Any) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(self, coro: Any) -> Any:
        """Run `coro` on the loop and wait for it; Ctrl-C still interrupts the wait (and
        then waits, briefly, for the coroutine to have stopped)."""
        future = self.submit(coro)
        try:
            return wait_result(future)
        except BaseException:
            future.cancel()
            with contextlib.suppress(BaseException):
                future.exception(timeout=5)
            raise

    def close(self) -> None:
        if self._loop.is_closed() or not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            self.submit(self._session.close()).result(timeout=2)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=2)

    # -- transfers ----------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _turn(self, priority: tuple[int, int]) -> Any:
        if self._free > 0 and not self._turns:
            self._free -= 1
        else:
            waiter = self._loop.create_future()
            self._arrivals += 1
            heapq.heappush(self._turns, (priority, self._arrivals, waiter))
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._pass_turn()  # it was handed over as we were cancelled
                raise
        try:
            yield
        finally:
            self._pass_turn()

    def _pass_turn(self) -> None:
        while self._turns:
            _, _, waiter = heapq.heappop(self._turns)
            if not waiter.done():
                waiter.set_result(None)
                return
        self._free += 1

    async def _attempts(self, url: str, offset: Callable[[], int], attempt: Any) -> Any:
        """Call `attempt()` until it succeeds, retrying what may pass; FetchError after.
        An error of the connection's (no answer, or no HTTP in what came back) has
        ``transport`` set; one about what the server answered comes from `attempt`."""
        aiohttp = self._aiohttp
        o = self.options

        def failed(what: str) -> FetchError:
            error = located(FetchError, url, offset(), what)
            error.transport = True  # type: ignore[attr-defined]
            return error

        last = "no attempt made"
        for n in range(o.retries + 1):
            delay: float | None = None
            try:
                return await attempt()
            except _Retryable as e:
                last, delay = str(e), e.delay
            except asyncio.TimeoutError:  # aiohttp's socket timeouts are these too
                last = f"stalled: no data for {o.stall_timeout:g} s"
            except asyncio.IncompleteReadError as e:
                last = f"short body: {len(e.partial)} of {e.expected} bytes"
            except (aiohttp.ClientConnectorCertificateError, aiohttp.ClientSSLError) as e:
                raise failed(f"TLS: {clip(str(e))}") from e
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as e:
                last = f"{type(e).__name__}: {clip(str(e))}" if str(e) else type(e).__name__
            except aiohttp.TooManyRedirects as e:
                raise failed(f"too many redirects: {clip(str(e))}") from e
            except aiohttp.RedirectClientError as e:
                raise failed(f"refused redirect (only http(s) is followed): {clip(str(e))}") from e
            except aiohttp.ClientError as e:
                raise failed(f"{type(e).__name__}: {clip(str(e))}") from e
            if n < o.retries:
                backoff = _retry_delay(o, n)
                wait = max(delay, backoff) if delay is not None else backoff
                log.info("%s: %s; retry %d/%d in %.2f s", url, last, n + 1, o.retries, wait)
                await asyncio.sleep(wait)
        raise failed(f"gave up after {plural(o.retries + 1, 'attempt')}; last: {last}")

    def _check_response(self, url: str, offset: int, response: Any) -> None:
        status = response.status
        reason = f"HTTP {status} {clip(response.reason or '')}".strip()
        if status == 429 or status == 408 or status >= 500:
            raise _Retryable(
                reason, _retry_after(response.headers.get("Retry-After"), self.options)
            )
        if status not in (200, 206):
            error = located(FetchError, url, offset, reason)
            error.status = status  # type: ignore[attr-defined]
            raise error
        coding = response.headers.get("Content-Encoding", "identity").strip().lower()
        if coding not in ("", "identity"):
            raise located(
                FetchError, url, offset, f"the server sent a {coding}-encoded body, asked not to"
            )

    def _get(self, url: str, headers: dict[str, str] | None = None) -> Any:
        return self._session.get(
            url, headers=headers, max_redirects=self.options.max_redirects, allow_redirects=True
        )

    async def size_of(self, url: str) -> int | None:
        """The size of `url` in bytes, from one ranged GET (HEAD is not always served)."""

        async def attempt() -> int | None:
            async with self._get(url, {"Range": "bytes=0-0"}) as response:
                self._check_response(url, 0, response)
                return _total_size(response)

        return await self._attempts(url, lambda: 0, attempt)

    async def read_range(self, url: str, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) of `url`."""
        if length == 0:
            return b""

        async def attempt() -> bytes:
            headers = {"Range": f"bytes={offset}-{offset + length - 1}"}
            async with self._get(url, headers) as response:
                self._check_response(url, offset, response)
                if response.status == 206:
                    start = _range_start(response)
                    if start != offset:
                        raise located(
                            FetchError, url, offset, f"asked for offset {offset}, got {start}"
                        )
                else:  # no ranges here: skip to the bytes wanted in the whole body
                    skipped = 0
                    while skipped < offset:
                        chunk = await response.content.read(min(1 << 20, offset - skipped))
                        if not chunk:
                            raise _Retryable(f"short body: {skipped} of {offset + length} bytes")
                        skipped += len(chunk)
                return await response.content.readexactly(length)

        return await self._attempts(url, lambda: offset, attempt)

    async def read_all(self, url: str, limit: int = 64 << 20) -> bytes:
        """The whole body of a small resource (a manifest)."""

        async def attempt() -> bytes:
            async with self._get(url) as response:
                self._check_response(url, 0, response)
                parts, got = [], 0
                async for chunk in response.content.iter_chunked(1 << 20):
                    got += len(chunk)
                    if got > limit:
                        raise located(FetchError, url, limit, f"larger than {limit} bytes")
                    parts.append(chunk)
                expected = response.content_length
                if expected is not None and got != expected:
                    raise _Retryable(f"short body: {got} of {expected} bytes")
                return b"".join(parts)

        return await self._attempts(url, lambda: 0, attempt)

    async def download(
        self,
        url: str,
        fd: int,
        size: int,
        sha256: str | None,
        progress: Callable[[int], None] | None = None,
        priority: tuple[int, int] = (0, 0),
    ) -> None:
        """Write the `size` bytes of `url` into `fd` (from offset 0), checking the length and
        `sha256`. A broken transfer resumes where it stopped when the server takes ranges
        and the object provably did not change (a strong ETag or Last-Modified to send as
        If-Range, or a sha256 to check the whole with); otherwise it starts over."""
        o = self.options
        # Our own descriptor: if the caller gives up (Ctrl-C) and closes theirs, a write
        # still in flight here cannot land in whatever file reuses the number.
        fd = os.dup(fd)
        state: dict[str, Any] = {"got": 0, "hash": hashlib.sha256(), "since": None, "bad": 0}

        def restart() -> None:
            if progress and state["got"]:
                progress(-state["got"])
            state.update(got=0, hash=hashlib.sha256(), since=None)

        async def attempt() -> None:
            headers = {}
            if state["got"]:
                if state["since"] is None and sha256 is None:
                    restart()  # nothing proves the rest would be the same object
                else:
                    headers["Range"] = f"bytes={state['got']}-"
                    if state["since"] is not None:
                        headers["If-Range"] = state["since"]
            async with self._get(url, headers) as response:
                self._check_response(url, state["got"], response)
                if response.status == 206 and state["got"]:
                    start = _range_start(response)
                    if start != state["got"]:
                        raise _Retryable(f"resumed at {start}, not {state['got']}")
                elif state["got"]:  # the whole body again: start over
                    restart()
                total = _total_size(response)
                if total is not None and total != size:
                    raise located(
                        FetchError,
                        url,
                        0,
                        f"the server has {total} bytes but {size} were expected "
                        "(manifest or first look): the shard changed",
                    )
                if response.status == 200:
                    state["since"] = _validator(response)
                async for chunk in response.content.iter_chunked(1 << 20):
                    got = state["got"]
                    if got + len(chunk) > size:
                        raise located(
                            FetchError, url, got, f"the body runs past the {size} bytes expected"
                        )
                    _pwrite_all(fd, chunk, got)
                    state["hash"].update(chunk)
                    state["got"] = got + len(chunk)
                    if progress:
                        progress(len(chunk))
            if state["got"] < size:
                raise _Retryable(f"short body: {state['got']} of {size} bytes")
            digest = state["hash"].hexdigest()
            if sha256 is not None and digest != sha256:
                state["bad"] += 1
                restart()
                if state["bad"] > o.retries:
                    raise located(
                        ChecksumError,
                        url,
                        0,
                        f"sha256 {digest} does not match the manifest's {sha256} "
                        f"({state['bad']} downloads)",
                    )
                raise _Retryable(f"sha256 {digest} does not match the manifest's {sha256}")

        try:
            async with self._turn(priority):
                await self._attempts(url, lambda: state["got"], attempt)
        except FetchError as e:
            if state["bad"] and not isinstance(e, ChecksumError):
                error = located(
                    ChecksumError,
                    url,
                    0,
                    f"sha256 does not match the manifest's {sha256} ({state['bad']} "
                    f"download(s)); then: {e}",
                )
                error.status = getattr(e, "status", None)  # type: ignore[attr-defined]
                raise error from e
            raise
        finally:
            os.close(fd)


def _validator(response: Any) -> str | None:
    """What If-Range may carry to resume this response's object: a strong ETag, else its
    Last-Modified date."""
    etag = response.headers.get("ETag")
    if etag and not etag.startswith("W/"):
        return etag
    return response.headers.get("Last-Modified")


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


def _range_start(response: Any) -> int | None:
    match = _CONTENT_RANGE.match(response.headers.get("Content-Range", ""))
    return int(match.group(1)) if match else None


def _total_size(response: Any) -> int | None:
    if response.status == 206:
        match = _CONTENT_RANGE.match(response.headers.get("Content-Range", ""))
        if match and match.group(3) != "*":
            return int(match.group(3))
        return None
    return response.content_length


_fetchers: dict[FetchOptions, tuple[int, Fetcher]] = {}


def fetcher_for(options: FetchOptions) -> Fetcher:
    """The process's Fetcher for `options`; a forked child makes its own (the parent's loop
    thread does not exist there)."""
    with _registry_lock:
        found = _fetchers.get(options)
        if found is None or found[0] != os.getpid():
            found = _fetchers[options] = (os.getpid(), Fetcher(options))
        return found[1]


# -- the cache ---------------------------------------------------------------------


def default_cache_root() -> str:
    root = os.environ.get("STOKER_CACHE")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "stoker")
    return os.path.abspath(root)


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def cache_name(url: str, sha256: str | None = None) -> str:
    """Where `url` lives under a cache root: ``host_port/its/path``, of safe names only,
    so no URL can point outside the cache. Where making it safe changed the path (or the
    URL has a query) a hash of the exact URL keeps two URLs from sharing a file; with a
    known sha256 the name carries it, so a republished shard is a new file."""
    parts = urllib.parse.urlsplit(url)
    host = _UNSAFE.sub("_", parts.hostname or "host") + (f"_{parts.port}" if parts.port else "")
    raw = [p for p in parts.path.split("/")]
    pieces = [_UNSAFE.sub("_", p) for p in raw if p not in ("", ".", "..")]
    pieces = [("_" + p[1:]) if p.startswith(".") else p for p in pieces] or ["index"]
    changed = "/".join(pieces) != parts.path.strip("/") or bool(parts.query)
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


def _open_locked_fd(path: str, flags: int) -> int:
    fd = os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    with _registry_lock:
        _lock_fds.add(fd)
    return fd


def _close_locked_fd(fd: int) -> None:
    with _registry_lock:
        _lock_fds.discard(fd)
    os.close(fd)


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
                if not self._evict(path):
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

    def _forget_holds(self) -> None:
        # In a forked child: the holds are the parent's (their descriptors are closed
        # with the other lock descriptors).
        self._mutex = threading.Lock()
        self._holds = {}

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
    ) -> Hold:
        """Hold the shard `url` at `path`, downloading it if no one has: one download per
        node; whoever else wants it waits for that one (for as long as its process lives:
        the lock dies with it). Without `wait_for_room`, NoRoom when the cache is full."""
        while True:
            hold = self.hold(path, size)
            if hold is not None:
                return hold
            fd = _open_locked_fd(self._lock_file(path), os.O_RDWR | os.O_CREAT)
            try:
                if not _try_lock(fd, True):  # someone is downloading it: wait for them
                    _lock_polling(fd, True, math.inf, url)
                    continue  # their download is done (or they died): look again
                hold = self.hold(path, size)
                if hold is not None:
                    return hold
                return self._download(
                    url, path, size, sha256, fetcher, limit, progress, wait_for_room, priority
                )
            finally:
                _close_locked_fd(fd)

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
    ) -> Hold:
        part = path + _PART
        fd = -1  # the part being written
        done = False
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(part)  # a dead downloader's: we hold this shard's lock now
            fd = self._reserve(part, size, limit, url, fetcher.options.cache_wait, wait_for_room)
            fetcher.call(fetcher.download(url, fd, size, sha256, progress, priority))
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
                used = self._evict_for(size, limit)
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
                dirs[:] = [d for d in dirs if d != _LOCKS]
                files = [f for f in files if f != _MARKER]
            for name in files:
                path = os.path.join(folder, name)
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    continue
                out.append((path, st.st_size, st.st_atime_ns))
        return out

    def _evict_for(self, size: int, limit: int) -> int:
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
            if path not in held and self._evict(path):
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

    def _evict(self, path: str) -> bool:
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


_caches: dict[str, ShardCache] = {}


def cache_for(root: str) -> ShardCache:
    """The process's ShardCache for `root`: one per folder, so holds are counted once."""
    root = os.path.abspath(root)
    with _registry_lock:
        cache = _caches.get(root)
        if cache is None:
            cache = _caches[root] = ShardCache(root)
        return cache


def _private_dirs(path: str) -> None:
    """makedirs with every folder it makes private to the user (makedirs' own mode only
    reaches the last one)."""
    if os.path.isdir(path):
        return
    _private_dirs(os.path.dirname(path))
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)


def _after_fork_in_child() -> None:
    global _registry_lock
    _registry_lock = threading.Lock()
    for fd in _lock_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    _lock_fds.clear()
    for cache in _caches.values():
        cache._forget_holds()


os.register_at_fork(after_in_child=_after_fork_in_child)


# -- one dataset's remote shards ----------------------------------------------------


@dataclass
class RemoteShard:
    url: str
    format: str
    size: int | None = None
    sha256: str | None = None
    samples: int | None = None
    fields: list[str] | None = None
    name: str = ""  # where it lives under the cache root, once size and sha256 are known


#: Read-ahead of the header walk over a tar shard that has no manifest entry.
PROBE_WINDOW = 64 * 1024


class RemoteShards:
    """The remote shards of one dataset: what is known of each and where it is cached."""

    def __init__(
        self,
        shards: list[RemoteShard],
        cache_dir: str | os.PathLike[str] | None,
        cache_limit: int | None,
        options: FetchOptions | None,
    ) -> None:
        self.options = options or FetchOptions()
        # Resolved now: a child process may run in another working directory.
        self.cache_dir = os.path.abspath(os.fspath(cache_dir or default_cache_root()))
        self.cache_limit = cache_limit
        self.shards = shards
        self._cache: ShardCache | None = None
        self._limit: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_cache"] = None  # per process
        state["_limit"] = None
        return state

    @property
    def cache(self) -> ShardCache:
        if self._cache is None:
            self._cache = cache_for(self.cache_dir)
        return self._cache

    @property
    def limit(self) -> int:
        if self._limit is None:
            given = self.cache_limit
            self._limit = int(given) if given is not None else self.cache.default_limit()
        return self._limit

    @property
    def fetcher(self) -> Fetcher:
        return fetcher_for(self.options)

    @property
    def _threads(self) -> int:
        # More threads than connections: a thread finishing one shard (fsync, rename,
        # index) or making room for the next must not keep a connection idle; aiohttp's
        # connector is what bounds the transfers.
        return 2 * self.options.connections + 4

    def path_of(self, i: int) -> str:
        return self.cache.path_of(self.shards[i].name)

    def describe(self) -> None:
        """Learn each shard's size and samples that no manifest gave: from a manifest beside
        the shards if there is one, else from their headers, read with range requests."""
        missing = [s for s in self.shards if s.size is None or s.samples is None]
        if missing:
            self._adopt_manifests(missing)
            missing = [s for s in missing if s.size is None or s.samples is None]
        if missing:
            log.info(
                "%d remote shard(s) have no manifest entry: reading their headers with range "
                "requests (a stoker.json beside them saves this)",
                len(missing),
            )
            pool = shard_pool(self._threads)
            for future in [pool.submit(lambda s=s: self._probe(s)) for s in missing]:
                wait_result(future)
        for shard in self.shards:
            shard.name = cache_name(shard.url, shard.sha256)

    def _probe(self, shard: RemoteShard) -> None:
        from stoker import _core

        fetcher = self.fetcher
        if shard.size is None:
            shard.size = fetcher.call(fetcher.size_of(shard.url))
            if shard.size is None:
                raise located(FetchError, shard.url, 0, "the server does not say its size")

        def read(offset: int, length: int) -> bytes:
            return fetcher.call(fetcher.read_range(shard.url, offset, length))

        index = _core.index_remote(shard.url, shard.size, shard.format, read, PROBE_WINDOW)
        if shard.format == "npy":
            shard.samples, shard.fields = int(index["shape"][0]), ["npy"]
        else:
            shard.samples, shard.fields = len(index["keys"]), list(index["field_names"])

    def _adopt_manifests(self, shards: list[RemoteShard]) -> None:
        """Use the ``stoker.json`` beside the shards, where there is one that lists them:
        one request per folder instead of a look at every shard."""
        from stoker.sources import MANIFEST_NAME, parse_manifest

        fetcher = self.fetcher
        folders: dict[str, list[RemoteShard]] = {}
        for shard in shards:
            folders.setdefault(shard.url.rsplit("/", 1)[0] + "/", []).append(shard)
        for folder, members in folders.items():
            url = folder + MANIFEST_NAME
            try:
                listed = dict(parse_manifest(fetcher.call(fetcher.read_all(url)), url))
            except FetchError as e:
                if getattr(e, "transport", False):
                    # The server is not answering: the shards would fail too. Said of the
                    # shard the user named, not of a manifest they never typed.
                    what = str(e).removeprefix(f"{url}: offset {getattr(e, 'offset', 0)}: ")
                    raise located(
                        FetchError,
                        members[0].url,
                        0,
                        f"{what} (while looking for a {MANIFEST_NAME} beside it)",
                    ) from e
                log.debug("%s: no manifest (%s)", url, e)
                continue
            except ShardFormatError as e:  # something else answers to that name: a web page
                log.debug("%s: not a manifest (%s)", url, e)
                continue
            for shard in members:
                entry = listed.get(shard.url)
                if entry is not None:
                    apply_entry(shard, entry)

    # -- acquire / release --------------------------------------------------------

    def acquire(
        self,
        i: int,
        progress: Callable[[int], None] | None = None,
        wait_for_room: bool = True,
        priority: tuple[int, int] = (0, 0),
    ) -> Hold:
        """Hold shard `i` in the cache, fetching it if needed (blocks). A download waiting
        for a connection goes before those of higher `priority`."""
        shard = self.shards[i]
        assert shard.size is not None
        return self.cache.fetch(
            shard.url,
            self.path_of(i),
            shard.size,
            shard.sha256,
            self.fetcher,
            self.limit,
            progress,
            wait_for_room,
            priority,
        )

    def start(
        self,
        i: int,
        then: Callable[[Hold], Any] | None = None,
        priority: tuple[int, int] = (0, 0),
    ) -> concurrent.futures.Future:
        """acquire(i) (then `then(hold)`) on the process's shard threads."""

        def task() -> Any:
            hold = self.acquire(i, priority=priority)
            return then(hold) if then is not None else hold

        return shard_pool(self._threads).submit(task)

    def warm(self, i: int, priority: tuple[int, int] = (1, 0)) -> concurrent.futures.Future:
        """Fetch shard `i` into the cache without holding it, if there is room now: a
        prefetch that never crowds out the shards being read."""

        def task() -> bool:
            try:
                self.acquire(i, wait_for_room=False, priority=priority)
            except NoRoom:
                return False
            self.release(i)
            return True

        return shard_pool(self._threads).submit(task)

    def release(self, i: int) -> bool:
        return self.cache.release(self.path_of(i))


def apply_entry(shard: RemoteShard, entry: dict) -> None:
    """What a manifest entry says of a shard: bytes, samples, sha256, fields."""
    shard.size = entry.get("bytes", shard.size)
    shard.samples = entry.get("samples", shard.samples)
    shard.sha256 = entry.get("sha256", shard.sha256)
    if isinstance(entry.get("fields"), list):
        shard.fields = [str(f) for f in entry["fields"]]
