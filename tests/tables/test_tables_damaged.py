"""Damaged and refused Parquet files: each a StokerError (a ShardFormatError for a damaged
file) whose message names the file, and where it can the row group, column and page; never
a crash, a hang or a wrong value."""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import stoker
from tests.support import REPO
from tests.support.tables import footer, pages, rewrite_footer, varint_bytes

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

N = 60


# Blobs of 30-50 bytes are copied out of their decompressed pages; of 300-320, they are
# left in the pages the decode keeps (parquet.hpp, kLeastBytesInPages).
BLOB_BYTES = {"copied": 30, "kept": 300}


def table(n: int = N, blob_bytes: int = BLOB_BYTES["copied"]):
    rng = np.random.default_rng(0)
    return pa.table(
        {
            "label": pa.array(np.arange(n, dtype=np.int64)),
            "blob": pa.array(
                [
                    rng.integers(0, 256, blob_bytes + i % 20, dtype=np.uint8).tobytes()
                    for i in range(n)
                ],
                pa.binary(),
            ),
        },
        schema=pa.schema(
            [
                pa.field("label", pa.int64(), nullable=False),
                pa.field("blob", pa.binary(), nullable=False),
            ]
        ),
    )


def write(tmp_path, name="bad.parquet", codec="snappy", blob_bytes=BLOB_BYTES["copied"], **kw):
    path = str(tmp_path / name)
    options = {"row_group_size": 20, "use_dictionary": False, **kw}
    pq.write_table(table(blob_bytes=blob_bytes), path, compression=codec, **options)
    return path


def patch(path: str, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


def read_all(path: str, fields=None) -> None:
    """Open `path` and read every sample (through a Loader when `fields` are given)."""
    ds = stoker.Dataset(path)
    if fields is None:
        ds.get_batch(range(len(ds)))
        return
    for _ in stoker.Loader(ds, batch_size=16, fields=fields):
        pass


def assert_names(error: BaseException, path: str, *parts: str) -> str:
    message = str(error)
    assert os.path.basename(path) in message, message
    for part in parts:
        assert re.search(part, message), (part, message)
    return message


# -- the footer ---------------------------------------------------------------------------


def test_a_file_cut_short_is_an_error_naming_it(tmp_path):
    path = write(tmp_path)
    size = os.path.getsize(path)
    for keep in (size - 3, size - 30, size // 2, 10, 0):
        with open(path, "rb") as f:
            data = f.read()
        cut = str(tmp_path / f"cut-{keep}.parquet")
        with open(cut, "wb") as f:
            f.write(data[:keep])
        with pytest.raises(stoker.ShardFormatError) as e:
            read_all(cut)
        assert_names(e.value, cut)


def test_a_truncated_footer_is_an_error_naming_the_file(tmp_path):
    path = write(tmp_path)
    start, old = footer(path)
    with open(path, "rb") as f:
        head = f.read(start)
    cases = {
        "half.parquet": old[: len(old) // 2] + struct.pack("<I", len(old) // 2),
        "longer.parquet": old + struct.pack("<I", os.path.getsize(path) * 4),
        "shifted.parquet": old[7:] + struct.pack("<I", len(old) - 7),
    }
    for name, tail in cases.items():
        broken = str(tmp_path / name)
        with open(broken, "wb") as f:
            f.write(head + tail + b"PAR1")
        with pytest.raises(stoker.ShardFormatError) as e:
            read_all(broken)
        assert_names(e.value, broken)


@pytest.mark.parametrize("where", ["head", "tail"])
def test_a_wrong_magic_is_an_error_naming_the_file(tmp_path, where):
    path = write(tmp_path)
    patch(path, 0 if where == "head" else os.path.getsize(path) - 4, b"PAR2")
    with pytest.raises(stoker.ShardFormatError) as e:
        read_all(path)
    assert_names(e.value, path)


def test_an_encrypted_footer_is_refused_by_name(tmp_path):
    path = write(tmp_path)
    patch(path, os.path.getsize(path) - 4, b"PARE")
    with pytest.raises(stoker.ShardFormatError) as e:
        stoker.Dataset(path)
    assert_names(e.value, path, "(?i)encrypt")


def test_row_groups_that_do_not_add_up_are_an_error(tmp_path):
    path = write(tmp_path)

    def edit(old, parsed):
        _, start, end = parsed[3]  # FileMetaData.num_rows
        return old[:start] + varint_bytes(N + 5) + old[end:]

    rewrite_footer(path, edit)
    with pytest.raises(stoker.ShardFormatError) as e:
        stoker.Dataset(path)
    assert_names(e.value, path, "rows")


def _chunk_meta(parsed: dict, group: int, column: int) -> dict:
    """ColumnMetaData of row group `group`'s column `column`, as Compact gives it."""
    row_group = parsed[4][0][group]  # FileMetaData.row_groups
    chunk = row_group[1][0][column]  # RowGroup.columns
    return chunk[3][0]  # ColumnChunk.meta_data


def test_a_column_chunk_running_past_the_file_is_an_error_naming_it(tmp_path):
    path = write(tmp_path)
    size = os.path.getsize(path)

    def edit(old, parsed):
        _, start, end = _chunk_meta(parsed, 1, 1)[7]  # total_compressed_size
        return old[:start] + varint_bytes(size * 3) + old[end:]

    rewrite_footer(path, edit)
    with pytest.raises(stoker.ShardFormatError) as e:
        read_all(path)
    assert_names(e.value, path, r"row group 1\b", "blob")


def test_a_column_chunk_before_the_header_is_an_error(tmp_path):
    path = write(tmp_path)

    def edit(old, parsed):
        _, start, end = _chunk_meta(parsed, 0, 0)[9]  # data_page_offset
        return old[:start] + varint_bytes(1) + old[end:]

    rewrite_footer(path, edit)
    with pytest.raises(stoker.ShardFormatError) as e:
        read_all(path)
    assert_names(e.value, path, "label")


# -- pages ----------------------------------------------------------------------------------


@pytest.mark.parametrize("column, name", [(0, "label"), (1, "blob")])
def test_a_bad_page_header_is_an_error_naming_file_column_and_page(tmp_path, column, name):
    path = write(tmp_path)
    first = pages(path, 1, column)[0]
    patch(path, first.offset, b"\xff" * first.header_size)
    with pytest.raises(stoker.ShardFormatError) as e:
        read_all(path)
    assert_names(e.value, path, name, r"(?i)page", r"row group 1\b")
    with pytest.raises(stoker.ShardFormatError) as e:
        read_all(path, {name: stoker.Int() if name == "label" else stoker.Bytes()})
    assert_names(e.value, path, name, r"(?i)page")


def test_a_page_header_of_another_kind_is_an_error(tmp_path):
    path = write(tmp_path)
    first = pages(path, 0, 1)[0]
    _, start, end = first.header[1]  # PageHeader.type: DATA_PAGE (0) made INDEX_PAGE (1)
    patch(path, start, varint_bytes(1))
    with pytest.raises(stoker.ShardFormatError) as e:
        read_all(path, {"blob": stoker.Bytes()})
    assert_names(e.value, path, "blob")


def test_a_page_running_past_its_column_chunk_is_an_error(tmp_path):
    path = write(tmp_path, codec="none")
    first = pages(path, 0, 1)[0]
    _, start, end = first.header[3]  # compressed_page_size
    width = end - start
    larger = ((1 << (7 * width)) - 1) >> 1  # the largest value of the same varint length
    meta = pq.ParquetFile(path).metadata.row_group(0).column(1)
    assert larger > meta.total_compressed_size, "the page must run past its chunk"
    patch(path, start, varint_bytes(larger))
    assert len(varint_bytes(larger)) == width
    with pytest.raises(stoker.ShardFormatError) as e:
        read_all(path, {"blob": stoker.Bytes()})
    assert_names(e.value, path, "blob", r"(?i)page")


@pytest.mark.parametrize("blob_bytes", BLOB_BYTES.values(), ids=BLOB_BYTES.keys())
@pytest.mark.parametrize("codec", ["snappy", "zstd", "gzip"])
@pytest.mark.parametrize("version", ["1.0", "2.0"])
def test_a_corrupt_compressed_page_is_an_error_naming_it(tmp_path, codec, version, blob_bytes):
    path = write(tmp_path, codec=codec, data_page_version=version, blob_bytes=blob_bytes)
    for column, name in ((0, "label"), (1, "blob")):
        broken = str(tmp_path / f"{name}.parquet")
        with open(path, "rb") as f:
            data = bytearray(f.read())
        page = pages(path, 2, column)[0]
        # The body's first bytes: snappy's length preamble, zstd's and gzip's frame header.
        for k in range(4):
            data[page.body + k] ^= 0xA5
        with open(broken, "wb") as f:
            f.write(data)
        spec = stoker.Int() if name == "label" else stoker.Bytes()
        with pytest.raises(stoker.ShardFormatError) as e:
            read_all(broken, {name: spec})
        assert_names(e.value, broken, name, r"(?i)page")
        # The other column, and the row groups before, still read.
        other = "blob" if name == "label" else "label"
        ds = stoker.Dataset(broken)
        read_all(broken, {other: stoker.Bytes() if other == "blob" else stoker.Int()})
        assert int(ds[5]["label"]) == 5


def test_a_dictionary_index_past_the_dictionary_is_an_error(tmp_path):
    path = str(tmp_path / "dict.parquet")
    words = pa.array([f"w{i % 3}" for i in range(N)], pa.string())
    pq.write_table(
        pa.table({"text": words}), path, compression="none", use_dictionary=True, row_group_size=N
    )
    dictionary, data_page = pages(path, 0, 0)[:2]
    assert dictionary.kind == 2
    # A data page of required values: the body is [bit width][RLE/bit-packed indices].
    with open(path, "rb") as f:
        body = bytearray(f.read())[data_page.body : data_page.body + data_page.compressed]
    levels = 0
    if pq.ParquetFile(path).schema_arrow.field("text").nullable:  # v1: a 4-byte level length
        (levels,) = struct.unpack_from("<I", body, 0)
        levels += 4
    width = body[levels]
    assert 1 <= width <= 8
    patch(path, data_page.body + levels, bytes([8]))  # indices now read 8 bits wide
    with pytest.raises(stoker.ShardFormatError) as e:
        read_all(path, {"text": stoker.Bytes()})
    assert_names(e.value, path, "text")


# -- refused by name ------------------------------------------------------------------------


def test_an_int96_column_asked_for_says_int96(tmp_path):
    path = str(tmp_path / "stamps.parquet")
    stamps = pa.array(np.arange(N).astype("datetime64[ns]"))
    pq.write_table(
        pa.table({"label": pa.array(range(N)), "when": stamps}),
        path,
        use_deprecated_int96_timestamps=True,
    )
    assert pq.ParquetFile(path).schema.column(1).physical_type == "INT96"
    ds = stoker.Dataset(path)
    assert "when" not in ds.fields and "when" not in ds[0]
    with pytest.raises(stoker.StokerError, match="INT96") as e:
        stoker.Loader(ds, batch_size=8, fields={"when": stoker.Raw((12,), "uint8")})
    assert "stamps.parquet" in str(e.value)
    read_all(path, {"label": stoker.Int()})


def test_a_codec_without_a_library_is_refused_by_name(tmp_path):
    path = str(tmp_path / "brotli.parquet")
    pq.write_table(table(), path, compression={"label": "snappy", "blob": "brotli"})
    ds = stoker.Dataset(path)
    assert "blob" not in ds.fields
    with pytest.raises(stoker.StokerError, match="brotli"):
        stoker.Loader(ds, batch_size=8, fields={"blob": stoker.Bytes()})


# -- never a crash ----------------------------------------------------------------------------

_FUZZ = textwrap.dedent("""
    import sys, stoker
    bad = 0
    for path in sys.argv[1:]:
        try:
            ds = stoker.Dataset(path)
            for batch in stoker.Loader(ds, batch_size=16, fields={"label": stoker.Int(),
                                                                   "blob": stoker.Bytes()}):
                pass
            ds.get_batch(range(len(ds)))
        except stoker.StokerError:
            bad += 1
    print("errors", bad)
""")


@pytest.mark.parametrize(
    ("blob_bytes", "dictionary"),
    [(BLOB_BYTES["copied"], True), (BLOB_BYTES["kept"], False)],
    ids=BLOB_BYTES.keys(),
)
def test_damage_anywhere_is_an_error_or_a_read_never_a_crash(tmp_path, blob_bytes, dictionary):
    """Bytes flipped at random places of files (footer and pages): every file either reads
    or raises a StokerError, in a child process, so that a crash shows as one."""
    path = write(tmp_path, codec="snappy", use_dictionary=dictionary, blob_bytes=blob_bytes)
    with open(path, "rb") as f:
        data = f.read()
    start, _ = footer(path)
    rng = np.random.default_rng(0)
    paths = []
    for k in range(120):
        damaged = bytearray(data)
        low = start if k % 2 else 4  # half in the footer, half anywhere before it
        for at in rng.integers(low, len(data) - 8, int(rng.integers(1, 4))):
            damaged[at] ^= int(rng.integers(1, 256))
        out = str(tmp_path / f"fuzz-{k:03d}.parquet")
        with open(out, "wb") as f:
            f.write(damaged)
        paths.append(out)
    result = subprocess.run(
        [sys.executable, "-c", _FUZZ, *paths], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    assert "errors" in result.stdout


def test_a_file_cut_shorter_while_it_is_read_is_an_error_not_a_crash(tmp_path):
    # The reader maps the files it decodes from: a file truncated after its first rows were
    # read (its descriptor and mapping kept open) must fail as a short read does, naming
    # the file, not kill the process with SIGBUS in a decoder.
    path = write(tmp_path, "cut.parquet", codec="snappy")
    fields = {"blob": stoker.Bytes(), "label": stoker.Int()}
    batches = iter(stoker.Loader(stoker.Dataset(path), 5, fields=fields, shuffle=False))
    first = next(batches)
    assert first["label"].tolist() == [0, 1, 2, 3, 4]
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 4)
    with pytest.raises(stoker.ShardFormatError) as caught:
        for _ in batches:
            pass
    assert_names(caught.value, path, "short read|truncated")


def test_a_file_cut_shorter_under_values_left_in_place_is_an_error_not_a_crash(tmp_path):
    # Uncompressed byte strings are not copied out of the file's mapping when their column
    # chunk is decoded: the cache keeps where they are, and every later batch takes them
    # from the mapping again. A row group cut off after it was decoded must then fail as a
    # short read does, naming the file, and not kill the process with SIGBUS.
    path = write(tmp_path, "cut-in-place.parquet", codec="none")
    fields = {"blob": stoker.Bytes(), "label": stoker.Int()}
    loader = stoker.Loader(stoker.Dataset(path), 5, fields=fields, shuffle=False, prefetch=1)
    batches = iter(loader)
    first = next(batches)
    assert first["label"].tolist() == [0, 1, 2, 3, 4]
    assert [bytes(v) for v in first["blob"]] == table()["blob"].to_pylist()[:5]
    blob = pq.ParquetFile(path).metadata.row_group(0).column(1)
    assert blob.compression == "UNCOMPRESSED" and blob.dictionary_page_offset is None
    with open(path, "r+b") as f:
        f.truncate(blob.data_page_offset + 10)  # inside the row group decoded for batch 1
    served = []
    with pytest.raises(stoker.ShardFormatError) as caught:
        for batch in batches:  # (the batch after the first may have been read already)
            served += batch["label"].tolist()
    assert served in ([], [5, 6, 7, 8, 9])
    assert_names(caught.value, path, "short read|truncated")
