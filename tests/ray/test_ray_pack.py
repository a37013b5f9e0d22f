"""stoker pack --ray and stoker.ray.write_shards on a local Ray cluster: the shards equal
a pack on one machine and read back byte for byte through stoker and webdataset; a worker
killed mid-write is run again and the manifest lists only whole shards; a job killed
before its end leaves no stoker.json."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import stoker
from stoker.manifest import sha256_of
from stoker.ray.tasks import KILL_ONCE_ENV
from stoker.tools.cli import main
from tests.support import REPO

pytestmark = pytest.mark.xdist_group("ray")

Image = pytest.importorskip("PIL.Image")
ray = pytest.importorskip("ray")

IMAGES = 5000
CLASSES = 5


@pytest.fixture(scope="module")
def jpeg_tree(tmp_path_factory) -> str:
    """A class-per-folder tree of 5,000 small JPEGs (their sizes vary)."""
    root = tmp_path_factory.mktemp("jpegs")
    rng = np.random.default_rng(0)
    for i in range(IMAGES):
        folder = root / f"class{i % CLASSES}"
        folder.mkdir(exist_ok=True)
        h, w = int(rng.integers(20, 48)), int(rng.integers(20, 48))
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, "JPEG", quality=80)
        (folder / f"img{i:05d}.jpg").write_bytes(out.getvalue())
    return str(root)


def pack(args: list[str]) -> None:
    assert main(["pack", *args, "--quiet"]) == 0


def shard_bytes(folder) -> dict[str, str]:
    names = sorted(n for n in os.listdir(folder) if n.endswith(".tar"))
    return {n: sha256_of(os.path.join(folder, n)) for n in names}


def samples_of(folder) -> dict[str, dict[str, bytes]]:
    ds = stoker.Dataset(str(folder))
    return {
        s["__key__"]: {k: np.asarray(v).tobytes() for k, v in s.items() if k != "__key__"}
        for s in ds.get_batch(np.arange(len(ds)))
    }


def webdataset_samples(folder) -> dict[str, dict[str, bytes]]:
    import webdataset as wds

    urls = sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".tar"))
    out = {}
    for sample in wds.WebDataset(urls, shardshuffle=False, empty_check=False):
        out[sample["__key__"]] = {k: v for k, v in sample.items() if not k.startswith("__")}
    return out


def originals(tree: str) -> dict[str, bytes]:
    out = {}
    for folder in sorted(os.listdir(tree)):
        for name in sorted(os.listdir(os.path.join(tree, folder))):
            with open(os.path.join(tree, folder, name), "rb") as f:
                out[f"{folder}/{name.removesuffix('.jpg')}"] = f.read()
    return out


@pytest.mark.parametrize("resize", [[], ["--image-size", "16"]], ids=["as-is", "image-size"])
def test_pack_on_ray_writes_the_shards_a_pack_on_one_machine_writes(
    ray_cluster, jpeg_tree, tmp_path, resize
):
    pack([jpeg_tree, str(tmp_path / "one"), "--samples-per-shard", "500", *resize])
    pack([jpeg_tree, str(tmp_path / "ray"), "--samples-per-shard", "500", *resize, "--ray"])
    assert shard_bytes(tmp_path / "ray") == shard_bytes(tmp_path / "one")
    assert len(shard_bytes(tmp_path / "ray")) == IMAGES // 500
    with open(tmp_path / "ray" / "stoker.json") as f, open(tmp_path / "one" / "stoker.json") as g:
        assert json.load(f) == json.load(g)
    got = samples_of(tmp_path / "ray")
    assert got == webdataset_samples(tmp_path / "ray")
    assert len(got) == IMAGES
    jpegs = originals(jpeg_tree)
    keys = sorted(got)
    assert sorted(k.split("/", 1)[1] for k in keys) == sorted(k.split("/", 1)[1] for k in jpegs)
    by_name = {k.rsplit("/", 1)[-1]: v for k, v in jpegs.items()}
    for key in keys:
        member = got[key]["jpg"]
        original = by_name[key.rsplit("/", 1)[-1]]
        if resize:
            decoded = Image.open(io.BytesIO(member))
            assert min(decoded.size) <= 16
        else:
            assert member == original


def test_a_task_killed_mid_write_is_run_again(ray_cluster, jpeg_tree, tmp_path, monkeypatch):
    marker = tmp_path / "killed-once"
    monkeypatch.setenv(KILL_ONCE_ENV, str(marker))
    pack([jpeg_tree, str(tmp_path / "ray"), "--samples-per-shard", "1000", "--ray"])
    assert marker.exists()  # a worker died, halfway through a shard
    with open(tmp_path / "ray" / "stoker.json") as f:
        manifest = json.load(f)
    for entry in manifest["shards"]:
        path = tmp_path / "ray" / entry["path"]
        assert entry["sha256"] == sha256_of(str(path))
        assert entry["bytes"] == os.path.getsize(path)
    assert sum(e["samples"] for e in manifest["shards"]) == IMAGES
    assert len(samples_of(tmp_path / "ray")) == IMAGES


def test_a_pack_killed_before_its_end_leaves_no_manifest(ray_cluster, jpeg_tree, tmp_path):
    out = tmp_path / "ray"
    work = tmp_path  # the pack's hidden work folder is made beside its output
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "stoker", "pack", jpeg_tree, str(out)]
    command += ["--samples-per-shard", "50", "--image-size", "12", "--ray", ray_cluster]
    process = subprocess.Popen(command, env=env, cwd=str(tmp_path))
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and process.poll() is None:
            tars = [
                n
                for folder, _, files in os.walk(work)
                if ".stoker-pack-" in folder
                for n in files
                if n.endswith(".tar")
            ]
            if len(tars) >= 3:
                break
            time.sleep(0.05)
        assert process.poll() is None, "the pack ended before it could be killed"
        process.send_signal(signal.SIGKILL)
        process.wait(30)
    finally:
        if process.poll() is None:
            process.kill()
    assert not (out / "stoker.json").exists()
    assert not out.exists() or not os.listdir(out)


# -- write_shards from a Ray Dataset -------------------------------------------------------


def items(n: int) -> list[dict]:
    rng = np.random.default_rng(1)
    return [
        {
            "__key__": f"s{i:05d}",
            "jpg": rng.integers(0, 256, int(rng.integers(10, 400)), dtype=np.uint8).tobytes(),
            "cls": int(i % 7),
        }
        for i in range(n)
    ]


def test_write_shards_from_a_ray_dataset(ray_cluster, tmp_path):
    rows = items(600)
    dataset = ray.data.from_items(rows, override_num_blocks=4)
    manifest = stoker.ray.write_shards(dataset, tmp_path / "out", max_samples=64)
    assert os.path.basename(manifest) == "stoker.json"
    got = samples_of(tmp_path / "out")
    assert got == webdataset_samples(tmp_path / "out")
    assert got == {r["__key__"]: {"cls": str(r["cls"]).encode(), "jpg": r["jpg"]} for r in rows}
    with open(manifest) as f:
        entries = json.load(f)["shards"]
    assert all(e["samples"] <= 64 for e in entries)
    # Names follow the tasks: the same write again gives the same shards.
    again = stoker.ray.write_shards(
        ray.data.from_items(rows, override_num_blocks=4), tmp_path / "again", max_samples=64
    )
    with open(again) as f:
        assert [e["path"] for e in json.load(f)["shards"]] == [e["path"] for e in entries]


def test_write_shards_makes_keys_from_the_input_order(ray_cluster, tmp_path):
    rows = [{"txt": f"row {i}"} for i in range(100)]
    stoker.ray.write_shards(ray.data.from_items(rows, override_num_blocks=3), tmp_path / "o")
    got = samples_of(tmp_path / "o")
    assert [got[k]["txt"].decode() for k in sorted(got)] == [r["txt"] for r in rows]


def test_a_write_task_killed_is_run_again(ray_cluster, tmp_path, monkeypatch):
    marker = tmp_path / "killed-once"
    monkeypatch.setenv(KILL_ONCE_ENV, str(marker))
    rows = items(300)
    manifest = stoker.ray.write_shards(
        ray.data.from_items(rows, override_num_blocks=3), tmp_path / "out", max_samples=40
    )
    assert marker.exists()
    with open(manifest) as f:
        entries = json.load(f)["shards"]
    for entry in entries:
        assert entry["sha256"] == sha256_of(str(tmp_path / "out" / entry["path"]))
    assert sum(e["samples"] for e in entries) == len(rows)
    assert not [n for n in os.listdir(tmp_path / "out") if n.startswith(".")]


def test_write_shards_refuses_a_finished_dataset(ray_cluster, tmp_path):
    stoker.ray.write_shards(ray.data.from_items(items(10)), tmp_path / "out")
    with pytest.raises(stoker.StokerError, match="finished dataset"):
        stoker.ray.write_shards(ray.data.from_items(items(10)), tmp_path / "out")


def test_a_task_error_ends_the_job_naming_the_file(ray_cluster, tmp_path):
    from stoker.ray.packing import write_shards_on_ray

    root = tmp_path / "files"
    root.mkdir()
    names = [f"f{i}.bin" for i in range(6)]
    for i, name in enumerate(names):
        (root / name).write_bytes(bytes([i]) * 100)
    ds = stoker.Dataset.from_files(str(root), names, list(range(6)))
    os.unlink(root / "f3.bin")  # gone after the driver opened the source
    paths = [str(tmp_path / "shard-0.tar"), str(tmp_path / "shard-1.tar")]
    with pytest.raises(stoker.ReadError, match="f3.bin"):
        write_shards_on_ray(ds, [np.arange(3), np.arange(3, 6)], paths)


def test_a_failed_join_by_address_says_how_to_give_the_token(monkeypatch, tmp_path):
    """Ray looks for a token-authenticated cluster's token only when joining by ``auto``
    or with RAY_AUTH_MODE set; joining by HOST:PORT without them fails as InvalidAuthToken."""
    from stoker.ray.tasks import _token_hint

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    assert "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN" in _token_hint("10.0.0.1:6379")
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("x" * 64)
    assert "~/.ray/auth_token" in _token_hint("10.0.0.1:6379")
    assert _token_hint("auto") == _token_hint(None) == ""
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    assert _token_hint("10.0.0.1:6379") == ""
