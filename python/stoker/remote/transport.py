"""The way to a remote object: aiohttp on one background event-loop thread per process,
its session, and a request sent as a server or store needs it (signed for a store,
percent-encoded once, redirects kept to https). What is asked, and how often it is tried
again, is the fetcher's (:mod:`.http`)."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import re
import threading
import urllib.parse
from typing import Any

from stoker._process import wait_result
from stoker.errors import FetchError, StokerError, UsageError, clip, located
from stoker.remote.options import FetchOptions
from stoker.remote.stores import ObjectName, ObjectStore, is_object_url, without_signature
from stoker.remote.turns import Turns

log = logging.getLogger("stoker.remote")


class Transport:
    """aiohttp on a background event loop: the blocking bridge to it for the threads that
    need a shard (submit, call), and one request at a time, sent right."""

    def __init__(self, options: FetchOptions) -> None:
        import aiohttp  # imported with the first fetcher, not with stoker
        import yarl

        self.options = options
        self._aiohttp = aiohttp
        self._yarl = yarl
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="stoker-fetch")
        self._thread.daemon = True
        self._thread.start()
        self._session = self.call(self._open_session())
        self._turns = Turns(self._loop, options.connections)
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
        return self._turns.allowed

    def note_rangeless(self, url: str) -> None:
        host = host_of(url)
        if host not in self.rangeless:
            self.rangeless.add(host)
            log.info(
                "%s ignores range requests: its shards are downloaded whole into the cache "
                "and indexed there",
                host,
            )

    @contextlib.asynccontextmanager
    async def _request(
        self,
        url: str,
        headers: dict[str, str] | None = None,
        method: str = "GET",
        target: str | None = None,
        body: Any = None,
    ) -> Any:
        """A request for `url`: an http(s) URL, sent as given, or an object in a store,
        sent to its https URL (or to `target`, a request of the store's that is not an
        object's: a listing), signed. `body`: what a PUT sends (an open file, streamed)."""
        yarl = self._yarl
        headers = dict(headers or {})
        redirects = True
        if is_object_url(url):
            store = self.store_of(url)
            target = target or store.url_of(ObjectName.parse(url))
            try:
                headers = await store.sign(method, target, headers, body)
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
            data=body,
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


#: A URL with nothing left to percent-encode (what a signer produced, say).
_ENCODED = re.compile(r"(?:[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=]|%[0-9A-Fa-f]{2})*")


def host_of(url: str) -> str:
    """What a server is known by: host and port (a bucket, for a store)."""
    if is_object_url(url):
        return url.partition("://")[0] + "://" + ObjectName.parse(url).bucket
    return urllib.parse.urlsplit(url).netloc
