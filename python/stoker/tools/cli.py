"""The ``stoker`` command line: demo, pack, index, inspect, fetch, bench."""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import stoker
from stoker.errors import human

_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([KMGTkmgt])(iB|B)?|(B))?\s*")
_SIZE_RULE = (
    "write bytes (5000000), or a number and a unit: K, M, G, T or KiB, MiB, GiB, TiB "
    "(powers of 1024), kB, MB, GB, TB (powers of 1000); a lower-case b would mean bits"
)


def parse_size(text: str) -> int:
    """Bytes from a size on the command line, as GNU dd and coreutils read sizes: ``500M``
    and ``500MiB`` are powers of 1024, ``500MB`` powers of 1000 (as stoker prints sizes),
    plain numbers bytes; the prefix letter may be lower-case. Anything else (``8Mb``,
    ``8 megs``) is refused rather than guessed."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: {_SIZE_RULE}")
    number, prefix, suffix, _ = match.groups()
    power = "KMGT".index(prefix.upper()) + 1 if prefix else 0
    base = 1000 if suffix == "B" else 1024
    size = float(number) * base**power
    if size != int(size):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of bytes")
    return int(size)


def _count(text: str) -> int:
    """A thread count: 0 (one per core) or more."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not 0 (one per core) or a positive count")
    return value


def _quiet(args: argparse.Namespace) -> bool:
    return args.quiet or not sys.stderr.isatty()


# -- commands ----------------------------------------------------------------------------


def _demo(args: argparse.Namespace) -> int:
    from stoker.tools import demo

    return demo.run(args.samples, quiet=args.quiet, keep=args.keep)


def _pack(args: argparse.Namespace) -> int:
    from stoker.tools import pack

    ds, classes = pack.open_input(args.source, args.csv, args.root)
    result = pack.pack(
        ds,
        args.out,
        shard_size=args.shard_size,
        samples_per_shard=args.samples_per_shard,
        shuffle=args.shuffle,
        seed=args.seed,
        stratify=args.stratify,
        classes=classes,
        num_threads=args.threads,
        quiet=_quiet(args),
        image_size=args.image_size,
        image_quality=args.quality,
        ray=args.ray,
        fetch=_fetch_options(args),
    )
    print(
        f"packed {result.samples:,} samples into {len(result.shards)} shard(s), "
        f"{human(result.bytes)}, in {result.folder} (manifest: stoker.json)"
    )
    return 0


def _index(args: argparse.Namespace) -> int:
    from stoker.tools import inspect

    remote = [s for s in args.source if stoker.formats.is_url(s)]
    if remote:
        if len(remote) != len(args.source):
            raise stoker.UsageError("stoker index: give either local shards or URLs, not both")
        written, entries, folder = inspect.index_remote(
            remote,
            args.out,
            cache_dir=args.cache_dir,
            cache_limit=args.cache_limit,
            fetch=_fetch_options(args),
            ray=args.ray,
            quiet=_quiet(args),
        )
    elif args.ray:
        raise stoker.UsageError("stoker index --ray: for remote shards (local ones: without it)")
    elif len(args.source) > 1:
        raise stoker.UsageError("stoker index: one local source (a folder, glob or pattern)")
    else:
        written, entries = inspect.index(args.source[0], args.out, args.threads)
    samples = sum(e["samples"] for e in entries)
    size = sum(e["bytes"] for e in entries)
    print(
        f"wrote {written}: {len(entries)} shard(s), {samples:,} samples, "
        f"{human(size)}, sha256 of each"
    )
    if remote:
        print(f"put it beside the shards ({folder}): opening them then reads it, and nothing else")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from stoker.tools import inspect

    if stoker.formats.is_url(args.source):
        ds = stoker.Dataset(args.source, fetch=_fetch_options(args))
        print(f"{len(ds.shards)} remote shard(s), {len(ds):,} samples, fields: {ds.fields}")
        return 0
    notes = inspect.manifest_notes(args.source)  # a manifest's missing shards are said there
    shards = inspect.local_shards(args.source, allow_missing=bool(notes))
    formats = inspect.shard_formats(args.source)
    reports = inspect.inspect_shards(shards, args.threads, [formats.get(p) for p in shards])
    notes += inspect.manifest_mismatches(args.source, reports)
    print(inspect.format_inspection(args.source, reports, notes))
    return 1 if any(r.error for r in reports) else 0


def _fetch(args: argparse.Namespace) -> int:
    from stoker.tools.progress import progress_bar

    options = _fetch_options(args, connections=args.connections)
    ds = stoker.Dataset(
        args.source, cache_dir=args.cache_dir, cache_limit=args.cache_limit, fetch=options
    )
    remote = ds.remote
    if remote is None:
        print("stoker fetch: every shard of this source is local already; nothing to fetch")
        return 0
    sizes = [shard.size or 0 for shard in remote.shards]
    count = len(sizes)
    while count and sum(sizes[:count]) > remote.limit:
        count -= 1
    if count < len(sizes):
        print(
            f"stoker fetch: the cache limit ({human(remote.limit)}) holds the first {count} of "
            f"{len(sizes)} shards ({human(sum(sizes))}); fetching those",
            file=sys.stderr,
        )
    with progress_bar(
        total=sum(sizes[:count]), unit="B", unit_scale=True, disable=_quiet(args), desc="fetch"
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
    print(f"{count} shard(s), {human(sum(sizes[:count]))}, in {remote.cache.root}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from stoker.tools import bench

    return bench.run(args)


def _ray_argument(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--ray",
        nargs="?",
        const=True,
        default=False,
        metavar="ADDRESS",
        help=f"{what} on a Ray cluster: the one at ADDRESS ('auto': the one this machine is "
        "in), else the one RAY_ADDRESS names, else a new local one",
    )


def _fetch_options(args: argparse.Namespace, **more: object) -> stoker.FetchOptions:
    """FetchOptions from the object-store arguments (see _store_arguments)."""
    return stoker.FetchOptions(
        endpoint_url=args.endpoint_url,
        region=args.region,
        profile=args.profile,
        unsigned=args.unsigned,
        requester_pays=args.requester_pays,
        **more,  # type: ignore[arg-type]
    )


# -- the parser --------------------------------------------------------------------------


def _store_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("s3:// and gs:// stores (see the README, Object stores)")
    group.add_argument(
        "--endpoint-url",
        help="the s3:// store (default: $AWS_ENDPOINT_URL_S3, $AWS_ENDPOINT_URL, "
        "$S3_ENDPOINT_URL, else AWS)",
    )
    group.add_argument("--region", help="default: $AWS_REGION, $AWS_DEFAULT_REGION, the profile's")
    group.add_argument("--profile", help="the credentials' profile (default: $AWS_PROFILE)")
    group.add_argument("--unsigned", action="store_true", help="no credentials: a public bucket")
    group.add_argument("--requester-pays", action="store_true", help="a requester-pays bucket")


def _command(
    commands: argparse._SubParsersAction, name: str, help: str, example: str, quiet: bool = False
) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        name,
        help=help,
        description=help[0].upper() + help[1:] + ".",
        epilog=f"example:\n  {example}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens")
    if quiet:  # commands that show a progress bar
        parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stoker",
        description="stoker keeps GPUs fed: a C++ data loader for PyTorch.",
        epilog="examples:\n  stoker demo\n  stoker inspect 'data/shard-{000000..000009}.tar'\n"
        "  stoker COMMAND --help",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"stoker {stoker.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = _command(
        commands,
        "demo",
        "make a small dataset, serve it over HTTP on 127.0.0.1 and load it, next to a DataLoader",
        "stoker demo --samples 5000",
        quiet=True,
    )
    demo.add_argument("--samples", type=int, default=10_000, help="dataset size")
    demo.add_argument("--keep", metavar="DIR", help="work in DIR (new) and keep it")
    demo.set_defaults(run=_demo)

    pack = _command(
        commands,
        "pack",
        "write tar shards (WebDataset convention) and a stoker.json from a CSV + folder, "
        "a class-per-folder tree, Parquet or Arrow tables, or any stoker source",
        "stoker pack --csv labels_train.csv --root labels_train/ shards/ --shuffle --stratify",
        quiet=True,
    )
    pack.add_argument(
        "source",
        nargs="?",
        help="a class-per-folder tree or a stoker source: shards, Parquet files (a folder, "
        "glob), a datasets save_to_disk folder",
    )
    pack.add_argument(
        "out", help="the output folder (new or empty), or an s3:// or gs:// prefix (empty)"
    )
    pack.add_argument("--csv", help="a CSV of filename,label rows, beside --root")
    pack.add_argument("--root", help="the folder the CSV's file names are in")
    size = pack.add_mutually_exclusive_group()
    size.add_argument("--shard-size", type=parse_size, help="bytes per shard (default 256M)")
    size.add_argument("--samples-per-shard", type=int, help="samples per shard")
    pack.add_argument("--shuffle", action="store_true", help="shuffle the samples first")
    pack.add_argument("--seed", type=int, default=0, help="the shuffle's seed")
    pack.add_argument(
        "--stratify", action="store_true", help="spread each label evenly over the shards"
    )
    pack.add_argument("--threads", type=_count, default=0, help="shards written at once")
    pack.add_argument(
        "--image-size",
        type=int,
        metavar="S",
        help="re-encode JPEGs so that their shorter side is at most S pixels",
    )
    pack.add_argument(
        "--quality", type=int, default=90, help="JPEG quality of --image-size (default 90)"
    )
    _store_arguments(pack)
    _ray_argument(pack, "write each shard as a Ray task (OUT: a folder all nodes see, or a prefix)")
    pack.set_defaults(run=_pack)

    index = _command(
        commands,
        "index",
        "write stoker.json (samples, fields, sha256 of each shard) for existing shards",
        "stoker index data/\n  stoker index 's3://bucket/set/shard-{000000..000099}.tar'",
        quiet=True,
    )
    index.add_argument(
        "source",
        nargs="+",
        help="local shards (a folder, glob, brace pattern or file), or remote ones: URLs, "
        "a brace pattern of URLs, an s3:// or gs:// prefix",
    )
    index.add_argument(
        "--out",
        help="where to write it (default: the shards' folder; ./stoker.json for remote ones)",
    )
    index.add_argument("--cache-dir", help="remote shards: the cache they are fetched through")
    index.add_argument("--cache-limit", type=parse_size, help="remote shards: the cache's limit")
    index.add_argument("--threads", type=_count, default=0, help="local shards read at once")
    _store_arguments(index)
    _ray_argument(index, "remote shards: fetch, index and hash each as a Ray task")
    index.set_defaults(run=_index)

    inspect = _command(
        commands,
        "inspect",
        "show a source's shards, samples, fields and their sizes, and anything malformed",
        "stoker inspect data/",
    )
    inspect.add_argument(
        "source",
        help="a folder, glob, brace pattern, shard, Parquet or Arrow file, or stoker.json",
    )
    inspect.add_argument("--threads", type=_count, default=0, help="shards read at once")
    _store_arguments(inspect)
    inspect.set_defaults(run=_inspect)

    fetch = _command(
        commands,
        "fetch",
        "download a remote source's shards into a cache ahead of training",
        "stoker fetch http://host/data/stoker.json --cache-dir /local/cache --cache-limit 200G",
        quiet=True,
    )
    fetch.add_argument(
        "source", help="remote shards: a stoker.json, brace pattern or shard URL, an s3:// prefix"
    )
    fetch.add_argument("--cache-dir", help="the cache (default: $STOKER_CACHE or ~/.cache/stoker)")
    fetch.add_argument("--cache-limit", type=parse_size, help="bytes the cache may hold, e.g. 200G")
    fetch.add_argument("--connections", type=int, default=16, help="downloads at once")
    _store_arguments(fetch)
    fetch.set_defaults(run=_fetch)

    bench = _command(
        commands,
        "bench",
        "measure the loader on your data against a sequential read and a DataLoader, "
        "over a grid of num_threads and batch_size",
        "stoker bench data/ --threads 1,2,4 --batch-sizes 32,128 --plot bench.png",
    )
    from stoker.tools import bench as bench_module

    bench_module.add_arguments(bench)
    bench.set_defaults(run=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    for stream in (sys.stdout, sys.stderr):  # names from shards need not be UTF-8
        with contextlib.suppress(AttributeError, ValueError):
            # TextIO has no reconfigure; a replaced stream may lack it (AttributeError).
            stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
    logging.basicConfig(
        format="%(name)s: %(message)s",
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
    )
    try:
        return args.run(args)
    except (stoker.StokerError, OSError) as error:
        # A user's mistake (a bad path, a corrupt shard) is one line, not a traceback.
        print(f"stoker: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stoker: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
