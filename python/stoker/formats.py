"""Shard formats: which format a file or URL is, by its name, and where shards are in a
folder. (What is inside each format is read by the C++ parsers: ``csrc/stoker/format``.)"""

from __future__ import annotations

import os
import urllib.parse

from stoker.errors import ShardFormatError, located

#: File name endings stoker reads, and the index parser for each.
SHARD_FORMATS = {".tar": "tar", ".zip": "zip", ".npy": "npy"}

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


def format_of(path: str) -> str:
    """The shard format of `path` (or URL), from its name; a clear error for anything else."""
    dot = path.rfind(".")
    if dot > path.rfind("/") and not is_url(path):  # the common case, cheaply
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
        from stoker.arrays import ARRAY_FORMATS, array_format

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
    """Every shard file under `folder`, sorted (folders walked in order)."""
    found = []
    from stoker.arrays import is_zarr_store

    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not is_zarr_store(os.path.join(root, d)))
        for name in sorted(files):
            if os.path.splitext(name.lower())[1] in SHARD_FORMATS:
                found.append(os.path.join(root, name))
    return found


def load_json(path: str, what: str) -> object:
    """The JSON document at `path` (`what` it should be, for the error otherwise)."""
    import json

    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError) as e:
        raise located(ShardFormatError, path, 0, f"not readable {what} ({e})") from e


def samples_and_fields(index: dict, fmt: str) -> tuple[int, list[str]]:
    """How many samples a shard's index (from the C++ indexer) holds, and their fields."""
    if fmt == "npy":
        return int(index["shape"][0]), ["npy"]
    if index.get("format") == "array":
        return int(index["rows"]), [field.name for field in index["fields"]]
    return len(index["keys"]), list(index["field_names"])
