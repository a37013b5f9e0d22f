"""When a transfer is tried again: what may pass on a retry (connection errors, stalls,
short bodies, 5xx, 408, 429, a store's SlowDown), and how long to wait before it
(exponential backoff with full jitter, or what the server's ``Retry-After`` asks)."""

from __future__ import annotations

import asyncio
import datetime
import email.utils
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from stoker.errors import FetchError, clip, located, plural
from stoker.remote.options import FetchOptions

log = logging.getLogger("stoker.remote")

T = TypeVar("T")


class Retryable(Exception):
    """An attempt failed in a way another attempt may not: `delay`, the seconds the
    server asked for (None: the usual backoff)."""

    def __init__(self, cause: str, delay: float | None = None) -> None:
        super().__init__(cause)
        self.delay = delay


def retry_delay(options: FetchOptions, attempt: int) -> float:
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


def connection_error(url: str, offset: int, what: str) -> FetchError:
    """A FetchError of the connection's (no answer, or no HTTP in what came back), marked
    ``transport``: the server never said anything of the object."""
    error = located(FetchError, url, offset, what)
    error.transport = True  # type: ignore[attr-defined]
    return error


async def with_retries(
    url: str,
    offset: Callable[[], int],
    attempt: Callable[[], Awaitable[T]],
    options: FetchOptions,
) -> T:
    """Await `attempt()` until it succeeds, retrying what may pass; FetchError after (an
    error of the connection's: see connection_error; one about what the server answered
    comes from `attempt`). `offset()`: where the transfer stands, for the error."""
    import aiohttp  # imported with the first transfer, not with stoker

    last = "no attempt made"
    for n in range(options.retries + 1):
        delay: float | None = None
        try:
            return await attempt()
        except Retryable as e:
            last, delay = str(e), e.delay
        except asyncio.TimeoutError:  # aiohttp's socket timeouts are these too
            last = f"stalled: no data for {options.stall_timeout:g} s"
        except asyncio.IncompleteReadError as e:
            last = f"short body: {len(e.partial)} of {e.expected} bytes"
        except (aiohttp.ClientConnectorCertificateError, aiohttp.ClientSSLError) as e:
            raise connection_error(url, offset(), f"TLS: {clip(str(e))}") from e
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as e:
            last = f"{type(e).__name__}: {clip(str(e))}" if str(e) else type(e).__name__
        except aiohttp.TooManyRedirects as e:
            raise connection_error(url, offset(), f"too many redirects: {clip(str(e))}") from e
        except aiohttp.RedirectClientError as e:
            what = f"refused redirect (only http(s) is followed): {clip(str(e))}"
            raise connection_error(url, offset(), what) from e
        except aiohttp.ClientResponseError as e:
            # Raised before there is a response (stoker reads statuses itself): what
            # came back is not HTTP, a fault of the connection (a broken proxy, a
            # kept-alive connection the server half closed), not the server's answer.
            # aiohttp drops that connection; the retry takes a fresh one.
            last = f"not an HTTP response ({clip(e.message)})"
        except aiohttp.ClientError as e:
            raise connection_error(url, offset(), f"{type(e).__name__}: {clip(str(e))}") from e
        if n < options.retries:
            backoff = retry_delay(options, n)
            wait = max(delay, backoff) if delay is not None else backoff
            log.info("%s: %s; retry %d/%d in %.2f s", url, last, n + 1, options.retries, wait)
            await asyncio.sleep(wait)
    what = f"gave up after {plural(options.retries + 1, 'attempt')}; last: {last}"
    raise connection_error(url, offset(), what)
