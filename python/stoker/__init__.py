"""stoker: keeps GPUs fed. A C++ data loader for PyTorch."""

from stoker._core import (
    ChecksumError,
    CudaError,
    CuFileError,
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
from stoker._process import set_decoded_cache_bytes
from stoker.arrays import codec_status
from stoker.arrays.nifti import nifti_header
from stoker.cuda import FallbackWarning, cuda_status
from stoker.dataset import Dataset
from stoker.dataset.mix import Mix
from stoker.errors import UsageError
from stoker.fields import Bytes, Image, Int, Npy, Raw, Row
from stoker.gds import GDSCache, load_array, load_npy, read_into
from stoker.loader import Loader
from stoker.remote import FetchOptions
from stoker.volumes import (
    GridSampler,
    LabelSampler,
    PatchAggregator,
    PatchLoader,
    UniformSampler,
    Volumes,
)
from stoker.writer import ShardWriter

__all__ = [
    "ChecksumError",
    "Bytes",
    "Image",
    "CudaError",
    "CuFileError",
    "Dataset",
    "FallbackWarning",
    "GDSCache",
    "GridSampler",
    "Int",
    "LabelSampler",
    "Loader",
    "Mix",
    "Npy",
    "PatchAggregator",
    "PatchLoader",
    "Raw",
    "Row",
    "FetchError",
    "FetchOptions",
    "FileTable",
    "PendingRead",
    "PinnedRing",
    "ReadError",
    "ShardFormatError",
    "ShardReader",
    "ShardWriter",
    "StokerError",
    "UniformSampler",
    "UsageError",
    "Volumes",
    "codec_status",
    "cuda_status",
    "load_array",
    "load_npy",
    "nifti_header",
    "read_into",
    "set_decoded_cache_bytes",
]
