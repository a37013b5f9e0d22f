"""Array sources: HDF5 files and Zarr stores, whose arrays' rows are samples.

At open, the layout of each array is learnt once (HDF5's through h5py, Zarr's from its
JSON): where its bytes are, in one contiguous block or in chunks, and which filters
encode the chunks. Reads then go through the C++ reader like any shard's members, with
no HDF5 or Zarr call per batch and no lock: rows stored as they are used are read in
place; rows of encoded chunks (``ARRAY_ROW`` members) are grouped by chunk, each chunk
of a batch read and decoded once by the reader's threads, and the rows copied out.

Each format's module registers its opener (:mod:`.registry`); which format a source is,
by its name, is told by ``stoker.formats``.
"""

from __future__ import annotations

from collections.abc import Sequence

# Imported for what they register: the openers of their formats.
from stoker.arrays import hdf5 as hdf5
from stoker.arrays import zarr as zarr
from stoker.arrays.array_fields import ArrayField as ArrayField
from stoker.arrays.codec_libraries import codec_status as codec_status
from stoker.arrays.registry import array_format_named


def index_array_source(path: str, fmt: str, arrays: Sequence[str] | None = None) -> dict:
    """The index of an array source: ``{"format": "array", "rows", "fields", "identity"}``
    with one ArrayField per array whose first axis has the source's length (or each of
    `arrays`)."""
    opener = array_format_named(fmt)
    rows, fields = opener.find_arrays(path, arrays)
    return {"format": "array", "rows": rows, "fields": fields, "identity": opener.identity(path)}
