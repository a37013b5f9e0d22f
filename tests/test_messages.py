"""What a user sees when something is wrong: one line, naming what was passed and what to
pass instead, quoting at most a few hundred characters of anything read from outside."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import zipfile

import pytest

import stoker
from stoker.tools.cli import main, parse_size
from tests.support.shards import make_samples, write_tar


@pytest.fixture
def shard(tmp_path) -> str:
    samples = [(f"k{i}", {"raw": bytes(12), "cls": b"%d" % i}) for i in range(10)]
    return write_tar(tmp_path / "s.tar", samples)


def one_line(error: BaseException) -> str:
    text = str(error)
    assert "\n" not in text, text
    return text


def test_fields_as_a_list_says_to_pass_a_dict(shard):
    with pytest.raises(TypeError) as error:  # a stoker.UsageError, which is a TypeError
        stoker.Loader(stoker.Dataset(shard), 4, fields=["raw", "cls"])
    text = one_line(error.value)
    assert isinstance(error.value, stoker.StokerError)
    assert "not a list (['raw', 'cls'])" in text
    assert "{'raw': stoker.Bytes(), 'cls': stoker.Int()}" in text


def test_a_field_value_that_is_not_a_decoder(shard):
    with pytest.raises(stoker.UsageError, match="not a stoker field decoder; use stoker.Raw"):
        stoker.Loader(stoker.Dataset(shard), 4, fields={"raw": "uint8"})


def test_a_loader_over_something_else_says_what_it_reads():
    with pytest.raises(TypeError) as error:
        stoker.Loader([b"a", b"b"], 2)
    text = one_line(error.value)
    assert "reads a stoker.Dataset, not a list" in text
    assert "torch.utils.data.DataLoader" in text and "stoker.Dataset(" in text


def test_slices_give_samples_and_other_indexes_point_to_get_batch(shard):
    ds = stoker.Dataset(shard)
    assert [s["__key__"] for s in ds[0:3]] == ["k0", "k1", "k2"]
    assert [s["__key__"] for s in ds[-2:]] == ["k8", "k9"]
    assert [s["__key__"] for s in ds[::4]] == ["k0", "k4", "k8"]
    assert ds[9:100] and ds[5:2] == []
    with pytest.raises(TypeError, match=r"use ds.get_batch\(indices\)"):
        ds[[1, 2]]
    with pytest.raises(stoker.UsageError, match="not a str"):
        ds["k1"]


def test_torch_dataloader_reads_a_whole_batch_at_once(shard):
    import torch

    ds = stoker.Dataset(shard)
    calls = []
    real = ds.get_batch

    def counting(indices):
        calls.append(len(indices))
        return real(indices)

    ds.get_batch = counting
    keys = []
    loader = torch.utils.data.DataLoader(ds, batch_size=4, collate_fn=lambda b: b)
    for batch in loader:
        keys += [s["__key__"] for s in batch]
    assert keys == [f"k{i}" for i in range(10)] and calls == [4, 4, 2]


def test_int_over_text_names_the_field_and_the_sample_in_a_deflated_zip(tmp_path):
    path = tmp_path / "z.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for i in range(6):
            z.writestr(f"k{i}.cls", b"12" if i != 4 else b"twelve")
    loader = stoker.Loader(stoker.Dataset(str(path)), 6, fields={"cls": stoker.Int()})
    with pytest.raises(stoker.ShardFormatError) as error:
        next(iter(loader))
    text = one_line(error.value)
    assert "field 'cls' of sample 'k4': not an integer: 'twelve'" in text
    assert text.startswith(str(path))


def test_a_server_that_is_down_is_named_by_the_url_given():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/shard-{{0..3}}.tar"
    with pytest.raises(stoker.FetchError) as error:
        stoker.Dataset(url, fetch=stoker.FetchOptions(retries=0))
    text = one_line(error.value)
    assert text.startswith(f"http://127.0.0.1:{port}/shard-0.tar: ")
    assert "gave up after 1 attempt;" in text  # not "1 attempts"
    assert "stoker.json:" not in text  # the manifest looked for is not what failed


class _GarbageServer:
    """A TCP server that answers the size probe properly, then any range request with 40 KB
    of random bytes instead of an HTTP response."""

    def __init__(self, size: int) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.size = size
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                request = b""
                while b"\r\n\r\n" not in request:
                    data = conn.recv(65536)
                    if not data:
                        break
                    request += data
                if b"stoker.json" in request.split(b"\r\n")[0]:
                    conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                elif b"bytes=0-0" in request:
                    conn.sendall(
                        b"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-0/%d\r\n"
                        b"Content-Length: 1\r\nConnection: close\r\n\r\nx" % self.size
                    )
                else:
                    conn.sendall(os.urandom(40_000))


def test_garbage_from_a_server_is_quoted_briefly(shard):
    server = _GarbageServer(os.path.getsize(shard))
    try:
        with pytest.raises(stoker.FetchError) as error:
            stoker.Dataset(
                f"http://127.0.0.1:{server.port}/s.tar", fetch=stoker.FetchOptions(retries=0)
            )
    finally:
        server.sock.close()
    text = one_line(error.value)
    assert len(text) < 400, len(text)
    assert "characters in all)" in text


def test_a_megabyte_member_name_is_quoted_briefly(tmp_path):
    import tarfile

    path = tmp_path / "long.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo("x" * 100_000 + ".bin")
        info.size = 1_000_000  # runs past the end: the error quotes the name
        tar.addfile(info)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 512)
    with pytest.raises(stoker.ShardFormatError) as error:
        stoker.Dataset(str(path))
    assert len(str(error.value)) < 500 and "(100004 bytes)" in str(error.value)


def test_pack_says_keys_as_text_not_numpy(tmp_path, capsys):
    root = tmp_path / "classes"
    for cls in ("bird", "cat"):
        (root / cls).mkdir(parents=True)
        (root / cls / "x.png").write_bytes(b"1")
        (root / cls / "x.jpg").write_bytes(b"2")
    assert main(["pack", str(root), str(tmp_path / "out"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "np.str_" not in err and "'bird/x'" in err


@pytest.mark.parametrize(
    "text,size",
    [
        ("8M", 8 << 20),
        ("8MiB", 8 << 20),
        ("8MB", 8_000_000),
        ("8kB", 8000),
        ("200G", 200 << 30),
        ("2.", 2),
        ("1.5K", 1536),
    ],
)
def test_size_units(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["8Mb", "8mb", "8 megs", "1.5", "-3", "8KiBs"])
def test_size_units_that_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="not a"):
        parse_size(text)


def test_cache_limit_of_8mb_is_refused_on_the_command_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "stoker", "fetch", "http://x/a.tar", "--cache-limit", "8Mb"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert (
        "'8Mb' is not a size" in result.stderr and "lower-case b would mean bits" in result.stderr
    )


def test_fetch_prints_sizes_as_the_other_commands_do(tmp_path, capsys):
    from tests.support.server import ShardServer

    folder = tmp_path / "served"
    folder.mkdir()
    write_tar(folder / "a.tar", [(f"k{i}", {"raw": bytes(5000)}) for i in range(40)])
    stoker.manifest.write_manifest([str(folder / "a.tar")], folder)
    with ShardServer(str(folder)) as server:
        url = server.url_for("stoker.json")
        args = ["fetch", url, "--cache-dir", str(tmp_path / "c"), "--quiet"]
        assert main([*args, "--cache-limit", "100kB"]) == 1  # too small for two shards
        assert main(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"^1 shard\(s\), [\d.]+ kB, in ", out, re.M), out


def test_a_manifest_that_no_longer_matches_its_folder(tmp_path, caplog, capsys):
    for name in ("a", "b", "c"):
        write_tar(tmp_path / f"{name}.tar", [(f"{name}{i}", {"cls": b"1"}) for i in range(3)])
    stoker.manifest.write_manifest(
        [str(tmp_path / "a.tar"), str(tmp_path / "b.tar")], tmp_path
    )  # c.tar is not listed
    with caplog.at_level(logging.WARNING, "stoker"):
        ds = stoker.Dataset(str(tmp_path))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1
    assert "does not list 1 shard file beside it (c.tar)" in said[0]
    assert f"run `stoker index {tmp_path}`" in said[0]
    assert len(ds) == 6
    os.unlink(tmp_path / "b.tar")  # and now b.tar is gone: the dataset cannot be read whole
    with pytest.raises(stoker.ReadError) as error:
        stoker.Dataset(str(tmp_path))
    assert error.value.errno == errno.ENOENT and error.value.path == str(tmp_path / "b.tar")
    assert "the manifest lists this shard but it is not there" in one_line(error.value)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "lists 1 missing shard (b.tar)" in out and "(c.tar)" in out
    assert main(["index", str(tmp_path)]) == 0
    caplog.clear()
    with caplog.at_level(logging.WARNING, "stoker"):
        assert len(stoker.Dataset(str(tmp_path))) == 6
    assert not caplog.records
    listed = [s["path"] for s in json.loads((tmp_path / "stoker.json").read_text())["shards"]]
    assert listed == ["a.tar", "c.tar"]


def test_inspect_says_when_a_manifest_counts_otherwise(tmp_path, capsys):
    write_tar(tmp_path / "a.tar", [(f"a{i}", {"cls": b"1"}) for i in range(3)])
    stoker.manifest.write_manifest([str(tmp_path / "a.tar")], tmp_path)
    write_tar(tmp_path / "a.tar", [(f"a{i}", {"cls": b"1"}) for i in range(5)])  # rewritten
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "the manifest is out of date for 1 shard (a.tar holds 5 samples, not 3)" in out
    assert f"run `stoker index {tmp_path}`" in out


def test_a_manifest_of_another_name_may_describe_part_of_its_folder(tmp_path, caplog):
    for name in ("a", "b"):
        write_tar(tmp_path / f"{name}.tar", [(f"{name}{i}", {"cls": b"1"}) for i in range(3)])
    stoker.manifest.write_manifest([str(tmp_path / "a.tar")], tmp_path / "train.json")
    with caplog.at_level(logging.WARNING, "stoker"):
        assert len(stoker.Dataset(str(tmp_path / "train.json"))) == 3
    assert not caplog.records


def test_an_html_page_where_a_manifest_would_be_is_not_one(tmp_path):
    # A server that answers any name with a page (a single-page app's fallback): stoker
    # looks at the shards themselves instead.
    from tests.support.server import ShardServer

    folder = tmp_path / "served"
    folder.mkdir()
    write_tar(folder / "a.tar", [(f"k{i}", {"cls": b"%d" % i}) for i in range(4)])
    (folder / "stoker.json").write_text("<!doctype html><html><body>Welcome</body></html>")
    with ShardServer(str(folder)) as server:
        ds = stoker.Dataset(server.url_for("a.tar"), cache_dir=str(tmp_path / "cache"))
        assert len(ds) == 4 and bytes(ds[3]["cls"]) == b"3"


def test_a_member_name_with_a_newline_stays_on_one_line(tmp_path):
    import tarfile

    path = tmp_path / "nl.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("evil\nname.bin")
        info.size = 10_000  # runs past the end: the error quotes the name
        tar.addfile(info)
    with pytest.raises(stoker.ShardFormatError) as error:
        stoker.Dataset(str(path))
    assert "'evil\\x0aname.bin'" in one_line(error.value)


def test_a_decoder_class_instead_of_a_decoder(shard):
    with pytest.raises(stoker.UsageError, match=r"call it: stoker.Int\(\)"):
        stoker.Loader(stoker.Dataset(shard), 4, fields={"cls": stoker.Int})
    with pytest.raises(ValueError, match="empty name"):  # a value problem: a ValueError too
        stoker.Loader(stoker.Dataset(shard), 4, fields={"cls;": stoker.Int()})


def test_arguments_stoker_cannot_use_are_usage_errors(tmp_path):
    """A wrong argument is a stoker.UsageError, which the built-in TypeError and
    ValueError handlers catch too, as they would the built-in error for it."""
    from stoker.loader.sampler import plan_epoch, rank_stretch

    write_tar(tmp_path / "a.tar", make_samples(8))
    ds = stoker.Dataset(str(tmp_path / "a.tar"))
    wrong = [
        lambda: stoker.Loader(ds, 0),
        lambda: stoker.Loader(ds, 4, prefetch=0),
        lambda: stoker.Loader(ds, 4, pinned_bytes=0),
        lambda: stoker.Loader(ds, 4, rank=2, world_size=2),
        lambda: stoker.Loader(ds, 4, seed=-1),  # numpy's SeedSequence takes none below 0
        lambda: stoker.Loader(ds, 4, seed=1.5),
        lambda: stoker.Loader(ds, 4, seed=True),
        lambda: stoker.Dataset(3.5),
        lambda: rank_stretch(10, 3, 2, True),
        lambda: plan_epoch(
            [4], batch_size=0, shuffle=False, seed=0, epoch=0, rank=0, world_size=1, drop_last=False
        ),
    ]
    for call in wrong:
        with pytest.raises(stoker.UsageError) as e:
            call()
        assert isinstance(e.value, ValueError) and isinstance(e.value, TypeError)
