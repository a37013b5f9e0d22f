"""Turning what a user passes as a source into a list of shard paths."""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Union

from stoker.errors import ShardFormatError, StokerError, located, plural

log = logging.getLogger("stoker.sources")

Source = Union[str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]]]

#: File name endings stoker reads, and the index parser for each.
SHARD_FORMATS = {".tar": "tar", ".zip": "zip", ".npy": "npy"}
MANIFEST_NAME = "stoker.json"

_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_COMPRESSED_TAR = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst")


def expand_braces(pattern: str) -> list[str]:
    """Expand ``{0..99}`` ranges (zero-padded to the first bound's width) and ``{a,b}``
    alternatives, as a shell would: ``shard-{000..002}.tar`` -> three names."""
    match = _BRACE.search(pattern)
    if match is None:
        return [pattern]
    head, body, tail = pattern[: match.start()], match.group(1), pattern[match.end() :]
    numeric = _RANGE.match(body)
    if numeric:
        first, last = numeric.group(1), numeric.group(2)
        width = len(first) if first.lstrip("-").startswith("0") else 0
        lo, hi = int(first), int(last)
        step = 1 if hi >= lo else -1
        items = [str(i).zfill(width) for i in range(lo, hi + step, step)]
    elif "," in body:
        items = body.split(",")
    else:  # a literal brace pair, not an expansion
        return [head + "{" + body + "}" + name for name in expand_braces(tail)]
    return [head + item + rest for item in items for rest in expand_braces(tail)]


def is_url(text: str) -> bool:
    return text.startswith(("http://", "https://"))


def format_of(path: str) -> str:
    """The shard format of `path` (or URL), from its name; a clear error for anything else."""
    lower = urllib.parse.urlsplit(path).path.lower() if is_url(path) else path.lower()
    if lower.endswith(_COMPRESSED_TAR):
        raise located(
            ShardFormatError,
            path,
            0,
            "compressed tar archives cannot be read by byte range; store shards as plain .tar "
            "(compress the members, not the archive)",
        )
    fmt = SHARD_FORMATS.get(os.path.splitext(lower)[1])
    if fmt is None:
        raise located(
            ShardFormatError,
            path,
            0,
            f"unknown shard format (stoker reads {', '.join(sorted(SHARD_FORMATS))} shards)",
        )
    return fmt


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
    for i, entry in enumerate(manifest["shards"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise located(ShardFormatError, where, 0, f"manifest shard {i} has no 'path'")
        for key in ("bytes", "samples"):
            if key in entry and (not isinstance(entry[key], int) or entry[key] < 0):
                raise located(
                    ShardFormatError, where, 0, f"manifest shard {i}: {key!r} is not a count"
                )
        if "sha256" in entry:
            digest = entry["sha256"]
            if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
                raise located(
                    ShardFormatError, where, 0, f"manifest shard {i}: 'sha256' is not a digest"
                )
            entry = {**entry, "sha256": digest.lower()}
        if is_url(where):
            location = urllib.parse.urljoin(where, entry["path"])
            if not is_url(location):
                raise located(
                    ShardFormatError, where, 0, f"manifest shard {i}: {location!r} is not http(s)"
                )
        elif is_url(entry["path"]):
            location = entry["path"]
        else:
            location = os.path.join(os.path.dirname(where), entry["path"])
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
    listed = {os.path.abspath(path) for path, _ in shards}
    missing = sorted(p for p in listed if not os.path.exists(p)) if check_missing else []
    if os.path.basename(manifest) != MANIFEST_NAME:
        return missing, []
    folders = {os.path.dirname(os.path.abspath(manifest))} | {os.path.dirname(p) for p in listed}
    present = set()
    for folder in folders:
        with contextlib.suppress(OSError):
            for entry in os.scandir(folder):
                is_shard = os.path.splitext(entry.name.lower())[1] in SHARD_FORMATS
                if is_shard and entry.is_file():
                    present.add(entry.path)
    return missing, sorted(present - listed)


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


def _read_local_manifest(path: str, note_drift: bool) -> list[tuple[str, dict]]:
    shards = read_manifest(path)
    if note_drift:  # (a listed shard that is missing is an error when the dataset opens)
        _, unlisted = manifest_drift(path, shards, check_missing=False)
        if unlisted:
            log.warning("%s", describe_drift(path, [], unlisted))
    return shards


def _shards_in_folder(folder: str) -> list[str]:
    found = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            if os.path.splitext(name.lower())[1] in SHARD_FORMATS:
                found.append(os.path.join(root, name))
    return found


def resolve(
    source: Source, read_url: Callable[[str], bytes] | None = None, note_drift: bool = True
) -> list[tuple[str, dict | None]]:
    """Shard paths and URLs for `source`, each with its manifest entry (or None), in order.

    `source` may be a folder (its ``stoker.json`` if it has one, else every shard under it,
    sorted), a manifest, a glob, a brace pattern, a path, an http(s) URL (of a shard or a
    manifest, read with `read_url`), or a list of any of these. A local manifest that no
    longer matches its folder is logged (`note_drift`).
    """
    if isinstance(source, (list, tuple)):
        out: list[tuple[str, dict | None]] = []
        for item in source:
            out.extend(resolve(item, read_url, note_drift))
        return out
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"a source is a path, pattern or list of them, not {type(source)!r}")
    text = os.fspath(source)
    names = expand_braces(text)
    if len(names) > 1:
        return [entry for name in names for entry in resolve(name, read_url, note_drift)]
    if is_url(text):
        if urllib.parse.urlsplit(text).path.lower().endswith(".json"):
            if read_url is None:
                raise StokerError(f"{text}: a remote manifest needs a reader")
            return parse_manifest(read_url(text), text)
        return [(text, None)]
    if _SCHEME.match(text):
        raise StokerError(f"{text}: only local paths and http(s) URLs are sources")
    if any(c in text for c in "*?["):
        matches = sorted(glob.glob(text, recursive=True))
        if not matches:
            raise StokerError(f"{text}: no files match this pattern")
        return [(path, None) for path in matches if not os.path.isdir(path)]
    if os.path.isdir(text):
        manifest = os.path.join(text, MANIFEST_NAME)
        if os.path.isfile(manifest):
            return list(_read_local_manifest(manifest, note_drift))
        shards = _shards_in_folder(text)
        if not shards:
            raise StokerError(
                f"{text}: no shards in this folder (looked for {', '.join(SHARD_FORMATS)})"
            )
        return [(path, None) for path in shards]
    if text.endswith(("/", os.sep)):
        raise StokerError(f"{text}: no such folder")
    if text.lower().endswith(".json"):
        return list(_read_local_manifest(text, note_drift))
    return [(text, None)]
