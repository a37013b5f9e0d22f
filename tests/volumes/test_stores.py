"""Patches of Zarr arrays and HDF5 datasets: byte for byte what numpy slicing of
zarr-python's and h5py's own reads gives, for chunked, compressed, sharded, F-order,
big-endian and contiguous layouts; only the chunks a patch touches are read; bad chunks
are named."""

from __future__ import annotations

import numpy as np
import pytest

import stoker
from tests.support.patches import check_batches

zarr = pytest.importorskip("zarr")
h5py = pytest.importorskip("h5py")
numcodecs = pytest.importorskip("numcodecs")
pytest.importorskip("torch")

SHAPES = [(23, 17, 11), (9, 30, 14)]


def data_of(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, shape, endpoint=True).astype(dtype)


def write_zarr(path, data, kind):
    if kind == "zarr3-sharded":
        group = zarr.open_group(str(path), mode="w", zarr_format=3)
        z = group.create_array(
            "image",
            shape=data.shape,
            dtype=data.dtype,
            chunks=(4, 4, 4),
            shards=(8, 8, 8),
        )
    elif kind in ("zarr3", "zarr3-raw"):
        group = zarr.open_group(str(path), mode="w", zarr_format=3)
        raw = {"compressors": None} if kind == "zarr3-raw" else {}
        z = group.create_array("image", shape=data.shape, dtype=data.dtype, chunks=(8, 8, 8), **raw)
    else:
        group = zarr.open_group(str(path), mode="w", zarr_format=2)
        kw: dict = {"chunks": (8, 7, 5), "compressors": numcodecs.Zstd(1)}
        dtype = data.dtype
        if kind == "zarr2-F-blosc":
            kw = {"chunks": (8, 7, 5), "order": "F", "compressors": numcodecs.Blosc("lz4")}
        elif kind == "zarr2-F-raw":  # read in place: only the bytes a patch's part spans
            kw = {"chunks": (8, 7, 5), "order": "F", "compressors": None}
        elif kind == "zarr2-big-endian-raw":
            kw = {"chunks": (5, 9, 11), "compressors": None}
            dtype = data.dtype.newbyteorder(">")
        z = group.create_array("image", shape=data.shape, dtype=dtype, **kw)
    z[:] = data
    return f"{path}:/image"


def write_h5(path, data, kind):
    with h5py.File(path, "w") as f:
        if kind == "h5-contiguous":
            f.create_dataset("image", data=data)
        elif kind == "h5-slices":  # chunked by whole slices, written last to first
            d = f.create_dataset(
                "image", shape=data.shape, dtype=data.dtype, chunks=(1, *data.shape[1:])
            )
            for i in reversed(range(data.shape[0])):
                d[i] = data[i]
        elif kind == "h5-big-endian":
            f.create_dataset("image", data=data.astype(data.dtype.newbyteorder(">")))
        else:
            f.create_dataset("image", data=data, chunks=(6, 5, 4), compression="gzip", shuffle=True)
    return f"{path}:/image"


KINDS = [
    "zarr2-zstd",
    "zarr2-F-blosc",
    "zarr2-F-raw",
    "zarr2-big-endian-raw",
    "zarr3",
    "zarr3-raw",
    "zarr3-sharded",
    "h5-chunked-gzip-shuffle",
    "h5-contiguous",
    "h5-slices",
    "h5-big-endian",
]


@pytest.mark.parametrize("dtype", [np.int16, np.float32, np.uint8])
@pytest.mark.parametrize("kind", KINDS)
def test_patches_are_exact(tmp_path, kind, dtype):
    truth, subjects = [], []
    for i, shape in enumerate(SHAPES):
        data = data_of(shape, dtype, i)
        if kind.startswith("zarr"):
            source = write_zarr(tmp_path / f"v{i}.zarr", data, kind)
        else:
            source = write_h5(tmp_path / f"v{i}.h5", data, kind)
        truth.append(data)
        subjects.append({"id": f"s{i}", "image": source})
    volumes = stoker.Volumes(subjects)
    for sampler in (stoker.UniformSampler(), stoker.GridSampler(overlap=0)):
        loader = stoker.PatchLoader(
            volumes, (10, 12, 16), 3, sampler=sampler, patches_per_subject=5, pad_value=7
        )
        assert check_batches(loader, truth, pad=7) > 0


def test_the_store_alone_names_its_only_array(tmp_path):
    data = data_of((12, 12, 12), np.int16, 0)
    group = zarr.open_group(str(tmp_path / "one.zarr"), mode="w", zarr_format=2)
    group.create_array("scan", shape=data.shape, dtype=data.dtype, chunks=(4, 4, 4))[:] = data
    with h5py.File(tmp_path / "one.h5", "w") as f:
        f.create_dataset("scan", data=data, chunks=(4, 4, 4), compression="gzip")
        f.create_dataset("other", data=data)
    volumes = stoker.Volumes([{"image": str(tmp_path / "one.zarr")}])
    assert check_batches(stoker.PatchLoader(volumes, 5, 2, patches_per_subject=4), [data]) == 4
    with pytest.raises(stoker.ShardFormatError, match=r"one.h5:/NAME"):
        stoker.Volumes([{"image": str(tmp_path / "one.h5")}])


def test_channels_and_a_label_from_another_format(tmp_path):
    image = data_of((2, 16, 16, 16), np.float32, 0)  # channel first
    label = (data_of((16, 16, 16), np.uint8, 1) > 200).astype(np.uint8)
    group = zarr.open_group(str(tmp_path / "s.zarr"), mode="w", zarr_format=3)
    group.create_array("image", shape=image.shape, dtype=image.dtype, chunks=(1, 8, 8, 8))[:] = (
        image
    )
    np.save(tmp_path / "label.npy", label)
    volumes = stoker.Volumes(
        [{"image": f"{tmp_path}/s.zarr:/image", "label": str(tmp_path / "label.npy")}]
    )
    loader = stoker.PatchLoader(
        volumes, 8, 4, sampler=stoker.LabelSampler("label", ratio=(1, 0)), patches_per_subject=8
    )
    assert check_batches(loader, [np.moveaxis(image, 0, -1)], key="image") == 8
    for batch in stoker.PatchLoader(
        volumes, 8, 4, sampler=stoker.LabelSampler("label", ratio=(1, 0)), patches_per_subject=8
    ):
        assert batch["image"].shape == (4, 2, 8, 8, 8)
        # every patch holds a foreground voxel (its centre, moved inside the volume)
        assert (batch["label"].flatten(1).amax(1) == 1).all()


def test_only_the_chunks_a_patch_touches_are_read(tmp_path):
    data = data_of((64, 64, 64), np.int16, 0)
    with h5py.File(tmp_path / "v.h5", "w") as f:
        f.create_dataset("image", data=data, chunks=(16, 16, 16), compression="gzip")
    volumes = stoker.Volumes([{"image": f"{tmp_path}/v.h5:/image"}])
    loader = stoker.PatchLoader(volumes, 16, 1, sampler=stoker.GridSampler(overlap=0))
    first = next(iter(loader))  # one patch on the chunk grid: one chunk
    np.testing.assert_array_equal(first["image"][0, 0].numpy(), data[:16, :16, :16])
    stats = loader.stats()
    chunk = 16**3 * 2
    assert 0 < stats["bytes_read"] <= chunk * 1.05  # one chunk (random data: deflate gains nothing)
    volume_bytes = data.nbytes
    assert stats["bytes_read"] < volume_bytes / 32


def test_a_corrupt_chunk_names_its_file(tmp_path):
    data = data_of((16, 16, 16), np.int16, 0)
    group = zarr.open_group(str(tmp_path / "c.zarr"), mode="w", zarr_format=2)
    group.create_array(
        "image", shape=data.shape, dtype=data.dtype, chunks=(8, 8, 8), compressors=numcodecs.Zlib()
    )[:] = data
    chunk = tmp_path / "c.zarr" / "image" / "0.0.0"
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    chunk.write_bytes(bytes(raw[: len(raw) - 3]))
    volumes = stoker.Volumes([{"image": f"{tmp_path}/c.zarr:/image"}])
    loader = stoker.PatchLoader(volumes, 8, 1, sampler=stoker.GridSampler(overlap=0))
    with pytest.raises(stoker.ShardFormatError, match="0.0.0"):
        list(loader)


def test_shapes_that_differ_name_both_files(tmp_path):
    group = zarr.open_group(str(tmp_path / "s.zarr"), mode="w", zarr_format=2)
    group.create_array("image", shape=(8, 8, 8), dtype="i2", chunks=(4, 4, 4))
    group.create_array("label", shape=(8, 8, 9), dtype="u1", chunks=(4, 4, 4))
    with pytest.raises(stoker.UsageError, match=r"s\.zarr:/label.*s\.zarr:/image|s\.zarr:/image"):
        stoker.Volumes(
            [
                {
                    "id": "a",
                    "image": f"{tmp_path}/s.zarr:/image",
                    "label": f"{tmp_path}/s.zarr:/label",
                }
            ]
        )


def test_dataloader_fork_workers_read_chunks_of_their_own(tmp_path):
    import torch

    truth, subjects = [], []
    for i in range(3):
        data = data_of((20, 18, 16), np.int16, i)
        subjects.append({"id": i, "image": write_zarr(tmp_path / f"v{i}.zarr", data, "zarr2-zstd")})
        truth.append(data)
    loader = stoker.PatchLoader(stoker.Volumes(subjects), 6, 4, patches_per_subject=4, seed=2)
    next(iter(loader))  # the parent's reader and decoded-chunk cache exist before the fork
    loader.set_epoch(0)
    workers = torch.utils.data.DataLoader(
        loader.iterable_dataset(), batch_size=None, num_workers=2, multiprocessing_context="fork"
    )
    assert check_batches(workers, truth, patch_size=(6, 6, 6)) == 12
