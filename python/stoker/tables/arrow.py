"""Arrow IPC files as table sources, as Hugging Face ``datasets`` keeps them (its cache, and
``save_to_disk`` folders): their buffers are uncompressed, so every value is a byte range of
the file, read in place like a tar member.

pyarrow is used at open only, to walk the IPC metadata (flatbuffers) and find where each
buffer lies; reads then need no pyarrow. Anyone with such a file has pyarrow: ``datasets``
needs it."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from stoker.errors import ShardFormatError, StokerError, located
from stoker.tables.table_fields import TableField

_FILE_MAGIC = b"ARROW1"


def _pyarrow(path: str) -> Any:
    try:
        import pyarrow as pa
        import pyarrow.ipc  # noqa: F401
    except ImportError as e:
        raise StokerError(
            f"{path}: reading Arrow IPC files needs pyarrow at open (pip install "
            "'stoker[arrow]'); Parquet files need nothing more"
        ) from e
    return pa


def arrow_fields(path: str) -> tuple[int, list[TableField], np.ndarray]:
    """The file's rows, a field per leaf column (values as byte ranges of the file), and
    each record batch's rows."""
    pa = _pyarrow(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(len(_FILE_MAGIC))
        mapped = pa.memory_map(path)
        whole = mapped.read_buffer()
        source = pa.BufferReader(whole)
        if magic == _FILE_MAGIC:
            reader = pa.ipc.open_file(source)
            batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        else:
            batches = list(pa.ipc.open_stream(source))
            schema = batches[0].schema if batches else None
    except (OSError, pa.ArrowInvalid) as e:
        raise located(ShardFormatError, path, 0, f"is not an Arrow IPC file or stream: {e}") from e
    if magic == _FILE_MAGIC:
        schema = reader.schema
    base, size = whole.address, whole.size
    groups = np.array([b.num_rows for b in batches], np.int64)
    rows = int(groups.sum())
    fields: list[TableField] = []
    if schema is None:
        return 0, fields, groups
    for j, column in enumerate(schema):
        parts = [b.column(j) for b in batches]
        fields += _leaf_fields(
            pa, path, column.name, column.type, parts, [None] * len(parts), base, size
        )
    return rows, fields, groups


def _leaf_fields(
    pa: Any,
    path: str,
    name: str,
    kind: Any,
    parts: list[Any],
    above: list[np.ndarray | None],
    base: int,
    size: int,
) -> list[TableField]:
    """The fields of one column (a struct's leaves, dotted), from its arrays, one per
    record batch; `above`: each array's rows that a struct above it makes null."""
    types = pa.types
    if types.is_struct(kind):
        # A child's buffers are the file's; the struct's own nulls are its children's too.
        nulls = [_joined(a, _null_rows(p)) for a, p in zip(above, parts)]
        out = []
        for k in range(kind.num_fields):
            child = kind.field(k)
            children = [p.field(k) for p in parts]
            out += _leaf_fields(
                pa, path, f"{name}.{child.name}", child.type, children, nulls, base, size
            )
        return out
    where = _Buffers(path, name, base, size, above)
    try:
        if types.is_boolean(kind):
            raise _Unusable(
                "holds booleans, which Arrow packs as bits and stoker cannot read in place: "
                "cast it to uint8"
            )
        if types.is_binary(kind) or types.is_string(kind):
            return [_variable(name, None, False, parts, where, np.int32)]
        if types.is_large_binary(kind) or types.is_large_string(kind):
            return [_variable(name, None, False, parts, where, np.int64)]
        if types.is_fixed_size_binary(kind):
            return [_fixed(name, None, kind.byte_width, parts, where)]
        if types.is_list(kind) or types.is_large_list(kind):
            value = kind.value_type
            dtype = _numeric(pa, value)
            if dtype is None:
                raise _Unusable(
                    f"is a list of {value}, and stoker reads lists of numbers only: flatten it"
                )
            return [_variable(name, dtype, True, parts, where, _offset_type(kind))]
        dtype = _numeric(pa, kind)
        if dtype is None:
            raise _Unusable(f"holds {kind}, which stoker does not read")
        return [_fixed(name, dtype, dtype.itemsize, parts, where)]
    except _Unusable as e:
        return [TableField(name=name, dtype=None, unusable=str(e))]


class _Unusable(Exception):
    pass


def _null_rows(array: Any) -> np.ndarray | None:
    """Which rows of `array` are null (None: none), from its validity bitmap. (Asking
    pyarrow, ``array.is_valid()`` made into numpy, imported pyarrow.compute and pandas:
    0.2 s of a first batch's wait for a Hub image column, whose paths are all null.)"""
    if not array.null_count:
        return None
    bitmap = array.buffers()[0]
    if bitmap is None:  # an array of the null type: no bitmap, every row null
        return np.ones(len(array), bool)
    bits = np.unpackbits(np.frombuffer(bitmap, np.uint8), bitorder="little")
    return bits[array.offset : array.offset + len(array)] == 0


def _joined(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
    if a is None or b is None:
        return a if b is None else b
    return a | b


def _offset_type(kind: Any) -> type:
    import pyarrow as pa

    return np.int64 if pa.types.is_large_list(kind) else np.int32


def _numeric(pa: Any, kind: Any) -> np.dtype | None:
    types = pa.types
    if types.is_integer(kind) or types.is_floating(kind):
        return np.dtype(kind.to_pandas_dtype()).newbyteorder("<")
    if types.is_timestamp(kind) or types.is_date64(kind) or types.is_duration(kind):
        return np.dtype("<i8")
    if types.is_date32(kind) or types.is_time32(kind):
        return np.dtype("<i4")
    if types.is_time64(kind):
        return np.dtype("<i8")
    return None


class _Buffers:
    """Where an array's buffers lie in the file, each checked to be inside it (a buffer
    that is not was decompressed into memory: the file is compressed)."""

    def __init__(
        self, path: str, name: str, base: int, size: int, above: list[np.ndarray | None]
    ) -> None:
        self.path, self.name, self.base, self.size = path, name, base, size
        self.above = above

    def offset(self, buffer: Any) -> int:
        if buffer is None or buffer.size == 0:  # (a column of nulls, or of empty values)
            return 0
        at = buffer.address - self.base
        if at < 0 or at + buffer.size > self.size:
            raise _Unusable(
                "is stored compressed (an Arrow IPC file written with compression=), which "
                "cannot be read in place: write it again uncompressed, or as Parquet"
            )
        return at

    def nulls(self, i: int, array: Any) -> np.ndarray | None:
        """The null rows of part `i`, `array`: its own and those of the structs above it."""
        return _joined(self.above[i], _null_rows(array))


def _fixed(
    name: str, dtype: np.dtype | None, width: int, parts: list[Any], where: _Buffers
) -> TableField:
    offsets: list[np.ndarray] = []
    nulls: list[np.ndarray | None] = []
    for i, array in enumerate(parts):
        if len(array) == 0:
            continue
        data = where.offset(array.buffers()[1])
        offsets.append(data + (array.offset + np.arange(len(array), dtype=np.uint64)) * width)
        nulls.append(where.nulls(i, array))
    return _in_place(name, dtype, False, width, offsets, None, nulls)


def _variable(
    name: str, dtype: np.dtype | None, listed: bool, parts: list[Any], where: _Buffers, kind: type
) -> TableField:
    offsets: list[np.ndarray] = []
    lengths: list[np.ndarray] = []
    nulls: list[np.ndarray | None] = []
    item = dtype.itemsize if dtype is not None else 1
    for i, array in enumerate(parts):
        if len(array) == 0:
            continue
        buffers = array.buffers()
        stored: np.ndarray = np.frombuffer(buffers[1], dtype=kind)
        ends = stored[array.offset : array.offset + len(array) + 1].astype(np.uint64)
        if listed:
            values = array.values
            if values.null_count:
                raise _Unusable("is a list with null elements, which stoker does not read")
            data = where.offset(values.buffers()[1]) + values.offset * item
        else:
            data = where.offset(buffers[2])
        offsets.append(np.uint64(data) + ends[:-1] * np.uint64(item))
        lengths.append(np.diff(ends) * np.uint64(item))
        nulls.append(where.nulls(i, array))
    return _in_place(name, dtype, listed, 0, offsets, lengths, nulls)


def _in_place(
    name: str,
    dtype: np.dtype | None,
    listed: bool,
    width: int,
    offsets: list[np.ndarray],
    lengths: list[np.ndarray] | None,
    nulls: list[np.ndarray | None],
) -> TableField:
    joined = np.concatenate(offsets) if offsets else np.zeros(0, np.uint64)
    if lengths is None:
        sizes = np.full(len(joined), width, np.uint64)
    else:
        sizes = np.concatenate(lengths) if lengths else np.zeros(0, np.uint64)
    null = None
    if any(n is not None for n in nulls):
        parts = [n if n is not None else np.zeros(len(o), bool) for n, o in zip(nulls, offsets)]
        null = np.concatenate(parts)
    return TableField(
        name=name,
        dtype=dtype,
        listed=listed,
        width=width,
        offsets=joined,
        lengths=sizes,
        nulls=null,
        storage="uncompressed, in place",
        stored_bytes=int(sizes.sum()),
    )


def is_saved_dataset(folder: str) -> bool:
    """Whether `folder` is a ``datasets`` ``save_to_disk`` folder of one split."""
    return os.path.isfile(os.path.join(folder, "state.json")) and os.path.isfile(
        os.path.join(folder, "dataset_info.json")
    )


def saved_dataset_files(folder: str) -> list[str]:
    """The Arrow files of a ``save_to_disk`` folder, in the dataset's order (its
    ``state.json``'s)."""
    import json

    state_path = os.path.join(folder, "state.json")
    try:
        with open(state_path, encoding="utf-8") as f:
            state = json.load(f)
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise located(ShardFormatError, state_path, 0, f"is not a datasets state.json ({e})") from e
    if state.get("_indexes") or state.get("_indices_data_files"):
        raise StokerError(
            f"{folder}: this saved dataset has an indices mapping (it was shuffled, selected "
            "or filtered without flatten_indices()): save it again after "
            "dataset.flatten_indices()"
        )
    return [os.path.join(folder, name) for name in names]
