"""Lazy orders of sample indices: a line of groups, a stretch of it, and a stretch shuffled
over a window of groups (see ``stoker.loader.sampler`` for the order they make).

Each order is a sequence of global sample indices of known length, of which `take` makes
only the part asked for; callers keep 0 <= start and start + count <= length. Nothing here
reads data; everything is numpy.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import numpy as np

# numpy imports these on first use (np.unique asks numpy.ma whether an array is masked),
# 25 ms that would otherwise fall on the first batch of a loader's first epoch.
import numpy.ma  # noqa: F401
import numpy.random  # noqa: F401

import stoker._core as _core

# Random streams, each its own tag, so that changing how one is drawn never shifts another
# (tags 1 and 2: the first order's keys, and the sampler's augment_seed; a Mix's sources
# are seeded with tag 3 in another position of the words, see stoker.loader.mixing).
_GROUP_ORDER, MIX_LABELS, _COUNTS, _BUCKET, _SEGMENT = 0, 3, 4, 5, 6

EMPTY = np.zeros(0, np.int64)


def random_stream(*words: int) -> np.random.Generator:
    """The random stream `words` name (the seed, the epoch, a tag, ...)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(w) for w in words])))


def random_permutation(n: int, *words: int) -> np.ndarray:
    """``random_stream(*words).permutation(n)``, the same numbers, worked out in C++: making
    the numpy generator costs ten times permuting a group of a hundred samples, and a batch
    permutes several."""
    values = [operator.index(w) for w in words]
    if min(values, default=0) < 0:
        return random_stream(*values).permutation(n)  # numpy's own error
    return _core.keyed_shuffle(np.array(seed_words(*values), np.uint32), n)


WORD_MAX = 0xFFFFFFFF  # SeedSequence takes integers as 32-bit words


def seed_words(*values: int) -> list[int]:
    """`values` (none negative) as SeedSequence takes a list of integers: each as 32-bit
    words, lowest first."""
    words = []
    for value in values:
        words.append(value & WORD_MAX)
        while value > WORD_MAX:
            value >>= 32
            words.append(value & WORD_MAX)
    return words


def concat(parts: list[np.ndarray]) -> np.ndarray:
    """`parts` one after another (copied only where there are several)."""
    if not parts:
        return EMPTY
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def first_and_last(
    blocks: Iterable[tuple[int, np.ndarray]], labels: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Of labels in [0, `labels`) given a block at a time (the block's first position, its
    labels), those that occur, and the first and the last position of each, in label
    order."""
    first = np.full(labels, -1, np.int64)
    last = np.full(labels, -1, np.int64)
    for at, block in blocks:
        u, where = np.unique(block, return_index=True)
        new = first[u] < 0
        first[u[new]] = at + where[new]
        u, where = np.unique(block[::-1], return_index=True)
        last[u] = at + len(block) - 1 - where
    read = np.flatnonzero(first >= 0)
    return read, first[read], last[read]


#: Segments of more samples than this are permuted by a KeyedPermutation, worked out at the
#: positions a batch reads, rather than by a permutation array made whole (8 bytes a
#: sample: a billion-row file read in place is one group, its rank's segment 125M samples
#: in a world of 8, which took 9 s and a gigabyte at every epoch).
LAZY_SEGMENT = 1 << 22
_ROUNDS = 6
_LABEL_BLOCK = 1 << 20


class KeyedPermutation:
    """A pseudo-random permutation of range(n), keyed by the random stream `words` name:
    ``at(positions)`` is where each position goes, in time of the positions asked and no
    memory of n (a Feistel network of _ROUNDS rounds, see _core.keyed_permutation)."""

    def __init__(self, n: int, *words: int) -> None:
        self.n = int(n)
        self.keys = random_stream(*words).integers(0, 2**64, _ROUNDS, dtype=np.uint64)

    def at(self, positions: np.ndarray) -> np.ndarray:
        return _core.keyed_permutation(self.n, self.keys, positions)


class SampleSeq(Protocol):
    """An order: `length` sample indices, of which `take` makes [start, start + count)."""

    length: int

    def take(self, start: int, count: int) -> np.ndarray: ...


class RecentCache:
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


class Stretch:
    """Positions [begin, begin + length) of `seq`, wrapping around to its start."""

    def __init__(self, seq: SampleSeq, begin: int, length: int) -> None:
        self.seq, self.begin, self.length = seq, begin, length

    def take(self, start: int, count: int) -> np.ndarray:
        pieces = _wrapped(self.begin + start, count, self.seq.length)
        return concat([self.seq.take(at, n) for at, n in pieces])


class GroupLine:
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


class ShuffledStretch:
    """A rank's stretch of a shuffled line, its segments dealt into buckets over the window
    (see the module's docstring). `streams` = (seed, epoch, rank, world_size): what every
    random stream of it is drawn from."""

    def __init__(
        self, line: GroupLine, begin: int, length: int, window: int, streams: tuple[int, ...]
    ) -> None:
        assert line.order is not None
        self.window, self.streams, self.length = window, streams, length
        # A wrap around the line's end cuts a segment too: `segments` sees each piece alone.
        found = [line.segments(at, at + n) for at, n in _wrapped(begin, length, line.length)]
        i, lo, hi = (np.concatenate(parts) for parts in zip(*found)) if found else (EMPTY,) * 3
        self.group = line.order[i]  # each segment's group
        self.base = line.first[i] + lo  # its first sample, in the group's own order
        self.n = n = hi - lo
        w = window
        seed, epoch, rank, world = streams
        if len(n):
            counts = random_stream(seed, epoch, _COUNTS, rank, world).multinomial(n, [1.0 / w] * w)
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
        self._segments = RecentCache(w + 1)
        self._buckets = RecentCache(2)

    def _segment(self, j: int) -> tuple[np.ndarray | _LazySegment, np.ndarray]:
        """Segment j's samples in the order they are dealt out (a large one's worked out
        where they are read), and where each bucket's piece of them starts."""
        seed, epoch, rank, world = self.streams
        words = (seed, epoch, _SEGMENT, rank, world, j)
        cuts = np.zeros(self.window + 1, np.int64)
        np.cumsum(self.counts[j], out=cuts[1:])
        n = int(self.n[j])
        if n > LAZY_SEGMENT:
            return _LazySegment(int(self.base[j]), KeyedPermutation(n, *words)), cuts
        return self.base[j] + random_permutation(n, *words), cuts

    def _sources(self, k: int) -> range:
        """The segments that may have samples in bucket k."""
        return range(max(0, k - self.window + 1), min(k, len(self.n) - 1) + 1)

    def _bucket_permutation(self, k: int, size: int) -> np.ndarray:
        seed, epoch, rank, world = self.streams
        return random_permutation(size, seed, epoch, _BUCKET, rank, world, k)

    def _lazy(self, k: int) -> bool:
        """Whether bucket k holds a piece of a segment permuted lazily: it is too."""
        return any(self.n[j] > LAZY_SEGMENT for j in self._sources(k))

    def _lazy_bucket(self, k: int) -> _LazyBucket:
        seed, epoch, rank, world = self.streams
        return _LazyBucket(self, k, (seed, epoch, _BUCKET, rank, world, k))

    def _bucket(self, k: int) -> np.ndarray | _LazyBucket:
        if self._lazy(k):
            return self._lazy_bucket(k)
        parts = []
        for j in self._sources(k):
            if self.counts[j, k - j]:
                samples, cuts = self._segments.get(j, self._segment)
                parts.append(samples[cuts[k - j] : cuts[k - j + 1]])
        bucket = concat(parts)
        return bucket[self._bucket_permutation(k, len(bucket))]

    def _bucket_reads(self, k: int, lo: int, hi: int) -> tuple[np.ndarray, ...]:
        """The segments that bucket k's positions [lo, hi) hold samples of, and the first
        and the last of those positions holding each."""
        sources = np.array(self._sources(k), np.int64)
        pieces = self.counts[sources, k - sources].astype(np.int64)
        blocks: Iterable[tuple[int, np.ndarray]]
        if not self._lazy(k):
            labels = np.repeat(np.arange(len(sources)), pieces)
            blocks = [(lo, labels[self._bucket_permutation(k, len(labels))][lo:hi])]
        elif np.count_nonzero(pieces) == 1:  # (a file read in place is one group)
            return sources[pieces > 0], np.array([lo]), np.array([hi - 1])
        else:  # in blocks: a bucket may be millions
            bucket = self._lazy_bucket(k)
            blocks = (
                (at, bucket.segments_at(at, min(hi, at + _LABEL_BLOCK)) - sources[0])
                for at in range(lo, hi, _LABEL_BLOCK)
            )
        read, first, last = first_and_last(blocks, len(sources))
        return sources[read], first, last

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
        return concat(parts)

    def spans(
        self, start: int, stop: int, batch_size: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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
            ks = rows[:, None] + np.arange(w)  # each row's buckets
            used = (self.counts[j0 : j1 + 1] > 0) & (ks > k_lo) & (ks < k_hi)
            has = used.any(axis=1)
            rows, used = rows[has], used[has]
            k_first = rows + np.argmax(used, axis=1)
            k_last = rows + (w - 1 - np.argmax(used[:, ::-1], axis=1))
            seg.append(rows)
            first.append(s[k_first] // b)
            last.append((s[k_last + 1] - 1) // b)
            bucket.append(k_first)
        for k in sorted({k_lo, k_hi}):
            lo, hi = max(start, int(s[k])), min(stop, int(s[k + 1]))
            if hi <= lo:
                continue
            u, at, at_last = self._bucket_reads(k, lo - int(s[k]), hi - int(s[k]))
            seg.append(u)
            first.append((s[k] + at) // b)
            last.append((s[k] + at_last) // b)
            bucket.append(np.full(len(u), k, np.int64))
        return spans_by_group(self.group[concat(seg)], concat(first), concat(last), concat(bucket))


class _LazySegment:
    """A large segment's samples in their dealt-out order, worked out where sliced."""

    def __init__(self, base: int, order: KeyedPermutation) -> None:
        self.base, self.order = base, order

    def at(self, positions: np.ndarray) -> np.ndarray:
        return self.base + self.order.at(positions)


class _LazyBucket:
    """Bucket k of a stretch holding a lazily permuted segment's piece: its pieces one
    after another (as an eager bucket's), permuted by a KeyedPermutation; a slice of it
    is worked out from the positions alone."""

    def __init__(self, stretch: ShuffledStretch, k: int, words: tuple[int, ...]) -> None:
        self.stretch, self.k = stretch, k
        self.sources = np.array(stretch._sources(k), np.int64)
        sizes = stretch.counts[self.sources, k - self.sources].astype(np.int64)
        self.starts = np.zeros(len(sizes) + 1, np.int64)  # each piece's place in the bucket
        np.cumsum(sizes, out=self.starts[1:])
        self.order = KeyedPermutation(int(self.starts[-1]), *words)

    def _pieces(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """For bucket positions [lo, hi): which piece each sample is of, and where in it."""
        at = self.order.at(np.arange(lo, hi, dtype=np.int64))
        piece = np.searchsorted(self.starts, at, side="right") - 1
        return piece, at - self.starts[piece]

    def segments_at(self, lo: int, hi: int) -> np.ndarray:
        """The segment of each sample at bucket positions [lo, hi)."""
        return self.sources[self._pieces(lo, hi)[0]]

    def __getitem__(self, key: slice) -> np.ndarray:
        lo, hi, _ = key.indices(int(self.starts[-1]))
        piece, offset = self._pieces(lo, hi)
        out = np.empty(len(piece), np.int64)
        for p in np.unique(piece).tolist():
            j = int(self.sources[p])
            samples, cuts = self.stretch._segments.get(j, self.stretch._segment)
            where = piece == p
            positions = cuts[self.k - j] + offset[where]
            out[where] = (
                samples.at(positions) if isinstance(samples, _LazySegment) else samples[positions]
            )
        return out


def spans_by_group(
    groups: np.ndarray, first: np.ndarray, last: np.ndarray, then: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Spans of (group, first batch, last batch) merged per group, the groups in the order
    of their first batch (then of `then`)."""
    if not len(groups):
        return EMPTY, EMPTY, EMPTY
    order = np.lexsort((then, first))
    groups, first, last = groups[order], first[order], last[order]
    unique, at, inverse = np.unique(groups, return_index=True, return_inverse=True)
    latest = np.full(len(unique), -1, np.int64)
    np.maximum.at(latest, inverse, last)
    by_first = np.argsort(at, kind="stable")
    return unique[by_first], first[at[by_first]], latest[by_first]


def group_line(
    sizes: np.ndarray, *, shuffle: bool, seed: int, epoch: int, offset: int = 0
) -> GroupLine:
    """An epoch's line of groups `sizes` long: in a random order, or in natural order
    without shuffle; `offset` is added to every sample."""
    order = random_permutation(len(sizes), seed, epoch, _GROUP_ORDER) if shuffle else None
    return GroupLine(sizes, order, offset)


def read_order(
    line: GroupLine,
    begin: int,
    length: int,
    *,
    shuffle: bool,
    window: int,
    streams: tuple[int, ...],
) -> SampleSeq:
    """Positions [begin, begin + length) of `line` in the order a rank reads them: dealt
    over the window's buckets with shuffle (`streams` as for ShuffledStretch), else as
    they lie."""
    if shuffle:
        return ShuffledStretch(line, begin, length, window, streams)
    return Stretch(line, begin, length)
