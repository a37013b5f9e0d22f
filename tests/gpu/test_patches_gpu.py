"""PatchLoader onto a real GPU: patches read into a pinned slot and copied in one copy,
permuted into patch order on the device, each equal to the same loader's CPU batch.

Skipped as a whole where no CUDA device is usable (conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import stoker
from tests.support.nifti_volumes import volume, write_nifti

nib = pytest.importorskip("nibabel")


@pytest.mark.parametrize("suffix", [".nii", ".nii.gz", ".npy"])
def test_device_patches_equal_cpu_patches(tmp_path, suffix):
    subjects = []
    for i in range(3):
        data = volume("int16", (40, 36, 30), seed=i)
        label = (data > 0).astype(np.uint8)
        if suffix == ".npy":
            np.save(tmp_path / f"i{i}.npy", data)
            np.save(tmp_path / f"l{i}.npy", label)
        else:
            write_nifti(tmp_path / f"i{i}{suffix}", data)
            write_nifti(tmp_path / f"l{i}{suffix}", label)
        subjects.append(
            {"image": str(tmp_path / f"i{i}{suffix}"), "label": str(tmp_path / f"l{i}{suffix}")}
        )
    volumes = stoker.Volumes(subjects, cache_dir=tmp_path / "cache")
    options = dict(sampler=stoker.LabelSampler("label"), patches_per_subject=6, seed=3)
    cpu = list(stoker.PatchLoader(volumes, 16, 4, **options))
    gpu = list(stoker.PatchLoader(volumes, 16, 4, device="cuda", **options))
    assert len(cpu) == len(gpu)
    for a, b in zip(cpu, gpu):
        for key in ("image", "label"):
            assert b[key].device.type == "cuda" and b[key].is_contiguous()
            assert torch.equal(a[key], b[key].cpu())
        assert torch.equal(a["location"], b["location"])
