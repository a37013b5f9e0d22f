"""load_array onto a real GPU for NIfTI volumes: a .nii through cuFile or the pinned bounce
ring, a .nii.gz inflated into pinned slots and copied, each byte for byte what nibabel reads
(``img.dataobj.get_unscaled()``), and GDSCache.put from a .nii.gz read back on the device.

Skipped as a whole where no CUDA device is usable (conftest.py). Files live under pytest's
tmp_path, which may be a tmpfs where GPUDirect cannot work and stoker falls back: whatever
the path, the bytes must be exact.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import stoker
from tests.support.nifti_volumes import (
    flip_byte,
    gzip_copy,
    reference,
    volume,
    with_trailing,
    write_nifti,
)

nib = pytest.importorskip("nibabel")

GPU = torch.device("cuda", 0)


def _reference(path: str) -> torch.Tensor:
    """nibabel's stored values as a contiguous CPU tensor in native byte order."""
    values = reference(path)
    return torch.from_numpy(np.ascontiguousarray(values.astype(values.dtype.newbyteorder("="))))


def _check(got: torch.Tensor, expected: torch.Tensor, device: torch.device = GPU) -> None:
    assert got.device == device, f"on {got.device}, not {device}"
    assert (got.dtype, tuple(got.shape)) == (expected.dtype, tuple(expected.shape))
    assert torch.equal(got.cpu(), expected), "values differ"
    assert torch.equal(got.contiguous().cpu(), expected)


@pytest.mark.parametrize("suffix", [".nii", ".nii.gz"])
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize(
    "dtype, shape",
    [
        ("uint8", (31, 17, 9)),
        ("int16", (64, 48, 33)),
        ("float32", (40, 41, 7, 3)),
        ("float64", (13, 11, 5)),
        ("int64", (9, 7, 5)),
        ("RGB24", (21, 19, 7)),
        ("complex64", (8, 9, 10)),
    ],
)
def test_load_array_equals_nibabel(tmp_path, suffix, version, dtype, shape):
    path = write_nifti(tmp_path / f"vol{suffix}", volume(dtype, shape, seed=version), version)
    _check(stoker.load_array(path, device="cuda"), _reference(path))


@pytest.mark.parametrize("suffix", [".nii", ".nii.gz"])
@pytest.mark.parametrize("dtype", ["int16", "float64", "complex64"])
def test_big_endian_is_swapped_on_the_device(tmp_path, suffix, dtype):
    path = write_nifti(tmp_path / f"be{suffix}", volume(dtype, (23, 19, 11), seed=4), 2, True)
    _check(stoker.load_array(path, device="cuda"), _reference(path))


@pytest.mark.parametrize("suffix", [".nii", ".nii.gz"])
def test_tens_of_megabytes_span_several_pinned_slots(tmp_path, suffix):
    # 40 MiB of int16: more than two 16 MiB bounce slots, the last one partial.
    data = volume("int16", (256, 256, 320), seed=8)
    path = write_nifti(tmp_path / f"big{suffix}", data, 1)
    _check(stoker.load_array(path, device="cuda:0"), _reference(path))


@pytest.mark.parametrize("suffix", [".nii", ".nii.gz"])
def test_scale_on_the_device_equals_the_cpu(tmp_path, suffix):
    data = volume("int16", (30, 20, 10), seed=9)
    path = write_nifti(tmp_path / "vol.nii", data)
    with open(path, "r+b") as f:  # scl_slope, scl_inter
        f.seek(112)
        f.write(np.array([0.25, -100.0], "<f4").tobytes())
    if suffix == ".nii.gz":
        path = gzip_copy(path)
    got = stoker.load_array(path, device="cuda", scale=True)
    assert got.device == GPU and got.dtype == torch.float32
    expected = torch.from_numpy(np.asarray(nib.load(path).get_fdata(), np.float32))
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-6, atol=1e-5)
    assert torch.equal(got.cpu(), stoker.load_array(path, device="cpu", scale=True))


def test_gds_cache_from_a_nii_gz_on_the_gpu(tmp_path):
    path = write_nifti(tmp_path / "vol.nii.gz", volume("float32", (70, 60, 50), seed=10), 2)
    cache = stoker.GDSCache(tmp_path / "cache")
    cache.put("vol", path)
    _check(cache.get("vol", device="cuda"), _reference(path))


def test_a_damaged_checksum_after_the_voxels_is_refused(tmp_path):
    # The voxels end with the first gzip member; the second, after them, is still checked.
    path, _ = with_trailing(tmp_path / "tail.nii", 100, members=2)
    _check(stoker.load_array(path, device="cuda"), _reference(path))
    flip_byte(path, -8)  # its CRC-32
    with pytest.raises(stoker.ShardFormatError, match=r"tail\.nii\.gz: offset \d+:.*data check"):
        stoker.load_array(path, device="cuda")
