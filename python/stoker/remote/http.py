"""HTTP transfers: aiohttp on one background event-loop thread per process.

Every transfer retries connection errors, 5xx, 429 (after ``Retry-After``), stalls and
short bodies with exponential backoff and jitter, and resumes a partial body with a Range
request where the server allows it.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import datetime
import email.utils
import hashlib
import heapq
import logging
import math
import os
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stoker._process import per_process, wait_result
from stoker.errors import ChecksumError, FetchError, clip, located, plural

log = logging.getLogger("stoker.remote")


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


def retry_after_seconds(value: str | None, options: FetchOptions) -> float | None:
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
                reason, retry_after_seconds(response.headers.get("Retry-After"), self.options)
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


def fetcher_for(options: FetchOptions) -> Fetcher:
    """The process's Fetcher for `options`; a forked child makes its own (the parent's loop
    thread does not exist there)."""
    return per_process(("fetcher", options), lambda: Fetcher(options))
