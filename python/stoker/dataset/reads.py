"""Reading members with the C++ reader: the process's readers, and whole sets of member
rows read into one buffer and handed out as sample dicts viewing it."""

from __future__ import annotations

from typing import Any

import numpy as np

import stoker._core as _core
from stoker._process import values
from stoker.dataset.members import NULL_VALUE, Gathered, MemberTable

#: Where each piece starts in a batch buffer: aligned so that any dtype can be viewed in
#: place (the C++ plan's alignment).
ALIGN = _core.ALIGN


def forget_everywhere(path: str) -> None:
    """Close the descriptors every reader of this process keeps for `path` (an evicted
    cache file's space is then freed)."""
    for value in values():
        if isinstance(value, _core.ShardReader):
            value.forget(path)


def aligned_offsets(lengths: np.ndarray) -> tuple[np.ndarray, int]:
    """Offsets that put pieces of `lengths` bytes back to back, each ALIGN-aligned, and the
    bytes they take in all."""
    padded = (lengths + (ALIGN - 1)) & ~np.uint64(ALIGN - 1)
    ends = np.cumsum(padded, dtype=np.uint64)
    starts = ends - padded
    return starts, int(ends[-1]) if len(ends) else 0


def submit_members(
    table: MemberTable,
    members: Gathered,
    reader: _core.ShardReader,
) -> _core.PendingRead:
    """Start reading gathered `members`: each lands, decoded (inflated, CRC-checked), at
    the next aligned offset of a new buffer."""
    out = members.out
    dest, size = aligned_offsets(out)
    codecs = members.codec
    compressed = bool(codecs.any())
    return reader.read(
        table.files,
        members.file,
        members.offset,
        members.length,
        dest,
        size,
        out_lengths=out,
        codecs=codecs if compressed else None,
        crcs=members.crc if compressed else None,
        arrays=members.array if table.arrays or table.columns else None,
    )


def samples_from(
    table: MemberTable,
    buffer: np.ndarray,
    indices: np.ndarray,
    members: Gathered,
) -> list[dict[str, Any]]:
    """Sample dicts viewing `buffer`, as submit_members(members) read it."""
    lengths = members.out
    starts, _ = aligned_offsets(lengths)
    nulls = set(np.flatnonzero(members.length == NULL_VALUE).tolist())
    fields = members.field.tolist()
    decoders = members.decoder.tolist()
    begins = starts.tolist()
    lengths = lengths.tolist()
    bounds = members.bounds.tolist()
    extras = {name: values[indices].tolist() for name, values in table.extras.items()}
    names = table.field_names
    samples = []
    for s, key in enumerate(table.keys(indices)):
        sample: dict[str, Any] = {"__key__": key}
        for m in range(bounds[s], bounds[s + 1]):
            if nulls and m in nulls:  # a table's null value: left out, as a missing member is
                continue
            view = buffer[begins[m] : begins[m] + lengths[m]]
            decoder = table.decoders[decoders[m]]
            if decoder is not None:
                dtype, shape = decoder
                view = view.view(dtype).reshape(shape)
            sample[names[fields[m]]] = view
        for name, column in extras.items():
            sample[name] = column[s]
        samples.append(sample)
    return samples
