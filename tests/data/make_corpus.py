"""Writes the fuzzing seeds and the malformed shards next to this file.

    python tests/data/make_corpus.py

seeds/      small valid shards, written by the standard writers (tarfile, zipfile, numpy):
            the starting corpus of scripts/fuzz.sh and of the mutation test in
            tests/formats/test_malformed.py.
index-seeds/  each tar and zip seed's member index (NAME.idx), the fuzz target's seeds
            for its fourth format; written by stoker itself, so this needs stoker built.
chunk-seeds/  array sources' chunks as the fuzz target's sixth format reads them (a layout
            header, then each chunk as a 2-byte length and its bytes), unfiltered and
            through each filter stoker decodes (needs numcodecs, and stoker for CRC-32C).
record-seeds/  MDS shards and LitData chunks in the layout their writers use (a first line
            with the record format the fuzz target reads), valid and damaged.
gzip-seeds/  gzip files as .nii.gz volumes are (one member, several, trailing zeros).
malformed/  shards that are wrong in one way each, named for what is wrong: every one must
            be refused with stoker.ShardFormatError, when the Dataset opens it or when its
            samples are read (tests/formats/test_malformed.py). Inputs the fuzzer found are saved
            here by hand, named the same way; this script leaves them alone.

The output is deterministic (fixed times and contents), so running this again rewrites the
same bytes; the files are committed.
"""

from __future__ import annotations

import io
import struct
import tarfile
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SEEDS = HERE / "seeds"
INDEX_SEEDS = HERE / "index-seeds"
MALFORMED = HERE / "malformed"
CHUNK_SEEDS = HERE / "chunk-seeds"
GZIP_SEEDS = HERE / "gzip-seeds"
RECORD_SEEDS = HERE / "record-seeds"
MTIME = 1_700_000_000
DATE = (2024, 1, 1, 0, 0, 0)
LIMIT = 64 * 1024  # every file stays tiny

Members = list[tuple[str, bytes]]


def payload(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def samples(n: int = 3, seed: int = 0) -> Members:
    out = []
    for i in range(n):
        out.append((f"sample{i:04d}.cls", str(i % 10).encode()))
        out.append((f"sample{i:04d}.raw", payload(40 + 37 * i, seed + i)))
        out.append((f"sample{i:04d}.json", b'{"i": %d}' % i))
    return out


# -- tar ------------------------------------------------------------------------


def tar_bytes(
    members: Members, fmt: int = tarfile.PAX_FORMAT, extra: Callable | None = None
) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        if extra is not None:
            extra(tar)
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = MTIME
            tar.addfile(info, io.BytesIO(data))
        end = tar.offset
    # tarfile pads the archive to 10 KiB records; the two zero blocks that close it are
    # enough (and keep the seeds small).
    return buf.getvalue()[: end + 1024]


def tar_dir_and_link(tar: tarfile.TarFile) -> None:
    for name, kind in (("images", tarfile.DIRTYPE), ("images/link.txt", tarfile.SYMTYPE)):
        info = tarfile.TarInfo(name)
        info.type = kind
        info.mtime = MTIME
        if kind == tarfile.SYMTYPE:
            info.linkname = "sample0000.json"
        tar.addfile(info)


def tar_checksum(header: bytearray) -> None:
    """Recomputes a 512-byte tar header's checksum in place."""
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)


def tar_header(name: bytes, size_field: bytes, kind: bytes = b"0") -> bytearray:
    """A ustar header with raw fields, for what tarfile will not write."""
    h = bytearray(512)
    h[0 : len(name)] = name
    h[100:108] = b"0000644\0"
    h[108:116] = b"0000000\0"
    h[116:124] = b"0000000\0"
    h[124:136] = size_field
    h[136:148] = b"%011o\0" % MTIME
    h[156:157] = kind
    h[257:265] = b"ustar\x0000"
    tar_checksum(h)
    return h


def pax_record(key: str, value: str) -> bytes:
    """A well-formed pax record: its length counts the whole record, itself included."""
    body = f" {key}={value}\n".encode()
    length = len(body) + 1
    while len(str(length)) + len(body) != length:
        length += 1
    return str(length).encode() + body


def padded(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % 512)


def tar_seeds() -> dict[str, bytes]:
    long_dir = "a-directory-name-that-is-long/" * 4
    return {
        "ustar.tar": tar_bytes(samples(3), tarfile.USTAR_FORMAT, tar_dir_and_link),
        "gnu-longname.tar": tar_bytes(
            [(long_dir + "x" * 80 + ".cls", b"7"), (long_dir + "x" * 80 + ".txt", b"hello")],
            tarfile.GNU_FORMAT,
        ),
        # ustar splits a path of up to 255 characters into prefix + name.
        "ustar-prefix.tar": tar_bytes(
            [(long_dir + "y.cls", b"3"), (long_dir + "y.bin", payload(100, 1))],
            tarfile.USTAR_FORMAT,
        ),
        "pax.tar": tar_bytes(
            [(long_dir + "zz.cls", b"1"), ("caf\u00e9/\u00fc.Seg.PNG", payload(70, 2))],
            tarfile.PAX_FORMAT,
        ),
        # No closing zero blocks: accepted, as tarfile accepts it.
        "no-trailer.tar": tar_bytes(samples(2, 5), tarfile.USTAR_FORMAT)[: 512 * 12],
        "one-member.tar": tar_bytes([("k.cls", b"42")], tarfile.USTAR_FORMAT),
    }


def tar_malformed() -> dict[str, bytes]:
    good = tar_bytes(samples(2), tarfile.USTAR_FORMAT)
    out: dict[str, bytes] = {}

    bad = bytearray(good)
    bad[3] ^= 0x20  # a byte of the first name, checksum left alone
    out["tar-bad-checksum.tar"] = bytes(bad)

    # Cut in the middle of the second member's data.
    out["tar-truncated-member.tar"] = good[: 512 * 3 + 20]

    # The bytes are all there; the file ends inside the last member's padding.
    one = tar_bytes([("k.raw", payload(100, 3))], tarfile.USTAR_FORMAT)
    out["tar-truncated-padding.tar"] = one[: 512 + 300]

    # A partial header after the last member.
    out["tar-partial-header.tar"] = one[:1024] + b"z.cls\0" + b"\x01" * 94

    # A size field that claims more than the file holds, checksum recomputed.
    h = bytearray(good[:512])
    h[124:136] = b"%011o\0" % 10_000_000
    tar_checksum(h)
    out["tar-size-past-end.tar"] = bytes(h) + good[512:]

    h = bytearray(good[:512])
    h[124:136] = b"0000000012x\0"
    tar_checksum(h)
    out["tar-size-not-octal.tar"] = bytes(h) + good[512:]

    # GNU base-256 with the sign bit set: a negative size.
    h = bytearray(good[:512])
    h[124:136] = b"\xff" * 12
    tar_checksum(h)
    out["tar-negative-size.tar"] = bytes(h) + good[512:]

    # A GNU long name member declaring 2 MiB: refused without reading or allocating it.
    longname = tar_header(b"././@LongLink", b"%011o\0" % (2 << 20), b"L")
    out["tar-huge-longname.tar"] = bytes(longname) + padded(b"x" * 600) + good

    # A pax record whose length does not match its text.
    record = b"99 path=a.cls\n"
    pax = tar_header(b"./PaxHeaders/a.cls", b"%011o\0" % len(record), b"x")
    out["tar-pax-bad-record.tar"] = bytes(pax) + padded(record) + good

    # A pax size that overrides the header's with one past the end of the file.
    record = pax_record("size", "9999999")
    pax = tar_header(b"./PaxHeaders/a.cls", b"%011o\0" % len(record), b"x")
    out["tar-pax-size-past-end.tar"] = bytes(pax) + padded(record) + good

    record = pax_record("size", "12345678x")
    pax = tar_header(b"./PaxHeaders/a.cls", b"%011o\0" % len(record), b"x")
    out["tar-pax-size-not-number.tar"] = bytes(pax) + padded(record) + good

    sparse = tar_header(b"s.raw", b"%011o\0" % 0, b"S")
    out["tar-gnu-sparse.tar"] = bytes(sparse) + good

    # One sample with two members of one field.
    out["tar-duplicate-field.tar"] = tar_bytes(
        [("a.cls", b"1"), ("a.cls", b"2")], tarfile.USTAR_FORMAT
    )

    # Not a tar at all: a gzip stream.
    out["tar-gzipped.tar"] = b"\x1f\x8b\x08\x00" + bytes(600)

    # A member name that is not UTF-8, in a member that runs past the end (the error
    # quotes the name).
    name = tar_header(b"\xff\xfe-not-utf8.raw", b"%011o\0" % 5000)
    out["tar-non-utf8-name-past-end.tar"] = bytes(name) + padded(b"x" * 100)

    out["empty.tar"] = b""
    return out


# -- zip ------------------------------------------------------------------------


def zip_bytes(
    members: Members,
    method: int = zipfile.ZIP_STORED,
    force_zip64: bool = False,
    comment: bytes = b"",
) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Duplicate name": wanted in one malformed case
        for name, data in members:
            info = zipfile.ZipInfo(name, date_time=DATE)
            info.compress_type = method
            with zf.open(info, "w", force_zip64=force_zip64) as f:
                f.write(data)
        zf.comment = comment
    return buf.getvalue()


def zip_records(data: bytes) -> tuple[int, int, list[int], list[int]]:
    """(end record offset, central directory offset, central entries, local headers)."""
    end = data.rindex(b"PK\x05\x06")
    cd_offset = struct.unpack_from("<I", data, end + 16)[0]
    entries, locals_ = [], []
    at = cd_offset
    while data[at : at + 4] == b"PK\x01\x02":
        entries.append(at)
        locals_.append(struct.unpack_from("<I", data, at + 42)[0])
        n, m, k = struct.unpack_from("<HHH", data, at + 28)
        at += 46 + n + m + k
    return end, cd_offset, entries, locals_


def zip_patch(
    data: bytes,
    entry_field: int,
    fmt: str,
    value: int,
    local_field: int | None = None,
    member: int = 0,
) -> bytes:
    """Overwrites a field of one member's central entry (and its local header)."""
    out = bytearray(data)
    _, _, entries, locals_ = zip_records(data)
    struct.pack_into(fmt, out, entries[member] + entry_field, value)
    if local_field is not None:
        struct.pack_into(fmt, out, locals_[member] + local_field, value)
    return bytes(out)


def zip_seeds() -> dict[str, bytes]:
    return {
        "stored.zip": zip_bytes(samples(3)),
        "deflated.zip": zip_bytes(samples(3, 7), zipfile.ZIP_DEFLATED),
        "zip64.zip": zip_bytes(samples(2, 9), zipfile.ZIP_DEFLATED, force_zip64=True),
        "zip64-stored.zip": zip_bytes(samples(1, 4), force_zip64=True),
        "comment.zip": zip_bytes(
            [("dir/", b""), ("dir/k.cls", b"5"), ("dir/k.txt", b"PK\x05\x06 in a member")],
            comment=b"a comment with PK\x05\x06 inside",
        ),
        "mixed.zip": _mixed_zip(),
    }


def _mixed_zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for i, method in enumerate((zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED) * 2):
            info = zipfile.ZipInfo(f"s{i // 2}.f{i % 2}", date_time=DATE)
            info.compress_type = method
            zf.writestr(info, bytes(200) + payload(50, i))
    return buf.getvalue()


def zip_malformed() -> dict[str, bytes]:
    stored = zip_bytes(samples(2))
    deflated = zip_bytes(samples(2, 3), zipfile.ZIP_DEFLATED)
    out: dict[str, bytes] = {}
    end, cd_offset, entries, locals_ = zip_records(stored)

    out["zip-no-eocd.zip"] = stored[:-22]
    out["zip-too-short.zip"] = b"PK\x05\x06" + bytes(10)

    bad = bytearray(stored)
    struct.pack_into("<I", bad, end + 16, len(stored) + 1000)
    out["zip-cd-past-end.zip"] = bytes(bad)

    bad = bytearray(stored)
    struct.pack_into("<H", bad, end + 10, 50)  # entries
    out["zip-cd-too-many-entries.zip"] = bytes(bad)

    bad = bytearray(stored)
    bad[entries[1] : entries[1] + 4] = b"PK\x09\x09"
    out["zip-cd-entry-bad-sig.zip"] = bytes(bad)

    bad = bytearray(stored)
    struct.pack_into("<HH", bad, end + 4, 1, 1)
    out["zip-multi-disk.zip"] = bytes(bad)

    bad = bytearray(stored)
    bad[locals_[0] : locals_[0] + 4] = b"PK\x07\x07"
    out["zip-local-header-bad-sig.zip"] = bytes(bad)

    # A local header offset past the central directory.
    out["zip-local-header-past-cd.zip"] = zip_patch(stored, 42, "<I", cd_offset + 10)

    # A stored member whose compressed size runs into the central directory.
    big = zip_patch(stored, 20, "<I", 10_000, member=1)
    out["zip-member-into-cd.zip"] = zip_patch(big, 24, "<I", 10_000, member=1)

    out["zip-stored-size-mismatch.zip"] = zip_patch(stored, 24, "<I", 3)

    # 1 MiB of zeros deflates to about 1 KiB; the headers say it is 1000 bytes.
    bomb = zip_bytes([("bomb.raw", bytes(1 << 20))], zipfile.ZIP_DEFLATED)
    out["zip-deflate-bomb.zip"] = zip_patch(bomb, 24, "<I", 1000, local_field=22)

    # A size no deflate stream of that length can produce: refused before any allocation.
    out["zip-impossible-ratio.zip"] = zip_patch(deflated, 24, "<I", 0xFFFFFFF0, member=1)

    # The real data inflates to fewer bytes than declared.
    out["zip-deflate-short.zip"] = zip_patch(deflated, 24, "<I", 4000, member=1, local_field=22)

    out["zip-bad-crc.zip"] = zip_patch(deflated, 16, "<I", 0x12345678, member=1, local_field=14)

    # Garbage where a member's deflate stream is.
    _, _, d_entries, d_locals = zip_records(deflated)
    bad = bytearray(deflated)
    name_len, extra_len = struct.unpack_from("<HH", bad, d_locals[1] + 26)
    data_at = d_locals[1] + 30 + name_len + extra_len
    bad[data_at] = 0xFF  # BTYPE 11: an invalid block type
    out["zip-corrupt-deflate.zip"] = bytes(bad)

    out["zip-encrypted.zip"] = zip_patch(stored, 8, "<H", 1, local_field=6)
    out["zip-method-bzip2.zip"] = zip_bytes(samples(1), zipfile.ZIP_BZIP2)

    # zip64 extra field too short for the sizes it must carry.
    z64 = bytearray(zip_bytes([("a.raw", b"xyz")]))
    _, _, z_entries, _ = zip_records(bytes(z64))
    struct.pack_into("<II", z64, z_entries[0] + 20, 0xFFFFFFFF, 0xFFFFFFFF)
    name_len = struct.unpack_from("<H", z64, z_entries[0] + 28)[0]
    at = z_entries[0] + 46 + name_len
    # Give the entry a 4-byte zip64 extra (header only) in place of no extra at all.
    z64[at:at] = struct.pack("<HH", 1, 0)
    struct.pack_into("<H", z64, z_entries[0] + 30, 4)
    end = z64.rindex(b"PK\x05\x06")
    size = struct.unpack_from("<I", z64, end + 12)[0]
    struct.pack_into("<I", z64, end + 12, size + 4)
    out["zip-zip64-extra-too-short.zip"] = bytes(z64)

    # A zip64 end locator pointing past the end record.
    z = zip_bytes([("a.raw", b"xyz")])
    end = z.rindex(b"PK\x05\x06")
    locator = struct.pack("<IIQI", 0x07064B50, 0, 1 << 40, 1)
    out["zip-zip64-locator-past-end.zip"] = z[:end] + locator + z[end:]

    out["zip-duplicate-field.zip"] = zip_bytes([("a.cls", b"1"), ("a.cls", b"2")])
    # An encrypted member whose name is not UTF-8: the error quotes the name.
    named = zip_bytes([("n\u00e9.raw", b"abc")])  # zipfile writes it as UTF-8, flag 11 set
    named = named.replace("n\u00e9".encode(), b"n\xe9\xff")
    named = zip_patch(named, 8, "<H", 1, local_field=6)
    out["zip-non-utf8-name-encrypted.zip"] = named
    out["zip-not-a-zip.zip"] = b"this is not a zip file at all\n" * 10
    return out


# -- npy ------------------------------------------------------------------------


def npy_bytes(array: np.ndarray, version: tuple[int, int] | None = None) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array, version=version, allow_pickle=True)
    return buf.getvalue()


def npy_raw(header: str, data: bytes = b"", version: int = 1) -> bytes:
    """A .npy with a header of our own: text padded to 64 bytes, as numpy writes it."""
    prefix = 10 if version == 1 else 12
    text = header.encode("latin1")
    text += b" " * (-(prefix + len(text) + 1) % 64) + b"\n"
    if version == 1:
        return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text + data
    return b"\x93NUMPY" + bytes([version, 0]) + struct.pack("<I", len(text)) + text + data


def npy_seeds() -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    return {
        "f4-2d.npy": npy_bytes(rng.random((6, 5), dtype=np.float32)),
        "i8-big-endian.npy": npy_bytes(np.arange(12, dtype=">i8")),
        "u1-3d.npy": npy_bytes(rng.integers(0, 256, (4, 3, 3), dtype=np.uint8)),
        "bool.npy": npy_bytes(np.array([True, False, True])),
        "unicode.npy": npy_bytes(np.array(["ab", "cde", ""], dtype="<U3")),
        "bytes.npy": npy_bytes(np.array([b"x", b"yz"], dtype="S2")),
        "datetime.npy": npy_bytes(np.array([0, 10**9], dtype="<M8[ns]")),
        "complex-v2.npy": npy_bytes(np.ones((3, 2), dtype=np.complex128), version=(2, 0)),
        "f8-v3.npy": npy_bytes(np.arange(5, dtype=np.float64), version=(3, 0)),
        "fortran-1d.npy": npy_bytes(np.asfortranarray(np.arange(4, dtype=np.int16))),
        "fortran-long-axis.npy": npy_bytes(np.asfortranarray(np.ones((5, 1), np.int32))),
        "zero-rows.npy": npy_bytes(np.zeros((0, 3), np.float32)),
        "empty-rows.npy": npy_bytes(np.zeros((4, 0), np.uint8)),
    }


def npy_malformed() -> dict[str, bytes]:
    good = npy_bytes(np.arange(16, dtype="<i4").reshape(4, 4))
    out: dict[str, bytes] = {}
    out["npy-bad-magic.npy"] = b"\x93NUMPX" + good[6:]
    out["npy-bad-version.npy"] = good[:6] + b"\x04\x00" + good[8:]
    out["npy-truncated-data.npy"] = good[:-10]
    out["npy-truncated-preamble.npy"] = good[:7]
    out["npy-header-past-end.npy"] = good[:8] + struct.pack("<H", 5000) + good[10:]
    out["npy-object-dtype.npy"] = npy_bytes(np.array([1, "a", None], dtype=object))
    out["npy-structured-dtype.npy"] = npy_bytes(np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")]))
    out["npy-unknown-dtype.npy"] = npy_raw(
        "{'descr': '<q8', 'fortran_order': False, 'shape': (2,), }", bytes(16)
    )
    header_len = struct.unpack_from("<H", good, 8)[0]
    out["npy-header-garbage.npy"] = good[:10] + b"#" * header_len + good[10 + header_len :]
    out["npy-header-missing-key.npy"] = npy_raw("{'descr': '<i4', 'shape': (2,), }", bytes(8))
    out["npy-header-unterminated.npy"] = npy_raw("{'descr': '<i4, 'fortran_order': False")
    out["npy-huge-shape.npy"] = npy_raw(
        "{'descr': '<f8', 'fortran_order': False, 'shape': (4294967296, 4294967296), }"
    )
    out["npy-shape-past-end.npy"] = npy_raw(
        "{'descr': '<f8', 'fortran_order': False, 'shape': (1000000000000,), }", bytes(64)
    )
    out["npy-dimension-overflow.npy"] = npy_raw(
        "{'descr': '<f8', 'fortran_order': False, 'shape': (99999999999999999999999,), }"
    )
    out["npy-many-empty-rows.npy"] = npy_raw(
        "{'descr': '<f4', 'fortran_order': False, 'shape': (1099511627776, 0), }"
    )
    out["npy-0d.npy"] = npy_bytes(np.array(3.5))
    out["npy-fortran-2d.npy"] = npy_bytes(np.asfortranarray(np.ones((3, 4), np.float32)))
    out["npy-v2-truncated-length.npy"] = b"\x93NUMPY\x02\x00\x10\x00"
    # dtype strings of a known kind that numpy has no type for.
    out["npy-datetime-bad-unit.npy"] = npy_raw(
        "{'descr': '<M8[os]', 'fortran_order': False, 'shape': (2,), }", bytes(16)
    )
    out["npy-impossible-itemsize.npy"] = npy_raw(
        "{'descr': '<i3', 'fortran_order': False, 'shape': (2,), }", bytes(6)
    )
    # A header key that is not UTF-8 (the error quotes it).
    out["npy-non-utf8-header-key.npy"] = npy_raw(
        "{'\x80descr': '|b1', 'fortran_order': False, 'shape': (3,), }", b"\x01\x00\x01"
    )
    return out


def _shuffled(raw: bytes, size: int) -> bytes:
    """HDF5's shuffle: byte j of every element together, plane by plane."""
    n = len(raw) // size
    planes = np.frombuffer(raw[: n * size], np.uint8).reshape(n, size).T.tobytes()
    return planes + raw[n * size :]


def _fletcher32(data: bytes) -> int:
    """HDF5's Fletcher-32 of `data` (16-bit big-endian words, an odd last byte padded)."""
    if len(data) % 2:
        data += b"\x00"
    sum1 = sum2 = 0
    for i in range(0, len(data), 2):
        sum1 = (sum1 + (data[i] << 8 | data[i + 1])) % 65535
        sum2 = (sum2 + sum1) % 65535
    return sum2 << 16 | sum1


def chunk_seeds() -> dict[str, bytes]:
    """Layouts and chunks for the fuzz target's chunk format, one per filter pipeline."""
    import zlib

    import numcodecs

    from stoker import _core

    def seed(flags: int, axes: list[tuple[int, int]], filters: int, encode) -> bytes:
        rank, itemsize = len(axes), 1 << ((flags >> 2) & 3)
        header = bytes([flags | (rank - 1)]) + bytes(
            (length - 1) | (chunk - 1) << 4 for length, chunk in axes
        )
        header = header.ljust(4, b"\x00") + bytes([filters, 0, 0, 0])
        grid = [-(-n // c) for n, c in axes]
        chunk_bytes = int(np.prod([c for _, c in axes])) * itemsize
        body = b""
        for k in range(int(np.prod(grid))):
            if k == 1 and len(grid) and grid[0] > 2:
                body += b"\xff\xff"  # a chunk never written
                continue
            stored = encode(bytes((k * 31 + j * 7) % 251 for j in range(chunk_bytes)), itemsize)
            body += struct.pack("<H", len(stored)) + stored
        return header + body

    def gzip_member(raw: bytes) -> bytes:
        z = zlib.compressobj(6, zlib.DEFLATED, 31)
        return z.compress(raw) + z.flush()

    plain = lambda raw, size: raw  # noqa: E731
    return {
        "c-order.chunk": seed(1 << 2, [(10, 4), (5, 2)], 0, plain),
        "f-order-big-endian.chunk": seed(16 | 32 | 2 << 2, [(9, 3), (3, 2), (4, 4)], 0, plain),
        "one-axis.chunk": seed(3 << 2, [(12, 5)], 0, plain),
        "zlib-shuffle.chunk": seed(
            2 << 2, [(9, 4), (6, 3)], 1 | 2, lambda r, n: zlib.compress(_shuffled(r, n))
        ),
        "gzip.chunk": seed(0, [(11, 4), (3, 3)], 2 | 1 << 2, lambda r, n: gzip_member(r)),
        "zstd-crc32c.chunk": seed(
            1 << 2,
            [(8, 3), (4, 4)],
            2 | 2 << 2 | 16 | 32,
            lambda r, n: (c := numcodecs.Zstd(1).encode(r)) + struct.pack("<I", _core.crc32c(c)),
        ),
        "blosc.chunk": seed(
            2 << 2, [(7, 2), (5, 5)], 2 | 3 << 2, lambda r, n: numcodecs.Blosc("lz4").encode(r)
        ),
        "shuffle-zlib-fletcher32.chunk": seed(
            3 << 2,
            [(6, 4)],
            1 | 2 | 16,
            lambda r, n: (c := zlib.compress(_shuffled(r, n))) + struct.pack("<I", _fletcher32(c)),
        ),
    }


def gzip_seeds() -> dict[str, bytes]:
    """Gzip streams for the fuzz target's gzip format (fixed times: the bytes are fixed)."""
    import gzip

    data = bytes(range(256)) * 40 + b"\x00" * 3000
    return {
        "one-member.gz": gzip.compress(data, 6, mtime=0),
        "two-members.gz": gzip.compress(data[:5000], 1, mtime=0)
        + gzip.compress(data[5000:], 9, mtime=0),
        "trailing-zeros.gz": gzip.compress(data[:100], 6, mtime=0) + bytes(16),
        "empty.gz": gzip.compress(b"", 6, mtime=0),
    }


def _records(records: list[bytes], between: bytes = b"") -> bytes:
    """A shard of `records` behind their offset table (MDS puts its config JSON between
    the table and the records; LitData nothing)."""
    n = len(records)
    at = 4 + 4 * (n + 1) + len(between)
    offsets = [at]
    for record in records:
        offsets.append(offsets[-1] + len(record))
    return struct.pack(f"<I{n + 1}I", n, *offsets) + between + b"".join(records)


def record_seeds() -> dict[str, bytes]:
    """MDS shards and LitData chunks for the fuzz target's record format."""
    mds = b"mds|image:v|label:8|name:v\n"
    rows = [
        struct.pack("<II", 12, 3) + bytes(range(12)) + struct.pack("<q", i) + b"abc"
        for i in range(4)
    ]
    mds_shard = _records(rows, b'{"format": "mds"}')
    lit = b"litdata|image:v:numpy|label:8\n"
    items = []
    for i in range(3):
        array = struct.pack("<III", 4, 1, 6) + bytes(range(6))  # uint8 (6,) with its header
        items.append(struct.pack("<II", len(array), 8) + array + struct.pack("<q", i))
    lit_chunk = _records(items)
    return {
        "mds.record": mds + mds_shard,
        "mds-truncated.record": mds + mds_shard[:-7],
        "mds-offsets-past-the-end.record": mds + mds_shard[:8] + b"\xff\xff\x00\x00"
        + mds_shard[12:],
        "litdata.record": lit + lit_chunk,
        "litdata-header-too-long.record": lit + lit_chunk.replace(
            struct.pack("<III", 4, 1, 6), struct.pack("<III", 4, 9, 6), 1
        ),
    }  # fmt: skip


def write(folder: Path, files: dict[str, bytes]) -> None:
    """Writes `files`; other files in `folder` (a fuzzer's reproducer saved there by
    hand) are left alone."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in sorted(files.items()):
        if len(data) >= LIMIT:
            raise SystemExit(f"{name}: {len(data)} bytes, over the {LIMIT}-byte limit")
        (folder / name).write_bytes(data)


def write_index_seeds() -> None:
    """Each tar and zip seed's member index, as index-seeds/NAME.idx (the fuzz target's
    fourth format). The shards' times are fixed first: an index records its shard's time."""
    import os

    from stoker import _core

    shards = sorted(p for p in SEEDS.iterdir() if p.suffix in (".tar", ".zip"))
    for path in shards:
        os.utime(path, (MTIME, MTIME))
    _core.write_member_index([str(p) for p in shards], [p.suffix[1:] for p in shards], 1)
    for path in shards:
        INDEX_SEEDS.mkdir(exist_ok=True)
        os.replace(str(path) + _core.SIDECAR_SUFFIX, INDEX_SEEDS / (path.name + ".idx"))


def main() -> None:
    write(SEEDS, {**tar_seeds(), **zip_seeds(), **npy_seeds()})
    write_index_seeds()
    write(MALFORMED, {**tar_malformed(), **zip_malformed(), **npy_malformed()})
    write(CHUNK_SEEDS, chunk_seeds())
    write(GZIP_SEEDS, gzip_seeds())
    write(RECORD_SEEDS, record_seeds())
    for folder in (SEEDS, INDEX_SEEDS, MALFORMED, CHUNK_SEEDS, GZIP_SEEDS, RECORD_SEEDS):
        files = sorted(folder.iterdir())
        total = sum(f.stat().st_size for f in files)
        print(f"{folder.relative_to(HERE.parent.parent)}: {len(files)} files, {total} bytes")


if __name__ == "__main__":
    main()
