"""Datasets: every sample of a set of shards, indexed once, read a batch at a time.

A dataset holds a columnar index (numpy arrays: one row per member, a member being
one field of one sample) and reads any set of samples with one call into the C++
ShardReader. Opening indexes every shard in parallel, reading headers only.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import csv as csv_module
import errno
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

import numpy as np

from stoker import _core
from stoker.errors import (
    FetchError,
    ReadError,
    ShardFormatError,
    StokerError,
    UsageError,
    located,
)
from stoker.remote import (
    FetchOptions,
    Hold,
    RemoteShard,
    RemoteShards,
    apply_entry,
    fetcher_for,
    wait_result,
)
from stoker.sources import Source, format_of, is_url, resolve

log = logging.getLogger("stoker.dataset")

#: Where each piece starts in a batch buffer: aligned so that any dtype can be
#: viewed in place.
ALIGN = 64
_CODEC_STORED = 0
_MEMBER_COLUMNS = {
    "file": np.uint32,
    "offset": np.uint64,
    "length": np.uint64,
    "out": np.uint64,
    "codec": np.uint8,
    "crc": np.uint32,
    "field": np.int32,
    "decoder": np.int32,
    "sample": np.int64,
}

_readers: dict[tuple[int, int], _core.ShardReader] = {}
_readers_lock = threading.Lock()


def _new_lock_after_fork() -> None:
    # Another thread may have held the lock at the fork; it does not exist here.
    global _readers_lock
    _readers_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_after_fork)


def all_readers() -> list[_core.ShardReader]:
    with _readers_lock:
        return list(_readers.values())


def shared_reader(num_threads: int | None = None) -> _core.ShardReader:
    """The process's ShardReader for `num_threads` (0 or None: one per core).

    One pool of threads serves every dataset; the reader rebuilds it by itself
    in a forked child (a DataLoader worker), so this is safe across fork.
    """
    key = (num_threads or 0, 256)
    with _readers_lock:
        reader = _readers.get(key)
        if reader is None:
            reader = _readers[key] = _core.ShardReader(*key)
        return reader


def aligned_offsets(lengths: np.ndarray) -> tuple[np.ndarray, int]:
    """Offsets that put pieces of `lengths` bytes back to back, each ALIGN-aligned, and
    the bytes they take in all."""
    padded = (lengths + (ALIGN - 1)) & ~np.uint64(ALIGN - 1)
    ends = np.cumsum(padded, dtype=np.uint64)
    starts = ends - padded
    return starts, int(ends[-1]) if len(ends) else 0


class Dataset:
    """Every sample of `source`: ``len(ds)``, ``ds[i]``, ``ds.get_batch(indices)``.

    ``ds[i]`` is a dict: ``"__key__"`` (str) and one entry per field: a 1-D uint8 numpy
    array viewing the bytes (zero-copy), or for ``.npy`` shards a typed numpy array.
    """

    def __init__(
        self,
        source: Source,
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | None = None,
        num_threads: int | None = None,
        fetch: FetchOptions | None = None,
    ) -> None:
        self.source = source
        self.cache_dir = cache_dir
        self.cache_limit = cache_limit
        self.num_threads = num_threads
        options = fetch or FetchOptions()

        def read_url(url: str) -> bytes:
            fetcher = fetcher_for(options)
            return fetcher.call(fetcher.read_all(url))

        shards = resolve(source, read_url)
        paths = [path for path, _ in shards]
        formats = [format_of(path) for path in paths]
        remote_ids = [i for i, path in enumerate(paths) if is_url(path)]
        local_ids = [i for i, path in enumerate(paths) if not is_url(path)]
        for i in local_ids:
            _check_manifest_size(paths[i], shards[i][1])
        indexes: list[dict] = [{} for _ in paths]
        identities = np.zeros((len(paths), 3), np.int64)
        # Shards a manifest describes open without a scan: each is indexed when a batch
        # first reads it.
        lazy = [i for i in local_ids if _describes(shards[i][1])]
        for i in lazy:
            entry = shards[i][1]
            indexes[i] = {"format": formats[i], "samples": entry["samples"]}
            indexes[i]["fields"] = entry.get("fields")
        described = set(lazy)
        scan = [i for i in local_ids if i not in described]
        found = _core.index_shards(
            [paths[i] for i in scan], [formats[i] for i in scan], num_threads or 0
        )
        for i, index in zip(scan, found):
            indexes[i] = index
            identities[i] = index["identity"]
        self._remote: RemoteShards | None = None
        self._remote_of: dict[int, int] = {}  # shard -> its number among the remote ones
        if remote_ids:
            remote = RemoteShards(
                [_remote_shard(paths[i], formats[i], shards[i][1]) for i in remote_ids],
                cache_dir,
                cache_limit,
                options,
            )
            remote.describe()
            for r, i in enumerate(remote_ids):
                shard = remote.shards[r]
                indexes[i] = {
                    "format": formats[i],
                    "samples": shard.samples,
                    "fields": shard.fields,
                }
                paths[i] = remote.path_of(r)
                self._remote_of[i] = r
            self._remote = remote
            largest = max(s.size or 0 for s in remote.shards)
            if remote.limit < 2 * largest:
                raise StokerError(
                    f"cache_limit={remote.limit} bytes cannot hold two of these shards at "
                    f"once (one being read, one arriving): it needs at least {2 * largest}"
                )
        self._build(paths, identities, indexes)
        for shard, (_, entry) in enumerate(shards):
            runs = (entry or {}).get("key_runs")
            if isinstance(runs, int) and runs > entry.get("samples", runs):
                self._note_regrouped(shard, entry["samples"], runs)

    @classmethod
    def from_csv(
        cls,
        csv: str | os.PathLike[str],
        root: str | os.PathLike[str],
        *,
        num_threads: int | None = None,
    ) -> Dataset:
        """A CSV of ``filename,label`` rows and the folder of files it names.

        Each sample holds the file's bytes under its extension (``"png"``, ...) and the
        integer label under ``"label"``. A header row is detected and skipped.
        """
        names, labels = read_labels_csv(csv)
        return cls.from_files(root, names, labels, source=os.fspath(csv), num_threads=num_threads)

    @classmethod
    def from_files(
        cls,
        root: str | os.PathLike[str],
        names: Sequence[str],
        labels: Sequence[int] | np.ndarray | None = None,
        *,
        source: str | None = None,
        num_threads: int | None = None,
    ) -> Dataset:
        """One sample per file: ``root/name`` for each of `names` (key: the name up to its
        extension, field: the extension), with an integer ``"label"`` if `labels` is given.
        Files that cannot be read are reported together (the first few and the count)."""
        root = os.fspath(root)
        names = list(names)
        paths = [os.path.join(root, name) for name in names]
        identities, errors = _core.stat_files(paths, 0)
        missing = np.flatnonzero(errors)
        if len(missing):
            shown = ", ".join(paths[i] for i in missing[:5])
            raise located(
                ReadError,
                paths[missing[0]],
                0,
                f"{len(missing)} file(s) listed in {source or root} cannot be read "
                f"({os.strerror(int(errors[missing[0]]))}): {shown}",
            )
        sizes = identities[:, 1]

        self = cls.__new__(cls)
        self._remote, self._remote_of = None, {}
        self.source = source or root
        self.cache_dir = self.cache_limit = None
        self.num_threads = num_threads
        keys, fields = zip(*(_split_name(name) for name in names)) if names else ((), ())
        field_names = sorted(set(fields))
        field_id = {name: i for i, name in enumerate(field_names)}
        n = len(paths)
        index = {
            "format": "files",
            "keys": list(keys),
            "field_names": field_names,
            "sample_start": np.arange(n + 1, dtype=np.uint32),
            "member_field": np.array([field_id[f] for f in fields], dtype=np.uint16),
            "member_offset": np.zeros(n, np.uint64),
            "member_length": sizes.astype(np.uint64),
            "member_out_length": sizes.astype(np.uint64),
            "member_codec": np.zeros(n, np.uint8),
            "member_crc": np.zeros(n, np.uint32),
        }
        # Every sample is its own file: file i holds exactly member i.
        self._build(paths, identities, [index], member_files=np.arange(n, dtype=np.uint32))
        if labels is not None:
            self._extras["label"] = np.asarray(labels, dtype=np.int64)
        return self

    # -- building the index --------------------------------------------------

    def _build(
        self,
        paths: list[str],
        identities: np.ndarray,
        indexes: list[dict],
        member_files: np.ndarray | None = None,
    ) -> None:
        """The columnar index of `indexes` (one per shard). A shard not yet local has a
        placeholder ``{"format", "samples", "fields"}``: its samples count, its members
        are added by _add_index once it is."""
        self._paths = paths
        self._formats = [str(index.get("format", "")) for index in indexes]  # per shard
        self._identities = identities
        self._index_lock_of: tuple[int, threading.RLock] = (os.getpid(), threading.RLock())
        # Reads check that each file is still the one indexed.
        self._files = _core.FileTable(paths, identities)
        self._field_names: list[str] = []
        self._field_ids: dict[str, int] = {}
        self._decoders: list[tuple[np.dtype, tuple[int, ...]] | None] = [None]
        self._decoder_ids: dict[tuple[str, tuple[int, ...]], int] = {}
        self._extras: dict[str, np.ndarray] = {}
        self._key_array: np.ndarray | None = None
        self._field_tables: dict[str, np.ndarray] = {}
        self._fields_known = True
        self._regroup_noted = False  # said once per dataset: see _note_regrouped
        counts = []
        for index in indexes:
            if "samples" in index:  # a placeholder
                counts.append(int(index["samples"]))
                if index.get("fields") is None:
                    self._fields_known = False
                for name in index.get("fields") or ():
                    self._field_id(name)
            elif index["format"] == "npy":
                counts.append(int(index["shape"][0]))
            else:
                counts.append(len(index["keys"]))
        self._shard_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        n = len(self)
        self._sample_first = np.full(n, -1, np.int64)
        self._sample_count = np.zeros(n, np.int64)
        self._indexed = np.zeros(len(indexes), bool)
        self._shard_keys: list[list[str] | None] = [None] * len(indexes)
        self._rows = 0
        self._columns = {name: np.zeros(0, dtype) for name, dtype in _MEMBER_COLUMNS.items()}
        self._append_rows({k: np.zeros(0, d) for k, d in _MEMBER_COLUMNS.items()}, 0)
        ready = [s for s, index in enumerate(indexes) if "samples" not in index]
        self._add_index(ready, [indexes[s] for s in ready], member_files)

    def _field_id(self, name: str) -> int:
        if name not in self._field_ids:
            self._field_ids[name] = len(self._field_names)
            self._field_names.append(name)
        return self._field_ids[name]

    def _add_index(
        self, shards: list[int], indexes: list[dict], member_files: np.ndarray | None = None
    ) -> None:
        """Add the members of `shards` (now local and indexed) to the columns."""
        parts: dict[str, list[np.ndarray]] = {name: [] for name in _MEMBER_COLUMNS}
        pointers = []
        base = self._rows
        for shard, index in zip(shards, indexes):
            first = int(self._shard_start[shard])
            expected = int(self._shard_start[shard + 1]) - first
            if index["format"] == "npy":
                n = int(index["shape"][0])
                row_shape = tuple(int(d) for d in index["shape"][1:])
                key = (index["descr"], row_shape)
                if key not in self._decoder_ids:
                    try:
                        dtype = np.dtype(index["descr"])
                    except (TypeError, ValueError) as e:
                        raise located(
                            ShardFormatError,
                            self._shard_name(shard),
                            0,
                            f"the .npy header's dtype {index['descr']!r} is not one numpy "
                            f"knows ({e})",
                        ) from e
                    self._decoder_ids[key] = len(self._decoders)
                    self._decoders.append((dtype, row_shape))
                row = np.uint64(index["row_bytes"])
                cols = {
                    "offset": np.uint64(index["data_offset"]) + np.arange(n, dtype=np.uint64) * row,
                    "length": np.full(n, row, np.uint64),
                    "out": np.full(n, row, np.uint64),
                    "codec": np.zeros(n, np.uint8),
                    "crc": np.zeros(n, np.uint32),
                    "field": np.full(n, self._field_id("npy"), np.int32),
                    "decoder": np.full(n, self._decoder_ids[key], np.int32),
                }
                per_sample = np.ones(n, np.int64)
            else:
                n = len(index["keys"])
                m = len(index["member_offset"])
                lookup = np.array([self._field_id(f) for f in index["field_names"]], np.int32)
                cols = {
                    "offset": index["member_offset"],
                    "length": index["member_length"],
                    "out": index["member_out_length"],
                    "codec": index["member_codec"],
                    "crc": index["member_crc"],
                    "field": lookup[index["member_field"]] if m else np.zeros(0, np.int32),
                    "decoder": np.zeros(m, np.int32),
                }
                per_sample = np.diff(index["sample_start"].astype(np.int64))
                self._shard_keys[shard] = index["keys"]
                runs = int(index.get("key_runs", n))
                if runs > n:
                    self._note_regrouped(shard, n, runs)
                if n != expected and runs == expected:
                    raise located(
                        ShardFormatError,
                        self._shard_name(shard),
                        0,
                        f"holds {n} samples but its manifest says {expected}: the manifest was "
                        "written by a stoker that did not yet put a sample's scattered members "
                        "together; write it again with `stoker index`",
                    )
            if n != expected:
                raise located(
                    ShardFormatError,
                    self._shard_name(shard),
                    0,
                    f"holds {n} samples but {expected} were expected (manifest or first look): "
                    "the shard changed",
                )
            m = len(cols["offset"])
            cols["file"] = np.full(m, shard, np.uint32)
            cols["sample"] = first + np.repeat(np.arange(n, dtype=np.int64), per_sample)
            starts = np.concatenate([[0], np.cumsum(per_sample)[:-1]]).astype(np.int64)
            pointers.append((first, n, base + starts, per_sample))
            base += m
            for name in _MEMBER_COLUMNS:
                parts[name].append(cols[name])
        if member_files is not None:
            parts["file"] = [member_files]
        added = base - self._rows
        if added:
            self._append_rows({k: np.concatenate(v) for k, v in parts.items()}, added)
        # Only now that their rows exist may samples point at them: another thread may
        # be reading other samples meanwhile.
        for first, n, sample_first, per_sample in pointers:
            self._sample_first[first : first + n] = sample_first
            self._sample_count[first : first + n] = per_sample
        for name, table in list(self._field_tables.items()):  # keep built tables current
            self._fill_field_table(name, table, self._rows - added, self._rows)
        if self._key_array is not None:
            for shard in shards:
                self._fill_keys(shard)
        self._indexed[shards] = True

    def _note_regrouped(self, shard: int, samples: int, runs: int) -> None:
        """Say once per dataset that a shard stored samples' members apart."""
        if self._regroup_noted:
            return
        self._regroup_noted = True
        log.warning(
            "%s: some samples' members are stored apart (as `zip -r` and tar without "
            "--sort=name store them); stoker groups them by key into %d samples, where "
            "WebDataset, which groups adjacent members only, would read %d. (Said once per "
            "dataset; `stoker inspect` lists every such shard.)",
            self._shard_name(shard),
            samples,
            runs,
        )

    def _append_rows(self, new: dict[str, np.ndarray], added: int) -> None:
        # Amortised growth: a remote dataset adds one shard's members at a time.
        capacity = len(self._columns["offset"])
        if self._rows + added > capacity:
            grown = max(self._rows + added, 2 * capacity)
            for name, dtype in _MEMBER_COLUMNS.items():
                column = np.zeros(grown, dtype)
                column[: self._rows] = self._columns[name][: self._rows]
                self._columns[name] = column
        for name, dtype in _MEMBER_COLUMNS.items():
            self._columns[name][self._rows : self._rows + added] = new[name].astype(dtype)
        self._rows += added
        c, r = self._columns, self._rows
        self._m_file, self._m_offset, self._m_length = (
            c["file"][:r],
            c["offset"][:r],
            c["length"][:r],
        )
        self._m_out, self._m_codec, self._m_crc = c["out"][:r], c["codec"][:r], c["crc"][:r]
        self._m_field, self._m_decoder = c["field"][:r], c["decoder"][:r]
        self._m_sample = c["sample"][:r]

    # -- the public surface --------------------------------------------------

    def __len__(self) -> int:
        return int(self._shard_start[-1])

    @property
    def fields(self) -> list[str]:
        """Every field name some sample has (plus extras such as ``label``)."""
        return [*self._field_names, *self._extras]

    @property
    def shards(self) -> list[str]:
        """The shard files or URLs (for a CSV dataset: the sample files)."""
        return [self._shard_name(s) for s in range(len(self._paths))]

    def _shard_name(self, shard: int) -> str:
        """Shard `shard` as the user named it: its URL if remote, else its path."""
        r = self._remote_of.get(shard)
        return self._paths[shard] if r is None else self._remote.shards[r].url  # type: ignore[union-attr]

    def key(self, i: int) -> str:
        return self.keys([self._check_index(i)])[0]

    def keys(self, indices: Sequence[int] | np.ndarray) -> list[str]:
        """Keys of samples `indices` (non-negative)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if not self._indexed[self.shards_of(idx)].all():
            if self._remote is not None:
                with self._holding(idx):  # a remote shard's keys are known once it is here
                    return self.keys(idx)
            self._ensure_local(idx)
        if self._key_array is None:  # built on first use: one array lookup per batch after
            with self._index_lock:
                if self._key_array is None:
                    keys = np.empty(len(self), dtype=object)
                    self._key_array = keys
                    for shard in np.flatnonzero(self._indexed).tolist():
                        self._fill_keys(shard)
        return self._key_array[idx].tolist()

    def _fill_keys(self, shard: int) -> None:
        assert self._key_array is not None
        first, end = int(self._shard_start[shard]), int(self._shard_start[shard + 1])
        keys = self._shard_keys[shard]
        if keys is None:  # rows of a .npy shard
            name = self._shard_name(shard).rsplit("/", 1)[-1]
            stem = os.path.splitext(name)[0]
            keys = [f"{stem}/{row}" for row in range(end - first)]
        self._key_array[first:end] = keys

    @overload
    def __getitem__(self, i: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, i: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, i: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        """Sample `i`, or the samples of a slice (read as one batch)."""
        if isinstance(i, slice):
            return self.get_batch(np.arange(len(self))[i])
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
            raise UsageError(
                f"a Dataset is indexed by an int or a slice, not a {type(i).__name__}: use "
                "ds.get_batch(indices) for a list of samples"
            )
        return self.get_batch([i])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """What torch's DataLoader asks a dataset for a whole batch: one read, not one
        per sample."""
        return self.get_batch(indices)

    def get_batch(self, indices: Sequence[int] | np.ndarray) -> list[dict[str, Any]]:
        """Samples `indices`, read with one call to the C++ reader.

        All values view one buffer for the batch: no copy per sample.
        """
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(self)
        if len(idx) and (idx.min() < -n or idx.max() >= n):
            bad = int(idx[(idx < -n) | (idx >= n)][0])
            raise IndexError(f"sample {bad} out of range for a dataset of {n}")
        idx = np.where(idx < 0, idx + n, idx)
        with self._holding(idx):
            rows, bounds = self._member_rows(idx)
            buffer = self._submit_members(rows).wait()
            return self._samples_from(buffer, idx, rows, bounds)

    # -- internals the loader builds on ---------------------------------------

    def _field_rows(self, name: str, idx: np.ndarray) -> np.ndarray:
        """The member row holding field `name` of each sample of `idx` (-1: it has none)."""
        self._ensure_local(idx)
        table = self._field_tables.get(name)
        if table is None:
            with self._index_lock:
                table = self._field_tables.get(name)
                if table is None:
                    table = np.full(len(self), -1, np.int64)
                    self._fill_field_table(name, table, 0, self._rows)
                    self._field_tables[name] = table
        return table[idx]

    def _fill_field_table(self, name: str, table: np.ndarray, lo: int, hi: int) -> None:
        field = self._field_ids.get(name)
        if field is None:
            return
        hits = lo + np.flatnonzero(self._m_field[lo:hi] == field)
        table[self._m_sample[hits]] = hits

    def _check_index(self, i: int) -> int:
        n = len(self)
        i = int(i)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for a dataset of {n}")
        return i + n if i < 0 else i

    def shards_of(self, idx: np.ndarray) -> np.ndarray:
        """The shard of each sample in `idx`."""
        return np.searchsorted(self._shard_start, idx, side="right") - 1

    def _ensure_local(self, idx: np.ndarray) -> None:
        """Every shard of samples `idx` indexed: local ones a manifest described are
        indexed now; remote ones must be held already (see _holding)."""
        if self._indexed.all() or len(idx) == 0:
            return
        shards = np.unique(self.shards_of(idx))
        missing = shards[~self._indexed[shards]].tolist()
        local = [s for s in missing if s not in self._remote_of]
        if local:
            with self._index_lock:
                local = [s for s in local if not self._indexed[s]]
                found = _core.index_shards(
                    [self._paths[s] for s in local],
                    [self._formats[s] for s in local],
                    self.num_threads or 0,
                )
                self._add_index(local, found)
                identities = self._identities.copy()
                for s, index in zip(local, found):
                    identities[s] = index["identity"]
                self._files = _core.FileTable(self._paths, identities)
                self._identities = identities
        remote = [s for s in missing if s in self._remote_of]
        if remote:
            raise StokerError(
                f"internal: shard {self._shard_name(remote[0])} is read before it is local"
            )

    @contextlib.contextmanager
    def _holding(self, idx: np.ndarray) -> Iterator[None]:
        """Remote shards of `idx` held in the cache (fetched if need be) for the block."""
        if self._remote is None or len(idx) == 0:
            yield
            return
        shards = [s for s in np.unique(self.shards_of(idx)).tolist() if s in self._remote_of]
        futures = [self._start_fetch(s) for s in shards]
        held = []
        try:
            for shard, future in zip(shards, futures):
                result = wait_result(future)
                held.append(shard)  # ours to release from here on, whatever happens
                self._shard_arrived(shard, result)
            yield
        finally:
            for shard in held:
                self._release(shard)
            for shard, future in zip(shards[len(held) :], futures[len(held) :]):
                future.add_done_callback(_release_when_done(self, shard))

    def _start_fetch(
        self, shard: int, priority: tuple[int, int] = (0, 0)
    ) -> concurrent.futures.Future:
        """Hold `shard` (remote) in the cache; the future's result is (hold, index or None)
        with the index made on the shard thread when this process has none yet. Downloads
        start in `priority` order (lowest first)."""
        assert self._remote is not None
        remote = self._remote
        r = self._remote_of[shard]
        fmt = remote.shards[r].format

        def then(hold: Hold) -> tuple[Hold, dict | None]:
            # The cache file changes only by a new download; with a sha256 that is the
            # same bytes. Otherwise its index is made again, to compare.
            if self._indexed[shard] and (
                tuple(self._identities[shard]) == hold.identity or remote.shards[r].sha256
            ):
                return hold, None
            try:
                return hold, _core.index_shards([hold.path], [fmt], 1)[0]
            except BaseException:
                remote.release(r)
                raise

        return remote.start(r, then, priority)

    def _shard_arrived(self, shard: int, result: tuple[Hold, dict | None]) -> None:
        """A fetched shard is held: index it (first time) or check it is the same. On an
        error the hold stays the caller's to release."""
        hold, index = result
        with self._index_lock:  # threads reading the dataset share its index
            if index is not None:
                if not self._indexed[shard]:
                    self._add_index([shard], [index])
                elif not self._same_index(shard, index):
                    raise located(
                        FetchError,
                        self._shard_name(shard),
                        0,
                        "fetched again, the shard's members differ from the first time: it "
                        "changed on the server (a manifest with sha256 pins it)",
                    )
            if tuple(self._identities[shard]) != hold.identity:
                identities = self._identities.copy()
                identities[shard] = hold.identity
                self._files = _core.FileTable(self._paths, identities)
                self._identities = identities

    def _same_index(self, shard: int, index: dict) -> bool:
        first, end = int(self._shard_start[shard]), int(self._shard_start[shard + 1])
        rows, _ = self._member_rows(np.arange(first, end, dtype=np.int64))
        if index["format"] == "npy":
            return bool(
                len(rows) == int(index["shape"][0])
                and (not len(rows) or int(self._m_offset[rows[0]]) == int(index["data_offset"]))
            )
        return bool(
            np.array_equal(self._m_offset[rows], index["member_offset"])
            and np.array_equal(self._m_length[rows], index["member_length"])
        )

    def _release(self, shard: int) -> None:
        assert self._remote is not None
        if self._remote.release(self._remote_of[shard]):
            # Close our cached descriptor too, or an evicted file's space stays in use.
            for reader in all_readers():
                reader.forget(self._paths[shard])

    def _member_rows(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Member rows of samples `idx`, in order, and where each sample's rows start."""
        self._ensure_local(idx)
        starts = self._sample_first[idx]
        counts = self._sample_count[idx]
        bounds = np.zeros(len(idx) + 1, np.int64)
        np.cumsum(counts, out=bounds[1:])
        rows = np.arange(bounds[-1], dtype=np.int64) + np.repeat(starts - bounds[:-1], counts)
        return rows, bounds

    def _submit_members(
        self,
        rows: np.ndarray,
        dest: np.ndarray | None = None,
        size: int | None = None,
        codecs: np.ndarray | None = None,
        out: np.ndarray | None = None,
        offsets: np.ndarray | None = None,
        lengths: np.ndarray | None = None,
        reader: _core.ShardReader | None = None,
        into: np.ndarray | None = None,
    ) -> _core.PendingRead:
        """Start reading member `rows`; by default each lands, as stored, at the next aligned
        offset of a new buffer (of `into`, a buffer of at least `size` bytes, when given).
        `codecs` and `out` (decoded lengths) override how members are decoded, `offsets` and
        `lengths` which bytes of them are read."""
        if out is None:
            out = self._m_out[rows]
        if dest is None:
            dest, size = aligned_offsets(out)
        if codecs is None:
            codecs = self._m_codec[rows]
        compressed = bool((codecs != _CODEC_STORED).any())
        reader = reader or shared_reader(self.num_threads)
        pieces = (
            self._files,
            self._m_file[rows],
            self._m_offset[rows] if offsets is None else offsets,
            self._m_length[rows] if lengths is None else lengths,
            dest,
        )
        decoding = {
            "out_lengths": out,
            "codecs": codecs if compressed else None,
            "crcs": self._m_crc[rows] if compressed else None,
        }
        if into is not None:
            return reader.read_into(into, *pieces, **decoding)
        return reader.read(*pieces, size, **decoding)

    def _samples_from(
        self, buffer: np.ndarray, idx: np.ndarray, rows: np.ndarray, bounds: np.ndarray
    ) -> list[dict[str, Any]]:
        """Sample dicts viewing `buffer`, as read by _submit_members(rows) by default."""
        starts, _ = aligned_offsets(self._m_out[rows])
        fields = self._m_field[rows].tolist()
        decoders = self._m_decoder[rows].tolist()
        begins = starts.tolist()
        lengths = self._m_out[rows].tolist()
        bounds = bounds.tolist()
        extras = {name: values[idx].tolist() for name, values in self._extras.items()}
        samples = []
        for s, key in enumerate(self.keys(idx)):
            sample: dict[str, Any] = {"__key__": key}
            for m in range(bounds[s], bounds[s + 1]):
                view = buffer[begins[m] : begins[m] + lengths[m]]
                decoder = self._decoders[decoders[m]]
                if decoder is not None:
                    dtype, shape = decoder
                    view = view.view(dtype).reshape(shape)
                sample[self._field_names[fields[m]]] = view
            for name, values in extras.items():
                sample[name] = values[s]
            samples.append(sample)
        return samples

    @property
    def _index_lock(self) -> threading.RLock:
        """Guards index growth. A forked child gets its own: another thread of the parent
        may have held this one at the fork."""
        pid, lock = self._index_lock_of
        if pid != os.getpid():
            lock = threading.RLock()
            self._index_lock_of = (os.getpid(), lock)
        return lock

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_index_lock_of"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._index_lock_of = (os.getpid(), threading.RLock())

    def __repr__(self) -> str:
        return f"Dataset({len(self)} samples in {len(self._paths)} files, fields {self.fields})"


def read_labels_csv(path: str | os.PathLike[str]) -> tuple[list[str], np.ndarray]:
    """The file names and integer labels of a ``filename,label`` CSV (a header row is
    detected and skipped, blank lines ignored). Every bad row is found in one pass and
    reported with its line number: the first few and the count."""
    path = os.fspath(path)
    rows: list[tuple[int, list[str]]] = []
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv_module.reader(f)
            for row in reader:
                if any(cell.strip() for cell in row):
                    rows.append((reader.line_num, [cell.strip() for cell in row]))
    except (UnicodeDecodeError, csv_module.Error) as e:
        raise located(ShardFormatError, path, 0, f"not a filename,label CSV: {e}") from e
    wrong = [(line, row) for line, row in rows if len(row) != 2]
    if wrong:
        line, row = wrong[0]
        raise located(
            ShardFormatError,
            path,
            0,
            f"not a filename,label CSV: line {line} has {len(row)} fields "
            f"({len(wrong)} such row(s))",
        )
    if rows and not _is_integer(rows[0][1][1]):  # a header row
        rows = rows[1:]
    bad = [
        (line, name, label) for line, (name, label) in rows if not name or not _is_integer(label)
    ]
    if bad:
        shown = ", ".join(f"line {line}: {name!r},{label!r}" for line, name, label in bad[:5])
        raise located(
            ShardFormatError,
            path,
            0,
            f"{len(bad)} row(s) without a file name or an integer label ({shown})",
        )
    return [name for _, (name, _) in rows], np.array([int(row[1]) for _, row in rows], np.int64)


def _is_integer(text: str) -> bool:
    text = text.strip()
    if text and text[0] in "+-":
        text = text[1:]
    return text.isascii() and text.isdigit()


def _split_name(name: str) -> tuple[str, str]:
    """Key and field of a file name, by the same rule as shard members."""
    folder, base = os.path.split(name)
    stem, dot, ext = base.partition(".")
    if not dot or not stem:
        stem, ext = base, "bin"
    return (os.path.join(folder, stem) if folder else stem), ext.lower()


def _describes(entry: dict | None) -> bool:
    """Whether a manifest entry says enough to open its shard without a scan."""
    return bool(entry) and isinstance(entry.get("samples"), int) and "bytes" in entry


def _check_manifest_size(path: str, entry: dict | None) -> None:
    """A shard a manifest lists is there, and as large as the manifest says."""
    if entry is None:
        return  # not from a manifest: the index parser reports a missing file
    try:
        actual = os.stat(path).st_size
    except FileNotFoundError:
        folder = os.path.dirname(path) or "."
        raise located(
            ReadError,
            path,
            0,
            "the manifest lists this shard but it is not there; run `stoker index "
            f"{folder}` to write the manifest again",
            errno.ENOENT,
        ) from None
    except OSError:
        return  # the index parser reports it with its errno
    if "bytes" in entry and actual != entry["bytes"]:
        raise located(
            ShardFormatError,
            path,
            min(actual, entry["bytes"]),
            f"the manifest says {entry['bytes']} bytes but the file has {actual}",
        )


def _remote_shard(url: str, fmt: str, entry: dict | None) -> RemoteShard:
    shard = RemoteShard(url=url, format=fmt)
    if entry:
        apply_entry(shard, entry)
    return shard


def _release_when_done(ds: Dataset, shard: int) -> Callable[[concurrent.futures.Future], None]:
    # A fetch left behind by an error: whatever it held is let go when it ends.
    def done(future: concurrent.futures.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            ds._release(shard)

    return done
