"""Parquet files as datasets: every value byte-exact against pyarrow for each way pyarrow's
writer can be told to write it (codec, dictionary, page version, nulls, row groups, pages),
through ``Dataset`` and through a ``Loader``; files by other writers (``datasets``,
fastparquet); the ways a source is named; columns stoker cannot read; DataLoader workers;
and that a loader reads only the columns it asks for."""

from __future__ import annotations

import glob
import io
import os
import re

import numpy as np
import pytest

import stoker
from tests.support.tables import (
    NULLS_A,
    NULLS_B,
    assert_rows,
    assert_value,
    chunk_bytes,
    expected_rows,
    leaves,
    make_table,
    pages,
)

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

N = 100
CODECS = ["none", "snappy", "gzip", "zstd", "lz4"]  # pyarrow's "lz4" writes LZ4_RAW


def write(path, table, codec="snappy", dictionary=True, version="1.0", **kw) -> str:
    """`table` as pyarrow writes it, in small row groups (30 rows) of small pages."""
    options = {"row_group_size": 30, "data_page_size": 64, "write_batch_size": 8, **kw}
    pq.write_table(
        table,
        str(path),
        compression=None if codec == "none" else codec,
        use_dictionary=dictionary,
        data_page_version=version,
        **options,
    )
    return str(path)


def loader_rows(ds, fields, batch_size=32, **kw) -> dict[str, dict[str, np.ndarray]]:
    """Every sample a Loader gives, by key: its entries as numpy arrays."""
    loader = stoker.Loader(ds, batch_size=batch_size, fields=fields, **kw)
    out: dict[str, dict[str, np.ndarray]] = {}
    for batch in loader:
        keys = batch["__key__"]
        for name in fields:
            values = batch[name]
            if isinstance(values, list):
                assert len(values) == len(keys)
                got = [np.asarray(v) for v in values]
            else:
                assert values.shape[0] == len(keys), (name, values.shape)
                got = list(values.numpy())
            for key, value in zip(keys, got):
                out.setdefault(key, {})[name] = value
    assert len(out) == len(ds), "every sample once"
    return out


def key(stem: str, row: int) -> str:
    return f"{stem}/{row}"


def _clean(i: int) -> bool:
    return i % 10 not in (3, 7)


# -- byte-exact against pyarrow ---------------------------------------------------------------


@pytest.mark.parametrize("nulls", [False, True], ids=["no-nulls", "nulls"])
@pytest.mark.parametrize("version", ["1.0", "2.0"], ids=["v1", "v2"])
@pytest.mark.parametrize("dictionary", [True, False], ids=["dict", "plain"])
@pytest.mark.parametrize("codec", CODECS)
def test_every_value_byte_exact(tmp_path, codec, dictionary, version, nulls):
    table = make_table(N, seed=1, nulls=nulls)
    path = write(tmp_path / "rows.parquet", table, codec, dictionary, version)
    assert pq.ParquetFile(path).metadata.num_row_groups == 4
    assert len(pages(path, 0, 1)) > 1 and len(pages(path, 0, 13)) > 2  # several pages
    wanted = expected_rows(table)
    ds = stoker.Dataset(path)
    assert len(ds) == N
    names = {leaf.name for leaf in leaves(table.schema)}
    assert names <= set(ds.fields), sorted(names - set(ds.fields))

    rows = [i for i in range(N) if not nulls or _clean(i)]
    samples = ds.get_batch(rows)
    assert_rows(
        samples, [wanted[i] for i in rows], "parquet", table.schema, [key("rows", i) for i in rows]
    )
    # One at a time, and across row groups in any order, too.
    for i in (rows[-1], rows[0], 31):
        assert_rows([ds[i]], [wanted[i]], "parquet", table.schema, [key("rows", i)])
    backwards = rows[::-1]
    assert_rows(ds.get_batch(backwards), [wanted[i] for i in backwards], "parquet", table.schema)

    if nulls:
        for row, group in ((3, NULLS_A), (57, NULLS_B)):
            with pytest.raises(stoker.ShardFormatError) as e:
                ds.get_batch([0, row])
            message = str(e.value)
            assert "rows.parquet" in message
            assert re.search(rf"\brow {row}\b", message), message
            assert any(re.search(rf"\b{re.escape(c)}\b", message) for c in group), message
    _check_loaders(ds, table, wanted, nulls)


def _check_loaders(ds, table, wanted, nulls):
    by_name = {leaf.name: leaf for leaf in leaves(table.schema)}
    numbers = {n: leaf for n, leaf in by_name.items() if leaf.dtype is not None and not leaf.listed}
    variable = [n for n, leaf in by_name.items() if leaf.dtype is None or leaf.listed]
    ints = [n for n, leaf in numbers.items() if leaf.dtype.kind in "iu" and n != "u64"]
    if nulls:
        # A field with no nulls reads in every row; one with nulls is an error.
        got = loader_rows(ds, {"id": stoker.Int()})
        assert {k: int(v["id"]) for k, v in got.items()} == {
            key("rows", i): 1000 + i for i in range(N)
        }
        for name in ("i8", "blob", "li64"):
            spec = stoker.Raw((), "int32") if name == "i8" else stoker.Bytes()
            with pytest.raises(stoker.ShardFormatError, match="rows.parquet"):
                loader_rows(ds, {name: spec})
        return
    first = ds[0]  # (Raw takes the type the values are read as)
    raw = {n: stoker.Raw((), first[n].dtype.str) for n in numbers}
    got = loader_rows(ds, raw, shuffle=True, seed=3)
    for i, want in enumerate(wanted):
        for name, leaf in numbers.items():
            value = got[key("rows", i)][name]
            assert_value(np.asarray(value), want[name], leaf, "parquet", f"Raw row {i} {name}")
    got = loader_rows(ds, {n: stoker.Int() for n in ints}, batch_size=17)
    for i, want in enumerate(wanted):
        for name in ints:
            value = got[key("rows", i)][name]
            assert value.dtype == np.int64, (name, value.dtype)
            assert int(value) == int(want[name]), (i, name)
    got = loader_rows(ds, {n: stoker.Bytes() for n in variable}, shuffle=True, seed=0)
    for i, want in enumerate(wanted):
        for name in variable:
            value = got[key("rows", i)][name]
            assert value.tobytes() == want[name].tobytes(), (i, name)


@pytest.mark.parametrize("version", ["1.0", "2.0"], ids=["v1", "v2"])
@pytest.mark.parametrize("codec", [c for c in CODECS if c != "none"])
def test_large_values_read_from_their_kept_pages(tmp_path, codec, version):
    """Compressed byte strings of images' sizes stay in their decompressed pages, which
    the decoded-chunk cache keeps whole: every value byte-exact, empty values among them,
    in any order, and through a shuffled Loader twice (the second epoch from the cache);
    a null among them is left out of its sample and is an error naming its row in a batch."""
    rng = np.random.default_rng(7)
    n = 90
    values = []
    for i in range(n):
        if i % 13 == 6:
            values.append(b"")
        elif i % 2:  # incompressible, as JPEG bytes are
            values.append(rng.integers(0, 256, int(rng.integers(200, 3000)), np.uint8).tobytes())
        else:
            values.append(bytes([i % 251]) * int(rng.integers(200, 3000)))
    for nulls in (False, True):
        stored = [None if nulls and i % 11 == 4 else v for i, v in enumerate(values)]
        table = pa.table({"image": pa.array(stored, pa.binary()), "label": pa.array(range(n))})
        path = write(tmp_path / f"big-{nulls}.parquet", table, codec, False, version)
        ds = stoker.Dataset(path)
        rows = [i for i in range(n) if stored[i] is not None]
        for order in (rows, rows[::-1]):
            assert [bytes(s["image"]) for s in ds.get_batch(order)] == [values[i] for i in order]
        loader = stoker.Loader(
            ds, 16, fields={"image": stoker.Bytes(), "label": stoker.Int()}, shuffle=True
        )
        if nulls:
            assert "image" not in ds.get_batch([3, 4])[1]
            with pytest.raises(
                stoker.ShardFormatError, match=r"big-True\.parquet.*\brow \d+ .*is null"
            ):
                list(loader)
            continue
        for epoch in range(2):
            loader.set_epoch(epoch)
            seen = {}
            for batch in loader:
                for image, label in zip(batch["image"], batch["label"].tolist()):
                    seen[label] = bytes(np.asarray(image))
            assert seen == dict(enumerate(values))


@pytest.mark.parametrize("codec", [c for c in CODECS if c != "none"])
def test_large_values_are_handed_out_where_they_were_decompressed(
    tmp_path, monkeypatch, codec, decoded_cache_restored
):
    """A Bytes field's table values are not sized by a pass of their own before their read,
    and a compressed column's values of 4 KiB or more in a unit the decoded-chunk cache
    keeps are not copied into the batch: each is a read-only view of the decompressed
    pages, which it keeps alive after the cache lets them go, and which later batches and
    epochs read unchanged. Smaller values are copied and writable, and so is every value
    of a unit the cache does not keep (a cache of nothing here, and units more than a
    quarter of its limit): a batch does not hold such units alive. Lists of numbers view
    their pages as their type where it is aligned there."""
    rng = np.random.default_rng(11)
    n = 60
    sizes = [
        0 if i % 17 == 5 else int(rng.integers(4096, 20000)) if i % 3 else 900 for i in range(n)
    ]
    values = [rng.integers(0, 256, size, np.uint8).tobytes() for size in sizes]
    tokens = [np.arange(i, i + (600 if i % 2 else 40), dtype=np.int64) for i in range(n)]
    table = pa.table(
        {
            "image": pa.array(values, pa.binary()),
            "tokens": pa.array([t.tolist() for t in tokens], pa.list_(pa.int64())),
            "label": pa.array(range(n)),
        }
    )
    path = write(tmp_path / "big.parquet", table, codec, False, data_page_size=1 << 16)
    fields = {"image": stoker.Bytes(), "tokens": stoker.Bytes(), "label": stoker.Int()}
    sized = []  # Bytes values are not sized before their read: no pass decodes them first
    size_values = stoker.dataset.members.MemberTable.size_values
    monkeypatch.setattr(
        stoker.dataset.members.MemberTable,
        "size_values",
        lambda self, *a, **kw: sized.append(a[1]) or size_values(self, *a, **kw),
    )
    for limit in (0, 64 << 20):
        stoker.set_decoded_cache_bytes(limit)
        loader = stoker.Loader(stoker.Dataset(path), 8, fields=fields, shuffle=True)
        kept = []
        for epoch in range(3):
            loader.set_epoch(epoch)
            seen = 0
            for batch in loader:
                for image, token, label in zip(
                    batch["image"], batch["tokens"], batch["label"].tolist()
                ):
                    assert bytes(image) == values[label]
                    lent = limit and len(values[label]) >= 4096
                    assert image.flags.writeable == (not lent), (label, limit)
                    assert token.dtype == np.int64 and np.array_equal(token, tokens[label])
                    assert token.flags.aligned  # copied where the pages have it unaligned
                    seen += 1
                    if epoch == 0:
                        kept.append((label, image, token))
            assert seen == n
        assert sized == []
        values_bytes = sum(map(len, values)) + sum(t.nbytes for t in tokens) + 8 * n
        assert loader.stats()["bytes"] >= 3 * values_bytes  # those left where they lay too
        if limit:
            with pytest.raises(ValueError, match="read-only"):
                next(v for _, v, _ in kept if not v.flags.writeable)[0] = 1
            stoker.set_decoded_cache_bytes(0)  # the cache lets every unit go
        for label, image, token in kept:  # still what they were, pages let go of or not
            assert bytes(image) == values[label]
            assert np.array_equal(token, tokens[label])


def test_a_null_of_another_field_beside_bytes_is_the_readers_error(tmp_path):
    """A null that an Int() field asks for, in a batch whose Bytes() values have none: the
    reader's error, naming the file and the row, stands (the pass that names a Bytes
    field's null with its sample finds nothing to say)."""
    n = 40
    table = pa.table(
        {
            "image": pa.array([bytes([i]) * 5000 for i in range(n)], pa.binary()),
            "label": pa.array([None if i == 17 else i for i in range(n)], pa.int64()),
        }
    )
    path = write(tmp_path / "labels.parquet", table, "zstd", False)
    loader = stoker.Loader(
        stoker.Dataset(path), 8, fields={"image": stoker.Bytes(), "label": stoker.Int()}
    )
    with pytest.raises(stoker.ShardFormatError, match=r"labels\.parquet.*row 17 is null"):
        list(loader)


def test_a_row_group_of_one_row_and_a_file_of_one_group(tmp_path):
    table = make_table(31, seed=2)
    for name, groups in (("one.parquet", 31), ("ones.parquet", 1)):
        path = write(tmp_path / name, table, row_group_size=groups)
        ds = stoker.Dataset(path)
        assert_rows(ds.get_batch(range(31)), expected_rows(table), "parquet", table.schema)


def test_fields_are_lower_cased_dotted_paths(tmp_path):
    table = pa.table(
        {
            "Label": pa.array([1, 2, 3], pa.int64()),
            "Meta": pa.array(
                [
                    {"Score": 0.5, "Tag": "a"},
                    {"Score": 1.5, "Tag": "b"},
                    {"Score": 2.5, "Tag": "c"},
                ],
                pa.struct([("Score", pa.float64()), ("Tag", pa.string())]),
            ),
            "Input_IDs": pa.array([[1, 2], [], [3]], pa.list_(pa.int32())),
        }
    )
    path = write(tmp_path / "Named.parquet", table)
    ds = stoker.Dataset(path)
    assert {"label", "meta.score", "meta.tag", "input_ids"} <= set(ds.fields), ds.fields
    sample = ds[2]
    assert sample["__key__"] == "Named/2"
    assert int(sample["label"]) == 3 and sample["label"].shape == ()
    assert float(sample["meta.score"]) == 2.5
    assert bytes(sample["meta.tag"]) == b"c"
    assert sample["input_ids"].dtype == np.int32 and sample["input_ids"].tolist() == [3]
    assert ds[1]["input_ids"].shape == (0,)
    got = loader_rows(ds, {"label": stoker.Int(), "meta.score": stoker.Raw((), "float64")})
    assert [int(got[f"Named/{i}"]["label"]) for i in range(3)] == [1, 2, 3]


OPTIONS = {
    # A dictionary that outgrows its page limit: the chunk's later pages fall back to PLAIN.
    "dictionary fallback": {"dictionary_pagesize_limit": 64},
    "page index": {"write_page_index": True},
    "no statistics": {"write_statistics": False},
    "page checksums": {"write_page_checksum": True},
    "byte stream split": {
        "use_dictionary": False,
        "column_encoding": {
            n: "BYTE_STREAM_SPLIT" for n in ("f32", "f64", "i32", "i64", "u32", "u64", "f16")
        },
    },
    "one page per chunk": {"data_page_size": 1 << 20, "write_batch_size": 1024},
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_other_writer_options_read_byte_exact(tmp_path, option):
    table = make_table(N, seed=9)
    options = dict(OPTIONS[option])
    dictionary = options.pop("use_dictionary", True)
    path = write(tmp_path / "opts.parquet", table, "zstd", dictionary, **options)
    ds = stoker.Dataset(path)
    assert_rows(
        ds.get_batch(range(N)),
        expected_rows(table),
        "parquet",
        table.schema,
        [key("opts", i) for i in range(N)],
    )


def test_large_and_nested_types(tmp_path):
    table = pa.table(
        {
            "ll": pa.array([[1, 2], [], [3]], pa.large_list(pa.int64())),
            "ls": pa.array(["a", "", "ccc"], pa.large_string()),
            "deep": pa.array(
                [{"b": {"c": 1.5}}, {"b": {"c": -2.0}}, {"b": {"c": 0.0}}],
                pa.struct([("b", pa.struct([("c", pa.float32())]))]),
            ),
        }
    )
    path = write(tmp_path / "large.parquet", table)
    ds = stoker.Dataset(path)
    assert {"ll", "ls", "deep.b.c"} <= set(ds.fields), ds.fields
    assert_rows(ds.get_batch(range(3)), expected_rows(table), "parquet", table.schema)


def test_an_empty_file_and_an_empty_row_group(tmp_path):
    """pyarrow writes a row group of no rows (its column chunks at offset 0) for an empty
    table, and for an empty table written between others: they hold no samples."""
    table = make_table(10, seed=11)
    empty = write(tmp_path / "empty.parquet", table.slice(0, 0))
    assert len(stoker.Dataset(empty)) == 0
    path = str(tmp_path / "gap.parquet")
    with pq.ParquetWriter(path, table.schema) as writer:
        writer.write_table(table.slice(0, 4))
        writer.write_table(table.slice(0, 0))
        writer.write_table(table.slice(4))
    assert pq.ParquetFile(path).metadata.row_group(1).num_rows == 0
    ds = stoker.Dataset(path)
    assert_rows(
        ds.get_batch(range(10)),
        expected_rows(table),
        "parquet",
        table.schema,
        [key("gap", i) for i in range(10)],
    )


# -- the ways a source is named ---------------------------------------------------------------


@pytest.fixture
def three_files(tmp_path):
    """Three Parquet files (b, a, c written in that order) in a folder, and their tables."""
    folder = tmp_path / "data"
    folder.mkdir()
    tables = {}
    for seed, stem in enumerate(["b", "a", "c"]):
        tables[stem] = make_table(20 + 7 * seed, seed=10 + seed)
        write(folder / f"{stem}.parquet", tables[stem], row_group_size=8)
    return str(folder), tables


def _expect_sorted(ds, tables):
    samples = ds.get_batch(range(len(ds)))
    wanted, keys = [], []
    for stem in sorted(tables):
        wanted += expected_rows(tables[stem])
        keys += [key(stem, r) for r in range(tables[stem].num_rows)]
    assert len(ds) == len(wanted)
    assert_rows(samples, wanted, "parquet", tables["a"].schema, keys)


def test_a_folder_a_glob_a_list_and_a_file(three_files):
    folder, tables = three_files
    _expect_sorted(stoker.Dataset(folder), tables)
    _expect_sorted(stoker.Dataset(os.path.join(folder, "*.parquet")), tables)
    _expect_sorted(stoker.Dataset(sorted(glob.glob(os.path.join(folder, "*.parquet")))), tables)
    one = stoker.Dataset(os.path.join(folder, "c.parquet"))
    assert_rows(
        one.get_batch(range(len(one))),
        expected_rows(tables["c"]),
        "parquet",
        tables["c"].schema,
        [key("c", r) for r in range(len(one))],
    )


def test_a_loader_over_several_files_gives_every_row_once(three_files):
    folder, tables = three_files
    ds = stoker.Dataset(folder)
    got = loader_rows(
        ds, {"id": stoker.Int(), "blob": stoker.Bytes()}, batch_size=9, shuffle=True, seed=5
    )
    for stem, table in tables.items():
        for r, want in enumerate(expected_rows(table)):
            assert int(got[key(stem, r)]["id"]) == int(want["id"])
            assert got[key(stem, r)]["blob"].tobytes() == want["blob"].tobytes()


# -- files by other writers -------------------------------------------------------------------


def _jpegs(n: int) -> tuple[list[bytes], list[tuple[int, int, int]]]:
    from PIL import Image

    colours = [((37 * i) % 256, (91 * i) % 256, (151 * i) % 256) for i in range(n)]
    out = []
    for i, colour in enumerate(colours):
        buf = io.BytesIO()
        Image.new("RGB", (40 + i % 7, 30 + i % 5), colour).save(buf, "JPEG", quality=95)
        out.append(buf.getvalue())
    return out, colours


def test_a_hub_image_dataset_written_by_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("PIL")
    n = 24
    jpegs, colours = _jpegs(n)
    labels = [i % 5 for i in range(n)]
    hub = datasets.Dataset.from_dict(
        {"image": [{"bytes": b, "path": None} for b in jpegs], "label": labels}
    ).cast_column("image", datasets.Image())
    path = str(tmp_path / "train-00000-of-00001.parquet")
    hub.to_parquet(path, batch_size=10)  # (row groups of 10)
    stored = pq.read_table(path)
    assert stored.column("image").to_pylist()[3]["bytes"] == jpegs[3]  # embedded

    ds = stoker.Dataset(path)
    assert len(ds) == n
    assert {"image.bytes", "label"} <= set(ds.fields)
    stem = "train-00000-of-00001"
    got = loader_rows(ds, {"image": stoker.Bytes(), "label": stoker.Int()}, batch_size=7)
    for i in range(n):
        assert got[key(stem, i)]["image"].tobytes() == jpegs[i]
        assert int(got[key(stem, i)]["label"]) == labels[i]
    if not stoker._core.image_support():
        pytest.skip("this build decodes no images")
    loader = stoker.Loader(
        ds, batch_size=8, fields={"image": stoker.Image(32, crop="center"), "label": stoker.Int()}
    )
    seen = 0
    for batch in loader:
        images = batch["image"]
        assert images.dtype == stoker_torch().uint8
        assert tuple(images.shape[1:]) == (3, 32, 32)
        assert batch["label"].dtype == stoker_torch().int64
        for k, name in enumerate(batch["__key__"]):
            i = int(name.rsplit("/", 1)[1])
            mean = images[k].float().mean(dim=(1, 2)).numpy()
            assert np.abs(mean - np.array(colours[i])).max() < 8, (i, mean, colours[i])
            assert int(batch["label"][k]) == labels[i]
            seen += 1
    assert seen == n


def test_a_hub_dataset_with_null_paths(tmp_path):
    """The Hub's Image feature stores path None beside embedded bytes. ds[i] leaves a null
    text or bytes value out of the sample, as a missing member is; a loader that asks for
    it is an error naming the column and row, and one that does not reads."""
    datasets = pytest.importorskip("datasets")
    jpegs = [b"\xff\xd8 not really a jpeg %d" % i for i in range(5)]
    hub = datasets.Dataset.from_dict(
        {"image": [{"bytes": b, "path": None} for b in jpegs], "label": list(range(5))}
    ).cast_column("image", datasets.Image())
    path = str(tmp_path / "hub.parquet")
    hub.to_parquet(path)
    ds = stoker.Dataset(path)
    assert "image.path" not in ds[2] and ds[2]["image.bytes"].tobytes() == jpegs[2]
    with pytest.raises(
        stoker.ShardFormatError, match=r"hub\.parquet.*image\.path, row group 0, row \d+ "
    ):
        loader_rows(ds, {"image.path": stoker.Bytes()})
    got = loader_rows(ds, {"image": stoker.Bytes(), "label": stoker.Int()})
    assert [got[key("hub", i)]["image"].tobytes() for i in range(5)] == jpegs
    with pytest.raises(stoker.ShardFormatError, match="hub.parquet"):
        loader_rows(ds, {"image.path": stoker.Bytes()})


def stoker_torch():
    import torch

    return torch


@pytest.mark.parametrize("compression", [None, "SNAPPY", "GZIP", "ZSTD"])
def test_a_file_written_by_fastparquet(tmp_path, compression):
    fastparquet = pytest.importorskip("fastparquet")
    pd = pytest.importorskip("pandas")
    n = 50
    rng = np.random.default_rng(4)
    frame = pd.DataFrame(
        {
            "label": rng.integers(-(10**12), 10**12, n).astype(np.int64),
            "small": rng.integers(-(2**31), 2**31 - 1, n).astype(np.int32),
            "score": rng.standard_normal(n),
            "half": rng.standard_normal(n).astype(np.float32),
            "flag": rng.random(n) < 0.5,
            "text": [f"row {i} {'é' * (i % 4)}" for i in range(n)],
            "data": [rng.integers(0, 256, i % 13, dtype=np.uint8).tobytes() for i in range(n)],
        }
    )
    path = str(tmp_path / "fp.parquet")
    fastparquet.write(
        path,
        frame,
        compression=compression,
        row_group_offsets=[0, 20, 35],
        write_index=False,
        stats=False,
    )
    table = pq.read_table(path)
    assert table.num_rows == n
    ds = stoker.Dataset(path)
    assert_rows(
        ds.get_batch(range(n)),
        expected_rows(table),
        "parquet",
        table.schema,
        [key("fp", i) for i in range(n)],
    )
    got = loader_rows(
        ds,
        {"label": stoker.Int(), "text": stoker.Bytes(), "score": stoker.Raw((), "float64")},
        batch_size=16,
    )
    for i in range(n):
        assert int(got[key("fp", i)]["label"]) == int(frame["label"][i])
        assert got[key("fp", i)]["text"].tobytes() == frame["text"][i].encode()
        assert float(got[key("fp", i)]["score"]) == frame["score"][i]


# -- columns stoker does not read -------------------------------------------------------------


UNREADABLE = {
    "structs": (
        pa.list_(pa.struct([("a", pa.int32())])),
        [[{"a": 1}], [], [{"a": 2}, {"a": 3}]],
        "list of structs",
    ),
    "mapped": (pa.map_(pa.string(), pa.int32()), [[("k", 1)], [], [("a", 2)]], "part of a map"),
    "words": (pa.list_(pa.string()), [["a", "b"], [], ["c"]], "list of byte strings"),
    "stamps": (pa.timestamp("ns"), [1, 2, 3], "INT96"),
    "nested": (pa.list_(pa.list_(pa.int32())), [[[1], [2, 3]], [], [[]]], "list of lists"),
}


def test_columns_it_cannot_read_are_left_out_and_refused_by_name(tmp_path):
    columns = {"label": pa.array([7, 8, 9], pa.int64())}
    columns.update({name: pa.array(values, kind) for name, (kind, values, _) in UNREADABLE.items()})
    path = str(tmp_path / "odd.parquet")
    pq.write_table(pa.table(columns), path, use_deprecated_int96_timestamps=True)
    ds = stoker.Dataset(path)
    assert int(ds[1]["label"]) == 8
    for name, (_, _, why) in UNREADABLE.items():
        assert not any(f == name or f.startswith(name + ".") for f in ds.fields), ds.fields
        assert not any(f == name or f.startswith(name + ".") for f in ds[0]), sorted(ds[0])
        with pytest.raises(stoker.StokerError, match=why) as e:
            stoker.Loader(ds, batch_size=2, fields={name: stoker.Bytes()})
        assert "odd.parquet" in str(e.value)
    got = loader_rows(ds, {"label": stoker.Int()})
    assert [int(got[key("odd", i)]["label"]) for i in range(3)] == [7, 8, 9]


@pytest.mark.parametrize(
    "name, kind, values, options, why",
    [
        (
            "delta",
            pa.int64(),
            [1, 5, 9, 2],
            {"use_dictionary": False, "column_encoding": {"delta": "DELTA_BINARY_PACKED"}},
            "(?i)delta",
        ),
        (
            "dtext",
            pa.string(),
            ["a", "bc", "", "d"],
            {"use_dictionary": False, "column_encoding": {"dtext": "DELTA_LENGTH_BYTE_ARRAY"}},
            "(?i)delta",
        ),
        (
            "dstrings",
            pa.binary(),
            [b"ab", b"abc", b"", b"d"],
            {"use_dictionary": False, "column_encoding": {"dstrings": "DELTA_BYTE_ARRAY"}},
            "(?i)delta",
        ),
        (
            "brotli",
            pa.int64(),
            [1, 2, 3, 4],
            {"compression": {"brotli": "brotli", "label": "snappy"}},
            "brotli",
        ),
    ],
)
def test_encodings_and_codecs_it_cannot_read(tmp_path, name, kind, values, options, why):
    path = str(tmp_path / "enc.parquet")
    table = pa.table({"label": pa.array([1, 2, 3, 4], pa.int64()), name: pa.array(values, kind)})
    pq.write_table(table, path, **options)
    ds = stoker.Dataset(path)
    assert name not in ds.fields, ds.fields
    assert name not in ds[0]
    assert int(ds[3]["label"]) == 4
    with pytest.raises(stoker.StokerError, match=why):
        stoker.Loader(ds, batch_size=2, fields={name: stoker.Bytes()})


# -- the wider system -------------------------------------------------------------------------


def test_dataloader_fork_workers_read_every_row_once(tmp_path):
    torch = pytest.importorskip("torch")
    table = make_table(N, seed=6)
    path = write(tmp_path / "fork.parquet", table, "zstd")
    wanted = expected_rows(table)
    ds = stoker.Dataset(path)
    ds[0]  # opened and read in the parent first: the workers inherit that
    loader = torch.utils.data.DataLoader(
        ds, batch_size=9, num_workers=2, multiprocessing_context="fork", collate_fn=lambda x: x
    )
    seen = {}
    for batch in loader:
        for sample in batch:
            assert sample["__key__"] not in seen
            seen[sample["__key__"]] = sample
    assert sorted(seen) == sorted(key("fork", i) for i in range(N))
    assert_rows([seen[key("fork", i)] for i in range(N)], wanted, "parquet", table.schema)


def test_a_loader_reads_only_the_columns_it_asks_for(tmp_path):
    rng = np.random.default_rng(7)
    n = 200
    table = pa.table(
        {
            "label": pa.array(rng.integers(0, 1000, n), pa.int64()),
            "blob": pa.array(
                [rng.integers(0, 256, 20_000, dtype=np.uint8).tobytes() for _ in range(n)],
                pa.binary(),
            ),
        }
    )
    path = str(tmp_path / "wide.parquet")
    pq.write_table(table, path, row_group_size=50, compression="snappy")
    assert os.path.getsize(path) > 3_000_000
    label_bytes = chunk_bytes(path, "label")
    loader = stoker.Loader(
        stoker.Dataset(path), batch_size=32, fields={"label": stoker.Int()}, shuffle=True, seed=0
    )
    labels = {}
    for batch in loader:
        for k, v in zip(batch["__key__"], batch["label"].tolist()):
            labels[k] = v
    assert labels == {
        key("wide", i): int(v) for i, v in enumerate(table.column("label").to_pylist())
    }
    read = loader.stats()["bytes_read"]
    assert 0 < read <= 1.2 * label_bytes, (read, label_bytes)


@pytest.mark.parametrize("dictionary", [True, False], ids=["dictionary", "plain"])
def test_a_page_index_reads_by_runs_of_pages(tmp_path, monkeypatch, dictionary):
    """Where the writer wrote a page index, a column is read by runs of pages (each after
    its chunk's dictionary page), not whole row groups: each value still reads exactly."""
    import stoker.tables.parquet as parquet

    monkeypatch.setattr(parquet, "UNIT_BYTES", 1)  # every page a unit of its own
    n = 3000
    table = pa.table(
        {
            "label": pa.array(np.arange(n, dtype=np.int64)),
            "text": pa.array([f"value {i % 37} " * (i % 5) for i in range(n)]),
        }
    )
    path = str(tmp_path / "paged.parquet")
    pq.write_table(
        table,
        path,
        row_group_size=1000,
        data_page_size=256,
        write_batch_size=64,  # (pages are cut between batches of values)
        write_page_index=True,
        use_dictionary=dictionary,
        compression="snappy",
    )
    ds = stoker.Dataset(path)
    got = ds.get_batch(np.random.default_rng(0).permutation(n))
    assert sorted(int(s["label"]) for s in got) == list(range(n))
    for s in got:
        i = int(s["label"])
        assert s["text"].tobytes() == table["text"][i].as_py().encode()
    for column in ds.members.columns:
        units = column.units
        assert len(units) > 3 * 3, len(units)  # several per row group
        assert (units[:, 5] > 0).any() == dictionary  # the dictionary page read before them


def test_batches_in_flight_together_read_a_row_group_they_share_once(tmp_path):
    """Batches read ahead at once (prefetch) on two threads all want the one row group of
    each file: one thread reads and decodes it, the others wait for its values."""
    paths = []
    for f in range(8):
        path = str(tmp_path / f"one-group-{f}.parquet")
        labels = pa.array(np.arange(20_000, dtype=np.int64) + f)
        pq.write_table(
            pa.table({"label": labels}),
            path,
            row_group_size=20_000,
            compression="none",
            use_dictionary=False,
        )
        paths.append(path)
    for path in paths:
        ds = stoker.Dataset(path)
        loader = stoker.Loader(
            ds,
            batch_size=16,
            fields={"label": stoker.Int()},
            shuffle=True,
            seed=0,
            num_threads=2,
            prefetch=8,
        )
        for _, batch in zip(range(16), loader):
            assert len(batch["label"]) == 16
        assert loader.stats()["bytes_read"] == chunk_bytes(path, "label"), path
