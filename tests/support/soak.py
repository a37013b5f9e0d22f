"""One soak process: load a remote dataset epoch after epoch for a bounded time.

    python tests/support/soak.py MANIFEST_URL CACHE_DIR CACHE_LIMIT SECONDS SEED

Prints one JSON line per epoch: samples, distinct keys, exactly-once (bool), the process's
resident memory (bytes), its open descriptors at the epoch's end (sockets apart: the HTTP
connections kept alive come and go within the pool's bound, from 1 to
FetchOptions.connections), and seconds taken.
"""

from __future__ import annotations

import json
import os
import sys
import time

import stoker


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_descriptors() -> tuple[int, int]:
    """(sockets, every other descriptor) this process has open."""
    sockets = others = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # listdir's own descriptor, closed by now
            continue
        if target.startswith("socket:"):
            sockets += 1
        else:
            others += 1
    return sockets, others


def main() -> None:
    url, cache, limit, seconds, seed = sys.argv[1:6]
    ds = stoker.Dataset(url, cache_dir=cache, cache_limit=int(limit))
    keys_expected = len(ds)
    loader = stoker.Loader(
        ds, batch_size=32, seed=int(seed), shuffle_window=4, fields={"raw": stoker.Bytes()}
    )
    deadline = time.monotonic() + float(seconds)
    epoch = 0
    while epoch < 2 or time.monotonic() < deadline:  # two epochs, however slow, to compare
        start = time.monotonic()
        keys = [k for batch in loader for k in batch["__key__"]]
        sockets, fds = open_descriptors()
        print(
            json.dumps(
                {
                    "epoch": epoch,
                    "samples": len(keys),
                    "distinct": len(set(keys)),
                    "exactly_once": len(keys) == len(set(keys)) == keys_expected,
                    "rss": rss_bytes(),
                    "fds": fds,
                    "sockets": sockets,
                    "seconds": time.monotonic() - start,
                }
            ),
            flush=True,
        )
        epoch += 1


if __name__ == "__main__":
    main()
