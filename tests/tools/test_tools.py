"""The command line's tools on tiny data: pack, index, inspect, demo, and the Loader's log."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import stoker
from stoker.tools.cli import main
from tests.support.shards import make_samples, write_tar, write_zip


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stoker", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def files_and_csv(folder, n: int = 60, bad: dict | None = None):
    """One file per sample in labels_train/, and labels_train.csv of filename,label rows."""
    root = folder / "labels_train"
    root.mkdir()
    rng = np.random.default_rng(1)
    rows = ["filename,label"]
    for i in range(n):
        name = f"img{i:04d}.png"
        (root / name).write_bytes(rng.integers(0, 256, 100 + i, dtype=np.uint8).tobytes())
        rows.append(f"{name},{i % 3}")
    for line, text in (bad or {}).items():
        rows[line] = text
    csv = folder / "labels_train.csv"
    csv.write_text("\n".join(rows) + "\n")
    return csv, root


def pack_csv(csv, root, out, *options: str) -> int:
    return main(["pack", "--csv", str(csv), "--root", str(root), str(out), "--quiet", *options])


def tar_bytes(folder) -> dict[str, bytes]:
    """The shards and the manifest (member indexes record the shards' times: not these)."""
    names = [p for p in sorted(os.listdir(folder)) if not p.endswith(stoker._core.SIDECAR_SUFFIX)]
    return {p: (folder / p).read_bytes() for p in names}


# -- pack ------------------------------------------------------------------------------


def test_pack_csv_round_trips_through_stoker_and_webdataset(tmp_path):
    import webdataset as wds

    csv, root = files_and_csv(tmp_path)
    out = tmp_path / "shards"
    assert pack_csv(csv, root, out, "--samples-per-shard", "25") == 0
    shards = ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
    indexes = [name + stoker._core.SIDECAR_SUFFIX for name in shards]
    assert sorted(os.listdir(out)) == sorted([*shards, *indexes, "stoker.json"])
    original = stoker.Dataset.from_csv(csv, root)
    want = {s["__key__"]: s for s in original.get_batch(np.arange(len(original)))}
    packed = stoker.Dataset(out)
    assert len(packed) == len(original)
    for sample in packed.get_batch(np.arange(len(packed))):
        source = want[sample["__key__"]]
        assert bytes(sample["png"]) == bytes(source["png"])
        assert int(bytes(sample["cls"])) == source["label"]
    urls = [str(out / name) for name in sorted(os.listdir(out)) if name.endswith(".tar")]
    seen = 0
    for sample in wds.WebDataset(urls, shardshuffle=False, empty_check=False):
        source = want[sample["__key__"]]
        assert sample["png"] == bytes(source["png"])
        assert int(sample["cls"]) == source["label"]
        seen += 1
    assert seen == len(original)


def test_pack_is_deterministic(tmp_path):
    csv, root = files_and_csv(tmp_path)
    outs = [tmp_path / "a", tmp_path / "b"]
    for out, threads in zip(outs, ("1", "3")):  # scheduling must not matter
        options = ("--shard-size", "3K", "--shuffle", "--seed", "7", "--threads", threads)
        assert pack_csv(csv, root, out, *options) == 0
    assert tar_bytes(outs[0]) == tar_bytes(outs[1])
    assert len(os.listdir(outs[0])) > 3
    other = tmp_path / "c"
    assert pack_csv(csv, root, other, "--shard-size", "3K", "--shuffle", "--seed", "8") == 0
    assert tar_bytes(other) != tar_bytes(outs[0])


def test_pack_stratify_spreads_each_label(tmp_path):
    csv, root = files_and_csv(tmp_path, n=90)
    out = tmp_path / "shards"
    assert pack_csv(csv, root, out, "--samples-per-shard", "30", "--shuffle", "--stratify") == 0
    for name in sorted(n for n in os.listdir(out) if n.endswith(".tar")):
        ds = stoker.Dataset(out / name)
        labels = [int(bytes(s["cls"])) for s in ds.get_batch(np.arange(len(ds)))]
        assert sorted(np.bincount(labels, minlength=3).tolist()) == [10, 10, 10]


def test_pack_class_folders(tmp_path):
    tree = tmp_path / "tree"
    for c, count in (("cat", 3), ("dog", 4)):
        (tree / c).mkdir(parents=True)
        for i in range(count):
            (tree / c / f"{c}{i}.jpg").write_bytes(f"{c}-{i}".encode())
    out = tmp_path / "shards"
    assert main(["pack", str(tree), str(out), "--quiet"]) == 0
    manifest = json.loads((out / "stoker.json").read_text())
    assert manifest["classes"] == ["cat", "dog"]
    ds = stoker.Dataset(out)
    got = {s["__key__"]: (bytes(s["jpg"]), int(bytes(s["cls"]))) for s in ds.get_batch(range(7))}
    assert got["dog/dog2"] == (b"dog-2", 1) and got["cat/cat0"] == (b"cat-0", 0)


def test_pack_from_shards_and_npy(tmp_path):
    write_zip(tmp_path / "a.zip", make_samples(5))
    np.save(tmp_path / "b.npy", np.arange(12, dtype=np.float32).reshape(4, 3))
    out = tmp_path / "out"
    assert main(["pack", str(tmp_path / "a.zip"), str(out), "--quiet"]) == 0
    assert len(stoker.Dataset(out)) == 5
    out2 = tmp_path / "out2"
    assert main(["pack", str(tmp_path / "b.npy"), str(out2), "--quiet"]) == 0
    ds = stoker.Dataset(out2)
    row = np.load(__import__("io").BytesIO(bytes(ds[2]["npy"])))
    assert row.tolist() == [6.0, 7.0, 8.0]


def test_manifest_checksums_are_true(tmp_path):
    csv, root = files_and_csv(tmp_path)
    out = tmp_path / "shards"
    assert pack_csv(csv, root, out) == 0
    manifest = json.loads((out / "stoker.json").read_text())
    for entry in manifest["shards"]:
        data = (out / entry["path"]).read_bytes()
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
        assert entry["bytes"] == len(data)
    assert sum(e["samples"] for e in manifest["shards"]) == 60


def test_bad_csv_rows_stop_the_run_with_one_line(tmp_path):
    csv, root = files_and_csv(tmp_path, bad={3: "img0002.png,three", 7: "nothere.png,1"})
    out = tmp_path / "shards"
    result = run_cli("pack", "--csv", str(csv), "--root", str(root), str(out))
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "line 4: 'img0002.png','three'" in result.stderr and "1 row(s)" in result.stderr
    assert not out.exists()
    (root / "img0002.png").unlink()
    csv.write_text("filename,label\nimg0002.png,1\nimg0001.png,2\nimg0009.png,x\n")
    result = run_cli("pack", "--csv", str(csv), "--root", str(root), str(out))
    assert result.returncode == 1 and "integer label" in result.stderr
    csv.write_text("filename,label\nimg0002.png,1\nimg0001.png,2\nmissing.png,0\n")
    result = run_cli("pack", "--csv", str(csv), "--root", str(root), str(out))
    assert result.returncode == 1
    assert "2 file(s)" in result.stderr and "img0002.png" in result.stderr
    assert not out.exists()


def test_pack_refuses_a_full_output_folder(tmp_path):
    write_tar(tmp_path / "a.tar", make_samples(3))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = run_cli("pack", str(tmp_path / "a.tar"), str(out))
    assert result.returncode == 1 and "not empty" in result.stderr
    assert os.listdir(out) == ["keep.txt"]


# -- index and inspect ------------------------------------------------------------------


def test_index_tar_zip_npy(tmp_path):
    write_tar(tmp_path / "a.tar", make_samples(4))
    write_zip(tmp_path / "b.zip", make_samples(5, seed=1))
    np.save(tmp_path / "c.npy", np.zeros((6, 2), np.int16))
    result = run_cli("index", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "3 shard(s), 15 samples" in result.stdout
    manifest = json.loads((tmp_path / "stoker.json").read_text())
    assert [(e["path"], e["samples"]) for e in manifest["shards"]] == [
        ("a.tar", 4), ("b.zip", 5), ("c.npy", 6)
    ]  # fmt: skip
    assert manifest["shards"][2]["fields"] == ["npy"]
    ds = stoker.Dataset(tmp_path)  # opens through the manifest now
    assert len(ds) == 15


def test_index_refuses_a_zip_whose_crc_fails(tmp_path):
    path = write_zip(tmp_path / "b.zip", make_samples(5))
    with open(path, "r+b") as f:
        f.seek(40)  # inside the first member's bytes
        byte = f.read(1)
        f.seek(40)
        f.write(bytes([byte[0] ^ 0xFF]))
    result = run_cli("index", str(tmp_path))
    assert result.returncode == 1 and "CRC" in result.stderr
    assert not (tmp_path / "stoker.json").exists()


def test_inspect_reports_fields_and_a_malformed_shard(tmp_path):
    write_tar(tmp_path / "a.tar", make_samples(4))
    (tmp_path / "broken.tar").write_bytes(b"x" * 1024)
    result = run_cli("inspect", str(tmp_path))
    assert result.returncode == 1
    out = result.stdout
    assert "2 shard(s)" in out and "4 samples" in out
    assert "broken.tar" in out and "MALFORMED" in out and "1 malformed shard(s)" in out
    assert "cls" in out and "raw" in out and "mean" in out


# -- everywhere --------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["demo", "pack", "index", "inspect", "fetch", "bench"])
def test_every_command_has_help_with_an_example(command):
    result = run_cli(command, "--help")
    assert result.returncode == 0
    assert "example:" in result.stdout and f"stoker {command}" in result.stdout


def test_loader_logs_its_stats(tmp_path, caplog):
    write_tar(tmp_path / "a.tar", make_samples(40))
    with caplog.at_level(logging.INFO, logger="stoker"):
        for _ in stoker.Loader(stoker.Dataset(tmp_path), batch_size=4, log_every=5):
            pass
    lines = [r.getMessage() for r in caplog.records if r.name == "stoker.loader"]
    assert len(lines) == 2 and "samples/s" in lines[0] and "batch 5" in lines[0]


def test_demo_end_to_end(tmp_path):
    result = run_cli("demo", "--samples", "600", env={"TMPDIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "packed them into" in out and "serving the shards at http://127.0.0.1:" in out
    assert "from a process of its own" in out
    # Each stoker line names the baseline its ratio is to: remote to remote, local to local.
    remote = next(line for line in out.splitlines() if "remote -> node cache -> batches" in line)
    assert re.search(r"[\d.]+x the download-first baseline$", remote)
    cached = next(line for line in out.splitlines() if "from its node cache" in line)
    assert re.search(r"[\d.]+x the DataLoader$", cached)
    assert "baseline: download, then torch DataLoader" in out
    assert "baseline: torch DataLoader, one file per sample" in out
    assert "seed" not in out  # no word from the project's history
    assert os.listdir(tmp_path) == []  # nothing left behind


def test_a_manifest_opens_without_a_scan(tmp_path):
    for i in range(3):
        write_tar(tmp_path / f"s{i}.tar", make_samples(20, seed=i))
    scanned = stoker.Dataset(sorted(str(p) for p in tmp_path.glob("*.tar")))
    assert run_cli("index", str(tmp_path)).returncode == 0
    # Break a header but keep the size: opening reads only the manifest, so it succeeds;
    # the shard is indexed (and refused) when a batch first reads it.
    with open(tmp_path / "s2.tar", "r+b") as f:
        f.write(b"\xff" * 100)
    ds = stoker.Dataset(tmp_path)
    assert len(ds) == 60 and sorted(ds.fields) == ["cls", "raw"]
    assert not ds.members.known.any()
    got = ds.get_batch(range(40))
    want = scanned.get_batch(range(40))
    assert [bytes(s["raw"]) for s in got] == [bytes(s["raw"]) for s in want]
    assert ds.members.known.tolist() == [True, True, False]
    with pytest.raises(stoker.ShardFormatError, match="s2.tar"):
        ds.get_batch([45])
    (tmp_path / "s2.tar").unlink()
    write_tar(tmp_path / "s2.tar", make_samples(20, seed=2))
    fields = {"raw": stoker.Bytes(), "cls": stoker.Int()}
    loader = stoker.Loader(stoker.Dataset(tmp_path), batch_size=7, seed=1, fields=fields)
    rescanned = stoker.Dataset(sorted(str(p) for p in tmp_path.glob("*.tar")))
    reference = stoker.Loader(rescanned, batch_size=7, seed=1, fields=fields)
    assert [b["cls"].tolist() for b in loader] == [b["cls"].tolist() for b in reference]


def test_csv_rows_of_the_wrong_shape_are_one_line(tmp_path):
    csv, root = files_and_csv(tmp_path, n=4)
    for text, expected in (
        ("filename,label\nimg0000.png,1\nimg0001.png,1,extra\n", "not a filename,label CSV"),
        ("filename,label\nimg0000.png,1\n,4\n", "line 3: '','4'"),
        ("filename,label\nimg0000.png,1\n\nimg0001.png,²\n", "line 4: 'img0001.png','²'"),
    ):
        csv.write_text(text)
        result = run_cli("pack", "--csv", str(csv), "--root", str(root), str(tmp_path / "o"))
        assert result.returncode == 1 and expected in result.stderr, result.stderr
        assert result.stderr.count("\n") == 1


def test_repack_of_packed_shards_and_npy_uint8_rows(tmp_path):
    csv, root = files_and_csv(tmp_path, n=20)
    assert pack_csv(csv, root, tmp_path / "a", "--samples-per-shard", "7") == 0
    assert main(["pack", str(tmp_path / "a"), str(tmp_path / "b"), "--quiet"]) == 0  # lazy
    assert len(stoker.Dataset(tmp_path / "b")) == 20
    np.save(tmp_path / "u8.npy", np.arange(12, dtype=np.uint8).reshape(3, 4))
    assert main(["pack", str(tmp_path / "u8.npy"), str(tmp_path / "c"), "--quiet"]) == 0
    row = np.load(__import__("io").BytesIO(bytes(stoker.Dataset(tmp_path / "c")[1]["npy"])))
    assert row.tolist() == [4, 5, 6, 7]


def test_pack_refuses_repeated_keys(tmp_path):
    tree = tmp_path / "tree" / "c"
    tree.mkdir(parents=True)
    (tree / "x.png").write_bytes(b"1")
    (tree / "x.jpg").write_bytes(b"2")
    result = run_cli("pack", str(tmp_path / "tree"), str(tmp_path / "out"))
    assert result.returncode == 1 and "appear more than once" in result.stderr
    assert not (tmp_path / "out").exists()


def test_index_of_a_folder_lists_what_is_there_now(tmp_path):
    write_tar(tmp_path / "a.tar", make_samples(4))
    assert run_cli("index", str(tmp_path)).returncode == 0
    write_tar(tmp_path / "b.tar", make_samples(3, seed=1))
    assert run_cli("index", str(tmp_path)).returncode == 0
    manifest = json.loads((tmp_path / "stoker.json").read_text())
    assert [e["path"] for e in manifest["shards"]] == ["a.tar", "b.tar"]
    assert (tmp_path / "stoker.json").stat().st_mode & 0o044 == 0o044  # readable by others
