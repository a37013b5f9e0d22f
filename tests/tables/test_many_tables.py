"""A dataset of many Parquet files opens from their footers summed up in C++ (rows, row
groups, a key of how the columns read): one file of each kind is read whole at open, the
others when a batch first reads them. Damaged files are still named, at open or then."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import stoker
import stoker._core as _core
from stoker.tools.inspect import index as stoker_index

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

FILES = 12
ROWS = 300


def _write(path, i: int, rows: int = ROWS, **options) -> pa.Table:
    rng = np.random.default_rng(i)
    table = pa.table(
        {
            "label": pa.array(np.arange(rows, dtype=np.int64) + 1000 * i),
            "blob": pa.array([rng.bytes(int(k)) for k in rng.integers(0, 50, rows)], pa.binary()),
        }
    )
    pq.write_table(table, path, row_group_size=100, **options)
    return table


@pytest.fixture
def folder(tmp_path):
    tables = [_write(tmp_path / f"part-{i:03d}.parquet", i) for i in range(FILES)]
    return tmp_path, tables


def _every_row(ds) -> dict[int, bytes]:
    loader = stoker.Loader(
        ds,
        batch_size=64,
        shuffle=True,
        seed=2,
        fields={"label": stoker.Int(), "blob": stoker.Bytes()},
    )
    out = {}
    for batch in loader:
        out.update(zip(batch["label"].tolist(), (bytes(b) for b in batch["blob"])))
    return out


def _expected(tables) -> dict[int, bytes]:
    return {
        label: blob
        for t in tables
        for label, blob in zip(t.column("label").to_pylist(), t.column("blob").to_pylist())
    }


def test_one_file_is_read_at_open_and_the_others_when_a_batch_reads_them(folder):
    path, tables = folder
    ds = stoker.Dataset(str(path))
    assert len(ds) == FILES * ROWS
    assert sorted(ds.fields) == ["blob", "label"]
    assert len(ds.members.tables) == 1  # the others: their footers summed up only
    assert ds.members.group_sizes().tolist() == [100] * (FILES * ROWS // 100)
    assert _every_row(ds) == _expected(tables)
    assert len(ds.members.tables) == FILES


def test_the_summaries_match_what_the_footers_say(folder):
    path, _ = folder
    paths = sorted(str(p) for p in path.iterdir())
    rows, groups, identities, keys = _core.parquet_summaries(paths, 3)
    assert rows.tolist() == [ROWS] * FILES
    assert all(g.tolist() == [100, 100, 100] for g in groups)
    assert identities[:, 1].tolist() == [os.path.getsize(p) for p in paths]
    assert len(set(keys.tolist())) == 1


def test_files_whose_columns_read_otherwise_are_read_at_open(tmp_path):
    tables = [_write(tmp_path / "a.parquet", 0, compression="snappy")]
    tables.append(_write(tmp_path / "b.parquet", 1, compression="zstd"))
    tables.append(_write(tmp_path / "c.parquet", 2, compression="snappy"))
    tables.append(_write(tmp_path / "d.parquet", 3, use_dictionary=False))
    extra = _write(tmp_path / "e.parquet", 4).append_column("more", pa.array(range(ROWS)))
    pq.write_table(extra, tmp_path / "e.parquet", row_group_size=100)
    tables.append(extra)
    ds = stoker.Dataset(str(tmp_path))
    # a (snappy, dictionary), b (zstd), d (no dictionary: other encodings), e (a column more)
    assert sorted(ds.members.tables) == [0, 1, 3, 4]
    assert _every_row(ds) == _expected(tables)


def test_a_damaged_file_among_many_is_named_at_open(folder):
    path, _ = folder
    bad = path / "part-005.parquet"
    data = bad.read_bytes()
    bad.write_bytes(data[:-3])  # its closing magic cut off
    with pytest.raises(stoker.ShardFormatError, match=r"part-005\.parquet.*not a Parquet file"):
        stoker.Dataset(str(path))
    bad.write_bytes(b"PAR1" + b"\0" * 4)
    with pytest.raises(stoker.ShardFormatError, match=r"part-005\.parquet"):
        stoker.Dataset(str(path))


def test_a_file_that_changes_after_open_is_named_when_read(folder):
    path, _ = folder
    ds = stoker.Dataset(str(path))
    _write(path / "part-009.parquet", 9, rows=ROWS - 1)  # one row fewer, read later
    with pytest.raises(stoker.ShardFormatError, match=r"part-009\.parquet.*299 rows but 300"):
        _every_row(ds)


def test_a_missing_file_among_many_is_named_at_open(folder):
    path, _ = folder
    paths = sorted(str(p) for p in path.iterdir())
    os.unlink(paths[7])
    with pytest.raises(stoker.StokerError, match=r"part-007\.parquet"):
        stoker.Dataset(paths)


def test_stoker_index_writes_a_manifest_that_opens_without_a_footer(folder, monkeypatch):
    path, tables = folder
    written, entries = stoker_index(str(path))
    assert len(entries) == FILES
    first = entries[0]
    assert first["samples"] == ROWS and first["groups"] == [100, 100, 100]
    assert sorted(first["fields"]) == ["blob", "label"]
    assert len({e["columns_key"] for e in entries}) == 1

    def no_footers(*args, **kwargs):
        raise AssertionError("the manifest says what the footers would")

    monkeypatch.setattr(_core, "parquet_summaries", no_footers)
    ds = stoker.Dataset(str(path))
    assert len(ds) == FILES * ROWS and len(ds.members.tables) == 1
    assert _every_row(ds) == _expected(tables)


def test_a_manifest_of_a_file_since_rewritten_is_refused_naming_it(folder):
    path, _ = folder
    stoker_index(str(path))
    _write(path / "part-003.parquet", 3, rows=ROWS - 50)
    with pytest.raises(stoker.StokerError, match=r"part-003\.parquet"):
        stoker.Dataset(str(path))


def test_a_manifest_entry_without_its_groups_reads_the_footer(folder):
    path, tables = folder
    written, _ = stoker_index(str(path))
    with open(written) as f:
        manifest = json.load(f)
    manifest["shards"][4]["groups"] = [1, 2]  # does not add up: not believed
    del manifest["shards"][5]["columns_key"]
    with open(written, "w") as f:
        json.dump(manifest, f)
    ds = stoker.Dataset(str(path))
    assert _every_row(ds) == _expected(tables)
