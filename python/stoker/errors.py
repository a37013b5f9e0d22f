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
    "located",
]

E = TypeVar("E", bound=StokerError)


def located(cls: type[E], path: str | os.PathLike[str], offset: int, what: str) -> E:
    """An exception of `cls` about byte `offset` of `path`, worded as the C++ core words them."""
    path = os.fspath(path)
    error = cls(f"{path}: offset {offset}: {what}")
    error.path = path  # type: ignore[attr-defined]
    error.offset = offset  # type: ignore[attr-defined]
    return error
