"""Patches of volumes into GPU memory: stoker's cuFile gather against the pinned CPU-reader
path and MONAI.

    python benchmarks/gpu_patches.py [--volumes 4] [--size 256] [--patch 64] [--batch 8]
                                     [--seconds 5] [--formats npy nii] [--cold]
                                     [--dir bench-data/gpu-patches] [--only NAME ...]
                                     [--timeout SECONDS] [--budget SECONDS] [--json FILE]
                                     [--quick]

--volumes int16 volumes of --size^3 (random values, so a byte in the wrong place shows) are
written once under --dir as ``.npy`` and as single-file NIfTI-1 ``.nii`` (a header written
here, vox_offset 352, dims x, y, z = the .npy's last, middle, first axes: the same voxel
bytes). Batches of --batch patches of --patch^3 voxels at uniformly random places go into
device memory, each method for --seconds (after a first batch that is not timed) in a
process of its own, per format:

- stoker cuFile gather: ``stoker.volumes.device_reads.DevicePatchReader``: each batch's
  runs (``boxes.patch_runs``: 4,096 runs of 128 bytes for 64^3 of 256^3) read by cuFile
  into device scratch memory, span by span, then put in place by device-to-device copies
  (2-D copies, one per patch where the slices are a span each); a .nii batch is then
  permuted on the device into [x, y, z] order, as PatchLoader's is. Where cuFile is not
  GPUDirect (no nvidia-fs, an unsupported file system) it runs with STOKER_GDS=on, in
  cuFile's POSIX compatibility mode, and says so. Read synchronously by the timing thread,
  with no read-ahead. Its first batch is checked against the files' bytes.
- stoker PatchLoader(device="cuda"): today's path: the C++ reader's threads read the runs
  into a pinned slot (prefetch 2), copied to the device in one copy and permuted there.
- MONAI: ``LoadImaged`` (int16) + ``EnsureChannelFirstd`` + ``RandSpatialCropd`` over a
  ``Dataset``, DataLoader with 2 workers, then ``.cuda()``: the whole volume read per
  patch. Skipped with a line where MONAI (or, for .nii, nibabel) is not installed.

Warm by default: the files are read through the page cache first, so the CPU paths read
memory while cuFile with O_DIRECT reads the disk; --cold evicts them
(``posix_fadvise(DONTNEED)``, best effort) before each method. The clock covers making
each batch's runs (the gather), the reads and copies, and ``torch.cuda.synchronize()`` at
the end. Reported: patches/s, ratios to PatchLoader(cuda) and to MONAI, and for the gather
its mode, bytes read per patch byte and copies per batch. A closing ``headline`` line per
format says it in one line (scripts/gpu_check.sh reads it).

--quick (scripts/gpu_check.sh): 3 volumes, 2 s a method, well under 60 s. A method process
that runs past --timeout is killed and reported; --budget cuts what does not fit; the tables
are printed from whatever finished. Without a usable CUDA device the benchmark says so and
exits with status 0.

NOT YET RUN ON A GPU: written on a machine without one; its numbers are unmeasured.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
from typing import Any

import _runner
import numpy as np
from _runner import say

from stoker.tools.measure import evict_from_page_cache, read_through

METHODS = ("stoker cuFile gather", "stoker PatchLoader(cuda)", "MONAI + .cuda()")
FORMATS = ("npy", "nii")


# ---- the data -------------------------------------------------------------------------------


def nifti1_int16_header(dims: tuple[int, int, int]) -> bytes:
    """A NIfTI-1 header for int16 voxels of `dims` (x, y, z), data at byte 352."""
    h = bytearray(352)
    struct.pack_into("<i", h, 0, 348)
    struct.pack_into("<8h", h, 40, 3, *dims, 1, 1, 1, 1)
    struct.pack_into("<hh", h, 70, 4, 16)  # NIFTI_TYPE_INT16, bitpix
    struct.pack_into("<8f", h, 76, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
    struct.pack_into("<3f", h, 108, 352.0, 1.0, 0.0)  # vox_offset, scl_slope, scl_inter
    h[123] = 2  # mm
    struct.pack_into("<hh", h, 252, 0, 2)  # qform 0, sform 2
    struct.pack_into("<12f", h, 280, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0)
    h[344:348] = b"n+1\0"
    return bytes(h)


def write_data(folder: str, volumes: int, size: int) -> dict[str, list[str]]:
    paths = {
        fmt: [os.path.join(folder, f"vol_{i:03d}.{fmt}") for i in range(volumes)] for fmt in FORMATS
    }
    stamp = os.path.join(folder, "stamp.json")
    want = {"volumes": volumes, "size": size, "version": 1}
    if _runner.stamp_if_current(stamp, want) is not None:
        return paths
    os.makedirs(folder, exist_ok=True)
    say(f"writing {volumes} int16 volumes of {size}^3 as .npy and .nii into {folder}")
    rng = np.random.default_rng(0)
    for i in range(volumes):
        data = rng.integers(-1024, 3072, (size,) * 3, dtype=np.int16)
        np.save(paths["npy"][i], data)
        with open(paths["nii"][i] + ".part", "wb") as f:
            f.write(nifti1_int16_header((size,) * 3))
            f.write(memoryview(data).cast("B"))
        os.replace(paths["nii"][i] + ".part", paths["nii"][i])
    with open(stamp, "w") as f:
        json.dump(want, f)
    return paths


def warm_or_cold(paths: list[str], cold: bool) -> None:
    if not cold:
        read_through(paths)
        return
    for path in paths:
        evict_from_page_cache(path)


# ---- the methods, each in a child process ---------------------------------------------------


def _clock(args: argparse.Namespace, one_batch: Any) -> tuple[int, float]:
    """Batches until --seconds have passed, the first not timed: (patches, seconds)."""
    import torch

    one_batch()
    torch.cuda.synchronize()
    start = time.perf_counter()
    patches = 0
    while time.perf_counter() - start < args.seconds:
        patches += one_batch()
    torch.cuda.synchronize()
    return patches, time.perf_counter() - start


def child_gather(args: argparse.Namespace, paths: list[str], fmt: str) -> dict:
    import torch

    from stoker.volumes.arrays import open_nifti, open_npy
    from stoker.volumes.boxes import patch_runs
    from stoker.volumes.device_reads import DevicePatchReader

    reader = DevicePatchReader(0, paths)
    mode = "GPUDirect"
    if not reader.available():
        why = reader.reason
        os.environ["STOKER_GDS"] = "on"
        reader = DevicePatchReader(0, paths)
        if not reader.available():
            return {"skipped": f"cuFile is not usable: {why}"}
        mode = f"cuFile compatibility mode (STOKER_GDS=on; not GPUDirect: {why})"
    arrays = [open_npy(p, 3) if fmt == "npy" else open_nifti(p, 3, None) for p in paths]
    patch = (args.patch,) * 3
    per = args.patch**3 * 2
    rng = np.random.default_rng(1)
    shape = arrays[0].spatial_shape
    totals = {"bytes_read": 0, "copies": 0, "batches": 0}

    def runs() -> tuple[list[np.ndarray], tuple[int, ...]]:
        parts = []
        stored: tuple[int, ...] = ()
        for k in range(args.batch):
            f = int(rng.integers(len(arrays)))
            start = tuple(int(rng.integers(0, s - p + 1)) for s, p in zip(shape, patch))
            r = patch_runs(arrays[f], start, patch)
            stored = r.shape
            parts.append(
                (np.full(r.offsets.size, f), r.offsets, r.lengths, r.dest_offsets + k * per)
            )
        return [np.concatenate(p) for p in zip(*parts)], stored

    def batch(keep: list | None = None) -> int:
        (ids, offsets, lengths, dests), stored = runs()
        dest = torch.empty(args.batch * per, dtype=torch.uint8, device="cuda")
        stats = reader.read(dest, ids, offsets, lengths, dests)
        tensor = dest.view(torch.int16).view(args.batch, *stored)
        if fmt == "nii":  # stored z, y, x: PatchLoader hands out [x, y, z]
            tensor = tensor.permute(0, 3, 2, 1).contiguous()
        totals["bytes_read"] += stats["bytes_read"]
        totals["copies"] += stats["copies"] + stats["copies_2d"]
        totals["batches"] += 1
        if keep is not None:
            keep.extend([dest, ids, offsets, lengths, dests])
        return args.batch

    first: list = []
    batch(first)
    dest, ids, offsets, lengths, dests = first
    torch.cuda.synchronize()
    got = dest.cpu().numpy()
    want = np.full_like(got, 0)
    maps = [np.memmap(p, np.uint8, "r") for p in paths]
    for i, o, n, d in zip(ids.tolist(), offsets.tolist(), lengths.tolist(), dests.tolist()):
        want[d : d + n] = maps[i][o : o + n]
    verified = bool(np.array_equal(got, want))
    totals.update(bytes_read=0, copies=0, batches=0)
    patches, seconds = _clock(args, batch)
    return {
        "patches": patches,
        "seconds": seconds,
        "verified": verified,
        "mode": mode,
        "read_per_patch_byte": totals["bytes_read"] / max(1, totals["batches"] * args.batch * per),
        "copies_per_batch": totals["copies"] / max(1, totals["batches"]),
    }


def child_loader(args: argparse.Namespace, paths: list[str], fmt: str) -> dict:
    import stoker

    volumes = stoker.Volumes(
        [{"image": p} for p in paths], cache_dir=os.path.join(args.dir, "cache")
    )
    loader = stoker.PatchLoader(
        volumes, args.patch, args.batch, device="cuda", patches_per_subject=64, seed=0
    )
    batches = iter(())
    epoch = 0

    def batch() -> int:
        nonlocal batches, epoch
        for _ in range(2):
            for b in batches:
                return int(b["image"].shape[0])
            loader.set_epoch(epoch)
            epoch += 1
            batches = iter(loader)
        raise RuntimeError("PatchLoader gave no batch")

    patches, seconds = _clock(args, batch)
    return {"patches": patches, "seconds": seconds}


def child_monai(args: argparse.Namespace, paths: list[str], fmt: str) -> dict:
    try:
        from monai.data import DataLoader, Dataset
        from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, RandSpatialCropd
    except ImportError as e:
        return {"skipped": f"MONAI is not installed ({e})"}
    if fmt == "nii":
        try:
            import nibabel  # noqa: F401  (MONAI reads NIfTI with it)
        except ImportError:
            return {"skipped": "nibabel is not installed (MONAI reads .nii with it)"}
    transform = Compose(
        [
            LoadImaged(keys="image", image_only=True, dtype=np.int16),
            EnsureChannelFirstd(keys="image", channel_dim="no_channel"),
            RandSpatialCropd(keys="image", roi_size=(args.patch,) * 3, random_size=False),
        ]
    )
    data = Dataset([{"image": p} for p in paths] * 64, transform=transform)
    loader = DataLoader(data, batch_size=args.batch, shuffle=True, num_workers=2)
    batches = iter(())

    def batch() -> int:
        nonlocal batches
        for _ in range(2):
            for b in batches:
                return int(b["image"].cuda().shape[0])
            batches = iter(loader)
        raise RuntimeError("MONAI's DataLoader gave no batch")

    patches, seconds = _clock(args, batch)
    return {"patches": patches, "seconds": seconds}


CHILDREN = dict(zip(METHODS, (child_gather, child_loader, child_monai)))


def child(args: argparse.Namespace) -> None:
    paths = json.loads(args.paths_json)
    result = CHILDREN[args.child](args, paths, args.format)
    print(json.dumps(result), flush=True)


# ---- the run --------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--volumes", type=int, default=4)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--patch", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=5.0, help="timed per method")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--cold", action="store_true", help="evict the files before each")
    parser.add_argument("--dir", default="bench-data/gpu-patches")
    parser.add_argument("--only", nargs="+", help="methods whose names contain one of these")
    parser.add_argument("--quick", action="store_true", help="3 volumes, 2 s a method")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--format", help=argparse.SUPPRESS)
    parser.add_argument("--paths-json", help=argparse.SUPPRESS)
    _runner.add_arguments(
        parser,
        timeout=60,
        timeout_help="seconds a method's process may run",
        measured="methods",
        json_help="write the results here too",
    )
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.quick:
        args.volumes, args.seconds = min(args.volumes, 3), min(args.seconds, 2.0)
    limits = _runner.Limits(parser, args)
    why = _runner.why_no_cuda()
    if why is not None:
        say(f"gpu_patches: skipped: {why}")
        return
    if args.patch > args.size:
        parser.error("--patch must not exceed --size")
    methods = [m for m in METHODS if not args.only or any(o in m for o in args.only)]
    paths = write_data(args.dir, args.volumes, args.size)
    results: dict[str, dict[str, dict]] = {fmt: {} for fmt in args.formats}
    with _runner.Interruptible("gpu_patches"):
        for fmt in args.formats:
            for method in methods:
                slot = limits.next_slot()
                warm_or_cold(paths[fmt], args.cold)
                command = [
                    sys.executable,
                    os.path.abspath(__file__),
                    "--child",
                    method,
                    "--format",
                    fmt,
                    "--paths-json",
                    json.dumps(paths[fmt]),
                    "--patch",
                    str(args.patch),
                    "--batch",
                    str(args.batch),
                    "--seconds",
                    str(args.seconds),
                    "--dir",
                    args.dir,
                ]
                run = _runner.run_child(command, slot)
                result = run.result or {}
                if run.failed:
                    result = {"failed": f"{run.failed}: {run.stderr.strip()[-300:]}"}
                results[fmt][method] = result
                say(f"{fmt:4} {method:28} {describe(result)}")
    report(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


def rate(result: dict) -> float | None:
    if "patches" not in result or not result.get("seconds"):
        return None
    return result["patches"] / result["seconds"]


def notes(result: dict) -> str:
    """What a row says beside its rate; why it has none, if it has none."""
    if rate(result) is None:
        return result.get("skipped") or result.get("failed") or "no result"
    extra = []
    if "verified" in result:
        extra.append("bytes exact" if result["verified"] else "WRONG BYTES")
    if "read_per_patch_byte" in result:
        extra.append(f"{result['read_per_patch_byte']:.2f} B read per patch byte")
        extra.append(f"{result['copies_per_batch']:.0f} copies per batch")
    if "mode" in result:
        extra.append(result["mode"])
    return "; ".join(extra)


def describe(result: dict) -> str:
    r = rate(result)
    if r is None:
        return notes(result)
    extra = notes(result)
    return f"{r:10.1f} patches/s" + (f"  ({extra})" if extra else "")


def report(results: dict[str, dict[str, dict]], args: argparse.Namespace) -> None:
    say(
        f"\n{args.batch} patches of {args.patch}^3 int16 a batch from {args.volumes} volumes of "
        f"{args.size}^3, {'cold' if args.cold else 'warm'} page cache, into device memory"
    )
    for fmt, rows in results.items():
        say(f"\n| {fmt} | patches/s | x PatchLoader(cuda) | x MONAI | notes |")
        say("|---|---|---|---|---|")
        loader = rate(rows.get(METHODS[1], {}))
        monai = rate(rows.get(METHODS[2], {}))
        for method, result in rows.items():
            r = rate(result)
            ratios = [
                f"{r / base:.2f}" if r is not None and base else "-" for base in (loader, monai)
            ]
            shown = f"{r:.1f}" if r is not None else "-"
            say(f"| {method} | {shown} | {ratios[0]} | {ratios[1]} | {notes(result)} |")
        gather = rate(rows.get(METHODS[0], {}))
        parts = [
            f"{name} {value:.0f}/s" if value is not None else f"{name} -"
            for name, value in (
                ("cuFile gather", gather),
                ("PatchLoader", loader),
                ("MONAI", monai),
            )
        ]
        ratio = [
            f"gather/{name} {gather / value:.2f}"
            for name, value in (("PatchLoader", loader), ("MONAI", monai))
            if gather is not None and value
        ]
        mode = rows.get(METHODS[0], {}).get("mode", "")
        say(
            f"headline gpu_patches ({fmt}): {', '.join(parts)}"
            + (f"; {', '.join(ratio)}" if ratio else "")
            + (f" [{mode.split(' (')[0]}]" if mode else "")
        )


if __name__ == "__main__":
    main()
