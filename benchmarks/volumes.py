"""Patches of volumes and slides: stoker's PatchLoader against TorchIO, MONAI, zarr-python,
tifffile and OpenSlide on the same files.

``python benchmarks/volumes.py``: --subjects CT-like volumes of --size^3 int16 with a uint8
label volume each (a foreground block in the middle), written by nibabel as ``.nii`` and
``.nii.gz``, by numpy as ``.npy`` and by zarr-python as Zarr v3 stores of --chunk^3 chunks
compressed with Zstandard (level 3; chunks that are all fill value are not written, zarr's
default), one store per array (``ct_000.zarr:/image``, ``seg_000.zarr:/label``); and one
RGB slide of --slide-size^2 written by tifffile with 256^2 tiles, once as JPEG (quality
85, YCbCr, tifffile's default for JPEG) and once uncompressed. Everything is written once
and stamped. Batches of --batch patches of --patch^3 voxels (slides: --slide-patch^2); a
measurement stops after --patches patches or --max-seconds, whichever comes first, and its
rate is over what it did. Every row runs in a process of its own, the files in the page
cache (read through first: a cold disk is the same for everyone and measures the disk).

Rows (--sets picks among nii, nii.gz, npy, zarr, slide-jpeg, slide-raw):

- stoker PatchLoader, uniform and label-balanced (``LabelSampler``, ratio 1:1), two
  epochs of --patches patches from an empty cache (a ``.nii.gz`` is inflated once into it
  in the first);
- TorchIO: ``tio.Queue`` over a ``SubjectsDataset``, ``UniformSampler`` or ``LabelSampler``
  ({0: 1, 1: 1}), the Queue's 2 workers loading volumes, popped by a ``SubjectsLoader``
  with 0 workers as TorchIO's docs require (8 patches a volume, a queue of 64);
- MONAI: ``LoadImaged`` + ``EnsureChannelFirstd`` + ``RandCropByPosNegLabeld`` (pos 1, neg
  1, 4 patches a volume; batch_size 2, so 8 patches a batch) over a ``Dataset``, and over
  a ``PersistentDataset`` whose cache (in --scratch) starts empty: its first --patches
  patches write the cache and its next --patches read it, reported as two epochs as
  stoker's are;
- the written-out per-sample loaders of the first figures, for continuity: the whole
  volume per sample, then cropped; only the patch, through nibabel's array proxy or a
  memory-mapped ``.npy``. They are baselines, not the issue's peers: stoker's ratio to the
  best of them is printed under each table, and the targets are over the peers;
- Zarr: the patch sliced per sample with zarr-python (decoding only the chunks it touches);
- slides: the patch sliced per sample from ``tifffile.imread(path, aszarr=True)`` opened
  with zarr (decoding only the tiles it touches); each tile the patch touches read with
  ``os.pread`` and decoded with tifffile's ``TiffPage.decode``, then cropped into the patch
  (the same tiles, without zarr: tifffile's fastest way here); and OpenSlide's
  ``read_region``.

Every peer but TorchIO's (whose Queue has the workers) runs under a DataLoader with 2
workers. Reported per row: patches/s (median of --runs), the ratio to the best peer with
the same sampling (in the same epoch, where a peer has two; where no peer samples that way,
the best peer of any sampling, marked *), bytes read per patch over the patch's own bytes
(stoker's: its reader's count, epoch by epoch, the merged gaps and the label reads
included, as it maps files and reads from the mappings; the peers': the processes'
``rchar``, bytes their read calls returned, the measuring process and its workers; for
rows that load whole volumes at least the volumes' bytes each load, as nibabel maps a
``.nii`` rather than reading it), the time to the first batch (from opening the
subjects) and peak RSS (the measuring process or the largest of its workers), with the
issue's targets beside stoker's rows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import _runner
import numpy as np
import peers
from _runner import say

from stoker.tools.measure import peak_rss_bytes, read_through

FORMATS = ("nii", "nii.gz", "npy")
SLIDES = ("slide-jpeg", "slide-raw")
SETS = (*FORMATS, "zarr", *SLIDES)
TILE = 256
JPEG_QUALITY = 85
ZSTD_LEVEL = 3


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    sampling: str  # "uniform" or "label"
    sets: tuple[str, ...]
    epochs: int = 1
    baseline: bool = False  # written out here, not a peer's loader: no target is over it

    @property
    def stoker(self) -> bool:
        return self.key.startswith("stoker")


_DL = "DataLoader 2 workers"
_RAW = ("nii", "npy")
ROWS = (
    Row("stoker-uniform", "stoker PatchLoader", "uniform", SETS, 2),
    Row("stoker-label", "stoker PatchLoader, LabelSampler 1:1", "label", (*FORMATS, "zarr"), 2),
    Row(
        "torchio-uniform",
        "TorchIO Queue + UniformSampler (Queue 2 workers)",
        "uniform",
        FORMATS,
    ),
    Row(
        "torchio-label",
        "TorchIO Queue + LabelSampler {0:1, 1:1} (Queue 2 workers)",
        "label",
        FORMATS,
    ),
    Row(
        "monai",
        f"MONAI Dataset, LoadImaged + RandCropByPosNegLabeld ×{peers.MONAI_NUM_SAMPLES}, {_DL}",
        "label",
        FORMATS,
    ),
    Row("monai-persistent", f"MONAI PersistentDataset, the same, {_DL}", "label", FORMATS, 2),
    Row(
        "whole",
        f"written out: whole volume per sample + crop, {_DL}",
        "uniform",
        FORMATS,
        baseline=True,
    ),
    # a gzip stream has no random access: nibabel's proxy would inflate it all per patch
    Row(
        "sliced",
        f"written out: nibabel proxy / .npy mmap slice, {_DL}",
        "uniform",
        _RAW,
        baseline=True,
    ),
    Row("zarr-sliced", f"zarr-python slice per sample, {_DL}", "uniform", ("zarr",)),
    Row("tifffile", f"tifffile aszarr + zarr slice per patch, {_DL}", "uniform", SLIDES),
    Row(
        "tifffile-tiles",
        f"tifffile TiffPage.decode per tile + numpy, {_DL}",
        "uniform",
        SLIDES,
    ),
    Row("openslide", f"OpenSlide read_region per patch, {_DL}", "uniform", SLIDES),
)
ROW = {r.key: r for r in ROWS}

# The targets: stoker over the best peer (1st epoch, later epochs), and bytes read
# per patch over the patch's bytes where the data is stored uncompressed.
TARGETS = {
    "nii": (10.0, 10.0, 4.0),
    "npy": (10.0, 10.0, 4.0),
    "nii.gz": (3.0, 10.0, None),
    "zarr": (5.0, 5.0, None),
    "slide-jpeg": (5.0, 5.0, None),
    "slide-raw": (5.0, 5.0, 4.0),
}


# -- the data ----------------------------------------------------------------------------


def write_data(folder: str, subjects: int, size: int) -> dict[str, list[dict[str, str]]]:
    """The volumes in every format, and each format's subject list (written once: a stamp
    says for which sizes)."""
    import nibabel

    stamp_path = os.path.join(folder, "stamp.json")
    want = {"subjects": subjects, "size": size, "version": 1}
    lists = {
        fmt: [
            {
                "image": os.path.join(folder, fmt, f"ct_{i:03d}.{fmt}"),
                "label": os.path.join(folder, fmt, f"seg_{i:03d}.{fmt}"),
                "id": f"ct_{i:03d}",
            }
            for i in range(subjects)
        ]
        for fmt in FORMATS
    }
    if _runner.stamp_if_current(stamp_path, want) is not None:
        return lists
    say(f"writing {subjects} volumes of {size}^3 as .nii, .nii.gz and .npy into {folder}")
    rng = np.random.default_rng(0)
    affine = np.diag([0.8, 0.8, 1.5, 1.0])
    for fmt in FORMATS:
        os.makedirs(os.path.join(folder, fmt), exist_ok=True)
    q = size // 4
    for i in range(subjects):
        # CT-like: smooth-ish values in a body, air around it (gzip finds something to do)
        image = np.full((size, size, size), -1000, np.int16)
        body = rng.integers(-200, 400, (size - 2 * q // 2,) * 3).astype(np.int16)
        image[
            q // 2 : q // 2 + body.shape[0],
            q // 2 : q // 2 + body.shape[1],
            q // 2 : q // 2 + body.shape[2],
        ] = body
        label = np.zeros((size, size, size), np.uint8)
        label[q : 3 * q, q : 3 * q, q : 2 * q] = 1
        for fmt in FORMATS:
            subject = lists[fmt][i]
            if fmt == "npy":
                np.save(subject["image"], image)
                np.save(subject["label"], label)
            else:
                nibabel.save(nibabel.Nifti1Image(image, affine), subject["image"])
                nibabel.save(nibabel.Nifti1Image(label, affine), subject["label"])
    with open(stamp_path, "w") as f:
        json.dump(want, f)
    return lists


def write_zarr(folder: str, npy: list[dict[str, str]], size: int, chunk: int) -> list[dict]:
    """The .npy volumes copied into Zarr v3 stores, one array each (written once)."""
    import zarr
    from zarr.codecs import ZstdCodec

    base = os.path.join(folder, "zarr")
    names = {"image": ("ct", "image"), "label": ("seg", "label")}
    lists = [
        {
            k: os.path.join(base, f"{prefix}_{i:03d}.zarr") + f":/{name}"
            for k, (prefix, name) in names.items()
        }
        | {"id": s["id"]}
        for i, s in enumerate(npy)
    ]
    stamp_path = os.path.join(base, "stamp.json")
    want = {"subjects": len(npy), "size": size, "chunk": chunk, "zstd": ZSTD_LEVEL, "version": 1}
    if _runner.stamp_if_current(stamp_path, want) is not None:
        return lists
    say(f"writing the volumes as Zarr into {base}")
    os.makedirs(base, exist_ok=True)
    for source, subject in zip(npy, lists):
        for key in names:
            data = np.load(source[key])
            store, _, name = subject[key].rpartition(":/")
            group = zarr.open_group(store, mode="w", zarr_format=3)
            array = group.create_array(
                name,
                shape=data.shape,
                chunks=(min(chunk, size),) * 3,
                dtype=data.dtype,
                compressors=ZstdCodec(level=ZSTD_LEVEL),
            )
            array[...] = data
    with open(stamp_path, "w") as f:
        json.dump(want, f)
    return lists


def _slide_tiles(size: int):
    """The slide's tiles in row order: an ellipse of H&E-like texture (blobs of purple
    nuclei on pink stroma, a fine grain over them) on a near-white background, as whole
    slides are mostly glass around the tissue."""
    rng = np.random.default_rng(1)
    pink, purple = np.array([230, 160, 200.0]), np.array([120, 60, 150.0])
    pool = []
    for _ in range(16):
        blobs = np.kron(rng.random((TILE // 8, TILE // 8, 1)), np.ones((8, 8, 1)))
        v = np.clip(blobs * 0.85 + rng.random((TILE, TILE, 1)) * 0.15, 0, 1)
        pool.append((pink + (purple - pink) * v).astype(np.uint8))
    glass = (242 + rng.integers(-3, 4, (TILE, TILE, 3))).astype(np.uint8)
    n = -(-size // TILE)
    c = (n - 1) / 2
    for ty in range(n):
        for tx in range(n):
            inside = ((ty - c) / (0.45 * n)) ** 2 + ((tx - c) / (0.35 * n)) ** 2 <= 1
            yield pool[(ty * 7 + tx * 3) % len(pool)] if inside else glass


def write_slide(folder: str, size: int, compression: str) -> str:
    """The slide as a tiled TIFF, `compression` "jpeg" or "raw" (written once)."""
    import tifffile

    path = os.path.join(folder, "slide", f"slide-{compression}.tif")
    stamp_path = path + ".stamp.json"
    want = {"size": size, "tile": TILE, "quality": JPEG_QUALITY, "version": 1}
    if _runner.stamp_if_current(stamp_path, want) is not None:
        return path
    say(f"writing a {size}^2 slide ({compression}) as {path}")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    jpeg = compression == "jpeg"
    tifffile.imwrite(
        path,
        _slide_tiles(size),
        shape=(size, size, 3),
        dtype=np.uint8,
        tile=(TILE, TILE),
        photometric="rgb",
        compression="jpeg" if jpeg else None,
        compressionargs={"level": JPEG_QUALITY} if jpeg else None,
    )
    with open(stamp_path, "w") as f:
        json.dump(want, f)
    return path


def _files(subjects: list[dict[str, str]]) -> list[str]:
    """Every file the subjects' arrays are in (a Zarr store's chunk files among them)."""
    out = []
    for s in subjects:
        for key, value in s.items():
            if key == "id":
                continue
            store = value.rpartition(":/")[0] or value
            if os.path.isdir(store):
                out += [os.path.join(d, f) for d, _, fs in os.walk(store) for f in sorted(fs)]
            else:
                out.append(store)
    return out


def _data_bytes(path: str) -> int:
    """The voxel bytes of a volume file, as loaded whole."""
    import nibabel

    if path.endswith(".npy"):
        array = np.load(path, mmap_mode="r")
        return int(array.nbytes)
    image = nibabel.load(path)
    return int(np.prod(image.shape)) * image.get_data_dtype().itemsize


def rchar(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


# -- the children ------------------------------------------------------------------------


class Workers:
    """This process's descendants (DataLoader and Queue workers) as last seen: their rchar
    and peak RSS, read while they run (every 50 ms at most, and at the end of each epoch),
    as a worker's /proc entry goes when it exits (TorchIO's Queue starts new workers each
    pass)."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[int, int]] = {}
        self.last = 0.0

    def sample(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < 0.05:
            return
        self.last = now
        for pid in _descendants(os.getpid()):
            with contextlib.suppress(OSError):  # it exited between the listing and the read
                self.seen[pid] = (rchar(pid), peak_rss_bytes(pid))

    def read(self) -> int:
        return sum(r for r, _ in self.seen.values())

    def peak(self) -> int:
        return max((p for _, p in self.seen.values()), default=0)


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(c) for c in f.read().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def _preimport(row: Row) -> None:
    """Import what the row uses before the clock starts (as torch is for every row)."""
    import torch  # noqa: F401

    modules = {
        "torchio": ("torchio",),
        "monai": ("monai.data", "monai.transforms"),
        "zarr": ("zarr",),
        "tifffile": ("tifffile", "zarr"),
        "openslide": ("openslide", "tifffile"),
        "stoker": ("stoker",),
        "whole": ("nibabel",),
        "sliced": ("nibabel",),
    }
    for name in modules[row.key.split("-")[0]]:
        __import__(name)


def _build(row: Row, args: argparse.Namespace, subjects: list[dict], scratch: str):
    """The row's loader: (one pass's iterator for pass k, patches in a batch, whole-volume
    bytes each patch costs at least: 0 for rows that read only patches, and for stoker's
    rows the bytes its reader read so far: it maps files, which rchar does not see)."""
    import torch

    slide = args.set in SLIDES
    per_load = {
        "whole": 1,
        "torchio": peers.TORCHIO_SAMPLES_PER_VOLUME,
        "monai": peers.MONAI_NUM_SAMPLES,
    }.get(row.key.split("-")[0])
    whole = (
        sum(_data_bytes(subjects[0][k]) for k in ("image", "label")) / per_load if per_load else 0
    )
    if row.stoker:
        import stoker

        volumes = stoker.Volumes(subjects, spatial_dims=2 if slide else 3, cache_dir=scratch)
        sampler = stoker.LabelSampler("label", ratio=(1, 1)) if row.sampling == "label" else None
        loader = stoker.PatchLoader(
            volumes,
            args.slide_patch if slide else args.patch,
            args.batch,
            sampler=sampler,
            patches_per_subject=max(1, args.patches // len(subjects)),
            seed=0,
        )

        def one_pass(k: int):
            loader.set_epoch(k)
            return iter(loader)

        return one_pass, lambda b: len(b["subject"]), 0, lambda: loader.stats()["bytes_read"]
    if row.key.startswith("torchio"):
        import torchio as tio

        loader = peers.torchio_queue_loader(
            subjects, args.patch, args.batch, label=row.sampling == "label"
        )
        return lambda k: iter(loader), lambda b: len(b["image"][tio.DATA]), whole, None
    if row.key.startswith("monai"):
        cache = scratch if row.key == "monai-persistent" else None
        loader = peers.monai_patch_loader(subjects, args.patch, args.batch, cache_dir=cache)
        return lambda k: iter(loader), lambda b: len(b["image"]), whole, None
    if row.key in ("whole", "sliced"):
        dataset = peers.volume_patch_dataset(
            subjects, args.patch, args.patches, 0, sliced=row.key == "sliced"
        )
    elif row.key == "zarr-sliced":
        dataset = peers.zarr_patch_dataset(subjects, args.patch, args.patches, 0)
    else:
        dataset = peers.slide_patch_dataset(
            subjects[0]["image"], args.slide_patch, args.patches, 0, reader=row.key
        )
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=args.batch, num_workers=2, persistent_workers=True
    )
    count = (lambda b: len(b)) if slide else (lambda b: len(b["image"]))
    return lambda k: iter(loader), count, whole, None


def child(args: argparse.Namespace) -> None:
    row = ROW[args.child]
    subjects = json.loads(args.subjects_json)
    _preimport(row)
    # This machine's page cache gives files back within a minute (DAMON reclaim): each
    # measurement reads its files through just before its clock starts.
    read_through(_files(subjects))
    scratch = tempfile.mkdtemp(prefix=f"stoker-volumes-{row.key}-", dir=args.scratch)
    try:
        result = _measure(row, args, subjects, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps(result), flush=True)


def _measure(row: Row, args: argparse.Namespace, subjects: list[dict], scratch: str) -> dict:
    """Epochs of up to --patches patches or --max-seconds each, over as many passes of
    the loader as that takes; the first epoch's clock starts before the loader is made."""
    workers = Workers()
    before = rchar()
    began = time.perf_counter()
    one_pass, count, whole, bytes_read = _build(row, args, subjects, scratch)
    first, epochs, k = None, [], 0
    for e in range(row.epochs):
        start = began if e == 0 else time.perf_counter()
        read_before = bytes_read() if bytes_read else 0
        n = 0
        while n < args.patches and time.perf_counter() - start < args.max_seconds:
            got = 0
            for batch in one_pass(k):
                if first is None:
                    first = time.perf_counter() - began
                got += count(batch)
                if not row.stoker:
                    workers.sample()
                if n + got >= args.patches or time.perf_counter() - start >= args.max_seconds:
                    break
            k, n = k + 1, n + got
            if not got:
                break
        epochs.append({"patches": n, "seconds": time.perf_counter() - start})
        if bytes_read:
            epochs[-1]["bytes_per_patch"] = (bytes_read() - read_before) / max(1, n)
        if not row.stoker:
            workers.sample(force=True)
    done = sum(e["patches"] for e in epochs)
    read = (bytes_read() if bytes_read else rchar() - before + workers.read()) / max(1, done)
    return {
        "epochs": epochs,
        "first_batch_s": first,
        "bytes_per_patch": max(read, whole),
        "worker_peak_rss": workers.peak(),
    }


# -- the parent --------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--subjects", type=int, default=16)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--patch", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=64, help="Zarr chunks of this^3")
    parser.add_argument("--slide-size", type=int, default=20000, help="the slide's side")
    parser.add_argument("--slide-patch", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--patches", type=int, default=256, help="patches per measurement")
    parser.add_argument("--max-seconds", type=float, default=60, help="seconds per measurement")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--sets", default=",".join(SETS), help=f"some of {','.join(SETS)}")
    parser.add_argument("--rows", help="only these rows (keys: " + ",".join(ROW) + ")")
    parser.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "stoker-volumes"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--set", help=argparse.SUPPRESS)
    parser.add_argument("--subjects-json", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", default=tempfile.gettempdir(), help=argparse.SUPPRESS)
    _runner.add_arguments(
        parser,
        timeout=900,
        timeout_help="seconds per measurement's process, before it is killed",
        measured="measurements",
        json_help="write the results here",
    )
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    sets = args.sets.split(",")
    keys = args.rows.split(",") if args.rows else list(ROW)
    if unknown := [s for s in sets if s not in SETS] + [k for k in keys if k not in ROW]:
        parser.error(f"unknown sets or rows: {', '.join(unknown)}")
    limits = _runner.Limits(parser, args)
    lists: dict[str, list[dict]] = {}
    if any(s in (*FORMATS, "zarr") for s in sets):
        lists.update(write_data(args.data, args.subjects, args.size))
    if "zarr" in sets:
        lists["zarr"] = write_zarr(args.data, lists["npy"], args.size, args.chunk)
    for s in SLIDES:
        if s in sets:
            path = write_slide(args.data, args.slide_size, s.removeprefix("slide-"))
            lists[s] = [{"image": path}]
    say(
        f"{args.subjects} volumes of {args.size}^3 int16 ({args.size**3 * 2 / 1e6:.0f} MB) + "
        f"uint8 labels, patches of {args.patch}^3; a {args.slide_size}^2 RGB slide, patches "
        f"of {args.slide_patch}^2; batches of {args.batch}; up to {args.patches} patches or "
        f"{args.max_seconds:g} s per measurement, median of {args.runs} runs; files in the "
        f"page cache; {os.cpu_count()} cores"
    )
    results: dict[str, dict[str, list[dict]]] = {}
    with _runner.Interruptible("volumes") as measuring:
        for name in sets:
            subjects = lists[name]
            for row in ROWS:
                if name in row.sets and row.key in keys:
                    results.setdefault(name, {})[row.key] = _runs(row, name, subjects, args, limits)
    report(results, args)
    if measuring.stopped:
        say(f"(stopped: {measuring.stopped})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def _runs(row: Row, name: str, subjects: list[dict], args: argparse.Namespace, limits) -> list:
    outcomes: list[dict] = []
    for _ in range(args.runs):
        command = [sys.executable, os.path.abspath(__file__), "--child", row.key, "--set", name]
        command += ["--subjects-json", json.dumps(subjects), "--scratch", args.scratch]
        for option in ("patch", "slide_patch", "batch", "patches", "max_seconds"):
            command += ["--" + option.replace("_", "-"), str(getattr(args, option))]
        run = _runner.run_child(command, limits.next_slot())
        outcome = (
            run.result
            if run.failed is None and run.result
            else {"failed": run.failed or "no result", "stderr": run.stderr[-800:]}
        )
        outcome["peak_rss"] = max(run.peak_rss, (run.result or {}).get("worker_peak_rss", 0))
        outcomes.append(outcome)
        if "failed" in outcome:
            say(f"{name} {row.key}: {outcome['failed']}\n{outcome['stderr']}")
            break
    return outcomes


def report(results: dict[str, dict[str, list[dict]]], args: argparse.Namespace) -> None:
    for name, rows in results.items():
        slide = name in SLIDES
        # a slide's patch is RGB uint8; a volume's an int16 image and a uint8 label
        patch_bytes = args.slide_patch**2 * 3 if slide else args.patch**3 * 3
        first_target, later_target, bytes_target = TARGETS[name]
        note = f", bytes read <= {bytes_target:g}x the patch's" if bytes_target else ""
        say(
            f"\n{name} (targets: stoker >= {first_target:g}x the best peer in the 1st epoch, "
            f">= {later_target:g}x from the 2nd{note}):"
        )
        say(
            "| loader | sampling | epoch | patches | patches/s | x best peer | target "
            "| bytes read / patch bytes | 1st batch (s) | peak RSS (MB) |"
        )
        say("|---|---|---|---:|---:|---:|---|---:|---:|---:|")
        good = {k: [r for r in runs if "failed" not in r] for k, runs in rows.items()}
        rates = _rates(good)
        for row in ROWS:
            runs = good.get(row.key)
            if not runs:
                if rows.get(row.key):
                    failed = rows[row.key][0]["failed"]
                    say(f"| {row.label} | {row.sampling} | | | failed: {failed} | | | | | |")
                continue
            amplification = statistics.median(r["bytes_per_patch"] for r in runs) / patch_bytes
            first = statistics.median(r["first_batch_s"] or 0 for r in runs)
            rss = max(r["peak_rss"] for r in runs) / 1e6
            for e in range(len(runs[0]["epochs"])):
                if "bytes_per_patch" in runs[0]["epochs"][e]:  # stoker's, epoch by epoch
                    amplification = (
                        statistics.median(r["epochs"][e]["bytes_per_patch"] for r in runs)
                        / patch_bytes
                    )
                rate = rates[row.key][e]
                best, mark = _best_peer(rates, row.sampling, e), ""
                if not best:
                    best, mark = _best_peer(rates, None, e), "*"
                ratio = f"{rate / best:.1f}x{mark}" if best else ""
                target = ""
                if row.stoker and best:
                    want = first_target if e == 0 else later_target
                    target = f">= {want:g}x: {'met' if rate / best >= want else 'NOT met'}"
                    if bytes_target is not None:
                        met = "met" if amplification <= bytes_target else "NOT met"
                        target += f"; bytes <= {bytes_target:g}x: {met}"
                patches = statistics.median(r["epochs"][e]["patches"] for r in runs)
                say(
                    f"| {row.label} | {row.sampling} | {('1st', '2nd')[e]} | {patches:.0f} "
                    f"| {rate:,.0f} | {ratio} | {target} | {amplification:.2f}x "
                    f"| {first:.3f} | {rss:.0f} |"
                )
        _say_over_baselines(rates)


def _rates(good: dict[str, list[dict]]) -> dict[str, list[float]]:
    """Each row's patches/s per epoch, the median over its runs."""
    return {
        key: [
            statistics.median(r["epochs"][e]["patches"] / r["epochs"][e]["seconds"] for r in runs)
            for e in range(len(runs[0]["epochs"]))
        ]
        for key, runs in good.items()
        if runs
    }


def _best_peer(
    rates: dict[str, list[float]], sampling: str | None, epoch: int, baseline: bool = False
) -> float:
    """The fastest peer (`baseline`: written-out baseline) sampling as `sampling` does (any,
    for None) in epoch `epoch`, or in its only epoch."""
    return max(
        (
            r[min(epoch, len(r) - 1)]
            for key, r in rates.items()
            if not ROW[key].stoker
            and ROW[key].baseline == baseline
            and sampling in (None, ROW[key].sampling)
        ),
        default=0.0,
    )


def _say_over_baselines(rates: dict[str, list[float]]) -> None:
    """stoker's uniform rows over the best written-out baseline, epoch by epoch."""
    ratios = [
        f"{rates[row.key][e] / best:.1f}x"
        for row in ROWS
        if row.stoker and row.sampling == "uniform" and row.key in rates
        for e in range(len(rates[row.key]))
        if (best := _best_peer(rates, "uniform", e, baseline=True))
    ]
    if ratios:
        say(
            "stoker, uniform, over the best written-out baseline (not a peer: no target), "
            f"1st / 2nd epoch: {' / '.join(ratios)}"
        )


if __name__ == "__main__":
    main()
