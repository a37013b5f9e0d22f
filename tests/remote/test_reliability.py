"""Faults, a soak, and the security properties: what a multi-day training run relies on."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time

import numpy as np
import pytest

import stoker
from stoker.manifest import write_manifest
from tests.support import REPO
from tests.support.server import ShardServer
from tests.support.shards import make_samples, write_tar

FAST = dict(backoff=0.05, max_backoff=0.5, stall_timeout=2.0)


def make_shards(folder, count: int, per_shard: int, size: int = 2000) -> list[str]:
    os.makedirs(folder, exist_ok=True)
    paths = []
    for i in range(count):
        samples = [(f"s{i}/{k}", f) for k, f in make_samples(per_shard, seed=i, size=size)]
        paths.append(write_tar(os.path.join(folder, f"shard-{i:04d}.tar"), samples))
    write_manifest(paths, folder)
    return paths


def python(code: str, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], **kwargs)


def cache_files(root) -> list[str]:
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in (".locks", ".index")]  # bookkeeping
        out += [os.path.join(folder, f) for f in files if f != ".stoker-cache"]
    return out


def assert_cache_consistent(root, manifest_folder) -> None:
    """Every complete file in the cache is byte for byte a shard of the manifest."""
    with open(os.path.join(manifest_folder, "stoker.json")) as f:
        digests = {e["sha256"] for e in json.load(f)["shards"]}
    for path in cache_files(root):
        if path.endswith(".part"):
            continue
        with open(path, "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() in digests, path


# -- faults ------------------------------------------------------------------------------

_FETCH_WITH_FSIZE_LIMIT = """
import resource, signal, sys, stoker
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
limit = int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
ds = stoker.Dataset(sys.argv[1], cache_dir=sys.argv[2])
try:
    ds.get_batch([0])
except stoker.FetchError as e:
    print("FetchError:", e)
    sys.exit(3)
"""


def test_a_full_cache_disk_is_a_clear_error_and_leaves_the_cache_valid(tmp_path):
    paths = make_shards(tmp_path / "data", 2, 30)
    with ShardServer(tmp_path / "data") as server:
        url = server.url_for("stoker.json")
        cache = tmp_path / "cache"
        limit = os.path.getsize(paths[0]) // 2  # the file-size limit: half a shard
        proc = subprocess.run(
            [sys.executable, "-c", _FETCH_WITH_FSIZE_LIMIT, url, str(cache), str(limit)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 3, proc.stderr
        assert "shard-0000.tar" in proc.stdout and "File too large" in proc.stdout
        assert [p for p in cache_files(cache) if os.path.getsize(p)] == []  # nothing partial
        # The same cache, without the limit, works.
        ds = stoker.Dataset(url, cache_dir=cache)
        assert len(ds.get_batch(range(60))) == 60
        assert_cache_consistent(cache, tmp_path / "data")


def test_a_shard_deleted_under_a_running_loader_is_named(tmp_path):
    paths = make_shards(tmp_path, 3, 40)
    ds = stoker.Dataset(paths)
    it = iter(stoker.Loader(ds, batch_size=8, shuffle=False, prefetch=1))
    next(it)  # reading shard 0
    os.unlink(paths[2])
    with pytest.raises(stoker.StokerError, match="shard-0002.tar"):
        for _ in it:
            pass


def test_a_shard_truncated_under_a_running_loader_is_named(tmp_path):
    paths = make_shards(tmp_path, 3, 40)
    ds = stoker.Dataset(paths)
    it = iter(stoker.Loader(ds, batch_size=8, shuffle=False, prefetch=1))
    next(it)
    with open(paths[1], "r+b") as f:
        f.truncate(os.path.getsize(paths[1]) // 3)
    with pytest.raises(stoker.StokerError, match="shard-0001.tar"):
        for _ in it:
            pass


def test_the_loader_carries_on_when_the_server_dies_and_comes_back(tmp_path):
    make_shards(tmp_path / "data", 6, 40, size=20000)
    with ShardServer(tmp_path / "data", bandwidth=2e6) as server:
        ds = stoker.Dataset(
            server.url_for("stoker.json"),
            cache_dir=tmp_path / "cache",
            # Full-jitter backoff of at most 0.5 s: 30 retries wait about 7 s on average,
            # never near the 1 s outage (10 retries, about 2 s on average, now and then were).
            fetch=stoker.FetchOptions(retries=30, connections=2, **FAST),
        )

        def outage() -> None:  # while a shard is on its way: the download must recover
            deadline = time.monotonic() + 30
            while server.active == 0 and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(0.1)
            server.restart(down_for=1.0)

        thread = threading.Thread(target=outage)
        thread.start()
        keys = [k for b in stoker.Loader(ds, batch_size=16, seed=1) for k in b["__key__"]]
        thread.join()
        assert len(keys) == len(set(keys)) == 240
        # It really broke a download, which was retried (resumed where the server allowed).
        assert len([r for r in server.requests if r.path.endswith(".tar")]) > 6


_LOAD_ALL = """
import sys, stoker
ds = stoker.Dataset(sys.argv[1], cache_dir=sys.argv[2], cache_limit=int(sys.argv[3]))
loader = stoker.Loader(ds, batch_size=16, seed=int(sys.argv[4]), shuffle_window=2)
keys = [k for b in loader for k in b["__key__"]]
print(len(keys), len(set(keys)))
"""


def test_killing_one_of_two_processes_again_and_again(tmp_path):
    paths = make_shards(tmp_path / "data", 12, 30, size=20000)
    limit = sum(os.path.getsize(p) for p in paths) // 2  # forces eviction too
    with ShardServer(tmp_path / "data", bandwidth=3e6) as server:
        args = [server.url_for("stoker.json"), str(tmp_path / "cache"), str(limit)]
        survivor = python(
            _LOAD_ALL, *args, "1", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        rng = random.Random(0)
        kills = 0
        deadline = time.monotonic() + 90
        while survivor.poll() is None and time.monotonic() < deadline:
            victim = python(_LOAD_ALL, *args, str(kills + 2), stdout=subprocess.DEVNULL)
            time.sleep(rng.uniform(0.2, 0.8))
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            kills += 1
        out, err = survivor.communicate(timeout=60)
        assert survivor.returncode == 0, err[-3000:]
        assert out.split() == ["360", "360"]
        assert kills >= 2
        assert_cache_consistent(tmp_path / "cache", tmp_path / "data")
        # And the cache still serves a newcomer completely.
        fresh = python(_LOAD_ALL, *args, "99", stdout=subprocess.PIPE, text=True)
        out, _ = fresh.communicate(timeout=60)
        assert out.split() == ["360", "360"]


# -- soak --------------------------------------------------------------------------------

SOAK_SECONDS = float(os.environ.get("STOKER_SOAK_SECONDS", 20))
RSS_GROWTH_BOUND = 64 << 20  # after the first epoch, resident memory grows less than this
FD_GROWTH_BOUND = 8  # and open descriptors other than sockets by less than this
# Sockets: the HTTP connections the pool keeps alive (how many is up to timing, never more
# than FetchOptions.connections) and the event loop's wake-up pair, plus slack.
SOCKET_BOUND = stoker.FetchOptions().connections + 4


def test_soak_two_processes_with_eviction(tmp_path):
    paths = make_shards(tmp_path / "data", 200, 12, size=1500)
    limit = sum(os.path.getsize(p) for p in sorted(paths, key=os.path.getsize)[-60:])
    with ShardServer(tmp_path / "data") as server:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    os.path.join(REPO, "tests", "support", "soak.py"),
                    server.url_for("stoker.json"),
                    str(tmp_path / "cache"),
                    str(limit),
                    str(SOAK_SECONDS),
                    str(seed),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for seed in (1, 2)
        ]
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=SOAK_SECONDS + 120)
            assert proc.returncode == 0, err[-2000:]
            results.append([json.loads(line) for line in out.splitlines()])
    for epochs in results:
        assert len(epochs) >= 2, epochs
        assert all(e["exactly_once"] for e in epochs), epochs
        after_first = epochs[0]
        assert max(e["rss"] for e in epochs) - after_first["rss"] < RSS_GROWTH_BOUND, epochs
        assert max(e["fds"] for e in epochs) - after_first["fds"] < FD_GROWTH_BOUND, epochs
        assert max(e["sockets"] for e in epochs) <= SOCKET_BOUND, epochs
    assert sum(os.path.getsize(p) for p in cache_files(tmp_path / "cache")) <= limit


# -- security ----------------------------------------------------------------------------


def test_hostile_member_names_are_harmless(tmp_path):
    shard = tmp_path / "in" / "evil.tar"
    shard.parent.mkdir()
    with tarfile.open(shard, "w") as tar:
        for name, data in (("../../escape.txt", b"x"), ("/etc/abs.txt", b"y"), ("ok.txt", b"z")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, __import__("io").BytesIO(data))
        link = tarfile.TarInfo("link.txt")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    before = set(os.listdir(tmp_path))
    ds = stoker.Dataset(shard)
    got = {s["__key__"]: bytes(s["txt"]) for s in ds.get_batch(range(len(ds)))}
    assert got == {"../../escape": b"x", "/etc/abs": b"y", "ok": b"z"}  # the link is skipped
    assert set(os.listdir(tmp_path)) == before  # nothing was extracted anywhere
    result = subprocess.run(
        [sys.executable, "-m", "stoker", "pack", str(shard), str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1 and "not a safe relative name" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("source", ["ftp://host/a.tar", "file:///etc/passwd.tar", "az://c/a.tar"])
def test_only_http_and_object_stores_are_fetched(source):
    with pytest.raises(stoker.StokerError, match="local paths, http.s. URLs, s3:// and gs://"):
        stoker.Dataset(source)


def test_redirects_are_bounded_and_stay_on_http(tmp_path):
    make_shards(tmp_path / "data", 1, 10)
    with ShardServer(tmp_path / "data") as server:
        fast = stoker.FetchOptions(retries=1, **FAST)
        server.fault("moved.tar", "302", times=None, location=server.url_for("shard-0000.tar"))
        ds = stoker.Dataset(server.url_for("moved.tar"), cache_dir=tmp_path / "c1", fetch=fast)
        assert len(ds.get_batch(range(10))) == 10  # an http redirect is followed
        server.fault("loop.tar", "302", times=None, location=server.url_for("loop.tar"))
        with pytest.raises(stoker.FetchError, match="redirect"):
            stoker.Dataset(server.url_for("loop.tar"), cache_dir=tmp_path / "c2", fetch=fast)
        server.fault("away.tar", "302", times=None, location="ftp://127.0.0.1/shard-0000.tar")
        with pytest.raises(stoker.FetchError, match="redirect"):
            stoker.Dataset(server.url_for("away.tar"), cache_dir=tmp_path / "c3", fetch=fast)
        for refused in ("c2", "c3"):
            assert not any(p.endswith(".tar") for p in cache_files(tmp_path / refused))


_LOAD_FROM_WATCHED = """
import sys, stoker
ds = stoker.Dataset(sys.argv[1], cache_dir=sys.argv[2])
for _ in stoker.Loader(ds, batch_size=4):
    pass
"""


def test_nothing_is_written_outside_the_cache(tmp_path):
    make_shards(tmp_path / "data", 2, 10)
    watched = tmp_path / "watched"
    watched.mkdir()
    # Everywhere a process might write by default (home, caches, temp, its folder) is in
    # the watched tree; only the cache may get files.
    env = {
        **os.environ,
        "HOME": str(watched),
        "XDG_CACHE_HOME": str(watched / "xdg"),
        "TMPDIR": str(watched),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    with ShardServer(tmp_path / "data") as server:
        cache = watched / "cache"
        subprocess.run(
            [sys.executable, "-c", _LOAD_FROM_WATCHED, server.url_for("stoker.json"), str(cache)],
            cwd=watched,
            env=env,
            check=True,
            timeout=60,
        )
    written = []
    for folder, _, files in os.walk(watched):
        written += [os.path.join(folder, f) for f in files]
    assert written and all(p.startswith(str(cache) + os.sep) for p in written)
    assert np.all([os.stat(p).st_mode & 0o077 == 0 for p in written])


def test_bytes_that_are_no_http_response_are_retried_on_a_fresh_connection(tmp_path):
    make_shards(tmp_path / "data", 1, 10)
    with ShardServer(tmp_path / "data") as server:
        server.fault("shard-0000.tar", "garbage")  # once: as a broken proxy would answer
        fetch = stoker.FetchOptions(retries=2, **FAST)
        url = server.url_for("shard-0000.tar")
        ds = stoker.Dataset(url, cache_dir=tmp_path / "c1", fetch=fetch)
        assert len(ds.get_batch(range(10))) == 10
        assert server.count("shard-0000.tar") >= 2  # the garbage, then a good answer
        server.fault("shard-0000.tar", "garbage", times=None)  # every time: a clear error
        ds = stoker.Dataset(url, cache_dir=tmp_path / "c2", fetch=fetch)  # (its manifest)
        with pytest.raises(stoker.FetchError, match=r"shard-0000.tar.*not an HTTP response"):
            ds.get_batch(range(10))


_HTTPS_TO_HTTP = """
import sys, stoker
url, cache, allow = sys.argv[1], sys.argv[2], sys.argv[3] == "allow"
fetch = stoker.FetchOptions(retries=0, allow_insecure_redirects=allow)
try:
    ds = stoker.Dataset(url, cache_dir=cache, fetch=fetch)
    print("read", len(ds.get_batch(range(len(ds)))))
except stoker.FetchError as e:
    print("refused:", e)
"""


def _self_signed(folder) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key, made by openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not on PATH (.ci/run installs it)")
    cert, key = str(folder / "cert.pem"), str(folder / "key.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        + ["-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"]
        + ["-keyout", key, "-out", cert],
        check=True,
        capture_output=True,
    )
    return cert, key


def test_a_redirect_from_https_to_http_is_refused_unless_allowed(tmp_path):
    import ssl

    make_shards(tmp_path / "data", 1, 10)
    cert, key = _self_signed(tmp_path)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    env = {**os.environ, "SSL_CERT_FILE": cert}  # the client trusts this certificate
    with ShardServer(tmp_path / "data") as plain, ShardServer(tmp_path / "data", tls=tls) as safe:
        target = plain.url_for("shard-0000.tar")
        safe.fault("moved.tar", "302", times=None, location=target)
        url = safe.url_for("moved.tar")
        assert url.startswith("https://")
        runs = {}
        for allow in ("refuse", "allow"):
            runs[allow] = subprocess.run(
                [sys.executable, "-c", _HTTPS_TO_HTTP, url, str(tmp_path / allow), allow],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            ).stdout
        assert "refused:" in runs["refuse"] and url in runs["refuse"]
        assert "redirected from https to http://" in runs["refuse"]
        assert not any(p.endswith(".tar") for p in cache_files(tmp_path / "refuse"))
        assert "read 10" in runs["allow"]
