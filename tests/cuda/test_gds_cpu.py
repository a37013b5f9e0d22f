"""load_npy, read_into and GDSCache on the CPU, and the refusal of device="cuda" on a
machine without CUDA. Nothing here needs a GPU or the stand-in driver."""

from __future__ import annotations

import functools
import io
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import stoker

_PROBE = """
import json, stoker._core
driver = stoker._core.cuda_driver_status()
try:
    import torch
    torch_cuda = bool(torch.cuda.is_available())
except Exception:
    torch_cuda = False
print(json.dumps({"driver": bool(driver["available"]), "reason": driver["reason"],
                  "torch": torch_cuda}))
"""


@functools.cache
def _cuda_reachable() -> str:
    """Why CUDA is usable here ("" where it is not), asked of stoker's own driver loader
    (cuda_driver_status, with this environment's STOKER_LIBCUDA) and of torch, in a fresh
    interpreter so that this process never loads the driver."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120
        )
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired) as e:
        return f"could not tell whether CUDA is usable here ({type(e).__name__}: {e})"
    if found["driver"]:
        return "stoker.cuda_driver_status() finds a usable CUDA driver here"
    if found["torch"]:
        return "torch.cuda.is_available() is True here"
    return ""


@pytest.fixture
def no_cuda():
    """Skips the test where CUDA is usable: the refusals are for machines without it."""
    why = _cuda_reachable()
    if why:
        pytest.skip(f"{why}: the refusal is for machines without CUDA")


NO_CUDA = pytest.mark.usefixtures("no_cuda")

DTYPES = [
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
]  # fmt: skip
SHAPES = [(), (0,), (1,), (3, 0), (7,), (4, 5), (2, 3, 4), (1, 1, 1, 1), (4097,)]


def _array(dtype: str, shape: tuple, seed: int = 0) -> np.ndarray:
    return np.asarray(_values(dtype, shape, seed))


def _values(dtype: str, shape: tuple, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.startswith("complex"):
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    if dtype.startswith(("int", "uint")):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    return (rng.standard_normal(shape) * 1000).astype(dtype)


def _same(t: torch.Tensor, a: np.ndarray) -> bool:
    got = t.numpy()
    return (
        t.device.type == "cpu"
        and got.dtype == a.dtype
        and got.shape == a.shape
        and (np.array_equal(got, a))
    )


# ---- load_npy on the CPU -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_load_npy_cpu_matches_numpy(tmp_path, dtype):
    for i, shape in enumerate(SHAPES):
        a = _array(dtype, shape, seed=i)
        path = tmp_path / f"{i}.npy"
        np.save(path, a)
        t = stoker.load_npy(str(path), device="cpu")
        assert isinstance(t, torch.Tensor)
        assert _same(t, np.load(path)), (dtype, shape)


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_load_npy_header_versions(tmp_path, version):
    a = _array("float32", (5, 6))
    path = tmp_path / "v.npy"
    with open(path, "wb") as f:
        np.lib.format.write_array(f, a, version=version)
    assert _same(stoker.load_npy(str(path), device="cpu"), a)


def test_load_npy_accepts_path_objects(tmp_path):
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    np.save(tmp_path / "p.npy", a)
    assert _same(stoker.load_npy(tmp_path / "p.npy", device="cpu"), a)


def test_load_npy_refuses_fortran_order(tmp_path):
    path = tmp_path / "fortran.npy"
    np.save(path, np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4)))
    with pytest.raises(stoker.StokerError, match="fortran\\.npy"):
        stoker.load_npy(str(path), device="cpu")


def test_load_npy_refuses_object_arrays(tmp_path):
    path = tmp_path / "objects.npy"
    np.save(path, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    with pytest.raises(stoker.StokerError, match="objects\\.npy"):
        stoker.load_npy(str(path), device="cpu")


@pytest.mark.parametrize("keep", ["half-magic", "half-header", "short-data"])
def test_load_npy_truncated(tmp_path, keep):
    buf = io.BytesIO()
    np.save(buf, np.arange(1000, dtype=np.float64))
    data = buf.getvalue()
    cut = {"half-magic": 4, "half-header": 40, "short-data": len(data) - 8}[keep]
    path = tmp_path / "cut.npy"
    path.write_bytes(data[:cut])
    with pytest.raises(stoker.ShardFormatError, match=r"cut\.npy.*offset \d+") as info:
        stoker.load_npy(str(path), device="cpu")
    assert isinstance(info.value, stoker.StokerError)


def test_load_npy_missing_file(tmp_path):
    path = tmp_path / "absent.npy"
    with pytest.raises(stoker.ReadError, match="absent\\.npy") as info:
        stoker.load_npy(str(path), device="cpu")
    assert isinstance(info.value, OSError) and isinstance(info.value, stoker.StokerError)


# ---- read_into a CPU tensor ----------------------------------------------------------------


@pytest.fixture
def raw_file(tmp_path):
    data = np.random.default_rng(2).integers(0, 256, (3 << 20) + 77, dtype=np.uint8)
    path = tmp_path / "raw.bin"
    data.tofile(path)
    return str(path), data


def test_read_into_cpu_exact(raw_file):
    path, data = raw_file
    rng = np.random.default_rng(9)
    cases = [(0, 0), (0, 1), (1, 1), (4095, 2), (4097, 8191), (0, data.size), (data.size - 1, 1)]
    cases += [(int(o), int(rng.integers(0, data.size - o))) for o in rng.integers(0, data.size, 20)]
    for offset, size in cases:
        t = torch.full((size,), 0xAB, dtype=torch.uint8)
        got = stoker.read_into(t, path, offset)
        assert got.data_ptr() == t.data_ptr()  # filled in place
        assert np.array_equal(t.numpy(), data[offset : offset + size]), (offset, size)


def test_read_into_typed_tensor(raw_file):
    path, data = raw_file
    t = torch.zeros((10, 7), dtype=torch.float64)
    stoker.read_into(t, path, 13)
    assert np.array_equal(t.numpy().view(np.uint8).ravel(), data[13 : 13 + 560])
    default = torch.zeros(100, dtype=torch.int16)
    stoker.read_into(default, path)  # offset 0 by default
    assert np.array_equal(default.numpy().view(np.uint8), data[:200])


def test_read_into_past_end_of_file(raw_file):
    path, data = raw_file
    t = torch.zeros(100, dtype=torch.uint8)
    offset = data.size - 50
    with pytest.raises(stoker.StokerError, match=rf"raw\.bin.*{offset}"):
        stoker.read_into(t, path, offset)


# ---- GDSCache --------------------------------------------------------------------------


def _data_offset(path: str) -> int:
    with open(path, "rb") as f:
        major, _ = np.lib.format.read_magic(f)
        if major == 1:
            np.lib.format.read_array_header_1_0(f)
        else:
            np.lib.format.read_array_header_2_0(f)
        return f.tell()


@pytest.mark.parametrize(
    "dtype, shape", [("float32", (17, 33, 9)), ("int16", (5,)), ("bool", (3, 3)), ("float64", ())]
)
def test_gdscache_round_trip(tmp_path, dtype, shape):
    cache = stoker.GDSCache(str(tmp_path / "cache"))
    a = _array(dtype, shape)
    assert "vol" not in cache
    path = cache.put("vol", torch.from_numpy(a))
    assert path == cache.path("vol") and os.path.basename(path) == "vol.npy"
    assert "vol" in cache
    assert _data_offset(path) % 4096 == 0  # data starts on a 4 KiB boundary
    assert np.array_equal(np.load(path), a) and np.load(path).dtype == a.dtype
    assert _same(cache.get("vol", device="cpu"), a)
    assert os.listdir(tmp_path / "cache") == ["vol.npy"]  # no temp files left behind


def test_gdscache_overwrite_and_missing(tmp_path):
    cache = stoker.GDSCache(str(tmp_path))
    cache.put("k", torch.arange(10))
    cache.put("k", torch.arange(20, dtype=torch.int32))
    assert _same(cache.get("k", device="cpu"), np.arange(20, dtype=np.int32))
    assert sorted(os.listdir(tmp_path)) == ["k.npy"]
    with pytest.raises(KeyError):
        cache.get("absent", device="cpu")


@pytest.mark.parametrize("key", ["a/b", "../x", "..", "x/../../y"])
def test_gdscache_refuses_unsafe_keys(tmp_path, key):
    cache = stoker.GDSCache(str(tmp_path / "c"))
    with pytest.raises((stoker.StokerError, ValueError)):
        cache.put(key, torch.zeros(3))
    assert sorted(p.name for p in tmp_path.rglob("*.npy")) == []


# ---- device="cuda" on a machine without CUDA ---------------------------------------------


@NO_CUDA
def test_load_npy_cuda_refused_without_cuda(tmp_path):
    path = tmp_path / "a.npy"
    np.save(path, np.arange(4))
    with pytest.raises(stoker.StokerError, match=re.compile("cuda", re.I)):
        stoker.load_npy(str(path), device="cuda")
    cache = stoker.GDSCache(str(tmp_path / "cache"))
    cache.put("k", torch.arange(3))
    with pytest.raises(stoker.StokerError, match=re.compile("cuda", re.I)):
        cache.get("k", device="cuda")


@NO_CUDA
def test_read_mode_and_status_without_cuda(tmp_path):
    import stoker.gds

    path = tmp_path / "a.npy"
    np.save(path, np.arange(4))
    assert stoker.gds.read_mode(str(path)) == "cpu"
    status = stoker.cuda_status()
    assert status["mode"] == "cpu" and status["cuda"] is False


@NO_CUDA
def test_loader_cuda_refused_without_cuda(tmp_path):
    np.save(tmp_path / "rows.npy", np.zeros((8, 3), np.float32))
    ds = stoker.Dataset(str(tmp_path / "rows.npy"))
    with pytest.raises(stoker.StokerError, match=re.compile("cuda", re.I)):
        loader = stoker.Loader(ds, 4, device="cuda")
        next(iter(loader))
