"""Parquet files as table sources: the footer read once at open (by stoker's own Thrift
reader in C++, so no pyarrow is needed), each leaf column a field whose values the C++
reader decodes per batch from the column chunks the batch's rows lie in.

A leaf is named by its dotted path (``image.bytes``); a list of numbers is named by its
list's name (``input_ids``, not ``input_ids.list.element``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import stoker._core as _core
from stoker.errors import ShardFormatError, located
from stoker.tables.table_fields import TableField

#: Bytes of a file's end read first: most footers fit, and a larger one costs one read more.
_TAIL = 64 * 1024
#: Pages decoded together, where a page index says where they are: a batch's rows then cost
#: the pages they lie in (and the dictionary), not their whole row group.
UNIT_BYTES = 1024 * 1024

# parquet.thrift's numbers.
_BOOLEAN, _INT32, _INT64, _INT96, _FLOAT, _DOUBLE, _BYTE_ARRAY, _FIXED = range(8)
_REQUIRED, _OPTIONAL, _REPEATED = range(3)
_CODECS = {0: "uncompressed", 1: "snappy", 2: "gzip", 3: "lzo", 4: "brotli", 5: "lz4 (hadoop)"}
_CODECS.update({6: "zstd", 7: "lz4_raw"})
_SUPPORTED_CODECS = (0, 1, 2, 6, 7)
_ENCODINGS = {0: "plain", 2: "dictionary", 3: "rle", 4: "bit-packed", 5: "DELTA_BINARY_PACKED"}
_ENCODINGS.update({6: "DELTA_LENGTH_BYTE_ARRAY", 7: "DELTA_BYTE_ARRAY", 8: "dictionary"})
_ENCODINGS[9] = "byte-stream-split"
#: DELTA_BINARY_PACKED, DELTA_LENGTH_BYTE_ARRAY, DELTA_BYTE_ARRAY.
_UNREAD_ENCODINGS = {5, 6, 7}


@dataclass
class _Leaf:
    path: list[str]
    element: dict  # its schema element
    max_definition: int
    max_repetition: int
    repeated_groups: int  # repeated groups above it
    list_element: bool  # the one child of a repeated group (a 3-level list's element)
    in_map: bool
    repeated_definition: int  # the definition level of its repeated field (-1: none)


def read_footer(
    path: str, read: Callable[[int, int], bytes] | None = None, size: int = -1, tail: int = _TAIL
) -> dict:
    """The file's FileMetaData, as _core.parquet_metadata gives it, with ``file_size`` and
    ``footer_offset``. `read(offset, length)` reads a remote file of `size` bytes: its last
    `tail` bytes (at least 8), then the rest of the footer if they did not hold it all (so
    two range requests, most often one); else `path` is opened."""
    if read is None:
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size

                def read_local(offset: int, length: int) -> bytes:
                    f.seek(offset)
                    return f.read(length)

                return read_footer(path, read_local, size)
        except OSError as e:
            raise located(ShardFormatError, path, 0, f"cannot read its footer: {e}") from e
    tail_size = min(size, max(tail, 8))
    end = read(size - tail_size, tail_size)
    offset, length = _core.parquet_footer(end, size, path)
    if offset < size - tail_size:
        data = read(offset, length)
    else:
        at = offset - (size - tail_size)
        data = end[at : at + length]
    meta = _core.parquet_metadata(data, path, offset)
    meta["file_size"] = size
    meta["footer_offset"] = offset
    return meta


def parquet_fields(
    path: str, meta: dict, read: Callable[[int, int], bytes] | None = None
) -> tuple[int, list[TableField], np.ndarray]:
    """The file's rows, a field per leaf column, and each row group's rows. With `read`
    (offset, length), the page index is read where the writer wrote one, so that columns
    are read by runs of pages instead of whole column chunks."""
    if meta.get("encrypted"):
        raise located(
            ShardFormatError,
            path,
            0,
            "is an encrypted Parquet file, which stoker does not read: decrypt it with "
            "pyarrow (pyarrow.parquet.read_table with decryption_properties) and write it again",
        )
    rows = int(meta["num_rows"])
    groups = np.array([int(g["num_rows"]) for g in meta["row_groups"]], np.int64)
    if int(groups.sum()) != rows:
        raise located(
            ShardFormatError,
            path,
            int(meta["footer_offset"]),
            f"its row groups hold {int(groups.sum())} rows but its footer says {rows}",
        )
    leaves = _leaves(meta["schema"])
    page_index = _page_index(path, meta, read) if read is not None else None
    fields = [_field(path, meta, j, leaf, groups, page_index) for j, leaf in enumerate(leaves)]
    return rows, fields, groups


def column_byte_ranges(path: str, meta: dict, names: frozenset[str]) -> list[tuple[int, int]]:
    """The (start, end) byte ranges a reader of fields `names` needs of the file `meta`
    describes, in file order: the column chunks of those leaves, the offset index, and
    the footer. The leading magic is not among them (a copy of the file in part is told from a
    whole one by it)."""
    _, fields, _ = parquet_fields(path, meta)
    ranges = [
        (int(u[2]), int(u[2] + u[3]))
        for f in fields
        if f.name in names and f.units is not None
        for u in f.units
    ]
    offset_indexes = [  # (the column index, of statistics, is never read)
        (int(c["offset_index_offset"]), int(c["offset_index_length"]))
        for group in meta["row_groups"]
        for c in group["columns"]
        if int(c.get("offset_index_offset", -1)) > 0 and int(c.get("offset_index_length", 0)) > 0
    ]
    footer = int(meta["footer_offset"])
    ranges += [(o, o + n) for o, n in offset_indexes if o + n <= footer]
    ranges.append((footer, int(meta["file_size"])))
    return sorted(ranges)


def _page_index(path: str, meta: dict, read: Callable[[int, int], bytes]) -> dict:
    """Each column chunk's page locations, by (row group, column), from the offset index
    (which writers put together before the footer: read in one piece)."""
    spans = [
        (g, j, int(c["offset_index_offset"]), int(c["offset_index_length"]))
        for g, group in enumerate(meta["row_groups"])
        for j, c in enumerate(group["columns"])
        if int(c.get("offset_index_offset", -1)) > 0 and int(c.get("offset_index_length", 0)) > 0
    ]
    if not spans:
        return {}
    lo = min(s[2] for s in spans)
    hi = max(s[2] + s[3] for s in spans)
    if hi > int(meta["footer_offset"]) or hi - lo > 64 * 1024 * 1024:
        return {}  # not where an index is written, or too large to be one: read chunks whole
    data = read(lo, hi - lo)
    return {
        (g, j): _core.parquet_offset_index(data[o - lo : o - lo + n], path, o)
        for g, j, o, n in spans
    }


def _leaves(schema: list[dict]) -> list[_Leaf]:
    """Every leaf of the schema (depth first, as column chunks are ordered)."""
    leaves: list[_Leaf] = []
    position = 1

    def walk(
        count: int,
        path: list[str],
        definition: int,
        repetition: int,
        groups: int,
        single: bool,
        in_map: bool,
        repeated_at: int,
    ) -> None:
        nonlocal position
        for _ in range(count):
            element = schema[position]
            position += 1
            rep = int(element.get("repetition", _REQUIRED))
            d = definition + (rep != _REQUIRED)
            r = repetition + (rep == _REPEATED)
            name_path = [*path, str(element["name"])]
            children = int(element.get("num_children", 0))
            is_map = element.get("logical_type") == "MAP" or _converted(element) == "MAP"
            at = d if rep == _REPEATED else repeated_at
            if children:
                repeated = rep == _REPEATED
                walk(
                    children,
                    name_path,
                    d,
                    r,
                    groups + repeated,
                    repeated and children == 1,
                    in_map or is_map,
                    at,
                )
            else:
                leaves.append(_Leaf(name_path, element, d, r, groups, single, in_map, at))

    walk(int(schema[0].get("num_children", 0)), [], 0, 0, 0, False, False, -1)
    return leaves


def _converted(element: dict) -> str:
    return {1: "MAP", 2: "MAP", 3: "LIST"}.get(int(element.get("converted_type", -1)), "")


def _name(leaf: _Leaf) -> tuple[str, bool]:
    """The field's name, and whether it is a list of primitives (else, with repetition, a
    shape stoker refuses)."""
    parts = leaf.path
    if leaf.max_repetition == 1 and leaf.repeated_groups == 1 and leaf.list_element:
        # A 3-level list: LIST group > repeated group > element, named by the LIST group
        # (a bare repeated group of one leaf: by the group).
        return ".".join(parts[:-2] if len(parts) > 2 else parts[:-1]), True
    if leaf.max_repetition == 1 and leaf.repeated_groups == 0:  # a 2-level list: repeated leaf
        return ".".join(parts), True
    return ".".join(parts), False


def _field(
    path: str, meta: dict, j: int, leaf: _Leaf, groups: np.ndarray, page_index: dict | None
) -> TableField:
    element = leaf.element
    ptype = int(element["type"])
    type_length = int(element.get("type_length", 0))
    logical = str(element.get("logical_type") or "")
    name, listed = _name(leaf)
    dtype, width, integer = _value_type(element, ptype, type_length, logical)
    unusable = ""
    if ptype == _INT96:
        unusable = (
            "holds INT96 timestamps, a legacy type stoker does not read: write the file again "
            "with pyarrow's coerce_timestamps='us' (or cast the column to timestamp)"
        )
    elif leaf.in_map:
        unusable = "is part of a map, which stoker does not read: flatten it into columns"
    elif leaf.max_repetition and not listed:
        unusable = (
            "is inside a list of lists or a list of structs, which stoker does not read (only "
            "lists of numbers are): flatten it into columns of its own"
        )
    elif listed and dtype is None:
        unusable = (
            "is a list of byte strings or text, which stoker does not read (lists of numbers "
            "are): join each list into one value, or read it with map="
        )
    units: list[tuple[int, ...]] = []
    first = 0
    codecs: set[int] = set()
    encodings: set[int] = set()
    stored = 0
    for g, group in enumerate(meta["row_groups"]):
        chunk = group["columns"][j]
        if chunk.get("file_path"):
            raise located(
                ShardFormatError,
                path,
                0,
                f"row group {g}, column {name!r} lies in another file "
                f"({chunk['file_path']!r}), which stoker does not follow: write the table as "
                "one file",
            )
        if chunk.get("encrypted"):
            raise located(
                ShardFormatError,
                path,
                0,
                f"column {name!r} is encrypted, which stoker does not read",
            )
        rows = int(group["num_rows"])
        if not rows:  # a row group of no rows holds no pages (writers point it nowhere)
            continue
        start, size = _chunk_span(path, meta, g, name, chunk)
        pages = page_index.get((g, j)) if page_index else None
        units += [(*u, g) for u in _units(first, rows, start, size, pages)]
        first += rows
        codecs.add(int(chunk["codec"]))
        encodings.update(int(e) for e in chunk.get("encodings", ()))
        stored += size
    bad = sorted(codecs - set(_SUPPORTED_CODECS))
    if bad and not unusable:
        unusable = (
            f"is compressed with {_CODECS.get(bad[0], f'codec {bad[0]}')}, which stoker does "
            "not read: write it again with snappy, zstd, gzip or lz4 (pyarrow's 'lz4' "
            "writes LZ4_RAW)"
        )
    delta = sorted(encodings & _UNREAD_ENCODINGS)
    if delta and not unusable:
        unusable = (
            f"is written in the {_ENCODINGS[delta[0]]} encoding, which stoker does not read: "
            "write it again with pyarrow's defaults (dictionary, else plain) or "
            "column_encoding='PLAIN'"
        )
    if len(codecs) > 1 and not unusable:
        unusable = (
            "is compressed with different codecs in different row groups, which stoker does "
            "not read: write it again with one compression"
        )
    codec = min(codecs) if codecs else 0
    storage = [_CODECS.get(c, str(c)) for c in sorted(codecs)]
    storage += sorted({_ENCODINGS[e] for e in encodings if e in _ENCODINGS} - {"rle"})
    return TableField(
        name=name,
        dtype=dtype,
        listed=listed,
        width=0 if listed else width,
        integer=0 if listed else integer,
        units=np.array(units, np.uint64).reshape(-1, 7),
        spec=(
            ptype,
            type_length,
            leaf.max_definition,
            leaf.max_repetition,
            leaf.repeated_definition,
            codec,
        ),
        storage=", ".join(storage),
        stored_bytes=stored,
        unusable=unusable,
    )


def _units(
    first: int, rows: int, start: int, size: int, pages: dict | None
) -> list[tuple[int, int, int, int, int, int]]:
    """The units a column chunk is read and decoded in: the whole chunk, or, where the file
    has a page index, runs of its pages of about UNIT_BYTES (a batch then decodes the
    pages its rows are in, not a whole row group's), each read after the chunk's
    dictionary page."""
    if pages is None or len(pages["offset"]) < 2:
        return [(first, rows, start, size, 0, 0)]
    offsets, sizes = pages["offset"].tolist(), pages["compressed_page_size"].tolist()
    firsts = pages["first_row_index"].tolist() + [rows]
    dictionary = start if offsets[0] > start else 0
    dictionary_size = offsets[0] - start if dictionary else 0
    if offsets[0] < start or offsets[-1] + sizes[-1] > start + size:
        return [(first, rows, start, size, 0, 0)]  # an index that does not fit: not used
    out = []
    a = 0
    for b in range(len(offsets)):
        end = offsets[b] + sizes[b]
        if b + 1 < len(offsets) and end - offsets[a] < UNIT_BYTES:
            continue
        out.append(
            (
                first + firsts[a],
                firsts[b + 1] - firsts[a],
                offsets[a],
                end - offsets[a],
                dictionary,
                dictionary_size,
            )
        )
        a = b + 1
    return out


def _chunk_span(path: str, meta: dict, group: int, name: str, chunk: dict) -> tuple[int, int]:
    """Where a column chunk's pages (its dictionary page first) lie in the file."""
    data = int(chunk["data_page_offset"])
    dictionary = int(chunk.get("dictionary_page_offset", -1))
    # (Some writers put 0 where no dictionary page is, or point past the first data page.)
    start = dictionary if 0 < dictionary < data else data
    size = int(chunk["total_compressed_size"])
    end = int(meta["footer_offset"])  # where the footer's metadata starts
    if start < 4 or size <= 0 or start + size > end:
        raise located(
            ShardFormatError,
            path,
            max(start, 0),
            f"row group {group}, column {name!r}: its column chunk of {size} bytes at offset "
            f"{start} does not lie between the file's header and its footer (at {end}): "
            "the file is truncated or its footer is damaged",
        )
    return start, size


def _value_type(
    element: dict, ptype: int, type_length: int, logical: str
) -> tuple[np.dtype | None, int, int]:
    """A value's numpy type (None: bytes), its bytes (0: they vary), and whether it is a
    signed (1) or unsigned (2) integer."""
    unsigned = logical == "INTEGER" and not element.get("int_signed", True)
    unsigned |= int(element.get("converted_type", -1)) in (11, 12, 13, 14)  # UINT_8..UINT_64
    if ptype == _BOOLEAN:
        return np.dtype(bool), 1, 2
    if ptype == _INT32:
        return np.dtype("<u4" if unsigned else "<i4"), 4, 2 if unsigned else 1
    if ptype == _INT64:
        return np.dtype("<u8" if unsigned else "<i8"), 8, 2 if unsigned else 1
    if ptype == _FLOAT:
        return np.dtype("<f4"), 4, 0
    if ptype == _DOUBLE:
        return np.dtype("<f8"), 8, 0
    if ptype == _FIXED:
        if logical == "FLOAT16" and type_length == 2:
            return np.dtype("<f2"), 2, 0
        return None, type_length, 0
    if ptype == _INT96:
        return None, 12, 0
    return None, 0, 0  # BYTE_ARRAY


def describe(path: str) -> dict:
    """What `stoker inspect` says of a Parquet file: its rows, row groups and columns."""
    meta = read_footer(path)
    rows, fields, groups = parquet_fields(path, meta)
    return {
        "format": "parquet",
        "rows": rows,
        "row_groups": len(groups),
        "created_by": meta.get("created_by", ""),
        "fields": fields,
        "bytes": int(meta["file_size"]),
    }
