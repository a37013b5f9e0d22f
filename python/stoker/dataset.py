"""Datasets: every sample of a set of shards, indexed once, read a batch at a time.

A dataset holds a columnar index (numpy arrays: one row per member, a member being
one field of one sample) and reads any set of samples with one call into the C++
ShardReader. Opening indexes every shard in parallel, reading headers only.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from stoker import _core
from stoker.errors import ReadError, ShardFormatError, located
from stoker.sources import Source, format_of, resolve

#: Where each piece starts in a batch buffer: aligned so that any dtype can be
#: viewed in place.
ALIGN = 64
_CODEC_STORED = 0

_readers: dict[tuple[int, int], _core.ShardReader] = {}
_readers_lock = threading.Lock()


def _new_lock_after_fork() -> None:
    # Another thread may have held the lock at the fork; it does not exist here.
    global _readers_lock
    _readers_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_after_fork)


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
    ) -> None:
        self.source = source
        self.cache_dir = cache_dir
        self.cache_limit = cache_limit
        self.num_threads = num_threads
        shards = resolve(source)
        paths = [path for path, _ in shards]
        formats = [format_of(path) for path in paths]
        for path, entry in shards:
            _check_manifest_size(path, entry)
        indexes = _core.index_shards(paths, formats, num_threads or 0)
        identities = np.array([index["identity"] for index in indexes], np.int64).reshape(-1, 3)
        self._build(paths, identities, indexes)

    @classmethod
    def from_csv(
        cls,
        csv: str | os.PathLike[str],
        root: str | os.PathLike[str],
        *,
        num_threads: int | None = None,
    ) -> Dataset:
        """The seeds' layout: a CSV of ``filename,label`` rows and a folder of files.

        Each sample holds the file's bytes under its extension (``"png"``, ...) and the
        integer label under ``"label"``. A header row is detected and skipped.
        """
        import pandas as pd

        csv, root = os.fspath(csv), os.fspath(root)
        table = pd.read_csv(csv, header=None, dtype=str, keep_default_na=False)
        if table.shape[1] < 2:
            raise located(ShardFormatError, csv, 0, "expected two columns: filename,label")
        names = table.iloc[:, 0].str.strip()
        label_text = table.iloc[:, 1].str.strip()
        first_line = 1
        if len(table) and not _is_integer(label_text.iloc[0]):  # a header row
            names, label_text, first_line = names.iloc[1:], label_text.iloc[1:], 2
        bad = np.flatnonzero(~label_text.map(_is_integer).to_numpy(bool))
        if len(bad):
            shown = ", ".join(f"line {i + first_line}: {label_text.iloc[i]!r}" for i in bad[:5])
            raise located(
                ShardFormatError,
                csv,
                0,
                f"{len(bad)} row(s) have a label that is not an integer ({shown})",
            )
        labels = label_text.astype(np.int64).to_numpy()
        names = names.tolist()
        paths = [os.path.join(root, name) for name in names]
        identities, errors = _core.stat_files(paths, 0)
        missing = np.flatnonzero(errors)
        if len(missing):
            shown = ", ".join(paths[i] for i in missing[:5])
            raise located(
                ReadError,
                paths[missing[0]],
                0,
                f"{len(missing)} file(s) listed in {csv} cannot be read "
                f"({os.strerror(int(errors[missing[0]]))}): {shown}",
            )
        sizes = identities[:, 1]

        self = cls.__new__(cls)
        self.source = csv
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
        self._extras["label"] = labels
        return self

    # -- building the index --------------------------------------------------

    def _build(
        self,
        paths: list[str],
        identities: np.ndarray,
        indexes: list[dict],
        member_files: np.ndarray | None = None,
    ) -> None:
        field_names: list[str] = []
        field_ids: dict[str, int] = {}
        decoders: list[tuple[np.dtype, tuple[int, ...]] | None] = [None]
        decoder_ids: dict[tuple[str, tuple[int, ...]], int] = {}

        def global_field(name: str) -> int:
            if name not in field_ids:
                field_ids[name] = len(field_names)
                field_names.append(name)
            return field_ids[name]

        columns: dict[str, list[np.ndarray]] = {
            k: [] for k in ("file", "offset", "length", "out", "codec", "crc", "field", "decoder")
        }
        sample_counts, member_counts = [], []
        shard_keys: list[list[str] | None] = []
        for shard, index in enumerate(indexes):
            if index["format"] == "npy":
                n = int(index["shape"][0])
                row_shape = tuple(int(d) for d in index["shape"][1:])
                descr = index["descr"]
                key = (descr, row_shape)
                if key not in decoder_ids:
                    decoder_ids[key] = len(decoders)
                    decoders.append((np.dtype(descr), row_shape))
                row = np.uint64(index["row_bytes"])
                columns["offset"].append(
                    np.uint64(index["data_offset"]) + np.arange(n, dtype=np.uint64) * row
                )
                columns["length"].append(np.full(n, row, np.uint64))
                columns["out"].append(columns["length"][-1])
                columns["codec"].append(np.zeros(n, np.uint8))
                columns["crc"].append(np.zeros(n, np.uint32))
                columns["field"].append(np.full(n, global_field("npy"), np.int32))
                columns["decoder"].append(np.full(n, decoder_ids[key], np.int32))
                sample_counts.append(n)
                member_counts.append(np.ones(n, np.int64))
                shard_keys.append(None)
            else:
                m = len(index["member_offset"])
                lookup = np.array([global_field(f) for f in index["field_names"]], np.int32)
                columns["offset"].append(index["member_offset"])
                columns["length"].append(index["member_length"])
                columns["out"].append(index["member_out_length"])
                columns["codec"].append(index["member_codec"])
                columns["crc"].append(index["member_crc"])
                columns["field"].append(
                    lookup[index["member_field"]] if m else np.zeros(0, np.int32)
                )
                columns["decoder"].append(np.zeros(m, np.int32))
                sample_counts.append(len(index["keys"]))
                member_counts.append(np.diff(index["sample_start"].astype(np.int64)))
                shard_keys.append(index["keys"])
            if member_files is None:
                columns["file"].append(np.full(len(columns["offset"][-1]), shard, np.uint32))

        def cat(name: str, dtype: Any) -> np.ndarray:
            parts = columns[name]
            return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)

        self._paths = paths
        # Reads check that each file is still the one indexed.
        self._files = _core.FileTable(paths, identities)
        self._m_file = member_files if member_files is not None else cat("file", np.uint32)
        self._m_offset = cat("offset", np.uint64)
        self._m_length = cat("length", np.uint64)
        self._m_out = cat("out", np.uint64)
        self._m_codec = cat("codec", np.uint8)
        self._m_crc = cat("crc", np.uint32)
        self._m_field = cat("field", np.int32)
        self._m_decoder = cat("decoder", np.int32)
        counts = np.concatenate(member_counts) if member_counts else np.zeros(0, np.int64)
        self._member_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._shard_start = np.concatenate([[0], np.cumsum(sample_counts)]).astype(np.int64)
        self._shard_keys = shard_keys
        self._field_names = field_names
        self._decoders = decoders
        self._extras: dict[str, np.ndarray] = {}
        self._key_array: np.ndarray | None = None

    # -- the public surface --------------------------------------------------

    def __len__(self) -> int:
        return int(self._shard_start[-1])

    @property
    def fields(self) -> list[str]:
        """Every field name some sample has (plus extras such as ``label``)."""
        return [*self._field_names, *self._extras]

    @property
    def shards(self) -> list[str]:
        """The shard files (for a CSV dataset: the sample files)."""
        return list(self._paths)

    def key(self, i: int) -> str:
        return self.keys([self._check_index(i)])[0]

    def keys(self, indices: Sequence[int] | np.ndarray) -> list[str]:
        """Keys of samples `indices` (non-negative)."""
        if self._key_array is None:  # built on first use: one array lookup per batch after
            parts = []
            for shard, keys in enumerate(self._shard_keys):
                if keys is None:  # rows of a .npy shard
                    stem = os.path.splitext(os.path.basename(self._paths[shard]))[0]
                    count = int(self._shard_start[shard + 1] - self._shard_start[shard])
                    keys = [f"{stem}/{row}" for row in range(count)]
                parts.append(np.array(keys, dtype=object))
            self._key_array = np.concatenate(parts) if parts else np.zeros(0, object)
        return self._key_array[np.asarray(indices, dtype=np.int64).reshape(-1)].tolist()

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.get_batch([i])[0]

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
        rows, bounds = self._member_rows(idx)
        buffer = self._submit_members(rows).wait()
        return self._samples_from(buffer, idx, rows, bounds)

    # -- internals the loader builds on ---------------------------------------

    def _check_index(self, i: int) -> int:
        n = len(self)
        i = int(i)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for a dataset of {n}")
        return i + n if i < 0 else i

    def _member_rows(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Member rows of samples `idx`, in order, and where each sample's rows start."""
        starts = self._member_start[idx]
        counts = self._member_start[idx + 1] - starts
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
    ) -> _core.PendingRead:
        """Start reading member `rows`; by default each lands, as stored, at the next aligned
        offset. `codecs` and `out` (decoded lengths) override how members are decoded,
        `offsets` and `lengths` which bytes of them are read."""
        if out is None:
            out = self._m_out[rows]
        if dest is None:
            dest, size = aligned_offsets(out)
        if codecs is None:
            codecs = self._m_codec[rows]
        compressed = bool((codecs != _CODEC_STORED).any())
        return (reader or shared_reader(self.num_threads)).read(
            self._files,
            self._m_file[rows],
            self._m_offset[rows] if offsets is None else offsets,
            self._m_length[rows] if lengths is None else lengths,
            dest,
            size,
            out_lengths=out,
            codecs=codecs if compressed else None,
            crcs=self._m_crc[rows] if compressed else None,
        )

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

    def __repr__(self) -> str:
        return f"Dataset({len(self)} samples in {len(self._paths)} files, fields {self.fields})"


def _is_integer(text: str) -> bool:
    text = text.strip()
    if text and text[0] in "+-":
        text = text[1:]
    return text.isdigit()


def _split_name(name: str) -> tuple[str, str]:
    """Key and field of a file name, by the same rule as shard members."""
    folder, base = os.path.split(name)
    stem, dot, ext = base.partition(".")
    if not dot or not stem:
        stem, ext = base, "bin"
    return (os.path.join(folder, stem) if folder else stem), ext.lower()


def _check_manifest_size(path: str, entry: dict | None) -> None:
    if not entry or "bytes" not in entry:
        return
    try:
        actual = os.stat(path).st_size
    except OSError:
        return  # the index parser reports a missing file with its errno
    if actual != entry["bytes"]:
        raise located(
            ShardFormatError,
            path,
            min(actual, entry["bytes"]),
            f"the manifest says {entry['bytes']} bytes but the file has {actual}",
        )
