"""Type stubs for stoker's C++ extension."""

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__version__: str

class StokerError(Exception):
    path: str | None
    offset: int

class ShardFormatError(StokerError, ValueError): ...
class ReadError(StokerError, OSError): ...
class FetchError(StokerError, OSError): ...
class ChecksumError(FetchError): ...

class FileTable:
    def __init__(self, paths: Sequence[str], identities: npt.ArrayLike | None = None) -> None: ...
    def __len__(self) -> int: ...
    def __getitem__(self, i: int) -> str: ...
    @property
    def paths(self) -> list[str]: ...
    @property
    def identities(self) -> np.ndarray: ...

class PendingRead:
    def wait(self, timeout: float | None = None) -> Any: ...
    def done(self) -> bool: ...
    def cancel(self) -> None: ...
    def busy_seconds(self) -> float: ...

class ShardReader:
    def __init__(self, num_threads: int = 0, max_open_files: int = 256) -> None: ...
    @property
    def num_threads(self) -> int: ...
    @property
    def max_open_files(self) -> int: ...
    def open_files(self) -> int: ...
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
    ) -> PendingRead: ...

def index_shards(
    paths: Sequence[str], formats: Sequence[str], num_threads: int = 0
) -> list[dict[str, Any]]: ...
def bench_pread(
    files: FileTable,
    file_ids: npt.ArrayLike,
    offsets: npt.ArrayLike,
    lengths: npt.ArrayLike,
    num_threads: int = 0,
) -> float: ...
def default_num_threads() -> int: ...
def stat_files(paths: Sequence[str], num_threads: int = 0) -> tuple[np.ndarray, np.ndarray]: ...
