"""The index half of a Dataset: the member table of an opened source, the holds on its
remote shards, and what readers of whole batches (the Loader, the tools) go through to
reach them. ``Dataset`` adds the constructors and the sample-level surface."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

import stoker._core as _core
from stoker.dataset.holds import ShardHolds
from stoker.dataset.members import Gathered, MemberTable
from stoker.dataset.opening import Opening, announce, member_table
from stoker.dataset.reads import samples_from, submit_members
from stoker.dataset.shard_rows import Note
from stoker.dataset.shared import SharedDescribe
from stoker.errors import StokerError
from stoker.remote import RemoteShards
from stoker.sources import Source


class IndexedSamples:
    """Every sample of an opened source, as its member table indexes them: held (remote
    shards fetched into the cache) and indexed while they are read."""

    source: Source | str
    num_threads: int | None
    # Until opening is finished (see describe_shared), and for the other constructors.
    _pending: Opening | None = None
    _sharing: SharedDescribe | None = None
    _members: MemberTable | None = None
    _holds: ShardHolds | None = None

    @property
    def members(self) -> MemberTable:
        if self._members is None:
            self._finish_open()  # a dataset used before (or without) a Loader's swap
        assert self._members is not None
        return self._members

    @property
    def holds(self) -> ShardHolds | None:
        if self._pending is not None:
            self._finish_open()
        return self._holds

    def _open(
        self,
        names: list[str],
        paths: list[str],
        identities: np.ndarray,
        formats: list[str],
        indexes: list[dict],
        member_files: np.ndarray | None = None,
        tables: dict[int, dict] | None = None,
    ) -> None:
        """The member table of `indexes` (one per shard), as .opening.member_table makes
        it."""
        # With member_files (from_files: one "shard" of every file) the source is a str.
        shard_names = names if member_files is None else [str(self.source)] * len(indexes)
        self._pending = None
        self._members, notes = member_table(
            shard_names, paths, identities, formats, indexes, member_files, tables
        )
        self._holds = None
        self._said: set[str] = set()
        self._group_starts: np.ndarray | None = None
        self._say(notes)

    def _say(self, notes: list[Note]) -> None:
        """What indexing found that a user should hear: each kind once per dataset."""
        announce(notes, self._said, self.members.names)

    def _finish_open(self) -> None:
        """Open what opening left: the member table, once every shard's samples are
        known."""
        p = self._pending
        if p is None:
            return
        self._pending = None
        paths, indexes = p.finished()
        self._open(p.names, paths, p.identities, p.formats, indexes, tables=p.tables)
        if p.remote is not None:
            remote_of = {i: r for r, i in enumerate(p.remote_ids)}
            self._holds = ShardHolds(p.remote, remote_of, self.members)
            self._holds.on_notes(self._say)
        self._say(p.regroupings())

    def __getstate__(self) -> dict[str, Any]:
        # A copy in another process (a spawned DataLoader worker) is a whole dataset: it
        # takes no part in the ranks' swap (torch.distributed's store stays here).
        self._finish_open()
        state = self.__dict__.copy()
        state.pop("_sharing", None)
        return state

    # -- describing remote shards across ranks (see .shared) ---------------------------

    def shard_weights(self) -> np.ndarray | None:
        """Each shard's bytes, where this dataset's shards are to be described by a swap
        across ranks that has not happened yet (the Loader estimates with them which
        shards each rank reads first); else None."""
        if self._sharing is None:
            return None
        return np.array([s.size or 0 for s in self._remote_shards().shards], np.int64)

    def _remote_shards(self) -> RemoteShards:
        p = self._pending
        if p is not None:
            remote = p.remote
        else:
            remote = self.holds.remote if self.holds is not None else None
        assert remote is not None
        return remote

    def describe_shared(self, mine: np.ndarray) -> None:
        """Describe shards `mine` (of shard_weights'), swap descriptions with every other
        rank, and finish opening with the counts all ranks found. Every rank of the job
        calls it once (the Loader does); a rank that finished opening on its own (it was
        used before its Loader was made) publishes all it knows."""
        sharing, self._sharing = self._sharing, None
        if sharing is None:
            return
        remote = self._remote_shards()
        if self._pending is not None:
            try:
                remote.describe(only=[int(i) for i in mine])
            except BaseException as e:
                sharing.fail(e)
                raise
        found = {
            i: (s.samples, s.fields) for i, s in enumerate(remote.shards) if s.samples is not None
        }
        for i, (samples, fields) in sharing.swap(found).items():
            shard = remote.shards[i]
            if shard.samples is None:
                shard.samples, shard.fields = samples, fields
        self._finish_open()

    # -- what readers of whole batches go through (the Loader's way into the index) -----

    def shards_of(self, indices: np.ndarray) -> np.ndarray:
        """The shard of each sample of `indices`."""
        return self.members.shards_of(indices)

    def group_sizes(self) -> np.ndarray:
        """The sampler's groups of consecutive samples (each shard, or runs of an array
        source's chunks)."""
        return self.members.group_sizes()

    def shards_of_groups(self, groups: np.ndarray) -> np.ndarray:
        """The shard each of the sampler's `groups` (indices into group_sizes) lies in."""
        starts = self._group_starts
        if starts is None:
            starts = np.concatenate([[0], np.cumsum(self.group_sizes())[:-1]]).astype(np.int64)
            self._group_starts = starts
        return self.members.shards_of(starts[np.asarray(groups, np.int64)])

    def reserve_index(self, shards: int) -> None:
        """A reader will use up to `shards` shards at once: keep that many indexed."""
        self.members.reserve(shards)

    @property
    def fields_known(self) -> bool:
        """Whether every shard's field names are known (a manifest, or opening, said)."""
        return self.members.fields_known

    @property
    def columns(self) -> dict[str, np.ndarray]:
        """The dataset's integer columns (a CSV's labels): one value per sample."""
        return self.members.extras

    def table_dtype(self, name: str, listed: bool = False) -> np.dtype | None:
        """The type of a table source's field `name` where its values are numbers (or,
        `listed`, lists of numbers) of one type; else None."""
        return (self.members.table_lists if listed else self.members.table_dtypes).get(name)

    def unusable_field(self, name: str) -> str | None:
        """Why a table source's column `name` (or a struct or list it names, whose leaves
        are columns) cannot be read; None: it is no such column."""
        unusable = self.members.unusable
        found = unusable.get(name)
        if found is None:
            found = next((why for key, why in unusable.items() if key.startswith(name + ".")), None)
        return found

    def field_ids(self, names: Sequence[str]) -> list[int]:
        """The ids of field `names` as a BatchPlan names them (-1: none yet)."""
        return self.members.field_ids(names)

    def decoder(self, decoder: int) -> tuple[np.dtype, tuple[int, ...]] | None:
        """dtype and row shape of a typed decoder (rows of .npy shards); None for bytes."""
        return self.members.decoders[decoder]

    def plan_columns(self) -> _core.MemberColumns:
        """The index as a BatchPlan reads a batch (inside `indexed` for it)."""
        return self.members.plan_columns()

    def size_values(
        self, indices: np.ndarray, field_ids: Sequence[int] | None, reader: _core.ShardReader
    ) -> None:
        """Learn the sizes of the table values (Parquet text, bytes and lists) of samples
        `indices`, fields `field_ids` (None: all), that are not known yet: before they are
        gathered or planned, inside `indexed` for them. `reader`: the one that then reads
        them (its cache keeps the pages this decodes)."""
        self.members.size_values(indices, field_ids, reader)

    def gather(self, indices: np.ndarray) -> Gathered:
        """The members of samples `indices` (inside `indexed` for them), in order."""
        return self.members.gather(indices)

    def read_members(self, members: Gathered, reader: _core.ShardReader) -> _core.PendingRead:
        """Start reading gathered `members` into one buffer, each decoded at the next
        aligned offset."""
        return submit_members(self.members, members, reader)

    def samples_of(
        self, buffer: np.ndarray, indices: np.ndarray, members: Gathered
    ) -> list[dict[str, Any]]:
        """Sample dicts viewing `buffer`, as read_members(members) read it."""
        return samples_from(self.members, buffer, indices, members)

    def describe(self, member: int) -> tuple[str, str, int] | None:
        """The file, field name and sample of a member id a batch plan named (None where
        its shard is no longer indexed)."""
        return self.members.describe(member)

    # -- indexing and holding ------------------------------------------------------

    @contextlib.contextmanager
    def indexed(self, indices: np.ndarray) -> Iterator[None]:
        """Every piece of samples `indices` indexed (a shard, or a run of a table's rows),
        and kept so for the block: local ones not indexed now are indexed (a manifest
        described their shards, or they were let go of); remote shards must be held
        already (see holding)."""
        table = self.members
        pieces = np.unique(table.pieces_of(indices)).tolist() if len(indices) else []
        pinned: list[int] = []
        try:
            with table.lock:
                missing = table.missing(np.asarray(pieces, np.int64))
                present = sorted(set(pieces) - set(missing))
                table.pin_pieces(present)  # first: indexing the others must not let them go
                pinned += present
                if missing:
                    if self.holds is not None:
                        shards = table.piece_shard[missing]
                        # (A held table's pieces are made from its metadata, kept.)
                        unheld = [
                            int(s)
                            for s in shards[self.holds.is_remote[shards]].tolist()
                            if not table.has_index(int(s))
                        ]
                        if unheld:
                            name = table.names[unheld[0]]
                            raise StokerError(f"internal: shard {name} is read before it is local")
                    self._say(table.index_local(missing, self.num_threads or 0, pin=True))
                    pinned += missing
            yield
        finally:
            table.unpin_pieces(pinned)

    def ensure_indexed(self, indices: np.ndarray) -> None:
        """Every shard of samples `indices` indexed now (see indexed, which also keeps them
        so)."""
        with self.indexed(indices):
            pass

    @contextlib.contextmanager
    def holding(self, indices: np.ndarray) -> Iterator[None]:
        """The shards of samples `indices` held (remote ones fetched into the cache) and
        indexed, for the block."""
        if self.holds is None or len(indices) == 0:
            with self.indexed(indices):
                yield
            return
        shards = self.holds.remote_among(np.unique(self.shards_of(indices)))
        with self.holds.holding(shards), self.indexed(indices):
            yield

    def _each_piece_indexed(self, fetched_only: bool) -> Iterator[tuple[int, int, int]]:
        """(piece, first sample, end) of every piece with samples (a shard, or a run of a
        table's rows), each indexed (and kept so) while the caller looks at it;
        `fetched_only`: pieces of remote shards not indexed now are yielded unindexed
        instead of read (the caller tells them by `piece_index`)."""
        table = self.members
        starts = table.piece_start
        for piece in range(len(starts) - 1):
            first, end = int(starts[piece]), int(starts[piece + 1])
            if end == first:
                continue
            shard = int(table.piece_shard[piece])
            remote = self.holds is not None and self.holds.is_remote[shard]
            if fetched_only and remote and not table.has_index(shard):
                yield piece, first, end
                continue
            with self.indexed(np.array([first], np.int64)):
                yield piece, first, end
