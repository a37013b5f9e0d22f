"""Batches onto the GPU: stoker.Loader(device="cuda") against torch's DataLoader with pinned
memory and non-blocking copies, the plain DataLoader with .cuda(), and a bare pinned copy.

    python benchmarks/h2d.py [--samples SMALL [LARGE]] [--batch 256] [--runs 3] [--epochs 3]
                             [--min-seconds 1] [--large-dtype uint8] [--data DIR]
                             [--timeout SECONDS] [--budget SECONDS] [--quick]

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
  each batch moved with ``.to("cuda", non_blocking=True)`` (the usual recipe);
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
--runs rounds and the tables show medians.

The headline goes first: the large configuration before the small one, and in each, stoker
and the ceiling before the two DataLoaders. Each measurement's result is printed the moment
it finishes; one that runs past --timeout seconds is killed (with its workers) and reported
as timed out; with --budget, no measurement starts or runs past that many seconds from the
start; on SIGTERM or Ctrl-C the running one is killed. In every case the tables are printed
from whatever finished. --quick (what scripts/gpu_check.sh runs): one round, 2048 large and
8192 small samples. Without a usable CUDA device the benchmark says so and exits with
status 0.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import statistics
import sys
import tarfile
import time

import _runner
import numpy as np
import peers
from _runner import say

from stoker.tools.measure import read_through

CONFIGS = {"large": (3, 224, 224), "small": (3, 64, 64)}  # the headline (large) first
SHARDS = 16
CHECK_BYTES = 64  # of each image, summed on the GPU by every consumer
CEILING = "ceiling: bare pinned copy"
PINNED = "DataLoader, pin_memory + non_blocking"
# in the order they run: the headline's two (stoker against the ceiling) first
NAMES = ["stoker", CEILING, PINNED, "DataLoader, plain + .cuda()"]
TARGET = 0.90  # stoker's share of the ceiling on large batches


def workers() -> int:
    return min(8, os.cpu_count() or 1)


# -- data ---------------------------------------------------------------------


def prepare(folder: str, shape: tuple[int, ...], dtype: str, n: int) -> dict:
    """Write the shards unless a stamp says they are there; returns the stamp (the files,
    one sample's bytes and the checksums a full epoch must give)."""
    stamp_path = os.path.join(folder, "stamp.json")
    want = {"samples": n, "shape": list(shape), "dtype": dtype}
    stamp = _runner.stamp_if_current(stamp_path, want)
    if stamp is not None:
        return stamp
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
        peers.TarNpySamples(stamp["shards"]),
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


def measure(name: str, config: str, args, slot: _runner.Slot, sink: list[dict]) -> dict:
    """One measurement in a fresh process (its own process group, so its DataLoader workers
    die with it), killed when `slot` runs out. Its result goes into `sink` (at once, marked
    as stopped, so a run stopped meanwhile shows it) and is returned."""
    command = [sys.executable, __file__, "--child", name, "--config", config]
    command += ["--data", args.data, "--batch", str(args.batch)]
    command += ["--samples", str(args.samples_of["small"]), str(args.samples_of["large"])]
    command += ["--epochs", str(args.epochs), "--min-seconds", repr(args.min_seconds)]
    command += ["--large-dtype", args.large_dtype]
    result = {"failed": "stopped while running"}
    sink.append(result)
    done = _runner.run_child(command, slot)
    if done.failed is not None:
        got = {"failed": done.failed, "stderr": done.stderr}
    elif done.result is None:  # the child's last line is its result
        got = {"failed": "no result", "stderr": ("\n".join(done.lines) + done.stderr)[-3000:]}
    else:
        got = done.result
    result.clear()
    result.update(got)
    return result


def result_line(config: str, name: str, r: dict, took: float) -> str:
    where = f"[{config}] {name}:"
    if "failed" in r:
        tail = r.get("stderr", "").strip()
        tail = f"\n{tail}" if tail and not r["failed"].startswith("not run") else ""
        return f"{where} {r['failed']} ({took:.0f} s){tail}"
    rate = r["batches"] / r["seconds"]
    gbs = r["bytes"] / r["seconds"] / 1e9
    first = f", 1st epoch {r['first_epoch']:.2f} s" if name != CEILING else ""
    check = f"WRONG checksums (image bytes, labels) {r['wrong']}" if r["wrong"] else "exact"
    return (
        f"{where} {rate:,.1f} batches/s, {gbs:.2f} GB/s ({r['epochs']} epochs in "
        f"{r['seconds']:.2f} s{first}); batches {check} ({took:.0f} s)"
    )


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
    say(
        f"\nhost -> GPU, {info.get('device', 'GPU')}, torch {info.get('torch', '?')}, "
        f"{os.cpu_count()} cores, DataLoader workers: {workers()}; warm page cache; "
        f"median of up to {args.runs} run(s), each in a fresh process, after one untimed "
        "epoch."
    )
    if status is not None:
        say(f"stoker.cuda_status(): {status}")
    headline, wrong_batches = {}, {}
    for config in results:
        stamp = stamps.get(config)
        if stamp is None:
            say(f"\n{config}: not run (its data was not written)")
            continue
        shape, dtype = tuple(stamp["shape"]), stamp["dtype"]
        batch_mb = args.batch * (stamp["sample_bytes"] + 8) / 1e6
        say(
            f"\n{config}: {stamp['samples']} samples of {shape} {dtype} + an int64 label in "
            f"{len(stamp['shards'])} tar shards, batches of {args.batch} ({batch_mb:.1f} MB), "
            "shuffled"
        )
        say(
            "| loader | batches/s | GB/s | of ceiling | x DataLoader pinned | 1st epoch (s) "
            "| runs |"
        )
        say("|---|---:|---:|---:|---:|---:|---:|")
        names = list(results[config])
        rates = {}
        for name in names:
            good = [r for r in results[config][name] if "failed" not in r]
            if good:
                rates[name] = (
                    statistics.median(r["batches"] / r["seconds"] for r in good),
                    statistics.median(r["bytes"] / r["seconds"] / 1e9 for r in good),
                    statistics.median(r["first_epoch"] for r in good),
                    any(r["wrong"] for r in good),
                    len(good),
                )
        ceiling = rates.get(CEILING, (None,))[0]
        pinned = rates.get(PINNED, (None,))[0]
        for name in names:
            if name not in rates:
                why = sorted({r["failed"] for r in results[config][name]}) or ["not run"]
                say(f"| {name} | {'; '.join(why)} | | | | | 0 |")
                continue
            rate, gbs, first, wrong, runs = rates[name]
            of = f"{rate / ceiling:.0%}" if ceiling else "-"
            x = f"{rate / pinned:.2f}x" if pinned else "-"
            first_text = f"{first:.2f}" if name != CEILING else "-"
            flag = " (WRONG BATCHES)" if wrong else ""
            say(f"| {name}{flag} | {rate:,.1f} | {gbs:.2f} | {of} | {x} | {first_text} | {runs} |")
        if "stoker" in rates and ceiling:
            headline[config] = rates["stoker"][0] / ceiling
            wrong_batches[config] = rates["stoker"][3]
    say()
    for config in results:
        target = f" (target {TARGET:.0%})" if config == "large" else ""
        if config in headline:
            flag = ", but its batches were WRONG" if wrong_batches[config] else ""
            say(f"stoker / ceiling ({config}): {headline[config]:.0%}{target}{flag}")
        else:
            missing = [
                f"{n}: {'; '.join(sorted({r['failed'] for r in results[config].get(n, [])}))}"
                if results[config].get(n)
                else f"{n}: not run"
                for n in ("stoker", CEILING)
                if not any("failed" not in r for r in results[config].get(n, []))
            ]
            say(f"stoker / ceiling ({config}): n/a ({', '.join(missing)}){target}")
    return headline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--samples",
        type=int,
        nargs="+",
        metavar="N",
        help="samples of the small and the large configuration (one number: both); "
        "default 40960 8192, --quick 8192 2048",
    )
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--runs", type=int, help="rounds (default 3, --quick 1)")
    parser.add_argument("--epochs", type=int, help="timed epochs at least (default 3, --quick 2)")
    parser.add_argument(
        "--min-seconds", type=float, help="timed seconds at least (default 1, --quick 0.5)"
    )
    parser.add_argument("--large-dtype", choices=["uint8", "float16"], default="uint8")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--only", nargs="*", help="substrings of the loader names to run")
    _runner.add_arguments(
        parser,
        timeout=600,
        timeout_help="seconds per measurement (its process is killed and it is reported as "
        "timed out)",
        measured="measurements",
        json_help="write the raw results and the headline here",
    )
    parser.add_argument("--data", default=os.path.join("bench-data", "h2d"))
    parser.add_argument(
        "--quick", action="store_true", help="one round of fewer samples (gpu_check)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    limits = _runner.Limits(parser, args)
    samples = args.samples or ([8192, 2048] if args.quick else [40960, 8192])
    if len(samples) > 2 or min(samples) < 1 or args.batch < 1:
        parser.error("--samples takes one or two positive numbers; --batch must be positive")
    args.samples_of = {"small": samples[0], "large": samples[-1]}
    args.runs = args.runs or (1 if args.quick else 3)
    args.epochs = args.epochs or (2 if args.quick else 3)
    if args.min_seconds is None:
        args.min_seconds = 0.5 if args.quick else 1.0
    if args.child:
        child(args.child, args.config, args)
        return
    missing = _runner.why_no_cuda()
    if missing:
        say(f"h2d: skipped: {missing}")
        return
    configs = [c for c in CONFIGS if c in args.configs]  # the headline's config first
    names = [n for n in NAMES if not args.only or any(o in n for o in args.only)]
    stamps: dict[str, dict] = {}
    results: dict[str, dict[str, list[dict]]] = {c: {n: [] for n in names} for c in configs}
    with _runner.Interruptible("h2d") as measuring:
        for run in range(args.runs):
            for config in configs:
                if config not in stamps:
                    limits.require(15)  # writing the data takes a while
                    dtype = args.large_dtype if config == "large" else "uint8"
                    folder = os.path.join(args.data, folder_name(config, args))
                    t0 = time.monotonic()
                    stamps[config] = prepare(
                        folder, CONFIGS[config], dtype, args.samples_of[config]
                    )
                    read_through(stamps[config]["shards"])
                    say(f"[{config}] data ready in {folder} ({time.monotonic() - t0:.0f} s)")
                for name in names:
                    slot = limits.next_slot()
                    t0 = time.monotonic()
                    r = measure(name, config, args, slot, results[config][name])
                    line = result_line(config, name, r, time.monotonic() - t0)
                    done = {
                        n: results[config][n][-1]
                        for n in ("stoker", CEILING)
                        if len(results[config].get(n, [])) > run
                    }
                    if (
                        name in done
                        and len(done) == 2
                        and all("failed" not in v for v in done.values())
                    ):
                        ratio = (done["stoker"]["batches"] / done["stoker"]["seconds"]) / (
                            done[CEILING]["batches"] / done[CEILING]["seconds"]
                        )
                        line += f"; stoker / ceiling, this run: {ratio:.0%}"
                    say(f"run {run + 1}/{args.runs} {line}")
    headline = report(args, stamps, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"results": results, "stoker_of_ceiling": headline, "stopped": measuring.stopped},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
