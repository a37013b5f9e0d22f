"""``stoker demo``: the whole path on a small dataset, in under a minute, leaving nothing.

The seeds' layout (a labels CSV and a folder of image files) is written to a temporary
folder, packed into tar shards with a manifest, served over HTTP on 127.0.0.1, and read
remote -> cache -> batches; then the cached epoch, and the seeds' DataLoader over the
original files, for comparison.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time

import numpy as np

SHAPE = (3, 64, 64)

log = logging.getLogger("stoker.demo")


def write_seed_layout(folder: str, samples: int, seed: int = 0) -> tuple[str, str]:
    """labels_train.csv and labels_train/ (one raw 3x64x64 image per file), as the seeds
    have them."""
    rng = np.random.default_rng(seed)
    root = os.path.join(folder, "labels_train")
    os.makedirs(root)
    csv = os.path.join(folder, "labels_train.csv")
    labels = rng.integers(0, 10, samples)
    with open(csv, "w") as f:
        f.write("filename,label\n")
        for i in range(samples):
            name = f"img{i:06d}.rgb"
            with open(os.path.join(root, name), "wb") as image:
                image.write(rng.integers(0, 256, SHAPE, dtype=np.uint8).tobytes())
            f.write(f"{name},{labels[i]}\n")
    return csv, root


class _SeedsDataset:
    """The seeds' pattern: a map-style dataset that opens one file per sample."""

    def __init__(self, csv: str, root: str) -> None:
        from stoker.dataset import read_labels_csv

        names, self.labels = read_labels_csv(csv)
        self.paths = [os.path.join(root, n) for n in names]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):  # noqa: ANN204 - a (tensor, int) pair
        import torch

        with open(self.paths[i], "rb") as f:
            image = np.frombuffer(f.read(), np.uint8).reshape(SHAPE)
        return torch.from_numpy(image.copy()), int(self.labels[i])


def _epoch(batches, device: str) -> tuple[int, float, float]:  # noqa: ANN001
    """Samples, seconds and seconds to the first batch of one pass over `batches`."""
    start = time.perf_counter()
    first = None
    samples = 0
    for batch in batches:
        images = batch["rgb"] if isinstance(batch, dict) else batch[0]
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


def run(samples: int = 20_000, quiet: bool = False, keep: str | None = None) -> int:
    import torch

    import stoker
    from stoker.pack import pack
    from stoker.serve import ShardServer

    device = "cuda" if torch.cuda.is_available() and stoker.cuda_status()["cuda"] else "cpu"
    say = print
    with tempfile.TemporaryDirectory(prefix="stoker-demo-") as folder:
        work = keep or folder
        start = time.perf_counter()
        csv, root = write_seed_layout(work, samples)
        say(
            f"1. wrote the seeds' layout: {samples:,} images of {SHAPE} uint8 in "
            f"{os.path.relpath(root, work)}/ and labels_train.csv "
            f"({time.perf_counter() - start:.1f} s)"
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
            f"and stratified by label ({packed.bytes / 1e6:.0f} MB, "
            f"{time.perf_counter() - start:.1f} s)"
        )
        with ShardServer(os.path.join(work, "shards")) as server:
            url = server.url_for("stoker.json")
            say(f"3. serving them at {url}")
            fields = {"rgb": stoker.Raw(SHAPE, "uint8"), "cls": stoker.Int()}
            ds = stoker.Dataset(url, cache_dir=os.path.join(work, "cache"))
            loader = stoker.Loader(ds, batch_size=64, seed=0, fields=fields, device=device)
            cold = _epoch(loader, device)
            warm = _epoch(loader, device)
        seeds = torch.utils.data.DataLoader(
            _SeedsDataset(csv, root), batch_size=64, shuffle=True, num_workers=0
        )
        base = _epoch(seeds, device)
        rows = [
            ("stoker, remote -> cache -> batches (epoch 1)", cold),
            ("stoker, from the node-local cache (epoch 2)", warm),
            ("torch DataLoader over the files (the seeds' pattern)", base),
        ]
        say(f"4. one shuffled epoch each, batches of 64 on {device}:\n")
        say(f"   {'':<54} {'samples/s':>10} {'first batch':>12} {'vs DataLoader':>14}")
        for name, (n, seconds, first) in rows:
            rate = n / seconds
            say(
                f"   {name:<54} {rate:>10,.0f} {first * 1e3:>9.0f} ms "
                f"{rate / (base[0] / base[1]):>13.1f}x"
            )
        if keep:
            say(f"\nkept everything in {keep}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run())
