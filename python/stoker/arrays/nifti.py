"""NIfTI-1 and NIfTI-2 volumes in one file (``.nii``, and ``.nii.gz``, the same file gzipped).

The header, read once, says where the voxels start, what type they are and the volume's
shape; ``stoker.load_array`` (in ``stoker.gds``) then reads the voxels as it reads a .npy's
data: straight into device memory for a ``.nii``, inflated by the C++ core through pinned
slots for a ``.nii.gz`` (gzip has no random access: the stream is read from its start).

Voxels are stored with the first index varying fastest, so the bytes in the file are, in C
order, the array of shape ``(dim[n], ..., dim[1])``. stoker reads them as that array and
returns the view with its axes reversed: indexed ``[x, y, z, ...]`` as nibabel indexes,
without moving a byte, and therefore not contiguous (``.contiguous()`` makes a copy that is).
RGB24 and RGBA32 voxels get a last axis of 3 or 4 uint8 components.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import stoker._core as _core
from stoker.errors import ReadError, ShardFormatError, UsageError, located

GZIP_MAGIC = b"\x1f\x8b"
#: Deflate never inflates data more than about 1032 to 1 (a 258-byte match in 2 bits): a
#: gzipped header asking for more voxels than its file could hold is refused before any
#: memory is set aside for them.
MAX_DEFLATE_RATIO = 1032

#: File name endings load_array reads as NIfTI (a .hdr only to refuse it clearly).
NIFTI_SUFFIXES = (".nii", ".nii.gz", ".hdr", ".hdr.gz")
#: The voxel file of a .hdr/.img pair: refused.
PAIR_DATA_SUFFIXES = (".img", ".img.gz")


@dataclass(frozen=True)
class _Layout:
    """Where one version's header keeps each field (byte offsets), and their types."""

    size: int  # sizeof_hdr
    magic_at: int
    magic: bytes  # of a single file
    pair_magic: bytes  # of a .hdr/.img pair's header
    datatype_at: int
    bitpix_at: int
    dim_at: int
    dim_type: str
    vox_offset_at: int
    vox_offset_type: str
    slope_at: int
    inter_at: int
    scale_type: str  # scl_slope's and scl_inter's, pixdim's, the quaternion's and srow's
    pixdim_at: int
    qform_code_at: int
    code_type: str  # qform_code's and sform_code's (sform_code follows qform_code)
    quatern_at: int  # quatern_b, c, d, then qoffset_x, y, z
    srow_at: int  # srow_x, srow_y, srow_z: 4 values each

    @property
    def first_voxel(self) -> int:
        """Where voxels start at the earliest in a single file: after the header and the
        4 bytes that say whether extensions follow."""
        return self.size + 4


# fmt: off
_LAYOUTS = {
    1: _Layout(348, 344, b"n+1\0", b"ni1\0", 70, 72, 40, "i2", 108, "f4", 112, 116, "f4",
               pixdim_at=76, qform_code_at=252, code_type="i2", quatern_at=256, srow_at=280),
    2: _Layout(540, 4, b"n+2\0\r\n\x1a\n", b"ni2\0", 12, 14, 16, "i8", 168, "i8", 176, 184, "f8",
               pixdim_at=104, qform_code_at=344, code_type="i4", quatern_at=352, srow_at=400),
}
# fmt: on
_BY_SIZE = {layout.size: version for version, layout in _LAYOUTS.items()}

# datatype code -> (name, numpy type of one component, components per voxel)
_DATATYPES = {
    2: ("uint8", "u1", 1),
    4: ("int16", "i2", 1),
    8: ("int32", "i4", 1),
    16: ("float32", "f4", 1),
    32: ("complex64", "c8", 1),
    64: ("float64", "f8", 1),
    128: ("RGB24", "u1", 3),
    256: ("int8", "i1", 1),
    512: ("uint16", "u2", 1),
    768: ("uint32", "u4", 1),
    1024: ("int64", "i8", 1),
    1280: ("uint64", "u8", 1),
    1792: ("complex128", "c16", 1),
    2304: ("RGBA32", "u1", 4),
}
_REFUSED = {
    0: "datatype 0 (DT_UNKNOWN) says nothing about the voxels",
    1: "datatype 1 (1-bit binary voxels) has no tensor type",
    1536: "datatype 1536 (float128) has no tensor type",
    2048: "datatype 2048 (complex256) has no tensor type",
}


@dataclass(frozen=True)
class NiftiHeader:
    """What load_array needs from a NIfTI header."""

    path: str
    version: int  # 1 or 2
    compressed: bool  # gzipped (.nii.gz)
    big_endian: bool  # the whole file, voxels included
    datatype: int  # the header's code
    dtype: np.dtype  # one component of a voxel, in native byte order
    components: int  # 1; 3 for RGB24, 4 for RGBA32
    dims: tuple[int, ...]  # (dim[1], ..., dim[n]): nibabel's img.shape
    offset: int  # where the voxels start (in the inflated stream for a .nii.gz)
    slope: float  # scl_slope, as stored
    inter: float  # scl_inter, as stored
    affine: np.ndarray  # 4x4 float64: voxel (i, j, k) to world (x, y, z), as nibabel's img.affine
    spacing: tuple[float, ...]  # the voxel sizes of dims (pixdim[1:]), as nibabel's zooms

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape load_array returns: dims, and a last axis for RGB(A) components."""
        return self.dims + ((self.components,) if self.components > 1 else ())

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The C-order shape of the bytes as stored: dims reversed (and the components)."""
        return self.dims[::-1] + ((self.components,) if self.components > 1 else ())

    @property
    def axes(self) -> tuple[int, ...]:
        """The permutation from stored_shape to shape."""
        n = len(self.dims)
        return tuple(reversed(range(n))) + ((n,) if self.components > 1 else ())

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=object)) * self.dtype.itemsize

    @property
    def swap_unit(self) -> int:
        """Bytes to reverse, group by group, to make a big-endian file's voxels native (a
        complex number's two halves each); 0 when nothing needs swapping."""
        size = self.dtype.itemsize // (2 if self.dtype.kind == "c" else 1)
        return size if self.big_endian and size > 1 else 0

    def scaling(self) -> tuple[float, float] | None:
        """(slope, inter) when the header asks for scaling: a slope that is neither 0 nor
        NaN nor infinite. A usable slope with an unusable intercept is an error."""
        if self.slope == 0 or not np.isfinite(self.slope):
            return None
        if not np.isfinite(self.inter):
            raise located(
                ShardFormatError,
                self.path,
                _LAYOUTS[self.version].inter_at,
                f"scl_slope is {self.slope} but scl_inter is {self.inter}: the voxels "
                "cannot be scaled" + _inflated(self.compressed),
            )
        return self.slope, self.inter

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "dtype": self.dtype,
            "shape": self.shape,
            "offset": self.offset,
            "nbytes": self.nbytes,
            "slope": self.slope,
            "inter": self.inter,
            "compressed": self.compressed,
            "big_endian": self.big_endian,
            "datatype": self.datatype,
            "affine": self.affine,
            "spacing": self.spacing,
        }


def nifti_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The facts of a NIfTI-1 or NIfTI-2 file (.nii or .nii.gz) that ``load_array`` uses,
    read from its header alone (a ``.nii.gz`` is inflated only as far as its header).

    Args:
        path: A ``.nii`` or ``.nii.gz`` file; whether it is gzipped is told by its first
            bytes, not by its name.

    Returns:
        A dict of:

        - ``version``: 1 or 2; ``compressed``: whether it is gzipped;
        - ``dtype``: the numpy dtype of the tensor load_array returns (native byte order;
            uint8 for RGB24/RGBA32); ``big_endian``: whether the file stores big-endian values;
            ``datatype``: the header's code;
        - ``shape``: the shape load_array returns, ``(x, y, z, ...)`` as nibabel's ``img.shape``,
            with a last axis of 3 or 4 components for RGB24/RGBA32;
        - ``offset``: where the voxels start (in the inflated bytes of a .nii.gz); ``nbytes``:
            how many bytes they take;
        - ``slope``, ``inter``: scl_slope and scl_inter as stored (a slope of 0 or NaN: no
            scaling);
        - ``affine``: the 4x4 voxel-to-world matrix nibabel's ``img.affine`` gives (the
            sform where its code is set, else the qform, else the voxel sizes alone);
            ``spacing``: the voxel sizes, ``pixdim[1:]`` as nibabel's ``header.get_zooms()``.

    Raises:
        ShardFormatError: The header is not NIfTI, or is inconsistent; the message names
            the file and the offset of the field at fault.
        ReadError: The file cannot be read.
    """
    return read_header(path).as_dict()


def read_header(path: str | os.PathLike[str]) -> NiftiHeader:
    return open_header(path)[0]


def open_header(path: str | os.PathLike[str]) -> tuple[NiftiHeader, Any]:
    """The header of the NIfTI file at `path`, and for a gzipped one the GzipFile it was
    read from, left just after the header (None for a plain file). Whether a file is
    gzipped is told by its first bytes, not by its name."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            head = f.read(_LAYOUTS[2].first_voxel)
            size = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise located(ReadError, path, 0, f"cannot read: {e.strerror or e}", e.errno) from e
    if head[:2] != GZIP_MAGIC:
        return _parse(path, head, size=size, compressed=False), None
    stream = _core.GzipFile(path)
    raw = np.empty(_LAYOUTS[1].size, np.uint8)
    stream.read_into(raw)  # a stream too short for a header is reported here
    version, _ = _version_of(path, raw.tobytes(), compressed=True)
    if version == 2:
        rest = np.empty(_LAYOUTS[2].size - _LAYOUTS[1].size, np.uint8)
        stream.read_into(rest)
        raw = np.concatenate([raw, rest])
    return _parse(path, raw.tobytes(), size=size, compressed=True), stream


def _inflated(compressed: bool) -> str:
    return " (an offset into the inflated bytes)" if compressed else ""


def _version_of(path: str, raw: bytes, *, compressed: bool) -> tuple[int, str]:
    """(version, byte order) from sizeof_hdr: 348 or 540, in either byte order."""
    if len(raw) < 4:
        raise located(
            ShardFormatError,
            path,
            len(raw),
            f"the file ends after {len(raw)} bytes: too short for a NIfTI header",
        )
    little = int.from_bytes(raw[:4], "little")
    big = int.from_bytes(raw[:4], "big")
    if little in _BY_SIZE:
        return _BY_SIZE[little], "<"
    if big in _BY_SIZE:
        return _BY_SIZE[big], ">"
    raise located(
        ShardFormatError,
        path,
        0,
        f"not a NIfTI file: sizeof_hdr is {little}, where NIfTI-1 has 348 and NIfTI-2 540"
        + _inflated(compressed),
    )


def _parse(path: str, raw: bytes, *, size: int, compressed: bool) -> NiftiHeader:
    """The header in `raw` (the file's first bytes, inflated when `compressed`); `size`:
    the file's size on disk."""
    where = _inflated(compressed)

    def bad(offset: int, what: str) -> ShardFormatError:
        return located(ShardFormatError, path, offset, what + where)

    version, order = _version_of(path, raw, compressed=compressed)
    L = _LAYOUTS[version]
    if len(raw) < L.size:
        raise bad(
            len(raw),
            f"the file ends after {len(raw)} bytes, inside its {L.size}-byte NIfTI-{version} "
            "header",
        )

    def field(at: int, kind: str, count: int = 1) -> np.ndarray:
        return np.frombuffer(raw, np.dtype(order + kind), count, at)

    magic = raw[L.magic_at : L.magic_at + len(L.magic)]
    if magic[:4] == L.pair_magic:
        raise bad(
            L.magic_at,
            f"magic {magic[:3].decode('latin1')!r}: the header of a .hdr/.img pair, whose "
            "voxels are in a separate .img file; load_array reads single-file NIfTI (.nii, "
            ".nii.gz): save the volume as one .nii",
        )
    if magic != L.magic:
        if magic[:4] == L.magic[:4]:
            raise bad(
                L.magic_at,
                f"the NIfTI-2 magic's last bytes are {magic[4:]!r}, not {L.magic[4:]!r}: "
                "the file was damaged, as a transfer in text mode damages it",
            )
        raise bad(
            L.magic_at,
            f"magic {magic!r} is not NIfTI-{version}'s {L.magic!r} (an ANALYZE 7.5 header, "
            "or not a NIfTI file)",
        )

    dim = field(L.dim_at, L.dim_type, 8)
    step = np.dtype(L.dim_type).itemsize
    ndim = int(dim[0])
    if not 1 <= ndim <= 7:
        raise bad(L.dim_at, f"dim[0] (the number of dimensions) is {ndim}, not 1 to 7")
    dims = tuple(int(d) for d in dim[1 : ndim + 1])
    for i, d in enumerate(dims, 1):
        if d < 0:
            raise bad(L.dim_at + i * step, f"dim[{i}] is {d}: a length cannot be negative")

    datatype = int(field(L.datatype_at, "i2")[0])
    if datatype in _REFUSED:
        raise bad(L.datatype_at, _REFUSED[datatype])
    if datatype not in _DATATYPES:
        raise bad(L.datatype_at, f"datatype {datatype} is not a NIfTI data type")
    name, kind, components = _DATATYPES[datatype]
    dtype = np.dtype(kind)
    bitpix = int(field(L.bitpix_at, "i2")[0])
    if bitpix != 8 * dtype.itemsize * components:
        raise bad(
            L.bitpix_at,
            f"bitpix is {bitpix}, but datatype {datatype} ({name}) has "
            f"{8 * dtype.itemsize * components} bits per voxel",
        )

    stored = field(L.vox_offset_at, L.vox_offset_type)[0]
    if not np.isfinite(stored) or stored != np.floor(stored) or stored < 0:
        raise bad(
            L.vox_offset_at,
            f"vox_offset is {stored}: voxels cannot start there (it must be a whole number "
            "of bytes, 0 or more)",
        )
    # The standard: a single file's vox_offset under the header's end (and its 4 extension
    # flag bytes) means that end, 352 (NIfTI-1) or 544 (NIfTI-2).
    offset = max(int(stored), L.first_voxel)
    slope, inter = (float(field(at, L.scale_type)[0]) for at in (L.slope_at, L.inter_at))
    pixdim = field(L.pixdim_at, L.scale_type, 8).astype(np.float64)
    spacing = tuple(float(abs(z)) for z in pixdim[1 : ndim + 1])
    header = NiftiHeader(
        path=path,
        version=version,
        compressed=compressed,
        big_endian=order == ">",
        datatype=datatype,
        dtype=dtype,
        components=components,
        dims=dims,
        offset=offset,
        slope=slope,
        inter=inter,
        affine=_affine(L, field, pixdim, dims),
        spacing=spacing,
    )
    nbytes = header.nbytes
    if compressed:
        # The stream reports its own end; but voxels that no file of this size could
        # inflate to are refused now, before memory is set aside for them.
        most = MAX_DEFLATE_RATIO * size + 1024
        if offset + nbytes > most:
            raise bad(
                L.dim_at,
                f"the header's dimensions {dims} ask for {offset + nbytes} bytes (voxels and "
                f"header), more than the file can hold: its {size} gzipped bytes inflate to "
                f"{most} at the most",
            )
    else:
        if offset > size:
            raise bad(
                L.vox_offset_at,
                f"vox_offset is {offset}, past the end of the file ({size} bytes)",
            )
        if offset + nbytes > size:
            raise bad(
                size,
                f"the voxels ({nbytes} bytes from offset {offset}) run "
                f"{offset + nbytes - size} bytes past the end of the file ({size} bytes): it "
                "is truncated, or its header is wrong",
            )
    return header


def _affine(
    L: _Layout, field: Callable[..., np.ndarray], pixdim: np.ndarray, dims: tuple[int, ...]
) -> np.ndarray:
    """The voxel-to-world matrix by the standard's three methods, in nibabel's order of
    preference: the sform (srow_x, y, z) where sform_code is set; else the qform, a rotation
    from the quaternion (b, c, d; a = sqrt(1 - b^2 - c^2 - d^2)) scaled by the voxel sizes,
    the third by qfac (pixdim[0]: -1 for a left-handed grid), then shifted by qoffset; else
    the voxel sizes alone, x flipped and the grid's centre at the origin (ANALYZE's)."""
    qform_code, sform_code = (int(c) for c in field(L.qform_code_at, L.code_type, 2))
    if sform_code > 0:
        affine = np.eye(4)
        affine[:3] = field(L.srow_at, L.scale_type, 12).astype(np.float64).reshape(3, 4)
        return affine
    zooms = np.ones(3)
    used = min(len(dims), 3)
    zooms[:used] = pixdim[1 : used + 1]
    if qform_code > 0:
        b, c, d, *offset = (float(v) for v in field(L.quatern_at, L.scale_type, 6))
        a = np.sqrt(max(0.0, 1.0 - (b * b + c * c + d * d)))
        rotation = np.array(
            [
                [a * a + b * b - c * c - d * d, 2 * (b * c - a * d), 2 * (b * d + a * c)],
                [2 * (b * c + a * d), a * a + c * c - b * b - d * d, 2 * (c * d - a * b)],
                [2 * (b * d - a * c), 2 * (c * d + a * b), a * a + d * d - c * c - b * b],
            ]
        )
        qfac = -1.0 if pixdim[0] < 0 else 1.0
        affine = np.eye(4)
        affine[:3, :3] = rotation * (zooms * np.array([1.0, 1.0, qfac]))
        affine[:3, 3] = offset
        return affine
    shape = np.ones(3)
    shape[:used] = dims[:used]
    diagonal = np.abs(zooms) * np.array([-1.0, 1.0, 1.0])
    affine = np.diag([*diagonal, 1.0])
    affine[:3, 3] = -(shape - 1) / 2.0 * diagonal
    return affine


def finish(tensor: Any, header: NiftiHeader, *, scale: bool) -> Any:
    """`tensor`, the voxels as stored (C order, shape header.stored_shape, fresh memory),
    as load_array returns them: native byte order, scaled if asked, axes as nibabel's."""
    if header.swap_unit and tensor.numel():
        _byteswap(tensor, header.swap_unit)
    if scale:
        tensor = scaled(tensor, header)
    return tensor.permute(header.axes)


def _byteswap(tensor: Any, unit: int) -> None:
    """Reverse the bytes of each `unit`-byte group of contiguous `tensor`, in place."""
    import torch

    raw = tensor.reshape(-1).view(torch.uint8)
    if raw.device.type == "cpu":
        raw.numpy().view(f"u{unit}").byteswap(inplace=True)
        return
    groups = raw.view(-1, unit)
    groups.copy_(groups.flip(-1))


def scale_factors(header: NiftiHeader) -> tuple[float, float] | None:
    """What scale=True applies: (slope, inter), or None for no scaling; an error, before
    anything is read, for voxels that cannot become float32 values."""
    if header.components > 1 or header.dtype.kind == "c":
        kind = "complex" if header.dtype.kind == "c" else _DATATYPES[header.datatype][0]
        raise UsageError(
            f"{header.path}: scale=True makes float32 values of the voxels, and {kind} voxels "
            "are not single real numbers; load them with scale=False"
        )
    return header.scaling()


def scaled(tensor: Any, header: NiftiHeader) -> Any:
    """float32 ``tensor * scl_slope + scl_inter`` on tensor's device (the values as float32
    when the header asks for no scaling). Integers wider than float32's mantissa and
    float64 are scaled in float64 first."""
    import torch

    factors = scale_factors(header)
    wide = header.dtype.itemsize >= 4 and header.dtype != np.float32
    work = tensor.to(torch.float64 if wide and factors else torch.float32)
    if factors is not None:  # in place: `work` is `tensor` itself only when that is ours
        work.mul_(factors[0]).add_(factors[1])
    return work.to(torch.float32)
