"""HTTP transfers: aiohttp on one background event-loop thread per process.

Every transfer retries connection errors, 5xx, 429 (after ``Retry-After``), stalls and
short bodies with exponential backoff and jitter, and resumes a partial body with a Range
request where the server allows it. Objects in stores (``s3://``, ``gs://``) go the same
way, with each request signed (:mod:`.stores`); a store that keeps throttling gets fewer
downloads at once.
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
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stoker._process import per_process, wait_result
from stoker.errors import (
    ChecksumError,
    FetchError,
    StokerError,
    UsageError,
    clip,
    located,
    plural,
)
from stoker.remote.stores import (
    AUTH_CODES,
    THROTTLE_CODES,
    ObjectName,
    ObjectStore,
    is_object_url,
    parse_listing,
    store_error,
    without_signature,
)

log = logging.getLogger("stoker.remote")


@dataclass(frozen=True)
class FetchOptions:
    """How remote shards are fetched: ``stoker.Dataset(url, fetch=FetchOptions(...))``.
    The defaults suit a data-centre link.

    Connection errors, 5xx, 408, 429, stalls and short bodies are retried with
    exponential backoff and full jitter; a broken body resumes with a ``Range`` request
    where the server takes ranges. Other 4xx fail at once.

    Args:
        connections: Transfers at once, per process.
        retries: Attempts after the first, per transfer.
        backoff: The first retry's delay in seconds; doubled at each retry, and drawn
            uniformly below that (full jitter).
        max_backoff: The longest delay between retries, in seconds.
        max_retry_after: A server's ``Retry-After`` is honoured up to this many seconds.
        stall_timeout: Seconds without a byte after which a transfer is retried.
        connect_timeout: Seconds to wait for a connection.
        max_redirects: Redirects followed, to http(s) URLs only.
        allow_insecure_redirects: Follow a redirect from https to plain http (refused by
            default, with a FetchError naming both URLs).
        cache_wait: Seconds to wait for room in a full cache before failing.
        endpoint_url: ``s3://``: the store's endpoint (R2, MinIO, Ceph, SeaweedFS...);
            else ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL`` or ``S3_ENDPOINT_URL``,
            else AWS. A custom endpoint is addressed path-style.
        region: ``s3://``: the region; else ``AWS_REGION``, ``AWS_DEFAULT_REGION``, the
            profile's, else ``us-east-1``.
        profile: The botocore profile to take credentials from (else ``AWS_PROFILE``);
            for ``gs://``, the profile whose HMAC keys sign when ``GS_ACCESS_KEY_ID`` /
            ``GS_SECRET_ACCESS_KEY`` are not set.
        unsigned: Send requests without credentials (public buckets).
        requester_pays: Ask for requester-pays buckets' objects (the requester is
            billed).
        gs_endpoint_url: ``gs://``: the endpoint of Google Cloud Storage's XML API, by
            default ``https://storage.googleapis.com``.
    """

    connections: int = 16  # transfers at once, per process
    retries: int = 6  # attempts after the first, per transfer
    backoff: float = 0.25  # first retry's delay (s); doubled each time, with full jitter
    max_backoff: float = 20.0
    max_retry_after: float = 120.0  # a server's Retry-After is honoured up to this (s)
    stall_timeout: float = 30.0  # no byte for this long: the transfer is retried
    connect_timeout: float = 10.0
    max_redirects: int = 5
    # A redirect from https to plain http is refused unless this is set: what the http
    # answer says (sizes, bytes) could come from anyone on the path.
    allow_insecure_redirects: bool = False
    cache_wait: float = 600.0  # how long to wait for room in a full cache before failing
    # Object stores. s3://: the endpoint (else AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL,
    # S3_ENDPOINT_URL, else AWS itself), the region (else AWS_REGION, AWS_DEFAULT_REGION,
    # the profile's), the botocore profile (else AWS_PROFILE). gs://: the endpoint (else
    # storage.googleapis.com). unsigned: no credentials (public buckets).
    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    unsigned: bool = False
    requester_pays: bool = False
    gs_endpoint_url: str | None = None


@dataclass(frozen=True)
class RemoteObject:
    """What one look at a remote object says: its size, what identifies this version of
    it (a strong ETag, else Last-Modified), and whether its server takes ranges (None:
    it did not say)."""

    size: int | None
    validator: str | None
    ranges: bool | None


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
        import yarl

        self.options = options
        self._aiohttp = aiohttp
        self._yarl = yarl
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="stoker-fetch")
        self._thread.daemon = True
        self._thread.start()
        self._session = self.call(self._open_session())
        # Whole-shard downloads take turns for the connections in priority order (loop
        # thread only): the shard a reader waits for goes before read-ahead. A store that
        # throttles lowers `_cap` (halved, at most once a second); downloads that pass
        # raise it again, one at a time.
        self._cap = options.connections
        self._active = 0
        self._last_cut = -math.inf
        self._calm = 0
        self._turns: list[tuple[tuple[int, int], int, asyncio.Future]] = []
        self._arrivals = 0
        self._stores: dict[str, ObjectStore] = {}
        self._stores_lock = threading.Lock()
        #: Hosts that answered a range request with the whole body (host:port).
        self.rangeless: set[str] = set()
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

    def store_of(self, url: str) -> ObjectStore:
        """The store an ``s3://`` or ``gs://`` URL is in, as this process reaches it."""
        scheme = url.partition("://")[0]
        with self._stores_lock:
            store = self._stores.get(scheme)
            if store is None:
                store = self._stores[scheme] = ObjectStore(scheme, self.options)
            return store

    def cache_url(self, url: str) -> str:
        """What names `url`'s object in the cache: an object in a store by its https URL
        (the endpoint is part of its name), any URL less the parameters that sign it."""
        if is_object_url(url):
            return self.store_of(url).url_of(ObjectName.parse(url))
        return without_signature(url)

    @property
    def concurrency(self) -> int:
        """Downloads allowed at once now (fewer than `connections` after throttling)."""
        return self._cap

    @contextlib.asynccontextmanager
    async def _turn(self, priority: tuple[int, int]) -> Any:
        if self._active < self._cap and not self._turns:
            self._active += 1
        else:
            waiter = self._loop.create_future()
            self._arrivals += 1
            heapq.heappush(self._turns, (priority, self._arrivals, waiter))
            try:
                await waiter  # whoever wakes us has counted us active
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._active -= 1  # it was handed over as we were cancelled
                    self._wake()
                raise
        try:
            yield
        finally:
            self._active -= 1
            self._wake()

    def _wake(self) -> None:
        while self._turns and self._active < self._cap:
            _, _, waiter = heapq.heappop(self._turns)
            if not waiter.done():
                self._active += 1
                waiter.set_result(None)

    def _throttled(self, url: str, why: str) -> None:
        """A store said "slow down": fewer downloads at once (halved, at most once a
        second, so that one burst of refusals counts once)."""
        now = self._loop.time()
        if self._cap <= 1 or now - self._last_cut < 1.0:
            return
        before, self._cap = self._cap, max(1, self._cap // 2)
        self._last_cut, self._calm = now, 0
        log.warning(
            "%s: the server is throttling (%s): %d downloads at once from now on, not %d",
            host_of(url),
            why,
            self._cap,
            before,
        )

    def _passed(self) -> None:
        """A download went through: after as many as are allowed at once, one more."""
        if self._cap >= self.options.connections:
            return
        self._calm += 1
        if self._calm >= self._cap:
            self._cap, self._calm = self._cap + 1, 0
            log.info("fetch: %d downloads at once again", self._cap)
            self._wake()

    def note_rangeless(self, url: str) -> None:
        host = host_of(url)
        if host not in self.rangeless:
            self.rangeless.add(host)
            log.info(
                "%s ignores range requests: its shards are downloaded whole into the cache "
                "and indexed there",
                host,
            )

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
            except aiohttp.ClientResponseError as e:
                # Raised before there is a response (stoker reads statuses itself): what
                # came back is not HTTP, a fault of the connection (a broken proxy, a
                # kept-alive connection the server half closed), not the server's answer.
                # aiohttp drops that connection; the retry takes a fresh one.
                last = f"not an HTTP response ({clip(e.message)})"
            except aiohttp.ClientError as e:
                raise failed(f"{type(e).__name__}: {clip(str(e))}") from e
            if n < o.retries:
                backoff = _retry_delay(o, n)
                wait = max(delay, backoff) if delay is not None else backoff
                log.info("%s: %s; retry %d/%d in %.2f s", url, last, n + 1, o.retries, wait)
                await asyncio.sleep(wait)
        raise failed(f"gave up after {plural(o.retries + 1, 'attempt')}; last: {last}")

    async def _check_response(self, url: str, offset: int, response: Any) -> None:
        """Raise what a response that is not the bytes asked for means: retry (5xx, 429,
        408, a store's SlowDown) or a FetchError in words (a store's error code
        explained: a wrong secret, a missing key)."""
        status = response.status
        if status in (200, 206):
            coding = response.headers.get("Content-Encoding", "identity").strip().lower()
            if coding not in ("", "identity"):
                what = f"the server sent a {coding}-encoded body, asked not to"
                raise located(FetchError, url, offset, what)
            return
        body = b""
        with contextlib.suppress(Exception):  # an error's body is small, and only a help
            body = await response.content.read(64 << 10)
        code, words = store_error(status, body)
        reason = f"HTTP {status} {clip(response.reason or '')}".strip()
        if code in THROTTLE_CODES or status in (429, 503):
            self._throttled(url, f"{reason}" + (f" {code}" if code else ""))
        retry = status in (408, 429) or status >= 500 or code in THROTTLE_CODES
        if retry and code not in AUTH_CODES:
            raise _Retryable(
                reason + (f" ({code})" if code else ""),
                retry_after_seconds(response.headers.get("Retry-After"), self.options),
            )
        region = response.headers.get("x-amz-bucket-region")
        if (
            region
            and status in (301, 307, 400)
            and is_object_url(url)
            and region != self.store_of(url).region
        ):
            words = f"the bucket is in region {region}: set AWS_REGION={region}"
        elif not words and status == 404:
            words = "not found"
        elif not words and status == 412:
            words = "the object changed since it was first looked at"
        error = located(FetchError, url, offset, f"{reason}: {words}" if words else reason)
        error.status = status  # type: ignore[attr-defined]
        error.code = code  # type: ignore[attr-defined]
        raise error

    @contextlib.asynccontextmanager
    async def _get(
        self,
        url: str,
        headers: dict[str, str] | None = None,
        method: str = "GET",
        target: str | None = None,
    ) -> Any:
        """A request for `url`: an http(s) URL, sent as given, or an object in a store,
        sent to its https URL (or to `target`, a request of the store's that is not an
        object's: a listing), signed."""
        yarl = self._yarl
        headers = dict(headers or {})
        redirects = True
        if is_object_url(url):
            store = self.store_of(url)
            target = target or store.url_of(ObjectName.parse(url))
            try:
                headers = await store.sign(method, target, headers)
            except StokerError as e:  # credentials that cannot be had: no retry helps
                kind = UsageError if isinstance(e, UsageError) else FetchError
                raise located(kind, url, 0, str(e)) from None
            # A signature is for one host: a redirect is an error that names the region.
            redirects = False
            sent = yarl.URL(target, encoded=True)
        elif _ENCODED.fullmatch(url):
            # Already percent-encoded: sent byte for byte, so that a presigned URL's
            # signature still matches what arrives.
            sent = yarl.URL(url, encoded=True)
        else:
            sent = yarl.URL(url)
        async with self._session.request(
            method,
            sent,
            headers=headers,
            allow_redirects=redirects,
            max_redirects=self.options.max_redirects,
        ) as response:
            if (
                sent.scheme == "https"
                and response.url.scheme != "https"
                and not self.options.allow_insecure_redirects
            ):
                what = (
                    f"redirected from https to {response.url.scheme}:// "
                    f"({clip(str(response.url))}): refused, since anyone on the path could "
                    "answer it; FetchOptions(allow_insecure_redirects=True) follows it"
                )
                raise located(FetchError, url, 0, what)
            yield response

    async def stat(self, url: str) -> RemoteObject:
        """One look at `url`: HEAD where it can be trusted to be served (a plain URL),
        else a one-byte ranged GET (a URL signed for GET, an object in a store, whose
        error bodies say what is wrong)."""

        async def by_head() -> RemoteObject | None:
            async with self._get(url, method="HEAD") as response:
                if response.status in (400, 403, 405, 501):
                    return None  # no HEAD here: ask with a GET
                await self._check_response(url, 0, response)
                accept = response.headers.get("Accept-Ranges", "").strip().lower()
                ranges = True if "bytes" in accept else (False if accept == "none" else None)
                if ranges is False:
                    self.note_rangeless(url)
                return RemoteObject(response.content_length, _validator(response), ranges)

        async def by_range() -> RemoteObject:
            async with self._get(url, {"Range": "bytes=0-0"}) as response:
                await self._check_response(url, 0, response)
                if response.status == 200:
                    self.note_rangeless(url)
                ranged = response.status == 206
                return RemoteObject(_total_size(response), _validator(response), ranged)

        if not is_object_url(url) and not urllib.parse.urlsplit(url).query:
            found = await self._attempts(url, lambda: 0, by_head)
            if found is not None and found.size is not None:
                return found
        return await self._attempts(url, lambda: 0, by_range)

    async def list_objects(self, url: str) -> list[tuple[str, int, str | None]]:
        """Every object under the prefix `url` (``s3://bucket/prefix``), page by page:
        (URL, size, ETag) each."""
        store = self.store_of(url)
        name = ObjectName.parse(url)
        found: list[tuple[str, int, str | None]] = []
        token: str | None = None
        while True:
            target = store.list_request(name, token)

            async def attempt(target: str = target) -> bytes:
                async with self._get(url, target=target) as response:
                    await self._check_response(url, 0, response)
                    return await response.read()

            last = token
            objects, token = parse_listing(await self._attempts(url, lambda: 0, attempt), url)
            found += [(f"{name.scheme}://{name.bucket}/{key}", n, etag) for key, n, etag in objects]
            if token is None:
                return found
            if token == last:
                raise located(FetchError, url, 0, "the listing repeats its continuation token")

    async def read_range(
        self, url: str, offset: int, length: int, version: str | None = None
    ) -> bytes:
        """Bytes [offset, offset + length) of `url` (of its `version`: see _pinned)."""
        if length == 0:
            return b""

        async def attempt() -> bytes:
            headers = _pinned(url, version, {"Range": f"bytes={offset}-{offset + length - 1}"})
            async with self._get(url, headers) as response:
                await self._check_response(url, offset, response)
                if response.status == 206:
                    start = _range_start(response)
                    if start != offset:
                        raise located(
                            FetchError, url, offset, f"asked for offset {offset}, got {start}"
                        )
                else:  # no ranges here: skip to the bytes wanted in the whole body
                    self.note_rangeless(url)
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
                await self._check_response(url, 0, response)
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
        version: str | None = None,
    ) -> str | None:
        """Write the `size` bytes of `url` into `fd` (from offset 0), checking the length and
        `sha256`. A broken transfer resumes where it stopped when the server takes ranges
        and the object provably did not change (a strong ETag or Last-Modified to send as
        If-Range, or a sha256 to check the whole with); otherwise it starts over. Returns
        what identifies the version written (ETag or Last-Modified). An object in a store
        is asked for as of `version`, the ETag it had when first looked at (see
        _pinned)."""
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
            headers = _pinned(url, version, {})
            if state["got"]:
                if state["since"] is None and sha256 is None:
                    restart()  # nothing proves the rest would be the same object
                else:
                    headers["Range"] = f"bytes={state['got']}-"
                    if state["since"] is not None:
                        headers["If-Range"] = state["since"]
            async with self._get(url, headers) as response:
                await self._check_response(url, state["got"], response)
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
                self._passed()
            return state["since"]
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


#: A URL with nothing left to percent-encode (what a signer produced, say).
_ENCODED = re.compile(r"(?:[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=]|%[0-9A-Fa-f]{2})*")


def host_of(url: str) -> str:
    """What a server is known by: host and port (a bucket, for a store)."""
    if is_object_url(url):
        return url.partition("://")[0] + "://" + ObjectName.parse(url).bucket
    return urllib.parse.urlsplit(url).netloc


def _pinned(url: str, version: str | None, headers: dict[str, str]) -> dict[str, str]:
    """`headers`, asking a store for the object only as of `version` (its ETag when it was
    looked at or listed): a store answers 412 once it changed, so no read mixes versions
    and what was learnt of it stays true. Only stores: a plain server's ETags may differ
    between the machines behind one name."""
    if version and is_object_url(url) and version.startswith('"'):
        headers["If-Match"] = version
    return headers


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
