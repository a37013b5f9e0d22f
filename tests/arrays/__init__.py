"""Tests of array sources: HDF5, Zarr, NIfTI (stoker.arrays)."""
