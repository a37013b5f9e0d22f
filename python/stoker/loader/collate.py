"""The flexible path: map= over each sample on a thread pool, then collate=."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from stoker._process import ProcessLocal
from stoker.errors import StokerError


class MapRunner:
    """map= over a batch: one task per thread-sized chunk, not a future per sample (a
    future costs more than a cheap map function), the caller taking a chunk too. Its
    threads are this process's: a forked child (a DataLoader worker) makes its own."""

    def __init__(self, fn: Callable[[Any], Any], threads: int) -> None:
        self.fn = fn
        self.threads = threads
        self._executor = ProcessLocal(self._make_executor)

    def _make_executor(self) -> ThreadPoolExecutor:
        executor = ThreadPoolExecutor(self.threads - 1, "stoker-map")
        weakref.finalize(self, executor.shutdown, wait=False)
        return executor

    def __call__(self, samples: list[dict[str, Any]]) -> list[Any]:
        fn = self.fn
        chunks = min(self.threads, len(samples))
        if chunks <= 1:
            return [fn(s) for s in samples]
        executor = self._executor.get()
        bounds = np.linspace(0, len(samples), chunks + 1).astype(int).tolist()
        parts = [samples[a:b] for a, b in zip(bounds, bounds[1:])]

        def run(part: list[dict[str, Any]]) -> list[Any]:
            return [fn(s) for s in part]

        futures = [executor.submit(run, p) for p in parts[1:]]
        out = [fn(s) for s in parts[0]]
        for future in futures:
            out.extend(future.result())
        return out


def default_collate(samples: list[Any]) -> Any:  # samples: dicts, or whatever map= returned
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
