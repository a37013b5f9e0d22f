"""Field decoders for the Loader's fast path: how each named field of a whole batch is
laid out in the batch buffer and handed out, with no Python per sample."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np


@dataclass(frozen=True)
class Raw:
    """Member bytes are one fixed-shape array: ``Raw((3, 64, 64), "uint8")``.
    The batch gets a ``(batch, *shape)`` tensor viewing the buffer."""

    shape: tuple[int, ...]
    dtype: str = "uint8"

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        np.dtype(self.dtype)  # fail early on a bad dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Int:
    """Member bytes are an ASCII integer, as WebDataset's ``.cls`` (or an integer column such
    as ``from_csv``'s label): an optional sign and 1 to 18 digits, whitespace around them
    allowed. The batch gets an int64 tensor of shape ``(batch,)``."""


@dataclass(frozen=True)
class Npy:
    """The row of a ``.npy`` shard (field ``npy``), or a ``.npy`` file stored (not compressed)
    as a member of a tar or zip. The batch gets a ``(batch, *shape)`` tensor viewing the
    buffer; every sample of a batch must share dtype and shape."""


@dataclass(frozen=True)
class Bytes:
    """Variable-length bytes (a JPEG, a JSON text). The batch gets a list of uint8 arrays
    viewing the buffer, for ``map=`` or a decoder downstream."""


FieldSpec = Union[Raw, Int, Npy, Bytes]
