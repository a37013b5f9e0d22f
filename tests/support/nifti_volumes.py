"""NIfTI volumes for the tests (tests/arrays/test_nifti.py, tests/gpu/test_nifti_gpu.py): random
voxels of a type, written by nibabel, and nibabel's reading of them to compare with.

nibabel is imported inside the functions, so that importing this module never fails: the
test files skip themselves with ``pytest.importorskip("nibabel")`` where it is missing."""

from __future__ import annotations

import gzip
import os

import numpy as np

AFFINE = np.diag([0.8, 0.8, 1.5, 1.0])
RGB = np.dtype([("R", "u1"), ("G", "u1"), ("B", "u1")])


def volume(dtype, shape, seed=0) -> np.ndarray:
    """Random voxels of `dtype` (a numpy type, or "RGB24") and `shape`, over the type's whole
    range (floats: spread over thousands)."""
    rng = np.random.default_rng(seed)
    if dtype == "RGB24":
        out = np.zeros(shape, RGB)
        for name in RGB.names:
            out[name] = rng.integers(0, 256, shape, dtype=np.uint8)
        return out
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return (rng.standard_normal(shape) * 1000).astype(dtype)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)


def write_nifti(
    path, data, version=1, *, big_endian=False, extension=None, affine=AFFINE, qform_only=False
) -> str:
    """`data` saved by nibabel as a NIfTI-`version` file (.nii or .nii.gz by the name), with
    `affine` as its sform and qform (as its qform alone with `qform_only`)."""
    import nibabel as nib

    image = {1: nib.Nifti1Image, 2: nib.Nifti2Image}[version]
    header = image.header_class(endianness=">" if big_endian else "<")
    header.set_data_dtype(data.dtype)
    img = image(data, affine, header=header)
    if qform_only:
        img.set_qform(affine, code=1)
        img.set_sform(None, code=0)
    if extension is not None:
        img.header.extensions.append(nib.nifti1.Nifti1Extension("comment", extension))
    img.to_filename(str(path))
    return str(path)


def reference(path) -> np.ndarray:
    """nibabel's stored values (``img.dataobj.get_unscaled()``); RGB voxels as a last axis of
    3 uint8 components."""
    import nibabel as nib

    values = np.asarray(nib.load(str(path)).dataobj.get_unscaled())
    if values.dtype.names:
        values = np.stack([values[name] for name in values.dtype.names], axis=-1)
    return values


def gzip_copy(path, members=1, cut=None) -> str:
    """`path` gzipped beside it, as ``path + ".gz"``: `members` gzip members one after
    another, splitting the bytes evenly, or at the offsets in `cut` (first 0, last the
    size)."""
    with open(path, "rb") as f:
        data = f.read()
    bounds = np.linspace(0, len(data), members + 1).astype(int) if cut is None else cut
    out = os.fspath(path) + ".gz"
    with open(out, "wb") as f:
        for start, end in zip(bounds[:-1], bounds[1:]):
            f.write(gzip.compress(data[start:end]))
    return out


def with_trailing(path, trailing, members=1) -> tuple[str, np.ndarray]:
    """An int16 volume written to `path` (a .nii) with `trailing` zero bytes after its
    voxels, gzipped beside it: in one member, or (members=2) with the trailing bytes in a
    member of their own, which reading the voxels alone never reaches. Returns the .nii.gz
    and the volume."""
    data = volume("int16", (20, 18, 7))
    plain = write_nifti(path, data)
    size = os.path.getsize(plain)
    with open(plain, "ab") as f:
        f.write(bytes(trailing))
    cut = [0, size, size + trailing] if members == 2 else None
    return gzip_copy(plain, cut=cut), data


def flip_byte(path, at) -> None:
    """Flip every bit of the byte `at` (negative: from the end) of the file at `path`."""
    with open(path, "r+b") as f:
        f.seek(at, os.SEEK_END if at < 0 else os.SEEK_SET)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0xFF]))
