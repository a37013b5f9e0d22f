"""One shard's members as rows: the member columns, a ShardIndex of an indexed shard, and
how each format's index (from the C++ indexer, or an array source's layouts) becomes
rows, checked against the number of samples the shard was opened with."""

from __future__ import annotations

import os
from typing import Any, Protocol

import numpy as np

import stoker._core as _core
from stoker._columns import ComputedColumn
from stoker.errors import ShardFormatError, located

#: What adding shards found that a user should hear: (kind, shard, detail, detail).
Note = tuple[str, int, int, int]

#: A table's pieces (see table_pieces): runs of row groups of this many rows at the least,
#: and at the most (a larger row group is cut).
PIECE_MIN_ROWS = 512
PIECE_MAX_ROWS = 65536

#: Members one shard (or table piece) may hold: a member's id keeps its row in 32 bits.
MAX_SHARD_MEMBERS = 1 << 32

#: The member columns and their types (rows and samples numbered within their shard).
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
_PLAN_COLUMNS = [c for c in MEMBER_COLUMNS if c not in ("field", "sample")]


class Numbering(Protocol):
    """Where rows get the numbers of their fields, decoders and array layouts (a member
    table's, shared by all its shards)."""

    arrays: list[_core.ArrayLayout]

    def field_id(self, name: str) -> int: ...

    def column_id(self, shard: int, field: Any) -> int: ...

    def decoder_id(self, descr: str, row_shape: tuple[int, ...], name: str) -> int: ...


class ShardIndex:
    """One indexed piece's members: a whole shard, or a run of a table's rows (see
    table_pieces). `columns` hold MEMBER_COLUMNS (``sample`` within the piece); a sample's
    members are consecutive rows from ``sample_first[i]`` to ``sample_first[i + 1]``;
    `field_rows` maps a field id to each sample's row of it (-1: none); `keys` is None
    where keys are made from the shard's name and the row (the piece's first being row
    `row_offset` of its shard)."""

    def __init__(
        self,
        first_sample: int,
        columns: dict[str, np.ndarray | ComputedColumn],
        per_sample: np.ndarray | int,
        keys: np.ndarray | None,
        row_offset: int = 0,
    ) -> None:
        self.first_sample = first_sample
        self.row_offset = row_offset
        self.columns: dict[str, Any] = {
            name: column
            if isinstance(column := columns[name], ComputedColumn)
            else np.ascontiguousarray(column, dtype=dtype)
            for name, dtype in MEMBER_COLUMNS.items()
        }
        self.field_rows: dict[int, Any] = {}
        #: Fields with members whose size is not known yet (table values: see
        #: MemberTable.size_values).
        self.unsized: set[int] = set()
        self.sample_first: Any
        if isinstance(per_sample, int):
            # Every sample has the same `per_sample` members, one per field in the same
            # order (a .npy's rows, an array source's): the rows follow a rule, and so do
            # the samples' first rows and each field's rows.
            self.samples = self.rows // per_sample
            self.sample_first = ComputedColumn(self.samples + 1, 0, per_sample, np.int64)
            for j, f in enumerate(np.asarray(columns["field"][:per_sample]).tolist()):
                self.field_rows[int(f)] = ComputedColumn(self.samples, j, per_sample, np.int64)
        else:
            self.samples = len(per_sample)
            self.sample_first = np.zeros(self.samples + 1, np.int64)
            np.cumsum(per_sample, out=self.sample_first[1:])
            field, sample = self.columns["field"], self.columns["sample"]
            for f in np.unique(field).tolist():
                hits = np.flatnonzero(field == f)
                rows = np.full(self.samples, -1, np.int64)
                rows[sample[hits]] = hits
                self.field_rows[int(f)] = rows
            out = self.columns["out"]
            unsized = field[out == np.iinfo(np.uint64).max]
            self.unsized = {int(f) for f in np.unique(unsized).tolist()}
        self.keys = keys
        self._core: _core.ShardColumns | None = None

    @property
    def rows(self) -> int:
        return len(self.columns["offset"])

    def plan_columns(self) -> _core.ShardColumns:
        """The shard as a BatchPlan reads it (made once)."""
        if self._core is None:
            fields = max(self.field_rows, default=-1) + 1
            first = self.sample_first
            self._core = _core.ShardColumns(
                self.first_sample,
                {name: self.columns[name] for name in _PLAN_COLUMNS},
                first[:-1]
                if isinstance(first, np.ndarray)
                else ComputedColumn(self.samples, first.base, first.step, np.int64),
                [self.field_rows.get(f) for f in range(fields)],
            )
        return self._core

    def keys_of(self, local: np.ndarray, name: str) -> list[str]:
        """Keys of the shard's samples `local` (`name`: the shard's, which names the rows of
        a .npy or a table)."""
        if self.keys is not None:
            return self.keys[local].tolist()
        prefix = key_prefix(name)
        return [prefix + str(row) for row in (local + self.row_offset).tolist()]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_core"] = None  # made again on the other side
        return state


def key_prefix(name: str) -> str:
    """What the numbered keys of shard `name` (a table's rows, a .npy's) start with: the
    stem of its file name and a slash."""
    return os.path.splitext(name.rsplit("/", 1)[-1])[0] + "/"


def shard_index(
    numbering: Numbering,
    shard: int,
    name: str,
    first: int,
    expected: int,
    index: dict,
    member_files: np.ndarray | None,
    seen: bool,
    rows: tuple[int, int] | None = None,
) -> tuple[ShardIndex, list[Note]]:
    """The ShardIndex of shard `shard` (`name`), indexed as `index`, whose `expected`
    samples are numbered from `first`; and what a user should hear of it (`seen`: it was
    indexed before, and heard of then). Of a table, `rows` (start, end) is the piece
    indexed, its samples numbered from `first` too. Raises ShardFormatError for a shard
    whose sample count is not the one it was opened with."""
    notes: list[Note] = []
    keys = None
    start = 0
    per_sample: np.ndarray | int  # an int: every sample's members follow a rule
    if index["format"] == "table":
        start, end = rows if rows is not None else (0, int(index["rows"]))
        cols, n, per_sample = _table_rows(numbering, shard, index, name, start, end)
    elif index["format"] == "npy":
        cols, n, per_sample = _npy_rows(numbering, index, name)
    elif index["format"] == "array":
        cols, n, per_sample = _array_rows(numbering, index, name)
    else:
        cols, n, per_sample = _member_rows_of(numbering, index)
        found = index["keys"]
        if index["format"] in ("mds", "litdata"):  # records: numbered in their shard
            stem = os.path.splitext(os.path.basename(name))[0]
            found = [f"{stem}/{k}" for k in found]
        keys = np.empty(len(found), dtype=object)
        keys[:] = found
        runs = int(index.get("key_runs", n))
        if runs > n and not seen:
            notes.append(("regrouped", shard, n, runs))
        state = index.get("sidecar", 0)
        if state in (_core.SidecarState.STALE, _core.SidecarState.DAMAGED):
            notes.append(("stale-index", shard, int(state), 0))  # the shard was walked
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
    if m > MAX_SHARD_MEMBERS:
        raise located(
            ShardFormatError,
            name,
            0,
            f"holds {m:,} members (rows times arrays): a shard holds at most {MAX_SHARD_MEMBERS:,} "
            "(members are numbered in 32 bits); split it into several files",
        )
    if isinstance(per_sample, int):  # rows that follow a rule (see ShardIndex)
        cols["file"] = ComputedColumn(m, shard, 0, np.uint32)
        cols["sample"] = ComputedColumn(m, [0] * per_sample, [1] * per_sample, np.int64)
    else:
        cols["file"] = member_files if member_files is not None else np.full(m, shard)
        cols["sample"] = np.repeat(np.arange(n, dtype=np.int64), per_sample)
    return ShardIndex(first, cols, per_sample, keys, start), notes


def dtype_of(descr: str, name: str) -> np.dtype:
    """The dtype a .npy header's `descr` names (`name`: the shard, for errors)."""
    try:
        return np.dtype(descr)
    except (TypeError, ValueError) as e:
        raise located(
            ShardFormatError,
            name,
            0,
            f"the .npy header's dtype {descr!r} is not one numpy knows ({e})",
        ) from e


def chunk_groups(sizes: np.ndarray, rows_per_group: dict[int, int | np.ndarray]) -> np.ndarray:
    """Shards' `sizes` as the sampler's groups: a shard of `rows_per_group` cut into runs
    of that many rows (the last shorter), or into the groups listed (a table's row groups),
    any other whole."""
    out = []
    for shard, size in enumerate(sizes.tolist()):
        rows = rows_per_group.get(shard)
        if isinstance(rows, np.ndarray):
            out.append(rows[rows > 0] if size else np.zeros(0, np.int64))
        elif rows is None or rows >= size:
            out.append(np.array([size], np.int64))
        else:
            whole, rest = divmod(size, rows)
            out.append(np.array([rows] * whole + ([rest] if rest else []), np.int64))
    return np.concatenate(out) if out else sizes


def _npy_rows(table: Numbering, index: dict, name: str) -> tuple[dict, int, int]:
    """The member rows of a .npy shard's index: one per row, with a decoder for its dtype
    and row shape; computed, not stored."""
    n = int(index["shape"][0])
    row_shape = tuple(int(d) for d in index["shape"][1:])
    row = int(index["row_bytes"])
    constant = {
        "length": row,
        "out": row,
        "codec": 0,
        "crc": 0,
        "field": table.field_id("npy"),
        "decoder": table.decoder_id(index["descr"], row_shape, name),
        "array": 0,
    }
    cols: dict[str, Any] = {
        column: ComputedColumn(n, value, 0, MEMBER_COLUMNS[column])
        for column, value in constant.items()
    }
    cols["offset"] = ComputedColumn(n, int(index["data_offset"]), row, np.uint64)
    return cols, n, 1


def _array_rows(table: Numbering, index: dict, name: str) -> tuple[dict, int, int]:
    """The member rows of an array source: per sample, one per field (array), each row
    read in place or as an ARRAY_ROW of the array's layout (which joins the table's).
    Computed, but for the offsets of an array whose rows lie in uncompressed chunks read in
    place (they follow the chunks'), which are stored."""
    n = int(index["rows"])
    fields = index["fields"]
    k = len(fields)
    base = {column: [0] * k for column in MEMBER_COLUMNS}
    step = {column: [0] * k for column in MEMBER_COLUMNS}
    stored = {}  # the offsets of arrays whose rows follow no rule
    for j, field in enumerate(fields):
        row_bytes = field.row_bytes
        base["out"][j] = row_bytes
        base["field"][j] = table.field_id(field.name)
        base["decoder"][j] = table.decoder_id(field.dtype.str, field.row_shape, name)
        if field.layout is None:
            base["length"][j] = row_bytes
            if isinstance(field.offsets, ComputedColumn) and field.offsets.period == 1:
                base["offset"][j] = int(field.offsets.base[0])
                step["offset"][j] = int(field.offsets.step[0])
            else:
                stored[j] = np.asarray(field.offsets, np.uint64)
        else:
            step["offset"][j] = 1  # the row
            base["codec"][j] = int(_core.Codec.ARRAY_ROW)
            base["array"][j] = len(table.arrays)
            table.arrays.append(field.layout)
    computed: dict[str, Any] = {
        column: ComputedColumn(n * k, base[column], step[column], dtype)
        for column, dtype in MEMBER_COLUMNS.items()
        if column not in ("file", "sample")
    }
    if stored:  # only the offsets are stored, 8 bytes a member
        offsets = np.asarray(computed["offset"])
        for j, values in stored.items():
            offsets[j : n * k : k] = values  # sample-major: sample i's at i*k .. i*k+k-1
        computed["offset"] = offsets
    return computed, n, k


def table_pieces(rows: int, groups: np.ndarray | None) -> np.ndarray:
    """A table's `rows` cut into the pieces indexed one at a time: runs of whole row groups
    (`groups`, their rows) of PIECE_MIN_ROWS or more, a larger group cut at PIECE_MAX_ROWS,
    or, where the groups are not known yet, PIECE_MAX_ROWS each. A shuffled epoch visits a
    row group among the groups of other files, so a piece is indexed for about that group:
    indexing every row of a file of a million rows to serve one group of a thousand
    costed a thousand times the rows it served, and holding such files whole, gigabytes."""
    if groups is None or int(np.sum(groups)) != rows:
        groups = np.array([rows], np.int64)
    sizes: list[int] = []
    run = 0
    for g in np.asarray(groups, np.int64).tolist():
        if run and run + g > PIECE_MAX_ROWS:
            sizes.append(run)
            run = 0
        while g > PIECE_MAX_ROWS:
            sizes.append(PIECE_MAX_ROWS)
            g -= PIECE_MAX_ROWS
        run += g
        if run >= PIECE_MIN_ROWS:
            sizes.append(run)
            run = 0
    if run or not sizes:
        sizes.append(run)
    return np.array(sizes, np.int64)


def _table_rows(
    table: Numbering, shard: int, index: dict, name: str, start: int, end: int
) -> tuple[dict, int, np.ndarray]:
    """The member rows of rows [start, end) of a table source: per sample, one per usable
    field (column), each a COLUMN_VALUE of the column's layout (a Parquet column: its size
    found when a batch first needs it, unless every value has the same), or a byte range
    read in place (an Arrow column; a null is a member the sample does not have)."""
    n = end - start
    at = slice(start, end)
    fields = [f for f in index["fields"] if not f.unusable]
    k = len(fields)
    grid = {column: np.zeros((n, k), dtype) for column, dtype in MEMBER_COLUMNS.items()}
    present = np.ones((n, k), bool)
    for j, field in enumerate(fields):
        grid["field"][:, j] = table.field_id(field.name.lower())
        if field.dtype is not None:
            grid["decoder"][:, j] = table.decoder_id(field.dtype.str, field.row_shape, name)
        if field.offsets is not None:  # in place
            grid["offset"][:, j] = field.offsets[at]
            grid["length"][:, j] = field.lengths[at]
            grid["out"][:, j] = field.lengths[at]
            if field.nulls is not None:
                present[:, j] = ~field.nulls[at]
            continue
        grid["offset"][:, j] = np.arange(start, end, dtype=np.uint64)
        grid["codec"][:, j] = int(_core.Codec.COLUMN_VALUE)
        grid["array"][:, j] = table.column_id(shard, field)
        size = np.uint64(field.width) if field.width else np.iinfo(np.uint64).max
        grid["length"][:, j] = size
        grid["out"][:, j] = size
    keep = present.ravel()
    cols = {column: values.ravel()[keep] for column, values in grid.items()}
    return cols, n, present.sum(axis=1).astype(np.int64)


def chunk_rows(index: dict) -> int:
    """Rows per chunk of an array source's costliest array read by chunk (0: none is)."""
    chunked = [f.layout for f in index["fields"] if f.layout is not None]
    if not chunked:
        return 0
    costliest = max(chunked, key=lambda layout: layout.chunk_bytes)
    return int(costliest.chunk_shape[0])


def _member_rows_of(table: Numbering, index: dict) -> tuple[dict, int, np.ndarray]:
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
