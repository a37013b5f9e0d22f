"""Type stubs for stoker's C++ extension.

The docstrings of the public names here (the reader, its buffers, the errors) are what the
documentation site shows for them: the extension itself is not imported to build it.
"""

import enum
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from stoker._columns import ComputedColumn

__version__: str

class StokerError(Exception):
    """The base of every error stoker raises.

    An error about data names the file (or URL) and the byte offset, in its one-line
    message and as attributes, and, where the Loader knows them, the field and the
    sample's key. Anything quoted from outside (a member's name, a server's bytes) is cut
    to about 200 characters, saying how long the whole was.

    Attributes:
        path: The file or URL the error is about, or None.
        offset: The byte offset in it.
        detail: The message without its file and offset.
    """

    path: str | None
    offset: int
    detail: str  # the message without its file and offset

class ShardFormatError(StokerError, ValueError):
    """A shard's bytes are corrupt, truncated or in a form stoker does not read; also a
    shard replaced or rewritten after the dataset indexed it ("the file changed after it
    was indexed"), and a bad image with ``Image(on_error="raise")``."""

class ReadError(StokerError, OSError):
    """The operating system refused a read: a missing file, a directory, EIO, permissions.
    ``.errno`` is set."""

class FetchError(StokerError, OSError):
    """A remote shard could not be fetched after the retries, answered 4xx, or changed
    ("the shard changed", "the object changed"). Names the URL, the offset reached and
    the last cause."""

class ChecksumError(FetchError):
    """A remote shard's bytes keep differing from the sha256 its manifest gives."""

class CudaError(StokerError, RuntimeError):
    """CUDA is not usable here (no driver, no device, a CPU-only torch, a forked child of
    a CUDA process), or a driver call failed."""

class CuFileError(CudaError):
    """A cuFile (GPUDirect Storage) call failed. stoker falls back to its bounce path
    unless ``STOKER_GDS=on``."""

class ChunkFilter(enum.IntEnum):
    ZLIB = 0
    GZIP = 1
    ZSTD = 2
    BLOSC = 3
    SHUFFLE = 4
    FLETCHER32 = 5
    CRC32C = 6
    JPEG = 7
    HORIZONTAL_PREDICTOR = 8
    SNAPPY = 9
    LZ4_RAW = 10

#: JPEG's step params: the colour space the tiles store (TIFF photometric 6, converted
#: to RGB; photometric 2, as Aperio writes, left as it is).
JPEG_YCBCR: int
JPEG_RGB: int

class ColumnLayout:
    """Where the values of one Parquet leaf column of one file lie: its units (column
    chunks, or runs of their pages after the chunk's dictionary page), each read and
    decoded whole by the reader, kept in its decoded-chunk cache, and its rows copied out.
    Pickles.

    Args:
        name: For messages: ``"data.parquet: column image.bytes"``.
        file: The column's file, by its index in the FileTable.
        rows: The file's rows.
        width: Bytes of every value that is not null (0: they vary).
        integer: 1: signed, 2: unsigned integers of `width` bytes, which Int() widens to
            int64; 0: Int() parses values as text.
        units: ``(n, 7)`` uint64 rows of (first row, rows, offset, size, dictionary
            offset, dictionary size, row group), covering the rows in order.
        physical_type, type_length, max_definition, max_repetition, repeated_definition,
            codec: The column's Parquet type, levels and compression codec.
    """

    def __init__(
        self,
        name: str,
        file: int,
        rows: int,
        width: int,
        integer: int,
        units: npt.ArrayLike,
        physical_type: int,
        type_length: int,
        max_definition: int,
        max_repetition: int,
        repeated_definition: int,
        codec: int,
    ) -> None: ...
    @property
    def name(self) -> str: ...
    @property
    def file(self) -> int: ...
    @property
    def rows(self) -> int: ...
    @property
    def width(self) -> int: ...
    @property
    def units(self) -> np.ndarray: ...
    @property
    def stored_bytes(self) -> int: ...

class ArrayLayout:
    """Where the elements of one chunked array lie (an HDF5 dataset, a Zarr array, the
    tiles of a TIFF image): its chunk grid, each chunk's file, offset, size and filter
    mask (in C order over the grid; offset 2**64-1 for a chunk never written, which reads
    as `fill`), and the filters that encode them (`steps`, in the order the writer applied
    them). Edge chunks are stored whole. A layout pickles.

    Args:
        order: The axis order of a decoded chunk's bytes, outermost first (Zarr's F order
            or transpose); empty for C order.
        byteswap: Elements are stored big-endian: swapped after decoding (before the
            horizontal predictor, which works on values).
        jpeg_tables: The tables a JPEG step's abbreviated tiles leave out (TIFF tag 347),
            loaded before each tile; empty when each tile is a whole JPEG stream.
        clipped_edge: The last chunks along axis 0 are stored clipped to the array
            (TIFF's last strip holds only the image's remaining rows) instead of whole.

    Steps: ``(JPEG, JPEG_YCBCR or JPEG_RGB)`` decodes a tile to its uint8 (rows,
    columns, samples); ``(HORIZONTAL_PREDICTOR, element bytes)`` undoes TIFF's
    horizontal differencing along rows of the chunk's last two axes (columns, then a
    pixel's samples: give tiles of planes a last axis of 1).

    Raises:
        StokerError: The layout is inconsistent (named in the message), or a JPEG or
            predictor step does not fit its array (JPEG: uint8 elements in C order;
            predictor: its element size is the array's).
    """

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
        jpeg_tables: bytes = b"",
        clipped_edge: bool = False,
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
    def order(self) -> list[int]: ...
    @property
    def byteswap(self) -> bool: ...
    @property
    def jpeg_tables(self) -> bytes: ...
    @property
    def clipped_edge(self) -> bool: ...
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

def label_block_counts(labels: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The values present in `labels`, a C-contiguous array of 1- or 2-byte integers, as
    int64 (ascending), and the voxels of each per block of `block` voxels a side (shorter
    at the far edges): ``(values, counts)``, counts int64 of shape ``(len(values),
    *grid)``. Counted on every core with the GIL released.

    Raises:
        ValueError: `labels` is not such an array, or `block` is 0.
    """

def permute_into(src: np.ndarray, dst: np.ndarray) -> None:
    """Copy `src`, an array of any strides, into `dst`, a writable C-contiguous array of
    its shape and element size, in cache-sized tiles on several threads with the GIL
    released: a faster ``np.copyto`` for a transposed view (a batch of NIfTI patches
    turned from Fortran order). The two must not overlap.

    Raises:
        ValueError: `dst` is not writable and C-contiguous, or the two differ in shape or
            element size.
    """

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
    """The files a reader's requests refer to by index: ``FileTable(["a.tar", "b.tar"])``.
    A table pickles.

    Args:
        paths: The files, in the order requests' ``file_ids`` count them.
        identities: An optional ``(len(paths), 3)`` int64 array of (inode, size,
            mtime_ns) as the files were when indexed: a read of a file that no longer
            matches fails instead of reading other bytes.
        arrays: The array layouts that array-row requests name by index (for HDF5 and
            Zarr sources).
        columns: The column layouts that column-value requests name by index (for
            Parquet sources).

    Raises:
        ValueError: `identities` does not have shape ``(len(paths), 3)``, or a column
            names a file the table does not have.
    """

    def __init__(
        self,
        paths: Sequence[str],
        identities: npt.ArrayLike | None = None,
        arrays: Sequence[ArrayLayout] = ...,
        columns: Sequence[ColumnLayout] = ...,
    ) -> None: ...
    def extended(self, arrays: Sequence[ArrayLayout], columns: Sequence[ColumnLayout]) -> FileTable:
        """A table of the same files (their paths shared, not copied) with `arrays` and
        `columns` after its own. ValueError for a column that names a file the table does
        not have."""
    def __len__(self) -> int:
        """How many files."""
    def __getitem__(self, i: int) -> str:
        """The path of file `i`."""
    @property
    def paths(self) -> list[str]:
        """The files, in order."""
    @property
    def identities(self) -> np.ndarray:
        """The ``(n, 3)`` identities given, empty when none were."""
    @property
    def arrays(self) -> list[ArrayLayout]:
        """The array layouts given."""
    @property
    def columns(self) -> list[ColumnLayout]:
        """The column layouts given."""

class PendingRead:
    """A batch being read, as `ShardReader.read`, `ShardReader.read_into` and
    `ShardReader.read_boxes_into` return it.

    A batch does not need its reader to stay alive: whoever waits on it finishes it.
    Dropping a handle before it is done cancels what has not started and waits for what
    has.
    """

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the batch is read, with the GIL released and Ctrl-C honoured; the
        waiting thread reads pieces of the batch too, and once they are all taken, pieces
        of the reader's other batches in flight, oldest first, one at a time, while the
        batch's last are read.

        Args:
            timeout: Seconds to wait at most; None waits as long as it takes.

        Returns:
            The buffer: for `ShardReader.read`, a new page-aligned uint8 array; for
            `ShardReader.read_into`, the buffer given.

        Raises:
            StokerError: The batch's error (a ShardFormatError, ReadError, ...), or
                StokerError after `cancel`.
            TimeoutError: `timeout` passed first.
        """
    def done(self) -> bool:
        """Whether the batch has finished, read or failed."""
    def cancel(self) -> None:
        """Skip the pieces not yet started; `wait` then raises StokerError."""
    def busy_seconds(self) -> float:
        """Thread time spent reading and decoding this batch, summed over threads."""
    def bytes_read(self) -> int:
        """Bytes read from files for this batch so far: whole merged runs (their gaps
        included) and array chunks as stored; chunks the chunk cache served, and chunks
        never written, count nothing."""
    def blanked(self) -> np.ndarray:
        """The requests whose image did not decode and were filled with zeros (with
        ``Image(on_error="blank")``)."""
    def unsized_bytes(self) -> int:
        """Bytes of the values handed out where the reader left them, for which the
        batch's buffer had no room (table values not sized before the read)."""

class PinnedRing:
    """Reusable page-aligned host slots: ``ring.acquire(nbytes)`` hands out a uint8 array.

    A slot goes back to the ring only when that array and every view of it (tensors
    included) are gone, so a slot in use is never handed out twice, and batches kept are
    never overwritten. The reader's batch buffers come from such a ring, so reading costs
    no fresh memory per batch.

    With `device`, every slot is page-locked once, when it is made, for asynchronous
    copies to that device; the bounds then hold for every slot, live or idle (`acquire`
    waits for one to come back), and a slot a copy still reads is reused only once that
    copy has completed.

    Args:
        max_idle_slots: The most slots kept for reuse (with `device`: the most slots).
        max_idle_bytes: The most bytes of slots kept for reuse (with `device`: of all
            slots).
        device: A CUDA device index: page-lock the slots for copies to it.
    """

    def __init__(
        self,
        max_idle_slots: int = 16,
        max_idle_bytes: int = 256 << 20,
        *,
        device: int | None = None,
    ) -> None: ...
    def acquire(self, size: int, timeout: float | None = None) -> np.ndarray:
        """A slot of `size` bytes: a recycled one when one fits.

        Args:
            size: Bytes wanted.
            timeout: For a pinned ring, seconds to wait for a slot to come back (with the
                GIL released); None waits as long as it takes.

        Returns:
            A page-aligned uint8 array of `size` bytes.

        Raises:
            TimeoutError: Every slot was still held when `timeout` passed.
        """
    def idle_slots(self) -> int:
        """Slots waiting to be reused."""
    @property
    def pinned(self) -> bool:
        """Whether the slots are page-locked for device copies."""
    @property
    def slots(self) -> int:
        """Slots in existence (a ring without `device` counts its idle ones)."""
    @property
    def pinned_bytes(self) -> int:
        """Bytes of host memory this ring has page-locked now."""

class Event:
    def query(self) -> bool: ...
    def wait(self) -> None: ...
    def make_wait(self, stream: int) -> None:
        """Work queued on `stream` (a CUstream handle) from now on starts after this event."""

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
def gather_to_device(
    files: Sequence[CuFile | None],
    device: int,
    dest: int,
    dest_bytes: int,
    scratch: int,
    scratch_bytes: int,
    file_ids: npt.ArrayLike,
    offsets: npt.ArrayLike,
    lengths: npt.ArrayLike,
    dest_offsets: npt.ArrayLike,
    stream: int,
    consumer_stream: int | None = None,
    threads: int = 0,
    merge_gap: int = 8192,
    align: int = 4096,
) -> dict[str, Any]:
    """Runs of bytes of `files` (by file id) into device memory [dest, dest + dest_bytes):
    each span of a file (runs closer than `merge_gap` merged) read by cuFile into the
    scratch, then each run copied to dest + dest_offsets[i] on `stream`, runs of one length
    at constant strides in one 2-D copy. No copy out of the scratch may be pending at the
    call. Returns spans, reads, bytes_read, copies, copies_2d, rounds and the "event"
    recorded after the last copy (which `consumer_stream`, when given, waits for)."""

class ShardReader:
    """Reads whole batches of (file, offset, length) ranges into one buffer on a pool of
    C++ threads, with the GIL released.

    A batch is sorted by file and offset, and neighbouring ranges (gaps under 8 KiB) are
    merged into one ``preadv`` that scatters each piece straight into place; the work is
    cut into chunks that the pool's threads claim, as does the thread that waits.
    Descriptors stay open in a bounded LRU. After a ``fork()`` the child builds its own
    pool on first use.

    Args:
        num_threads: Pool threads; 0 means one fewer than the cores this process may run
            on (its cpuset), at least one, since the waiting thread reads too. Raise it
            for network file systems, where each read waits on the network.
        max_open_files: Descriptors kept open at most.

    Attributes:
        chunk_cache_bytes: Bytes of decoded array chunks (HDF5, Zarr) and Parquet units
            kept across batches, per process, at most; 0 keeps none. The cache starts at
            an eighth of it (32 MiB at most) and doubles whenever a chunk it dropped is
            asked for again. Setting it empties the cache.
    """

    def __init__(self, num_threads: int = 0, max_open_files: int = 256) -> None: ...
    chunk_cache_bytes: int
    @property
    def num_threads(self) -> int:
        """Pool threads."""
    @property
    def max_open_files(self) -> int:
        """Descriptors kept open at most."""
    def open_files(self) -> int:
        """Descriptors open now."""
    def forget(self, path: str) -> None:
        """Close the cached descriptor of `path`, if any (reads in flight keep theirs).

        Args:
            path: A file this reader may have open.
        """
    def batch_buffer(self, size: int) -> npt.NDArray[np.uint8]:
        """A page-aligned uint8 array of `size` bytes, its contents undefined, from the
        ring the reader's own batches come from.

        A recycled buffer, its pages already present, where one of about that size was let
        go of; it returns to the ring once the array and every view of it (tensors
        included) are gone. For a batch filled by several ``*_into`` reads.

        Args:
            size: Bytes.
        """
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
    ) -> PendingRead:
        """Start reading the pieces into a new page-aligned buffer of `size` bytes; piece i
        lands at ``dest_offsets[i]``. Every per-piece argument has one entry per piece.

        Args:
            files: The files `file_ids` index.
            file_ids: Each piece's file, an index into `files`.
            offsets: Each piece's byte offset in its file.
            lengths: Each piece's bytes in the file.
            dest_offsets: Where each piece lands in the buffer.
            size: The buffer's size in bytes.
            out_lengths: Each piece's bytes in the buffer once decoded (an inflated
                member's size); default: its length.
            codecs: How each piece is stored, as ``stoker._core.Codec`` values (stored,
                deflated, an ASCII integer, an image, an array row...); default: stored.
            crcs: Each piece's expected CRC-32, of its decoded bytes.
            check_crc: Which pieces' CRCs to check; default: the decoded ones (stored
                pieces are served as they are on disk). Needs `crcs`.
            arrays: For array-row pieces, the index of their layout in ``files.arrays``.

        Returns:
            The batch being read; ``wait()`` returns the buffer.

        Raises:
            ValueError: The per-piece arguments differ in length, or `check_crc` was
                given without `crcs`.
        """
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
    ) -> PendingRead:
        """Start reading the pieces into `dest`, as `read` reads into a new buffer.

        `dest` stays exported until the batch is read (a ``bytearray`` cannot be resized
        meanwhile). If the read fails, `dest` may hold some of the pieces.

        Args:
            dest: A writable C-contiguous buffer (a bytearray, a numpy array, a tensor's
                memory) large enough for every piece.
            files: As for `read`.
            file_ids: As for `read`.
            offsets: As for `read`.
            lengths: As for `read`.
            dest_offsets: Where each piece lands in `dest`.
            out_lengths: As for `read`.
            codecs: As for `read`.
            crcs: As for `read`.
            check_crc: As for `read`.
            arrays: As for `read`.

        Returns:
            The batch being read; ``wait()`` returns `dest`.

        Raises:
            ValueError: `dest` is not C-contiguous, or the per-piece arguments differ in
                length.
        """
    def read_value_sizes(
        self, files: FileTable, columns: npt.ArrayLike, rows: npt.ArrayLike
    ) -> PendingRead:
        """Read the size in bytes of row ``rows[i]`` of column ``files.columns[columns[i]]``
        as uint64 `i` of the buffer (``2**64 - 1``: the value is null). Each unit the rows
        lie in is decoded once, and kept for the reads of the values themselves."""
    def read_spans_into(
        self,
        dest: Any,
        files: FileTable,
        file_ids: npt.ArrayLike,
        offsets: npt.ArrayLike,
        lengths: npt.ArrayLike,
        dest_offsets: npt.ArrayLike,
        box_ids: npt.ArrayLike,
        extents: npt.ArrayLike,
        src_strides: npt.ArrayLike,
        dest_strides: npt.ArrayLike,
        itemsizes: npt.ArrayLike,
    ) -> PendingRead:
        """Start reading spans of files whole, keeping a strided box of each: a patch of a
        volume stored in place, its rows read a few long spans at a time and the short gaps
        between them dropped by the reader's threads.

        Span i is ``lengths[i]`` bytes at ``offsets[i]`` of ``files.paths[file_ids[i]]``.
        Element ``(j0, j1, ...)`` of box ``b = box_ids[i]``, ``itemsizes[b]`` bytes at byte
        ``sum(j_d * src_strides[b, d])`` of the span, lands at byte
        ``dest_offsets[i] + sum(j_d * dest_strides[b, d])`` of `dest`.

        Args:
            dest: A writable C-contiguous buffer, kept alive until the read is done.
            files: The table the spans' files are in.
            file_ids: ``(n,)``: each span's file.
            offsets: ``(n,)``: where each span starts in its file.
            lengths: ``(n,)``: each span's bytes.
            dest_offsets: ``(n,)``: where each span's box starts in `dest`.
            box_ids: ``(n,)``: each span's box, a row of the tables below.
            extents: ``(m, rank)``: each box's extent along each axis (an axis of extent
                1 pads a box to the others' rank).
            src_strides: ``(m, rank)``: each box's byte strides in its span.
            dest_strides: ``(m, rank)``: each box's byte strides in `dest`.
            itemsizes: ``(m,)``: each box's element size in bytes.

        Returns:
            The batch being read; ``wait()`` returns `dest`.

        Raises:
            ValueError: The arguments differ in length or shape, or a box id is out of range.
            StokerError: A box reaches past its span, or lands past the end of `dest`.
        """
    def read_boxes_into(
        self,
        dest: Any,
        files: FileTable,
        arrays: npt.ArrayLike,
        starts: npt.ArrayLike,
        extents: npt.ArrayLike,
        dest_offsets: npt.ArrayLike,
        dest_strides: npt.ArrayLike,
    ) -> PendingRead:
        """Start reading boxes (patches) of chunked arrays into `dest`, a writable
        C-contiguous buffer kept alive until the read is done.

        Box i is ``[starts[i], starts[i] + extents[i])`` along each axis of
        ``files.arrays[arrays[i]]``, inside the array (clip boxes at its edge and fill
        their padding yourself); its element ``(j0, j1, ...)`` lands at byte
        ``dest_offsets[i] + sum(j_d * dest_strides[i, d])`` of `dest`, so a box may go
        into a C-order patch buffer or any other strided view. Only the chunks the boxes
        touch are read and decoded, each once however many boxes share it, and decoded
        chunks are kept for later batches (``chunk_cache_bytes``). Chunks never written
        read as the fill value. Boxes of one call may be of different arrays of one rank.

        Args:
            dest: The buffer the boxes land in.
            files: The table whose ``arrays`` the boxes name.
            arrays: ``(n,)`` uint32: each box's array, an index into ``files.arrays``.
            starts: ``(n, rank)`` int64 (or uint64): each box's first element.
            extents: ``(n, rank)`` int64 (or uint64): each box's extent along each axis.
            dest_offsets: ``(n,)`` int64: where each box's first element lands in `dest`.
            dest_strides: ``(n, rank)`` int64: each box's byte strides in `dest`.

        Returns:
            The batch being read; ``wait()`` returns `dest`, ``bytes_read()`` the stored
            bytes read for it.

        Raises:
            ValueError: `dest` is not C-contiguous, the arguments' shapes differ, or a
                value is negative.
            StokerError: A box is not inside its array, has another rank, or would write
                outside `dest` (the message names the array).
        """

    def foresee_boxes(
        self,
        files: FileTable,
        arrays: npt.ArrayLike,
        starts: npt.ArrayLike,
        extents: npt.ArrayLike,
        batches: npt.ArrayLike,
        fresh: bool,
    ) -> None:
        """Say which boxes the batches ahead will read, so that the JPEG tiles of tiled
        arrays they touch are decoded once each, only in the part they take.

        A tile that more than one batch ahead reads is decoded once, in the part all of
        them copy out, and kept (``chunk_cache_bytes``) until the last of them has read
        it, where that costs less than decoding each batch's part; any other tile is
        decoded as it would be without foresight (whole and kept, or, for a box that
        needs no more than half of it, that part alone). What is foreseen only guides
        decoding: boxes read that were not foreseen are read as they would be anyway.
        Boxes of arrays not tiled with JPEG are passed over.

        Args:
            files: The table whose ``arrays`` the boxes name.
            arrays: ``(n,)`` uint32: each box's array, as for ``read_boxes_into``.
            starts: ``(n, rank)`` int64: each box's first element.
            extents: ``(n, rank)`` int64: each box's extent.
            batches: ``(n,)`` int64: the batch that will read each box, a batch's
                boxes one after another (a batch reads each tile it touches once, however
                many of its boxes share it).
            fresh: Forget what was foreseen for the table's arrays before (a new
                epoch).

        Raises:
            ValueError: The arguments' shapes differ, or a value is negative.
            StokerError: A box is not inside its array, or the boxes touch more than
                2**24 tiles.
        """

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
    ARRAY_BOX = 7
    COLUMN_VALUE = 8
    SPAN_BOX = 9

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
        columns: dict[str, np.ndarray | ComputedColumn],
        sample_first: np.ndarray | ComputedColumn,
        field_rows: Sequence[np.ndarray | ComputedColumn | None],
    ) -> None: ...

def keyed_permutation(n: int, keys: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Where each of `positions` (each in [0, n)) goes under the pseudo-random permutation of
    [0, n) that `keys` (uint64, one per Feistel round) choose."""

def keyed_generators(prefix: np.ndarray, tails: np.ndarray) -> np.ndarray:
    """The generator numpy's default_rng(key) makes, for each key: an (n, 5) uint64 array
    that generator_uniforms and generator_integers draw from. A key's 32-bit words (as
    SeedSequence splits its integers) are `prefix` then its row of `tails` (uint32, n
    rows)."""

def generator_uniforms(states: np.ndarray, count: int) -> np.ndarray:
    """`count` doubles in [0, 1) from each generator of `states` (keyed_generators'), as
    numpy's Generator.random(count) draws them: an (n, count) array. The states advance."""

def generator_integers(states: np.ndarray, highs: np.ndarray) -> np.ndarray:
    """One integer in [0, highs[i]) from each generator of `states` (keyed_generators'), as
    numpy's Generator.integers(highs[i]) draws an int64. The states advance."""

def keyed_shuffle(words: np.ndarray, n: int) -> np.ndarray:
    """The permutation of [0, n) (int64) that numpy's default_rng(key).permutation(n) makes;
    the key's 32-bit words (as SeedSequence splits its integers) are `words` (uint32)."""

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
    def values(
        self,
        field: int,
        buffer: np.ndarray,
        pending: PendingRead,
        copy: bool = False,
        dtype: np.dtype | None = None,
    ) -> list[np.ndarray]: ...
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
        # (low, high): any sequence of two, as pybind11 converts a std::pair
        scale: Sequence[float],
        ratio: Sequence[float],
        flip: bool,
        channels_last: bool,
        blank_on_error: bool,
    ) -> None: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def shape(self) -> tuple[int, int, int]: ...

def image_support() -> bool: ...
def jpeg_entropy_marks() -> tuple[bool, int, int]: ...
def allow_jpeg_skim(allowed: bool) -> bool: ...
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

# -- TIFF ---------------------------------------------------------------------------

class TiffDirectory:
    """One image directory (IFD) of a TIFF or BigTIFF file: its image, and where each of
    its tiles (or strips) lies. Read-only; values are as the file stores them, with TIFF's
    defaults where a tag is absent. Every tile (strip) lies inside the file, and there are
    as many as the image's grid needs."""

    @property
    def offset(self) -> int:
        """Where the IFD is in the file."""
    @property
    def big_endian(self) -> bool:
        """The file is big-endian (``MM``)."""
    @property
    def big_tiff(self) -> bool:
        """The file is a BigTIFF (8-byte offsets)."""
    @property
    def width(self) -> int:
        """ImageWidth (tag 256), in pixels."""
    @property
    def length(self) -> int:
        """ImageLength (tag 257), in pixels: the image's height."""
    @property
    def tile_width(self) -> int:
        """TileWidth (tag 322); 0 when the image is in strips."""
    @property
    def tile_length(self) -> int:
        """TileLength (tag 323); 0 when the image is in strips."""
    @property
    def rows_per_strip(self) -> int:
        """RowsPerStrip (tag 278); the image's length when absent."""
    @property
    def samples_per_pixel(self) -> int:
        """SamplesPerPixel (tag 277); 1 when absent."""
    @property
    def bits_per_sample(self) -> list[int]:
        """BitsPerSample (tag 258), as many values as stored; ``[1]`` when absent."""
    @property
    def sample_format(self) -> int:
        """SampleFormat (tag 339): 1 unsigned, 2 signed, 3 floating point; 1 when absent."""
    @property
    def compression(self) -> int:
        """Compression (tag 259): 1 none, 5 LZW, 7 JPEG, 8 deflate, ...; 1 when absent."""
    @property
    def photometric(self) -> int | None:
        """PhotometricInterpretation (tag 262); None when the file leaves it out."""
    @property
    def planar_config(self) -> int:
        """PlanarConfiguration (tag 284): 1 samples together, 2 one plane per sample."""
    @property
    def predictor(self) -> int:
        """Predictor (tag 317): 1 none, 2 horizontal differencing, 3 floating point."""
    @property
    def new_subfile_type(self) -> int:
        """NewSubfileType (tag 254): bit 0 set for a reduced-resolution image."""
    @property
    def jpeg_tables(self) -> bytes:
        """JPEGTables (tag 347), the tables every JPEG tile shares; empty when absent."""
    @property
    def ycbcr_subsampling(self) -> tuple[int, int]:
        """YCbCrSubSampling (tag 530), horizontal and vertical; (2, 2) when absent."""
    @property
    def description(self) -> str:
        """ImageDescription (tag 270) up to its first NUL; bytes that are not UTF-8 are
        kept with surrogateescape."""
    @property
    def offsets(self) -> np.ndarray:
        """Where each tile (strip) starts: a read-only uint64 array, tiles row by row,
        each plane after the other when ``planar_config`` is 2."""
    @property
    def byte_counts(self) -> np.ndarray:
        """How many bytes each tile (strip) has, as stored: a read-only uint64 array."""
    @property
    def sub_directories(self) -> list[TiffDirectory]:
        """The directories its SubIFDs (tag 330) point at: a pyramid's lower levels."""
    @property
    def tiled(self) -> bool:
        """The image is in tiles, not strips."""

def read_tiff(path: str) -> list[TiffDirectory]:
    """The directories of a TIFF or BigTIFF file's main IFD chain, in order, each with its
    SubIFDs. Reads only the directories, never image data. Raises ShardFormatError, naming
    the file and the byte offset, for anything malformed: a bad header, an IFD offset
    outside the file or a chain that loops, values or tiles past the end of the file, tile
    counts that do not match the image."""

# -- Parquet (csrc/stoker/format/parquet.hpp) ---------------------------------------

def parquet_footer(tail: Any, file_size: int, path: str) -> tuple[int, int]:
    """(offset, size) of the FileMetaData of a Parquet file of `file_size` bytes, from its
    last bytes `tail` (at least 8; the whole file, and its leading PAR1 is checked too).
    ShardFormatError for a file that is not Parquet, is cut off, or has an encrypted
    footer ("PARE")."""

def parquet_summaries(
    paths: list[str], num_threads: int = 0
) -> tuple[np.ndarray, list[np.ndarray], np.ndarray, np.ndarray]:
    """(rows, groups, identities, keys) of Parquet files, each from its footer alone, read
    on `num_threads` threads (0: a few per core): int64 rows per file, each file's row
    groups' rows (int64), an (n, 3) int64 array of (inode, size, mtime_ns), and a uint64 key
    equal for files whose columns read alike (schema, codecs, encodings). Raises the first
    file's error (ShardFormatError, ReadError), naming it."""

def parquet_metadata(data: Any, path: str, offset: int) -> dict[str, Any]:
    """The FileMetaData in `data` (found at file offset `offset`) as plain dicts and lists,
    keyed by the C++ structs' field names: version, num_rows, schema, row_groups (each
    with num_rows, total_byte_size and columns: path, type, codec, encodings, offsets and
    sizes), key_value (a list of (key, value)), created_by, encrypted; and leaves, each
    leaf column's path, schema_index, physical_type, type_length, max_definition,
    max_repetition and repeated_definition, in column-chunk order."""

def parquet_offset_index(data: Any, path: str, offset: int) -> dict[str, np.ndarray]:
    """A column chunk's offset index: "offset" (int64), "compressed_page_size" (int32,
    header included) and "first_row_index" (int64), one entry a page."""

def decode_parquet_chunk(
    data: Any,
    file_offset: int,
    rows: int,
    physical_type: int,
    type_length: int,
    max_definition: int,
    max_repetition: int,
    codec: int,
    name: str,
    path: str,
    repeated_definition: int = -1,
    max_decoded_bytes: int = ...,
    values_left: str = "copied",
    least_bytes_in_pages: int = 128,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """A whole column chunk (an optional dictionary page, then data pages, which start at
    file offset `file_offset`) of exactly `rows` rows, decoded: (offsets uint64[rows + 1],
    nulls uint8[rows] or None when no row is null, data uint8), read-only arrays;
    row r is data[offsets[r]:offsets[r + 1]]: one little-endian value of the
    physical type (BOOLEAN one byte), a byte array's bytes, or a list's elements back to
    back. `repeated_definition` (lists): the definition level at which an element is
    present, -1 for max_definition - 1. ShardFormatError naming `path`, the page header's
    offset, `name` and the page for anything damaged or unsupported. `values_left`
    ("copied", "pages" or "stored") decodes byte strings as the reader does, leaving them
    in their decompressed pages (of `least_bytes_in_pages` a row or more) or in `data`;
    they are gathered back to back here whichever it is."""
