"""The patches of an epoch, rank and batch: which (subject, patch number) each batch holds,
worked out for the batches asked for only.

An epoch is every subject's patches, one line of them (subject by subject, in order),
shuffled by a keyed permutation of the line. Ranks take equal stretches of it, wrapped
around its end where it does not divide. Nothing is made per patch of the epoch: a rank of
an epoch of 10 million patches makes its first batch as soon as it would for a hundred,
and holds the subjects' counts, not a list of the epoch's patches.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from stoker.loader.sample_orders import KeyedPermutation

# The random stream of the epoch's order, beside (seed, epoch).
_ORDER_TAG = 0x9A7C


class PatchOrder:
    """One rank's batches of an epoch: `counts` patches from each subject, shuffled (or
    not), split among `world_size` ranks (wrapping around to fill the last ranks' share,
    or dropping the rest with `drop_last`), then into batches of `batch_size`."""

    def __init__(
        self,
        counts: np.ndarray,
        seed: int,
        epoch: int,
        shuffle: bool,
        rank: int,
        world_size: int,
        batch_size: int,
        drop_last: bool,
    ) -> None:
        self._firsts = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))
        total = int(self._firsts[-1])
        share = total // world_size if drop_last else -(-total // world_size)
        self._total, self._share, self._begin = total, share, rank * share
        self._batch_size = batch_size
        self._batches = share // batch_size if drop_last else -(-share // batch_size)
        self._order = (
            KeyedPermutation(total, seed, epoch, _ORDER_TAG) if shuffle and total else None
        )

    def __len__(self) -> int:
        return self._batches

    def sizes(self, numbers: Sequence[int]) -> np.ndarray:
        """The patches in each of batches `numbers`."""
        starts = np.asarray(numbers, np.int64) * self._batch_size
        return np.minimum(starts + self._batch_size, self._share) - starts

    def entries(self, numbers: Sequence[int]) -> np.ndarray:
        """The (subject, patch number) of each patch of batches `numbers`, one batch after
        another: ``(patches, 2)`` int64."""
        sizes = self.sizes(numbers)
        starts = np.asarray(numbers, np.int64) * self._batch_size
        offsets = np.arange(int(sizes.sum()), dtype=np.int64)
        offsets -= np.repeat(np.cumsum(sizes) - sizes, sizes)
        line = (self._begin + np.repeat(starts, sizes) + offsets) % max(self._total, 1)
        if self._order is not None:
            line = self._order.at(line)
        subjects = np.searchsorted(self._firsts, line, side="right") - 1
        return np.stack([subjects, line - self._firsts[subjects]], axis=1)

    def batch(self, number: int) -> list[tuple[int, int]]:
        """The (subject, patch number) of each patch of batch `number`."""
        return [(s, k) for s, k in self.entries([number]).tolist()]
