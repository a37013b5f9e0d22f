"""What ``stoker pack`` makes of a table source's fields (Parquet, Arrow IPC): tar members
in the WebDataset convention, so the packed shards read as any other's.

- An image column (byte values whose first bytes are an image's magic) becomes a member
  named by the image's type, ``KEY.jpg`` or ``KEY.png``, found value by value (the Hub's
  ``Image`` feature mixes JPEGs and PNGs in one column). Where several columns hold images,
  each keeps its name before the type (``KEY.mask.png``). The ``path`` beside the Hub's
  ``image.bytes`` (the file the bytes came from, or null) is left out.
- An integer column ``label`` becomes ``KEY.cls``, its value in ASCII digits.
- Other numbers become text (digits, a float's ``repr``), lists of numbers ``.npy`` files,
  and other bytes (text, binary) stay as they are, each under its field's name (a struct
  leaf's dotted path: ``KEY.meta.source``).

Numbers become text rather than raw bytes because that is what WebDataset readers and
stoker's ``Int()`` expect of a member; the bytes are sniffed rather than named by an option
because the Hub's image columns say nothing of their type, and one column may hold several.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from stoker.dataset import Dataset
from stoker.errors import StokerError
from stoker.formats import TABLE_SOURCES, format_of, is_url
from stoker.writer import encode_value

#: An image's first bytes, and the member extension it gets.
_IMAGE_MAGIC = (
    (b"\xff\xd8\xff", "jpg"),
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"GIF87a", "gif"),
    (b"GIF89a", "gif"),
    (b"BM", "bmp"),
    (b"II*\x00", "tiff"),
    (b"MM\x00*", "tiff"),
)


def image_type(data: bytes | np.ndarray) -> str | None:
    """The extension of the image `data` holds, by its magic (None: no image it knows)."""
    if isinstance(data, np.ndarray):
        if data.ndim != 1 or data.dtype != np.uint8:  # (numbers, not bytes)
            return None
        data = data[:12].tobytes()
    head = data[:12]
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    for magic, ext in _IMAGE_MAGIC:
        if head.startswith(magic):
            return ext
    return None


def is_table_dataset(ds: Dataset) -> bool:
    """Whether every shard of `ds` is a table file (Parquet, Arrow IPC)."""

    def is_table(path: str) -> bool:
        try:
            return format_of(path) in TABLE_SOURCES
        except StokerError:  # (a dataset of loose files: its "shards" are the files)
            return False

    return bool(ds.shards) and all(is_table(path) for path in ds.shards)


@dataclass
class TableMembers:
    """How each field of a table dataset is written: decided once from its first sample,
    so that every shard, written on its own thread, names members alike."""

    images: dict[str, str] = field(default_factory=dict)  # image column -> member name stem
    typed: dict[str, bool] = field(default_factory=dict)  # numeric column -> is a list
    dropped: set[str] = field(default_factory=set)

    def convert(self, batch: list[dict]) -> None:
        """Each sample of `batch` (as get_batch gives it) as bytes per member name."""
        for sample in batch:
            for name in list(sample):
                if name == "__key__":
                    continue
                value = sample.pop(name)
                if name in self.dropped:
                    continue
                member, data = self._member(name, value)
                sample[member] = data

    def _member(self, name: str, value: np.ndarray) -> tuple[str, bytes]:
        if name in self.images:
            stem = self.images[name]
            ext = image_type(value)
            if ext is None:  # (an image type not sniffed: kept, under its column's name)
                return name, value.tobytes()
            return (f"{stem}.{ext}" if stem else ext), value.tobytes()
        listed = self.typed.get(name)
        if listed is None and (value.ndim == 0 or value.dtype != np.uint8):
            listed = value.ndim > 0  # (a field absent from the first sample)
        if listed is None:
            return name, value.tobytes()
        if listed:
            return name, bytes(encode_value(value))
        if name == "label" and np.issubdtype(value.dtype, np.integer):
            return "cls", bytes(encode_value(value.item()))
        return name, bytes(encode_value(value.item()))


def table_members(ds: Dataset) -> TableMembers:
    """How `ds`'s fields are packed, from what its first sample holds: which fields are
    typed (numbers, lists of numbers), and which hold images."""
    plan = TableMembers()
    if not len(ds):
        return plan
    first = np.zeros(1, np.int64)
    with ds.holding(first):
        members = ds.gather(first).columns
        names = dict(zip(ds.field_ids(ds.fields), ds.fields))
        for field_id, decoder in zip(members["field"], members["decoder"]):
            typed = ds.decoder(int(decoder))
            if typed is not None and int(field_id) in names:
                plan.typed[names[int(field_id)]] = typed[1] != ()
        sample = ds.get_batch(first)[0]
    images = [
        name
        for name, value in sample.items()
        if name != "__key__" and name not in plan.typed and image_type(value) is not None
    ]
    for name in images:
        stem = name[: -len(".bytes")] if name.endswith(".bytes") else name
        plan.images[name] = "" if len(images) == 1 else stem
        if name.endswith(".bytes"):
            plan.dropped.add(stem + ".path")  # (the Hub's Image feature: where it came from)
    return plan


def hub_class_names(ds: Dataset) -> list[str] | None:
    """The class names of a Hugging Face ``ClassLabel`` column ``label``, from the first
    shard's metadata (a Parquet footer's or an Arrow schema's ``huggingface`` entry), or
    None. The packed shards' manifest keeps them, as it does a class-per-folder tree's."""
    path = ds.shards[0] if ds.shards else ""
    if is_url(path) or not os.path.isfile(path):
        return None
    parquet = path.lower().endswith(".parquet")
    read: Callable[[str], str | None] = _parquet_hub_info if parquet else _arrow_hub_info
    try:
        info = json.loads(read(path) or "null")
        label = info["info"]["features"]["label"]
    except (ValueError, KeyError, TypeError, OSError):
        return None
    if not isinstance(label, dict) or label.get("_type") != "ClassLabel":
        return None
    names = label.get("names")
    return [str(n) for n in names] if isinstance(names, list) else None


def _parquet_hub_info(path: str) -> str | None:
    from stoker.tables.parquet import read_footer

    return dict(read_footer(path).get("key_value") or ()).get("huggingface")


def _arrow_hub_info(path: str) -> str | None:
    try:
        import pyarrow as pa
        import pyarrow.ipc
    except ImportError:
        return None
    with pa.memory_map(path) as source:
        try:
            schema = pyarrow.ipc.open_file(source).schema
        except pa.ArrowInvalid:
            source.seek(0)
            schema = pyarrow.ipc.open_stream(source).schema
    value = (schema.metadata or {}).get(b"huggingface")
    return value.decode("utf-8") if value is not None else None
