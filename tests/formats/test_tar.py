import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

import stoker
from tests.support.shards import as_bytes, assert_matches, make_samples, write_tar


@pytest.mark.parametrize(
    "fmt",
    [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT],
    ids=["ustar", "gnu", "pax"],
)
def test_tar_formats_round_trip(tmp_path, samples, fmt):
    path = write_tar(tmp_path / "s.tar", samples, fmt)
    assert_matches(stoker.Dataset(path), samples)


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT], ids=["gnu", "pax"])
def test_long_names(tmp_path, fmt):
    deep = "/".join(["directory-with-a-long-name"] * 12)  # > 255 bytes: needs L or pax
    samples = [
        (f"{deep}/sample{i}", {"seg.png": bytes([i]) * 700, "txt": b"x" * i}) for i in range(5)
    ]
    path = write_tar(tmp_path / "long.tar", samples, fmt)
    assert_matches(stoker.Dataset(path), samples)


def test_ustar_prefix_field(tmp_path):
    # ustar splits paths of 100..255 bytes into prefix + name.
    prefix = "p" * 120
    samples = [(f"{prefix}/s{i}", {"bin": b"%d" % i}) for i in range(3)]
    path = write_tar(tmp_path / "prefix.tar", samples, tarfile.USTAR_FORMAT)
    assert_matches(stoker.Dataset(path), samples)


def test_webdataset_shardwriter(tmp_path):
    rng = np.random.default_rng(1)
    pattern = str(tmp_path / "wds-%06d.tar")
    expected = []
    with wds.ShardWriter(pattern, maxcount=7) as sink:
        for i in range(20):
            img = rng.integers(0, 256, (3, 8, 8), dtype=np.uint8).tobytes()
            sink.write({"__key__": f"k{i:04d}", "img.raw": img, "cls": str(i)})
            expected.append((f"k{i:04d}", {"img.raw": img, "cls": str(i).encode()}))
    ds = stoker.Dataset(str(tmp_path / "wds-{000000..000002}.tar"))
    assert_matches(ds, expected)
    # and webdataset reads back the same bytes stoker does
    theirs = list(wds.WebDataset(str(tmp_path / "wds-{000000..000002}.tar"), shardshuffle=False))
    assert [s["__key__"] for s in theirs] == [k for k, _ in expected]


def test_key_field_rule(tmp_path):
    path = tmp_path / "rule.tar"
    with tarfile.open(path, "w") as tar:

        def add(name, data=b"d", kind=tarfile.REGTYPE):
            info = tarfile.TarInfo(name)
            info.type = kind
            info.size = len(data) if kind == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

        add("dir", kind=tarfile.DIRTYPE)
        add("__meta__.json", b"{}")
        add("./a/x.seg.PNG", b"seg")  # field keeps its dots, lower-cased
        add("a/x.jpg", b"jpg")
        add("noext", b"skipped")
        add(".hidden", b"skipped")
        add("link.txt", kind=tarfile.SYMTYPE)
        add("b.cls", b"1")
        add("a/x.txt", b"again")  # same key, not adjacent: still the same sample
    ds = stoker.Dataset(str(path))
    got = [(s["__key__"], as_bytes(s)) for s in ds.get_batch(range(len(ds)))]
    assert got == [
        ("a/x", {"seg.png": b"seg", "jpg": b"jpg", "txt": b"again"}),
        ("b", {"cls": b"1"}),
    ]


def test_empty_members_and_no_end_marker(tmp_path):
    samples = [("a", {"txt": b""}), ("b", {"txt": b"1"})]
    path = write_tar(tmp_path / "e.tar", samples)
    data = Path(path).read_bytes().rstrip(b"\0")
    trimmed = tmp_path / "trimmed.tar"
    trimmed.write_bytes(data + b"\0" * (-len(data) % 512))  # no closing zero blocks
    assert_matches(stoker.Dataset(str(trimmed)), samples)


def test_base256_size(tmp_path):
    samples = [("a", {"bin": b"x" * 1000})]
    path = tmp_path / "b256.tar"
    write_tar(path, samples, tarfile.GNU_FORMAT)
    raw = bytearray(path.read_bytes())
    raw[124:136] = b"\x80" + (1000).to_bytes(11, "big")  # GNU base-256 size
    raw[148:156] = b" " * 8
    raw[148:156] = b"%06o\0 " % sum(raw[:512])
    path.write_bytes(bytes(raw))
    assert_matches(stoker.Dataset(str(path)), samples)


# -- bad input ---------------------------------------------------------------


def _corrupt(tmp_path, mutate, name="bad.tar"):
    path = tmp_path / "good.tar"
    write_tar(path, make_samples(5))
    raw = bytearray(path.read_bytes())
    raw = mutate(raw)
    bad = tmp_path / name
    bad.write_bytes(bytes(raw))
    return str(bad)


def test_truncated_in_member(tmp_path):
    # layout: cls header 0, data 512; raw header 1024, data 1536...
    bad = _corrupt(tmp_path, lambda r: r[:1537])
    with pytest.raises(
        stoker.ShardFormatError, match=r"bad\.tar: offset 1024: .*runs past the end"
    ):
        stoker.Dataset(bad)


def test_truncated_in_header(tmp_path):
    bad = _corrupt(tmp_path, lambda r: r[: 1024 + 200])
    with pytest.raises(stoker.ShardFormatError, match="truncated") as err:
        stoker.Dataset(bad)
    assert err.value.path == bad
    assert err.value.offset == 1024


def test_bad_checksum(tmp_path):
    def flip(r):
        r[512 * 2 + 10] ^= 0x55  # a name byte of the second header
        return r

    # the second member's header starts after the first member's one data block
    with pytest.raises(stoker.ShardFormatError, match="checksum") as err:
        stoker.Dataset(_corrupt(tmp_path, flip))
    assert err.value.offset == 1024


def test_not_a_tar(tmp_path):
    bad = tmp_path / "garbage.tar"
    bad.write_bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes())
    with pytest.raises(stoker.ShardFormatError, match=r"garbage\.tar: offset 0: bad tar header"):
        stoker.Dataset(str(bad))


def test_empty_file(tmp_path):
    (tmp_path / "empty.tar").write_bytes(b"")
    with pytest.raises(stoker.ShardFormatError, match="empty file"):
        stoker.Dataset(str(tmp_path / "empty.tar"))


def test_bad_pax_record(tmp_path):
    path = tmp_path / "pax.tar"
    write_tar(path, [("a", {"txt": b"1"})], tarfile.PAX_FORMAT)
    # craft a pax header with an inconsistent record length
    header = tarfile.TarInfo("././@PaxHeader")
    header.type = tarfile.XHDTYPE
    body = b"99 path=a.txt\n"
    header.size = len(body)
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        tar.addfile(header, io.BytesIO(body))
        info = tarfile.TarInfo("a.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"1"))
    with pytest.raises(stoker.ShardFormatError, match="pax"):
        stoker.Dataset(str(path))


def test_huge_pax_header_refused(tmp_path):
    path = tmp_path / "bigpax.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("a.txt")
        info.size = 1
        info.pax_headers = {"comment": "x" * 2_000_000}
        tar.addfile(info, io.BytesIO(b"1"))
    with pytest.raises(stoker.ShardFormatError, match="implausibly large"):
        stoker.Dataset(str(path))


def test_duplicate_field_in_sample(tmp_path):
    path = write_tar(tmp_path / "dup.tar", [("a", {"txt": b"1"})])
    with tarfile.open(path, "a") as tar:
        info = tarfile.TarInfo("a.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"2"))
    with pytest.raises(stoker.ShardFormatError, match="two members with field 'txt'"):
        stoker.Dataset(path)


def test_errors_are_value_errors(tmp_path):
    with pytest.raises(ValueError):
        stoker.Dataset(_corrupt(tmp_path, lambda r: r[:700]))


def test_member_names_that_are_not_utf8_open_as_tarfile_reads_them(tmp_path):
    path = tmp_path / "latin1.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT, errors="surrogateescape") as tar:
        info = tarfile.TarInfo("k\udcff.cls")  # the byte 0xff in the archive
        info.size = 1
        tar.addfile(info, io.BytesIO(b"7"))
    ds = stoker.Dataset(path)
    assert ds.keys([0]) == ["k\udcff"]
    assert bytes(ds[0]["cls"]) == b"7"
