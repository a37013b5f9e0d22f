"""The order samples are read in: a pure function of the seed, the epoch, the rank, the
world size, the group sizes, the shuffle window and drop_last, never of timing or threads.

Samples come in groups: a shard, or a run of whole chunks of an array source. The order is
shuffled at two levels so that data can stream group by group (order version 3):

- **The line.** The epoch's groups are put in a random order (natural order without
  shuffle), and their samples laid out one group after another, each group's in its own
  order.
- **The ranks' stretches.** Rank r takes its own contiguous stretch of the line, the same
  number of samples on every rank, so it touches about 1/world_size of the groups. With
  ``drop_last`` the stretches are disjoint and at most world_size - 1 samples at the end of
  the line are left out; without it the last ranks wrap around to the start of the line
  (padding), so that every sample is read.
- **The window.** Without shuffle a rank reads its stretch as it lies. With it the stretch is
  cut into segments, each the part of one group that lies in the stretch, and the segments'
  samples are dealt into buckets: every sample of segment j goes to one of the ``w``
  buckets j, j+1, ..., j+w-1 (w is ``shuffle_window``), each equally likely, and every
  bucket is shuffled. The rank reads the buckets one after another.

What this guarantees:

- Each sample of a rank's stretch is read exactly once in the epoch.
- At any point of the order the samples come from at most w consecutive segments, so
  about w groups are open (or, for remote data, cached) at once; a segment is started in
  bucket j at the earliest and finished by bucket j+w-1.
- The mixing is that of giving each sample a key uniform in [j, j+w) and sorting by key,
  per rank: a sample's bucket is uniform over its w buckets, and within a bucket the order
  is uniformly random.
- A segment of more than ``LAZY_SEGMENT`` (4M) samples, and a bucket holding a piece of
  one, is permuted by a keyed pseudo-random permutation (a Feistel network) worked out at
  the positions a batch reads, rather than by a permutation made whole: a file of a
  billion rows read in place is one group, a rank's segment of it 125M samples in a world
  of 8. (Version 2 made those whole; smaller segments are permuted as they were.)
- Nothing is made before it is needed. A plan holds a few numbers per group; a batch is
  built from the one or two buckets it overlaps, each from at most w segments, so the first
  batch costs the same for a thousand samples or a billion, and batch k comes without
  making the batches before it (an exact resume starts there at once). Reading batch by
  batch, each segment is shuffled once and each bucket built once; memory stays about w
  groups' worth (nothing of a segment permuted lazily).

**A Mix** draws an epoch of ``epoch_samples`` from its sources, exactly ``counts()[s]`` of
source s. Each source is read as an endless stream of passes, pass p that source's own
order (as above, as one rank) for epoch p, so a source keeps its group-by-group locality:
weighted past its size it is resampled, each pass without repeats; weighted below it, the
next epoch goes on where the last one stopped. The streams are interleaved by key: source
s's k-th sample of the epoch has the key (k + 1/2) * epoch_samples / counts[s], so that it
falls about that far into the epoch. The keys are cut into blocks 65536 wide, and a block
holds the samples whose keys fall in it, in random order (in key order without shuffle):
every 65536 samples of the epoch hold each source's share of them, give or take one. The
Mix's epoch is then split over the ranks as the line above.

**Elastic resume**: the rest of an epoch begun with another world size is every old rank's
unread part of its own order, old rank after old rank (then, if the old ranks dropped the
end of the line, that end), split over the new ranks in that order. Nothing is read twice
(padding aside) and nothing is lost.

The orders themselves are made lazily by :mod:`.sample_orders` (a line of groups, the
ranks' stretches, the window) and :mod:`.mixing` (a Mix's interleaving); this module
splits an epoch over the ranks, resumes one begun with another world size, and cuts a
rank's order into batches. Nothing here reads data; everything is numpy.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from stoker.errors import UsageError
from stoker.loader.mixing import MixLine, MixSpec, source_seed
from stoker.loader.sample_orders import (
    EMPTY,
    GroupLine,
    RecentCache,
    SampleSeq,
    ShuffledStretch,
    Stretch,
    concat,
    first_and_last,
    group_line,
    read_order,
)

#: Default number of groups whose samples are mixed together. More mixes better and holds
#: more groups open (or cached, for remote data) at once.
DEFAULT_SHUFFLE_WINDOW = 8

#: Key units in a block of a Mix's interleaving: a block's labels are made at once.
MIX_BLOCK = 65536

# Samples mapped at a time when group_spans walks a plan's batches.
_WALK = 1 << 18

# The names these had here before they moved out, still imported from here.
_Shuffled = ShuffledStretch
_source_seed = source_seed


def augment_seed(seed: int, epoch: int) -> int:
    """The seed of an epoch's random image crops: with each sample's index, it decides every
    crop and flip, whichever thread decodes the sample and whenever."""
    state = np.random.SeedSequence([seed, epoch, 2]).generate_state(1, np.uint64)
    return int(state[0])


def batch_count(samples: int, batch_size: int, drop_last: bool) -> int:
    """Batches `samples` make: a partial last one counts unless drop_last."""
    full, rest = divmod(samples, batch_size)
    return full + (1 if rest and not drop_last else 0)


def rank_stretch(total: int, rank: int, world_size: int, drop_last: bool) -> tuple[int, int]:
    """[begin, end) of this rank's stretch of an epoch of `total` samples; `end` may pass
    `total` (without drop_last the last ranks wrap around to the start)."""
    if not 0 <= rank < world_size:
        raise UsageError(f"rank {rank} is not in [0, {world_size})")
    per_rank = total // world_size if drop_last else -(-total // world_size)
    return rank * per_rank, (rank + 1) * per_rank


class _Epoch:
    """One epoch of a dataset (or of one Mix source, as its own samples from `offset` on),
    before it is split over ranks: its line, and any rank's order of any world size."""

    def __init__(
        self,
        sizes: np.ndarray,
        *,
        shuffle: bool,
        seed: int,
        epoch: int,
        window: int,
        mix: MixSpec | None = None,
        offset: int = 0,
    ) -> None:
        self.shuffle, self.seed, self.epoch, self.window = shuffle, seed, epoch, window
        self.mix = mix
        if mix is not None:
            # (MIX_BLOCK is read when the epoch is made: tests narrow it.)
            self.line: SampleSeq = MixLine(
                sizes, mix, shuffle=shuffle, seed=seed, epoch=epoch, window=window, block=MIX_BLOCK
            )
        else:
            self.line = group_line(sizes, shuffle=shuffle, seed=seed, epoch=epoch, offset=offset)

    def rank_order(self, world: int, drop_last: bool, rank: int) -> SampleSeq:
        begin, end = rank_stretch(self.line.length, rank, world, drop_last)
        if self.mix is not None:
            return Stretch(self.line, begin, end - begin)
        assert isinstance(self.line, GroupLine)
        streams = (self.seed, self.epoch, rank, world)
        return read_order(
            self.line, begin, end - begin, shuffle=self.shuffle, window=self.window, streams=streams
        )

    def remainder(self, old_world: int, old_drop_last: bool, done: int) -> _Concat:
        """What ranks of `old_world` had not read after `done` samples each."""
        total = self.line.length
        _, per_rank = rank_stretch(total, 0, old_world, old_drop_last)
        done = min(max(int(done), 0), per_rank)
        parts: list[tuple[int | None, int, int]] = []
        if done < per_rank:
            parts = [(r, done, per_rank) for r in range(old_world)]
        if old_drop_last and old_world * per_rank < total:  # the end no old rank had
            parts.append((None, old_world * per_rank, total))
        return _Concat(self, old_world, old_drop_last, parts)


class _Concat:
    """Pieces [start, stop) of old ranks' orders (rank None: of the line), one after
    another; an old rank's order is made only when a piece of it is taken."""

    def __init__(
        self,
        epoch: _Epoch,
        world: int,
        drop_last: bool,
        parts: list[tuple[int | None, int, int]],
    ) -> None:
        self.epoch, self.world, self.drop_last, self.parts = epoch, world, drop_last, parts
        self.bounds = np.zeros(len(parts) + 1, np.int64)
        np.cumsum([stop - start for _, start, stop in parts], out=self.bounds[1:])
        self.length = int(self.bounds[-1])
        self._orders = RecentCache(2)

    def _order(self, rank: int | None) -> SampleSeq:
        if rank is None:
            return self.epoch.line
        return self.epoch.rank_order(self.world, self.drop_last, rank)

    def take(self, start: int, count: int) -> np.ndarray:
        stop, b = start + count, self.bounds
        first = int(np.searchsorted(b, start, side="right")) - 1
        last = int(np.searchsorted(b, stop - 1, side="right")) - 1
        out = []
        for p in range(first, last + 1):
            rank, begin, _ = self.parts[p]
            lo, hi = max(start, b[p]) - b[p], min(stop, b[p + 1]) - b[p]
            if hi > lo:
                out.append(self._orders.get(rank, self._order).take(begin + lo, hi - lo))
        return concat(out)


# -- the plan -----------------------------------------------------------------------------


class EpochPlan:
    """This rank's samples for one epoch, in order, cut into batches; made lazily, a batch at
    a time (any batch, in any order), from a description a few numbers a group in size."""

    def __init__(
        self,
        order: SampleSeq,
        samples: int,
        batch_size: int,
        drop_last: bool,
        group_sizes: np.ndarray,
    ) -> None:
        self._order = order
        self.samples = samples  # this rank's, in the epoch (or the rest of it, resuming)
        self.batch_size = batch_size
        self.drop_last = drop_last
        self._group_sizes = group_sizes
        self._lock = threading.Lock()  # the caches behind `take` are shared

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Number of batches."""
        return batch_count(self.samples, self.batch_size, self.drop_last)

    def take(self, start: int, count: int) -> np.ndarray:
        """Global sample indices (int64) of positions [start, start + count) of this rank's
        order, cut short at its end."""
        start, count = int(start), int(count)
        if start < 0 or count < 0:
            raise UsageError(f"no positions [{start}, {start} + {count}) in an epoch plan")
        count = max(0, min(count, self.samples - start))
        if count == 0:
            return EMPTY.copy()
        with self._lock:
            return self._order.take(start, count)

    def batch(self, k: int) -> np.ndarray:
        """Batch k's sample indices (the last may be short, unless drop_last)."""
        if not 0 <= k < len(self):
            raise IndexError(f"batch {k} is not in [0, {len(self)})")
        return self.take(k * self.batch_size, self.batch_size)

    @property
    def indices(self) -> np.ndarray:
        """This rank's whole order, made at once: for tests and small datasets only (it is
        8 bytes a sample)."""
        return self.take(0, self.samples)

    def group_spans(self, start_batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The groups (indices into the group sizes) that batches `start_batch` on read, in
        the order batches first read them, with the first and the last batch that reads
        each. A shuffled plan's spans come from its buckets' make-up without making samples,
        and may be wider than the truth (first no later, last no earlier than the true
        ones); the group set is exact. Other plans (unshuffled, elastic, Mix) are walked
        batch by batch, a window of samples at a time: exact, in time of the samples left
        and memory of the groups."""
        start = max(0, int(start_batch)) * self.batch_size
        stop = min(self.samples, len(self) * self.batch_size)
        if start >= stop:
            return EMPTY, EMPTY, EMPTY
        if isinstance(self._order, ShuffledStretch):
            with self._lock:
                return self._order.spans(start, stop, self.batch_size)
        return self._walk(start, stop)

    def _walk(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ends = np.cumsum(self._group_sizes)
        blocks = (
            (at, np.searchsorted(ends, self.take(at, min(_WALK, stop - at)), side="right"))
            for at in range(start, stop, _WALK)
        )
        read, first, last = first_and_last(blocks, len(ends))
        order = np.argsort(first, kind="stable")
        b = self.batch_size
        return read[order], first[order] // b, last[order] // b


def group_readers(
    weights: np.ndarray,
    *,
    shuffle: bool,
    seed: int,
    epoch: int,
    world_size: int,
    drop_last: bool,
) -> np.ndarray:
    """For each group, the rank whose stretch of `epoch`'s line holds the middle of it, were
    the groups `weights` samples each: the rank most likely to read it, from estimates
    (shard bytes) of their sizes. One pass over the groups, for every rank at once."""
    sizes = np.maximum(np.asarray(weights, np.int64).reshape(-1), 0)
    line = group_line(sizes, shuffle=shuffle, seed=seed, epoch=epoch)
    order = np.arange(len(sizes)) if line.order is None else line.order
    bounds = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(sizes[order], out=bounds[1:])
    _, per_rank = rank_stretch(line.length, 0, world_size, drop_last)
    middles = (bounds[:-1] + bounds[1:]) // 2
    readers = np.empty(len(sizes), np.int64)
    readers[order] = np.minimum(middles // max(per_rank, 1), world_size - 1)
    return readers


def plan_epoch(
    group_sizes: np.ndarray,
    *,
    batch_size: int,
    shuffle: bool,
    seed: int,
    epoch: int,
    rank: int,
    world_size: int,
    drop_last: bool,
    shuffle_window: int = DEFAULT_SHUFFLE_WINDOW,
    consumed: tuple[int, bool, int] | None = None,
    mix: MixSpec | None = None,
) -> EpochPlan:
    """This rank's batches for `epoch` (order version 3; see the module's docstring).

    Every rank gets the same number of samples, hence of batches (DDP hangs otherwise).
    With ``drop_last`` the ranks are disjoint and the end of the line is dropped (at most
    world_size - 1 samples), as is a last partial batch; without it every sample is covered,
    the last ranks padding with samples from the start of the line.

    ``consumed = (old_world_size, old_drop_last, samples_each_old_rank_read)`` plans the rest
    of an epoch that began with another world size: ranks move in lockstep, so one rank's
    count tells what every old rank read of its own order; what none of them read is shared
    out, in order, as above. Nothing is read twice (padding aside), none lost.
    With `mix`, the epoch is a Mix's.
    """
    if batch_size < 1:
        raise UsageError(f"batch_size must be at least 1, not {batch_size}")
    sizes = np.asarray(group_sizes, dtype=np.int64).reshape(-1)
    whole = _Epoch(
        sizes, shuffle=shuffle, seed=seed, epoch=epoch, window=max(1, int(shuffle_window)), mix=mix
    )
    if consumed is None:
        order = whole.rank_order(world_size, drop_last, rank)
    else:
        old_world, old_drop_last, done = consumed
        rest = whole.remainder(int(old_world), bool(old_drop_last), int(done))
        begin, end = rank_stretch(rest.length, rank, world_size, drop_last)
        order = Stretch(rest, begin, end - begin)
    return EpochPlan(order, order.length, batch_size, drop_last, sizes)
