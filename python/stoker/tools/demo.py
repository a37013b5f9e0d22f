"""``stoker demo``: the whole path on a small dataset, in seconds, leaving nothing behind.

A dataset of one JPEG file per sample with a CSV of ``filename,label`` rows is written to a
temporary folder, packed into tar shards with a manifest, served over HTTP on 127.0.0.1 by
a server in a process of its own, and read remote -> node cache -> batches of randomly
cropped, flipped and resized images, decoded by ``stoker.Image()``. Each stoker figure is
set beside the baseline that does the same job without stoker, decoding with Pillow in
torch's DataLoader: the remote epoch beside downloading the shards and running the
DataLoader over them, the cached epoch beside the DataLoader over one local file per sample.
"""

from __future__ import annotations

import io
import math
import os
import random
import shutil
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from stoker._process import usable_cores
from stoker.fields import FieldSpec

if TYPE_CHECKING:  # torch is imported where it is used: the demo runs without it at first
    import torch

#: The images written, (height, width), and the crops the loaders make of them.
IMAGE = (192, 256)
CROP = 128
BATCH = 64
#: Downloads at once in the download-first baseline, as `aws s3 cp` or a few wgets would.
DOWNLOADS = 4
#: Distinct scenes; every sample is one of them shifted, mirrored and lit its own way.
SCENES = 16


def _scene(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """A smooth, photo-like picture: soft colour gradients and a few blurred discs (random
    noise would not compress or decode like a photograph)."""
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    image = np.zeros((height, width, 3))
    for c in range(3):
        for _ in range(3):
            fx, fy, phase = rng.uniform(0.5, 4, 2).tolist() + [rng.uniform(0, 2 * np.pi)]
            image[..., c] += np.cos(2 * np.pi * (fx * x + fy * y) + phase)
    image = (image - image.min()) / (np.ptp(image) + 1e-9) * 200 + 20
    for _ in range(6):
        cy, cx, r = rng.uniform(0, 1, 2).tolist() + [rng.uniform(0.05, 0.25)]
        d = np.sqrt((y - cy * height / max(height, width)) ** 2 + (x - cx) ** 2)
        inside = np.clip((r - d) / 0.01, 0, 1)[..., None]
        image = image * (1 - inside) + rng.uniform(0, 255, 3) * inside
    return image


def write_files_and_csv(folder: str, samples: int, seed: int = 0) -> tuple[str, str]:
    """labels_train.csv (``filename,label`` rows) and labels_train/ (one JPEG per file)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    root = os.path.join(folder, "labels_train")
    os.makedirs(root)
    csv = os.path.join(folder, "labels_train.csv")
    labels = rng.integers(0, 10, samples)
    height, width = IMAGE
    scenes = [_scene(rng, height, width) for _ in range(SCENES)]
    shifts = rng.integers(0, width, samples)
    gains = rng.uniform(0.8, 1.2, samples)

    def write(i: int) -> None:
        image = np.roll(scenes[i % SCENES], int(shifts[i]), axis=1) * gains[i]
        if i % 2:
            image = image[:, ::-1]
        picture = Image.fromarray(np.clip(image, 0, 255).astype(np.uint8))
        picture.save(os.path.join(root, f"img{i:06d}.jpg"), quality=90)

    with ThreadPoolExecutor(usable_cores()) as pool:  # Pillow encodes without the GIL
        list(pool.map(write, range(samples)))
    with open(csv, "w") as f:
        f.write("filename,label\n")
        f.writelines(f"img{i:06d}.jpg,{labels[i]}\n" for i in range(samples))
    return csv, root


def random_resized_crop(width: int, height: int, rng: random.Random) -> tuple[int, int, int, int]:
    """RandomResizedCrop's box (area 8-100%, aspect 3/4-4/3, ten tries, then the centre),
    as torchvision draws it."""
    area = width * height
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top, left = rng.randint(0, height - h), rng.randint(0, width - w)
            return (left, top, left + w, top + h)
    w, h = width, height
    if width / height < 3 / 4:
        h = round(w / (3 / 4))
    elif width / height > 4 / 3:
        w = round(h * (4 / 3))
    left, top = (width - w) // 2, (height - h) // 2
    return (left, top, left + w, top + h)


def pillow_decode(data: bytes, rng: random.Random, size: int = CROP) -> np.ndarray:
    """What a torch user's dataset does with a JPEG: Pillow decodes it, a RandomResizedCrop
    and a random flip (torchvision's, on a PIL image), then a (3, size, size) uint8 array."""
    from PIL import Image

    image = Image.open(io.BytesIO(data)).convert("RGB")
    box = random_resized_crop(image.width, image.height, rng)
    # Pillow sets its module's constants in a loop, out of mypy's sight; their enums
    # (Image.Resampling) need Pillow 9.1, and the demo extra takes 9.0.
    image = image.resize((size, size), Image.BILINEAR, box=box)  # type: ignore[attr-defined]
    if rng.random() < 0.5:
        image = image.transpose(Image.FLIP_LEFT_RIGHT)  # type: ignore[attr-defined]
    return np.asarray(image).transpose(2, 0, 1)


class _Members:
    """Where a member's bytes are: a path, an offset, a length."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.offsets: list[int] = []
        self.sizes: list[int] = []
        self._open: dict[str, Any] = {}

    def add(self, path: str, offset: int, size: int) -> None:
        self.paths.append(path)
        self.offsets.append(offset)
        self.sizes.append(size)

    def read(self, i: int) -> bytes:
        f = self._open.get(self.paths[i])
        if f is None:
            f = self._open[self.paths[i]] = open(self.paths[i], "rb")  # noqa: SIM115
        f.seek(self.offsets[i])
        return f.read(self.sizes[i])


class TarMembersDataset:
    """What a torch user writes for tar shards on local disk, without stoker: the members
    listed once with tarfile, then a map-style dataset that reads each sample's image and
    label by offset (no unpacking into files)."""

    def __init__(self, shards: list[str]) -> None:
        self.images = _Members()
        self.rng = random.Random(0)
        labels = _Members()
        for shard in shards:
            with tarfile.open(shard) as tar:
                for member in tar.getmembers():
                    if member.name.endswith(".jpg"):
                        self.images.add(shard, member.offset_data, member.size)
                    elif member.name.endswith(".cls"):
                        labels.add(shard, member.offset_data, member.size)
        self.labels = [int(labels.read(i)) for i in range(len(labels.paths))]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        import torch

        image = pillow_decode(self.images.read(i), self.rng)
        return torch.from_numpy(image.copy()), self.labels[i]


class FilePerSampleDataset:
    """What a torch user writes without stoker: a map-style dataset that opens one file per
    sample (``paths[i]``, label ``labels[i]``)."""

    def __init__(self, paths: list[str], labels: Iterable[int]) -> None:
        self.paths = paths
        self.labels = [int(label) for label in labels]
        self.rng = random.Random(0)

    @classmethod
    def from_csv(cls, csv: str, root: str) -> FilePerSampleDataset:
        from stoker.dataset.files import read_labels_csv

        names, labels = read_labels_csv(csv)
        return cls([os.path.join(root, n) for n in names], labels)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        import torch

        with open(self.paths[i], "rb") as f:
            image = pillow_decode(f.read(), self.rng)
        return torch.from_numpy(image.copy()), self.labels[i]


def seed_worker(worker: int) -> None:
    """Each worker its own crops (a forked worker would repeat its parent's draws)."""
    import torch

    info = torch.utils.data.get_worker_info()
    assert info is not None  # a worker_init_fn runs in a worker
    dataset: Any = info.dataset  # any dataset with an `rng` (a random.Random)
    dataset.rng.seed(worker)


def _data_loader(dataset: Any) -> torch.utils.data.DataLoader:
    """torch's DataLoader as it is used for decoding: a worker process per core."""
    import torch

    return torch.utils.data.DataLoader(
        dataset,
        batch_size=BATCH,
        shuffle=True,
        num_workers=usable_cores(),
        worker_init_fn=seed_worker,
    )


def _epoch(batches: Iterable, device: str, start: float | None = None) -> tuple[int, float, float]:
    """Samples, seconds and seconds to the first batch of one pass over `batches`, timed
    from `start` (default: now)."""
    start = time.perf_counter() if start is None else start
    first = None
    samples = 0
    for batch in batches:
        images = batch["jpg"] if isinstance(batch, dict) else batch[0]
        if device != "cpu":
            images = images.to(device, non_blocking=True)
        samples += len(images)
        if first is None:
            first = time.perf_counter() - start
    if device != "cpu":
        import torch

        torch.cuda.synchronize()  # the copies still queued belong to this epoch
    seconds = time.perf_counter() - start
    return samples, seconds, first if first is not None else seconds


def _download_then_load(urls: list[str], folder: str, device: str) -> tuple[int, float, float]:
    """The remote baseline: download every shard (a few at once), then torch's DataLoader
    over the downloaded tars. Timed from the first request, as stoker's remote epoch is
    timed from opening the dataset."""
    start = time.perf_counter()
    os.makedirs(folder)

    def fetch(url: str) -> str:
        path = os.path.join(folder, url.rsplit("/", 1)[-1])
        with urllib.request.urlopen(url) as response, open(path, "wb") as out:
            shutil.copyfileobj(response, out, 1 << 20)
        return path

    with ThreadPoolExecutor(DOWNLOADS) as pool:
        shards = list(pool.map(fetch, urls))
    return _epoch(_data_loader(TarMembersDataset(shards)), device, start)


def _row(name: str, result: tuple[int, float, float], versus: str) -> str:
    n, seconds, first = result
    return f"     {name:<50} {n / seconds:>9,.0f}/s {first:>8.2f} s   {versus}"


def require_demo_packages() -> None:
    """torch (the Loader's batches, the DataLoader baseline) and Pillow (the demo's JPEGs,
    the baseline's decoder): said in one line where either is missing."""
    import importlib.util

    from stoker.errors import UsageError

    wanted = {"torch": "torch", "Pillow": "PIL"}
    missing = [name for name, module in wanted.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise UsageError(
            f"stoker demo needs {' and '.join(missing)}: pip install 'stoker[demo]' (torch's "
            "CPU build: pip install torch --index-url https://download.pytorch.org/whl/cpu)"
        )


def run(samples: int = 10_000, quiet: bool = False, keep: str | None = None) -> int:
    require_demo_packages()
    import torch

    import stoker
    from stoker.errors import human
    from stoker.tools.pack import pack
    from stoker.tools.serve import ServerProcess

    device = "cuda" if torch.cuda.is_available() and stoker.cuda_status()["cuda"] else "cpu"
    say = print
    with tempfile.TemporaryDirectory(prefix="stoker-demo-") as folder:
        work = keep or folder
        start = time.perf_counter()
        csv, root = write_files_and_csv(work, samples)
        say(
            f"1. wrote {samples:,} JPEG images of {IMAGE[1]}x{IMAGE[0]}, one file per sample, "
            f"in {os.path.relpath(root, work)}/, and their labels in "
            f"{os.path.relpath(csv, work)} ({time.perf_counter() - start:.1f} s)"
        )
        start = time.perf_counter()
        packed = pack(
            stoker.Dataset.from_csv(csv, root),
            os.path.join(work, "shards"),
            samples_per_shard=max(1, samples // 10),
            shuffle=True,
            stratify=True,
            quiet=True,
        )
        say(
            f"2. packed them into {len(packed.shards)} tar shards + stoker.json, shuffled "
            f"and stratified by label ({human(packed.bytes)}, "
            f"{time.perf_counter() - start:.1f} s)"
        )
        with ServerProcess(os.path.join(work, "shards")) as server:
            say(f"3. serving the shards at {server.url}/ from a process of its own")
            image = stoker.Image(size=CROP, crop="random", flip=True)
            fields: dict[str, FieldSpec] = {"jpg": image, "cls": stoker.Int()}
            start = time.perf_counter()  # opening the dataset counts: it is one request
            ds = stoker.Dataset(
                server.url_for("stoker.json"), cache_dir=os.path.join(work, "cache")
            )
            loader = stoker.Loader(ds, batch_size=BATCH, seed=0, fields=fields, device=device)
            remote = _epoch(loader, device, start)
            cached = _epoch(loader, device)
            urls = [server.url_for(os.path.basename(p)) for p in packed.shards]
            download_first = _download_then_load(urls, os.path.join(work, "download"), device)
        local = _epoch(_data_loader(FilePerSampleDataset.from_csv(csv, root)), device)

        def times(result: tuple[int, float, float], baseline: tuple[int, float, float]) -> str:
            return f"{(result[0] / result[1]) / (baseline[0] / baseline[1]):.1f}x"

        say(
            f"4. one shuffled epoch each: batches of {BATCH} random {CROP}x{CROP} crops, "
            f"flipped half the time, on {device}; stoker decodes with stoker.Image() on its "
            f"threads, the DataLoader with Pillow in {usable_cores()} worker processes:\n"
        )
        say(f"     {'':<50} {'samples/s':>11} {'1st batch':>10}")
        say("   over HTTP, from the server process:")
        say(
            _row(
                "stoker: remote -> node cache -> batches",
                remote,
                f"{times(remote, download_first)} the download-first baseline",
            )
        )
        say(_row("baseline: download, then torch DataLoader", download_first, "1.0x"))
        say("   from this machine's disk:")
        say(
            _row(
                "stoker: from its node cache (the 2nd epoch)",
                cached,
                f"{times(cached, local)} the DataLoader",
            )
        )
        say(_row("baseline: torch DataLoader, one file per sample", local, "1.0x"))
        if keep:
            say(f"\nkept everything in {keep}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run())
