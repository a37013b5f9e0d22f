"""Where patches go: uniform, label-balanced, or on a grid.

A random sampler's positions are a pure function of (seed, epoch, subject, patch number),
so they do not depend on the rank, the world size, the thread count or the order batches
are read in. The label-balanced sampler draws a class first (by ``ratio`` or by
``class_weights``), then a voxel of that class, uniformly among all of them: from the
label volume's coarse occupancy grid (voxels of each class per block of ``block``^D
voxels, counted once per label file and kept in the cache) it draws a block in
proportion to its count, then reads that block's labels and takes one of its voxels of
the class. The patch is centred there, moved inside the volume where it fits (as MONAI's
``RandCropByPosNegLabeld`` does).
"""

from __future__ import annotations

import hashlib
import io
import itertools
import operator
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from stoker import _core
from stoker._files import write_atomically
from stoker.errors import StokerError, UsageError
from stoker.loader.sample_orders import WORD_MAX, seed_words
from stoker.volumes.arrays import VolumeArray, cache_folder


class PatchSampler:
    """The base of the samplers: ``positions`` of one subject's patches."""

    #: Whether patches_per_subject applies (False: the sampler says how many, as the grid).
    random = True

    def grid_positions(
        self, shape: tuple[int, ...], patch_size: tuple[int, ...]
    ) -> list[tuple[int, ...]]:
        raise NotImplementedError


@dataclass(frozen=True)
class UniformSampler(PatchSampler):
    """Patch positions drawn uniformly among those that fit the volume (a volume smaller
    than the patch along an axis: the patch centred on it, the rest padding)."""


@dataclass(frozen=True)
class LabelSampler(PatchSampler):
    """Patch centres drawn at voxels of chosen classes of the label array `label`.

    Args:
        label: The subject's key of the label array.
        ratio: (foreground, background) weights: a centre is drawn at a voxel above 0
            with probability ``ratio[0] / sum(ratio)``, else at a voxel of 0 (MONAI's
            ``pos``/``neg``). Ignored when `class_weights` is given.
        class_weights: {label value: weight}: a class drawn by weight, then a voxel of it
            (MONAI's ``RandCropByLabelClasses``, TorchIO's ``LabelSampler``'s
            ``label_probabilities``). Classes with no voxel in a volume are left out of
            its draw.
        block: The edge of the occupancy grid's blocks, in voxels.
    """

    label: str = "label"
    ratio: tuple[float, float] = (1.0, 1.0)
    class_weights: Mapping[int, float] | None = None
    block: int = 8

    def __post_init__(self) -> None:
        if self.block < 1:
            raise UsageError(f"LabelSampler(block={self.block}): it must be at least 1")
        weights = list(self.class_weights.values()) if self.class_weights else list(self.ratio)
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise UsageError(
                "LabelSampler: weights must be 0 or more, and not all 0 "
                f"(ratio={self.ratio}, class_weights={self.class_weights})"
            )

    def classes(self, present: Sequence[int]) -> tuple[list[list[int]], np.ndarray]:
        """The groups of label values a draw chooses among, and their weights, given the
        values `present` in a volume: [[foreground values], [0]] for `ratio`, one group
        per class for `class_weights`; groups with no voxel get weight 0."""
        if self.class_weights:
            groups = [[int(c)] for c in self.class_weights]
            weights = np.array([float(w) for w in self.class_weights.values()])
        else:
            groups = [[int(v) for v in present if v > 0], [0]]
            weights = np.array([float(self.ratio[0]), float(self.ratio[1])])
        has = np.array([any(v in present for v in g) for g in groups])
        return groups, np.where(has, weights, 0.0)


@dataclass(frozen=True)
class GridSampler(PatchSampler):
    """Every position of a grid over the volume, in order, for inference: starts every
    ``patch - overlap`` voxels along each axis, the last one flush with the volume's end.

    Args:
        overlap: Voxels shared by neighbouring patches, per axis or for all; a float under
            1 is a fraction of the patch.
    """

    overlap: int | float | Sequence[int | float] = 0
    random = False

    def steps(self, patch_size: tuple[int, ...]) -> tuple[int, ...]:
        overlap = self.overlap
        per_axis = list(overlap) if isinstance(overlap, Sequence) else [overlap] * len(patch_size)
        if len(per_axis) != len(patch_size):
            raise UsageError(f"GridSampler(overlap={overlap}) for {len(patch_size)}-D patches")
        steps = []
        for o, p in zip(per_axis, patch_size):
            voxels = int(round(o * p)) if isinstance(o, float) and o < 1 else int(o)
            if not 0 <= voxels < p:
                raise UsageError(
                    f"GridSampler(overlap={overlap}): an overlap of {voxels} voxels for a "
                    f"patch of {p}; it must be 0 or more and less than the patch"
                )
            steps.append(p - voxels)
        return tuple(steps)

    def axis_starts(self, shape: tuple[int, ...], patch_size: tuple[int, ...]) -> list[list[int]]:
        """The grid's starts along each axis: its positions are every combination, the
        last axis varying fastest."""
        axes = []
        for size, p, step in zip(shape, patch_size, self.steps(patch_size)):
            if size <= p:
                axes.append([0])  # one patch, padded past the end
                continue
            starts = list(range(0, size - p + 1, step))
            if starts[-1] != size - p:
                starts.append(size - p)
            axes.append(starts)
        return axes

    def grid_positions(
        self, shape: tuple[int, ...], patch_size: tuple[int, ...]
    ) -> list[tuple[int, ...]]:
        return [tuple(p) for p in itertools.product(*self.axis_starts(shape, patch_size))]


class PatchDraws:
    """The generators of patches (subject, patch number) of an epoch: numpy's
    ``default_rng([seed, epoch, subject, patch number])`` each, its draws taken in turns.
    Worked out in C++ for the whole batch: a numpy generator a patch cost ten times its
    draws and a third of the loader's Python time."""

    def __init__(self, seed: int, epoch: int, keys: Sequence[tuple[int, int]] | np.ndarray) -> None:
        seed, epoch = operator.index(seed), operator.index(epoch)
        try:
            rows = np.asarray(keys, np.int64).reshape(-1, 2)
            words = not rows.size or 0 <= rows.min() <= rows.max() <= WORD_MAX
        except OverflowError:  # past int64
            rows, words = np.asarray(keys, object).reshape(-1, 2), False
        self._numpy: list[np.random.Generator] | None = None
        if min(seed, epoch) < 0 or not words:
            # Words SeedSequence would split differently, or refuses: numpy's own generators.
            self._numpy = [np.random.default_rng([seed, epoch, s, k]) for s, k in rows.tolist()]
            self._states = np.empty((0, 5), np.uint64)
        else:
            prefix = np.array(seed_words(seed, epoch), np.uint32)
            self._states = _core.keyed_generators(prefix, rows.astype(np.uint32))

    def random(self, count: int) -> np.ndarray:
        """``(patches, count)`` doubles in [0, 1), as ``Generator.random(count)``."""
        if self._numpy is not None:
            return np.array([g.random(count) for g in self._numpy]).reshape(-1, count)
        return _core.generator_uniforms(self._states, count)

    def integers(self, highs: np.ndarray) -> np.ndarray:
        """Patch i's integer in [0, highs[i]), as ``Generator.integers(highs[i])``."""
        if self._numpy is not None:
            return np.array([g.integers(int(h)) for g, h in zip(self._numpy, highs)], np.int64)
        return _core.generator_integers(self._states, np.asarray(highs, np.int64))


def uniform_starts(
    seed: int,
    epoch: int,
    batch: Sequence[tuple[int, int]] | np.ndarray,
    shapes: Sequence[tuple[int, ...]] | np.ndarray,
    patch_size: tuple[int, ...],
) -> np.ndarray:
    """Each (subject, patch number)'s start, ``(len(batch), rank)`` int64, drawn uniformly
    among those where the patch fits (centred where it cannot) by the first draws of its
    generator (PatchDraws)."""
    rank = len(patch_size)
    draws = PatchDraws(seed, epoch, batch).random(rank)
    span = np.array(shapes, np.int64).reshape(-1, rank) - np.array(patch_size, np.int64)
    return np.where(span >= 0, np.minimum((draws * (span + 1)).astype(np.int64), span), span // 2)


def start_around(
    centre: tuple[int, ...], shape: tuple[int, ...], patch_size: tuple[int, ...]
) -> tuple[int, ...]:
    """The start of the patch centred on `centre`, moved inside the volume along each axis
    where the patch fits (centred on the volume where it does not)."""
    out = []
    for c, s, p in zip(centre, shape, patch_size):
        start = c - p // 2
        out.append(min(max(start, 0), s - p) if s >= p else (s - p) // 2)
    return tuple(out)


@dataclass
class Occupancy:
    """The voxels of each label value per block of a label volume: ``counts[v]`` is the
    grid of block counts of value ``values[v]``."""

    values: list[int]
    counts: np.ndarray  # (len(values), *grid), int64
    block: int
    shape: tuple[int, ...]
    cumulative: dict[int, np.ndarray] = field(default_factory=dict)  # per value, flat cumsum

    def group_counts(self, group: Sequence[int]) -> np.ndarray:
        """The flat block counts of voxels whose value is in `group`, cumulated."""
        key = hash(tuple(group))
        if key not in self.cumulative:
            rows = [self.values.index(v) for v in group if v in self.values]
            total = self.counts[rows].sum(axis=0).reshape(-1) if rows else np.zeros(1, np.int64)
            self.cumulative[key] = np.cumsum(total)
        return self.cumulative[key]


def occupancy(
    label: VolumeArray,
    labels: np.ndarray | Callable[[], np.ndarray],
    block: int,
    cache_dir: str | None,
) -> Occupancy:
    """The occupancy grid of the label volume whose voxels (spatial axes first, in patch
    order) are `labels` (or what calling it reads: only when the grid is not in the cache),
    from the cache where a process computed it before (keyed by the file's path, size,
    modification time and the block), else computed and kept."""
    try:
        st = os.stat(label.identity_path)
        key = (
            f"{os.path.realpath(label.identity_path)}\0{label.path}\0{st.st_size}"
            f"\0{st.st_mtime_ns}\0{block}\0{label.stored_shape}"
        )
        name = hashlib.sha256(key.encode()).hexdigest()[:24] + ".npz"
        path = os.path.join(cache_folder(cache_dir, "occupancy"), name)
    except (OSError, StokerError):  # no cache to keep it in: computed each time
        path = None
    if path is not None and os.path.exists(path):
        try:
            with np.load(path) as kept:
                return Occupancy(
                    [int(v) for v in kept["values"]], kept["counts"], block, label.spatial_shape
                )
        except (OSError, ValueError, KeyError):
            pass  # a copy that cannot be read is made again
    if callable(labels):
        labels = labels()
    values, counts = block_counts(labels, block, label.path)
    result = Occupancy([int(v) for v in values], counts, block, label.spatial_shape)
    if path is not None:
        try:
            out = io.BytesIO()
            np.savez(out, values=values, counts=result.counts)
            write_atomically(path, [out.getbuffer()])
        except OSError:
            pass  # the cache is full or read-only: the grid is used without being kept
    return result


def block_counts(labels: np.ndarray, block: int, path: str) -> tuple[np.ndarray, np.ndarray]:
    """The values present in `labels` (ascending, of its dtype) and the voxels of each per
    block of `block` voxels a side: ``(len(values), *grid)`` int64 counts, counted by the
    C++ core on every core with the GIL released (11x numpy's masks and sums on a 256^3
    label). They are counted in memory order, so a NIfTI's transposed labels are not
    copied, and the grid is turned back. Labels of other types than 1- and 2-byte
    integers (float label maps) are counted as the index of each voxel's value; `path`
    names the file in an error."""
    order = np.argsort([-abs(s) for s in labels.strides], kind="stable")
    stored = np.ascontiguousarray(labels.transpose(order))
    if stored.dtype.kind in "ui" and stored.dtype.itemsize <= 2:
        found, counts = _core.label_block_counts(stored, block)
        values = found.astype(labels.dtype)
    else:
        values, inverse = np.unique(stored, return_inverse=True)
        if len(values) > 1 << 16:
            raise UsageError(
                f"{path}: a label volume of {len(values)} distinct values, where a label map "
                "has at most 65,536: is LabelSampler(label=...) naming the image?"
            )
        index = inverse.reshape(stored.shape).astype(np.uint16 if len(values) > 256 else np.uint8)
        _, counts = _core.label_block_counts(index, block)
    back = [0, *(1 + int(axis) for axis in np.argsort(order))]
    return values, np.ascontiguousarray(counts.transpose(back))


def block_bounds(
    occupancy_grid: Occupancy, flat_block: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The first voxel and the extent of block `flat_block` of the grid."""
    grid = occupancy_grid.counts.shape[1:]
    index = np.unravel_index(flat_block, grid)
    first = tuple(int(i) * occupancy_grid.block for i in index)
    extent = tuple(min(occupancy_grid.block, s - f) for f, s in zip(first, occupancy_grid.shape))
    return first, extent
