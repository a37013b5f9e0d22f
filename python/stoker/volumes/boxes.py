"""A patch of an array on disk as the runs of bytes that hold it, and where each run
lands in the patch's buffer.

A patch of a C-order array is a box: in the stored order its innermost axes that the box
covers whole (channels, and spatial axes as long as the patch) and the first one it does
not give contiguous runs, one per position of the outer axes. A 64^3 patch of a 256^3
int16 volume is 4,096 runs of 128 bytes, 512 bytes apart within a slice. stoker's reader
merges runs less than 8 KiB apart into one ``preadv`` that drops the gaps, so that patch
costs 64 reads of 32 KiB (its slices' rows, whole): 4x the patch's own bytes, where a
read per run would cost 4,096 system calls, and reading the whole slab of each slice (or
the volume, as whole-volume loaders do) 64x. The trade is the reader's: gaps under 8 KiB
are cheaper read than skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stoker.volumes.arrays import VolumeArray

#: The reader's rule (csrc/stoker/io/shard_reader.cpp): ranges of one file closer than
#: this are read by one preadv, the gap with them.
MERGE_GAP = 8 << 10


@dataclass(frozen=True)
class PatchRuns:
    """The runs of one patch of one array: file offsets, lengths and where each lands in
    the patch's own buffer (C-order in the stored axis order, `shape`)."""

    offsets: np.ndarray  # int64
    lengths: np.ndarray  # int64
    dest_offsets: np.ndarray  # int64, from the start of this patch's buffer
    shape: tuple[int, ...]  # the patch's stored-order shape (channels whole)
    padded: bool  # part of the patch lies outside the array: the rest is padding


def stored_box_shape(array: VolumeArray, patch_size: tuple[int, ...]) -> tuple[int, ...]:
    """The stored-order shape of a patch's buffer: channel axes whole, spatial axes the
    patch's."""
    shape = list(array.stored_shape)
    for k, axis in enumerate(array.spatial_axes):
        shape[axis] = patch_size[k]
    return tuple(shape)


def patch_runs(
    array: VolumeArray, start: tuple[int, ...], patch_size: tuple[int, ...]
) -> PatchRuns:
    """The runs of the patch at spatial `start` (which may lie partly outside the array:
    only the part inside is read) of `patch_size` voxels."""
    stored = array.stored_shape
    n = len(stored)
    dest_shape = stored_box_shape(array, patch_size)
    first = [0] * n  # the part inside the array, in stored coordinates
    last = list(stored)
    dest_first = [0] * n  # where that part starts in the patch
    for k, axis in enumerate(array.spatial_axes):
        lo, hi = start[k], start[k] + patch_size[k]
        first[axis], last[axis] = max(lo, 0), min(hi, stored[axis])
        dest_first[axis] = first[axis] - lo
    extent = [last[a] - first[a] for a in range(n)]
    padded = any(extent[a] != dest_shape[a] for a in range(n))
    if any(e <= 0 for e in extent):
        empty = np.empty(0, np.int64)
        return PatchRuns(empty, empty, empty, dest_shape, True)
    item = array.dtype.itemsize
    src_strides = _strides(stored, item)
    dest_strides = _strides(dest_shape, item)
    # The runs go over axis k and every axis after it, which lie whole in both the file
    # and the patch; k is the outermost such axis' parent.
    k = n - 1
    while k > 0 and extent[k] == stored[k] == dest_shape[k]:
        k -= 1
    run = extent[k] * src_strides[k]
    offsets = np.array([array.offset + first[k] * src_strides[k]], np.int64)
    dests = np.array([dest_first[k] * dest_strides[k]], np.int64)
    for axis in range(k - 1, -1, -1):  # outer axes: one run per position
        steps = np.arange(extent[axis], dtype=np.int64)
        offsets = ((first[axis] + steps) * src_strides[axis])[:, None] + offsets[None, :]
        dests = ((dest_first[axis] + steps) * dest_strides[axis])[:, None] + dests[None, :]
        offsets, dests = offsets.reshape(-1), dests.reshape(-1)
    lengths = np.full(offsets.shape, run, np.int64)
    return PatchRuns(offsets, lengths, dests, dest_shape, padded)


def _strides(shape: tuple[int, ...] | list[int], item: int) -> list[int]:
    strides = [item] * len(shape)
    for a in range(len(shape) - 2, -1, -1):
        strides[a] = strides[a + 1] * shape[a + 1]
    return strides


def bytes_read(file_ids: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> int:
    """The bytes the reader reads for these ranges: sorted by file and offset, ranges
    closer than MERGE_GAP read as one, gaps included."""
    if offsets.size == 0:
        return 0
    order = np.lexsort((offsets, file_ids))
    files, starts = file_ids[order], offsets[order]
    ends = starts + lengths[order]
    reach = np.maximum.accumulate(ends)  # overlapping ranges extend the span before them
    new_span = np.ones(starts.size, bool)
    new_span[1:] = (files[1:] != files[:-1]) | (starts[1:] - reach[:-1] >= MERGE_GAP)
    span_ids = np.cumsum(new_span) - 1
    span_starts = starts[new_span]
    span_ends = np.zeros(span_starts.size, np.int64)
    np.maximum.at(span_ends, span_ids, ends)
    return int((span_ends - span_starts).sum())
