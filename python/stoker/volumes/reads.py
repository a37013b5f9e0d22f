"""The reads that fill one buffer of patches: runs of bytes of arrays read in place, boxes of
chunked or tiled ones, each started on the process's shared C++ reader."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from stoker._process import shared_reader
from stoker.volumes.arrays import VolumeArray
from stoker.volumes.boxes import (
    PatchSpans,
    byte_strides,
    patch_runs,
    patch_spans,
    stored_box,
    stored_box_shape,
)


class PatchReads:
    """What one buffer needs read: runs of bytes of arrays read in place (merged into spans
    read into scratch memory where their gaps are short, see patch_spans), boxes of
    chunked ones (each chunk a box touches read and decoded once by the C++ reader).
    The reader's threads move each span's box into its place, its gaps dropped."""

    def __init__(self) -> None:
        self.runs: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self.spans: list[tuple[int, PatchSpans, int, np.dtype]] = []  # file, spans, at, dtype
        self.boxes: list[tuple[int, list[int], list[int], int, list[int]]] = []
        self.patch_bytes = 0  # the patches' own bytes inside their arrays

    def add(
        self,
        array: VolumeArray,
        file_id: int,
        array_id: int | None,
        start: tuple[int, ...],
        size: tuple[int, ...],
        at: int,
    ) -> bool:
        """Reads the patch of `size` at spatial `start` into the buffer at `at`; True when
        part of it lies outside the array (the caller fills the buffer's part first)."""
        if array.layout is None:
            box = stored_box(array, start, size)
            spans = patch_spans(array, start, size, box)
            if spans is not None:
                self.spans.append((file_id, spans, at, array.dtype))
                inner = math.prod(spans.outer_shape + spans.inner_shape)
                self.patch_bytes += inner * array.dtype.itemsize
                return spans.padded
            runs = patch_runs(array, start, size, box)
            ids = np.full(runs.offsets.shape, file_id, np.int64)
            self.runs.append((ids, runs.offsets, runs.lengths, runs.dest_offsets + at))
            self.patch_bytes += int(runs.lengths.sum())
            return runs.padded
        assert array_id is not None
        first, extent, dest_first, padded = stored_box(array, start, size)
        if min(extent) > 0:
            strides = byte_strides(stored_box_shape(array, size), array.dtype.itemsize)
            dest = at + sum(f * st for f, st in zip(dest_first, strides))
            self.boxes.append((array_id, first, extent, dest, strides))
            self.patch_bytes += math.prod(extent) * array.dtype.itemsize
        return padded

    def submit(self, buffer: np.ndarray, files: Any) -> list[Any]:
        """The reads, started: runs first, then the boxes (the reader groups those by
        chunk); each a _core.PendingRead."""
        reader = shared_reader()
        pending = []
        if self.runs:
            ids, offsets, lengths, dests = (np.concatenate(p) for p in zip(*self.runs))
            pending.append(reader.read_into(buffer, files, ids, offsets, lengths, dests))
        if self.spans:
            pending.append(reader.read_spans_into(buffer, files, *_span_columns(self.spans)))
        by_rank: dict[int, list[tuple[int, list[int], list[int], int, list[int]]]] = {}
        for box in self.boxes:
            by_rank.setdefault(len(box[1]), []).append(box)
        for boxes in by_rank.values():
            box_arrays, firsts, extents, box_dests, strides = zip(*boxes)
            pending.append(
                reader.read_boxes_into(
                    buffer,
                    files,
                    np.array(box_arrays, np.uint32),
                    np.array(firsts, np.int64),
                    np.array(extents, np.int64),
                    np.array(box_dests, np.int64),
                    np.array(strides, np.int64),
                )
            )
        return pending


def _span_columns(spans: list[tuple[int, PatchSpans, int, np.dtype]]) -> tuple[np.ndarray, ...]:
    """read_spans_into's columns: per span its file, offset, length and place; per patch
    its box (inner axes, each patch's padded with axes of extent 1 to one rank)."""
    rank = max(len(sp.inner_shape) for _, sp, _, _ in spans)
    count = len(spans)
    extents = np.ones((count, rank), np.int64)
    src_strides = np.zeros((count, rank), np.int64)
    dest_strides = np.zeros((count, rank), np.int64)
    itemsizes = np.empty(count, np.uint64)
    ids, lengths, counts = [], [], []
    offsets, places = [], []
    for b, (file_id, sp, at, dtype) in enumerate(spans):
        inner = len(sp.inner_shape)
        extents[b, rank - inner :] = sp.inner_shape
        src_strides[b, rank - inner :] = sp.inner_strides
        dest_strides[b, rank - inner :] = sp.dest_strides[len(sp.outer_shape) :]
        itemsizes[b] = dtype.itemsize
        ids.append(file_id)
        lengths.append(sp.span)
        counts.append(sp.offsets.size)
        offsets.append(sp.offsets)
        # Span k, in C order over the outer axes, lands that far along them in the patch.
        places.append(sp.dest_steps + (at + sp.dest_offset))
    return (
        np.repeat(np.array(ids, np.uint32), counts),
        np.concatenate(offsets).astype(np.uint64),
        np.repeat(np.array(lengths, np.uint64), counts),
        np.concatenate(places).astype(np.uint64),
        np.repeat(np.arange(count, dtype=np.uint32), counts),
        extents,
        src_strides,
        dest_strides,
        itemsizes,
    )
