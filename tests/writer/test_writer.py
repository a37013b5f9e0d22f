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


_WRITE_THEN_HANG = """
import sys, time, stoker
with stoker.ShardWriter(sys.argv[1], max_samples=100) as w:
    for i in range(450):
        w.write({"__key__": f"k{i:04d}", "bin": bytes(64)})
        if i == 330:
            print("written", flush=True)
            time.sleep(600)  # killed here, before close()
"""


def _killed_when(command: list[str], ready) -> None:
    """Run `command` and SIGKILL it once `ready()` is true."""
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, *command], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready(proc) and time.monotonic() < deadline:
            assert proc.poll() is None, "the writer finished before it could be killed"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(30)


def _work_folders(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith(".stoker-"))


def test_a_killed_shard_writer_leaves_nothing_read_as_data(tmp_path, caplog):
    out = tmp_path / "out"
    _killed_when(["-c", _WRITE_THEN_HANG, str(out)], lambda p: p.stdout.readline() == "written\n")
    assert len(_work_folders(out)) == 1  # its unfinished shards, hidden
    with caplog.at_level("WARNING", "stoker"), pytest.raises(stoker.StokerError, match="no shards"):
        stoker.Dataset(str(out))
    assert "skipped 1 hidden entry (.stoker-writer-" in caplog.text
    # The next writer into the same place removes what the dead one left, and finishes.
    with stoker.ShardWriter(out, max_samples=100) as w:
        for i in range(150):
            w.write({"__key__": f"n{i:04d}", "bin": bytes(8)})
    assert _work_folders(out) == []
    assert len(stoker.Dataset(str(out))) == 150


def test_a_killed_pack_leaves_nothing_read_as_data(tmp_path, caplog):
    from stoker.tools.cli import main as cli
    from tests.support.server import ShardServer
    from tests.support.shards import make_samples, write_tar

    source = tmp_path / "source"
    source.mkdir()
    for s in range(8):
        samples = [(f"s{s}-{k}", fields) for k, fields in make_samples(100, seed=s, size=4000)]
        write_tar(source / f"in-{s}.tar", samples)
    parent = tmp_path / "packed"
    parent.mkdir()
    out = parent / "train"

    def packing(proc) -> bool:  # a pack's work folder with a shard in it
        return any(
            name.endswith(".tar")
            for work in _work_folders(parent)
            for name in os.listdir(parent / work)
        )

    # A slow link, so that the pack is still at work when it is killed.
    with ShardServer(source, bandwidth=400_000) as server:
        urls = server.url + "/in-{0..7}.tar"
        command = ["-m", "stoker", "pack", urls, str(out), "--samples-per-shard", "100", "--quiet"]
        _killed_when(command, packing)
    assert not out.exists() and len(_work_folders(parent)) == 1
    with caplog.at_level("WARNING", "stoker"), pytest.raises(stoker.StokerError, match="no shards"):
        stoker.Dataset(str(parent))
    assert "skipped 1 hidden entry (.stoker-pack-" in caplog.text
    # The next pack there removes the dead one's folder.
    assert cli(["pack", str(source), str(out), "--samples-per-shard", "100", "--quiet"]) == 0
    assert _work_folders(parent) == [] and len(stoker.Dataset(str(out))) == 800
