"""Writing ``stoker.json``: what each shard holds, so a dataset opens without a scan and
remote shards are checked byte for byte (sha256) when they arrive."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

from stoker import _core
from stoker.errors import ShardFormatError, located
from stoker.sources import MANIFEST_NAME, format_of

MANIFEST_VERSION = 1


def sha256_of(path: str, block: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def shard_entry(path: str, relative_to: str) -> dict:
    """A manifest entry for the shard at `path`: path (relative), bytes, samples, fields,
    sha256, and key_runs where some samples' members lie apart."""
    fmt = format_of(path)
    index = _core.index_shards([path], [fmt], 1)[0]
    if fmt == "zip":  # stored members' CRCs are not checked on every read: check them once
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
        if bad is not None:
            raise located(
                ShardFormatError, path, 0, f"member {bad!r} does not match its CRC-32: corrupt"
            )
    if fmt == "npy":
        samples, fields = int(index["shape"][0]), ["npy"]
    else:
        samples, fields = len(index["keys"]), list(index["field_names"])
    entry = {
        "path": os.path.relpath(path, relative_to),
        "bytes": int(index["file_size"]),
        "samples": samples,
        "fields": fields,
        "sha256": sha256_of(path),
    }
    if index.get("key_runs", samples) > samples:
        # Samples whose members lie apart: said when the dataset opens, not at its first
        # read of this shard mid-epoch.
        entry["key_runs"] = int(index["key_runs"])
    return entry


def write_manifest(
    shards: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    *,
    num_threads: int = 0,
    extra: dict | None = None,
) -> str:
    """Write the manifest of `shards` to `out` (a ``stoker.json`` path or the folder to
    put one in), atomically. Shard paths are stored relative to it. `extra` keys (such
    as ``classes``) go beside ``shards``."""
    out = os.fspath(out)
    if os.path.isdir(out):
        out = os.path.join(out, MANIFEST_NAME)
    base = os.path.dirname(os.path.abspath(out))
    paths = [os.path.abspath(os.fspath(p)) for p in shards]
    with ThreadPoolExecutor(num_threads or os.cpu_count() or 1) as pool:
        entries = list(pool.map(lambda p: shard_entry(p, base), paths))
    text = json.dumps({"version": MANIFEST_VERSION, **(extra or {}), "shards": entries}, indent=1)
    write_atomically(out, [(text + "\n").encode("utf-8")])
    return out


def write_atomically(out: str, parts: Iterable[bytes | memoryview]) -> None:
    """Write `parts` to `out` through a temporary file beside it, synced, then renamed: a
    reader sees the old file or the whole new one, and a crash leaves no short file under
    the name. The file is readable as others are (the umask's mode, not mkstemp's 0600)."""
    fd, tmp = tempfile.mkstemp(prefix=".stoker-", suffix=".tmp", dir=os.path.dirname(out) or ".")
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
