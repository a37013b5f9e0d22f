"""Remote shards over a real aiohttp server on 127.0.0.1, faults included."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import stoker
from stoker.manifest import write_manifest
from stoker.remote import ShardCache, cache_name
from tests.support.server import ShardServer
from tests.support.shards import make_samples, write_tar, write_zip

SHARDS = 6
PER_SHARD = 30
FAST = stoker.FetchOptions(backoff=0.01, max_backoff=0.05, stall_timeout=1.0, retries=4)


def shard_name(i: int) -> str:
    return f"shard-{i:03d}.{'zip' if i % 2 else 'tar'}"


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Tar and zip shards of distinct samples, and a manifest of them (served or not)."""
    root = str(tmp_path_factory.mktemp("remote-data"))
    for i in range(SHARDS):
        samples = make_samples(PER_SHARD, seed=i, size=20000)
        samples = [(f"s{i}/{key}", fields) for key, fields in samples]
        path = os.path.join(root, shard_name(i))
        (write_zip if i % 2 else write_tar)(path, samples)
    os.makedirs(os.path.join(root, "with-manifest"))
    for i in range(SHARDS):
        os.link(
            os.path.join(root, shard_name(i)), os.path.join(root, "with-manifest", shard_name(i))
        )
    write_manifest(
        [os.path.join(root, "with-manifest", shard_name(i)) for i in range(SHARDS)],
        os.path.join(root, "with-manifest"),
    )
    return root


@pytest.fixture
def server(data: str):
    with ShardServer(data) as srv:
        yield srv


def urls(server: ShardServer, folder: str = "") -> list[str]:
    return [server.url_for(os.path.join(folder, shard_name(i))) for i in range(SHARDS)]


def local(data: str) -> stoker.Dataset:
    return stoker.Dataset([os.path.join(data, shard_name(i)) for i in range(SHARDS)])


def assert_same_samples(remote: stoker.Dataset, reference: stoker.Dataset) -> None:
    assert len(remote) == len(reference)
    everything = np.arange(len(reference))
    for got, want in zip(remote.get_batch(everything), reference.get_batch(everything)):
        assert got["__key__"] == want["__key__"]
        assert set(got) == set(want)
        for field in want:
            if field != "__key__":
                assert bytes(got[field]) == bytes(want[field])


def shard_gets(server: ShardServer) -> dict[str, int]:
    """Whole-shard downloads (GETs without a Range, or resuming ones) per path."""
    counts: dict[str, int] = {}
    for r in server.requests:
        if r.method == "GET" and not r.path.endswith(".json") and r.range in (None, ""):
            counts[r.path] = counts.get(r.path, 0) + 1
    return counts


def cache_bytes(root: str) -> int:
    """Bytes of shards and partial downloads in a cache (its marker file aside)."""
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            if name == ".stoker-cache" or os.path.basename(folder) == ".index":
                continue
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(folder, name)).st_size
    return total


# -- opening --------------------------------------------------------------------------


def test_urls_without_manifest_read_only_headers_at_open(server, data, tmp_path):
    zips = [u for u in urls(server) if u.endswith(".zip")]
    ds = stoker.Dataset(zips, cache_dir=tmp_path, fetch=FAST)
    assert len(ds) == PER_SHARD * len(zips)
    assert set(ds.fields) == {"cls", "raw"}
    sizes = [os.path.getsize(os.path.join(data, shard_name(i))) for i in (1, 3, 5)]
    # A shard of 256 KiB or less is fetched whole (a probe would read much of it); of
    # the others, only the central directories cross the network until they are read.
    small = sum(n for n in sizes if n <= 256 * 1024)
    assert 0 < small < sum(sizes)
    assert cache_bytes(str(tmp_path)) == small
    assert server.bytes_sent < small + (sum(sizes) - small) / 4


def test_remote_samples_equal_local_samples(server, data, tmp_path):
    ds = stoker.Dataset(urls(server), cache_dir=tmp_path, fetch=FAST)
    assert ds.shards == urls(server)
    assert_same_samples(ds, local(data))


def test_brace_range_url(server, data, tmp_path):
    pattern = server.url + "/shard-{000..005}.{tar,zip}"
    ds = stoker.Dataset(
        [u for u in stoker.sources.expand_braces(pattern) if u in urls(server)],
        cache_dir=tmp_path,
        fetch=FAST,
    )
    assert len(ds) == SHARDS * PER_SHARD


def test_manifest_url_opens_with_one_request(server, data, tmp_path):
    ds = stoker.Dataset(server.url_for("with-manifest/stoker.json"), cache_dir=tmp_path, fetch=FAST)
    assert [r.path for r in server.requests] == ["with-manifest/stoker.json"]
    assert len(ds) == SHARDS * PER_SHARD
    assert ds.shards == urls(server, "with-manifest")
    assert_same_samples(ds, local(data))


def test_manifest_beside_the_shards_is_found(server, data, tmp_path):
    ds = stoker.Dataset(urls(server, "with-manifest"), cache_dir=tmp_path, fetch=FAST)
    assert [r.path for r in server.requests] == ["with-manifest/stoker.json"]
    assert len(ds) == SHARDS * PER_SHARD


def test_loader_batches_equal_local_loader_batches(server, data, tmp_path):
    ds = stoker.Dataset(urls(server), cache_dir=tmp_path, fetch=FAST)
    kwargs = dict(batch_size=16, seed=3, shuffle_window=2)
    remote_batches = list(stoker.Loader(ds, **kwargs))
    local_batches = list(stoker.Loader(local(data), **kwargs))
    assert [b["__key__"] for b in remote_batches] == [b["__key__"] for b in local_batches]
    keys = [k for b in remote_batches for k in b["__key__"]]
    assert len(keys) == len(set(keys)) == SHARDS * PER_SHARD
    for got, want in zip(remote_batches, local_batches):
        assert [bytes(x) for x in got["raw"]] == [bytes(x) for x in want["raw"]]
    assert set(shard_gets(server).values()) == {1}  # each shard downloaded once


def test_fields_fast_path_over_remote_shards(server, data, tmp_path):
    ds = stoker.Dataset(server.url_for("with-manifest/stoker.json"), cache_dir=tmp_path)
    fields = {"cls": stoker.Int(), "raw": stoker.Bytes()}
    got = list(stoker.Loader(ds, batch_size=10, seed=1, fields=fields))
    want = list(stoker.Loader(local(data), batch_size=10, seed=1, fields=fields))
    assert [b["cls"].tolist() for b in got] == [b["cls"].tolist() for b in want]


def test_second_epoch_comes_from_the_cache(server, data, tmp_path):
    ds = stoker.Dataset(server.url_for("with-manifest/stoker.json"), cache_dir=tmp_path)
    loader = stoker.Loader(ds, batch_size=32)
    for _ in loader:
        pass
    server.reset_counters()
    for _ in loader:
        pass
    assert shard_gets(server) == {}


# -- faults ---------------------------------------------------------------------------


def manifest_dataset(server: ShardServer, tmp_path, **options) -> stoker.Dataset:
    fetch = stoker.FetchOptions(**{**FAST.__dict__, **options})
    return stoker.Dataset(
        server.url_for("with-manifest/stoker.json"), cache_dir=tmp_path, fetch=fetch
    )


@pytest.mark.parametrize(
    ("kind", "params"),
    [
        ("503", {}),
        ("reset", {"after": 5000}),
        ("short", {"after": 5000}),
        ("corrupt", {}),
        ("stall", {"after": 5000, "seconds": 30}),
    ],
)
def test_transient_faults_are_retried(server, data, tmp_path, kind, params):
    server.fault("with-manifest/shard-*", kind, times=2, **params)
    ds = manifest_dataset(server, tmp_path, stall_timeout=0.3)
    start = time.monotonic()
    assert_same_samples(ds, local(data))
    assert time.monotonic() - start < 10


def test_broken_body_resumes_with_a_range_request(server, data, tmp_path):
    server.fault("with-manifest/shard-000.tar", "reset", after=20000)
    ds = manifest_dataset(server, tmp_path)
    assert_same_samples(ds, local(data))
    ranges = [
        r.range for r in server.requests if r.path == "with-manifest/shard-000.tar" and r.range
    ]
    assert ranges and ranges[0].startswith("bytes=") and ranges[0] != "bytes=0-"


def test_broken_body_restarts_when_the_server_ignores_ranges(data, tmp_path):
    with ShardServer(data, ranges=False) as server:
        server.fault("with-manifest/shard-000.tar", "reset", after=20000)
        assert_same_samples(manifest_dataset(server, tmp_path), local(data))


def test_429_waits_for_retry_after(server, data, tmp_path):
    server.fault("with-manifest/shard-000.tar", "429", retry_after="1")
    ds = manifest_dataset(server, tmp_path)
    start = time.monotonic()
    ds.get_batch([0])
    assert time.monotonic() - start >= 0.9


def test_404_fails_at_once_naming_the_url(server, data, tmp_path):
    ds = manifest_dataset(server, tmp_path)
    server.fault("with-manifest/shard-002.tar", "404", times=None)
    with pytest.raises(stoker.FetchError, match=r"shard-002\.tar.*HTTP 404") as info:
        ds.get_batch([2 * PER_SHARD])
    assert info.value.path == server.url_for("with-manifest/shard-002.tar")
    assert server.count("with-manifest/shard-002.tar") == 1


def test_persistent_5xx_gives_up_with_fetch_error(server, data, tmp_path):
    ds = manifest_dataset(server, tmp_path)
    server.fault("with-manifest/shard-000.tar", "503", times=None)
    start = time.monotonic()
    with pytest.raises(stoker.FetchError, match=r"shard-000\.tar.*gave up after 5 attempts.*503"):
        ds.get_batch([0])
    assert time.monotonic() - start < 5
    assert server.count("with-manifest/shard-000.tar") == 5
    assert cache_bytes(str(tmp_path)) == 0  # nothing partial left behind


def test_persistent_stall_gives_up(server, data, tmp_path):
    ds = manifest_dataset(server, tmp_path, stall_timeout=0.2, retries=1)
    server.fault("with-manifest/shard-000.tar", "stall", times=None, after=1000, seconds=30)
    start = time.monotonic()
    with pytest.raises(stoker.FetchError, match="stalled"):
        ds.get_batch([0])
    assert time.monotonic() - start < 5


def test_wrong_bytes_every_time_is_a_checksum_error(server, data, tmp_path):
    ds = manifest_dataset(server, tmp_path, retries=2)
    server.fault("with-manifest/shard-000.tar", "corrupt", times=None)
    with pytest.raises(stoker.ChecksumError, match=r"shard-000\.tar.*sha256") as info:
        ds.get_batch([0])
    assert isinstance(info.value, stoker.FetchError)
    assert cache_bytes(str(tmp_path)) == 0


def test_a_shard_that_changed_size_is_refused(data, tmp_path):
    largest = max(os.path.getsize(os.path.join(data, shard_name(i))) for i in range(SHARDS))
    with ShardServer(data) as server:
        # A cache too small for the whole dataset: the shards are looked into at open, and
        # fetched when read.
        ds = stoker.Dataset(
            urls(server), cache_dir=tmp_path / "c", cache_limit=3 * largest, fetch=FAST
        )
        path = os.path.join(data, shard_name(0))
        with open(path, "rb") as f:
            original = f.read()
        try:
            with open(path, "ab") as f:
                f.write(b"\0" * 1024)
            with pytest.raises(stoker.FetchError, match="changed"):
                ds.get_batch([0])
        finally:
            with open(path, "wb") as f:
                f.write(original)


def test_loader_error_names_the_url(server, data, tmp_path):
    ds = manifest_dataset(server, tmp_path)
    server.fault("with-manifest/shard-004.tar", "404", times=None)
    with pytest.raises(stoker.FetchError, match=r"shard-004\.tar"):
        for _ in stoker.Loader(ds, batch_size=8, shuffle=False):
            pass


# -- the cache ------------------------------------------------------------------------


def test_cache_limit_holds_at_every_moment(server, data, tmp_path):
    largest = max(os.path.getsize(os.path.join(data, shard_name(i))) for i in range(SHARDS))
    limit = 4 * largest + 100  # a window of one, one more, two ahead: forces eviction
    ds = manifest_dataset(server, tmp_path)
    ds = stoker.Dataset(
        server.url_for("with-manifest/stoker.json"),
        cache_dir=tmp_path,
        cache_limit=limit,
        fetch=FAST,
    )
    peak = 0
    stop = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, cache_bytes(str(tmp_path)))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for epoch in range(2):
            loader = stoker.Loader(ds, batch_size=8, shuffle=False, prefetch=2)
            loader.set_epoch(epoch)
            seen = [k for b in loader for k in b["__key__"]]
            assert len(seen) == len(set(seen)) == SHARDS * PER_SHARD
    finally:
        stop.set()
        watcher.join()
    assert 0 < peak <= limit
    assert sum(shard_gets(server).values()) > SHARDS  # eviction made it fetch again


def test_eviction_never_removes_a_held_shard(server, data, tmp_path):
    ds = manifest_dataset(server, tmp_path)
    holder = ds.remote
    holder.acquire(0)  # held by this dataset
    held = holder.cache.path_of(holder.shards[0].name)
    # Another cache object on the same folder (as another process would have) that needs
    # room for everything else.
    other = ShardCache(str(tmp_path))
    need = limit = os.path.getsize(held)  # room for one shard: only by evicting ours
    assert not other.evict(held)
    other.evict_for(need, limit)
    assert os.path.exists(held)
    holder.release(0)
    other.evict_for(need, limit)
    assert not os.path.exists(held)


def test_a_limit_too_small_for_the_window_is_refused(server, data, tmp_path):
    largest = max(os.path.getsize(os.path.join(data, shard_name(i))) for i in range(SHARDS))
    with pytest.raises(stoker.StokerError, match=r"raise cache_limit to at least \d+"):
        stoker.Dataset(urls(server), cache_dir=tmp_path, cache_limit=largest, fetch=FAST)
    ds = stoker.Dataset(urls(server), cache_dir=tmp_path, cache_limit=4 * largest, fetch=FAST)
    with pytest.raises(stoker.StokerError, match=r"too small.*need \d+ bytes"):
        stoker.Loader(ds, shuffle_window=4)
    # Small batches read in order hold two or three shards at a time: that fits.
    loader = stoker.Loader(ds, shuffle=False, batch_size=8, prefetch=1)
    assert sum(len(b["__key__"]) for b in loader) == SHARDS * PER_SHARD
    # Batches that each span several shards hold more than the window alone suggests.
    with pytest.raises(stoker.StokerError, match="too small"):
        stoker.Loader(ds, shuffle=False, batch_size=128)


def test_cache_files_are_private_and_named_safely(server, data, tmp_path):
    ds = manifest_dataset(server, tmp_path)
    ds.get_batch([0])
    for folder, dirs, files in os.walk(tmp_path):
        for name in dirs:
            assert stat.S_IMODE(os.stat(os.path.join(folder, name)).st_mode) == 0o700
        for name in files:
            assert stat.S_IMODE(os.stat(os.path.join(folder, name)).st_mode) & 0o077 == 0
    for url in ("http://h/../../etc/passwd", "http://h/a/%2e%2e/b.tar", "https://h:8/./x?q=1"):
        name = cache_name(url)
        assert not os.path.isabs(name)
        assert ".." not in name.split(os.sep)
        assert os.path.realpath(os.path.join(tmp_path, name)).startswith(str(tmp_path))


# -- processes sharing a cache --------------------------------------------------------

_LOAD_ALL = """
import sys, stoker
ds = stoker.Dataset(sys.argv[1], cache_dir=sys.argv[2])
n = sum(len(b["__key__"]) for b in stoker.Loader(ds, batch_size=16, seed=int(sys.argv[3])))
print(n)
"""


def test_two_processes_fetch_each_shard_once(server, data, tmp_path):
    server.bandwidth = 2e6  # slow enough that the two overlap
    manifest = server.url_for("with-manifest/stoker.json")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _LOAD_ALL, manifest, str(tmp_path), str(seed)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0
        assert int(out) == SHARDS * PER_SHARD
    assert shard_gets(server) == {f"with-manifest/{shard_name(i)}": 1 for i in range(SHARDS)}


_FETCH_ONE = """
import sys, stoker
ds = stoker.Dataset(sys.argv[1], cache_dir=sys.argv[2])
ds.remote.acquire(0)
"""


def test_a_killed_download_does_not_block_the_next(server, data, tmp_path):
    server.fault("with-manifest/shard-000.tar", "slow", bandwidth=5000)
    manifest = server.url_for("with-manifest/stoker.json")
    proc = subprocess.Popen([sys.executable, "-c", _FETCH_ONE, manifest, str(tmp_path)])
    try:
        deadline = time.monotonic() + 30
        parts: list[str] = []
        while not parts and time.monotonic() < deadline:
            parts = [
                os.path.join(f, n)
                for f, _, ns in os.walk(tmp_path)
                for n in ns
                if n.endswith(".part")
            ]
            time.sleep(0.02)
        assert parts, "the child never started its download"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    ds = manifest_dataset(server, tmp_path)
    start = time.monotonic()
    assert_same_samples(ds, local(data))
    assert time.monotonic() - start < 10
    leftovers = [n for _, _, ns in os.walk(tmp_path) for n in ns if n.endswith(".part")]
    assert leftovers == []


def test_dataloader_workers_over_remote_shards(server, data, tmp_path):
    torch = pytest.importorskip("torch")
    ds = manifest_dataset(server, tmp_path)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=2, collate_fn=lambda s: s["__key__"]
    )
    keys = list(loader)
    assert sorted(keys) == sorted(local(data).keys(np.arange(SHARDS * PER_SHARD)))


# -- stoker fetch ---------------------------------------------------------------------


def test_stoker_fetch_prewarms_the_cache(server, data, tmp_path):
    manifest = server.url_for("with-manifest/stoker.json")
    result = subprocess.run(
        [sys.executable, "-m", "stoker", "fetch", manifest, "--cache-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert f"{SHARDS} shard(s)" in result.stdout
    server.reset_counters()
    ds = stoker.Dataset(manifest, cache_dir=tmp_path)
    for _ in stoker.Loader(ds, batch_size=50):
        pass
    assert shard_gets(server) == {}


def test_stoker_fetch_error_is_one_line(server, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "stoker", "fetch", server.url_for("missing/stoker.json")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "STOKER_CACHE": str(tmp_path)},
    )
    assert result.returncode == 1
    assert result.stderr.startswith("stoker: error:") and "404" in result.stderr
    assert result.stderr.count("\n") == 1


def test_manifest_json_is_what_write_manifest_wrote(data):
    with open(os.path.join(data, "with-manifest", "stoker.json")) as f:
        manifest = json.load(f)
    entry = manifest["shards"][0]
    assert entry["path"] == shard_name(0) and entry["samples"] == PER_SHARD
    assert entry["bytes"] == os.path.getsize(os.path.join(data, shard_name(0)))
    assert len(entry["sha256"]) == 64


# -- prefetch -------------------------------------------------------------------------


def test_downloads_take_connections_in_priority_order(server, data, tmp_path):
    """With one connection busy, waiting downloads go in priority order: a shard a batch
    needs (0, rank) before read-ahead (1, rank), each by rank."""
    from stoker.remote import fetcher_for

    fetcher = fetcher_for(stoker.FetchOptions(connections=1, backoff=0.01))
    server.fault("shard-000.tar", "slow", bandwidth=200_000)
    order = []

    async def fetch(name: str, priority: tuple[int, int]) -> None:
        path = os.path.join(data, name)
        fd = os.open(str(tmp_path / name), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            await fetcher.download(
                server.url_for(name), fd, os.path.getsize(path), None, priority=priority
            )
        finally:
            os.close(fd)
        order.append(name)

    first = fetcher.submit(fetch(shard_name(0), (0, 0)))
    time.sleep(0.2)  # it holds the one connection
    waiting = [(shard_name(1), (1, 5)), (shard_name(2), (1, 3)), (shard_name(3), (0, 9))]
    futures = [fetcher.submit(fetch(name, p)) for name, p in waiting]
    for future in [first, *futures]:
        future.result(timeout=30)
    assert order == [shard_name(0), shard_name(3), shard_name(2), shard_name(1)]


def test_every_shard_is_fetched_once_in_an_epoch(server, data, tmp_path):
    ds = manifest_dataset(server, tmp_path, connections=2)
    for _ in stoker.Loader(ds, batch_size=8, seed=5, shuffle_window=2):
        pass
    assert shard_gets(server) == {f"with-manifest/{shard_name(i)}": 1 for i in range(SHARDS)}


def test_shards_download_while_earlier_ones_are_read(server, data, tmp_path):
    server.bandwidth = 4e6
    ds = manifest_dataset(server, tmp_path)
    loader = stoker.Loader(ds, batch_size=8, seed=5, shuffle_window=1)
    it = iter(loader)
    start = time.monotonic()
    next(it)
    first_batch = time.monotonic() - start
    # The first batch needed one shard (and maybe its neighbour); by now more are coming.
    time.sleep(0.05)
    done = {r.path for r in server.requests if r.path.endswith((".tar", ".zip"))}
    assert len(done) + server.active >= 3  # the window, one more, and some ahead
    largest = max(os.path.getsize(os.path.join(data, shard_name(i))) for i in range(SHARDS))
    assert first_batch < 3 * largest / 4e6 + 1  # about one shard's download, not all six
    assert sum(len(b["__key__"]) for b in it) + 8 == SHARDS * PER_SHARD


# -- review cases ---------------------------------------------------------------------


def test_a_large_manifest_is_read_whole(server, data, tmp_path):
    from stoker.remote import fetcher_for

    blob = os.urandom(3 << 20)
    with open(os.path.join(data, "big.bin"), "wb") as f:
        f.write(blob)
    fetcher = fetcher_for(FAST)
    assert fetcher.call(fetcher.read_all(server.url_for("big.bin"))) == blob


def test_a_folder_that_is_not_a_cache_is_refused(server, data, tmp_path):
    (tmp_path / "thesis.pdf").write_bytes(b"precious")
    with pytest.raises(stoker.StokerError, match="not a stoker cache"):
        stoker.Dataset(server.url_for("with-manifest/stoker.json"), cache_dir=tmp_path)
    assert (tmp_path / "thesis.pdf").read_bytes() == b"precious"


def test_a_dead_downloads_part_does_not_count_against_the_limit(server, data, tmp_path):
    largest = max(os.path.getsize(os.path.join(data, shard_name(i))) for i in range(SHARDS))
    ds = stoker.Dataset(
        server.url_for("with-manifest/stoker.json"),
        cache_dir=tmp_path,
        cache_limit=2 * largest,
        fetch=stoker.FetchOptions(**{**FAST.__dict__, "cache_wait": 2}),
    )
    remote = ds.remote
    remote.acquire(1)  # one shard held
    stale = remote.path_of(0) + ".part"
    os.makedirs(os.path.dirname(stale), exist_ok=True)
    with open(stale, "wb") as f:
        f.truncate(largest)  # what a killed download of shard 0 leaves
    assert ds.get_batch([0])[0]["__key__"] == local(data).key(0)
    remote.release(1)


def test_a_forked_child_does_not_keep_the_parents_locks(server, data, tmp_path):
    ds = manifest_dataset(server, tmp_path)
    remote = ds.remote
    remote.acquire(0)
    path = remote.path_of(0)
    ready, tell = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child (its at-fork handlers have run) outlives the parent's hold
        os.write(tell, b"x")
        time.sleep(1.5)
        os._exit(0)
    try:
        os.read(ready, 1)
        remote.release(0)
        assert ShardCache(str(tmp_path)).evict(path)  # no copy of the lock left behind
    finally:
        os.waitpid(pid, 0)
        os.close(ready)
        os.close(tell)


def test_a_forked_child_holds_a_shard_with_its_own_lock(server, data, tmp_path):
    # The parent holds shard 0, then forks. A hold the child takes is its own (a lock of
    # its own), not the parent's: once the parent lets go, the shard is still kept from
    # eviction while the child holds it.
    ds = manifest_dataset(server, tmp_path)
    remote = ds.remote
    remote.acquire(0)
    path = remote.path_of(0)
    ready, tell = os.pipe()
    done, finish = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            remote.acquire(0)
            os.write(tell, b"x")
            os.read(done, 1)  # until the parent has tried to evict it
            remote.release(0)
        finally:
            os._exit(0)
    try:
        os.read(ready, 1)
        remote.release(0)
        assert not ShardCache(str(tmp_path)).evict(path)  # the child's hold keeps it
        os.write(finish, b"x")
        os.waitpid(pid, 0)
        assert ShardCache(str(tmp_path)).evict(path)
    finally:
        for fd in (ready, tell, done, finish):
            os.close(fd)


def test_threads_reading_a_remote_dataset_at_once(server, data, tmp_path):
    from tests.support.concurrency import run_in_threads

    ds = manifest_dataset(server, tmp_path)
    reference = local(data)
    rng = np.random.default_rng(0)
    picks = [rng.permutation(len(ds))[:40] for _ in range(6)]

    def work(t: int) -> None:
        for i in picks[t].tolist():
            got, want = ds[i], reference[i]
            assert got["__key__"] == want["__key__"]
            assert bytes(got["raw"]) == bytes(want["raw"])

    run_in_threads(work, 6)


_EXIT_MID_EPOCH = """
import sys, time, stoker
ds = stoker.Dataset(sys.argv[1], cache_dir=sys.argv[2])
it = iter(stoker.Loader(ds, batch_size=8, shuffle=False))
next(it)
start = time.monotonic()
sys.exit(0)
"""


def test_the_process_exits_promptly_with_downloads_in_flight(server, data, tmp_path):
    server.fault("with-manifest/shard-00[1-5]*", "stall", times=None, after=100, seconds=60)
    manifest = server.url_for("with-manifest/stoker.json")
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", _EXIT_MID_EPOCH, manifest, str(tmp_path)], timeout=30
    )
    assert result.returncode == 0
    assert time.monotonic() - start < 15


def test_retry_after_values():
    from stoker.remote.http import retry_after_seconds

    o = stoker.FetchOptions(max_retry_after=60)
    assert retry_after_seconds("2", o) == 2
    assert retry_after_seconds("soon", o) is None
    assert retry_after_seconds("nan", o) is None
    assert retry_after_seconds("100000", o) == 60
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT", o) == 0  # in the past
    future = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 30))
    assert 25 < retry_after_seconds(future, o) <= 31


def test_cache_names_of_distinct_urls_differ():
    urls = [
        "http://h/a%20b.tar",
        "http://h/a_20b.tar",
        "http://h/a b.tar",
        "http://h/a+b.tar",
        "http://h/a_b.tar",
        "http://h/x//y.tar",
        "http://h/x/y.tar",
        "http://h/a/../y.tar",
        "http://h/a/y.tar",
        "http://h:81/a/y.tar",
    ]
    names = [cache_name(u) for u in urls]
    assert len(set(names)) == len(names)
    assert cache_name("http://h/a/y.tar") == os.path.join("h", "a", "y.tar")
    assert cache_name("http://h/a/y.tar", "ab" * 32).endswith(".tar")
    assert cache_name("http://h/a/y.tar", "ab" * 32) != cache_name("http://h/a/y.tar")
