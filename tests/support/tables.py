"""Table sources for the tests: pyarrow tables of every type stoker reads, what each row of
them should read back as, and a small Thrift compact-protocol reader to find (and damage)
the parts of a Parquet file: its footer, its column chunks' page headers and bodies."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

#: Columns whose values are null in rows i % 10 == 3 (group A) and i % 10 == 7 (group B),
#: when a table is made with nulls. "id" is never null.
NULLS_A = ("i8", "i32", "u8", "u32", "f16", "f64", "blob", "fixed", "li32", "lf32", "image")
NULLS_B = ("i16", "i64", "u16", "u64", "f32", "flag", "text", "big", "li64", "image.path")

_INTS = {
    "i8": pa.int8(),
    "i16": pa.int16(),
    "i32": pa.int32(),
    "i64": pa.int64(),
    "u8": pa.uint8(),
    "u16": pa.uint16(),
    "u32": pa.uint32(),
    "u64": pa.uint64(),
}
_FLOATS = {"f16": pa.float16(), "f32": pa.float32(), "f64": pa.float64()}
_LISTS = {"li32": pa.int32(), "li64": pa.int64(), "lf32": pa.float32()}
_WORDS = ["", "cat", "dog", "Zürich", "日本語", "a somewhat longer piece of text", "x"]


def _null_rows(name: str, n: int, nulls: bool) -> np.ndarray:
    mask = np.zeros(n, bool)
    if nulls and name in NULLS_A:
        mask[3::10] = True
    if nulls and name in NULLS_B:
        mask[7::10] = True
    return mask


def _with_nulls(values: list, mask: np.ndarray) -> list:
    return [None if m else v for v, m in zip(values, mask)]


def make_table(n: int = 100, seed: int = 0, nulls: bool = False) -> Any:
    """A table of every type the contract names, `n` rows; with `nulls`, the columns of
    NULLS_A and NULLS_B have nulls in their rows (else no column is even nullable)."""
    rng = np.random.default_rng(seed)
    columns: dict[str, Any] = {}
    fields = []

    def add(name: str, kind: Any, values: list) -> None:
        mask = _null_rows(name, n, nulls)
        columns[name] = pa.array(_with_nulls(values, mask), type=kind)
        fields.append(pa.field(name, kind, nullable=nulls))

    add("id", pa.int64(), list(range(1000, 1000 + n)))
    for name, kind in _INTS.items():
        info = np.iinfo(kind.to_pandas_dtype())
        values = rng.integers(info.min, info.max, n, dtype=kind.to_pandas_dtype(), endpoint=True)
        values[:2] = (info.min, info.max)
        add(name, kind, values.tolist())
    for name, kind in _FLOATS.items():
        values = rng.standard_normal(n).astype(kind.to_pandas_dtype()) * 100
        values[:3] = (np.inf, -np.inf, -0.0)
        # (np.float16 values go in as numpy scalars: pyarrow takes them for halffloat)
        add(name, kind, list(values) if name == "f16" else values.tolist())
    add("flag", pa.bool_(), (rng.random(n) < 0.4).tolist())
    add("blob", pa.binary(), [_bytes(rng, 0, 60) for _ in range(n)])
    add("text", pa.string(), [_WORDS[i] for i in rng.integers(0, len(_WORDS), n)])
    add("big", pa.large_binary(), [_bytes(rng, 0, 200) for _ in range(n)])
    add("fixed", pa.binary(5), [_bytes(rng, 5, 5) for _ in range(n)])
    for name, kind in _LISTS.items():
        lengths = rng.integers(0, 6, n)
        lengths[::9] = 0  # empty lists
        dtype = kind.to_pandas_dtype()
        if np.dtype(dtype).kind == "f":
            lists = [rng.standard_normal(k).astype(dtype).tolist() for k in lengths]
        else:
            info = np.iinfo(dtype)
            lists = [rng.integers(info.min, info.max, k, dtype=dtype).tolist() for k in lengths]
        add(name, pa.list_(kind), lists)
    image = pa.struct(
        [
            pa.field("bytes", pa.binary(), nullable=nulls),
            pa.field("path", pa.string(), nullable=nulls),
        ]
    )
    path_null = _null_rows("image.path", n, nulls)
    images = [
        {"bytes": _bytes(rng, 1, 300), "path": None if path_null[i] else f"img/{i:04d}.jpg"}
        for i in range(n)
    ]
    add("image", image, images)
    return pa.Table.from_arrays(list(columns.values()), schema=pa.schema(fields))


def _bytes(rng: np.random.Generator, low: int, high: int) -> bytes:
    return rng.integers(0, 256, int(rng.integers(low, high + 1)), dtype=np.uint8).tobytes()


# -- what rows read back as -----------------------------------------------------------------

#: Parquet stores these in 32 bits: they read back as the wider type.
PARQUET_WIDENED = {"int8": "int32", "int16": "int32", "uint8": "uint32", "uint16": "uint32"}


@dataclass
class Leaf:
    """A leaf column of a pyarrow table as stoker names it, and its values' numpy type
    (None: bytes)."""

    name: str
    kind: Any  # the leaf's pyarrow type
    dtype: np.dtype | None
    listed: bool

    def stored_dtype(self, fmt: str) -> np.dtype | None:
        """The type a value is read as from a file of format `fmt`."""
        if self.dtype is None or fmt != "parquet":
            return self.dtype
        return np.dtype(PARQUET_WIDENED.get(self.dtype.name, self.dtype.name))


def leaves(schema: Any) -> list[Leaf]:
    """The leaf columns of `schema`: struct children dotted, lower-cased."""
    out: list[Leaf] = []

    def walk(name: str, kind: Any) -> None:
        if pa.types.is_struct(kind):
            for k in range(kind.num_fields):
                walk(f"{name}.{kind.field(k).name}", kind.field(k).type)
            return
        if pa.types.is_list(kind) or pa.types.is_large_list(kind):
            out.append(Leaf(name.lower(), kind, np.dtype(kind.value_type.to_pandas_dtype()), True))
        elif pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
            out.append(Leaf(name.lower(), kind, np.dtype(kind.to_pandas_dtype()), False))
        else:
            out.append(Leaf(name.lower(), kind, None, False))

    for field in schema:
        walk(field.name, field.type)
    return out


def _column(table: Any, name: str) -> list:
    """A leaf's values, a null struct making its children null."""
    parts = name.split(".")
    values = table.column(next(f.name for f in table.schema if f.name.lower() == parts[0]))
    values = values.to_pylist()
    for part in parts[1:]:
        values = [None if v is None else v[part] for v in values]
    return values


def expected_rows(table: Any) -> list[dict[str, np.ndarray | None]]:
    """Each row of `table` as stoker's dataset gives it (field: value; None where null):
    numbers 0-d arrays of their type, bytes and text uint8 arrays of the bytes, lists 1-D
    arrays of their elements."""
    rows: list[dict[str, np.ndarray | None]] = [{} for _ in range(table.num_rows)]
    for leaf in leaves(table.schema):
        for row, value in zip(rows, _column(table, leaf.name)):
            row[leaf.name] = None if value is None else as_value(leaf, value)
    return rows


def as_value(leaf: Leaf, value: Any) -> np.ndarray:
    if leaf.dtype is None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        return np.frombuffer(data, np.uint8)
    if leaf.listed:
        return np.asarray(value, leaf.dtype).reshape(-1)
    return np.asarray(value, leaf.dtype)


def assert_value(got: Any, want: np.ndarray, leaf: Leaf, fmt: str, where: str) -> None:
    """`got` (a dataset's value) is `want`, byte for byte, of the type format `fmt`
    reads `leaf` as (Parquet's widened integers compared by value)."""
    assert isinstance(got, np.ndarray), (where, type(got))
    stored = leaf.stored_dtype(fmt)
    if stored is None:
        assert got.dtype == np.uint8 and got.ndim == 1, (where, got.dtype, got.shape)
        assert got.tobytes() == want.tobytes(), where
        return
    # (Parquet's 8- and 16-bit integers may read as stored, in 32 bits, or as written.)
    assert got.dtype in (stored, leaf.dtype), (where, got.dtype, stored)
    assert got.shape == want.shape, (where, got.shape, want.shape)
    assert got.tobytes() == want.astype(got.dtype).tobytes(), (where, got, want)


def assert_rows(
    samples: list[dict], wanted: list[dict], fmt: str, schema: Any, keys: list[str] | None = None
) -> None:
    """Every field of every sample is the row's value; `keys` are the samples' keys."""
    assert len(samples) == len(wanted)
    by_name = {leaf.name: leaf for leaf in leaves(schema)}
    for i, (got, want) in enumerate(zip(samples, wanted)):
        if keys is not None:
            assert got["__key__"] == keys[i]
        names = {k for k, v in want.items() if v is not None or fmt == "parquet"}
        for name in names:
            assert name in got, (i, name, sorted(got))
            assert_value(got[name], want[name], by_name[name], fmt, f"row {i} {name}")


# -- a Parquet file's parts -----------------------------------------------------------------

_I32, _I64, _BINARY, _LIST, _STRUCT = 5, 6, 8, 9, 12


class Compact:
    """Thrift's compact protocol, read: `struct()` gives {field id: (value, start, end)},
    the byte span of each field's value in `data`, nested structs as dicts of their own."""

    def __init__(self, data: bytes, at: int = 0) -> None:
        self.data, self.at = data, at

    def varint(self) -> int:
        shift = value = 0
        while True:
            b = self.data[self.at]
            self.at += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return value

    def zigzag(self) -> int:
        v = self.varint()
        return (v >> 1) ^ -(v & 1)

    def value(self, kind: int) -> Any:
        if kind in (1, 2):  # bools in a struct: in the type itself
            return kind == 1
        if kind == 3:
            self.at += 1
            return self.data[self.at - 1]
        if kind in (4, 5, 6):
            return self.zigzag()
        if kind == 7:
            self.at += 8
            return struct.unpack_from("<d", self.data, self.at - 8)[0]
        if kind == _BINARY:
            n = self.varint()
            self.at += n
            return self.data[self.at - n : self.at]
        if kind in (_LIST, 10):
            head = self.data[self.at]
            self.at += 1
            n, element = head >> 4, head & 0x0F
            if n == 15:
                n = self.varint()
            if element in (1, 2):
                self.at += n
                return [None] * n
            return [self.value(element) for _ in range(n)]
        if kind == 11:
            n = self.varint()
            if n:
                types = self.data[self.at]
                self.at += 1
                return [(self.value(types >> 4), self.value(types & 0x0F)) for _ in range(n)]
            return []
        if kind == _STRUCT:
            return self.struct()
        raise ValueError(f"compact type {kind} at {self.at}")

    def struct(self) -> dict[int, tuple[Any, int, int]]:
        out: dict[int, tuple[Any, int, int]] = {}
        last = 0
        while True:
            head = self.data[self.at]
            self.at += 1
            if head == 0:
                return out
            delta, kind = head >> 4, head & 0x0F
            fid = last + delta if delta else self.zigzag()
            start = self.at
            out[fid] = (self.value(kind), start, self.at)
            last = fid


def varint_bytes(value: int, zigzag: bool = True) -> bytes:
    v = (value << 1) ^ (value >> 63) if zigzag else value
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def footer(path: str | os.PathLike) -> tuple[int, bytes]:
    """Where a Parquet file's footer starts, and its bytes."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[-4:] == b"PAR1"
    (length,) = struct.unpack_from("<I", data, len(data) - 8)
    start = len(data) - 8 - length
    return start, data[start : start + length]


@dataclass
class Page:
    offset: int  # of its header, in the file
    header_size: int
    kind: int  # 0 data v1, 2 dictionary, 3 data v2
    uncompressed: int
    compressed: int
    header: dict  # as Compact.struct gives it

    @property
    def body(self) -> int:
        return self.offset + self.header_size


def pages(path: str | os.PathLike, group: int, column: int) -> list[Page]:
    """The pages of a column chunk, read from their headers."""
    meta = pq.ParquetFile(path).metadata.row_group(group).column(column)
    start = meta.data_page_offset
    if meta.has_dictionary_page and 0 < meta.dictionary_page_offset < start:
        start = meta.dictionary_page_offset
    end = start + meta.total_compressed_size
    with open(path, "rb") as f:
        data = f.read()
    out, at = [], start
    while at < end:
        reader = Compact(data, at)
        header = reader.struct()
        size = reader.at - at
        page = Page(at, size, header[1][0], header[2][0], header[3][0], header)
        out.append(page)
        at = page.body + page.compressed
    assert at == end, (at, end)
    return out


def chunk_bytes(path: str | os.PathLike, name: str) -> int:
    """A column's compressed bytes, over every row group (its chunks' total_compressed_size)."""
    meta = pq.ParquetFile(path).metadata
    j = next(k for k in range(meta.num_columns) if meta.schema.column(k).path == name)
    return sum(
        meta.row_group(g).column(j).total_compressed_size for g in range(meta.num_row_groups)
    )


def rewrite_footer(path: str | os.PathLike, edit) -> None:
    """Rewrite a Parquet file's footer: `edit(footer bytes, parsed footer)` returns the new
    footer, whose length the file's tail then says."""
    start, old = footer(path)
    new = edit(old, Compact(old).struct())
    with open(path, "rb") as f:
        head = f.read(start)
    with open(path, "wb") as f:
        f.write(head + new + struct.pack("<I", len(new)) + b"PAR1")
