"""Zarr arrays and HDF5 datasets as volumes: the layout stoker.arrays learns for their rows
(the chunk grid, each chunk's place and filters, from the Zarr JSON or through h5py), used
for boxes instead of rows.

A chunked array's patch reads and decodes only the chunks it touches (the reader's decoded
chunk cache serves the next patch that touches them again); a dataset stored contiguous,
or chunked by whole slices with no filter, is read in place as runs of bytes, as a ``.npy``
is.
"""

from __future__ import annotations

import numpy as np

from stoker.arrays.array_fields import ArrayField
from stoker.arrays.hdf5 import hdf5_arrays
from stoker.arrays.zarr import zarr_arrays
from stoker.errors import ShardFormatError, located
from stoker.volumes.arrays import ZARR_SUFFIXES, VolumeArray, channel_first_axes


def open_store_array(source: str, file: str, inner: str, spatial_dims: int) -> VolumeArray:
    """The array `inner` of the Zarr store or HDF5 file `file` (its only array when
    `inner` is empty), for `spatial_dims`-D patches; `source` is how the subject named it."""
    zarr = file.lower().rstrip("/").endswith(ZARR_SUFFIXES)
    opener = zarr_arrays if zarr else hdf5_arrays
    rows, fields = opener(file, [inner] if inner else None)
    if len(fields) != 1:
        names = ", ".join(f"{file}:/{f.name}" for f in fields)
        raise located(
            ShardFormatError,
            file,
            0,
            f"holds {len(fields)} arrays ({names}): name the one a subject's key is, as "
            f"'{file}:/NAME'",
        )
    return _volume(source, file, rows, fields[0], spatial_dims)


def _volume(source: str, file: str, rows: int, array: ArrayField, spatial_dims: int) -> VolumeArray:
    shape = (rows, *array.row_shape)
    spatial = channel_first_axes(source, shape, spatial_dims)
    offset, row_offsets = 0, None
    if array.layout is None:
        assert array.offsets is not None
        offsets = np.asarray(array.offsets, np.int64)
        offset = int(offsets[0]) if offsets.size else 0
        if offsets.size > 1 and not (np.diff(offsets) == array.row_bytes).all():
            row_offsets = offsets
    return VolumeArray(
        path=source,
        data_path=file,
        offset=offset,
        dtype=array.dtype,
        stored_shape=shape,
        spatial_axes=spatial,
        affine=None,
        spacing=(1.0,) * spatial_dims,
        swap_unit=0,  # chunks are swapped as they are decoded; in-place rows are native
        layout=array.layout,
        row_offsets=row_offsets,
        identity_path=file,
    )
