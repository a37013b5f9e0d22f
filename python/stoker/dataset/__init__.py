"""Datasets: every sample of a set of shards, indexed once, read a batch at a time.

A dataset keeps a member table (:mod:`.members`: one row per member, a member being one
field of one sample) and reads any set of samples with one call into the C++ reader
(:mod:`.reads`). Opening indexes every shard in parallel, reading headers only; shards a
manifest describes, and remote ones (held in the node cache by :mod:`.holds`), are indexed
when first read.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from stoker import _core
from stoker._process import collector_paused, shared_reader
from stoker.arrays import index_array_source
from stoker.dataset.files import files_index, read_labels_csv
from stoker.dataset.holds import ShardHolds
from stoker.dataset.members import DEFAULT_RESIDENT, Gathered, MemberTable, Note
from stoker.dataset.reads import samples_from, submit_members
from stoker.dataset.shared import SharedDescribe, shared_describe
from stoker.errors import (
    ReadError,
    ShardFormatError,
    StokerError,
    UsageError,
    human,
    located,
    quoted,
)
from stoker.formats import format_of, is_url
from stoker.remote import FetchOptions, RemoteShard, RemoteShards, apply_entry, fetcher_for
from stoker.sources import Source, resolve

log = logging.getLogger("stoker.dataset")

ARRAY_SOURCES = ("hdf5", "zarr")

__all__ = ["Dataset", "Gathered", "read_labels_csv"]


class Dataset:
    """Every sample of `source`: ``len(ds)``, ``ds[i]``, ``ds[a:b]``, ``ds.get_batch(indices)``.

    ``ds[i]`` is a dict: ``"__key__"`` (str) and one entry per field: a 1-D uint8 numpy
    array viewing the bytes (zero-copy), or for ``.npy`` shards a typed numpy array.
    Opening reads headers only (a manifest's shards, and remote ones, are indexed when a
    batch first reads them). A Dataset pickles (its index travels, not its data) and works
    as a map-style dataset under ``torch.utils.data.DataLoader``, which reads each batch
    with one ``__getitems__`` call.

    Args:
        source: A folder (its ``stoker.json``, else every ``.tar``, ``.zip`` and ``.npy``
            under it), a glob, a brace range (``"shard-{000000..000099}.tar"``), a
            ``stoker.json`` manifest, an ``http(s)://``, ``s3://`` or ``gs://`` URL or
            prefix, an HDF5 file or Zarr store, the ``index.json`` of a MosaicML MDS or
            LitData dataset, or a list of any of these.
        cache_dir: The node-local cache folder for remote shards (and for peers' shards
            compressed as a whole). Default: ``$STOKER_CACHE``, else
            ``~/.cache/stoker``.
        cache_limit: The most bytes the cache folder may hold, downloads in flight
            included. Default: the disk's free space less a tenth of the disk.
        num_threads: Reader threads for indexing at open and for reads (None: one fewer
            than the cores this process may run on, at least one).
        fetch: How remote shards are fetched: connections, retries, timeouts, object store
            settings. Default: ``FetchOptions()``.
        arrays: For HDF5 and Zarr sources, the arrays (paths inside the file) to read as
            fields; they must share a length. Default: every array whose first axis has
            the source's length.

    Raises:
        ShardFormatError: A shard is corrupt, truncated or in a form stoker does not read.
        ReadError: A file is missing or cannot be read.
        FetchError: A remote manifest or shard could not be fetched.
        UsageError: `arrays` was given for a source with no HDF5 file or Zarr store.
    """

    # Until opening is finished (see describe_shared), and for the other constructors.
    _pending: _Pending | None = None
    _sharing: SharedDescribe | None = None
    _members: MemberTable | None = None
    _holds: ShardHolds | None = None

    def __init__(
        self,
        source: Source,
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | None = None,
        num_threads: int | None = None,
        fetch: FetchOptions | None = None,
        arrays: Sequence[str] | None = None,
    ) -> None:
        self.source = source
        self.cache_dir = cache_dir
        self.cache_limit = cache_limit
        self.num_threads = num_threads
        options = fetch or FetchOptions()
        self.fetch = options
        self.arrays = None if arrays is None else list(arrays)

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

        with collector_paused():  # a hundred thousand shards' entries, all kept
            self._open_source(source, read_url, list_url, read_range, arrays, options)

    def _open_source(
        self,
        source: Source,
        read_url: Callable[[str], bytes],
        list_url: Callable[[str], list[tuple[str, int, str | None]]],
        read_range: Callable[[str, int, int], bytes],
        arrays: Sequence[str] | None,
        options: FetchOptions,
    ) -> None:
        """Find the shards of `source` and index (or describe) them: the body of __init__."""
        cache_dir, cache_limit, num_threads = self.cache_dir, self.cache_limit, self.num_threads
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
            [paths[i] for i in listed], [shards[i][1] for i in listed]
        )
        # Shards a manifest describes open without a scan: each is indexed when a batch
        # first reads it.
        described = {i for i in local_ids if _describes(shards[i][1])}
        for i in described:
            entry = shards[i][1]
            indexes[i] = {"samples": entry["samples"], "fields": entry.get("fields")}
        scan = [i for i in local_ids if i not in described and formats[i] not in ARRAY_SOURCES]
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
        pending = _Pending(names, paths, identities, formats, indexes, shards, remote_ids)
        self._pending = pending
        if remote_ids:
            remote = _open_remote(shards, remote_ids, formats, cache_dir, cache_limit, options)
            pending.remote = remote
            # With torch.distributed, shards no rank knows yet are described by the ranks
            # that will read them, when the Loader is made (see .shared); opening stops here.
            if len(remote_ids) == len(paths) and remote.undescribed():
                urls, sizes = [s.url for s in remote.shards], [s.size or 0 for s in remote.shards]
                self._sharing = shared_describe(urls, sizes)
                if self._sharing is not None:
                    return
        self._finish_open()

    def _finish_open(self) -> None:
        """Open what `_open_source` left: the member table, once every shard's samples are
        known."""
        p = self._pending
        if p is None:
            return
        self._pending = None
        names, paths, indexes = p.names, list(p.paths), list(p.indexes)
        remote = p.remote
        if remote is not None:
            remote.describe()  # every shard a swap (if any) left undescribed
            for r, i in enumerate(p.remote_ids):
                shard = remote.shards[r]
                indexes[i] = {"samples": shard.samples, "fields": shard.fields}
                paths[i] = remote.path_of(r)
        self._open(names, paths, p.identities, p.formats, indexes)
        if remote is not None:
            remote_of = {i: r for r, i in enumerate(p.remote_ids)}
            self._holds = ShardHolds(remote, remote_of, self.members)
            self._holds.on_notes(self._say)
        for shard, (_, entry) in enumerate(p.shards):
            runs = (entry or {}).get("key_runs")
            if isinstance(runs, int) and runs > entry.get("samples", runs):
                self._say([("regrouped", shard, entry["samples"], runs)])

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
        remote = p.remote if p is not None else self.remote
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

    def __getstate__(self) -> dict[str, Any]:
        # A copy in another process (a spawned DataLoader worker) is a whole dataset: it
        # takes no part in the ranks' swap (torch.distributed's store stays here).
        self._finish_open()
        state = self.__dict__.copy()
        state.pop("_sharing", None)
        return state

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

        Args:
            csv: The CSV file: two columns, file name and integer label.
            root: The folder the file names are relative to.
            num_threads: Reader threads, as for `Dataset`.

        Returns:
            A dataset of one sample per row, keyed by the file name up to its extension.

        Raises:
            ShardFormatError: The CSV is not two columns, or has labels that are not
                integers (the first few and the count are named).
            ReadError: Files the CSV names are missing (the first few and the count).
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
        Files that cannot be read are reported together (the first few and the count).

        Args:
            root: The folder the names are relative to.
            names: The files, one sample each, in this order.
            labels: One integer per name, served as the ``"label"`` field.
            source: What the dataset's ``source`` says it was opened from (default:
                `root`).
            num_threads: Reader threads, as for `Dataset`.

        Returns:
            The dataset.

        Raises:
            ReadError: Some files cannot be read.
            UsageError: `labels` does not have one label per name.
        """
        root = os.fspath(root)
        paths, identities, index = files_index(root, list(names), source or root)
        self = cls.__new__(cls)
        self.source = source or root
        self.cache_dir = self.cache_limit = None
        self.fetch = None  # (not a source Dataset() can open again: see Mix)
        self.arrays = None
        self.num_threads = num_threads
        # One "shard" of every file: member i is file i's bytes.
        self._open(paths, paths, identities, ["files"], [index], np.arange(len(paths)))
        if labels is not None:
            column = np.ascontiguousarray(labels, dtype=np.int64).reshape(-1)
            if len(column) != len(paths):
                raise UsageError(
                    f"from_files got {len(column)} labels for {len(paths)} files: give one "
                    "label per file, in the same order"
                )
            self.members.extras["label"] = column
        return self

    def _open(
        self,
        names: list[str],
        paths: list[str],
        identities: np.ndarray,
        formats: list[str],
        indexes: list[dict],
        member_files: np.ndarray | None = None,
    ) -> None:
        """The member table of `indexes` (one per shard). A shard not yet local has a
        placeholder ``{"samples", "fields"}``: its samples count; its members are added
        once it is indexed."""
        counts, field_names, fields_known = [], [], True
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
        shard_names = names if member_files is None else [self.source] * len(indexes)
        self._pending = None
        self._members = MemberTable(
            counts, shard_names, paths, identities, formats, field_names, fields_known
        )
        self._holds = None
        self._said: set[str] = set()
        self._group_starts: np.ndarray | None = None
        ready = [s for s, index in enumerate(indexes) if "samples" not in index]
        # What opening indexed (a scan of every shard) stays indexed: it was paid for, and
        # only a source without a manifest is scanned. Shards indexed later are held while
        # in use, a bounded number at once.
        self.members.reserve(max(DEFAULT_RESIDENT, len(ready)))
        member_files = None if member_files is None else member_files.astype(np.uint32)
        self._say(self.members.add(ready, [indexes[s] for s in ready], member_files))

    def _say(self, notes: list[Note]) -> None:
        """What indexing found that a user should hear: each kind once per dataset."""
        for kind, shard, a, b in notes:
            if kind in self._said:
                continue
            self._said.add(kind)
            name = self.members.names[shard]
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

    # -- the public surface --------------------------------------------------------

    def __len__(self) -> int:
        """Every sample of every shard."""
        return len(self.members)

    @property
    def fields(self) -> list[str]:
        """Every field name some sample has (plus extras such as ``label``)."""
        return [*self.members.field_names, *self.members.extras]

    @property
    def shards(self) -> list[str]:
        """The shard files or URLs (for a dataset of loose files: the sample files)."""
        if self.members.formats == ["files"]:
            return list(self.members.paths)
        return list(self.members.names)

    @property
    def remote(self) -> RemoteShards | None:
        """The remote shards and their cache, for a dataset with any."""
        return self.holds.remote if self.holds is not None else None

    def key(self, i: int) -> str:
        """The key of sample `i`.

        Args:
            i: A sample index; negative counts from the end.
        """
        return self.keys([self._check_index(i)])[0]

    def keys(self, indices: Sequence[int] | np.ndarray) -> list[str]:
        """Keys of samples `indices`.

        Args:
            indices: Sample indices, non-negative.
        """
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        table = self.members
        with table.lock:  # (indexes are let go of under it)
            if not table.missing(np.unique(table.shards_of(idx))):
                return table.keys(idx)
        with self.holding(idx):  # a shard's keys are known once it is indexed
            return table.keys(idx)

    @overload
    def __getitem__(self, i: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, i: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, i: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        """Sample `i`, or the samples of a slice (read as one batch).

        Args:
            i: An index (negative counts from the end) or a slice.

        Returns:
            A sample dict, or a list of them for a slice.

        Raises:
            UsageError: `i` is neither an int nor a slice (``ds.get_batch`` takes a list).
        """
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

        Args:
            indices: Sample indices, in the order wanted; negative ones count from the
                end.

        Returns:
            One sample dict per index, as ``ds[i]`` gives it.

        Raises:
            IndexError: An index is out of range.
        """
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(self)
        if len(idx) and (idx.min() < -n or idx.max() >= n):
            bad = int(idx[(idx < -n) | (idx >= n)][0])
            raise IndexError(f"sample {bad} out of range for a dataset of {n}")
        idx = np.where(idx < 0, idx + n, idx)
        with self.holding(idx):
            members = self.members.gather(idx)
            buffer = self.read_members(members, shared_reader(self.num_threads)).wait()
            return self.samples_of(buffer, idx, members)

    def shards_of(self, indices: np.ndarray) -> np.ndarray:
        """The shard of each sample of `indices`."""
        return self.members.shards_of(indices)

    def _each_shard_indexed(self, fetched_only: bool) -> Iterator[tuple[int, int, int]]:
        """(shard, first sample, end) of every shard with samples, each indexed (and kept
        so) while the caller looks at it; `fetched_only`: remote shards not indexed now are
        yielded unindexed instead of read (the caller tells them by `resident`)."""
        starts = self.members.shard_start
        for shard in range(len(starts) - 1):
            first, end = int(starts[shard]), int(starts[shard + 1])
            if end == first:
                continue
            remote = self.holds is not None and self.holds.is_remote[shard]
            if fetched_only and remote and self.members.resident(shard) is None:
                yield shard, first, end
                continue
            with self.indexed(np.array([first], np.int64)):
                yield shard, first, end

    def sample_bytes(self, cost: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """Each sample's members' summed `cost` (of their decoded lengths), shard by shard
        (indexing local shards a manifest described); a remote shard not fetched yet counts
        its size spread evenly over its samples."""
        table = self.members
        sizes = np.zeros(len(self), np.int64)
        for shard, first, end in self._each_shard_indexed(fetched_only=True):
            if table.resident(shard) is None:  # remote, not fetched
                sizes[first:end] = self.holds.size_of(shard) // (end - first)
                continue
            out, sample_first = table.member_out(shard)
            per_member = np.concatenate([np.asarray(cost(out), np.int64), [0]])
            sums = np.add.reduceat(per_member, np.minimum(sample_first[:-1], len(out)))
            sums[np.diff(sample_first) == 0] = 0
            sizes[first:end] = sums
        return sizes

    def has_field_everywhere(self, name: str) -> bool:
        """Whether every sample has field `name` (local shards are indexed to tell, one at a
        time)."""
        if name in self.members.extras:
            return True
        return all(
            self.members.has_field(name, shard)
            for shard, _, _ in self._each_shard_indexed(fetched_only=False)
        )

    # -- what readers of whole batches go through (the Loader's way into the index) -----

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

    def field_ids(self, names: Sequence[str]) -> list[int]:
        """The ids of field `names` as a BatchPlan names them (-1: none yet)."""
        return self.members.field_ids(names)

    def decoder(self, decoder: int) -> tuple[np.dtype, tuple[int, ...]] | None:
        """dtype and row shape of a typed decoder (rows of .npy shards); None for bytes."""
        return self.members.decoders[decoder]

    def plan_columns(self) -> _core.MemberColumns:
        """The index as a BatchPlan reads a batch (inside `indexed` for it)."""
        return self.members.plan_columns()

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

    def explain(
        self, error: ShardFormatError, members: np.ndarray, offsets: np.ndarray
    ) -> ShardFormatError:
        """`error`, which the reader raised about a piece of one of `members` (ids) read at
        file `offsets`, said of the field and sample whose bytes it is about."""
        path, offset = getattr(error, "path", None), getattr(error, "offset", None)
        hits = np.flatnonzero(offsets == np.uint64(offset or 0)) if path is not None else ()
        for hit in list(hits):
            found = self.describe(int(members[hit]))
            if found is not None and found[0] == path:
                _, field, sample = found
                what = getattr(error, "detail", str(error))
                return located(
                    ShardFormatError,
                    path,
                    offset,
                    f"field {field!r} of sample {quoted(self.key(sample))}: {what}",
                )
        return error

    # -- indexing and holding ------------------------------------------------------

    @contextlib.contextmanager
    def indexed(self, indices: np.ndarray) -> Iterator[None]:
        """Every shard of samples `indices` indexed, and kept so for the block: local shards
        not indexed now are indexed (a manifest described them, or they were let go of);
        remote ones must be held already (see holding)."""
        table = self.members
        shards = np.unique(table.shards_of(indices)).tolist() if len(indices) else []
        pinned: list[int] = []
        try:
            with table.lock:
                missing = table.missing(np.asarray(shards, np.int64))
                for shard in set(shards) - set(missing):
                    table.pin(shard)  # first: indexing the others must not let them go
                    pinned.append(shard)
                if missing:
                    if self.holds is not None and self.holds.is_remote[missing].any():
                        name = table.names[next(s for s in missing if self.holds.is_remote[s])]
                        raise StokerError(f"internal: shard {name} is read before it is local")
                    self._say(table.index_local(missing, self.num_threads or 0, pin=True))
                    pinned += missing
            yield
        finally:
            for shard in pinned:
                table.unpin(shard)

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

    def _check_index(self, i: int) -> int:
        n = len(self)
        i = int(i)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for a dataset of {n}")
        return i + n if i < 0 else i

    def __repr__(self) -> str:
        files = len(self.members.paths)
        return f"Dataset({len(self)} samples in {files} files, fields {self.fields})"


@dataclass
class _Pending:
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
        if shards[i][1]:
            apply_entry(shard, shards[i][1])
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
    return bool(entry) and isinstance(entry.get("samples"), int) and "bytes" in entry


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
