"""The ``stoker`` command line."""

from __future__ import annotations

import argparse
import re
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import stoker


def _inspect(args: argparse.Namespace) -> int:
    ds = stoker.Dataset(args.source)
    print(f"{len(ds.shards)} file(s), {len(ds)} samples, fields: {', '.join(ds.fields)}")
    return 0


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from ``123``, ``500M``, ``20G`` or ``1.5T`` (binary units; a trailing B or iB
    is allowed)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 500M or 20G")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def _fetch(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    options = stoker.FetchOptions(connections=args.connections)
    ds = stoker.Dataset(
        args.source, cache_dir=args.cache_dir, cache_limit=args.cache_limit, fetch=options
    )
    remote = ds._remote
    if remote is None:
        print("stoker fetch: every shard of this source is local already; nothing to fetch")
        return 0
    cache = remote.cache
    sizes = [shard.size or 0 for shard in remote.shards]
    count = len(sizes)
    while count and sum(sizes[:count]) > remote.limit:
        count -= 1
    if count < len(sizes):
        print(
            f"stoker fetch: the cache limit ({remote.limit} bytes) holds the first {count} of "
            f"{len(sizes)} shards ({sum(sizes)} bytes); fetching those",
            file=sys.stderr,
        )
    quiet = args.quiet or not sys.stderr.isatty()
    with tqdm(
        total=sum(sizes[:count]), unit="B", unit_scale=True, disable=quiet, desc="fetch"
    ) as bar:
        lock = threading.Lock()

        def one(i: int) -> None:
            got = 0

            def progress(n: int) -> None:
                nonlocal got
                got += n
                with lock:
                    bar.update(n)

            remote.acquire(i, progress)
            remote.release(i)
            with lock:  # a shard cached already, or fetched by another process, is done too
                bar.update(sizes[i] - got)

        with ThreadPoolExecutor(args.connections) as pool:
            for future in [pool.submit(one, i) for i in range(count)]:
                future.result()
    print(f"{count} shard(s), {sum(sizes[:count])} bytes, in {cache.root}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stoker",
        description="stoker keeps GPUs fed: a C++ data loader for PyTorch.",
        epilog="example: stoker inspect 'data/shard-{000000..000009}.tar'",
    )
    parser.add_argument("--version", action="version", version=f"stoker {stoker.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    inspect = commands.add_parser(
        "inspect",
        help="count the shards, samples and fields of a source",
        epilog="example: stoker inspect data/",
    )
    inspect.add_argument("source", help="a folder, glob, brace pattern, shard or stoker.json")
    inspect.set_defaults(run=_inspect)
    fetch = commands.add_parser(
        "fetch",
        help="download a remote source's shards into a cache ahead of training",
        epilog="example: stoker fetch http://host/data/stoker.json --cache-dir /local/cache "
        "--cache-limit 200G",
    )
    fetch.add_argument("source", help="http(s) URLs: a stoker.json, a brace pattern or a shard")
    fetch.add_argument("--cache-dir", help="the cache (default: $STOKER_CACHE or ~/.cache/stoker)")
    fetch.add_argument("--cache-limit", type=parse_size, help="bytes the cache may hold, e.g. 200G")
    fetch.add_argument("--connections", type=int, default=16, help="downloads at once")
    fetch.add_argument("--quiet", action="store_true", help="no progress bar")
    fetch.set_defaults(run=_fetch)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.run(args)
    except (stoker.StokerError, OSError) as error:
        # A user's mistake (a bad path, a corrupt shard) is one line, not a traceback.
        print(f"stoker: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
