"""stoker.ray.read on a local Ray cluster: the rows equal a Loader's batches over the same
dataset (keys, bytes, integers, tensors), whatever the number of read tasks; streaming_split
deals every sample once; remote shards are read through the node cache; a corrupt shard's
error reaches the driver naming the file; stoker index --ray writes the manifest stoker
index writes."""

from __future__ import annotations

import json
import os
import shutil
import threading

import numpy as np
import pytest

import stoker
from stoker.tools.cli import main
from tests.support.server import ShardServer

pytestmark = pytest.mark.xdist_group("ray")

ray = pytest.importorskip("ray")

SAMPLES = 1_000


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    """Ten tar shards of 100 samples: bytes of varying length, a label, a 2x3 float array."""
    out = tmp_path_factory.mktemp("shards") / "data"
    rng = np.random.default_rng(1)
    with stoker.ShardWriter(str(out), max_samples=100) as sink:
        for i in range(SAMPLES):
            sink.write(
                {
                    "__key__": f"s{i:05d}",
                    "bin": rng.integers(
                        0, 256, int(rng.integers(1, 200)), dtype=np.uint8
                    ).tobytes(),
                    "cls": i % 7,
                    "npy": rng.standard_normal((2, 3)).astype(np.float32),
                }
            )
    return str(out)


FIELDS = {"bin": stoker.Bytes(), "cls": stoker.Int(), "npy": stoker.Npy()}


def loader_rows(source: str) -> dict[str, tuple[bytes, int, np.ndarray]]:
    rows = {}
    for batch in stoker.Loader(stoker.Dataset(source), 64, shuffle=False, fields=FIELDS):
        for j, key in enumerate(batch["__key__"]):
            rows[key] = (bytes(batch["bin"][j]), int(batch["cls"][j]), batch["npy"][j].numpy())
    return rows


def ray_rows(rows: list[dict]) -> dict[str, tuple[bytes, int, np.ndarray]]:
    return {r["__key__"]: (bytes(r["bin"]), int(r["cls"]), np.asarray(r["npy"])) for r in rows}


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, (data, label, array) in want.items():
        assert got[key][0] == data, key
        assert got[key][1] == label, key
        np.testing.assert_array_equal(got[key][2], array)


@pytest.mark.parametrize("tasks", [1, 3, 7])
def test_read_gives_the_samples_a_loader_gives(ray_cluster, shards, tasks):
    from stoker.ray import read

    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    try:
        got = read(shards, fields=FIELDS, batch_size=50, override_num_blocks=tasks)
        rows = got.take_all()
    finally:
        context.execution_options.preserve_order = False
    want = loader_rows(shards)
    assert len(rows) == SAMPLES
    assert [r["__key__"] for r in rows] == list(want)  # the source's order, kept by Ray
    assert_same(ray_rows(rows), want)


def test_read_blocks_are_batches_of_the_columns_fields_name(ray_cluster, shards):
    from stoker.ray import read

    got = read(stoker.Dataset(shards), fields=FIELDS, batch_size=100, override_num_blocks=2)
    batches = list(got.iter_batches(batch_size=None, batch_format="numpy"))
    assert sum(len(b["__key__"]) for b in batches) == SAMPLES
    first = batches[0]
    assert set(first) == {"__key__", "bin", "cls", "npy"}
    assert first["npy"].shape[1:] == (2, 3) and first["npy"].dtype == np.float32
    assert first["cls"].dtype == np.int64


def test_streaming_split_deals_every_sample_once(ray_cluster, shards):
    from stoker.ray import read

    splits = read(shards, fields=FIELDS, batch_size=25, override_num_blocks=4).streaming_split(2)
    keys: list[list[str]] = [[], []]

    def consume(i: int) -> None:
        for batch in splits[i].iter_batches(batch_size=32, batch_format="numpy"):
            keys[i].extend(batch["__key__"].tolist())

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert keys[0] and keys[1]
    assert not set(keys[0]) & set(keys[1])
    assert sorted(keys[0] + keys[1]) == sorted(loader_rows(shards))


def test_read_of_remote_shards_goes_through_the_node_cache(ray_cluster, shards, tmp_path):
    from stoker.ray import read

    with ShardServer(os.path.dirname(shards)) as server:
        url = f"{server.url}/data/stoker.json"
        rows = read(url, fields=FIELDS, batch_size=64, cache_dir=str(tmp_path / "cache"))
        got = ray_rows(rows.take_all())
    assert_same(got, loader_rows(shards))


def test_a_shard_cut_short_is_named_where_the_dataset_is_consumed(ray_cluster, shards, tmp_path):
    from stoker.ray import read

    bad = tmp_path / "bad"
    shutil.copytree(shards, bad)
    ds = stoker.Dataset(str(bad))
    victim = sorted(n for n in os.listdir(bad) if n.endswith(".tar"))[4]
    with open(bad / victim, "r+b") as f:  # cut short after the driver opened it
        f.truncate(os.path.getsize(bad / victim) // 3)
    with pytest.raises(stoker.StokerError) as caught:
        read(ds, fields=FIELDS, batch_size=50, override_num_blocks=3).take_all()
    assert victim in str(caught.value)


def test_read_refuses_what_it_cannot_read(shards):
    from stoker.ray import read

    with pytest.raises(stoker.UsageError, match="fields="):
        read(shards, fields={})
    with pytest.raises(stoker.UsageError, match="batch_size"):
        read(shards, fields=FIELDS, batch_size=0)


def test_index_on_ray_writes_the_manifest_index_writes(ray_cluster, shards, tmp_path, capsys):
    from stoker.tools.inspect import index_remote

    names = sorted(n for n in os.listdir(shards) if n.endswith(".tar"))
    with ShardServer(shards) as server:
        urls = [f"{server.url}/{n}" for n in names]
        plain, on_ray = tmp_path / "plain.json", tmp_path / "ray.json"
        cache = ["--cache-dir", str(tmp_path / "cache")]
        assert main(["index", *urls, "--out", str(plain), *cache]) == 0
        ray_cache = ["--cache-dir", str(tmp_path / "ray-cache")]
        assert main(["index", *urls, "--out", str(on_ray), *ray_cache, "--ray"]) == 0
        capsys.readouterr()
        cache_dir = str(tmp_path / "shown")
        index_remote(urls, str(tmp_path / "shown.json"), cache_dir=cache_dir, ray=True, quiet=False)
        shown = capsys.readouterr().err  # the progress bar: shards done, samples, bytes
        assert f"{len(names)}/{len(names)}" in shown and "samples" in shown, shown
    with open(plain) as f, open(on_ray) as g:
        assert json.load(g) == json.load(f)
    with open(os.path.join(shards, "stoker.json")) as f:
        written = json.load(f)
    with open(on_ray) as f:
        indexed = json.load(f)
    assert [s["sha256"] for s in indexed["shards"]] == [s["sha256"] for s in written["shards"]]


def test_index_on_ray_is_for_remote_shards(shards, capsys):
    assert main(["index", shards, "--ray"]) == 1
    assert "for remote shards" in capsys.readouterr().err
