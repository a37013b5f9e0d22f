"""Where a URL's shard lives under a cache root: a relative path of safe names only,
so that no URL can point outside the cache and no two URLs share a file."""

from __future__ import annotations

import functools
import hashlib
import os
import re
import urllib.parse

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def cache_name(url: str, sha256: str | None = None) -> str:
    """Where `url` lives under a cache root: ``host_port/its/path``, of safe names only,
    so no URL can point outside the cache. Where making it safe changed the path (or the
    URL has a query) a hash of the exact URL keeps two URLs from sharing a file; with a
    known sha256 the name carries it, so a republished shard is a new file."""
    folder, _, leaf = url.rpartition("/")
    if "?" in url or "#" in url or leaf in ("", ".", "..") or folder.endswith(":/"):
        host, pieces, changed = _safe_path(url)
    else:  # a manifest's shards share a few folders: each made safe once
        host, folder_pieces, changed = _safe_folder(folder)
        piece = _safe_piece(leaf)
        pieces, changed = [*folder_pieces, piece], changed or piece != leaf
    return _named(url, sha256, host, pieces, changed)


@functools.lru_cache(maxsize=256)
def _safe_folder(folder: str) -> tuple[str, tuple[str, ...], bool]:
    """_safe_path of a folder URL (no query), for the names of the files in it."""
    parts = urllib.parse.urlsplit(folder)
    host = _safe_host(parts)
    pieces = tuple(_safe_piece(p) for p in parts.path.split("/") if p not in ("", ".", ".."))
    return host, pieces, "/".join(pieces) != parts.path.lstrip("/")


def _safe_host(parts: urllib.parse.SplitResult) -> str:
    return _UNSAFE.sub("_", parts.hostname or "host") + (f"_{parts.port}" if parts.port else "")


def _safe_piece(piece: str) -> str:
    piece = _UNSAFE.sub("_", piece)
    return "_" + piece[1:] if piece.startswith(".") else piece


def _safe_path(url: str) -> tuple[str, list[str], bool]:
    parts = urllib.parse.urlsplit(url)
    host = _safe_host(parts)
    pieces = [_safe_piece(p) for p in parts.path.split("/") if p not in ("", ".", "..")]
    pieces = pieces or ["index"]
    changed = "/".join(pieces) != parts.path.strip("/") or bool(parts.query)
    return host, pieces, changed


def _named(url: str, sha256: str | None, host: str, pieces: list[str], changed: bool) -> str:
    tags = []
    if changed:
        tags.append(hashlib.sha1(url.encode()).hexdigest()[:12])
    if sha256:
        tags.append(sha256[:16])
    stem, ext = os.path.splitext(pieces[-1])
    if len(stem) > 120:
        tags.insert(0, hashlib.sha1(stem.encode()).hexdigest()[:12])
        stem = stem[:100]
    pieces[-1] = "-".join([stem, *tags]) + ext[:40]
    pieces = [
        p if len(p) <= 200 else p[:180] + hashlib.sha1(p.encode()).hexdigest()[:12] for p in pieces
    ]
    return os.path.join(host, *pieces)
