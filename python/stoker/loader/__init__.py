"""The Loader: ``for batch in stoker.Loader(ds, batch_size=64): ...``.

One batch goes through the modules of this package once, in one direction: the epoch
cursor (:mod:`.epochs`) says which batch comes next and the sampler (:mod:`.sampler`)
which samples it holds; remote shards are held for it (:mod:`.prefetch`); it is laid out
by the fields= plan (:mod:`.plan`, in C++) or read as whole samples, and read by the C++
reader (:mod:`.batches`); ``map=`` and ``collate=`` (:mod:`.collate`) or tensor views
make it a batch, which the device stage (:mod:`stoker.cuda`) moves to the GPU; it is
handed out, and its shards let go of after the last batch that reads them.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

import stoker.cuda as cuda
from stoker._process import shared_reader
from stoker.dataset import Dataset
from stoker.dataset.mix import Mix
from stoker.errors import StokerError, UsageError
from stoker.fields import FieldSpec
from stoker.loader.batches import BatchReader, FailedRead, InFlight, RingFull, Stats
from stoker.loader.collate import MapRunner, default_collate
from stoker.loader.epochs import EpochCursor, Order
from stoker.loader.mixing import MixSpec
from stoker.loader.plan import FieldsPlan, check_fields_argument
from stoker.loader.prefetch import ShardPrefetch, check_cache_room
from stoker.loader.sampler import (
    DEFAULT_SHUFFLE_WINDOW,
    augment_seed,
    group_readers,
)

log = logging.getLogger("stoker.loader")

__all__ = ["Loader", "default_collate", "resolve_rank"]

_DEFAULT_PINNED_BYTES = 1 << 30  # page-locked host memory a GPU loader may hold


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """rank and world size: as given, else torch.distributed's when it is initialised,
    else the RANK / WORLD_SIZE environment, else 0 and 1."""
    found: tuple[int, int] | None
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
        raise UsageError(f"rank {found[0]} is not in [0, world_size={found[1]})")
    return found


def _check_arguments(
    dataset: Any,
    batch_size: int,
    prefetch: int,
    pinned_bytes: int | None,
    fields: Mapping[str, FieldSpec] | None,
    map_fn: Callable[[dict[str, Any]], Any] | None,
    collate: Callable[[list[Any]], Any] | None,
    seed: int,
) -> None:
    """Refuse what a Loader cannot be made of, before anything is made."""
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise UsageError(f"seed must be an integer of 0 or more, not {seed!r}")
    if batch_size < 1:
        raise UsageError(f"batch_size must be at least 1, not {batch_size}")
    if prefetch < 1:
        raise UsageError(f"prefetch must be at least 1, not {prefetch}")
    if pinned_bytes is not None and pinned_bytes < 1:
        raise UsageError(f"pinned_bytes must be positive, not {pinned_bytes}")
    if fields is not None and (map_fn is not None or collate is not None):
        raise StokerError("fields= is the declarative fast path; it takes no map= or collate=")
    if not isinstance(dataset, Dataset):
        raise UsageError(
            f"stoker.Loader reads a stoker.Dataset, not a {type(dataset).__name__}: open "
            "your data with stoker.Dataset(shards or folder), Dataset.from_csv(csv, folder) "
            "or Dataset.from_files(folder, names); a map-style torch dataset of your own "
            "goes to torch.utils.data.DataLoader"
        )


def _describe_own_shards(
    dataset: Dataset, shuffle: bool, seed: int, rank: int, world_size: int, drop_last: bool
) -> None:
    """Remote shards no rank has described yet: each rank describes those it will likely
    read first, and the ranks swap counts (see stoker.dataset.shared)."""
    weights = dataset.shard_weights()
    if weights is None:
        return
    readers = group_readers(
        weights, shuffle=shuffle, seed=seed, epoch=0, world_size=world_size, drop_last=drop_last
    )
    dataset.describe_shared(np.flatnonzero(readers == rank))


def _shards_in_use(
    groups: np.ndarray, mix: MixSpec | None, window: int, prefetch: int, batch_size: int
) -> int:
    """The shards a loader uses at once: a window of them per source, and what the batches
    being read span; their member indexes are kept while in use, not longer."""
    typical = int(np.median(groups[groups > 0])) if (groups > 0).any() else 1
    sources = len(mix.groups) if mix is not None else 1
    return (window + 1) * sources + (prefetch + 2) * -(-batch_size // typical)


class _EpochSetter:
    """A Loader's ``sampler``: only ``set_epoch``, for frameworks that drive samplers."""

    def __init__(self, loader: Loader) -> None:
        self.set_epoch = loader.set_epoch


class Loader:
    """Batches of `dataset` for this rank, in an order that depends only on the seed, the
    epoch and the ranks: ``for batch in stoker.Loader(ds, 64, fields=...): ...``.

    Each batch is a dict of field name to value, plus ``"__key__"`` (the samples' keys).
    With `fields`, each named field of a whole batch is read with one call into one
    buffer, and the batch's tensors view that buffer; without it, each sample dict goes
    through `map` on a thread pool and then `collate`. The epoch is shuffled at two
    levels (the shards' order, then samples within a window of `shuffle_window`
    shards), and each rank reads its own contiguous stretch of it. ``len(loader)`` is
    the batches of a whole epoch on this rank. Once every batch of an epoch has been
    handed out, the next ``iter(loader)`` begins the next epoch; ``state_dict()`` and
    ``load_state_dict()`` resume exactly, also under another world size.

    Args:
        dataset: A `stoker.Dataset` (or `stoker.Mix`); any other dataset is a
            UsageError (torch's DataLoader takes those).
        batch_size: Samples per batch, at least 1.
        shuffle: Shuffle each epoch. False reads the samples in their natural order.
        seed: The shuffle's seed, and that of `Image` crops and flips, with the epoch: an
            integer of 0 or more.
        drop_last: Drop the last partial batch, and make the ranks' samples disjoint (at
            most ``world_size - 1`` samples are dropped). Without it every sample is read
            and the last ranks wrap around to the start of the epoch.
        rank: This process's rank. None takes torch.distributed's when it is initialised,
            else the ``RANK`` environment variable, else 0.
        world_size: How many ranks share the epoch. None takes torch.distributed's when
            it is initialised, else ``WORLD_SIZE``, else 1.
        map: Without `fields`: called on each sample dict (as ``ds[i]`` gives it), on a
            thread pool of `num_threads` threads. Cannot be given with `fields`.
        collate: Without `fields`: makes a batch of the list of mapped samples. The
            default stacks equal-shape arrays and numbers into tensors and keeps raw
            bytes (1-D uint8 arrays), keys and anything else as lists; a key some samples
            lack is an error. Cannot be given with `fields`.
        device: ``"cpu"``, ``"cuda"`` (the current device) or ``"cuda:N"``: where the
            batches' tensors are handed out. On a device each batch is read into a
            page-locked slot and copied in one asynchronous copy; keys and `Bytes` lists
            stay on the host.
        fields: The fast path: a mapping of field name to field decoder (`Raw`, `Int`,
            `Npy`, `Row`, `Bytes`, `Image`). A name may list alternatives, ``"jpg;png"``:
            each sample's first that it has is read, and the batch entry is named by the
            first. Fields not named are not read.
        num_threads: Reader threads, shared by every Loader and Dataset of the process
            that asks for the same number, and the threads `map` runs on. None: one fewer
            than the cores this process may run on, at least one.
        prefetch: Batches read ahead of the one handed out, at least 1. A GPU loader
            keeps ``prefetch + 2`` page-locked slots at most.
        shuffle_window: How many consecutive shards (or, for an array source, groups of
            chunks) a rank's samples are drawn from at a time, 8 by default. Wider mixes better;
            narrower keeps fewer shards open, or cached for remote data.
        log_every: Log `stats` every this many batches, at INFO on the ``stoker.loader``
            logger. None: never.
        pinned_bytes: For a device loader, the most page-locked host memory its slots
            may take (default 1 GiB).

    Raises:
        UsageError: `dataset` is not a stoker Dataset, or `fields` is not a mapping of
            names to field decoders.
        StokerError: `fields` was given with `map` or `collate`; a rank outside
            ``[0, world_size)``; for a remote dataset, a cache too small for the shards
            this Loader holds at once.
        CudaError: `device` names a GPU that cannot be used in this process.
    """

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
        _check_arguments(dataset, batch_size, prefetch, pinned_bytes, fields, map, collate, seed)
        self._device = cuda.device_index(device)
        self._torch = cuda.require_torch()
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.rank, self.world_size = resolve_rank(rank, world_size)
        self.prefetch = prefetch
        self.shuffle_window = shuffle_window
        self.log_every = log_every
        self.map = map
        self.collate = collate or default_collate
        self.fields = check_fields_argument(fields)
        self._reader_threads = num_threads  # None: the process's default reader
        self.num_threads = shared_reader(num_threads).num_threads
        self.pinned_bytes = pinned_bytes or _DEFAULT_PINNED_BYTES
        _describe_own_shards(dataset, shuffle, seed, self.rank, self.world_size, drop_last)
        mix = None
        if isinstance(dataset, Mix):
            mix = MixSpec(dataset.group_counts(), tuple(dataset.weights), dataset.epoch_samples)
        groups = dataset.group_sizes()
        self._cursor = EpochCursor(
            Order(
                groups,
                batch_size,
                shuffle,
                seed,
                drop_last,
                self.rank,
                self.world_size,
                shuffle_window,
                mix,
            )
        )
        dataset.reserve_index(_shards_in_use(groups, mix, shuffle_window, prefetch, batch_size))
        self._stats = Stats()
        if mix is not None:
            self._stats.per_source = np.zeros(len(mix.groups), np.int64)
        self._map_runner = MapRunner(map, self.num_threads) if map is not None else None
        self._build()
        self._check_cache()

    def _build(self) -> None:
        """What does not cross a process boundary: made here, and again when unpickled."""
        self._fields_plan = FieldsPlan(self.dataset, self.fields) if self.fields else None
        stage = None
        if self._device is not None:
            # Slots for the reads in flight, one being copied and one being filled.
            cuda.require_cuda(self._device)
            stage = cuda.DeviceStage(self._device, self.pinned_bytes, self.prefetch + 2)
        self._batches = BatchReader(
            self.dataset,
            self._fields_plan,
            self._map_runner,
            self.collate,
            shared_reader(self._reader_threads),
            stage,
            self._stats,
            self._torch,
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("_torch", "_fields_plan", "_batches"):
            state[name] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._torch = cuda.require_torch()
        self._build()  # a GPU loader in another process starts afresh

    # -- order, epochs, resume --------------------------------------------------------

    def __len__(self) -> int:
        """Batches in a whole epoch on this rank (also while resuming mid-epoch).

        Returns:
            The same number on every rank.
        """
        return len(self._cursor)

    def set_epoch(self, epoch: int) -> None:
        """Read epoch `epoch` (its own shuffle) from the next iteration on. Setting the epoch
        a loaded state is in keeps that state's position, so the usual ``set_epoch`` at the
        top of a resumed training loop does not start the epoch over.

        Args:
            epoch: The epoch number, from 0. Without calls to it the loader moves to the
                next epoch by itself once an epoch's batches have all been handed out.
        """
        self._cursor.set_epoch(epoch)

    @property
    def sampler(self) -> _EpochSetter:
        """What code written for a DataLoader with a DistributedSampler calls each epoch:
        ``loader.sampler.set_epoch(n)`` is ``loader.set_epoch(n)``. Lightning calls it with
        its own epoch number, which keeps the two in step even where it resumes without
        the loader's state (a checkpoint taken at an epoch's end)."""
        return _EpochSetter(self)

    def state_dict(self) -> dict[str, Any]:
        """Where this rank is: small and JSON-serialisable. A Loader loaded with it yields
        exactly the batches this one would have yielded next.

        Returns:
            The epoch, the batches done in it and what the order depends on (seed,
            shuffle, batch size, ranks, dataset size, shuffle window). Ranks move in
            lockstep, so any rank's state serves every rank.

        Raises:
            StokerError: In the middle of an epoch that was itself resumed under another
                world size: save again once it ends.
        """
        return self._cursor.state_dict(len(self.dataset))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from `state`: the next iteration yields the batches the loader that saved
        it would have yielded next.

        Args:
            state: What `state_dict` returned, here or in an earlier run. A state saved
                under another `world_size` or `drop_last` is shared out over this
                loader's ranks (elastic resume); one saved under another `batch_size`,
                seed, `shuffle`, `shuffle_window` or dataset size is refused.

        Raises:
            StokerError: The state cannot be resumed by this loader; the message says why.
        """
        self._cursor.load_state_dict(state, len(self.dataset))

    def stats(self) -> dict[str, Any]:
        """Counters since the loader was made; cheap enough to leave on.

        Returns:
            ``samples``, ``batches``, ``bytes``, ``elapsed_s``, ``wait_s`` (time the
            consumer waited for a batch), ``read_busy_s`` (reader thread time),
            ``images_blanked`` (images served as zeros by ``on_error="blank"``),
            ``input_bound_fraction`` (``wait_s`` over ``elapsed_s``) and
            ``samples_per_s``; for a Mix also ``per_source``, the samples handed out
            from each source.
        """
        return self._stats.summary()

    def _check_cache(self) -> None:
        holds = self.dataset.holds
        if holds is not None:
            check_cache_room(
                self.dataset,
                holds,
                self._cursor.plan(self._cursor.epoch),
                self.prefetch,
                f"a shuffle window of {self.shuffle_window}, batches of {self.batch_size}, "
                f"{self.prefetch} read ahead",
            )

    def _log_stats(self) -> None:
        s = self.stats()
        log.info(
            "epoch %d batch %d: %.0f samples/s, %.1f MB/s, waited %.0f%% of the time "
            "(%d samples, %.2f s)",
            self._cursor.epoch,
            self._cursor.position + 1,
            s["samples_per_s"],
            s["bytes"] / s["elapsed_s"] / 1e6 if s["elapsed_s"] else 0.0,
            100 * s["input_bound_fraction"],
            s["samples"],
            s["elapsed_s"],
        )

    # -- iteration --------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """The batches of this rank, from where the loader stands: the start of a new
        epoch, or a loaded state's position. Leaving the loop early cancels the reads in
        flight, and the next ``iter()`` starts that epoch over (unless a state was loaded
        meanwhile).

        Yields:
            One dict per batch. A batch whose data is bad raises its StokerError here, at
            its turn.
        """
        cursor, stats, batches = self._cursor, self._stats, self._batches
        generation, plan, next_batch = cursor.begin()
        batches_in_plan = len(plan)
        if stats.started is None:
            stats.started = time.perf_counter()
        in_flight: deque[InFlight] = deque()
        holds = self.dataset.holds
        fetch = None
        if holds:
            columns = self._fields_plan.columns if self._fields_plan else None
            fetch = ShardPrefetch(self.dataset, holds, plan, next_batch, columns)
        done = next_batch  # batches handed out by this iterator, as plan numbers
        augment = augment_seed(self.seed, cursor.epoch)
        try:
            while True:
                while len(in_flight) < self.prefetch and next_batch < batches_in_plan:
                    if fetch is not None:
                        fetch.pump(next_batch)
                        if not fetch.ready(next_batch):
                            if in_flight:
                                break  # read it ahead once its shards are here
                            start = time.perf_counter()  # nothing else to do: wait
                            fetch.wait(next_batch)
                            stats.wait_s += time.perf_counter() - start
                    try:
                        if fetch is not None:
                            fetch.arrive(next_batch)
                        item = batches.submit(plan.batch(next_batch), not in_flight, augment)
                        in_flight.append(item)
                    except RingFull:
                        break  # every pinned slot holds a batch read ahead: hand one out
                    except StokerError as error:  # raised when its batch's turn comes
                        in_flight.append(InFlight(FailedRead(error)))
                    next_batch += 1
                if not in_flight:
                    break
                start = time.perf_counter()
                batch = batches.finish(in_flight.popleft())
                stats.wait_s += time.perf_counter() - start
                stats.batches += 1
                if self.log_every and stats.batches % self.log_every == 0:
                    self._log_stats()
                if fetch is not None:
                    fetch.finished(done)
                done += 1
                cursor.handed_out(generation, batches_in_plan)
                yield batch
        finally:
            for item in in_flight:  # a loop left early: stop reading ahead
                item.pending.cancel()
            if fetch is not None:
                fetch.close()
        cursor.ended(generation)
