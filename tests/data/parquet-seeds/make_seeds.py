"""Writes the Parquet seeds of the fuzzer (scripts/fuzz.sh, format "parquet") with
pyarrow: tiny files (a few hundred bytes to a few KiB) covering what the page decoder
reads (PLAIN and dictionary pages, v1 and v2 pages, nulls, lists, struct leaves, each
codec), and two cut short. Deterministic for one pyarrow version; run from the
repository root:

    python tests/data/parquet-seeds/make_seeds.py
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent


def _table(nulls: bool) -> pa.Table:
    n = 24
    ints = [None if nulls and i % 5 == 0 else i * 7 - 40 for i in range(n)]
    words = [None if nulls and i % 4 == 1 else "w" * (i % 6) for i in range(n)]
    lists = [None if nulls and i % 6 == 2 else list(range(i % 4)) for i in range(n)]
    images = [
        None if nulls and i % 7 == 3 else {"bytes": bytes([i]) * (i % 3), "path": f"{i}.png"}
        for i in range(n)
    ]
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    return pa.table(
        {
            "i": pa.array(ints, pa.int32()),
            "d": pa.array([None if v is None else v / 4 for v in ints], pa.float64()),
            "b": pa.array([None if v is None else v % 3 == 0 for v in ints], pa.bool_()),
            "s": pa.array(words, pa.string()),
            "f": pa.array(
                [None if w is None else (w + "xyz")[:3].encode() for w in words], pa.binary(3)
            ),
            "l": pa.array(lists, pa.list_(pa.int64())),
            "image": pa.array(images, image_type),
        }
    )


def _write(path: Path, table: pa.Table, **options: object) -> None:
    pq.write_table(
        table, path, store_schema=False, data_page_size=128, write_batch_size=8, **options
    )


def write_seeds(folder: Path = HERE) -> list[Path]:
    seeds = {
        "plain.parquet": (False, {"use_dictionary": False, "compression": "none"}),
        "dictionary.parquet": (False, {"use_dictionary": True, "compression": "snappy"}),
        "v2.parquet": (True, {"data_page_version": "2.0", "compression": "zstd"}),
        "nulls.parquet": (True, {"compression": "gzip", "row_group_size": 10}),
        "list.parquet": (True, {"compression": "lz4", "use_dictionary": False}),
    }
    written = []
    for name, (nulls, options) in seeds.items():
        path = folder / name
        _write(path, _table(nulls), **options)
        written.append(path)
    plain = (folder / "plain.parquet").read_bytes()
    cut = {
        "truncated-footer.parquet": plain[:-12],  # the footer's tail, length and PAR1 lost
        "truncated-pages.parquet": plain[: len(plain) // 2] + plain[-8:],
    }
    for name, content in cut.items():
        (folder / name).write_bytes(content)
        written.append(folder / name)
    return written


if __name__ == "__main__":
    for path in write_seeds():
        print(path.name, path.stat().st_size)
