"""One array of a subject, as patches read it: where its voxels lie in which file, in which
order, and what they mean in space.

A ``.npy``, a ``.nii`` and an HDF5 dataset stored contiguous are read where they are, a
patch as runs of bytes. A ``.nii.gz`` is one gzip stream, which cannot be entered in the
middle: it is inflated once, when the Volumes are made, into the node cache (beside remote
shards, under ``volumes/``), and its patches are read from that copy, which every process
and rank of the node shares and later runs find again. Chunked arrays (Zarr, chunked
HDF5) and tiled TIFF (stoker.volumes.stores, stoker.volumes.slides) carry an ArrayLayout
instead: a patch reads and decodes only the chunks or tiles it touches.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stoker._files import default_cache_root
from stoker.arrays import nifti
from stoker.errors import ReadError, ShardFormatError, UsageError, located
from stoker.npy_pages import npy_layout
from stoker.remote.cache import cache_for

#: File name endings of arrays read as runs of bytes.
RAW_SUFFIXES = (".npy", ".nii", ".nii.gz")
#: Containers of named arrays: ``"ct.h5:/image"``, ``"ct.zarr:/image"`` (or the container
#: alone, when it holds one array).
HDF5_SUFFIXES = (".h5", ".hdf5", ".hdf", ".he5")
ZARR_SUFFIXES = (".zarr",)
#: Tiled TIFF, whole-slide images among them (a pyramid's level is chosen by level=).
TIFF_SUFFIXES = (".tif", ".tiff", ".svs", ".btf", ".tf8")
#: File name endings a subject's arrays may have.
VOLUME_SUFFIXES = RAW_SUFFIXES + HDF5_SUFFIXES + ZARR_SUFFIXES + TIFF_SUFFIXES

#: Bytes inflated per step into the cache's copy of a .nii.gz.
_INFLATE_STEP = 16 << 20


@dataclass(frozen=True)
class VolumeArray:
    """An array on disk, as C-order bytes, and how its axes map onto a patch.

    The stored bytes are the C-order array of `stored_shape` at `offset` in `data_path`
    (the file given, or the cache's inflated copy of a ``.nii.gz``). `spatial_axes[k]` is
    the stored axis of the k-th spatial axis, in the order patches are indexed (nibabel's
    ``[x, y, z]`` for NIfTI, the array's own for ``.npy``); the other stored axes are
    channels, read whole, in stored order.
    """

    path: str
    data_path: str
    offset: int
    dtype: np.dtype
    stored_shape: tuple[int, ...]
    spatial_axes: tuple[int, ...]
    affine: np.ndarray | None  # 4x4 voxel-to-world, where the file has one (NIfTI)
    spacing: tuple[float, ...]
    swap_unit: int  # bytes to reverse per group for a big-endian file; 0: native
    # Chunked or tiled: where each chunk is and how it is encoded (the C++ reader reads and
    # decodes the chunks a patch touches, swapped to native order). None: runs of bytes.
    layout: Any = field(default=None, compare=False)
    # Runs of bytes whose stored axis 0 is not evenly spaced (an HDF5 dataset chunked by
    # whole slices): each index's offset in the file. None: `offset` plus the index times
    # the stride.
    row_offsets: np.ndarray | None = field(default=None, compare=False)
    # The file whose size and modification time key what the cache keeps for this array.
    identity_path: str = ""

    @property
    def spatial_shape(self) -> tuple[int, ...]:
        return tuple(self.stored_shape[a] for a in self.spatial_axes)

    # (cached: a batch asks each of its patches' arrays several times)
    @functools.cached_property
    def channel_axes(self) -> tuple[int, ...]:
        return tuple(a for a in range(len(self.stored_shape)) if a not in self.spatial_axes)

    @functools.cached_property
    def channels(self) -> int:
        return math.prod(self.stored_shape[a] for a in self.channel_axes)


def split_source(value: str) -> tuple[str, str]:
    """A subject's value as (file, array inside it): ``"ct.h5:/image"`` is ``("ct.h5",
    "image")``; a plain file has no inner name."""
    head, sep, inner = value.partition(":/")
    if sep and head.lower().endswith(HDF5_SUFFIXES + ZARR_SUFFIXES):
        return head, inner.strip("/")
    return value, ""


def is_volume_path(value: object) -> bool:
    """Whether a subject's value names an array (by its file name's ending)."""
    if not isinstance(value, (str, os.PathLike)):
        return False
    file, _ = split_source(os.fspath(value))
    return file.lower().rstrip("/").endswith(VOLUME_SUFFIXES)


def channel_first_axes(path: str, shape: tuple[int, ...], spatial_dims: int) -> tuple[int, ...]:
    """The spatial axes of a C-order array of `shape`: all of them, or all but a first
    channel axis; else ShardFormatError naming `path`."""
    if len(shape) not in (spatial_dims, spatial_dims + 1):
        raise located(
            ShardFormatError,
            path,
            0,
            f"an array of shape {shape} for {spatial_dims}-D patches: it needs "
            f"{spatial_dims} spatial axes, and at most one channel axis before them",
        )
    return tuple(range(len(shape) - spatial_dims, len(shape)))


def open_npy(path: str, spatial_dims: int) -> VolumeArray:
    """A .npy's layout (see open_volume_array)."""
    dtype, shape, offset, _, fortran = npy_layout(path, fortran_ok=True)
    channel_first_axes(path, tuple(shape), spatial_dims)
    first = len(shape) - spatial_dims  # a channel axis, if any, comes first
    if fortran:  # stored with the first index fastest: the C-order array of reversed shape
        stored = shape[::-1]
        spatial = tuple(len(shape) - 1 - a for a in range(first, len(shape)))
    else:
        stored = shape
        spatial = tuple(range(first, len(shape)))
    return VolumeArray(
        path=path,
        data_path=path,
        offset=offset,
        dtype=dtype,
        stored_shape=tuple(stored),
        spatial_axes=spatial,
        affine=None,
        spacing=(1.0,) * spatial_dims,
        swap_unit=0,
        identity_path=path,
    )


def open_nifti(path: str, spatial_dims: int, cache_dir: str | None) -> VolumeArray:
    """A .nii's or .nii.gz's layout (see open_volume_array)."""
    header, stream = nifti.open_header(path)
    if len(header.dims) < spatial_dims:
        raise located(
            ShardFormatError,
            path,
            0,
            f"a {len(header.dims)}-D volume of shape {header.dims} for {spatial_dims}-D patches",
        )
    data_path, offset = path, header.offset
    if stream is not None:
        data_path, offset = _inflated_copy(header, stream, cache_dir), 0
    # Stored: dims reversed (x fastest), then the RGB components.
    n = len(header.dims)
    spatial = tuple(n - 1 - k for k in range(spatial_dims))
    return VolumeArray(
        path=path,
        data_path=data_path,
        offset=offset,
        dtype=header.dtype,
        stored_shape=header.stored_shape,
        spatial_axes=spatial,
        affine=header.affine,
        spacing=header.spacing[:spatial_dims],
        swap_unit=header.swap_unit,
        identity_path=path,
    )


def _inflated_copy(header: nifti.NiftiHeader, stream: Any, cache_dir: str | None) -> str:
    """The cache's copy of a .nii.gz's voxels, inflated now unless a process of this node
    did so before: named for the file's path, size and modification time (a changed file
    is inflated again), written under a lock (one process inflates, the others wait for
    it) to a temporary name, then renamed, so no half-inflated copy is ever read.

    The copy ends with a stamp of the boot that wrote it, and is not synced to disk:
    syncing took three times as long as inflating, and a copy is only trusted in the boot
    that wrote it, when every process reads it through the same page cache. A copy found
    after a reboot, whose blocks a crash may have lost, is inflated again."""
    try:
        st = os.stat(header.path)
    except OSError as e:
        raise located(ReadError, header.path, 0, f"cannot read: {e.strerror or e}") from e
    folder = cache_folder(cache_dir)
    key = f"{os.path.realpath(header.path)}\0{st.st_size}\0{st.st_mtime_ns}".encode()
    name = hashlib.sha256(key).hexdigest()[:24]
    out = os.path.join(folder, f"{name}-{os.path.basename(header.path)[:80]}.raw")
    stamp = _copy_stamp()
    if _complete(out, header.nbytes, stamp):
        return out
    with open(out + ".lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if _complete(out, header.nbytes, stamp):
            return out
        tmp = f"{out}.{os.getpid()}.tmp"
        try:
            stream.skip(header.offset - stream.produced)
            buffer = np.empty(min(_INFLATE_STEP, max(header.nbytes, 1)), np.uint8)
            with open(tmp, "wb") as f:
                left = header.nbytes
                while left:
                    piece = buffer[: min(left, buffer.size)]
                    stream.read_into(piece)
                    f.write(piece.data)
                    left -= piece.size
                stream.finish()  # every member's CRC-32 and length
                f.write(stamp)
                if stamp == _DURABLE:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, out)
        except OSError as e:
            raise located(
                ReadError,
                out,
                0,
                f"cannot write the inflated copy of {header.path} into the cache: "
                f"{e.strerror or e} (cache_dir= chooses another folder)",
            ) from e
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return out


#: The stamp of a copy synced to disk, trusted in any boot (where no boot id is known).
_DURABLE = b"stoker-inflated:durable".ljust(64, b"\0")


def _copy_stamp() -> bytes:
    """The 64 bytes an inflated copy ends with: this boot's id, or _DURABLE where the
    system has none (the copy is then synced before it is renamed into place)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip()
    except OSError:
        return _DURABLE
    return (b"stoker-inflated:boot=" + boot[:40]).ljust(64, b"\0")


def _complete(path: str, nbytes: int, stamp: bytes) -> bool:
    """Whether `path` is a whole copy of `nbytes` voxels that `stamp`'s boot may trust."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size != nbytes + len(stamp):
                return False
            f.seek(nbytes)
            found = f.read(len(stamp))
    except OSError:
        return False
    return found in (stamp, _DURABLE)


def cache_folder(cache_dir: str | None, *parts: str) -> str:
    """The folder of the node cache (`cache_dir`, else the default) where volumes keep what
    they make, made now: under ``volumes/`` of a folder marked as stoker's cache, which
    remote shards share (a cache folder is claimed by a marker before anything is put in
    it, so a Dataset opened on the same cache later finds one of stoker's)."""
    root = cache_dir or default_cache_root()
    cache_for(root)
    folder = os.path.join(root, "volumes", *parts)
    os.makedirs(folder, exist_ok=True)
    return folder


def check_same_space(subject: str, arrays: dict[str, VolumeArray], atol: float) -> None:
    """Every array of a subject on one grid: the same spatial shape, and where two have an
    affine, the same affine (within `atol`); else UsageError naming the subject and files."""
    items = list(arrays.items())
    first_key, first = items[0]
    for key, array in items[1:]:
        if array.spatial_shape != first.spatial_shape:
            raise UsageError(
                f"subject {subject}: {key!r} ({array.path}) has spatial shape "
                f"{array.spatial_shape}, {first_key!r} ({first.path}) has "
                f"{first.spatial_shape}: a subject's arrays must lie on one grid"
            )
        a, b = first.affine, array.affine
        if a is not None and b is not None and not np.allclose(a, b, atol=atol, rtol=0):
            raise UsageError(
                f"subject {subject}: the affines of {key!r} ({array.path}) and "
                f"{first_key!r} ({first.path}) differ by up to "
                f"{np.abs(a - b).max():.3g} (more than "
                f"affine_tolerance={atol}): they are not on one grid in space"
            )
