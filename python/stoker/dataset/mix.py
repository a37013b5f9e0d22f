"""Several datasets as one, drawn from by weight: ``stoker.Mix``."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from stoker.dataset import Dataset
from stoker.errors import UsageError


class Mix(Dataset):
    """The samples of `datasets`, which a Loader draws from in proportion to `weights`:
    ``stoker.Mix([web, curated], weights=[0.7, 0.3])``.

    An epoch holds `epoch_samples` samples (default: as many as the sources together), each
    source exactly its weight's share of them. Sources are read as endless streams of their
    own shuffled passes, so a source whose share is more than it holds is read again
    (without repeats within a pass: each sample 2 or 3 times when its share is 2.5 times its
    size), and one whose share is less goes on in the next epoch where this one stopped.
    Each source keeps its own two-level shuffle (shard by shard, `shuffle_window` of its
    shards at a time), so remote sources still stream shard by shard; the sources are
    interleaved sample by sample. The order is a pure function of (seed, epoch, rank,
    world size); exact and elastic resume work as for any dataset. ``len(mix)`` is the
    number of distinct samples, ``mix[i]`` and ``mix.get_batch`` index them source after
    source (see `offsets`), and a Loader's ``stats()["per_source"]`` counts the samples
    drawn from each.

    The sources must have been opened with ``stoker.Dataset(source, ...)``, with the same
    cache and fetch options: a Mix opens their sources again as one dataset.

    Args:
        datasets: One or more datasets opened with ``stoker.Dataset(source, ...)`` (not
            ``from_csv`` or ``from_files``, and not a Mix), sharing their cache, fetch,
            thread and ``arrays`` options.
        weights: Each source's share of an epoch: non-negative, not all 0, in any unit
            (they are normalised). Default: the sources' sizes, so that an epoch reads
            every sample once.
        epoch_samples: Samples in an epoch, at least 1. Default: the sources' sizes added
            up.

    Attributes:
        weights: The weights, as floats.
        epoch_samples: Samples in an epoch.
        offsets: Where each source's samples start among the Mix's indices, and where the
            last ends (``len(datasets) + 1`` numbers).
        sources: Each dataset's source, as it was opened.

    Raises:
        UsageError: The datasets or weights cannot be mixed; the message says why.
    """

    def __init__(
        self,
        datasets: Sequence[Dataset],
        weights: Sequence[float] | None = None,
        epoch_samples: int | None = None,
    ) -> None:
        datasets = list(datasets)
        if not datasets or not all(isinstance(d, Dataset) for d in datasets):
            raise UsageError("stoker.Mix takes a list of one or more stoker.Dataset")
        if any(isinstance(d, Mix) for d in datasets):
            raise UsageError("a Mix of Mixes: list their sources in one Mix instead")
        if any(d.fetch is None for d in datasets):
            raise UsageError(
                "a Mix opens its sources again as one dataset: Dataset.from_csv and "
                "from_files datasets cannot be; pack them into shards (stoker pack) first"
            )
        first = datasets[0]
        for d in datasets[1:]:
            for name in ("cache_dir", "cache_limit", "num_threads", "fetch", "arrays"):
                if getattr(d, name) != getattr(first, name):
                    raise UsageError(
                        f"a Mix's sources must share their {name}: {first.source!r} has "
                        f"{getattr(first, name)!r}, {d.source!r} has {getattr(d, name)!r}"
                    )
        weights = [float(w) for w in weights] if weights is not None else None
        if weights is None:
            weights = [float(len(d)) for d in datasets]  # every sample once an epoch
        if len(weights) != len(datasets):
            raise UsageError(f"{len(datasets)} datasets but {len(weights)} weights")
        if not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
            raise UsageError(f"weights must be non-negative numbers, not all 0: {weights}")
        if any(w > 0 and len(d) == 0 for w, d in zip(weights, datasets)):
            raise UsageError("a source with no samples cannot have a weight")
        sizes = [len(d) for d in datasets]
        # A list of Sources (some may be lists themselves), which resolve() flattens: more
        # nesting than the Source alias spells out, hence Any.
        sources: list[Any] = [d.source for d in datasets]
        super().__init__(
            sources,
            cache_dir=first.cache_dir,
            cache_limit=first.cache_limit,
            num_threads=first.num_threads,
            fetch=first.fetch,
            arrays=first.arrays,
        )
        if len(self) != sum(sizes):
            raise UsageError(
                f"the sources hold {sum(sizes)} samples but opened together {len(self)}: one "
                "changed since it was opened; open them again"
            )
        if epoch_samples is None:
            epoch_samples = sum(sizes)
        if epoch_samples < 1:
            raise UsageError(f"epoch_samples must be at least 1, not {epoch_samples}")
        self.weights = weights
        self.epoch_samples = int(epoch_samples)
        #: Where each source's samples start among the Mix's (and where the last ends).
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.sources = [os.fspath(d.source) if isinstance(d.source, os.PathLike) else d.source
                        for d in datasets]  # fmt: skip

    def source_of(self, indices: np.ndarray) -> np.ndarray:
        """The source of each sample of `indices`.

        Args:
            indices: Indices into the Mix.

        Returns:
            For each index, the position of its dataset in `datasets`.
        """
        return np.searchsorted(self.offsets, indices, side="right") - 1

    def group_counts(self) -> tuple[int, ...]:
        """How many of the sampler's groups each source has (they follow one another)."""
        ends = np.cumsum(self.members.group_sizes())
        cut = np.searchsorted(ends, self.offsets[1:], side="left") + 1
        cut[self.offsets[1:] == 0] = 0
        return tuple(int(c) for c in np.diff(np.concatenate([[0], cut])))

    def __repr__(self) -> str:
        return (
            f"Mix({len(self.weights)} sources, weights {self.weights}, "
            f"{self.epoch_samples} samples an epoch)"
        )
