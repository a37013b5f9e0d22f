"""A Mix's epoch: its sources' streams, each an endless run of passes in the source's own
order, interleaved by key (see ``stoker.loader.sampler`` for the order it makes)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stoker.errors import UsageError
from stoker.loader.sample_orders import (
    EMPTY,
    MIX_LABELS,
    RecentCache,
    SampleSeq,
    concat,
    group_line,
    random_permutation,
    read_order,
)


@dataclass(frozen=True)
class MixSpec:
    """How a Mix draws an epoch from its sources (see ``stoker.loader.sampler``): each
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


def source_seed(seed: int, source: int) -> int:
    """The seed of Mix source `source`'s own order, drawn from the Mix's `seed`."""
    return int(np.random.SeedSequence([seed, 3, source]).generate_state(1, np.uint64)[0] >> 1)


class _SourceStream:
    """A Mix source's endless stream: pass p is its own order, as one rank, for epoch p."""

    def __init__(self, sizes: np.ndarray, offset: int, seed: int, shuffle: bool, window: int):
        self.sizes, self.offset, self.seed = sizes, offset, seed
        self.shuffle, self.window = shuffle, window
        self.length = int(sizes.sum())  # of a pass
        self._passes = RecentCache(2)

    def _pass(self, p: int) -> SampleSeq:
        line = group_line(
            self.sizes, shuffle=self.shuffle, seed=self.seed, epoch=p, offset=self.offset
        )
        streams = (self.seed, p, 0, 1)  # as rank 0 of 1
        return read_order(
            line, 0, line.length, shuffle=self.shuffle, window=self.window, streams=streams
        )

    def take(self, start: int, count: int) -> np.ndarray:
        out, n = [], self.length
        while count > 0:
            p, at = divmod(start, n)
            k = min(count, n - at)
            out.append(self._passes.get(p, self._pass).take(at, k))
            start, count = start + k, count - k
        return concat(out)


class MixLine:
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
        block: int,
    ) -> None:
        self.counts = [int(c) for c in mix.counts()]
        self.total = int(mix.epoch_samples)
        self.length = self.total
        self.shuffle, self.seed, self.epoch = shuffle, seed, epoch
        self.block = block
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
                _SourceStream(own, int(firsts[bounds[s]]), source_seed(seed, s), shuffle, window)
            )
        self._blocks = RecentCache(2)

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
            labels = labels[random_permutation(len(labels), self.seed, self.epoch, MIX_LABELS, b)]
        else:
            labels = self._by_key(b, lo, got)
        index = np.empty(len(labels), np.int64)
        index[np.argsort(labels, kind="stable")] = concat(
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
        labels_ = concat(labels)
        return labels_[np.lexsort((labels_, concat(frac) if frac else EMPTY, concat(whole)))]

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
        lab, idx = concat(labels), concat(index)
        out = np.empty(count, np.int64)
        for s, stream in enumerate(self.streams):
            mine = lab == s
            if mine.any():
                # Along the line a source's indices run on one by one: one piece of its stream.
                first_index = int(idx[mine][0])
                out[mine] = stream.take(self.epoch * self.counts[s] + first_index, int(mine.sum()))
        return out
