"""stoker.ray.write_shards into an s3:// prefix of SeaweedFS: each shard put whole by its
write task, the manifest last; the shards read back through stoker; what an earlier run
left is replaced; a prefix holding a finished dataset is refused."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest

import stoker
import stoker.ray
from tests.support import REPO, object_store

pytestmark = pytest.mark.xdist_group("ray")

ray = pytest.importorskip("ray")
pytest.importorskip("botocore")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with object_store.started_for_tests(tmp_path_factory, "ray") as server:
        yield server


@pytest.fixture
def env(store, tmp_path, monkeypatch):
    return object_store.use_store(store, monkeypatch, tmp_path)


def worker_env() -> dict:
    """The store's settings for the write tasks: a node signs with what it finds itself,
    and the cluster's workers were started before the store."""
    names = [n for n in os.environ if n.startswith("AWS_")]
    return {
        "runtime_env": {
            "env_vars": {**{n: os.environ[n] for n in names}, "PYTHONPATH": REPO},
        }
    }


def rows(n: int) -> list[dict]:
    rng = np.random.default_rng(3)
    return [
        {
            "__key__": f"k{i:05d}",
            "jpg": rng.integers(0, 256, int(rng.integers(10, 3000)), dtype=np.uint8).tobytes(),
            "cls": i % 5,
        }
        for i in range(n)
    ]


def test_write_shards_into_an_s3_prefix(ray_cluster, store, env, tmp_path):
    data = rows(400)
    # An earlier run that died: a shard no task of this run writes, and one it rewrites.
    store.put("ray", "set/shard-000009-000000.tar", b"left by a run that died")
    store.put("ray", "set/shard-000000-000000.tar", b"half a shard")
    manifest = stoker.ray.write_shards(
        ray.data.from_items(data, override_num_blocks=3),
        "s3://ray/set/",
        max_samples=50,
        ray_remote_args=worker_env(),
    )
    assert manifest == "s3://ray/set/stoker.json"
    client = store.client()
    listed = client.list_objects_v2(Bucket="ray", Prefix="set/")["Contents"]
    keys = {o["Key"] for o in listed}
    assert "set/shard-000009-000000.tar" not in keys
    entries = json.loads(client.get_object(Bucket="ray", Key="set/stoker.json")["Body"].read())
    entries = entries["shards"]
    assert {f"set/{e['path']}" for e in entries} <= keys
    assert sum(e["samples"] for e in entries) == len(data)
    for entry in entries:
        body = client.get_object(Bucket="ray", Key=f"set/{entry['path']}")["Body"].read()
        assert hashlib.sha256(body).hexdigest() == entry["sha256"]
    ds = stoker.Dataset("s3://ray/set/", cache_dir=str(tmp_path / "cache"))
    got = {s["__key__"]: s for s in ds.get_batch(np.arange(len(ds)))}
    assert sorted(got) == [r["__key__"] for r in data]
    for r in data:
        assert bytes(got[r["__key__"]]["jpg"]) == r["jpg"]
        assert bytes(got[r["__key__"]]["cls"]) == str(r["cls"]).encode()

    with pytest.raises(stoker.StokerError, match="finished dataset"):
        stoker.ray.write_shards(ray.data.from_items(data[:10]), "s3://ray/set/")


def test_write_shards_refuses_a_prefix_holding_other_files(ray_cluster, store, env):
    store.put("ray", "other/notes.txt", b"not a shard")
    with pytest.raises(stoker.StokerError, match="other files"):
        stoker.ray.write_shards(ray.data.from_items(rows(5)), "s3://ray/other/")
