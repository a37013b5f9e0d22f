"""Dataset: sources, the CSV layout, pickling and use under torch's DataLoader."""

import os
import pickle
import zipfile

import numpy as np
import pytest

import stoker
from stoker.sources import expand_braces
from tests.support.concurrency import run_in_threads
from tests.support.shards import as_bytes, assert_matches, make_samples, write_tar, write_zip


@pytest.fixture
def shards(tmp_path):
    """Four tar shards and a zip shard of 10 samples each, plus what they hold."""
    all_samples = []
    for s in range(4):
        samples = make_samples(10, seed=s)
        samples = [(f"s{s}/{k}", f) for k, f in samples]
        write_tar(tmp_path / f"shard-{s:06d}.tar", samples)
        all_samples += samples
    return tmp_path, all_samples


def test_brace_expansion():
    assert expand_braces("a-{000..002}.tar") == ["a-000.tar", "a-001.tar", "a-002.tar"]
    assert expand_braces("{a,b}/{1..2}") == ["a/1", "a/2", "b/1", "b/2"]
    assert expand_braces("x{}y") == ["x{}y"]


def test_sources(shards):
    folder, samples = shards
    by_folder = stoker.Dataset(str(folder))
    by_glob = stoker.Dataset(str(folder / "shard-*.tar"))
    by_brace = stoker.Dataset(str(folder / "shard-{000000..000003}.tar"))
    by_list = stoker.Dataset([folder / f"shard-{s:06d}.tar" for s in range(4)])
    for ds in (by_folder, by_glob, by_brace, by_list):
        assert_matches(ds, samples)


def test_mixed_formats(tmp_path):
    a = make_samples(5, seed=1)
    b = make_samples(5, seed=2)
    write_tar(tmp_path / "a.tar", a)
    write_zip(tmp_path / "b.zip", b, zipfile.ZIP_DEFLATED)
    np.save(tmp_path / "c.npy", np.arange(6, dtype=np.int16).reshape(3, 2))
    ds = stoker.Dataset(str(tmp_path))
    assert len(ds) == 13
    assert_matches(stoker.Dataset([str(tmp_path / "a.tar"), str(tmp_path / "b.zip")]), a + b)
    assert ds[12]["npy"].tolist() == [4, 5]
    assert set(ds.fields) == {"cls", "raw", "npy"}


def test_manifest(shards):
    folder, samples = shards
    import json

    entries = [
        {"path": f"shard-{s:06d}.tar", "bytes": os.path.getsize(folder / f"shard-{s:06d}.tar")}
        for s in range(4)
    ]
    (folder / "stoker.json").write_text(json.dumps({"version": 1, "shards": entries}))
    assert_matches(stoker.Dataset(str(folder / "stoker.json")), samples)
    assert_matches(stoker.Dataset(str(folder)), samples)  # a folder's manifest wins
    entries[1]["bytes"] += 1
    (folder / "stoker.json").write_text(json.dumps({"version": 1, "shards": entries}))
    with pytest.raises(stoker.ShardFormatError, match="shard-000001.tar.*manifest says"):
        stoker.Dataset(str(folder))
    (folder / "stoker.json").write_text("{not json")
    with pytest.raises(stoker.ShardFormatError, match="stoker.json: offset 1: manifest is not"):
        stoker.Dataset(str(folder))


def test_bad_sources(tmp_path):
    with pytest.raises(stoker.StokerError, match="no files match"):
        stoker.Dataset(str(tmp_path / "*.tar"))
    with pytest.raises(stoker.StokerError, match="no shards in this folder"):
        stoker.Dataset(str(tmp_path))
    (tmp_path / "x.orc").write_bytes(b"")
    with pytest.raises(stoker.ShardFormatError, match="unknown shard format"):
        stoker.Dataset(str(tmp_path / "x.orc"))
    (tmp_path / "x.parquet").write_bytes(b"")
    with pytest.raises(stoker.ShardFormatError, match="not a Parquet file"):
        stoker.Dataset(str(tmp_path / "x.parquet"))
    (tmp_path / "x.tar.gz").write_bytes(b"")
    with pytest.raises(stoker.ShardFormatError, match="compressed tar"):
        stoker.Dataset(str(tmp_path / "x.tar.gz"))
    with pytest.raises(stoker.ReadError, match="missing.tar: offset 0: cannot open"):
        stoker.Dataset(str(tmp_path / "missing.tar"))


def test_indexing(shards):
    folder, samples = shards
    ds = stoker.Dataset(str(folder))
    assert ds[-1]["__key__"] == samples[-1][0]
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(IndexError):
        ds.get_batch([0, -len(ds) - 1])
    batch = ds.get_batch([5, 5, 0])
    assert [s["__key__"] for s in batch] == [samples[5][0], samples[5][0], samples[0][0]]
    assert ds.get_batch([]) == []


def test_values_are_zero_copy_views(shards):
    folder, _ = shards
    batch = stoker.Dataset(str(folder)).get_batch(range(8))
    bases = {id(s["raw"].base) for s in batch}
    assert len(bases) == 1  # every value views the batch's one buffer


def test_pickle(shards):
    folder, samples = shards
    ds = pickle.loads(pickle.dumps(stoker.Dataset(str(folder))))
    assert_matches(ds, samples)


def test_concurrent_get_batch(shards):
    folder, samples = shards
    ds = stoker.Dataset(str(folder))

    def work(seed):
        rng = np.random.default_rng(seed)
        for _ in range(50):
            idx = rng.integers(0, len(ds), 16)
            for i, s in zip(idx, ds.get_batch(idx)):
                assert as_bytes(s) == samples[i][1]

    run_in_threads(work, 6)


def _collate(batch):
    return [(s["__key__"], bytes(s["raw"])) for s in batch]


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_torch_dataloader_workers(shards, context):
    torch = pytest.importorskip("torch")
    folder, samples = shards
    ds = stoker.Dataset(str(folder))
    ds.get_batch(range(len(ds)))  # the parent has used the reader before the workers start
    loader = torch.utils.data.DataLoader(
        ds, batch_size=7, num_workers=2, collate_fn=_collate, multiprocessing_context=context
    )
    got = [item for batch in loader for item in batch]
    assert got == [(k, f["raw"]) for k, f in samples]


# -- a CSV of filename,label rows and a folder of files ---------------------


def _csv_layout(tmp_path, n=12, header=True):
    root = tmp_path / "labels_train"
    root.mkdir()
    rows, expected = [], []
    rng = np.random.default_rng(0)
    for i in range(n):
        data = rng.integers(0, 256, 100 + i, dtype=np.uint8).tobytes()
        name = f"img{i:03d}.png" if i % 3 else f"sub/img{i:03d}.PNG"
        (root / name).parent.mkdir(exist_ok=True)
        (root / name).write_bytes(data)
        rows.append(f"{name},{i % 4}")
        expected.append((os.path.splitext(name)[0], name.rsplit(".", 1)[1].lower(), data, i % 4))
    text = ("filename,label\n" if header else "") + "\n".join(rows) + "\n"
    (tmp_path / "labels_train.csv").write_text(text)
    return tmp_path / "labels_train.csv", root, expected


@pytest.mark.parametrize("header", [True, False])
def test_from_csv(tmp_path, header):
    csv, root, expected = _csv_layout(tmp_path, header=header)
    ds = stoker.Dataset.from_csv(csv, root)
    assert len(ds) == len(expected)
    for sample, (key, ext, data, label) in zip(ds.get_batch(range(len(ds))), expected):
        assert sample["__key__"] == key
        assert bytes(sample[ext]) == data
        assert sample["label"] == label
    assert pickle.loads(pickle.dumps(ds))[3]["label"] == 3


def test_from_csv_bad_labels(tmp_path):
    csv, root, _ = _csv_layout(tmp_path)
    lines = csv.read_text().splitlines()
    lines[3] = lines[3].split(",")[0] + ",cat"
    lines[5] = lines[5].split(",")[0] + ",1.5"
    csv.write_text("\n".join(lines) + "\n")
    with pytest.raises(
        stoker.ShardFormatError,
        match=r"2 row\(s\).*line 4: 'img002.png','cat', line 6: 'img004.png','1.5'",
    ):
        stoker.Dataset.from_csv(csv, root)


def test_from_csv_missing_files(tmp_path):
    csv, root, _ = _csv_layout(tmp_path)
    os.remove(root / "img001.png")
    os.remove(root / "img002.png")
    with pytest.raises(stoker.ReadError, match=r"2 file\(s\) listed.*img001.png.*img002.png"):
        stoker.Dataset.from_csv(csv, root)


def test_file_changed_after_indexing(shards):
    folder, _ = shards
    ds = stoker.Dataset(str(folder))
    path = folder / "shard-000003.tar"
    path.write_bytes(path.read_bytes()[:2048])
    with pytest.raises(
        stoker.ShardFormatError, match="shard-000003.tar: offset 0: the file changed after it"
    ):
        ds.get_batch(range(len(ds)))
    ds.get_batch(range(10))  # other shards still read


def test_file_replaced_after_indexing(tmp_path):
    # A shard replaced by rename (as a cache refresh would) with bytes of the same size:
    # a dataset opened after reads the new bytes, never the old descriptor's, and one
    # opened before fails clearly rather than serve bytes its index does not describe.
    a = [("k", {"bin": b"A" * 100})]
    b = [("k", {"bin": b"B" * 100})]
    path = write_tar(tmp_path / "s.tar", a)
    old = stoker.Dataset(path)
    assert bytes(old[0]["bin"]) == b"A" * 100  # its descriptor is now cached
    write_tar(tmp_path / "new.tar", b)
    os.replace(tmp_path / "new.tar", path)
    assert bytes(stoker.Dataset(path)[0]["bin"]) == b"B" * 100
    with pytest.raises(stoker.ShardFormatError, match="changed after it was indexed"):
        old[0]
