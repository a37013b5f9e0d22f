"""Shard formats: which format a file or URL is, by its name, and where shards are in a
folder. (What is inside each format is read by the C++ parsers: ``csrc/stoker/format``.)"""

from __future__ import annotations

import logging
import os
import urllib.parse

from stoker._work import WORK_FOLDER
from stoker.errors import ShardFormatError, located

#: File name endings stoker reads, and the index parser for each.
SHARD_FORMATS = {
    ".tar": "tar",
    ".zip": "zip",
    ".npy": "npy",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
#: The formats of table sources (indexed by ``stoker.tables`` from their metadata, not by
#: the C++ indexer): their rows are samples, their columns fields.
TABLE_SOURCES = ("parquet", "arrow")

_COMPRESSED_TAR = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst")


def is_url(text: str) -> bool:
    """Whether `text` names something remote: an http(s) URL or an object in a store
    (``s3://``, ``gs://``)."""
    return text.startswith(("http://", "https://", "s3://", "gs://"))


def join_url(base: str, relative: str) -> str:
    """`relative` (a manifest's shard path) resolved against the URL `base`."""
    if is_url(relative):
        return relative
    if not base.startswith(("s3://", "gs://")):
        if _plain(base) and _plain(relative) and ":" not in relative and base.count("/") > 2:
            # A manifest's usual entry, a name under the manifest's folder: what urljoin
            # makes of it, without its parsing (a hundred thousand entries).
            segments = relative.split("/")
            if "" not in segments and "." not in segments and ".." not in segments:
                return base[: base.rfind("/") + 1] + relative
        return urllib.parse.urljoin(base, relative)
    # An object's key is a name, not a path: joined as written (no `//` collapsed, no
    # `:` taken for a scheme); only `.` and `..` segments are resolved.
    scheme, _, rest = base.partition("://")
    bucket, _, key = rest.partition("/")
    parts = [] if relative.startswith("/") else key.split("/")[:-1]
    for segment in relative.lstrip("/").split("/"):
        if segment == "..":
            if parts:
                parts.pop()
        elif segment != ".":
            parts.append(segment)
    return f"{scheme}://{bucket}/" + "/".join(parts)


def _plain(text: str) -> bool:
    """No query, fragment, control character or space at either end (which URL parsing
    drops): a URL's path is its text after the host."""
    return "?" not in text and "#" not in text and text.isprintable() and text == text.strip()


ARRAY_FORMATS = {".h5": "hdf5", ".hdf5": "hdf5", ".hdf": "hdf5", ".zarr": "zarr"}
#: The formats of array sources (indexed by ``stoker.arrays``, not by the C++ indexer).
ARRAY_SOURCES = tuple(dict.fromkeys(ARRAY_FORMATS.values()))
_ZARR_MARKERS = ("zarr.json", ".zarray", ".zgroup")


def is_zarr_store(path: str) -> bool:
    """Whether `path` is a local Zarr v2 or v3 group or array (a folder with its JSON)."""
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, m)) for m in _ZARR_MARKERS)


def array_format(path: str) -> str | None:
    """ "hdf5" or "zarr" for an array source, else None."""
    if is_zarr_store(path):
        return "zarr"
    return ARRAY_FORMATS.get(os.path.splitext(path.rstrip("/" + os.sep).lower())[1])


def format_of(path: str) -> str:
    """The shard format of `path` (or URL), from its name; a clear error for anything else."""
    dot = path.rfind(".")
    if dot > path.rfind("/") and (not is_url(path) or (_plain(path) and path.count("/") > 2)):
        found = SHARD_FORMATS.get(path[dot:].lower())
        if found is not None:
            return found
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
        if is_url(path) and os.path.splitext(lower.rstrip("/"))[1] in ARRAY_FORMATS:
            raise located(
                ShardFormatError,
                path,
                0,
                "HDF5 files and Zarr stores are read from a local disk: copy it there first, "
                "or pack it into shards (stoker pack) to serve it",
            )
        fmt = None if is_url(path) else array_format(path)
    if fmt is None:
        raise located(
            ShardFormatError,
            path,
            0,
            f"unknown shard format (stoker reads {', '.join(sorted(SHARD_FORMATS))} shards, "
            "and HDF5 files and Zarr stores as array sources)",
        )
    return fmt


def shards_in_folder(folder: str) -> list[str]:
    """Every shard file under `folder`, sorted (folders walked in order). Hidden folders
    and files are not read: a writer keeps its unfinished work in one (see stoker._work),
    and tools keep theirs (``.git``, ``.cache``); a skipped writer's folder or hidden shard
    is said once."""
    found, skipped = [], []
    for root, dirs, files in os.walk(folder):
        hidden = [d for d in dirs if d.startswith(".")]
        skipped += [os.path.join(root, d) for d in hidden if WORK_FOLDER.match(d)]
        dirs[:] = sorted(
            d for d in dirs if d not in hidden and not is_zarr_store(os.path.join(root, d))
        )
        for name in sorted(files):
            if os.path.splitext(name.lower())[1] in SHARD_FORMATS:
                if name.startswith("."):
                    skipped.append(os.path.join(root, name))
                else:
                    found.append(os.path.join(root, name))
    if skipped:
        logging.getLogger("stoker.dataset").warning(
            "%s: skipped %d hidden entr%s (%s): a hidden folder or file is never read as "
            "data (a writer keeps its unfinished work in one, .stoker-writer-... or "
            ".stoker-pack-...)",
            folder,
            len(skipped),
            "y" if len(skipped) == 1 else "ies",
            ", ".join(os.path.relpath(p, folder) for p in skipped[:3])
            + (", ..." if len(skipped) > 3 else ""),
        )
    return found


def samples_and_fields(index: dict, fmt: str) -> tuple[int, list[str]]:
    """How many samples a shard's index (from the C++ indexer) holds, and their fields."""
    if fmt == "npy":
        return int(index["shape"][0]), ["npy"]
    if index.get("format") == "array":
        return int(index["rows"]), [field.name for field in index["fields"]]
    if index.get("format") == "table":
        usable = [field.name.lower() for field in index["fields"] if not field.unusable]
        return int(index["rows"]), usable
    return len(index["keys"]), list(index["field_names"])
