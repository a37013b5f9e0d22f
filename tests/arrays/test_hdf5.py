"""HDF5 files as array sources: rows byte-exact against h5py for every layout and filter
stoker reads, clear errors for those it does not, and reads under DataLoader workers."""

from __future__ import annotations

import ctypes
import os
import pickle
import struct
import tarfile

import numpy as np
import pytest

import stoker

h5py = pytest.importorskip("h5py")

N = 203  # not a multiple of any chunk's rows: every array has a partial last chunk


def _data(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "images": rng.integers(0, 256, (N, 3, 8, 8), dtype=np.uint8),
        "labels": rng.integers(-(10**12), 10**12, N).astype(np.int64),
        "floats": rng.standard_normal((N, 5)).astype(">f4"),
        "halves": rng.standard_normal((N, 2, 3)).astype(np.float16),
        "flags": rng.integers(0, 2, (N, 4)).astype(bool),
        "grid": rng.integers(-(2**15), 2**15, (N, 5, 7)).astype("<i2"),
    }


LAYOUTS = {
    "contiguous": {},
    "whole-row chunks": {"chunks": "rows"},
    "auto chunks": {"chunks": True},
    "tiled chunks": {"chunks": "tiled"},
    "gzip": {"chunks": "rows", "compression": "gzip", "compression_opts": 1},
    "gzip auto chunks": {"compression": "gzip"},
    "shuffle gzip": {"chunks": "tiled", "compression": "gzip", "shuffle": True},
    "shuffle gzip fletcher32": {"compression": "gzip", "shuffle": True, "fletcher32": True},
    "fletcher32": {"chunks": "rows", "fletcher32": True},
}


def _chunks(option, shape):
    if option == "rows":
        return (16, *shape[1:])
    if option == "tiled":  # chunks that cut across each row, with partial edges on every axis
        return tuple(max(1, (s + 1) // 2) if i else 16 for i, s in enumerate(shape))
    return option


def _write(path, data, **options):
    with h5py.File(path, "w") as f:
        for name, array in data.items():
            kw = dict(options)
            if "chunks" in kw:
                kw["chunks"] = _chunks(kw["chunks"], array.shape)
            f.create_dataset(name if name != "labels" else "meta/labels", data=array, **kw)
    return str(path)


def _check_rows(ds, data, indices):
    batch = ds.get_batch(indices)
    for sample, i in zip(batch, indices):
        for name, array in data.items():
            field = "meta/labels" if name == "labels" else name
            got = sample[field]
            assert got.dtype == array.dtype.newbyteorder("="), (name, got.dtype)
            assert got.shape == array.shape[1:]
            assert got.tobytes() == array[i].astype(got.dtype).tobytes(), (name, i)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rows_byte_exact(tmp_path, layout):
    data = _data()
    path = _write(tmp_path / "data.h5", data, **LAYOUTS[layout])
    ds = stoker.Dataset(path)
    assert len(ds) == N
    assert sorted(ds.fields) == sorted(["meta/labels" if n == "labels" else n for n in data])
    order = np.random.default_rng(1).permutation(N)
    _check_rows(ds, data, order)
    with h5py.File(path) as f:  # and h5py agrees with the data written
        assert np.array_equal(f["images"][N - 1], data["images"][N - 1])
    assert ds[N - 1]["__key__"] == f"data/{N - 1}"


@pytest.mark.parametrize("layout", ["contiguous", "tiled chunks", "shuffle gzip"])
def test_loader_fields(tmp_path, layout):
    torch = pytest.importorskip("torch")
    data = _data()
    path = _write(tmp_path / "data.h5", data, **LAYOUTS[layout])
    ds = stoker.Dataset(path, arrays=["images", "/meta/labels", "grid"])
    assert sorted(ds.fields) == ["grid", "images", "meta/labels"]
    fields = {"images": stoker.Row(), "meta/labels": stoker.Row(), "grid": stoker.Npy()}
    loader = stoker.Loader(ds, batch_size=32, shuffle=True, seed=3, fields=fields)
    seen = []
    for batch in loader:
        idx = [int(k.rsplit("/", 1)[1]) for k in batch["__key__"]]
        assert batch["images"].dtype == torch.uint8
        assert torch.equal(batch["images"], torch.from_numpy(data["images"][idx]))
        assert torch.equal(batch["meta/labels"], torch.from_numpy(data["labels"][idx]))
        assert torch.equal(batch["grid"], torch.from_numpy(data["grid"][idx]))
        seen += idx
    assert sorted(seen) == list(range(N))


def test_map_path_and_pickle(tmp_path):
    data = _data()
    path = _write(tmp_path / "data.h5", data, **LAYOUTS["shuffle gzip"])
    ds = pickle.loads(pickle.dumps(stoker.Dataset(path)))
    _check_rows(ds, data, [0, 5, N - 1])
    loader = stoker.Loader(ds, batch_size=50, shuffle=False, map=lambda s: int(s["meta/labels"]))
    assert [x for batch in loader for x in batch] == data["labels"].tolist()


def test_many_sources_in_a_list(tmp_path):
    a, b = _data(0), _data(1)
    first = _write(tmp_path / "a.h5", a, **LAYOUTS["gzip"])
    second = _write(tmp_path / "b.hdf5", b)
    tar = tmp_path / "extra.tar"
    with tarfile.open(tar, "w") as t:
        for i in range(3):
            (tmp_path / f"s{i}.cls").write_text(str(i))
            t.add(tmp_path / f"s{i}.cls", arcname=f"s{i}.cls")
    ds = stoker.Dataset([first, second, str(tar)])
    assert len(ds) == 2 * N + 3
    _check_rows(ds, a, [0, N - 1])
    got = ds.get_batch([N, 2 * N - 1, 2 * N + 2])
    assert got[0]["images"].tobytes() == b["images"][0].tobytes()
    assert got[1]["meta/labels"] == b["labels"][N - 1]
    assert bytes(got[2]["cls"]) == b"2"


def test_fill_values(tmp_path):
    path = tmp_path / "fill.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("never", shape=(40, 3), dtype="<i4", fillvalue=-7)  # unallocated
        part = f.create_dataset("part", shape=(40, 3), dtype="f8", chunks=(8, 3), fillvalue=2.5)
        part[0:8] = 1.0  # chunks 1.. never written
        part[32:40] = 3.0
    ds = stoker.Dataset(str(path))
    rows = ds.get_batch([0, 9, 39])
    assert rows[0]["never"].tolist() == [-7, -7, -7]
    assert rows[0]["part"].tolist() == [1.0] * 3
    assert rows[1]["part"].tolist() == [2.5] * 3
    assert rows[2]["part"].tolist() == [3.0] * 3


def test_userblock_and_unfiltered_chunks(tmp_path):
    data = np.arange(64 * 6, dtype="<u2").reshape(64, 6)
    path = tmp_path / "ub.h5"
    with h5py.File(path, "w", userblock_size=1024) as f:
        f.create_dataset("plain", data=data)
        d = f.create_dataset(
            "mixed", shape=(64, 6), dtype="<u2", chunks=(16, 6), compression="gzip", shuffle=True
        )
        d[:] = data
        # a chunk stored with both filters skipped (filter mask 0b11): raw bytes
        d.id.write_direct_chunk((16, 0), data[16:32].tobytes(), filter_mask=0b11)
    ds = stoker.Dataset(str(path))
    got = ds.get_batch(range(64))
    assert np.array_equal(np.stack([s["plain"] for s in got]), data)
    assert np.array_equal(np.stack([s["mixed"] for s in got]), data)


def _hdf5_library():
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "libhdf5" in os.path.basename(path) and "_hl" not in path:
                return ctypes.CDLL(path)
    pytest.skip("h5py's HDF5 library not found in this process")


def test_partial_chunks_left_unfiltered(tmp_path):
    """H5D_CHUNK_DONT_FILTER_PARTIAL_CHUNKS: the edge chunk is stored raw while its filter
    mask still says it was filtered."""
    lib = _hdf5_library()
    data = np.arange(40 * 4, dtype="<i4").reshape(40, 4)
    path = tmp_path / "partial.h5"
    with h5py.File(path, "w") as f:
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_chunk((16, 4))
        dcpl.set_shuffle()
        dcpl.set_deflate(4)
        assert lib.H5Pset_chunk_opts(ctypes.c_int64(dcpl.id), ctypes.c_uint(2)) >= 0
        space = h5py.h5s.create_simple((40, 4))
        dsid = h5py.h5d.create(f.id, b"x", h5py.h5t.STD_I32LE, space, dcpl=dcpl)
        h5py.Dataset(dsid)[:] = data
    with h5py.File(path) as f:
        edge = f["x"].id.get_chunk_info_by_coord((32, 0))
        assert edge.filter_mask == 0 and edge.size == 16 * 4 * 4  # raw, mask 0
    ds = stoker.Dataset(str(path))
    assert np.array_equal(np.stack([s["x"] for s in ds.get_batch(range(40))]), data)


# -- what stoker does not read: each a clear error -------------------------------------


def test_unsupported_filter_names_it(tmp_path):
    path = tmp_path / "lzf.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.zeros((10, 3)), compression="lzf")
    with pytest.raises(stoker.ShardFormatError) as e:
        stoker.Dataset(str(path))
    text = str(e.value)
    assert str(path) in text and "'/x'" in text and "lzf" in text and "h5repack" in text


def test_records_and_strings_are_left_out_or_refused(tmp_path):
    path = tmp_path / "mixed.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.arange(6, dtype="u1"))
        f.create_dataset("names", data=np.array([b"a", b"b", b"c", b"d", b"e", b"f"]))
        f.create_dataset("pairs", data=np.zeros(6, dtype=[("a", "i4"), ("b", "f4")]))
    ds = stoker.Dataset(str(path))  # arrays with no tensor type are left out...
    assert ds.fields == ["x"]
    with pytest.raises(stoker.ShardFormatError, match="records") as e:  # ...unless asked for
        stoker.Dataset(str(path), arrays=["pairs"])
    assert str(path) in str(e.value)


def test_virtual_and_external_datasets_refused(tmp_path):
    src = tmp_path / "src.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("x", data=np.arange(10, dtype="i4"))
    layout = h5py.VirtualLayout(shape=(10,), dtype="i4")
    layout[:] = h5py.VirtualSource(str(src), "x", shape=(10,))
    vds = tmp_path / "vds.h5"
    with h5py.File(vds, "w") as f:
        f.create_virtual_dataset("v", layout)
    with pytest.raises(stoker.ShardFormatError, match="virtual"):
        stoker.Dataset(str(vds))
    raw = tmp_path / "raw.bin"
    raw.write_bytes(np.arange(10, dtype="<i4").tobytes())
    ext = tmp_path / "ext.h5"
    with h5py.File(ext, "w") as f:
        f.create_dataset("e", shape=(10,), dtype="<i4", external=[(str(raw), 0, 40)])
    with pytest.raises(stoker.ShardFormatError, match="external"):
        stoker.Dataset(str(ext))


def test_arrays_argument_errors(tmp_path):
    path = _write(tmp_path / "d.h5", {"a": np.zeros((4, 2)), "b": np.zeros((5,))})
    with pytest.raises(stoker.StokerError, match="no array 'c'"):
        stoker.Dataset(path, arrays=["c"])
    with pytest.raises(stoker.UsageError, match="different lengths"):
        stoker.Dataset(path, arrays=["a", "b"])
    (tmp_path / "one.cls").write_text("1")
    tar = tmp_path / "x.tar"
    with tarfile.open(tar, "w") as t:
        t.add(tmp_path / "one.cls", arcname="one.cls")
    with pytest.raises(stoker.UsageError, match="arrays="):
        stoker.Dataset(str(tar), arrays=["a"])


# -- corrupt files ---------------------------------------------------------------------


def _chunk_at(path, name, coord):
    with h5py.File(path) as f:
        info = f[name].id.get_chunk_info_by_coord(coord)
        return info.byte_offset, info.size


def test_truncated_file(tmp_path):
    data = _data()
    path = _write(tmp_path / "t.h5", data, **LAYOUTS["contiguous"])
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(stoker.ShardFormatError) as e:
        ds = stoker.Dataset(path)
        ds.get_batch(range(len(ds)))
    assert path in str(e.value)


def test_chunk_past_the_end_of_the_file(tmp_path):
    data = _data()["images"]
    path = str(tmp_path / "c.h5")
    with h5py.File(path, "w", libver="earliest") as f:
        f.create_dataset("images", data=data, chunks=(16, 3, 8, 8), compression="gzip")
    offset, size = _chunk_at(path, "images", (192, 0, 0, 0))
    # The chunk's key in the version 1 B-tree: its size, its filter mask, its coordinates.
    key = struct.pack("<II5Q", size, 0, 192, 0, 0, 0, 0)
    with open(path, "rb") as f:
        raw = f.read()
    assert raw.count(key) == 1
    with open(path, "r+b") as f:
        f.write(raw.replace(key, struct.pack("<II5Q", 10**7, 0, 192, 0, 0, 0, 0)))
    with pytest.raises(stoker.ShardFormatError) as e:
        stoker.Dataset(path)
    text = str(e.value)
    assert path in text and "'/images'" in text and "past the end of the file" in text
    assert f"offset {offset}" in text


def test_corrupt_gzip_chunk(tmp_path):
    data = _data()
    path = _write(tmp_path / "z.h5", data, **LAYOUTS["gzip"])
    offset, size = _chunk_at(path, "images", (32, 0, 0, 0))
    with open(path, "r+b") as f:
        f.seek(offset + size // 2)
        f.write(b"\xff" * 16)
    ds = stoker.Dataset(path)
    _check_rows(ds, data, [0, 16, 48])  # rows of other chunks read
    with pytest.raises(stoker.ShardFormatError) as e:
        ds.get_batch([33])
    text = str(e.value)
    assert path in text and f"offset {offset}" in text and "images" in text
    assert "chunk (2, 0, 0, 0)" in text


def test_corrupt_checksum(tmp_path):
    data = _data()
    path = _write(tmp_path / "f.h5", data, **LAYOUTS["fletcher32"])
    offset, size = _chunk_at(path, "images", (0, 0, 0, 0))
    with open(path, "r+b") as f:
        f.seek(offset + 10)
        f.write(b"\x00\x01\x02")
    with pytest.raises(stoker.ShardFormatError, match="Fletcher-32"):
        stoker.Dataset(path).get_batch([3])


def test_not_hdf5(tmp_path):
    path = tmp_path / "fake.h5"
    path.write_bytes(b"not hdf5 at all" * 10)
    with pytest.raises(stoker.ShardFormatError) as e:
        stoker.Dataset(str(path))
    assert str(path) in str(e.value)


# -- fork safety -----------------------------------------------------------------------


def _collate(batch):
    return [(s["__key__"], s["images"].tobytes(), int(s["meta/labels"])) for s in batch]


@pytest.mark.parametrize("layout", ["contiguous", "shuffle gzip"])
def test_dataloader_workers(tmp_path, layout):
    torch = pytest.importorskip("torch")
    data = _data()
    path = _write(tmp_path / "w.h5", data, **LAYOUTS[layout])
    ds = stoker.Dataset(path)
    ds.get_batch(range(10))  # the parent has read before the workers fork
    loader = torch.utils.data.DataLoader(ds, batch_size=9, num_workers=2, collate_fn=_collate)
    got = [item for batch in loader for item in batch]
    assert got == [
        (f"w/{i}", data["images"][i].tobytes(), int(data["labels"][i])) for i in range(N)
    ]


# -- shuffled epochs over chunks -------------------------------------------------------


def test_shuffled_epochs_keep_chunk_locality(tmp_path):
    data = _data()
    path = _write(tmp_path / "g.h5", data, **LAYOUTS["gzip"])  # 16 rows per chunk
    ds = stoker.Dataset(path)
    assert ds.members.group_sizes().tolist() == [16] * 12 + [11]
    loader = stoker.Loader(ds, batch_size=16, seed=5, shuffle_window=2, map=lambda s: s["__key__"])
    order = [int(k.rsplit("/", 1)[1]) for batch in loader for k in batch]
    assert sorted(order) == list(range(N))
    for start in range(0, N, 16):  # a batch draws from the few chunks in the window
        assert len({i // 16 for i in order[start : start + 16]}) <= 3
    again = stoker.Loader(ds, batch_size=16, seed=5, shuffle_window=2, map=lambda s: s["__key__"])
    assert [int(k.rsplit("/", 1)[1]) for b in again for k in b] == order
    contiguous = stoker.Dataset(_write(tmp_path / "c.h5", data))
    assert contiguous.members.group_sizes().tolist() == [N]  # rows read in place: one group


def test_resume_refuses_another_grouping(tmp_path):
    data = _data()
    chunked = stoker.Dataset(_write(tmp_path / "g.h5", data, **LAYOUTS["gzip"]))
    contiguous = stoker.Dataset(_write(tmp_path / "c.h5", data))
    first = stoker.Loader(chunked, batch_size=16, fields={"images": stoker.Row()})
    it = iter(first)
    next(it)
    state = first.state_dict()
    again = stoker.Loader(chunked, batch_size=16, fields={"images": stoker.Row()})
    again.load_state_dict(state)
    other = stoker.Loader(contiguous, batch_size=16, fields={"images": stoker.Row()})
    with pytest.raises(stoker.StokerError, match="groups"):
        other.load_state_dict(state)


def test_decoded_chunk_cache_off(tmp_path):
    from stoker._process import shared_reader

    data = _data()
    ds = stoker.Dataset(_write(tmp_path / "z.h5", data, **LAYOUTS["shuffle gzip"]))
    reader = shared_reader()
    kept = reader.chunk_cache_bytes
    try:
        reader.chunk_cache_bytes = 0
        _check_rows(ds, data, _order_of(N))
    finally:
        reader.chunk_cache_bytes = kept
    _check_rows(ds, data, _order_of(N))  # cached and read again: the same bytes
    _check_rows(ds, data, _order_of(N))


def _order_of(n):
    return np.random.default_rng(7).permutation(n)


# -- the tools -------------------------------------------------------------------------


def test_inspect_and_pack(tmp_path, capsys):
    from stoker.tools.cli import main

    data = _data()
    path = _write(tmp_path / "d.h5", data, **LAYOUTS["shuffle gzip"])
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert f"{N:,} samples" in out and "hdf5" in out
    assert "images: (203, 3, 8, 8) uint8, chunked (16, 2, 4, 4), shuffle+gzip" in out
    assert "chunks cut across rows" in out and "chunks=(16, 3, 8, 8)" in out
    out_dir = tmp_path / "packed"
    assert main(["pack", path, str(out_dir), "--quiet"]) == 0
    packed = stoker.Dataset(str(out_dir))
    assert len(packed) == N and "meta.labels" in packed.fields
    loader = stoker.Loader(
        packed, batch_size=N, shuffle=False, fields={"images": stoker.Npy(), "grid": stoker.Npy()}
    )
    batch = next(iter(loader))
    assert batch["images"].numpy().tobytes() == data["images"].tobytes()
    assert batch["grid"].numpy().tobytes() == data["grid"].tobytes()


def test_remote_array_sources_are_refused_clearly():
    with pytest.raises(stoker.ShardFormatError, match="local disk") as e:
        stoker.Dataset("https://127.0.0.1:9/data.h5")
    assert "https://127.0.0.1:9/data.h5" in str(e.value)


def test_rows_by_rule_beside_rows_in_chunks_read_in_place(tmp_path):
    """Rows of a contiguous array, and of one read by chunk, follow a rule: their members
    are computed, not stored row by row. Whole rows in uncompressed chunks are read in
    place from each chunk's offset, which follows no rule: beside them the members are
    stored. Both read byte-exact."""
    from stoker._columns import ComputedColumn

    data = _data()
    path = tmp_path / "mixed.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("images", data=data["images"])
        f.create_dataset("floats", data=data["floats"], chunks=(16, 5), compression="gzip")
        f.create_dataset("grid", data=data["grid"], chunks=(16, 5, 7))
    order = np.random.default_rng(2).permutation(N)
    for arrays, computed in ((["images", "floats"], True), (None, False)):
        ds = stoker.Dataset(str(path), arrays=arrays)
        batch = ds.get_batch(order)
        for sample, i in zip(batch, order):
            for name in arrays or ("images", "floats", "grid"):
                want = data[name][i]
                assert sample[name].tobytes() == want.astype(sample[name].dtype).tobytes()
        columns = ds.members.piece_index(0).columns
        # Beside rows in chunks read in place only the offsets are stored, 8 bytes a member.
        assert isinstance(columns["offset"], ComputedColumn) == computed
        assert all(isinstance(c, ComputedColumn) for n, c in columns.items() if n != "offset")
