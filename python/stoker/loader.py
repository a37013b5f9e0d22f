"""The Loader: ``for batch in stoker.Loader(ds, batch_size=64): ...``.

Batches are planned by the sampler (a pure function of seed, epoch, rank and world size),
read ``prefetch`` batches ahead by the C++ reader, and handed out as dicts of torch tensors.
With ``fields=`` a whole batch is laid out by numpy index arithmetic and read with one call
into one recycled buffer, which the tensors view without a copy; the buffer goes back for
reuse only when every tensor viewing it is gone.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import logging
import os
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stoker import cuda
from stoker.dataset import ALIGN, Dataset, _release_when_done, aligned_offsets, shared_reader
from stoker.errors import ReadError, ShardFormatError, StokerError, UsageError, located, quoted
from stoker.fields import Bytes, FieldSpec, Int, Npy, Raw
from stoker.gds import read_npy_header
from stoker.remote import wait_result
from stoker.sampler import (
    DEFAULT_SHUFFLE_WINDOW,
    EpochPlan,
    batch_count,
    plan_epoch,
    rank_stretch,
)

log = logging.getLogger("stoker.loader")

_STATE_VERSION = 1
_EXTRA_SHARDS = 2  # remote shards fetched ahead beyond one per connection
_INT_WIDTH = 64  # bytes of text an Int() member may have, whitespace included
_CODEC_ASCII_INT = 2  # the reader parses the text into an int64 (io::Codec::kAsciiInt)
_DEFAULT_PINNED_BYTES = 1 << 30  # page-locked host memory a GPU loader may hold


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """rank and world size: as given, else torch.distributed's when it is initialised,
    else the RANK / WORLD_SIZE environment, else 0 and 1."""
    if rank is not None and world_size is not None:
        found = rank, world_size
    else:
        found = None
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                found = dist.get_rank(), dist.get_world_size()
        except ImportError:  # pragma: no cover
            pass
        if found is None:
            found = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        found = (found[0] if rank is None else rank, found[1] if world_size is None else world_size)
    if not 0 <= found[0] < found[1]:
        raise StokerError(f"rank {found[0]} is not in [0, world_size={found[1]})")
    return found


def _epoch_batches(samples: int, world_size: int, drop_last: bool, batch_size: int) -> int:
    """Batches each rank reads in a whole epoch of `samples` split over `world_size`."""
    begin, end = rank_stretch(samples, 0, world_size, drop_last)
    return batch_count(end - begin, batch_size, drop_last)


def _check_dataset(dataset: object) -> None:
    if not isinstance(dataset, Dataset):
        raise UsageError(
            f"stoker.Loader reads a stoker.Dataset, not a {type(dataset).__name__}: open your "
            "data with stoker.Dataset(shards or folder), Dataset.from_csv(csv, folder) or "
            "Dataset.from_files(folder, names); a map-style torch dataset of your own goes "
            "to torch.utils.data.DataLoader"
        )


def _some(names: list[str], most: int = 20) -> str:
    """Field names for a message: all of a few, the first `most` of many."""
    shown = ", ".join(quoted(n, 60) for n in names[:most])
    return shown + (f" and {len(names) - most:,} more" if len(names) > most else "")


def _likely_decoder(name: str) -> str:
    """The decoder a field of this name usually needs, for an example in a message."""
    return "Int" if name.lower() in ("cls", "label", "target", "index") else "Bytes"


def _check_fields_argument(fields: object) -> dict[str, FieldSpec] | None:
    if fields is None:
        return None
    if not isinstance(fields, Mapping):
        names = [fields] if isinstance(fields, str) else fields
        if isinstance(names, (list, tuple)) and names and all(isinstance(n, str) for n in names):
            example = ", ".join(f"{n!r}: stoker.{_likely_decoder(n)}()" for n in names[:3])
        else:
            example = "'raw': stoker.Raw((3, 64, 64), 'uint8'), 'cls': stoker.Int()"
        raise UsageError(
            f"fields= maps each field to its decoder, not a {type(fields).__name__} "
            f"({quoted(fields, 80)}): pass a dict such as {{{example}}}, with the decoder "
            "each field needs: stoker.Raw(shape, dtype), Int(), Npy() or Bytes()"
        )
    wrong = [key for key in fields if not isinstance(key, str)]
    if wrong:
        raise UsageError(
            f"fields= keys are field names (str), not {type(wrong[0]).__name__}: {wrong[0]!r}"
        )
    return dict(fields)


class _EpochSetter:
    """A Loader's ``sampler``: only ``set_epoch``, for frameworks that drive samplers."""

    def __init__(self, loader: Loader) -> None:
        self.set_epoch = loader.set_epoch


@dataclass
class _Stats:
    samples: int = 0
    batches: int = 0
    bytes: int = 0
    wait_s: float = 0.0  # the consumer blocked in __next__
    read_busy_s: float = 0.0  # thread time spent reading and decoding, summed
    started: float | None = None


@dataclass
class _Layout:
    """Where each field of one batch lies in its buffer, and how to hand it out."""

    indices: np.ndarray
    fixed: list[tuple[str, int, np.dtype, tuple[int, ...]]] = field(default_factory=list)
    ints: list[tuple[str, int, np.ndarray, np.ndarray, int]] = field(default_factory=list)
    blobs: list[tuple[str, np.ndarray, np.ndarray]] = field(default_factory=list)
    extras: list[tuple[str, str, int]] = field(default_factory=list)
    headers: list[tuple[str, int, bytes, np.ndarray]] = field(default_factory=list)
    nbytes: int = 0
    # every piece read: its member row and the file offset it starts at (errors name them)
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    offsets: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))


class _RingFull(Exception):
    """No pinned slot is free for the next batch without waiting on the consumer."""


class _FailedRead:
    """Stands in the queue for a batch that could not even be submitted, so its error is
    raised at that batch, not at the earlier one being waited on."""

    def __init__(self, error: StokerError) -> None:
        self.error = error

    def wait(self) -> None:
        raise self.error

    def cancel(self) -> None:
        pass


def _shard_spans(ds: Dataset, plan: EpochPlan, start: int) -> tuple[list[int], dict, dict]:
    """This rank's remote shards from batch `start` on: in the order batches first read
    them, and the first and last batch that reads each."""
    indices = plan.indices[start * plan.batch_size : len(plan) * plan.batch_size]
    shards = ds.shards_of(indices)
    batches = start + np.arange(len(indices), dtype=np.int64) // plan.batch_size
    keep = np.array([s in ds._remote_of for s in shards.tolist()], bool)
    shards, batches = shards[keep], batches[keep]
    unique, first_at = np.unique(shards, return_index=True)
    order = unique[np.argsort(first_at, kind="stable")].tolist()
    first = dict(zip(shards[::-1].tolist(), batches[::-1].tolist()))
    last = dict(zip(shards.tolist(), batches.tolist()))
    return order, first, last


class _ShardPrefetch:
    """One epoch's remote shards for this rank. The shards of the batches being read are
    held (fetched first if need be) until the last batch that reads them is done; the
    next few in the order batches first need them are fetched ahead, unheld and only
    into free room, so read-ahead never crowds out what is being read."""

    def __init__(self, ds: Dataset, plan: EpochPlan, start: int) -> None:
        self.ds = ds
        self.plan = plan
        self.order, _, self.last = _shard_spans(ds, plan, start)
        self.remote = np.zeros(len(ds._paths), bool)
        self.remote[list(ds._remote_of)] = True
        # Enough fetched ahead to keep every connection busy while batches are read.
        self.ahead = ds._remote.options.connections + _EXTRA_SHARDS
        self.rank = {shard: i for i, shard in enumerate(self.order)}  # download priority
        self.started: dict[int, concurrent.futures.Future] = {}  # held, or on the way
        self.arrived: set[int] = set()  # held and indexed
        self.warming: dict[int, concurrent.futures.Future] = {}  # fetched ahead, unheld
        self.next = 0  # the first shard of self.order neither held nor warming

    def _batch_shards(self, k: int) -> list[int]:
        shards = np.unique(self.ds.shards_of(self.plan.batch(k)))
        return [s for s in shards.tolist() if self.remote[s]]

    def pump(self, next_batch: int) -> None:
        """Hold the shards batch `next_batch` reads, and warm the next ones in order, so
        that ``ahead`` are warming (or warm and not needed yet)."""
        if next_batch < len(self.plan):
            for shard in self._batch_shards(next_batch):
                self._start(shard)
        while self.next < len(self.order) and len(self.warming) < self.ahead:
            shard = self.order[self.next]
            self.next += 1
            if shard not in self.started:
                r = self.ds._remote_of[shard]
                self.warming[shard] = self.ds._remote.warm(r, priority=(1, self.rank[shard]))

    def _start(self, shard: int) -> None:
        self.warming.pop(shard, None)  # its download, if running, is waited for by lock
        if shard not in self.started:
            self.started[shard] = self.ds._start_fetch(shard, priority=(0, self.rank[shard]))

    def ready(self, k: int) -> bool:
        """Whether every fetch batch `k` needs has ended (well or not)."""
        return all(self.started[s].done() for s in self._batch_shards(k))

    def wait(self, k: int) -> None:
        for shard in self._batch_shards(k):
            with contextlib.suppress(Exception):  # arrive() raises it, at its batch
                wait_result(self.started[shard])

    def arrive(self, k: int) -> None:
        """Index batch `k`'s shards that arrived; a fetch that failed raises here (and is
        forgotten, so a later batch that needs the shard tries again)."""
        for shard in self._batch_shards(k):
            if shard in self.arrived:
                continue
            future = self.started.pop(shard)
            result = future.result()  # a failed fetch holds nothing
            try:
                self.ds._shard_arrived(shard, result)
            except BaseException:
                self.ds._release(shard)
                raise
            self.started[shard] = future
            self.arrived.add(shard)

    def finished(self, k: int) -> None:
        """Batch `k` is read: let go of the shards no later batch reads."""
        for shard in self._batch_shards(k):
            if self.last.get(shard) == k and shard in self.arrived:
                self.arrived.discard(shard)
                del self.started[shard]
                self.ds._release(shard)

    def close(self) -> None:
        """Let go of everything: held shards now, fetches still running when they end."""
        for shard, future in self.started.items():
            if shard in self.arrived:
                self.ds._release(shard)
            elif not future.cancel():
                future.add_done_callback(_release_when_done(self.ds, shard))
        self.started.clear()
        self.arrived.clear()
        self.warming.clear()  # unheld: nothing to let go


class Loader:
    """Batches of `dataset` for this rank, in the sampler's order. See the README."""

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int = 64,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        map: Callable[[dict[str, Any]], Any] | None = None,  # noqa: A002 - the contract's name
        collate: Callable[[list[Any]], Any] | None = None,
        device: str = "cpu",
        fields: Mapping[str, FieldSpec] | None = None,
        num_threads: int | None = None,
        prefetch: int = 4,
        shuffle_window: int = DEFAULT_SHUFFLE_WINDOW,
        log_every: int | None = None,
        pinned_bytes: int | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size}")
        if prefetch < 1:
            raise ValueError(f"prefetch must be at least 1, not {prefetch}")
        self._device = cuda.device_index(device)
        if pinned_bytes is not None and pinned_bytes < 1:
            raise ValueError(f"pinned_bytes must be positive, not {pinned_bytes}")
        if fields is not None and (map is not None or collate is not None):
            raise StokerError("fields= is the declarative fast path; it takes no map= or collate=")
        _check_dataset(dataset)
        self._torch = cuda.require_torch()
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.rank, self.world_size = resolve_rank(rank, world_size)
        self.prefetch = prefetch
        self.shuffle_window = shuffle_window
        self.log_every = log_every
        self.map = map
        self.collate = collate or default_collate
        self.fields = _check_fields_argument(fields)
        # (batch entry, the dataset fields it may come from in order, decoder) per field
        self._field_plan = self._plan_fields() if self.fields is not None else []
        self._reader = shared_reader(num_threads)
        self._num_threads = num_threads or self._reader.num_threads
        self._executor: ThreadPoolExecutor | None = None
        self._executor_pid = 0
        self._epoch = 0
        self._position = 0  # batches of the current epoch already handed out
        # Every batch of the epoch is handed out: the next iterator begins the next epoch,
        # whether or not this one was run to StopIteration (Lightning and zip(range(len(L)),
        # L) stop after len(L) batches without asking for more).
        self._epoch_done = False
        # Where the next iteration starts, when a state was loaded; otherwise every new
        # iterator starts its epoch at the beginning, as a DataLoader's does.
        self._resume_at: int | None = None
        # set_epoch() named the epoch of a loaded state: the next iterator stays in it,
        # even where that epoch is done (it then yields nothing).
        self._epoch_pinned = False
        self._generation = 0  # only the newest iterator moves the position
        self._plans: dict[int, EpochPlan] = {}
        # Set by loading a state saved with another world size: (epoch, what the old ranks
        # had read), so that epoch's rest is shared out over this loader's ranks.
        self._elastic: tuple[int, tuple[int, int, int]] | None = None
        self._stats = _Stats()
        self._check_cache()
        self.pinned_bytes = pinned_bytes or _DEFAULT_PINNED_BYTES
        self._stage = self._device_stage()

    def __getstate__(self) -> dict[str, Any]:
        # What cannot cross a process boundary is rebuilt on the other side.
        state = self.__dict__.copy()
        for name in ("_torch", "_reader", "_executor", "_stage"):
            state[name] = None
        state["_plans"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._torch = cuda.require_torch()
        self._reader = shared_reader(self._num_threads)
        self._stage = self._device_stage()  # a GPU loader in another process starts afresh

    def _device_stage(self) -> cuda.DeviceStage | None:
        """What moves batches to the device (None for the CPU): slots for the reads in
        flight, one being copied and one being filled."""
        if self._device is None:
            return None
        cuda.require_cuda(self._device)
        return cuda.DeviceStage(self._device, self.pinned_bytes, self.prefetch + 2)

    # -- order, epochs, resume ------------------------------------------------

    def _plan(self, epoch: int) -> EpochPlan:
        plan = self._plans.get(epoch)
        if plan is None:
            elastic = self._elastic
            plan = plan_epoch(
                np.diff(self.dataset._shard_start),
                batch_size=self.batch_size,
                shuffle=self.shuffle,
                seed=self.seed,
                epoch=epoch,
                rank=self.rank,
                world_size=self.world_size,
                drop_last=self.drop_last,
                shuffle_window=self.shuffle_window,
                consumed=elastic[1] if elastic is not None and elastic[0] == epoch else None,
            )
            self._plans = {epoch: plan}  # one epoch's order at a time
        return plan

    def __len__(self) -> int:
        """Batches in a whole epoch on this rank (also while resuming mid-epoch)."""
        return _epoch_batches(len(self.dataset), self.world_size, self.drop_last, self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Read epoch `epoch` (its own shuffle) from the next iteration on. Setting the epoch
        a loaded state is in keeps that state's position, so the usual ``set_epoch`` at the
        top of a resumed training loop does not start the epoch over."""
        epoch = int(epoch)
        self._generation += 1  # iterators still alive no longer move the position
        if epoch == self._epoch and self._resume_at is not None:
            self._epoch_pinned = True
            return
        self._start_epoch(epoch)

    @property
    def sampler(self) -> _EpochSetter:
        """What code written for a DataLoader with a DistributedSampler calls each epoch:
        ``loader.sampler.set_epoch(n)`` is ``loader.set_epoch(n)``. Lightning calls it with
        its own epoch number, which keeps the two in step even where it resumes without
        the loader's state (a checkpoint taken at an epoch's end)."""
        return _EpochSetter(self)

    def _start_epoch(self, epoch: int) -> None:
        self._epoch, self._position, self._resume_at = epoch, 0, None
        self._epoch_done = self._epoch_pinned = False
        self._elastic = None
        self._plans = {}

    def state_dict(self) -> dict[str, Any]:
        """Where this rank is: small and JSON-serialisable. A Loader loaded with it yields
        exactly the batches this one would have yielded next."""
        position = self._position
        if self._epoch_done:  # every batch done, however this epoch's rest was shared out
            position = len(self)
        elif self._elastic is not None and self._elastic[0] == self._epoch:
            raise StokerError(
                "this epoch was itself resumed with another world size; save the state "
                "again after it ends"
            )
        return {
            "version": _STATE_VERSION,
            "epoch": self._epoch,
            "batches_done": position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "rank": self.rank,
            "world_size": self.world_size,
            "samples": len(self.dataset),
            "shuffle_window": self.shuffle_window,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise StokerError(f"loader state version {state.get('version')} is not supported")
        # Ranks move in lockstep, so any rank's state serves every rank.
        mine = {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "samples": len(self.dataset),
            "shuffle_window": self.shuffle_window,
        }
        for key, value in mine.items():
            if state[key] != value:
                raise StokerError(
                    f"cannot resume: the state has {key}={state[key]!r} but this loader has "
                    f"{value!r}"
                )
        self._plans = {}
        self._epoch = int(state["epoch"])
        old_world, old_drop_last = int(state["world_size"]), bool(state["drop_last"])
        batches_done = int(state["batches_done"])
        same_split = old_world == self.world_size and old_drop_last == self.drop_last
        # An epoch whose every batch was handed out is over in any split: what its ranks
        # dropped (drop_last) stays dropped, and the next iteration begins the next epoch.
        finished = batches_done >= _epoch_batches(
            len(self.dataset), old_world, old_drop_last, self.batch_size
        )
        self._elastic = None
        if finished:
            self._position = len(self)
        elif same_split or batches_done == 0:  # nothing read: nothing to share out
            self._position = batches_done if same_split else 0
        else:  # elastic: what the old ranks read is known; share out the rest of the epoch
            done = batches_done * self.batch_size
            self._elastic = (self._epoch, (old_world, old_drop_last, done))
            self._position = 0
        self._resume_at = self._position
        self._epoch_done = finished or self._position >= len(self._plan(self._epoch))
        self._epoch_pinned = False
        self._generation += 1

    def stats(self) -> dict[str, float]:
        """Counters since the loader was made; cheap enough to leave on."""
        s = self._stats
        elapsed = time.perf_counter() - s.started if s.started is not None else 0.0
        return {
            "samples": s.samples,
            "batches": s.batches,
            "bytes": s.bytes,
            "elapsed_s": elapsed,
            "wait_s": s.wait_s,
            "read_busy_s": s.read_busy_s,
            "input_bound_fraction": s.wait_s / elapsed if elapsed > 0 else 0.0,
            "samples_per_s": s.samples / elapsed if elapsed > 0 else 0.0,
        }

    # -- remote shards --------------------------------------------------------

    def _check_cache(self) -> None:
        """Refuse, now, a cache too small for what this loader holds at once (the shards of
        the batches being read); it would wait for room that never comes, later."""
        remote = self.dataset._remote
        if remote is None:
            return
        need = self._held_peak(self._plan(self._epoch)) * int(
            os.environ.get("LOCAL_WORLD_SIZE", 1)  # every rank of the node reads its own
        )
        if remote.limit < need:
            raise StokerError(
                f"cache_limit={remote.limit} bytes is too small for this loader: the shards "
                f"it holds at once (a shuffle window of {self.shuffle_window}, batches of "
                f"{self.batch_size}, {self.prefetch} read ahead, "
                f"{os.environ.get('LOCAL_WORLD_SIZE', 1)} process(es) on the node) need "
                f"{need} bytes; raise cache_limit, or lower shuffle_window or prefetch"
            )

    def _held_peak(self, plan: EpochPlan) -> int:
        """The most bytes of remote shards held at once over `plan`: a shard is held from
        when the batch `prefetch` before its first is read until its last is done."""
        remote = self.dataset._remote
        assert remote is not None
        _, first, last = _shard_spans(self.dataset, plan, 0)
        if not first:
            return 0
        delta = np.zeros(len(plan) + 2, np.int64)
        for shard, begin in first.items():
            size = remote.shards[self.dataset._remote_of[shard]].size or 0
            delta[max(begin - self.prefetch, 0)] += size
            delta[last[shard] + 1] -= size
        return int(np.cumsum(delta).max())

    def _log_stats(self) -> None:
        s = self.stats()
        log.info(
            "epoch %d batch %d: %.0f samples/s, %.1f MB/s, waited %.0f%% of the time "
            "(%d samples, %.2f s)",
            self._epoch,
            self._position + 1,
            s["samples_per_s"],
            s["bytes"] / s["elapsed_s"] / 1e6 if s["elapsed_s"] else 0.0,
            100 * s["input_bound_fraction"],
            s["samples"],
            s["elapsed_s"],
        )

    # -- iteration ------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._generation += 1
        generation = self._generation
        if self._epoch_done and not self._epoch_pinned:
            self._start_epoch(self._epoch + 1)
        epoch = self._epoch
        plan = self._plan(epoch)
        if self._stats.started is None:
            self._stats.started = time.perf_counter()
        if self._resume_at is not None:
            self._position = self._resume_at
        elif not self._epoch_done:
            self._position = 0
        self._resume_at = None
        self._epoch_pinned = False
        next_batch = self._position
        in_flight: deque[tuple[Any, Any]] = deque()
        fetch = (
            _ShardPrefetch(self.dataset, plan, next_batch)
            if self.dataset._remote is not None
            else None
        )
        done = next_batch  # batches handed out by this iterator, as plan numbers
        try:
            while True:
                while len(in_flight) < self.prefetch and next_batch < len(plan):
                    if fetch is not None:
                        fetch.pump(next_batch)
                        if not fetch.ready(next_batch):
                            if in_flight:
                                break  # read it ahead once its shards are here
                            start = time.perf_counter()  # nothing else to do: wait
                            fetch.wait(next_batch)
                            self._stats.wait_s += time.perf_counter() - start
                    try:
                        if fetch is not None:
                            fetch.arrive(next_batch)
                        in_flight.append(self._submit(plan.batch(next_batch), not in_flight))
                    except _RingFull:
                        break  # every pinned slot holds a batch read ahead: hand one out
                    except StokerError as error:  # raised when its batch's turn comes
                        in_flight.append((_FailedRead(error), None))
                    next_batch += 1
                if not in_flight:
                    break
                start = time.perf_counter()
                batch = self._finish(*in_flight.popleft())
                self._stats.wait_s += time.perf_counter() - start
                self._stats.batches += 1
                if self.log_every and self._stats.batches % self.log_every == 0:
                    self._log_stats()
                if fetch is not None:
                    fetch.finished(done)
                done += 1
                if generation == self._generation:
                    self._position += 1
                    self._epoch_done = self._position >= len(plan)
                yield batch
        finally:
            for pending, _ in in_flight:  # a loop left early: stop reading ahead
                pending.cancel()
            if fetch is not None:
                fetch.close()
        if generation == self._generation:
            self._epoch_done = True  # (an epoch of no batches ends here)

    def _submit(self, indices: np.ndarray, can_wait: bool = True) -> tuple[Any, Any]:
        """Start reading a batch. A device loader's fields= batch needs a pinned slot: when
        none is free and `can_wait` is false (batches are in flight, whose hand-out frees
        one), this raises _RingFull instead of waiting."""
        if self.fields is not None:
            return self._submit_fields(indices, can_wait)
        ds = self.dataset
        rows, bounds = ds._member_rows(indices)
        return ds._submit_members(rows, reader=self._reader), (indices, rows, bounds)

    def _finish(self, pending: Any, layout: Any) -> dict[str, Any]:
        try:
            buffer = pending.wait()
        except ShardFormatError as error:  # the reader knows files and offsets, not samples
            if layout is None:  # a batch that failed before any read: its error says it all
                raise
            if isinstance(layout, _Layout):
                rows, offsets = layout.rows, layout.offsets
            else:
                rows = layout[1]
                offsets = self.dataset._m_offset[rows]
            raise self._name_member(error, rows, offsets) from error
        self._stats.read_busy_s += pending.busy_seconds()
        self._stats.bytes += int(buffer.nbytes)
        if self.fields is not None:
            batch = self._assemble_fields(buffer, layout)
            self._stats.samples += len(layout.indices)
            return self._stage.to_device(batch, buffer) if self._stage else batch
        indices, rows, bounds = layout
        samples = self.dataset._samples_from(buffer, indices, rows, bounds)
        if self.map is not None:
            samples = self._map_batch(samples)
        self._stats.samples += len(samples)
        batch = self.collate(samples)
        return self._stage.to_device(batch) if self._stage else batch

    def _map_batch(self, samples: list[dict[str, Any]]) -> list[Any]:
        """map= over a batch: one task per thread-sized chunk, not a future per sample
        (a future costs more than a cheap map function), the caller taking a chunk too."""
        fn = self.map
        chunks = min(self._num_threads, len(samples))
        if chunks <= 1:
            return [fn(s) for s in samples]
        if self._executor is None or self._executor_pid != os.getpid():
            # (Again) in a forked child: the parent's executor has no threads here.
            self._executor = ThreadPoolExecutor(self._num_threads - 1, "stoker-map")
            self._executor_pid = os.getpid()
            weakref.finalize(self, self._executor.shutdown, wait=False)
        bounds = np.linspace(0, len(samples), chunks + 1).astype(int).tolist()
        parts = [samples[a:b] for a, b in zip(bounds, bounds[1:])]
        futures = [self._executor.submit(lambda p=p: [fn(s) for s in p]) for p in parts[1:]]
        out = [fn(s) for s in parts[0]]
        for future in futures:
            out.extend(future.result())
        return out

    # -- the fields= fast path ------------------------------------------------

    def _plan_fields(self) -> list[tuple[str, tuple[str, ...], FieldSpec]]:
        """Each fields= entry checked against the dataset: its name in the batch, the
        alternatives it reads (``"jpg;jpeg;png"``: the first a sample has), its decoder."""
        ds = self.dataset
        have = set(ds.fields)
        plan = []
        for key, spec in self.fields.items():
            alternatives = tuple(a.strip() for a in key.split(";"))
            name = alternatives[0]
            if not all(alternatives):
                raise UsageError(
                    f"fields= key {key!r} has an empty name; alternatives are written "
                    "'jpg;jpeg;png'"
                )
            if isinstance(spec, type) and spec in (Raw, Int, Npy, Bytes):
                call = "Raw(shape, dtype)" if spec is Raw else f"{spec.__name__}()"
                raise UsageError(
                    f"fields={{{key!r}: stoker.{spec.__name__}}}: that is the decoder's class; "
                    f"call it: stoker.{call}"
                )
            if not isinstance(spec, (Raw, Int, Npy, Bytes)):
                raise UsageError(
                    f"fields={{{key!r}: {quoted(spec, 80)}}}: the value is not a stoker field "
                    "decoder; use stoker.Raw(shape, dtype), stoker.Int(), stoker.Npy() or "
                    "stoker.Bytes()"
                )
            if any(p[0] == name for p in plan):
                raise UsageError(f"fields= names the batch entry {name!r} twice")
            lookup = tuple(a.lower() for a in alternatives)
            extras = [a for a in lookup if a in ds._extras]
            if extras and len(lookup) > 1:
                raise UsageError(
                    f"fields= key {key!r}: {extras[0]!r} is an integer column of the dataset, "
                    "which every sample has; name it alone"
                )
            if extras and not isinstance(spec, Int):
                raise UsageError(f"field {name!r} is an integer column: use stoker.Int()")
            known = len(ds) and ds._fields_known
            if known and not any(a in have for a in lookup):
                what = (
                    f"field {name!r} is in no sample"
                    if len(lookup) == 1
                    else f"no sample has any of the fields {key!r}"
                )
                raise StokerError(f"{what}; the dataset has {_some(sorted(have))}")
            plan.append((name, lookup, spec))
        return plan

    def _field_rows(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """For each named field read from shards, the member row of every sample: of the
        first of its alternatives the sample has."""
        ds = self.dataset
        out = {}
        for name, alternatives, _ in self._field_plan:
            if alternatives[0] in ds._extras:
                continue
            chosen = ds._field_rows(alternatives[0], indices)
            for alternative in alternatives[1:]:
                lacking = np.flatnonzero(chosen < 0)
                if not len(lacking):
                    break
                chosen[lacking] = ds._field_rows(alternative, indices[lacking])
            if (chosen < 0).any():
                i = int(indices[np.flatnonzero(chosen < 0)[0]])
                which = (
                    f"field {name!r}"
                    if len(alternatives) == 1
                    else f"field of {', '.join(map(repr, alternatives))}"
                )
                raise self._bad_member(
                    int(ds._sample_first[i]), f"sample {quoted(ds.key(i))} (#{i}) has no {which}"
                )
            out[name] = chosen
        return out

    def _name_member(
        self, error: ShardFormatError, rows: np.ndarray, offsets: np.ndarray
    ) -> ShardFormatError:
        """`error` from the reader, said of the field and sample whose bytes it is about."""
        ds = self.dataset
        path, offset = getattr(error, "path", None), getattr(error, "offset", None)
        hits = np.flatnonzero(offsets == np.uint64(offset or 0)) if path is not None else []
        for hit in hits:
            row = int(rows[hit])
            if ds._paths[int(ds._m_file[row])] == path:
                field = ds._field_names[int(ds._m_field[row])]
                key = ds.key(int(ds._m_sample[row]))
                what = str(error).removeprefix(f"{path}: offset {offset}: ")
                return located(
                    ShardFormatError,
                    path,
                    offset,
                    f"field {field!r} of sample {quoted(key)}: {what}",
                )
        return error

    def _bad_member(self, row: int, what: str) -> ShardFormatError:
        ds = self.dataset
        return located(
            ShardFormatError, ds._paths[int(ds._m_file[row])], int(ds._m_offset[row]), what
        )

    def _submit_fields(self, indices: np.ndarray, can_wait: bool = True) -> tuple[Any, _Layout]:
        ds = self.dataset
        n = len(indices)
        layout = _Layout(indices)
        # (member rows, dest offsets, codecs, decoded lengths[, file offsets, file lengths])
        parts: list[tuple[np.ndarray, ...]] = []
        at = 0

        def region(size: int) -> int:
            nonlocal at
            base = at
            at += (size + ALIGN - 1) // ALIGN * ALIGN
            return base

        specs = {name: spec for name, _, spec in self._field_plan}
        for name, member_rows in self._field_rows(indices).items():
            spec = specs[name]
            out = ds._m_out[member_rows]
            if isinstance(spec, Npy) and not ds._m_decoder[member_rows].any():
                # .npy files as members of a tar or zip: each member is split into its
                # header (to a side region, checked against the first) and its data (laid
                # out as one array).
                if ds._m_codec[member_rows].any():
                    raise self._bad_member(
                        int(member_rows[np.flatnonzero(ds._m_codec[member_rows])[0]]),
                        f"field {name!r}: compressed .npy members cannot be viewed in place; "
                        "store them uncompressed, or read them with stoker.Bytes()",
                    )
                header, dtype, shape = self._npy_member_header(name, member_rows)
                size, nbytes = len(header), int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                wrong = np.flatnonzero(out != size + nbytes)
                if len(wrong):
                    raise self._bad_member(
                        int(member_rows[wrong[0]]),
                        f"field {name!r} of sample {quoted(ds.key(int(indices[wrong[0]])))} does "
                        f"not hold a {shape} {dtype} array like the batch's first sample",
                    )
                steps = np.arange(n, dtype=np.uint64)
                starts = ds._m_offset[member_rows]
                stored = np.zeros(n, np.uint8)
                header_base, base = region(n * size), region(n * nbytes)
                for dest, file_offsets, length in (
                    (header_base + steps * np.uint64(size), starts, size),
                    (base + steps * np.uint64(nbytes), starts + np.uint64(size), nbytes),
                ):
                    lengths = np.full(n, length, np.uint64)
                    parts.append((member_rows, dest, stored, lengths, file_offsets, lengths))
                layout.fixed.append((name, base, dtype, shape))
                layout.headers.append((name, header_base, header, member_rows))
            elif isinstance(spec, (Raw, Npy)):
                if isinstance(spec, Raw):
                    dtype, shape, nbytes = np.dtype(spec.dtype), spec.shape, spec.nbytes
                else:
                    dtype, shape = self._npy_layout(name, member_rows)
                    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                wrong = np.flatnonzero(out != nbytes)
                if len(wrong):
                    row = int(member_rows[wrong[0]])
                    raise self._bad_member(
                        row,
                        f"field {name!r} of sample {quoted(ds.key(int(indices[wrong[0]])))} is "
                        f"{int(out[wrong[0]])} bytes, not the {nbytes} of {shape} {dtype}",
                    )
                base = region(n * nbytes)
                offsets = base + np.arange(n, dtype=np.uint64) * np.uint64(nbytes)
                parts.append((member_rows, offsets, ds._m_codec[member_rows], out))
                layout.fixed.append((name, base, dtype, shape))
            elif isinstance(spec, Int) and not ds._m_codec[member_rows].any():
                # Parsed by the reader threads, straight into an int64 column.
                base = region(n * 8)
                offsets = base + np.arange(n, dtype=np.uint64) * np.uint64(8)
                codecs = np.full(n, _CODEC_ASCII_INT, np.uint8)
                parts.append((member_rows, offsets, codecs, np.full(n, 8, np.uint64)))
                layout.fixed.append((name, base, np.dtype(np.int64), ()))
            elif isinstance(spec, Int):
                too_long = np.flatnonzero(out > _INT_WIDTH)
                if len(too_long):
                    raise self._bad_member(
                        int(member_rows[too_long[0]]),
                        f"field {name!r} is {int(out[too_long[0]])} bytes: too long for an integer",
                    )
                # Compressed members (a deflated zip): inflated by the reader, parsed here
                # into their own region of the buffer.
                base = region(n * _INT_WIDTH)
                offsets = base + np.arange(n, dtype=np.uint64) * np.uint64(_INT_WIDTH)
                parts.append((member_rows, offsets, ds._m_codec[member_rows], out))
                layout.ints.append((name, base, out.astype(np.int64), member_rows, region(n * 8)))
            else:  # Bytes
                starts, size = aligned_offsets(out)
                base = region(size)
                parts.append((member_rows, np.uint64(base) + starts, ds._m_codec[member_rows], out))
                layout.blobs.append((name, base + starts.astype(np.int64), out.astype(np.int64)))
        # Integer columns of the dataset are written into the buffer too: a batch for a
        # device then goes over in one copy of one buffer.
        layout.extras = [
            (name, alternatives[0], region(n * 8))
            for name, alternatives, _ in self._field_plan
            if alternatives[0] in ds._extras
        ]
        layout.nbytes = at
        # Pieces read as whole members take their file range from the index.
        parts = [p if len(p) == 6 else (*p, ds._m_offset[p[0]], ds._m_length[p[0]]) for p in parts]
        kinds = (np.int64, np.uint64, np.uint8, np.uint64, np.uint64, np.uint64)
        rows, dest, codecs, lengths, offsets, sizes = (
            [np.concatenate([p[k] for p in parts]).astype(t) for k, t in enumerate(kinds)]
            if parts
            else [np.zeros(0, t) for t in kinds]
        )
        layout.rows, layout.offsets = rows, offsets
        slot = None
        if self._stage is not None:
            # Read straight into a pinned slot: the batch then goes over in one copy.
            slot = self._stage.acquire(at, wait=can_wait)
            if slot is None:
                raise _RingFull
        pending = ds._submit_members(
            rows,
            dest=dest,
            size=at,
            codecs=codecs,
            out=lengths,
            offsets=offsets,
            lengths=sizes,
            reader=self._reader,
            into=slot,
        )
        return pending, layout

    def _npy_layout(self, name: str, member_rows: np.ndarray) -> tuple[np.dtype, tuple[int, ...]]:
        ds = self.dataset
        decoders = np.unique(ds._m_decoder[member_rows])
        if len(decoders) != 1 or ds._decoders[int(decoders[0])] is None:
            raise self._bad_member(
                int(member_rows[0]),
                f"field {name!r}: stoker.Npy() reads rows of .npy shards or .npy members, "
                "and every sample of a batch must share one dtype and shape",
            )
        return ds._decoders[int(decoders[0])]

    def _npy_member_header(
        self, name: str, member_rows: np.ndarray
    ) -> tuple[bytes, np.dtype, tuple[int, ...]]:
        """The first member's .npy header: its bytes (the batch's others must match them),
        dtype and shape. One small read per batch and field."""
        ds = self.dataset
        row = int(member_rows[0])
        path, offset = ds._paths[int(ds._m_file[row])], int(ds._m_offset[row])
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                head = f.read(min(int(ds._m_out[row]), 1 << 17))
        except OSError as e:
            raise located(ReadError, path, offset, f"cannot read a .npy header: {e}") from e
        try:
            stream = io.BytesIO(head)
            dtype, shape, fortran = read_npy_header(stream)
        except (ValueError, OSError) as e:
            raise self._bad_member(row, f"field {name!r} is not a .npy file: {e}") from e
        long_axes = sum(d > 1 for d in shape)
        if dtype.hasobject or (fortran and long_axes > 1):
            raise self._bad_member(
                row,
                f"field {name!r}: a .npy of {dtype} (fortran_order={fortran}) cannot be "
                "viewed in place",
            )
        return head[: stream.tell()], dtype, tuple(shape)

    def _assemble_fields(self, buffer: np.ndarray, layout: _Layout) -> dict[str, Any]:
        torch = self._torch
        ds = self.dataset
        n = len(layout.indices)
        batch: dict[str, Any] = {}
        for name, base, header, member_rows in layout.headers:
            seen = buffer[base : base + n * len(header)].reshape(n, len(header))
            differs = np.flatnonzero((seen != np.frombuffer(header, np.uint8)).any(axis=1))
            if len(differs):
                raise self._bad_member(
                    int(member_rows[differs[0]]),
                    f"field {name!r}: this .npy's dtype or shape differs from the batch's "
                    "first sample's",
                )
        for name, base, dtype, shape in layout.fixed:
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            view = buffer[base : base + n * nbytes].view(dtype).reshape((n, *shape))
            try:
                batch[name] = torch.from_numpy(view)
            except TypeError as e:  # a dtype torch has no tensor for (big-endian, strings)
                raise StokerError(
                    f"field {name!r}: torch has no tensor type for {dtype} ({e}); read it "
                    "with stoker.Bytes() and convert it in your own code"
                ) from e
        for name, base, lengths, member_rows, value_base in layout.ints:
            text = buffer[base : base + n * _INT_WIDTH].reshape(n, _INT_WIDTH)
            values, bad = parse_ascii_ints(text, lengths)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                shown = quoted(bytes(text[i, : lengths[i]]))
                key = quoted(ds.key(int(layout.indices[i])))
                raise self._bad_member(
                    int(member_rows[i]),
                    f"field {name!r} of sample {key}: not an integer: {shown}",
                )
            column = buffer[value_base : value_base + n * 8].view(np.int64)
            column[:] = values
            batch[name] = torch.from_numpy(column)
        for name, starts, lengths in layout.blobs:
            views = (buffer[s : s + ln] for s, ln in zip(starts.tolist(), lengths.tolist()))
            # On a device loader the buffer is a pinned slot the ring needs back soon.
            batch[name] = [v.copy() for v in views] if self._stage else list(views)
        for name, extra, value_base in layout.extras:
            column = buffer[value_base : value_base + n * 8].view(np.int64)
            column[:] = ds._extras[extra][layout.indices]
            batch[name] = torch.from_numpy(column)
        batch["__key__"] = ds.keys(layout.indices)
        return batch


def parse_ascii_ints(text: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Integers from rows of ASCII text (row i is ``text[i, :lengths[i]]``), vectorised.
    Whitespace around the number is allowed; returns (values, bad) with bad[i] where row i
    is not an optional sign followed by 1 to 18 digits (the C++ codec's rule)."""
    n, width = text.shape
    pos = np.arange(width)
    valid = pos[None, :] < lengths[:, None]
    c = np.where(valid, text, ord(" ")).astype(np.int64)
    space = (c == 32) | (c == 9) | (c == 10) | (c == 13)
    digit = (c >= 48) & (c <= 57)
    solid = ~space
    has_text = solid.any(axis=1)
    first = np.argmax(solid, axis=1)
    last = width - 1 - np.argmax(solid[:, ::-1], axis=1)
    inside = (pos[None, :] >= first[:, None]) & (pos[None, :] <= last[:, None])
    lead = c[np.arange(n), first]
    signed = (lead == 45) | (lead == 43)
    sign_at = signed[:, None] & (pos[None, :] == first[:, None])
    bad = ~has_text | (inside & ~digit & ~sign_at).any(axis=1)
    ndigits = last - first + 1 - signed
    bad |= (ndigits < 1) | (ndigits > 18)
    power = np.clip(last[:, None] - pos[None, :], 0, 18)
    weights = np.where(inside & digit, 10**power, 0)
    values = ((c - 48) * weights).sum(axis=1)
    values = np.where(lead == 45, -values, values)
    return np.where(bad, 0, values).astype(np.int64), bad


def default_collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack what stacks: equal-shape arrays into one tensor (raw bytes, 1-D uint8, excepted),
    numbers into a tensor, the rest (and ``__key__``) into lists."""
    import torch

    if not samples:
        return {}
    if not isinstance(samples[0], Mapping):
        return samples  # map= returned something else: the user's to collate
    keys = list(dict.fromkeys(k for s in samples for k in s))
    out: dict[str, Any] = {}
    for key in keys:
        missing = [i for i, s in enumerate(samples) if key not in s]
        if missing:
            raise StokerError(
                f"collate: {len(missing)} sample(s) of the batch lack {key!r} "
                f"(first: #{missing[0]}); give map= a value for every key, or your own collate="
            )
        values = [s[key] for s in samples]
        first = values[0]
        if key == "__key__":
            out[key] = values
        elif isinstance(first, np.ndarray) and first.dtype == np.uint8 and first.ndim == 1:
            # A member's raw bytes: kept as a list, whatever their lengths happen to be.
            out[key] = values
        elif isinstance(first, torch.Tensor) and all(
            isinstance(v, torch.Tensor) and v.shape == first.shape for v in values
        ):
            out[key] = torch.stack(values)
        elif isinstance(first, np.ndarray) and all(
            isinstance(v, np.ndarray) and v.shape == first.shape and v.dtype == first.dtype
            for v in values
        ):
            out[key] = torch.from_numpy(np.stack(values))
        elif all(isinstance(v, (int, float, np.integer, np.floating)) for v in values):
            out[key] = torch.as_tensor(values)
        else:
            out[key] = values
    return out
