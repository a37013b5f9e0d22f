"""The exceptions stoker raises (defined by the extension, so C++ and Python
raise the same types) and a helper to raise them with a location."""

from __future__ import annotations

import os
from typing import TypeVar

from stoker._core import (
    ChecksumError,
    CudaError,
    CuFileError,
    FetchError,
    ReadError,
    ShardFormatError,
    StokerError,
)

__all__ = [
    "ChecksumError",
    "CudaError",
    "CuFileError",
    "FetchError",
    "ReadError",
    "ShardFormatError",
    "StokerError",
    "UsageError",
    "clip",
    "human",
    "located",
    "plural",
    "quoted",
]

E = TypeVar("E", bound=StokerError)


def located(
    cls: type[E], path: str | os.PathLike[str], offset: int, what: str, errno: int | None = None
) -> E:
    """An exception of `cls` about byte `offset` of `path`, worded as the C++ core words them
    (`errno`, for a ReadError, as the C++ core sets it)."""
    path = os.fspath(path)
    message = f"{path}: offset {offset}: {what}"
    error = cls(message) if errno is None else cls(errno, message)
    error.path = path
    error.offset = offset
    error.detail = what
    return error


def human(n: float) -> str:
    """A size as stoker prints sizes, in powers of 1000: ``20.1 MB``."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def plural(n: int, noun: str) -> str:
    """``1 shard``, ``2 shards``, ``1,200 samples``."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def quoted(text: object, limit: int = 200) -> str:
    """`text` (a key, a member name, bytes a server sent) quoted for a message, cut after
    `limit` characters: whatever comes from outside, a message stays readable."""
    if isinstance(text, (bytes, bytearray)):  # shown as C++ messages show them
        text = bytes(text).decode("utf-8", "backslashreplace")
    return clip(repr(text), limit, len(text) if isinstance(text, str) else None)


def clip(text: str, limit: int = 200, size: int | None = None) -> str:
    """`text` cut after `limit` characters, saying so: a message that quotes what another
    program said (a server's bytes in aiohttp's error) stays one readable line."""
    text = " ".join(text.split())  # one line, whatever it held
    if len(text) <= limit:
        return text
    return text[:limit] + f"... ({size if size is not None else len(text):,} characters in all)"


class UsageError(StokerError, TypeError, ValueError):
    """stoker was called with an argument it cannot use, of the wrong kind or value; the
    message says what to pass instead. Caught by ``except TypeError`` and ``except
    ValueError`` alike, as the built-in error for the same mistake would be."""

    __module__ = "stoker"  # raised and pickled as stoker.UsageError, as the others are
