"""Opening remote shards that have no manifest: looked into once per node and remembered in
the cache; servers that ignore ranges; presigned URLs; a store that throttles; and
``stoker index URL``."""

from __future__ import annotations

import contextlib
import http.server
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import numpy as np
import pytest

import stoker
from stoker.remote import fetcher_for
from stoker.tools import inspect
from tests.support.concurrency import open_in_processes
from tests.support.object_store import stub_server
from tests.support.server import ShardServer
from tests.support.shards import write_tar

SHARDS = 12
MEMBERS = 200  # small members: a header walk would read nearly every byte
FAST = stoker.FetchOptions(retries=3, backoff=0.01, max_backoff=0.05, connect_timeout=2)


FIELDS = (("bin", 3000), ("cls", 2))


def write_tars(folder: str, shards: int = SHARDS, members: int = MEMBERS, seed: int = 0) -> None:
    """Shards of `members` samples of about 3 KB (two fields each), by tarfile."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    for s in range(shards):
        samples = [
            (
                f"s{s:03d}-{m:04d}",
                {ext: rng.integers(0, 256, size, dtype=np.uint8).tobytes() for ext, size in FIELDS},
            )
            for m in range(members)
        ]
        write_tar(os.path.join(folder, f"shard-{s:03d}.tar"), samples)


def dataset_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))


def shard_urls(base: str, shards: int = SHARDS) -> list[str]:
    return [f"{base}/shard-{s:03d}.tar" for s in range(shards)]


def read_every_sample(urls: list[str], cache: str) -> dict[str, bytes]:
    ds = stoker.Dataset(urls, cache_dir=cache, fetch=FAST)
    return {s["__key__"]: bytes(s["bin"]) for s in ds.get_batch(np.arange(len(ds)))}


def local_samples(folder: str) -> dict[str, bytes]:
    ds = stoker.Dataset(os.path.join(folder, "shard-{000..011}.tar"))
    return {s["__key__"]: bytes(s["bin"]) for s in ds.get_batch(np.arange(len(ds)))}


@pytest.fixture(scope="module")
def tars(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = str(tmp_path_factory.mktemp("tars"))
    write_tars(folder)
    return folder


def test_two_processes_and_a_later_run_pull_the_dataset_about_once(tars, tmp_path):
    total = dataset_bytes(tars)
    with ShardServer(tars) as server:
        urls = shard_urls(server.url)
        cache = str(tmp_path / "cache")
        assert open_in_processes(urls, cache, 2) == [str(SHARDS * MEMBERS)] * 2
        assert open_in_processes(urls, cache, 1) == [str(SHARDS * MEMBERS)]
        assert server.bytes_sent <= 1.1 * total, server.bytes_sent / total
        gets = [r for r in server.requests if r.method == "GET" and r.path.endswith(".tar")]
        assert len(gets) <= 2 * SHARDS  # a first read and one download each, no header walk
        sent = server.bytes_sent
        assert read_every_sample(urls, cache) == local_samples(tars)
        assert server.bytes_sent == sent  # every byte from the cache now


def test_a_server_that_ignores_ranges_is_remembered_and_downloaded_once(tars, tmp_path):
    total = dataset_bytes(tars)
    cache = str(tmp_path / "cache")
    with ShardServer(tars, ranges=False) as server:
        urls = shard_urls(server.url)
        assert read_every_sample(urls, cache) == local_samples(tars)
        assert server.bytes_sent <= 1.02 * total, server.bytes_sent / total
        server.reset_counters()
        assert read_every_sample(urls, cache) == local_samples(tars)
        assert server.bytes_sent == 0  # remembered: one look (HEAD) at each, no body
    keys = record_keys(cache)
    assert sum(not k.startswith("copy: ") for k in keys) == SHARDS  # one per shard
    assert sum(k.startswith("copy: ") for k in keys) == SHARDS  # the version of each copy


def test_a_range_request_answered_whole_marks_the_host(tars, tmp_path):
    # A cache too small for the dataset: shards are looked into, not fetched at open; the
    # first range request answered with the whole body says the server ignores ranges.
    largest = max(os.path.getsize(os.path.join(tars, n)) for n in os.listdir(tars))
    cache = str(tmp_path / "cache")
    with python_http_server(tars) as base:
        urls = shard_urls(base)[:4]
        ds = stoker.Dataset(urls, cache_dir=cache, cache_limit=3 * largest, fetch=FAST)
        assert len(ds) == 4 * MEMBERS
        assert base.partition("://")[2] in stoker.remote.fetcher_for(FAST).rangeless
        got = {}
        for first in range(0, len(ds), MEMBERS):  # a shard at a time: the cache holds three
            batch = ds.get_batch(np.arange(first, first + MEMBERS))
            got.update({s["__key__"]: bytes(s["bin"]) for s in batch})
    assert got == {k: v for k, v in local_samples(tars).items() if int(k[1:4]) < 4}


def record_keys(cache: str) -> list[str]:
    """The keys of what a cache remembers (.index/)."""
    keys = []
    for name in os.listdir(os.path.join(cache, ".index")):
        with open(os.path.join(cache, ".index", name)) as f:
            keys.append(json.load(f)["key"])
    return keys


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def python_http_server(folder: str) -> Iterator[str]:
    """`python -m http.server`'s handler (it ignores Range), on a free port."""
    handler = lambda *a, **k: _QuietHandler(*a, directory=folder, **k)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_python_http_server_dataset_reads_byte_exact(tars, tmp_path):
    with python_http_server(tars) as base:
        urls = shard_urls(base)
        assert read_every_sample(urls, str(tmp_path / "c")) == local_samples(tars)


def test_a_changed_object_is_noticed_at_the_next_open(tmp_path):
    folder = str(tmp_path / "data")
    write_tars(folder, shards=2, members=50)
    cache = str(tmp_path / "cache")
    with ShardServer(folder) as server:
        urls = shard_urls(server.url, 2)
        assert len(stoker.Dataset(urls, cache_dir=cache, fetch=FAST)) == 100
        write_tars(folder, shards=2, members=60, seed=1)  # republished, bigger
        ds = stoker.Dataset(urls, cache_dir=cache, fetch=FAST)
        assert len(ds) == 120
        fresh = stoker.Dataset(os.path.join(folder, "shard-{000..001}.tar"))
        got = ds.get_batch(np.arange(120))
        want = fresh.get_batch(np.arange(120))
        assert [bytes(s["bin"]) for s in got] == [bytes(s["bin"]) for s in want]


def test_a_same_size_change_is_noticed_by_its_etag(tmp_path):
    folder = str(tmp_path / "data")
    write_tars(folder, shards=1, members=40)
    cache = str(tmp_path / "cache")
    with ShardServer(folder) as server:
        url = shard_urls(server.url, 1)
        first = stoker.Dataset(url, cache_dir=cache, fetch=FAST)[0]["bin"].tobytes()
        write_tars(folder, shards=1, members=40, seed=7)  # same size, other bytes
        os.utime(os.path.join(folder, "shard-000.tar"), ns=(1, 10**18))
        again = stoker.Dataset(url, cache_dir=cache, fetch=FAST)[0]["bin"].tobytes()
    assert first != again
    assert again == stoker.Dataset(os.path.join(folder, "shard-000.tar"))[0]["bin"].tobytes()


def test_presigned_urls_share_one_cached_copy(tars, tmp_path):
    cache = str(tmp_path / "cache")
    with ShardServer(tars) as server:
        url = f"{server.url}/shard-000.tar"
        signed = [
            url + "?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AK%2F20261201%2Fus-east-1"
            f"%2Fs3%2Faws4_request&X-Amz-Date=20261201T000000Z&X-Amz-Expires=600"
            f"&X-Amz-SignedHeaders=host&X-Amz-Signature={sig * 64}"
            for sig in "ab"
        ]
        first = read_every_sample([signed[0]], cache)
        sent = server.bytes_sent
        assert read_every_sample([signed[1]], cache) == first  # a fresh signature
        assert server.bytes_sent - sent <= 1  # a one-byte look, not the shard again
        paths = [p for _, _, files in os.walk(cache) for p in files if p.endswith(".tar")]
        assert paths == ["shard-000.tar"]  # named without its signature


# -- a store that throttles -------------------------------------------------------------

_SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


@contextlib.contextmanager
def throttling_store(folder: str, refusals: int) -> Iterator[tuple[str, dict]]:
    """An aiohttp stub that answers its first `refusals` shard requests with 503 SlowDown,
    then serves the files of `folder` whole."""
    from aiohttp import web

    state = {"refused": 0, "served": 0}

    async def handle(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name.endswith(".tar") and state["refused"] < refusals:
            state["refused"] += 1
            return web.Response(status=503, body=_SLOW_DOWN, content_type="application/xml")
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return web.Response(status=404)
        state["served"] += 1
        with open(path, "rb") as f:
            return web.Response(body=f.read())

    with stub_server("/{name}", handle) as base:
        yield base, state


def test_a_throttling_store_gets_fewer_downloads_at_once(tars, tmp_path, caplog):
    folder = str(tmp_path / "with-manifest")
    os.makedirs(folder)
    for s in range(SHARDS):
        os.link(
            os.path.join(tars, f"shard-{s:03d}.tar"), os.path.join(folder, f"shard-{s:03d}.tar")
        )
    inspect.index(folder)
    options = stoker.FetchOptions(retries=30, backoff=0.01, max_backoff=0.05, connections=8)
    with throttling_store(folder, refusals=20) as (base, state), caplog.at_level(logging.INFO):
        ds = stoker.Dataset(f"{base}/stoker.json", cache_dir=str(tmp_path / "c"), fetch=options)
        got = {}
        for first in range(0, len(ds), MEMBERS):  # a shard at a time: the cache holds three
            batch = ds.get_batch(np.arange(first, first + MEMBERS))
            got.update({s["__key__"]: bytes(s["bin"]) for s in batch})
        fetcher = fetcher_for(options)
        assert fetcher.concurrency < 8
    assert got == local_samples(tars)
    assert state["refused"] == 20
    assert "throttling" in caplog.text and "SlowDown" in caplog.text


# -- stoker index URL --------------------------------------------------------------------


def test_stoker_index_url_writes_a_manifest_to_put_beside_the_shards(tars, tmp_path):
    out = str(tmp_path / "stoker.json")
    with ShardServer(tars) as server:
        pattern = server.url + "/shard-{000..011}.tar"
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "stoker",
                "index",
                pattern,
                "--out",
                out,
                "--cache-dir",
                str(tmp_path / "c"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 0, run.stderr
        assert "put it beside the shards" in run.stdout
        with open(out) as f:
            entries = json.load(f)["shards"]
        assert [e["path"] for e in entries] == [f"shard-{s:03d}.tar" for s in range(SHARDS)]
        assert all(e["samples"] == MEMBERS and len(e["sha256"]) == 64 for e in entries)
        # Uploaded beside the shards (here: the server's folder), it opens them unread.
        os.link(out, os.path.join(tars, "stoker.json"))
        try:
            server.reset_counters()
            ds = stoker.Dataset(f"{server.url}/stoker.json", cache_dir=str(tmp_path / "d"))
            assert len(ds) == SHARDS * MEMBERS
            assert [r.path for r in server.requests] == ["stoker.json"]
        finally:
            os.unlink(os.path.join(tars, "stoker.json"))


def test_a_shard_whole_in_the_cache_is_indexed_there_not_probed(tars, tmp_path):
    cache = str(tmp_path / "cache")
    with ShardServer(tars) as server:
        urls = shard_urls(server.url, 3)
        want = read_every_sample(urls, cache)
        records = os.path.join(cache, ".index")
        for name in os.listdir(records):  # what was learnt of each shard: forgotten
            with open(os.path.join(records, name)) as f:
                if not json.load(f)["key"].startswith("copy: "):
                    os.unlink(os.path.join(records, name))
        server.reset_counters()
        assert read_every_sample(urls, cache) == want
        assert {r.method for r in server.requests} <= {"HEAD", "GET"}
        assert server.bytes_sent == 0  # HEADs, and a manifest looked for: no shard bytes


def test_signed_url_parameters_are_left_out_of_cache_names():
    from stoker.remote.stores import without_signature

    gcs = (
        "https://storage.googleapis.com/b/set/a.tar?X-Goog-Algorithm=GOOG4-RSA-SHA256"
        "&X-Goog-Credential=sa%40p.iam.gserviceaccount.com%2F20261201%2Fauto%2Fstorage"
        "%2Fgoog4_request&X-Goog-Date=20261201T000000Z&X-Goog-Expires=600"
        "&X-Goog-SignedHeaders=host&X-Goog-Signature=00ff"
    )
    sas = "https://acct.blob.core.windows.net/c/a.tar?sv=2024-05-04&st=2026-12-01&se=2026-12-02&sr=b&sp=r&sig=ab%2Bc%3D"
    assert without_signature(gcs) == "https://storage.googleapis.com/b/set/a.tar"
    assert without_signature(sas) == "https://acct.blob.core.windows.net/c/a.tar"
    kept = "https://host/a.tar?version=2&X-Amz-Signature=1"
    assert without_signature(kept) == "https://host/a.tar?version=2"  # it names the object
