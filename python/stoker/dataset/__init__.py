"""Datasets: every sample of a set of shards, indexed once, read a batch at a time.

A dataset keeps a member table (:mod:`.members`: one row per member, a member being one
field of one sample) and reads any set of samples with one call into the C++ reader
(:mod:`.reads`). Opening indexes every shard in parallel, reading headers only; shards a
manifest describes, and remote ones (held in the node cache by :mod:`.holds`), are indexed
when first read.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, overload

import numpy as np

from stoker._process import collector_paused, shared_reader
from stoker.dataset.files import files_index, read_labels_csv
from stoker.dataset.indexed import IndexedSamples
from stoker.dataset.members import Gathered
from stoker.dataset.opening import open_source
from stoker.dataset.shared import shared_describe
from stoker.errors import ShardFormatError, UsageError, located, quoted
from stoker.formats import ARRAY_SOURCES as ARRAY_SOURCES
from stoker.remote import FetchOptions, RemoteShards
from stoker.sources import Source

__all__ = ["Dataset", "Gathered", "read_labels_csv"]


class Dataset(IndexedSamples):
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
        # None for from_files and from_csv datasets, which Dataset() cannot open again.
        self.fetch: FetchOptions | None = options
        self.arrays = None if arrays is None else list(arrays)

        with collector_paused():  # a hundred thousand shards' entries, all kept
            opening = open_source(
                source,
                cache_dir=cache_dir,
                cache_limit=cache_limit,
                num_threads=num_threads,
                arrays=arrays,
                options=options,
            )
            self._pending = opening
            # With torch.distributed, shards no rank knows yet are described by the ranks
            # that will read them, when the Loader is made (see .shared); opening stops here.
            if opening.waits_for_ranks():
                self._sharing = shared_describe(*opening.remote_sizes())
                if self._sharing is not None:
                    return
            self._finish_open()

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
            if not table.missing(np.unique(table.pieces_of(idx))):
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
        reader = shared_reader(self.num_threads)
        with self.holding(idx):
            self.size_values(idx, None, reader)
            members = self.members.gather(idx)
            buffer = self.read_members(members, reader).wait()
            return self.samples_of(buffer, idx, members)

    def sample_bytes(self, cost: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """Each sample's members' summed `cost` (of their decoded lengths), shard by shard
        (indexing local shards a manifest described); a remote shard not fetched yet counts
        its size spread evenly over its samples."""
        table = self.members
        sizes = np.zeros(len(self), np.int64)
        for piece, first, end in self._each_piece_indexed(fetched_only=True):
            if table.piece_index(piece) is None:  # remote, not fetched
                holds = self.holds
                assert holds is not None  # only a source with remote shards has one
                shard = int(table.piece_shard[piece])
                samples = int(table.shard_start[shard + 1] - table.shard_start[shard])
                sizes[first:end] = holds.size_of(shard) // samples
                continue
            out, sample_first = table.member_out(piece)
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
            self.members.has_field(name, piece)
            for piece, _, _ in self._each_piece_indexed(fetched_only=False)
        )

    def explain(
        self, error: ShardFormatError, members: np.ndarray, offsets: np.ndarray
    ) -> ShardFormatError:
        """`error`, which the reader raised about a piece of one of `members` (ids) read at
        file `offsets`, said of the field and sample whose bytes it is about."""
        path, offset = getattr(error, "path", None), getattr(error, "offset", None)
        if path is None or offset is None:  # not about a place in a file (both are set)
            return error
        for hit in np.flatnonzero(offsets == np.uint64(offset)).tolist():
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

    def _check_index(self, i: int) -> int:
        n = len(self)
        i = int(i)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for a dataset of {n}")
        return i + n if i < 0 else i

    def __repr__(self) -> str:
        files = len(self.members.paths)
        return f"Dataset({len(self)} samples in {files} files, fields {self.fields})"
