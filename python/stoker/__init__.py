"""stoker: keeps GPUs fed. A C++ data loader for PyTorch."""

from stoker._core import (
    ChecksumError,
    FetchError,
    FileTable,
    PendingRead,
    ReadError,
    ShardFormatError,
    ShardReader,
    StokerError,
)
from stoker._core import __version__ as __version__
from stoker.dataset import Dataset

__all__ = [
    "ChecksumError",
    "Dataset",
    "FetchError",
    "FileTable",
    "PendingRead",
    "ReadError",
    "ShardFormatError",
    "ShardReader",
    "StokerError",
]
