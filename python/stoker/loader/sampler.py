"""The order samples are read in: a pure function of (seed, epoch, rank, world size).

Two levels, so data can stream shard by shard: the shards are permuted, then samples are
drawn at random from a window of ``shuffle_window`` consecutive shards of that order. Each
rank takes its own contiguous stretch of the epoch's order, so it touches about
1/world_size of the shards. Nothing here reads data; everything is numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Default number of shards whose samples are mixed together. More mixes better and
#: holds more shards open (or cached, for remote data) at once.
DEFAULT_SHUFFLE_WINDOW = 8


@dataclass(frozen=True)
class EpochPlan:
    """This rank's samples for one epoch, in order, cut into batches."""

    indices: np.ndarray  # int64 global sample indices, this rank's whole epoch
    batch_size: int
    drop_last: bool

    def __len__(self) -> int:
        """Number of batches."""
        return batch_count(len(self.indices), self.batch_size, self.drop_last)

    def batch(self, k: int) -> np.ndarray:
        return self.indices[k * self.batch_size : (k + 1) * self.batch_size]


def augment_seed(seed: int, epoch: int) -> int:
    """The seed of an epoch's random image crops: with each sample's index, it decides every
    crop and flip, whichever thread decodes the sample and whenever."""
    state = np.random.SeedSequence([seed, epoch, 2]).generate_state(1, np.uint64)
    return int(state[0])


def batch_count(samples: int, batch_size: int, drop_last: bool) -> int:
    """Batches `samples` make: a partial last one counts unless drop_last."""
    full, rest = divmod(samples, batch_size)
    return full + (1 if rest and not drop_last else 0)


def _epoch_rng(seed: int, epoch: int, stream: int) -> np.random.Generator:
    # Independent streams per (seed, epoch, purpose): changing one never shifts another.
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, stream])))


def global_order(
    shard_sizes: np.ndarray,
    *,
    shuffle: bool,
    seed: int,
    epoch: int,
    shuffle_window: int = DEFAULT_SHUFFLE_WINDOW,
) -> tuple[np.ndarray, np.ndarray]:
    """The epoch's order of every sample, and the shard order it follows.

    Sample indices are global: shard s holds ``[starts[s], starts[s] + shard_sizes[s])``.
    Without shuffling both are natural order. With it, shard p of the permuted order has
    its samples given keys uniform in ``[p, p + window)`` and everything is sorted by key:
    at any point of the epoch samples come from about ``window`` consecutive shards, and
    a shard is finished ``window`` shards after it is started.
    """
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)])[:-1]
    total = int(sizes.sum())
    if not shuffle:
        return np.arange(total, dtype=np.int64), np.arange(len(sizes), dtype=np.int64)
    shard_order = _epoch_rng(seed, epoch, 0).permutation(len(sizes)).astype(np.int64)
    ordered_sizes = sizes[shard_order]
    position = np.repeat(np.arange(len(sizes), dtype=np.float64), ordered_sizes)
    window = max(1, int(shuffle_window))
    keys = position + _epoch_rng(seed, epoch, 1).random(total) * window
    # Every sample of the shards in their permuted order, then sorted by key.
    first = np.repeat(starts[shard_order], ordered_sizes)
    within = np.arange(total, dtype=np.int64) - np.repeat(
        np.concatenate([[0], np.cumsum(ordered_sizes)])[:-1], ordered_sizes
    )
    samples = first + within
    return samples[np.argsort(keys, kind="stable")], shard_order


@dataclass(frozen=True)
class MixSpec:
    """How a Mix draws an epoch from its sources (see mix_order): each source's groups, in
    order, are the next `groups[s]` entries of the group sizes."""

    groups: tuple[int, ...]
    weights: tuple[float, ...]
    epoch_samples: int

    def counts(self) -> np.ndarray:
        """Samples each source gives an epoch: the weights' shares of epoch_samples, the
        remainders handed out largest first (ties to the earlier source)."""
        w = np.asarray(self.weights, np.float64)
        exact = w / w.sum() * self.epoch_samples
        counts = np.floor(exact).astype(np.int64)
        short = self.epoch_samples - int(counts.sum())
        counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
        return counts


def _source_seed(seed: int, source: int) -> int:
    return int(np.random.SeedSequence([seed, 3, source]).generate_state(1, np.uint64)[0] >> 1)


def mix_order(
    group_sizes: np.ndarray,
    mix: MixSpec,
    *,
    shuffle: bool,
    seed: int,
    epoch: int,
    shuffle_window: int = DEFAULT_SHUFFLE_WINDOW,
) -> np.ndarray:
    """The epoch's order of a Mix: exactly ``mix.counts()[s]`` samples of each source s.

    Each source is read as an endless stream of passes, pass j its own ``global_order`` for
    epoch j (so a source keeps its shard-by-shard locality); epoch e takes the stream's
    next ``counts[s]`` samples, so a source weighted past its size is resampled (each pass
    without replacement) and one weighted below it goes on where the last epoch stopped.
    The sources' streams are then interleaved sample by sample, at random positions (in
    proportion, without shuffle), each keeping its own order. A pure function of its
    arguments."""
    sizes = np.asarray(group_sizes, dtype=np.int64)
    counts = mix.counts()
    bounds = np.concatenate([[0], np.cumsum(mix.groups)])
    sample_starts = np.concatenate([[0], np.cumsum(sizes)])
    streams = []
    for s, count in enumerate(counts.tolist()):
        own = sizes[bounds[s] : bounds[s + 1]]
        offset = int(sample_starts[bounds[s]])
        n = int(own.sum())
        if count == 0:
            streams.append(np.zeros(0, np.int64))
            continue
        if n == 0:
            raise ValueError(f"source {s} of a Mix has no samples")
        start = epoch * count
        pieces = []
        for j in range(start // n, (start + count - 1) // n + 1):
            order, _ = global_order(
                own, shuffle=shuffle, seed=_source_seed(seed, s), epoch=j,
                shuffle_window=shuffle_window,
            )  # fmt: skip
            lo = max(start, j * n) - j * n
            hi = min(start + count, (j + 1) * n) - j * n
            pieces.append(order[lo:hi] + offset)
        streams.append(np.concatenate(pieces))
    labels = np.repeat(np.arange(len(counts)), counts)
    if shuffle:
        labels = _epoch_rng(seed, epoch, 3).permutation(labels)
    else:  # in proportion: source s's k-th sample at (k + 0.5) / counts[s] of the epoch
        keys = np.concatenate([(np.arange(c) + 0.5) / c for c in counts.tolist() if c])
        labels = labels[np.argsort(keys, kind="stable")]
    out = np.empty(len(labels), np.int64)
    for s, stream in enumerate(streams):
        out[labels == s] = stream
    return out


def rank_stretch(total: int, rank: int, world_size: int, drop_last: bool) -> tuple[int, int]:
    """[begin, end) of this rank's stretch of an epoch of `total` samples; `end` may pass
    `total` (without drop_last the last ranks wrap around to the start)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    per_rank = total // world_size if drop_last else -(-total // world_size)
    return rank * per_rank, (rank + 1) * per_rank


def plan_epoch(
    shard_sizes: np.ndarray,
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
    """This rank's batches for `epoch`.

    Every rank gets the same number of samples, hence of batches (DDP hangs otherwise).
    With ``drop_last`` the ranks are disjoint and the tail of the order is dropped (at most
    world_size - 1 samples), as is a last partial batch; without it every sample is covered,
    the last ranks padding with samples from the start of the order.

    ``consumed = (old_world_size, old_drop_last, samples_each_old_rank_read)`` plans the rest
    of an epoch that began with another world size: ranks move in lockstep, so one rank's
    count tells what every old rank read from its stretch; what none of them read is shared
    out, in the epoch's order, as above. Nothing is read twice (padding aside), none lost.
    With `mix`, the epoch's order is a Mix's (mix_order).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, not {batch_size}")
    if mix is not None:
        order = mix_order(
            shard_sizes, mix, shuffle=shuffle, seed=seed, epoch=epoch, shuffle_window=shuffle_window
        )
    else:
        order, _ = global_order(
            shard_sizes, shuffle=shuffle, seed=seed, epoch=epoch, shuffle_window=shuffle_window
        )
    if consumed is not None and len(order):
        old_world, old_drop_last, done = consumed
        taken = np.zeros(len(order), dtype=bool)  # by position in the epoch's order
        for r in range(old_world):
            begin, end = rank_stretch(len(order), r, old_world, bool(old_drop_last))
            taken[np.arange(begin, min(end, begin + done)) % len(order)] = True
        order = order[~taken]
    begin, end = rank_stretch(len(order), rank, world_size, drop_last)
    if len(order) == 0:
        return EpochPlan(np.zeros(0, np.int64), batch_size, drop_last)
    return EpochPlan(order[np.arange(begin, end) % len(order)], batch_size, drop_last)
