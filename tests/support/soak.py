"""One soak process: load a remote dataset epoch after epoch for a bounded time.

    python tests/support/soak.py MANIFEST_URL CACHE_DIR CACHE_LIMIT SECONDS SEED

Prints one JSON line per epoch: samples, distinct keys, exactly-once (bool), the process's
resident memory (bytes) and open descriptors at the epoch's end, and seconds taken.
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


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


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
        print(
            json.dumps(
                {
                    "epoch": epoch,
                    "samples": len(keys),
                    "distinct": len(set(keys)),
                    "exactly_once": len(keys) == len(set(keys)) == keys_expected,
                    "rss": rss_bytes(),
                    "fds": open_fds(),
                    "seconds": time.monotonic() - start,
                }
            ),
            flush=True,
        )
        epoch += 1


if __name__ == "__main__":
    main()
