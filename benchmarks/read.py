"""How fast ShardReader reads shuffled batches of small records, next to its ceilings.

    python benchmarks/read.py [--records 20000] [--record-bytes 12288] [--shards 20]

Makes (once, under --data) tar shards of fixed-size records, warms the page cache, then
measures in one run, the methods taking turns for --runs rounds (median of each, and
median of the per-round ratios to the ceilings):

- ShardReader.read: shuffled batches of 64, one call per batch, waiting on each;
- the same with 4 batches in flight (how the loader drives it);
- ShardReader.read over batches in file order (neighbours merged into one preadv);
- Dataset.get_batch: the same batches as lists of sample dicts (Python per sample);
- Loader(fields=) in the steady state: one shuffled epoch of a Loader made once, each
  record a Raw field, batches handed out as tensors;
- Loader(fields=), first epoch: stoker.Dataset over the shards' stoker.json and a fresh
  Loader, opened and read for one shuffled epoch, all of it timed;
- a Python os.pread loop over the same ranges, files kept open;
- ceiling 1: the bare C++ pread loop on --threads threads, no batching (bench_pread);
- ceiling 2: a sequential read of the whole shard files.

Prints records/s and the ratios to both ceilings.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import tarfile
import time
from collections.abc import Callable

import numpy as np

import stoker
from stoker import _core
from stoker.manifest import write_manifest
from stoker.tools.measure import read_through


def make_shards(folder: str, records: int, record_bytes: int, shards: int) -> list[str]:
    os.makedirs(folder, exist_ok=True)
    paths = [os.path.join(folder, f"shard-{s:06d}.tar") for s in range(shards)]
    stamp = os.path.join(folder, f".done-{records}-{record_bytes}-{shards}")
    if os.path.exists(stamp):
        return paths
    rng = np.random.default_rng(0)
    per_shard = -(-records // shards)
    for s, path in enumerate(paths):
        with tarfile.open(path + ".tmp", "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(s * per_shard, min(records, (s + 1) * per_shard)):
                info = tarfile.TarInfo(f"{i:08d}.bin")
                info.size = record_bytes
                tar.addfile(info, io.BytesIO(rng.bytes(record_bytes)))
        os.replace(path + ".tmp", path)
    write_manifest(paths, folder)  # with each shard's member index beside it
    open(stamp, "w").close()
    return paths


def interleaved_seconds(
    methods: dict[str, Callable[[], float | None]], runs: int
) -> dict[str, list[float]]:
    """Seconds per run of each method, the methods taking turns round by round, so
    that a shared machine's drift hits them alike. A method may return its own
    timing (to leave out set-up); otherwise the wall time of the call counts."""
    for fn in methods.values():
        fn()  # warm-up: page cache, threads, allocator
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(runs):
        for name, fn in methods.items():
            start = time.perf_counter()
            own = fn()
            times[name].append(own if own is not None else time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--record-bytes", type=int, default=12 * 1024)
    parser.add_argument("--shards", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--data", default=os.path.join("bench-data", "read"))
    args = parser.parse_args()

    paths = make_shards(args.data, args.records, args.record_bytes, args.shards)
    ds = stoker.Dataset(paths, num_threads=args.threads)
    n = len(ds)
    order = np.random.default_rng(1).permutation(n)
    batches = [order[i : i + args.batch_size] for i in range(0, n, args.batch_size)]
    reader = _core.ShardReader(args.threads)
    table = ds.members.files

    def read_plan(indices: np.ndarray) -> tuple:
        """The bare reader's arguments for samples `indices` (their members gathered once,
        before timing)."""
        with ds.indexed(indices):
            m = ds.gather(indices)
        dest = np.arange(len(m.offset), dtype=np.uint64) * np.uint64(args.record_bytes)
        return m.file, m.offset, m.length, dest, len(m.offset) * args.record_bytes

    plans = [read_plan(b) for b in batches]

    def shard_reader_sync() -> None:
        for f, o, ln, d, size in plans:
            reader.read(table, f, o, ln, d, size).wait()

    def shard_reader_pipelined(depth: int = 4) -> None:
        in_flight = []
        for f, o, ln, d, size in plans:
            in_flight.append(reader.read(table, f, o, ln, d, size))
            if len(in_flight) >= depth:
                in_flight.pop(0).wait()
        for pending in in_flight:
            pending.wait()

    in_order = [
        read_plan(np.arange(start, min(n, start + args.batch_size)))
        for start in range(0, n, args.batch_size)
    ]

    def shard_reader_in_order() -> None:
        for f, o, ln, d, size in in_order:
            reader.read(table, f, o, ln, d, size).wait()

    def dataset_get_batch() -> None:
        for b in batches:
            ds.get_batch(b)

    fds = [os.open(p, os.O_RDONLY) for p in paths]
    flat_files = np.concatenate([p[0] for p in plans]).tolist()
    flat_offsets = np.concatenate([p[1] for p in plans]).tolist()

    def python_pread() -> None:
        size = args.record_bytes
        for f, o in zip(flat_files, flat_offsets):
            os.pread(fds[f], size, o)

    all_files = np.concatenate([p[0] for p in plans])
    all_offsets = np.concatenate([p[1] for p in plans])
    all_lengths = np.concatenate([p[2] for p in plans])

    def bare_pread() -> float:  # its own timer leaves out opening the files
        return _core.bench_pread(table, all_files, all_offsets, all_lengths, args.threads)

    fields = {"bin": stoker.Raw((args.record_bytes,), "uint8")}
    # The Loaders take their default reader threads: one fewer than the cores, the
    # consumer's own thread reading too.
    steady = stoker.Loader(ds, args.batch_size, fields=fields)

    def loader_epoch(loader: stoker.Loader) -> None:
        got = 0
        for batch in loader:
            got += len(batch["bin"])
        assert got == n, got

    def loader_first_epoch() -> None:
        fresh = stoker.Dataset(os.path.join(args.data, "stoker.json"))
        loader_epoch(stoker.Loader(fresh, args.batch_size, fields=fields))

    bare_name, seq_name = "ceiling: bare C++ pread loop", "ceiling: sequential read of the shards"
    times = interleaved_seconds(
        {
            bare_name: bare_pread,
            seq_name: lambda: read_through(paths, chunk=1 << 20).seconds,
            "ShardReader.read, one batch at a time": shard_reader_sync,
            "ShardReader.read, 4 batches in flight": shard_reader_pipelined,
            "ShardReader.read, batches in file order": shard_reader_in_order,
            "Dataset.get_batch (dicts per sample)": dataset_get_batch,
            "Python os.pread loop, files open": python_pread,
            "Loader(fields=), steady state": lambda: loader_epoch(steady),
            "Loader(fields=), first epoch, open included": loader_first_epoch,
        },
        args.runs,
    )

    def median_ratio(name: str, ceiling: str) -> float:
        return statistics.median(c / t for t, c in zip(times[name], times[ceiling]))

    mb = args.record_bytes / 1e6
    print(
        f"{n} records of {args.record_bytes} bytes in {len(paths)} tar shards, shuffled "
        f"batches of {args.batch_size}, {args.threads} threads, warm page cache, "
        f"{args.runs} interleaved runs: median rate, median of per-run ratios"
    )
    print(f"{'':46} {'records/s':>11} {'MB/s':>8} {'/ bare pread':>13} {'/ sequential':>13}")
    for name, seconds in times.items():
        rate = n / statistics.median(seconds)
        print(
            f"{name:46} {rate:11,.0f} {rate * mb:8,.0f} "
            f"{median_ratio(name, bare_name):13.2f} {median_ratio(name, seq_name):13.2f}"
        )
    for fd in fds:
        os.close(fd)


if __name__ == "__main__":
    main()
