"""Member index sidecars (SHARD.stoker-idx): written by `stoker index`, `stoker pack` and
write_manifest; a shard opened with one costs no walk over its headers; a sidecar that is
not for the shard as it is now, or is damaged, is never trusted."""

from __future__ import annotations

import logging
import os
import shutil
import struct
import tarfile
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stoker
from stoker import _core
from stoker.manifest import write_manifest
from stoker.tools.cli import main
from tests.support.shards import as_bytes, make_samples, write_tar, write_zip

SUFFIX = _core.SIDECAR_SUFFIX


def _index(path: str, fmt: str = "tar") -> dict:
    return _core.index_shards([path], [fmt], 1)[0]


def _same(a: dict, b: dict) -> None:
    assert a["keys"] == b["keys"] and a["field_names"] == b["field_names"]
    for column in ("sample_start", "member_field", "member_offset", "member_length"):
        assert np.array_equal(a[column], b[column]), column
    for column in ("member_out_length", "member_codec", "member_crc"):
        assert np.array_equal(a[column], b[column]), column
    assert a["key_runs"] == b["key_runs"]


@pytest.mark.parametrize("fmt", ["tar", "zip"])
def test_write_manifest_writes_the_member_index_and_opening_uses_it(tmp_path, fmt):
    samples = make_samples(50)
    path = str(tmp_path / f"s.{fmt}")
    (write_tar if fmt == "tar" else write_zip)(path, samples)
    walked = _index(path, fmt)
    assert walked["sidecar"] == _core.SidecarState.NONE  # none yet
    write_manifest([path], tmp_path)
    assert os.path.exists(path + SUFFIX)
    from_sidecar = _index(path, fmt)
    assert from_sidecar["sidecar"] == _core.SidecarState.USED
    _same(walked, from_sidecar)


def test_a_shard_with_its_index_is_never_walked(tmp_path):
    # Damage a tar header the index covers, keeping the shard's size and time: a walk
    # would refuse the shard; its member index makes walking unnecessary, and every
    # member's bytes (untouched) read back right.
    samples = make_samples(30)
    path = write_tar(tmp_path / "s.tar", samples)
    write_manifest([path], tmp_path)
    st_before = os.stat(path)
    with tarfile.open(path) as tar:
        header = tar.getmembers()[5].offset
    with open(path, "r+b") as f:
        f.seek(header + 148)  # a later member's header checksum
        f.write(b"XXXXXXXX")
    os.utime(path, ns=(st_before.st_atime_ns, st_before.st_mtime_ns))
    os.rename(path + SUFFIX, tmp_path / "away")
    with pytest.raises(stoker.ShardFormatError, match="checksum"):
        stoker.Dataset(path)  # without its index: walked, and refused
    os.rename(tmp_path / "away", path + SUFFIX)
    for source in (str(tmp_path), path):  # through the manifest, or the shard alone
        ds = stoker.Dataset(source)
        got = {s["__key__"]: as_bytes(s) for s in ds.get_batch(range(len(ds)))}
        assert got == dict(samples)


def test_the_dataset_opened_directly_uses_the_index_too(tmp_path):
    samples = make_samples(20)
    path = write_tar(tmp_path / "s.tar", samples)
    _core.write_member_index([path], ["tar"], 1)
    assert _index(path)["sidecar"] == _core.SidecarState.USED
    assert stoker.Dataset(path).keys(range(20)) == [k for k, _ in samples]


def test_a_stale_index_is_not_trusted_and_said_once(tmp_path, caplog):
    path = write_tar(tmp_path / "s.tar", make_samples(20))
    _core.write_member_index([path], ["tar"], 1)
    other = make_samples(25, seed=3)
    write_tar(tmp_path / "s.tar", other)  # the shard rewritten: its index is for the old
    with caplog.at_level(logging.WARNING, "stoker"):
        ds = stoker.Dataset(path)
    assert len(ds) == 25
    assert {s["__key__"]: as_bytes(s) for s in ds[:]} == dict(other)
    said = [r.getMessage() for r in caplog.records if SUFFIX in r.getMessage()]
    assert len(said) == 1 and "another version of the shard" in said[0]


def test_a_copy_without_its_times_makes_the_index_stale(tmp_path):
    folder = tmp_path / "a"
    folder.mkdir()
    path = write_tar(folder / "s.tar", make_samples(10))
    write_manifest([path], folder)
    copy = tmp_path / "b"
    copy.mkdir()
    for name in os.listdir(folder):
        shutil.copyfile(folder / name, copy / name)  # as cp without -p does
    os.utime(copy / "s.tar", ns=(1, 10**18))
    assert (
        _index(str(copy / "s.tar"))["sidecar"] == _core.SidecarState.STALE
    )  # stale: the shard was walked
    assert len(stoker.Dataset(str(copy))[:]) == 10


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "lying-count"])
def test_a_damaged_index_is_not_trusted(tmp_path, damage, caplog):
    samples = make_samples(15)
    path = write_tar(tmp_path / "s.tar", samples)
    _core.write_member_index([path], ["tar"], 1)
    sidecar = path + SUFFIX
    with open(sidecar, "rb") as f:
        data = bytearray(f.read())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
    elif damage == "truncate":
        data = data[: len(data) - 9]
    elif damage == "empty":
        data = bytearray()
    else:  # a count that points past the sidecar, with a CRC that matches it
        struct.pack_into("<Q", data, 8 + 8 * 4 + 4 + 4 + 8, 10**12)
        struct.pack_into("<I", data, len(data) - 4, zlib.crc32(bytes(data[:-4])))
    with open(sidecar, "wb") as f:
        f.write(data)
    assert _index(path)["sidecar"] == _core.SidecarState.DAMAGED
    with caplog.at_level(logging.WARNING, "stoker"):
        ds = stoker.Dataset(path)
    assert {s["__key__"]: as_bytes(s) for s in ds[:]} == dict(samples)
    assert any("is damaged" in r.getMessage() for r in caplog.records)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(position=st.integers(0, 10_000), value=st.integers(0, 255), cut=st.integers(0, 64))
def test_any_change_to_an_index_is_caught(tmp_path, position, value, cut):
    path = str(tmp_path / "h.tar")
    if not os.path.exists(path):
        write_tar(path, make_samples(12))
        _core.write_member_index([path], ["tar"], 1)
        shutil.copyfile(path + SUFFIX, str(tmp_path / "good"))
    good = (tmp_path / "good").read_bytes()
    data = bytearray(good)
    data[position % len(data)] = value
    data = data[: len(data) - cut]
    with open(path + SUFFIX, "wb") as f:
        f.write(data)
    found = _index(path)
    damaged = _core.SidecarState.DAMAGED
    assert found["sidecar"] == (_core.SidecarState.USED if bytes(data) == good else damaged)
    assert len(found["keys"]) == 12  # from the index, or from the walk: the same


def test_index_and_pack_write_the_member_indexes(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    write_tar(src / "a.tar", make_samples(10))
    write_zip(src / "b.zip", [(f"b{i}", {"cls": b"%d" % i}) for i in range(10)])
    np.save(src / "c.npy", np.zeros((4, 3), np.float32))
    assert main(["index", str(src)]) == 0
    assert sorted(n for n in os.listdir(src) if n.endswith(SUFFIX)) == [
        "a.tar" + SUFFIX,
        "b.zip" + SUFFIX,
    ]
    assert main(["pack", str(src), str(tmp_path / "packed"), "--quiet"]) == 0
    packed = sorted(os.listdir(tmp_path / "packed"))
    assert "shard-000000.tar" + SUFFIX in packed and "stoker.json" in packed


def _rewrite_with_crc(sidecar: str, change) -> None:
    """Change a sidecar's fields behind its back, and give it a CRC that matches: only
    its structural checks can catch it then."""
    with open(sidecar, "rb") as f:
        data = bytearray(f.read())
    change(data)
    struct.pack_into("<I", data, len(data) - 4, zlib.crc32(bytes(data[:-4])))
    with open(sidecar, "wb") as f:
        f.write(data)


@pytest.mark.parametrize(
    "lie",
    ["out-past-deflate", "stored-out-differs", "deflate-in-a-tar", "past-the-end", "runs"],
)
def test_an_index_with_a_good_crc_that_no_shard_could_have_is_refused(tmp_path, lie):
    samples = [(f"k{i}", {"cls": b"%d" % i}) for i in range(6)]
    path = write_tar(tmp_path / "s.tar", samples)
    _core.write_member_index([path], ["tar"], 1)
    sidecar = path + SUFFIX
    members = 6
    header = 8 + 8 + 8 + 8 + 8 + 4 + 4 + 8 + 8  # magic .. members
    names = 4 + len(b"cls") + sum(4 + len(k.encode()) for k, _ in samples)
    starts = header + names + 4 * 7
    offsets = starts + 2 * members
    outs = offsets + 16 * members  # after the offsets and the lengths
    codecs = offsets + 24 * members

    def change(data: bytearray) -> None:
        if lie == "out-past-deflate":
            data[codecs] = 1  # deflate
            struct.pack_into("<Q", data, outs, 1 << 60)
        elif lie == "stored-out-differs":
            struct.pack_into("<Q", data, outs, 1 << 40)
        elif lie == "deflate-in-a-tar":
            data[codecs] = 1
        elif lie == "past-the-end":
            struct.pack_into("<Q", data, offsets, os.path.getsize(path))
        else:  # fewer runs of keys than samples
            struct.pack_into("<Q", data, 8 + 8 + 8 + 8, 1)

    _rewrite_with_crc(sidecar, change)
    assert _index(path)["sidecar"] == _core.SidecarState.DAMAGED
    assert len(stoker.Dataset(path)[:]) == 6  # walked instead


def test_pack_into_an_existing_empty_folder_keeps_the_member_indexes(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    write_tar(src / "a.tar", make_samples(20))
    out = tmp_path / "out"
    out.mkdir()  # exists, empty: files are moved into it at the end
    assert main(["pack", str(src), str(out), "--samples-per-shard", "8", "--quiet"]) == 0
    names = sorted(os.listdir(out))
    assert not [n for n in names if n.startswith(".")]  # the work folder is gone
    shards = [n for n in names if n.endswith(".tar")]
    assert len(shards) == 3 and all(n + SUFFIX in names for n in shards)
    for name in shards:  # moved with their shards, they still are the shards' indexes
        assert _index(str(out / name))["sidecar"] == _core.SidecarState.USED


def test_a_member_index_that_cannot_be_written_leaves_the_manifest_whole(tmp_path, caplog):
    # (As a read-only shard folder would; a folder where the index goes does it as root.)
    path = write_tar(tmp_path / "a.tar", make_samples(5))
    os.mkdir(path + SUFFIX)
    (tmp_path / ("a.tar" + SUFFIX) / "x").write_text("in the way")
    with caplog.at_level(logging.WARNING, "stoker"):
        written = write_manifest([path], tmp_path)
    assert os.path.exists(written)
    said = [r.getMessage() for r in caplog.records if "no member index written" in r.getMessage()]
    assert len(said) == 1 and "beside 1 shard" in said[0]
    assert len(stoker.Dataset(str(tmp_path))[:]) == 5
