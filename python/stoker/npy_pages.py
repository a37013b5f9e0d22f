"""The .npy files of the device paths: a file's layout, checked by the one .npy header
reader (in C++), and headers padded so that the data starts on a page, where GPUDirect
reads it straight into device memory."""

from __future__ import annotations

import numpy as np

from stoker._core import npy_header
from stoker.errors import ShardFormatError, StokerError, located

PAGE = 4096  # GPUDirect reads whole 4 KiB pages at page-aligned device addresses


def npy_layout(
    path: str, *, fortran_ok: bool = False
) -> tuple[np.dtype, tuple[int, ...], int, int, bool]:
    """dtype, shape, data offset, data bytes and whether it is Fortran-ordered (with more
    than one axis longer than 1: only when `fortran_ok`) of the .npy at `path`, checked
    against its size (by the one .npy header reader, in C++)."""
    try:
        header = npy_header(path)
    except ShardFormatError as e:
        why = getattr(e, "detail", e)
        offset = getattr(e, "offset", 0)
        raise located(ShardFormatError, path, offset, f"not a .npy file: {why}") from e
    dtype, shape = np.dtype(header["descr"]), tuple(header["shape"])
    fortran = bool(header["fortran_order"]) and sum(d > 1 for d in shape) > 1
    if fortran and not fortran_ok:
        raise located(
            ShardFormatError,
            path,
            0,
            "a Fortran-ordered .npy cannot be loaded as it is; save np.ascontiguousarray(a)",
        )
    if not dtype.isnative and dtype.itemsize > 1:
        raise located(
            ShardFormatError,
            path,
            0,
            f"a .npy of byte-swapped {dtype} has no torch "
            "type; save a.astype(a.dtype.newbyteorder('='))",
        )
    return dtype, shape, int(header["data_offset"]), int(header["data_bytes"]), fortran


def page_aligned_header(
    dtype: np.dtype, shape: tuple[int, ...], *, fortran_order: bool = False
) -> bytes:
    """A version 1.0 .npy header padded with spaces so the data starts at a page boundary."""
    text = repr(
        {
            "descr": np.lib.format.dtype_to_descr(dtype),
            "fortran_order": fortran_order,
            "shape": tuple(int(d) for d in shape),
        }
    )
    preamble = 10  # magic, version, 2-byte header length
    length = -(-(preamble + len(text) + 1) // PAGE) * PAGE - preamble
    if length > 0xFFFF:
        raise StokerError(f"GDSCache: a {len(shape)}-dimensional shape is too long for a header")
    body = (text + " " * (length - len(text) - 1) + "\n").encode("latin1")
    return b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body
