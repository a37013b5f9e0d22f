import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest

import stoker
from tests.support.shards import assert_matches, make_samples, write_zip


@pytest.mark.parametrize(
    "compression", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED], ids=["stored", "deflated"]
)
@pytest.mark.parametrize("zip64", [False, True], ids=["zip32", "zip64"])
def test_zip_round_trip(tmp_path, samples, compression, zip64):
    path = write_zip(tmp_path / "s.zip", samples, compression, force_zip64=zip64)
    assert_matches(stoker.Dataset(path), samples)


def test_mixed_methods_dirs_and_comment(tmp_path):
    samples = make_samples(10)
    path = tmp_path / "mixed.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.mkdir("folder")
        for i, (key, fields) in enumerate(samples):
            for field, data in fields.items():
                method = zipfile.ZIP_DEFLATED if i % 2 else zipfile.ZIP_STORED
                zf.writestr(f"{key}.{field}", data, compress_type=method)
        zf.comment = b"PK\x05\x06 a comment that looks like an end record"
    assert_matches(stoker.Dataset(str(path)), samples)


def test_zip64_end_record(tmp_path):
    # More than 65535 entries: zipfile writes the zip64 end of central directory.
    n = 65_600
    path = tmp_path / "many.zip"
    with zipfile.ZipFile(path, "w") as zf:
        for i in range(n):
            zf.writestr(f"{i:06d}.txt", b"%d" % i)
    ds = stoker.Dataset(str(path))
    assert len(ds) == n
    last = ds[n - 1]
    assert last["__key__"] == f"{n - 1:06d}" and bytes(last["txt"]) == b"%d" % (n - 1)


def test_large_deflate_member(tmp_path):
    data = np.random.default_rng(0).integers(0, 4, 3_000_000, dtype=np.uint8).tobytes()
    path = write_zip(tmp_path / "big.zip", [("big", {"bin": data})], zipfile.ZIP_DEFLATED)
    assert bytes(stoker.Dataset(path)[0]["bin"]) == data


# -- bad input ---------------------------------------------------------------


def _good(tmp_path, compression=zipfile.ZIP_STORED):
    return bytearray(
        Path(write_zip(tmp_path / "good.zip", make_samples(6), compression)).read_bytes()
    )


def _central_entries(raw: bytearray) -> list[int]:
    out, at = [], raw.find(b"PK\x01\x02")
    while at >= 0:
        out.append(at)
        at = raw.find(b"PK\x01\x02", at + 1)
    return out


def _write(tmp_path, raw, name="bad.zip"):
    path = tmp_path / name
    path.write_bytes(bytes(raw))
    return str(path)


def test_truncated_zip(tmp_path):
    raw = _good(tmp_path)
    with pytest.raises(stoker.ShardFormatError, match="no end of central directory") as err:
        stoker.Dataset(_write(tmp_path, raw[: len(raw) // 2]))
    assert err.value.path.endswith("bad.zip")


def test_not_a_zip(tmp_path):
    with pytest.raises(stoker.ShardFormatError, match="too short|no end of central"):
        stoker.Dataset(_write(tmp_path, b"hello"))


def test_broken_central_directory(tmp_path):
    raw = _good(tmp_path)
    entry = _central_entries(raw)[3]
    raw[entry : entry + 4] = b"XXXX"
    with pytest.raises(stoker.ShardFormatError, match="broken central directory") as err:
        stoker.Dataset(_write(tmp_path, raw))
    assert err.value.offset == entry


def test_central_directory_past_end(tmp_path):
    raw = _good(tmp_path)
    end = raw.rfind(b"PK\x05\x06")
    struct.pack_into("<I", raw, end + 16, len(raw) + 10)  # directory offset past the file
    with pytest.raises(stoker.ShardFormatError, match="central directory"):
        stoker.Dataset(_write(tmp_path, raw))


def test_member_runs_past_end(tmp_path):
    raw = _good(tmp_path)
    entry = _central_entries(raw)[-1]
    struct.pack_into("<II", raw, entry + 20, 10**6, 10**6)  # sizes beyond the data
    with pytest.raises(stoker.ShardFormatError, match="runs into the central directory"):
        stoker.Dataset(_write(tmp_path, raw))


def test_bad_local_header(tmp_path):
    raw = _good(tmp_path)
    first = raw.find(b"PK\x03\x04", 10)  # the second member's local header
    raw[first : first + 4] = b"PK\x09\x09"
    with pytest.raises(stoker.ShardFormatError, match="bad local header") as err:
        stoker.Dataset(_write(tmp_path, raw))
    assert err.value.offset == first


def test_unsupported_method(tmp_path):
    path = write_zip(tmp_path / "bz.zip", make_samples(2), zipfile.ZIP_BZIP2)
    with pytest.raises(stoker.ShardFormatError, match="compression method 12"):
        stoker.Dataset(path)


def test_encrypted_member(tmp_path):
    raw = _good(tmp_path)
    entry = _central_entries(raw)[0]
    raw[entry + 8] |= 1
    with pytest.raises(stoker.ShardFormatError, match="encrypted"):
        stoker.Dataset(_write(tmp_path, raw))


def test_corrupt_deflate_data(tmp_path):
    samples = [("a", {"txt": b"hello world " * 2000})]
    raw = bytearray(Path(write_zip(tmp_path / "d.zip", samples, zipfile.ZIP_DEFLATED)).read_bytes())
    data_at = raw.find(b"a.txt") + len("a.txt")
    for i in range(data_at + 5, data_at + 25):
        raw[i] ^= 0xFF
    ds = stoker.Dataset(_write(tmp_path, raw))
    with pytest.raises(
        stoker.ShardFormatError, match=r"bad\.zip: offset \d+: (corrupt deflate|CRC-32|deflate)"
    ):
        ds[0]


_CRC_FIELD, _SIZE_FIELD = 16, 24  # in a central directory entry


def _deflated_with_field(tmp_path, data: bytes, field: int, value: int) -> stoker.Dataset:
    """A one-member deflated zip whose central directory lies in one field."""
    path = write_zip(tmp_path / "one.zip", [("a", {"bin": data})], zipfile.ZIP_DEFLATED)
    raw = bytearray(Path(path).read_bytes())
    struct.pack_into("<I", raw, _central_entries(raw)[0] + field, value)
    return stoker.Dataset(_write(tmp_path, raw))


def test_impossible_declared_size_refused_at_open(tmp_path):
    # More than deflate can produce from so few bytes: refused before any buffer is sized.
    path = write_zip(tmp_path / "one.zip", [("a", {"bin": b"abc"})], zipfile.ZIP_DEFLATED)
    raw = bytearray(Path(path).read_bytes())
    struct.pack_into("<I", raw, _central_entries(raw)[0] + _SIZE_FIELD, 0xF0000000)
    with pytest.raises(stoker.ShardFormatError, match="more than deflate can produce"):
        stoker.Dataset(_write(tmp_path, raw))


def test_crc_mismatch(tmp_path):
    ds = _deflated_with_field(tmp_path, b"hello world " * 100, _CRC_FIELD, 0xDEADBEEF)
    with pytest.raises(stoker.ShardFormatError, match="CRC-32 mismatch"):
        ds[0]


def test_decompression_bomb_refused(tmp_path):
    # A member that inflates to far more than its header declares is refused
    # without inflating past the declared size.
    ds = _deflated_with_field(tmp_path, b"\0" * 50_000_000, _SIZE_FIELD, 1000)
    with pytest.raises(stoker.ShardFormatError, match="inflates past its declared size"):
        ds[0]


def test_deflate_shorter_than_declared(tmp_path):
    ds = _deflated_with_field(tmp_path, b"abc" * 100, _SIZE_FIELD, 301)
    with pytest.raises(stoker.ShardFormatError, match="inflates to 300 bytes"):
        ds[0]
