import io

import numpy as np
import pytest

import stoker

DTYPES = [
    "bool",
    "i1",
    "u1",
    "<i2",
    ">i2",
    "<u2",
    "<i4",
    ">i4",
    "<u4",
    "<i8",
    ">u8",
    "<f2",
    "<f4",
    ">f4",
    "<f8",
    ">f8",
    "<c8",
    "<c16",
    "<M8[ns]",
    "<m8[s]",
    "S5",
    "<U3",
]


def _array(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    raw = rng.integers(0, 256, n * np.dtype(dtype).itemsize, dtype=np.uint8)
    a = raw.view(np.dtype(dtype)).reshape(shape) if n else np.zeros(shape, dtype)
    if a.dtype.kind == "b":
        a = (raw.reshape(shape) % 2).astype(bool)
    if a.dtype.kind == "U":
        a = np.array(["abc", "d", ""] * (n // 3 + 1), dtype)[:n].reshape(shape)
    return a


def _check(path, a: np.ndarray):
    ds = stoker.Dataset(str(path))
    assert len(ds) == a.shape[0]
    got = ds.get_batch(range(len(ds)))
    for i, sample in enumerate(got):
        row = sample["npy"]
        assert row.dtype == a.dtype and row.shape == a.shape[1:]
        assert row.tobytes() == np.ascontiguousarray(a[i]).tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes(tmp_path, dtype):
    a = _array(dtype, (7, 3))
    np.save(tmp_path / "a.npy", a)
    _check(tmp_path / "a.npy", a)


@pytest.mark.parametrize("shape", [(5,), (4, 3), (3, 2, 3, 4), (0, 3), (6, 1)])
def test_shapes(tmp_path, shape):
    a = _array("<f4", shape)
    np.save(tmp_path / "a.npy", a)
    _check(tmp_path / "a.npy", a)


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_versions(tmp_path, version):
    a = _array("<i4", (9, 2))
    with open(tmp_path / "v.npy", "wb") as f:
        np.lib.format.write_array(f, a, version=version)
    _check(tmp_path / "v.npy", a)


def test_fortran_order_when_rows_are_contiguous(tmp_path):
    for shape in [(8,), (8, 1), (1, 5)]:
        a = np.asfortranarray(_array("<f8", shape))
        np.save(tmp_path / "f.npy", a)
        _check(tmp_path / "f.npy", a)


def test_fortran_order_refused_when_rows_are_strided(tmp_path):
    np.save(tmp_path / "f.npy", np.asfortranarray(_array("<f8", (8, 3))))
    with pytest.raises(stoker.ShardFormatError, match="Fortran-ordered.*ascontiguousarray"):
        stoker.Dataset(str(tmp_path / "f.npy"))


def test_row_keys_and_mixed_shards(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(4, dtype="<i8"))
    np.save(tmp_path / "b.npy", np.ones((2, 2), dtype="<f4"))
    ds = stoker.Dataset([str(tmp_path / "a.npy"), str(tmp_path / "b.npy")])
    assert [ds.key(i) for i in range(len(ds))] == ["a/0", "a/1", "a/2", "a/3", "b/0", "b/1"]
    assert ds[3]["npy"] == 3 and ds[3]["npy"].dtype == np.int64
    assert ds[5]["npy"].tolist() == [1.0, 1.0]


# -- bad input ---------------------------------------------------------------


def _raw(tmp_path, a, mutate, name="bad.npy"):
    buf = io.BytesIO()
    np.save(buf, a)
    path = tmp_path / name
    path.write_bytes(mutate(bytearray(buf.getvalue())))
    return str(path)


def test_bad_magic(tmp_path):
    def mutate(r):
        r[1:6] = b"NUMPX"
        return bytes(r)

    with pytest.raises(stoker.ShardFormatError, match=r"bad\.npy: offset 0: bad magic"):
        stoker.Dataset(_raw(tmp_path, np.zeros(3), mutate))


def test_unsupported_version(tmp_path):
    def mutate(r):
        r[6] = 9
        return bytes(r)

    with pytest.raises(stoker.ShardFormatError, match="version 9.0"):
        stoker.Dataset(_raw(tmp_path, np.zeros(3), mutate))


def test_bad_header_text(tmp_path):
    def mutate(r):
        at = r.find(b"'shape'")
        r[at : at + 7] = b"'shapx'"
        return bytes(r)

    with pytest.raises(stoker.ShardFormatError, match="bad .npy header") as err:
        stoker.Dataset(_raw(tmp_path, np.zeros(3), mutate))
    assert err.value.offset > 10


def test_truncated_data(tmp_path):
    with pytest.raises(stoker.ShardFormatError, match="truncated: the header declares 800 bytes"):
        stoker.Dataset(_raw(tmp_path, np.zeros(100), lambda r: bytes(r[:-8])))


def test_truncated_header(tmp_path):
    with pytest.raises(stoker.ShardFormatError, match="truncated"):
        stoker.Dataset(_raw(tmp_path, np.zeros(100), lambda r: bytes(r[:40])))


def test_object_and_structured_refused(tmp_path):
    np.save(tmp_path / "o.npy", np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    with pytest.raises(stoker.ShardFormatError, match="dtype '\\|O' is not supported"):
        stoker.Dataset(str(tmp_path / "o.npy"))
    np.save(tmp_path / "s.npy", np.zeros(3, dtype=[("a", "<i4"), ("b", "<f4")]))
    with pytest.raises(stoker.ShardFormatError, match="structured"):
        stoker.Dataset(str(tmp_path / "s.npy"))


def test_absurd_count_of_empty_rows_refused(tmp_path):
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (8589934592, 0), }"
    header += " " * (-(len(header) + 11) % 64) + "\n"
    (tmp_path / "e.npy").write_bytes(
        b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode()
    )
    with pytest.raises(stoker.ShardFormatError, match="rows of zero bytes"):
        stoker.Dataset(str(tmp_path / "e.npy"))


def test_zero_d_refused(tmp_path):
    np.save(tmp_path / "z.npy", np.float32(3))
    with pytest.raises(stoker.ShardFormatError, match="0-d"):
        stoker.Dataset(str(tmp_path / "z.npy"))
