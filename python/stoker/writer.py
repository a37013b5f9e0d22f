"""Writing shards: ``stoker.ShardWriter`` from Python, and what ``stoker pack`` shares with
it: the tar members every shard is made of (``TarShard``), how values become member bytes
(``encode_value``), which samples go in which shard (``assign``) and writing a dataset's
samples into shards (``write_shards``).

A shard is a tar in the WebDataset convention: each field of a sample is a member
``KEY.FIELD``, a sample's members side by side, in field order. Every header is fixed
(mtime 0, owner 0, mode 0644, no user names), so the same samples make the same bytes.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tarfile
import threading
import types
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

import stoker._core as _core
from stoker._work import make_work_folder, remove_dead_work
from stoker.dataset import Dataset
from stoker.errors import StokerError, UsageError, quoted
from stoker.manifest import MANIFEST_NAME, write_manifest

#: Header block size and the fixed fields every member gets.
BLOCK = 512
_MTIME = 0
_MODE = 0o644
_DEFAULT_MAX_BYTES = 256 << 20


def tar_bytes(length: int | np.ndarray) -> Any:
    """Bytes a member of `length` bytes takes in a tar: a header, the data padded to blocks."""
    return BLOCK + (length + BLOCK - 1) // BLOCK * BLOCK


class TarShard:
    """A tar shard being written, member by member, with fixed headers."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.tar = tarfile.open(path, "w", format=tarfile.PAX_FORMAT)  # noqa: SIM115 - closed by close()
        self.samples = 0
        self.members_bytes = 0  # headers and padded data so far

    def size_with(self, extra: int) -> int:
        """The file's size once closed, with `extra` more member bytes: tarfile ends an
        archive with two zero blocks, padded to a whole record."""
        end = self.members_bytes + extra + 2 * BLOCK
        return -(-end // tarfile.RECORDSIZE) * tarfile.RECORDSIZE

    def add(self, name: str, data: bytes | memoryview) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        info.mtime = _MTIME
        info.mode = _MODE
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        self.tar.addfile(info, io.BytesIO(data))
        self.members_bytes += tar_bytes(len(data))

    def close(self) -> None:
        self.tar.close()


def encode_value(value: Any) -> bytes | memoryview:
    """A field's value as member bytes, the conventional way: bytes as they are, ``str`` as
    UTF-8, integers (and booleans, as 0/1) as ASCII digits, floats as their ``repr``, numpy
    arrays and tensors as ``.npy`` files, dicts and lists as JSON. TypeError otherwise."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, memoryview):
        return value.cast("B") if value.contiguous else value.tobytes()
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bool, np.bool_)):
        return b"1" if value else b"0"
    if isinstance(value, (int, np.integer)):
        return str(int(value)).encode("ascii")
    if isinstance(value, (float, np.floating)):
        return repr(float(value)).encode("ascii")
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        buffer = io.BytesIO()
        np.save(buffer, value, allow_pickle=False)
        return buffer.getvalue()
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    raise UsageError(
        f"no conventional encoding for a {type(value).__name__}: give bytes, str, int, float, "
        "a numpy array or tensor, or a dict or list (JSON); encode images yourself "
        "(e.g. PIL's save to BytesIO) and give their bytes"
    )


def check_key(key: object, where: str) -> str:
    """`key` if a sample may be stored under it: a relative name that stays inside the
    folder it is unpacked in, whose last part has no dot (a reader splits KEY.FIELD at
    the first dot of a member's base name)."""
    if not isinstance(key, str) or not key:
        raise UsageError(f"{where}: a sample needs a non-empty str '__key__', not {key!r}")
    parts = key.split("/")
    if key.startswith("/") or ".." in parts or "" in parts or "." in parts[-1]:
        raise UsageError(
            f"{where}: sample key {quoted(key)} must be a relative name without '..', empty "
            "parts or a dot in its last part (readers take KEY.FIELD apart at that dot)"
        )
    return key


# -- what goes where (stoker pack's planning, and a stratified writer's) ---------------


def sample_sizes(ds: Dataset) -> np.ndarray:
    """Each sample's bytes once packed (an estimate where members are not indexed yet)."""
    sizes = ds.sample_bytes(lambda out: tar_bytes(out.astype(np.int64)))
    if "label" in ds.columns:
        sizes += 2 * BLOCK  # a .cls member of a few digits
    return sizes


def assign(
    sizes: np.ndarray,
    *,
    shard_size: int | None,
    samples_per_shard: int | None,
    shuffle: bool,
    seed: int,
    labels: np.ndarray | None,
) -> list[np.ndarray]:
    """Which samples go in each shard, in order: a pure function of its arguments.

    Without `labels`, the (shuffled) order is cut into consecutive shards. With them
    (stratify), the order is sorted by label and dealt round robin, so each label is spread
    evenly over the shards, and each shard keeps the shuffled order inside it.
    """
    n = len(sizes)
    order = np.random.default_rng(seed).permutation(n) if shuffle else np.arange(n)
    if n == 0:
        return []
    if labels is not None:
        total = int(sizes.sum())
        count = (
            -(-n // samples_per_shard)
            if samples_per_shard
            else max(1, -(-total // int(shard_size or total or 1)))
        )
        count = min(count, n)  # never an empty shard
        by_label = order[np.argsort(labels[order], kind="stable")]
        shard_of = np.empty(n, np.int64)
        shard_of[by_label] = np.arange(n) % count
        rank = np.empty(n, np.int64)
        rank[order] = np.arange(n)
        return [
            members[np.argsort(rank[members], kind="stable")]
            for members in (np.flatnonzero(shard_of == s) for s in range(count))
        ]
    if samples_per_shard:
        return [order[i : i + samples_per_shard] for i in range(0, n, samples_per_shard)]
    limit = int(shard_size or sizes.sum() or 1)
    shards, start, used = [], 0, 0
    ordered = sizes[order]
    for i in range(n):
        if i > start and used + ordered[i] > limit:
            shards.append(order[start:i])
            start, used = i, 0
        used += int(ordered[i])
    shards.append(order[start:])
    return shards


# -- writing the samples of a dataset ---------------------------------------------------


class _Stopped(Exception):
    """Another shard failed (or Ctrl-C): this one stops where it is."""


def write_shard(
    ds: Dataset,
    samples: np.ndarray,
    path: str,
    progress: Callable[[int], None] | None = None,
    stop: threading.Event | None = None,
    transform: Callable[[list[dict]], None] | None = None,
) -> None:
    """Tar shard `path` of `samples` of `ds`: each field a member ``KEY.FIELD`` (a row of a
    ``.npy`` shard or array source a ``.npy`` file of its own; an array's path
    ``meta/labels`` the field ``meta.labels``), an integer label column ``KEY.cls``.
    `transform` may change each batch of samples first (stoker pack shrinks JPEGs)."""
    chunk = 256
    shard = TarShard(path)
    try:
        for at in range(0, len(samples), chunk):
            idx = samples[at : at + chunk]
            with ds.holding(idx):  # (fetches remote shards, and indexes them)
                batch = ds.get_batch(idx)
                npy_rows = ds.gather(idx).decoder != 0
            if transform is not None:
                transform(batch)
            labels = ds.columns.get("label")
            at_member = 0
            for s, sample in enumerate(batch):
                if stop is not None and stop.is_set():
                    raise _Stopped()
                key = sample.pop("__key__")
                if key.startswith("/") or ".." in key.split("/"):
                    # Nothing in stoker extracts members, but other tools do: a shard never
                    # names a place outside the folder it is unpacked in.
                    raise StokerError(
                        f"sample key {quoted(key)} (from {ds.source}) is not a safe relative name: "
                        "refusing to write it"
                    )
                if labels is not None:  # a column, not a member: written as KEY.cls
                    sample.pop("label", None)
                is_row = bool(npy_rows[at_member]) if len(npy_rows) > at_member else False
                at_member += len(sample)
                for field in sorted(sample):
                    value = sample[field]
                    data = encode_value(value) if is_row else memoryview(value)
                    shard.add(f"{key}.{field.replace('/', '.')}", data)
                if labels is not None:
                    shard.add(f"{key}.cls", str(int(labels[int(idx[s])])).encode())
            if progress is not None:
                progress(len(idx))
    finally:
        shard.close()


def write_shards(
    ds: Dataset,
    plan: list[np.ndarray],
    paths: list[str],
    *,
    num_threads: int = 1,
    progress: Callable[[int], None] | None = None,
    transform: Callable[[list[dict]], None] | None = None,
    then: Callable[[int], None] | None = None,
) -> None:
    """Shard `paths[i]` of the samples `plan[i]`, `num_threads` at a time, each followed
    by ``then(i)`` on its thread once written (stoker pack puts it in an object store).
    When one fails (or on Ctrl-C) the others stop where they are; the caller removes what
    was written."""
    stop = threading.Event()
    pool = ThreadPoolExecutor(max(1, num_threads))

    def one(i: int) -> None:
        write_shard(ds, plan[i], paths[i], progress, stop, transform)
        if then is not None:
            then(i)

    try:
        futures = [pool.submit(one, i) for i in range(len(plan))]
        for future in futures:
            future.result()
    except BaseException:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)  # no writer left for the caller to race
        raise
    finally:
        pool.shutdown(wait=False)


# -- ShardWriter -------------------------------------------------------------------------


class ShardWriter:
    """Tar shards and their ``stoker.json`` written from Python::

        with stoker.ShardWriter("out/", max_samples=10_000) as sink:
            for i, (jpeg, label) in enumerate(items):
                sink.write({"__key__": f"{i:08d}", "jpg": jpeg, "cls": label})

    Each value is encoded the conventional way (see `encode_value`): the field name is
    the member's extension, so give ``.npy`` arrays a field such as ``"npy"``. A new shard
    starts when the current one holds `max_samples` samples or would pass `max_bytes`
    (default 256 MiB when neither is given). With `stratify_by` (a field whose values
    are labels), the samples are dealt over the shards so that each label is spread
    evenly, as ``stoker pack --stratify`` does: they are kept in a spill file until the
    writer closes, then packed.

    Everything is written in a hidden folder in `out_dir` (new or empty) and moved in
    when the writer closes, the manifest (with each shard's member index and sha256)
    last: a writer that fails, or a process that dies, leaves no dataset that looks
    whole. Leaving the ``with`` block by an exception discards what was written.

    Args:
        out_dir: The folder to write into: new or empty.
        max_samples: Start a new shard once the current one holds this many samples.
        max_bytes: Start a new shard before the current one would pass this many bytes
            (tar's padding counted). Default, when neither limit is given: 256 MiB.
        stratify_by: A field whose values are labels: each label is spread evenly over
            the shards.
        prefix: Shard names are ``PREFIX-000000.tar``, ``PREFIX-000001.tar``, ...

    Attributes:
        samples: Samples written so far.
        shards: The shards' paths, once the writer has closed.

    Raises:
        StokerError: `out_dir` exists and is not an empty folder.
        UsageError: A limit is less than 1.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        *,
        max_samples: int | None = None,
        max_bytes: int | None = None,
        stratify_by: str | None = None,
        prefix: str = "shard",
    ) -> None:
        if max_samples is not None and max_samples < 1:
            raise UsageError(f"max_samples must be at least 1, not {max_samples}")
        if max_bytes is not None and max_bytes < 1:
            raise UsageError(f"max_bytes must be at least 1, not {max_bytes}")
        if max_samples is None and max_bytes is None:
            max_bytes = _DEFAULT_MAX_BYTES
        self.out_dir = os.path.abspath(os.fspath(out_dir))
        remove_dead_work(self.out_dir)  # (what a killed writer left does not count)
        if os.path.exists(self.out_dir) and (
            not os.path.isdir(self.out_dir) or os.listdir(self.out_dir)
        ):
            raise StokerError(f"{self.out_dir}: the output folder exists and is not empty")
        os.makedirs(self.out_dir, exist_ok=True)
        self.max_samples, self.max_bytes = max_samples, max_bytes
        self.stratify_by = stratify_by
        self.prefix = prefix
        self._work = make_work_folder(self.out_dir, "writer")
        self._names: list[str] = []
        self._shard: TarShard | None = None
        self._spill: TarShard | None = None
        self._labels: list[Hashable] = []
        self._keys: set[str] = set()
        self.samples = 0
        self.shards: list[str] = []  # the shards' paths, once closed
        self._closed = False

    # -- writing ---------------------------------------------------------------------

    def write(self, sample: Mapping[str, Any]) -> None:
        """Add one sample: ``"__key__"`` (unique in the dataset) and its fields.

        Args:
            sample: ``"__key__"``, a relative key with no dot in its last part, and one
                entry per field, the field name being the member's extension. Values are
                encoded the conventional way: bytes as they are, ``str`` as UTF-8,
                integers and booleans as ASCII digits, floats as their ``repr``, numpy
                arrays and tensors as ``.npy`` files, dicts and lists as JSON.

        Raises:
            UsageError: The key was written already, is not a usable key, or the sample
                has no fields (or lacks the `stratify_by` field).
            TypeError: A value has no conventional encoding (encode images yourself and
                pass their bytes).
            StokerError: The writer is closed.
        """
        if self._closed:
            raise StokerError(f"{self.out_dir}: this ShardWriter is closed")
        key = check_key(sample.get("__key__"), self.out_dir)
        if key in self._keys:
            raise UsageError(f"{self.out_dir}: sample key {quoted(key)} was written already")
        members = []
        for field in sorted(f for f in sample if f != "__key__"):
            if not field or "/" in field or field != field.strip():
                raise UsageError(f"{self.out_dir}: field name {field!r} of {quoted(key)}")
            try:
                members.append((f"{key}.{field}", encode_value(sample[field])))
            except TypeError as e:
                raise UsageError(f"{self.out_dir}: {quoted(key)}.{field}: {e}") from None
        if not members:
            raise UsageError(f"{self.out_dir}: sample {quoted(key)} has no fields")
        if self.stratify_by is not None:
            if self.stratify_by not in sample:
                raise UsageError(
                    f"{self.out_dir}: sample {quoted(key)} has no {self.stratify_by!r} field "
                    "to stratify by"
                )
            label = sample[self.stratify_by]
            self._labels.append(label.item() if isinstance(label, np.generic) else label)
            if self._spill is None:
                self._spill = TarShard(os.path.join(self._work, ".spill.tar"))
            target = self._spill
        else:
            target = self._shard_for(sum(tar_bytes(len(data)) for _, data in members))
        for name, data in members:
            target.add(name, data)
        target.samples += 1
        self._keys.add(key)
        self.samples += 1

    def _shard_for(self, size: int) -> TarShard:
        shard = self._shard
        if (
            shard is not None
            and shard.samples
            and (
                (self.max_samples is not None and shard.samples >= self.max_samples)
                or (self.max_bytes is not None and shard.size_with(size) > self.max_bytes)
            )
        ):
            shard.close()
            shard = None
        if shard is None:
            name = f"{self.prefix}-{len(self._names):06d}.tar"
            self._names.append(name)
            shard = self._shard = TarShard(os.path.join(self._work, name))
        return shard

    # -- finishing -------------------------------------------------------------------

    def close(self) -> None:
        """Finish the last shard, write the manifest and move everything into place.
        Leaving the ``with`` block calls it; calling it again does nothing.

        Raises:
            StokerError: No samples were written.
        """
        if self._closed:
            return
        try:
            if self._shard is not None:
                self._shard.close()
            if self._spill is not None:
                self._spill.close()
                self._pack_spill(self._spill)
            if not self._names:
                raise StokerError(f"{self.out_dir}: no samples were written")
            paths = [os.path.join(self._work, n) for n in self._names]
            write_manifest(paths, self._work)
            # Each shard with its member index, the manifest last: it says the rest is there.
            for name in [n for s in self._names for n in (s, s + _core.SIDECAR_SUFFIX)]:
                if os.path.exists(os.path.join(self._work, name)):
                    os.replace(os.path.join(self._work, name), os.path.join(self.out_dir, name))
            os.replace(
                os.path.join(self._work, MANIFEST_NAME), os.path.join(self.out_dir, MANIFEST_NAME)
            )
            self.shards = [os.path.join(self.out_dir, n) for n in self._names]
        except BaseException:
            self.abort()
            raise
        finally:
            self._closed = True
            shutil.rmtree(self._work, ignore_errors=True)

    def _pack_spill(self, spilled: TarShard) -> None:
        """Deal the samples spilled to `spilled` (the writer's spill shard, closed) over
        shards by label (``stoker pack --stratify``)."""
        spill = Dataset(spilled.path)
        _, codes = np.unique(np.array([str(label) for label in self._labels]), return_inverse=True)
        plan = assign(
            sample_sizes(spill),
            shard_size=self.max_bytes,
            samples_per_shard=self.max_samples,
            shuffle=False,
            seed=0,
            labels=codes,
        )
        width = 6
        self._names = [f"{self.prefix}-{i:0{width}d}.tar" for i in range(len(plan))]
        write_shards(spill, plan, [os.path.join(self._work, n) for n in self._names])
        os.unlink(spilled.path)

    def abort(self) -> None:
        """Discard everything written (nothing in `out_dir` is left from this writer)."""
        self._closed = True
        for shard in (self._shard, self._spill):
            if shard is not None:
                with contextlib.suppress(Exception):
                    shard.close()
        shutil.rmtree(self._work, ignore_errors=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: types.TracebackType | None,
    ) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()
