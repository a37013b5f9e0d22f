"""Table sources: Parquet files (the Hugging Face Hub's format) and Arrow IPC files
(``datasets``' cache and ``save_to_disk`` folders), whose rows are samples and whose leaf
columns are fields.

At open, each file's metadata is read once: a Parquet footer by stoker's own Thrift reader,
an Arrow file's buffers by pyarrow. Parquet values are then decoded per batch by the C++
reader (``COLUMN_VALUE`` members): each column chunk a batch touches is read and decoded
once, kept for the batches after it, and each row's value copied out. Arrow values are byte
ranges of the file, read in place as tar members are. Nothing per batch calls pyarrow.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from stoker.errors import ReadError, located
from stoker.tables.arrow import arrow_fields
from stoker.tables.parquet import parquet_fields, read_footer
from stoker.tables.table_fields import TableField as TableField


def index_table_source(path: str, fmt: str) -> dict:
    """The index of a table file: ``{"format": "table", "rows", "fields", "groups",
    "identity"}``: a TableField per leaf column, and the row groups (Parquet's, or an Arrow
    file's record batches), the sampler's groups."""
    try:
        with open(path, "rb") as f:
            stat = os.fstat(f.fileno())
            if fmt == "parquet":

                def read(offset: int, length: int) -> bytes:
                    return os.pread(f.fileno(), length, offset)

                meta = read_footer(path, read, stat.st_size)
                rows, fields, groups = parquet_fields(path, meta, read)
    except OSError as e:
        raise located(ReadError, path, 0, f"cannot read it: {e.strerror or e}", e.errno) from e
    if fmt != "parquet":
        rows, fields, groups = arrow_fields(path)
    return {
        "format": "table",
        "rows": rows,
        "fields": fields,
        "groups": np.asarray(groups, np.int64),
        "identity": (stat.st_ino, stat.st_size, stat.st_mtime_ns),
    }


def remote_table_index(url: str, size: int, read: Callable[[int, int], bytes]) -> dict:
    """What a remote Parquet file's footer says (its rows and fields), read with
    `read(offset, length)` range requests: enough to count its samples before it is
    fetched."""
    rows, fields, groups = parquet_fields(url, read_footer(url, read, size))
    return {"format": "table", "rows": rows, "fields": fields, "groups": groups}
