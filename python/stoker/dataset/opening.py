"""Opening a Dataset: finding the shards of a source and indexing (or describing) them,
then making the member table of what was found.

Local shards without a manifest are indexed at once, in parallel, reading headers only;
shards a manifest describes open without a scan; HDF5 files and Zarr stores have their
layouts learnt here. Remote shards are described (their sizes known, their cache checked);
their samples are counted later, by this rank or, with torch.distributed, by a swap across
ranks (see :mod:`.shared`), which is why an `Opening` is kept until that is done.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

import stoker._core as _core
from stoker.arrays import index_array_source
from stoker.dataset.members import DEFAULT_RESIDENT, MemberTable
from stoker.dataset.shard_rows import Note
from stoker.errors import ReadError, ShardFormatError, StokerError, UsageError, human, located
from stoker.formats import ARRAY_SOURCES, TABLE_SOURCES, format_of, is_url, samples_and_fields
from stoker.remote import FetchOptions, RemoteShard, RemoteShards, apply_entry, fetcher_for
from stoker.sources import Source, resolve
from stoker.tables import index_table_source

log = logging.getLogger("stoker.dataset")


@dataclass
class Opening:
    """What opening found, kept until every remote shard's samples are known (see
    Dataset.describe_shared)."""

    names: list[str]
    paths: list[str]
    identities: np.ndarray
    formats: list[str]
    indexes: list[dict]
    shards: list[tuple[str, dict | None]]
    remote_ids: list[int]
    remote: RemoteShards | None = None
    tables: dict[int, dict] | None = None  # local table sources' indexes, by shard

    def waits_for_ranks(self) -> bool:
        """Whether every shard is remote and some have samples no one has counted yet: with
        torch.distributed, the ranks that will read them describe them (see .shared)."""
        return (
            self.remote is not None
            and len(self.remote_ids) == len(self.paths)
            and (bool(self.remote.undescribed()))
        )

    def remote_sizes(self) -> tuple[list[str], list[int]]:
        """Each remote shard's URL and size in bytes (0 where unknown)."""
        shards = self.remote.shards if self.remote is not None else []
        return [s.url for s in shards], [s.size or 0 for s in shards]

    def finished(self) -> tuple[list[str], list[dict]]:
        """Every shard's path and index, each remote shard described now (those a swap, if
        any, left undescribed) and named by its copy in the cache."""
        paths, indexes = list(self.paths), list(self.indexes)
        if self.remote is not None:
            self.remote.describe()
            for r, i in enumerate(self.remote_ids):
                shard = self.remote.shards[r]
                indexes[i] = {"samples": shard.samples, "fields": shard.fields}
                paths[i] = self.remote.path_of(r)
        return paths, indexes

    def regroupings(self) -> list[Note]:
        """What the manifest says of shards whose samples' members lie apart."""
        notes: list[Note] = []
        for shard, (_, entry) in enumerate(self.shards):
            if entry is None:  # no manifest entry: nothing said of it
                continue
            runs = entry.get("key_runs")
            if isinstance(runs, int) and runs > entry.get("samples", runs):
                notes.append(("regrouped", shard, entry["samples"], runs))
        return notes


def open_source(
    source: Source,
    *,
    cache_dir: str | os.PathLike[str] | None,
    cache_limit: int | None,
    num_threads: int | None,
    arrays: Sequence[str] | None,
    options: FetchOptions,
) -> Opening:
    """Find the shards of `source` and index (or describe) them."""

    def read_url(url: str) -> bytes:
        fetcher = fetcher_for(options)
        fetcher.cache_url(url)  # a store is set up here, not on the event loop
        return fetcher.call(fetcher.read_all(url))

    def read_range(url: str, offset: int, length: int) -> bytes:
        fetcher = fetcher_for(options)
        fetcher.cache_url(url)
        return fetcher.call(fetcher.read_range(url, offset, length))

    def list_url(url: str) -> list[tuple[str, int, str | None]]:
        fetcher = fetcher_for(options)
        fetcher.cache_url(url)
        return fetcher.call(fetcher.list_objects(url))

    shards = resolve(
        source,
        read_url,
        list_url=list_url,
        cache_dir=None if cache_dir is None else os.fspath(cache_dir),
        read_range=read_range,
    )
    names = [path for path, _ in shards]
    paths = list(names)
    # (An MDS shard or LitData chunk's entry carries its record format.)
    formats = [(entry or {}).get("format") or format_of(path) for path, entry in shards]
    remote_ids = [i for i, path in enumerate(paths) if is_url(path)]
    local_ids = [i for i, path in enumerate(paths) if not is_url(path)]
    indexes: list[dict] = [{} for _ in paths]
    identities = np.zeros((len(paths), 3), np.int64)
    # What a manifest lists is stat'ed now: each file as it is when opened is what
    # reads check against (and what indexing it later is compared with).
    listed = [i for i in local_ids if shards[i][1] is not None]
    identities[listed] = _check_manifest_sizes(
        [paths[i] for i in listed], [e for i in listed if (e := shards[i][1]) is not None]
    )
    # Shards a manifest describes open without a scan: each is indexed when a batch
    # first reads it.
    described = {i for i in local_ids if _describes(shards[i][1])}
    for i in described:
        entry = shards[i][1]
        assert entry is not None  # _describes(entry)
        indexes[i] = {"samples": entry["samples"], "fields": entry.get("fields")}
    scan = [
        i
        for i in local_ids
        if i not in described and formats[i] not in ARRAY_SOURCES + TABLE_SOURCES
    ]
    found = _core.index_shards(
        [paths[i] for i in scan], [formats[i] for i in scan], num_threads or 0
    )
    for i in local_ids:  # HDF5 files and Zarr stores: their layouts, learnt here
        if formats[i] in ARRAY_SOURCES:
            scan.append(i)
            found.append(index_array_source(paths[i], formats[i], arrays))
    if arrays is not None and not any(f in ARRAY_SOURCES for f in formats):
        raise UsageError(
            "arrays= chooses arrays of HDF5 files and Zarr stores; this source has none"
        )
    for i, index in zip(scan, found):
        indexes[i] = index
        identities[i] = index["identity"]
    # Table sources: their footers summed up now (or taken from the manifest), one file of
    # each kind read whole (see _open_tables); their members are made a piece at a time,
    # when a batch first reads each, like a manifest's shards.
    table_ids = [i for i in local_ids if formats[i] in TABLE_SOURCES]
    listed_tables = {i: shards[i][1] for i in table_ids if i in described}
    tables = _open_tables(paths, table_ids, formats, listed_tables, identities)
    fields_of: dict[int, list[str]] = {}  # (the file read for a key names them all)
    for i, index in tables.items():
        like = index.get("like", i)
        if like not in fields_of:
            fields_of[like] = samples_and_fields(tables[like], formats[like])[1]
        indexes[i] = {"samples": int(index["rows"]), "fields": fields_of[like]}
        identities[i] = index["identity"]
    opening = Opening(names, paths, identities, formats, indexes, shards, remote_ids)
    opening.tables = tables
    if remote_ids:
        opening.remote = _open_remote(shards, remote_ids, formats, cache_dir, cache_limit, options)
    return opening


def _open_tables(
    paths: list[str],
    shards: list[int],
    formats: list[str],
    listed: dict[int, dict | None] | None = None,
    identities: np.ndarray | None = None,
) -> dict[int, dict]:
    """The indexes of local table files `shards` (their metadata), read on a few threads:
    a dataset of many files waits on the disk, not on one read after another.

    Of many Parquet files, each footer is summed up in C++ (its rows and row groups, and a
    key of how its columns read: _core.parquet_summaries), or taken from its manifest entry
    (`listed`, with `identities` as stat'ed), and only one file of each key is read whole
    now; the others are read when a batch first reads them. Their index here is
    ``{"format": "table", "rows", "groups", "identity", "like"}``, `like` the shard read
    for them. (Reading every footer whole took 0.3 ms of Python a file: 30 s for 100,000
    files, before the first batch of every run.)"""
    if not shards:
        return {}
    now = [s for s in shards if formats[s] != "parquet"]
    parquet = [s for s in shards if formats[s] == "parquet"]
    summaries: dict[int, tuple[int, np.ndarray, tuple[int, ...], int]] = {}
    for s in parquet:
        said = _listed_summary((listed or {}).get(s))
        if said is not None and identities is not None:
            summaries[s] = (said[0], said[1], tuple(int(v) for v in identities[s]), said[2])
    unlisted = [s for s in parquet if s not in summaries]
    if len(parquet) > 1 and unlisted:
        counts, group_rows, ids, keys = _core.parquet_summaries([paths[s] for s in unlisted])
        for j, s in enumerate(unlisted):
            identity = tuple(int(v) for v in ids[j])
            summaries[s] = (int(counts[j]), group_rows[j], identity, int(keys[j]))
    first_of: dict[int, int] = {}
    later: dict[int, dict] = {}
    for s in parquet:
        if s not in summaries:
            now.append(s)
            continue
        rows, groups, identity, key = summaries[s]
        like = first_of.setdefault(key, s)
        if like == s or int(groups.sum()) != rows:
            now.append(s)  # (read whole: a file that does not add up says why)
            continue
        later[s] = {"format": "table", "rows": rows, "groups": groups}
        later[s].update(identity=identity, like=like)
    if len(now) == 1:
        read = {now[0]: index_table_source(paths[now[0]], formats[now[0]])}
    else:
        with ThreadPoolExecutor(min(8, len(now))) as pool:
            read = dict(zip(now, pool.map(lambda s: index_table_source(paths[s], formats[s]), now)))
    return {s: read.get(s) or later[s] for s in shards}


def _listed_summary(entry: dict | None) -> tuple[int, np.ndarray, int] | None:
    """(rows, row groups' rows, columns key) of a Parquet file's manifest entry, where it
    says them all (as `stoker index` writes them); else None, and its footer is read."""
    if entry is None:
        return None
    groups, key, rows = entry.get("groups"), entry.get("columns_key"), entry.get("samples")
    if not isinstance(groups, list) or not isinstance(key, str) or type(rows) is not int:
        return None
    try:
        sizes = np.array(groups, np.int64)
        value = int(key, 16)
    except (TypeError, ValueError, OverflowError):
        return None
    if sizes.ndim != 1 or (sizes < 0).any() or int(sizes.sum()) != rows or value >> 64:
        return None
    return rows, sizes, value


def member_table(
    shard_names: list[str],
    paths: list[str],
    identities: np.ndarray,
    formats: list[str],
    indexes: list[dict],
    member_files: np.ndarray | None = None,
    tables: dict[int, dict] | None = None,
) -> tuple[MemberTable, list[Note]]:
    """The member table of `indexes` (one per shard), and what indexing found that a user
    should hear. A shard not yet local has a placeholder ``{"samples", "fields"}``: its
    samples count; its members are added once it is indexed."""
    counts: list[int] = []
    field_names: list[str] = []
    fields_known = True
    for index in indexes:
        if "samples" in index:  # a placeholder
            counts.append(int(index["samples"]))
            fields_known &= index.get("fields") is not None
            field_names += index.get("fields") or ()
        elif index["format"] == "npy":
            counts.append(int(index["shape"][0]))
        elif index["format"] == "array":
            counts.append(int(index["rows"]))
        else:
            counts.append(len(index["keys"]))
    table = MemberTable(counts, shard_names, paths, identities, formats, field_names, fields_known)
    if tables:
        table.add_tables(tables)
    table.cut_table_pieces()
    ready = [s for s, index in enumerate(indexes) if "samples" not in index]
    # What opening indexed (a scan of every shard) stays indexed: it was paid for, and
    # only a source without a manifest is scanned. Shards indexed later are held while
    # in use, a bounded number at once.
    table.reserve(max(DEFAULT_RESIDENT, len(ready)))
    member_files = None if member_files is None else member_files.astype(np.uint32)
    return table, table.add(ready, [indexes[s] for s in ready], member_files)


def announce(notes: list[Note], said: set[str], names: list[str]) -> None:
    """Log what indexing found that a user should hear: each kind once (`said`: the kinds
    said already, which this adds to); `names` are the shards'."""
    for kind, shard, a, b in notes:
        if kind in said:
            continue
        said.add(kind)
        name = names[shard]
        if kind == "regrouped":
            log.warning(
                "%s: some samples' members are stored apart (as `zip -r` and tar without "
                "--sort=name store them); stoker groups them by key into %d samples, "
                "where WebDataset, which groups adjacent members only, would read %d. "
                "(Said once per dataset; `stoker inspect` lists every such shard.)",
                name,
                a,
                b,
            )
        elif kind == "stale-index":
            damaged = a == int(_core.SidecarState.DAMAGED)
            why = "is damaged" if damaged else "is for another version of the shard"
            log.warning(
                "%s: its member index %s; the shard's headers were read instead. "
                "(Said once per dataset; `stoker index` writes the indexes again. A "
                "shard copied without its modification time, by `cp` without -p, "
                "makes its index stale too.)",
                name + _core.SIDECAR_SUFFIX,
                why,
            )


def _open_remote(
    shards: list[tuple[str, dict | None]],
    remote_ids: list[int],
    formats: list[str],
    cache_dir: str | os.PathLike[str] | None,
    cache_limit: int | None,
    options: FetchOptions,
) -> RemoteShards:
    """The remote shards of a source, their sizes known and their cache checked."""
    described = []
    for i in remote_ids:
        shard = RemoteShard(url=shards[i][0], format=formats[i])
        entry = shards[i][1]
        if entry:
            apply_entry(shard, entry)
        described.append(shard)
    remote = RemoteShards(described, cache_dir, cache_limit, options)
    remote.describe(only=())  # sizes: the samples of shards no manifest gave come later
    largest = max(s.size or 0 for s in remote.shards)
    if remote.limit < 2 * largest:
        raise StokerError(
            f"cache_limit={remote.limit} bytes cannot hold two of these shards at once (one "
            f"being read, one arriving): raise cache_limit to at least {2 * largest} "
            f"({human(2 * largest)}), or write smaller shards"
        )
    return remote


def _describes(entry: dict | None) -> bool:
    """Whether a manifest entry says enough to open its shard without a scan."""
    return entry is not None and isinstance(entry.get("samples"), int) and "bytes" in entry


def _check_manifest_sizes(paths: list[str], entries: list[dict]) -> np.ndarray:
    """Each shard a manifest lists is there, and as large as the manifest says (stat'ed in
    parallel: a manifest may list a hundred thousand). Returns their identities (zeros
    where a stat failed: the index parser reports it with its errno)."""
    identities, errors = _core.stat_files(paths, 0)
    for j in np.flatnonzero(errors).tolist():
        if int(errors[j]) == errno.ENOENT:
            path = paths[j]
            folder = os.path.dirname(path) or "."
            raise located(
                ReadError,
                path,
                0,
                "the manifest lists this shard but it is not there; run `stoker index "
                f"{folder}` to write the manifest again",
                errno.ENOENT,
            )
        # (any other failure: the index parser reports it with its errno)
    expected = np.array([entry.get("bytes", -1) for entry in entries], np.int64)
    wrong = np.flatnonzero((errors == 0) & (expected >= 0) & (identities[:, 1] != expected))
    if len(wrong):
        j = int(wrong[0])
        path, entry, actual = paths[j], entries[j], int(identities[j, 1])
        raise located(
            ShardFormatError,
            path,
            min(actual, entry["bytes"]),
            f"{entry.get('listed_by', 'the manifest')} says {entry['bytes']} bytes but the "
            f"file has {actual}",
        )
    identities[errors != 0] = 0
    return identities
