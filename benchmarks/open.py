"""What opening remote tar shards without a manifest costs: bytes the server sends (as a
multiple of the dataset's size), requests, and seconds.

    python benchmarks/open.py [--members 2000] [--member-bytes 3000] [--json FILE]

Two datasets of small members, written by ``tarfile`` (one tar of ``--members`` samples;
12 tars of a twelfth as many each), served by the tests' server (``tests/support/server.py``)
in this process, once
taking range requests and once ignoring them (as ``python -m http.server`` does). For each,
with a fresh cache: opening the dataset; then a first epoch (every sample, in one batch);
then opening it again and reading every sample, as a later run on the node does; and, with
another fresh cache, two processes opening it and reading it at once. The server counts
every byte of every response body and every request.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time

import _tests_support  # noqa: F401  (tests.support, below)
import numpy as np

import stoker
from tests.support.server import ShardServer

_CHILD = """
import sys, numpy as np, stoker
ds = stoker.Dataset(sys.argv[2:], cache_dir=sys.argv[1])
ds.get_batch(np.arange(len(ds)))
"""


def write_tars(folder: str, shards: int, members: int, member_bytes: int) -> int:
    """`shards` tars of `members` samples each (a payload and a label); their total bytes."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    for s in range(shards):
        with tarfile.open(os.path.join(folder, f"shard-{s:03d}.tar"), "w") as tar:
            for m in range(members):
                for ext, size in (("bin", member_bytes), ("cls", 2)):
                    info = tarfile.TarInfo(f"s{s:03d}-{m:05d}.{ext}")
                    info.size = size
                    tar.addfile(info, io.BytesIO(rng.integers(0, 256, size, np.uint8).tobytes()))
    return sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))


def measure(folder: str, shards: int, size: int, ranges: bool) -> dict:
    with ShardServer(folder, ranges=ranges) as server:
        urls = [f"{server.url}/shard-{s:03d}.tar" for s in range(shards)]
        cache = tempfile.mkdtemp(prefix="stoker-open-")
        out = {}

        def step(name: str, work) -> None:
            server.reset_counters()
            start = time.perf_counter()
            work()
            out[name] = {
                "x": server.bytes_sent / size,
                "requests": len(server.requests),
                "s": time.perf_counter() - start,
            }

        ds = None

        def open_it() -> None:
            nonlocal ds
            ds = stoker.Dataset(urls, cache_dir=cache)

        step("open", open_it)
        step("first epoch", lambda: ds.get_batch(np.arange(len(ds))))

        def again() -> None:
            open_it()
            ds.get_batch(np.arange(len(ds)))

        step("re-open + epoch", again)

        def two() -> None:
            both = tempfile.mkdtemp(prefix="stoker-open-")
            children = [
                subprocess.Popen([sys.executable, "-c", _CHILD, both, *urls]) for _ in range(2)
            ]
            for child in children:
                if child.wait() != 0:
                    raise SystemExit("a child failed")

        step("2 processes at once", two)
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--members", type=int, default=2000, help="samples in all")
    parser.add_argument("--member-bytes", type=int, default=3000)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="stoker-open-data-")
    rows, results = [], {}
    for shards in (1, 12):
        folder = os.path.join(root, f"{shards}")
        size = write_tars(folder, shards, args.members // shards, args.member_bytes)
        for ranges in (True, False):
            found = measure(folder, shards, size, ranges)
            server = "takes ranges" if ranges else "ignores ranges"
            results[f"{shards} tar(s), {server}"] = found
            cells = [f"{v['x']:.3f}x, {v['requests']} req, {v['s']:.2f} s" for v in found.values()]
            rows.append(
                f"| {shards} tar(s), {size / 1e6:.1f} MB | {server} | " + " | ".join(cells) + " |"
            )
    print(f"stoker {stoker.__version__}: members of {args.member_bytes} bytes, no manifest")
    print("| dataset | server | open | first epoch | re-open + epoch | 2 processes at once |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
