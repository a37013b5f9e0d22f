"""Tables are indexed a piece at a time: runs of row groups, made from the file's metadata
when a batch first reads one, let go of and made again like shards. A file of many rows
then costs a shuffled epoch the row groups it reads, not the whole file for every group."""

from __future__ import annotations

import os

import numpy as np
import pytest

import stoker
from stoker.dataset.shard_rows import PIECE_MAX_ROWS, PIECE_MIN_ROWS, table_pieces
from tests.support.server import ShardServer

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


@pytest.mark.parametrize(
    ("rows", "groups", "pieces"),
    [
        (10_000, [1000] * 10, [1000] * 10),
        (2000, [100] * 20, [600, 600, 600, 200]),
        (200_000, [200_000], [PIECE_MAX_ROWS] * 3 + [200_000 - 3 * PIECE_MAX_ROWS]),
        (70_000, None, [PIECE_MAX_ROWS, 70_000 - PIECE_MAX_ROWS]),
        (66_036, [500, PIECE_MAX_ROWS], [500, PIECE_MAX_ROWS]),
        (0, [], [0]),
        (10, [3, 7], [10]),
    ],
)
def test_pieces_are_runs_of_whole_row_groups(rows, groups, pieces):
    found = table_pieces(rows, None if groups is None else np.array(groups, np.int64))
    assert found.tolist() == pieces
    assert PIECE_MIN_ROWS <= 600


def _many_groups(path: str, n: int, group: int, seed: int = 0) -> pa.Table:
    """A file of `n` rows in row groups of `group`: an int64 label, a text of varying
    length, and past row 3000 a null in another text every 97th row."""
    rng = np.random.default_rng(seed)
    table = pa.table(
        {
            "label": pa.array(np.arange(n, dtype=np.int64) * 7 + seed, pa.int64()),
            "text": pa.array(
                [f"row {i} " + "x" * int(k) for i, k in enumerate(rng.integers(0, 40, n))]
            ),
            "note": pa.array([None if i % 97 == 0 and i > 3000 else str(i) for i in range(n)]),
        }
    )
    pq.write_table(table, path, row_group_size=group, compression="snappy")
    return table


def _resident_rows(ds) -> list[int]:
    return [index.samples for index in ds.members._resident.values()]


def test_a_shuffled_epoch_of_a_file_of_many_row_groups_holds_a_few_of_them(tmp_path):
    path = str(tmp_path / "big.parquet")
    table = _many_groups(path, 30_000, 700)
    ds = stoker.Dataset(path)
    assert len(ds) == 30_000
    loader = stoker.Loader(
        ds, batch_size=64, shuffle=True, seed=3, shuffle_window=4,
        fields={"label": stoker.Int(), "text": stoker.Bytes()},
    )  # fmt: skip
    ds.members.table_capacity = 6  # fewer pieces than the file has: they are let go of
    labels = table.column("label").to_numpy()
    texts = table.column("text").to_pylist()
    seen = np.zeros(len(ds), np.int64)
    most = 0
    for batch in loader:
        rows = np.array([int(k.rsplit("/", 1)[1]) for k in batch["__key__"]])
        seen[rows] += 1
        assert batch["label"].tolist() == labels[rows].tolist()
        assert [bytes(t).decode() for t in batch["text"]] == [texts[r] for r in rows]
        held = _resident_rows(ds)
        most = max(most, sum(held))
        assert max(held) <= 1400  # a piece is a run of 700-row groups, not the file
    assert (seen == 1).all()
    assert most < len(ds) // 2


def test_pieces_let_go_of_come_back_the_same_and_keys_count_from_the_file(tmp_path):
    path = str(tmp_path / "big.parquet")
    table = _many_groups(path, 5_000, 600)
    ds = stoker.Dataset(path)
    assert ds.keys([0, 4321, 4999]) == ["big/0", "big/4321", "big/4999"]
    ds.members.table_capacity = 1
    rows = [4321, 7, 2600, 4321, 1, 4999]
    for row in rows:  # each in another piece than the last: every read indexes one again
        sample = ds[row]
        assert int(sample["label"]) == row * 7
        assert bytes(sample["text"]).decode() == table.column("text")[row].as_py()
        assert ("note" in sample) == (row % 97 != 0 or row < 3000)
    assert ds.members.resident_count <= 2


def test_a_null_asked_for_in_a_later_piece_names_its_row(tmp_path):
    path = str(tmp_path / "big.parquet")
    _many_groups(path, 5_000, 600)
    ds = stoker.Dataset(path)
    loader = stoker.Loader(ds, batch_size=1000, fields={"note": stoker.Bytes()})
    with pytest.raises(
        stoker.ShardFormatError, match=r"big\.parquet.*row 3007 \(sample 3007\) is null"
    ):
        list(loader)


def test_several_files_of_many_groups_under_dataloader_fork_workers(tmp_path):
    torch = pytest.importorskip("torch")
    tables = [
        _many_groups(str(tmp_path / f"part-{i}.parquet"), 3_000, 500, seed=i) for i in range(3)
    ]
    ds = stoker.Dataset(str(tmp_path))
    ds[4_000]  # a piece indexed in the parent first: the workers inherit it
    loader = torch.utils.data.DataLoader(
        ds, batch_size=50, num_workers=2, multiprocessing_context="fork", collate_fn=lambda x: x,
        sampler=torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(0)),
    )  # fmt: skip
    got = sorted(int(sample["label"]) for batch in loader for sample in batch)
    assert got == sorted(v for t in tables for v in t.column("label").to_pylist())


def test_a_remote_file_of_more_rows_than_a_piece(tmp_path):
    folder = tmp_path / "served"
    folder.mkdir()
    n = PIECE_MAX_ROWS + 4_000
    labels = np.arange(n, dtype=np.int64) * 3
    pq.write_table(pa.table({"label": labels}), folder / "long.parquet", row_group_size=20_000)
    with ShardServer(str(folder)) as server:
        ds = stoker.Dataset(server.url_for("long.parquet"), cache_dir=tmp_path / "cache")
        loader = stoker.Loader(
            ds, batch_size=4096, shuffle=True, seed=0, fields={"label": stoker.Int()}
        )
        got = np.concatenate([batch["label"].numpy() for batch in loader])
    assert np.array_equal(np.sort(got), labels)
    assert os.path.getsize(folder / "long.parquet") > 0


def test_a_layout_that_fails_to_be_made_leaves_later_reads_right(tmp_path, monkeypatch):
    """A column layout made for one file, then a failure making the next: the file table
    must still hold every layout at the place members name it by."""
    for name, base in (("a", 0), ("b", 1000)):
        n = np.arange(base, base + 10, dtype=np.int64)
        pq.write_table(
            pa.table({"x": n, "y": n * 2 + 1, "z": n * 3 + 2}), tmp_path / f"{name}.parquet"
        )
    ds = stoker.Dataset(str(tmp_path))
    made = stoker._core.ColumnLayout
    calls = []

    def flaky(*args):
        calls.append(args[0])
        if len(calls) == 2:
            raise stoker.ShardFormatError("a damaged column, once")
        return made(*args)

    monkeypatch.setattr(stoker._core, "ColumnLayout", flaky)
    with pytest.raises(stoker.ShardFormatError, match="once"):
        ds.get_batch([0])
    got = {}
    for batch in stoker.Loader(ds, batch_size=7, fields={"x": stoker.Int(), "z": stoker.Int()}):
        got.update(zip(batch["x"].tolist(), batch["z"].tolist()))
    assert got == {v: 3 * v + 2 for v in [*range(10), *range(1000, 1010)]}


def test_a_table_read_again_is_the_same_only_if_it_lays_its_values_out_alike(tmp_path):
    from stoker.dataset.members import same_index
    from stoker.tables import index_table_source

    first, second = str(tmp_path / "first.parquet"), str(tmp_path / "second.parquet")
    _many_groups(first, 2_000, 600)
    _many_groups(second, 2_000, 600, seed=5)  # the same rows, other text
    ds = stoker.Dataset(first)
    assert same_index(ds.members, 0, index_table_source(first, "parquet"))
    assert not same_index(ds.members, 0, index_table_source(second, "parquet"))


def test_keys_of_tables_npy_and_tar_in_one_dataset(tmp_path):
    """Numbered keys (a table's rows, a .npy's) are the file's stem and the row in it, in
    any order and across files and pieces; a batch that also holds a tar shard's samples
    gets theirs from its index."""
    import io
    import tarfile

    _many_groups(str(tmp_path / "a.parquet"), 2000, 100)
    _many_groups(str(tmp_path / "b.parquet"), 1500, 700, seed=1)
    np.save(tmp_path / "c.npy", np.arange(30, dtype=np.int64).reshape(10, 3))
    with tarfile.open(tmp_path / "d.tar", "w") as tar:
        for i in range(5):
            info = tarfile.TarInfo(f"s{i:02d}.cls")
            info.size = 1
            tar.addfile(info, io.BytesIO(b"7"))
    paths = [str(tmp_path / f) for f in ("a.parquet", "b.parquet", "c.npy")]
    truth = [f"a/{i}" for i in range(2000)] + [f"b/{i}" for i in range(1500)]
    truth += [f"c/{i}" for i in range(10)]
    numbered = stoker.Dataset(paths)
    order = np.random.default_rng(0).permutation(len(truth))
    assert numbered.keys(order) == [truth[i] for i in order]
    assert numbered.keys([]) == []
    mixed = stoker.Dataset([*paths, str(tmp_path / "d.tar")])
    truth += [f"s{i:02d}" for i in range(5)]
    order = np.random.default_rng(1).permutation(len(truth))
    assert mixed.keys(order) == [truth[i] for i in order]
    assert mixed.keys(order[-7:]) == [truth[i] for i in order[-7:]]
