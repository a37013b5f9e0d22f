"""The ``stoker`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import stoker


def _inspect(args: argparse.Namespace) -> int:
    ds = stoker.Dataset(args.source)
    print(f"{len(ds.shards)} file(s), {len(ds)} samples, fields: {', '.join(ds.fields)}")
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
