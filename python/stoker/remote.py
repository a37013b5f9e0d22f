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
import email.utils
import errno
import fcntl
import hashlib
import logging
import os
import random
import re
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from stoker.errors import ChecksumError, FetchError, StokerError, located

log = logging.getLogger("stoker.remote")

_PART = ".part"
_LOCKS = ".locks"


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
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        when = email.utils.parsedate_to_datetime(value) if value else None
        if when is None:
            return None
        seconds = when.timestamp() - time.time()
    return min(max(seconds, 0.0), options.max_retry_after)


def wait_result(future: concurrent.futures.Future) -> Any:
    """future.result(), waited in short slices so that Ctrl-C gets through."""
    while True:
        try:
            return future.result(timeout=0.05)
        except concurrent.futures.TimeoutError:
            continue


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
        atexit.register(self.close)

    async def _open_session(self) -> Any:
        aiohttp = self._aiohttp
        o = self.options
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=o.connections, limit_per_host=o.connections),
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=o.connect_timeout, sock_read=o.stall_timeout
            ),
            auto_decompress=False,  # shards are bytes; a Content-Encoding must not alter them
        )

    def submit(self, coro: Any) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(self, coro: Any) -> Any:
        """Run `coro` on the loop and wait for it; Ctrl-C still interrupts the wait."""
        future = self.submit(coro)
        try:
            return wait_result(future)
        except BaseException:
            future.cancel()
            raise

    def close(self) -> None:
        if self._loop.is_closed() or not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            self.submit(self._session.close()).result(timeout=2)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=2)

    # -- transfers ----------------------------------------------------------------

    async def _attempts(self, url: str, offset: Callable[[], int], attempt: Any) -> Any:
        """Call `attempt()` until it succeeds, retrying what may pass; FetchError after."""
        aiohttp = self._aiohttp
        o = self.options
        last = "no attempt made"
        for n in range(o.retries + 1):
            delay: float | None = None
            try:
                return await attempt()
            except _Retryable as e:
                last, delay = str(e), e.delay
            except asyncio.TimeoutError:  # aiohttp's socket timeouts are these too
                last = f"stalled: no data for {o.stall_timeout:g} s"
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as e:
                if isinstance(e, aiohttp.ClientConnectorError) and n == o.retries:
                    last = f"cannot connect: {e}"
                else:
                    last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            except aiohttp.TooManyRedirects as e:
                raise located(FetchError, url, offset(), f"too many redirects: {e}") from e
            except aiohttp.RedirectClientError as e:
                raise located(
                    FetchError, url, offset(), f"refused redirect (only http(s) is followed): {e}"
                ) from e
            except aiohttp.ClientError as e:
                raise located(FetchError, url, offset(), f"{type(e).__name__}: {e}") from e
            if n < o.retries:
                wait = delay if delay is not None else _retry_delay(o, n)
                log.info("%s: %s; retry %d/%d in %.2f s", url, last, n + 1, o.retries, wait)
                await asyncio.sleep(wait)
        raise located(
            FetchError, url, offset(), f"gave up after {o.retries + 1} attempts; last: {last}"
        )

    def _check_status(self, url: str, offset: int, response: Any) -> None:
        status = response.status
        if status in (200, 206):
            return
        reason = f"HTTP {status} {response.reason or ''}".strip()
        if status == 429 or status == 408 or status >= 500:
            raise _Retryable(
                reason, _retry_after(response.headers.get("Retry-After"), self.options)
            )
        error = located(FetchError, url, offset, reason)
        error.status = status  # type: ignore[attr-defined]
        raise error

    def _get(self, url: str, headers: dict[str, str] | None = None) -> Any:
        return self._session.get(
            url,
            headers=headers,
            max_redirects=self.options.max_redirects,
            allow_redirects=True,
        )

    async def size_of(self, url: str) -> int:
        """The size of `url` in bytes, from one ranged GET (HEAD is not always served)."""

        async def attempt() -> int:
            async with self._get(url, {"Range": "bytes=0-0"}) as response:
                self._check_status(url, 0, response)
                return _total_size(url, response)

        return await self._attempts(url, lambda: 0, attempt)

    async def read_range(self, url: str, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) of `url`."""
        if length == 0:
            return b""

        async def attempt() -> bytes:
            headers = {"Range": f"bytes={offset}-{offset + length - 1}"}
            async with self._get(url, headers) as response:
                self._check_status(url, offset, response)
                if response.status == 206:
                    start = _range_start(response)
                    if start != offset:
                        raise located(
                            FetchError, url, offset, f"asked for offset {offset}, got {start}"
                        )
                    data = await response.content.readexactly(length)
                else:  # no ranges here: skip to the bytes wanted in the whole body
                    skipped = 0
                    while skipped < offset:
                        chunk = await response.content.read(min(1 << 20, offset - skipped))
                        if not chunk:
                            break
                        skipped += len(chunk)
                    data = await response.content.readexactly(length)
                return data

        try:
            return await self._attempts(url, lambda: offset, attempt)
        except asyncio.IncompleteReadError as e:  # pragma: no cover - mapped in _attempts
            raise located(FetchError, url, offset, f"short body: {e}") from e

    async def read_all(self, url: str, limit: int = 64 << 20) -> bytes:
        """The whole body of a small resource (a manifest)."""

        async def attempt() -> bytes:
            async with self._get(url) as response:
                self._check_status(url, 0, response)
                data = await response.content.read(limit + 1)
                if len(data) > limit:
                    raise located(FetchError, url, limit, f"larger than {limit} bytes")
                expected = response.content_length
                if expected is not None and len(data) != expected:
                    raise _Retryable(f"short body: {len(data)} of {expected} bytes")
                return data

        return await self._attempts(url, lambda: 0, attempt)

    async def download(
        self,
        url: str,
        fd: int,
        size: int,
        sha256: str | None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """Write the `size` bytes of `url` into `fd` (from offset 0), checking the length and
        `sha256`. A broken transfer resumes where it stopped when the server takes ranges."""
        o = self.options
        state = {"got": 0, "hash": hashlib.sha256(), "etag": None, "bad_sums": 0}

        async def attempt() -> None:
            got = state["got"]
            headers = {}
            if got:
                headers["Range"] = f"bytes={got}-"
                if state["etag"]:  # resume only if it is still the same object
                    headers["If-Range"] = state["etag"]
            async with self._get(url, headers) as response:
                self._check_status(url, got, response)
                if response.status == 206 and got:
                    start = _range_start(response)
                    if start != got:
                        raise _Retryable(f"resumed at {start}, not {got}")
                elif got:  # the whole body again: start over
                    if progress:
                        progress(-got)
                    got = state["got"] = 0
                    state["hash"] = hashlib.sha256()
                total = _total_size(url, response)
                if total is not None and total != size:
                    raise located(
                        FetchError,
                        url,
                        0,
                        f"the server has {total} bytes but {size} were expected "
                        "(manifest or first look): the shard changed",
                    )
                state["etag"] = (
                    response.headers.get("ETag")
                    if response.status == 200
                    else (state["etag"] or response.headers.get("ETag"))
                )
                async for chunk in response.content.iter_chunked(1 << 20):
                    if got + len(chunk) > size:
                        raise located(
                            FetchError, url, got, f"the body runs past the {size} bytes expected"
                        )
                    _pwrite_all(fd, chunk, got)
                    state["hash"].update(chunk)
                    got = state["got"] = got + len(chunk)
                    if progress:
                        progress(len(chunk))
            if got < size:
                raise _Retryable(f"short body: {got} of {size} bytes")
            digest = state["hash"].hexdigest()
            if sha256 is not None and digest != sha256.lower():
                state["bad_sums"] += 1
                if progress:
                    progress(-got)
                state["got"], state["hash"], state["etag"] = 0, hashlib.sha256(), None
                if state["bad_sums"] > o.retries:
                    raise located(
                        ChecksumError,
                        url,
                        0,
                        f"sha256 {digest} does not match the manifest's {sha256} "
                        f"({state['bad_sums']} downloads)",
                    )
                raise _Retryable(f"sha256 {digest} does not match the manifest's {sha256}")

        try:
            await self._attempts(url, lambda: state["got"], attempt)
        except FetchError as e:
            if state["bad_sums"] and not isinstance(e, ChecksumError):
                raise located(
                    ChecksumError,
                    url,
                    0,
                    f"sha256 does not match the manifest's {sha256} ({state['bad_sums']} "
                    f"downloads; last problem: {e})",
                ) from e
            raise


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


def _range_start(response: Any) -> int | None:
    match = _CONTENT_RANGE.match(response.headers.get("Content-Range", ""))
    return int(match.group(1)) if match else None


def _total_size(url: str, response: Any) -> int | None:
    if response.status == 206:
        match = _CONTENT_RANGE.match(response.headers.get("Content-Range", ""))
        if match and match.group(3) != "*":
            return int(match.group(3))
        return None
    return response.content_length


_fetchers: dict[FetchOptions, tuple[int, Fetcher]] = {}
_fetchers_lock = threading.Lock()


def fetcher_for(options: FetchOptions) -> Fetcher:
    """The process's Fetcher for `options`; a forked child makes its own (the parent's loop
    thread does not exist there)."""
    with _fetchers_lock:
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
    return root


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def cache_name(url: str) -> str:
    """Where `url` lives under a cache root: ``host_port/its/path``, made of safe names
    only, so no URL can point outside the cache."""
    parts = urllib.parse.urlsplit(url)
    host = _UNSAFE.sub("_", parts.hostname or "host") + (f"_{parts.port}" if parts.port else "")
    pieces = [host]
    for piece in parts.path.split("/"):
        if piece in ("", ".", ".."):
            continue
        pieces.append(_UNSAFE.sub("_", piece))
    if parts.query:  # same path, other query: another object
        digest = hashlib.sha1(parts.query.encode()).hexdigest()[:12]
        stem, ext = os.path.splitext(pieces[-1])
        pieces[-1] = f"{stem}-{digest}{ext}"
    for i, piece in enumerate(pieces):
        if len(piece) > 150:
            digest = hashlib.sha1(piece.encode()).hexdigest()[:12]
            stem, ext = os.path.splitext(piece)
            pieces[i] = f"{stem[:100]}-{digest}{ext[:40]}"
        if pieces[i].startswith("."):
            pieces[i] = "_" + pieces[i][1:]
    return os.path.join(*pieces)


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


@dataclass
class Hold:
    """A shard this process holds: a descriptor with a shared lock, so nobody evicts it."""

    path: str
    fd: int
    identity: tuple[int, int, int]  # (inode, size, mtime_ns), as the reader checks them
    count: int = 1


class ShardCache:
    """A cache directory shared by every process on the node, each keeping it within the
    limit it was given (``limit`` arguments).

    Within a process one object per directory (see :func:`cache_for`) counts holds, since
    one lock per file per process is enough.
    """

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        _private_dirs(os.path.join(self.root, _LOCKS))
        self._holds: dict[str, Hold] = {}
        self._mutex = threading.Lock()
        self._pid = os.getpid()

    def default_limit(self) -> int:
        """With no cache_limit: what is cached now plus the disk's free space, less a tenth
        of the disk, so the cache never fills it."""
        st = os.statvfs(self.root)
        reserve = st.f_blocks * st.f_frsize // 10
        return max(self.usage() + st.f_bavail * st.f_frsize - reserve, 0)

    # -- paths and locks ----------------------------------------------------------

    def path_of(self, name: str) -> str:
        return os.path.join(self.root, name)

    def _lock_file(self, path: str) -> str:
        rel = os.path.relpath(path, self.root)
        return os.path.join(self.root, _LOCKS, hashlib.sha1(rel.encode()).hexdigest()[:24])

    @contextlib.contextmanager
    def _locked(self, lock_path: str, what: str, deadline: float) -> Iterator[None]:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            _lock_polling(fd, True, deadline, what)
            yield
        finally:
            os.close(fd)  # the lock goes with the descriptor

    def _cache_lock(self, deadline: float) -> contextlib.AbstractContextManager[None]:
        return self._locked(os.path.join(self.root, _LOCKS, "cache"), self.root, deadline)

    # -- holding ------------------------------------------------------------------

    def hold(self, path: str, size: int | None) -> Hold | None:
        """Hold the complete shard at `path` if it is there (and `size` bytes); None if not."""
        with self._mutex:
            self._after_fork()
            held = self._holds.get(path)
            if held is not None:
                held.count += 1
                return held
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            _lock_polling(fd, False, time.monotonic() + 60, path)
            st = os.fstat(fd)
            try:
                now = os.stat(path)
            except FileNotFoundError:
                now = None
            # Evicted between our open and our lock: it is gone, whatever fd says.
            if now is None or (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):
                os.close(fd)
                return None
            if size is not None and st.st_size != size:
                raise located(
                    StokerError,
                    path,
                    min(st.st_size, size),
                    f"cached shard has {st.st_size} bytes, {size} expected: delete it",
                )
            # atime orders eviction (mtime is part of the identity reads check).
            os.utime(path, ns=(time.time_ns(), st.st_mtime_ns))
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        return self._keep(path, fd, st)

    def _keep(self, path: str, fd: int, st: os.stat_result) -> Hold:
        hold = Hold(path, fd, (st.st_ino, st.st_size, st.st_mtime_ns))
        with self._mutex:
            held = self._holds.get(path)
            if held is not None:  # another thread got there first: keep one lock
                held.count += 1
                os.close(fd)
                return held
            self._holds[path] = hold
        return hold

    def release(self, path: str) -> bool:
        """Let go of one hold of `path`; True when this process no longer holds it."""
        with self._mutex:
            self._after_fork()
            held = self._holds.get(path)
            if held is None:
                return True
            held.count -= 1
            if held.count > 0:
                return False
            del self._holds[path]
        os.close(held.fd)
        return True

    def held(self) -> list[str]:
        with self._mutex:
            self._after_fork()
            return list(self._holds)

    def _after_fork(self) -> None:
        # A forked child inherits the parent's descriptors and with them its locks;
        # they are the parent's to release, so the child forgets them (and closes its
        # copies, which leaves the parent's locks in place).
        if self._pid != os.getpid():
            for hold in self._holds.values():
                with contextlib.suppress(OSError):
                    os.close(hold.fd)
            self._holds = {}
            self._pid = os.getpid()

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
    ) -> Hold:
        """Hold the shard `url` at `path`, downloading it if no one has: one download per
        node, whoever else wants it waits for it."""
        deadline = time.monotonic() + fetcher.options.cache_wait
        while True:
            hold = self.hold(path, size)
            if hold is not None:
                return hold
            lock_path = self._lock_file(path)
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                if not _try_lock(fd, True):  # someone is downloading it: wait for them
                    _lock_polling(fd, True, deadline, f"{url}: waiting for its download")
                    continue  # their download is done (or they died): look again
                hold = self.hold(path, size)
                if hold is not None:
                    return hold
                return self._download(url, path, size, sha256, fetcher, limit, progress, deadline)
            finally:
                os.close(fd)

    def _download(
        self,
        url: str,
        path: str,
        size: int,
        sha256: str | None,
        fetcher: Fetcher,
        limit: int,
        progress: Callable[[int], None] | None,
        deadline: float,
    ) -> Hold:
        part = path + _PART
        fd = self._reserve(part, size, limit, deadline, url)
        done = False
        try:
            fetcher.call(fetcher.download(url, fd, size, sha256, progress))
            os.fsync(fd)  # a cached shard survives a crash whole, or not at all
            os.close(fd)
            fd = os.open(part, os.O_RDONLY | os.O_CLOEXEC)
            if not _try_lock(fd, False):  # pragma: no cover - nobody else knows the part
                raise StokerError(f"{part}: locked while being downloaded")
            os.rename(part, path)
            done = True
            return self._keep(path, fd, os.fstat(fd))
        except OSError as e:
            if isinstance(e, StokerError):
                raise
            raise located(
                FetchError, url, 0, f"cannot write the cache file {part}: {e.strerror or e}"
            ) from e
        finally:
            if not done:
                with contextlib.suppress(OSError):
                    os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(part)

    def _reserve(self, part: str, size: int, limit: int, deadline: float, url: str) -> int:
        """Make room for `size` bytes (evicting least recently used shards no one holds)
        and create `part` at its full size, so other processes count it."""
        if size > limit:
            raise StokerError(f"{url}: the shard is {size} bytes, more than cache_limit={limit}")
        waited = False
        started = time.monotonic()
        while True:
            with self._cache_lock(deadline):
                used = self._evict_for(size, limit)
                if used + size <= limit:
                    _private_dirs(os.path.dirname(part))
                    fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                    try:
                        _preallocate(fd, size)
                    except OSError as e:
                        os.close(fd)
                        with contextlib.suppress(OSError):
                            os.unlink(part)
                        raise located(
                            FetchError,
                            url,
                            0,
                            f"no room for {size} bytes in the cache {self.root}: {e.strerror or e}",
                        ) from e
                    return fd
            if time.monotonic() > deadline:
                raise StokerError(
                    f"{url}: cache {self.root} is full ({used} of {limit} bytes) of "
                    f"shards in use; waited {time.monotonic() - started:.0f} s for room for {size} "
                    "bytes: raise cache_limit, or run fewer processes on it"
                )
            if not waited:
                log.info("%s: cache full of shards in use; waiting for room", self.root)
                waited = True
            time.sleep(0.05)

    def usage(self) -> int:
        """Bytes in the cache: complete shards and downloads in flight."""
        return sum(size for _, size, _ in self._files())

    def _files(self) -> list[tuple[str, int, int]]:
        out = []
        for folder, dirs, files in os.walk(self.root):
            if folder == self.root:
                dirs[:] = [d for d in dirs if d != _LOCKS]
            for name in files:
                path = os.path.join(folder, name)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                out.append((path, st.st_size, st.st_atime_ns))
        return out

    def _evict_for(self, size: int, limit: int) -> int:
        """Under the cache lock: remove orphaned downloads, then least recently used
        unheld shards until `size` more bytes fit. Returns the bytes then in use."""
        files = self._files()
        used = sum(s for _, s, _ in files)
        for path, s, _ in files:
            if path.endswith(_PART) and self._orphaned(path):
                used -= s
        if used + size <= limit:
            return used
        held = set(self.held())
        for path, s, _ in sorted(
            (f for f in files if not f[0].endswith(_PART)), key=lambda f: f[2]
        ):
            if used + size <= limit:
                break
            if path in held:
                continue
            if self._evict(path):
                used -= s
        return used

    def _orphaned(self, part: str) -> bool:
        """A partial download whose downloader is gone: removed (True) or not."""
        fd = os.open(
            self._lock_file(part[: -len(_PART)]), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
        )
        try:
            if not _try_lock(fd, True):
                return False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(part)
            log.info("removed %s, left by a download that did not finish", part)
            return True
        finally:
            os.close(fd)

    def _evict(self, path: str) -> bool:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return True
        try:
            if not _try_lock(fd, True):  # some process holds it
                return False
            os.unlink(path)
            log.debug("evicted %s", path)
            return True
        finally:
            os.close(fd)


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
_caches_lock = threading.Lock()


def cache_for(root: str) -> ShardCache:
    """The process's ShardCache for `root`: one per directory, so holds are counted once."""
    root = os.path.abspath(root)
    with _caches_lock:
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


def _reset_locks_after_fork() -> None:
    global _fetchers_lock, _caches_lock, _executor
    _fetchers_lock = threading.Lock()
    _caches_lock = threading.Lock()
    _executor = None  # its threads do not exist in the child
    for cache in _caches.values():
        cache._mutex = threading.Lock()
        cache._after_fork()


# -- one dataset's remote shards ----------------------------------------------------


@dataclass
class RemoteShard:
    url: str
    name: str  # where it lives under the cache root
    format: str
    size: int | None = None
    sha256: str | None = None
    samples: int | None = None
    fields: list[str] | None = None


_executor: concurrent.futures.ThreadPoolExecutor | None = None
_executor_pid = 0


def _acquire_pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    # Threads that wait for shards (locks, downloads); the network work itself is on the
    # event loop. One pool per process, made again in a forked child.
    global _executor, _executor_pid
    with _caches_lock:
        if _executor is None or _executor_pid != os.getpid():
            _executor = concurrent.futures.ThreadPoolExecutor(workers, "stoker-shards")
            _executor_pid = os.getpid()
        return _executor


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
        self.cache_dir = os.fspath(cache_dir) if cache_dir is not None else None
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
            self._cache = cache_for(self.cache_dir or default_cache_root())
        return self._cache

    @property
    def limit(self) -> int:
        if self._limit is None:
            self._limit = (
                int(self.cache_limit)
                if self.cache_limit is not None
                else self.cache.default_limit()
            )
        return self._limit

    @property
    def fetcher(self) -> Fetcher:
        return fetcher_for(self.options)

    def describe(self, probe_threads: int) -> None:
        """Learn each shard's size and samples that no manifest gave: a manifest beside the
        shards if there is one, else the headers, read with range requests."""
        from stoker import _core

        missing = [s for s in self.shards if s.size is None or s.samples is None]
        if not missing:
            return
        fetcher = self.fetcher
        self._adopt_manifests(missing)
        missing = [s for s in missing if s.size is None or s.samples is None]
        if missing:
            log.info(
                "%d remote shard(s) have no manifest entry: reading their headers with range "
                "requests (write a stoker.json beside them to skip this)",
                len(missing),
            )

        def probe(shard: RemoteShard) -> None:
            if shard.size is None:
                shard.size = fetcher.call(fetcher.size_of(shard.url))
                if shard.size is None:
                    raise located(FetchError, shard.url, 0, "the server does not say its size")
            if shard.samples is None:

                def read(offset: int, length: int) -> bytes:
                    return fetcher.call(fetcher.read_range(shard.url, offset, length))

                index = _core.index_remote(shard.url, shard.size, shard.format, read, PROBE_WINDOW)
                if shard.format == "npy":
                    shard.samples = int(index["shape"][0])
                    shard.fields = ["npy"]
                else:
                    shard.samples = len(index["keys"])
                    shard.fields = list(index["field_names"])

        with concurrent.futures.ThreadPoolExecutor(max(1, probe_threads)) as pool:
            for future in [pool.submit(probe, s) for s in missing]:
                future.result()

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
                data = fetcher.call(fetcher.read_all(url))
                listed = dict(parse_manifest(data, url))
            except (FetchError, StokerError) as e:
                if getattr(e, "status", None) not in (None, 401, 403, 404, 410):
                    raise
                log.debug("%s: no manifest (%s)", url, e)
                continue
            for shard in members:
                entry = listed.get(shard.url)
                if entry is None:
                    continue
                shard.size = entry.get("bytes", shard.size)
                shard.samples = entry.get("samples", shard.samples)
                shard.sha256 = entry.get("sha256", shard.sha256)
                if isinstance(entry.get("fields"), list):
                    shard.fields = list(entry["fields"])

    def cache_need(self, shards: int) -> int:
        """Bytes the largest `shards` shards take: what holding that many at once needs."""
        sizes = sorted((s.size or 0 for s in self.shards), reverse=True)
        return sum(sizes[:shards])

    # -- acquire / release --------------------------------------------------------

    def acquire(self, i: int, progress: Callable[[int], None] | None = None) -> Hold:
        """Hold shard `i` in the cache, fetching it if needed (blocks)."""
        shard = self.shards[i]
        assert shard.size is not None
        path = self.cache.path_of(shard.name)
        return self.cache.fetch(
            shard.url, path, shard.size, shard.sha256, self.fetcher, self.limit, progress
        )

    def start(self, i: int, then: Callable[[Hold], Any] | None = None) -> concurrent.futures.Future:
        """acquire(i) (then `then(hold)`) on the process's shard threads."""

        def task() -> Any:
            hold = self.acquire(i)
            return then(hold) if then is not None else hold

        return _acquire_pool(self.options.connections).submit(task)

    def release(self, i: int) -> bool:
        return self.cache.release(self.cache.path_of(self.shards[i].name))


os.register_at_fork(after_in_child=_reset_locks_after_fork)
