"""A small HTTP file server with a link model and fault injection, for remote shards.

Remote-shard code is only as good as its handling of a bad network, and a bad network is
hard to get on demand. ``ShardServer`` serves the files of a folder on 127.0.0.1 with real
aiohttp on its own thread, so tests and benchmarks can talk to it with any client:

- a link model: ``latency`` seconds before every response's headers, and ``bandwidth``
  bytes/s per response, so benchmarks see something like a remote store;
- faults on demand: ``server.fault("shard-0003.tar", "reset")`` makes the next GET of that
  file die halfway through its body; other kinds answer an error status, cut the body
  short, flip bytes, stall, or slow one response down;
- counters: every request answered, bytes sent, and how many responses were in flight at
  once, so tests can check retries and benchmarks can check concurrency.

Bodies are streamed in chunks, so the link model and the faults act mid-body. ``python -m
stoker.tools.serve ROOT`` serves a folder until Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fnmatch
import logging
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, NamedTuple
from urllib.parse import quote

from aiohttp import web

from stoker.tools.serve_files import FileResponses, abort

log = logging.getLogger("stoker.serve")

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


class ShardServer:
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
        self.root = os.path.realpath(os.fspath(root))
        self.tls = tls  # serve https with this server-side context
        self.host = host
        self.port = port
        self.latency = latency
        self.bandwidth = bandwidth
        self.ranges = ranges
        self._requested_port = port
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._requests: list[RequestRecord] = []
        self._bytes_sent = 0
        self._active = 0
        self._max_active = 0
        # Loop-thread state.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._inflight: set[asyncio.BaseTransport] = set()
        self._responses = FileResponses(self)

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> ShardServer:
        """Start serving; returns once the socket listens (``self.port`` is then real)."""
        if self._thread is not None:
            raise RuntimeError("ShardServer is already running")
        loop = asyncio.new_event_loop()
        thread = threading.Thread(
            target=self._run_loop, args=(loop,), name="stoker-serve", daemon=True
        )
        thread.start()
        self._loop, self._thread = loop, thread
        try:
            asyncio.run_coroutine_threadsafe(self._astart(), loop).result(timeout=30)
        except BaseException:
            self._halt_loop()
            raise
        log.debug("serving %s at %s", self.root, self.url)
        return self

    def stop(self) -> None:
        """Stop listening, abort every open connection and join the thread.

        Connections are aborted, not drained: a test that stops the server mid-body (or
        mid-stall) wants the client to see a dead server now, not in a minute.
        """
        loop = self._loop
        if loop is None:
            return
        if threading.current_thread() is self._thread:
            raise RuntimeError("ShardServer.stop() called from the server's own thread")
        try:
            asyncio.run_coroutine_threadsafe(self._astop(), loop).result(timeout=30)
        finally:
            self._halt_loop()

    def restart(self, down_for: float = 0.0) -> None:
        """Stop, stay down `down_for` seconds (connections are refused meanwhile), then
        start again on the same port: a server that dies and comes back.

        Open connections are aborted; faults and counters carry over.
        """
        port = self.port
        self.stop()
        time.sleep(down_for)
        self._requested_port = port
        self.start()

    def __enter__(self) -> ShardServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._thread is not None

    @property
    def url(self) -> str:
        """Base URL, ``http://HOST:PORT`` (https with tls=), with no trailing slash."""
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    def url_for(self, relpath: str | os.PathLike[str]) -> str:
        """URL of a file given by its path relative to the root."""
        return url_under(self.url, relpath)

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

    # -- event loop side ---------------------------------------------------------------

    @staticmethod
    def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
            # Whatever is left (handlers cancelled by stop) gets to finish its cleanup.
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()

    def _halt_loop(self) -> None:
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(timeout=10)

    async def _astart(self) -> None:
        app = web.Application()
        app.router.add_get("/{path:.*}", self._handle)  # HEAD too
        # handler_cancellation: a client that hangs up ends its handler (a stalled or
        # paced body would otherwise hold the file and count as active). A short
        # shutdown_timeout: stop() aborts connections itself and must not wait on them.
        runner = web.AppRunner(
            app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5
        )
        await runner.setup()
        try:
            site = web.TCPSite(
                runner, self.host, self._requested_port, reuse_address=True, ssl_context=self.tls
            )
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = site.port

    async def _astop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is None:
            return
        for site in list(runner.sites):
            await site.stop()  # no new connections from here on
        for transport in list(self._inflight):
            abort(transport)
        server = runner.server
        if server is not None:
            for conn in server.connections:  # idle keep-alive ones too
                if conn.transport is not None:
                    abort(conn.transport)
        await runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        transport = request.transport
        if transport is not None:
            self._inflight.add(transport)
        with self._lock:
            self._active += 1
            self._max_active = max(self._max_active, self._active)
        try:
            return await self._responses.respond(request)
        finally:
            with self._lock:
                self._active -= 1
            if transport is not None:
                self._inflight.discard(transport)


def kill_process_group(proc: subprocess.Popen | None, grace: float = 0.0) -> None:
    """End the process group of a child started with start_new_session, and reap the
    child: SIGTERM and up to `grace` seconds to exit first, if `grace`, then SIGKILL. The
    group is killed even when the child itself has exited: workers it left behind would
    hold its pipes (and a GPU). (The child's pid names the group, and Linux does not give
    that pid to a new process while any member of the group lives.)"""
    if proc is None:
        return
    if grace > 0 and proc.poll() is None:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:  # the group is gone, or not all of it may be signalled
        proc.kill()  # a no-op once the child is reaped
    proc.wait()


def url_under(base: str, relpath: str | os.PathLike[str]) -> str:
    """The URL a server at `base` serves the file at `relpath` of its root under."""
    rel = os.fspath(relpath).replace(os.sep, "/").lstrip("/")
    return f"{base}/{quote(rel)}"


class ServerProcess:
    """``python -m stoker.tools.serve ROOT`` in a process (and process group) of its own, so that
    what it costs is not charged to the client being measured. ``url`` is known once it
    answers; ``stop()`` (or leaving the ``with`` block) ends it. Its log goes to `log`
    (default: a temporary file, removed at stop)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        latency: float = 0.0,
        bandwidth: float | None = None,
        log: str | None = None,
        timeout: float = 60.0,
    ) -> None:
        self._scratch = None if log is not None else tempfile.mkdtemp(prefix="stoker-serve-")
        self.log = log if log is not None else os.path.join(self._scratch, "serve.log")
        command = [sys.executable, "-m", "stoker.tools.serve", os.fspath(root), "--port", "0"]
        command += ["--latency", repr(latency)]
        if bandwidth is not None:
            command += ["--bandwidth", repr(bandwidth)]
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                command, stdout=subprocess.DEVNULL, stderr=out, start_new_session=True
            )
        try:
            self.url = self._wait_url(deadline=time.monotonic() + timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_url(self, deadline: float) -> str:
        """The URL the server logs once it listens, after its port answers."""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                with open(self.log) as f:
                    raise RuntimeError(f"the server exited early:\n{f.read()[-2000:]}")
            with open(self.log) as f:
                found = re.search(r" at (http://[\d.]+:(\d+))", f.read())
            if found:
                with contextlib.suppress(OSError):
                    socket.create_connection(("127.0.0.1", int(found.group(2))), 1).close()
                    return found.group(1)
            time.sleep(0.05)
        raise RuntimeError("the server did not answer in time")

    def url_for(self, relpath: str | os.PathLike[str]) -> str:
        """URL of a file given by its path relative to the root."""
        return url_under(self.url, relpath)

    def cpu_seconds(self) -> float:
        """User + system CPU time the server has used so far."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        kill_process_group(self.proc, grace=5.0)
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    """``python -m stoker.tools.serve ROOT``: serve a folder until Ctrl-C."""
    parser = argparse.ArgumentParser(
        prog="python -m stoker.tools.serve",
        description="Serve the files of a folder over HTTP, with optional latency and "
        "bandwidth limits (a stand-in for a remote shard store).",
    )
    parser.add_argument("root", help="folder to serve")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds before headers")
    parser.add_argument(
        "--bandwidth", type=float, default=None, help="bytes/s per response (default: unlimited)"
    )
    parser.add_argument("--no-ranges", action="store_true", help="ignore Range headers")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.root):
        parser.error(f"not a folder: {args.root}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    server = ShardServer(
        args.root,
        host=args.host,
        port=args.port,
        latency=args.latency,
        bandwidth=args.bandwidth,
        ranges=not args.no_ranges,
    )
    with server:
        log.info("serving %s at %s (Ctrl-C to stop)", server.root, server.url)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            log.info("stopping")


if __name__ == "__main__":
    main()
