"""Patches of volumes: stoker's PatchLoader against per-sample loaders on the same files.

``python benchmarks/volumes.py``: --subjects CT-like volumes of --size^3 int16 with a uint8
label volume each (a foreground block in the middle), written by nibabel as ``.nii`` and
``.nii.gz`` and by numpy as ``.npy``; batches of --batch patches of --patch^3 voxels,
--patches of them per measurement. Rows, each in a process of its own, the files in the
page cache (warmed first; a cold disk is the same for everyone and measures the disk):

- stoker PatchLoader, uniform and label-balanced (``LabelSampler``, ratio 1:1);
- the whole volume loaded per sample, then cropped, under a torch DataLoader with 2
  workers: what MONAI's ``LoadImaged`` + ``RandSpatialCropd`` and TorchIO's subject
  loading do (neither installs where this runs, so their operations are written out in
  ``peers.volume_patch_dataset``);
- only the patch read per sample through nibabel's array proxy (``img.dataobj[box]``) or a
  memory-mapped .npy, the same DataLoader: the strongest per-sample reader in Python.

For ``.nii.gz`` stoker's first epoch (into an empty cache: the volumes are inflated once)
and a second one are both reported. Each row reports patches/s (median of --runs), bytes
read per patch (the processes' ``rchar``: bytes their read calls returned, over the
patches; for the whole-volume rows the volumes' bytes, as nibabel maps a ``.nii`` rather
than reading it), the time to the first batch (from opening the subjects) and peak RSS (the
measuring process; with workers, the largest of its workers' too).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import _runner
import numpy as np
import peers
from _runner import say

from stoker.tools.measure import read_through

FORMATS = ("nii", "nii.gz", "npy")


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


def child_stoker(args: argparse.Namespace, subjects: list[dict[str, str]], sampler: str) -> dict:
    import torch  # noqa: F401  (imported before the clock starts, as the peers' DataLoader is)

    import stoker

    cache = tempfile.mkdtemp(prefix="stoker-volumes-cache-", dir=args.scratch)
    epochs = []
    began = time.perf_counter()
    before = rchar()
    volumes = stoker.Volumes(subjects, cache_dir=cache)
    chosen = stoker.LabelSampler("label", ratio=(1, 1)) if sampler == "label" else None
    loader = stoker.PatchLoader(
        volumes,
        args.patch,
        args.batch,
        sampler=chosen,
        patches_per_subject=max(1, args.patches // len(subjects)),
        seed=0,
    )
    first = None
    for epoch in range(2):
        loader.set_epoch(epoch)
        start, n = time.perf_counter(), 0
        for batch in loader:
            if first is None:
                first = time.perf_counter() - began
            n += len(batch["subject"])
        epochs.append(
            {"patches": n, "seconds": time.perf_counter() - (began if epoch == 0 else start)}
        )
    read = rchar() - before
    stats = loader.stats()
    return {
        "epochs": epochs,
        "first_batch_s": first,
        "bytes_per_patch": read / max(1, stats["patches"]),
        "reader_bytes_per_patch": stats["bytes_read_per_patch"],
    }


def child_peer(args: argparse.Namespace, subjects: list[dict[str, str]], sliced: bool) -> dict:
    import torch

    dataset = peers.volume_patch_dataset(subjects, args.patch, args.patches, 0, sliced=sliced)
    began = time.perf_counter()
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=args.batch, num_workers=2, persistent_workers=True
    )
    first, n, pids = None, 0, set()
    for batch in loader:
        if first is None:
            first = time.perf_counter() - began
        n += len(batch["pid"])
        pids.update(int(p) for p in batch["pid"])
    seconds = time.perf_counter() - began
    read = sum(rchar(p) for p in pids)
    if not sliced:  # the whole volumes, by construction (nibabel maps a .nii: no read calls)
        read = max(read, n * sum(_data_bytes(subjects[0][k]) for k in ("image", "label")))
    peak = 0
    for pid in pids:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    peak = max(peak, int(line.split()[1]) * 1024)
    return {
        "epochs": [{"patches": n, "seconds": seconds}],
        "first_batch_s": first,
        "bytes_per_patch": read / max(1, n),
        "worker_peak_rss": peak,
    }


def child(args: argparse.Namespace) -> None:
    subjects = json.loads(args.subjects_json)
    name = args.child
    if name.startswith("stoker"):
        result = child_stoker(args, subjects, "label" if "label" in name else "uniform")
    else:
        result = child_peer(args, subjects, sliced="sliced" in name)
    print(json.dumps(result), flush=True)


# -- the parent --------------------------------------------------------------------------

ROWS = (
    ("stoker, uniform", "stoker-uniform"),
    ("stoker, label-balanced", "stoker-label"),
    ("whole volume per sample + crop (MONAI/TorchIO's way), DataLoader 2 workers", "whole"),
    ("patch through nibabel's proxy / .npy mmap, DataLoader 2 workers", "sliced"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--subjects", type=int, default=16)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--patch", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--patches", type=int, default=256, help="patches per measurement")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "stoker-volumes"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--subjects-json", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", default=tempfile.gettempdir(), help=argparse.SUPPRESS)
    _runner.add_arguments(
        parser,
        timeout=900,
        timeout_help="seconds per measurement",
        measured="measurements",
        json_help="write the results here",
    )
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    limits = _runner.Limits(parser, args)
    lists = write_data(args.data, args.subjects, args.size)
    volume_mb = args.size**3 * 2 / 1e6
    say(
        f"{args.subjects} volumes of {args.size}^3 int16 ({volume_mb:.0f} MB) + uint8 labels; "
        f"patches of {args.patch}^3, batches of {args.batch}, {args.patches} patches per "
        f"measurement, median of {args.runs} runs; files in the page cache; "
        f"{os.cpu_count()} cores"
    )
    results: dict[str, dict[str, list[dict]]] = {}
    with _runner.Interruptible("volumes") as measuring:
        for fmt in args.formats.split(","):
            subjects = lists[fmt]
            read_through([p for s in subjects for p in (s["image"], s["label"])])
            for _, key in ROWS:
                if key == "sliced" and fmt == "nii.gz":
                    continue  # a gzip stream has no random access: the proxy inflates it all
                for _ in range(args.runs):
                    command = [
                        sys.executable,
                        os.path.abspath(__file__),
                        "--child",
                        key,
                        "--subjects-json",
                        json.dumps(subjects),
                        "--patch",
                        str(args.patch),
                        "--batch",
                        str(args.batch),
                        "--patches",
                        str(args.patches),
                        "--scratch",
                        args.scratch,
                    ]
                    run = _runner.run_child(command, limits.next_slot())
                    outcome = (
                        run.result
                        if run.failed is None and run.result
                        else {"failed": run.failed or "no result", "stderr": run.stderr[-500:]}
                    )
                    outcome["peak_rss"] = max(
                        run.peak_rss, (run.result or {}).get("worker_peak_rss", 0)
                    )
                    results.setdefault(fmt, {}).setdefault(key, []).append(outcome)
                    if "failed" in outcome:
                        say(f"{fmt} {key}: {outcome['failed']}\n{outcome['stderr']}")
                        break
    report(results, args)
    if measuring.stopped:
        say(f"(stopped: {measuring.stopped})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def report(results: dict[str, dict[str, list[dict]]], args: argparse.Namespace) -> None:
    patch_bytes = args.patch**3 * 3  # image int16 + label uint8
    for fmt, rows in results.items():
        say(f"\n{fmt}:")
        say(
            "| loader | epoch | patches/s | x best per-sample | bytes read / patch bytes "
            "| 1st batch (s) | peak RSS (MB) |"
        )
        say("|---|---|---:|---:|---:|---:|---:|")
        rates: dict[tuple[str, int], float] = {}
        for key, runs in rows.items():
            good = [r for r in runs if "failed" not in r]
            if not good:
                continue
            for e in range(len(good[0]["epochs"])):
                rates[(key, e)] = statistics.median(
                    r["epochs"][e]["patches"] / r["epochs"][e]["seconds"] for r in good
                )
        best_peer = max((v for (k, _), v in rates.items() if not k.startswith("stoker")), default=0)
        for label, key in ROWS:
            runs = [r for r in rows.get(key, []) if "failed" not in r]
            if not runs:
                if rows.get(key):
                    say(f"| {label} | | failed: {rows[key][0]['failed']} | | | | |")
                continue
            for e in range(len(runs[0]["epochs"])):
                rate = rates[(key, e)]
                ratio = f"{rate / best_peer:.1f}x" if best_peer else ""
                epoch = ("1st" if e == 0 else "2nd") if key.startswith("stoker") else "1st"
                amplification = statistics.median(r["bytes_per_patch"] for r in runs) / patch_bytes
                shown = f"{amplification:.1f}x" if amplification else "(mmap: not counted)"
                first = statistics.median(r["first_batch_s"] for r in runs)
                rss = max(r["peak_rss"] for r in runs) / 1e6
                say(
                    f"| {label} | {epoch} | {rate:,.0f} | {ratio} | {shown} "
                    f"| {first:.3f} | {rss:.0f} |"
                )


if __name__ == "__main__":
    main()
