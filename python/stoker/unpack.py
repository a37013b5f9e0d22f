"""Shards compressed as a whole, made plain once: MDS's ``zstd``/``gz`` shards and
LitData's ``zstd`` chunks, whole or in frames (``LDFZ01``).

A local shard is decompressed into the cache folder, under ``unpacked/``, and read there
in place; a remote one is decompressed from the bytes fetched, on its way into the node
cache. Both the index readers (:mod:`stoker.peers`) and the fetch path
(:mod:`stoker.remote`) stand on this module; it knows neither.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

import stoker._core as _core
from stoker._files import default_cache_root, write_atomically
from stoker.errors import ShardFormatError, located

_FRAMED_MAGIC = b"LDFZ01\x00\x00"
_FRAMED_HEAD = 24  # magic, version, flags, items, a reserved word, frames


def framed_header_size(items: int) -> int:
    """The bytes at the start of a framed chunk of `items` items that say its plain size."""
    return _FRAMED_HEAD + 4 * (items + 1)


def framed_plain_size(header: bytes, n: int, where: str) -> int:
    """The size of the plain chunk a framed chunk of `n` items becomes, from its header."""
    if header[:8] != _FRAMED_MAGIC or len(header) < framed_header_size(n):
        raise located(
            ShardFormatError, where, 0, "framed LitData chunk: no LDFZ01 header of its items"
        )
    (items,) = struct.unpack_from("<I", header, 12)
    if items != n:
        raise located(ShardFormatError, where, 12, f"holds {items} items, the index says {n}")
    (logical_end,) = struct.unpack_from("<I", header, _FRAMED_HEAD + 4 * n)
    return 4 + 4 * (n + 1) + logical_end


def unframe(data: bytes | memoryview, source: str) -> list[bytes | memoryview]:
    """LitData's framed zstd chunk (items compressed in frames of a few hundred) as the
    parts of the plain chunk it stands for: the offset table, then the items."""
    data = memoryview(data)

    def bad(at: int, what: str) -> ShardFormatError:
        return located(ShardFormatError, source, at, f"framed LitData chunk: {what}")

    if bytes(data[:8]) != _FRAMED_MAGIC or len(data) < _FRAMED_HEAD:
        raise bad(0, "not one (no LDFZ01 magic): a LitData chunk of another compression")
    version, _, n, _, frames = struct.unpack_from("<HHIII", data, 8)
    if version != 1:
        raise bad(8, f"version {version}")
    table_end = framed_header_size(n)
    if table_end + 24 * frames > len(data):
        raise bad(12, f"{n} items in {frames} frames do not fit {len(data)} bytes")
    logical = np.frombuffer(data, "<u4", n + 1, _FRAMED_HEAD).astype(np.int64)
    head = 4 + 4 * (n + 1)
    parts: list[bytes | memoryview] = [
        struct.pack("<I", n),
        (logical + head).astype("<u4").tobytes(),
    ]
    expected = 0
    for k in range(frames):
        at = table_end + 24 * k
        _, _, offset, packed, plain = struct.unpack_from("<IIQII", data, at)
        if offset + packed > len(data):
            raise bad(at, f"frame {k} ({packed} bytes at {offset}) runs past the file's end")
        frame = _core.decompress(
            data[offset : offset + packed], plain, _core.ChunkFilter.ZSTD, source
        )
        # numpy types the buffer protocol (__buffer__) for Python 3.12+ only
        parts.append(memoryview(frame))  # type: ignore[arg-type]
        expected += plain
    if expected != int(logical[-1]):
        raise bad(table_end, f"frames hold {expected} bytes but the items {int(logical[-1])}")
    return parts


def check_hashes(data: bytes, hashes: Mapping[str, str], where: str) -> None:
    """The writer's digests of a compressed file (those hashlib knows), checked: a zstd
    frame without a checksum cannot tell damaged data from other data."""
    for algorithm, digest in hashes.items():
        if algorithm in hashlib.algorithms_available:
            got = hashlib.new(algorithm, data).hexdigest()
            if got != str(digest).lower():
                raise located(
                    ShardFormatError,
                    where,
                    0,
                    f"its {algorithm} is {got}, but the index says {digest}: the file is damaged",
                )


def unpack_bytes(
    spec: Mapping[str, Any], data: bytes, size: int, where: str
) -> list[bytes | memoryview]:
    """A compressed remote shard's bytes (`data`, as fetched, its hashes checked: see
    check_hashes) as the `size` bytes of the shard it stands for, per its entry's
    ``unpack`` `spec` (zstd, gz, or LitData's framed chunks)."""
    kind = spec["kind"]
    if kind == "framed":
        parts = unframe(data, where)
    else:
        codec = _core.ChunkFilter.ZSTD if kind == "zstd" else _core.ChunkFilter.GZIP
        # numpy types the buffer protocol (__buffer__) for Python 3.12+ only
        parts = [memoryview(_core.decompress(data, size, codec, where))]  # type: ignore[arg-type]
    got = sum(len(p) for p in parts)
    if got != size:
        raise located(ShardFormatError, where, 0, f"decompresses to {got} bytes, not {size}")
    return parts


# -- local shards, decompressed into the cache folder once ----------------------------


def unpacked(
    source: str,
    size: int,
    codec: _core.ChunkFilter,
    cache_dir: str | None,
    hashes: dict[str, str] | None = None,
) -> str:
    """A decompressed copy of the whole-file-compressed shard `source` (`size` bytes once
    decompressed) in the cache, made once: written beside its place and renamed. `hashes`
    (algorithm: hex digest of `source`) are checked first, those hashlib knows."""

    try:
        out = _cache_path(source, cache_dir)
    except FileNotFoundError:
        raise located(
            ShardFormatError, source, 0, "the index lists this shard but it is not there"
        ) from None
    if os.path.exists(out) and os.path.getsize(out) == size:
        return out
    with open(source, "rb") as f:
        data = f.read()
    check_hashes(data, hashes or {}, source)
    # numpy types the buffer protocol (__buffer__) for Python 3.12+ only
    write_atomically(out, [memoryview(_core.decompress(data, size, codec, source))])  # type: ignore[arg-type]
    return out


def unframed(source: str, cache_dir: str | None) -> tuple[str, int]:
    """A local framed LitData chunk as a plain chunk in the cache: its path and size."""

    out = _cache_path(source, cache_dir)
    with open(source, "rb") as f:
        head = f.read(_FRAMED_HEAD)
        n = struct.unpack_from("<I", head, 12)[0] if len(head) == _FRAMED_HEAD else 0
        size = framed_plain_size(head + f.read(4 * (n + 1)), n, source)
        if os.path.exists(out) and os.path.getsize(out) == size:
            return out, size  # decompressed at an earlier open: not again
        f.seek(0)
        data = f.read()
    write_atomically(out, unframe(data, source))
    return out, size


def _cache_path(source: str, cache_dir: str | None) -> str:
    """Where the decompressed copy of `source` goes: a folder of the cache named for the
    source as it is now (path, size, modification time), so a changed file is not served
    from an old copy."""

    st = os.stat(source)
    tag = f"{os.path.abspath(source)}\0{st.st_size}\0{st.st_mtime_ns}".encode()
    folder = os.path.join(
        os.path.abspath(cache_dir) if cache_dir else default_cache_root(),
        "unpacked",
        hashlib.sha256(tag).hexdigest()[:24],
    )
    os.makedirs(folder, exist_ok=True)
    name = os.path.basename(source)
    for suffix in (".zstd.bin", ".zstd", ".gz"):
        if name.endswith(suffix):
            name = name[: -len(suffix)] + (".bin" if suffix == ".zstd.bin" else "")
    return os.path.join(folder, name)
