"""Arrow IPC files as datasets, read in place: files and streams by pyarrow, the folders
``datasets.save_to_disk`` writes (in their state.json's order) and ``datasets``' cache
files, every value byte-exact; nulls leave a field out of a sample; compressed files and
booleans are refused with a message saying why."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import stoker
from tests.support.tables import assert_rows, assert_value, expected_rows, leaves, make_table

pa = pytest.importorskip("pyarrow")
ipc = pytest.importorskip("pyarrow.ipc")

N = 100


def write_file(path, table, stream=False, chunk=30, **options) -> str:
    """`table` as an Arrow IPC file (or stream) of record batches of `chunk` rows."""
    write_options = ipc.IpcWriteOptions(**options) if options else None
    with pa.OSFile(str(path), "wb") as sink:
        make = ipc.new_stream if stream else ipc.new_file
        with make(sink, table.schema, options=write_options) as writer:
            for batch in table.to_batches(max_chunksize=chunk):
                writer.write_batch(batch)
    return str(path)


def readable(table):
    """The table less its booleans (Arrow packs them as bits: stoker leaves them out)."""
    return table.drop_columns([f.name for f in table.schema if pa.types.is_boolean(f.type)])


def loader_rows(ds, fields, batch_size=32, **kw):
    loader = stoker.Loader(ds, batch_size=batch_size, fields=fields, **kw)
    out = {}
    for batch in loader:
        for name in fields:
            values = batch[name]
            got = (
                [np.asarray(v) for v in values]
                if isinstance(values, list)
                else list(values.numpy())
            )
            for k, value in zip(batch["__key__"], got):
                out.setdefault(k, {})[name] = value
    assert len(out) == len(ds)
    return out


def check_loaders(ds, table, stem):
    wanted = expected_rows(table)
    by_name = {leaf.name: leaf for leaf in leaves(table.schema)}
    numbers = {n: leaf for n, leaf in by_name.items() if leaf.dtype is not None and not leaf.listed}
    variable = [n for n, leaf in by_name.items() if leaf.dtype is None or leaf.listed]
    got = loader_rows(
        ds,
        {n: stoker.Raw((), leaf.dtype.name) for n, leaf in numbers.items()},
        shuffle=True,
        seed=1,
    )
    for i, want in enumerate(wanted):
        for name, leaf in numbers.items():
            assert_value(
                np.asarray(got[f"{stem}/{i}"][name]), want[name], leaf, "arrow", f"row {i} {name}"
            )
    ints = [n for n, leaf in numbers.items() if leaf.dtype.kind in "iu" and n != "u64"]
    got = loader_rows(ds, {n: stoker.Int() for n in ints}, batch_size=13)
    for i, want in enumerate(wanted):
        for name in ints:
            value = got[f"{stem}/{i}"][name]
            assert value.dtype == np.int64 and int(value) == int(want[name]), (i, name)
    got = loader_rows(ds, {n: stoker.Bytes() for n in variable}, batch_size=11)
    for i, want in enumerate(wanted):
        for name in variable:
            assert got[f"{stem}/{i}"][name].tobytes() == want[name].tobytes(), (i, name)


@pytest.mark.parametrize("stream", [False, True], ids=["file", "stream"])
def test_every_value_byte_exact(tmp_path, stream):
    table = make_table(N, seed=1)
    path = write_file(tmp_path / "rows.arrow", table, stream=stream)
    ds = stoker.Dataset(path)
    assert len(ds) == N
    want = readable(table)
    assert {leaf.name for leaf in leaves(want.schema)} <= set(ds.fields), ds.fields
    assert_rows(
        ds.get_batch(range(N)),
        expected_rows(want),
        "arrow",
        want.schema,
        [f"rows/{i}" for i in range(N)],
    )
    assert_rows([ds[77]], [expected_rows(want)[77]], "arrow", want.schema, ["rows/77"])
    check_loaders(ds, want, "rows")


def test_booleans_are_left_out_and_refused_by_name(tmp_path):
    path = write_file(tmp_path / "b.arrow", make_table(10, seed=2))
    ds = stoker.Dataset(path)
    assert "flag" not in ds.fields and "flag" not in ds[0]
    with pytest.raises(stoker.StokerError, match="(?i)boolean") as e:
        stoker.Loader(ds, batch_size=4, fields={"flag": stoker.Raw((), "bool")})
    assert "b.arrow" in str(e.value)


@pytest.mark.parametrize("stream", [False, True], ids=["file", "stream"])
def test_a_null_leaves_the_field_out_of_its_sample(tmp_path, stream):
    table = make_table(N, seed=3, nulls=True)
    path = write_file(tmp_path / "nulls.arrow", table, stream=stream)
    want = readable(table)
    wanted = expected_rows(want)
    ds = stoker.Dataset(path)
    samples = ds.get_batch(range(N))
    for i, (got, row) in enumerate(zip(samples, wanted)):
        for name, value in row.items():
            if value is None:
                assert name not in got, (i, name)
    assert_rows(samples, wanted, "arrow", want.schema)  # every value that is not null
    # A loader asking for a field some of its samples lack: an error naming the file.
    with pytest.raises(stoker.StokerError, match="nulls.arrow"):
        loader_rows(ds, {"blob": stoker.Bytes()})
    got = loader_rows(ds, {"id": stoker.Int()})
    assert sorted(int(v["id"]) for v in got.values()) == list(range(1000, 1000 + N))


def test_null_rows_come_from_the_validity_bitmap():
    """Which rows are null, read from an array's bitmap at its offset (slices at odd
    offsets, structs, an array of the null type), as pyarrow's is_valid says."""
    from stoker.tables.arrow import _null_rows

    rng = np.random.default_rng(5)
    valid = rng.random(203) > 0.3
    arrays = [
        pa.array([int(i) if ok else None for i, ok in enumerate(valid)], pa.int64()),
        pa.array([b"x" * (i % 7) if ok else None for i, ok in enumerate(valid)], pa.binary()),
        pa.array([{"a": i} if ok else None for i, ok in enumerate(valid)]),
        pa.nulls(203),
        pa.array(list(range(203)), pa.int32()),
    ]
    for array in arrays:
        for start, stop in ((0, 203), (3, 200), (13, 14), (64, 203), (101, 101)):
            part = array.slice(start, stop - start)
            want = ~np.asarray(part.is_valid().to_pylist(), dtype=bool)
            got = _null_rows(part)
            if got is None:
                assert not want.any(), (array.type, start, stop)
            else:
                assert np.array_equal(got, want), (array.type, start, stop)


def test_opening_an_arrow_file_imports_no_pandas(tmp_path):
    """Opening reads the IPC messages with pyarrow and nothing more: the nulls of a Hub
    image column (its paths are all null) once cost 0.2 s of pyarrow.compute and pandas
    imports at open."""
    import subprocess
    import sys

    from tests.support import REPO

    table = pa.table(
        {
            "image": pa.array(
                [{"bytes": b"\xff" * 9, "path": None}] * 40,
                pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
            ),
            "label": pa.array(range(40)),
        }
    )
    path = write_file(tmp_path / "hub.arrow", table, stream=True)
    script = (
        "import sys, stoker\n"
        f"ds = stoker.Dataset({path!r})\n"
        "assert len(ds) == 40 and 'image.bytes' in ds.fields, ds.fields\n"
        "print('pandas' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False", out.stderr


def test_a_compressed_file_is_refused_with_the_way_out(tmp_path):
    table = make_table(20, seed=4)
    path = write_file(tmp_path / "packed.arrow", table, compression="zstd")
    ds = stoker.Dataset(path)
    assert len(ds) == 20
    assert "id" not in ds.fields and "blob" not in ds.fields
    for name, spec in (("id", stoker.Int()), ("blob", stoker.Bytes())):
        with pytest.raises(stoker.StokerError, match="(?i)compress") as e:
            stoker.Loader(ds, batch_size=4, fields={name: spec})
        assert "packed.arrow" in str(e.value)


# -- datasets' files --------------------------------------------------------------------------


def _hub(n: int, seed: int = 0):
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(seed)
    images = [
        {
            "bytes": rng.integers(0, 256, int(rng.integers(1, 400)), dtype=np.uint8).tobytes(),
            "path": None,
        }
        for _ in range(n)
    ]
    data = {
        "image": images,
        "label": [int(v) for v in rng.integers(0, 10, n)],
        "text": [f"caption {i} " + "ü" * (i % 5) for i in range(n)],
        "input_ids": [rng.integers(0, 50_000, int(rng.integers(0, 9))).tolist() for _ in range(n)],
        "score": rng.standard_normal(n).astype(np.float32).tolist(),
    }
    features = datasets.Features(
        {
            "image": datasets.Image(),
            "label": datasets.Value("int64"),
            "text": datasets.Value("string"),
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "score": datasets.Value("float32"),
        }
    )
    return datasets.Dataset.from_dict(data, features=features)


def _check_against(ds, reference, keys):
    """`ds`'s samples against the rows of a datasets Dataset `reference` (its Arrow
    table, so image bytes are compared undecoded)."""
    table = reference.data.table if hasattr(reference.data, "table") else reference.data
    table = pa.table(table)
    wanted = expected_rows(table)
    assert len(ds) == len(wanted)
    assert_rows(ds.get_batch(range(len(ds))), wanted, "arrow", table.schema, keys)


def test_a_save_to_disk_folder_in_its_state_order(tmp_path):
    datasets = pytest.importorskip("datasets")
    hub = _hub(45, seed=5)
    folder = str(tmp_path / "saved")
    hub.save_to_disk(folder, num_shards=3)
    state_path = os.path.join(folder, "state.json")
    with open(state_path) as f:
        state = json.load(f)
    names = [entry["filename"] for entry in state["_data_files"]]
    assert len(names) == 3
    # The dataset's order is state.json's, which need not be the files' sorted order.
    state["_data_files"] = state["_data_files"][::-1]
    with open(state_path, "w") as f:
        json.dump(state, f)
    reference = datasets.load_from_disk(folder)
    ds = stoker.Dataset(folder)
    sizes = [len(datasets.Dataset.from_file(os.path.join(folder, n))) for n in names[::-1]]
    keys = [f"{os.path.splitext(n)[0]}/{r}" for n, k in zip(names[::-1], sizes) for r in range(k)]
    _check_against(ds, reference, keys)
    got = loader_rows(
        ds,
        {"image": stoker.Bytes(), "label": stoker.Int(), "input_ids": stoker.Bytes()},
        batch_size=8,
        shuffle=True,
        seed=2,
    )
    rows = reference.cast_column("image", datasets.Image(decode=False))
    for k, row in zip(keys, rows):
        assert got[k]["image"].tobytes() == row["image"]["bytes"]
        assert int(got[k]["label"]) == row["label"]
        assert got[k]["input_ids"].tobytes() == np.asarray(row["input_ids"], np.int32).tobytes()


def test_a_save_to_disk_folder_with_an_indices_mapping_is_refused(tmp_path):
    # (Older datasets wrote a shuffled dataset's indices beside its data, listed in
    # state.json; this one flattens them, so the listing is made by hand.)
    pytest.importorskip("datasets")
    folder = str(tmp_path / "shuffled")
    _hub(12).save_to_disk(folder)
    state_path = os.path.join(folder, "state.json")
    with open(state_path) as f:
        state = json.load(f)
    state["_indices_data_files"] = [{"filename": "indices.arrow"}]
    with open(state_path, "w") as f:
        json.dump(state, f)
    with pytest.raises(stoker.StokerError, match="flatten_indices"):
        stoker.Dataset(folder)


def test_a_datasets_cache_file(tmp_path):
    hub = _hub(30, seed=6)
    cache = str(tmp_path / "cache-0123abcd.arrow")
    mapped = hub.map(lambda batch: batch, batched=True, batch_size=7, cache_file_name=cache)
    assert os.path.isfile(cache)
    ds = stoker.Dataset(cache)
    _check_against(ds, mapped, [f"cache-0123abcd/{i}" for i in range(30)])
    got = loader_rows(ds, {"image": stoker.Bytes(), "score": stoker.Raw((), "float32")})
    table = pa.table(mapped.data.table)
    for i, row in enumerate(table.to_pylist()):
        assert got[f"cache-0123abcd/{i}"]["image"].tobytes() == row["image"]["bytes"]
        assert float(got[f"cache-0123abcd/{i}"]["score"]) == np.float32(row["score"])


def test_dataloader_fork_workers_over_an_arrow_file(tmp_path):
    torch = pytest.importorskip("torch")
    table = readable(make_table(60, seed=8))
    ds = stoker.Dataset(write_file(tmp_path / "fork.arrow", table))
    loader = torch.utils.data.DataLoader(
        ds, batch_size=7, num_workers=2, multiprocessing_context="fork", collate_fn=lambda x: x
    )
    seen = {s["__key__"]: s for batch in loader for s in batch}
    assert len(seen) == 60
    assert_rows([seen[f"fork/{i}"] for i in range(60)], expected_rows(table), "arrow", table.schema)
