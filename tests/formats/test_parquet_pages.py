"""Parquet's footer and pages decoded by stoker's own C++ (stoker._core.parquet_*,
decode_parquet_chunk): every column chunk of files pyarrow and fastparquet write must
decode to exactly what pyarrow reads, byte for byte, and damaged or unsupported files
are refused with ShardFormatError naming the file, the offset and the page."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from stoker import _core
from stoker.errors import ShardFormatError
from tests.support import DATA

ROWS = 400
ROW_GROUP = 150
IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
# The physical type's value, as the decoder gives it: small integers widen to INT32.
PHYSICAL = {
    pa.int8(): np.int32,
    pa.int16(): np.int32,
    pa.int32(): np.int32,
    pa.int64(): np.int64,
    pa.uint8(): np.uint32,
    pa.uint16(): np.uint32,
    pa.uint32(): np.uint32,
    pa.uint64(): np.uint64,
    pa.float16(): np.float16,
    pa.float32(): np.float32,
    pa.float64(): np.float64,
    pa.bool_(): np.uint8,
}


# -- reading files the way the reader will ----------------------------------------


def _footer(raw: bytes, path: Path) -> dict[str, Any]:
    offset, size = _core.parquet_footer(raw[-64:], len(raw), str(path))
    return _core.parquet_metadata(raw[offset : offset + size], str(path), offset)


def _chunk_start(column: dict[str, Any]) -> int:
    dictionary = column["dictionary_page_offset"]
    return dictionary if dictionary >= 0 else column["data_page_offset"]


def _decode(raw: bytes, path: Path, group: int, column: int, rows: int | None = None, **kw):
    meta = _footer(raw, path)
    chunk = meta["row_groups"][group]["columns"][column]
    leaf = meta["leaves"][column]
    start = _chunk_start(chunk)
    return _core.decode_parquet_chunk(
        raw[start : start + chunk["total_compressed_size"]],
        start,
        meta["row_groups"][group]["num_rows"] if rows is None else rows,
        leaf["physical_type"],
        leaf["type_length"],
        leaf["max_definition"],
        leaf["max_repetition"],
        chunk["codec"],
        f"row group {group}, column {'.'.join(chunk['path'])}",
        str(path),
        leaf["repeated_definition"],
        **kw,
    )


def _leaf_arrays(table: pa.Table) -> dict[tuple[str, ...], pa.Array]:
    """Each leaf column's values as pyarrow reads them, a null parent's nulls merged in."""
    out = {}
    for field, column in zip(table.schema, table.columns):
        array = column.combine_chunks()
        if pa.types.is_struct(field.type):
            for child, values in zip(field.type, array.flatten()):
                out[(field.name, child.name)] = values
        elif pa.types.is_list(field.type):
            out[(field.name, "list", "element")] = array
        else:
            out[(field.name,)] = array
    return out


def _expected(array: pa.Array) -> tuple[np.ndarray, np.ndarray, bytes]:
    """(offsets, nulls, data) as decode_parquet_chunk must give them for `array`."""
    nulls = array.is_null().to_numpy(zero_copy_only=False).astype(np.uint8)
    kind = array.type
    if pa.types.is_list(kind):
        lengths = pc.fill_null(pc.list_value_length(array), 0).to_numpy().astype(np.uint64)
        values = array.flatten()
        dtype = PHYSICAL[values.type]
        sizes = lengths * np.dtype(dtype).itemsize
        data = values.to_numpy(zero_copy_only=False).astype(dtype).tobytes()
    elif kind in PHYSICAL:
        dtype = PHYSICAL[kind]
        sizes = (1 - nulls).astype(np.uint64) * np.dtype(dtype).itemsize
        present = array.drop_null().to_numpy(zero_copy_only=False)
        data = present.astype(dtype).tobytes()
    else:
        items = [v.encode() if isinstance(v, str) else v for v in array.to_pylist()]
        sizes = np.array([0 if v is None else len(v) for v in items], np.uint64)
        data = b"".join(v for v in items if v is not None)
    offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.uint64)]).astype(np.uint64)
    return offsets, nulls, data


# How the reader may decode byte strings: copied out, left in their decompressed pages
# (here whatever their size, so that the small values of these files are too), left in
# the stored bytes where those are uncompressed.
VALUES_LEFT = [
    {"values_left": "copied"},
    {"values_left": "pages", "least_bytes_in_pages": 0},
    {"values_left": "stored", "least_bytes_in_pages": 0},
]


def _check_file(path: Path) -> int:
    """Decodes every column chunk of `path`, each way of VALUES_LEFT, and compares it
    with pyarrow; returns how many chunks there were."""
    raw = path.read_bytes()
    meta = _footer(raw, path)
    reader = pq.ParquetFile(path)
    assert meta["num_rows"] == reader.metadata.num_rows
    checked = 0
    for g, group in enumerate(meta["row_groups"]):
        leaves = _leaf_arrays(reader.read_row_group(g))
        assert len(group["columns"]) == len(leaves)
        for c, chunk in enumerate(group["columns"]):
            want_offsets, want_nulls, want_data = _expected(leaves[tuple(chunk["path"])])
            for left in VALUES_LEFT:
                offsets, nulls, data = _decode(raw, path, g, c, **left)
                where = f"{path.name}: row group {g}, column {chunk['path']}, {left}"
                assert offsets.dtype == np.uint64 and data.dtype == np.uint8
                np.testing.assert_array_equal(offsets, want_offsets, err_msg=where)
                if want_nulls.any():
                    assert nulls is not None, where
                    np.testing.assert_array_equal(nulls, want_nulls, err_msg=where)
                else:
                    assert nulls is None, where
                assert data.tobytes() == want_data, where
            checked += 1
    return checked


# -- the matrix -------------------------------------------------------------------


def _table(nulls: bool, seed: int = 0) -> pa.Table:
    """One column of each type the decoder reads; with `nulls`, nullable columns holding
    nulls (null lists and structs too), else required ones."""
    rng = np.random.default_rng(seed)

    def blank(values: list) -> list:
        return [None if nulls and i % 7 == 3 else v for i, v in enumerate(values)]

    def ints(dtype: str) -> list:
        info = np.iinfo(dtype)
        low = rng.integers(info.min, info.max, ROWS, dtype=dtype, endpoint=True)
        few = rng.integers(0, 5, ROWS).astype(dtype)  # dictionary-friendly
        return np.where(np.arange(ROWS) % 3 == 0, low, few).tolist()

    def words(alphabet: str, longest: int) -> list:
        return ["".join(rng.choice(list(alphabet), rng.integers(0, longest))) for _ in range(ROWS)]

    lists = [rng.integers(-1000, 1000, rng.integers(0, 5)).tolist() for _ in range(ROWS)]
    columns: dict[str, tuple[pa.DataType, list]] = {
        name: (getattr(pa, name)(), ints(name))
        for name in ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
    }
    columns["float16"] = (pa.float16(), rng.standard_normal(ROWS).astype(np.float16).tolist())
    columns["float32"] = (pa.float32(), rng.standard_normal(ROWS).astype(np.float32).tolist())
    columns["float64"] = (pa.float64(), (rng.integers(0, 9, ROWS) / 8).tolist())
    columns["bool"] = (pa.bool_(), (rng.random(ROWS) < 0.3).tolist())
    columns["string"] = (pa.string(), words("abcé", 12))
    columns["binary"] = (pa.binary(), [w.encode() * 3 for w in words("xyz", 9)])
    columns["large_binary"] = (pa.large_binary(), [w.encode() for w in words("0123456789", 40)])
    columns["fixed"] = (pa.binary(5), [rng.bytes(5) for _ in range(ROWS)])
    columns["list_i32"] = (pa.list_(pa.int32()), lists)
    items = pa.field("item", pa.int64(), nullable=False)
    columns["list_i64"] = (pa.list_(items), [v[::-1] for v in lists])
    columns["list_f32"] = (pa.list_(pa.float32()), [[x / 4 for x in v] for v in lists])
    images = [
        {"bytes": rng.bytes(int(rng.integers(0, 30))), "path": f"{i}.png"} for i in range(ROWS)
    ]
    if nulls:  # null children as well as null structs
        images = [dict(v, bytes=None) if i % 11 == 5 else v for i, v in enumerate(images)]
    columns["image"] = (IMAGE, images)
    fields, arrays = [], []
    for name, (kind, values) in columns.items():
        if not nulls and kind == IMAGE:
            kind = pa.struct([pa.field(f.name, f.type, nullable=False) for f in IMAGE])
        fields.append(pa.field(name, kind, nullable=nulls))
        arrays.append(pa.array(blank(values), kind))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


MATRIX = list(
    itertools.product(["none", "snappy", "gzip", "zstd", "lz4"], [True, False], ["1.0", "2.0"])
)


@pytest.fixture(scope="module")
def tables() -> dict[bool, pa.Table]:
    return {nulls: _table(nulls) for nulls in (False, True)}


@pytest.mark.parametrize("nulls", [False, True], ids=["required", "nulls"])
@pytest.mark.parametrize(("compression", "dictionary", "version"), MATRIX)
def test_matrix(tmp_path, tables, compression, dictionary, version, nulls):
    path = tmp_path / "t.parquet"
    pq.write_table(
        tables[nulls],
        path,
        compression=compression,
        use_dictionary=dictionary,
        data_page_version=version,
        data_page_size=512,
        write_batch_size=64,
        row_group_size=ROW_GROUP,
        # Small enough that high-cardinality columns fall back to PLAIN mid-chunk.
        dictionary_pagesize_limit=1024,
    )
    assert _check_file(path) == 3 * len(_leaf_arrays(tables[nulls]))


def test_pages_mix_dictionary_and_plain(tmp_path):
    path = tmp_path / "mixed.parquet"
    values = [f"value {i}" for i in range(2000)]
    pq.write_table(pa.table({"s": values}), path, dictionary_pagesize_limit=256, data_page_size=256)
    encodings = pq.ParquetFile(path).metadata.row_group(0).column(0).encodings
    assert "RLE_DICTIONARY" in encodings and "PLAIN" in encodings
    assert _check_file(path) == 1


def test_byte_stream_split(tmp_path):
    rng = np.random.default_rng(3)
    table = pa.table(
        {
            "f": pa.array(rng.standard_normal(300), pa.float32()),
            "d": pa.array(rng.standard_normal(300)),
            "i": pa.array(rng.integers(-9, 9, 300), pa.int32()),
            "l": pa.array(rng.integers(-9, 9, 300), pa.int64()),
            "x": pa.array([None if i % 9 == 0 else rng.bytes(3) for i in range(300)], pa.binary(3)),
        }
    )
    path = tmp_path / "split.parquet"
    pq.write_table(
        table,
        path,
        use_dictionary=False,
        data_page_size=256,
        column_encoding={name: "BYTE_STREAM_SPLIT" for name in table.column_names},
    )
    assert "BYTE_STREAM_SPLIT" in pq.ParquetFile(path).metadata.row_group(0).column(0).encodings
    assert _check_file(path) == 5


def test_fastparquet_file(tmp_path):
    fastparquet = pytest.importorskip("fastparquet")
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame(
        {
            "i": np.arange(300, dtype=np.int64) * 3,
            "f": np.linspace(0, 1, 300, dtype=np.float32),
            "s": [f"row {i % 17}" for i in range(300)],
            "b": [bytes([i % 256]) * (i % 5) for i in range(300)],
            "o": pd.array([None if i % 4 == 0 else i for i in range(300)], dtype="Int32"),
        }
    )
    for compression in ["SNAPPY", "GZIP", "ZSTD", None]:
        path = tmp_path / f"fast-{compression}.parquet"
        fastparquet.write(
            str(path),
            frame,
            row_group_offsets=[0, 120, 250],
            compression=compression,
            object_encoding={"s": "utf8", "b": "bytes"},
            stats=False,
        )
        assert _check_file(path) == 15


def test_metadata_matches_pyarrow(tmp_path, tables):
    path = tmp_path / "meta.parquet"
    table = tables[True].replace_schema_metadata({"huggingface": '{"info": 1}', "k": "v"})
    pq.write_table(table, path, row_group_size=ROW_GROUP, compression="zstd")
    meta = _footer(path.read_bytes(), path)
    theirs = pq.ParquetFile(path).metadata
    assert meta["num_rows"] == theirs.num_rows == ROWS
    assert meta["created_by"] == theirs.created_by
    assert len(meta["row_groups"]) == theirs.num_row_groups == 3
    assert meta["encrypted"] is False
    keys = dict(meta["key_value"])
    assert keys["huggingface"] == '{"info": 1}' and keys["k"] == "v" and "ARROW:schema" in keys
    for g, group in enumerate(meta["row_groups"]):
        their_group = theirs.row_group(g)
        assert group["num_rows"] == their_group.num_rows
        assert group["total_byte_size"] == their_group.total_byte_size
        for c, column in enumerate(group["columns"]):
            their = their_group.column(c)
            assert ".".join(column["path"]) == their.path_in_schema
            assert column["data_page_offset"] == their.data_page_offset
            assert column["dictionary_page_offset"] == (their.dictionary_page_offset or -1)
            assert column["total_compressed_size"] == their.total_compressed_size
            assert column["total_uncompressed_size"] == their.total_uncompressed_size
            assert column["num_values"] == their.num_values
            assert column["codec"] == 6  # ZSTD
            assert column["type"] == [
                "BOOLEAN",
                "INT32",
                "INT64",
                "INT96",
                "FLOAT",
                "DOUBLE",
                "BYTE_ARRAY",
                "FIXED_LEN_BYTE_ARRAY",
            ].index(their.physical_type)
            assert column["file_path"] == "" and not column["encrypted"]
    schema = pq.ParquetFile(path).schema
    for leaf, column in zip(meta["leaves"], (schema.column(i) for i in range(len(schema)))):
        assert ".".join(leaf["path"]) == column.path
        assert leaf["max_definition"] == column.max_definition_level
        assert leaf["max_repetition"] == column.max_repetition_level
    by_name = {e["name"]: e for e in meta["schema"]}
    assert by_name["string"]["logical_type"] == "STRING"
    assert by_name["float16"]["logical_type"] == "FLOAT16"
    assert by_name["fixed"]["type_length"] == 5
    assert (by_name["uint16"]["int_bit_width"], by_name["uint16"]["int_signed"]) == (16, False)
    assert by_name["list_i32"]["logical_type"] == "LIST"
    assert by_name["image"]["num_children"] == 2


def test_timestamp_logical_type(tmp_path):
    path = tmp_path / "time.parquet"
    pq.write_table(pa.table({"t": pa.array([0, 1], pa.timestamp("us", tz="UTC"))}), path)
    element = _footer(path.read_bytes(), path)["schema"][1]
    assert element["logical_type"] == "TIMESTAMP"
    assert (element["time_unit"], element["adjusted_to_utc"]) == ("MICROS", True)


def test_offset_index(tmp_path):
    path = tmp_path / "paged.parquet"
    values = np.arange(3000, dtype=np.int64)
    pq.write_table(
        pa.table({"v": values}),
        path,
        write_page_index=True,
        use_dictionary=False,
        data_page_size=1024,
        write_batch_size=100,
        compression="snappy",
    )
    raw = path.read_bytes()
    column = _footer(raw, path)["row_groups"][0]["columns"][0]
    at, length = column["offset_index_offset"], column["offset_index_length"]
    assert at > 0 and length > 0
    index = _core.parquet_offset_index(raw[at : at + length], str(path), at)
    assert index["offset"].dtype == np.int64 and index["compressed_page_size"].dtype == np.int32
    assert index["first_row_index"][0] == 0 and len(index["offset"]) > 3
    assert index["offset"][0] == column["data_page_offset"]
    ends = [*index["first_row_index"][1:].tolist(), 3000]
    # Each page decodes alone, from where the offset index says it is.
    for offset, size, first, end in zip(
        index["offset"], index["compressed_page_size"], index["first_row_index"], ends
    ):
        offsets, nulls, data = _core.decode_parquet_chunk(
            raw[offset : offset + size], int(offset), end - first, 2, 0, 1, 0, 1, "v", str(path)
        )
        assert nulls is None and len(offsets) == end - first + 1
        assert data.tobytes() == values[first:end].tobytes()


@pytest.mark.parametrize(
    ("codec", "step"),
    [("snappy", _core.ChunkFilter.SNAPPY), ("lz4_raw", _core.ChunkFilter.LZ4_RAW)],
)
def test_page_codecs_in_decompress(codec, step):
    data = b"pages of parquet " * 300
    packed = pa.compress(data, codec=codec, asbytes=True)
    assert _core.codec_unavailable(step) == ""
    # lz4 is opened at run time; snappy is stoker's own decoder, from no library.
    assert bool(_core.codec_library(step)) == (codec == "lz4_raw")
    assert _core.decompress(packed, len(data), step, "x.bin").tobytes() == data
    refused(lambda: _core.decompress(packed, len(data) + 1, step, "x.bin"), "x.bin", "expected")
    refused(lambda: _core.decompress(b"\xff" * 9, len(data), step, "x.bin"), "corrupt")


def test_seeds_decode():
    for path in sorted((DATA / "parquet-seeds").glob("*.parquet")):
        if path.name.startswith("truncated"):
            with pytest.raises(ShardFormatError, match=path.name):
                _check_file(path)
        else:
            assert _check_file(path) > 0


# -- damaged and unsupported files ------------------------------------------------


def refused(call, *words: str) -> ShardFormatError:
    with pytest.raises(ShardFormatError) as info:
        call()
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    return info.value


def _one_column(tmp_path: Path, **options: Any) -> tuple[Path, bytearray, dict[str, Any]]:
    path = tmp_path / "one.parquet"
    values = pa.array([f"{i % 13} {'ab' * (i % 7)}" for i in range(500)])
    pq.write_table(
        pa.table({"s": values}), path, use_dictionary=False, write_statistics=False, **options
    )
    raw = bytearray(path.read_bytes())
    return path, raw, _footer(bytes(raw), path)["row_groups"][0]["columns"][0]


def _varint(raw: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        value |= (raw[at] & 0x7F) << shift
        shift += 7
        at += 1
        if raw[at - 1] < 0x80:
            return value, at


def _page_sizes(raw: bytes, at: int) -> tuple[int, int, int]:
    """The page header at `at` (type, uncompressed and compressed sizes: its first three
    fields, as pyarrow writes them): (compressed size, where its varint starts, where it
    ends)."""
    for _ in range(2):
        assert raw[at] == 0x15  # field id + 1, type i32
        _, at = _varint(raw, at + 1)
    assert raw[at] == 0x15
    zigzag, end = _varint(raw, at + 1)
    return zigzag >> 1, at + 1, end


def test_wrong_magic(tmp_path):
    path, raw, _ = _one_column(tmp_path)
    raw[-4:] = b"PAR2"
    refused(
        lambda: _core.parquet_footer(bytes(raw), len(raw), str(path)),
        str(path),
        "not a Parquet file",
        "PAR2",
    )
    raw[-4:] = b"PAR1"
    raw[:4] = b"GIF8"
    error = refused(lambda: _core.parquet_footer(bytes(raw), len(raw), str(path)), "GIF8")
    assert error.offset == 0


def test_encrypted_footer(tmp_path):
    path, raw, _ = _one_column(tmp_path)
    raw[-4:] = b"PARE"
    error = refused(
        lambda: _core.parquet_footer(bytes(raw[-100:]), len(raw), str(path)),
        str(path),
        "encrypted",
        "decryption_properties",
    )
    assert error.offset == len(raw) - 4


def test_truncated_footer(tmp_path):
    path, raw, _ = _one_column(tmp_path)
    offset, size = _core.parquet_footer(bytes(raw), len(raw), str(path))
    refused(
        lambda: _core.parquet_metadata(bytes(raw[offset : offset + size // 2]), str(path), offset),
        str(path),
        "footer",
        "cut off",
    )
    cut = bytes(raw[: len(raw) // 2])
    refused(lambda: _core.parquet_footer(cut, len(cut), str(path)), "not a Parquet file")
    refused(lambda: _core.parquet_footer(b"PAR1", 4, str(path)), "fewer than the 12")
    # A length larger than the file holds.
    raw[-8:-4] = (len(raw) * 2).to_bytes(4, "little")
    refused(lambda: _core.parquet_footer(bytes(raw), len(raw), str(path)), "footer length")


def test_bad_page_header(tmp_path):
    path, raw, column = _one_column(tmp_path)
    at = column["data_page_offset"]
    raw[at : at + 4] = b"\xff" * 4
    error = refused(
        lambda: _decode(bytes(raw), path, 0, 0),
        str(path),
        "row group 0, column s",
        "page 0",
        "page header",
    )
    assert error.offset == at


LEFT_IDS = [left["values_left"] for left in VALUES_LEFT]


@pytest.mark.parametrize("left", VALUES_LEFT, ids=LEFT_IDS)
@pytest.mark.parametrize("compression", ["snappy", "zstd", "gzip", "lz4"])
def test_corrupt_compressed_page(tmp_path, compression, left):
    path, raw, column = _one_column(tmp_path, compression=compression)
    start = column["data_page_offset"]
    size, _, _ = _page_sizes(raw, start)
    end = start + column["total_compressed_size"]  # one page: its body ends the chunk
    body = end - size
    raw[body : body + 6] = b"\xff" * 6
    error = refused(
        lambda: _decode(bytes(raw), path, 0, 0, **left),
        str(path),
        "column s",
        "page 0",
        "corrupt" if compression != "gzip" else "gzip",
    )
    assert error.offset == start


@pytest.mark.parametrize("left", VALUES_LEFT, ids=LEFT_IDS)
def test_compressed_size_past_the_chunk(tmp_path, left):
    path, raw, column = _one_column(tmp_path, compression="snappy")
    start = column["data_page_offset"]
    size, at, end = _page_sizes(raw, start)
    assert end - at == 2  # a 2-byte varint, rewritten to its largest value
    raw[at:end] = bytes([0xFE, 0x7F])
    refused(
        lambda: _decode(bytes(raw), path, 0, 0, **left),
        str(path),
        "page 0",
        "runs past the end of the column chunk",
    )


@pytest.mark.parametrize("left", VALUES_LEFT, ids=LEFT_IDS)
def test_wrong_row_count(tmp_path, left):
    path, raw, _ = _one_column(tmp_path, compression="zstd")
    refused(lambda: _decode(bytes(raw), path, 0, 0, rows=499, **left), "page 0", "499 rows")
    refused(lambda: _decode(bytes(raw), path, 0, 0, rows=501, **left), "hold 500 rows", "has 501")


@pytest.mark.parametrize("left", VALUES_LEFT, ids=LEFT_IDS)
def test_decoded_size_bound(tmp_path, left):
    """Pages kept whole need more room than the values alone (a start and a length a
    row): where they would not fit, the values are copied, and the bound is the same."""
    path, raw, _ = _one_column(tmp_path, compression="snappy")
    refused(
        lambda: _decode(bytes(raw), path, 0, 0, max_decoded_bytes=8000, **left),
        "max_decoded_bytes",
    )
    # Room for the values copied (8,700 bytes), not for the pages kept (about 14,000).
    offsets, _, data = _decode(bytes(raw), path, 0, 0, max_decoded_bytes=9000, **left)
    assert len(offsets) == 501 and data.tobytes() == b"".join(
        f"{i % 13} {'ab' * (i % 7)}".encode() for i in range(500)
    )


def test_int96_refused(tmp_path):
    path = tmp_path / "int96.parquet"
    table = pa.table({"t": pa.array([0, 10**9], pa.timestamp("ns"))})
    pq.write_table(table, path, use_deprecated_int96_timestamps=True)
    refused(
        lambda: _decode(path.read_bytes(), path, 0, 0),
        str(path),
        "column t",
        "INT96",
        "coerce_timestamps",
    )


def test_delta_binary_packed_refused(tmp_path):
    path = tmp_path / "delta.parquet"
    pq.write_table(
        pa.table({"i": pa.array(range(100), pa.int32())}),
        path,
        use_dictionary=False,
        column_encoding={"i": "DELTA_BINARY_PACKED"},
    )
    refused(
        lambda: _decode(path.read_bytes(), path, 0, 0),
        str(path),
        "column i",
        "page 0",
        "DELTA_BINARY_PACKED",
        "column_encoding='PLAIN'",
    )


def test_brotli_refused(tmp_path):
    path = tmp_path / "brotli.parquet"
    pq.write_table(pa.table({"i": [1, 2]}), path, compression="brotli")
    refused(lambda: _decode(path.read_bytes(), path, 0, 0), "BROTLI", "compression='zstd'")


@pytest.mark.parametrize(("codec", "words"), [(5, "Hadoop LZ4"), (3, "LZO"), (9, "codec 9")])
def test_other_codecs_refused(tmp_path, codec, words):
    path, raw, column = _one_column(tmp_path)
    start = column["data_page_offset"]
    chunk = bytes(raw[start : start + column["total_compressed_size"]])
    error = refused(
        lambda: _core.decode_parquet_chunk(chunk, start, 500, 6, 0, 1, 0, codec, "s", str(path)),
        str(path),
        words,
    )
    assert error.offset == start


def test_unsupported_lists_refused(tmp_path):
    path = tmp_path / "lists.parquet"
    table = pa.table({"words": [["a", "b"], []], "nested": [[[1], [2, 3]], []]})
    pq.write_table(table, path)
    raw = path.read_bytes()
    refused(lambda: _decode(raw, path, 0, 0), "list of byte arrays")
    refused(lambda: _decode(raw, path, 0, 1), "nested lists")


def test_null_list_element_refused(tmp_path):
    path = tmp_path / "holes.parquet"
    pq.write_table(pa.table({"l": pa.array([[1], [2, None]], pa.list_(pa.int32()))}), path)
    refused(lambda: _decode(path.read_bytes(), path, 0, 0), "row 1", "null element")


@pytest.mark.parametrize("first", [None, []], ids=["null", "empty"])
def test_an_entry_continuing_a_null_or_empty_list_refused(tmp_path, first):
    """A null or empty list is all of its row; an entry whose repetition level continues
    it (found by the fuzzer: it gave a null row a value) is refused."""
    path = tmp_path / "ended.parquet"
    table = pa.table({"l": pa.array([first, [5]], pa.list_(pa.int32()))})
    pq.write_table(table, path, use_dictionary=False, compression="none", data_page_version="1.0")
    raw = path.read_bytes()
    _decode(raw, path, 0, 0)  # as written, it decodes
    # The page's repetition levels, [0, 0]: one RLE run (4-byte length 2, header 2<<1, value
    # 0). Bit-packed, [0, 1] is as long: header 1<<1|1, then the bits 0b10.
    levels = bytes([2, 0, 0, 0, 4, 0])
    assert raw.count(levels) == 1
    damaged = raw.replace(levels, bytes([2, 0, 0, 0, 3, 2]))
    refused(lambda: _decode(damaged, path, 0, 0), "row 0", "null or empty list", "continues")
