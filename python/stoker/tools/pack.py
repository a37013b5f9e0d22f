"""Writing and describing shards: ``stoker pack``, ``stoker index``, ``stoker inspect``.

``pack`` turns any stoker source (a CSV of filename,label rows and a folder of files, a
class-per-folder tree, shards, Parquet and Arrow tables: see table_members) into tar
shards in the WebDataset convention plus a ``stoker.json``. The assignment of samples to
shards is a pure function of the input and the options, and every tar header is fixed
(mtime, owner, mode), so the same input packs to the same bytes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from stoker import _core
from stoker._process import usable_cores
from stoker._work import make_work_folder, remove_dead_work
from stoker.dataset import Dataset
from stoker.errors import StokerError, quoted
from stoker.fields import require_image_support
from stoker.formats import SHARD_FORMATS, is_url
from stoker.manifest import MANIFEST_NAME, write_manifest
from stoker.outputs import Prefix, is_shard_name, put_shard, refuse_unless_free, remove_stale
from stoker.remote import FetchOptions
from stoker.remote.stores import STORE_SCHEMES
from stoker.sources import Source
from stoker.tools.table_members import hub_class_names, is_table_dataset, table_members
from stoker.writer import assign, sample_sizes, write_shards

log = logging.getLogger("stoker.pack")

_JPEG_MAGIC = b"\xff\xd8\xff"


@dataclass(frozen=True)
class ImageResize:
    """``--image-size``: JPEG members re-encoded so that their shorter side is at most
    `shorter_side`, at `quality`, on `num_threads` C++ threads (the GIL released)."""

    shorter_side: int
    quality: int = 90
    num_threads: int = 1


def shrink_images(batch: list[dict], resize: ImageResize, source: Source) -> None:
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


def _progress(total: int, quiet: bool, unit: str, desc: str) -> Any:
    from stoker.tools.progress import progress_bar

    quiet = quiet or not sys.stderr.isatty()
    return progress_bar(total=total, unit=unit, desc=desc, disable=quiet)


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


def labels_of(ds: Dataset) -> np.ndarray | None:
    """Every sample's integer label: the ``label`` column, the ``cls`` field, or a table
    source's integer ``label`` column."""
    if "label" in ds.columns:
        return ds.columns["label"]
    label = ds.table_dtype("label")
    name = "label" if label is not None and np.issubdtype(label, np.integer) else "cls"
    if name not in ds.fields:
        return None
    from stoker.fields import Int
    from stoker.loader import Loader

    out = np.zeros(len(ds), np.int64)
    at = 0
    every = Loader(ds, 8192, shuffle=False, rank=0, world_size=1, fields={name: Int()})
    for batch in every:
        values = batch[name].numpy()
        out[at : at + len(values)] = values
        at += len(values)
    return out


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
    ray: str | bool = False,
    fetch: FetchOptions | None = None,
) -> PackResult:
    """Pack `ds` into tar shards and a ``stoker.json`` in `out` (new or empty). Everything
    is written in a hidden folder and moved into `out` at the end: a run that fails leaves
    nothing behind. `out` may be an ``s3://`` or ``gs://`` prefix (`fetch`: the store's
    settings): each shard, once written in a local temporary folder, is put in one signed
    request, its member index first, and the manifest last, once all are there; a prefix
    holding only what an unfinished pack left is written again. `image_size`: JPEG members
    re-encoded (at `image_quality`) so that their shorter side is at most that many
    pixels; shards are then smaller than `shard_size`, which is reckoned on the members as
    they were. `ray`: the shards written by Ray tasks
    (see stoker.ray.packing), on the cluster at that address (True: the one joined, or a
    local one); the same shards as without it."""
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
    store = None
    if is_url(out):
        if not out.startswith(STORE_SCHEMES):
            raise StokerError(f"{out}: stoker pack writes to a folder or an s3:// or gs:// prefix")
        store = Prefix(out, fetch or FetchOptions())
        refuse_unless_free(store, lambda name: is_shard_name(name, prefix))
    else:
        out = os.path.abspath(out)
        for folder in (out, os.path.dirname(out)):
            remove_dead_work(folder)  # (what a killed pack left does not count)
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
    if store is None:
        parent = os.path.dirname(out)
        work = make_work_folder(out if not made else parent, "pack")
    else:  # local: each shard is put in the store once written, then removed
        work = tempfile.mkdtemp(prefix=".stoker-pack-")
    moved: list[str] = []
    writers = max(1, num_threads or os.cpu_count() or 1)
    steps: list[Callable[[list[dict]], None]] = []
    if image_size is not None:
        # Shards are written side by side; their decoding threads share the cores (a
        # Ray task has the one core Ray gave it).
        threads = 1 if ray else max(1, usable_cores() // min(writers, len(plan) or 1))
        resize = ImageResize(image_size, image_quality, threads)
        steps.append(lambda batch: shrink_images(batch, resize, ds.source))
    if is_table_dataset(ds):  # (after shrinking, which looks for JPEGs among the arrays)
        steps.append(table_members(ds).convert)
        if classes is None:
            classes = hub_class_names(ds)

    def transform(batch: list[dict]) -> None:
        for step in steps:
            step(batch)

    try:
        lock = threading.Lock()
        with _progress(len(ds), quiet, "samples", "pack") as bar:
            shards_done = [0]

            def progress(n: int) -> None:
                with lock:
                    bar.update(n)
                    shards_done[0] += 1
                    if ray:
                        bar.set_postfix_str(f"{shards_done[0]}/{len(plan)} shard tasks")

            paths = [os.path.join(work, name) for name in names]
            entries: list[dict] = [{} for _ in names]
            if ray:
                from stoker.ray.packing import write_shards_on_ray

                address = ray if isinstance(ray, str) else None
                entries = write_shards_on_ray(
                    ds,
                    plan,
                    paths,
                    address=address,
                    progress=progress,
                    transform=transform if steps else None,
                    store=store,
                )
            else:

                def put(i: int) -> None:
                    assert store is not None
                    entries[i] = put_shard(store, paths[i])
                    for path in (paths[i], paths[i] + _core.SIDECAR_SUFFIX):
                        os.unlink(path)

                write_shards(
                    ds,
                    plan,
                    paths,
                    num_threads=writers,
                    progress=progress,
                    transform=transform if steps else None,
                    then=put if store is not None else None,
                )
        extra = {"classes": list(classes)} if classes is not None else None
        if store is not None:
            remove_stale(store, set(names), prefix)  # an unfinished earlier pack's
            store.put_manifest(entries, extra)
            shutil.rmtree(work, ignore_errors=True)
            urls = [store.path_of(n) for n in names]
            return PackResult(store.out, urls, len(ds), sum(e["bytes"] for e in entries))
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
        shutil.rmtree(work, ignore_errors=True)
        for path in moved:
            with contextlib.suppress(OSError):
                os.unlink(path)
        raise
    paths = [os.path.join(out, n) for n in names]
    return PackResult(out, paths, len(ds), sum(os.path.getsize(p) for p in paths))
