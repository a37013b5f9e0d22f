"""Turning what a user passes as a source into a list of shard paths."""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Sequence
from typing import Union

from stoker.errors import ShardFormatError, StokerError, located

Source = Union[str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]]]

#: File name endings stoker reads, and the index parser for each.
SHARD_FORMATS = {".tar": "tar", ".zip": "zip", ".npy": "npy"}
MANIFEST_NAME = "stoker.json"

_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")
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
    """The shard format of `path`, from its name; a clear error for anything else."""
    lower = path.lower()
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
    """The shards a ``stoker.json`` lists, as (absolute path, entry) pairs."""
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except json.JSONDecodeError as e:
        raise located(ShardFormatError, path, e.pos, f"manifest is not valid JSON: {e.msg}") from e
    if not isinstance(manifest, dict) or not isinstance(manifest.get("shards"), list):
        raise located(ShardFormatError, path, 0, "manifest has no 'shards' list")
    if manifest.get("version", 1) != 1:
        raise located(
            ShardFormatError, path, 0, f"manifest version {manifest['version']} is not supported"
        )
    base = os.path.dirname(os.path.abspath(path))
    shards = []
    for i, entry in enumerate(manifest["shards"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise located(ShardFormatError, path, 0, f"manifest shard {i} has no 'path'")
        shards.append((os.path.join(base, entry["path"]), entry))
    return shards


def _shards_in_folder(folder: str) -> list[str]:
    found = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            if os.path.splitext(name.lower())[1] in SHARD_FORMATS:
                found.append(os.path.join(root, name))
    return found


def resolve(source: Source) -> list[tuple[str, dict | None]]:
    """Local shard paths for `source`, each with its manifest entry (or None), in order.

    `source` may be a folder (its ``stoker.json`` if it has one, else every shard under it,
    sorted), a manifest, a glob, a brace pattern, a path, or a list of any of these.
    """
    if isinstance(source, (list, tuple)):
        out: list[tuple[str, dict | None]] = []
        for item in source:
            out.extend(resolve(item))
        return out
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"a source is a path, pattern or list of them, not {type(source)!r}")
    text = os.fspath(source)
    if is_url(text):
        raise StokerError(
            f"{text}: http(s) sources need stoker's remote shard support, which this build "
            "does not have yet"
        )
    names = expand_braces(text)
    if len(names) > 1:
        return [entry for name in names for entry in resolve(name)]
    if any(c in text for c in "*?["):
        matches = sorted(glob.glob(text, recursive=True))
        if not matches:
            raise StokerError(f"{text}: no files match this pattern")
        return [(path, None) for path in matches if not os.path.isdir(path)]
    if os.path.isdir(text):
        manifest = os.path.join(text, MANIFEST_NAME)
        if os.path.isfile(manifest):
            return list(read_manifest(manifest))
        shards = _shards_in_folder(text)
        if not shards:
            raise StokerError(
                f"{text}: no shards in this folder (looked for {', '.join(SHARD_FORMATS)})"
            )
        return [(path, None) for path in shards]
    if text.lower().endswith(".json"):
        return list(read_manifest(text))
    return [(text, None)]
