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


# -- patches of volumes and slides: TorchIO, MONAI, zarr-python, tifffile, OpenSlide -------

# TorchIO's Queue: each volume loaded by the Queue's workers yields this many patches, and
# the queue holds up to this many (the patches of 8 volumes, so that a batch mixes
# subjects). Its docs' example has 10 a volume and 300 in the queue, for 96^3 patches.
TORCHIO_SAMPLES_PER_VOLUME = 8
TORCHIO_QUEUE_LENGTH = 64
# MONAI's RandCropByPosNegLabeld crops this many patches from each loaded volume; the
# DataLoader's batch_size is the batch over it (the spleen tutorial: 4 samples, batch 2).
MONAI_NUM_SAMPLES = 4


def random_box(rng: np.random.Generator, shape: Sequence[int], patch: int) -> tuple[slice, ...]:
    """A uniformly random box of `patch` along each of `shape`'s axes, inside them."""
    return tuple(
        slice(start, start + patch)
        for start in (int(rng.integers(0, s - patch + 1)) for s in shape)
    )


def _torchio_npy_reader(path: Any) -> tuple[np.ndarray, np.ndarray]:
    """TorchIO reads a .npy through a custom reader (its docs' ``numpy_reader`` example),
    which must return channel-first data and an affine."""
    return np.load(path)[None], np.eye(4)


def torchio_queue_loader(
    subjects: Sequence[dict[str, str]],
    patch: int,
    batch: int,
    *,
    label: bool,
    workers: int = 2,
    samples_per_volume: int = TORCHIO_SAMPLES_PER_VOLUME,
    max_length: int = TORCHIO_QUEUE_LENGTH,
) -> Any:
    """TorchIO's patch pipeline as its docs have it: a ``SubjectsDataset`` of subjects with
    a ``ScalarImage`` "image" and a ``LabelMap`` "label", a ``Queue`` with a
    ``UniformSampler`` (or, with `label`, a ``LabelSampler`` drawing background and
    foreground centres 1:1) loading volumes in `workers` processes, popped by a
    ``SubjectsLoader`` with ``num_workers=0`` (the Queue's docs: "this must be 0"). Each
    pass over it is ``len(subjects) * samples_per_volume`` patches."""
    import torchio as tio

    def image(kind: type, path: str) -> Any:
        return kind(path, reader=_torchio_npy_reader) if path.endswith(".npy") else kind(path)

    dataset = tio.SubjectsDataset(
        [
            tio.Subject(
                image=image(tio.ScalarImage, s["image"]), label=image(tio.LabelMap, s["label"])
            )
            for s in subjects
        ]
    )
    sampler = (
        tio.LabelSampler(patch, label_name="label", label_probabilities={0: 1, 1: 1})
        if label
        else tio.UniformSampler(patch)
    )
    queue = tio.Queue(dataset, max_length, samples_per_volume, sampler, num_workers=workers)
    return tio.SubjectsLoader(queue, batch_size=batch, num_workers=0)


def monai_patch_loader(
    subjects: Sequence[dict[str, str]],
    patch: int,
    batch: int,
    *,
    workers: int = 2,
    cache_dir: str | None = None,
    num_samples: int = MONAI_NUM_SAMPLES,
) -> Any:
    """MONAI's patch pipeline as its tutorials have it: ``LoadImaged`` +
    ``EnsureChannelFirstd`` + ``RandCropByPosNegLabeld`` (foreground and background
    centres 1:1, `num_samples` patches a loaded volume) over a ``monai.data.Dataset`` of
    the subjects' dicts, or with `cache_dir` a ``PersistentDataset`` (the transforms before
    the first random one cached there: its first pass writes the cache, later passes read
    it), in a ``monai.data.DataLoader`` with `workers` workers and ``batch_size`` `batch` /
    `num_samples`. Each pass over it is ``len(subjects) * num_samples`` patches."""
    from monai.data import DataLoader, Dataset, PersistentDataset
    from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, RandCropByPosNegLabeld

    keys = ["image", "label"]
    transform = Compose(
        [
            LoadImaged(keys=keys),
            EnsureChannelFirstd(keys=keys),
            RandCropByPosNegLabeld(
                keys=keys,
                label_key="label",
                spatial_size=(patch,) * 3,
                pos=1,
                neg=1,
                num_samples=num_samples,
            ),
        ]
    )
    data = [{k: s[k] for k in keys} for s in subjects]
    dataset = (
        Dataset(data, transform)
        if cache_dir is None
        else PersistentDataset(data, transform, cache_dir=cache_dir)
    )
    return DataLoader(
        dataset,
        batch_size=max(1, batch // num_samples),
        shuffle=True,
        num_workers=workers,
        persistent_workers=workers > 0,
    )


def volume_patch_dataset(
    subjects: Sequence[dict[str, str]], patch: int, patches: int, seed: int, *, sliced: bool
) -> Any:
    """A map-style dataset of `patches` random patches of `patch`^3 voxels from the
    subjects' "image" and "label" volumes, returned as channel-first tensors: the
    written-out per-sample loaders of the first figures, kept for continuity.

    ``sliced=False`` loads each subject's volumes whole with nibabel (or numpy) and crops,
    per sample, as MONAI's ``LoadImaged`` + ``RandSpatialCropd`` and TorchIO's subject
    loading do, without their transforms' and collation's overhead; a ``.nii.gz`` is
    inflated whole for every sample. ``sliced=True`` reads only the patch through
    nibabel's array proxy (``dataobj[...]``) or a memory-mapped ``.npy``: the strongest
    pure-Python per-sample reader."""
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
                box = random_box(rng, _volume_shape(subject["image"]), patch)
                out = {k: load(subject[k], box) for k in ("image", "label")}
            else:
                whole = {k: load(subject[k], None) for k in ("image", "label")}
                box = random_box(rng, whole["image"].shape, patch)
                out = {k: np.ascontiguousarray(v[box]) for k, v in whole.items()}
            return {k: torch.from_numpy(v)[None] for k, v in out.items()}

    return Patches()


def _volume_shape(path: str) -> tuple[int, ...]:
    import nibabel

    if path.endswith(".npy"):
        return tuple(np.load(path, mmap_mode="r").shape)
    return tuple(nibabel.load(path).shape)


def _open_zarr(name: str) -> Any:
    """A Zarr array named as stoker.Volumes names one: ``store.zarr:/path``."""
    import zarr

    store, _, inner = name.rpartition(":/")
    return zarr.open_array(store, path=inner, mode="r")


def zarr_patch_dataset(
    subjects: Sequence[dict[str, str]], patch: int, patches: int, seed: int
) -> Any:
    """A map-style dataset of `patches` random patches of `patch`^3 voxels, each sliced
    from the subjects' Zarr "image" and "label" arrays with zarr-python (which reads and
    decodes only the chunks the slice touches), as channel-first tensors; the arrays are
    opened on first use in each process (never in the parent before workers fork)."""
    import torch

    class ZarrPatches(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.arrays: dict[int, dict[str, Any]] = {}
            self.pid = os.getpid()

        def __len__(self) -> int:
            return patches

        def __getitem__(self, i: int) -> dict[str, Any]:
            if self.pid != os.getpid():
                self.arrays, self.pid = {}, os.getpid()
            s = i % len(subjects)
            if s not in self.arrays:
                self.arrays[s] = {k: _open_zarr(subjects[s][k]) for k in ("image", "label")}
            arrays = self.arrays[s]
            box = random_box(np.random.default_rng([seed, i]), arrays["image"].shape, patch)
            return {k: torch.from_numpy(a[box])[None] for k, a in arrays.items()}

    return ZarrPatches()


def slide_patch_dataset(path: str, patch: int, patches: int, seed: int, *, reader: str) -> Any:
    """A map-style dataset of `patches` random `patch`^2 RGB patches of the slide at
    `path` (level 0), as (3, patch, patch) uint8 tensors, each read on its own:
    ``reader="tifffile"`` slices the zarr array over ``tifffile.imread(path,
    aszarr=True)``, tifffile's documented way to a region (it reads and decodes only the
    tiles the patch touches); ``reader="tifffile-tiles"`` reads each tile the patch
    touches with ``os.pread`` at the offset the page gives and decodes it with
    ``TiffPage.decode`` (tifffile's per-tile API, without zarr's machinery: its fastest
    way to a region here); ``reader="openslide"`` calls OpenSlide's ``read_region`` (RGBA,
    its alpha dropped). The slide is opened on first use in each process."""
    import tifffile
    import torch

    with tifffile.TiffFile(path) as tiff:
        height, width = tiff.pages[0].shape[:2]
    if reader not in ("tifffile", "tifffile-tiles", "openslide"):
        raise ValueError(f"reader={reader!r}: 'tifffile', 'tifffile-tiles' or 'openslide'")

    class TileReader:
        """Level 0's tiles, each read and decoded by tifffile when a patch touches it."""

        def __init__(self) -> None:
            self.tiff = tifffile.TiffFile(path)
            self.page = self.tiff.pages[0]
            self.fd = self.tiff.filehandle.fileno()
            self.across = -(-width // self.page.tilewidth)

        def __getitem__(self, box: tuple[slice, slice]) -> np.ndarray:
            rows, cols = box
            page, th, tw = self.page, self.page.tilelength, self.page.tilewidth
            out = np.empty((rows.stop - rows.start, cols.stop - cols.start, 3), np.uint8)
            for ty in range(rows.start // th, (rows.stop - 1) // th + 1):
                for tx in range(cols.start // tw, (cols.stop - 1) // tw + 1):
                    index = ty * self.across + tx
                    data = os.pread(self.fd, page.databytecounts[index], page.dataoffsets[index])
                    tile = page.decode(data, index, jpegtables=page.jpegtables)[0]
                    tile = tile.reshape(th, tw, -1)
                    y0, y1 = max(rows.start, ty * th), min(rows.stop, (ty + 1) * th)
                    x0, x1 = max(cols.start, tx * tw), min(cols.stop, (tx + 1) * tw)
                    out[y0 - rows.start : y1 - rows.start, x0 - cols.start : x1 - cols.start] = (
                        tile[y0 - ty * th : y1 - ty * th, x0 - tx * tw : x1 - tx * tw, :3]
                    )
            return out

    class SlidePatches(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.slide: Any = None
            self.pid = os.getpid()

        def __len__(self) -> int:
            return patches

        def _open(self) -> Any:
            if reader == "openslide":
                import openslide

                return openslide.OpenSlide(path)
            if reader == "tifffile-tiles":
                return TileReader()
            import zarr

            return zarr.open(tifffile.imread(path, aszarr=True), mode="r")

        def __getitem__(self, i: int) -> Any:
            if self.slide is None or self.pid != os.getpid():
                self.slide, self.pid = self._open(), os.getpid()
            rows, cols = random_box(np.random.default_rng([seed, i]), (height, width), patch)
            if reader == "openslide":
                region = self.slide.read_region((cols.start, rows.start), 0, (patch, patch))
                pixels = np.asarray(region)[..., :3]
            else:
                pixels = self.slide[rows, cols]
            return torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1)

    return SlidePatches()
