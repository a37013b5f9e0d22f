"""Decoding JPEGs into training batches: stoker.Image() against the loaders that decode with
Pillow, and against a bare C++ decode loop.

    python benchmarks/decode.py [--samples 10000] [--images 3000] [--runs 3] [--only NAME ...]

The data (written once under --data): --samples JPEGs of photographs (scikit-image's sample
photos, cut at random places and scales and resized to the usual ImageNet sizes, 500x375,
375x500, 500x333 and 400x300, quality 90), as one file per sample with a filename,label CSV
(as torch's tutorial keeps images; the DataLoader reads these) and as tar shards with a
stoker.json; and the same shards re-encoded by ``stoker pack --image-size 256``.

Every loader makes shuffled batches of 64 RandomResizedCrop(224) images (uint8, 3x224x224)
and their labels; each measurement runs in a fresh process and times --images images after
its first batch. The DataLoader's dataset decodes with Pillow and crops with the
RandomResizedCrop rules in Python (what torchvision does with a PIL image; torchvision is
not used, its PyPI build does not load beside the CPU torch here). The ceiling decodes every
image whole with libjpeg-turbo and resizes it to 224x224 on bare threads, one per core, with
no batching, no shuffling and no crop. SPDL decodes with FFmpeg (its Python package needs
FFmpeg's shared libraries: on Debian 12 `apt-get install libavformat59 libavfilter8
libavdevice59`); where it does not import, its row says why. Loaders take turns for --runs
rounds; the table shows medians and ratios to the ceiling and to the best DataLoader.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time

import numpy as np
import peers

from stoker._process import usable_cores
from stoker.tools import measure
from stoker.tools.demo import pillow_decode, seed_worker  # the Pillow baseline's decode

BATCH = 64
SIZE = 224
SIZES = [(500, 375), (375, 500), (500, 333), (400, 300)]  # (width, height)
TIMEOUT = 1800  # seconds per measurement, far over any at the default size: a hang fails its row


# -- data ---------------------------------------------------------------------


def _photos() -> list[np.ndarray]:
    import skimage.data as sd

    names = ["astronaut", "chelsea", "coffee", "rocket", "immunohistochemistry", "retina"]
    photos = [getattr(sd, n)() for n in names if hasattr(sd, n)]
    return [p[..., :3] for p in photos if p.ndim == 3]


def photo_jpeg(photo, rng: random.Random) -> bytes:
    """A JPEG (quality 90) of a random window of the PIL image `photo`, at one of SIZES,
    flipped half the time."""
    from PIL import Image

    w, h = SIZES[rng.randrange(len(SIZES))]
    scale = rng.uniform(0.5, 1.0)  # the window keeps the output's aspect ratio
    cw = min(photo.width, photo.height * w / h) * scale
    ch = cw * h / w
    x0, y0 = rng.uniform(0, photo.width - cw), rng.uniform(0, photo.height - ch)
    image = photo.resize((w, h), Image.BICUBIC, box=(x0, y0, x0 + cw, y0 + ch))
    if rng.random() < 0.5:
        image = image.transpose(Image.FLIP_LEFT_RIGHT)
    out = io.BytesIO()
    image.save(out, "JPEG", quality=90)
    return out.getvalue()


def prepare(folder: str, n: int, shards: int = 10) -> None:
    """Write the files, the shards and the re-encoded shards, each unless already there."""
    from PIL import Image

    stamp = os.path.join(folder, "done")
    if not os.path.exists(stamp):
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(os.path.join(folder, "files"))
        os.makedirs(os.path.join(folder, "shards"))
        rng = random.Random(0)
        photos = [Image.fromarray(p) for p in _photos()]
        per_shard = math.ceil(n / shards)
        rows = []
        tars = [
            tarfile.open(os.path.join(folder, "shards", f"shard-{s:04d}.tar"), "w")  # noqa: SIM115
            for s in range(shards)
        ]
        for i in range(n):
            data, label = photo_jpeg(photos[i % len(photos)], rng), i % 1000
            name = f"{i:06d}.jpg"
            with open(os.path.join(folder, "files", name), "wb") as f:
                f.write(data)
            rows.append(f"{name},{label}\n")
            tar = tars[i // per_shard]
            for member, payload in ((name, data), (f"{i:06d}.cls", str(label).encode())):
                info = tarfile.TarInfo(member)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
        for tar in tars:
            tar.close()
        with open(os.path.join(folder, "labels.csv"), "w") as f:
            f.write("filename,label\n")
            f.writelines(rows)
        shards_dir = os.path.join(folder, "shards")
        subprocess.run(["stoker", "index", shards_dir], check=True, capture_output=True)
        subprocess.run(
            ["stoker", "pack", shards_dir, os.path.join(folder, "resized"), "--image-size", "256"],
            check=True,
            capture_output=True,
        )
        open(stamp, "w").close()


# -- the loaders ----------------------------------------------------------------


def run_dataloader(folder: str, workers: int):
    import torch
    from torch.utils.data import DataLoader

    def decode(data: bytes, rng: random.Random) -> torch.Tensor:
        return torch.from_numpy(pillow_decode(data, rng, SIZE).copy())

    jpegs = peers.files_with_labels_dataset(
        os.path.join(folder, "labels.csv"), os.path.join(folder, "files"), decode
    )
    return DataLoader(
        jpegs, batch_size=BATCH, shuffle=True, num_workers=workers, worker_init_fn=seed_worker
    )


def run_stoker_map(folder: str):
    import stoker

    rng = random.Random(0)

    def decode(sample):
        image = pillow_decode(bytes(sample["jpg"]), rng, SIZE)
        return {"image": image, "label": int(bytes(sample["cls"]))}

    return stoker.Loader(stoker.Dataset(os.path.join(folder, "shards")), BATCH, map=decode)


def run_stoker(folder: str, crop: str, shards: str = "shards"):
    import stoker

    fields = {"jpg": stoker.Image(size=SIZE, crop=crop, flip=crop == "random"), "cls": stoker.Int()}
    return stoker.Loader(stoker.Dataset(os.path.join(folder, shards)), BATCH, fields=fields)


def run_spdl(folder: str):
    """SPDL's pipeline, decoding with FFmpeg on a thread per core. The crop is RandomResizedCrop
    in FFmpeg's filter language: an area and aspect ratio drawn per image, clamped to the
    image instead of retried, then a bilinear scale to 224 and RGB."""
    import spdl.io
    import torch

    paths, labels = peers.files_and_labels(
        os.path.join(folder, "labels.csv"), os.path.join(folder, "files")
    )
    order = np.random.default_rng(0).permutation(len(paths))
    rng = random.Random(0)

    def load(i):
        area = rng.uniform(0.08, 1.0)
        aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        x, y = rng.random(), rng.random()
        crop = (
            f"crop=w=min(iw\\,sqrt(iw*ih*{area}*{aspect})):h=min(ih\\,sqrt(iw*ih*{area}/{aspect}))"
            f":x=(iw-ow)*{x}:y=(ih-oh)*{y}"
        )
        packets = spdl.io.demux_image(paths[i])
        frames = spdl.io.decode_packets(
            packets, filter_desc=f"{crop},scale={SIZE}:{SIZE}:flags=bilinear,format=rgb24"
        )
        return np.asarray(spdl.io.convert_frames(frames)).transpose(2, 0, 1), int(labels[i])

    def collate(items):
        return torch.from_numpy(np.stack([x[0] for x in items])), [x[1] for x in items]

    threads = usable_cores()
    return peers.spdl_loader(
        order.tolist(), load, concurrency=threads, threads=threads, batch=BATCH, collate=collate
    )


LOADERS = {
    "DataLoader + Pillow, 0 workers": lambda d: run_dataloader(d, 0),
    "DataLoader + Pillow, 2 workers": lambda d: run_dataloader(d, 2),
    "stoker Loader(map=) + Pillow": run_stoker_map,
    "SPDL pipeline, FFmpeg decode + crop": run_spdl,
    "stoker Image(crop='random')": lambda d: run_stoker(d, "random"),
    "stoker Image(crop='center')": lambda d: run_stoker(d, "center"),
    "stoker Image(crop='random'), pack --image-size 256": lambda d: run_stoker(
        d, "random", "resized"
    ),
}
CEILING = "ceiling: bare libjpeg-turbo decode + resize, all cores"


def _count(batch) -> int:
    if isinstance(batch, dict):
        return len(batch["jpg"] if "jpg" in batch else batch["image"])
    return len(batch[0])


def child(name: str, folder: str, images: int) -> dict:
    import torch  # noqa: F401 - imports are not what is measured

    if name == CEILING:
        from stoker import _core

        with open(os.path.join(folder, "labels.csv")) as f:
            names = [line.split(",")[0] for line in f.readlines()[1:]][:images]
        data = []
        for n in names:
            with open(os.path.join(folder, "files", n), "rb") as f:
                data.append(f.read())
        seconds = _core.bench_decode(data, SIZE, SIZE, usable_cores())
        return {"rate": len(data) / seconds}
    loader = LOADERS[name](folder)
    done, start = 0, None
    while True:
        batches = 0
        for batch in loader:
            batches += 1
            if start is None:  # after the first batch: workers and threads are up
                start = time.perf_counter()
                continue
            done += _count(batch)
            if done >= images:
                return {"rate": done / (time.perf_counter() - start)}
        if not batches:  # SPDL drops the items whose load fails: do not loop for ever
            raise RuntimeError("an epoch gave no batch: did every load fail?")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--images", type=int, default=3000, help="images timed per loader")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", nargs="*", help="substrings of the loader names to run")
    parser.add_argument("--data", default=os.path.join("bench-data", "decode"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    folder = os.path.join(args.data, str(args.samples))
    if args.child:
        print(json.dumps(child(args.child, folder, args.images)))
        return
    # SIGTERM ends the run as Ctrl-C does, so the running child's group is killed too
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    prepare(folder, args.samples)
    names = [CEILING, *LOADERS]
    names = [n for n in names if not args.only or any(o in n for o in args.only)]
    results: dict[str, list[float]] = {n: [] for n in names}
    failed: dict[str, str] = {}
    for _ in range(args.runs):
        for name in names:
            if name in failed:
                continue
            command = [sys.executable, __file__, "--child", name, "--data", args.data]
            command += ["--samples", str(args.samples), "--images", str(args.images)]
            done = measure.run_child(command, timeout=TIMEOUT)
            if done.failed is not None or done.result is None:
                said = done.stderr.strip().splitlines() or [done.failed or "no result"]
                failed[name] = (done.killed or said[-1])[:150]
                continue
            results[name].append(done.result["rate"])
    cores = usable_cores()
    print(
        f"{args.samples} JPEGs (500x375 and similar, quality 90), RandomResizedCrop(224) "
        f"batches of {BATCH}, {args.images} images timed after the first batch, median of "
        f"{args.runs} runs, {cores} cores"
    )
    medians = {n: statistics.median(r) for n, r in results.items() if r}
    ceiling = medians.get(CEILING)
    dataloaders = [r for n, r in medians.items() if n.startswith("DataLoader")]
    best = max(dataloaders) if dataloaders else None
    print(f"{'loader':52} {'images/s':>9} {'per core':>9} {'/ ceiling':>9} {'/ best DL':>9}")
    for name in names:
        if name not in medians:
            print(f"{name:52} {'failed':>9}  {failed.get(name, '')}")
            continue
        rate = medians[name]
        c = f"{rate / ceiling:.2f}" if ceiling else "-"
        b = f"{rate / best:.1f}x" if best else "-"
        print(f"{name:52} {rate:9,.0f} {rate / cores:9,.0f} {c:>9} {b:>9}")


if __name__ == "__main__":
    main()
