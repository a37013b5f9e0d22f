"""A plain HTTP file server for a folder of shards: ``python -m stoker.tools.serve ROOT``.

It answers GET and HEAD for the files under its root, with single byte ranges, ``If-Range``,
``ETag`` and ``Last-Modified``, over http or https, which is all stoker's remote reader asks
of a store. Use it to serve shards from one machine to others on a trusted network, or to
try a remote dataset without an object store. ``stoker demo`` serves its shards with it.

``FileServer`` runs it on a thread of the calling process, ``ServerProcess`` in a process of
its own (so that what serving costs is not charged to the client being measured). The
tests' server with a link model, fault injection and counters (``tests/support/server.py``)
is built on these classes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import email.utils
import logging
import mimetypes
import os
import re
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any, BinaryIO
from urllib.parse import quote

from aiohttp import web

from stoker.tools.measure import kill_process_group

log = logging.getLogger("stoker.serve")

#: Body bytes written per step: small enough that a stopped server stops mid-body, large
#: enough that a fast link is not limited by Python.
CHUNK = 64 * 1024

_RANGE_RE = re.compile(r"(\d*)-(\d*)", re.ASCII)


class _Unsatisfiable(Exception):
    """A Range that lies wholly past the end of the file: the answer is 416."""


def parse_range(value: str, size: int) -> tuple[int, int] | None:
    """The (first, last) byte, inclusive, that a single-range header asks for.

    None means "ignore the header and send the whole file": it is malformed, not in
    bytes, or asks for several ranges (which this server answers with the full body).
    Raises ``_Unsatisfiable`` when the range starts at or past the end of the file.
    """
    unit, sep, spec = value.partition("=")
    if not sep or unit.strip().lower() != "bytes" or "," in spec:
        return None
    m = _RANGE_RE.fullmatch(spec.strip())
    if m is None or m.group(1) == m.group(2) == "":
        return None
    first_s, last_s = m.groups()
    if first_s == "":  # suffix: the last n bytes
        n = int(last_s)
        if n == 0 or size == 0:
            raise _Unsatisfiable
        return max(0, size - n), size - 1
    first = int(first_s)
    if last_s and int(last_s) < first:
        return None
    if first >= size:
        raise _Unsatisfiable
    last = min(int(last_s), size - 1) if last_s else size - 1
    return first, last


def abort(transport: asyncio.BaseTransport) -> None:
    """Drop a connection with a TCP RST, as a crashed server or middlebox would."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    if isinstance(transport, asyncio.WriteTransport):  # what aiohttp's connections are
        transport.abort()
    else:
        transport.close()


def url_under(base: str, relpath: str | os.PathLike[str]) -> str:
    """The URL a server at `base` serves the file at `relpath` of its root under."""
    rel = os.fspath(relpath).replace(os.sep, "/").lstrip("/")
    return f"{base}/{quote(rel)}"


class FileServer:
    """Serves the files under ``root`` over HTTP on its own thread and event loop.

    Args:
        root: The folder served; paths outside it (``..``, links out) are answered 404.
        host: The address to listen on.
        port: The port; 0 picks a free one (``port`` is the real one once started).
        ranges: False ignores Range headers and always sends whole files, as some
            stores do.
        tls: A server-side ``ssl.SSLContext`` to serve https with.

    Use it as a context manager, or call ``start()`` and ``stop()``.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        ranges: bool = True,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.root = os.path.realpath(os.fspath(root))
        self.host = host
        self.port = port
        self.ranges = ranges
        self.tls = tls
        self._requested_port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._inflight: set[asyncio.BaseTransport] = set()

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> Any:
        """Start serving; returns the server once its socket listens."""
        if self._thread is not None:
            raise RuntimeError(f"{type(self).__name__} is already running")
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

        Connections are aborted, not drained: a server stopped mid-body must look dead to
        its clients now, not once a slow download ends.
        """
        loop = self._loop
        if loop is None:
            return
        if threading.current_thread() is self._thread:
            raise RuntimeError(f"{type(self).__name__}.stop() called from the server's thread")
        try:
            asyncio.run_coroutine_threadsafe(self._astop(), loop).result(timeout=30)
        finally:
            self._halt_loop()

    def restart(self, down_for: float = 0.0) -> None:
        """Stop, stay down `down_for` seconds (connections are refused meanwhile), then
        start again on the same port: a server that dies and comes back."""
        port = self.port
        self.stop()
        time.sleep(down_for)
        self._requested_port = port
        self.start()

    def __enter__(self) -> Any:
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

    # -- answers -----------------------------------------------------------------------

    def record(self, request: web.Request, relpath: str, status: int) -> None:
        """Called as each answer's headers go out (a hook for servers that count)."""

    def add_bytes(self, n: int) -> None:
        """Called before each piece of a body is written (a hook for servers that count)."""

    async def respond(self, request: web.Request) -> web.StreamResponse:
        """The answer to one GET or HEAD."""
        relpath = request.path.lstrip("/")
        return await self.respond_with_file(request, relpath, None)

    async def respond_with_file(
        self, request: web.Request, relpath: str, plan: Any
    ) -> web.StreamResponse:
        """Answer with the file `relpath` names, or 404; `plan` goes on to ``write_body``."""
        path = self._resolve(relpath)
        if path is None:
            return self.empty(request, relpath, 404)
        try:
            fh = open(path, "rb")  # noqa: SIM115 - closed in the finally below
        except OSError:
            return self.empty(request, relpath, 404)
        try:
            return await self._send_file(request, relpath, fh, plan)
        finally:
            fh.close()

    def empty(
        self, request: web.Request, relpath: str, status: int, headers: dict[str, str] | None = None
    ) -> web.Response:
        """An answer with no body."""
        self.record(request, relpath, status)
        return web.Response(status=status, headers=headers)

    async def write_body(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        fh: BinaryIO,
        length: int,
        plan: Any,
    ) -> None:
        """Write ``length`` bytes of ``fh`` as the body (servers that pace or fail bodies
        override this)."""
        sent = 0
        while sent < length:
            data = fh.read(min(CHUNK, length - sent))
            if not data:  # the file shrank under us: the body cannot be completed
                log.warning("%s shrank while being served", fh.name)
                await self.hang_up(request, resp, abort_connection=True)
                return
            self.add_bytes(len(data))
            await resp.write(data)
            sent += len(data)
        await resp.write_eof()

    @staticmethod
    async def hang_up(
        request: web.Request, resp: web.StreamResponse, *, abort_connection: bool
    ) -> None:
        """End the connection mid-body: a TCP reset if ``abort_connection``, else a clean
        close."""
        resp.force_close()
        transport = request.transport
        if transport is None:
            return
        if abort_connection:
            # abort() drops whatever is still buffered: let the bytes promised go first.
            deadline = time.monotonic() + 2.0
            while transport.get_write_buffer_size() and time.monotonic() < deadline:
                await asyncio.sleep(0.001)
            abort(transport)
        else:
            transport.close()  # flushes the buffer, then FIN

    def _resolve(self, relpath: str) -> str | None:
        """The file a request path names, or None if it is outside the root or no file."""
        if "\x00" in relpath:
            return None
        full = os.path.realpath(os.path.join(self.root, relpath))
        if not full.startswith(self.root.rstrip(os.sep) + os.sep):
            return None
        return full if os.path.isfile(full) else None

    async def _send_file(
        self, request: web.Request, relpath: str, fh: BinaryIO, plan: Any
    ) -> web.StreamResponse:
        st = os.fstat(fh.fileno())
        size = st.st_size
        etag = f'"{size:x}-{st.st_mtime_ns:x}"'
        last_modified = email.utils.formatdate(st.st_mtime, usegmt=True)
        headers = {"ETag": etag, "Last-Modified": last_modified}
        headers["Content-Type"] = mimetypes.guess_type(relpath)[0] or "application/octet-stream"

        status, first, length = 200, 0, size
        range_header = request.headers.get("Range") if self.ranges else None
        if_range = request.headers.get("If-Range")
        if if_range is not None and if_range.strip() not in (etag, last_modified):
            range_header = None  # a resumed download of a file that changed must start over
        if range_header is not None:
            try:
                span = parse_range(range_header, size)
            except _Unsatisfiable:
                return self.empty(request, relpath, 416, {"Content-Range": f"bytes */{size}"})
            if span is not None:
                first, last = span
                status, length = 206, last - first + 1
                headers["Content-Range"] = f"bytes {first}-{last}/{size}"
        if self.ranges:
            headers["Accept-Ranges"] = "bytes"

        resp = web.StreamResponse(status=status, headers=headers)
        resp.content_length = length
        self.record(request, relpath, status)
        await resp.prepare(request)
        if request.method == "HEAD":
            await resp.write_eof()
            return resp
        fh.seek(first)
        await self.write_body(request, resp, fh, length, plan)
        return resp

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
        # handler_cancellation: a client that hangs up ends its handler (a long body would
        # otherwise hold the file open). A short shutdown_timeout: stop() aborts
        # connections itself and must not wait on them.
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
        try:
            return await self.respond(request)
        finally:
            if transport is not None:
                self._inflight.discard(transport)


class ServerProcess:
    """``python -m MODULE ROOT --port 0 ARGS...`` in a process (and process group) of its
    own, so that what it costs is not charged to the client being measured.

    Args:
        root: The folder to serve.
        module: The server's module; it must log ``... at http://HOST:PORT`` once it
            listens, as ``python -m stoker.tools.serve`` does.
        args: More arguments for it.
        cwd: The folder it runs in (where `module` is importable from).
        log: Where its log goes (default: a temporary file, removed at stop).
        timeout: Seconds to wait for it to answer.

    ``url`` is known once it answers; ``stop()`` (or leaving the ``with`` block) ends it.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        module: str = "stoker.tools.serve",
        args: Sequence[str] = (),
        cwd: str | None = None,
        log: str | None = None,
        timeout: float = 60.0,
    ) -> None:
        self._scratch = None if log is not None else tempfile.mkdtemp(prefix="stoker-serve-")
        self.log = log if log is not None else os.path.join(self._scratch or "", "serve.log")
        command = [sys.executable, "-m", module, os.fspath(root), "--port", "0", *args]
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                command, stdout=subprocess.DEVNULL, stderr=out, start_new_session=True, cwd=cwd
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
                found = re.search(r" at (https?://[\d.]+:(\d+))", f.read())
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


def argument_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The command line of a folder server (servers built on this one add to it)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("root", help="folder to serve")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--no-ranges", action="store_true", help="ignore Range headers")
    return parser


def serve_until_interrupted(server: FileServer) -> None:
    """Run `server` until Ctrl-C (or SIGTERM), logging the URL it listens at."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with server:
        log.info("serving %s at %s (Ctrl-C to stop)", server.root, server.url)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            log.info("stopping")


def main(argv: list[str] | None = None) -> None:
    """``python -m stoker.tools.serve ROOT``: serve a folder until Ctrl-C."""
    parser = argument_parser(
        "python -m stoker.tools.serve",
        "Serve the files of a folder over HTTP, with byte ranges, to stoker readers.",
    )
    args = parser.parse_args(argv)
    if not os.path.isdir(args.root):
        parser.error(f"not a folder: {args.root}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    serve_until_interrupted(
        FileServer(args.root, host=args.host, port=args.port, ranges=not args.no_ranges)
    )


if __name__ == "__main__":
    main()
