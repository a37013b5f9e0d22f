"""A sample's members grouped by key wherever they lie in a shard: archives made by the
everyday tools (`zip -r`, GNU tar without --sort=name), by webdataset, and by tarfile in a
deliberately scattered order."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import tarfile
import zipfile

import numpy as np
import pytest

import stoker
from stoker.tools.cli import main
from tests.support.shards import as_bytes, write_tar, write_tar_members

FIELDS = ("jpg", "cls", "json")


def _source_tree(folder, n: int = 40, seed: int = 0) -> dict[str, dict[str, bytes]]:
    """n samples as loose files, KEY.jpg / KEY.cls / KEY.json, some in a sub-folder."""
    rng = np.random.default_rng(seed)
    truth = {}
    for i in range(n):
        key = f"{'sub/' if i % 3 == 0 else ''}k{i:03d}"
        fields = {
            "jpg": rng.bytes(int(rng.integers(1, 300))),
            "cls": str(i % 7).encode(),
            "json": json.dumps({"i": i}).encode(),
        }
        for field, data in fields.items():
            path = folder / f"{key}.{field}"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        truth[key] = fields
    return truth


def _by_field_order(truth: dict[str, dict[str, bytes]]) -> list[str]:
    """Every file of the tree, all the .jpg first, then all .cls, then all .json: each
    sample's members as far apart as they can be."""
    return [f"{key}.{field}" for field in FIELDS for key in truth]


def _check(ds, truth) -> None:
    assert len(ds) == len(truth)
    got = {s["__key__"]: as_bytes(s) for s in ds.get_batch(range(len(ds)))}
    assert got == truth


needs_zip = pytest.mark.skipif(shutil.which("zip") is None, reason="the zip command is missing")
needs_tar = pytest.mark.skipif(shutil.which("tar") is None, reason="GNU tar is missing")


@needs_zip
def test_zip_of_files_listed_field_by_field(tmp_path, caplog):
    src = tmp_path / "src"
    truth = _source_tree(src)
    names = _by_field_order(truth)
    subprocess.run(["zip", "-q", str(tmp_path / "d.zip"), *names], cwd=src, check=True)
    with caplog.at_level(logging.WARNING, "stoker"):
        ds = stoker.Dataset(str(tmp_path / "d.zip"))
    _check(ds, truth)
    # Samples keep the order their keys first appear in.
    assert ds.keys(range(len(ds))) == list(truth)
    said = [r for r in caplog.records if "stored apart" in r.getMessage()]
    assert len(said) == 1 and "d.zip" in said[0].getMessage()


@pytest.mark.parametrize(
    "command,archive",
    [(["zip", "-qr"], "d.zip"), (["tar", "-cf"], "d.tar")],  # as users run them: no sorting
)
def test_a_folder_archived_by_the_everyday_tools(tmp_path, command, archive):
    if shutil.which(command[0]) is None:
        pytest.skip(f"the {command[0]} command is missing")
    src = tmp_path / "src"
    truth = _source_tree(src)
    subprocess.run([*command, str(tmp_path / archive), "."], cwd=src, check=True)
    _check(stoker.Dataset(str(tmp_path / archive)), truth)


@needs_tar
def test_gnu_tar_members_field_by_field_and_a_loader(tmp_path):
    src = tmp_path / "src"
    truth = _source_tree(src)
    tar = tmp_path / "d.tar"
    subprocess.run(["tar", "-cf", str(tar), *_by_field_order(truth)], cwd=src, check=True)
    ds = stoker.Dataset(str(tar))
    _check(ds, truth)
    fields = {"jpg": stoker.Bytes(), "cls": stoker.Int(), "json": stoker.Bytes()}
    seen = 0
    for batch in stoker.Loader(ds, 16, fields=fields, seed=1):
        for j, key in enumerate(batch["__key__"]):
            assert bytes(batch["jpg"][j]) == truth[key]["jpg"]
            assert int(batch["cls"][j]) == int(truth[key]["cls"])
            seen += 1
    assert seen == len(truth)


def test_said_once_per_dataset_naming_the_shard(tmp_path, caplog):
    truth = {f"k{i}": {"a": b"x%d" % i, "b": b"y%d" % i} for i in range(6)}
    paths = []
    for s in range(3):
        path = tmp_path / f"s{s}.tar"
        members = [(f"{s}-{k}.{f}", truth[k][f]) for f in ("a", "b") for k in truth]
        paths.append(write_tar_members(path, members))
    with caplog.at_level(logging.WARNING, "stoker"):
        ds = stoker.Dataset(paths)
    assert len(ds) == 18
    said = [r.getMessage() for r in caplog.records if "stored apart" in r.getMessage()]
    assert len(said) == 1 and "s0.tar" in said[0]
    assert "into 6 samples" in said[0] and "would read 12" in said[0]


def test_webdataset_shards_are_read_as_written_and_nothing_is_said(tmp_path, caplog):
    import webdataset as wds

    path = str(tmp_path / "w.tar")
    with wds.TarWriter(path) as sink:
        for i in range(20):
            sink.write({"__key__": f"k{i:02d}", "cls": i, "txt": f"text {i}"})
    with caplog.at_level(logging.WARNING, "stoker"):
        ds = stoker.Dataset(path)
    assert len(ds) == 20 and not caplog.records
    assert [bytes(s["cls"]) for s in ds.get_batch(range(20))] == [b"%d" % i for i in range(20)]


def test_a_key_split_across_shards_stays_two_samples_and_inspect_says_so(tmp_path, capsys):
    write_tar(tmp_path / "a.tar", [("k0", {"jpg": b"0"}), ("both", {"jpg": b"j"})])
    write_tar(tmp_path / "b.tar", [("both", {"cls": b"1"}), ("k1", {"cls": b"2"})])
    ds = stoker.Dataset(str(tmp_path))
    assert len(ds) == 4
    assert [s["__key__"] for s in ds.get_batch(range(4))] == ["k0", "both", "both", "k1"]
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "keys in more than one shard: 1 (first: 'both' in a.tar and b.tar)" in out
    assert "fields that not all 4 samples have: cls (2), jpg (2)" in out


@needs_zip
def test_inspect_reports_scattered_members(tmp_path, capsys):
    src = tmp_path / "src"
    truth = _source_tree(src, n=30)
    subprocess.run(["zip", "-q", str(tmp_path / "d.zip"), *_by_field_order(truth)], cwd=src)
    shutil.rmtree(src)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "30 samples" in out.splitlines()[0]
    assert "stored apart in 1 of 1 shard" in out and "would read 90" in out
    assert "fields that not all" not in out  # every sample has every field


def test_one_field_twice_in_a_scattered_sample_names_the_second(tmp_path):
    path = tmp_path / "twice.tar"
    offsets = {}
    with tarfile.open(path, "w") as tar:
        for name in ("a.jpg", "b.jpg", "a.cls", "a.jpg"):
            info = tarfile.TarInfo(name)
            info.size = 1
            offsets.setdefault(name, []).append(tar.offset)
            tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(stoker.ShardFormatError) as error:
        stoker.Dataset(str(path))
    assert "sample 'a' has two members with field 'jpg'" in str(error.value)
    assert error.value.offset == offsets["a.jpg"][1]


def _zip_field_by_field(path):
    """Five samples k0..k4 of a jpg and a cls, every jpg first: written by zipfile."""
    with zipfile.ZipFile(path, "w") as z:
        for field in ("jpg", "cls"):
            for i in range(5):
                z.writestr(f"k{i}.{field}", b"%d" % i)
    return path


def test_a_manifest_written_before_grouping_is_explained(tmp_path, capsys):
    # A manifest counting the runs of adjacent members, as stoker 0.1 wrote it for a
    # scattered archive: opening says what to do, not that the shard changed.
    path = _zip_field_by_field(tmp_path / "old.zip")
    stoker.manifest.write_manifest([str(path)], tmp_path)
    manifest = json.loads((tmp_path / "stoker.json").read_text())
    assert manifest["shards"][0]["samples"] == 5
    manifest["shards"][0]["samples"] = 10
    (tmp_path / "stoker.json").write_text(json.dumps(manifest))
    ds = stoker.Dataset(str(tmp_path))
    with pytest.raises(stoker.ShardFormatError, match="write it again with `stoker index`"):
        ds.get_batch([0])
    assert main(["inspect", str(tmp_path)]) == 0  # inspect says so too
    assert "old.zip holds 5 samples, not 10" in capsys.readouterr().out


def test_a_manifest_says_at_open_that_members_lie_apart(tmp_path, caplog):
    path = _zip_field_by_field(tmp_path / "apart.zip")
    stoker.manifest.write_manifest([str(path)], tmp_path)
    assert json.loads((tmp_path / "stoker.json").read_text())["shards"][0]["key_runs"] == 10
    with caplog.at_level(logging.WARNING, "stoker"):
        ds = stoker.Dataset(str(tmp_path))  # nothing read yet: the manifest says it
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1 and "apart.zip" in said[0] and "into 5 samples" in said[0]
        assert [s["__key__"] for s in ds[:]] == [f"k{i}" for i in range(5)]
    assert len(caplog.records) == 1  # and not again when the shard is read


def test_a_remote_tar_without_manifest_groups_as_a_local_one(tmp_path):
    from tests.support.server import ShardServer

    truth = {f"k{i}": {"jpg": b"j%d" % i, "cls": b"%d" % i} for i in range(12)}
    folder = tmp_path / "served"
    folder.mkdir()
    with tarfile.open(folder / "r.tar", "w") as tar:
        for field in ("jpg", "cls"):
            for key, fields in truth.items():
                info = tarfile.TarInfo(f"{key}.{field}")
                info.size = len(fields[field])
                tar.addfile(info, io.BytesIO(fields[field]))
    with ShardServer(str(folder)) as server:
        ds = stoker.Dataset(server.url_for("r.tar"), cache_dir=str(tmp_path / "cache"))
        assert len(ds) == 12
        _check(ds, truth)
    assert os.path.exists(tmp_path / "cache")
