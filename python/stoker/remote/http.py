"""HTTP transfers of remote objects: a look (size, version, ranges), a range, a small
whole body, a listing, and a whole shard written into a file.

Every transfer retries connection errors, 5xx, 429 (after ``Retry-After``), stalls and
short bodies with exponential backoff and jitter (:mod:`.retry`), and a download resumes
a partial body with a Range request where the server allows it. Objects in stores
(``s3://``, ``gs://``) go the same way, with each request signed (:mod:`.stores`); a store
that keeps throttling gets fewer downloads at once (:mod:`.turns`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stoker._process import per_process
from stoker.errors import ChecksumError, FetchError, clip, located
from stoker.remote.options import FetchOptions
from stoker.remote.retry import Retryable, retry_after_seconds, with_retries
from stoker.remote.stores import (
    AUTH_CODES,
    THROTTLE_CODES,
    ObjectName,
    is_object_url,
    parse_listing,
    store_error,
)
from stoker.remote.transport import Transport, host_of

#: Ranges of one file asked for at once (see Fetcher.download_ranges).
RANGES_AT_ONCE = 4


@dataclass(frozen=True)
class RemoteObject:
    """What one look at a remote object says: its size, what identifies this version of
    it (a strong ETag, else Last-Modified), and whether its server takes ranges (None:
    it did not say)."""

    size: int | None
    validator: str | None
    ranges: bool | None


class Fetcher(Transport):
    """The transfers of remote objects, on the transport's event loop: coroutines, run
    from a thread that needs a shard with `call`."""

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
            self._turns.throttled(host_of(url), f"{reason}" + (f" {code}" if code else ""))
        retry = status in (408, 429) or status >= 500 or code in THROTTLE_CODES
        if retry and code not in AUTH_CODES:
            raise Retryable(
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

    async def stat(self, url: str) -> RemoteObject:
        """One look at `url`: HEAD where it can be trusted to be served (a plain URL),
        else a one-byte ranged GET (a URL signed for GET, an object in a store, whose
        error bodies say what is wrong)."""

        async def by_head() -> RemoteObject | None:
            async with self._request(url, method="HEAD") as response:
                if response.status in (400, 403, 405, 501):
                    return None  # no HEAD here: ask with a GET
                await self._check_response(url, 0, response)
                accept = response.headers.get("Accept-Ranges", "").strip().lower()
                ranges = True if "bytes" in accept else (False if accept == "none" else None)
                if ranges is False:
                    self.note_rangeless(url)
                return RemoteObject(response.content_length, _validator(response), ranges)

        async def by_range() -> RemoteObject:
            async with self._request(url, {"Range": "bytes=0-0"}) as response:
                await self._check_response(url, 0, response)
                if response.status == 200:
                    self.note_rangeless(url)
                ranged = response.status == 206
                return RemoteObject(_total_size(response), _validator(response), ranged)

        if not is_object_url(url) and not urllib.parse.urlsplit(url).query:
            found = await with_retries(url, lambda: 0, by_head, self.options)
            if found is not None and found.size is not None:
                return found
        return await with_retries(url, lambda: 0, by_range, self.options)

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
                async with self._request(url, target=target) as response:
                    await self._check_response(url, 0, response)
                    return await response.read()

            last = token
            objects, token = parse_listing(
                await with_retries(url, lambda: 0, attempt, self.options), url
            )
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
            async with self._request(url, headers) as response:
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
                            raise Retryable(f"short body: {skipped} of {offset + length} bytes")
                        skipped += len(chunk)
                return await response.content.readexactly(length)

        return await with_retries(url, lambda: offset, attempt, self.options)

    async def read_all(self, url: str, limit: int = 64 << 20) -> bytes:
        """The whole body of a small resource (a manifest)."""

        async def attempt() -> bytes:
            async with self._request(url) as response:
                await self._check_response(url, 0, response)
                parts, got = [], 0
                async for chunk in response.content.iter_chunked(1 << 20):
                    got += len(chunk)
                    if got > limit:
                        raise located(FetchError, url, limit, f"larger than {limit} bytes")
                    parts.append(chunk)
                expected = response.content_length
                if expected is not None and got != expected:
                    raise Retryable(f"short body: {got} of {expected} bytes")
                return b"".join(parts)

        return await with_retries(url, lambda: 0, attempt, self.options)

    async def upload(self, url: str, path: str) -> None:
        """The file `path` put at `url` (an object in a store) in one request: the store
        shows the object whole, once it has all of it, or not at all."""
        size = os.path.getsize(path)

        async def attempt() -> None:
            with open(path, "rb") as body:
                headers = {"Content-Length": str(size)}
                async with self._request(url, headers, method="PUT", body=body) as response:
                    await self._check_response(url, 0, response)

        await with_retries(url, lambda: 0, attempt, self.options)

    async def delete(self, url: str) -> None:
        """The object `url` removed (one already gone is no error)."""

        async def attempt() -> None:
            async with self._request(url, method="DELETE") as response:
                if response.status not in (204, 404):
                    await self._check_response(url, 0, response)

        await with_retries(url, lambda: 0, attempt, self.options)

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
            async with self._request(url, headers) as response:
                await self._check_response(url, state["got"], response)
                if response.status == 206 and state["got"]:
                    start = _range_start(response)
                    if start != state["got"]:
                        raise Retryable(f"resumed at {start}, not {state['got']}")
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
                await _write_body(url, response, fd, state, size, progress, state["hash"])
            if state["got"] < size:
                raise Retryable(f"short body: {state['got']} of {size} bytes")
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
                raise Retryable(f"sha256 {digest} does not match the manifest's {sha256}")

        try:
            async with self._turns.turn(priority):
                await with_retries(url, lambda: state["got"], attempt, self.options)
                self._turns.passed()
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

    async def download_ranges(
        self,
        url: str,
        fd: int,
        ranges: list[tuple[int, int]],
        size: int,
        version: str | None,
        progress: Callable[[int], None] | None = None,
        priority: tuple[int, int] = (0, 0),
    ) -> None:
        """Write the (start, end) byte `ranges` of `url` into `fd` at their own offsets:
        a file cached in part. Each response must be of the object of `size` bytes and,
        where both say one, of `version` (its ETag or Last-Modified when first looked
        at), so that no copy mixes two versions. A range broken off is asked for again
        from where it stopped."""
        fd = os.dup(fd)  # (see download)

        async def fetch(start: int, end: int) -> None:
            state = {"got": start}

            async def attempt() -> None:
                at = state["got"]
                headers = _pinned(url, version, {"Range": f"bytes={at}-{end - 1}"})
                async with self._request(url, headers) as response:
                    await self._check_response(url, at, response)
                    if response.status != 206 or _range_start(response) != at:
                        self.note_rangeless(url)
                        raise located(
                            FetchError, url, at, "the server no longer answers range requests"
                        )
                    total = _total_size(response)
                    now = _validator(response)
                    if (total is not None and total != size) or (
                        version and now and comparable_version(now) != comparable_version(version)
                    ):
                        raise located(
                            FetchError,
                            url,
                            at,
                            "the file changed on the server since it was first looked at "
                            f"({total} bytes, version {now}; it was {size} bytes, {version})",
                        )
                    await _write_body(url, response, fd, state, end, progress)
                if state["got"] < end:
                    raise Retryable(f"short body: {state['got'] - start} of {end - start} bytes")

            await with_retries(url, lambda: state["got"], attempt, self.options)

        # A few ranges at once: a file's column chunks are many short requests, which
        # one at a time would leave the link idle for a round trip each.
        at_once = asyncio.Semaphore(RANGES_AT_ONCE)

        async def fetch_one(start: int, end: int) -> None:
            async with at_once:
                await fetch(start, end)

        try:
            async with self._turns.turn(priority):
                tasks = [asyncio.ensure_future(fetch_one(a, b)) for a, b in ranges]
                try:
                    await asyncio.gather(*tasks)
                finally:
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                self._turns.passed()
        finally:
            os.close(fd)


async def _write_body(
    url: str,
    response: Any,
    fd: int,
    state: dict[str, Any],
    end: int,
    progress: Callable[[int], None] | None,
    digest: Any = None,
) -> None:
    """The body of `response` written into `fd` from byte ``state["got"]`` of the file on,
    which follows it; `end`: the byte it must not run past. `digest` is updated with it."""
    async for chunk in response.content.iter_chunked(1 << 20):
        got = state["got"]
        if got + len(chunk) > end:
            what = f"the body runs past byte {end}, where it was to end"
            raise located(FetchError, url, got, what)
        write_all_at(fd, chunk, got)
        if digest is not None:
            digest.update(chunk)
        state["got"] = got + len(chunk)
        if progress:
            progress(len(chunk))


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


def comparable_version(validator: str | None) -> str | None:
    """An ETag or Last-Modified as compared: a listing and a response may quote an ETag
    differently, or mark it weak."""
    if validator is None:
        return None
    return (validator[2:] if validator.startswith("W/") else validator).strip().strip('"')


def write_all_at(fd: int, data: bytes | memoryview, offset: int) -> None:
    """All of `data` written into `fd` at `offset`."""
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
