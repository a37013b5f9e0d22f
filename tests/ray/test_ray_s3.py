"""stoker.ray.write_shards into an s3:// prefix of SeaweedFS: each shard put whole by its
write task, the manifest last; the shards read back through stoker; what an earlier run
left is replaced; a prefix holding a finished dataset is refused."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import stoker
import stoker.ray
from stoker.ray.tasks import KILL_ONCE_ENV
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


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> str:
    """A class-per-folder tree of 600 files of random bytes (a pack reads them as is)."""
    root = tmp_path_factory.mktemp("tree")
    rng = np.random.default_rng(5)
    for i in range(600):
        folder = root / f"class{i % 3}"
        folder.mkdir(exist_ok=True)
        (folder / f"f{i:04d}.jpg").write_bytes(rng.bytes(int(rng.integers(10, 5000))))
    return str(root)


def listed_bodies(store, bucket: str, prefix: str) -> dict[str, bytes]:
    client = store.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]]
    return {k[len(prefix) :]: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


@pytest.mark.parametrize("kill", [False, True], ids=["whole", "a-worker-killed"])
def test_pack_on_ray_into_an_s3_prefix(ray_cluster, store, env, tree, tmp_path, monkeypatch, kill):
    """`stoker pack SRC s3://... --ray`: each task puts its shard (member index first) from
    its node, the driver the manifest last; the objects are those of a pack into a folder
    on one machine, the shards byte for byte, also when a worker dies mid-shard and Ray
    runs it again."""
    from stoker.tools.cli import main

    args = ["--samples-per-shard", "100", "--quiet"]
    assert main(["pack", tree, str(tmp_path / "folder"), *args]) == 0
    if kill:
        marker = tmp_path / "killed-once"
        monkeypatch.setenv(KILL_ONCE_ENV, str(marker))
    prefix = f"pack-{kill:d}/"
    # The driver in a process of its own (the store's credentials are looked up once per
    # process), joining the tests' cluster.
    command = [sys.executable, "-m", "stoker", "pack", tree, f"s3://ray/{prefix}", *args]
    run = subprocess.run(
        [*command, "--ray", ray_cluster],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert run.returncode == 0, run.stderr
    if kill:
        assert marker.exists()  # a worker died, halfway through a shard
    got = listed_bodies(store, "ray", prefix)
    want = {}
    for name in os.listdir(tmp_path / "folder"):
        with open(tmp_path / "folder" / name, "rb") as f:
            want[name] = f.read()
    assert sorted(got) == sorted(want)
    assert json.loads(got.pop("stoker.json")) == json.loads(want.pop("stoker.json"))
    shards = sorted(n for n in want if n.endswith(".tar"))
    # every shard byte for byte (a member index holds its shard's local time: not compared)
    assert {n: got[n] for n in shards} == {n: want[n] for n in shards}
    ds = stoker.Dataset(f"s3://ray/{prefix}", cache_dir=str(tmp_path / "cache"))
    assert len(ds) == 600
