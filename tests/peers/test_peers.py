"""MosaicML Streaming (MDS) and LitData datasets read in place, as their own writers wrote
them: every column of every sample compared with the peer's own reader; compressed shards
decompressed once into the cache; damaged shards and indexes refused by name."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import stoker

N = 37


# -- LitData -------------------------------------------------------------------------

_LITDATA_WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import torch
    import litdata

    def sample(i):
        rng = np.random.default_rng(i)
        return {
            "image": rng.integers(0, 256, (3, 8, 8), dtype=np.uint8),
            "label": int(i * 7 - 50),
            "score": float(i) / 3,
            "flag": bool(i % 2),
            "name": f"sample-{i}-é",
            "blob": rng.bytes(5 + i % 9),
            "vec": rng.standard_normal(4 + i % 3).astype(np.float32),
            "t": torch.arange(6, dtype=torch.int16).reshape(2, 3) + i,
            "nested": {"a": int(i), "b": np.full((2, 2), i, np.int64)},
        }

    if __name__ == "__main__":
        out, compression, level = sys.argv[1], sys.argv[2], sys.argv[3]
        options = {}
        if compression != "none":
            options["compression"] = compression
        if level != "none":
            options["compression_level"] = level
        litdata.optimize(fn=sample, inputs=list(range(int(sys.argv[4]))), output_dir=out,
                         chunk_size=10, num_workers=1, **options)
    """
)


def _write_litdata(tmp_path, name: str, compression: str = "none", level: str = "none") -> str:
    pytest.importorskip("litdata")
    if compression == "zstd":
        pytest.importorskip("zstd", reason="litdata's zstd compression needs the zstd module")
    script = tmp_path / "write_litdata.py"
    script.write_text(_LITDATA_WRITER)
    out = tmp_path / name
    result = subprocess.run(
        [sys.executable, str(script), str(out), compression, level, str(N)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return str(out)


def _litdata_samples(folder: str) -> list[dict]:
    """Every sample as LitData's own reader gives it (read from a copy: it rewrites
    compressed chunks in place)."""
    import litdata

    copy = folder + "-litdata-copy"
    shutil.copytree(folder, copy)
    ds = litdata.StreamingDataset(copy)
    return [ds[i] for i in range(len(ds))]


def _check_litdata(ds, expected: list[dict]) -> None:
    assert len(ds) == len(expected)
    got = ds.get_batch(range(len(ds)))
    for sample, want in zip(got, expected):
        assert bytes(sample["image"]) == want["image"].tobytes()
        assert np.frombuffer(bytes(sample["label"]), "<i8")[0] == want["label"]
        assert np.frombuffer(bytes(sample["score"]), "<f8")[0] == want["score"]
        assert bytes(sample["flag"]) == bytes([want["flag"]])
        assert bytes(sample["name"]).decode() == want["name"]
        assert bytes(sample["blob"]) == bytes(want["blob"])  # (litdata may give a memoryview)
        assert bytes(sample["vec"]) == want["vec"].tobytes()
        assert bytes(sample["t"]) == want["t"].numpy().tobytes()
        assert np.frombuffer(bytes(sample["nested.a"]), "<i8")[0] == want["nested"]["a"]
        assert bytes(sample["nested.b"]) == want["nested"]["b"].tobytes()


@pytest.mark.parametrize(
    "variant",
    [("none", "none"), ("zstd", "none"), ("zstd", "chunk")],
    ids=["plain", "zstd-framed", "zstd-whole-chunk"],
)
def test_litdata_every_column(tmp_path, variant):
    folder = _write_litdata(tmp_path, "lit", *variant)
    ds = stoker.Dataset(folder, cache_dir=str(tmp_path / "cache"))  # before LitData's reader
    assert ds.fields == [
        "image", "label", "score", "flag", "name", "blob", "vec", "t", "nested.a", "nested.b"
    ]  # fmt: skip
    _check_litdata(ds, _litdata_samples(folder))
    assert ds[0]["__key__"].endswith("/0")
    if variant != ("none", "none"):  # decompressed once, into the cache
        assert os.listdir(tmp_path / "cache" / "unpacked")


def test_litdata_loader_fields_and_index_path(tmp_path):
    torch = pytest.importorskip("torch")
    folder = _write_litdata(tmp_path, "lit")
    expected = _litdata_samples(folder)
    ds = stoker.Dataset(os.path.join(folder, "index.json"))
    loader = stoker.Loader(
        ds,
        batch_size=16,
        shuffle=False,
        fields={"image": stoker.Raw((3, 8, 8), "uint8"), "label": stoker.Raw((), "int64")},
    )
    images = torch.cat([b["image"] for b in loader])
    assert images.shape == (N, 3, 8, 8)
    assert np.array_equal(images.numpy(), np.stack([s["image"] for s in expected]))
    labels = torch.cat([b["label"] for b in stoker.Loader(ds, 16, shuffle=False, fields={
        "label": stoker.Raw((), "int64")})])  # fmt: skip
    assert labels.tolist() == [s["label"] for s in expected]


def test_litdata_damaged_chunk(tmp_path):
    folder = _write_litdata(tmp_path, "lit")
    chunk = os.path.join(folder, sorted(f for f in os.listdir(folder) if f.endswith(".bin"))[0])
    with open(chunk, "r+b") as f:
        f.seek(4 + 4 * 3)  # the offset of record 3
        f.write((10**7).to_bytes(4, "little"))
    ds = stoker.Dataset(folder)
    with pytest.raises(stoker.ShardFormatError) as e:
        ds.get_batch([0])
    assert chunk in str(e.value) and "offset" in str(e.value)


def test_litdata_index_that_disagrees_with_its_chunks(tmp_path):
    folder = _write_litdata(tmp_path, "lit")
    index = os.path.join(folder, "index.json")
    with open(index) as f:
        meta = json.load(f)
    meta["chunks"][0]["chunk_size"] += 1
    with open(index, "w") as f:
        json.dump(meta, f)
    ds = stoker.Dataset(folder)
    with pytest.raises(stoker.ShardFormatError, match="expected") as e:
        ds.get_batch([0])
    assert meta["chunks"][0]["filename"] in str(e.value)


# -- MosaicML Streaming (MDS) ----------------------------------------------------------


def _streaming():
    try:
        from tests.support.peer_imports import import_streaming

        return import_streaming()
    except ImportError:
        pytest.skip(
            "mosaicml-streaming is not installed (it pins an old numpy and a CUDA torch: "
            "pip install --no-deps mosaicml-streaming zstd xxhash python-snappy cramjam "
            "brotli catalogue)"
        )


_MDS_COLUMNS = {
    "image": "ndarray:uint8:3,8,8",
    "label": "int",
    "small": "int16",
    "score": "float32",
    "name": "str",
    "blob": "bytes",
    "meta": "json",
    "count": "str_int",
}


def _mds_sample(i: int) -> dict:
    rng = np.random.default_rng(i)
    return {
        "image": rng.integers(0, 256, (3, 8, 8), dtype=np.uint8),
        "label": i * 7 - 50,
        "small": np.int16(i - 10),
        "score": np.float32(i / 3),
        "name": f"sample-{i}-é",
        "blob": rng.bytes(5 + i % 9),
        "meta": {"i": i, "tags": ["x", i]},
        "count": 10**12 + i,
    }


def _write_mds(tmp_path, name: str, compression: str | None, hashes=None) -> str:
    streaming = _streaming()
    out = str(tmp_path / name)
    with streaming.MDSWriter(
        out=out, columns=_MDS_COLUMNS, compression=compression, size_limit=1500, hashes=hashes
    ) as writer:
        for i in range(N):
            writer.write(_mds_sample(i))
    return out


@pytest.mark.parametrize("compression", [None, "zstd", "gz"])
def test_mds_every_column(tmp_path, compression):
    folder = _write_mds(tmp_path, "mds", compression)
    ds = stoker.Dataset(folder, cache_dir=str(tmp_path / "cache"))
    assert len(ds) == N and sorted(ds.fields) == sorted(_MDS_COLUMNS)
    streaming = _streaming()
    streaming.base.util.clean_stale_shared_memory()
    theirs = streaming.StreamingDataset(local=folder, batch_size=1)
    got = ds.get_batch(range(N))
    for i, sample in enumerate(got):
        want = theirs[i]
        assert bytes(sample["image"]) == want["image"].tobytes()
        assert np.frombuffer(bytes(sample["label"]), "<i8")[0] == want["label"]
        assert np.frombuffer(bytes(sample["small"]), "<i2")[0] == want["small"]
        assert np.frombuffer(bytes(sample["score"]), "<f4")[0] == want["score"]
        assert bytes(sample["name"]).decode() == want["name"]
        assert bytes(sample["blob"]) == bytes(want["blob"])  # (litdata may give a memoryview)
        assert json.loads(bytes(sample["meta"])) == want["meta"]
        assert int(bytes(sample["count"])) == want["count"]
    loader = stoker.Loader(
        ds, batch_size=N, shuffle=False,
        fields={"image": stoker.Raw((3, 8, 8), "uint8"), "count": stoker.Int()},
    )  # fmt: skip
    batch = next(iter(loader))
    assert batch["count"].tolist() == [10**12 + i for i in range(N)]
    assert np.array_equal(
        batch["image"].numpy(), np.stack([_mds_sample(i)["image"] for i in range(N)])
    )


def test_mds_damaged(tmp_path):
    folder = _write_mds(tmp_path, "mds", None)
    shard = os.path.join(folder, "shard.00001.mds")
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(stoker.ShardFormatError) as e:
        stoker.Dataset(folder)
    assert shard in str(e.value)
    folder = _write_mds(tmp_path, "mds2", None)
    shard = os.path.join(folder, "shard.00000.mds")
    with open(shard, "r+b") as f:
        f.seek(0)
        f.write((10**6).to_bytes(4, "little"))  # a record count the offset table cannot hold
    ds = stoker.Dataset(folder)
    with pytest.raises(stoker.ShardFormatError, match="offset table") as e:
        ds.get_batch([0])
    assert shard in str(e.value)


def test_mds_damaged_zstd_shard(tmp_path):
    folder = _write_mds(tmp_path, "mds", "zstd")
    shard = os.path.join(folder, "shard.00000.mds.zstd")
    with open(shard, "r+b") as f:
        f.seek(1)
        f.write(b"\xff" * 4)  # the frame's magic
    with pytest.raises(stoker.ShardFormatError) as e:
        stoker.Dataset(folder, cache_dir=str(tmp_path / "cache"))
    assert shard in str(e.value) and "zstd" in str(e.value)
    # Damaged data inside a frame is found by the writer's hash of the file.
    folder = _write_mds(tmp_path, "hashed", "zstd", hashes=["sha1"])
    shard = os.path.join(folder, "shard.00000.mds.zstd")
    with open(shard, "r+b") as f:
        f.seek(40)
        f.write(b"\xff" * 8)
    with pytest.raises(stoker.ShardFormatError, match="sha1") as e:
        stoker.Dataset(folder, cache_dir=str(tmp_path / "cache2"))
    assert shard in str(e.value)


# -- over HTTP ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "variant",
    [("none", "none"), ("zstd", "none"), ("zstd", "chunk")],
    ids=["plain", "zstd-framed", "zstd-whole-chunk"],
)
def test_a_served_litdata_index(tmp_path, variant):
    from tests.support.server import ShardServer

    folder = _write_litdata(tmp_path, "lit", *variant)
    with ShardServer(str(tmp_path)) as server:
        remote = stoker.Dataset(server.url_for("lit/index.json"), cache_dir=str(tmp_path / "c"))
        _check_litdata(remote, _litdata_samples(folder))
    if variant != ("none", "none"):  # fetched compressed, cached decompressed
        cached = [
            os.path.join(root, f)
            for root, _, files in os.walk(tmp_path / "c")
            for f in files
            if f.startswith("chunk-")
        ]
        assert cached
        for path in cached:
            with open(path, "rb") as f:
                assert f.read(4) != b"LDFZ"  # the plain chunk, not the framed one


def test_a_served_mds_index(tmp_path):
    from tests.support.server import ShardServer

    _write_mds(tmp_path, "mdsz", "zstd", hashes=["sha1"])
    local = _write_mds(tmp_path, "mds", None)
    with ShardServer(str(tmp_path)) as server:
        remote = stoker.Dataset(server.url_for("mdsz/index.json"), cache_dir=str(tmp_path / "c"))
        here = stoker.Dataset(local)
        for a, b in zip(remote.get_batch(range(N)), here.get_batch(range(N))):
            assert {k: bytes(v) for k, v in a.items() if k != "__key__"} == {
                k: bytes(v) for k, v in b.items() if k != "__key__"
            }
        shard = tmp_path / "mdsz" / "shard.00001.mds.zstd"
        damaged = bytearray(shard.read_bytes())
        damaged[40:48] = b"\xff" * 8
        shard.write_bytes(bytes(damaged))
        again = stoker.Dataset(server.url_for("mdsz/index.json"), cache_dir=str(tmp_path / "d"))
        with pytest.raises(stoker.StokerError, match="sha1") as e:
            again.get_batch(range(N))
        assert "shard.00001.mds.zstd" in str(e.value)


def test_inspect(tmp_path, capsys):
    from stoker.tools.cli import main

    folder = _write_litdata(tmp_path, "lit")
    assert main(["inspect", folder]) == 0
    out = capsys.readouterr().out
    assert f"{N} samples" in out and "litdata" in out and "notes" not in out
    assert "nested.b" in out
