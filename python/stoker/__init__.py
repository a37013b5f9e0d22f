"""stoker: keeps GPUs fed. A C++ data loader for PyTorch."""

from stoker._core import (
    ChecksumError,
    FetchError,
    FileTable,
    PendingRead,
    PinnedRing,
    ReadError,
    ShardFormatError,
    ShardReader,
    StokerError,
)
from stoker._core import __version__ as __version__
from stoker.dataset import Dataset
from stoker.fields import Bytes, Int, Npy, Raw
from stoker.loader import Loader
from stoker.remote import FetchOptions

__all__ = [
    "ChecksumError",
    "Bytes",
    "Dataset",
    "Int",
    "Loader",
    "Npy",
    "Raw",
    "FetchError",
    "FetchOptions",
    "FileTable",
    "PendingRead",
    "PinnedRing",
    "ReadError",
    "ShardFormatError",
    "ShardReader",
    "StokerError",
]
