"""PatchLoader: batches of patches read from the volumes' files, only the bytes each patch
needs, by the C++ reader's threads, into one buffer per batch (a pinned slot for a device
loader, copied to the device in one copy)."""

from __future__ import annotations

import bisect
import math
import os
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import stoker._core as _core
import stoker.cuda as cuda
from stoker._process import shared_reader
from stoker.errors import UsageError
from stoker.loader import resolve_rank
from stoker.volumes.arrays import VolumeArray
from stoker.volumes.boxes import stored_box_shape, stored_boxes
from stoker.volumes.device_reads import DevicePatchReader, read_patches_to_device
from stoker.volumes.patch_order import PatchOrder
from stoker.volumes.reads import PatchReads
from stoker.volumes.samplers import (
    GridSampler,
    LabelSampler,
    Occupancy,
    PatchDraws,
    PatchSampler,
    UniformSampler,
    block_bounds,
    occupancy,
    start_around,
    uniform_starts,
)
from stoker.volumes.subjects import Volumes

_ALIGN = 64  # each array's part of a batch buffer starts on a cache line
# Patches whose JPEG tiles are foreseen at a time (see PatchLoader._foresee): a tile they
# touch again may be kept from the first to the last of them. Measured on a 20,000^2
# slide of 256^2 tiles: 512 lost most of the gain (tiles touched again in the next window
# are decoded again), and 8,192 gained nothing over 2,048.
FORESIGHT_PATCHES = 2048

EDGES = ("pad", "refuse")
# The epoch order's name in a state_dict: a state taken mid-epoch under another order
# (stoker's states named none before this one) cannot resume exactly.
_ORDER = "keyed"


@dataclass
class PatchStats:
    """What patch loading has read so far, in this process."""

    patches: int = 0
    batches: int = 0
    patch_bytes: int = 0  # the patches' own bytes (the parts inside their volumes)
    bytes_read: int = 0  # what the reader read for them, merged gaps included
    read_seconds: float = 0.0  # reader threads' time, summed

    def as_dict(self) -> dict[str, Any]:
        per_patch = self.bytes_read / self.patches if self.patches else 0.0
        return {
            "patches": self.patches,
            "batches": self.batches,
            "patch_bytes": self.patch_bytes,
            "bytes_read": self.bytes_read,
            "bytes_read_per_patch": per_patch,
            "read_amplification": self.bytes_read / self.patch_bytes if self.patch_bytes else 0.0,
            "read_seconds": self.read_seconds,
        }


class PatchLoader:
    """Batches of patches from `volumes`: a dict of ``(B, C, *patch_size)`` tensors, one
    per array key (contiguous; channels_last in memory, with no copy made, for arrays
    that interleave their channels, as RGB slides do), plus ``"subject"`` (each patch's
    subject name), ``"subject_index"``, ``"location"`` (``(B, D)`` int64: each patch's
    first voxel, which may be negative or run past the end for a padded patch) and, where
    every subject's files have one,
    ``"affine"`` (``(B, 4, 4)`` float64: the patch's own voxel-to-world matrix).

    Only the bytes a patch needs are read (see stoker.volumes.boxes), by the C++ reader's
    threads with the GIL released, into one buffer per batch; the next ``prefetch``
    batches are read while one is used. The order of patches and their positions are pure
    functions of (seed, epoch, rank, world size): the same on any thread count, resumed
    exactly by ``load_state_dict``, and split across ranks into disjoint stretches of
    equal length (the epoch's line of patches wraps around to fill the last one).

    Args:
        volumes: The subjects.
        patch_size: Voxels per spatial axis (``volumes.spatial_dims`` of them), or one
            int for all.
        batch_size: Patches per batch.
        sampler: ``UniformSampler()`` (the default), ``LabelSampler(...)`` or
            ``GridSampler(...)``.
        patches_per_subject: Patches drawn from each subject per epoch (random samplers;
            a grid takes every position).
        edge: ``"pad"``: a patch reaching past a volume's edge (a volume smaller than
            the patch, a grid's last row) is padded with `pad_value`; ``"refuse"``: a
            volume smaller than the patch is an error when the loader is made.
        pad_value: The value of padded voxels.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        seed: The seed of positions and order.
        shuffle: Shuffle the epoch's patches (default: yes for random samplers, no for a
            grid).
        drop_last: Drop the last batch of a rank when it is short, and the end of the
            epoch's line of patches instead of wrapping it around.
        rank, world_size: As for ``stoker.Loader`` (default: torch.distributed's).
        prefetch: Batches read ahead.
        pinned_bytes: Page-locked memory a device loader's batches go through.
        gds: A device loader reads patches of uncompressed files with cuFile (GPUDirect
            Storage) straight into device memory: None (the default) where cuFile reads
            the files' file system directly, True always (an error where it cannot), False
            never. Batches with padded patches, big-endian files or chunked arrays go
            through pinned memory either way.

    ``DataLoader(loader.iterable_dataset(), batch_size=None, num_workers=N)`` runs it in
    N worker processes, each reading its own share of the batches.
    """

    def __init__(
        self,
        volumes: Volumes,
        patch_size: int | Sequence[int],
        batch_size: int,
        *,
        sampler: PatchSampler | None = None,
        patches_per_subject: int = 1,
        edge: str = "pad",
        pad_value: float = 0,
        device: Any = "cpu",
        seed: int = 0,
        shuffle: bool | None = None,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        prefetch: int = 2,
        pinned_bytes: int = 256 << 20,
        gds: bool | None = None,
    ) -> None:
        dims = volumes.spatial_dims
        size = (patch_size,) * dims if isinstance(patch_size, int) else tuple(patch_size)
        if len(size) != dims or any(int(p) < 1 for p in size):
            raise UsageError(
                f"patch_size={patch_size}: {dims} sizes of at least 1 for "
                f"{dims}-D volumes (Volumes(spatial_dims=...))"
            )
        if batch_size < 1 or patches_per_subject < 1 or prefetch < 0:
            raise UsageError(
                f"batch_size={batch_size}, patches_per_subject={patches_per_subject}: at "
                f"least 1; prefetch={prefetch}: 0 or more"
            )
        if edge not in EDGES:
            raise UsageError(f"edge={edge!r}: one of {EDGES}")
        self.volumes = volumes
        self.patch_size = tuple(int(p) for p in size)
        self.batch_size = batch_size
        self.sampler = sampler if sampler is not None else UniformSampler()
        self.patches_per_subject = patches_per_subject
        self.edge = edge
        self.pad_value = pad_value
        self.seed = seed
        self.shuffle = self.sampler.random if shuffle is None else shuffle
        self.drop_last = drop_last
        self.rank, self.world_size = resolve_rank(rank, world_size)
        self.prefetch = prefetch
        self.epoch = 0
        self._skip = 0  # batches of this epoch already handed out before a resume
        self._handed = 0  # batches of the epoch handed out, by the iteration running
        self._stats = PatchStats()
        self._occupancy: dict[int, Occupancy] = {}
        self._classes: dict[int, tuple[Occupancy, list[list[int]], list[float]]] = {}
        self._grids: dict[int, list[np.ndarray] | np.ndarray] = {}  # see _grid
        self._grid_counts: np.ndarray | None = None  # a GridSampler's positions a subject
        self._shapes: np.ndarray | None = None  # each subject's spatial shape
        if isinstance(self.sampler, LabelSampler) and self.sampler.label not in volumes.keys:
            raise UsageError(
                f"LabelSampler(label={self.sampler.label!r}): the subjects' arrays are "
                f"{list(volumes.keys)}"
            )
        if edge == "refuse":
            self._refuse_small_volumes()
        for key in volumes.keys:  # a pad value the arrays' type cannot hold is refused now
            dtype = volumes.arrays[0][key].dtype
            if dtype.kind in "iu" and not (np.iinfo(dtype).min <= pad_value <= np.iinfo(dtype).max):
                raise UsageError(
                    f"pad_value={pad_value} does not fit {key!r}'s {dtype} "
                    f"({volumes.arrays[0][key].path})"
                )
        # volumes.files() lists subject by subject, key by key: this is each one's place;
        # chunked arrays are read through their layouts, numbered in the same order.
        self._file_ids = {
            (s, k): s * len(volumes.keys) + j
            for s in range(len(volumes))
            for j, k in enumerate(volumes.keys)
        }
        layouts = [
            volumes.arrays[s][k].layout
            for s, k in self._file_ids
            if volumes.arrays[s][k].layout is not None
        ]
        self._array_ids = {
            (s, k): i
            for i, (s, k) in enumerate(
                (s, k) for s, k in self._file_ids if volumes.arrays[s][k].layout is not None
            )
        }
        self._files = _core.FileTable(volumes.files(), _identities(volumes.files()), arrays=layouts)
        # Tiled with JPEG: the reader is told ahead which of their tiles batches will touch.
        self._jpeg_arrays = {
            (s, k): i
            for (s, k), i in self._array_ids.items()
            if any(f == _core.ChunkFilter.JPEG for f, _ in volumes.arrays[s][k].layout.steps)
        }
        self._affines = all(volumes.affine(i) is not None for i in range(len(volumes)))
        index = cuda.device_index(device)
        self.device = "cpu" if index is None else f"cuda:{index}"
        self._stage: cuda.DeviceStage | None = None
        self._gather: DevicePatchReader | None = None
        if index is not None:
            cuda.require_cuda(index)
            self._stage = cuda.DeviceStage(index, pinned_bytes, max(2, prefetch + 1))
            if gds is not False:
                gather = DevicePatchReader(index, volumes.files())
                if gather.available():
                    self._gather = gather
                elif gds:
                    raise UsageError(f"PatchLoader(gds=True): cuFile cannot: {gather.reason}")

    def _refuse_small_volumes(self) -> None:
        for s in range(len(self.volumes)):
            shape = self.volumes.spatial_shape(s)
            if any(v < p for v, p in zip(shape, self.patch_size)):
                path = self.volumes.arrays[s][self.volumes.keys[0]].path
                raise UsageError(
                    f"subject {self.volumes.name(s)} ({path}) is {shape}, smaller than "
                    f"patch_size={self.patch_size}, and edge='refuse'; edge='pad' pads it"
                )

    # -- the epoch's plan ----------------------------------------------------------------

    def _plan(self, epoch: int) -> PatchOrder:
        """This rank's batches of epoch `epoch` (see PatchOrder: nothing made per patch)."""
        if self.sampler.random:
            counts = np.full(len(self.volumes), self.patches_per_subject, np.int64)
        else:
            if self._grid_counts is None:
                grids = [self._grid(s) for s in range(len(self.volumes))]
                self._grid_counts = np.array([_grid_size(g) for g in grids], np.int64)
            counts = self._grid_counts
        return PatchOrder(
            counts,
            self.seed,
            epoch,
            self.shuffle,
            self.rank,
            self.world_size,
            self.batch_size,
            self.drop_last,
        )

    def __len__(self) -> int:
        return len(self._plan(self.epoch))

    def set_epoch(self, epoch: int) -> None:
        """Read epoch `epoch` from the next iteration on (its own order and positions).
        Setting the epoch a loaded state is in keeps that state's position. Without calls
        to it, the loader moves to the next epoch once one has been read to its end."""
        if int(epoch) != self.epoch:
            self._skip = 0
        self.epoch = int(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is: the epoch, the batches of it handed out, and what the
        plan depends on. A loader loaded with it yields the batches this one would next."""
        return {
            "epoch": self.epoch,
            "batches": self._handed,
            "seed": self.seed,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "subjects": len(self.volumes),
            "order": _ORDER,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where `state` was taken: the next iteration starts with the next batch."""
        mine = self.state_dict()
        for what in ("seed", "world_size", "batch_size", "subjects"):
            if state.get(what) != mine[what]:
                raise UsageError(
                    f"a PatchLoader state of {what} {state.get(what)} cannot resume one of "
                    f"{what} {mine[what]}: the plan would differ"
                )
        if int(state["batches"]) and state.get("order") != _ORDER:
            raise UsageError(
                f"a PatchLoader state taken {state['batches']} batches into epoch "
                f"{state['epoch']} by a stoker whose epochs ran in another order (it names "
                "none): resuming there would repeat some patches and skip others. "
                "Set its 'batches' to 0 to start that epoch again, or its 'order' to "
                f"{_ORDER!r} to go on in the new order"
            )
        self.epoch = int(state["epoch"])
        self._skip = self._handed = int(state["batches"])

    def stats(self) -> dict[str, Any]:
        """Patches and bytes read so far in this process: ``bytes_read_per_patch`` and
        ``read_amplification`` (bytes read over the patches' own bytes) show that a patch
        was read, not a volume. The bytes count the label reads of a LabelSampler too (a
        label volume once for its occupancy grid, unless the cache had it, and a block of
        labels per patch centre)."""
        return self._stats.as_dict()

    # -- positions -----------------------------------------------------------------------

    def _grid(self, subject: int) -> list[np.ndarray] | np.ndarray:
        """A GridSampler's positions in `subject`, worked out once: its starts along each
        axis (every combination a position), or, where a subclass chooses its own
        positions (grid_positions), those, ``(positions, rank)``."""
        grid = self._grids.get(subject)
        if grid is None:
            sampler = self.sampler
            assert isinstance(sampler, GridSampler)
            shape = self.volumes.spatial_shape(subject)
            if type(sampler).grid_positions is GridSampler.grid_positions:
                starts = sampler.axis_starts(shape, self.patch_size)
                grid = [np.array(a, np.int64) for a in starts]
            else:
                positions = sampler.grid_positions(shape, self.patch_size)
                grid = np.array(positions, np.int64).reshape(len(positions), len(shape))
            self._grids[subject] = grid
        return grid

    def _drawn_starts(self, epoch: int, entries: np.ndarray) -> np.ndarray:
        """A uniform or grid sampler's starts of `entries` ((subject, patch number) rows),
        ``(len(entries), rank)``, all at once: such a position depends on its entry alone,
        and one call for a window of batches costs less than one a batch."""
        subjects = entries[:, 0]
        if isinstance(self.sampler, GridSampler):
            starts = np.empty((len(entries), len(self.patch_size)), np.int64)
            for s in np.unique(subjects).tolist():
                mine = subjects == s
                grid = self._grid(s)
                if isinstance(grid, np.ndarray):
                    starts[mine] = grid[entries[mine, 1]]
                    continue
                index = np.unravel_index(entries[mine, 1], [len(a) for a in grid])
                starts[mine] = np.stack([a[i] for a, i in zip(grid, index)], axis=1)
            return starts
        if self._shapes is None:
            shape_of = self.volumes.spatial_shape
            self._shapes = np.array([shape_of(s) for s in range(len(self.volumes))], np.int64)
        return uniform_starts(self.seed, epoch, entries, self._shapes[subjects], self.patch_size)

    def _draw_blocks(self, epoch: int, batch: list[tuple[int, int]]) -> _LabelBlocks:
        """A LabelSampler's first draws for `batch`, each patch from its own generator
        (PatchDraws): a class by weight, then a block by its count of the class's voxels.
        The reads of those blocks' labels are started, for _label_starts to finish."""
        draws = PatchDraws(self.seed, epoch, batch)
        # Generator.choice(p=...) takes one double and finds it among the cumulated weights.
        picks = draws.random(1)[:, 0].tolist()
        grids, groups, cumulatives = [], [], []
        for (s, _), pick in zip(batch, picks):
            grid, classes, cdf = self._classes_of(s)
            group = classes[bisect.bisect_right(cdf, pick)]
            grids.append(grid)
            groups.append(group)
            cumulatives.append(grid.group_counts(group))
        voxels = draws.integers(np.array([c[-1] for c in cumulatives], np.int64)).tolist()
        boxes = []
        for (s, _), grid, cumulative, voxel in zip(batch, grids, cumulatives, voxels):
            flat = int(np.searchsorted(cumulative, voxel, side="right"))
            boxes.append((s, *block_bounds(grid, flat)))
        return _LabelBlocks(batch, draws, groups, boxes, self._start_box_reads(boxes))

    def _label_starts(self, blocks: _LabelBlocks) -> list[tuple[int, ...]]:
        """The batch's starts: each patch centred on a voxel of its class in its block
        (the last draw of its generator), once the blocks' labels are read."""
        labels = self._box_values(blocks.reads)
        hits = [
            np.flatnonzero(values == group[0] if len(group) == 1 else np.isin(values, group))
            for values, group in zip(labels, blocks.groups)
        ]
        for (s, first, extent), found, group in zip(blocks.boxes, hits, blocks.groups):
            if not found.size:  # counted in the grid, gone from the file
                path = self.volumes.arrays[s][self._label_key].path
                raise UsageError(
                    f"{path}: the block of {extent} voxels at {first} holds none of the "
                    f"label values {group} its occupancy grid counted there; was the file "
                    "changed after the grid was counted?"
                )
        picks = blocks.draws.integers(np.array([found.size for found in hits], np.int64))
        starts = []
        for (s, first, _), values, found, pick in zip(blocks.boxes, labels, hits, picks.tolist()):
            voxel = np.unravel_index(int(found[pick]), values.shape)
            centre = tuple(f + int(v) for f, v in zip(first, voxel))
            starts.append(start_around(centre, self.volumes.spatial_shape(s), self.patch_size))
        return starts

    @property
    def _label_key(self) -> str:
        assert isinstance(self.sampler, LabelSampler)
        return self.sampler.label

    def _classes_of(self, subject: int) -> tuple[Occupancy, list[list[int]], list[float]]:
        """The subject's occupancy grid, the groups of label values its patches draw among,
        and their weights cumulated as Generator.choice(p=...) cumulates them."""
        if subject not in self._classes:
            sampler = self.sampler
            assert isinstance(sampler, LabelSampler)
            grid = self._occupancy_of(subject)
            groups, weights = sampler.classes(grid.values)
            if weights.sum() <= 0:
                path = self.volumes.arrays[subject][sampler.label].path
                raise UsageError(
                    f"subject {self.volumes.name(subject)}: its label ({path}) has none of the "
                    f"classes the LabelSampler draws (it has {grid.values})"
                )
            cdf = np.cumsum(weights / weights.sum())
            cdf /= cdf[-1]
            self._classes[subject] = (grid, groups, cdf.tolist())
        return self._classes[subject]

    def _occupancy_of(self, subject: int) -> Occupancy:
        if subject not in self._occupancy:
            sampler = self.sampler
            assert isinstance(sampler, LabelSampler)
            label = self.volumes.arrays[subject][sampler.label]
            shape = label.spatial_shape
            self._occupancy[subject] = occupancy(
                label,
                lambda: self._box_values(
                    self._start_box_reads([(subject, (0,) * len(shape), shape)])
                )[0],
                sampler.block,
                self.volumes.cache_dir,
            )
        return self._occupancy[subject]

    def _start_box_reads(
        self, boxes: list[tuple[int, tuple[int, ...], tuple[int, ...]]]
    ) -> _BoxReads:
        """Starts reading the label array's (subject, first voxel, extent) boxes, all of
        them in one read (a batch has a label block per patch, and reads waited for in turn
        would each add a round trip to the reader's threads)."""
        key = self._label_key
        places, total = [], 0
        for s, _, extent in boxes:
            array = self.volumes.arrays[s][key]
            shape = stored_box_shape(array, extent)
            places.append((array, shape, total, extent))
            total += -(-math.prod(shape) * array.dtype.itemsize // _ALIGN) * _ALIGN
        buffer = np.empty(total, np.uint8)
        reads = PatchReads()
        for (s, first, extent), (array, _, at, _) in zip(boxes, places):
            reads.add(
                array, self._file_ids[(s, key)], self._array_ids.get((s, key)), first, extent, at
            )
        return _BoxReads(reads.submit(buffer, self._files), buffer, places)

    def _box_values(self, boxes: _BoxReads) -> list[np.ndarray]:
        """The first channel of each box _start_box_reads started, in patch axis order, once
        read."""
        try:
            for pending in boxes.reads:
                pending.wait()
                self._stats.bytes_read += pending.bytes_read()
        except BaseException:
            for pending in boxes.reads:  # (none is left running into the buffer)
                pending.cancel()
            raise
        out = []
        for array, shape, at, extent in boxes.places:
            part = boxes.buffer[at : at + math.prod(shape) * array.dtype.itemsize]
            out.append(_to_patch_order(part, array, shape).reshape(-1, *extent)[0])
        return out

    # -- reading -------------------------------------------------------------------------

    def _window(
        self, epoch: int, plan: PatchOrder, numbers: Sequence[int], fresh: bool
    ) -> dict[int, tuple[list[tuple[int, int]], list[tuple[int, ...]]]]:
        """Batches `numbers`' entries and starts, batch by batch, drawn together; the
        reader is told which JPEG tiles they touch (_foresee). Empty for a LabelSampler,
        whose positions are known only once labels are read: its batches are drawn one by
        one (_draw_blocks), and not foreseen."""
        if isinstance(self.sampler, LabelSampler) or not numbers:
            return {}
        entries = plan.entries(numbers)
        starts = self._drawn_starts(epoch, entries)
        sizes = plan.sizes(numbers)
        if self._jpeg_arrays:
            self._foresee(entries[:, 0], starts, np.repeat(np.asarray(numbers), sizes), fresh)
        keys = [(s, k) for s, k in entries.tolist()]
        rows = [tuple(row) for row in starts.tolist()]
        ahead, at = {}, 0
        for n, size in zip(numbers, sizes.tolist()):
            ahead[n], at = (keys[at : at + size], rows[at : at + size]), at + size
        return ahead

    def _foresee(
        self, subjects: np.ndarray, starts: np.ndarray, owners: np.ndarray, fresh: bool
    ) -> None:
        """Tell the reader which JPEG tiles the patches of `subjects` at `starts` (read by
        batches `owners`) will touch, and which part of each: a tile several of them touch
        is then decoded once, in the part they take, and kept until the last of them (see
        ``_core.ShardReader.foresee_boxes``)."""
        by_rank: dict[int, list[tuple[np.ndarray, ...]]] = {}
        for (s, key), array_id in self._jpeg_arrays.items():
            mine = subjects == s
            if not mine.any():
                continue
            first, extent = stored_boxes(self.volumes.arrays[s][key], starts[mine], self.patch_size)
            ids = np.full(len(first), array_id, np.uint32)
            by_rank.setdefault(first.shape[1], []).append((ids, first, extent, owners[mine]))
        reader = shared_reader()
        for parts in by_rank.values():
            ids, first, extent, owner = (np.concatenate(p) for p in zip(*parts))
            reader.foresee_boxes(self._files, ids, first, extent, owner, fresh)

    def _submit(self, batch: list[tuple[int, int]], starts: list[tuple[int, ...]]) -> _PendingBatch:
        keys = self.volumes.keys
        layouts = []  # per key: (offset in buffer, bytes per patch, stored box shape, dtype)
        total = 0
        for key in keys:
            array = self.volumes.arrays[batch[0][0]][key]
            shape = stored_box_shape(array, self.patch_size)
            per_patch = math.prod(shape) * array.dtype.itemsize
            layouts.append((total, per_patch, shape, array.dtype))
            total += -(-per_patch * len(batch) // _ALIGN) * _ALIGN
        if self._gather is not None:
            direct = self._submit_direct(batch, starts, layouts, total)
            if direct is not None:
                return direct
        slot = self._stage.acquire(total) if self._stage is not None else None
        # A recycled buffer, its pages present: a fresh one per batch costs its page faults
        # (3-5% of the CPU of a slide's epoch).
        buffer = slot if slot is not None else shared_reader().batch_buffer(total)
        reads = PatchReads()
        for (base, per_patch, _, dtype), key in zip(layouts, keys):
            first = self.volumes.arrays[batch[0][0]][key]
            for i, ((s, _), start) in enumerate(zip(batch, starts)):
                array = self.volumes.arrays[s][key]
                if array.channels != first.channels or array.dtype != dtype:
                    raise UsageError(
                        f"{key!r} of subject {self.volumes.name(s)} ({array.path}) is "
                        f"{array.dtype} of {array.channels} channel(s), another subject's "
                        f"{dtype} of {first.channels}: patches of one batch need one type "
                        "and channel count"
                    )
                at = base + i * per_patch
                array_id = self._array_ids.get((s, key))
                if reads.add(array, self._file_ids[(s, key)], array_id, start, self.patch_size, at):
                    # In the file's byte order: the batch is swapped after the read.
                    stored_type = dtype.newbyteorder(">") if array.swap_unit else dtype
                    buffer[at : at + per_patch].view(stored_type)[:] = self.pad_value
        pending = reads.submit(buffer, self._files)
        self._stats.patch_bytes += reads.patch_bytes
        return _PendingBatch(pending, reads, buffer, slot, batch, starts, layouts)

    def _submit_direct(
        self,
        batch: list[tuple[int, int]],
        starts: list[tuple[int, ...]],
        layouts: list[tuple[int, int, tuple[int, ...], np.dtype]],
        total: int,
    ) -> _PendingBatch | None:
        """The batch read by cuFile into device memory, or None (see read_patches_to_device)."""
        assert self._gather is not None
        arrays, ids, places = [], [], []
        for (base, per_patch, _, _), key in zip(layouts, self.volumes.keys):
            for i, (s, _) in enumerate(batch):
                arrays.append(self.volumes.arrays[s][key])
                ids.append(self._file_ids[(s, key)])
                places.append(base + i * per_patch)
        done = read_patches_to_device(
            self._gather, arrays, ids, starts * len(layouts), places, self.patch_size, total
        )
        if done is None:
            return None
        buffer, counts = done
        self._stats.bytes_read += counts["bytes_read"]
        self._stats.patch_bytes += sum(per * len(batch) for _, per, _, _ in layouts)
        return _PendingBatch([], None, buffer, None, batch, starts, layouts)

    def _finish(self, pending: _PendingBatch) -> dict[str, Any]:
        torch = cuda.require_torch()
        if pending.plan is None:  # read by cuFile into device memory
            return self._arrange(pending, self._device_views(pending))
        for read in pending.reads:
            read.wait()
            self._stats.read_seconds += read.busy_seconds()
            self._stats.bytes_read += read.bytes_read()  # the reader's count, gaps included
        batch, n = pending.batch, len(pending.batch)
        stored: dict[str, Any] = {}
        for (base, per_patch, shape, dtype), key in zip(pending.layouts, self.volumes.keys):
            view = pending.buffer[base : base + per_patch * n].view(dtype).reshape(n, *shape)
            for i, (s, _) in enumerate(batch):  # each subject's file has its own byte order
                if self.volumes.arrays[s][key].swap_unit:
                    view[i].byteswap(inplace=True)
            stored[key] = torch.from_numpy(view)
        if self._stage is not None:
            stored = self._stage.to_device(stored, pending.slot)
        return self._arrange(pending, stored)

    def _device_views(self, pending: _PendingBatch) -> dict[str, Any]:
        """The device buffer's parts, one (B, *stored box) tensor per key."""
        torch = cuda.require_torch()
        mem, n = cuda.memory(), len(pending.batch)
        index = cuda.device_index(self.device)
        assert index is not None
        mem.hand_over(pending.buffer, index)
        views = {}
        for (base, per_patch, shape, dtype), key in zip(pending.layouts, self.volumes.keys):
            kind = torch.from_numpy(np.empty(0, dtype)).dtype
            views[key] = mem.view(pending.buffer, base, per_patch * n, kind, (n, *shape))
        return views

    def _arrange(self, pending: _PendingBatch, stored: dict[str, Any]) -> dict[str, Any]:
        """The batch's dict: each key's stored boxes in patch order, and what says where
        each patch is."""
        torch = cuda.require_torch()
        batch, starts, n = pending.batch, pending.starts, len(pending.batch)
        out: dict[str, Any] = {}
        for key in self.volumes.keys:
            arrays = [self.volumes.arrays[s][key] for s, _ in batch]
            orders = [(*a.channel_axes, *a.spatial_axes) for a in arrays]
            if any(o != orders[0] for o in orders):
                # Subjects stored in other axis orders (a .nii beside a .npy): each turned.
                shape = (arrays[0].channels, *self.patch_size)
                out[key] = torch.stack(
                    [
                        stored[key][i]
                        .reshape(stored_box_shape(a, self.patch_size))
                        .permute(*o)
                        .reshape(shape)
                        for i, (a, o) in enumerate(zip(arrays, orders))
                    ]
                )
                continue
            tensor = stored[key].permute(0, *(1 + a for a in orders[0]))
            if _channels_last(arrays[0]):
                # Samples stored interleaved (an RGB slide): the permuted view is already
                # torch's channels_last layout, which convolutions prefer; no copy.
                out[key] = tensor
                continue
            tensor = tensor.reshape(n, arrays[0].channels, *self.patch_size)
            if tensor.is_contiguous() or tensor.device.type != "cpu":
                out[key] = tensor.contiguous()
            else:
                # Stored in another axis order (a NIfTI's is Fortran order): turned in
                # cache-sized tiles on every core, 5x torch's contiguous() here.
                turned = torch.empty(tensor.shape, dtype=tensor.dtype)
                _core.permute_into(tensor.numpy(), turned.numpy())
                out[key] = turned
        out["subject"] = [self.volumes.name(s) for s, _ in batch]
        out["subject_index"] = torch.tensor([s for s, _ in batch], dtype=torch.int64)
        out["location"] = torch.tensor(starts, dtype=torch.int64).reshape(n, -1)
        if self._affines:
            out["affine"] = torch.from_numpy(
                np.stack(
                    [_patch_affine(self.volumes.affine(s), st) for (s, _), st in zip(batch, starts)]
                )
            )
        self._stats.patches += n
        self._stats.batches += 1
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        epoch, skip = self.epoch, self._skip
        self._skip = 0
        plan = self._plan(epoch)
        numbers = range(skip, len(plan))
        worker = _worker_info()
        if worker is not None:  # each DataLoader worker reads its own share
            numbers = numbers[worker[0] :: worker[1]]
        self._handed = skip
        queue: deque[tuple[int, _PendingBatch]] = deque()
        # the epoch's last batch, where this loop hands it out (see _deliver)
        last = len(plan) - 1 if worker is None else -1
        window = max(1, FORESIGHT_PATCHES // self.batch_size)
        # the entries and starts of the window's batches
        ahead: dict[int, tuple[list[tuple[int, int]], list[tuple[int, ...]]]] = {}
        # A LabelSampler's batches, their label blocks being read: the batch being started
        # and the next `prefetch`, so that waiting for a batch's blocks does not wait for
        # the patch reads queued before them. A batch whose draws failed holds the error,
        # raised once every batch before it is handed out.
        drawn: deque[_LabelBlocks | Exception] = deque()
        to_draw = iter(numbers)
        try:
            for i, number in enumerate(numbers):
                if i % window == 0:
                    ahead = self._window(epoch, plan, numbers[i : i + window], fresh=i == 0)
                if number in ahead:
                    batch, starts = ahead.pop(number)
                else:  # a LabelSampler's, drawn batch by batch
                    while len(drawn) <= self.prefetch:
                        later = next(to_draw, None)
                        if later is None:
                            break
                        try:
                            drawn.append(self._draw_blocks(epoch, plan.batch(later)))
                        except Exception as error:  # raised when its batch is reached
                            drawn.append(error)
                    blocks = drawn[0]
                    if isinstance(blocks, Exception):  # the batches before it first
                        while queue:
                            yield self._deliver(*queue.popleft(), last)
                        raise blocks
                    batch, starts = blocks.batch, self._label_starts(blocks)
                    drawn.popleft()  # (after: a failed wait leaves its reads to cancel)
                queue.append((number, self._submit(batch, starts)))
                if len(queue) > self.prefetch:
                    yield self._deliver(*queue.popleft(), last)
            while queue:
                yield self._deliver(*queue.popleft(), last)
        finally:
            for _, left in queue:
                for read in left.reads:
                    read.cancel()
            for blocks in drawn:
                if isinstance(blocks, _LabelBlocks):
                    for read in blocks.reads.reads:
                        read.cancel()

    def iterable_dataset(self) -> Any:
        """This loader as a ``torch.utils.data.IterableDataset``, for a DataLoader's worker
        processes (``batch_size=None``: the batches are made here); each worker yields
        every ``num_workers``-th batch of the epoch."""
        return _iterable_dataset_class()(self)

    def _deliver(self, number: int, pending: _PendingBatch, last: int) -> dict[str, Any]:
        """The batch; once the epoch's last one is handed out, the loader is at the next
        epoch's start (a loop that stops after len() batches, as Lightning's does, never
        asks the iterator for its end)."""
        batch = self._finish(pending)
        self._handed += 1
        if number == last:
            self.epoch, self._handed = self.epoch + 1, 0
        return batch


@dataclass
class _BoxReads:
    """Label boxes being read into `buffer`: per box its array, stored shape, place in the
    buffer and extent."""

    reads: list[Any]  # _core.PendingRead each
    buffer: np.ndarray
    places: list[tuple[VolumeArray, tuple[int, ...], int, tuple[int, ...]]]


@dataclass
class _LabelBlocks:
    """A batch of a LabelSampler's so far: its patches' generators, the class (label
    values) each drew, the block each drew ((subject, first voxel, extent)), and the reads
    of those blocks' labels, under way."""

    batch: list[tuple[int, int]]
    draws: PatchDraws
    groups: list[list[int]]
    boxes: list[tuple[int, tuple[int, ...], tuple[int, ...]]]
    reads: _BoxReads


@dataclass
class _PendingBatch:
    reads: list[Any]  # _core.PendingRead each
    plan: PatchReads | None  # what they read and what is left; None: read by cuFile
    buffer: np.ndarray
    slot: np.ndarray | None
    batch: list[tuple[int, int]]
    starts: list[tuple[int, ...]]
    layouts: list[tuple[int, int, tuple[int, ...], np.dtype]]


def _grid_size(grid: list[np.ndarray] | np.ndarray) -> int:
    """The positions of a subject's grid (PatchLoader._grid)."""
    return len(grid) if isinstance(grid, np.ndarray) else math.prod(len(a) for a in grid)


def _channels_last(array: VolumeArray) -> bool:
    """Whether the array is stored as (*spatial, channels) with more than one channel: its
    patches are then handed out as channels_last tensors rather than copied."""
    n = len(array.stored_shape)
    return (
        array.channels > 1
        and array.channel_axes == (n - 1,)
        and array.spatial_axes == tuple(range(n - 1))
    )


def _to_patch_order(buffer: np.ndarray, array: VolumeArray, shape: tuple[int, ...]) -> np.ndarray:
    """A stored-order box as (channels, *spatial in patch order)."""
    view = buffer.view(array.dtype).reshape(shape)
    if array.swap_unit:
        view = view.byteswap()
    moved = np.transpose(view, (*array.channel_axes, *array.spatial_axes))
    spatial = [shape[a] for a in array.spatial_axes]
    return moved.reshape(-1, *spatial)


def _patch_affine(affine: np.ndarray | None, start: tuple[int, ...]) -> np.ndarray:
    """The voxel-to-world matrix of a patch whose first voxel is `start` of the volume."""
    assert affine is not None
    shift = np.eye(4)
    shift[: len(start), 3] = start
    return affine @ shift


def _identities(paths: list[str]) -> np.ndarray:
    """(inode, size, mtime_ns) of each file now: a file replaced later is refused by the
    reader rather than read as another."""
    rows = []
    for p in paths:
        st = os.stat(p)
        rows.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return np.array(rows, np.int64).reshape(len(paths), 3)


_DATASET_CLASS: list[type] = []


def _iterable_dataset_class() -> type:
    """The IterableDataset over a PatchLoader, made on first use: stoker imports torch only
    when it is used."""
    if not _DATASET_CLASS:
        torch = cuda.require_torch()

        class PatchBatches(torch.utils.data.IterableDataset):  # type: ignore[misc, name-defined]
            """A PatchLoader's batches, for a DataLoader with batch_size=None."""

            def __init__(self, loader: PatchLoader) -> None:
                self.loader = loader

            def __iter__(self) -> Iterator[dict[str, Any]]:
                return iter(self.loader)

            def __len__(self) -> int:
                return len(self.loader)

        # Found by pickle (a spawned worker) as this module's PatchBatches: __getattr__.
        PatchBatches.__qualname__ = "PatchBatches"
        _DATASET_CLASS.append(PatchBatches)
    return _DATASET_CLASS[0]


def __getattr__(name: str) -> Any:
    if name == "PatchBatches":
        return _iterable_dataset_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _worker_info() -> tuple[int, int] | None:
    """(worker id, workers) inside a torch DataLoader worker, else None."""
    try:
        from torch.utils.data import get_worker_info
    except ImportError:
        return None
    info = get_worker_info()
    return None if info is None else (info.id, info.num_workers)
