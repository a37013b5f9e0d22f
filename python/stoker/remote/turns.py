"""Whole-shard downloads taking turns for a process's connections, in priority order (the
shard a reader waits for goes before read-ahead), fewer at once while a store throttles."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import math
from collections.abc import AsyncIterator

log = logging.getLogger("stoker.remote")


class Turns:
    """The downloads allowed at once: `connections`, halved (at most once a second) when a
    store throttles, raised again by one after as many downloads passed as are allowed.
    Used on the event loop's thread only."""

    def __init__(self, loop: asyncio.AbstractEventLoop, connections: int) -> None:
        self._loop = loop
        self._connections = connections
        self._cap = connections
        self._active = 0
        self._last_cut = -math.inf
        self._calm = 0
        self._waiting: list[tuple[tuple[int, int], int, asyncio.Future]] = []
        self._arrivals = 0

    @property
    def allowed(self) -> int:
        """Downloads allowed at once now."""
        return self._cap

    @contextlib.asynccontextmanager
    async def turn(self, priority: tuple[int, int]) -> AsyncIterator[None]:
        """A connection of one's own for the block, after those of lower `priority`."""
        if self._active < self._cap and not self._waiting:
            self._active += 1
        else:
            waiter = self._loop.create_future()
            self._arrivals += 1
            heapq.heappush(self._waiting, (priority, self._arrivals, waiter))
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
        while self._waiting and self._active < self._cap:
            _, _, waiter = heapq.heappop(self._waiting)
            if not waiter.done():
                self._active += 1
                waiter.set_result(None)

    def throttled(self, host: str, why: str) -> None:
        """`host` said "slow down": fewer downloads at once (one burst of refusals counts
        once)."""
        now = self._loop.time()
        if self._cap <= 1 or now - self._last_cut < 1.0:
            return
        before, self._cap = self._cap, max(1, self._cap // 2)
        self._last_cut, self._calm = now, 0
        log.warning(
            "%s: the server is throttling (%s): %d downloads at once from now on, not %d",
            host,
            why,
            self._cap,
            before,
        )

    def passed(self) -> None:
        """A download went through: after as many as are allowed at once, one more."""
        if self._cap >= self._connections:
            return
        self._calm += 1
        if self._calm >= self._cap:
            self._cap, self._calm = self._cap + 1, 0
            log.info("fetch: %d downloads at once again", self._cap)
            self._wake()
