"""Rows of HDF5 and Zarr arrays: stoker.Loader against h5py and zarr-python in torch's
DataLoader, the way their users are told to read them.

    python benchmarks/arrays.py [--samples 20000] [--runs 3] [--batch 256] [--workers 0 2]
                                [--peer-batches 40] [--peer-seconds 5] [--shuffle-window N]
                                [--only TEXT ...] [--data DIR] [--timeout SECONDS]
                                [--budget SECONDS] [--json FILE] [--check]

The workload: N rows of a 3x64x64 uint8 image and an int64 label, as two arrays ("images"
(N, 3, 64, 64) and "labels" (N,)) written once under --data (default: a folder in the temp
directory, reused while its stamp files say it is complete) in five layouts:

- hdf5-contiguous: h5py ``create_dataset`` with no chunks;
- hdf5-chunked: chunks of 64 rows (``chunks=(64, 3, 64, 64)`` and ``(64,)``), uncompressed;
- hdf5-gzip1: the same chunks, ``compression="gzip", compression_opts=1``;
- zarr3: a Zarr v3 group (``zarr.open_group(zarr_format=3)``, ``create_array`` with the
  same chunks and ``compressors=None``);
- zarr3-gzip1: the same with ``compressors=zarr.codecs.GzipCodec(level=1)``.

The images are not white noise, which deflate cannot shrink (zlib would store it and
"decompressing" would be a copy): each is 8x8 blocks of one value plus 2 bits of noise, so
gzip has real work to do (the header gives the ratio it got). Every layout holds the same
rows.

The loaders, each reading shuffled rows in batches of --batch into an image tensor
(B, 3, 64, 64) uint8 and a label tensor (B,) int64:

- h5py: a map-style torch Dataset whose ``__getitem__`` opens the h5py.File on first use
  in each process (h5py's advice for DataLoader workers) and returns
  ``(torch.from_numpy(images[i]), int(labels[i]))``, in ``torch.utils.data.DataLoader``
  with ``shuffle=True``, the default collate and each of --workers workers (with workers,
  ``persistent_workers=True``: epoch 2 does not pay for starting them again, the kinder
  setting for h5py); on the HDF5 layouts;
- zarr-python: the same with ``zarr.open_group`` per process; on the Zarr layouts;
- stoker: ``stoker.Loader(stoker.Dataset(path), batch_size=B, shuffle=True, seed=0,
  fields={"images": stoker.Row(), "labels": stoker.Row()})``, no DataLoader around it; on
  every layout. Its cache of decoded chunks is cut to --chunk-cache MiB (default 32), well
  under the data, so that epoch 2 decodes every chunk again as a run over a large set
  would (the default 256 MiB would hold this whole set).

Each measurement runs in a fresh process and reads two epochs: epoch 1's clock starts
after the imports, so it covers opening the data and building the loader (the time to the
first batch is counted from there too); epoch 2 is the steady state, the figure the table
reports. h5py and zarr-python read random rows slowly (a chunked layout decompresses or
copies a whole 64-row chunk for each row), so their two epochs are cut short: each is
--peer-batches batches, or fewer where --peer-seconds pass first (0 for either: no such
limit), and their samples/s come from the batches they read ("measured" in the table says
how many samples epoch 2 was). A cut-short epoch 2 goes on with the same iterator, so the
batches DataLoader workers had prefetched are not thrown away and their restart is not
counted. stoker reads whole epochs. The loaders take turns for --runs rounds and the table
shows medians, with stoker's ratio to the best h5py configuration on the same layout (on the
Zarr layouts: to the best zarr-python one, and to the best h5py one on the HDF5 layout with
the same chunks and compression). Targets: at least 10x on the uncompressed layouts, 3x on
gzip. The page cache is warm: every layout is read once before the measurements.

--only keeps the measurements whose "layout: loader" name contains one of the texts given
(``--only h5py zarr-python``, ``--only hdf5-gzip1``). Each measurement is killed after
--timeout seconds (with its workers) and reported as timed out; with --budget, nothing
starts or runs past that many seconds from the start; SIGTERM or Ctrl-C kill the running
one. In every case the table is printed from what finished, and a loader that failed shows
its error in its row.

--check times nothing: for every selected loader on every selected layout, one child takes
the first batch and checks each of its rows against h5py's reading of the same row of
hdf5-contiguous (rows are recognised by their first 64 bytes; shapes and dtypes are checked
too); for stoker it also compares ``ds.get_batch(indices)`` and ``ds[i]`` with h5py for the
same indices.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import _runner
import numpy as np
import peers
from _runner import say

from stoker.tools.measure import STDERR_TAIL, read_through

SHAPE = (3, 64, 64)
CHUNK = 64  # rows per chunk in the chunked layouts
GENERATE_ROWS = 4096  # rows generated at a time
CHECK_INDICES = 256  # rows ds.get_batch is checked on
KEY_BYTES = SHAPE[-1]  # a row is recognised by the first row of its first channel
DATA_VERSION = 1  # bump when the data written changes: stale stamps are then rewritten


@dataclass(frozen=True)
class Layout:
    path: str  # under the data folder
    kind: str  # "hdf5" or "zarr"
    gzip: bool
    twin: str | None = None  # the HDF5 layout with the same chunks and compression

    @property
    def target(self) -> float:
        return 3.0 if self.gzip else 10.0


LAYOUTS = {
    "hdf5-contiguous": Layout("contiguous.h5", "hdf5", False),
    "hdf5-chunked": Layout("chunked.h5", "hdf5", False),
    "hdf5-gzip1": Layout("gzip1.h5", "hdf5", True),
    "zarr3": Layout("plain.zarr", "zarr", False, twin="hdf5-chunked"),
    "zarr3-gzip1": Layout("gzip1.zarr", "zarr", True, twin="hdf5-gzip1"),
}
REFERENCE = "hdf5-contiguous"  # what --check compares every loader's rows with
STOKER = "stoker.Loader"
PEER_LIBRARY = {"hdf5": "h5py", "zarr": "zarr-python"}


def loader_names(workers: list[int]) -> list[str]:
    peers = [f"{lib}, DataLoader {w} workers" for lib in ("h5py", "zarr-python") for w in workers]
    return [*peers, STOKER]


def library_of(name: str) -> str:
    return "stoker" if name == STOKER else name.split(",")[0]


def workers_of(name: str) -> int:
    return int(name.split("DataLoader ")[1].split()[0])


def applies(layout: str, name: str) -> bool:
    """Whether loader `name` reads `layout`: stoker reads all, each peer its own format."""
    return name == STOKER or PEER_LIBRARY[LAYOUTS[layout].kind] == library_of(name)


# -- data ---------------------------------------------------------------------


def make_rows(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The images (8x8 blocks of one value plus 2 bits of noise: deflate has something to
    do) and the labels, the same for every layout."""
    rng = np.random.default_rng(0)
    images = np.empty((n, *SHAPE), np.uint8)
    for start in range(0, n, GENERATE_ROWS):
        m = min(GENERATE_ROWS, n - start)
        blocks = rng.integers(0, 64, (m, SHAPE[0], SHAPE[1] // 8, SHAPE[2] // 8), np.uint8) * 4
        noise = rng.integers(0, 4, (m, *SHAPE), np.uint8)
        images[start : start + m] = blocks.repeat(8, axis=2).repeat(8, axis=3) | noise
    labels = rng.integers(0, 1000, n).astype(np.int64)
    return images, labels


def write_layout(name: str, path: str, images: np.ndarray, labels: np.ndarray) -> None:
    layout = LAYOUTS[name]
    n = len(labels)
    if layout.kind == "hdf5":
        import h5py

        options: dict[str, Any] = {"compression": "gzip", "compression_opts": 1}
        if not layout.gzip:
            options = {}
        with h5py.File(path, "w") as f:
            chunks = {} if name == "hdf5-contiguous" else {"chunks": (min(CHUNK, n), *SHAPE)}
            f.create_dataset("images", data=images, **chunks, **options)
            chunks = {} if name == "hdf5-contiguous" else {"chunks": (min(CHUNK, n),)}
            f.create_dataset("labels", data=labels, **chunks, **options)
        return
    import zarr
    import zarr.codecs

    compressors = zarr.codecs.GzipCodec(level=1) if layout.gzip else None
    group = zarr.open_group(path, mode="w", zarr_format=3)
    for field, data, chunks in (
        ("images", images, (CHUNK, *SHAPE)),
        ("labels", labels, (CHUNK,)),
    ):
        array = group.create_array(
            field, shape=data.shape, dtype=data.dtype, chunks=chunks, compressors=compressors
        )
        array[:] = data


def prepare(folder: str, n: int, names: Iterable[str], limits: _runner.Limits) -> dict:
    """Write whichever of the layouts `names` is missing or stale (each in full or not at
    all: a stamp file marks it done); returns each layout's size on disk in bytes."""
    os.makedirs(folder, exist_ok=True)
    rows: tuple[np.ndarray, np.ndarray] | None = None
    sizes = {}
    for name in names:
        path = os.path.join(folder, LAYOUTS[name].path)
        stamp_path = os.path.join(folder, f".done-{name}.json")
        want = {"layout": name, "samples": n, "version": DATA_VERSION}
        if _runner.stamp_if_current(stamp_path, want) is None:
            limits.require(30)  # writing a layout takes a while
            t0 = time.monotonic()
            if rows is None:
                rows = make_rows(n)
            part = path + ".part"
            for stale in (part, path):
                if os.path.isdir(stale):
                    shutil.rmtree(stale)
                elif os.path.exists(stale):
                    os.unlink(stale)
            write_layout(name, part, *rows)
            os.replace(part, path)
            with open(stamp_path, "w") as f:
                json.dump(want, f)
            say(f"[{name}] written in {time.monotonic() - t0:.0f} s: {path}")
        sizes[name] = size_on_disk(path)
    return sizes


def size_on_disk(path: str) -> int:
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(
        os.path.getsize(os.path.join(top, f)) for top, _, files in os.walk(path) for f in files
    )


# -- the loaders, in a child process --------------------------------------------


def build_loader(name: str, path: str, args: argparse.Namespace):
    if name == STOKER:
        import stoker
        from stoker._process import shared_reader

        options = {} if args.shuffle_window is None else {"shuffle_window": args.shuffle_window}
        # Decoded chunks kept across batches: less than the data, as it is at scale (the
        # default 256 MiB would hold this whole set, and epoch 2 would decode nothing).
        shared_reader().chunk_cache_bytes = args.chunk_cache << 20
        ds = stoker.Dataset(path)
        return stoker.Loader(
            ds,
            batch_size=args.batch,
            shuffle=True,
            seed=0,
            fields={"images": stoker.Row(), "labels": stoker.Row()},
            **options,
        )
    import torch
    from torch.utils.data import DataLoader

    rows = peers.h5py_rows(path) if library_of(name) == "h5py" else peers.zarr_rows(path)
    workers = workers_of(name)
    return DataLoader(
        rows,
        batch_size=args.batch,
        shuffle=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        generator=torch.Generator().manual_seed(0),
    )


def images_and_labels(batch):
    """A batch's two tensors, whether a dict (stoker) or a list (the default collate)."""
    if isinstance(batch, dict):
        return batch["images"], batch["labels"]
    return batch[0], batch[1]


def check_batch_types(images, labels) -> None:
    import torch

    b = len(labels)
    if (
        tuple(images.shape) != (b, *SHAPE)
        or images.dtype != torch.uint8
        or tuple(labels.shape) != (b,)
        or labels.dtype != torch.int64
    ):
        raise TypeError(
            f"a batch of images {tuple(images.shape)} {images.dtype} and labels "
            f"{tuple(labels.shape)} {labels.dtype}; wanted (B, {', '.join(map(str, SHAPE))}) "
            "torch.uint8 and (B,) torch.int64"
        )


def forever(loader) -> Iterator:
    """The loader's batches, epoch after epoch (``set_epoch`` before each where it has one),
    as one stream."""
    for epoch in itertools.count():
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        yield from loader


def timed_phase(stream: Iterator, batches: int, max_seconds: float, start: float) -> dict:
    """Read `batches` batches of `stream` (fewer if `max_seconds` is not 0 and passes first),
    the clock running from `start`."""
    first, samples, read = None, 0, 0
    while read < batches:
        images, labels = images_and_labels(next(stream))
        if first is None:
            first = time.perf_counter() - start
            check_batch_types(images, labels)
        samples += len(labels)
        read += 1
        if max_seconds and time.perf_counter() - start >= max_seconds:
            break
    seconds = time.perf_counter() - start
    return {"samples": samples, "seconds": seconds, "first": first or 0.0, "batches": read}


def peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def child_measure(name: str, path: str, args: argparse.Namespace) -> dict:
    import torch  # noqa: F401 - imports are not what is measured

    if name == STOKER:
        import stoker  # noqa: F401
    elif library_of(name) == "h5py":
        import h5py  # noqa: F401
    else:
        import zarr  # noqa: F401

    start = time.perf_counter()  # epoch 1: opening the data and building the loader, too
    loader = build_loader(name, path, args)
    stream = forever(loader)
    batches, max_seconds = len(loader), 0.0
    if name != STOKER:  # the peers' epochs are cut short (see the docstring)
        batches = min(batches, args.peer_batches or batches)
        max_seconds = args.peer_seconds
    epoch1 = timed_phase(stream, batches, max_seconds, start)
    epoch2 = timed_phase(stream, batches, max_seconds, time.perf_counter())
    return {
        "rate1": epoch1["samples"] / epoch1["seconds"],
        "rate2": epoch2["samples"] / epoch2["seconds"],
        "first": epoch1["first"],
        "samples2": epoch2["samples"],
        "cut": min(epoch1["batches"], epoch2["batches"]) < len(loader),
        "rss_mb": peak_rss_mb(),
    }


class Reference:
    """hdf5-contiguous read with h5py: the rows every loader's batches are checked with."""

    def __init__(self, path: str) -> None:
        import h5py

        self.file = h5py.File(path, "r")
        self.images = self.file["images"]
        self.labels = self.file["labels"][:]
        keys = self.images[:, 0, 0, :KEY_BYTES]
        self.index: dict[bytes, int] = {}
        for i, key in enumerate(keys):
            self.index.setdefault(key.tobytes(), i)

    def rows(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        order = np.unique(indices)  # h5py reads increasing indices
        found = self.images[order]
        at = np.searchsorted(order, indices)
        return found[at], self.labels[indices]

    def compare(self, indices: np.ndarray, images: np.ndarray, labels: np.ndarray) -> int:
        """How many of the rows differ from the reference's rows `indices`."""
        want_images, want_labels = self.rows(indices)
        same = (images.reshape(len(indices), -1) == want_images.reshape(len(indices), -1)).all(1)
        return int((~same | (labels.reshape(-1) != want_labels)).sum())


def stack_samples(got, field: str) -> np.ndarray:
    """One field of what ``ds.get_batch`` returns (a list of per-sample dicts, or a dict of
    batched arrays), as one array."""
    if isinstance(got, dict):
        return np.asarray(got[field])
    return np.stack([np.asarray(sample[field]) for sample in got])


def child_check(name: str, path: str, reference_path: str, args: argparse.Namespace) -> dict:
    reference = Reference(reference_path)
    n = len(reference.labels)
    loader = build_loader(name, path, args)
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(0)
    images, labels = images_and_labels(next(iter(loader)))
    check_batch_types(images, labels)
    images, labels = images.numpy(), labels.numpy()
    found = [reference.index.get(row[0, 0, :KEY_BYTES].tobytes()) for row in images]
    known = np.array([i for i in found if i is not None], np.int64)
    is_known = np.array([i is not None for i in found])
    result = {
        "rows": len(labels),
        "unknown": int((~is_known).sum()),  # rows that are no row of the data
        "repeated": int(len(known) - len(np.unique(known))),
        "wrong": reference.compare(known, images[is_known], labels[is_known]) if len(known) else 0,
    }
    if name == STOKER:
        ds = loader.dataset
        result["len"] = len(ds)
        indices = np.random.default_rng(1).choice(n, min(CHECK_INDICES, n), replace=False)
        result["get_batch_rows"] = len(indices)
        got = ds.get_batch(indices)
        got_images = stack_samples(got, "images")
        got_labels = stack_samples(got, "labels")
        if got_images.shape != (len(indices), *SHAPE) or got_images.dtype != np.uint8:
            result["get_batch"] = f"images {got_images.shape} {got_images.dtype}"
        else:
            result["get_batch_wrong"] = reference.compare(indices, got_images, got_labels)
        i = int(indices[0])
        sample = ds[i]
        one = reference.compare(
            np.array([i]), np.asarray(sample["images"])[None], np.asarray(sample["labels"])
        )
        result["getitem_wrong"] = one
    return result


def child(args: argparse.Namespace) -> None:
    folder = os.path.join(args.data, str(args.samples))
    path = os.path.join(folder, LAYOUTS[args.layout].path)
    if args.check:
        reference = os.path.join(folder, LAYOUTS[REFERENCE].path)
        result = child_check(args.child, path, reference, args)
    else:
        result = child_measure(args.child, path, args)
    print(json.dumps(result), flush=True)


# -- the parent ---------------------------------------------------------------


def brief(text: str) -> str:
    """A failed child's error in one line: the last line of its stderr."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    line = lines[-1] if lines else ""
    return line if len(line) <= 110 else line[:107] + "..."


def measure(layout: str, name: str, args: argparse.Namespace, slot: _runner.Slot) -> dict:
    """One measurement (or check) in a fresh process (its own process group, so its
    DataLoader workers die with it), killed when `slot` runs out."""
    command = [sys.executable, __file__, "--child", name, "--layout", layout]
    command += ["--data", args.data, "--samples", str(args.samples), "--batch", str(args.batch)]
    command += ["--peer-batches", str(args.peer_batches), "--peer-seconds", repr(args.peer_seconds)]
    if args.shuffle_window is not None:
        command += ["--shuffle-window", str(args.shuffle_window)]
    command += ["--chunk-cache", str(args.chunk_cache)]
    if args.check:
        command.append("--check")
    done = _runner.run_child(command, slot)
    if done.failed is not None:
        return {"failed": done.failed, "error": brief(done.stderr), "stderr": done.stderr}
    if done.result is None:  # the child's last line is its result
        tail = ("\n".join(done.lines) + done.stderr)[-STDERR_TAIL:]
        return {"failed": "no result", "error": brief(tail), "stderr": tail}
    return done.result


def failure(r: dict) -> str:
    return f"{r['failed']}: {r['error']}" if r["error"] else r["failed"]


def result_line(r: dict) -> str:
    if "failed" in r:
        return f"failed: {failure(r)}"
    cut = ", cut short" if r["cut"] else ""
    return (
        f"{r['rate2']:,.0f} samples/s (epoch 2, {r['samples2']:,} samples{cut}), "
        f"1st batch {r['first']:.2f} s, epoch 1 {r['rate1']:,.0f} samples/s"
    )


def check_line(r: dict, samples: int) -> tuple[bool, str]:
    if "failed" in r:
        return False, f"failed: {failure(r)}"
    what = {
        "unknown": "rows are no row of the data",
        "repeated": "rows repeat in the batch",
        "wrong": "rows differ from h5py's",
    }
    problems = [f"{r[k]} {text}" for k, text in what.items() if r[k]]
    if "get_batch" in r:
        problems.append(f"ds.get_batch gave {r['get_batch']}")
    for key, what in (("get_batch_wrong", "ds.get_batch"), ("getitem_wrong", "ds[i]")):
        if r.get(key):
            problems.append(f"{what}: {r[key]} rows differ from h5py's")
    if "len" in r and r["len"] != samples:
        problems.append(f"len(ds) is {r['len']}, not {samples}")
    text = f"{r['rows']} rows of the first batch"
    if "get_batch_wrong" in r:
        text += f", ds.get_batch of {r['get_batch_rows']} rows and ds[i]"
    if problems:
        return False, f"WRONG: {', '.join(problems)} ({text})"
    return True, f"ok: {text} equal h5py's"


@dataclass
class Row:
    rate: float
    rate1: float
    first: float
    samples: int
    cut: bool
    rss_mb: float
    runs: int


def summarize(results: list[dict]) -> Row | None:
    good = [r for r in results if "failed" not in r]
    if not good:
        return None

    def median(key: str) -> float:
        return statistics.median(r[key] for r in good)

    return Row(
        median("rate2"),
        median("rate1"),
        median("first"),
        int(median("samples2")),
        any(r["cut"] for r in good),
        median("rss_mb"),
        len(good),
    )


def report(args: argparse.Namespace, sizes: dict, results: dict[str, dict[str, list]]) -> dict:
    raw = args.samples * (int(np.prod(SHAPE)) + 8)
    say(
        f"\n{args.samples} rows of {SHAPE} uint8 + an int64 label, shuffled, batches of "
        f"{args.batch}, warm page cache, {os.cpu_count()} cores, median of up to {args.runs} "
        "run(s), each in a fresh process. samples/s: epoch 2 (steady state); 1st batch and "
        "epoch 1 include opening the data and building the loader. h5py and zarr-python read "
        f"at most {args.peer_batches or 'all'} batches or {args.peer_seconds or 'unlimited'} s "
        "an epoch (measured: samples in epoch 2)."
    )
    say(
        "on disk: "
        + ", ".join(
            f"{name} {size / 1e6:.0f} MB ({raw / size:.2f}x)" for name, size in sizes.items()
        )
    )
    say(
        "\n| layout | loader | samples/s | x best peer | 1st batch (s) | epoch 1 samples/s "
        "| measured | peak RSS | runs |"
    )
    say("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = {layout: {n: summarize(rs) for n, rs in by.items()} for layout, by in results.items()}

    def best_peer(layout: str) -> tuple[str, Row] | None:
        peers = [(n, r) for n, r in rows.get(layout, {}).items() if n != STOKER and r]
        return max(peers, key=lambda p: p[1].rate) if peers else None

    for layout, by in results.items():
        best = best_peer(layout)
        for name, rs in by.items():
            row = rows[layout][name]
            if row is None:
                why = "; ".join(sorted({failure(r) for r in rs})) or "not run"
                say(f"| {layout} | {name} | {why} | | | | | | 0 |")
                continue
            x = f"{row.rate / best[1].rate:.1f}x" if best and name == STOKER else "-"
            measured = f"{row.samples:,}" + (" (cut)" if row.cut else "")
            say(
                f"| {layout} | {name} | {row.rate:,.0f} | {x} | {row.first:.2f} | "
                f"{row.rate1:,.0f} | {measured} | {row.rss_mb:.0f} MB | {row.runs} |"
            )
    say()
    headline = {}
    for layout, by in results.items():
        if STOKER not in by:
            continue
        spec = LAYOUTS[layout]
        target = f"target >= {spec.target:g}x"
        mine = rows[layout][STOKER]
        library = PEER_LIBRARY[spec.kind]
        best = best_peer(layout)
        if mine is None or best is None:
            why = "stoker did not finish" if mine is None else f"no {library} row finished"
            say(f"stoker / best {library} ({layout}): n/a ({why}); {target}")
            continue
        ratio = mine.rate / best[1].rate
        headline[layout] = ratio
        met = "met" if ratio >= spec.target else "NOT met"
        line = f"stoker / best {library} ({layout}, {best[0]}): {ratio:.1f}x; {target}: {met}"
        twin = best_peer(spec.twin) if spec.twin else None
        if twin is not None:
            line += f"; / best h5py on {spec.twin}: {mine.rate / twin[1].rate:.1f}x"
        say(line)
    return headline


def report_checks(checks: dict[str, dict[str, dict]], samples: int) -> None:
    say("\n| layout | loader | check |")
    say("|---|---|---|")
    bad = 0
    for layout, by in checks.items():
        for name, r in by.items():
            ok, text = check_line(r, samples)
            bad += not ok
            say(f"| {layout} | {name} | {text} |")
    total = sum(len(by) for by in checks.values())
    say(f"\n{bad} of {total} checks failed" if bad else f"\nall {total} checks passed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[0, 2], help="DataLoader workers for the peers"
    )
    parser.add_argument(
        "--peer-batches",
        type=int,
        default=40,
        help="h5py and zarr-python epochs stop after this many batches (0: no limit)",
    )
    parser.add_argument(
        "--peer-seconds",
        type=float,
        default=5.0,
        help="... or after this many seconds (0: no limit), whichever comes first",
    )
    parser.add_argument("--shuffle-window", type=int, help="stoker.Loader's shuffle_window")
    parser.add_argument(
        "--chunk-cache",
        type=int,
        default=32,
        help="MiB of decoded chunks stoker keeps across batches (default 32: well under the "
        "data, so that every epoch decodes its chunks again, as at scale)",
    )
    parser.add_argument("--only", nargs="*", help='texts of the "layout: loader" names to run')
    parser.add_argument(
        "--data", default=os.path.join(tempfile.gettempdir(), "stoker-bench", "arrays")
    )
    parser.add_argument(
        "--check", action="store_true", help="time nothing: check one batch of each loader"
    )
    _runner.add_arguments(
        parser,
        timeout=120,
        timeout_help="seconds per measurement (its process is killed and it is reported as "
        "timed out)",
        measured="measurements",
        json_help="write the raw results and the ratios here",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--layout", choices=list(LAYOUTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    limits = _runner.Limits(parser, args)
    if args.samples < 1 or args.batch < 1 or args.runs < 1 or min(args.workers) < 0:
        parser.error("--samples, --batch and --runs must be positive, --workers not negative")
    if args.peer_batches < 0 or args.peer_seconds < 0:
        parser.error("--peer-batches and --peer-seconds must not be negative")
    if args.child:
        child(args)
        return
    pairs = [
        (layout, name)
        for layout in LAYOUTS
        for name in loader_names(args.workers)
        if applies(layout, name)
        and (not args.only or any(o in f"{layout}: {name}" for o in args.only))
    ]
    if not pairs:
        parser.error("--only matches no measurement")
    layouts = list(dict.fromkeys(layout for layout, _ in pairs))
    needed = list(dict.fromkeys(([REFERENCE] if args.check else []) + layouts))
    folder = os.path.join(args.data, str(args.samples))
    results: dict[str, dict[str, list]] = {}
    for layout, name in pairs:
        results.setdefault(layout, {})[name] = []
    sizes: dict[str, int] = {}
    shown: set[str] = set()  # errors whose stderr was printed in full once
    with _runner.Interruptible("arrays") as measuring:
        sizes = prepare(folder, args.samples, needed, limits)
        for layout in needed:
            read_through([os.path.join(folder, LAYOUTS[layout].path)])
        say(f"data ready in {folder}")
        for run in range(1 if args.check else args.runs):
            for layout, name in pairs:
                slot = limits.next_slot()
                t0 = time.monotonic()
                r = measure(layout, name, args, slot)
                results[layout][name].append(r)
                took = time.monotonic() - t0
                if args.check:
                    say(f"[{layout}] {name}: {check_line(r, args.samples)[1]} ({took:.0f} s)")
                else:
                    line = f"run {run + 1}/{args.runs} [{layout}] {name}: {result_line(r)}"
                    say(f"{line} ({took:.0f} s)")
                if "failed" in r and r["error"] and r["error"] not in shown:
                    shown.add(r["error"])
                    say("\n".join("    " + s for s in r["stderr"].strip().splitlines()[-12:]))
    for rs in (rs for by in results.values() for rs in by.values()):
        for r in rs:
            r.pop("stderr", None)
    if args.check:
        checks = {
            layout: {n: rs[0] for n, rs in by.items() if rs} for layout, by in results.items()
        }
        report_checks(checks, args.samples)
        headline = {}
    else:
        headline = report(args, {k: v for k, v in sizes.items() if k in layouts}, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "results": results,
                    "stoker_over_best_peer": headline,
                    "stopped": measuring.stopped,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
