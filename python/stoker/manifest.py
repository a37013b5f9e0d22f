"""``stoker.json``, read and written in one place: what each shard holds, so a dataset
opens without a scan and remote shards are checked byte for byte (sha256) when they
arrive; and whether a local one still matches its folder."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import zipfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import stoker._core as _core
from stoker._files import write_atomically
from stoker._process import collector_paused
from stoker.errors import ShardFormatError, located, plural
from stoker.formats import (
    SHARD_FORMATS,
    TABLE_SOURCES,
    format_of,
    is_url,
    join_url,
    samples_and_fields,
)
from stoker.tables import index_table_source

log = logging.getLogger("stoker.manifest")

MANIFEST_NAME = "stoker.json"
MANIFEST_VERSION = 1
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")


def read_manifest(path: str) -> list[tuple[str, dict]]:
    """The shards a local ``stoker.json`` lists, as (location, entry) pairs."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise located(ShardFormatError, path, 0, f"cannot read the manifest: {e}") from e
    return parse_manifest(data, os.path.abspath(path))


def parse_manifest(data: bytes, where: str) -> list[tuple[str, dict]]:
    """The shards of a manifest read from `where` (a path or URL), as (location, entry)
    pairs; locations are relative to the manifest, so a served manifest lists URLs."""
    with collector_paused():  # (100,000 shards: as many dicts that stay alive)
        return _parse_manifest(data, where)


def _parse_manifest(data: bytes, where: str) -> list[tuple[str, dict]]:
    try:
        manifest = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        pos = getattr(e, "pos", getattr(e, "start", 0))
        raise located(ShardFormatError, where, pos, f"manifest is not valid JSON: {e}") from e
    if not isinstance(manifest, dict) or not isinstance(manifest.get("shards"), list):
        raise located(ShardFormatError, where, 0, "manifest has no 'shards' list")
    if manifest.get("version", 1) != 1:
        raise located(
            ShardFormatError, where, 0, f"manifest version {manifest['version']} is not supported"
        )
    shards = []
    remote = is_url(where)
    folder = os.path.join(os.path.dirname(where), "")
    # Once per entry, for manifests of a hundred thousand shards: plain checks first.
    for i, entry in enumerate(manifest["shards"]):
        path = entry.get("path") if isinstance(entry, dict) else None
        if not isinstance(path, str):
            raise located(ShardFormatError, where, 0, f"manifest shard {i} has no 'path'")
        for key in ("bytes", "samples"):
            count = entry.get(key, 0)
            if type(count) is not int or count < 0:
                raise located(
                    ShardFormatError, where, 0, f"manifest shard {i}: {key!r} is not a count"
                )
        digest = entry.get("sha256")
        if digest is not None:
            if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
                raise located(
                    ShardFormatError, where, 0, f"manifest shard {i}: 'sha256' is not a digest"
                )
            if not digest.islower():
                entry = {**entry, "sha256": digest.lower()}
        if remote:
            location = join_url(where, path)
            if not is_url(location):
                raise located(
                    ShardFormatError, where, 0, f"manifest shard {i}: {location!r} is not a URL"
                )
        elif is_url(path) or path.startswith("/"):
            location = path
        else:
            location = folder + path
        shards.append((location, entry))
    return shards


def manifest_drift(
    manifest: str, shards: list[tuple[str, dict]], check_missing: bool = True
) -> tuple[list[str], list[str]]:
    """What a local manifest no longer says right: the shards it lists that are not there
    (if `check_missing`), and, for a folder's ``stoker.json``, the shard files beside it (in
    its folder, or in a folder a listed shard is in) that it does not list. Only those
    folders are listed, never a whole tree. (A manifest of another name may describe a part
    of its folder.)"""
    listed = {path for path, _ in shards}  # (made from the manifest's folder: absolute)
    missing = sorted(p for p in listed if not os.path.exists(p)) if check_missing else []
    if os.path.basename(manifest) != MANIFEST_NAME:
        return missing, []
    folders = {os.path.dirname(os.path.abspath(manifest))}
    folders |= {p.rpartition(os.sep)[0] or os.sep for p in listed}
    suffixes = tuple(SHARD_FORMATS)
    unlisted: list[str] = []
    normal: set[str] | None = None  # the listed paths normalised, made only if needed
    for folder in folders:
        with contextlib.suppress(OSError):
            for entry in os.scandir(folder):
                if entry.path in listed or not entry.name.lower().endswith(suffixes):
                    continue
                if normal is None:
                    normal = {os.path.normpath(p) for p in listed}
                if os.path.normpath(entry.path) not in normal and entry.is_file():
                    unlisted.append(entry.path)
    return missing, sorted(unlisted)


def describe_drift(manifest: str, missing: list[str], unlisted: list[str]) -> str:
    """One line on a manifest's drift (see manifest_drift), saying how to fix it."""

    def some(paths: list[str]) -> str:
        names = ", ".join(os.path.basename(p) for p in paths[:3])
        return names + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")

    parts = []
    if missing:
        parts.append(f"lists {plural(len(missing), 'missing shard')} ({some(missing)})")
    if unlisted:
        parts.append(
            f"does not list {plural(len(unlisted), 'shard file')} beside it ({some(unlisted)})"
        )
    folder = os.path.dirname(manifest) or "."
    return f"{manifest} {' and '.join(parts)}: run `stoker index {folder}` to write it again"


def read_local_manifest(path: str, note_drift: bool) -> list[tuple[str, dict]]:
    shards = read_manifest(path)
    if note_drift:  # (a listed shard that is missing is an error when the dataset opens)
        _, unlisted = manifest_drift(path, shards, check_missing=False)
        if unlisted:
            log.warning("%s", describe_drift(path, [], unlisted))
    return shards


def sha256_of(path: str, block: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def shard_entry(path: str, relative_to: str) -> dict:
    """A manifest entry for the shard at `path`: path (relative), bytes, samples, fields,
    sha256, and key_runs where some samples' members lie apart; of a table, its row groups'
    rows (`groups`), and of a Parquet file the key of how its columns read
    (`columns_key`, see _core.parquet_summaries): a dataset then opens from the manifest
    with one file of each key read whole."""
    fmt = format_of(path)
    if fmt in TABLE_SOURCES:
        return _table_entry(path, relative_to, fmt)
    index = _core.index_shards([path], [fmt], 1)[0]
    if fmt == "zip":  # stored members' CRCs are not checked on every read: check them once
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
        if bad is not None:
            raise located(
                ShardFormatError, path, 0, f"member {bad!r} does not match its CRC-32: corrupt"
            )
    samples, fields = samples_and_fields(index, fmt)
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


def _table_entry(path: str, relative_to: str, fmt: str) -> dict:
    index = index_table_source(path, fmt)
    samples, fields = samples_and_fields(index, fmt)
    entry = {
        "path": os.path.relpath(path, relative_to),
        "bytes": int(index["identity"][1]),
        "samples": samples,
        "fields": fields,
        "groups": [int(g) for g in index["groups"]],
    }
    if fmt == "parquet":
        entry["columns_key"] = f"{int(_core.parquet_summaries([path], 1)[3][0]):016x}"
    entry["sha256"] = sha256_of(path)
    return entry


def write_manifest(
    shards: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    *,
    num_threads: int = 0,
    extra: dict | None = None,
    member_index: bool = True,
) -> str:
    """Write the manifest of `shards` to `out` (a ``stoker.json`` path or the folder to
    put one in), atomically. Shard paths are stored relative to it. `extra` keys (such
    as ``classes``) go beside ``shards``. With `member_index`, each tar and zip shard's
    member index is written beside it too (``SHARD.stoker-idx``), so that reading it first
    costs one small read instead of a walk over its headers."""
    out = os.fspath(out)
    if os.path.isdir(out):
        out = os.path.join(out, MANIFEST_NAME)
    base = os.path.dirname(os.path.abspath(out))
    paths = [os.path.abspath(os.fspath(p)) for p in shards]
    if member_index:  # first: the entries below then read the shards' fresh indexes
        archives = [p for p in paths if format_of(p) in ("tar", "zip")]
        formats = [format_of(p) for p in archives]
        failed = [why for why in _core.write_member_index(archives, formats, num_threads) if why]
        if failed:  # a read-only shard folder: the manifest still is written
            log.warning(
                "no member index written beside %s; those shards' headers are read when "
                "they are first opened (%s)",
                plural(len(failed), "shard"),
                failed[0],
            )
    with ThreadPoolExecutor(num_threads or os.cpu_count() or 1) as pool:
        entries = list(pool.map(lambda p: shard_entry(p, base), paths))
    return write_entries(out, entries, extra)


def write_entries(out: str, entries: list[dict], extra: dict | None = None) -> str:
    """Write a manifest of `entries` (see shard_entry) to the file `out`, atomically."""
    text = json.dumps({"version": MANIFEST_VERSION, **(extra or {}), "shards": entries}, indent=1)
    write_atomically(out, [(text + "\n").encode("utf-8")])
    return out
