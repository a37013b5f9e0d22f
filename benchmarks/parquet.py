"""Parquet and Arrow as the Hugging Face Hub stores them: stoker against `datasets`, pyarrow
and Ray Data reading the same files, and against a bare read-and-decompress loop.

``python benchmarks/parquet.py``: --images JPEGs (smooth colour noise with grain, which
compresses like a photo: about 21 KB at quality 90, 224-288 pixels a side) with int64
labels, made into a ``datasets.Dataset`` the way the Hub stores one
(``Dataset.from_dict({"image": [{"bytes": b, "path": None}, ...], "label": ...})
.cast_column("image", datasets.Image())``, the bytes embedded as ``push_to_hub`` embeds
them) and written once under --work, in row groups of 100 rows:

- ``hub``: ``Dataset.to_parquet(path, batch_size=100)``, datasets' own writer, as
  ``push_to_hub`` writes: the image leaves uncompressed and PLAIN, the label snappy with a
  dictionary, content-defined pages and a page index;
- ``snappy`` and ``zstd``: the same writer's options (pyarrow's ``ParquetWriter`` with
  datasets' per-column options, content-defined chunking and page index, 100 rows per
  ``write_table``) with every column compressed by that codec (datasets' ``to_parquet``
  cannot be told another codec: it sets one per column);
- ``arrow``: ``Dataset.save_to_disk`` (Arrow IPC stream files, uncompressed);
- ``small``: a file of an int64 label and a 50 KB random binary column per row (pyarrow,
  snappy, 100-row groups, a dictionary for the label only, a page index).

Rows (--rows picks kinds or loader keys; every measurement is --epochs epochs (2) of one
loader, each epoch a pass or --max-seconds, whichever ends first, its rate over what it did,
in a process of its own; rounds of every loader in turn, --repeats of them, medians
reported; the files read through the page cache just before each measurement's clock
starts, as this machine's page cache gives pages back within a minute; DataLoaders with
workers keep them between epochs, ``persistent_workers=True``):

1. ``bytes``, on every set of --sets: the image bytes and the label of every row, in
   shuffled batches of --batch-size (bytes as a list, labels as an int64 tensor).
   stoker: ``Loader(Dataset(path), fields={"image": Bytes(), "label": Int()})``, and the
   same with ``shuffle=False`` (rows in order), which no target is over.
   ``datasets``: ``load_dataset("parquet", data_files=path, split="train")`` (for
   ``arrow``: ``load_from_disk``) with the image cast to ``Image(decode=False)`` and
   ``with_format("torch")``, under a DataLoader (``shuffle=True``, a collate that keeps the
   bytes) with 0 and 2 workers, and the same as ``to_iterable_dataset(num_shards=8)
   .shuffle(buffer_size=1000)``; ``load_dataset`` converts the Parquet to Arrow files in its
   cache once, when the data is written, so these rows read that cache as datasets users do.
   pyarrow: an ``IterableDataset`` giving each DataLoader worker its share of the row
   groups, in a shuffled order, read by ``ParquetFile.iter_batches(batch_size=...,
   row_groups=..., columns=["image", "label"])`` (``arrow``, which ``ParquetFile`` cannot
   read: slices of --batch-size consecutive rows of the memory-mapped IPC files, reported
   beside stoker's ``shuffle=False`` row and left out of the target's best peer, as the
   issue's shuffled batches are not what they hand out), 0 and 2 workers; and pyarrow
   shuffling each sample as the other rows do: the whole table (``read_table``; ``arrow``:
   the memory-mapped IPC files), its chunks joined (``combine_chunks``), and ``take`` of
   each batch's rows of a permutation, 0 and 2 workers, reported beside the others but left
   out of the target's best peer (they hold the whole table in each process; the other
   peers read the files as they go). Ray Data:
   ``read_parquet(path).select_columns([...]).iter_batches(batch_format="pyarrow",
   local_shuffle_buffer_size=1000)``, Ray started before the clock with one CPU a core
   (skipped, saying why, where it does not start).
   The ceiling: a bare loop, a process a core, that preads each row group's column chunks
   of ``image.bytes`` and ``label``, walks their page headers and decompresses every page
   (cramjam's snappy and zstd), decoding no values (``arrow``: preads the files' bytes).
2. ``image``, on --image-set: stoker's ``Image(224, crop="none")`` (decoded and resized on
   its threads) against the two best 2-worker peers of row 1 on that set (all three when
   row 1 did not run) doing ``PIL.Image.open(BytesIO(b)).convert("RGB").resize((224, 224))``
   in their collate, that is in their workers.
3. ``small``: stoker's ``Loader(fields={"label": Int()})`` on the ``small`` file: its
   ``stats()["bytes_read"]`` over the label column's compressed bytes (the footer's
   ``total_compressed_size`` of its chunks, page headers and dictionaries included), with
   the process's ``rchar`` (bytes its read calls returned, the footer's included) beside
   it; pyarrow's ``ParquetFile.iter_batches(columns=["label"])`` and ``read_table(columns=
   ["label"])``, by ``rchar`` (``read_bytes`` counts the disk only and is 0 from the page
   cache), each after a pass over a two-row file, so that the modules a first pass imports
   are not counted as reads of the file; and stoker reading the file over HTTP from
   ``stoker.tools.serve.FileServer`` on 127.0.0.1 into an empty cache: the bytes the server
   sent once the dataset is open (the bytes with the footer that opening reads beside it),
   its requests, and what the node cache holds after (the blocks of its files), by
   range requests of the label's column chunks, and, for comparison, from a server that
   ignores range requests (the file fetched whole, as stoker 0.1 always did).

The table shows samples/s of the 1st and the last epoch, each with its ratio to the best peer
(and for row 1 the ceiling) of the same set and epoch, and the first batch's time (the
clock starts after the imports, before the data is opened); --out writes every run's
figures as JSON.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

# datasets must not go looking for the network or draw progress bars.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

import _runner  # noqa: E402 - after the environment it passes on
import numpy as np  # noqa: E402
from _runner import say  # noqa: E402

from stoker._process import usable_cores  # noqa: E402
from stoker.tools.measure import read_through  # noqa: E402
from stoker.tools.serve import FileServer  # noqa: E402

PARQUET_SETS = ("hub", "snappy", "zstd")
SETS = (*PARQUET_SETS, "arrow")
KINDS = ("bytes", "image", "small")
ROW_GROUP = 100
LABELS = 1000
SIZE = 224
BLOB = 50_000  # bytes of the small file's large column, per row
SHUFFLE_BUFFER = 1000
ITERABLE_SHARDS = 8
#: The issue's targets: stoker over the best peer (bytes, image); bytes read over the
#: column's bytes (small).
TARGETS = {"bytes": 5.0, "image": 2.5, "small": 1.2}


@dataclass(frozen=True)
class Entry:
    key: str
    label: str
    kind: str
    sets: tuple[str, ...]
    workers: int = 0
    #: Holds the whole table in each process: reported beside the peers that read the
    #: files as they go, not counted among them for the target.
    in_memory: bool = False
    #: Sets where it hands out consecutive rows unshuffled, not the shuffled batches the
    #: target asks of stoker: reported beside stoker's unshuffled row, not counted.
    unshuffled_on: tuple[str, ...] = ()

    @property
    def peer(self) -> bool:
        return not self.key.startswith(("stoker", "ceiling"))

    def target_peer(self, name: str) -> bool:
        """Counted among the best peer's candidates on set `name`."""
        return self.peer and not self.in_memory and name not in self.unshuffled_on

    @property
    def target_row(self) -> bool:
        """stoker's row the target is over the best peer for."""
        return self.key in ("stoker", "stoker-image")


_DS = "datasets with_format('torch')"
_ITER = "datasets to_iterable_dataset()"
_PA = "pyarrow iter_batches"
_TAKE = "pyarrow whole table in memory + take(shuffled rows)"
ENTRIES = (
    Entry("stoker", "stoker Loader, Bytes() + Int()", "bytes", SETS),
    Entry("stoker-unshuffled", "stoker Loader, Bytes() + Int(), shuffle=False", "bytes", SETS),
    Entry("datasets-0", f"{_DS}, DataLoader 0 workers", "bytes", SETS),
    Entry("datasets-2", f"{_DS}, DataLoader 2 workers", "bytes", SETS, 2),
    Entry("datasets-iter-0", f"{_ITER}, DataLoader 0 workers", "bytes", SETS),
    Entry("datasets-iter-2", f"{_ITER}, DataLoader 2 workers", "bytes", SETS, 2),
    Entry(
        "pyarrow-0",
        f"{_PA} (arrow: IPC slices), DataLoader 0 workers",
        "bytes",
        SETS,
        unshuffled_on=("arrow",),
    ),
    Entry(
        "pyarrow-2",
        f"{_PA} (arrow: IPC slices), DataLoader 2 workers",
        "bytes",
        SETS,
        2,
        unshuffled_on=("arrow",),
    ),
    Entry("pyarrow-take-0", f"{_TAKE}, DataLoader 0 workers", "bytes", SETS, in_memory=True),
    Entry("pyarrow-take-2", f"{_TAKE}, DataLoader 2 workers", "bytes", SETS, 2, True),
    Entry("ray", "Ray Data read_parquet + iter_batches", "bytes", PARQUET_SETS),
    Entry("ceiling", "ceiling: pread + decompress the pages, a process a core", "bytes", SETS),
    Entry("stoker-image", "stoker Loader, Image(224, crop='none')", "image", SETS),
    Entry("datasets-2-pillow", f"{_DS} + Pillow, 2 workers", "image", SETS, 2),
    Entry("datasets-iter-2-pillow", f"{_ITER} + Pillow, 2 workers", "image", SETS, 2),
    Entry(
        "pyarrow-2-pillow",
        f"{_PA} (arrow: IPC slices) + Pillow, 2 workers",
        "image",
        SETS,
        2,
        unshuffled_on=("arrow",),
    ),
    Entry("stoker-small", "stoker Loader, Int() on the label only", "small", ("small",)),
    Entry("pyarrow-small", "pyarrow iter_batches(columns=['label'])", "small", ("small",)),
    Entry("pyarrow-small-table", "pyarrow read_table(columns=['label'])", "small", ("small",)),
    Entry("stoker-remote", "stoker, the label only, over HTTP (FileServer)", "small", ("small",)),
    Entry(
        "stoker-remote-whole",
        "stoker, the label only, over HTTP from a server ignoring ranges (the file whole)",
        "small",
        ("small",),
    ),
)
ENTRY = {e.key: e for e in ENTRIES}
PILLOW_PEERS = ("datasets-2", "datasets-iter-2", "pyarrow-2")  # row 1's peers row 2 may take


# -- the data ----------------------------------------------------------------------------


def _jpeg(rng: np.random.Generator) -> bytes:
    """A photo-like JPEG: colour noise upsampled smooth, with a fine grain over it."""
    from PIL import Image

    w, h = (256 + int(rng.integers(-32, 33)) for _ in range(2))
    low = (rng.random((h // 16 + 1, w // 16 + 1, 3)) * 255).astype(np.uint8)
    smooth = np.asarray(Image.fromarray(low).resize((w, h), Image.BICUBIC), np.int16)
    grain = rng.integers(-8, 9, (h, w, 3), dtype=np.int16)
    out = io.BytesIO()
    Image.fromarray(np.clip(smooth + grain, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=90)
    return out.getvalue()


def paths(work: str, images: int) -> dict[str, str]:
    folder = os.path.join(work, f"{images}-images")
    out = {s: os.path.join(folder, f"{s}.parquet") for s in PARQUET_SETS}
    out["arrow"] = os.path.join(folder, "saved")
    out["small"] = os.path.join(folder, "small", "small.parquet")
    out["hf-cache"] = os.path.join(folder, "hf-cache")
    return out


def prepare(work: str, images: int) -> dict[str, str]:
    """Every set, written once (a stamp says for how many images)."""
    where = paths(work, images)
    folder = os.path.dirname(where["hub"])
    stamp = os.path.join(folder, "stamp.json")
    want = {"images": images, "row_group": ROW_GROUP, "blob": BLOB, "version": 1}
    if _runner.stamp_if_current(stamp, want) is not None:
        return where
    import datasets

    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(os.path.dirname(where["small"]))
    say(f"writing {images} JPEGs as Parquet (hub, snappy, zstd) and save_to_disk into {folder}")
    rng = np.random.default_rng(0)
    labels = rng.integers(0, LABELS, images)
    ds = datasets.Dataset.from_dict(
        {"image": [{"bytes": _jpeg(rng), "path": None} for _ in range(images)], "label": labels}
    ).cast_column("image", datasets.Image())
    ds.to_parquet(where["hub"], batch_size=ROW_GROUP)
    for codec in ("snappy", "zstd"):
        _write_like_datasets(ds, where[codec], codec)
    ds.save_to_disk(where["arrow"])
    for s in PARQUET_SETS:  # load_dataset's conversion to its Arrow cache, done once here
        datasets.load_dataset(
            "parquet", data_files=where[s], split="train", cache_dir=where["hf-cache"]
        )
    _write_small(where["small"], labels, rng)
    with open(stamp, "w") as f:
        json.dump(want, f)
    return where


def _write_like_datasets(ds, path: str, codec: str) -> None:
    """What ``Dataset.to_parquet`` writes, every column compressed with `codec`."""
    import pyarrow.parquet as pq
    from datasets import config
    from datasets.arrow_writer import get_parquet_column_options

    table = ds.data.table
    options = get_parquet_column_options(ds.features, table.schema)
    options["compression"] = codec
    cdc = config.DEFAULT_CDC_OPTIONS
    with pq.ParquetWriter(
        path, table.schema, use_content_defined_chunking=cdc, write_page_index=True, **options
    ) as writer:
        for offset in range(0, len(table), ROW_GROUP):
            writer.write_table(table.slice(offset, ROW_GROUP))


def _write_small(path: str, labels: np.ndarray, rng: np.random.Generator) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("label", pa.int64()), ("blob", pa.binary())])
    with pq.ParquetWriter(path, schema, use_dictionary=["label"], write_page_index=True) as w:
        for offset in range(0, len(labels), ROW_GROUP):
            part = labels[offset : offset + ROW_GROUP]
            blobs = [rng.bytes(BLOB) for _ in part]
            w.write_table(pa.table({"label": part, "blob": blobs}, schema=schema))


def column_bytes(path: str, column: str) -> int:
    """The compressed bytes of a column's chunks, as the footer gives them."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    j = meta.schema.names.index(column)
    return sum(
        meta.row_group(g).column(j).total_compressed_size for g in range(meta.num_row_groups)
    )


def _files_of(path: str) -> list[str]:
    if os.path.isdir(path):
        return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".arrow"))
    return [path]


def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


# -- the batches the peers hand out ------------------------------------------------------


def pillow_224(data: bytes) -> np.ndarray:
    """The peers' decode: the whole image to 224x224 RGB, CHW as stoker's Image gives it."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB").resize((SIZE, SIZE))).transpose(2, 0, 1)


def _batch(images: list[bytes], labels, decode: bool) -> dict:
    import torch

    if decode:
        return {
            "image": torch.from_numpy(np.stack([pillow_224(b) for b in images])),
            "label": labels,
        }
    return {"image": images, "label": labels}


def collate_rows(rows: list[dict], decode: bool = False) -> dict:
    """datasets' rows (``{"image": {"bytes", "path"}, "label": tensor}``) into a batch."""
    import torch

    return _batch(
        [r["image"]["bytes"] for r in rows], torch.stack([r["label"] for r in rows]), decode
    )


def arrow_batch(batch, decode: bool = False) -> dict:
    """A pyarrow RecordBatch or Table of ``image`` (struct) and ``label`` into a batch."""
    import pyarrow as pa
    import torch

    images = batch.column("image")
    if isinstance(images, pa.ChunkedArray):
        images = images.combine_chunks()
    labels = torch.tensor(batch.column("label").to_numpy())
    return _batch(images.field("bytes").to_pylist(), labels, decode)


class ArrowUnits:
    """pyarrow under a DataLoader (as ``iterable(ArrowUnits(...))``): the DataLoader's
    workers take turns over the units (Parquet row groups; for Arrow IPC files, slices of
    --batch-size rows) in a shuffled order, each yielding whole batches."""

    def __init__(self, source: str, batch_size: int, decode: bool) -> None:
        import pyarrow.parquet as pq

        self.source, self.batch_size, self.decode = source, batch_size, decode
        if source.endswith(".parquet"):
            self.units = list(range(pq.ParquetFile(source).metadata.num_row_groups))
        else:
            rows = sum(len(self._ipc(f)) for f in _files_of(source))
            self.units = list(range(0, rows, batch_size))

    @staticmethod
    def _ipc(path: str):
        import pyarrow as pa

        return pa.ipc.open_stream(pa.memory_map(path)).read_all()

    def __iter__(self):
        import pyarrow as pa
        import pyarrow.parquet as pq
        import torch

        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        order = np.random.default_rng(0).permutation(len(self.units))  # one epoch is measured
        mine = [self.units[i] for i in order[worker::workers]]
        if self.source.endswith(".parquet"):
            batches = pq.ParquetFile(self.source).iter_batches(
                batch_size=self.batch_size, row_groups=mine, columns=["image", "label"]
            )
        else:
            table = pa.concat_tables(self._ipc(f) for f in _files_of(self.source))
            batches = (table.slice(start, self.batch_size) for start in mine)
        for batch in batches:
            yield arrow_batch(batch, self.decode)


class ArrowTake:
    """pyarrow with each sample shuffled, as stoker and the DataLoader rows shuffle (the
    units of ArrowUnits keep their rows together): the whole table, read once a process
    (Parquet: ``read_table``, into memory; Arrow IPC: the memory-mapped files) and its
    chunks joined into one array a column, then ``take`` of each batch's rows of a
    permutation of them all, the DataLoader's workers taking turns over the batches."""

    def __init__(self, source: str, batch_size: int, decode: bool) -> None:
        self.source, self.batch_size, self.decode = source, batch_size, decode

    def __iter__(self):
        import pyarrow as pa
        import torch

        images, labels = self._columns()
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        order = np.random.default_rng(0).permutation(len(labels))
        starts = range(worker * self.batch_size, len(order), workers * self.batch_size)
        for start in starts:
            rows = pa.array(order[start : start + self.batch_size])
            label = torch.tensor(labels.take(rows).to_numpy())
            yield _batch(images.take(rows).to_pylist(), label, self.decode)

    @functools.cache  # noqa: B019 - one table a process, kept for the next epoch
    def _columns(self):
        """The image bytes and the labels, each one array: made at the first epoch."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        if self.source.endswith(".parquet"):
            table = pq.read_table(self.source, columns=["image", "label"], memory_map=True)
        else:
            table = pa.concat_tables(ArrowUnits._ipc(f) for f in _files_of(self.source))
        # One array a column (take() over many chunks joins them at every call), and the
        # image bytes taken from the struct's child: Table.take of the struct is 15x slower.
        table = table.combine_chunks()
        return table.column("image").chunk(0).field("bytes"), table.column("label").chunk(0)


def iterable(items):
    """`items` (anything with ``__iter__``) as a torch IterableDataset, which a DataLoader
    splits over its workers by what each worker's iterator yields."""
    from torch.utils.data import IterableDataset

    class Items(IterableDataset):
        def __iter__(self):
            return iter(items)

    return Items()


# -- the loaders, in a child process -----------------------------------------------------


def _datasets(source: str, cache: str):
    import datasets

    if os.path.isdir(source):
        ds = datasets.load_from_disk(source)
    else:
        ds = datasets.load_dataset("parquet", data_files=source, split="train", cache_dir=cache)
    return ds.cast_column("image", datasets.Image(decode=False))


class Passes:
    """An iterable of epochs made by `make` (a pass over a dataset), one per ``iter()``."""

    def __init__(self, make):
        self.make = make

    def __iter__(self):
        return iter(self.make())


def base_of(entry: Entry) -> str:
    return entry.key.removesuffix("-pillow")


def build(entry: Entry, source: str, args: argparse.Namespace):
    """The entry's loader: an iterable of batches, each a dict with a "label" tensor."""
    from torch.utils.data import DataLoader

    base = base_of(entry)
    decode = entry.key.endswith("-pillow")
    batch = args.batch_size
    if entry.key.startswith("stoker"):
        import stoker

        image = stoker.Image(SIZE, crop="none") if entry.kind == "image" else stoker.Bytes()
        fields = {"image": image, "label": stoker.Int()}
        shuffle = entry.key != "stoker-unshuffled"
        return stoker.Loader(stoker.Dataset(source), batch, fields=fields, shuffle=shuffle, seed=0)
    if base.startswith("datasets"):
        ds = _datasets(source, args.hf_cache).with_format("torch")
        collate = functools.partial(collate_rows, decode=decode)
        if base.startswith("datasets-iter"):
            ids = ds.to_iterable_dataset(num_shards=ITERABLE_SHARDS).shuffle(
                seed=0, buffer_size=SHUFFLE_BUFFER
            )
            return DataLoader(
                ids,
                batch_size=batch,
                num_workers=entry.workers,
                collate_fn=collate,
                persistent_workers=entry.workers > 0,
            )
        return DataLoader(
            ds,
            batch_size=batch,
            shuffle=True,
            num_workers=entry.workers,
            collate_fn=collate,
            persistent_workers=entry.workers > 0,
        )
    if base.startswith("pyarrow"):
        make = ArrowTake if base.startswith("pyarrow-take") else ArrowUnits
        units = make(source, batch, decode)
        return DataLoader(
            iterable(units),
            batch_size=None,
            num_workers=entry.workers,
            persistent_workers=entry.workers > 0,
        )
    if base == "ray":
        import ray.data

        ds = ray.data.read_parquet(source).select_columns(["image", "label"])
        return Passes(
            lambda: (
                arrow_batch(b)
                for b in ds.iter_batches(
                    batch_size=batch,
                    batch_format="pyarrow",
                    local_shuffle_buffer_size=SHUFFLE_BUFFER,
                    local_shuffle_seed=0,
                )
            )
        )
    raise ValueError(entry.key)


def _start_ray() -> str | None:
    """Start Ray (before the clock); why it would not, or None."""
    try:
        import ray
        import ray.data

        ray.init(num_cpus=usable_cores(), include_dashboard=False, log_to_driver=False)
        ray.data.DataContext.get_current().enable_progress_bars = False
    except Exception as e:  # noqa: BLE001 - any failure to start is a skip, said as such
        return f"Ray did not start: {type(e).__name__}: {str(e)[:200]}"
    return None


def epoch(loader, max_seconds: float, began: float) -> dict:
    """One pass over `loader`, or as much of it as fits in `max_seconds` from `began`."""
    samples, first = 0, None
    for batch in loader:
        if first is None:
            first = time.perf_counter() - began
        samples += len(batch["label"])
        if time.perf_counter() - began >= max_seconds:
            break
    return {"samples": samples, "seconds": time.perf_counter() - began, "first_batch_s": first}


def child(args: argparse.Namespace) -> dict:
    import pyarrow.parquet  # noqa: F401 - imports are not what is measured
    import torch  # noqa: F401

    entry = ENTRY[args.child]
    source = args.source
    if entry.key == "ceiling":
        read_through(_files_of(source))
        return ceiling(source, args.max_seconds, args.epochs)
    if entry.kind == "small":
        return small(entry, source, args)
    if entry.key.startswith("stoker"):
        import stoker  # noqa: F401
    elif entry.key == "ray":
        if (why := _start_ray()) is not None:
            return {"skipped": why}
    else:
        import datasets  # noqa: F401
        import PIL.Image  # noqa: F401
    # This machine's page cache gives files back within a minute (DAMON reclaim): each
    # measurement reads its files through just before its clock starts.
    read_through(_files_of(args.hf_cache if base_of(entry).startswith("datasets") else source))
    began = time.perf_counter()
    loader = build(entry, source, args)
    result = epoch(loader, args.max_seconds, began)
    result["epochs"] = [{"samples": result["samples"], "seconds": result["seconds"]}]
    for e in range(1, args.epochs):
        if entry.key.startswith("stoker"):
            loader.set_epoch(e)
        later = epoch(loader, args.max_seconds, time.perf_counter())
        result["epochs"].append({"samples": later["samples"], "seconds": later["seconds"]})
    if entry.key.startswith("stoker"):
        result["bytes_read"] = loader.stats()["bytes_read"]
    elif entry.key == "ray":
        import ray

        ray.shutdown()
    return result


def _label_reader(key: str, batch_size: int):
    """Row 3's local readers: a function of a path giving an iterable of label batches."""
    import pyarrow.parquet as pq
    import torch

    import stoker

    def labels(column) -> dict:
        return {"label": torch.tensor(column.to_numpy())}

    if key == "pyarrow-small":
        return lambda path: (
            labels(b.column(0))
            for b in pq.ParquetFile(path).iter_batches(batch_size=batch_size, columns=["label"])
        )
    if key == "pyarrow-small-table":
        return lambda path: (
            labels(b.column(0))
            for b in pq.read_table(path, columns=["label"]).to_batches(max_chunksize=batch_size)
        )
    fields = {"label": stoker.Int()}
    return lambda path: stoker.Loader(stoker.Dataset(path), batch_size, fields=fields, seed=0)


def small(entry: Entry, source: str, args: argparse.Namespace) -> dict:
    """Row 3: one small column of a file with a large one; what reading it costs in bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if entry.key.startswith("stoker-remote"):
        return _remote(source, args, ranges=entry.key == "stoker-remote")
    read = _label_reader(entry.key, args.batch_size)
    # A pass over a file of two rows first: the lazy imports of a first pass (pyarrow's
    # to_numpy reads 10 MB of modules) are not reads of the file.
    with tempfile.TemporaryDirectory() as scratch:
        warm = os.path.join(scratch, "warm.parquet")
        pq.write_table(pa.table({"label": [1, 2], "blob": [b"x", b"y"]}), warm)
        epoch(read(warm), args.max_seconds, time.perf_counter())
    began, before = time.perf_counter(), rchar()
    loader = read(source)
    result = epoch(loader, args.max_seconds, began) | {"rchar": rchar() - before}
    if entry.key == "stoker-small":
        result["bytes_read"] = loader.stats()["bytes_read"]
    return result


def _remote(source: str, args: argparse.Namespace, ranges: bool) -> dict:
    """Row 3 over HTTP: stoker reading the label from the file served by stoker's server
    (one that ignores range requests, without `ranges`: the file is then fetched whole)."""
    import stoker

    cache = tempfile.mkdtemp(prefix="stoker-parquet-cache-")
    try:
        with CountingServer(os.path.dirname(source), ranges) as server:
            began = time.perf_counter()
            ds = stoker.Dataset(server.url_for(os.path.basename(source)), cache_dir=cache)
            opened = server.sent  # (the footer, read to count the rows)
            fields = {"label": stoker.Int()}
            loader = stoker.Loader(ds, args.batch_size, fields=fields, seed=0)
            result = epoch(loader, args.max_seconds, began)
            cached = stoker.remote.cache_for(cache).usage()  # (a copy in part: its blocks)
            return result | {
                "bytes_read": loader.stats()["bytes_read"],
                "served": server.sent,
                "fetched": server.sent - opened,
                "requests": server.requests,
                "cached": cached,
            }
    finally:
        shutil.rmtree(cache, ignore_errors=True)


class CountingServer(FileServer):
    """stoker's file server, counting the body bytes it sends and the requests."""

    def __init__(self, root: str, ranges: bool = True) -> None:
        super().__init__(root, ranges=ranges)
        self.sent = 0
        self.requests: list[str] = []

    def add_bytes(self, n: int) -> None:
        self.sent += n

    def record(self, request, relpath: str, status: int) -> None:
        span = request.headers.get("Range", "whole")
        self.requests.append(f"{request.method} {relpath} {status} {span}")


# -- the ceiling -------------------------------------------------------------------------

_PAGES: dict = {}  # what the ceiling's forked processes read: set before the fork


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _zigzag(buf: bytes, pos: int) -> tuple[int, int]:
    value, pos = _varint(buf, pos)
    return (value >> 1) ^ -(value & 1), pos


def _skip(buf: bytes, pos: int, kind: int) -> int:
    """Past one value of Thrift compact type `kind`."""
    if kind in (1, 2):  # a bool in a field header
        return pos
    if kind in (3, 7):  # byte, double
        return pos + (1 if kind == 3 else 8)
    if kind in (4, 5, 6):  # i16, i32, i64
        return _varint(buf, pos)[1]
    if kind == 8:  # binary
        n, pos = _varint(buf, pos)
        return pos + n
    if kind in (9, 10):  # list, set
        n, element = buf[pos] >> 4, buf[pos] & 0x0F
        pos += 1
        if n == 15:
            n, pos = _varint(buf, pos)
        for _ in range(n):
            pos = pos + 1 if element in (1, 2) else _skip(buf, pos, element)
        return pos
    if kind == 11:  # map
        n, pos = _varint(buf, pos)
        if n:
            types = buf[pos]
            pos += 1
            for _ in range(n):
                pos = _skip(buf, _skip(buf, pos, types >> 4), types & 0x0F)
        return pos
    if kind == 12:
        return _struct(buf, pos)[1]
    raise ValueError(f"Thrift compact type {kind} at {pos}")


def _struct(buf: bytes, pos: int) -> tuple[dict, int]:
    """A Thrift compact struct's integer, bool and struct fields by id, and where it ends."""
    fields, last = {}, 0
    while True:
        head = buf[pos]
        pos += 1
        kind = head & 0x0F
        if kind == 0:
            return fields, pos
        if head >> 4:
            last += head >> 4
        else:
            last, pos = _zigzag(buf, pos)
        if kind in (1, 2):
            fields[last] = kind == 1
        elif kind in (4, 5, 6):
            fields[last], pos = _zigzag(buf, pos)
        elif kind == 12:
            fields[last], pos = _struct(buf, pos)
        else:
            pos = _skip(buf, pos, kind)


def _decompress_chunk(buf: bytes, codec: str) -> int:
    """Every page of a column chunk decompressed (the values left undecoded); the bytes."""
    import cramjam

    decompress = {"SNAPPY": cramjam.snappy.decompress_raw, "ZSTD": cramjam.zstd.decompress}.get(
        codec
    )
    view, pos, out = memoryview(buf), 0, 0
    while pos < len(buf):
        header, pos = _struct(buf, pos)  # PageHeader: 3 compressed size, 8 a v2 data page
        page = view[pos : pos + header[3]]
        pos += header[3]
        v2 = header.get(8, {})
        levels = v2.get(5, 0) + v2.get(6, 0)  # a v2 page's levels are never compressed
        if decompress is None or not v2.get(7, True):
            out += len(page)
        else:
            out += levels + len(decompress(page[levels:]))
    return out


def _ceiling_unit(unit: int) -> int:
    """The rows of one unit, read (and, for Parquet, its pages decompressed) in this process."""
    fd = _PAGES.get("fd")
    if fd is None:
        fd = _PAGES["fd"] = {}
    rows, reads = _PAGES["units"][unit]
    for path, offset, length, codec in reads:
        if path not in fd:
            fd[path] = os.open(path, os.O_RDONLY)
        data = os.pread(fd[path], length, offset)
        if codec is not None:
            _decompress_chunk(data, codec)
    return rows


def _ceiling_units(source: str) -> list:
    """(rows, [(path, offset, length, codec or None)]) per unit: a row group's chunks of
    image.bytes and label, or 8 MB of an Arrow file."""
    import pyarrow.parquet as pq

    if not source.endswith(".parquet"):
        units = []
        for path in _files_of(source):
            rows, size, step = len(ArrowUnits._ipc(path)), os.path.getsize(path), 8 << 20
            for offset in range(0, size, step):
                share = rows * min(size, offset + step) // size - rows * offset // size
                units.append((share, [(path, offset, step, None)]))
        return units
    meta = pq.ParquetFile(source).metadata
    wanted = [
        j for j in range(meta.num_columns) if meta.schema.column(j).path in ("image.bytes", "label")
    ]
    units = []
    for g in range(meta.num_row_groups):
        group, reads = meta.row_group(g), []
        for j in wanted:
            c = group.column(j)
            start = c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset
            reads.append((source, start, c.total_compressed_size, c.compression))
        units.append((group.num_rows, reads))
    return units


def ceiling(source: str, max_seconds: float, epochs: int) -> dict:
    import multiprocessing

    _PAGES["units"] = _ceiling_units(source)
    with multiprocessing.get_context("fork").Pool(usable_cores()) as pool:
        pool.map(abs, range(usable_cores()))  # the processes are up before the clock
        passes = []
        for _ in range(epochs):
            began, samples = time.perf_counter(), 0
            for rows in pool.imap_unordered(_ceiling_unit, range(len(_PAGES["units"]))):
                samples += rows
                if time.perf_counter() - began >= max_seconds:
                    break
            passes.append({"samples": samples, "seconds": time.perf_counter() - began})
    return {**passes[0], "first_batch_s": None, "epochs": passes}


# -- the parent --------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3, help="rounds; medians are reported")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--max-seconds", type=float, default=120, help="seconds per measurement")
    parser.add_argument(
        "--epochs", type=int, default=2, help="epochs per measurement, the loader made once"
    )
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "stoker-parquet"))
    parser.add_argument(
        "--sets", default=",".join(SETS), help=f"row 1's sets: some of {','.join(SETS)}"
    )
    parser.add_argument("--image-set", default="hub", choices=SETS, help="row 2's set")
    parser.add_argument(
        "--rows", help=f"kinds ({','.join(KINDS)}) or loader keys ({','.join(ENTRY)})"
    )
    parser.add_argument("--out", dest="json", help="write every figure here as JSON (or --json)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)
    parser.add_argument("--hf-cache", help=argparse.SUPPRESS)
    _runner.add_arguments(
        parser,
        timeout=900,
        timeout_help="seconds per measurement's process, before it is killed",
        measured="measurements",
        json_help="write every figure here as JSON (or --out)",
    )
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return
    sets = args.sets.split(",")
    picked = args.rows.split(",") if args.rows else list(KINDS)
    keys = {e.key for e in ENTRIES if e.kind in picked or e.key in picked}
    unknown = [s for s in sets if s not in SETS]
    unknown += [k for k in picked if k not in KINDS and k not in ENTRY]
    if unknown:
        parser.error(f"unknown sets or rows: {', '.join(unknown)}")
    limits = _runner.Limits(parser, args)
    where = prepare(args.work, args.images)
    say(
        f"{args.images} JPEGs (~21 KB, 224-288 px) + int64 labels, row groups of {ROW_GROUP}, "
        f"shuffled batches of {args.batch_size}, {args.epochs} epochs of one loader per "
        f"measurement (each a pass or {args.max_seconds:g} s), median of {args.repeats} "
        f"rounds, files read through the page cache before each, {usable_cores()} cores"
    )
    results: dict = {
        "config": vars(args) | {"cores": usable_cores()},
        "bytes": {},
        "image": {},
        "small": {},
    }
    with _runner.Interruptible("parquet") as measuring:
        plan = [
            (s, e)
            for s in sets
            for e in ENTRIES
            if e.kind == "bytes" and e.key in keys and s in e.sets
        ]
        _rounds(plan, results["bytes"], where, args, limits)
        chosen = _pillow_peers(results["bytes"].get(args.image_set, {}))
        plan = [
            (args.image_set, e)
            for e in ENTRIES
            if e.kind == "image"
            and e.key in keys
            and (not e.peer or e.key.removesuffix("-pillow") in chosen)
        ]
        _rounds(plan, results["image"], where, args, limits)
        plan = [("small", e) for e in ENTRIES if e.kind == "small" and e.key in keys]
        results["small_label_bytes"] = column_bytes(where["small"], "label")
        results["small_file_bytes"] = os.path.getsize(where["small"])
        _rounds(plan, results["small"], where, args, limits)
    report(results)
    if measuring.stopped:
        say(f"(stopped: {measuring.stopped})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def _pillow_peers(bytes_results: dict) -> tuple[str, ...]:
    """Row 2's peers: the two fastest of row 1's 2-worker peers on the set, or all three."""
    rates = {k: r for k in PILLOW_PEERS if (r := _rate(bytes_results.get(k, [])))}
    if len(rates) < 2:
        return PILLOW_PEERS
    return tuple(sorted(rates, key=rates.get, reverse=True)[:2])


def _rounds(plan: list[tuple[str, Entry]], into: dict, where: dict, args, limits) -> None:
    """--repeats rounds of every (set, entry) in `plan`, in turn; a failed or skipped entry
    is not run again."""
    read_through(sorted({f for s, _ in plan for f in _files_of(where[s])}))
    done: set[tuple[str, str]] = set()
    for _ in range(args.repeats):
        for name, entry in plan:
            if (name, entry.key) in done:
                continue
            command = [sys.executable, os.path.abspath(__file__), "--child", entry.key]
            command += ["--source", where[name], "--hf-cache", where["hf-cache"]]
            command += [
                "--batch-size",
                str(args.batch_size),
                "--max-seconds",
                str(args.max_seconds),
                "--epochs",
                str(args.epochs),
            ]
            run = _runner.run_child(command, limits.next_slot())
            outcome = run.result if run.failed is None and run.result else None
            if outcome is None:
                outcome = {"failed": run.failed or "no result", "stderr": run.stderr[-800:]}
                say(f"{name} {entry.key}: {outcome['failed']}\n{outcome['stderr']}")
            outcome["peak_rss"] = run.peak_rss
            into.setdefault(name, {}).setdefault(entry.key, []).append(outcome)
            if "failed" in outcome or "skipped" in outcome:
                done.add((name, entry.key))


def _good(runs: list[dict]) -> list[dict]:
    return [r for r in runs if "samples" in r and r["seconds"] > 0]


def _rate(runs: list[dict]) -> float:
    good = _good(runs)
    return statistics.median(r["samples"] / r["seconds"] for r in good) if good else 0.0


def _later_rate(runs: list[dict]) -> float | None:
    """The median rate of the measurements' last epoch, where they ran more than one."""
    good = [r["epochs"][-1] for r in _good(runs) if len(r.get("epochs", ())) > 1]
    good = [e for e in good if e["seconds"] > 0]
    return statistics.median(e["samples"] / e["seconds"] for e in good) if good else None


def _median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in _good(runs) if r.get(key) is not None]
    return statistics.median(values) if values else None


def _why_not(runs: list[dict]) -> str:
    last = runs[-1]
    return f"skipped: {last['skipped']}" if "skipped" in last else f"failed: {last.get('failed')}"


def _row(*cells: object) -> None:
    say("| " + " | ".join("" if c is None else str(c) for c in cells) + " |")


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "" if value is None else f"{value:{spec}}{suffix}"


def report(results: dict) -> None:
    summary = results.setdefault("summary", {})
    for kind in ("bytes", "image"):
        target = TARGETS[kind]
        for name, rows in results[kind].items():
            what = "bytes + labels" if kind == "bytes" else "Image(224) against Pillow"
            say(f"\n{what}, {name} (target: stoker >= {target:g}x the best peer):")
            _row(
                "loader",
                "samples",
                "samples/s",
                "x best peer",
                "/ ceiling",
                "later epoch samples/s",
                "x best peer",
                "/ ceiling",
                "1st batch (s)",
                "target",
            )
            say("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
            peers = [r for k, r in rows.items() if ENTRY[k].target_peer(name)]
            best = max((_rate(r) for r in peers), default=0.0) or None
            top = _rate(rows.get("ceiling", [])) or None
            later_best = max((_later_rate(r) or 0.0 for r in peers), default=0.0)
            later_top = _later_rate(rows.get("ceiling", []))
            figures = summary.setdefault(kind, {}).setdefault(name, {})
            for key, runs in rows.items():
                entry = ENTRY[key]
                if not _good(runs):
                    _row(entry.label, "", _why_not(runs), "", "", "", "", "", "", "")
                    continue
                rate, later = _rate(runs), _later_rate(runs)
                x_best = rate / best if best else None
                x_top = rate / top if top and key != "ceiling" else None
                x_later = later / later_best if later and later_best else None
                x_later_top = None
                if later and later_top and key != "ceiling":
                    x_later_top = later / later_top
                met = ""
                if entry.target_row and x_best is not None:
                    met = f">= {target:g}x: 1st epoch {'met' if x_best >= target else 'NOT met'}"
                    if x_later is not None:
                        met += f", later {'met' if x_later >= target else 'NOT met'}"
                samples = statistics.median(r["samples"] for r in _good(runs))
                first = _median(runs, "first_batch_s")
                _row(entry.label, f"{samples:.0f}", f"{rate:,.0f}", _fmt(x_best, ".1f", "x"),
                     _fmt(x_top, ".2f"), _fmt(later, ",.0f"), _fmt(x_later, ".1f", "x"),
                     _fmt(x_later_top, ".2f"), _fmt(first, ".3f"), met)  # fmt: skip
                figures[key] = {
                    "rate": rate,
                    "x_best_peer": x_best,
                    "x_ceiling": x_top,
                    "later_rate": later,
                    "later_x_best_peer": x_later,
                }
            _report_beside(rows, name)
    _report_small(results, summary)


def _report_beside(rows: dict, name: str) -> None:
    """stoker over each peer the target leaves out on set `name`, and why it does."""
    ours = [k for k in rows if k.startswith("stoker") and _good(rows[k])]
    for key, runs in rows.items():
        entry = ENTRY[key]
        if not entry.peer or entry.target_peer(name) or not _good(runs):
            continue
        if entry.in_memory:
            why = "it holds the whole table in each process"
        else:
            why = "it hands out consecutive rows, unshuffled"
        for mine in ours:
            first = _rate(rows[mine]) / _rate(runs)
            later = _later_rate(rows[mine]), _later_rate(runs)
            again = f", later {later[0] / later[1]:.1f}x" if later[0] and later[1] else ""
            say(
                f"- {ENTRY[mine].label} over {entry.label} (not a target peer: {why}): "
                f"1st epoch {first:.1f}x{again}"
            )


def _report_small(results: dict, summary: dict) -> None:
    rows = results["small"].get("small")
    if not rows:
        return
    column, whole = results["small_label_bytes"], results["small_file_bytes"]
    target = TARGETS["small"]
    say(
        f"\none small column: the label ({column:,} bytes compressed) of a file of {whole:,} "
        f"bytes (target: stoker reads <= {target:g}x the column's bytes):"
    )
    _row("loader", "samples/s", "bytes read", "/ column", "rchar / column", "HTTP", "target")
    say("|---|---:|---:|---:|---:|---|---|")
    figures = summary.setdefault("small", {})
    for key, runs in rows.items():
        entry = ENTRY[key]
        if not _good(runs):
            _row(entry.label, _why_not(runs), "", "", "", "", "")
            continue
        rchar_read = _median(runs, "rchar")
        # (From a server ignoring ranges the file comes whole as the dataset opens.)
        counted = {"stoker-remote": "fetched", "stoker-remote-whole": "served"}.get(key, "rchar")
        counted = "bytes_read" if key == "stoker-small" else counted
        read = _median(runs, counted)
        x_column = read / column if read is not None else None
        http = ""
        if key.startswith("stoker-remote"):
            last = _good(runs)[-1]
            http = (
                f"{len(last['requests'])} requests, {last['served']:,} bytes with the open's "
                f"footer; the cache holds {last['cached']:,} bytes"
            )
        met = ""
        if key.startswith("stoker") and key != "stoker-remote-whole" and x_column is not None:
            met = f"<= {target:g}x: {'met' if x_column <= target else 'NOT met'}"
        x_rchar = rchar_read / column if rchar_read else None
        _row(entry.label, f"{_rate(runs):,.0f}", _fmt(read, ",.0f"), _fmt(x_column, ".2f", "x"),
             _fmt(x_rchar, ".2f", "x"), http, met)  # fmt: skip
        figures[key] = {
            "rate": _rate(runs),
            "bytes": read,
            "x_column": x_column,
            "rchar": rchar_read,
        }


if __name__ == "__main__":
    main()
