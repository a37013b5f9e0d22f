"""Zarr stores (v2 and v3, local) as array sources: each array's layout, from its JSON.

No zarr-python is needed: the metadata says the shape, the chunk grid, the data type,
the fill value and the codecs; each chunk is a file named by its grid coordinates (a
chunk that is not there reads as the fill value), or, for v3's ``sharding_indexed``
codec, an inner chunk of a shard file found through the shard's index. The C++ reader
then reads and decodes the chunks a batch needs.
"""

from __future__ import annotations

import itertools
import math
import os
import struct
from collections.abc import Callable, Sequence
from typing import Any, TypedDict

import numpy as np

import stoker._core as _core
from stoker._files import load_json
from stoker.arrays.array_fields import ArrayField, field_names_of, has_tensor_type, pick_arrays
from stoker.arrays.registry import ArrayFormat, Identity, register
from stoker.errors import ShardFormatError, located

_MISSING = np.uint64(2**64 - 1)
_F = _core.ChunkFilter
_COMPRESSORS = {"zlib": _F.ZLIB, "gzip": _F.GZIP, "zstd": _F.ZSTD, "blosc": _F.BLOSC}
_LEAVE_OUT = "read it through map= with zarr, or leave it out with arrays="
_ALTERNATIVE = "rewrite it with zstd, gzip, blosc or no compression, or read it through map="
_V3_TYPES = {
    "bool": "|b1",
    **{f"int{b}": f"<i{b // 8}" for b in (8, 16, 32, 64)},
    **{f"uint{b}": f"<u{b // 8}" for b in (8, 16, 32, 64)},
    "float16": "<f2",
    "float32": "<f4",
    "float64": "<f8",
    "complex64": "<c8",
    "complex128": "<c16",
}


class _Shard(TypedDict):
    """v3 sharding_indexed: the shard's shape and where its index is."""

    shape: tuple[int, ...]
    crc: bool  # the index ends with a crc32c
    start: bool  # the index is at the start of the shard (else at its end)


class _Array:
    """One array's metadata, as read from its JSON."""

    # Set by _v2 or _v3 as they read the JSON (declared here, not in __init__, so that
    # reading one before it is set still fails loudly).
    meta_path: str
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    fill: bytes  # one element, native byte order
    key: Callable[[tuple[int, ...]], str]  # a chunk's grid coordinates -> its file's key

    def __init__(self, store: str, name: str, folder: str) -> None:
        self.store, self.name, self.folder = store, name, folder
        self.where = f"{store}:/{name}" if name else store
        self.order: list[int] = []
        self.byteswap = False
        self.steps: list[tuple[_core.ChunkFilter, int]] = []
        self.shard: _Shard | None = None  # v3 sharding_indexed: inner shape, index layout
        self.dtype: np.dtype | None = None  # None: no tensor type (`unsupported` says why)
        self.unsupported = ""

    def known_dtype(self) -> np.dtype:
        """The dtype, where the caller has already turned away arrays without one."""
        if self.dtype is None:
            raise AssertionError(f"array {self.label}: no dtype ({self.unsupported})")
        return self.dtype

    def fail(self, what: str) -> ShardFormatError:
        return located(ShardFormatError, self.meta_path, 0, f"array {self.label}: {what}")

    @property
    def label(self) -> str:
        return repr(self.name or os.path.basename(self.store))


def zarr_arrays(path: str, arrays: Sequence[str] | None) -> tuple[int, list[ArrayField]]:
    """The rows of the store at `path` and its fields: every array of rank 1 or more whose
    first axis has that length (or each of `arrays`)."""
    found = {a.name: a for a in _walk(path)}
    shapes = {name: a.shape for name, a in found.items()}
    usable = {name: a.dtype is not None for name, a in found.items()}
    rows, names = pick_arrays(path, shapes, usable, arrays)
    for name in names:
        if found[name].dtype is None:
            raise found[name].fail(found[name].unsupported)
    labels = [n or os.path.splitext(os.path.basename(path.rstrip("/")))[0] for n in names]
    return rows, [
        _field(found[name], field) for name, field in zip(names, field_names_of(path, labels))
    ]


def _walk(store: str) -> list[_Array]:
    """Every array of rank 1 or more in the store, groups walked in name order."""
    out = []
    for folder, dirs, files in os.walk(store):
        dirs.sort()
        name = os.path.relpath(folder, store).replace(os.sep, "/")
        name = "" if name == "." else name
        if "zarr.json" in files:
            meta = _json(os.path.join(folder, "zarr.json"))
            if meta.get("node_type") == "array":
                dirs[:] = []
                array = _v3(store, name, folder, meta)
            else:
                continue
        elif ".zarray" in files:
            dirs[:] = []
            array = _v2(store, name, folder, _json(os.path.join(folder, ".zarray")))
        else:
            continue
        if array.shape:
            out.append(array)
    return out


def _json(path: str) -> dict:
    meta = load_json(path, "Zarr metadata")
    if not isinstance(meta, dict):
        raise located(ShardFormatError, path, 0, "Zarr metadata must be a JSON object")
    return meta


def _v2(store: str, name: str, folder: str, meta: dict) -> _Array:
    a = _Array(store, name, folder)
    a.meta_path = os.path.join(folder, ".zarray")
    a.shape, a.chunks = _shapes(a, meta.get("shape"), meta.get("chunks"))
    try:
        stored = np.dtype(meta["dtype"]) if isinstance(meta.get("dtype"), str) else None
    except TypeError:
        stored = None
    if stored is None or not has_tensor_type(stored):
        a.unsupported = f"the dtype {meta.get('dtype')!r} has no tensor type: {_LEAVE_OUT}"
        return a
    a.dtype = stored.newbyteorder("=")
    a.byteswap = stored.byteorder == ">" and stored.itemsize > 1
    a.fill = _fill(a, meta.get("fill_value"))
    if meta.get("order", "C") == "F":
        a.order = list(range(len(a.shape)))[::-1]
    if meta.get("filters"):
        ids = [f.get("id") for f in meta["filters"] if isinstance(f, dict)]
        raise a.fail(f"filters {ids} are not decoded by stoker: {_ALTERNATIVE}")
    compressor = meta.get("compressor")
    if compressor is not None:
        a.steps = [(_compressor(a, compressor.get("id")), 0)]
    separator = meta.get("dimension_separator") or "."
    a.key = lambda at: separator.join(map(str, at)) if at else "0"
    return a


def _v3(store: str, name: str, folder: str, meta: dict) -> _Array:
    a = _Array(store, name, folder)
    a.meta_path = os.path.join(folder, "zarr.json")
    grid = meta.get("chunk_grid") or {}
    if grid.get("name") != "regular":
        raise a.fail(f"chunk grid {grid.get('name')!r}: stoker reads regular grids")
    chunks = (grid.get("configuration") or {}).get("chunk_shape")
    a.shape, a.chunks = _shapes(a, meta.get("shape"), chunks)
    descr = _V3_TYPES.get(meta.get("data_type"))  # type: ignore[arg-type]
    if descr is None:
        a.unsupported = f"the data type {meta.get('data_type')!r} has no tensor type: {_LEAVE_OUT}"
        return a
    a.dtype = np.dtype(descr)
    a.fill = _fill(a, meta.get("fill_value"))
    if meta.get("storage_transformers"):
        raise a.fail("storage transformers are not read by stoker")
    a.steps, a.order, a.byteswap, sharding = _codecs(a, meta.get("codecs") or [], outer=True)
    if sharding is not None:
        inner = sharding.get("chunk_shape") or []
        _, inner = _shapes(a, a.chunks, inner)
        if any(c % i for c, i in zip(a.chunks, inner)):
            raise a.fail(f"inner chunks {inner} do not divide shards of {a.chunks}")
        index_steps, _, _, nested = _codecs(a, sharding.get("index_codecs") or [], outer=False)
        if nested is not None or any(f != _F.CRC32C for f, _ in index_steps):
            raise a.fail("a shard index must be stored as bytes, optionally with crc32c")
        steps, order, swap, nested = _codecs(a, sharding.get("codecs") or [], outer=False)
        if nested is not None or a.order or a.steps:
            raise a.fail(
                "sharding nested in sharding, or codecs around sharding_indexed, are not read "
                f"by stoker: {_ALTERNATIVE}"
            )
        location = sharding.get("index_location", "end")
        if location not in ("start", "end"):
            raise a.fail(f"index_location {location!r}")
        a.shard = {"shape": a.chunks, "crc": bool(index_steps), "start": location == "start"}
        a.chunks, a.steps, a.order, a.byteswap = inner, steps, order, swap
    encoding = meta.get("chunk_key_encoding") or {"name": "default"}
    separator = (encoding.get("configuration") or {}).get("separator")
    if encoding.get("name") == "default":
        sep = separator or "/"
        a.key = lambda at: "c" + "".join(sep + str(i) for i in at)
    elif encoding.get("name") == "v2":
        sep = separator or "."
        a.key = lambda at: sep.join(map(str, at)) if at else "0"
    else:
        raise a.fail(f"chunk key encoding {encoding.get('name')!r} is not one stoker reads")
    return a


def _codecs(a: _Array, codecs: list, outer: bool) -> tuple[list, list[int], bool, dict | None]:
    """(bytes steps in the order applied, transpose order, big-endian, sharding config)."""
    steps: list[tuple[_core.ChunkFilter, int]] = []
    order: list[int] = []
    byteswap = False
    sharding = None
    seen_bytes = False
    for codec in codecs:
        if isinstance(codec, str):
            codec = {"name": codec}
        name = codec.get("name")
        config = codec.get("configuration") or {}
        if name == "transpose" and not seen_bytes:
            given = [int(i) for i in config.get("order", [])]
            if sorted(given) != list(range(len(a.shape))):
                raise a.fail(f"transpose order {given} is not a permutation of the axes")
            order = given if not order else [order[i] for i in given]
        elif name == "bytes" and not seen_bytes:
            seen_bytes = True
            byteswap = config.get("endian", "little") == "big" and a.known_dtype().itemsize > 1
        elif name == "sharding_indexed" and outer and not seen_bytes:
            seen_bytes = True
            sharding = config
        elif name in _COMPRESSORS and seen_bytes:
            if any(step in _COMPRESSORS.values() for step, _ in steps):
                raise a.fail(f"two compressors one after the other: {_ALTERNATIVE}")
            steps.append((_COMPRESSORS[name], 0))
        elif name == "crc32c" and seen_bytes:
            steps.append((_F.CRC32C, 0))
        else:
            raise a.fail(f"the codec {name!r} is not decoded by stoker here: {_ALTERNATIVE}")
    if not seen_bytes:
        raise a.fail("no bytes codec in its codec list")
    if order == list(range(len(a.shape))):
        order = []
    return steps, order, byteswap, sharding


def _compressor(a: _Array, name: object) -> _core.ChunkFilter:
    if name not in _COMPRESSORS:
        raise a.fail(f"the compressor {name!r} is not decoded by stoker: {_ALTERNATIVE}")
    return _COMPRESSORS[name]


def _shapes(a: _Array, shape: Any, chunks: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    # Any: the JSON's values, whatever they are; the conversion below is their check.
    try:
        shape = tuple(int(s) for s in shape)
        chunks = tuple(int(c) for c in chunks)
    except (TypeError, ValueError):
        raise a.fail(
            f"shape {shape!r} or chunk shape {chunks!r} is not a list of integers"
        ) from None
    if len(shape) != len(chunks) or min(shape, default=0) < 0 or min(chunks, default=1) < 1:
        raise a.fail(f"chunk shape {list(chunks)} does not fit shape {list(shape)}")
    return shape, chunks


def _fill(a: _Array, value: object) -> bytes:
    """The fill value as one element of the array's dtype, native byte order."""
    dtype = a.known_dtype()
    if value is None:
        return bytes(dtype.itemsize)
    try:
        if isinstance(value, str) and value.startswith("0x"):
            bits = int(value, 16).to_bytes(dtype.itemsize, "big")
            return np.frombuffer(bits, dtype.newbyteorder(">")).astype(dtype).tobytes()
        if dtype.kind == "c" and isinstance(value, (list, tuple)):
            value = complex(_number(value[0]), _number(value[1]))
        elif isinstance(value, str):
            value = _number(value)
        return np.array(value, dtype).tobytes()
    except (TypeError, ValueError, OverflowError):
        raise a.fail(f"fill value {value!r} is not a {dtype}") from None


def _number(text: object) -> float:
    special = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
    return special[text] if text in special else float(text)  # type: ignore[arg-type]


def _field(a: _Array, field: str) -> ArrayField:
    """The array as a field: its layout, with every chunk found (stat'ed, or in a shard's
    index)."""
    grid = [-(-s // c) for s, c in zip(a.shape, a.chunks)]
    n = int(np.prod(grid, dtype=np.int64))
    offsets = np.full(n, _MISSING)
    sizes = np.zeros(n, np.uint64)
    files = np.zeros(n, np.uint32)
    dtype = a.known_dtype()
    itemsize = dtype.itemsize
    chunk_bytes = int(np.prod(a.chunks, dtype=np.int64)) * itemsize
    if a.shard is None:
        keys = [a.key(at) for at in itertools.product(*(range(g) for g in grid))]
        candidates = [os.path.join(a.folder, *k.split("/")) for k in keys]
        identities, errors = _core.stat_files(candidates)
        present = np.flatnonzero(errors == 0)
        paths = [candidates[i] for i in present.tolist()]
        offsets[present] = 0
        sizes[present] = identities[present, 1]
        files[present] = np.arange(len(present), dtype=np.uint32)
        if not a.steps:
            wrong = present[sizes[present] != chunk_bytes]
            if len(wrong):
                i = int(wrong[0])
                raise located(
                    ShardFormatError,
                    candidates[i],
                    0,
                    f"a chunk of array {a.label} holds {int(sizes[i])} bytes, but its "
                    f"uncompressed chunks are {chunk_bytes}",
                )
    else:
        paths = _shard_chunks(a, a.shard, grid, offsets, sizes, files)
    layout = _core.ArrayLayout(
        a.where,
        a.shape,
        a.chunks,
        itemsize,
        a.fill,
        a.steps,
        paths,
        files,
        offsets,
        sizes,
        np.zeros(n, np.uint32),
        order=a.order,
        byteswap=a.byteswap,
    )
    names = "+".join(f.name.lower() for f, _ in a.steps)
    storage = f"zarr chunks {a.chunks}" + (f" in shards {a.shard['shape']}" if a.shard else "")
    return ArrayField(
        field, dtype, a.shape[1:], layout, None, storage + (f", {names}" if names else "")
    )


def _shard_chunks(
    a: _Array,
    shard: _Shard,
    grid: list[int],
    offsets: np.ndarray,
    sizes: np.ndarray,
    files: np.ndarray,
) -> list[str]:
    """Fill in each inner chunk's place from the index of the shard file holding it (`shard`
    is `a.shard`)."""
    outer = shard["shape"]
    per = [o // i for o, i in zip(outer, a.chunks)]  # inner chunks per shard, per axis
    count = int(np.prod(per, dtype=np.int64))
    index_bytes = 16 * count + (4 if shard["crc"] else 0)
    strides = np.cumprod([1, *grid[::-1]])[:-1][::-1]
    local = np.array(list(itertools.product(*(range(p) for p in per))), np.int64).reshape(
        count, len(per)
    )
    paths: list[str] = []
    for at in itertools.product(*(range(-(-s // o)) for s, o in zip(a.shape, outer))):
        path = os.path.join(a.folder, *a.key(at).split("/"))
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < index_bytes:
                    raise located(
                        ShardFormatError,
                        path,
                        0,
                        f"a shard of array {a.label} of {size} bytes cannot hold its "
                        f"{index_bytes}-byte index",
                    )
                at_index = 0 if shard["start"] else size - index_bytes
                f.seek(at_index)
                raw = f.read(index_bytes)
        except FileNotFoundError:
            continue  # a shard never written: its chunks are the fill value
        if shard["crc"]:
            (stored,) = struct.unpack("<I", raw[-4:])
            if _core.crc32c(raw[:-4]) != stored:
                raise located(
                    ShardFormatError,
                    path,
                    at_index,
                    f"the shard index of array {a.label} fails its CRC-32C check: the shard "
                    "is corrupt",
                )
        table = np.frombuffer(raw, "<u8", 2 * count).reshape(count, 2)
        coords = np.array(at, np.int64) * np.array(per, np.int64) + local
        inside = (coords < np.array(grid, np.int64)).all(axis=1)
        written = inside & (table[:, 0] != _MISSING)
        bad = written & (
            (table[:, 1] > np.uint64(size)) | (table[:, 0] > np.uint64(size) - table[:, 1])
        )
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise located(
                ShardFormatError,
                path,
                at_index + 16 * k,
                f"the shard index of array {a.label} places inner chunk {k} at "
                f"{int(table[k, 0])} ({int(table[k, 1])} bytes), past the shard's end ({size})",
            )
        linear = coords[written] @ strides
        offsets[linear] = table[written, 0]
        sizes[linear] = table[written, 1]
        files[linear] = len(paths)
        paths.append(path)
    return paths


def _no_identity(path: str) -> Identity:
    return (0, 0, 0)  # a folder: each chunk file is checked as it is read


register(ArrayFormat("zarr", zarr_arrays, _no_identity))
