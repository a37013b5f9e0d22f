"""The member table: where every member (one field of one sample) of a dataset lies.

One row per member, in named numpy columns; per sample, where its rows start and how many
it has; per shard, whether it is indexed yet. It is the one interface between a dataset's
index and everything that reads (the Loader's plan, ``get_batch``, the tools): nothing
outside ``stoker.dataset`` reaches past its methods and properties.

Rows are only ever added (a shard a manifest described, or a remote one, is indexed when
first read), under a lock; a column seen by a reader is never changed where it has been
filled, so threads may read samples while others are added.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from stoker import _core
from stoker._process import ProcessLocal
from stoker.errors import ShardFormatError, located

#: What adding shards found that a user should hear: (kind, shard, detail, detail).
Note = tuple[str, int, int, int]

#: The member columns and their types.
MEMBER_COLUMNS = {
    "file": np.uint32,  # index into the table's files
    "offset": np.uint64,  # where the member's bytes start in its file
    "length": np.uint64,  # bytes on disk
    "out": np.uint64,  # bytes once decoded
    "codec": np.uint8,  # _core.Codec
    "crc": np.uint32,  # zip's CRC-32, checked for compressed members
    "field": np.int32,  # index into field_names
    "decoder": np.int32,  # index into decoders (0: bytes as they are)
    "sample": np.int64,  # the sample the member belongs to
    "array": np.uint32,  # ARRAY_ROW members: index into the table's arrays
}


class MemberTable:
    """Every member of every indexed shard, and how samples map to them. Each column of
    MEMBER_COLUMNS is an attribute (a view of every row so far, not to be written to).

    `shard_counts` is each shard's number of samples (known before its members are), and
    `names` each shard as the user knows it (its URL, for a remote one); `paths` are the
    files member rows refer to (a remote shard's copy in the cache; for a dataset of loose
    files, one per sample), with the `identities` they were indexed as.
    """

    file: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    out: np.ndarray
    codec: np.ndarray
    crc: np.ndarray
    field: np.ndarray
    decoder: np.ndarray
    sample: np.ndarray
    array: np.ndarray

    def __init__(
        self,
        shard_counts: Sequence[int],
        names: list[str],
        paths: list[str],
        identities: np.ndarray,
        formats: list[str],
        field_names: Sequence[str] = (),
        fields_known: bool = True,
    ) -> None:
        self.names = names
        self.paths = paths
        self.formats = formats  # per shard
        self.identities = identities
        #: The layouts of array sources' chunked arrays, which ARRAY_ROW members name.
        self.arrays: list[_core.ArrayLayout] = []
        self.files = _core.FileTable(paths, identities)  # reads check each file is as indexed
        self.shard_start = np.concatenate([[0], np.cumsum(shard_counts)]).astype(np.int64)
        n = int(self.shard_start[-1])
        self.sample_first = np.full(n, -1, np.int64)
        self.sample_count = np.zeros(n, np.int64)
        self.indexed = np.zeros(len(shard_counts), bool)
        self.complete = len(shard_counts) == 0  # every shard indexed
        self.field_names: list[str] = []
        self._field_ids: dict[str, int] = {}
        for name in field_names:
            self.field_id(name)
        self.fields_known = fields_known  # every shard's field names are known
        #: (dtype, row shape) of each typed decoder: rows of .npy shards. 0 is raw bytes.
        self.decoders: list[tuple[np.dtype, tuple[int, ...]] | None] = [None]
        self._decoder_ids: dict[tuple[str, tuple[int, ...]], int] = {}
        #: Integer columns of the dataset (a CSV's labels): one value per sample.
        self.extras: dict[str, np.ndarray] = {}
        self._shard_keys: list[list[str] | None] = [None] * len(shard_counts)
        self._group_rows: dict[int, int] = {}  # array sources read by chunk: rows per group
        self._key_array: np.ndarray | None = None
        self._field_tables: dict[str, np.ndarray] = {}
        self._rows = 0
        self._columns = {name: np.zeros(0, dtype) for name, dtype in MEMBER_COLUMNS.items()}
        self._show_rows()
        self._lock = ProcessLocal(threading.RLock)
        self._plan_columns: tuple[int, Any] | None = None
        self._version = 0  # moves on whenever rows, files or decoders change

    # -- the columns ---------------------------------------------------------------

    def __len__(self) -> int:
        """Samples."""
        return int(self.shard_start[-1])

    @property
    def rows(self) -> int:
        """Member rows so far."""
        return self._rows

    def plan_columns(self) -> _core.MemberColumns:
        """The columns as a BatchPlan reads them; the same object until rows are added or
        a file changes."""
        cached = self._plan_columns
        if cached is not None and cached[0] == self._version:
            return cached[1]
        with self.lock:
            key = self._version
            decoders = self.decoders[1:]
            columns = _core.MemberColumns(
                {name: getattr(self, name) for name in MEMBER_COLUMNS if name != "sample"},
                self.sample_first,
                self.files,
                [0] + [int(np.prod(shape, dtype=np.int64)) * d.itemsize for d, shape in decoders],
                [""] + [f"{shape} {d}" for d, shape in decoders],
            )
            self._plan_columns = (key, columns)
            return columns

    @property
    def lock(self) -> threading.RLock:
        """Guards growth (this process's: a forked child makes its own)."""
        return self._lock.get()

    def field_id(self, name: str) -> int:
        if name not in self._field_ids:
            self._field_ids[name] = len(self.field_names)
            self.field_names.append(name)
        return self._field_ids[name]

    def decoder_id(self, descr: str, row_shape: tuple[int, ...], name: str) -> int:
        """The decoder of rows of `descr` and `row_shape` (`name`: the shard, for errors)."""
        key = (descr, row_shape)
        if key not in self._decoder_ids:
            try:
                dtype = np.dtype(descr)
            except (TypeError, ValueError) as e:
                raise located(
                    ShardFormatError,
                    name,
                    0,
                    f"the .npy header's dtype {descr!r} is not one numpy knows ({e})",
                ) from e
            self._decoder_ids[key] = len(self.decoders)
            self.decoders.append((dtype, row_shape))
        return self._decoder_ids[key]

    def group_sizes(self) -> np.ndarray:
        """The sampler's groups of consecutive samples: each shard, except that the rows of
        an array source read by chunk are cut at the chunks of its costliest array, so
        that a shuffled epoch reads each chunk while its rows are being drawn (a shuffle
        over a whole file would decode a chunk for nearly every row it serves)."""
        sizes = np.diff(self.shard_start)
        cuts = self._group_rows
        if not cuts:
            return sizes
        out = []
        for shard, size in enumerate(sizes.tolist()):
            rows = cuts.get(shard)
            if rows is None or rows >= size:
                out.append(np.array([size], np.int64))
            else:
                whole, rest = divmod(size, rows)
                out.append(np.array([rows] * whole + ([rest] if rest else []), np.int64))
        return np.concatenate(out) if out else sizes

    def shards_of(self, indices: np.ndarray) -> np.ndarray:
        """The shard of each sample of `indices`."""
        return np.searchsorted(self.shard_start, indices, side="right") - 1

    def path_of_row(self, row: int) -> str:
        return self.paths[int(self.file[row])]

    # -- rows for samples ----------------------------------------------------------

    def member_rows(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Member rows of samples `indices` (indexed), in order, and where each sample's
        rows start."""
        starts = self.sample_first[indices]
        counts = self.sample_count[indices]
        bounds = np.zeros(len(indices) + 1, np.int64)
        np.cumsum(counts, out=bounds[1:])
        rows = np.arange(bounds[-1], dtype=np.int64) + np.repeat(starts - bounds[:-1], counts)
        return rows, bounds

    def field_rows(self, name: str, indices: np.ndarray) -> np.ndarray:
        """The row holding field `name` of each sample of `indices` (-1: it has none)."""
        return self.field_table(name)[indices]

    def field_table(self, name: str) -> np.ndarray:
        """Field `name`'s row for every sample (-1: none, or not indexed yet), built on
        first use and kept current as shards are indexed."""
        table = self._field_tables.get(name)
        if table is None:
            with self.lock:
                table = self._field_tables.get(name)
                if table is None:
                    table = np.full(len(self), -1, np.int64)
                    self._fill_field_table(name, table, 0, self._rows)
                    self._field_tables[name] = table
        return table

    def rows_for(self, alternatives: Sequence[str], indices: np.ndarray) -> np.ndarray:
        """For each sample of `indices`, the row of the first field of `alternatives` it
        has (-1: none of them)."""
        chosen = self.field_rows(alternatives[0], indices)
        for name in alternatives[1:]:
            lacking = np.flatnonzero(chosen < 0)
            if not len(lacking):
                break
            chosen[lacking] = self.field_rows(name, indices[lacking])
        return chosen

    def _fill_field_table(self, name: str, table: np.ndarray, lo: int, hi: int) -> None:
        field = self._field_ids.get(name)
        if field is None:
            return
        hits = lo + np.flatnonzero(self.field[lo:hi] == field)
        table[self.sample[hits]] = hits

    # -- keys ----------------------------------------------------------------------

    def keys(self, indices: np.ndarray) -> list[str]:
        """Keys of samples `indices` (of indexed shards)."""
        if self._key_array is None:  # built on first use: one array lookup per batch after
            with self.lock:
                if self._key_array is None:
                    keys = np.empty(len(self), dtype=object)
                    for shard in np.flatnonzero(self.indexed).tolist():
                        self._fill_keys(keys, shard)
                    self._key_array = keys
        return self._key_array[indices].tolist()

    def _fill_keys(self, keys: np.ndarray, shard: int) -> None:
        first, end = int(self.shard_start[shard]), int(self.shard_start[shard + 1])
        names = self._shard_keys[shard]
        if names is None:  # rows of a .npy shard
            stem = os.path.splitext(self.names[shard].rsplit("/", 1)[-1])[0]
            names = [f"{stem}/{row}" for row in range(end - first)]
        keys[first:end] = names

    # -- growth --------------------------------------------------------------------

    def add(
        self, shards: list[int], indexes: list[dict], member_files: np.ndarray | None = None
    ) -> list[Note]:
        """Add the members of `shards`, now local and indexed as `indexes`. Returns what a
        user should hear of them: ("regrouped", shard, samples, runs) for a shard whose
        samples' members lay apart (runs: the samples a reader of adjacent members only
        would see), ("stale-index", shard, state, 0) for one whose member index sidecar
        was not for it as it is now."""
        with self.lock:
            return self._add(shards, indexes, member_files)

    def _add(
        self, shards: list[int], indexes: list[dict], member_files: np.ndarray | None
    ) -> list[Note]:
        parts: dict[str, list[np.ndarray]] = {name: [] for name in MEMBER_COLUMNS}
        pointers = []
        notes: list[Note] = []
        base = self._rows
        for shard, index in zip(shards, indexes):
            name = self.names[shard]
            first = int(self.shard_start[shard])
            expected = int(self.shard_start[shard + 1]) - first
            if index["format"] == "npy":
                cols, n, per_sample = _npy_rows(self, index, name)
            elif index["format"] == "array":
                cols, n, per_sample = _array_rows(self, index, name)
                rows = _chunk_rows(index)
                if rows:
                    self._group_rows[shard] = rows
            else:
                cols, n, per_sample = _member_rows_of(self, index)
                keys = index["keys"]
                if index["format"] in ("mds", "litdata"):  # records: numbered in their shard
                    stem = os.path.splitext(os.path.basename(self.names[shard]))[0]
                    keys = [f"{stem}/{k}" for k in keys]
                self._shard_keys[shard] = keys
                runs = int(index.get("key_runs", n))
                if runs > n:
                    notes.append(("regrouped", shard, n, runs))
                found = index.get("sidecar", 0)
                if found in (_core.SidecarState.STALE, _core.SidecarState.DAMAGED):
                    notes.append(("stale-index", shard, int(found), 0))  # the shard was walked
                if n != expected and runs == expected:
                    raise located(
                        ShardFormatError,
                        name,
                        0,
                        f"holds {n} samples but its manifest says {expected}: the manifest was "
                        "written by a stoker that did not yet put a sample's scattered members "
                        "together; write it again with `stoker index`",
                    )
            if n != expected:
                raise located(
                    ShardFormatError,
                    name,
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
            for column in MEMBER_COLUMNS:
                parts[column].append(cols[column])
        if member_files is not None:
            parts["file"] = [member_files]
        if len(self.arrays) != len(self.files.arrays):
            self.files = _core.FileTable(self.paths, self.identities, self.arrays)
        added = base - self._rows
        if added:
            self._append({k: np.concatenate(v) for k, v in parts.items()}, added)
        # Only now that their rows exist may samples point at them: another thread may
        # be reading other samples meanwhile.
        for first, n, sample_first, per_sample in pointers:
            self.sample_first[first : first + n] = sample_first
            self.sample_count[first : first + n] = per_sample
        for field, table in list(self._field_tables.items()):  # keep built tables current
            self._fill_field_table(field, table, self._rows - added, self._rows)
        if self._key_array is not None:
            for shard in shards:
                self._fill_keys(self._key_array, shard)
        self.indexed[shards] = True
        self.complete = bool(self.indexed.all())
        return notes

    def _append(self, new: dict[str, np.ndarray], added: int) -> None:
        # Amortised growth: a remote dataset adds one shard's members at a time. A grown
        # column is a new array: readers holding the old one still see its rows.
        capacity = len(self._columns["offset"])
        if self._rows + added > capacity:
            grown = max(self._rows + added, 2 * capacity)
            for name, dtype in MEMBER_COLUMNS.items():
                column = np.zeros(grown, dtype)
                column[: self._rows] = self._columns[name][: self._rows]
                self._columns[name] = column
        for name, dtype in MEMBER_COLUMNS.items():
            self._columns[name][self._rows : self._rows + added] = new[name].astype(dtype)
        self._rows += added
        self._show_rows()
        self._version += 1

    def _show_rows(self) -> None:
        # A grown column is a new array: readers holding the old views still see their rows.
        for name in MEMBER_COLUMNS:
            setattr(self, name, self._columns[name][: self._rows])

    def set_identity(self, shard: int, identity: tuple[int, int, int]) -> None:
        """Shard `shard`'s file is now the one of `identity` (a remote shard fetched again):
        reads check against it."""
        with self.lock:
            if tuple(self.identities[shard]) != tuple(identity):
                identities = self.identities.copy()
                identities[shard] = identity
                self.files = _core.FileTable(self.paths, identities, self.arrays)
                self.identities = identities
                self._version += 1

    def index_local(self, shards: list[int], num_threads: int) -> list[Note]:
        """Index local shards a manifest described (when first read); returns what add()
        does. Shards indexed meanwhile by another thread are skipped."""
        with self.lock:
            todo = [s for s in shards if not self.indexed[s]]
            if not todo:
                return []
            found = _core.index_shards(
                [self.paths[s] for s in todo], [self.formats[s] for s in todo], num_threads
            )
            notes = self._add(todo, found, None)
            identities = self.identities.copy()
            for s, index in zip(todo, found):
                identities[s] = index["identity"]
            self.files = _core.FileTable(self.paths, identities, self.arrays)
            self.identities = identities
            self._version += 1
            return notes

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()  # (the lock is a ProcessLocal: the other side makes one)
        state["_plan_columns"] = None
        return state


def _npy_rows(table: MemberTable, index: dict, name: str) -> tuple[dict, int, np.ndarray]:
    """The member rows of a .npy shard's index: one per row, with a decoder for its dtype
    and row shape."""
    n = int(index["shape"][0])
    row_shape = tuple(int(d) for d in index["shape"][1:])
    row = np.uint64(index["row_bytes"])
    cols = {
        "offset": np.uint64(index["data_offset"]) + np.arange(n, dtype=np.uint64) * row,
        "length": np.full(n, row, np.uint64),
        "out": np.full(n, row, np.uint64),
        "codec": np.zeros(n, np.uint8),
        "crc": np.zeros(n, np.uint32),
        "field": np.full(n, table.field_id("npy"), np.int32),
        "decoder": np.full(n, table.decoder_id(index["descr"], row_shape, name), np.int32),
        "array": np.zeros(n, np.uint32),
    }
    return cols, n, np.ones(n, np.int64)


def _array_rows(table: MemberTable, index: dict, name: str) -> tuple[dict, int, np.ndarray]:
    """The member rows of an array source: per sample, one per field (array), each row
    read in place or as an ARRAY_ROW of the array's layout (which joins the table's)."""
    n = int(index["rows"])
    fields = index["fields"]
    k = len(fields)
    cols = {column: np.zeros(n * k, dtype) for column, dtype in MEMBER_COLUMNS.items()}
    for j, field in enumerate(fields):
        at = slice(j, n * k, k)  # sample-major: sample i's members are i*k .. i*k+k-1
        row_bytes = field.row_bytes
        cols["out"][at] = row_bytes
        cols["field"][at] = table.field_id(field.name)
        cols["decoder"][at] = table.decoder_id(field.dtype.str, field.row_shape, name)
        if field.layout is None:
            cols["offset"][at] = field.offsets
            cols["length"][at] = row_bytes
        else:
            cols["offset"][at] = np.arange(n, dtype=np.uint64)
            cols["codec"][at] = int(_core.Codec.ARRAY_ROW)
            cols["array"][at] = len(table.arrays)
            table.arrays.append(field.layout)
    return cols, n, np.full(n, k, np.int64)


def _chunk_rows(index: dict) -> int:
    """Rows per chunk of an array source's costliest array read by chunk (0: none is)."""
    chunked = [f.layout for f in index["fields"] if f.layout is not None]
    if not chunked:
        return 0
    costliest = max(chunked, key=lambda layout: layout.chunk_bytes)
    return int(costliest.chunk_shape[0])


def _member_rows_of(table: MemberTable, index: dict) -> tuple[dict, int, np.ndarray]:
    """The member rows of a tar or zip shard's index (or of loose files)."""
    n = len(index["keys"])
    m = len(index["member_offset"])
    lookup = np.array([table.field_id(f) for f in index["field_names"]], np.int32)
    cols = {
        "offset": index["member_offset"],
        "length": index["member_length"],
        "out": index["member_out_length"],
        "codec": index["member_codec"],
        "crc": index["member_crc"],
        "field": lookup[index["member_field"]] if m else np.zeros(0, np.int32),
        "decoder": np.zeros(m, np.int32),
        "array": np.zeros(m, np.uint32),
    }
    return cols, n, np.diff(index["sample_start"].astype(np.int64))


def same_index(table: MemberTable, shard: int, index: dict) -> bool:
    """Whether `index` (of the shard fetched again) lays its members out as before."""
    first, end = int(table.shard_start[shard]), int(table.shard_start[shard + 1])
    rows, _ = table.member_rows(np.arange(first, end, dtype=np.int64))
    if index["format"] == "npy":
        return bool(
            len(rows) == int(index["shape"][0])
            and (not len(rows) or int(table.offset[rows[0]]) == int(index["data_offset"]))
        )
    return bool(
        np.array_equal(table.offset[rows], index["member_offset"])
        and np.array_equal(table.length[rows], index["member_length"])
    )
