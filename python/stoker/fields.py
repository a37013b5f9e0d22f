"""Field decoders for the Loader's fast path: how each named field of a whole batch is
laid out in the batch buffer and handed out, with no Python per sample."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np

import stoker._core as _core
from stoker.errors import StokerError, UsageError


@dataclass(frozen=True)
class Raw:
    """Member bytes are one fixed-shape array: ``Raw((3, 64, 64), "uint8")``.
    The batch gets a ``(batch, *shape)`` tensor viewing the buffer.

    Each member's size is checked against the shape: a member of another size is an
    error.

    Args:
        shape: One sample's shape; ``()`` for a scalar.
        dtype: A numpy dtype name for the stored values (as stored: little-endian
            ``int64`` for an MDS ``int`` column, for instance).

    Raises:
        TypeError: `dtype` is not a numpy dtype.
    """

    shape: tuple[int, ...]
    dtype: str = "uint8"

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        np.dtype(self.dtype)  # fail early on a bad dtype

    @property
    def nbytes(self) -> int:
        """Bytes of one sample's value."""
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Int:
    """Member bytes are an ASCII integer, as WebDataset's ``.cls`` (or an integer column such
    as ``from_csv``'s label): an optional sign and 1 to 18 digits, whitespace around them
    allowed. The batch gets an int64 tensor of shape ``(batch,)``.

    The integers are parsed by the reader's threads. Takes no arguments.
    """


@dataclass(frozen=True)
class Npy:
    """The row of a ``.npy`` shard (field ``npy``), or a ``.npy`` file stored (not compressed)
    as a member of a tar or zip. The batch gets a ``(batch, *shape)`` tensor viewing the
    buffer; every sample of a batch must share dtype and shape.

    The members' ``.npy`` headers are read into a side region of the batch and checked
    against the batch's first; their data lands as one array. Takes no arguments.
    """


@dataclass(frozen=True)
class Row(Npy):
    """A row of an array source (an HDF5 dataset, a Zarr array; also a ``.npy`` shard's
    row): its dtype and shape are the array's. The batch gets a ``(batch, *row shape)``
    tensor, the rows read (and decoded, from compressed chunks) straight into it.

    Takes no arguments: the dtype and shape come from the array.
    """


@dataclass(frozen=True)
class Bytes:
    """Variable-length bytes (a JPEG, a JSON text). The batch gets a list of uint8 arrays
    viewing the buffer, for ``map=`` or a decoder downstream.

    A Parquet value is handed out where its read leaves it: one of 4 KiB or more in a
    decoded unit the decoded-chunk cache keeps (decompressed pages) is a read-only view of
    that unit, which it keeps alive; ``v.copy()`` gives a writable copy of its own.

    Takes no arguments. ``bytes(v)`` of a value gives ``bytes``.
    """


def require_image_support(what: str) -> None:
    """A StokerError saying what to install, unless this build decodes images."""
    if not _core.image_support():
        raise StokerError(
            f"{what} needs image support, and this build of stoker was made without "
            "libjpeg-turbo and libpng: install their development files (Debian: apt-get "
            "install libjpeg62-turbo-dev libpng-dev; Ubuntu: libjpeg-turbo8-dev libpng-dev) "
            "and reinstall stoker"
        )


_CROPS = {"random": _core.Crop.RANDOM, "center": _core.Crop.CENTER, "none": _core.Crop.NONE}
_LAYOUTS = ("NCHW", "NHWC")
_ON_ERROR = ("raise", "blank")


@dataclass(frozen=True)
class Image:
    """A JPEG or PNG member, decoded, cropped and resized by the reader's C++ threads straight
    into the batch: a uint8 tensor ``(batch, 3, H, W)`` (``layout="NCHW"``) or ``(batch, H, W,
    3)`` (``"NHWC"``), RGB.

    ``crop="random"``: a random area (``scale``, a fraction of the image's) and aspect ratio
    (``ratio``, width over height, drawn log-uniformly), ten tries, then the whole image cut
    to the nearest allowed ratio; ``flip=True`` adds a horizontal flip half the time. The
    draws depend only on the Loader's seed, the epoch and the sample's index.
    ``crop="center"``: the shorter side resized to ``size / 0.875``, the centre kept.
    ``crop="none"``: the whole image resized to ``size``.
    ``on_error="blank"``: a member that does not decode becomes zeros, is counted in
    ``loader.stats()["images_blanked"]`` and its key is logged once; ``"raise"`` stops with a
    ShardFormatError naming the member.

    Args:
        size: The output's ``(height, width)``, or one int for a square.
        crop: ``"random"``, ``"center"`` or ``"none"``, as above.
        scale: For ``crop="random"``: the range of the crop's area, as a fraction of the
            image's.
        ratio: For ``crop="random"``: the range of the crop's aspect ratio, width over
            height.
        flip: Flip horizontally half the time (drawn from the seed, like the crop).
        layout: ``"NCHW"`` (the batch is ``(batch, 3, H, W)``) or ``"NHWC"``.
        on_error: ``"raise"`` or ``"blank"``, as above.

    Raises:
        UsageError: An argument is not one of the values above.
        StokerError: This build of stoker was made without libjpeg-turbo and libpng; the
            message says what to install.
    """

    size: tuple[int, int] | int = (224, 224)  # a (height, width) tuple once made
    crop: str = "random"
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: bool = False
    layout: str = "NCHW"
    on_error: str = "raise"
    target: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        size = (self.size, self.size) if isinstance(self.size, int) else tuple(self.size)
        if len(size) != 2 or not all(isinstance(d, int) and d > 0 for d in size):
            raise UsageError(f"Image(size=) is (height, width) or one int, not {self.size!r}")
        for name, value, allowed in (
            ("crop", self.crop, tuple(_CROPS)),
            ("layout", self.layout, _LAYOUTS),
            ("on_error", self.on_error, _ON_ERROR),
        ):
            if value not in allowed:
                raise UsageError(
                    f"Image({name}={value!r}): use one of " + ", ".join(map(repr, allowed))
                )
        require_image_support("stoker.Image()")
        scale = tuple(float(v) for v in self.scale)
        ratio = tuple(float(v) for v in self.ratio)
        try:
            target = _core.ImageTarget(
                size[0],
                size[1],
                _CROPS[self.crop],
                scale,
                ratio,
                bool(self.flip),
                self.layout == "NHWC",
                self.on_error == "blank",
            )
        except (ValueError, TypeError) as e:
            raise UsageError(f"Image: {e}") from e
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "ratio", ratio)
        object.__setattr__(self, "target", target)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # The C++ target is made again on the other side.
        args = (self.size, self.crop, self.scale, self.ratio, self.flip, self.layout)
        return (Image, (*args, self.on_error))

    @property
    def shape(self) -> tuple[int, int, int]:
        """One sample's shape."""
        return tuple(self.target.shape)


FieldSpec = Union[Raw, Int, Npy, Row, Bytes, Image]
