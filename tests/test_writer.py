"""stoker.ShardWriter: shards and their manifest written from Python, read back byte for
byte by stoker and by webdataset, rolled over by size, stratified, and never left half
written."""

from __future__ import annotations

import io
import json
import os
import tarfile

import numpy as np
import pytest

import stoker


def _samples(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "__key__": f"part{i % 3}/s{i:05d}",
            "jpg": rng.bytes(50 + i),
            "cls": int(i % 5),
            "npy": rng.standard_normal((2, 3)).astype(np.float32),
            "json": {"i": i, "tags": ["a", "é"]},
            "txt": f"sample {i} é",
            "score": float(i) / 3,
            "flag": bool(i % 2),
        }
        for i in range(n)
    ]


def _expected_bytes(sample: dict) -> dict[str, bytes]:
    out = {}
    for field, value in sample.items():
        if field == "__key__":
            continue
        if isinstance(value, bytes):
            out[field] = value
        elif isinstance(value, np.ndarray):
            buffer = io.BytesIO()
            np.save(buffer, value)
            out[field] = buffer.getvalue()
        elif isinstance(value, dict):
            out[field] = json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
        elif isinstance(value, bool):
            out[field] = b"1" if value else b"0"
        elif isinstance(value, int):
            out[field] = str(value).encode()
        elif isinstance(value, float):
            out[field] = repr(value).encode()
        else:
            out[field] = value.encode()
    return out


def test_round_trip_through_stoker_and_webdataset(tmp_path):
    wds = pytest.importorskip("webdataset")
    samples = _samples(120)
    with stoker.ShardWriter(tmp_path / "out", max_samples=50) as sink:
        for sample in samples:
            sink.write(sample)
    assert [os.path.basename(p) for p in sink.shards] == [
        "shard-000000.tar",
        "shard-000001.tar",
        "shard-000002.tar",
    ]
    manifest = json.loads((tmp_path / "out" / "stoker.json").read_text())
    assert [s["samples"] for s in manifest["shards"]] == [50, 50, 20]
    assert all(len(s["sha256"]) == 64 for s in manifest["shards"])
    assert all(os.path.exists(p + ".stoker-idx") for p in sink.shards)
    ds = stoker.Dataset(str(tmp_path / "out"))
    got = ds.get_batch(range(len(ds)))
    for sample, back in zip(samples, got):
        assert back["__key__"] == sample["__key__"]
        assert {f: bytes(v) for f, v in back.items() if f != "__key__"} == _expected_bytes(sample)
    read = list(wds.WebDataset(sink.shards, shardshuffle=False))
    assert [s["__key__"] for s in read] == [s["__key__"] for s in samples]
    for sample, back in zip(samples, read):
        assert {f: back[f] for f in _expected_bytes(sample)} == _expected_bytes(sample)
    loader = stoker.Loader(
        ds, batch_size=40, shuffle=False, fields={"npy": stoker.Npy(), "cls": stoker.Int()}
    )
    batch = next(iter(loader))
    assert np.array_equal(batch["npy"].numpy(), np.stack([s["npy"] for s in samples[:40]]))
    assert batch["cls"].tolist() == [s["cls"] for s in samples[:40]]


def test_headers_are_fixed_and_the_bytes_repeatable(tmp_path):
    for name in ("a", "b"):
        with stoker.ShardWriter(tmp_path / name) as sink:
            for sample in _samples(10):
                sink.write(sample)
    a = (tmp_path / "a" / "shard-000000.tar").read_bytes()
    assert a == (tmp_path / "b" / "shard-000000.tar").read_bytes()
    with tarfile.open(tmp_path / "a" / "shard-000000.tar") as tar:
        members = tar.getmembers()
    assert {(m.mtime, m.uid, m.gid, m.mode, m.uname) for m in members} == {(0, 0, 0, 0o644, "")}
    assert [m.name for m in members[:3]] == [
        "part0/s00000.cls",
        "part0/s00000.flag",
        "part0/s00000.jpg",
    ]


def test_rolls_over_by_bytes(tmp_path):
    with stoker.ShardWriter(tmp_path / "out", max_bytes=20_000) as sink:
        for i in range(60):
            sink.write({"__key__": f"k{i:03d}", "bin": bytes(1000)})
    sizes = [os.path.getsize(p) for p in sink.shards]
    assert len(sizes) > 2 and max(sizes) <= 20_000
    assert len(stoker.Dataset(str(tmp_path / "out"))) == 60


def test_stratified(tmp_path):
    with stoker.ShardWriter(tmp_path / "out", max_samples=20, stratify_by="cls") as sink:
        for i in range(100):
            sink.write({"__key__": f"k{i:03d}", "bin": bytes([i]), "cls": i % 4})
    assert len(sink.shards) == 5
    for path in sink.shards:
        labels = [int(bytes(s["cls"])) for s in stoker.Dataset(path)[:]]
        assert len(labels) == 20 and sorted(np.bincount(labels, minlength=4)) == [5, 5, 5, 5]
    ds = stoker.Dataset(str(tmp_path / "out"))
    assert sorted(ds.keys(range(100))) == [f"k{i:03d}" for i in range(100)]
    assert not any(name.startswith(".") for name in os.listdir(tmp_path / "out"))


def test_a_failure_leaves_nothing_that_looks_whole(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom"), stoker.ShardWriter(out, max_samples=2) as sink:
        for i in range(5):
            sink.write({"__key__": f"k{i}", "bin": b"x"})
        raise RuntimeError("boom")
    assert os.listdir(out) == []
    # A writer that was never closed (a process that died) leaves only its hidden folder.
    sink = stoker.ShardWriter(tmp_path / "died")
    sink.write({"__key__": "k", "bin": b"x"})
    assert [n for n in os.listdir(tmp_path / "died") if not n.startswith(".")] == []
    with pytest.raises(stoker.StokerError):
        stoker.Dataset(str(tmp_path / "died"))
    sink.abort()


def test_bad_samples_are_refused(tmp_path):
    with stoker.ShardWriter(tmp_path / "out") as sink:
        for key in ("", "/abs", "a/../b", "a.b", None):
            with pytest.raises(stoker.UsageError):
                sink.write({"__key__": key, "bin": b"x"})
        sink.write({"__key__": "a", "bin": b"x"})
        with pytest.raises(stoker.UsageError, match="written already"):
            sink.write({"__key__": "a", "bin": b"y"})
        with pytest.raises(TypeError, match="no conventional encoding"):
            sink.write({"__key__": "b", "obj": object()})
        with pytest.raises(stoker.UsageError, match="no fields"):
            sink.write({"__key__": "c"})
    assert len(stoker.Dataset(str(tmp_path / "out"))) == 1
    with pytest.raises(stoker.StokerError, match="not empty"):
        stoker.ShardWriter(tmp_path / "out")
    with pytest.raises(stoker.StokerError, match="no samples"), stoker.ShardWriter(tmp_path / "e"):
        pass


def test_tensors_become_npy(tmp_path):
    torch = pytest.importorskip("torch")
    with stoker.ShardWriter(tmp_path / "out") as sink:
        sink.write({"__key__": "t", "npy": torch.arange(6, dtype=torch.int16).reshape(2, 3)})
    got = np.load(io.BytesIO(bytes(stoker.Dataset(str(tmp_path / "out"))[0]["npy"])))
    assert got.dtype == np.int16 and got.tolist() == [[0, 1, 2], [3, 4, 5]]
