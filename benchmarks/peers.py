"""The peers' loaders as the benchmarks drive them, each the way its own documentation or
tutorial has its users write it. In one module so that two benchmarks that measure against
the same peer measure the same thing, and a change to how a peer is driven is made once.

Imports of the peers (and of torch) happen inside the functions: the parent process of a
benchmark, which only starts children and prints tables, never pays for them.
"""

from __future__ import annotations

import os
import random
import tarfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

# -- torch's DataLoader baselines: map-style datasets -----------------------------------


def files_and_labels(csv_path: str, folder: str) -> tuple[list[str], np.ndarray]:
    """One file per sample with a ``filename,label`` CSV: each sample's path under `folder`
    and the labels (int64), in the CSV's order."""
    import pandas as pd

    table = pd.read_csv(csv_path)
    paths = [os.path.join(folder, name) for name in table.iloc[:, 0]]
    return paths, table.iloc[:, 1].to_numpy()


def files_with_labels_dataset(
    csv_path: str, folder: str, decode: Callable[[bytes, random.Random], Any]
) -> Any:
    """torch's tutorial dataset ("Writing Custom Datasets"): a pandas table of ``filename,
    label`` rows, each ``__getitem__`` looking its row up with ``iloc``, reading the file and
    returning ``(decode(its bytes, rng), label)``. ``rng`` (``random.Random(0)``, the
    dataset's ``.rng``) is for random augmentations; seed it per worker in
    ``worker_init_fn``."""
    import pandas as pd
    from torch.utils.data import Dataset

    class CustomImageDataset(Dataset):
        def __init__(self) -> None:
            self.img_labels = pd.read_csv(csv_path)
            self.img_dir = folder
            self.rng = random.Random(0)

        def __len__(self) -> int:
            return len(self.img_labels)

        def __getitem__(self, idx: int) -> tuple[Any, int]:
            img_path = os.path.join(self.img_dir, self.img_labels.iloc[idx, 0])
            with open(img_path, "rb") as f:
                image = decode(f.read(), self.rng)
            return image, int(self.img_labels.iloc[idx, 1])

    return CustomImageDataset()


def h5py_rows(path: str) -> Any:
    """The h5py recipe: a map-style dataset that opens the file on first use in each
    process (never in the parent before the workers fork)."""
    import h5py
    import torch
    from torch.utils.data import Dataset

    class H5Rows(Dataset):
        def __init__(self, path: str) -> None:
            self.path = path
            self.file = None
            with h5py.File(path, "r") as f:
                self.length = len(f["labels"])

        def __len__(self) -> int:
            return self.length

        def __getitem__(self, i: int):
            if self.file is None:
                self.file = h5py.File(self.path, "r")
                self.images = self.file["images"]
                self.labels = self.file["labels"]
            return torch.from_numpy(self.images[i]), int(self.labels[i])

    return H5Rows(path)


def zarr_rows(path: str) -> Any:
    """The same with zarr-python: the group opened on first use in each process."""
    import torch
    import zarr
    from torch.utils.data import Dataset

    class ZarrRows(Dataset):
        def __init__(self, path: str) -> None:
            self.path = path
            self.group = None
            self.length = zarr.open_group(path, mode="r")["labels"].shape[0]

        def __len__(self) -> int:
            return self.length

        def __getitem__(self, i: int):
            if self.group is None:
                self.group = zarr.open_group(self.path, mode="r")
                self.images = self.group["images"]
                self.labels = self.group["labels"]
            return torch.from_numpy(self.images[i]), int(self.labels[i])

    return ZarrRows(path)


class TarNpySamples:
    """The DataLoader's dataset: every ``.npy`` member's data range and every label, found
    once with tarfile and numpy's header reader; ``__getitem__`` reads one image with one
    ``preadv`` into a fresh array (files opened per process, so forked workers are fine)."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        files, offsets, labels = [], [], []
        self.shape: tuple[int, ...] = ()
        self.dtype = np.dtype(np.uint8)
        for s, path in enumerate(paths):
            header = None
            with tarfile.open(path) as tar:
                for member in tar:
                    if member.name.endswith(".npy"):
                        if header is None:  # every member of a shard has the same header
                            header = self._header(tar, member)
                        files.append(s)
                        offsets.append(member.offset_data + header)
                    elif member.name.endswith(".cls"):
                        labels.append(int(tar.extractfile(member).read()))
        self.files = np.array(files)
        self.offsets = np.array(offsets, np.int64)
        self.labels = labels
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize
        self._fds: dict[int, int] = {}
        self._pid = os.getpid()

    def _header(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> int:
        f = tar.fileobj
        f.seek(member.offset_data)
        version = np.lib.format.read_magic(f)
        read = (
            np.lib.format.read_array_header_1_0
            if version == (1, 0)
            else np.lib.format.read_array_header_2_0
        )
        shape, _, self.dtype = read(f)
        self.shape = tuple(shape)
        return f.tell() - member.offset_data

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int):
        import torch

        if self._pid != os.getpid():  # a forked worker: its own descriptors
            self._fds, self._pid = {}, os.getpid()
        s = int(self.files[i])
        if s not in self._fds:
            self._fds[s] = os.open(self.paths[s], os.O_RDONLY)
        image = np.empty(self.shape, self.dtype)
        got = os.preadv(self._fds[s], [memoryview(image).cast("B")], int(self.offsets[i]))
        if got != self.nbytes:
            raise OSError(f"{self.paths[s]}: short read at {int(self.offsets[i])}")
        return torch.from_numpy(image), self.labels[i]


# -- SPDL, WebDataset, LitData ------------------------------------------------------------


class _SpdlEpochs:
    """An SPDL pipeline runs once: each epoch builds it anew."""

    def __init__(self, builder: Any, threads: int) -> None:
        self.builder = builder
        self.threads = threads

    def __iter__(self) -> Any:
        pipeline = self.builder.build(num_threads=self.threads)
        with pipeline.auto_stop():
            yield from pipeline


def spdl_loader(
    source: Sequence[Any],
    load: Callable[[Any], Any],
    *,
    concurrency: int,
    threads: int,
    batch: int | None = None,
    collate: Callable[[list[Any]], Any] | None = None,
) -> Any:
    """SPDL's pipeline: `load` each item of `source` on `concurrency` tasks; with `batch`,
    `batch` results at a time are aggregated and `collate` makes the batch (without, `load`
    makes batches itself); a sink of 4; `threads` threads."""
    from spdl.pipeline import PipelineBuilder

    builder = PipelineBuilder().add_source(source).pipe(load, concurrency=concurrency)
    if batch is not None:
        builder = builder.aggregate(batch).pipe(collate)
    return _SpdlEpochs(builder.add_sink(4), threads)


def webdataset_loader(
    urls: str | list[str],
    *,
    shuffle_shards: int,
    image_field: str,
    shape: tuple[int, ...],
    batch: int,
    workers: int,
    seed: int | None = None,
) -> Any:
    """WebDataset's recipe: the shards shuffled, a 1,000-sample shuffle buffer, each
    sample's `image_field` as a uint8 tensor of `shape` and its ``cls`` as an int, batched
    in the pipeline, in a ``WebLoader`` with `workers` workers."""
    import torch
    import webdataset as wds

    def to_tensors(sample: dict[str, Any]) -> tuple[Any, int]:
        image = torch.frombuffer(bytearray(sample[image_field]), dtype=torch.uint8).reshape(shape)
        return image, int(sample["cls"])

    pipeline = (
        wds.WebDataset(urls, shardshuffle=shuffle_shards, seed=seed, empty_check=False)
        .shuffle(1000)
        .map(to_tensors)
        .batched(batch)
    )
    return wds.WebLoader(pipeline, batch_size=None, num_workers=workers)


def litdata_loader(input_dir: str, *, batch: int, workers: int, **options: Any) -> Any:
    """LitData's ``StreamingDataset(input_dir, shuffle=True, **options)`` in its
    ``StreamingDataLoader`` with `workers` workers."""
    from litdata import StreamingDataLoader, StreamingDataset

    dataset = StreamingDataset(input_dir, shuffle=True, **options)
    return StreamingDataLoader(dataset, batch_size=batch, num_workers=workers)


# -- patches of volumes: what MONAI's and TorchIO's pipelines do per sample --------------


def volume_patch_dataset(
    subjects: Sequence[dict[str, str]], patch: int, patches: int, seed: int, *, sliced: bool
) -> Any:
    """A map-style dataset of `patches` random patches of `patch`^3 voxels from the
    subjects' "image" and "label" volumes, returned as channel-first tensors.

    ``sliced=False`` loads each subject's volumes whole with nibabel (or numpy) and crops,
    per sample, as MONAI's ``LoadImaged`` + ``RandSpatialCropd`` and TorchIO's subject
    loading do (neither MONAI nor TorchIO installs where these benchmarks run, so their
    operations are written out here); a ``.nii.gz`` is inflated whole for every sample.
    ``sliced=True`` reads only the patch through nibabel's array proxy (``dataobj[...]``)
    or a memory-mapped ``.npy``: the strongest pure-Python per-sample reader."""
    import nibabel
    import torch

    def load(path: str, box: tuple[slice, ...] | None) -> np.ndarray:
        if path.endswith(".npy"):
            array = np.load(path, mmap_mode="r" if box is not None else None)
        else:
            proxy = nibabel.load(path).dataobj
            array = proxy if box is not None else np.asanyarray(proxy)
        return np.ascontiguousarray(array[box] if box is not None else array)

    class Patches(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return patches

        def __getitem__(self, i: int) -> dict[str, Any]:
            subject = subjects[i % len(subjects)]
            rng = np.random.default_rng([seed, i])
            if sliced:
                shape = _volume_shape(subject["image"])
                start = [int(rng.integers(0, s - patch + 1)) for s in shape]
                box = tuple(slice(s, s + patch) for s in start)
                out = {k: load(subject[k], box) for k in ("image", "label")}
            else:
                whole = {k: load(subject[k], None) for k in ("image", "label")}
                shape = whole["image"].shape
                start = [int(rng.integers(0, s - patch + 1)) for s in shape]
                box = tuple(slice(s, s + patch) for s in start)
                out = {k: np.ascontiguousarray(v[box]) for k, v in whole.items()}
            return {k: torch.from_numpy(v)[None] for k, v in out.items()} | {"pid": os.getpid()}

    return Patches()


def _volume_shape(path: str) -> tuple[int, ...]:
    import nibabel

    if path.endswith(".npy"):
        return tuple(np.load(path, mmap_mode="r").shape)
    return tuple(nibabel.load(path).shape)
