"""Writing and describing shards: ``stoker pack``, ``stoker index``, ``stoker inspect``.

``pack`` turns any stoker source (a CSV of filename,label rows and a folder of files, a
class-per-folder tree, or shards) into tar shards in the WebDataset convention plus a
``stoker.json``. The assignment of samples to shards is a pure function of the input and
the options, and every tar header is fixed (mtime, owner, mode), so the same input packs to
the same bytes.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import sys
import tarfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from stoker import _core
from stoker._process import usable_cores
from stoker.dataset import Dataset
from stoker.errors import StokerError, quoted
from stoker.fields import require_image_support
from stoker.formats import SHARD_FORMATS
from stoker.manifest import MANIFEST_NAME, write_manifest

log = logging.getLogger("stoker.pack")

_JPEG_MAGIC = b"\xff\xd8\xff"


@dataclass(frozen=True)
class ImageResize:
    """``--image-size``: JPEG members re-encoded so that their shorter side is at most
    `shorter_side`, at `quality`, on `num_threads` C++ threads (the GIL released)."""

    shorter_side: int
    quality: int = 90
    num_threads: int = 1


def shrink_images(batch: list[dict], resize: ImageResize, source: str) -> None:
    """Every JPEG member of `batch` (samples as get_batch gives them) larger than
    `resize` allows, replaced by its re-encoding. PNGs and other members are kept as they
    are (re-encoding a PNG as a JPEG would change what its name says); a JPEG that does not
    decode is kept, with a warning naming it."""
    where, images, names = [], [], []
    for s, sample in enumerate(batch):
        for field, value in sample.items():
            if field == "__key__" or not isinstance(value, np.ndarray):
                continue
            if value.dtype == np.uint8 and value.ndim == 1 and value[:3].tobytes() == _JPEG_MAGIC:
                where.append((s, field))
                images.append(value.tobytes())
                names.append(f"{source}: {sample['__key__']}.{field}")
    if not images:
        return
    resized, problems = _core.shrink_jpegs(
        images, resize.shorter_side, resize.quality, resize.num_threads, names
    )
    for (s, field), data, problem in zip(where, resized, problems):
        if problem is not None:
            log.warning("kept as it is, it does not decode: %s", problem)
        elif data is not None:
            batch[s][field] = np.frombuffer(data, np.uint8)


#: Header block size and the fixed fields every packed member gets.
_BLOCK = 512
_MTIME = 0
_MODE = 0o644


def _progress(total: int, quiet: bool, unit: str, desc: str):  # noqa: ANN202 - tqdm's type
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, desc=desc, disable=quiet or not sys.stderr.isatty())


# -- what to pack ----------------------------------------------------------------------


def class_folder(folder: str) -> tuple[Dataset, list[str]]:
    """A class-per-folder tree (``folder/<class>/<file>``): one sample per file, its label
    the index of its folder's name among the sorted class names."""
    classes = sorted(
        d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d)) and d[0] != "."
    )
    if not classes:
        raise StokerError(f"{folder}: no class folders in it (expected FOLDER/<class>/<file>)")
    names, labels = [], []
    for label, name in enumerate(classes):
        for root, dirs, files in os.walk(os.path.join(folder, name)):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for file in sorted(files):
                if not file.startswith("."):
                    names.append(os.path.relpath(os.path.join(root, file), folder))
                    labels.append(label)
    if not names:
        raise StokerError(f"{folder}: the class folders hold no files")
    return Dataset.from_files(folder, names, labels, source=folder), classes


def _is_class_folder(path: str) -> bool:
    """A folder of sub-folders with no shards (or manifest) anywhere under it."""
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, MANIFEST_NAME)):
        return False
    if not any(os.path.isdir(os.path.join(path, e)) for e in os.listdir(path)):
        return False
    for _, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        if any(os.path.splitext(f.lower())[1] in SHARD_FORMATS for f in files):
            return False
    return True


def open_input(
    source: str | None, csv: str | None, root: str | None
) -> tuple[Dataset, list[str] | None]:
    """The dataset to pack, and class names where the labels come from folder names."""
    if csv is not None:
        if root is None:
            raise StokerError("--csv needs --root, the folder its file names are in")
        return Dataset.from_csv(csv, root), None
    if source is None:
        raise StokerError("give a SOURCE to pack, or --csv with --root")
    if _is_class_folder(source):
        return class_folder(source)
    return Dataset(source), None


# -- planning ----------------------------------------------------------------------------


def _tar_bytes(lengths: np.ndarray) -> np.ndarray:
    """Bytes members of `lengths` take in a tar: a header and the data padded to blocks."""
    return _BLOCK + (lengths + _BLOCK - 1) // _BLOCK * _BLOCK


def sample_sizes(ds: Dataset) -> np.ndarray:
    """Each sample's bytes once packed (an estimate where members are not indexed yet)."""
    table = ds.members
    sizes = np.zeros(len(ds), np.int64)
    holds = ds.holds
    local = np.ones(len(table.indexed), bool) if holds is None else ~holds.is_remote
    # Shards a manifest described are indexed now: their member sizes count.
    starts = table.shard_start
    lazy = np.flatnonzero(~table.indexed & local & (starts[1:] > starts[:-1]))
    ds.ensure_indexed(starts[lazy])
    known = table.sample_first >= 0
    if known.any():
        idx = np.flatnonzero(known)
        rows, bounds = table.member_rows(idx)
        per_member = _tar_bytes(table.out[rows].astype(np.int64))
        sums = np.add.reduceat(per_member, bounds[:-1]) if len(rows) else np.zeros(len(idx))
        sums[np.diff(bounds) == 0] = 0
        sizes[idx] = sums
    if "label" in table.extras:
        sizes += 2 * _BLOCK  # a .cls member of a few digits
    if not known.all() and holds is not None:  # remote shards not fetched: their average
        for shard in np.flatnonzero(holds.is_remote).tolist():
            first, end = int(starts[shard]), int(starts[shard + 1])
            if end > first and sizes[first:end].sum() == 0:
                sizes[first:end] = holds.size_of(shard) // (end - first)
    return sizes


def labels_of(ds: Dataset) -> np.ndarray | None:
    """Every sample's integer label: the ``label`` column, or the ``cls`` field."""
    if "label" in ds.members.extras:
        return ds.members.extras["label"]
    if "cls" not in ds.fields:
        return None
    from stoker.fields import Int
    from stoker.loader import Loader

    out = np.zeros(len(ds), np.int64)
    at = 0
    every = Loader(ds, 8192, shuffle=False, rank=0, world_size=1, fields={"cls": Int()})
    for batch in every:
        values = batch["cls"].numpy()
        out[at : at + len(values)] = values
        at += len(values)
    return out


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


# -- writing -------------------------------------------------------------------------


def _member(name: str, data: bytes | memoryview) -> tuple[tarfile.TarInfo, io.BytesIO]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = _MTIME
    info.mode = _MODE
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info, io.BytesIO(data)


class _Stopped(Exception):
    """Another shard failed (or Ctrl-C): this one stops where it is."""


def write_shard(
    ds: Dataset,
    samples: np.ndarray,
    path: str,
    progress: Callable[[int], None],
    stop: threading.Event,
    resize: ImageResize | None = None,
) -> None:
    """Tar shard `path` of `samples`: each field a member ``KEY.FIELD``, a label ``KEY.cls``;
    JPEGs shrunk as `resize` says."""
    chunk = 256
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for at in range(0, len(samples), chunk):
            idx = samples[at : at + chunk]
            batch = ds.get_batch(idx)  # (fetches remote shards: their rows are known after)
            if resize is not None:
                shrink_images(batch, resize, ds.source)
            # (get_batch fetched and indexed the shards: their member rows are known)
            npy_rows = ds.members.decoder[ds.members.member_rows(idx)[0]] != 0  # .npy rows
            labels = ds.members.extras.get("label")
            at_member = 0
            for s, sample in enumerate(batch):
                if stop.is_set():
                    raise _Stopped()
                key = sample.pop("__key__")
                if key.startswith("/") or ".." in key.split("/"):
                    # Nothing in stoker extracts members, but other tools do: a packed
                    # shard never names a place outside the folder it is unpacked in.
                    raise StokerError(
                        f"sample key {quoted(key)} (from {ds.source}) is not a safe relative name: "
                        "refusing to pack it"
                    )
                if labels is not None:  # a column, not a member: written as KEY.cls
                    sample.pop("label", None)
                is_row = bool(npy_rows[at_member]) if len(npy_rows) > at_member else False
                at_member += len(sample)
                for field in sorted(sample):
                    value = sample[field]
                    if is_row:  # a row of a .npy shard or array source: a .npy file of its own
                        buffer = io.BytesIO()
                        np.save(buffer, value, allow_pickle=False)
                        data: bytes | memoryview = buffer.getvalue()
                    else:
                        data = memoryview(value)
                    # An array's path ("meta/labels") is a field name, not a folder.
                    tar.addfile(*_member(f"{key}.{field.replace('/', '.')}", data))
                if labels is not None:
                    label = int(labels[int(idx[s])])
                    tar.addfile(*_member(f"{key}.cls", str(label).encode()))
            progress(len(idx))


def _check_unique_keys(ds: Dataset) -> None:
    """Two samples with one key would be merged (or refused) by readers of the shards."""
    if ds.holds is not None:
        return  # remote shards' keys are known only once fetched
    keys = np.array(ds.keys(np.arange(len(ds))), dtype=object)
    unique, counts = np.unique(keys.astype(str), return_counts=True)
    repeated = unique[counts > 1]
    if len(repeated):
        shown = ", ".join(quoted(str(k)) for k in repeated[:5])
        raise StokerError(
            f"{len(repeated)} sample key(s) appear more than once ({shown}); keys are file "
            "names up to their first dot, so x.png and x.jpg collide: rename them"
        )


@dataclass
class PackResult:
    folder: str
    shards: list[str]
    samples: int
    bytes: int


def pack(
    ds: Dataset,
    out: str,
    *,
    shard_size: int | None = None,
    samples_per_shard: int | None = None,
    shuffle: bool = False,
    seed: int = 0,
    stratify: bool = False,
    classes: Sequence[str] | None = None,
    num_threads: int = 0,
    quiet: bool = False,
    prefix: str = "shard",
    image_size: int | None = None,
    image_quality: int = 90,
) -> PackResult:
    """Pack `ds` into tar shards and a ``stoker.json`` in `out` (new or empty). Everything
    is written in a hidden folder and moved into `out` at the end: a run that fails leaves
    nothing behind. `image_size`: JPEG members re-encoded (at `image_quality`) so that their
    shorter side is at most that many pixels; shards are then smaller than `shard_size`,
    which is reckoned on the members as they were."""
    if shard_size is not None and samples_per_shard is not None:
        raise StokerError("give --shard-size or --samples-per-shard, not both")
    if shard_size is None and samples_per_shard is None:
        shard_size = 256 << 20
    if image_size is not None and image_size < 1:
        raise StokerError(f"--image-size is a number of pixels, at least 1, not {image_size}")
    if not 1 <= image_quality <= 100:
        raise StokerError(f"--quality is 1 to 100, not {image_quality}")
    if image_size is not None:
        require_image_support("--image-size")
    if (shard_size is not None and shard_size <= 0) or (
        samples_per_shard is not None and samples_per_shard <= 0
    ):
        raise StokerError("shard sizes must be positive")
    labels = None
    if stratify:
        labels = labels_of(ds)
        if labels is None:
            raise StokerError(
                "--stratify needs labels: a CSV's label column, class folders or a .cls field"
            )
    out = os.path.abspath(out)
    made = not os.path.exists(out)
    if not made and (not os.path.isdir(out) or os.listdir(out)):
        raise StokerError(f"{out}: the output folder exists and is not empty")
    plan = assign(
        sample_sizes(ds),
        shard_size=shard_size,
        samples_per_shard=samples_per_shard,
        shuffle=shuffle,
        seed=seed,
        labels=labels,
    )
    _check_unique_keys(ds)
    width = max(6, len(str(len(plan) - 1)))
    names = [f"{prefix}-{i:0{width}d}.tar" for i in range(len(plan))]
    # A new folder is written beside its place and renamed into it whole; an empty one
    # gets a hidden work folder whose files are moved in at the end, manifest last.
    parent = os.path.dirname(out)
    work = os.path.join(out if not made else parent, f".stoker-pack-{os.getpid()}")
    os.makedirs(work)
    moved: list[str] = []
    stop = threading.Event()
    writers = max(1, num_threads or os.cpu_count() or 1)
    pool = ThreadPoolExecutor(writers)
    resize = None
    if image_size is not None:
        # Shards are written side by side; their decoding threads share the cores.
        threads = max(1, usable_cores() // min(writers, len(plan) or 1))
        resize = ImageResize(image_size, image_quality, threads)
    try:
        lock = threading.Lock()
        with _progress(len(ds), quiet, "samples", "pack") as bar:

            def progress(n: int) -> None:
                with lock:
                    bar.update(n)

            futures = [
                pool.submit(
                    write_shard, ds, members, os.path.join(work, name), progress, stop, resize
                )
                for members, name in zip(plan, names)
            ]
            for future in futures:
                future.result()
        extra = {"classes": list(classes)} if classes is not None else None
        write_manifest([os.path.join(work, n) for n in names], work, extra=extra)
        if made:
            os.rename(work, out)
        else:
            # Each shard with its member index (a rename keeps the time the index was
            # written for), the manifest last: it says the rest is there.
            written = [f for n in names for f in (n, n + _core.SIDECAR_SUFFIX)]
            for name in [*written, MANIFEST_NAME]:
                if os.path.exists(os.path.join(work, name)):
                    os.rename(os.path.join(work, name), os.path.join(out, name))
                    moved.append(os.path.join(out, name))
            os.rmdir(work)
    except BaseException:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)  # no writer left before cleaning up
        shutil.rmtree(work, ignore_errors=True)
        for path in moved:
            with contextlib.suppress(OSError):
                os.unlink(path)
        raise
    finally:
        pool.shutdown(wait=False)
    paths = [os.path.join(out, n) for n in names]
    return PackResult(out, paths, len(ds), sum(os.path.getsize(p) for p in paths))
