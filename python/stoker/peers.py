"""Datasets other loaders wrote, read in place: MosaicML Streaming's MDS shards and
LitData's ``optimize()`` chunks, found through their ``index.json``.

Both formats are records behind an offset table; the C++ indexer reads each shard's table
and record prefixes (``csrc/stoker/format/records.cpp``) given the columns this module
learns from the index. Each record is a sample, keyed ``<shard stem>/<record>``; each
column a field (MDS: its name; LitData: its path in the sample, dict keys joined by
dots). A shard compressed as a whole (MDS ``zstd``/``gz``; LitData ``zstd`` chunks, whole
or in frames) is decompressed once into the cache folder (:mod:`stoker.unpack`) and
read there in place.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

import stoker._core as _core
from stoker._files import load_json
from stoker.errors import ShardFormatError, located
from stoker.formats import is_url
from stoker.unpack import framed_header_size, framed_plain_size, unframed, unpacked

INDEX_NAME = "index.json"

# Fixed-size MDS encodings and their sizes; every other known one is variable.
_MDS_FIXED = {
    "int": 8,
    **{f"int{b}": b // 8 for b in (8, 16, 32, 64)},
    **{f"uint{b}": b // 8 for b in (8, 16, 32, 64)},
    "float16": 2,
    "float32": 4,
    "float64": 8,
}
_MDS_VARIABLE = {
    "str", "bytes", "str_int", "str_float", "str_decimal", "jpeg", "png", "pil", "pkl", "json",
    "jpeg_array", "jpegarray", "list[pil]", "list[jpeg]", "list[png]", "ndarray",
}  # fmt: skip
_MDS_COMPRESSION = {"zstd": _core.ChunkFilter.ZSTD, "gz": _core.ChunkFilter.GZIP}
# LitData leaves: fixed sizes, and leaves whose bytes start with an array header.
_LIT_FIXED = {"int": 8, "float": 8, "bool": 1}
_LIT_HEADER = {"numpy": "numpy", "tensor": "tensor"}


def is_peer_index(path: str) -> bool:
    return os.path.basename(path) == INDEX_NAME


def read_peer_index(path: str, cache_dir: str | None = None) -> list[tuple[str, dict]] | None:
    """The shards of the MDS or LitData dataset whose ``index.json`` is at `path`, each
    with its manifest-like entry (samples, bytes, fields, and its record ``format``); None
    when the file is not such an index."""
    folder = os.path.dirname(os.path.abspath(path))
    return peer_shards(
        load_json(path, "index.json"), path, lambda name: os.path.join(folder, name), cache_dir
    )


def peer_shards(
    index: object,
    where: str,
    locate: Callable[[str], str],
    cache_dir: str | None,
    read_range: Callable[[str, int, int], bytes] | None = None,
) -> list[tuple[str, dict]] | None:
    """The shards an MDS or LitData `index` (read from `where`) lists, each located by
    `locate(its file name)`: a path, or a URL. A compressed local shard is decompressed
    into the cache now; a compressed remote one is fetched into the node cache as any
    remote shard and decompressed on its way in (its entry's ``unpack``); for LitData's
    framed chunks, whose decompressed size only their header says, `read_range` reads
    each header. None when `index` is neither."""
    if not isinstance(index, dict):
        return None
    if isinstance(index.get("shards"), list) and index.get("version") == 2:
        return [_mds_shard(where, locate, s, cache_dir) for s in index["shards"]]
    if isinstance(index.get("chunks"), list) and isinstance(index.get("config"), dict):
        config = index["config"]
        format_string, fields = _litdata_format(where, config)
        chunks = index["chunks"]

        def one(chunk: Any) -> tuple[str, dict]:
            return _litdata_chunk(
                where, locate, chunk, config, format_string, fields, cache_dir, read_range
            )

        if read_range is None or len(chunks) < 2:
            return [one(c) for c in chunks]
        with ThreadPoolExecutor(16) as pool:  # a framed chunk's header: one request each
            return list(pool.map(one, chunks))
    return None


def _field(name: str) -> str:
    """A column's field name, in lower case as the indexer makes every field name."""
    return str(name).lower()


# -- MDS ----------------------------------------------------------------------------


def _mds_shard(
    index: str, locate: Callable[[str], str], shard: Any, cache_dir: str | None
) -> tuple[str, dict]:
    def bad(what: str) -> ShardFormatError:
        return located(ShardFormatError, index, 0, f"MDS shard entry: {what}")

    if not isinstance(shard, dict) or shard.get("format") != "mds":
        raise bad(f"format {shard.get('format') if isinstance(shard, dict) else shard!r}: "
                  "stoker reads MDS shards (not json, csv or xsv)")  # fmt: skip
    names, encodings = shard.get("column_names"), shard.get("column_encodings")
    sizes = shard.get("column_sizes")
    if not (
        isinstance(names, list) and isinstance(encodings, list) and isinstance(sizes, list)
    ) or not (len(names) == len(encodings) == len(sizes) and names):
        raise bad("column_names, column_encodings and column_sizes must be lists of one length")
    columns = []
    for name, encoding, size in zip(names, encodings, sizes):
        fixed = _MDS_FIXED.get(encoding)
        if encoding.startswith("ndarray:") and encoding.count(":") == 2:
            dtype, shape = encoding.split(":")[1:]
            fixed = int(np.prod([int(d) for d in shape.split(",")])) * np.dtype(dtype).itemsize
        elif (
            fixed is None and encoding not in _MDS_VARIABLE and not encoding.startswith("ndarray:")
        ):
            raise bad(f"column {name!r} has the encoding {encoding!r}, which stoker does not know")
        if (size is None) != (fixed is None) or (fixed is not None and size != fixed):
            raise bad(f"column {name!r} ({encoding}) says it is {size} bytes")
        columns.append(f"{_field(name)}:{'v' if fixed is None else fixed}")
    raw = shard.get("raw_data") or {}
    path = locate(str(raw.get("basename", "")))
    samples, nbytes = shard.get("samples"), raw.get("bytes")
    if not isinstance(samples, int) or not isinstance(nbytes, int):
        raise bad("samples and raw_data.bytes must be integers")
    compression = shard.get("compression")
    if compression and (
        is_url(path) or not (os.path.exists(path) and os.path.getsize(path) == nbytes)
    ):
        family = str(compression).split(":")[0]
        if family not in _MDS_COMPRESSION:
            raise bad(f"compression {compression!r}: stoker decompresses zstd and gz")
        zip_data = shard.get("zip_data") or {}
        zipped = locate(str(zip_data.get("basename", "")))
        # A zstd frame without a checksum cannot tell damaged data from other data: the
        # writer's hashes of the file (those hashlib has) are checked where it kept some.
        hashes = zip_data.get("hashes") if isinstance(zip_data.get("hashes"), dict) else {}
        if is_url(zipped):
            packed = zip_data.get("bytes")
            return zipped, _entry(samples, nbytes, columns, "mds", family, packed, hashes)
        path = unpacked(zipped, nbytes, _MDS_COMPRESSION[family], cache_dir, hashes)
    return path, _entry(samples, nbytes, columns, "mds")


def _entry(
    samples: int,
    nbytes: int,
    columns: list[str],
    kind: str,
    unpack: str | None = None,
    packed: int | None = None,
    hashes: dict | None = None,
) -> dict:
    """A manifest-like entry: what the dataset needs of a shard before it is read."""
    entry = {
        "samples": samples,
        "bytes": nbytes,
        "fields": [c.split(":")[0] for c in columns],
        "format": f"{kind}|" + "|".join(columns),
        "listed_by": f"its {'MDS' if kind == 'mds' else 'LitData'} index.json",
    }
    if unpack is not None:  # fetched compressed, decompressed on its way into the cache
        entry["unpack"] = {"kind": unpack, "bytes": packed, "hashes": hashes or {}}
    return entry


# -- LitData -------------------------------------------------------------------------


def _leaf_names(spec: Any, path: str) -> list[str]:
    """The leaves of a pytree spec (LitData's ``data_spec``), depth first, named by their
    path: dict keys and tuple/list positions joined by dots."""
    out: list[str] = []

    def walk(node: dict, prefix: str) -> None:
        children = node.get("children_spec") or []
        if node.get("type") is None or not children:
            out.append(prefix or "value")
            return
        context = json.loads(node.get("context") or "null")
        keys = context if isinstance(context, list) else list(range(len(children)))
        for key, child in zip(keys, children):
            walk(child, f"{prefix}.{key}" if prefix else str(key))

    try:
        walk(json.loads(spec)[1], "")
    except (TypeError, ValueError, IndexError, AttributeError, KeyError) as e:
        raise located(ShardFormatError, path, 0, f"a data_spec stoker cannot read ({e})") from e
    return out


def _litdata_format(path: str, config: dict) -> tuple[str, list[str]]:
    def bad(what: str) -> ShardFormatError:
        return located(ShardFormatError, path, 0, f"LitData config: {what}")

    if config.get("encryption"):
        raise bad("the chunks are encrypted: decrypt them with LitData first")
    if config.get("item_loader") not in (None, "PyTreeLoader"):
        raise bad(f"item_loader {config.get('item_loader')!r}: stoker reads PyTreeLoader chunks")
    formats = config.get("data_format")
    leaves = _leaf_names(config.get("data_spec"), path)
    if not isinstance(formats, list) or len(formats) != len(leaves):
        raise bad(f"{len(leaves)} leaves in data_spec but data_format is {formats!r}")
    fields = [_field(leaf) for leaf in leaves]
    if len(set(fields)) != len(fields):
        raise bad(f"leaf names {leaves} differ only in case")
    columns = []
    for field, kind in zip(fields, formats):
        base = str(kind).split(":")[0]
        if base in _LIT_FIXED:
            columns.append(f"{field}:{_LIT_FIXED[base]}")
        elif base in _LIT_HEADER:
            columns.append(f"{field}:v:{_LIT_HEADER[base]}")
        else:
            columns.append(f"{field}:v")
    return "litdata|" + "|".join(columns), fields


def _litdata_chunk(
    index: str,
    locate: Callable[[str], str],
    chunk: Any,
    config: dict,
    format_string: str,
    fields: list[str],
    cache_dir: str | None,
    read_range: Callable[[str, int, int], bytes] | None = None,
) -> tuple[str, dict]:
    if not isinstance(chunk, dict) or not isinstance(chunk.get("filename"), str):
        raise located(ShardFormatError, index, 0, f"a chunk entry without a filename: {chunk!r}")
    samples, nbytes = chunk.get("chunk_size"), chunk.get("chunk_bytes")
    if not isinstance(samples, int) or not isinstance(nbytes, int):
        raise located(ShardFormatError, index, 0, f"chunk {chunk['filename']}: sizes not integers")
    path = locate(chunk["filename"])
    columns = format_string.split("|")[1:]
    compression = config.get("compression")
    if compression:
        if not str(compression).startswith("zstd"):
            raise located(
                ShardFormatError, index, 0, f"compression {compression!r}: stoker reads zstd"
            )
        level = config.get("compression_level")
        if is_url(path) and level != "sample":
            if path.endswith(".zstd.bin"):
                return path, _entry(samples, nbytes, columns, "litdata", "zstd")
            if read_range is None:
                raise located(ShardFormatError, path, 0, "a framed chunk's header cannot be read")
            header = read_range(path, 0, framed_header_size(samples))
            size = framed_plain_size(header, samples, path)
            return path, _entry(samples, size, columns, "litdata", "framed", nbytes)
        if path.endswith(".zstd.bin"):  # the whole chunk is one frame
            plain = path[: -len(".zstd.bin")] + ".bin"
            if os.path.exists(plain) and os.path.getsize(plain) == nbytes:
                path = plain  # LitData's own reader left it decompressed
            else:
                path = unpacked(path, nbytes, _core.ChunkFilter.ZSTD, cache_dir)
        elif level == "sample":
            raise located(
                ShardFormatError,
                path,
                0,
                "LitData chunks compressed item by item (compression_level='sample') are not "
                "read by stoker: optimize with compression_level='chunk', or without compression",
            )
        else:
            path, nbytes = unframed(path, cache_dir)
    return path, _entry(samples, nbytes, columns, "litdata")
