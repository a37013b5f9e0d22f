"""The order samples are read in: a pure function of the seed, the epoch, the rank, the
world size, the group sizes, the shuffle window and drop_last, never of timing or threads.

Samples come in groups: a shard, or a run of whole chunks of an array source. The order is
shuffled at two levels so that data can stream group by group (order version 2):

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
- Nothing is made before it is needed. A plan holds a few numbers per group; a batch is
  built from the one or two buckets it overlaps, each from at most w segments, so the first
  batch costs the same for a thousand samples or a billion, and batch k comes without
  making the batches before it (an exact resume starts there at once). Reading batch by
  batch, each segment is shuffled once and each bucket built once; memory stays about w
  groups' worth.

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

Nothing here reads data; everything is numpy.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from stoker.errors import UsageError

#: Default number of groups whose samples are mixed together. More mixes better and holds
#: more groups open (or cached, for remote data) at once.
DEFAULT_SHUFFLE_WINDOW = 8

#: Key units in a block of a Mix's interleaving: a block's labels are made at once.
MIX_BLOCK = 65536

# Random streams, each its own tag, so that changing how one is drawn never shifts another
# (tags 1 and 2: the first order's keys, and augment_seed).
_GROUP_ORDER, _MIX_LABELS, _COUNTS, _BUCKET, _SEGMENT = 0, 3, 4, 5, 6

# Samples mapped at a time when group_spans walks a plan's batches.
_WALK = 1 << 18

_EMPTY = np.zeros(0, np.int64)


def _rng(*words: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(w) for w in words])))


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    if not parts:
        return _EMPTY
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


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


@dataclass(frozen=True)
class MixSpec:
    """How a Mix draws an epoch from its sources (see the module's docstring): each
    source's groups, in order, are the next `groups[s]` entries of the group sizes."""

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


# -- lazy sequences -----------------------------------------------------------------------
#
# Each is a sequence of global sample indices of known length, of which `take` makes only
# the part asked for. Callers keep 0 <= start and start + count <= length.


class _Seq(Protocol):
    length: int

    def take(self, start: int, count: int) -> np.ndarray: ...


class _Lru:
    """The last few things made, by key; dropped when pickled (they are made again)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.items: OrderedDict[Any, Any] = OrderedDict()

    def get(self, key: Any, make: Callable[[Any], Any]) -> Any:
        if key in self.items:
            self.items.move_to_end(key)
            return self.items[key]
        value = make(key)
        self.items[key] = value
        if len(self.items) > self.size:
            self.items.popitem(last=False)
        return value

    def __getstate__(self) -> dict[str, Any]:
        return {"size": self.size, "items": OrderedDict()}


def _wrapped(begin: int, length: int, total: int) -> list[tuple[int, int]]:
    """Positions [begin, begin + length) of a line of `total`, taken modulo `total`: as
    (start, count) pieces that do not wrap (more than one wrap when the line is short)."""
    pieces = []
    while length > 0:
        at = begin % total
        n = min(length, total - at)
        pieces.append((at, n))
        begin, length = begin + n, length - n
    return pieces


class _Stretch:
    """Positions [begin, begin + length) of `seq`, wrapping around to its start."""

    def __init__(self, seq: _Seq, begin: int, length: int) -> None:
        self.seq, self.begin, self.length = seq, begin, length

    def take(self, start: int, count: int) -> np.ndarray:
        pieces = _wrapped(self.begin + start, count, self.seq.length)
        return _cat([self.seq.take(at, n) for at, n in pieces])


class _GroupLine:
    """Every sample, the groups one after another in `order` (natural order when None),
    each group's samples in their own order; `offset` is added to every sample."""

    def __init__(self, sizes: np.ndarray, order: np.ndarray | None, offset: int = 0) -> None:
        self.offset = offset
        self.order = order
        self.length = int(sizes.sum())
        if order is not None:
            line_sizes = sizes[order]
            self.bounds = np.zeros(len(order) + 1, np.int64)  # line positions of the groups
            np.cumsum(line_sizes, out=self.bounds[1:])
            self.first = (np.cumsum(sizes) - sizes + offset)[order]  # their first samples

    def _at(self, positions: np.ndarray) -> np.ndarray:
        # 'right' steps over empty groups, whose bounds repeat the next group's start.
        return np.searchsorted(self.bounds, positions, side="right") - 1

    def segments(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The groups (by line index) that positions [start, stop) cross, and the offsets
        [lo, hi) within each group; empty groups are left out."""
        first, last = self._at(np.array([start, stop - 1]))
        i = np.arange(first, last + 1, dtype=np.int64)
        begin = self.bounds[i]
        lo = np.maximum(begin, start) - begin
        hi = np.minimum(self.bounds[i + 1], stop) - begin
        keep = hi > lo
        return i[keep], lo[keep], hi[keep]

    def take(self, start: int, count: int) -> np.ndarray:
        if self.order is None:
            return np.arange(start + self.offset, start + count + self.offset, dtype=np.int64)
        positions = np.arange(start, start + count, dtype=np.int64)
        i = self._at(positions)
        return self.first[i] + (positions - self.bounds[i])


class _Shuffled:
    """A rank's stretch of a shuffled line, its segments dealt into buckets over the window
    (see the module's docstring). `streams` = (seed, epoch, rank, world_size): what every
    random stream of it is drawn from."""

    def __init__(
        self, line: _GroupLine, begin: int, length: int, window: int, streams: tuple[int, ...]
    ) -> None:
        assert line.order is not None
        self.window, self.streams, self.length = window, streams, length
        # A wrap around the line's end cuts a segment too: `segments` sees each piece alone.
        found = [line.segments(at, at + n) for at, n in _wrapped(begin, length, line.length)]
        i, lo, hi = (np.concatenate(parts) for parts in zip(*found)) if found else (_EMPTY,) * 3
        self.group = line.order[i]  # each segment's group
        self.base = line.first[i] + lo  # its first sample, in the group's own order
        self.n = n = hi - lo
        w = window
        seed, epoch, rank, world = streams
        if len(n):
            counts = _rng(seed, epoch, _COUNTS, rank, world).multinomial(n, [1.0 / w] * w)
        else:
            counts = np.zeros((0, w), np.int64)
        # counts[j, i]: samples of segment j in bucket j + i. Kept narrow: it is the plan's
        # biggest array (window numbers a segment).
        self.counts = counts.astype(np.int32) if len(n) and n.max() < 2**31 else counts
        sizes = np.zeros(len(n) + w - 1, np.int64)
        for step in range(w):
            sizes[step : step + len(n)] += self.counts[:, step]
        self.starts = np.zeros(len(sizes) + 1, np.int64)  # each bucket's first position
        np.cumsum(sizes, out=self.starts[1:])
        # Enough to read in order: bucket k needs segments k-w+1..k; a batch spans 2 buckets.
        self._segments = _Lru(w + 1)
        self._buckets = _Lru(2)

    def _segment(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        """Segment j's samples in the order they are dealt out, and where each bucket's
        piece of them starts."""
        seed, epoch, rank, world = self.streams
        rng = _rng(seed, epoch, _SEGMENT, rank, world, j)
        samples = self.base[j] + rng.permutation(int(self.n[j]))
        cuts = np.zeros(self.window + 1, np.int64)
        np.cumsum(self.counts[j], out=cuts[1:])
        return samples, cuts

    def _sources(self, k: int) -> range:
        """The segments that may have samples in bucket k."""
        return range(max(0, k - self.window + 1), min(k, len(self.n) - 1) + 1)

    def _bucket_permutation(self, k: int, size: int) -> np.ndarray:
        seed, epoch, rank, world = self.streams
        return _rng(seed, epoch, _BUCKET, rank, world, k).permutation(size)

    def _bucket(self, k: int) -> np.ndarray:
        parts = []
        for j in self._sources(k):
            if self.counts[j, k - j]:
                samples, cuts = self._segments.get(j, self._segment)
                parts.append(samples[cuts[k - j] : cuts[k - j + 1]])
        bucket = _cat(parts)
        return bucket[self._bucket_permutation(k, len(bucket))]

    def _bucket_segments(self, k: int) -> np.ndarray:
        """The segment each sample of bucket k comes from, in bucket order."""
        sources = np.array(self._sources(k), np.int64)
        pieces = self.counts[sources, k - sources].astype(np.int64)
        labels = np.repeat(sources, pieces)
        return labels[self._bucket_permutation(k, len(labels))]

    def take(self, start: int, count: int) -> np.ndarray:
        stop = start + count
        s = self.starts
        first = int(np.searchsorted(s, start, side="right")) - 1
        last = int(np.searchsorted(s, stop - 1, side="right")) - 1
        parts = []
        for k in range(first, last + 1):
            if s[k + 1] > s[k]:
                bucket = self._buckets.get(k, self._bucket)
                parts.append(bucket[max(start, s[k]) - s[k] : min(stop, s[k + 1]) - s[k]])
        return _cat(parts)

    def spans(self, start: int, stop: int, batch_size: int) -> tuple[np.ndarray, ...]:
        """group_spans for positions [start, stop), from the buckets' make-up: a segment's
        group is read in each bucket it has samples in, anywhere in that bucket's batches.
        The two end buckets have the segment of each of their places drawn, to tell exactly
        what of them is read."""
        s, w, b = self.starts, self.window, batch_size
        k_lo = int(np.searchsorted(s, start, side="right")) - 1
        k_hi = int(np.searchsorted(s, stop - 1, side="right")) - 1
        seg, first, last, bucket = [], [], [], []
        # Buckets strictly between the end ones lie wholly within [start, stop).
        j0, j1 = max(0, k_lo + 1 - w + 1), min(len(self.n) - 1, k_hi - 1)
        if j1 >= j0:
            rows = np.arange(j0, j1 + 1, dtype=np.int64)
            k = rows[:, None] + np.arange(w)
            used = (self.counts[j0 : j1 + 1] > 0) & (k > k_lo) & (k < k_hi)
            has = used.any(axis=1)
            rows, used = rows[has], used[has]
            k_first = rows + np.argmax(used, axis=1)
            k_last = rows + (w - 1 - np.argmax(used[:, ::-1], axis=1))
            seg.append(rows)
            first.append(s[k_first] // b)
            last.append((s[k_last + 1] - 1) // b)
            bucket.append(k_first)
        for k in sorted({k_lo, k_hi}):
            labels = self._bucket_segments(k)
            positions = s[k] + np.arange(len(labels), dtype=np.int64)
            read = (positions >= start) & (positions < stop)
            labels, positions = labels[read], positions[read]
            if not len(labels):
                continue
            u, at = np.unique(labels, return_index=True)
            _, at_back = np.unique(labels[::-1], return_index=True)
            seg.append(u)
            first.append(positions[at] // b)
            last.append(positions[len(labels) - 1 - at_back] // b)
            bucket.append(np.full(len(u), k, np.int64))
        return _by_group(self.group[_cat(seg)], _cat(first), _cat(last), _cat(bucket))


def _by_group(
    groups: np.ndarray, first: np.ndarray, last: np.ndarray, then: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Spans of (group, first batch, last batch) merged per group, the groups in the order
    of their first batch (then of `then`)."""
    if not len(groups):
        return _EMPTY, _EMPTY, _EMPTY
    order = np.lexsort((then, first))
    groups, first, last = groups[order], first[order], last[order]
    unique, at, inverse = np.unique(groups, return_index=True, return_inverse=True)
    latest = np.full(len(unique), -1, np.int64)
    np.maximum.at(latest, inverse, last)
    by_first = np.argsort(at, kind="stable")
    return unique[by_first], first[at[by_first]], latest[by_first]


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
            self.line: _Seq = _MixLine(
                sizes, mix, shuffle=shuffle, seed=seed, epoch=epoch, window=window
            )
        else:
            order = _rng(seed, epoch, _GROUP_ORDER).permutation(len(sizes)) if shuffle else None
            self.line = _GroupLine(sizes, order, offset)

    def rank_order(self, world: int, drop_last: bool, rank: int) -> _Seq:
        begin, end = rank_stretch(self.line.length, rank, world, drop_last)
        if self.mix is None and self.shuffle:
            assert isinstance(self.line, _GroupLine)
            streams = (self.seed, self.epoch, rank, world)
            return _Shuffled(self.line, begin, end - begin, self.window, streams)
        return _Stretch(self.line, begin, end - begin)

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
        self._orders = _Lru(2)

    def _order(self, rank: int | None) -> _Seq:
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
        return _cat(out)


class _SourceStream:
    """A Mix source's endless stream: pass p is its own order, as one rank, for epoch p."""

    def __init__(self, sizes: np.ndarray, offset: int, seed: int, shuffle: bool, window: int):
        self.sizes, self.offset, self.seed = sizes, offset, seed
        self.shuffle, self.window = shuffle, window
        self.length = int(sizes.sum())  # of a pass
        self._passes = _Lru(2)

    def _pass(self, p: int) -> _Seq:
        epoch = _Epoch(
            self.sizes,
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=p,
            window=self.window,
            offset=self.offset,
        )
        return epoch.rank_order(1, False, 0)

    def take(self, start: int, count: int) -> np.ndarray:
        out, n = [], self.length
        while count > 0:
            p, at = divmod(start, n)
            k = min(count, n - at)
            out.append(self._passes.get(p, self._pass).take(at, k))
            start, count = start + k, count - k
        return _cat(out)


class _MixLine:
    """A Mix's epoch: its sources' streams interleaved by key, block by block."""

    def __init__(
        self,
        sizes: np.ndarray,
        mix: MixSpec,
        *,
        shuffle: bool,
        seed: int,
        epoch: int,
        window: int,
    ) -> None:
        self.counts = [int(c) for c in mix.counts()]
        self.total = int(mix.epoch_samples)
        self.length = self.total
        self.shuffle, self.seed, self.epoch = shuffle, seed, epoch
        self.block = MIX_BLOCK
        self.blocks = -(-self.total // self.block)
        bounds = np.concatenate([[0], np.cumsum(mix.groups)]).astype(np.int64)
        if bounds[-1] != len(sizes):
            raise UsageError(
                f"a Mix's sources have {int(bounds[-1])} groups in all, not {len(sizes)}"
            )
        firsts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.streams = []
        for s, count in enumerate(self.counts):
            own = sizes[bounds[s] : bounds[s + 1]]
            if count and not own.sum():
                raise UsageError(f"source {s} of a Mix has no samples")
            self.streams.append(
                _SourceStream(own, int(firsts[bounds[s]]), _source_seed(seed, s), shuffle, window)
            )
        self._blocks = _Lru(2)

    def _keys_below(self, s: int, x: int) -> int:
        """Source s's samples with keys below x: keys are (k + 1/2) * total / counts[s], so
        ceil(x * counts[s] / total - 1/2), in whole numbers (floats would drift at 1e9)."""
        c, e = self.counts[s], self.total
        return min(max(-((e - 2 * x * c) // (2 * e)), 0), c)

    def _block_start(self, b: int) -> int:
        return sum(self._keys_below(s, b * self.block) for s in range(len(self.counts)))

    def _find(self, position: int) -> int:
        """The block that holds `position`: the last whose start is at or before it."""
        lo, hi = 0, self.blocks - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._block_start(mid) <= position:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _make_block(self, b: int) -> tuple[int, np.ndarray, np.ndarray]:
        """Block b's first position, each of its positions' source, and its index in that
        source's samples of the epoch."""
        lo_key, hi_key = b * self.block, (b + 1) * self.block
        lo = [self._keys_below(s, lo_key) for s in range(len(self.counts))]
        got = [self._keys_below(s, hi_key) - lo[s] for s in range(len(self.counts))]
        if self.shuffle:
            labels = np.repeat(np.arange(len(got), dtype=np.int64), got)
            labels = _rng(self.seed, self.epoch, _MIX_LABELS, b).permutation(labels)
        else:
            labels = self._by_key(b, lo, got)
        index = np.empty(len(labels), np.int64)
        index[np.argsort(labels, kind="stable")] = _cat(
            [np.arange(k, k + n, dtype=np.int64) for k, n in zip(lo, got) if n]
        )
        return sum(lo), labels, index

    def _by_key(self, b: int, lo: list[int], got: list[int]) -> np.ndarray:
        """Block b's labels in key order (ties to the lower source). Key k of source s is
        (2k + 1) * total / (2 * counts[s]): its whole part is exact; the fraction, a float,
        only orders keys that share a whole part."""
        e, whole, frac, labels = self.total, [], [], []
        for s, (k0, n) in enumerate(zip(lo, got)):
            if not n:
                continue
            den = 2 * self.counts[s]
            q0, r0 = divmod((2 * k0 + 1) * e, den)
            step_q, step_r = divmod(2 * e, den)
            i = np.arange(n, dtype=np.int64)
            rest = r0 + i * step_r
            whole.append((q0 - b * self.block) + i * step_q + rest // den)
            frac.append((rest % den) / den)
            labels.append(np.full(n, s, np.int64))
        labels_ = _cat(labels)
        return labels_[np.lexsort((labels_, _cat(frac) if frac else _EMPTY, _cat(whole)))]

    def take(self, start: int, count: int) -> np.ndarray:
        stop, at, b = start + count, start, self._find(start)
        labels, index = [], []
        while at < stop:
            first, lab, idx = self._blocks.get(b, self._make_block)
            lo, hi = at - first, min(stop - first, len(lab))
            labels.append(lab[lo:hi])
            index.append(idx[lo:hi])
            at += hi - lo
            b += 1
        lab, idx = _cat(labels), _cat(index)
        out = np.empty(count, np.int64)
        for s, stream in enumerate(self.streams):
            mine = lab == s
            if mine.any():
                # Along the line a source's indices run on one by one: one piece of its stream.
                first_index = int(idx[mine][0])
                out[mine] = stream.take(self.epoch * self.counts[s] + first_index, int(mine.sum()))
        return out


# -- the plan -----------------------------------------------------------------------------


class EpochPlan:
    """This rank's samples for one epoch, in order, cut into batches; made lazily, a batch at
    a time (any batch, in any order), from a description a few numbers a group in size."""

    def __init__(
        self,
        order: _Seq,
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
            return _EMPTY.copy()
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
            return _EMPTY, _EMPTY, _EMPTY
        if isinstance(self._order, _Shuffled):
            with self._lock:
                return self._order.spans(start, stop, self.batch_size)
        return self._walk(start, stop)

    def _walk(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ends = np.cumsum(self._group_sizes)
        first = np.full(len(ends), -1, np.int64)  # first and last position reading each
        last = np.full(len(ends), -1, np.int64)
        for at in range(start, stop, _WALK):
            n = min(_WALK, stop - at)
            groups = np.searchsorted(ends, self.take(at, n), side="right")
            unique, where = np.unique(groups, return_index=True)
            new = first[unique] < 0
            first[unique[new]] = at + where[new]
            unique, where = np.unique(groups[::-1], return_index=True)
            last[unique] = at + n - 1 - where
        read = np.flatnonzero(first >= 0)
        read = read[np.argsort(first[read], kind="stable")]
        return read, first[read] // self.batch_size, last[read] // self.batch_size


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
    line = _Epoch(sizes, shuffle=shuffle, seed=seed, epoch=epoch, window=1).line
    assert isinstance(line, _GroupLine)
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
    """This rank's batches for `epoch` (order version 2; see the module's docstring).

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
        order = _Stretch(rest, begin, end - begin)
    return EpochPlan(order, order.length, batch_size, drop_last, sizes)
