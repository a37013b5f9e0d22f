"""PatchLoader onto a real GPU: patches read into a pinned slot and copied in one copy,
permuted into patch order on the device, each equal to the same loader's CPU batch; and
patches' runs read by cuFile straight into device memory (DevicePatchReader), equal to
numpy's slices.

Skipped as a whole where no CUDA device is usable (conftest.py); the cuFile test also where
cuFile cannot be loaded."""

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


@pytest.mark.parametrize("scratch_bytes", [64 << 20, 96 << 10])
def test_cufile_gather_equals_numpy_slices(tmp_path, monkeypatch, scratch_bytes):
    """DevicePatchReader: patches' runs read by cuFile into device memory (in rounds, with a
    small scratch), byte for byte numpy's slices. Where cuFile cannot load, skipped;
    without nvidia-fs it runs in cuFile's compatibility mode (STOKER_GDS=on)."""
    from stoker.volumes.arrays import open_npy
    from stoker.volumes.boxes import patch_runs
    from stoker.volumes.device_reads import DevicePatchReader

    monkeypatch.setenv("STOKER_GDS", "on")
    data = [volume("int16", (72, 80, 96), seed=10 + i) for i in range(2)]
    paths = []
    for i, a in enumerate(data):
        np.save(tmp_path / f"v{i}.npy", a)
        paths.append(str(tmp_path / f"v{i}.npy"))
    reader = DevicePatchReader(0, paths, scratch_bytes=scratch_bytes)
    if not reader.available():
        pytest.skip(f"cuFile is not usable here: {reader.reason}")
    arrays = [open_npy(p, 3) for p in paths]
    size = (32, 24, 40)
    starts = [(0, (0, 0, 0)), (1, (40, 56, 56)), (0, (17, 5, 33)), (1, (3, 30, 1))]
    per = int(np.prod(size)) * 2
    parts = []
    for k, (f, start) in enumerate(starts):
        runs = patch_runs(arrays[f], start, size)
        ids = np.full(runs.offsets.shape, f, np.int64)
        parts.append((ids, runs.offsets, runs.lengths, runs.dest_offsets + k * per))
    ids, offsets, lengths, dests = (np.concatenate(p) for p in zip(*parts))
    want = np.concatenate(
        [
            data[f][s[0] : s[0] + size[0], s[1] : s[1] + size[1], s[2] : s[2] + size[2]]
            .reshape(-1)
            .view(np.uint8)
            for f, s in starts
        ]
    )
    with reader:
        for wait_for_consumer in (True, False):
            dest = torch.full((len(starts) * per,), 0xAB, dtype=torch.uint8, device="cuda")
            stats = reader.read(
                dest, ids, offsets, lengths, dests, wait_for_consumer=wait_for_consumer
            )
            # .cpu() runs on the current stream, which waits for the reader's copies
            assert np.array_equal(dest.cpu().numpy(), want)
            assert stats["copies_2d"] >= 1
            if scratch_bytes < 1 << 20:
                assert stats["rounds"] > 1
