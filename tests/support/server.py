"""The tests' and benchmarks' HTTP server: stoker's plain file server with a link model,
fault injection and counters.

Remote-shard code is only as good as its handling of a bad network, and a bad network is
hard to get on demand. ``ShardServer`` serves the files of a folder on 127.0.0.1 with real
aiohttp on its own thread (``stoker.tools.serve.FileServer``), so tests and benchmarks can
talk to it with any client:

- a link model: ``latency`` seconds before every response's headers, and ``bandwidth``
  bytes/s per response, so benchmarks see something like a remote store;
- faults on demand: ``server.fault("shard-0003.tar", "reset")`` makes the next GET of that
  file die halfway through its body; other kinds answer an error status, cut the body
  short, flip bytes, stall, slow one response down, or answer bytes that are not HTTP;
- counters: every request answered, bytes sent, and how many responses were in flight at
  once, so tests can check retries and benchmarks can check concurrency.

Bodies are streamed in chunks, so the link model and the faults act mid-body. ``python -m
tests.support.server ROOT [--latency S] [--bandwidth B]`` (from the repository's root)
serves a folder until Ctrl-C; ``ShardServerProcess`` runs that in a process of its own.
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import os
import ssl
import threading
from dataclasses import dataclass, field
from typing import Any, BinaryIO, NamedTuple

from aiohttp import web

from stoker.tools.serve import (
    CHUNK,
    FileServer,
    ServerProcess,
    argument_parser,
    serve_until_interrupted,
)
from tests.support import REPO

log = logging.getLogger("stoker.serve")

#: Paced responses write chunks of about this many seconds of the link, so a slow link
#: trickles instead of sending 64 KiB bursts.
_PACE_STEP_S = 0.01

#: Fault kinds and the parameters each accepts.
_FAULT_PARAMS: dict[str, frozenset[str]] = {
    "status": frozenset({"status", "retry_after", "location"}),
    "reset": frozenset({"after"}),
    "short": frozenset({"after"}),
    "corrupt": frozenset({"at", "count"}),
    "stall": frozenset({"after", "seconds"}),
    "slow": frozenset({"bandwidth"}),
    "garbage": frozenset(),
}


class RequestRecord(NamedTuple):
    """One answered request, as the server saw it."""

    method: str
    path: str  # relative to the root, "/"-separated, as requested
    range: str | None  # the Range header, if any
    status: int


@dataclass
class Fault:
    """A fault waiting for matching GETs; ``remaining`` is None for one that never runs out."""

    pattern: str
    kind: str
    remaining: int | None
    params: dict[str, Any] = field(default_factory=dict)

    def matches(self, relpath: str) -> bool:
        return fnmatch.fnmatchcase(relpath, self.pattern)


class ShardServer(FileServer):
    """Serves the files under ``root`` over HTTP on its own thread and event loop.

    ``latency`` (seconds) is waited before every response's headers; ``bandwidth``
    (bytes/s, None for unlimited) paces each response's body on its own, like one TCP
    stream on a link. Both may be changed while the server runs. ``ranges=False`` makes
    the server ignore Range headers, like the stores that do.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        latency: float = 0.0,
        bandwidth: float | None = None,
        ranges: bool = True,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(root, host=host, port=port, ranges=ranges, tls=tls)
        self.latency = latency
        self.bandwidth = bandwidth
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._requests: list[RequestRecord] = []
        self._bytes_sent = 0
        self._active = 0
        self._max_active = 0

    def start(self) -> ShardServer:
        return super().start()

    def __enter__(self) -> ShardServer:
        return self.start()

    # -- faults ------------------------------------------------------------------------

    def fault(self, pattern: str, kind: str, *, times: int | None = 1, **params: Any) -> Fault:
        """Make the next ``times`` GETs whose path matches ``pattern`` fail with ``kind``.

        ``pattern`` is an fnmatch pattern on the path relative to the root ("*.tar";
        ``*`` matches across "/" too). HEAD requests never get faults.
        Kinds and their parameters:

        - ``"status"``: answer ``status`` with no body (``retry_after`` adds Retry-After,
          ``location`` a Location: with a 3xx status, a redirect);
          ``"503"``, ``"429"``, ``"404"`` (any three digits) are shorthands;
        - ``"reset"``: send ``after`` body bytes (default half), then abort the connection;
        - ``"short"``: send ``after`` body bytes (default half), then close cleanly, short
          of the Content-Length announced;
        - ``"corrupt"``: send the whole body with ``count`` bytes (default 1) inverted from
          body offset ``at`` (default the middle);
        - ``"stall"``: send ``after`` bytes (default half), then nothing for ``seconds``
          (default 3600), then the rest;
        - ``"slow"``: pace this response at ``bandwidth`` bytes/s;
        - ``"garbage"``: answer bytes that are not HTTP at all, then close the connection.

        Faults are used in the order added; a request gets at most one. Returns the
        fault, whose ``remaining`` counts down.
        """
        if kind.isdigit() and len(kind) == 3:
            params = {"status": int(kind), **params}
            kind = "status"
        allowed = _FAULT_PARAMS.get(kind)
        if allowed is None:
            raise ValueError(
                f"unknown fault kind {kind!r}; expected one of {sorted(_FAULT_PARAMS)}"
            )
        unknown = set(params) - allowed
        if unknown:
            raise TypeError(f"fault {kind!r} takes no parameter(s) {sorted(unknown)}")
        if kind == "status" and "status" not in params:
            raise TypeError("fault 'status' needs status=")
        if kind == "slow" and not params.get("bandwidth"):
            raise TypeError("fault 'slow' needs bandwidth= (bytes/s)")
        if times is not None and times < 1:
            raise ValueError(f"times must be at least 1 or None, got {times}")
        f = Fault(pattern, kind, times, dict(params))
        with self._lock:
            self._faults.append(f)
        return f

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def take_fault(self, relpath: str) -> Fault | None:
        with self._lock:
            for f in self._faults:
                if f.matches(relpath):
                    if f.remaining is not None:
                        f.remaining -= 1
                        if f.remaining <= 0:
                            self._faults.remove(f)
                    return f
        return None

    def peek_fault(self, relpath: str) -> Fault | None:
        """The fault the next GET of `relpath` would take, left in place."""
        with self._lock:
            return next((f for f in self._faults if f.matches(relpath)), None)

    # -- counters ----------------------------------------------------------------------

    @property
    def requests(self) -> list[RequestRecord]:
        """A copy of the requests answered so far, in the order their headers went out."""
        with self._lock:
            return list(self._requests)

    def count(self, relpath: str, method: str = "GET") -> int:
        """How many ``method`` requests of ``relpath`` were answered, faulted ones included."""
        rel = relpath.lstrip("/")
        with self._lock:
            return sum(1 for r in self._requests if r.path == rel and r.method == method)

    @property
    def bytes_sent(self) -> int:
        """Body bytes handed to the network, over all responses."""
        with self._lock:
            return self._bytes_sent

    @property
    def active(self) -> int:
        """Requests being answered now (from arrival, latency included, to the body's end).

        It drops a moment after a client has the whole body: wait for it, don't assume it.
        """
        with self._lock:
            return self._active

    @property
    def max_active(self) -> int:
        """The most requests that were being answered at once since the last reset."""
        with self._lock:
            return self._max_active

    def reset_counters(self) -> None:
        with self._lock:
            self._requests.clear()
            self._bytes_sent = 0
            self._max_active = self._active

    def record(self, request: web.Request, relpath: str, status: int) -> None:
        rec = RequestRecord(request.method, relpath, request.headers.get("Range"), status)
        with self._lock:
            self._requests.append(rec)

    def add_bytes(self, n: int) -> None:
        with self._lock:
            self._bytes_sent += n

    # -- answers -----------------------------------------------------------------------

    async def respond(self, request: web.Request) -> web.StreamResponse:
        with self._lock:
            self._active += 1
            self._max_active = max(self._max_active, self._active)
        try:
            return await self._respond_faulted(request)
        finally:
            with self._lock:
                self._active -= 1

    async def _respond_faulted(self, request: web.Request) -> web.StreamResponse:
        relpath = request.path.lstrip("/")
        fault = self.take_fault(relpath) if request.method == "GET" else None
        if request.method == "HEAD":  # a HEAD is redirected or refused as its GET would be
            fault = self.peek_fault(relpath)
            if fault is not None and not (fault.kind == "status" and fault.params["status"] < 500):
                fault = None
        if fault is not None:
            log.debug("fault %s on %s", fault.kind, relpath)
        if self.latency > 0:
            await asyncio.sleep(self.latency)

        if fault is not None and fault.kind == "status":
            headers = {}
            if fault.params.get("retry_after") is not None:
                headers["Retry-After"] = str(fault.params["retry_after"])
            if fault.params.get("location") is not None:  # a redirect
                headers["Location"] = str(fault.params["location"])
            return self.empty(request, relpath, int(fault.params["status"]), headers)
        if fault is not None and fault.kind == "garbage":
            # Bytes that are no HTTP response, as a broken proxy or a connection the
            # server half closed sends; then the connection is dropped.
            self.record(request, relpath, 0)
            transport = request.transport
            if transport is not None:
                transport.write(b"\x16\x03\x01 this is not an HTTP response\r\n\r\n")
                transport.close()
            raise ConnectionResetError("garbage fault")
        return await self.respond_with_file(request, relpath, fault)

    async def write_body(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        fh: BinaryIO,
        length: int,
        plan: Any,
    ) -> None:
        """Write ``length`` bytes of ``fh`` as the body, paced and faulted as configured."""
        fault: Fault | None = plan
        kind = fault.kind if fault is not None else None
        params = fault.params if fault is not None else {}
        bandwidth = params["bandwidth"] if kind == "slow" else self.bandwidth
        cut: int | None = None  # body offset where a reset/short/stall happens
        if kind in ("reset", "short", "stall"):
            cut = min(max(int(params.get("after", length // 2)), 0), length)
        flip_at = int(params.get("at", length // 2)) if kind == "corrupt" else -1
        flip_end = flip_at + int(params.get("count", 1)) if kind == "corrupt" else -1

        chunk = CHUNK
        if bandwidth:
            chunk = max(1024, min(CHUNK, int(bandwidth * _PACE_STEP_S)))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        sent = 0
        while True:
            if cut is not None and sent == cut:
                if kind == "stall":
                    await asyncio.sleep(float(params.get("seconds", 3600.0)))
                    cut = None
                    t0 = loop.time() - (sent / bandwidth if bandwidth else 0.0)
                else:
                    await self.hang_up(request, resp, abort_connection=kind == "reset")
                    return
            if sent >= length:
                break
            n = min(chunk, length - sent)
            if cut is not None and sent < cut:
                n = min(n, cut - sent)
            data = fh.read(n)
            if not data:  # the file shrank under us: the body cannot be completed
                log.warning("%s shrank while being served", fh.name)
                await self.hang_up(request, resp, abort_connection=True)
                return
            if flip_at < sent + len(data) and flip_end > sent:
                buf = bytearray(data)
                for i in range(max(flip_at, sent), min(flip_end, sent + len(data))):
                    buf[i - sent] ^= 0xFF
                data = bytes(buf)
            if bandwidth:
                # Never run ahead of the link: these bytes may leave at t0 + (sent+n)/bw.
                wait = t0 + (sent + len(data)) / bandwidth - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
            self.add_bytes(len(data))  # before the write, so a client never sees more
            await resp.write(data)
            sent += len(data)
        await resp.write_eof()


class ShardServerProcess(ServerProcess):
    """``python -m tests.support.server ROOT`` in a process of its own, with a link model."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        latency: float = 0.0,
        bandwidth: float | None = None,
        log: str | None = None,
        timeout: float = 60.0,
    ) -> None:
        args = ["--latency", repr(latency)]
        if bandwidth is not None:
            args += ["--bandwidth", repr(bandwidth)]
        super().__init__(
            root, module="tests.support.server", args=args, cwd=REPO, log=log, timeout=timeout
        )


def main(argv: list[str] | None = None) -> None:
    """``python -m tests.support.server ROOT``: serve a folder, paced, until Ctrl-C."""
    parser = argument_parser(
        "python -m tests.support.server",
        "Serve the files of a folder over HTTP with optional latency and bandwidth limits "
        "(a stand-in for a remote shard store).",
    )
    parser.add_argument("--latency", type=float, default=0.0, help="seconds before headers")
    parser.add_argument(
        "--bandwidth", type=float, default=None, help="bytes/s per response (default: unlimited)"
    )
    args = parser.parse_args(argv)
    if not os.path.isdir(args.root):
        parser.error(f"not a folder: {args.root}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    serve_until_interrupted(
        ShardServer(
            args.root,
            host=args.host,
            port=args.port,
            latency=args.latency,
            bandwidth=args.bandwidth,
            ranges=not args.no_ranges,
        )
    )


if __name__ == "__main__":
    main()
