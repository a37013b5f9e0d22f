"""Large arrays straight into device memory: ``load_npy``, ``load_array`` (.npy and NIfTI
volumes), ``read_into`` and ``GDSCache``.

With GPUDirect Storage (cuFile with nvidia-fs or PCI P2PDMA, on a file system it supports)
the bytes go from disk to the GPU without a host copy. Anywhere else they take the bounce
path: parallel ``pread``s into pinned ring slots, each slot copied to the device
asynchronously while the next ones are read. A gzipped volume (.nii.gz) is inflated by the
C++ core into the same slots, one after another, each copied while the next is inflated.
Whatever the path, the bytes are exact; a fallback from the path asked for is reported
once, with its reason, as a FallbackWarning.
"""

from __future__ import annotations

import os
import re
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

import stoker._core as _core
import stoker.cuda as cuda
from stoker._files import write_atomically
from stoker._process import per_process, shared_reader
from stoker.arrays import nifti
from stoker.cufile import cufile_handle, file_mode, rule_out
from stoker.cufile import read_mode as read_mode
from stoker.errors import (
    CuFileError,
    ReadError,
    ShardFormatError,
    StokerError,
    UsageError,
    located,
)
from stoker.npy_pages import PAGE, npy_layout, page_aligned_header

_BOUNCE_CHUNK = 16 << 20  # bytes per pinned slot on the bounce path
_BOUNCE_DEPTH = 4  # slots in flight: being read, and being copied
_READ_PIECE = 4 << 20  # one pread's share of a chunk, so threads split it


def _torch_dtype(dtype: np.dtype, path: str) -> Any:
    torch = cuda.require_torch()
    try:
        return torch.from_numpy(np.empty(0, dtype)).dtype
    except TypeError as e:
        raise located(StokerError, path, 0, f"torch has no tensor type for {dtype}") from e


def load_npy(path: str | os.PathLike[str], device: Any = "cuda") -> Any:
    """The whole .npy at `path` as a tensor on `device` ("cpu", "cuda", "cuda:N").

    On a GPU the array goes straight into device memory with cuFile (GPUDirect Storage)
    where the file and the machine allow, else through the pinned bounce ring; on the
    CPU the reader's threads read it. The bytes are exact on every path; a fallback is
    announced once per reason with a FallbackWarning.

    Args:
        path: A ``.npy`` file, format version 1, 2 or 3.
        device: Where the tensor is made.

    Returns:
        A tensor of the array's dtype and shape.

    Raises:
        ShardFormatError: A Fortran-ordered, object or byte-swapped array, or a file
            shorter than its header says.
        ReadError: The file cannot be read.
        CudaError: `device` names a GPU that cannot be used in this process.
    """
    path = os.fspath(path)
    dtype, shape, offset, nbytes, _ = npy_layout(path)
    return _load(path, dtype, shape, offset, nbytes, device)


def load_array(path: str | os.PathLike[str], device: Any = "cuda", *, scale: bool = False) -> Any:
    """The whole array in the file at `path` as a tensor on `device` ("cpu", "cuda",
    "cuda:N"), by the file's name: a ``.npy`` (as ``load_npy``), or a NIfTI-1/NIfTI-2
    volume, ``.nii`` or gzipped ``.nii.gz``.

    A ``.nii`` takes load_npy's paths (cuFile straight into device memory where it can, the
    pinned bounce ring otherwise). A ``.nii.gz`` has no random access: the C++ core
    inflates it from its start, into the tensor's memory on the CPU, or into pinned slots
    each copied to the device while the next is inflated.

    A NIfTI volume comes back indexed ``[x, y, z, ...]`` as nibabel indexes it, with the
    values ``img.dataobj.get_unscaled()`` holds: as the file stores the first index fastest,
    that is a view with reversed axes over the stored bytes, not contiguous; call
    ``.contiguous()`` where a contiguous tensor is needed. RGB24 and RGBA32 voxels get a
    last axis of 3 or 4 uint8 components. A big-endian file's values are byte-swapped
    after the read (on the device for device="cuda"), so the tensor is in native order.

    scale=True applies the header's scl_slope and scl_inter (``value * slope + inter``, as
    nibabel's ``get_fdata``, when slope is neither 0 nor NaN) and returns float32 on the
    same device; without scaling factors the values are only converted to float32. A .npy
    has none: scale=True gives its values as float32.

    ``stoker.nifti_header(path)`` tells a volume's type, shape and offsets without reading
    it.

    Args:
        path: A ``.npy``, ``.nii`` or ``.nii.gz`` file (not a ``.hdr``/``.img`` pair).
        device: Where the tensor is made.
        scale: Apply the NIfTI scaling factors and return float32, as above.

    Returns:
        A tensor on `device`.

    Raises:
        ShardFormatError: A header that cannot be right, the voxel file of a pair, or a
            truncated or corrupt file, naming the file and the offset.
        UsageError: The file is none of ``.npy``, ``.nii`` and ``.nii.gz``.
        CudaError: `device` names a GPU that cannot be used in this process.
    """
    path = os.fspath(path)
    name = path.lower()
    if name.endswith(".npy"):
        out = load_npy(path, device)
        return out.to(cuda.require_torch().float32) if scale else out
    if name.endswith(nifti.PAIR_DATA_SUFFIXES):
        raise located(
            ShardFormatError,
            path,
            0,
            "the voxel file of a .hdr/.img pair; load_array reads single-file NIfTI "
            "(.nii, .nii.gz): save the volume as one .nii",
        )
    if not name.endswith(nifti.NIFTI_SUFFIXES):
        raise UsageError(f"load_array reads .npy, .nii and .nii.gz files; {path} is none of them")
    header, stream = nifti.open_header(path)
    if scale:
        nifti.scale_factors(header)  # a volume that cannot be scaled is refused before it is read
    dtype, shape = header.dtype, header.stored_shape
    if stream is None:
        out = _load(path, dtype, shape, header.offset, header.nbytes, device)
    else:
        out = _inflate(stream, header, device)
    return nifti.finish(out, header, scale=scale)


def _load(
    path: str, dtype: np.dtype, shape: tuple[int, ...], offset: int, nbytes: int, device: Any
) -> Any:
    """The C-order array of `dtype` and `shape` stored at `offset` of `path` (`nbytes`
    bytes), as a tensor on `device`: load_npy's body, and a .nii's."""
    torch = cuda.require_torch()
    index = cuda.device_index(device)
    tdtype = _torch_dtype(dtype, path)
    if index is None:
        out = torch.empty(shape, dtype=tdtype)
        _read_host(out, path, offset)
        return out
    cuda.require_cuda(index)
    mem = cuda.memory()
    # One page more than needed, so the data can start where the file's page boundaries
    # fall: the aligned middle then goes straight from disk.
    buffer, address = mem.empty(nbytes + PAGE, index, cuda.copy_stream(index).handle)
    mem.hand_over(buffer, index)
    # Sharing the file's page offset needs the data's offset to be a multiple of the item
    # size (numpy pads headers so; other writers may not), or the view could not be typed.
    skew = (offset - address) % PAGE if offset % dtype.itemsize == 0 else 0
    _read_device(address + skew, nbytes, path, offset, index, users=False)
    return mem.view(buffer, skew, nbytes, tdtype, shape)


def _inflate(stream: Any, header: nifti.NiftiHeader, device: Any) -> Any:
    """The voxels of a gzipped NIfTI volume (`stream`, just after its header) as the C-order
    tensor of header.stored_shape on `device`, inflated with no intermediate copy: into the
    tensor's memory on the CPU, else into the pinned bounce slots, copied to the device."""
    torch = cuda.require_torch()
    index = cuda.device_index(device)
    tdtype = _torch_dtype(header.dtype, header.path)
    shape, nbytes = header.stored_shape, header.nbytes
    if index is None:
        stream.skip(header.offset - stream.produced)
        out = torch.empty(shape, dtype=tdtype)
        if nbytes:
            stream.read_into(out.reshape(-1).view(torch.uint8).numpy())
        stream.finish()  # every member's CRC-32 and length, the last one's too
        return out
    cuda.require_cuda(index)
    stream.skip(header.offset - stream.produced)
    mem = cuda.memory()
    buffer, address = mem.empty(nbytes, index, cuda.copy_stream(index).handle)
    mem.hand_over(buffer, index)
    _inflate_to_device(stream, address, nbytes, index)
    stream.finish()
    return mem.view(buffer, 0, nbytes, tdtype, shape)


def read_into(tensor: Any, path: str | os.PathLike[str], offset: int = 0) -> Any:
    """Fill `tensor` (contiguous, on the CPU or a CUDA device) with its size in bytes read
    from `path` at `offset`; returns it.

    On a GPU the copies wait, on the device, for work already queued on the caller's
    current stream; the paths are those of `load_npy`.

    Args:
        tensor: A contiguous tensor; its bytes are overwritten.
        path: The file to read.
        offset: Where in the file the bytes start, non-negative.

    Returns:
        `tensor`.

    Raises:
        ReadError: The file cannot be read, or ends before ``offset`` plus the tensor's
            size.
        StokerError: A negative offset, or a tensor that is not contiguous or neither on
            the CPU nor on a CUDA device.
    """
    path = os.fspath(path)
    if offset < 0:
        raise StokerError(f"read_into: offset {offset} is negative")
    if not tensor.is_contiguous():
        raise StokerError("read_into needs a contiguous tensor (use .contiguous() first)")
    nbytes = tensor.numel() * tensor.element_size()
    try:
        size = os.stat(path).st_size
    except OSError as e:
        raise located(ReadError, path, offset, f"cannot read: {e.strerror or e}") from e
    if offset + nbytes > size:
        raise located(
            ReadError,
            path,
            offset,
            f"asks for {nbytes} bytes but the file has "
            f"{size}: it ends {offset + nbytes - size} bytes short",
        )
    if tensor.device.type == "cpu":
        _read_host(tensor, path, offset)
        return tensor
    if tensor.device.type != "cuda":
        raise StokerError(f"read_into: a tensor on {tensor.device} is neither CPU nor CUDA")
    index = tensor.device.index if tensor.device.index is not None else 0
    cuda.require_cuda(index)
    if nbytes:
        _read_device(tensor.data_ptr(), nbytes, path, offset, index, users=True)
    return tensor


def _pieces(offset: int, nbytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """File offsets, lengths and destination offsets that split a read among threads."""
    starts = np.arange(0, nbytes, _READ_PIECE, dtype=np.uint64)
    lengths = np.minimum(np.uint64(_READ_PIECE), np.uint64(nbytes) - starts)
    return starts + np.uint64(offset), lengths, starts


def _read_pieces(dest: np.ndarray, files: Any, offset: int) -> Any:
    offsets, lengths, dests = _pieces(offset, dest.nbytes)
    return shared_reader().read_into(
        dest, files, np.zeros(len(offsets), np.uint32), offsets, lengths, dests
    )


def _read_host(tensor: Any, path: str, offset: int) -> None:
    torch = cuda.require_torch()
    raw = tensor.reshape(-1).view(torch.uint8).numpy()
    if raw.nbytes:
        _read_pieces(raw, _core.FileTable([path]), offset).wait()


# -- the device paths -------------------------------------------------------


def _bounce_ring(device: int) -> tuple[Any, threading.Lock]:
    """This process's bounce ring for `device`, and the lock that gives one read at a time
    all of its slots (two reads sharing four slots could each hold some and wait for the
    rest forever)."""

    def make() -> tuple[Any, threading.Lock]:
        ring = _core.PinnedRing(_BOUNCE_DEPTH, _BOUNCE_DEPTH * _BOUNCE_CHUNK, device=device)
        return ring, threading.Lock()

    return per_process(("bounce-ring", device), make)


def _bounce(address: int, nbytes: int, path: str, offset: int, device: int) -> None:
    """pread into pinned slots on the reader's threads, several slots in flight, each copied
    to the device asynchronously as soon as it is read."""
    ring, one_at_a_time = _bounce_ring(device)
    stream = cuda.copy_stream(device)
    consumer = cuda.memory().consumer_stream(device)
    files = _core.FileTable([path])
    reading: deque[tuple[int, Any]] = deque()

    def copy_oldest() -> None:
        at, pending = reading.popleft()
        stream.copy(pending.wait(), address + at, consumer)

    with one_at_a_time:
        try:
            for start in range(0, nbytes, _BOUNCE_CHUNK):
                if len(reading) >= _BOUNCE_DEPTH - 1:  # a slot stays free for copies in flight
                    copy_oldest()
                slot = ring.acquire(min(_BOUNCE_CHUNK, nbytes - start))
                reading.append((start, _read_pieces(slot, files, offset + start)))
                del slot  # the read holds it until it is copied
            while reading:
                copy_oldest()
        finally:
            for _, pending in reading:  # after an error: stop what was not copied
                pending.cancel()


def _inflate_to_device(stream: Any, address: int, nbytes: int, device: int) -> None:
    """The next `nbytes` of a GzipFile to device bytes [address, address + nbytes): each
    pinned slot inflated on this thread (GIL released), then copied asynchronously while
    the next one is inflated. A slot goes back to the ring once its copy has completed."""
    ring, one_at_a_time = _bounce_ring(device)
    copies = cuda.copy_stream(device)
    consumer = cuda.memory().consumer_stream(device)
    with one_at_a_time:
        for start in range(0, nbytes, _BOUNCE_CHUNK):
            slot = ring.acquire(min(_BOUNCE_CHUNK, nbytes - start))
            stream.read_into(slot)
            copies.copy(slot, address + start, consumer)
            del slot  # the copy holds it until it has completed


def _cufile(address: int, nbytes: int, path: str, offset: int, device: int) -> None:
    """cuFile for the page-aligned middle of the range, when device and file pages line up;
    the head and tail (under a page each) take the bounce path."""
    head = min(-offset % PAGE, nbytes)
    middle = (nbytes - head) // PAGE * PAGE
    if middle == 0:  # under a page or two: not worth a direct read
        _bounce(address, nbytes, path, offset, device)
        return
    if (address + head) % PAGE:
        head, middle = 0, nbytes  # not lined up: cuFile handles unaligned ranges itself
    tail = nbytes - head - middle
    cufile_handle(path, device).read(address + head, middle, offset + head)
    if head:
        _bounce(address, head, path, offset, device)
    if tail:
        _bounce(address + head + middle, tail, path, offset + head + middle, device)


def _read_device(
    address: int, nbytes: int, path: str, offset: int, device: int, *, users: bool
) -> None:
    """Fill device bytes [address, address + nbytes) from the file. `users`: the memory
    is the caller's (read_into), so work already queued on the caller's stream may still
    use it; otherwise it was allocated for stoker's copy stream (load_npy)."""
    if nbytes == 0:
        return
    stream = cuda.copy_stream(device)
    consumer = cuda.memory().consumer_stream(device)
    mode, why = file_mode(path)
    if mode in ("gds", "compat"):
        # cuFile writes from the host, outside any stream: what is queued on the streams
        # that may still use this memory is waited for first.
        stream.record().wait()
        if users:
            stream.record(consumer).wait()
        try:
            _cufile(address, nbytes, path, offset, device)
            return
        except CuFileError as e:
            if cuda.gds_setting() == "on":
                raise
            # Not tried again on this file system: its next reads go straight to the ring.
            rule_out(path, str(e))
            cuda.warn_once(
                "cufile-failed",
                f"stoker: cuFile failed ({e}); reading through the pinned bounce ring instead",
            )
    elif why and cuda.gds_setting() != "off":
        cuda.warn_once(f"bounce:{why}", f"stoker: {why}")
    if users:  # copies wait, on the device, for the caller's queued work
        stream.wait_for(consumer)
    _bounce(address, nbytes, path, offset, device)


# -- the cache ---------------------------------------------------------------

_KEY = re.compile(r"[A-Za-z0-9_.=+-][A-Za-z0-9_.=+ -]*")


class GDSCache:
    """Arrays kept between epochs as .npy files whose data starts on a 4 KiB boundary, so
    that ``get`` reads them with GPUDirect where it can (``numpy.load`` reads them too).
    For preprocessed volumes (CT, MRI) that are costly to make and large to move, and for
    gzipped NIfTI volumes, inflated once by ``put(key, "scan.nii.gz")`` and then read by
    every epoch's ``get`` straight into device memory.

    Each entry is ``<key>.npy`` in `cache_dir`, written atomically (a temporary file,
    fsync, rename) with its header padded so that the data starts at 4096. Keys are
    plain names: letters, digits, ``_ . = + -`` (and inner spaces); ``key in cache``
    tells whether one is there.

    Args:
        cache_dir: The folder the entries live in; made if missing.
    """

    def __init__(self, cache_dir: str | os.PathLike[str]) -> None:
        self.cache_dir = os.fspath(cache_dir)
        os.makedirs(self.cache_dir, exist_ok=True)

    def path(self, key: str) -> str:
        """The file that holds (or would hold) `key`.

        Args:
            key: An entry's name.

        Raises:
            StokerError: `key` is not a plain name.
        """
        if not isinstance(key, str) or not _KEY.fullmatch(key) or key in (".", ".."):
            raise StokerError(
                f"GDSCache key {key!r}: use letters, digits and _ . = + - (and inner spaces); "
                "no path separators"
            )
        return os.path.join(self.cache_dir, key + ".npy")

    def __contains__(self, key: str) -> bool:
        """Whether an entry `key` is stored."""
        return os.path.exists(self.path(key))

    def put(self, key: str, source: Any) -> str:
        """Store `source` under `key`, atomically: a reader sees the old file or the whole
        new one. Returns the file's path.

        `source` is a tensor (any device) or numpy array, stored C-contiguous; or the path
        of a .npy, .nii or .nii.gz file, whose array is streamed into the cache file in
        bounded pieces (a .nii.gz inflated by the C++ core), never whole in memory.

        A NIfTI volume is stored as ``load_array(source)`` returns it: shape ``(x, y, z,
        ...)``, its stored values (unscaled: for scaled values put
        ``load_array(source, "cpu", scale=True)``) in native byte order. Its voxels keep the
        file's order, first index fastest: the cache file is a Fortran-ordered .npy, which
        ``numpy.load`` reads as nibabel's ``img.dataobj.get_unscaled()``, and ``get`` returns,
        as load_array does, a view with reversed axes over contiguous memory: indexed
        [x, y, z, ...] as nibabel (and MONAI's readers, which use it) index volumes, at no
        cost in the read. RGB24/RGBA32 volumes, whose components cannot be kept in that
        order, are read whole and stored C-contiguous, (x, y, z, 3).

        Args:
            key: The entry's name.
            source: A tensor, a numpy array, or the path of a ``.npy``, ``.nii`` or
                ``.nii.gz`` file.

        Returns:
            The cache file's path.

        Raises:
            StokerError: `key` is not a plain name, or the source cannot be read (naming
                it).
            ReadError: The cache file cannot be written.
        """
        path = self.path(key)
        if isinstance(source, (str, os.PathLike)):
            parts = _file_parts(os.fspath(source))
        else:
            parts = _array_parts(_host_array(source))
        try:
            write_atomically(path, parts)
        except StokerError:
            raise  # reading the source failed: it names the source
        except OSError as e:
            raise located(ReadError, path, 0, f"cannot write the cache file: {e}") from e
        return path

    def get(self, key: str, device: Any = "cuda") -> Any:
        """The tensor stored under `key`, on `device`; KeyError when there is none. What
        ``put`` stored from a NIfTI volume comes back as load_array gives it: the (x, y,
        z, ...) view over the stored bytes (``.contiguous()`` for a contiguous copy).

        Args:
            key: The entry's name.
            device: Where the tensor is made, read as `load_npy` reads.

        Returns:
            The stored array as a tensor.

        Raises:
            KeyError: No entry `key` is stored.
        """
        path = self.path(key)
        if not os.path.exists(path):
            raise KeyError(key)
        dtype, shape, offset, nbytes, fortran = npy_layout(path, fortran_ok=True)
        if not fortran:
            return _load(path, dtype, shape, offset, nbytes, device)
        out = _load(path, dtype, shape[::-1], offset, nbytes, device)
        return out.permute(tuple(reversed(range(len(shape)))))


def _array_parts(array: np.ndarray) -> list[Any]:
    """A cache file's parts for a C-contiguous array."""
    return [
        page_aligned_header(array.dtype, array.shape),
        # numpy types the buffer protocol (__buffer__) for Python 3.12+ only
        memoryview(array.reshape(-1).view(np.uint8)),  # type: ignore[arg-type]
    ]


def _file_parts(source: str) -> Iterable[Any]:
    """A cache file's parts for the array in the .npy, .nii or .nii.gz file `source`: its
    header is read now (so a bad source fails before a cache file is begun), its data
    read in bounded pieces as they are written."""
    name = source.lower()
    if name.endswith(".npy"):
        dtype, shape, offset, nbytes, _ = npy_layout(source)
        header = page_aligned_header(dtype, shape)
        return _chain(header, _pieces_of_file(source, offset, nbytes, dtype.itemsize), 0)
    if not name.endswith(nifti.NIFTI_SUFFIXES):
        raise UsageError(
            f"GDSCache.put takes a tensor, an array, or the path of a .npy, .nii or .nii.gz "
            f"file; {source} is none of them"
        )
    volume, stream = nifti.open_header(source)
    if volume.components > 1:
        return _array_parts(_host_array(load_array(source, "cpu").contiguous()))
    header = page_aligned_header(volume.dtype, volume.dims, fortran_order=True)
    size = volume.dtype.itemsize
    if stream is None:
        pieces = _pieces_of_file(source, volume.offset, volume.nbytes, size)
    else:
        pieces = _pieces_of_stream(stream, volume.offset, volume.nbytes, size)
    return _chain(header, pieces, volume.swap_unit)


def _chain(header: bytes, pieces: Iterator[np.ndarray], swap_unit: int) -> Iterator[Any]:
    yield header
    for piece in pieces:
        if swap_unit:  # a big-endian volume is stored in native order
            piece.view(f"u{swap_unit}").byteswap(inplace=True)
        # numpy types the buffer protocol (__buffer__) for Python 3.12+ only
        yield memoryview(piece)  # type: ignore[arg-type]


def _piece_buffer(nbytes: int, itemsize: int) -> np.ndarray:
    """One reusable buffer for a copy in pieces: whole items, _BOUNCE_CHUNK or less (each
    piece is written before the next is read into it)."""
    piece = max(itemsize, _BOUNCE_CHUNK // itemsize * itemsize)
    return np.empty(max(1, min(piece, nbytes)), np.uint8)


def _pieces_of_file(path: str, offset: int, nbytes: int, itemsize: int) -> Iterator[np.ndarray]:
    buffer = _piece_buffer(nbytes, itemsize)
    files = _core.FileTable([path])
    for start in range(0, nbytes, len(buffer)):
        piece = buffer[: min(len(buffer), nbytes - start)]
        _read_pieces(piece, files, offset + start).wait()
        yield piece


def _pieces_of_stream(stream: Any, offset: int, nbytes: int, itemsize: int) -> Iterator[np.ndarray]:
    stream.skip(offset - stream.produced)
    buffer = _piece_buffer(nbytes, itemsize)
    for start in range(0, nbytes, len(buffer)):
        piece = buffer[: min(len(buffer), nbytes - start)]
        stream.read_into(piece)
        yield piece
    stream.finish()  # before the cache file is published: a bad checksum leaves none


def _host_array(tensor: Any) -> np.ndarray:
    if isinstance(tensor, np.ndarray):
        return np.ascontiguousarray(tensor)
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    try:
        return t.numpy()
    except TypeError as e:  # bfloat16 and others numpy has no type for
        raise StokerError(f"GDSCache: numpy has no type for {t.dtype} ({e})") from e
