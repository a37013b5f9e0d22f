"""How the test server answers a GET: a file of its root, with single ranges, If-Range,
its link model (latency, bandwidth) and the fault, if any, waiting for that path."""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import logging
import mimetypes
import os
import re
import socket
import struct
import time
from typing import TYPE_CHECKING, BinaryIO

from aiohttp import web

if TYPE_CHECKING:
    from stoker.tools.serve import Fault, ShardServer

log = logging.getLogger("stoker.serve")

#: Body bytes written per step. Small enough that pacing and faults act mid-body, large
#: enough that a fast link is not limited by Python.
CHUNK = 64 * 1024

#: Paced responses write chunks of about this many seconds of the link, so a slow link
#: trickles instead of sending 64 KiB bursts.
_PACE_STEP_S = 0.01

_RANGE_RE = re.compile(r"(\d*)-(\d*)", re.ASCII)


class _Unsatisfiable(Exception):
    """A Range that lies wholly past the end of the file: the answer is 416."""


def _parse_range(value: str, size: int) -> tuple[int, int] | None:
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


class FileResponses:
    """The answers of one ShardServer."""

    def __init__(self, server: ShardServer) -> None:
        self.server = server

    async def respond(self, request: web.Request) -> web.StreamResponse:
        relpath = request.path.lstrip("/")
        fault = self.server.take_fault(relpath) if request.method == "GET" else None
        if request.method == "HEAD":  # a HEAD is redirected or refused as its GET would be
            fault = self.server.peek_fault(relpath)
            if fault is not None and not (fault.kind == "status" and fault.params["status"] < 500):
                fault = None
        if fault is not None:
            log.debug("fault %s on %s", fault.kind, relpath)
        if self.server.latency > 0:
            await asyncio.sleep(self.server.latency)

        if fault is not None and fault.kind == "status":
            headers = {}
            if fault.params.get("retry_after") is not None:
                headers["Retry-After"] = str(fault.params["retry_after"])
            if fault.params.get("location") is not None:  # a redirect
                headers["Location"] = str(fault.params["location"])
            return self._empty(request, relpath, int(fault.params["status"]), headers)
        if fault is not None and fault.kind == "garbage":
            # Bytes that are no HTTP response, as a broken proxy or a connection the
            # server half closed sends; then the connection is dropped.
            self.server.record(request, relpath, 0)
            transport = request.transport
            if transport is not None:
                transport.write(b"\x16\x03\x01 this is not an HTTP response\r\n\r\n")
                transport.close()
            raise ConnectionResetError("garbage fault")

        path = self._resolve(relpath)
        if path is None:
            return self._empty(request, relpath, 404)
        try:
            fh = open(path, "rb")  # noqa: SIM115 - closed in the finally below
        except OSError:
            return self._empty(request, relpath, 404)
        try:
            return await self._send_file(request, relpath, fh, fault)
        finally:
            fh.close()

    def _resolve(self, relpath: str) -> str | None:
        """The file a request path names, or None if it is outside the root or no file."""
        if "\x00" in relpath:
            return None
        full = os.path.realpath(os.path.join(self.server.root, relpath))
        if not full.startswith(self.server.root.rstrip(os.sep) + os.sep):
            return None
        return full if os.path.isfile(full) else None

    def _empty(
        self, request: web.Request, relpath: str, status: int, headers: dict[str, str] | None = None
    ) -> web.Response:
        self.server.record(request, relpath, status)
        return web.Response(status=status, headers=headers)

    async def _send_file(
        self, request: web.Request, relpath: str, fh: BinaryIO, fault: Fault | None
    ) -> web.StreamResponse:
        st = os.fstat(fh.fileno())
        size = st.st_size
        etag = f'"{size:x}-{st.st_mtime_ns:x}"'
        last_modified = email.utils.formatdate(st.st_mtime, usegmt=True)
        headers = {"ETag": etag, "Last-Modified": last_modified}
        ctype = mimetypes.guess_type(relpath)[0] or "application/octet-stream"
        headers["Content-Type"] = ctype

        status, first, length = 200, 0, size
        range_header = request.headers.get("Range") if self.server.ranges else None
        if_range = request.headers.get("If-Range")
        if if_range is not None and if_range.strip() not in (etag, last_modified):
            range_header = None  # a resumed download of a file that changed must start over
        if range_header is not None:
            try:
                span = _parse_range(range_header, size)
            except _Unsatisfiable:
                return self._empty(request, relpath, 416, {"Content-Range": f"bytes */{size}"})
            if span is not None:
                first, last = span
                status, length = 206, last - first + 1
                headers["Content-Range"] = f"bytes {first}-{last}/{size}"
        if self.server.ranges:
            headers["Accept-Ranges"] = "bytes"

        resp = web.StreamResponse(status=status, headers=headers)
        resp.content_length = length
        self.server.record(request, relpath, status)
        await resp.prepare(request)
        if request.method == "HEAD":
            await resp.write_eof()
            return resp
        fh.seek(first)
        await self._stream(request, resp, fh, length, fault)
        return resp

    async def _stream(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        fh: BinaryIO,
        length: int,
        fault: Fault | None,
    ) -> None:
        """Write ``length`` bytes of ``fh`` as the body, paced and faulted as configured."""
        kind = fault.kind if fault is not None else None
        params = fault.params if fault is not None else {}
        bandwidth = params["bandwidth"] if kind == "slow" else self.server.bandwidth
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
                    await self._hang_up(request, resp, abort=kind == "reset")
                    return
            if sent >= length:
                break
            n = min(chunk, length - sent)
            if cut is not None and sent < cut:
                n = min(n, cut - sent)
            data = fh.read(n)
            if not data:  # the file shrank under us: the body cannot be completed
                log.warning("%s shrank while being served", fh.name)
                await self._hang_up(request, resp, abort=True)
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
            self.server.add_bytes(len(data))  # before the write, so a client never sees more
            await resp.write(data)
            sent += len(data)
        await resp.write_eof()

    @staticmethod
    async def _hang_up(request: web.Request, resp: web.StreamResponse, *, abort: bool) -> None:
        """End the connection mid-body: a TCP reset if ``abort``, else a clean close."""
        resp.force_close()
        transport = request.transport
        if transport is None:
            return
        if abort:
            # abort() drops whatever is still buffered: let the bytes promised go first.
            deadline = time.monotonic() + 2.0
            while transport.get_write_buffer_size() and time.monotonic() < deadline:
                await asyncio.sleep(0.001)
            abort(transport)
        else:
            transport.close()  # flushes the buffer, then FIN


def abort(transport: asyncio.BaseTransport) -> None:
    """Drop a connection with a TCP RST, as a crashed server or middlebox would."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()
