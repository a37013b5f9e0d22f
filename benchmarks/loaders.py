"""The headline: stoker.Loader against the loaders its users would otherwise pick.

    python benchmarks/loaders.py [--samples 20000] [--runs 3] [--cold] [--only NAME ...]

The workload: N samples of a 3x64x64 uint8 image and an integer label, written (once,
under --data) four ways: one file per sample with a labels CSV (filename,label rows), tar
shards in the WebDataset convention (with the stoker.json and member indexes `stoker index`
writes), LitData's optimized chunks and MosaicML's MDS shards. stoker reads the tar shards,
the CSV + files, and also LitData's and Streaming's own output in place (the rows "stoker,
fields= (LitData's chunks)" and "(Streaming's MDS)", compared at the end with the best
configuration of that peer on its own format).
Every loader reads shuffled epochs in batches of 64 and turns each batch into an image
tensor and a label tensor. Each measurement runs in a fresh process (clean peak RSS) and
reads two epochs: the first one's clock starts after the imports and covers opening the
data and building the loader; the second is the steady state. The loaders take turns for
--runs rounds and the table shows medians. --cold drops the page cache before every
measurement (root only; only epoch 1 is then cold).

MosaicML Streaming's package imports torchvision (for its vision datasets) and
transformers, which this benchmark does not use; where they cannot be imported, empty
placeholder modules stand in for them in the child process that measures Streaming
(stoker.tools.peer_imports), so its real StreamingDataset is what gets measured.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import statistics
import sys
import tarfile
import time

import _tests_support  # noqa: F401  (tests.support, below)
import numpy as np
import peers

from stoker.tools import measure

SHAPE = (3, 64, 64)
BATCH = 64
TIMEOUT = 1800  # seconds per measurement, far over any at the default size: a hang fails its row


# -- data ---------------------------------------------------------------------


def _litdata_item(item: tuple[str, int]) -> dict:
    path, label = item
    with open(path, "rb") as f:
        return {"image": np.frombuffer(f.read(), np.uint8).reshape(SHAPE), "label": label}


def prepare(folder: str, n: int, shards: int = 20) -> None:
    """Write whatever of the four layouts is missing (each is written in full or not at all:
    a stamp file marks it done)."""
    rng = np.random.default_rng(0)
    files = os.path.join(folder, "files")
    os.makedirs(files, exist_ok=True)
    os.makedirs(os.path.join(folder, "shards"), exist_ok=True)
    images = rng.integers(0, 256, (n, *SHAPE), dtype=np.uint8)
    labels = rng.integers(0, 1000, n)

    def missing(layout: str) -> bool:
        return not os.path.exists(os.path.join(folder, f".done-{layout}-{n}"))

    def done(layout: str) -> None:
        open(os.path.join(folder, f".done-{layout}-{n}"), "w").close()

    if missing("files-and-tar"):
        write_files_and_tar(folder, files, images, labels, shards)
        done("files-and-tar")
    if missing("manifest"):  # stoker.json and the shards' member indexes, as stoker pack writes
        from stoker.manifest import write_manifest

        shard_folder = os.path.join(folder, "shards")
        tars = sorted(f for f in os.listdir(shard_folder) if f.endswith(".tar"))
        write_manifest([os.path.join(shard_folder, t) for t in tars], shard_folder)
        done("manifest")
    if missing("litdata"):
        try:
            import litdata

            shutil.rmtree(os.path.join(folder, "litdata"), ignore_errors=True)
            litdata.optimize(
                fn=_litdata_item,
                inputs=[(os.path.join(files, f"img{i:07d}.raw"), int(labels[i])) for i in range(n)],
                output_dir=os.path.join(folder, "litdata"),
                chunk_bytes="64MB",
                num_workers=1,
                verbose=False,
            )
            done("litdata")
        except ImportError:
            print("litdata is not installed: its rows are skipped", file=sys.stderr)
    if missing("mds"):
        try:
            streaming = _import_streaming()
            shutil.rmtree(os.path.join(folder, "mds"), ignore_errors=True)
            with streaming.MDSWriter(
                out=os.path.join(folder, "mds"),
                columns={"image": "bytes", "label": "int"},
                size_limit=1 << 26,
            ) as writer:
                for i in range(n):
                    writer.write({"image": images[i].tobytes(), "label": int(labels[i])})
            done("mds")
        except ImportError:
            print("mosaicml-streaming is not installed: its rows are skipped", file=sys.stderr)


def write_files_and_tar(folder: str, files: str, images, labels, shards: int) -> None:
    n = len(images)
    with open(os.path.join(folder, "labels.csv"), "w") as f:
        f.write("filename,label\n")
        for i in range(n):
            name = f"img{i:07d}.raw"
            with open(os.path.join(files, name), "wb") as g:
                g.write(images[i].tobytes())
            f.write(f"{name},{labels[i]}\n")
    per_shard = -(-n // shards)
    for s in range(shards):
        with tarfile.open(os.path.join(folder, "shards", f"shard-{s:06d}.tar"), "w") as tar:
            for i in range(s * per_shard, min(n, (s + 1) * per_shard)):
                for field, data in (("raw", images[i].tobytes()), ("cls", b"%d" % labels[i])):
                    info = tarfile.TarInfo(f"{i:07d}.{field}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


# -- one loader, in a child process --------------------------------------------


def run_dataloader(folder: str, workers: int):
    import torch
    from torch.utils.data import DataLoader

    def image(data: bytes, rng: object) -> torch.Tensor:  # no random augmentation
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(SHAPE)

    ds = peers.files_with_labels_dataset(
        os.path.join(folder, "labels.csv"), os.path.join(folder, "files"), image
    )
    return DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=workers)


def run_webdataset(folder: str, workers: int):
    urls = os.path.join(folder, "shards", "shard-{000000..000019}.tar")
    return peers.webdataset_loader(
        urls, shuffle_shards=20, image_field="raw", shape=SHAPE, batch=BATCH, workers=workers
    )


def run_spdl(folder: str, batched: bool):
    import torch

    paths, labels = peers.files_and_labels(
        os.path.join(folder, "labels.csv"), os.path.join(folder, "files")
    )
    order = np.random.default_rng(0).permutation(len(paths))

    def load(i):
        with open(paths[i], "rb") as f:
            return np.frombuffer(f.read(), np.uint8), int(labels[i])

    def load_batch(idx):
        images = np.stack([load(i)[0] for i in idx]).reshape(len(idx), *SHAPE)
        return torch.from_numpy(images), torch.from_numpy(labels[idx])

    def collate(items):
        images = np.stack([x[0] for x in items]).reshape(len(items), *SHAPE)
        return torch.from_numpy(images), torch.tensor([x[1] for x in items])

    if batched:
        batches = [order[i : i + BATCH] for i in range(0, len(order), BATCH)]
        return peers.spdl_loader(batches, load_batch, concurrency=4, threads=4)
    return peers.spdl_loader(
        order.tolist(), load, concurrency=4, threads=4, batch=BATCH, collate=collate
    )


def run_litdata(folder: str, workers: int):
    return peers.litdata_loader(os.path.join(folder, "litdata"), batch=BATCH, workers=workers)


def _import_streaming():
    """mosaicml-streaming, importable without torchvision or transformers (see the
    docstring)."""
    from tests.support.peer_imports import import_streaming

    return import_streaming()


def run_mosaic(folder: str, workers: int):
    import torch

    streaming = _import_streaming()
    streaming.base.util.clean_stale_shared_memory()

    class Images(streaming.StreamingDataset):
        def __getitem__(self, idx):
            sample = super().__getitem__(idx)
            image = torch.frombuffer(bytearray(sample["image"]), dtype=torch.uint8).reshape(SHAPE)
            return image, sample["label"]

    ds = Images(local=os.path.join(folder, "mds"), shuffle=True, batch_size=BATCH)
    return torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=workers)


def run_stoker(folder: str, mode: str):
    import stoker

    if mode == "csv-fields":  # one file per sample + a filename,label CSV
        ds = stoker.Dataset.from_csv(
            os.path.join(folder, "labels.csv"), os.path.join(folder, "files")
        )
        return stoker.Loader(
            ds, BATCH, fields={"raw": stoker.Raw(SHAPE, "uint8"), "label": stoker.Int()}
        )
    if mode in ("mds", "litdata"):  # the peer's own format, as its writer wrote it
        ds = stoker.Dataset(os.path.join(folder, mode))
        fields = {"image": stoker.Raw(SHAPE, "uint8"), "label": stoker.Raw((), "int64")}
        return stoker.Loader(ds, BATCH, fields=fields)
    ds = stoker.Dataset(os.path.join(folder, "shards"))
    if mode == "fields":
        return stoker.Loader(
            ds, BATCH, fields={"raw": stoker.Raw(SHAPE, "uint8"), "cls": stoker.Int()}
        )

    def decode(sample):
        image = np.frombuffer(sample["raw"], np.uint8).reshape(SHAPE)
        return {"image": image, "label": int(bytes(sample["cls"]))}

    return stoker.Loader(ds, BATCH, map=decode)


LOADERS = {
    "DataLoader, 0 workers (one file per sample)": lambda d: run_dataloader(d, 0),
    "DataLoader, 2 workers (one file per sample)": lambda d: run_dataloader(d, 2),
    "SPDL, per-sample pipeline": lambda d: run_spdl(d, False),
    "SPDL, batched pipeline": lambda d: run_spdl(d, True),
    "WebDataset, 2 workers": lambda d: run_webdataset(d, 2),
    "LitData, 0 workers": lambda d: run_litdata(d, 0),
    "LitData, 2 workers": lambda d: run_litdata(d, 2),
    "MosaicML Streaming, 0 workers": lambda d: run_mosaic(d, 0),
    "MosaicML Streaming, 2 workers": lambda d: run_mosaic(d, 2),
    "stoker, fields= (tar shards)": lambda d: run_stoker(d, "fields"),
    "stoker, fields= (CSV + files)": lambda d: run_stoker(d, "csv-fields"),
    "stoker, map= (tar shards)": lambda d: run_stoker(d, "map"),
    "stoker, fields= (LitData's chunks)": lambda d: run_stoker(d, "litdata"),
    "stoker, fields= (Streaming's MDS)": lambda d: run_stoker(d, "mds"),
}
BASELINE = "DataLoader, 0 workers (one file per sample)"


def _epoch(loader) -> tuple[int, float]:
    """Samples read in one epoch, and the seconds until the first batch."""
    start, first, samples = time.perf_counter(), None, 0
    for batch in loader:
        if first is None:
            first = time.perf_counter() - start
        if isinstance(batch, dict):
            images = batch["raw"] if "raw" in batch else batch["image"]
        else:
            images = batch[0]
        samples += len(images)
    return samples, first if first is not None else 0.0


def child(name: str, folder: str) -> None:
    import pandas  # noqa: F401 - imports are not what is measured
    import torch  # noqa: F401

    import stoker  # noqa: F401

    # Epoch 1's clock starts before the data is opened and the loader built; epoch 2 is
    # the steady state a training run sees from then on.
    start = time.perf_counter()
    loader = LOADERS[name](folder)
    built = time.perf_counter() - start
    samples, first = _epoch(loader)
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    samples2, _ = _epoch(loader)
    seconds2 = time.perf_counter() - start
    main_mb = measure.peak_rss_bytes() / 2**20
    worker_mb = measure.children_peak_rss_bytes() / 2**20  # the largest DataLoader worker's
    result = {
        "rate1": samples / seconds,
        "rate2": samples2 / seconds2,
        "first": built + first,
        "rss_mb": main_mb,
        "worker_rss_mb": worker_mb,
    }
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="drop the page cache before each")
    parser.add_argument("--only", nargs="*", help="substrings of the loader names to run")
    parser.add_argument("--data", default=os.path.join("bench-data", "loaders"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    folder = os.path.join(args.data, str(args.samples))
    if args.child:
        child(args.child, folder)
        return
    # SIGTERM ends the run as Ctrl-C does, so the running child's group is killed too
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    prepare(folder, args.samples)
    names = [n for n in LOADERS if not args.only or any(o in n for o in args.only)]
    results: dict[str, list[dict]] = {n: [] for n in names}
    for _ in range(args.runs):
        for name in names:
            if args.cold:
                measure.drop_page_cache()
            command = [sys.executable, __file__, "--child", name, "--data", args.data]
            done = measure.run_child([*command, "--samples", str(args.samples)], timeout=TIMEOUT)
            if done.failed is not None or done.result is None:
                why = done.failed or "no result"
                print(f"{name}: failed ({why})\n{done.stderr[-2000:]}", file=sys.stderr)
                continue
            results[name].append(done.result)
    cache = "cold page cache" if args.cold else "warm page cache"
    print(
        f"{args.samples} samples of {SHAPE} uint8 + label, shuffled, batches of {BATCH}, "
        f"{cache}, median of {args.runs} runs, {os.cpu_count()} cores. Epoch 1 includes "
        "opening the data and building the loader; epoch 2 is the steady state."
    )

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    print(
        f"{'loader':40} {'epoch 1/s':>10} {'x':>6} {'epoch 2/s':>10} {'x':>6} "
        f"{'1st batch':>10} {'peak RSS':>9} {'+ worker':>9}"
    )
    base = results.get(BASELINE)
    for name, rs in results.items():
        if not rs:
            print(f"{name:40} {'failed':>10}")
            continue
        r1, r2 = median(name, "rate1"), median(name, "rate2")
        x1 = f"{r1 / median(BASELINE, 'rate1'):.1f}x" if base else "-"
        x2 = f"{r2 / median(BASELINE, 'rate2'):.1f}x" if base else "-"
        workers = median(name, "worker_rss_mb")
        worker_text = f"{workers:7.0f}MB" if workers else "        -"
        print(
            f"{name:40} {r1:10,.0f} {x1:>6} {r2:10,.0f} {x2:>6} {median(name, 'first'):9.3f}s "
            f"{median(name, 'rss_mb'):7.0f}MB {worker_text}"
        )
    # stoker on each peer's own format, against the peer's best configuration.
    for ours, peer in (
        ("stoker, fields= (LitData's chunks)", "LitData"),
        ("stoker, fields= (Streaming's MDS)", "MosaicML Streaming"),
    ):
        theirs = [n for n in results if n.startswith(peer) and results[n]]
        if not results.get(ours) or not theirs:
            continue
        best = max(theirs, key=lambda n: median(n, "rate2"))
        print(
            f"{ours} / {best}: {median(ours, 'rate2') / median(best, 'rate2'):.1f}x warm "
            f"(target >= 10x); first batch {median(ours, 'first'):.3f}s against "
            f"{min(median(n, 'first') for n in theirs):.3f}s"
        )


if __name__ == "__main__":
    main()
