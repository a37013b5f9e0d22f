"""Writing ``stoker.json``: what each shard holds, so a dataset opens without a scan and
remote shards are checked byte for byte (sha256) when they arrive."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zipfile
from collections.abc import Sequence
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
    sha256."""
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
    return {
        "path": os.path.relpath(path, relative_to),
        "bytes": int(index["file_size"]),
        "samples": samples,
        "fields": fields,
        "sha256": sha256_of(path),
    }


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
    fd, tmp = tempfile.mkstemp(prefix=".stoker-", suffix=".json", dir=base)
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)  # readable as the shards are (mkstemp makes it 0600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return out
