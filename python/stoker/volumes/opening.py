"""A subject's array opened by what its name says it is: the one place that knows every
kind (runs of bytes in stoker.volumes.arrays, chunked stores, TIFF slides)."""

from __future__ import annotations

import os

from stoker.volumes.arrays import (
    HDF5_SUFFIXES,
    TIFF_SUFFIXES,
    ZARR_SUFFIXES,
    VolumeArray,
    open_nifti,
    open_npy,
    split_source,
)
from stoker.volumes.slides import open_tiff_level
from stoker.volumes.stores import open_store_array


def open_volume_array(
    path: str, spatial_dims: int, cache_dir: str | None, level: int = 0
) -> VolumeArray:
    """The layout of the array at `path` whose first `spatial_dims` axes (as patches index
    them) are spatial: a .npy's, a Zarr array's or an HDF5 dataset's leading axes unless
    it has one more, which is then its channels (channel-first, as MONAI keeps arrays); a
    NIfTI volume's dims, any further dims and RGB components being channels; a TIFF's rows
    and columns (of pyramid level `level`), its samples being channels."""
    path = os.fspath(path)
    file, inner = split_source(path)
    lower = file.lower().rstrip("/")
    if lower.endswith(".npy"):
        return open_npy(path, spatial_dims)
    if lower.endswith(HDF5_SUFFIXES + ZARR_SUFFIXES):
        return open_store_array(path, file, inner, spatial_dims)
    if lower.endswith(TIFF_SUFFIXES):
        return open_tiff_level(path, spatial_dims, level)
    return open_nifti(path, spatial_dims, cache_dir)
