"""What a batch of patches must hold: numpy's slices of the arrays it was read from."""

from __future__ import annotations

import numpy as np


def expected_patch(data, start, size, pad=0):
    """data[start : start + size] with what lies outside the array as `pad`."""
    out = np.full(size + data.shape[len(size) :], pad, dtype=data.dtype)
    src, dst = [], []
    for st, p, s in zip(start, size, data.shape):
        lo, hi = max(st, 0), min(st + p, s)
        src.append(slice(lo, hi))
        dst.append(slice(lo - st, hi - st))
    out[tuple(dst)] = data[tuple(src)]
    return out


def all_batches(loader):
    return [b for b in loader]


def check_batches(loader, truth, key="image", pad=0, patch_size=None):
    """Every patch of `loader` (a PatchLoader, or any iterable of its batches with their
    `patch_size`) equals numpy's slice of the truth arrays (channel axis first)."""
    patch_size = patch_size or loader.patch_size
    seen = 0
    for batch in loader:
        for b in range(len(batch["subject_index"])):
            s = int(batch["subject_index"][b])
            start = tuple(int(v) for v in batch["location"][b])
            want = expected_patch(truth[s], start, patch_size, pad)
            want = np.moveaxis(want, range(len(start), want.ndim), range(want.ndim - len(start)))
            got = batch[key][b].numpy()
            assert (
                got.shape
                == (max(1, int(np.prod(want.shape[: want.ndim - len(start)]))),) + patch_size
            )
            np.testing.assert_array_equal(got.reshape(want.shape), want)
            seen += 1
    return seen
