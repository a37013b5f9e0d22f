"""``stoker inspect`` and ``stoker pack`` on table sources: Parquet files as the Hugging Face
Hub stores them (written by ``datasets``) and ``datasets.save_to_disk`` folders (Arrow IPC),
described column by column, and packed into tar shards that read back byte for byte with
stoker, ``tarfile`` and ``webdataset``."""

from __future__ import annotations

import io
import json
import os
import tarfile

import numpy as np
import pytest

import stoker
from stoker.tools.cli import main
from stoker.tools.table_members import image_type

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

N = 60
CLASSES = ["cat", "dog", "owl", "yak", "emu"]


def _images(n: int) -> list[bytes]:
    """Small real images, JPEG and (every fourth) PNG, as the Hub's columns mix them."""
    from PIL import Image

    out = []
    for i in range(n):
        buf = io.BytesIO()
        picture = Image.new("RGB", (12 + i % 5, 9 + i % 3), ((37 * i) % 256, 80, 160))
        picture.save(buf, "PNG" if i % 4 == 0 else "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def hub_dataset(n: int = N, paths: bool = False):
    """A dataset as the Hub keeps an image one: the Image feature's bytes embedded (paths
    None, as push_to_hub writes them, or file names), and a ClassLabel."""
    pytest.importorskip("PIL")
    images = _images(n)
    rows = [{"bytes": b, "path": f"{i:04d}.jpg" if paths else None} for i, b in enumerate(images)]
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES)}
    )
    labels = [i % len(CLASSES) for i in range(n)]
    return datasets.Dataset.from_dict({"image": rows, "label": labels}, features), images, labels


def hub_parquet(folder, n: int = N, files: int = 2, paths: bool = False) -> list[str]:
    """`files` Parquet files named as the Hub names them, in row groups of 20 rows."""
    ds, images, labels = hub_dataset(n, paths)
    os.makedirs(folder, exist_ok=True)
    out = []
    for k in range(files):
        path = os.path.join(folder, f"train-{k:05d}-of-{files:05d}.parquet")
        ds.shard(files, k, contiguous=True).to_parquet(path, batch_size=20)
        out.append(path)
    assert pq.read_table(out[0]).column("image").to_pylist()[1]["bytes"] == images[1]  # embedded
    return out


def run(capsys, *args: str) -> tuple[int, str]:
    code = main(list(args))
    said = capsys.readouterr()
    return code, said.out + said.err  # (an error's one line comes last)


def saved_folder(tmp_path) -> str:
    """A save_to_disk folder of two Arrow files: text with nulls, lists, floats, a struct."""
    n = 40
    table = {
        "text": [None if i % 7 == 3 else "word " * (i % 4) for i in range(n)],
        "input_ids": [list(range(i % 6)) for i in range(n)],
        "score": [i / 8 for i in range(n)],
        "meta": [{"source": f"site{i % 3}", "year": 2000 + i} for i in range(n)],
        "label": [i % 3 for i in range(n)],
    }
    features = datasets.Features(
        {
            "text": datasets.Value("string"),
            "input_ids": datasets.Sequence(datasets.Value("int64")),
            "score": datasets.Value("float64"),
            "meta": {"source": datasets.Value("string"), "year": datasets.Value("int64")},
            "label": datasets.Value("int64"),
        }
    )
    folder = str(tmp_path / "saved")
    datasets.Dataset.from_dict(table, features).save_to_disk(folder, num_shards=2)
    return folder


# -- inspect -----------------------------------------------------------------------------


def test_inspect_a_saved_dataset_folder(tmp_path, capsys):
    code, out = run(capsys, "inspect", saved_folder(tmp_path))
    assert code == 0, out
    assert "2 shard(s) (2 arrow), 40 samples" in out
    assert "20 rows, 1 record batch of 20 rows; Arrow IPC" in out
    assert "all 2 files: 40 rows, 2 record batches" in out
    lines = out.splitlines()
    total = lines[lines.index(next(s for s in lines if "all 2 files" in s)) + 1 :]
    column = {line.split()[0]: line for line in total if line.startswith("    ")}
    assert "list of int64" in column["input_ids"]
    assert "float64" in column["score"] and "320 B" in column["score"]  # 8 bytes x 40 rows
    assert "8 B" in column["score"].split("320 B")[1]  # per row
    assert "bytes" in column["meta.source"] and "int64" in column["meta.year"]
    assert "uncompressed, in place; 6 null" in column["text"]
    assert "fields that not all 40 samples have: text (34)" in out


def test_inspect_hub_parquet_files(tmp_path, capsys):
    paths = hub_parquet(tmp_path / "data")
    code, out = run(capsys, "inspect", str(tmp_path / "data"))
    assert code == 0, out
    assert "2 shard(s) (2 parquet), 60 samples" in out
    assert "train-00000-of-00002.parquet: 30 rows, 2 row groups of 20 rows (the last 10)" in out
    assert "written by parquet-cpp-arrow" in out
    meta = pq.read_metadata(paths[0])
    stored = sum(meta.row_group(g).column(0).total_compressed_size for g in range(2))
    per_file = [line for line in out.splitlines() if line.strip().startswith("image.bytes")]
    assert len(per_file) == 3  # two files, and the total
    assert stoker.errors.human(stored) in per_file[0] and " bytes " in per_file[0]
    assert "int64" in next(s for s in out.splitlines() if s.strip().startswith("label "))
    assert "all 2 files: 60 rows, 4 row groups" in out


def test_inspect_names_the_columns_it_cannot_read(tmp_path, capsys):
    table = pa.table(
        {
            "id": pa.array(range(10), pa.int64()),
            "tags": pa.array([["a", "b"]] * 10, pa.list_(pa.string())),
            "when": pa.array([0] * 10, pa.int64()),
        }
    )
    path = str(tmp_path / "t.parquet")
    pq.write_table(table, path, compression="zstd")
    code, out = run(capsys, "inspect", path)
    assert code == 0, out
    assert "zstd" in out
    assert "columns stoker cannot read" in out
    assert "'tags' (t.parquet) is a list of byte strings or text" in out
    assert "id, when" in out  # the readable ones are its fields


# -- pack ----------------------------------------------------------------------------------


def _members(folder) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".tar"):
            with tarfile.open(os.path.join(folder, name)) as tar:
                for member in tar.getmembers():
                    out[member.name] = tar.extractfile(member).read()
    return out


@pytest.mark.parametrize("paths", [False, True], ids=["null-paths", "file-paths"])
def test_pack_hub_parquet_into_webdataset_shards(tmp_path, capsys, paths):
    webdataset = pytest.importorskip("webdataset")
    hub_parquet(tmp_path / "data", paths=paths)
    _, images, labels = hub_dataset(N, paths)
    out = tmp_path / "shards"
    code, said = run(capsys, "pack", str(tmp_path / "data"), str(out), "--samples-per-shard", "25")
    assert code == 0, said
    members = _members(out)
    assert len(members) == 2 * N  # an image and a .cls each: the Image feature's path left out
    for i in range(N):
        key = f"train-{i // 30:05d}-of-00002/{i % 30}"
        ext = "png" if i % 4 == 0 else "jpg"
        assert members[f"{key}.{ext}"] == images[i]
        assert members[f"{key}.cls"] == str(labels[i]).encode()
    manifest = json.loads((out / "stoker.json").read_text())
    assert manifest["classes"] == CLASSES  # the ClassLabel's names, as class folders give
    shards = sorted(str(out / n) for n in os.listdir(out) if n.endswith(".tar"))
    seen = 0
    for sample in webdataset.WebDataset(shards, shardshuffle=False, empty_check=False):
        i = int(sample["__key__"].split("-")[1][:5]) * 30 + int(sample["__key__"].split("/")[1])
        assert sample.get("jpg", sample.get("png")) == images[i]
        assert int(sample["cls"]) == labels[i]
        seen += 1
    assert seen == N
    packed = stoker.Loader(
        stoker.Dataset(out), batch_size=16, shuffle=False, fields={"cls": stoker.Int()}
    )
    assert sorted(int(v) for batch in packed for v in batch["cls"]) == sorted(labels)


def test_pack_a_saved_dataset_folder(tmp_path, capsys):
    folder = saved_folder(tmp_path)
    source = datasets.load_from_disk(folder)
    out = tmp_path / "shards"
    code, said = run(capsys, "pack", folder, str(out), "--stratify", "--samples-per-shard", "10")
    assert code == 0, said
    members = _members(out)
    for k in range(len(source)):
        row = source[k]
        key = f"data-{k // 20:05d}-of-00002/{k % 20}"
        if row["text"] is None:  # a null is a member the sample does not have
            assert f"{key}.text" not in members
        else:
            assert members[f"{key}.text"] == row["text"].encode()
        ids = np.load(io.BytesIO(members[f"{key}.input_ids"]))
        assert ids.dtype == np.int64 and ids.tolist() == row["input_ids"]
        assert float(members[f"{key}.score"]) == row["score"]
        assert members[f"{key}.meta.source"] == row["meta"]["source"].encode()
        assert int(members[f"{key}.meta.year"]) == row["meta"]["year"]
        assert int(members[f"{key}.cls"]) == row["label"]
    # --stratify read the table's label column: each shard of 10 holds every label
    for name in sorted(n for n in os.listdir(out) if n.endswith(".tar")):
        with tarfile.open(out / name) as tar:
            shard = [tar.extractfile(m).read() for m in tar if m.name.endswith(".cls")]
        assert set(shard) == {b"0", b"1", b"2"}


def test_image_types_by_magic():
    assert image_type(b"\xff\xd8\xff\xe0rest") == "jpg"
    assert image_type(np.frombuffer(b"\x89PNG\r\n\x1a\n....", np.uint8)) == "png"
    assert image_type(b"RIFF\x10\x00\x00\x00WEBPVP8 ") == "webp"
    assert image_type(b"GIF89a...") == "gif"
    assert image_type(b"not an image") is None
    assert image_type(b"") is None


def test_inspect_totals_say_where_files_disagree(tmp_path, capsys):
    for name, kind in (("a", pa.int32()), ("b", pa.int64())):
        table = pa.table({"label": pa.array(range(30), kind)})
        pq.write_table(table, str(tmp_path / f"{name}.parquet"), row_group_size=12)
    code, out = run(capsys, "inspect", str(tmp_path))
    assert code == 0, out
    assert "a.parquet: 30 rows, 3 row groups of 12 rows (the last 6)" in out
    total = out.split("all 2 files: 60 rows, 6 row groups")[1].splitlines()
    assert "int32 / int64" in next(line for line in total if line.strip().startswith("label"))
