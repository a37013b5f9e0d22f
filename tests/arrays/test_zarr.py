"""Zarr stores (v2 and v3, sharded or not) as array sources: rows byte-exact against
zarr-python for every codec stoker decodes, missing chunks as fill values, and clear
errors for damaged stores and codecs it does not decode."""

from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import pytest

import stoker

zarr = pytest.importorskip("zarr")
codecs = pytest.importorskip("zarr.codecs")
numcodecs = pytest.importorskip("numcodecs")

N = 203


def _data(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "images": rng.integers(0, 256, (N, 3, 8, 8), dtype=np.uint8),
        "labels": rng.integers(-(10**12), 10**12, N).astype(np.int64),
        "floats": rng.standard_normal((N, 5)).astype("<f4"),
        "halves": rng.standard_normal((N, 2, 3)).astype(np.float16),
        "flags": rng.integers(0, 2, (N, 4)).astype(bool),
        "grid": rng.integers(-(2**15), 2**15, (N, 5, 7)).astype("<i2"),
    }


def _chunks(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if kind == "tiled":  # chunks that cut across each row, partial on every axis
        return tuple(max(1, (s + 1) // 2) if i else 16 for i, s in enumerate(shape))
    return (16, *shape[1:])


V3 = {
    "none": {"compressors": None},
    "default (zstd)": {},
    "gzip": {"compressors": "gzip"},
    "blosc lz4 shuffle": {"compressors": "blosc-lz4"},
    "blosc zstd bitshuffle": {"compressors": "blosc-zstd"},
    "zstd crc32c": {"compressors": "zstd-crc"},
    "tiled zstd": {"chunks": "tiled"},
    "tiled none": {"chunks": "tiled", "compressors": None},
    "big-endian": {"serializer": "big"},
    "transposed": {"filters": "transpose", "compressors": None},
    "sharded": {"shards": True},
    "sharded gzip index at start": {"shards": "start"},
}


def _v3_options(option: dict, shape: tuple[int, ...]) -> dict:
    kw: dict = {"chunks": _chunks(option.get("chunks", "rows"), shape)}
    compressors = option.get("compressors", "default")
    if compressors == "gzip":
        kw["compressors"] = codecs.GzipCodec(level=1)
    elif compressors == "blosc-lz4":
        kw["compressors"] = codecs.BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")
    elif compressors == "blosc-zstd":
        kw["compressors"] = codecs.BloscCodec(cname="zstd", clevel=3, shuffle="bitshuffle")
    elif compressors == "zstd-crc":
        kw["compressors"] = [codecs.ZstdCodec(level=1), codecs.Crc32cCodec()]
    elif compressors is None:
        kw["compressors"] = None
    if option.get("serializer") == "big":
        kw["serializer"] = codecs.BytesCodec(endian="big")
    if option.get("filters") == "transpose":
        kw["filters"] = [codecs.TransposeCodec(order=tuple(range(len(shape)))[::-1])]
    if option.get("shards") is True:
        kw["shards"] = (64, *shape[1:])
    elif option.get("shards") == "start":
        kw["chunks"] = (64, *shape[1:])
        kw["serializer"] = codecs.ShardingCodec(
            chunk_shape=_chunks("rows", shape),
            codecs=[codecs.BytesCodec(), codecs.GzipCodec(level=1)],
            index_location="start",
        )
        kw["compressors"] = None
    return kw


def _write_v3(path, data, option: dict) -> str:
    group = zarr.open_group(str(path), mode="w", zarr_format=3)
    for name, array in data.items():
        where = "meta/labels" if name == "labels" else name
        z = group.create_array(
            where, shape=array.shape, dtype=array.dtype, **_v3_options(option, array.shape)
        )
        z[:] = array
    return str(path)


V2 = {
    "none": None,
    "blosc lz4 (zarr 2's default)": "blosc",
    "zlib": "zlib",
    "gzip": "gzip",
    "zstd": "zstd",
    "order F": "F",
    "big-endian": ">",
    "slash separator": "/",
}


def _write_v2(path, data, option) -> str:
    group = zarr.open_group(str(path), mode="w", zarr_format=2)
    for name, array in data.items():
        where = "meta/labels" if name == "labels" else name
        kw: dict = {"chunks": _chunks("rows", array.shape), "compressors": None}
        if option == "blosc":
            kw["compressors"] = numcodecs.Blosc(cname="lz4", clevel=5, shuffle=1)
        elif option in ("zlib", "gzip", "zstd"):
            kw["compressors"] = {
                "zlib": numcodecs.Zlib(1),
                "gzip": numcodecs.GZip(1),
                "zstd": numcodecs.Zstd(1),
            }[option]
        elif option == "F":
            kw["order"] = "F"
        elif option == "/":
            kw["chunk_key_encoding"] = {"name": "v2", "separator": "/"}
        dtype = array.dtype.newbyteorder(">") if option == ">" else array.dtype
        z = group.create_array(where, shape=array.shape, dtype=dtype, **kw)
        z[:] = array
    return str(path)


def _check_rows(ds, data, indices):
    batch = ds.get_batch(indices)
    for sample, i in zip(batch, indices):
        for name, array in data.items():
            got = sample["meta/labels" if name == "labels" else name]
            assert got.dtype == array.dtype.newbyteorder("=") and got.shape == array.shape[1:]
            assert got.tobytes() == array[i].tobytes(), (name, i)


def _order():
    return np.random.default_rng(1).permutation(N)


@pytest.mark.parametrize("option", list(V3))
def test_v3_rows_byte_exact(tmp_path, option):
    data = _data()
    path = _write_v3(tmp_path / "data.zarr", data, V3[option])
    ds = stoker.Dataset(path)
    assert len(ds) == N
    _check_rows(ds, data, _order())
    group = zarr.open_group(path, mode="r")  # zarr-python reads the same
    assert np.array_equal(group["images"][N - 1], data["images"][N - 1])


@pytest.mark.parametrize("option", list(V2))
def test_v2_rows_byte_exact(tmp_path, option):
    data = _data()
    path = _write_v2(tmp_path / "data.zarr", data, V2[option])
    ds = stoker.Dataset(path)
    _check_rows(ds, data, _order())
    assert np.array_equal(zarr.open_group(path, mode="r")["grid"][:], data["grid"])


def test_loader_and_workers(tmp_path):
    torch = pytest.importorskip("torch")
    data = _data()
    path = _write_v3(tmp_path / "data.zarr", data, V3["sharded"])
    ds = stoker.Dataset(path, arrays=["images", "meta/labels"])
    loader = stoker.Loader(
        ds, batch_size=40, fields={"images": stoker.Row(), "meta/labels": stoker.Row()}
    )
    seen = []
    for batch in loader:
        idx = [int(k.rsplit("/", 1)[1]) for k in batch["__key__"]]
        assert torch.equal(batch["images"], torch.from_numpy(data["images"][idx]))
        assert torch.equal(batch["meta/labels"], torch.from_numpy(data["labels"][idx]))
        seen += idx
    assert sorted(seen) == list(range(N))
    workers = torch.utils.data.DataLoader(
        ds, batch_size=9, num_workers=2, collate_fn=lambda b: [s["images"].tobytes() for s in b]
    )
    assert [x for b in workers for x in b] == [data["images"][i].tobytes() for i in range(N)]


def test_missing_chunks_are_the_fill_value(tmp_path):
    group = zarr.open_group(str(tmp_path / "f.zarr"), mode="w", zarr_format=3)
    a = group.create_array("x", shape=(50, 3), dtype="f8", chunks=(10, 3), fill_value=float("nan"))
    b = group.create_array("y", shape=(50,), dtype="i2", chunks=(10,), fill_value=-3, shards=(20,))
    a[0:10] = 1.0
    b[20:30] = 4
    v2 = zarr.open_group(str(tmp_path / "f.zarr" / "old"), mode="w", zarr_format=2)
    c = v2.create_array("z", shape=(50,), dtype="<u4", chunks=(10,), fill_value=9)
    c[40:50] = 1
    ds = stoker.Dataset(str(tmp_path / "f.zarr"))
    rows = ds.get_batch([0, 15, 25, 45])
    assert rows[0]["x"].tolist() == [1.0] * 3 and np.isnan(rows[1]["x"]).all()
    assert [int(r["y"]) for r in rows] == [-3, -3, 4, -3]
    assert [int(r["old/z"]) for r in rows] == [9, 9, 9, 1]


def test_a_bare_array_is_named_by_its_folder(tmp_path):
    z = zarr.create_array(str(tmp_path / "volumes.zarr"), shape=(7, 2), dtype="u1", chunks=(3, 2))
    z[:] = np.arange(14, dtype="u1").reshape(7, 2)
    ds = stoker.Dataset(str(tmp_path / "volumes.zarr"))
    assert ds.fields == ["volumes"] and ds[6]["volumes"].tolist() == [12, 13]


def test_store_in_a_folder_of_shards_is_not_walked(tmp_path):
    _write_v3(tmp_path / "arrays.zarr", _data(), V3["none"])
    np.save(tmp_path / "rows.npy", np.zeros((4, 2), np.float32))
    ds = stoker.Dataset(str(tmp_path))
    assert len(ds) == 4  # the .npy shard; the store is a source of its own
    both = stoker.Dataset([str(tmp_path / "rows.npy"), str(tmp_path / "arrays.zarr")])
    assert len(both) == 4 + N


def test_text_arrays_are_left_out(tmp_path):
    group = zarr.open_group(str(tmp_path / "t.zarr"), mode="w", zarr_format=3)
    group.create_array("x", shape=(4,), dtype="u1")[:] = 1
    group.create_array("names", shape=(4,), dtype=str)[:] = np.array(["a", "b", "c", "d"])
    assert stoker.Dataset(str(tmp_path / "t.zarr")).fields == ["x"]
    with pytest.raises(stoker.ShardFormatError, match="no tensor type"):
        stoker.Dataset(str(tmp_path / "t.zarr"), arrays=["names"])


def test_codecs_not_decoded_are_named(tmp_path):
    group = zarr.open_group(str(tmp_path / "c.zarr"), mode="w", zarr_format=2)
    group.create_array("x", shape=(8,), dtype="<i4", chunks=(4,), compressors=numcodecs.LZ4())[
        :
    ] = 1
    with pytest.raises(stoker.ShardFormatError) as e:
        stoker.Dataset(str(tmp_path / "c.zarr"))
    assert "'lz4'" in str(e.value) and ".zarray" in str(e.value)
    group = zarr.open_group(str(tmp_path / "d.zarr"), mode="w", zarr_format=2)
    group.create_array(
        "x", shape=(8,), dtype="<i4", chunks=(4,), filters=[numcodecs.Delta(dtype="<i4")]
    )[:] = 1
    with pytest.raises(stoker.ShardFormatError, match="filters"):
        stoker.Dataset(str(tmp_path / "d.zarr"))


def test_codec_libraries_are_found():
    from stoker import _core

    assert _core.codec_unavailable(_core.ChunkFilter.ZSTD) == ""
    assert _core.codec_unavailable(_core.ChunkFilter.BLOSC) == ""
    status = stoker.codec_status()
    assert status["zstd"]["available"] and os.path.isfile(status["zstd"]["library"])
    assert status["blosc"]["available"] and os.path.isfile(status["blosc"]["library"])


def _blosc_elsewhere(root) -> str:
    """A copy of the installed `blosc` package laid out as pip lays out a prefix (the
    package in <root>/lib/pythonX.Y/site-packages, its libblosc in <root>/lib64, as the
    RECORD beside it says) in a folder that is no prefix of this Python's; returns the
    site-packages folder."""
    import glob
    import importlib.util
    import sys

    installed = os.path.dirname(os.path.dirname(importlib.util.find_spec("blosc").origin))
    record = glob.glob(os.path.join(installed, "blosc-*.dist-info", "RECORD"))
    if not record:
        pytest.skip("the installed blosc has no RECORD (not installed by pip)")
    site = os.path.join(root, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}")
    site = os.path.join(site, "site-packages")
    shutil.copytree(os.path.join(installed, "blosc"), os.path.join(site, "blosc"))
    info = os.path.dirname(record[0])
    shutil.copytree(info, os.path.join(site, os.path.basename(info)))
    with open(record[0]) as f:
        for line in f:
            file = line.split(",", 1)[0]
            if os.path.basename(file).startswith("libblosc.so"):
                target = os.path.normpath(os.path.join(site, file))
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.copy2(os.path.join(installed, file), target, follow_symlinks=True)
    return site


def _run_python(args: list[str], env: dict) -> str:
    import subprocess

    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


_READ_BLOSC = (
    "import sys, stoker\n"
    "ds = stoker.Dataset(sys.argv[1])\n"
    "print(stoker.codec_status()['blosc']['library'])\n"
    "print([int(sample['x']) for sample in ds.get_batch([0, 39])])\n"
)


def test_libblosc_is_found_where_the_blosc_package_is(tmp_path):
    """libblosc is looked for beside the `blosc` package that Python imports, wherever it
    is installed: here a copy outside every prefix of this Python (as `pip install
    --target` or a shared folder on PYTHONPATH leaves it), found before any other."""
    path = _write_v3(
        tmp_path / "b.zarr", {"x": np.arange(40, dtype="<i4")}, V3["blosc lz4 shuffle"]
    )
    site = _blosc_elsewhere(tmp_path / "elsewhere")
    env = dict(os.environ, PYTHONPATH=site)
    import sys

    lines = _run_python([sys.executable, "-c", _READ_BLOSC, path], env).splitlines()
    assert lines[0].startswith(str(tmp_path / "elsewhere") + os.sep), lines
    assert lines[1] == "[0, 39]"


def test_libblosc_is_found_through_a_linked_site(tmp_path):
    """A venv that sees another environment's packages through a .pth file (as the
    sanitizer run does): neither sys.prefix nor sys.base_prefix is where blosc lives, and
    libblosc is still found from the package."""
    import importlib.util
    import subprocess
    import sys
    import sysconfig

    path = _write_v3(
        tmp_path / "b.zarr", {"x": np.arange(40, dtype="<i4")}, V3["blosc lz4 shuffle"]
    )
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    venv_site = _run_python(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        dict(os.environ),
    ).strip()
    # This environment's site-packages, with its own .pth files (an editable stoker's).
    with open(os.path.join(venv_site, "_linked.pth"), "w") as f:
        f.write(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    lines = _run_python([python, "-c", _READ_BLOSC, path], env).splitlines()
    blosc_home = os.path.dirname(os.path.dirname(importlib.util.find_spec("blosc").origin))
    prefix = os.path.realpath(os.path.join(blosc_home, "..", "..", ".."))
    assert os.path.realpath(lines[0]).startswith(prefix + os.sep), (lines, prefix)
    assert not os.path.realpath(lines[0]).startswith(str(venv)), lines
    assert lines[1] == "[0, 39]"


# -- damaged stores ---------------------------------------------------------------------


def test_chunk_file_of_the_wrong_size(tmp_path):
    data = _data()
    path = _write_v3(tmp_path / "w.zarr", data, V3["none"])
    chunk = os.path.join(path, "images", "c", "2", "0", "0", "0")
    with open(chunk, "r+b") as f:
        f.truncate(100)
    with pytest.raises(stoker.ShardFormatError) as e:
        stoker.Dataset(path)
    assert chunk in str(e.value) and "100 bytes" in str(e.value)


@pytest.mark.parametrize("option", ["default (zstd)", "gzip", "blosc lz4 shuffle", "zstd crc32c"])
def test_corrupt_chunk(tmp_path, option):
    data = _data()
    path = _write_v3(tmp_path / "c.zarr", data, V3[option])
    chunk = os.path.join(path, "images", "c", "1", "0", "0", "0")
    with open(chunk, "rb") as f:
        raw = bytearray(f.read())
    # The frame's header: a zstd frame without its checksum cannot tell damaged data
    # from other data (nor can zarr-python), only a damaged frame.
    raw[1:5] = b"\xa5" * 4
    with open(chunk, "wb") as f:
        f.write(bytes(raw))
    ds = stoker.Dataset(path)
    _check_rows(ds, data, [0, 40])
    with pytest.raises(stoker.ShardFormatError) as e:
        ds.get_batch([17])
    text = str(e.value)
    assert chunk in text and "images" in text and "chunk (1, 0, 0, 0)" in text


def test_truncated_compressed_chunk(tmp_path):
    data = _data()
    path = _write_v2(tmp_path / "t.zarr", data, "zlib")
    chunk = os.path.join(path, "images", "3.0.0.0")
    with open(chunk, "r+b") as f:
        f.truncate(os.path.getsize(chunk) // 2)
    with pytest.raises(stoker.ShardFormatError, match="zlib data ends early") as e:
        stoker.Dataset(path).get_batch([50])
    assert chunk in str(e.value)


def _shard_file(path):
    return os.path.join(path, "images", "c", "0", "0", "0", "0")


def test_shard_index_checksum(tmp_path):
    path = _write_v3(tmp_path / "s.zarr", _data(), V3["sharded"])
    shard = _shard_file(path)
    with open(shard, "r+b") as f:
        f.seek(-10, os.SEEK_END)
        f.write(b"\xff\xff")  # the high bytes of the last chunk's size
    with pytest.raises(stoker.ShardFormatError, match="CRC-32C") as e:
        stoker.Dataset(path)
    assert shard in str(e.value)


def test_shard_index_past_the_end(tmp_path):
    path = _write_v3(tmp_path / "s.zarr", _data(), V3["sharded"])
    shard = _shard_file(path)
    with open(shard, "rb") as f:
        raw = bytearray(f.read())
    count = 4  # inner chunks per shard
    index = len(raw) - (16 * count + 4)
    raw[index + 16 + 8 : index + 16 + 16] = struct.pack("<Q", 10**9)  # chunk 1's size
    body = bytes(raw[index : index + 16 * count])
    from stoker import _core

    raw[-4:] = struct.pack("<I", _core.crc32c(body))
    with open(shard, "wb") as f:
        f.write(bytes(raw))
    with pytest.raises(stoker.ShardFormatError, match="past the shard's end") as e:
        stoker.Dataset(path)
    assert shard in str(e.value) and f"offset {index + 16}" in str(e.value)


def test_shard_too_short_for_its_index(tmp_path):
    path = _write_v3(tmp_path / "s.zarr", _data(), V3["sharded"])
    with open(_shard_file(path), "r+b") as f:
        f.truncate(20)
    with pytest.raises(stoker.ShardFormatError, match="cannot hold its"):
        stoker.Dataset(path)


def test_unreadable_metadata(tmp_path):
    path = _write_v3(tmp_path / "m.zarr", _data(), V3["none"])
    meta = os.path.join(path, "images", "zarr.json")
    with open(meta, "w") as f:
        f.write("{not json")
    with pytest.raises(stoker.ShardFormatError) as e:
        stoker.Dataset(path)
    assert meta in str(e.value)
    shutil.rmtree(path)
    os.makedirs(path)
    with open(os.path.join(path, "zarr.json"), "w") as f:
        json.dump(
            {
                "zarr_format": 3,
                "node_type": "array",
                "shape": [4],
                "data_type": "uint8",
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [0]}},
                "codecs": [{"name": "bytes"}],
                "fill_value": 0,
            },
            f,
        )
    with pytest.raises(stoker.ShardFormatError, match="does not fit"):
        stoker.Dataset(path)


def test_a_codec_without_its_library_says_what_to_install(tmp_path):
    """Where libblosc cannot be found, a blosc chunk is an error saying how to get it."""
    import ctypes.util
    import subprocess
    import sys

    if ctypes.util.find_library("blosc"):
        pytest.skip("libblosc is on the system's library path")
    path = _write_v3(
        tmp_path / "b.zarr", {"x": np.arange(40, dtype="<i4")}, V3["blosc lz4 shuffle"]
    )
    script = (
        "import stoker\n"
        "from stoker import _core\n"
        "_core.set_codec_search_dirs([])  # not where the blosc wheel put it\n"
        "try:\n"
        f"    stoker.Dataset({path!r}).get_batch([0])\n"
        "except stoker.ShardFormatError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "needs libblosc" in out.stdout and "pip install blosc" in out.stdout
    assert os.path.join(path, "x") in out.stdout
