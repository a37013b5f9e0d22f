"""Reading one batch: submitted to the C++ reader (laid out by the fields= plan, or as
whole samples for map=), then waited for and turned into what the Loader hands out."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

import stoker.cuda as cuda
from stoker.dataset import Dataset, Gathered
from stoker.dataset.mix import Mix
from stoker.errors import ShardFormatError, StokerError
from stoker.loader.plan import FieldsPlan

log = logging.getLogger("stoker.loader")


@dataclass
class Stats:
    samples: int = 0
    batches: int = 0
    bytes: int = 0
    bytes_read: int = 0  # from files: runs, chunks as stored, values taken in place
    wait_s: float = 0.0  # the consumer blocked in __next__
    read_busy_s: float = 0.0  # thread time spent reading and decoding, summed
    images_blanked: int = 0  # Image(on_error="blank") members that did not decode
    started: float | None = None
    per_source: npt.NDArray[np.int64] | None = None  # a Mix's: samples read from each source

    def summary(self) -> dict[str, Any]:
        """The counters as Loader.stats gives them, with the rates since `started`."""
        elapsed = time.perf_counter() - self.started if self.started is not None else 0.0
        return {
            "samples": self.samples,
            "batches": self.batches,
            "bytes": self.bytes,
            "bytes_read": self.bytes_read,
            "elapsed_s": elapsed,
            "wait_s": self.wait_s,
            "read_busy_s": self.read_busy_s,
            "images_blanked": self.images_blanked,
            "input_bound_fraction": self.wait_s / elapsed if elapsed > 0 else 0.0,
            "samples_per_s": self.samples / elapsed if elapsed > 0 else 0.0,
            **({"per_source": self.per_source.tolist()} if self.per_source is not None else {}),
        }


class RingFull(Exception):
    """No pinned slot is free for the next batch without waiting on the consumer."""


class FailedRead:
    """Stands in the queue for a batch that could not even be submitted, so its error is
    raised at that batch, not at the earlier one being waited on."""

    def __init__(self, error: StokerError) -> None:
        self.error = error

    def wait(self) -> None:
        raise self.error

    def cancel(self) -> None:
        pass


@dataclass
class InFlight:
    """A batch being read."""

    pending: Any  # _core.PendingRead, or FailedRead
    indices: np.ndarray | None = None
    prepared: Any = None  # fields=: the _core.PreparedBatch
    members: Gathered | None = None  # map=: the members read


class BatchReader:
    """Submits and finishes the batches of one Loader."""

    def __init__(
        self,
        ds: Dataset,
        plan: FieldsPlan | None,
        map_fn: Callable[[list[dict[str, Any]]], list[Any]] | None,
        collate: Callable[[list[Any]], Any],
        reader: Any,
        stage: cuda.DeviceStage | None,
        stats: Stats,
        torch: Any,
    ) -> None:
        self.ds = ds
        self.plan = plan
        self.map_fn = map_fn
        self.collate = collate
        self.reader = reader
        self.stage = stage
        self.stats = stats
        self.torch = torch

    def submit(self, indices: np.ndarray, can_wait: bool = True, augment_seed: int = 0) -> InFlight:
        """Start reading a batch. A device loader's fields= batch needs a pinned slot: when
        none is free and `can_wait` is false (batches are in flight, whose hand-out frees
        one), this raises RingFull instead of waiting. `augment_seed`: the epoch's seed of
        images' random crops."""
        if self.plan is None:
            with self.ds.indexed(indices):
                self.ds.size_values(indices, None, self.reader)
                members = self.ds.gather(indices)
            return InFlight(self.ds.read_members(members, self.reader), indices, members=members)
        prepared = self.plan.prepare(indices, self.reader, augment_seed)
        slot = None
        if self.stage is not None:
            # Read straight into a pinned slot: the batch then goes over in one copy.
            slot = self.stage.acquire(prepared.nbytes, wait=can_wait)
            if slot is None:
                raise RingFull
        return InFlight(prepared.submit(self.reader, slot), indices, prepared)

    def finish(self, item: InFlight) -> Any:
        """Wait for `item` and build its batch (on the device, for a device loader)."""
        plan = self.plan  # set for fields= batches: those with `item.prepared`
        try:
            buffer = item.pending.wait()
        except ShardFormatError as error:  # the reader knows files and offsets, not samples
            if item.prepared is not None:
                assert plan is not None and item.indices is not None
                named = plan.name_null(error, item.indices, self.reader)
                raise (named or plan.name_member(error, item.prepared)) from error
            if item.members is not None:
                members = item.members
                raise self.ds.explain(error, members.ids, members.offset) from error
            raise  # a batch that failed before any read: its error says it all
        # Only a FailedRead has no indices, and its wait() raised.
        indices = item.indices
        assert indices is not None
        self.stats.read_busy_s += item.pending.busy_seconds()
        self.stats.bytes_read += item.pending.bytes_read()
        if item.prepared is not None:
            assert plan is not None
            if plan.has_images:
                self._count_blanked(item, plan)
        self.stats.bytes += int(buffer.nbytes) + item.pending.unsized_bytes()
        self.stats.samples += len(indices)
        if self.stats.per_source is not None:
            assert isinstance(self.ds, Mix)  # per_source is counted for a Mix only
            self.stats.per_source += np.bincount(
                self.ds.source_of(np.asarray(indices)), minlength=len(self.stats.per_source)
            )
        if item.prepared is not None:
            assert plan is not None
            copy = self.stage is not None  # a pinned slot the ring needs back soon
            batch = plan.assemble(item.prepared, item.pending, buffer, indices, self.torch, copy)
            return self.stage.to_device(batch, buffer) if self.stage else batch
        assert item.members is not None  # a map= batch: submit() gathered its members
        samples = self.ds.samples_of(buffer, indices, item.members)
        if self.map_fn is not None:
            samples = self.map_fn(samples)
        batch = self.collate(samples)
        return self.stage.to_device(batch) if self.stage else batch

    def _count_blanked(self, item: InFlight, plan: FieldsPlan) -> None:
        blanked = item.pending.blanked()
        if not len(blanked):
            return
        self.stats.images_blanked += len(blanked)
        for key in plan.blanked(item.prepared, blanked):
            log.warning("sample %r: its image did not decode; it was served as zeros", key)
