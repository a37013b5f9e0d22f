"""Batches onto the GPU: stoker.Loader(device="cuda") against torch's DataLoader with pinned
memory and non-blocking copies, the plain DataLoader with .cuda(), and a bare pinned copy.

    python benchmarks/h2d.py [--samples SMALL [LARGE]] [--batch 256] [--runs 3] [--epochs 3]
                             [--min-seconds 1] [--large-dtype uint8] [--data DIR] [--quick]

Two configurations: "small", 3x64x64 uint8 images (12 KB, a batch of 256 is 3 MB), and
"large", 3x224x224 images (uint8: 150 KB, 38.5 MB a batch; --large-dtype float16: 77 MB),
each with an integer label. They are written once under --data as tar shards in the
WebDataset convention: each sample a ``KEY.npy`` member written by ``numpy.save`` and a
``KEY.cls`` member holding its label (a .npy shard has one field, its rows, so the labels
travel beside the rows this way). Every loader reads the same shards, shuffled, and moves
each batch's images and labels onto the GPU:

- stoker: ``stoker.Loader(ds, batch, device="cuda", fields={"npy": stoker.Npy(),
  "cls": stoker.Int()}, shuffle=True)``: batches arrive as device tensors;
- DataLoader, pinned: a map-style dataset that finds each member's bytes once with tarfile
  and numpy's header reader and ``preadv``s one sample per ``__getitem__``, in
  ``torch.utils.data.DataLoader(pin_memory=True, num_workers=W, persistent_workers=True)``,
  each batch moved with ``.to("cuda", non_blocking=True)`` (the seeds' trick);
- DataLoader, plain: the same without ``pin_memory``, moved with ``.cuda()``;
- the ceiling: no loading at all, one pinned host tensor copied into one device tensor with
  ``copy_(non_blocking=True)``, batch after batch (the same bytes per batch as the loaders
  move: images and int64 labels), synchronised at the end.

W is min(8, cores). Every consumer touches each batch on the GPU (a small reduction on the
current stream: a checksum of the first 64 bytes of each image plus the labels), and the
checksums are compared with the data's at the end, so a loader that hands over wrong or
unfinished batches is caught. Each measurement runs in a fresh process: one untimed epoch
first (workers start, memory is pinned, the allocator warms), then timed epochs, at least
--epochs and at least --min-seconds; the clock starts and stops with
``torch.cuda.synchronize()``. The page cache is warm: the shards are read once before the
first measurement, and every loader's first epoch is untimed. The loaders take turns for
--runs rounds and the tables show medians. Without a usable CUDA device the benchmark says
so and exits with status 0.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import statistics
import subprocess
import sys
import tarfile
import time

import numpy as np

CONFIGS = {"small": (3, 64, 64), "large": (3, 224, 224)}
SHARDS = 16
CHECK_BYTES = 64  # of each image, summed on the GPU by every consumer
LOADERS = ["stoker", "DataLoader, pin_memory + non_blocking", "DataLoader, plain + .cuda()"]
CEILING = "ceiling: bare pinned copy"
PINNED = "DataLoader, pin_memory + non_blocking"
TARGET = 0.90  # stoker's share of the ceiling on large batches


def workers() -> int:
    return min(8, os.cpu_count() or 1)


# -- data ---------------------------------------------------------------------


def prepare(folder: str, shape: tuple[int, ...], dtype: str, n: int) -> dict:
    """Write the shards unless a stamp says they are there; returns the stamp (the files,
    one sample's bytes and the checksums a full epoch must give)."""
    stamp_path = os.path.join(folder, "stamp.json")
    want = {"samples": n, "shape": list(shape), "dtype": dtype}
    if os.path.exists(stamp_path):
        with open(stamp_path) as f:
            stamp = json.load(f)
        if all(stamp.get(k) == v for k, v in want.items()):
            return stamp
        os.unlink(stamp_path)
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    per_shard = -(-n // SHARDS)
    paths, check_sum, label_sum = [], 0, 0
    for s in range(-(-n // per_shard)):
        first, last = s * per_shard, min(n, (s + 1) * per_shard)
        if dtype == "uint8":
            images = rng.integers(0, 256, (last - first, *shape), dtype=np.uint8)
        else:
            images = rng.standard_normal((last - first, *shape), dtype=np.float32).astype(dtype)
        labels = rng.integers(0, 1000, last - first)
        check_sum += int(
            images.reshape(len(images), -1).view(np.uint8)[:, :CHECK_BYTES].sum(dtype=np.int64)
        )
        label_sum += int(labels.sum())
        path = os.path.join(folder, f"shard-{s:06d}.tar")
        with tarfile.open(path + ".part", "w") as tar:
            for j in range(last - first):
                member = io.BytesIO()
                np.save(member, images[j])
                for field, data in (("npy", member.getvalue()), ("cls", b"%d" % labels[j])):
                    info = tarfile.TarInfo(f"{first + j:07d}.{field}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        os.replace(path + ".part", path)
        paths.append(path)
    stamp = {
        **want,
        "shards": paths,
        "sample_bytes": int(np.prod(shape)) * np.dtype(dtype).itemsize,
        "check_sum": check_sum,
        "label_sum": label_sum,
    }
    with open(stamp_path, "w") as f:
        json.dump(stamp, f)
    return stamp


def warm_page_cache(paths: list[str]) -> None:
    buffer = bytearray(16 << 20)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


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


# -- one measurement, in a child process ----------------------------------------


def build(name: str, stamp: dict, batch: int):
    """(an iterable of batches, a function moving one batch onto the GPU -> (x, y))."""
    import torch

    if name == "stoker":
        import stoker

        ds = stoker.Dataset(stamp["shards"])
        loader = stoker.Loader(
            ds,
            batch,
            device="cuda",
            fields={"npy": stoker.Npy(), "cls": stoker.Int()},
            shuffle=True,
        )
        return loader, lambda b: (b["npy"], b["cls"])
    pinned = name == PINNED
    loader = torch.utils.data.DataLoader(
        TarNpySamples(stamp["shards"]),
        batch_size=batch,
        shuffle=True,
        num_workers=workers(),
        pin_memory=pinned,
        persistent_workers=True,
    )
    if pinned:
        return loader, lambda b: (
            b[0].to("cuda", non_blocking=True),
            b[1].to("cuda", non_blocking=True),
        )
    return loader, lambda b: (b[0].cuda(), b[1].cuda())


def child_loader(name: str, stamp: dict, args) -> dict:
    import torch

    torch.zeros(1, device="cuda")  # the context, before the clock
    loader, to_device = build(name, stamp, args.batch)

    def epoch() -> tuple[int, torch.Tensor, torch.Tensor]:
        checks = torch.zeros((), dtype=torch.int64, device="cuda")
        labels = torch.zeros((), dtype=torch.int64, device="cuda")
        batches = 0
        for b in loader:
            x, y = to_device(b)
            if x.device.type != "cuda" or y.device.type != "cuda":
                raise ValueError(f"a batch on {x.device} / {y.device}")
            checks += (
                x.reshape(len(x), -1).view(torch.uint8)[:, :CHECK_BYTES].sum(dtype=torch.int64)
            )
            labels += y.sum()
            batches += 1
        return batches, checks, labels

    start = time.perf_counter()
    batches, checks, labels = epoch()
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    sums = [(checks, labels)]
    epochs = timed = 0
    torch.cuda.synchronize()
    start = time.perf_counter()
    while epochs < args.epochs or time.perf_counter() - start < args.min_seconds:
        n, checks, labels = epoch()
        sums.append((checks, labels))
        timed += n
        epochs += 1
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    wrong = [
        (int(c), int(y))
        for c, y in sums
        if (int(c), int(y)) != (stamp["check_sum"], stamp["label_sum"])
    ]
    extra = {}
    if name == "stoker":
        import stoker

        extra["cuda_status"] = stoker.cuda_status()
    return {
        "batches": timed,
        "batches_per_epoch": batches,
        "bytes": (stamp["sample_bytes"] + 8) * stamp["samples"] * epochs,
        "seconds": seconds,
        "epochs": epochs,
        "first_epoch": first,
        "wrong": wrong[:3],
        **extra,
    }


def child_ceiling(stamp: dict, args) -> dict:
    import torch

    per_sample = stamp["sample_bytes"] + 8
    n = stamp["samples"]
    sizes = [min(args.batch, n - i) * per_sample for i in range(0, n, args.batch)]
    src = torch.empty(max(sizes), dtype=torch.uint8).pin_memory()
    src.random_(0, 256)
    dst = torch.empty(max(sizes), dtype=torch.uint8, device="cuda")

    def passes(count: int) -> None:
        for _ in range(count):
            for size in sizes:
                dst[:size].copy_(src[:size], non_blocking=True)

    passes(1)  # warm
    torch.cuda.synchronize()
    start = time.perf_counter()
    passes(1)
    torch.cuda.synchronize()
    one = time.perf_counter() - start
    epochs = max(args.epochs, math.ceil(args.min_seconds / max(one, 1e-6)))
    torch.cuda.synchronize()
    start = time.perf_counter()
    passes(epochs)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if not torch.equal(dst[: sizes[0]].cpu(), src[: sizes[0]]):
        raise ValueError("the bare copy did not arrive")
    return {
        "batches": len(sizes) * epochs,
        "bytes": sum(sizes) * epochs,
        "seconds": seconds,
        "epochs": epochs,
        "first_epoch": 0.0,
        "wrong": [],
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }


def child(name: str, config: str, args) -> None:
    import torch  # noqa: F401 - imports are not what is measured

    import stoker  # noqa: F401

    with open(os.path.join(args.data, folder_name(config, args), "stamp.json")) as f:
        stamp = json.load(f)
    result = child_ceiling(stamp, args) if name == CEILING else child_loader(name, stamp, args)
    print(json.dumps(result))


# -- the parent ---------------------------------------------------------------


def folder_name(config: str, args) -> str:
    dtype = args.large_dtype if config == "large" else "uint8"
    return f"{config}-{args.samples_of[config]}-{dtype}"


def measure(name: str, config: str, args) -> dict:
    command = [sys.executable, __file__, "--child", name, "--config", config]
    command += ["--data", args.data, "--batch", str(args.batch)]
    command += ["--samples", str(args.samples_of["small"]), str(args.samples_of["large"])]
    command += ["--epochs", str(args.epochs), "--min-seconds", repr(args.min_seconds)]
    command += ["--large-dtype", args.large_dtype]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"{config} / {name}: timed out after {args.timeout} s", file=sys.stderr)
        return {"failed": "timed out"}
    if out.returncode != 0 or not out.stdout.strip():
        print(
            f"{config} / {name}: failed (exit status {out.returncode})\n{out.stderr[-3000:]}",
            file=sys.stderr,
        )
        return {"failed": f"exit status {out.returncode}"}
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if result["wrong"]:
        print(
            f"{config} / {name}: WRONG checksums (image bytes, labels) {result['wrong']}",
            file=sys.stderr,
        )
    return result


def report(args, stamps: dict, results: dict) -> dict:
    info = next((r for rs in results.values() for r in rs.get(CEILING, []) if "device" in r), {})
    status = next(
        (
            r["cuda_status"]
            for rs in results.values()
            for r in rs.get("stoker", [])
            if "cuda_status" in r
        ),
        None,
    )
    print(
        f"\nhost -> GPU, {info.get('device', 'GPU')}, torch {info.get('torch', '?')}, "
        f"{os.cpu_count()} cores, DataLoader workers: {workers()}; warm page cache; "
        f"median of {args.runs} runs, each in a fresh process, after one untimed epoch."
    )
    if status is not None:
        print(f"stoker.cuda_status(): {status}")
    headline, wrong_batches = {}, {}
    for config, stamp in stamps.items():
        shape, dtype = tuple(stamp["shape"]), stamp["dtype"]
        batch_mb = args.batch * (stamp["sample_bytes"] + 8) / 1e6
        print(
            f"\n{config}: {stamp['samples']} samples of {shape} {dtype} + an int64 label in "
            f"{len(stamp['shards'])} tar shards, batches of {args.batch} ({batch_mb:.1f} MB), "
            "shuffled"
        )
        print("| loader | batches/s | GB/s | of ceiling | x DataLoader pinned | 1st epoch (s) |")
        print("|---|---:|---:|---:|---:|---:|")
        names = list(results[config])
        rates = {}
        for name in names:
            good = [r for r in results[config].get(name, []) if "failed" not in r]
            if good:
                rates[name] = (
                    statistics.median(r["batches"] / r["seconds"] for r in good),
                    statistics.median(r["bytes"] / r["seconds"] / 1e9 for r in good),
                    statistics.median(r["first_epoch"] for r in good),
                    any(r["wrong"] for r in good),
                )
        ceiling = rates.get(CEILING, (None,))[0]
        pinned = rates.get(PINNED, (None,))[0]
        for name in names:
            if name not in rates:
                print(f"| {name} | failed | | | | |")
                continue
            rate, gbs, first, wrong = rates[name]
            of = f"{rate / ceiling:.0%}" if ceiling else "-"
            x = f"{rate / pinned:.2f}x" if pinned else "-"
            first_text = f"{first:.2f}" if name != CEILING else "-"
            flag = " (WRONG BATCHES)" if wrong else ""
            print(f"| {name}{flag} | {rate:,.1f} | {gbs:.2f} | {of} | {x} | {first_text} |")
        if "stoker" in rates and ceiling:
            headline[config] = rates["stoker"][0] / ceiling
            wrong_batches[config] = rates["stoker"][3]
    print()
    for config in stamps:
        target = f" (target {TARGET:.0%})" if config == "large" else ""
        if config in headline:
            flag = ", but its batches were WRONG" if wrong_batches[config] else ""
            print(f"stoker / ceiling ({config}): {headline[config]:.0%}{target}{flag}")
        else:
            print(f"stoker / ceiling ({config}): n/a (a measurement failed){target}")
    return headline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--samples",
        type=int,
        nargs="+",
        metavar="N",
        help="samples of the small and the large configuration (one number: both); "
        "default 40960 8192, --quick 16384 4096",
    )
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--runs", type=int, help="rounds (default 3, --quick 2)")
    parser.add_argument("--epochs", type=int, help="timed epochs at least (default 3, --quick 2)")
    parser.add_argument(
        "--min-seconds", type=float, help="timed seconds at least (default 1, --quick 0.5)"
    )
    parser.add_argument("--large-dtype", choices=["uint8", "float16"], default="uint8")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--only", nargs="*", help="substrings of the loader names to run")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per measurement")
    parser.add_argument("--json", help="write the raw results and the headline here")
    parser.add_argument("--data", default=os.path.join("bench-data", "h2d"))
    parser.add_argument("--quick", action="store_true", help="small sizes, 2 runs (gpu_check)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    samples = args.samples or ([16384, 4096] if args.quick else [40960, 8192])
    if len(samples) > 2 or min(samples) < 1 or args.batch < 1:
        parser.error("--samples takes one or two positive numbers; --batch must be positive")
    args.samples_of = {"small": samples[0], "large": samples[-1]}
    args.runs = args.runs or (2 if args.quick else 3)
    args.epochs = args.epochs or (2 if args.quick else 3)
    if args.min_seconds is None:
        args.min_seconds = 0.5 if args.quick else 1.0
    if args.child:
        child(args.child, args.config, args)
        return
    try:
        import torch
    except ImportError:
        print("h2d: skipped: torch is not installed")
        return
    if not torch.cuda.is_available():
        print("h2d: skipped: no CUDA device (torch.cuda.is_available() is False)")
        return
    stamps = {}
    for config in args.configs:
        dtype = args.large_dtype if config == "large" else "uint8"
        folder = os.path.join(args.data, folder_name(config, args))
        stamps[config] = prepare(folder, CONFIGS[config], dtype, args.samples_of[config])
        warm_page_cache(stamps[config]["shards"])
    names = [n for n in [*LOADERS, CEILING] if not args.only or any(o in n for o in args.only)]
    results: dict[str, dict[str, list[dict]]] = {c: {n: [] for n in names} for c in stamps}
    for _ in range(args.runs):
        for config in stamps:
            for name in names:
                results[config][name].append(measure(name, config, args))
    headline = report(args, stamps, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "stoker_of_ceiling": headline}, f, indent=1)


if __name__ == "__main__":
    main()
