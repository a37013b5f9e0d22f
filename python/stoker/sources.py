"""Turning what a user passes as a source into a list of shard paths and URLs."""

from __future__ import annotations

import fnmatch
import glob
import json
import os
import re
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Union

from stoker.errors import StokerError, UsageError, plural
from stoker.formats import (
    ARRAY_FORMATS,
    SHARD_FORMATS,
    is_url,
    is_zarr_store,
    join_url,
    shards_in_folder,
)
from stoker.manifest import MANIFEST_NAME, parse_manifest, read_local_manifest
from stoker.peers import INDEX_NAME, is_peer_index, peer_shards, read_peer_index
from stoker.remote.stores import is_object_url
from stoker.tables.arrow import is_saved_dataset, saved_dataset_files

Source = Union[str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]]]

_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


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


#: Lists the objects under a store prefix: (URL, size, ETag) each.
Lister = Callable[[str], "list[tuple[str, int, str | None]]"]


def resolve(
    source: Source,
    read_url: Callable[[str], bytes] | None = None,
    note_drift: bool = True,
    list_url: Lister | None = None,
    cache_dir: str | None = None,
    read_range: Callable[[str, int, int], bytes] | None = None,
) -> list[tuple[str, dict | None]]:
    """Shard paths and URLs for `source`, each with its manifest entry (or None), in order.

    `source` may be a folder (its ``stoker.json`` if it has one, else every shard under it,
    sorted), a manifest, a glob, a brace pattern, a path, an http(s) URL (of a shard or a
    manifest, read with `read_url`), an object in a store (``s3://``, ``gs://``: a shard, a
    manifest, a prefix ending in ``/`` or a glob, listed with `list_url`), or a list of
    any of these. A local manifest that no longer matches its folder is logged
    (`note_drift`). An MDS or LitData dataset (its ``index.json``, or the folder holding
    it) is read in place; its compressed shards are decompressed into `cache_dir`.
    """
    if isinstance(source, (list, tuple)):
        out: list[tuple[str, dict | None]] = []
        for item in source:
            out.extend(resolve(item, read_url, note_drift, list_url, cache_dir, read_range))
        return out
    if not isinstance(source, (str, os.PathLike)):
        raise UsageError(f"a source is a path, pattern or list of them, not {type(source)!r}")
    text = os.fspath(source)
    names = expand_braces(text)
    if len(names) > 1:
        return [
            entry
            for name in names
            for entry in resolve(name, read_url, note_drift, list_url, cache_dir, read_range)
        ]
    if is_object_url(text) and (text.endswith("/") or "/" not in text.partition("://")[2]):
        return _listed(text, text.rstrip("/") + "/", None, read_url, list_url, read_range)
    if is_object_url(text) and any(c in text for c in "*?["):
        prefix = text[: min(text.index(c) for c in "*?[" if c in text)]
        return _listed(text, prefix, text, read_url, list_url, read_range)
    if is_object_url(text) and not text.lower().endswith((".json", *SHARD_FORMATS)):
        raise StokerError(
            f"{text}: neither a shard ({', '.join(SHARD_FORMATS)}) nor a manifest (.json); "
            f"to list a prefix, end it with '/': {text}/"
        )
    if is_url(text):
        if urllib.parse.urlsplit(text).path.lower().endswith(".json"):
            if read_url is None:
                raise StokerError(f"{text}: a remote manifest needs a reader")
            data = read_url(text)
            if is_peer_index(urllib.parse.urlsplit(text).path):  # an MDS or LitData index?
                try:
                    index = json.loads(data)
                except ValueError:
                    index = None  # parse_manifest says what is wrong with it
                found = peer_shards(
                    index, text, lambda name: join_url(text, name), cache_dir, read_range
                )
                if found is not None:
                    return list(found)  # list(): a list of resolve's type, entries or None
            return list(parse_manifest(data, text))
        return [(text, None)]
    if _SCHEME.match(text):
        raise StokerError(f"{text}: sources are local paths, http(s) URLs, s3:// and gs://")
    if any(c in text for c in "*?["):
        matches = sorted(glob.glob(text, recursive=True))
        if not matches:
            raise StokerError(f"{text}: no files match this pattern")
        return [(path, None) for path in matches if not os.path.isdir(path)]
    if is_zarr_store(text):
        return [(text, None)]
    if os.path.isdir(text):
        if is_saved_dataset(text):  # datasets' save_to_disk: its Arrow files, in its order
            return [(path, None) for path in saved_dataset_files(text)]
        if os.path.isfile(os.path.join(text, "dataset_dict.json")):
            raise StokerError(
                f"{text}: a datasets DatasetDict (save_to_disk of several splits); open one "
                "split's folder: " + os.path.join(text, "train")
            )
        manifest = os.path.join(text, MANIFEST_NAME)
        if os.path.isfile(manifest):
            return list(read_local_manifest(manifest, note_drift))
        peer = os.path.join(text, INDEX_NAME)
        if os.path.isfile(peer):
            found = read_peer_index(peer, cache_dir)
            if found is not None:
                return list(found)
        shards = shards_in_folder(text)
        if not shards:
            raise StokerError(
                f"{text}: no shards in this folder (looked for {', '.join(SHARD_FORMATS)})"
            )
        return [(path, None) for path in shards]
    if text.endswith(("/", os.sep)):
        raise StokerError(f"{text}: no such folder")
    if is_peer_index(text) and os.path.isfile(text):
        found = read_peer_index(text, cache_dir)
        if found is not None:
            return list(found)
    if text.lower().endswith(".json"):
        return list(read_local_manifest(text, note_drift))
    known = (*SHARD_FORMATS, *ARRAY_FORMATS)
    if not os.path.exists(text) and os.path.splitext(text)[1].lower() not in known:
        raise StokerError(f"{text}: no such file or folder")
    return [(text, None)]


def _listed(
    text: str,
    prefix: str,
    pattern: str | None,
    read_url: Callable[[str], bytes] | None,
    list_url: Lister | None,
    read_range: Callable[[str, int, int], bytes] | None = None,
) -> list[tuple[str, dict | None]]:
    """The shards under a store prefix: its ``stoker.json`` if it has one (for a prefix
    that names a folder), else every shard object, in key order (only those matching
    `pattern`, a glob whose ``*`` also matches ``/``)."""
    if list_url is None or read_url is None:
        raise StokerError(f"{text}: a store listing needs a fetcher")
    objects = list_url(prefix)
    if pattern is None and any(url == prefix + MANIFEST_NAME for url, _, _ in objects):
        return list(parse_manifest(read_url(prefix + MANIFEST_NAME), prefix + MANIFEST_NAME))
    if pattern is None and any(url == prefix + INDEX_NAME for url, _, _ in objects):
        # An MDS or LitData dataset.
        return resolve(prefix + INDEX_NAME, read_url, list_url=list_url, read_range=read_range)
    found: list[tuple[str, dict | None]] = [
        (url, {"bytes": size, "listed": True, **({"etag": etag} if etag else {})})
        for url, size, etag in sorted(objects)
        if os.path.splitext(url.lower())[1] in SHARD_FORMATS
        and (pattern is None or fnmatch.fnmatchcase(url, pattern))
    ]
    if not found:
        raise StokerError(
            f"{text}: no shards there ({plural(len(objects), 'object')} under {prefix}; "
            f"looked for {', '.join(SHARD_FORMATS)})"
        )
    return found
