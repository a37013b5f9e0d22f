"""The servers, seen by a plain client: stoker.tools.serve (the plain file server users run)
and the tests' ShardServer built on it (files, ranges, the link model, faults, counters)."""

import http.client
import os
import random
import socket
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from stoker.tools import serve
from tests.support.server import ShardServer, ShardServerProcess

SIZE = 2 * 1024 * 1024
# What a client may see when the server hangs up mid-body.
BROKEN = (ConnectionError, http.client.IncompleteRead, http.client.RemoteDisconnected)


@pytest.fixture
def root(tmp_path):
    folder = tmp_path / "root"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.bin").write_bytes(random.Random(0).randbytes(SIZE))
    (folder / "sub" / "b.txt").write_bytes(b"hello from b\n")
    (folder / "with space.bin").write_bytes(b"spaced")
    (folder / "empty.bin").write_bytes(b"")
    (tmp_path / "secret.txt").write_bytes(b"do not serve")
    return folder


@pytest.fixture
def data(root):
    return (root / "a.bin").read_bytes()


@pytest.fixture
def server(root):
    with ShardServer(root) as s:
        yield s


def request(server, path, method="GET", headers=None, timeout=5.0):
    """(status, headers, body) of one request on a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        conn.request(method, path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.headers, resp.read()
    finally:
        conn.close()


def open_body(server, path, timeout=5.0):
    """The response of a GET, body not yet read, and its connection."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    conn.request("GET", path)
    return conn, conn.getresponse()


def wait_for(cond, timeout=2.0):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.005)


# -- files ----------------------------------------------------------------------------


def test_get_whole_file(server, data):
    assert server.port != 0 and server.url == f"http://127.0.0.1:{server.port}"
    status, headers, body = request(server, "/a.bin")
    assert status == 200 and body == data
    assert headers["Content-Length"] == str(SIZE)
    assert headers["Accept-Ranges"] == "bytes"
    assert headers["ETag"] and headers["Last-Modified"].endswith("GMT")
    assert request(server, "/sub/b.txt")[2] == b"hello from b\n"
    assert request(server, "/empty.bin")[:1] == (200,)


def test_url_for_quotes(server):
    with urllib.request.urlopen(server.url_for("with space.bin"), timeout=5) as resp:
        assert resp.read() == b"spaced"
    assert server.url_for("sub/b.txt") == server.url + "/sub/b.txt"


def test_head(server):
    status, headers, body = request(server, "/a.bin", "HEAD")
    assert status == 200 and body == b""
    assert headers["Content-Length"] == str(SIZE)
    assert headers["Accept-Ranges"] == "bytes"
    assert server.bytes_sent == 0


@pytest.mark.parametrize(
    "spec, first, last",
    [
        ("bytes=0-9", 0, 9),
        ("bytes=100-", 100, SIZE - 1),
        ("bytes=-50", SIZE - 50, SIZE - 1),
        ("bytes=10-99999999", 10, SIZE - 1),
        ("bytes=-99999999", 0, SIZE - 1),
        (f"bytes={SIZE - 1}-{SIZE - 1}", SIZE - 1, SIZE - 1),
    ],
)
def test_range(server, data, spec, first, last):
    status, headers, body = request(server, "/a.bin", headers={"Range": spec})
    assert status == 206
    assert headers["Content-Range"] == f"bytes {first}-{last}/{SIZE}"
    assert headers["Content-Length"] == str(last - first + 1)
    assert body == data[first : last + 1]


@pytest.mark.parametrize("spec", [f"bytes={SIZE}-", f"bytes={SIZE + 5}-{SIZE + 9}", "bytes=-0"])
def test_unsatisfiable_range(server, spec):
    status, headers, body = request(server, "/a.bin", headers={"Range": spec})
    assert status == 416 and body == b""
    assert headers["Content-Range"] == f"bytes */{SIZE}"


def test_empty_file_range_unsatisfiable(server):
    status, headers, _ = request(server, "/empty.bin", headers={"Range": "bytes=0-"})
    assert status == 416 and headers["Content-Range"] == "bytes */0"


@pytest.mark.parametrize("spec", ["bytes=9-2", "items=0-1", "bytes=0-1,5-6", "bytes=x-"])
def test_ignored_range_gives_whole_file(server, data, spec):
    status, headers, body = request(server, "/a.bin", headers={"Range": spec})
    assert status == 200 and body == data and "Content-Range" not in headers


def test_if_range(server, data):
    etag = request(server, "/a.bin", "HEAD")[1]["ETag"]
    hit = request(server, "/a.bin", headers={"Range": "bytes=0-3", "If-Range": etag})
    assert hit[0] == 206 and hit[2] == data[:4]
    miss = request(server, "/a.bin", headers={"Range": "bytes=0-3", "If-Range": '"other"'})
    assert miss[0] == 200 and miss[2] == data


def test_ranges_off(root, data):
    with ShardServer(root, ranges=False) as server:
        status, headers, body = request(server, "/a.bin", headers={"Range": "bytes=0-9"})
        assert status == 200 and body == data
        assert "Accept-Ranges" not in headers and "Content-Range" not in headers


def test_paths_outside_root_or_not_files(server, root, tmp_path):
    os.symlink(tmp_path / "secret.txt", root / "link.txt")
    for path in [
        "/../secret.txt",
        "/%2e%2e/secret.txt",
        "/sub/../../secret.txt",
        "/sub/%2e%2e/%2e%2e/secret.txt",
        "/..%2fsecret.txt",
        "//" + str(tmp_path / "secret.txt"),
        "/link.txt",
        "/sub",
        "/",
        "/missing.bin",
    ]:
        status, _, body = request(server, path)
        assert status == 404, path
        assert b"do not serve" not in body


def test_other_methods_refused(server):
    assert request(server, "/a.bin", "POST")[0] == 405


# -- faults ---------------------------------------------------------------------------


def test_status_faults(server, data):
    server.fault("a.bin", "503", retry_after=7)
    server.fault("a.bin", "status", status=500)
    server.fault("a.bin", "429", retry_after=2)
    server.fault("a.bin", "404")
    status, headers, body = request(server, "/a.bin")
    assert (status, headers["Retry-After"], body) == (503, "7", b"")
    status, headers, body = request(server, "/a.bin")
    assert (status, body) == (500, b"") and "Retry-After" not in headers
    status, headers, _ = request(server, "/a.bin")
    assert (status, headers["Retry-After"]) == (429, "2")
    assert request(server, "/a.bin")[0] == 404
    assert request(server, "/a.bin")[2] == data  # all used up


def test_fault_pattern_and_head(server):
    server.fault("*.txt", "503")
    assert request(server, "/a.bin")[0] == 200
    assert request(server, "/sub/b.txt", "HEAD")[0] == 200  # HEAD does not use faults
    assert request(server, "/sub/b.txt")[0] == 503
    assert request(server, "/sub/b.txt")[0] == 200


def test_fault_times(server):
    server.fault("a.bin", "503", times=2)
    assert [request(server, "/a.bin", "GET")[0] for _ in range(3)] == [503, 503, 200]
    server.fault("a.bin", "404", times=None)
    # A HEAD is refused (or redirected) as its GET would be, without using up the fault.
    assert [request(server, "/a.bin", "HEAD")[0] for _ in range(2)] == [404, 404]
    assert [request(server, "/a.bin")[0] for _ in range(3)] == [404, 404, 404]
    server.clear_faults()
    assert request(server, "/a.bin", "HEAD")[0] == 200
    assert request(server, "/sub/b.txt")[0] == 200


def test_fault_arguments_checked(server):
    with pytest.raises(ValueError):
        server.fault("*", "explode")
    with pytest.raises(TypeError):
        server.fault("*", "reset", at=3)
    with pytest.raises(TypeError):
        server.fault("*", "status")
    with pytest.raises(ValueError):
        server.fault("*", "503", times=0)


def test_reset(server, data):
    server.fault("a.bin", "reset", after=1000)
    conn, resp = open_body(server, "/a.bin")
    assert resp.status == 200 and resp.headers["Content-Length"] == str(SIZE)
    with pytest.raises(BROKEN):
        resp.read()
    conn.close()
    assert request(server, "/a.bin")[2] == data


def test_reset_on_a_range(server):
    server.fault("a.bin", "reset")
    with pytest.raises(BROKEN):
        request(server, "/a.bin", headers={"Range": "bytes=100-"})
    assert server.requests[-1].status == 206
    wait_for(lambda: server.bytes_sent == (SIZE - 100) // 2)


def test_short(server, data):
    server.fault("a.bin", "short", after=1000)
    conn, resp = open_body(server, "/a.bin")
    assert resp.headers["Content-Length"] == str(SIZE)
    with pytest.raises(http.client.IncompleteRead) as info:
        resp.read()
    conn.close()
    assert info.value.partial == data[:1000]
    assert request(server, "/a.bin")[2] == data


def test_corrupt(server, data):
    server.fault("a.bin", "corrupt", at=10, count=3)
    server.fault("a.bin", "corrupt")
    for first, last in [(10, 13), (SIZE // 2, SIZE // 2 + 1)]:
        status, _, body = request(server, "/a.bin")
        assert status == 200 and len(body) == SIZE
        got, want = np.frombuffer(body, np.uint8), np.frombuffer(data, np.uint8)
        diff = np.flatnonzero(got != want)
        assert diff.tolist() == list(range(first, last))
        assert (got[diff] == want[diff] ^ 0xFF).all()


def test_stall_then_rest(server, data):
    server.fault("a.bin", "stall", after=1000, seconds=0.3)
    start = time.monotonic()
    assert request(server, "/a.bin")[2] == data
    assert time.monotonic() - start >= 0.3


def test_stall_times_out_client(server, data):
    server.fault("a.bin", "stall", after=1000)
    conn, resp = open_body(server, "/a.bin", timeout=0.3)
    assert resp.read(1000) == data[:1000]
    with pytest.raises((TimeoutError, socket.timeout)):
        resp.read(1)
    conn.close()
    wait_for(lambda: server.active == 0)  # the stalled handler ends with the client


def test_slow(server, data):
    server.fault("a.bin", "slow", bandwidth=10e6)
    start = time.monotonic()
    assert request(server, "/a.bin")[2] == data
    assert time.monotonic() - start >= 0.15


# -- the link model -------------------------------------------------------------------


def test_latency(root):
    with ShardServer(root, latency=0.2) as server:
        for path in ["/sub/b.txt", "/missing.bin"]:
            start = time.monotonic()
            request(server, path)
            assert time.monotonic() - start >= 0.2


def test_bandwidth(root, data):
    with ShardServer(root, bandwidth=10e6) as server:
        start = time.monotonic()
        assert request(server, "/a.bin")[2] == data
        assert 0.15 <= time.monotonic() - start < 2.0


# -- counters -------------------------------------------------------------------------


def test_counters(server):
    server.fault("a.bin", "503")
    request(server, "/a.bin")
    request(server, "/a.bin", headers={"Range": "bytes=0-9"})
    request(server, "/a.bin", "HEAD")
    request(server, "/missing.bin")
    assert server.count("a.bin") == 2 and server.count("/a.bin") == 2
    assert server.count("a.bin", "HEAD") == 1
    assert [(r.method, r.path, r.range, r.status) for r in server.requests] == [
        ("GET", "a.bin", None, 503),
        ("GET", "a.bin", "bytes=0-9", 206),
        ("HEAD", "a.bin", None, 200),
        ("GET", "missing.bin", None, 404),
    ]
    assert server.bytes_sent == 10
    server.reset_counters()
    assert server.requests == [] and server.bytes_sent == 0 and server.count("a.bin") == 0


def test_active_and_max_active(root):
    with ShardServer(root, latency=0.5) as server:
        threads = [threading.Thread(target=request, args=(server, "/sub/b.txt")) for _ in range(3)]
        for t in threads:
            t.start()
        wait_for(lambda: server.active >= 2)
        for t in threads:
            t.join()
        wait_for(lambda: server.active == 0)
        assert server.max_active >= 2
        server.reset_counters()
        assert server.max_active == 0


def test_client_hanging_up_ends_the_response(server):
    server.fault("a.bin", "slow", bandwidth=100e3)
    conn, resp = open_body(server, "/a.bin")
    resp.read(1000)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_for(lambda: server.active == 0)


# -- lifecycle ------------------------------------------------------------------------


def test_restart_on_same_port(root, data):
    with ShardServer(root) as server:
        port = server.port
        assert request(server, "/a.bin")[2] == data
        server.restart()
        assert server.port == port
        assert request(server, "/a.bin")[2] == data
        assert server.count("a.bin") == 2
    assert not server.running
    with pytest.raises(OSError):
        request(server, "/a.bin", timeout=1)


def test_stop_during_stall_is_prompt(root):
    server = ShardServer(root).start()
    server.fault("a.bin", "stall", after=1000)
    conn, resp = open_body(server, "/a.bin")
    resp.read(1000)
    errors = []

    def read_rest():
        try:
            resp.read()
        except Exception as exc:
            errors.append(exc)

    reader = threading.Thread(target=read_rest)
    reader.start()
    start = time.monotonic()
    server.stop()
    assert time.monotonic() - start < 2.0
    reader.join(2.0)
    assert not reader.is_alive() and isinstance(errors[0], BROKEN)
    conn.close()


def test_main_rejects_a_non_folder(tmp_path):
    with pytest.raises(SystemExit):
        serve.main([str(tmp_path / "nope")])


def test_plain_server_process_serves_ranges_and_refuses_what_is_outside(root, data):
    # `python -m stoker.tools.serve ROOT`, the documented tool, in a process of its own.
    with serve.ServerProcess(root) as proc:
        with urllib.request.urlopen(proc.url_for("a.bin"), timeout=10) as resp:
            assert resp.status == 200 and resp.read() == data
        req = urllib.request.Request(proc.url_for("a.bin"), headers={"Range": "bytes=10-19"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 206 and resp.read() == data[10:20]
            assert resp.headers["Content-Range"] == f"bytes 10-19/{SIZE}"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(proc.url + "/../secret.txt", timeout=10)
        assert err.value.code == 404


def test_plain_server_has_no_faults_or_link_model(root):
    # What users run carries none of the tests' machinery.
    with serve.FileServer(root) as plain:
        assert not hasattr(plain, "fault") and not hasattr(plain, "latency")
        status, _, body = request(plain, "/sub/b.txt")
        assert (status, body) == (200, b"hello from b\n")


def test_shard_server_process_paces_its_link(root):
    with ShardServerProcess(root, latency=0.3) as proc:
        start = time.monotonic()
        with urllib.request.urlopen(proc.url_for("sub/b.txt"), timeout=10) as resp:
            assert resp.read() == b"hello from b\n"
        assert time.monotonic() - start >= 0.3
