"""Type stubs for stoker's C++ extension."""

import enum
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__version__: str

class StokerError(Exception):
    path: str | None
    offset: int
    detail: str  # the message without its file and offset

class ShardFormatError(StokerError, ValueError): ...
class ReadError(StokerError, OSError): ...
class FetchError(StokerError, OSError): ...
class ChecksumError(FetchError): ...
class CudaError(StokerError, RuntimeError): ...
class CuFileError(CudaError): ...

class ChunkFilter(enum.IntEnum):
    ZLIB = 0
    GZIP = 1
    ZSTD = 2
    BLOSC = 3
    SHUFFLE = 4
    FLETCHER32 = 5
    CRC32C = 6

class ArrayLayout:
    def __init__(
        self,
        name: str,
        shape: Sequence[int],
        chunk_shape: Sequence[int],
        itemsize: int,
        fill: bytes,
        steps: Sequence[tuple[ChunkFilter, int]],
        paths: Sequence[str],
        chunk_file: npt.ArrayLike,
        chunk_offset: npt.ArrayLike,
        chunk_size: npt.ArrayLike,
        chunk_mask: npt.ArrayLike,
        order: Sequence[int] = ...,
        byteswap: bool = False,
    ) -> None: ...
    @property
    def name(self) -> str: ...
    @property
    def shape(self) -> list[int]: ...
    @property
    def chunk_shape(self) -> list[int]: ...
    @property
    def itemsize(self) -> int: ...
    @property
    def paths(self) -> list[str]: ...
    @property
    def steps(self) -> list[tuple[ChunkFilter, int]]: ...
    @property
    def row_bytes(self) -> int: ...
    @property
    def chunk_bytes(self) -> int: ...
    @property
    def chunks_per_row(self) -> int: ...
    @property
    def num_chunks(self) -> int: ...
    @property
    def stored_bytes(self) -> int: ...

def set_codec_search_dirs(dirs: Sequence[str]) -> None: ...
def codec_unavailable(filter: ChunkFilter) -> str: ...
def codec_library(filter: ChunkFilter) -> str: ...
def crc32c(data: Any) -> int: ...
def decompress(data: Any, size: int, filter: ChunkFilter, path: str) -> np.ndarray: ...

class GzipFile:
    def __init__(self, path: str) -> None: ...
    def read_into(self, dest: Any) -> None: ...
    def skip(self, n: int) -> None: ...
    def finish(self, max_trailing: int = 1 << 20) -> None: ...
    def at_end(self) -> bool: ...
    @property
    def produced(self) -> int: ...
    @property
    def path(self) -> str: ...

class FileTable:
    def __init__(
        self,
        paths: Sequence[str],
        identities: npt.ArrayLike | None = None,
        arrays: Sequence[ArrayLayout] = ...,
    ) -> None: ...
    def __len__(self) -> int: ...
    def __getitem__(self, i: int) -> str: ...
    @property
    def paths(self) -> list[str]: ...
    @property
    def identities(self) -> np.ndarray: ...
    @property
    def arrays(self) -> list[ArrayLayout]: ...

class PendingRead:
    def wait(self, timeout: float | None = None) -> Any: ...
    def done(self) -> bool: ...
    def cancel(self) -> None: ...
    def busy_seconds(self) -> float: ...
    def blanked(self) -> np.ndarray: ...

class PinnedRing:
    def __init__(
        self,
        max_idle_slots: int = 16,
        max_idle_bytes: int = 256 << 20,
        *,
        device: int | None = None,
    ) -> None: ...
    def acquire(self, size: int, timeout: float | None = None) -> np.ndarray: ...
    def idle_slots(self) -> int: ...
    @property
    def pinned(self) -> bool: ...
    @property
    def slots(self) -> int: ...
    @property
    def pinned_bytes(self) -> int: ...

class Event:
    def query(self) -> bool: ...
    def wait(self) -> None: ...

class CopyStream:
    def __init__(self, device: int) -> None: ...
    @property
    def device(self) -> int: ...
    @property
    def handle(self) -> int: ...
    def copy(self, src: np.ndarray, dst: int, consumer_stream: int) -> Event: ...
    def wait_for(self, stream: int) -> None: ...
    def record(self, stream: int | None = None) -> Event: ...

class CuFile:
    def __init__(self, path: str, device: int) -> None: ...
    @property
    def path(self) -> str: ...
    @property
    def direct(self) -> bool: ...
    def read(
        self,
        dst: int,
        size: int,
        file_offset: int,
        num_threads: int = 0,
        chunk_bytes: int = 16 << 20,
    ) -> None: ...
    def close(self) -> None: ...

def cuda_driver_status() -> dict[str, Any]: ...
def cufile_status(candidates: Sequence[str] = ...) -> dict[str, Any]: ...

class ShardReader:
    def __init__(self, num_threads: int = 0, max_open_files: int = 256) -> None: ...
    chunk_cache_bytes: int
    @property
    def num_threads(self) -> int: ...
    @property
    def max_open_files(self) -> int: ...
    def open_files(self) -> int: ...
    def forget(self, path: str) -> None: ...
    def read(
        self,
        files: FileTable,
        file_ids: npt.ArrayLike,
        offsets: npt.ArrayLike,
        lengths: npt.ArrayLike,
        dest_offsets: npt.ArrayLike,
        size: int,
        out_lengths: npt.ArrayLike | None = None,
        codecs: npt.ArrayLike | None = None,
        crcs: npt.ArrayLike | None = None,
        check_crc: npt.ArrayLike | None = None,
        arrays: npt.ArrayLike | None = None,
    ) -> PendingRead: ...
    def read_into(
        self,
        dest: Any,
        files: FileTable,
        file_ids: npt.ArrayLike,
        offsets: npt.ArrayLike,
        lengths: npt.ArrayLike,
        dest_offsets: npt.ArrayLike,
        out_lengths: npt.ArrayLike | None = None,
        codecs: npt.ArrayLike | None = None,
        crcs: npt.ArrayLike | None = None,
        check_crc: npt.ArrayLike | None = None,
        arrays: npt.ArrayLike | None = None,
    ) -> PendingRead: ...

def index_shards(
    paths: Sequence[str], formats: Sequence[str], num_threads: int = 0
) -> list[dict[str, Any]]: ...
def index_remote(
    label: str,
    size: int,
    format: str,
    read: Callable[[int, int], bytes],
    window: int = 65536,
) -> dict[str, Any]: ...
def bench_pread(
    files: FileTable,
    file_ids: npt.ArrayLike,
    offsets: npt.ArrayLike,
    lengths: npt.ArrayLike,
    num_threads: int = 0,
) -> float: ...
def default_num_threads() -> int: ...
def stat_files(paths: Sequence[str], num_threads: int = 0) -> tuple[np.ndarray, np.ndarray]: ...

# -- shard formats and member indexes ------------------------------------------------

SIDECAR_SUFFIX: str

class SidecarState(enum.IntEnum):
    NONE = 0
    USED = 1
    STALE = 2
    DAMAGED = 3

def write_member_index(
    paths: Sequence[str], formats: Sequence[str], num_threads: int = 0
) -> list[str | None]: ...
def npy_header(path: str) -> dict[str, Any]: ...

# -- the fields= plan ---------------------------------------------------------------

ALIGN: int

class Codec(enum.IntEnum):
    STORED = 0
    DEFLATE = 1
    ASCII_INT = 2
    DEFLATE_ASCII_INT = 3
    IMAGE = 4
    DEFLATE_IMAGE = 5
    ARRAY_ROW = 6

class FieldKind(enum.IntEnum):
    RAW = 0
    INT = 1
    NPY = 2
    BYTES = 3
    COLUMN = 4
    IMAGE = 5

class ShardColumns:
    def __init__(
        self,
        first_sample: int,
        columns: dict[str, np.ndarray],
        sample_first: np.ndarray,
        field_rows: Sequence[np.ndarray | None],
    ) -> None: ...

class MemberColumns:
    def __init__(
        self,
        shard_start: np.ndarray,
        resident: dict[int, ShardColumns],
        files: FileTable,
        decoder_row_bytes: Sequence[int],
        decoder_what: Sequence[str],
    ) -> None: ...

class PreparedBatch:
    @property
    def nbytes(self) -> int: ...
    def submit(self, reader: ShardReader, into: Any | None = None) -> PendingRead: ...
    def check(self, buffer: Any) -> None: ...
    def layout(
        self,
    ) -> list[tuple[int, int, tuple[str, tuple[int, ...], bool] | None, tuple | None]]: ...
    def pieces(self) -> tuple[np.ndarray, np.ndarray]: ...

class BatchPlan:
    def __init__(
        self,
        fields: Sequence[
            tuple[
                str,
                int,
                int,
                str,
                Sequence[str],
                Sequence[int],
                np.ndarray | None,
                ImageTarget | None,
            ]
        ],
    ) -> None: ...
    def prepare(
        self,
        indices: npt.ArrayLike,
        members: MemberColumns,
        key_of: Callable[[int], str],
        augment_seed: int = 0,
    ) -> PreparedBatch: ...

# -- images -------------------------------------------------------------------------

MAX_IMAGE_PIXELS: int

class Crop(enum.IntEnum):
    RANDOM = 0
    CENTER = 1
    NONE = 2

class ImageTarget:
    def __init__(
        self,
        height: int,
        width: int,
        crop: Crop,
        scale: tuple[float, float],
        ratio: tuple[float, float],
        flip: bool,
        channels_last: bool,
        blank_on_error: bool,
    ) -> None: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def shape(self) -> tuple[int, int, int]: ...

def image_support() -> bool: ...
def decode_image(
    data: Any, target: ImageTarget, seed: int = 0, name: str = "<image>"
) -> np.ndarray: ...
def image_box(
    width: int, height: int, target: ImageTarget, seed: int = 0
) -> tuple[float, float, float, float, bool]: ...
def decode_rgb(data: Any, name: str = "<image>") -> np.ndarray: ...
def shrink_jpegs(
    images: Sequence[bytes],
    shorter_side: int,
    quality: int,
    num_threads: int,
    names: Sequence[str],
) -> tuple[list[bytes | None], list[str | None]]: ...
def bench_decode(images: Sequence[bytes], height: int, width: int, num_threads: int) -> float: ...
