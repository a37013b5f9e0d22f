"""``stoker bench SOURCE``: how fast stoker reads the user's own data on this machine.

One run measures, on the same files: a plain sequential read (what the disk and page cache
give at best), stoker's Loader over a small grid of ``num_threads`` and ``batch_size``, and
``torch.utils.data.DataLoader`` over the same Dataset, so the numbers answer "which settings,
and how much faster than what I would otherwise use" without any benchmark of our own data.

Every row reads about the same amount (``--samples`` samples, or their bytes for the
sequential read) and is timed from the loader's creation to its last batch, so a row's
samples/s includes its start-up; the first-batch column shows that start-up alone. The page
cache is left as it is: the first row to touch a file may read it from disk.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import stoker
from stoker._process import usable_cores
from stoker.errors import StokerError
from stoker.formats import is_url
from stoker.tools.measure import read_through

logger = logging.getLogger("stoker.bench")

CHUNK = 1 << 20  # sequential reads, 1 MiB at a time
_WARMUP_BATCHES = 3
_CLOSE_ENOUGH = 0.95  # fewer threads win when they reach this share of the fastest's rate
_DATALOADER_BATCH = 64  # the batch size the DataLoader rows use when it is in the grid


@dataclass
class Row:
    """One measured configuration."""

    kind: str  # "sequential", "stoker" or "DataLoader"
    samples: float  # samples read (for the sequential read: the equivalent in samples)
    nbytes: int
    seconds: float
    first_s: float  # time to the first batch (to the first chunk, for the sequential read)
    threads: int | None = None
    workers: int | None = None
    batch_size: int | None = None

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("inf")

    @property
    def mb_per_s(self) -> float:
        return self.nbytes / 1e6 / self.seconds if self.seconds > 0 else float("inf")

    @property
    def label(self) -> str:
        if self.kind == "sequential":
            return "sequential read"
        if self.kind == "stoker":
            return f"stoker threads={self.threads} batch={self.batch_size}"
        return f"DataLoader workers={self.workers} batch={self.batch_size}"


# -- arguments ------------------------------------------------------------------


def default_threads(cores: int | None = None) -> list[int]:
    """1, 2 and 4 where the machine has them, and the core count: more threads than cores
    only contend with each other and with the training loop."""
    cores = cores or usable_cores()
    return sorted({t for t in (1, 2, 4) if t <= cores} | {cores})


def _int_list(minimum: int) -> Callable[[str], list[int]]:
    def parse(text: str) -> list[int]:
        try:
            values = [int(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a comma-separated list of integers, like 1,2,4"
            ) from None
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(
                f"{text!r}: give integers of at least {minimum}, separated by commas"
            )
        return sorted(set(values))

    return parse


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench's options on `parser` (the CLI's ``bench`` subcommand, or a parser of one's
    own): the grid is small by default so a run takes seconds, not minutes."""
    threads = ",".join(map(str, default_threads()))
    parser.add_argument("source", help="a folder, glob, brace pattern, shard or stoker.json")
    parser.add_argument(
        "--threads",
        type=_int_list(1),
        default=threads,
        help=f"num_threads values to try, comma-separated (default: {threads} on this machine)",
    )
    parser.add_argument(
        "--batch-sizes",
        type=_int_list(1),
        default="16,64,256",
        help="batch sizes to try, comma-separated (default: 16,64,256)",
    )
    parser.add_argument(
        "--samples",
        type=_positive,
        default=20000,
        help="samples read per measurement, at most (default: 20000, or the whole dataset "
        "when it is smaller)",
    )
    parser.add_argument(
        "--dataloader-workers",
        type=_int_list(0),
        default="0,2",
        help="num_workers of the torch DataLoader rows, comma-separated (default: 0,2)",
    )
    parser.add_argument(
        "--plot", metavar="FILE.png", help="draw samples/s against num_threads (matplotlib)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


# -- measurements ---------------------------------------------------------------


def _shard_bytes(ds: stoker.Dataset) -> list[int]:
    """Each shard's size in bytes (a remote one's as its manifest or server gave it)."""
    holds = ds.holds
    return [
        holds.size_of(i) if holds is not None and holds.is_remote[i] else os.path.getsize(path)
        for i, path in enumerate(ds.shards)
    ]


def _complete_fields(ds: stoker.Dataset) -> tuple[list[str], list[str]]:
    """The fields every sample has, and the others: a Loader's fields= needs each named
    field in every sample of a batch, and a bench should not fail on optional fields."""
    if ds.holds is not None:  # members of shards not yet fetched are not known
        return list(ds.fields), []
    complete: list[str] = []
    partial: list[str] = []
    for name in ds.fields:
        (complete if ds.has_field_everywhere(name) else partial).append(name)
    return complete, partial


def sequential_read(paths: Sequence[str], budget: int) -> tuple[int, float, float]:
    """Bytes read, seconds and seconds to the first chunk for a front-to-back read of
    `paths`, stopping after `budget` bytes."""
    try:
        read = read_through(paths, chunk=CHUNK, limit=budget)
    except OSError as e:
        raise StokerError(f"{e.filename}: cannot read it for the sequential read: {e}") from e
    return read.nbytes, read.seconds, read.first_s


def timed(
    make: Callable[[], Iterable[Any]], count: Callable[[Any], tuple[int, int]], limit: int
) -> tuple[int, int, float, float]:
    """Samples, bytes, seconds and seconds to the first batch of iterating what `make`
    builds (its building timed too) until `limit` samples have come."""
    samples = nbytes = 0
    first = None
    start = time.perf_counter()
    iterator = iter(make())
    for batch in iterator:
        n, b = count(batch)
        samples += n
        nbytes += b
        if first is None:
            first = time.perf_counter() - start
        if samples >= limit:
            break
    seconds = time.perf_counter() - start
    close = getattr(iterator, "close", None)
    if close is not None:  # a Loader's generator: cancel the reads still in flight now
        close()
    return samples, nbytes, seconds, first if first is not None else seconds


def _keep_bytes(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The DataLoader's collate: each field as bytes, so no batch keeps a reader buffer
    alive, and no work beyond what any real collate would do."""
    return [{k: v if k == "__key__" else bytes(v) for k, v in s.items()} for s in samples]


def _import_torch() -> Any:
    try:
        import torch
        import torch.utils.data  # noqa: F401 - imported now, not inside a timed row
    except ImportError:
        return None
    return torch


def _dataloader_batch(batch_sizes: Sequence[int]) -> int:
    if _DATALOADER_BATCH in batch_sizes:
        return _DATALOADER_BATCH
    ordered = sorted(batch_sizes)
    return ordered[len(ordered) // 2]


# -- report ---------------------------------------------------------------------


def _baseline(rows: Sequence[Row], batch_size: int | None) -> Row | None:
    """The DataLoader with 0 workers at `batch_size`: what the ratios are against."""
    for row in rows:
        if row.kind == "DataLoader" and row.workers == 0 and row.batch_size == batch_size:
            return row
    return None


def format_table(rows: Sequence[Row]) -> str:
    """A markdown table, its columns aligned so it also reads well in a terminal."""
    header = ["configuration", "samples/s", "MB/s", "first batch (ms)", "x DataLoader"]
    body = []
    for row in rows:
        base = _baseline(rows, row.batch_size) if row.kind != "sequential" else None
        ratio = f"{row.samples_per_s / base.samples_per_s:.2f}" if base is not None else "-"
        body.append(
            [
                row.label,
                f"{row.samples_per_s:,.0f}",
                f"{row.mb_per_s:,.1f}",
                f"{row.first_s * 1e3:,.1f}",
                ratio,
            ]
        )
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        parts = [cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return "| " + " | ".join(parts) + " |"

    rule = "|" + "|".join(["-" * (widths[0] + 2)] + ["-" * (w + 1) + ":" for w in widths[1:]])
    return "\n".join([line(header), rule + "|", *(line(cells) for cells in body)])


def suggestion(rows: Sequence[Row]) -> str:
    """The fastest stoker configuration, or one with fewer threads that comes within 5% of
    it: threads the loader does not need are cores the training loop can use. Its
    x DataLoader is against the fastest DataLoader row, the one a user would otherwise pick."""
    grid = [row for row in rows if row.kind == "stoker"]
    fastest = max(grid, key=lambda r: r.samples_per_s)
    near = [
        r
        for r in grid
        if r.threads < fastest.threads  # type: ignore[operator]
        and r.samples_per_s >= _CLOSE_ENOUGH * fastest.samples_per_s
    ]
    best = min(near, key=lambda r: (r.threads, -r.samples_per_s)) if near else fastest
    facts = [f"{best.samples_per_s:,.0f} samples/s"]
    loaders = [row for row in rows if row.kind == "DataLoader"]
    if loaders:
        top = max(loaders, key=lambda r: r.samples_per_s)
        facts.append(f"{best.samples_per_s / top.samples_per_s:.1f} x DataLoader")
    sequential = [row for row in rows if row.kind == "sequential"]
    if sequential:
        facts.append(
            f"{100 * best.samples_per_s / sequential[0].samples_per_s:.0f}% of a sequential read"
        )
    text = f"best: num_threads={best.threads}, batch_size={best.batch_size} ({', '.join(facts)})"
    if best is not fastest:
        text += (
            f"; fewer threads than the fastest (num_threads={fastest.threads}, "
            f"batch_size={fastest.batch_size}, {fastest.samples_per_s:,.0f} samples/s), within "
            f"{100 * (1 - _CLOSE_ENOUGH):.0f}% of it, leave cores to the training loop"
        )
    return text


def plot(rows: Sequence[Row], path: str, title: str) -> None:
    """samples/s against num_threads, one line per batch size, with the sequential read
    and the DataLoader rows as horizontal references."""
    Figure, FigureCanvasAgg = _matplotlib()
    figure = Figure(figsize=(7.5, 4.8))
    FigureCanvasAgg(figure)  # Agg, without touching pyplot's global backend
    ax = figure.add_subplot()
    grid = [row for row in rows if row.kind == "stoker"]
    for batch_size in sorted({r.batch_size for r in grid}):  # type: ignore[type-var]
        line = sorted((r for r in grid if r.batch_size == batch_size), key=lambda r: r.threads or 0)
        ax.plot(
            [r.threads for r in line],
            [r.samples_per_s for r in line],
            marker="o",
            label=f"stoker, batch {batch_size}",
        )
    for row in rows:
        if row.kind == "sequential":
            ax.axhline(row.samples_per_s, linestyle="--", color="0.4", label="sequential read")
        elif row.kind == "DataLoader":
            ax.axhline(
                row.samples_per_s,
                linestyle=":",
                color=f"C{len(ax.lines) % 10}",
                label=f"DataLoader, {_workers(row.workers)}, batch {row.batch_size}",
            )
    rates = [r.samples_per_s for r in rows if 0 < r.samples_per_s < float("inf")]
    log = bool(rates) and max(rates) > 20 * min(rates)  # a sequential read can dwarf the rest
    if log:
        ax.set_yscale("log")
    threads = sorted({r.threads for r in grid})  # type: ignore[type-var]
    ax.set_xscale("log", base=2)
    ax.set_xticks(threads, [str(t) for t in threads])
    ax.minorticks_off()
    ax.set_xlabel("num_threads")
    ax.set_ylabel("samples/s (log scale)" if log else "samples/s")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", loc="best")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def _matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise StokerError("--plot needs matplotlib: pip install matplotlib") from e
    return Figure, FigureCanvasAgg


def _workers(n: int | None) -> str:
    return "1 worker" if n == 1 else f"{n} workers"


def _human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if nbytes < 1000 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    raise AssertionError("unreachable")


# -- the command ----------------------------------------------------------------


def _as_list(value: str | Sequence[int], minimum: int) -> list[int]:
    """A grid option as parsed, or as text when the Namespace was built by hand."""
    return _int_list(minimum)(value) if isinstance(value, str) else sorted(set(value))


def run(args: argparse.Namespace) -> int:
    """Runs the bench, prints the table and the suggestion to stdout, returns 0."""
    from stoker.tools.progress import progress_bar

    threads = _as_list(args.threads, 1)
    batch_sizes = _as_list(args.batch_sizes, 1)
    workers = _as_list(args.dataloader_workers, 0)
    if args.plot:  # fail now, not after minutes of measuring
        _matplotlib()
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder):
            raise StokerError(f"--plot {args.plot}: the folder {folder} does not exist")

    ds = stoker.Dataset(args.source)
    n = len(ds)
    if n == 0:
        raise StokerError(f"{args.source}: no samples to read")
    sizes = _shard_bytes(ds)
    total_bytes = sum(sizes)
    fields, partial = _complete_fields(ds)
    print(
        f"{args.source}: {len(sizes)} shard(s), {n:,} samples, fields: {', '.join(ds.fields)}, "
        f"{_human(total_bytes)}",
        flush=True,
    )
    notes = []
    if partial:
        notes.append(
            f"fields {', '.join(partial)} are not in every sample: stoker reads only "
            f"{', '.join(fields)}"
        )
        if not fields:
            raise StokerError(f"{args.source}: no field is in every sample; nothing to bench")
    limit = min(args.samples, n)
    torch = _import_torch()
    if torch is None:
        notes.append("torch is not installed: no DataLoader rows (pip install torch)")
        workers = []
    local = not any(is_url(path) for path in ds.shards)
    if not local:
        notes.append("remote shards: no sequential read (it reads local files only)")
    dl_batch = _dataloader_batch(batch_sizes)

    plan: list[tuple[str, int | None, int]] = []  # (kind, threads or workers, batch size)
    if local:
        plan.append(("sequential", None, 0))
    plan += [("stoker", t, b) for t in threads for b in batch_sizes]
    plan += [("DataLoader", w, dl_batch) for w in workers]

    def count_stoker(batch: dict[str, Any]) -> tuple[int, int]:
        return len(batch["__key__"]), sum(sum(map(len, batch[f])) for f in fields)

    def count_dataloader(batch: list[dict[str, Any]]) -> tuple[int, int]:
        return len(batch), sum(len(s[f]) for s in batch for f in fields)

    def stoker_loader(t: int, b: int) -> stoker.Loader:
        return stoker.Loader(
            ds,
            batch_size=b,
            num_threads=t,
            shuffle=True,
            seed=0,
            fields={f: stoker.Bytes() for f in fields},
        )

    quiet = args.quiet or not sys.stderr.isatty()
    rows: list[Row] = []
    warmed = False
    with progress_bar(plan, desc="bench", unit="config", disable=quiet, leave=False) as bar:
        for kind, knob, b in bar:
            if kind == "sequential":
                bar.set_postfix_str("sequential read")
                budget = -(-total_bytes * limit // n)  # the bytes of `limit` samples
                got, seconds, first = sequential_read(ds.shards, budget)
                row = Row(kind, n * got / max(total_bytes, 1), got, seconds, first)
            elif kind == "stoker":
                bar.set_postfix_str(f"stoker threads={knob} batch={b}")
                if not warmed:  # imports, first allocations, the first reader's threads
                    timed(
                        functools.partial(stoker_loader, knob, b), count_stoker, b * _WARMUP_BATCHES
                    )
                    warmed = True
                got, nbytes, seconds, first = timed(
                    functools.partial(stoker_loader, knob, b), count_stoker, limit
                )
                row = Row(kind, got, nbytes, seconds, first, threads=knob, batch_size=b)
            else:
                bar.set_postfix_str(f"DataLoader workers={knob} batch={b}")
                ds[0]  # its reader's threads started before the clock, as stoker's were

                def dataloader(w: int = knob, b: int = b) -> Any:
                    fork = w > 0 and sys.platform.startswith("linux")
                    # The `limit` samples read, in a random order: what shuffle=True reads
                    # first, without its permutation of every sample (a list of a billion
                    # ints for a billion-row file, more memory than most machines have).
                    order = np.random.default_rng(0).choice(n, limit, replace=False)
                    return torch.utils.data.DataLoader(
                        ds,
                        batch_size=b,
                        sampler=order.tolist(),
                        num_workers=w,
                        collate_fn=_keep_bytes,
                        multiprocessing_context="fork" if fork else None,
                    )

                got, nbytes, seconds, first = timed(dataloader, count_dataloader, limit)
                row = Row(kind, got, nbytes, seconds, first, workers=knob, batch_size=b)
            logger.debug(
                "%s: %.0f samples/s, %.1f MB/s, first batch %.1f ms",
                row.label,
                row.samples_per_s,
                row.mb_per_s,
                row.first_s * 1e3,
            )
            rows.append(row)

    print(
        f"each row reads up to {limit:,} shuffled samples, timed from the loader's creation to "
        "its last batch; MB/s counts the fields' bytes. The sequential read reads as large a "
        "share of the files front to back: MB/s of file bytes (format headers too), samples/s "
        "the equivalent"
    )
    print()
    print(format_table(rows))
    print()
    if 0 in workers:
        print(
            "x DataLoader: against torch's DataLoader with 0 workers at the same batch size "
            f"(the DataLoader rows use batch {dl_batch}); on the best: line, against the "
            "fastest DataLoader row"
        )
    elif workers:
        notes.append("no DataLoader row with 0 workers: the x DataLoader column is empty")
    for note in notes:
        logger.info(note)
        print(f"note: {note}")
    print(suggestion(rows))
    if args.plot:
        name = os.path.basename(os.path.normpath(str(args.source)))
        plot(rows, args.plot, f"stoker bench: {name} ({n:,} samples)")
        print(f"plot: {args.plot}")
    return 0
