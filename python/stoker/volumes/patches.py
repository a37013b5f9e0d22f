"""PatchLoader: batches of patches read from the volumes' files, only the bytes each patch
needs, by the C++ reader's threads, into one buffer per batch (a pinned slot for a device
loader, copied to the device in one copy)."""

from __future__ import annotations

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
from stoker.volumes.boxes import PatchRuns, bytes_read, patch_runs, stored_box_shape
from stoker.volumes.samplers import (
    GridSampler,
    LabelSampler,
    Occupancy,
    PatchSampler,
    UniformSampler,
    block_bounds,
    occupancy,
    start_around,
    uniform_start,
)
from stoker.volumes.subjects import Volumes

_ALIGN = 64  # each array's part of a batch buffer starts on a cache line

EDGES = ("pad", "refuse")


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
    per array key, plus ``"subject"`` (each patch's subject name), ``"subject_index"``,
    ``"location"`` (``(B, D)`` int64: each patch's first voxel, which may be negative or run
    past the end for a padded patch) and, where every subject's files have one,
    ``"affine"`` (``(B, 4, 4)`` float64: the patch's own voxel-to-world matrix).

    Only the bytes a patch needs are read (see stoker.volumes.boxes), by the C++ reader's
    threads with the GIL released, into one buffer per batch; the next ``prefetch``
    batches are read while one is used. The order of patches and their positions are pure
    functions of (seed, epoch, rank, world size): the same on any thread count, resumed
    exactly by ``load_state_dict``, and split across ranks into disjoint stretches of
    equal length (the epoch's list wraps around to fill the last one).

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
            epoch's list instead of wrapping it around.
        rank, world_size: As for ``stoker.Loader`` (default: torch.distributed's).
        prefetch: Batches read ahead.
        pinned_bytes: Page-locked memory a device loader's batches go through.

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
        self._files = _core.FileTable(volumes.files(), _identities(volumes.files()))
        # volumes.files() lists subject by subject, key by key: this is each one's place.
        self._file_ids = {
            (s, k): s * len(volumes.keys) + j
            for s in range(len(volumes))
            for j, k in enumerate(volumes.keys)
        }
        self._affines = all(volumes.affine(i) is not None for i in range(len(volumes)))
        index = cuda.device_index(device)
        self.device = "cpu" if index is None else f"cuda:{index}"
        self._stage: cuda.DeviceStage | None = None
        if index is not None:
            cuda.require_cuda(index)
            self._stage = cuda.DeviceStage(index, pinned_bytes, max(2, prefetch + 1))

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

    def _entries(self, epoch: int) -> list[tuple[int, int]]:
        """(subject, patch number) of every patch of the epoch, in order, before ranks."""
        entries: list[tuple[int, int]] = []
        for s in range(len(self.volumes)):
            count = self.patches_per_subject if self.sampler.random else len(self._grid(s))
            entries.extend((s, k) for k in range(count))
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch, 0x9A7C]).permutation(len(entries))
            entries = [entries[i] for i in order]
        return entries

    def _rank_entries(self, epoch: int) -> list[tuple[int, int]]:
        entries = self._entries(epoch)
        n, world = len(entries), self.world_size
        per_rank = n // world if self.drop_last else math.ceil(n / world)
        if per_rank == 0:
            return []
        wrapped = (entries * math.ceil(per_rank * world / n))[: per_rank * world]
        return wrapped[self.rank * per_rank : (self.rank + 1) * per_rank]

    def _batches(self, epoch: int) -> list[list[tuple[int, int]]]:
        mine = self._rank_entries(epoch)
        batches = [mine[i : i + self.batch_size] for i in range(0, len(mine), self.batch_size)]
        if self.drop_last and batches and len(batches[-1]) < self.batch_size:
            batches.pop()
        return batches

    def __len__(self) -> int:
        return len(self._batches(self.epoch))

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
        self.epoch = int(state["epoch"])
        self._skip = self._handed = int(state["batches"])

    def stats(self) -> dict[str, Any]:
        """Patches and bytes read so far in this process: ``bytes_read_per_patch`` and
        ``read_amplification`` (bytes read over the patches' own bytes) show that a patch
        was read, not a volume."""
        return self._stats.as_dict()

    # -- positions -----------------------------------------------------------------------

    def _grid(self, subject: int) -> list[tuple[int, ...]]:
        assert isinstance(self.sampler, GridSampler)
        return self.sampler.grid_positions(self.volumes.spatial_shape(subject), self.patch_size)

    def _starts(self, epoch: int, batch: list[tuple[int, int]]) -> list[tuple[int, ...]]:
        shape_of = self.volumes.spatial_shape
        if isinstance(self.sampler, GridSampler):
            grids: dict[int, list[tuple[int, ...]]] = {}
            return [grids.setdefault(s, self._grid(s))[k] for s, k in batch]
        rngs = [np.random.default_rng([self.seed, epoch, s, k]) for s, k in batch]
        if isinstance(self.sampler, LabelSampler):
            return self._label_starts(batch, rngs)
        return [uniform_start(r, shape_of(s), self.patch_size) for (s, _), r in zip(batch, rngs)]

    def _label_starts(
        self, batch: list[tuple[int, int]], rngs: list[np.random.Generator]
    ) -> list[tuple[int, ...]]:
        """Centres at voxels of drawn classes: a group by weight, a block by its count of
        the group's voxels, then one of those voxels, read from the block's labels."""
        sampler = self.sampler
        assert isinstance(sampler, LabelSampler)
        blocks = []
        for (s, _), rng in zip(batch, rngs):
            grid = self._occupancy_of(s)
            groups, weights = sampler.classes(grid.values)
            if weights.sum() <= 0:
                path = self.volumes.arrays[s][sampler.label].path
                raise UsageError(
                    f"subject {self.volumes.name(s)}: its label ({path}) has none of the "
                    f"classes the LabelSampler draws (it has {grid.values})"
                )
            g = int(rng.choice(len(groups), p=weights / weights.sum()))
            cumulative = grid.group_counts(groups[g])
            flat = int(np.searchsorted(cumulative, rng.integers(cumulative[-1]), side="right"))
            blocks.append((s, groups[g], *block_bounds(grid, flat)))
        labels = self._read_boxes([(s, first, extent) for s, _, first, extent in blocks])
        starts = []
        for (s, group, first, _), values, rng in zip(blocks, labels, rngs):
            hits = np.flatnonzero(np.isin(values, group))
            voxel = np.unravel_index(int(hits[rng.integers(hits.size)]), values.shape)
            centre = tuple(f + int(v) for f, v in zip(first, voxel))
            starts.append(start_around(centre, self.volumes.spatial_shape(s), self.patch_size))
        return starts

    def _occupancy_of(self, subject: int) -> Occupancy:
        if subject not in self._occupancy:
            sampler = self.sampler
            assert isinstance(sampler, LabelSampler)
            label = self.volumes.arrays[subject][sampler.label]
            shape = label.spatial_shape
            whole = self._read_boxes([(subject, (0,) * len(shape), shape)])[0]
            self._occupancy[subject] = occupancy(
                label, whole, sampler.block, self.volumes.cache_dir
            )
        return self._occupancy[subject]

    def _read_boxes(
        self, boxes: list[tuple[int, tuple[int, ...], tuple[int, ...]]]
    ) -> list[np.ndarray]:
        """The label array's first channel in each (subject, first voxel, extent) box, in
        patch axis order, read now."""
        assert isinstance(self.sampler, LabelSampler)
        key = self.sampler.label
        out = []
        for s, first, extent in boxes:
            array = self.volumes.arrays[s][key]
            runs = patch_runs(array, first, extent)
            buffer = np.empty(int(np.prod(runs.shape)) * array.dtype.itemsize, np.uint8)
            ids = np.full(runs.offsets.shape, self._file_ids[(s, key)], np.int64)
            shared_reader().read_into(
                buffer, self._files, ids, runs.offsets, runs.lengths, runs.dest_offsets
            ).wait()
            values = _to_patch_order(buffer, array, runs.shape)
            out.append(values.reshape(-1, *extent)[0])
        return out

    # -- reading -------------------------------------------------------------------------

    def _submit(self, epoch: int, batch: list[tuple[int, int]]) -> _PendingBatch:
        starts = self._starts(epoch, batch)
        keys = self.volumes.keys
        layouts = []  # per key: (offset in buffer, bytes per patch, stored box shape, dtype)
        total = 0
        for key in keys:
            array = self.volumes.arrays[batch[0][0]][key]
            shape = stored_box_shape(array, self.patch_size)
            per_patch = int(np.prod(shape)) * array.dtype.itemsize
            layouts.append((total, per_patch, shape, array.dtype))
            total += -(-per_patch * len(batch) // _ALIGN) * _ALIGN
        slot = self._stage.acquire(total) if self._stage is not None else None
        buffer = slot if slot is not None else np.empty(total, np.uint8)
        pieces: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        patch_bytes = 0
        for (base, per_patch, shape, dtype), key in zip(layouts, keys):
            for i, ((s, _), start) in enumerate(zip(batch, starts)):
                array = self.volumes.arrays[s][key]
                if stored_box_shape(array, self.patch_size) != shape or array.dtype != dtype:
                    raise UsageError(
                        f"{key!r} of subject {self.volumes.name(s)} ({array.path}) is "
                        f"{array.dtype} of channels {array.channels}, other subjects' "
                        f"{dtype}: patches of one batch need one type and channel count"
                    )
                runs: PatchRuns = patch_runs(array, start, self.patch_size)
                at = base + i * per_patch
                if runs.padded:  # in the file's byte order: the batch is swapped after the read
                    stored_type = dtype.newbyteorder(">") if array.swap_unit else dtype
                    buffer[at : at + per_patch].view(stored_type)[:] = self.pad_value
                ids = np.full(runs.offsets.shape, self._file_ids[(s, key)], np.int64)
                pieces.append((ids, runs.offsets, runs.lengths, runs.dest_offsets + at))
                patch_bytes += int(runs.lengths.sum())
        ids, offsets, lengths, dests = (np.concatenate(p) for p in zip(*pieces))
        pending = shared_reader().read_into(buffer, self._files, ids, offsets, lengths, dests)
        self._stats.patch_bytes += patch_bytes
        read = bytes_read(ids, offsets, lengths)
        self._stats.bytes_read += read
        return _PendingBatch(pending, buffer, slot, batch, starts, layouts)

    def _finish(self, pending: _PendingBatch) -> dict[str, Any]:
        torch = cuda.require_torch()
        pending.read.wait()
        self._stats.read_seconds += pending.read.busy_seconds()
        batch, starts, n = pending.batch, pending.starts, len(pending.batch)
        out: dict[str, Any] = {}
        stored: dict[str, Any] = {}
        for (base, per_patch, shape, dtype), key in zip(pending.layouts, self.volumes.keys):
            view = pending.buffer[base : base + per_patch * n].view(dtype).reshape(n, *shape)
            for i, (s, _) in enumerate(batch):  # each subject's file has its own byte order
                if self.volumes.arrays[s][key].swap_unit:
                    view[i].byteswap(inplace=True)
            stored[key] = torch.from_numpy(view)
        if self._stage is not None:
            stored = self._stage.to_device(stored, pending.slot)
        for key in self.volumes.keys:
            array = self.volumes.arrays[batch[0][0]][key]
            order = [0] + [1 + a for a in (*array.channel_axes, *array.spatial_axes)]
            tensor = stored[key].permute(*order)
            out[key] = tensor.reshape(n, array.channels, *self.patch_size).contiguous()
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
        batches = self._batches(epoch)
        numbers = list(range(skip, len(batches)))
        worker = _worker_info()
        if worker is not None:  # each DataLoader worker reads its own share
            numbers = numbers[worker[0] :: worker[1]]
        self._handed = skip
        ended = False
        queue: deque[_PendingBatch] = deque()
        upcoming = iter(numbers)
        try:
            for number in upcoming:
                queue.append(self._submit(epoch, batches[number]))
                if len(queue) > self.prefetch:
                    yield self._deliver(queue.popleft())
            while queue:
                yield self._deliver(queue.popleft())
            ended = True
        finally:
            for left in queue:
                left.read.cancel()
        if ended and worker is None:
            self.epoch, self._handed = epoch + 1, 0

    def iterable_dataset(self) -> Any:
        """This loader as a ``torch.utils.data.IterableDataset``, for a DataLoader's worker
        processes (``batch_size=None``: the batches are made here); each worker yields
        every ``num_workers``-th batch of the epoch."""
        return _iterable_dataset_class()(self)

    def _deliver(self, pending: _PendingBatch) -> dict[str, Any]:
        batch = self._finish(pending)
        self._handed += 1
        return batch


@dataclass
class _PendingBatch:
    read: Any  # _core.PendingRead
    buffer: np.ndarray
    slot: np.ndarray | None
    batch: list[tuple[int, int]]
    starts: list[tuple[int, ...]]
    layouts: list[tuple[int, int, tuple[int, ...], np.dtype]]


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
