"""The member table: where every member (one field of one sample) of a dataset lies.

It costs memory in proportion to the shards in use, not to the dataset. From the start it
knows each shard's number of samples (so a sample's shard is one search of an array of
shards); the members of a shard are known only once the shard is indexed, and then held
as a ShardIndex of its own: its member columns (rows and samples numbered within the
shard), each sample's first row, each field's row per sample, and the keys. A table
(Parquet, Arrow) is held in pieces instead, each a run of its row groups (see
table_pieces), made from its metadata when a batch first reads one: a shuffled epoch reads
a file of a million rows a row group at a time, and then pays for the group it reads, not
for the file. Indexed shards and pieces are kept in a bounded least-recently-used set; one
let go of is indexed again from its member index sidecar, its header, the node cache's
copy or the table's metadata (milliseconds) when it is read again. A shard in use by a
hold (a remote shard being read) is never let go of, and neither are the few whose index
cannot be made again from a file (array sources, loose files). A batch being planned or
read keeps what it reads alive by itself.

It is the one interface between a dataset's index and everything that reads (the Loader's
plan, ``get_batch``, the tools), through ``stoker.dataset.Dataset``: nothing outside
``stoker.dataset`` reaches past its methods. Members are named outside a piece by a member
id, ``piece << 32 | row`` (a shard other than a table is one piece).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import stoker._core as _core
from stoker._columns import ComputedColumn
from stoker._process import ProcessLocal
from stoker.dataset.shard_rows import (
    MEMBER_COLUMNS,
    PIECE_MAX_ROWS,
    PIECE_MIN_ROWS,
    Note,
    ShardIndex,
    chunk_groups,
    chunk_rows,
    dtype_of,
    key_prefix,
    shard_index,
    table_pieces,
)
from stoker.errors import ShardFormatError, located
from stoker.formats import TABLE_SOURCES
from stoker.tables import index_table_source

#: Indexed shards kept beyond those in use, at the least (a Loader asks for more when its
#: shuffle window and read-ahead span more). About 2 MB each for shards of 10,000 samples.
DEFAULT_RESIDENT = 32
#: Pieces of tables kept, at the least, in a dataset with tables: about a quarter of a
#: million rows of small row groups, so that a file of some thousands of rows stays
#: indexed from one epoch to the next.
TABLE_RESIDENT = 256 * 1024 // PIECE_MIN_ROWS

#: Formats whose index can be made again from the shard's file (or its sidecar).
_REINDEXABLE = ("tar", "zip", "npy", "mds", "litdata", "parquet", "arrow")

#: A table's values whose size is not known until their pages are decoded (see size_values).
UNSIZED = np.uint64(np.iinfo(np.uint64).max)
#: The length of a table's value that size_values found null: nothing is read for it.
NULL_VALUE = np.uint64(np.iinfo(np.uint64).max - 1)

_ROW_BITS = 32
_ROW_MASK = (1 << _ROW_BITS) - 1


def member_id(shard: int | np.ndarray, row: int | np.ndarray) -> Any:
    """A member's name outside its piece (a shard, but for tables)."""
    return (np.int64(shard) << _ROW_BITS) | np.int64(row)


#: One piece's part of a set of samples: (its index, its samples, numbered within it,
#: where they stand in the set, the piece).
ShardPart = tuple[ShardIndex, np.ndarray, Any, int]


@dataclass
class Gathered:
    """The members of a set of samples, in order, each sample's consecutive: MEMBER_COLUMNS
    (``sample``: the dataset's numbers), where each sample's members start (`bounds`), and
    each member's id."""

    columns: dict[str, np.ndarray]
    bounds: np.ndarray
    ids: np.ndarray

    def __getattr__(self, name: str) -> np.ndarray:
        try:
            return self.__dict__["columns"][name]
        except KeyError:
            raise AttributeError(name) from None

    @classmethod
    def of(cls, n: int, parts: list[ShardPart]) -> Gathered:
        """The members of `n` samples, from each piece's part of them: (the piece's index,
        its samples among the n, numbered within it, where they stand among the n, the
        piece)."""
        firsts = np.zeros(n, np.int64)
        counts = np.zeros(n, np.int64)
        shard_of = np.zeros(n, np.int64)
        for index, local, where, shard in parts:
            firsts[where] = index.sample_first[local]
            counts[where] = index.sample_first[local + 1] - index.sample_first[local]
            shard_of[where] = shard
        bounds = np.zeros(n + 1, np.int64)
        np.cumsum(counts, out=bounds[1:])
        rows = np.arange(bounds[-1], dtype=np.int64) + np.repeat(firsts - bounds[:-1], counts)
        member_shard = np.repeat(shard_of, counts)
        columns = {name: np.zeros(len(rows), dtype) for name, dtype in MEMBER_COLUMNS.items()}
        for index, _, _, shard in parts:
            at = slice(None) if len(parts) == 1 else member_shard == shard
            picked = rows[at]
            for name, column in columns.items():
                column[at] = index.columns[name][picked]
            columns["sample"][at] += index.first_sample
        return cls(columns, bounds, member_id(member_shard, rows))


class MemberTable:
    """Every shard's sample count, and the members of the shards indexed now.

    `shard_start` is where each shard's samples start (and the last ends); `names` each
    shard as the user knows it (its URL, for a remote one); `paths` are the files member
    rows refer to (a remote shard's copy in the cache; for a dataset of loose files, one
    per sample), with the `identities` they were indexed as.
    """

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
        #: The layouts of Parquet files' columns, which COLUMN_VALUE members name: made once
        #: per (shard, field), as a table shard let go of is indexed again.
        self.columns: list[_core.ColumnLayout] = []
        self._column_ids: dict[tuple[int, str], int] = {}
        #: Table sources' indexes (their fields, from each file's metadata), by shard: read
        #: once at open, the members made from them whenever the shard is indexed.
        self.tables: dict[int, dict] = {}
        #: Columns of table sources that cannot be read, and why (for a fields= message).
        self.unusable: dict[str, str] = {}
        #: Table sources' fields of numbers, and their type: scalars', lists' elements'.
        self.table_dtypes: dict[str, np.dtype] = {}
        self.table_lists: dict[str, np.dtype] = {}
        self.files = _core.FileTable(paths, identities)  # reads check each file is as indexed
        #: The layouts `files` holds: (arrays, columns), the first so many of each list.
        self._files_holds = (0, 0)
        self.shard_start = np.zeros(len(shard_counts) + 1, np.int64)
        np.cumsum(np.asarray(shard_counts, np.int64), out=self.shard_start[1:])
        #: Each shard indexed at least once (its samples and fields checked).
        self.known = np.zeros(len(shard_counts), bool)
        #: The pieces: every shard one, until cut_table_pieces cuts tables into several.
        self.piece_start = self.shard_start.copy()
        self.piece_shard = np.arange(len(shard_counts), dtype=np.int64)
        self.shard_piece = np.arange(len(shard_counts) + 1, dtype=np.int64)
        self._is_table = np.array([f in TABLE_SOURCES for f in formats], bool)
        #: Indexed pieces, by piece; how many of them are tables'.
        self._resident: OrderedDict[int, ShardIndex] = OrderedDict()
        self._table_pieces_held = 0
        self._pins: dict[int, int] = {}  # by piece
        self.capacity = DEFAULT_RESIDENT  # indexed shards other than tables' pieces
        #: Indexed pieces of tables kept (see cut_table_pieces).
        self.table_capacity = DEFAULT_RESIDENT
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
        # Array sources read by chunk: rows per group; table sources: their row groups.
        self._group_rows: dict[int, int | np.ndarray] = {}
        self._lock = ProcessLocal(threading.RLock)
        self._plan_columns: tuple[int, Any] | None = None
        self._version = 0  # moves on whenever the indexed shards, files or decoders change

    # -- shards and samples ----------------------------------------------------------

    def __len__(self) -> int:
        """Samples."""
        return int(self.shard_start[-1])

    @property
    def lock(self) -> threading.RLock:
        """Guards changes (this process's: a forked child makes its own)."""
        return self._lock.get()

    def shards_of(self, indices: np.ndarray) -> np.ndarray:
        """The shard of each sample of `indices`."""
        return np.searchsorted(self.shard_start, indices, side="right") - 1

    def pieces_of(self, indices: np.ndarray) -> np.ndarray:
        """The piece of each sample of `indices`."""
        return np.searchsorted(self.piece_start, indices, side="right") - 1

    def cut_table_pieces(self) -> None:
        """Cut each table shard into pieces (see table_pieces): at its row groups where its
        metadata was read at open, else every PIECE_MAX_ROWS. Before any shard is indexed."""
        if not self._is_table.any():
            return
        assert not self._resident
        counts = np.diff(self.shard_start)
        sizes: list[np.ndarray] = [counts[s : s + 1] for s in range(len(counts))]
        known = {
            s: g
            for s, g in self._group_rows.items()
            if self._is_table[s] and isinstance(g, np.ndarray) and len(g)
        }
        # Most files' row groups are pieces as they are: told apart all at once (100,000
        # files, one at a time, took a second).
        if known:
            shards = np.fromiter(known, np.int64, len(known))
            flat = np.concatenate(list(known.values())).astype(np.int64)
            lengths = np.fromiter((len(g) for g in known.values()), np.int64, len(known))
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            odd = ((flat < PIECE_MIN_ROWS) | (flat > PIECE_MAX_ROWS)).astype(np.int64)
            as_they_are = (np.add.reduceat(odd, starts) == 0) & (
                np.add.reduceat(flat, starts) == counts[shards]
            )
            for s, g, whole in zip(shards.tolist(), known.values(), as_they_are.tolist()):
                sizes[s] = g.astype(np.int64) if whole else table_pieces(int(counts[s]), g)
        for s in np.flatnonzero(self._is_table).tolist():
            if s not in known:
                sizes[s] = table_pieces(int(counts[s]), None)
        per_shard = np.fromiter((len(p) for p in sizes), np.int64, len(sizes))
        self.shard_piece = np.zeros(len(counts) + 1, np.int64)
        np.cumsum(per_shard, out=self.shard_piece[1:])
        self.piece_shard = np.repeat(np.arange(len(counts), dtype=np.int64), per_shard)
        self.piece_start = np.zeros(int(self.shard_piece[-1]) + 1, np.int64)
        np.cumsum(np.concatenate(sizes), out=self.piece_start[1:])
        self.table_capacity = max(self.table_capacity, TABLE_RESIDENT)
        self._version += 1

    def group_sizes(self) -> np.ndarray:
        """The sampler's groups of consecutive samples: each shard, except that the rows of
        an array source read by chunk are cut at the chunks of its costliest array, so
        that a shuffled epoch reads each chunk while its rows are being drawn (a shuffle
        over a whole file would decode a chunk for nearly every row it serves)."""
        sizes = np.diff(self.shard_start)
        return chunk_groups(sizes, self._group_rows) if self._group_rows else sizes

    def field_id(self, name: str) -> int:
        if name not in self._field_ids:
            self._field_ids[name] = len(self.field_names)
            self.field_names.append(name)
        return self._field_ids[name]

    def field_ids(self, names: Sequence[str]) -> list[int]:
        """The ids of field `names` (-1 for one no shard indexed so far has)."""
        return [self._field_ids.get(name, -1) for name in names]

    def decoder_id(self, descr: str, row_shape: tuple[int, ...], name: str) -> int:
        """The decoder of rows of `descr` and `row_shape` (`name`: the shard, for errors)."""
        key = (descr, row_shape)
        if key not in self._decoder_ids:
            dtype = dtype_of(descr, name)
            self._decoder_ids[key] = len(self.decoders)
            self.decoders.append((dtype, row_shape))
            self._version += 1
        return self._decoder_ids[key]

    def column_id(self, shard: int, field: Any) -> int:
        """The COLUMN_VALUE layout of `field` (a TableField) of table shard `shard`."""
        key = (shard, field.name)
        found = self._column_ids.get(key)
        if found is None:
            units = field.units
            layout = _core.ColumnLayout(
                f"column {field.name}",
                shard,
                int(units[:, 1].sum()) if len(units) else 0,
                field.width,
                field.integer,
                units,
                *field.spec,
            )  # (checked here: one that raises is not numbered)
            found = self._column_ids[key] = len(self.columns)
            self.columns.append(layout)
        return found

    def add_tables(self, tables: dict[int, dict], at_open: bool = True) -> None:
        """Table shards' indexes: their members are made when each piece is indexed. Read
        at open, their row groups are the sampler's groups from the start (a table read
        later, a remote file fetched, leaves them as they were: the order is fixed)."""
        for shard, index in tables.items():
            if at_open:
                self._group_rows[shard] = index["groups"]
            if "like" in index:  # summed up from its footer: read when a batch first does
                continue
            self.tables[shard] = index
            for field in index["fields"]:
                if field.dtype is not None and not field.unusable:
                    types = self.table_lists if field.listed else self.table_dtypes
                    types.setdefault(field.name.lower(), field.dtype)
                if field.unusable:
                    self.unusable.setdefault(
                        field.name.lower(),
                        f"{self.names[shard]}: column {field.name!r} {field.unusable}",
                    )

    # -- the shards indexed now ------------------------------------------------------

    def resident(self, shard: int) -> ShardIndex | None:
        """Shard `shard`'s index if it is held now (and marked as just used); None for a
        table, which is held in pieces (see has_index, piece_index)."""
        return None if self._is_table[shard] else self.piece_index(int(self.shard_piece[shard]))

    def piece_index(self, piece: int) -> ShardIndex | None:
        """Piece `piece`'s index if it is held now (and marked as just used)."""
        found = self._resident.get(piece)
        if found is not None:
            self._resident.move_to_end(piece)
        return found

    def has_index(self, shard: int) -> bool:
        """Whether shard `shard`'s index is held now: its members, or a table's metadata."""
        if self._is_table[shard]:
            return shard in self.tables
        return int(self.shard_piece[shard]) in self._resident  # (no LRU move: called unlocked)

    def missing(self, pieces: np.ndarray) -> list[int]:
        """Those of `pieces` (unique) not indexed now."""
        resident = self._resident
        return [p for p in pieces.tolist() if p not in resident]

    @property
    def resident_count(self) -> int:
        """Pieces (shards, but for tables) whose index is held now."""
        return len(self._resident)

    def reserve(self, shards: int) -> None:
        """Hold at least `shards` indexed shards before letting any go (a reader that uses
        that many at once)."""
        self.capacity = max(self.capacity, int(shards))
        self.table_capacity = max(self.table_capacity, int(shards))

    def pin(self, shard: int) -> None:
        """Keep `shard`'s index (it must be indexed) until unpin: a hold reads it. (A
        table's pieces are made from its metadata, which is kept: it needs no pin.)"""
        if not self._is_table[shard]:
            self.pin_pieces([int(self.shard_piece[shard])])

    def unpin(self, shard: int) -> None:
        if not self._is_table[shard]:
            self.unpin_pieces([int(self.shard_piece[shard])])

    def pin_pieces(self, pieces: Sequence[int]) -> None:
        """Keep `pieces`' indexes (they must be indexed) until unpin_pieces."""
        with self.lock:
            for p in pieces:
                self._pins[p] = self._pins.get(p, 0) + 1

    def unpin_pieces(self, pieces: Sequence[int]) -> None:
        with self.lock:
            for p in pieces:
                left = self._pins.get(p, 0) - 1
                if left > 0:
                    self._pins[p] = left
                else:
                    self._pins.pop(p, None)
            self._let_go()

    def _let_go(self) -> None:
        """Drop the least recently used indexes past the capacity (tables' pieces: past
        theirs) that nothing pins and that can be made again."""
        held, tables = len(self._resident), self._table_pieces_held
        excess = {True: tables - self.table_capacity, False: held - tables - self.capacity}
        if excess[True] <= 0 and excess[False] <= 0:
            return
        for piece in list(self._resident):
            shard = int(self.piece_shard[piece])
            kind = bool(self._is_table[shard])
            if excess[kind] <= 0 or piece in self._pins or self.formats[shard] not in _REINDEXABLE:
                continue
            del self._resident[piece]
            self._table_pieces_held -= kind
            excess[kind] -= 1
            self._version += 1
            if excess[True] <= 0 and excess[False] <= 0:
                break

    def plan_columns(self) -> _core.MemberColumns:
        """The index as a BatchPlan reads it; the same object until shards are indexed or
        let go of, or a file changes."""
        cached = self._plan_columns
        if cached is not None and cached[0] == self._version:
            return cached[1]
        with self.lock:
            key = self._version
            # Only decoder 0 (bytes) has no type: every one after it was appended with one.
            decoders = [d for d in self.decoders[1:] if d is not None]
            columns = _core.MemberColumns(
                self.piece_start,
                {p: index.plan_columns() for p, index in self._resident.items()},
                self.files,
                # (A list's elements vary in number: its rows have no one size.)
                [0]
                + [
                    max(0, int(np.prod(shape, dtype=np.int64))) * d.itemsize
                    for d, shape in decoders
                ],
                [""] + [f"{shape} {d}" for d, shape in decoders],
            )
            self._plan_columns = (key, columns)
            return columns

    # -- members of samples (of indexed shards) --------------------------------------

    def _by_piece(self, indices: np.ndarray) -> list[ShardPart]:
        """(index, samples within the piece, where they are in `indices`, piece) per piece
        of `indices`; every one must be indexed."""
        pieces = self.pieces_of(indices)
        if len(pieces) and pieces[0] == pieces[-1] and (pieces == pieces[0]).all():
            groups = [(int(pieces[0]), slice(None))]
        else:
            groups = [(int(p), pieces == p) for p in np.unique(pieces).tolist()]
        out = []
        for piece, where in groups:
            index = self._resident.get(piece)
            if index is None:
                raise KeyError(piece)
            out.append((index, indices[where] - int(self.piece_start[piece]), where, piece))
        return out

    def gather(self, indices: np.ndarray) -> Gathered:
        """The members of samples `indices`, in order (their pieces indexed)."""
        return Gathered.of(len(indices), self._by_piece(indices))

    def size_values(
        self, indices: np.ndarray, field_ids: Sequence[int] | None, reader: _core.ShardReader
    ) -> None:
        """Find the sizes of the table values of samples `indices` (of fields `field_ids`,
        or all) not known yet: a Parquet column's text, bytes and lists are only sized by
        decoding their pages, which this does (once per unit, on the reader's threads,
        and kept in its cache for the read that follows). Their shards must be indexed.

        A null among them is marked (length NULL_VALUE, nothing to read): a sample dict
        leaves it out, as an Arrow file's nulls and a shard's missing members are; asked for
        by `field_ids` (a fields= plan), it is an error naming its sample."""
        todo: list[tuple[ShardIndex, np.ndarray]] = []
        for index, local, _, _ in self._by_piece(indices):
            if not index.unsized:
                continue
            wanted = index.unsized if field_ids is None else index.unsized & set(field_ids)
            for f in wanted:
                rows = index.field_rows[f][local]
                rows = rows[rows >= 0]
                if field_ids is not None:
                    nulls = rows[index.columns["length"][rows] == NULL_VALUE]
                    if len(nulls):
                        self._null_value(index, int(nulls[0]))
                rows = rows[index.columns["out"][rows] == UNSIZED]
                if len(rows):
                    todo.append((index, self._whole_units(index, f, rows)))
        if not todo:
            return
        columns = np.concatenate([index.columns["array"][rows] for index, rows in todo])
        values = np.concatenate([index.columns["offset"][rows] for index, rows in todo])
        sizes = reader.read_value_sizes(self.files, columns, values).wait().view(np.uint64)
        at = 0
        for index, rows in todo:
            got = sizes[at : at + len(rows)]
            at += len(rows)
            null = got == UNSIZED
            index.columns["out"][rows] = np.where(null, 0, got)
            index.columns["length"][rows] = np.where(null, NULL_VALUE, got)
            if field_ids is not None and null.any():
                self._null_value(index, int(rows[int(np.flatnonzero(null)[0])]))

    def _whole_units(self, index: ShardIndex, field: int, rows: np.ndarray) -> np.ndarray:
        """Member rows `rows` of `field` and every other row of the units their values lie
        in (those in the piece): a unit is decoded to size any of its values, and sizing all
        of them costs nothing more, where each would otherwise cost a batch a sizing read of
        its own."""
        column = self.columns[int(index.columns["array"][rows[0]])]
        units = column.units
        values = index.columns["offset"][rows]  # a table's value rows are its samples
        hit = np.unique(np.searchsorted(units[:, 0], values, side="right") - 1)
        starts, counts = units[hit, 0].astype(np.int64), units[hit, 1].astype(np.int64)
        samples = np.repeat(starts - np.cumsum(counts) + counts, counts) + np.arange(
            int(counts.sum()), dtype=np.int64
        )
        samples -= index.row_offset
        samples = samples[(samples >= 0) & (samples < index.samples)]
        members = index.field_rows[field][samples]
        members = members[members >= 0]
        return members[index.columns["out"][members] == UNSIZED]

    def _null_value(self, index: ShardIndex, row: int) -> None:
        columns = index.columns
        column = self.columns[int(columns["array"][row])]
        sample = index.first_sample + int(columns["sample"][row])
        value = int(columns["offset"][row])
        units = column.units
        unit = units[max(0, int(np.searchsorted(units[:, 0], value, side="right")) - 1)]
        raise located(
            ShardFormatError,
            self.paths[column.file],
            int(unit[2]),  # where the value's pages are
            f"{column.name}, row group {int(unit[6])}, row {value} (sample "
            f"{sample}) is null, and a batch asks for it: leave the field out, or fill its "
            "nulls (pyarrow.compute.fill_null) and write the file again",
        )

    def describe(self, member: int) -> tuple[str, str, int] | None:
        """The file, field name and sample of member id `member` (None if its piece is not
        indexed now)."""
        piece, row = int(member) >> _ROW_BITS, int(member) & _ROW_MASK
        index = self._resident.get(piece)
        if index is None or row >= index.rows:
            return None
        columns = index.columns
        return (
            self.paths[int(columns["file"][row])],
            self.field_names[int(columns["field"][row])],
            index.first_sample + int(columns["sample"][row]),
        )

    def has_field(self, name: str, piece: int) -> bool:
        """Whether every sample of indexed `piece` has field `name`."""
        index = self._resident[piece]
        rows = index.field_rows.get(self._field_ids.get(name, -1))
        # (Rows that follow a rule are every sample's: see ShardIndex.)
        return rows is not None and (isinstance(rows, ComputedColumn) or bool((rows >= 0).all()))

    def member_out(self, piece: int) -> tuple[np.ndarray, np.ndarray]:
        """Each member's decoded bytes of indexed `piece`, and where each sample's start."""
        index = self._resident[piece]
        return np.asarray(index.columns["out"]), np.asarray(index.sample_first)

    def keys(self, indices: np.ndarray) -> list[str]:
        """Keys of samples `indices` (their pieces indexed)."""
        indices = np.asarray(indices, np.int64)
        if not len(indices):
            return []
        if all(self._resident[p].keys is None for p in np.unique(self.pieces_of(indices)).tolist()):
            # All numbered (tables, .npy and array rows): a key is its shard's stem and its
            # row there, made in one go rather than piece by piece (a batch of a shuffled
            # table crosses several row groups).
            shards = self.shards_of(indices)
            rows = (indices - self.shard_start[shards]).tolist()
            if shards[0] == shards[-1] and (shards == shards[0]).all():
                stem = key_prefix(self.names[int(shards[0])])
                return [stem + str(row) for row in rows]
            stems = {s: key_prefix(self.names[s]) for s in set(shards.tolist())}
            return [stems[s] + str(row) for s, row in zip(shards.tolist(), rows)]
        parts = self._by_piece(indices)
        if len(parts) == 1:
            index, local, _, piece = parts[0]
            return index.keys_of(local, self.names[self.piece_shard[piece]])
        out = np.empty(len(indices), dtype=object)
        for index, local, where, piece in parts:
            out[where] = index.keys_of(local, self.names[self.piece_shard[piece]])
        return out.tolist()

    # -- indexing --------------------------------------------------------------------

    def add(
        self, shards: list[int], indexes: list[dict], member_files: np.ndarray | None = None
    ) -> list[Note]:
        """Hold the members of `shards`, now local and indexed as `indexes` (of a table:
        its metadata, from which its pieces are made as batches read them). Returns what a
        user should hear of them: ("regrouped", shard, samples, runs) for a shard whose
        samples' members lay apart (runs: the samples a reader of adjacent members only
        would see), ("stale-index", shard, state, 0) for one whose member index sidecar
        was not for it as it is now."""
        with self.lock:
            notes = self._add(shards, indexes, member_files)
            self._let_go()
            return notes

    def _add(
        self, shards: list[int], indexes: list[dict], member_files: np.ndarray | None
    ) -> list[Note]:
        notes: list[Note] = []
        try:
            for shard, index in zip(shards, indexes):
                if self._is_table[shard]:
                    self._add_table(shard, index)
                    continue
                first = int(self.shard_start[shard])
                expected = int(self.shard_start[shard + 1]) - first
                seen = bool(self.known[shard])
                found, shard_notes = shard_index(
                    self, shard, self.names[shard], first, expected, index, member_files, seen
                )
                self._hold(int(self.shard_piece[shard]), found)
                self.known[shard] = True
                notes += shard_notes
                rows = chunk_rows(index) if index["format"] == "array" else 0
                if rows:  # (never let go of: indexed once)
                    self._group_rows[shard] = rows
        finally:
            self._sync_files()
        return notes

    def _add_table(self, shard: int, index: dict) -> None:
        """Keep table shard `shard`'s metadata `index` (read now: a remote file fetched, or
        a piece let go of before it was read), its rows checked against the count it was
        opened with."""
        expected = int(self.shard_start[shard + 1] - self.shard_start[shard])
        if int(index["rows"]) != expected:
            raise located(
                ShardFormatError,
                self.names[shard],
                0,
                f"holds {int(index['rows'])} rows but {expected} were expected (manifest "
                "or first look): the file changed",
            )
        self.add_tables({shard: index}, at_open=False)
        identity = index.get("identity")
        if identity is not None and tuple(self.identities[shard]) != tuple(identity):
            self._set_identities([shard], np.array([identity], np.int64))  # (read as it is)

    def _add_pieces(self, pieces: list[int]) -> None:
        """Index table pieces `pieces` from their tables' metadata (read already)."""
        try:
            for piece in pieces:
                shard = int(self.piece_shard[piece])
                first, end = int(self.piece_start[piece]), int(self.piece_start[piece + 1])
                start = first - int(self.shard_start[shard])
                index = self.tables[shard]
                found, _ = shard_index(
                    self, shard, self.names[shard], first, end - first, index, None, True,
                    (start, start + end - first),
                )  # fmt: skip
                self._hold(piece, found)
                self.known[shard] = True
        finally:  # (a piece held before one that failed names the layouts made for it)
            self._sync_files()

    def _sync_files(self) -> None:
        """`files` with every layout made so far, those of an indexing that failed after
        making some included: a request names a layout by its place in the lists. (Not
        made again from every path: a new file's layouts join it each time.)"""
        arrays, columns = self._files_holds
        if (arrays, columns) != (len(self.arrays), len(self.columns)):
            self.files = self.files.extended(self.arrays[arrays:], self.columns[columns:])
            self._files_holds = (len(self.arrays), len(self.columns))

    def _hold(self, piece: int, index: ShardIndex) -> None:
        if piece not in self._resident:
            self._table_pieces_held += bool(self._is_table[self.piece_shard[piece]])
        self._resident[piece] = index
        self._resident.move_to_end(piece)
        self._version += 1

    def set_identity(self, shard: int, identity: tuple[int, int, int]) -> None:
        """Shard `shard`'s file is now the one of `identity` (a remote shard fetched again):
        reads check against it."""
        with self.lock:
            if tuple(self.identities[shard]) != tuple(identity):
                self._set_identities([shard], np.array([identity], np.int64))

    def index_local(self, pieces: list[int], num_threads: int, pin: bool = False) -> list[Note]:
        """Index the local pieces of `pieces` not indexed now (a manifest described their
        shards, or they were let go of); returns what add() does. Pieces indexed meanwhile
        by another thread are skipped. `pin`: every one of `pieces` is pinned (unpin_pieces
        each when done)."""
        with self.lock:
            todo = [p for p in pieces if p not in self._resident]
            notes: list[Note] = []
            if todo:
                shards = sorted({int(self.piece_shard[p]) for p in todo})
                # A table's metadata not held (a file summed up at open, or a remote one now
                # in the cache) is read now, and checked as it is added; other shards are
                # indexed whole.
                tables = [s for s in shards if self._is_table[s] and s not in self.tables]
                others = [s for s in shards if not self._is_table[s]]
                found = _core.index_shards(
                    [self.paths[s] for s in others], [self.formats[s] for s in others], num_threads
                )
                metadata = [index_table_source(self.paths[s], self.formats[s]) for s in tables]
                notes = self._add(others + tables, found + metadata, None)
                self._add_pieces([p for p in todo if self._is_table[self.piece_shard[p]]])
                now = np.array([index["identity"] for index in found], np.int64).reshape(-1, 3)
                # (The FileTable holds every shard's path: made again only for a file that
                # is not the one opened.)
                if not np.array_equal(now, self.identities[others]):
                    self._set_identities(others, now)
            if pin:  # (before letting any go)
                self.pin_pieces(pieces)
            if todo:
                self._let_go()
            return notes

    def _set_identities(self, shards: list[int], identities: np.ndarray) -> None:
        """Shards `shards`' files are now those of `identities`: reads check against them."""
        changed = self.identities.copy()
        changed[shards] = identities
        self.files = _core.FileTable(self.paths, changed, self.arrays, self.columns)
        self._files_holds = (len(self.arrays), len(self.columns))
        self.identities = changed
        self._version += 1

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()  # (the lock is a ProcessLocal: the other side makes one)
        state["_plan_columns"] = None
        state["_pins"] = {}  # holds are this process's
        return state


def same_index(table: MemberTable, shard: int, index: dict) -> bool:
    """Whether `index` (of the shard fetched again) lays its members out as the one held
    now (a shard not held now has nothing to compare with: its sample count was checked)."""
    if index["format"] == "table":  # (its metadata is kept, and its pieces made from it)
        kept = table.tables.get(shard)
        return kept is None or _same_table(kept, index)
    held = table.resident(shard)
    if held is None:
        return True
    offsets, lengths = held.columns["offset"], held.columns["length"]
    if index["format"] == "npy":
        return bool(
            len(offsets) == int(index["shape"][0])
            and (not len(offsets) or int(offsets[0]) == int(index["data_offset"]))
        )
    return bool(
        np.array_equal(offsets, index["member_offset"])
        and np.array_equal(lengths, index["member_length"])
    )


def _same_table(held: dict, index: dict) -> bool:
    """Whether a table's metadata read again lays its values out as the one held: a copy
    fetched again must, or pieces made from the first would read the second wrongly."""
    if int(held["rows"]) != int(index["rows"]) or len(held["fields"]) != len(index["fields"]):
        return False
    for a, b in zip(held["fields"], index["fields"]):
        if (a.name, a.spec, a.width, a.unusable) != (b.name, b.spec, b.width, b.unusable):
            return False
        for name in ("units", "offsets", "lengths", "nulls"):
            x, y = getattr(a, name), getattr(b, name)
            if (x is None) != (y is None) or (x is not None and not np.array_equal(x, y)):
                return False
    return True
