"""Describing shards: ``stoker index`` (write a manifest) and ``stoker inspect`` (what each
shard holds, and what a user should know about it)."""

from __future__ import annotations

import contextlib
import json
import os
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

import numpy as np

from stoker import _core
from stoker.errors import StokerError, human, plural, quoted
from stoker.formats import TABLE_SOURCES, format_of, is_url, shards_in_folder
from stoker.manifest import (
    MANIFEST_NAME,
    describe_drift,
    manifest_drift,
    read_manifest,
    shard_entry,
    write_entries,
    write_manifest,
)
from stoker.remote import FetchOptions
from stoker.sources import resolve
from stoker.tables.table_fields import TableField


def local_shards(source: str, allow_missing: bool = False) -> list[str]:
    """The local shard files of `source` (a folder, glob, brace pattern, list, manifest);
    those that do not exist are an error, or left out with `allow_missing`."""
    paths = [path for path, _ in resolve(source, note_drift=False)]
    remote = [p for p in paths if is_url(p)]
    if remote:
        raise StokerError(f"{remote[0]}: this command reads local shards only")
    missing = [p for p in paths if not os.path.exists(p)]
    if allow_missing:
        return [p for p in paths if os.path.exists(p)]
    if missing:
        raise StokerError(
            f"{missing[0]}: no such file"
            + (f" (and {len(missing) - 1} more)" if missing[1:] else "")
        )
    return paths


def shard_formats(source: str) -> dict[str, str]:
    """The formats `source`'s index gives its shards (MDS shards and LitData chunks: their
    record formats), by path."""
    return {
        path: entry["format"]
        for path, entry in resolve(source, note_drift=False)
        if entry and isinstance(entry.get("format"), str)
    }


def index(source: str, out: str | None = None, num_threads: int = 0) -> tuple[str, list[dict]]:
    """Write ``stoker.json`` for the shards of `source` (beside them unless `out`)."""
    extra = None
    if os.path.isdir(source):  # every shard there now, whatever an old manifest says
        paths = shards_in_folder(source)
        old = os.path.join(source, MANIFEST_NAME)
        if os.path.isfile(old):  # keep what else it says (class names)
            with open(old, encoding="utf-8") as f, contextlib.suppress(ValueError):
                extra = {k: v for k, v in json.load(f).items() if k not in ("version", "shards")}
    else:
        paths = local_shards(source)
    if not paths:
        raise StokerError(f"{source}: no shards")
    if out is None:
        if os.path.isdir(source):
            out = source
        else:
            out = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths])
    written = write_manifest(paths, out, num_threads=num_threads, extra=extra or None)
    return written, [entry for _, entry in read_manifest(written)]


def index_remote(
    sources: list[str],
    out: str | None = None,
    *,
    cache_dir: str | None = None,
    cache_limit: int | None = None,
    fetch: FetchOptions | None = None,
    ray: str | bool = False,
    quiet: bool = True,
) -> tuple[str, list[dict], str]:
    """Write ``stoker.json`` for remote shards (http(s), ``s3://``, ``gs://``) to the local
    file `out` (default ``./stoker.json``), to be put beside them. Each shard is fetched
    through the node cache once (as a first epoch would) and described from its copy
    there: bytes, samples, fields, sha256. Paths are relative to the shards' common
    folder (returned too), where the manifest belongs. `ray`: each shard described by a
    Ray task, through the cache of the node it runs on, on the cluster at that address
    (True: the one joined, else a local one); the same manifest as without it. Unless
    `quiet`, a progress bar counts the shards described, their samples and bytes."""
    from stoker.dataset import Dataset
    from stoker.tools.progress import progress_bar

    ds = Dataset(
        sources if len(sources) > 1 else sources[0],
        cache_dir=cache_dir,
        cache_limit=cache_limit,
        fetch=fetch,
    )
    remote = ds.remote
    if remote is None or len(remote.shards) != len(ds.shards):
        raise StokerError(f"{sources[0]}: remote shards only (local: `stoker index FOLDER`)")
    urls = [shard.url for shard in remote.shards]
    folder = os.path.commonprefix([url.rsplit("/", 1)[0] + "/" for url in urls])
    folder = folder[: folder.rfind("/") + 1]

    entries: list[dict] = [{}] * len(urls)
    with progress_bar(total=len(urls), unit="shard", desc="index", disable=quiet) as bar:
        samples = size = 0

        def done(i: int, entry: dict) -> None:
            nonlocal samples, size
            entries[i] = entry
            samples, size = samples + entry["samples"], size + entry["bytes"]
            bar.update(1)
            bar.set_postfix_str(f"{samples:,} samples, {human(size)}")

        if ray:
            from stoker.ray.tasks import run_each

            address = ray if isinstance(ray, str) else None
            # (the task holds the pickled Dataset: its shards' URLs, not their bytes)
            work = run_each(len(urls), lambda i: json.dumps(_remote_entry(ds, i)), address)
            for i, text in work:
                done(i, json.loads(text))
        else:
            with ThreadPoolExecutor(remote.options.connections) as pool:
                futures = {pool.submit(_remote_entry, ds, i): i for i in range(len(urls))}
                for future in as_completed(futures):
                    done(futures[future], future.result())
    for described, url in zip(entries, urls):
        described["path"] = url[len(folder) :]
    written = write_entries(out or MANIFEST_NAME, entries)
    return written, entries, folder


def _remote_entry(ds: Any, i: int) -> dict:
    """The manifest entry of remote shard `i` of `ds`, from its copy in the node cache (its
    path not yet made relative)."""
    remote = ds.remote
    hold = remote.acquire(i)
    try:
        return shard_entry(hold.path, os.path.dirname(hold.path))
    finally:
        remote.release(i)


@dataclass
class FieldSizes:
    """A field's member sizes summed up: how many, the least, the most and their total (a
    file of a billion rows of one size is four numbers, not 8 GB of sizes)."""

    count: int = 0
    least: int = 0
    most: int = 0
    total: int = 0

    @classmethod
    def of(cls, sizes: np.ndarray) -> FieldSizes:
        if not len(sizes):
            return cls()
        return cls(len(sizes), int(sizes.min()), int(sizes.max()), int(sizes.sum()))

    @classmethod
    def uniform(cls, count: int, size: int) -> FieldSizes:
        return cls(count, size, size, count * size) if count else cls()

    def __add__(self, other: FieldSizes) -> FieldSizes:
        if not other.count or not self.count:
            return self if self.count else other
        return FieldSizes(
            self.count + other.count,
            min(self.least, other.least),
            max(self.most, other.most),
            self.total + other.total,
        )


@dataclass
class ShardReport:
    path: str
    format: str
    bytes: int
    samples: int = 0
    fields: dict[str, FieldSizes] | None = None  # field -> its members' sizes
    error: str | None = None
    keys: list[str] | None = None
    key_runs: int = 0  # samples a reader of adjacent members only would see
    arrays: list[str] | None = None  # an array source: how each of its arrays is stored
    table: TableReport | None = None  # a table source (Parquet, Arrow): its columns


@dataclass
class TableReport:
    """A Parquet or Arrow IPC file's rows, row groups (an Arrow file's record batches) and
    columns, as `stoker inspect` describes them."""

    groups: np.ndarray  # rows of each row group
    columns: list[TableField]
    about: str = ""  # its writer (Parquet's created_by), or which Arrow IPC form it is


def manifest_notes(source: str) -> list[str]:
    """What is wrong with the local manifest `source` names (or the folder's stoker.json):
    shards it lists that are gone, shard files beside it it does not list."""
    manifest = os.path.join(source, MANIFEST_NAME) if os.path.isdir(source) else source
    if not (manifest.lower().endswith(".json") and os.path.isfile(manifest)):
        return []
    missing, unlisted = manifest_drift(manifest, read_manifest(manifest))
    return [describe_drift(manifest, missing, unlisted)] if missing or unlisted else []


def manifest_mismatches(source: str, reports: list[ShardReport]) -> list[str]:
    """Shards whose manifest entry gives other sizes or sample counts than the shard has
    (a shard rewritten since, or a manifest written before stoker grouped a sample's
    scattered members)."""
    try:
        entries = {
            os.path.abspath(path): entry
            for path, entry in resolve(source, note_drift=False)
            if entry is not None
        }
    except StokerError:
        return []
    wrong = []
    for r in reports:
        entry = entries.get(os.path.abspath(r.path))
        if r.error is not None or entry is None:
            continue
        if entry.get("bytes", r.bytes) != r.bytes:
            wrong.append(
                f"{os.path.basename(r.path)} has {r.bytes:,} bytes, not {entry['bytes']:,}"
            )
        elif entry.get("samples", r.samples) != r.samples:
            wrong.append(
                f"{os.path.basename(r.path)} holds {r.samples:,} samples, not {entry['samples']:,}"
            )
    if not wrong:
        return []
    shown = "; ".join(wrong[:3]) + (f"; and {len(wrong) - 3} more" if len(wrong) > 3 else "")
    folder = source if os.path.isdir(source) else os.path.dirname(source) or "."
    return [
        f"the manifest is out of date for {plural(len(wrong), 'shard')} ({shown}): run "
        f"`stoker index {folder}` to write it again"
    ]


def inspect_shards(
    paths: list[str], num_threads: int = 0, formats: list[str | None] | None = None
) -> list[ShardReport]:
    """Each shard's samples and field sizes, or what is wrong with it. `formats`: each
    shard's format where its source says it (an MDS shard's or LitData chunk's record
    format, from their index), else it is told by the name."""
    given = dict(zip(paths, formats or []))

    def one(path: str) -> ShardReport:
        try:
            fmt = given.get(path) or format_of(path)
            if fmt in ("hdf5", "zarr"):
                return _array_report(path, fmt)
            if fmt in TABLE_SOURCES:
                return _table_report(path, fmt)
            size = os.path.getsize(path)
            found = _core.index_shards([path], [fmt], 1)[0]
        except (StokerError, OSError) as e:
            return ShardReport(path, os.path.splitext(path)[1][1:], 0, error=str(e))
        if fmt == "npy":
            rows = int(found["shape"][0])
            sizes = FieldSizes.uniform(rows, int(found["row_bytes"]))
            return ShardReport(path, fmt, size, rows, {"npy": sizes})
        fields = {
            name: FieldSizes.of(found["member_out_length"][found["member_field"] == i])
            for i, name in enumerate(found["field_names"])
        }
        keys = found["keys"]
        kind = found["format"]  # (a record format's kind: mds, litdata)
        if kind in ("mds", "litdata"):  # records: numbered in their shard, as a Dataset keys them
            stem = os.path.splitext(os.path.basename(path))[0]
            keys = [f"{stem}/{k}" for k in keys]
        return ShardReport(path, kind, size, len(keys), fields, None, keys, found["key_runs"])

    with ThreadPoolExecutor(num_threads or os.cpu_count() or 1) as pool:
        return list(pool.map(one, paths))


def _array_report(path: str, fmt: str) -> ShardReport:
    """An HDF5 file or Zarr store: its rows, and how each array is stored and read."""
    from stoker.arrays import index_array_source

    found = index_array_source(path, fmt)
    rows = int(found["rows"])
    fields, lines = {}, []
    stored = 0
    for field in found["fields"]:
        fields[field.name] = FieldSizes.uniform(rows, field.row_bytes)
        layout = field.layout
        shape = f"{(rows, *field.row_shape)} {field.dtype}"
        line = f"{field.name}: {shape}, {field.storage}"
        if layout is None:
            line += ": rows read in place"
            stored += rows * field.row_bytes
        else:
            stored += layout.stored_bytes
            chunk_rows = int(layout.chunk_shape[0])
            decoded = layout.chunk_bytes * layout.chunks_per_row
            line += (
                f": {chunk_rows:,} rows per chunk, {layout.chunks_per_row:,} chunk(s) per row; "
                f"a row alone reads {human(decoded)} of chunks "
                f"({decoded / max(field.row_bytes, 1):,.0f}x its {human(field.row_bytes)})"
            )
            if layout.chunks_per_row > 1:
                line += (
                    "; chunks cut across rows: store whole rows per chunk, "
                    f"chunks=({min(chunk_rows, 64)}, {', '.join(map(str, field.row_shape))})"
                )
        lines.append(line)
    size = os.path.getsize(path) if fmt == "hdf5" else stored
    return ShardReport(path, fmt, size, rows, fields, arrays=lines)


def _table_report(path: str, fmt: str) -> ShardReport:
    """A Parquet or Arrow IPC file: its rows, row groups and columns, read from its
    metadata alone (a Parquet footer, an Arrow file's IPC messages)."""
    from stoker.tables import arrow, parquet

    if fmt == "parquet":
        meta = parquet.read_footer(path)
        rows, columns, groups = parquet.parquet_fields(path, meta)
        chunks = [c for group in meta["row_groups"] for c in group["columns"]]
        indexed = bool(chunks) and all(int(c.get("offset_index_length", 0)) > 0 for c in chunks)
        about = ", ".join(
            part
            for part in (
                f"written by {meta['created_by']}" if meta.get("created_by") else "",
                "with a page index" if indexed else "",
            )
            if part
        )
    else:
        rows, columns, groups = arrow.arrow_fields(path)
        with open(path, "rb") as f:
            # (the two forms datasets writes: save_to_disk files, and its cache's streams)
            about = "Arrow IPC file" if f.read(6) == b"ARROW1" else "Arrow IPC stream"
    fields = {}
    for column in columns:
        if column.unusable:
            continue
        if column.lengths is not None:  # read in place: each value's size is known
            present = ~column.nulls if column.nulls is not None else slice(None)
            fields[column.name.lower()] = FieldSizes.of(column.lengths[present])
        elif column.width and column.spec is not None and column.spec[2] == 0:
            # (a required Parquet column of one width: every row has a value of that size;
            # other Parquet values are sized only by decoding their pages)
            fields[column.name.lower()] = FieldSizes.uniform(rows, column.width)
    report = TableReport(np.asarray(groups, np.int64), columns, about)
    return ShardReport(path, fmt, os.path.getsize(path), rows, fields, table=report)


def _value_type(column: TableField) -> str:
    """What a column's values become: a numpy type, bytes, or a list of a numpy type."""
    if column.unusable and column.dtype is None:
        return "-"
    if column.listed:
        return f"list of {column.dtype.name}" if column.dtype is not None else "list"
    if column.dtype is None:
        return f"bytes ({column.width} each)" if column.width else "bytes"
    return column.dtype.name


def _groups_text(groups: np.ndarray, fmt: str) -> str:
    """``3 row groups of 100 rows (the last 20)``; an Arrow file's are record batches."""
    noun = "row group" if fmt == "parquet" else "record batch"
    if not len(groups):
        return f"no {noun}" + ("s" if fmt == "parquet" else "es")
    counted = f"{len(groups):,} {noun}" + (
        "" if len(groups) == 1 else "s" if fmt == "parquet" else "es"
    )
    first, last = int(groups[0]), int(groups[-1])
    if (groups == first).all():
        return f"{counted} of {first:,} rows"
    if (groups[:-1] == first).all() and last < first:
        return f"{counted} of {first:,} rows (the last {last:,})"
    return f"{counted} of {int(groups.min()):,} to {int(groups.max()):,} rows"


def _column_lines(
    columns: list[TableField], rows: int, nulls: dict[str, int], kinds: dict[str, str] | None = None
) -> list[str]:
    """One line per readable column: its type (`kinds` where files disagree), stored
    bytes, bytes per row, storage."""
    usable = [c for c in columns if not c.unusable]
    if not usable:
        return ["(no column stoker can read)"]
    width = max([6, *(len(c.name) for c in usable)])
    types = [(kinds or {}).get(c.name) or _value_type(c) for c in usable]
    type_width = max([4, *(len(k) for k in types)])
    lines = [f"{'column':<{width}}  {'type':<{type_width}}  {'stored':>9}  {'per row':>9}  storage"]
    for column, kind in zip(usable, types):
        per_row = human(column.stored_bytes / rows) if rows else "-"
        storage = column.storage or "-"
        if nulls.get(column.name):
            storage += f"; {nulls[column.name]:,} null"
        lines.append(
            f"{column.name:<{width}}  {kind:<{type_width}}  {human(column.stored_bytes):>9}  "
            f"{per_row:>9}  {storage}"
        )
    return lines


def _null_counts(columns: list[TableField]) -> dict[str, int]:
    """Nulls per column, where the file's metadata says (Arrow's validity bitmaps)."""
    return {c.name: int(c.nulls.sum()) for c in columns if c.nulls is not None}


def _joined_columns(tables: list[ShardReport]) -> tuple[list[TableField], dict[str, str]]:
    """Every file's readable columns summed by name, their storages joined; and the types
    of those whose files disagree (``int32 / int64``)."""
    joined: dict[str, TableField] = {}
    kinds: dict[str, list[str]] = {}
    storages: dict[str, list[str]] = {}
    for r in tables:
        for column in r.table.columns if r.table else []:
            if column.unusable:
                continue
            if column.name not in joined:
                joined[column.name] = TableField(
                    column.name, column.dtype, column.listed, column.width
                )
                kinds[column.name], storages[column.name] = [], []
            joined[column.name].stored_bytes += column.stored_bytes
            if _value_type(column) not in kinds[column.name]:
                kinds[column.name].append(_value_type(column))
            for part in column.storage.split(", "):
                if part and part not in storages[column.name]:
                    storages[column.name].append(part)
    for name, column in joined.items():
        column.storage = ", ".join(storages[name])
    differ = {name: " / ".join(k) for name, k in kinds.items() if len(k) > 1}
    return list(joined.values()), differ


def table_lines(names: list[str], reports: list[ShardReport], shown_files: int = 10) -> list[str]:
    """The tables part of `stoker inspect`: each file's row groups and columns (the first
    `shown_files` files), every file's together, and the columns stoker cannot read."""
    tables = [(n, r) for n, r in zip(names, reports) if r.table is not None and r.error is None]
    if not tables:
        return []
    lines = ["", "tables (rows are samples; a shuffled Loader draws rows row group by row group):"]
    for name, r in tables[:shown_files]:
        assert r.table is not None  # (tables holds those only)
        head = f"{r.samples:,} rows, {_groups_text(r.table.groups, r.format)}"
        lines.append(f"  {name}: {head}" + (f"; {r.table.about}" if r.table.about else ""))
        columns = r.table.columns
        lines += [
            f"    {line}" for line in _column_lines(columns, r.samples, _null_counts(columns))
        ]
    if len(tables) > shown_files:
        lines.append(f"  ({len(tables) - shown_files:,} more files: every file is in the totals)")
    if len(tables) > 1:
        rows = sum(r.samples for _, r in tables)
        groups = sum(len(r.table.groups) for _, r in tables if r.table is not None)
        nulls: dict[str, int] = {}
        for _, r in tables:
            for column, count in _null_counts(r.table.columns if r.table else []).items():
                nulls[column] = nulls.get(column, 0) + count
        kinds = {r.format for _, r in tables}
        noun = {"parquet": "row groups", "arrow": "record batches"}.get(kinds.pop(), "groups")
        lines.append(
            f"  all {len(tables):,} files: {rows:,} rows, {groups:,} "
            + (noun if not kinds else "groups")
        )
        joined, differ = _joined_columns([r for _, r in tables])
        lines += [f"    {line}" for line in _column_lines(joined, rows, nulls, differ)]
    refused: dict[tuple[str, str], list[str]] = {}
    for name, r in tables:
        for leaf in r.table.columns if r.table else []:
            if leaf.unusable:
                refused.setdefault((leaf.name, leaf.unusable), []).append(name)
    if refused:
        lines += ["", "columns stoker cannot read (left out of the fields):"]
        for (column, why), where in refused.items():
            place = where[0] if len(where) == 1 else f"{len(where):,} files, first {where[0]}"
            lines.append(f"  {column!r} ({place}) {why}")
    return lines


def inspection_notes(reports: list[ShardReport], names: list[str]) -> list[str]:
    """Things about readable shards a user should know: samples whose members were stored
    apart, keys that more than one shard holds, fields only some samples have."""
    notes = []
    apart = [
        (name, r) for name, r in zip(names, reports) if r.error is None and r.key_runs > r.samples
    ]
    if apart:
        shown = ", ".join(name for name, _ in apart[:3]) + (" ..." if len(apart) > 3 else "")
        notes.append(
            f"some samples' members are stored apart in {len(apart):,} of "
            f"{plural(len(reports), 'shard')} ({shown}); stoker groups them by key into "
            f"{sum(r.samples for _, r in apart):,} samples, where WebDataset, which groups "
            f"adjacent members only, would read {sum(r.key_runs for _, r in apart):,}"
        )
    where: dict[str, int] = {}
    split = []
    for i, r in enumerate(reports):
        for key in r.keys or ():
            first = where.setdefault(key, i)
            if first != i:
                split.append((key, first, i))
    if split:
        key, a, b = split[0]
        count = len({k for k, _, _ in split})
        notes.append(
            f"keys in more than one shard: {count:,} (first: {quoted(key)} in {names[a]} and "
            f"{names[b]}); each shard's part is a sample of its own"
        )
    good = [r for r in reports if r.error is None]
    total = sum(r.samples for r in good)
    counts: dict[str, int] = {}
    for r in good:
        for field, sizes in (r.fields or {}).items():
            counts[field] = counts.get(field, 0) + sizes.count
    partial = sorted(f for f, n in counts.items() if n < total)
    if partial:
        shown = ", ".join(f"{f} ({counts[f]:,})" for f in partial)
        notes.append(f"fields that not all {total:,} samples have: {shown}")
    return notes


def _table_fields(r: ShardReport) -> set[str]:
    """A table file's readable columns, as fields are named (sized or not)."""
    return {c.name.lower() for c in r.table.columns if not c.unusable} if r.table else set()


def format_inspection(
    source: str, reports: list[ShardReport], manifest: list[str] | None = None
) -> str:
    good = [r for r in reports if r.error is None]
    bad = [r for r in reports if r.error is not None]
    formats: dict[str, int] = {}
    for r in good:
        formats[r.format] = formats.get(r.format, 0) + 1
    lines = [
        f"{source}: {len(reports)} shard(s) "
        f"({', '.join(f'{n} {f}' for f, n in sorted(formats.items())) or 'none readable'}), "
        f"{sum(r.samples for r in good):,} samples, {human(sum(r.bytes for r in good))}",
        "",
    ]
    if not reports:
        return lines[0]
    base = os.path.commonpath([os.path.dirname(os.path.abspath(r.path)) for r in reports])
    shown = [os.path.relpath(os.path.abspath(r.path), base) for r in reports]
    width = max([5, *(len(s) for s in shown)])
    kind = max([6, *(len(r.format) for r in reports)])  # ("parquet" is the longest)
    lines.append(f"{'shard':<{width}}  {'format':<{kind}}  {'samples':>9}  {'bytes':>9}  fields")
    for name, r in zip(shown, reports):
        if r.error is None:
            fields = ", ".join(sorted(set(r.fields or {}) | _table_fields(r)))
            lines.append(
                f"{name:<{width}}  {r.format:<{kind}}  {r.samples:>9,}  {human(r.bytes):>9}  "
                f"{fields}"
            )
        else:
            lines.append(f"{name:<{width}}  {r.format:<{kind}}  {'-':>9}  {'-':>9}  MALFORMED")
    totals: dict[str, FieldSizes] = {}
    for r in good:
        for field, sizes in (r.fields or {}).items():
            totals[field] = totals.get(field, FieldSizes()) + sizes
    if totals:
        named = max([10, *(len(f) for f in totals)])  # (a table's dotted names run long)
        lines += [
            "",
            f"{'field':<{named}}  {'samples':>9}  {'min':>9}  {'mean':>9}  {'max':>9}  total",
        ]
        for field in sorted(totals):
            sizes = totals[field]
            if not sizes.count:
                continue
            lines.append(
                f"{field:<{named}}  {sizes.count:>9,}  {human(sizes.least):>9}  "
                f"{human(sizes.total / sizes.count):>9}  {human(sizes.most):>9}  "
                f"{human(sizes.total)}"
            )
    lines += table_lines(shown, reports)
    arrays = [(name, r) for name, r in zip(shown, reports) if r.arrays and r.error is None]
    if arrays:
        lines += ["", "arrays (rows are samples; a shuffled Loader draws rows chunk by chunk):"]
        for name, r in arrays:
            lines += [f"  {name}:"] + [f"    {line}" for line in r.arrays or ()]
    notes = (manifest or []) + inspection_notes(reports, shown)
    if notes:
        lines += ["", "notes:"] + [f"  {note}" for note in notes]
    if bad:
        lines += ["", f"{len(bad)} malformed shard(s):"]
        lines += [f"  {r.error}" for r in bad]
    return "\n".join(lines)
