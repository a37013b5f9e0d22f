"""A patch of an array on disk as the runs of bytes that hold it, and where each run
lands in the patch's buffer.

A patch of a C-order array is a box: in the stored order its innermost axes that the box
covers whole (channels, and spatial axes as long as the patch) and the first one it does
not give contiguous runs, one per position of the outer axes. A 64^3 patch of a 256^3
int16 volume is 4,096 runs of 128 bytes, 512 bytes apart within a slice. Runs less than
8 KiB apart are merged into spans (patch_spans): that patch costs 64 reads of 32 KiB (its
slices' rows, whole), each cut to the patch's rows by the reader's thread that read it: 4x
the patch's own bytes, where a read per run would cost 4,096 system calls (and the
reader 4,096 requests to plan), and reading the whole slab of each slice (or the volume,
as whole-volume loaders do) 64x. Gaps under 8 KiB are cheaper read than skipped.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from stoker.volumes.arrays import VolumeArray

#: Spans are read into scratch memory only where they are at most this many times the
#: patch's bytes in them, so the scratch stays a few patches' size; runs farther apart go
#: to the reader as they are (it reads their gaps into a buffer it reuses).
SPAN_AMPLIFICATION = 4

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
    array: VolumeArray,
    start: tuple[int, ...],
    patch_size: tuple[int, ...],
    box: tuple[list[int], list[int], list[int], bool] | None = None,
) -> PatchRuns:
    """The runs of the patch at spatial `start` (which may lie partly outside the array:
    only the part inside is read) of `patch_size` voxels; `box`: its stored_box, where the
    caller has it."""
    dest_shape = stored_box_shape(array, patch_size)
    first, extent, dest_first, padded = box or stored_box(array, start, patch_size)
    if min(extent) <= 0:
        empty = np.empty(0, np.int64)
        return PatchRuns(empty, empty, empty, dest_shape, True)
    k, run, src, dst, steps, dest_steps = _run_plan(
        array.stored_shape,
        array.dtype.itemsize,
        array.row_offsets is None,
        tuple(extent),
        dest_shape,
    )
    offsets = _box_offsets(array, first, extent, src, k, steps)
    dests = dest_steps + sum(f * d for f, d in zip(dest_first, dst))
    lengths = np.full(offsets.shape, run, np.int64)
    return PatchRuns(offsets, lengths, dests, dest_shape, padded)


@functools.lru_cache(maxsize=256)
def _run_plan(
    stored: tuple[int, ...],
    item: int,
    evenly_spaced: bool,
    extent: tuple[int, ...],
    dest_shape: tuple[int, ...],
) -> tuple[int, int, tuple[int, ...], tuple[int, ...], np.ndarray, np.ndarray]:
    """What patch_runs works out from a box's shape alone, once per shape (a batch's
    patches, or its label blocks, are mostly of one): the run axis k, the run's bytes,
    the file's and the patch's byte strides, and per run its step in the file and in the
    patch from the box's first byte (read-only arrays)."""
    src = tuple(byte_strides(stored, item))
    dst = tuple(byte_strides(dest_shape, item))
    k = _run_axis(stored, evenly_spaced, extent, dest_shape)
    steps, dest_steps = _outer_steps(extent[:k], src[:k], dst[:k])
    return k, extent[k] * src[k], src, dst, steps, dest_steps


def _box_offsets(
    array: VolumeArray,
    first: list[int],
    extent: list[int],
    src: tuple[int, ...],
    j: int,
    steps: np.ndarray,
) -> np.ndarray:
    """The file offset of each piece of the box (axes j and after), given each piece's
    step from the box's first byte (`steps`, from its shape's plan): that first byte plus
    the step, or, where rows are not evenly spaced, worked out from the rows' offsets."""
    if array.row_offsets is None:
        return steps + (array.offset + sum(f * st for f, st in zip(first, src)))
    return _file_offsets(array, first, extent, list(src), j)


def _outer_steps(
    extent: tuple[int, ...], src: tuple[int, ...], dst: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """Each position of the outer axes (of `extent`, in C order)'s step in the file and in
    the patch, by their byte strides `src` and `dst` (read-only arrays)."""
    grid = np.indices(extent, np.int64).reshape(len(extent), math.prod(extent))
    steps = np.asarray(src, np.int64) @ grid
    dest_steps = np.asarray(dst, np.int64) @ grid
    steps.flags.writeable = dest_steps.flags.writeable = False
    return steps, dest_steps


def _run_axis(
    stored: tuple[int, ...],
    evenly_spaced: bool,
    extent: list[int] | tuple[int, ...],
    dest_shape: tuple[int, ...],
) -> int:
    """The axis k of a box's contiguous runs: they go over k and every axis after it, which
    lie whole in both the file and the patch. Where axis 0's positions are not evenly spaced
    (row_offsets), runs stop short of it."""
    lowest = 0 if evenly_spaced else 1
    k = len(stored) - 1
    while k > lowest and extent[k] == stored[k] == dest_shape[k]:
        k -= 1
    return k


def _file_offsets(
    array: VolumeArray, first: list[int], extent: list[int], src: list[int], j: int
) -> np.ndarray:
    """The file offset of each piece of the box holding axes j and after, one per position
    of the axes before j, in C order over them."""
    base = array.offset if array.row_offsets is None or j == 0 else 0
    offsets = np.array([base + sum(first[a] * src[a] for a in range(j, len(src)))], np.int64)
    for axis in range(j - 1, -1, -1):
        steps = np.arange(extent[axis], dtype=np.int64)
        if axis == 0 and array.row_offsets is not None:
            starts = array.row_offsets[first[0] + steps]
        else:
            starts = (first[axis] + steps) * src[axis]
        offsets = (starts[:, None] + offsets[None, :]).reshape(-1)
    return offsets


def byte_strides(shape: tuple[int, ...] | list[int], item: int) -> list[int]:
    """The byte strides of a C-order array of `shape` and elements of `item` bytes."""
    strides = [item] * len(shape)
    for a in range(len(shape) - 2, -1, -1):
        strides[a] = strides[a + 1] * shape[a + 1]
    return strides


@dataclass(frozen=True)
class PatchSpans:
    """A patch's runs merged, where their gaps are short, into equal spans read whole into
    scratch memory: one span per position of the outer axes (`outer_shape`), each holding
    the box's inner axes at `inner_strides` bytes; the box then lands in the patch's
    buffer at `dest_offset` with `dest_strides` (its stored-order axes)."""

    offsets: np.ndarray  # int64, one per span, in C order over outer_shape
    span: int  # bytes per span
    outer_shape: tuple[int, ...]
    inner_shape: tuple[int, ...]
    inner_strides: tuple[int, ...]
    dest_offset: int
    dest_strides: tuple[int, ...]
    padded: bool
    # int64, one per span: where its box starts in the patch's buffer, from dest_offset
    # (shared by every patch of the same box shape: read-only)
    dest_steps: np.ndarray


def patch_spans(
    array: VolumeArray,
    start: tuple[int, ...],
    patch_size: tuple[int, ...],
    box: tuple[list[int], list[int], list[int], bool] | None = None,
) -> PatchSpans | None:
    """The patch at spatial `start` as spans, or None where no runs merge (each run then
    goes straight to its place, as patch_runs gives them). Runs less than MERGE_GAP apart
    are merged here rather than by the reader: one request per span instead of one per run
    (a 64^3 patch of a 256^3 int16 volume: 64 requests of 32 KiB, not 4,096 of 128 bytes),
    the gaps dropped by the reader's threads (read_spans_into). `box`: its stored_box,
    where the caller has it."""
    first, extent, dest_first, padded = box or stored_box(array, start, patch_size)
    if min(extent) <= 0:
        return None
    dest_shape = stored_box_shape(array, patch_size)
    plan = _span_plan(
        array.stored_shape,
        array.dtype.itemsize,
        array.row_offsets is None,
        tuple(extent),
        dest_shape,
    )
    if plan is None:
        return None
    j, span, src, dst, steps, dest_steps = plan
    return PatchSpans(
        offsets=_box_offsets(array, first, extent, src, j, steps),
        span=span,
        outer_shape=tuple(extent[:j]),
        inner_shape=tuple(extent[j:]),
        inner_strides=src[j:],
        dest_offset=sum(f * d for f, d in zip(dest_first, dst)),
        dest_strides=dst,
        padded=padded,
        dest_steps=dest_steps,
    )


@functools.lru_cache(maxsize=256)
def _span_plan(
    stored: tuple[int, ...],
    item: int,
    evenly_spaced: bool,
    extent: tuple[int, ...],
    dest_shape: tuple[int, ...],
) -> tuple[int, int, tuple[int, ...], tuple[int, ...], np.ndarray, np.ndarray] | None:
    """What patch_spans works out from a box's shape alone, once per shape (a batch's
    patches are mostly of one): the axis j the spans start at, their bytes, the file's and
    the patch's byte strides, and per span its step in the file and in the patch, from the
    box's first byte (read-only arrays). None where no runs merge."""
    k, span, src, dst, _, _ = _run_plan(stored, item, evenly_spaced, extent, dest_shape)
    lowest = 0 if evenly_spaced else 1
    useful = span
    j = k
    while j > lowest and src[j - 1] - span < MERGE_GAP:
        wider = span + (extent[j - 1] - 1) * src[j - 1]
        if wider > SPAN_AMPLIFICATION * useful * extent[j - 1]:
            break  # the scratch would hold mostly gaps: the reader merges those runs instead
        span, useful = wider, useful * extent[j - 1]
        j -= 1
    if j == k:
        return None
    steps, dest_steps = _outer_steps(extent[:j], src[:j], dst[:j])
    return j, span, src, dst, steps, dest_steps


def stored_box(
    array: VolumeArray, start: tuple[int, ...], patch_size: tuple[int, ...]
) -> tuple[list[int], list[int], list[int], bool]:
    """The part of the patch at spatial `start` that lies inside a chunked array, in stored
    coordinates (channel axes whole): (first, extent, where it starts in the patch's
    buffer, whether the rest is padding); an extent of 0 on some axis: none of it does."""
    stored = array.stored_shape
    first, extent, dest_first = [0] * len(stored), list(stored), [0] * len(stored)
    for k, axis in enumerate(array.spatial_axes):
        lo, hi = start[k], start[k] + patch_size[k]
        first[axis] = max(lo, 0)
        extent[axis] = max(0, min(hi, stored[axis]) - first[axis])
        dest_first[axis] = first[axis] - lo
    padded = any(extent[a] != p for a, p in zip(array.spatial_axes, patch_size))
    return first, extent, dest_first, padded


def stored_boxes(
    array: VolumeArray, starts: np.ndarray, patch_size: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """stored_box's (first, extent) for many patches at once: `starts` is ``(n, spatial
    rank)``, the results ``(n, stored rank)`` int64."""
    stored = np.array(array.stored_shape, np.int64)
    first = np.zeros((len(starts), len(stored)), np.int64)
    extent = np.tile(stored, (len(starts), 1))
    for k, axis in enumerate(array.spatial_axes):
        first[:, axis] = np.maximum(starts[:, k], 0)
        end = np.minimum(starts[:, k] + patch_size[k], stored[axis])
        extent[:, axis] = np.maximum(end - first[:, axis], 0)
    return first, extent
