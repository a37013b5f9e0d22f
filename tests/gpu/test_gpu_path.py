"""stoker's GPU path on a real GPU: bytes on the device equal bytes in the file, Loader
batches on the device equal the CPU Loader's, nothing synchronises behind the consumer's
back, and the fallbacks (cuFile off, cuFile forced on, a forked child) are honest.

Skipped as a whole where no CUDA device is usable (conftest.py). Files live under pytest's
tmp_path, which may be a tmpfs: GPUDirect Storage cannot work there and stoker falls back,
which is fine here: whatever the path, the bytes must be exact. Scenarios that change the
environment (STOKER_GDS) or fork run in a fresh interpreter with a timeout, so a hang fails
the test instead of the run.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import textwrap
import time

import numpy as np
import pytest
import torch

import stoker
from stoker import StokerError

GPU = torch.device("cuda", 0)
MARK = "GPU-TEST-RESULT "


# ---- helpers -----------------------------------------------------------------------------


def _run(code: str, env: dict[str, str] | None = None, timeout: float = 180) -> dict:
    """Run `code` in a fresh interpreter (its own process group, killed whole on timeout)
    and return the JSON it printed after MARK."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("STOKER_")}
    environ.update(env or {})
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the scenario hung (killed after {timeout} s)\n{err[-3000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # a forked grandchild, if one was left
    lines = [line for line in out.splitlines() if line.startswith(MARK)]
    assert proc.returncode == 0 and lines, (
        f"exit status {proc.returncode}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    )
    return json.loads(lines[-1][len(MARK) :])


def _file_bytes(path, offset: int, nbytes: int) -> torch.Tensor:
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(nbytes)
    assert len(data) == nbytes
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _data_offset(path) -> int:
    """Where a .npy file's data starts, by numpy's own header reader."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            np.lib.format.read_array_header_1_0(f)
        else:
            np.lib.format.read_array_header_2_0(f)
        return f.tell()


def assert_same(gpu, cpu, device: torch.device = GPU, where: str = "batch") -> None:
    """`gpu` is `cpu` with every tensor on `device`; everything else (lists of host arrays,
    keys, numbers) is unchanged."""
    if isinstance(cpu, torch.Tensor):
        assert isinstance(gpu, torch.Tensor), f"{where}: {type(gpu)} instead of a tensor"
        assert gpu.device == device, f"{where}: on {gpu.device}, not {device}"
        assert (gpu.dtype, tuple(gpu.shape)) == (cpu.dtype, tuple(cpu.shape)), where
        assert torch.equal(gpu.cpu(), cpu), f"{where}: values differ"
    elif isinstance(cpu, dict):
        assert isinstance(gpu, dict) and gpu.keys() == cpu.keys(), where
        for key in cpu:
            assert_same(gpu[key], cpu[key], device, f"{where}[{key!r}]")
    elif isinstance(cpu, (list, tuple)):
        assert type(gpu) is type(cpu) and len(gpu) == len(cpu), where
        for i, (g, c) in enumerate(zip(gpu, cpu)):
            assert_same(g, c, device, f"{where}[{i}]")
    elif isinstance(cpu, np.ndarray):
        assert isinstance(gpu, np.ndarray), f"{where}: {type(gpu)} instead of a host array"
        assert np.array_equal(gpu, cpu), f"{where}: values differ"
    else:
        assert gpu == cpu, where


def _random_array(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, shape, dtype=dt, endpoint=True)
    if dt.kind == "c":
        real = rng.standard_normal(shape) * 1e3
        return (real + 1j * rng.standard_normal(shape)).astype(dt)
    return (rng.standard_normal(shape) * 1e3).astype(dt)


# ---- data --------------------------------------------------------------------------------

FILE_BYTES = 48 << 20


@pytest.fixture(scope="module")
def random_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("bytes") / "random.bin"
    path.write_bytes(np.random.default_rng(5).bytes(FILE_BYTES))
    return str(path)


@pytest.fixture(scope="module")
def volume(tmp_path_factory) -> str:
    """A 24.6 MB float32 .npy written by numpy.save (data at byte 128: not page-aligned)."""
    path = tmp_path_factory.mktemp("volume") / "volume.npy"
    np.save(path, _random_array(np.random.default_rng(6), "float32", (3, 1000, 2049)))
    return str(path)


SHAPE = (3, 8, 8)
TAR_FIELDS = {
    "npy": stoker.Npy(),
    "cls": stoker.Int(),
    "raw": stoker.Raw((3, 100), "uint8"),
    "txt": stoker.Bytes(),
}


@pytest.fixture(scope="module")
def tar_shards(tmp_path_factory) -> list[str]:
    """3 tar shards (WebDataset convention): .npy members written by numpy.save, ASCII
    labels, fixed-size raw bytes and variable-length text."""
    root = tmp_path_factory.mktemp("tar")
    rng = np.random.default_rng(11)
    paths, key = [], 0
    for s in range(3):
        path = root / f"shard-{s:06d}.tar"
        with tarfile.open(path, "w") as tar:
            for _ in range(37 + 5 * s):
                image = io.BytesIO()
                np.save(image, rng.standard_normal(SHAPE).astype(np.float32))
                members = {
                    "npy": image.getvalue(),
                    "cls": b"%d" % rng.integers(0, 1000),
                    "raw": rng.integers(0, 256, 300, dtype=np.uint8).tobytes(),
                    "txt": rng.bytes(int(rng.integers(1, 60))),
                }
                for field, data in members.items():
                    info = tarfile.TarInfo(f"{key:06d}.{field}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                key += 1
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def npy_shards(tmp_path_factory) -> list[str]:
    """2 .npy shards, one row per sample (float16)."""
    root = tmp_path_factory.mktemp("npy")
    rng = np.random.default_rng(12)
    paths = []
    for s, rows in enumerate((50, 31)):
        path = root / f"rows-{s}.npy"
        np.save(path, rng.standard_normal((rows, 4, 5)).astype(np.float16))
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def file_samples(tmp_path_factory) -> tuple[str, list[str], list[int]]:
    """One file per sample with integer labels (Dataset.from_files: the seeds' layout)."""
    root = tmp_path_factory.mktemp("files")
    rng = np.random.default_rng(13)
    names = [f"img{i:04d}.raw" for i in range(45)]
    for name in names:
        (root / name).write_bytes(rng.integers(0, 256, 192, dtype=np.uint8).tobytes())
    return str(root), names, [int(x) for x in rng.integers(0, 10, len(names))]


def _decode(sample: dict) -> dict:
    return {
        "image": np.load(io.BytesIO(bytes(sample["npy"]))),
        "label": int(bytes(sample["cls"])),
        "raw": np.frombuffer(bytes(sample["raw"]), np.uint8).reshape(3, 100),
        "key": sample["__key__"],
    }


def _as_tuple(samples: list[dict]):
    images = torch.stack([torch.from_numpy(s["image"]) for s in samples])
    return images, torch.tensor([s["label"] for s in samples]), [s["key"] for s in samples]


# ---- status --------------------------------------------------------------------------------


def test_cuda_status_reports_a_usable_gpu(monkeypatch):
    monkeypatch.delenv("STOKER_GDS", raising=False)
    status = stoker.cuda_status()
    print(status)
    assert status["cuda"] is True, status
    assert status["devices"] >= 1 and status["driver_version"] > 0, status
    # compat only when STOKER_GDS=on; cpu never where CUDA works
    assert status["mode"] in ("gds", "bounce"), status
    assert status["reason"], status


# ---- read_into: device bytes equal file bytes ------------------------------------------------


def _read_cases() -> list[tuple[int, int, str, int]]:
    """(file offset, bytes, dtype, byte shift of the destination on the device)."""
    cases = [
        (0, 1, "uint8", 0),
        (1, 1, "uint8", 0),
        (4095, 2, "uint8", 0),  # across a page boundary
        (4096, 4096, "uint8", 0),  # one aligned page
        (4097, 4095, "uint8", 0),
        (123, 65536, "int16", 0),
        (3 * 4096 + 5, 1 << 20, "float32", 0),
        (7, 3 * (1 << 20) + 12, "int32", 0),
        (12345, (16 << 20) + 8, "float64", 0),
        (100_003, 40_000_000, "uint8", 0),  # 40 MB
        ((1 << 20) + 1, 40 << 20, "int64", 0),
        (FILE_BYTES - 17, 17, "uint8", 0),  # the file's last bytes
        (1, 1000, "uint8", 1),  # the destination is not aligned either
        (513, 5 * 4096, "uint8", 3),
        (4096, 1 << 21, "uint8", 511),
    ]
    rng = np.random.default_rng(21)
    dtypes = ["uint8", "int16", "int32", "float32", "float64", "complex64"]
    for _ in range(16):
        dtype = dtypes[int(rng.integers(len(dtypes)))]
        size = np.dtype(dtype).itemsize
        nbytes = max(size, int(math.exp(rng.uniform(0, math.log(40e6)))) // size * size)
        offset = int(rng.integers(0, FILE_BYTES - nbytes))
        if offset % 4096 == 0:
            offset += 1
        shift = int(rng.integers(1, 64)) if dtype == "uint8" and rng.random() < 0.5 else 0
        cases.append((offset, nbytes, dtype, shift))
    return cases


@pytest.mark.parametrize(("offset", "nbytes", "dtype", "shift"), _read_cases())
def test_read_into_device_bytes_equal_file_bytes(random_file, offset, nbytes, dtype, shift):
    guard = 256
    base = torch.full((shift + nbytes + guard,), 0xA5, dtype=torch.uint8, device=GPU)
    dst = base[shift : shift + nbytes].view(getattr(torch, dtype))
    out = stoker.read_into(dst, random_file, offset)
    assert out.data_ptr() == dst.data_ptr() and out.device == GPU
    expected = _file_bytes(random_file, offset, nbytes).to(GPU)
    assert torch.equal(base[shift : shift + nbytes], expected), "the bytes differ"
    # the bytes around the destination are untouched (no aligned superset spills over)
    assert bool((base[:shift] == 0xA5).all()) and bool((base[shift + nbytes :] == 0xA5).all())


def test_read_into_many_reads_in_a_row_stay_exact(random_file):
    """The same handle, many reads, no synchronise between them from the caller."""
    rng = np.random.default_rng(22)
    reads = []
    for _ in range(40):
        nbytes = int(rng.integers(1, 1 << 20))
        offset = int(rng.integers(0, FILE_BYTES - nbytes))
        dst = torch.empty(nbytes, dtype=torch.uint8, device=GPU)
        reads.append((offset, nbytes, stoker.read_into(dst, random_file, offset)))
    torch.cuda.synchronize()
    for offset, nbytes, dst in reads:
        assert torch.equal(dst.cpu(), _file_bytes(random_file, offset, nbytes))


def test_read_into_past_the_end_is_an_error(random_file):
    dst = torch.empty(4096, dtype=torch.uint8, device=GPU)
    with pytest.raises(StokerError):
        stoker.read_into(dst, random_file, FILE_BYTES - 100)


# ---- load_npy: many dtypes and shapes ----------------------------------------------------------

DTYPES = [
    "bool",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
]  # bfloat16 has no numpy dtype
SHAPES = [(), (0,), (1,), (1001,), (3, 0, 2), (2, 3, 5, 7), (17, 1, 33, 9)]


def _check_load(path, expected: np.ndarray, device: str = "cuda") -> torch.Tensor:
    got = stoker.load_npy(path, device=device)
    want = torch.from_numpy(expected.copy())  # keeps 0-d arrays 0-d
    assert isinstance(got, torch.Tensor)
    assert got.device == (GPU if device.startswith("cuda") else torch.device("cpu"))
    assert got.dtype == want.dtype and tuple(got.shape) == expected.shape
    assert got.is_contiguous()
    assert torch.equal(got.cpu(), want)
    return got


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_load_npy_equals_numpy_load(tmp_path, dtype, shape):
    path = tmp_path / "a.npy"
    np.save(path, _random_array(np.random.default_rng(len(shape)), dtype, shape))
    _check_load(path, np.load(path))


@pytest.mark.parametrize("dtype", ["uint8", "float16", "float64", "complex64"])
def test_load_npy_tens_of_megabytes(tmp_path, dtype):
    path = tmp_path / "big.npy"
    shape = (4, 3, 1021, 1023) if np.dtype(dtype).itemsize <= 2 else (2, 3, 1021, 1023)
    np.save(path, _random_array(np.random.default_rng(31), dtype, shape))
    _check_load(path, np.load(path), device="cuda:0")


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_load_npy_format_versions(tmp_path, version):
    path = tmp_path / "v.npy"
    array = _random_array(np.random.default_rng(32), "float32", (33, 65))
    with open(path, "wb") as f:
        np.lib.format.write_array(f, array, version=version)
    _check_load(path, array)


def test_load_npy_on_the_cpu_too(volume):
    _check_load(volume, np.load(volume), device="cpu")


def test_load_npy_refuses_fortran_order(tmp_path):
    path = tmp_path / "f.npy"
    np.save(path, np.asfortranarray(np.arange(20, dtype=np.float32).reshape(4, 5)))
    with pytest.raises(StokerError):
        stoker.load_npy(path, device="cuda")


@pytest.mark.parametrize("dtype", [">i4", ">f8", ">c8"])
def test_load_npy_big_endian_is_exact_or_refused(tmp_path, dtype):
    path = tmp_path / "be.npy"
    native = np.dtype(dtype).newbyteorder("=")
    array = _random_array(np.random.default_rng(33), native.str, (7, 9)).astype(dtype)
    np.save(path, array)
    try:
        got = stoker.load_npy(path, device="cuda")
    except StokerError:
        return
    assert torch.equal(got.cpu(), torch.from_numpy(array.astype(native)))


def test_gds_cache_round_trip_on_the_gpu(tmp_path):
    source = torch.from_numpy(_random_array(np.random.default_rng(34), "float32", (5, 333, 17)))
    cache = stoker.GDSCache(tmp_path / "cache")
    path = cache.put("volume-1", source)
    assert "volume-1" in cache and os.fspath(cache.path("volume-1")) == os.fspath(path)
    assert np.array_equal(np.load(path), source.numpy())  # numpy reads it
    assert _data_offset(path) % 4096 == 0  # and its data starts on a 4 KiB boundary
    got = cache.get("volume-1", device="cuda")
    assert got.device == GPU and torch.equal(got.cpu(), source)
    with pytest.raises(KeyError):
        cache.get("absent", device="cuda")


def test_load_npy_larger_than_4_gib(tmp_path):
    free_gpu, _ = torch.cuda.mem_get_info(GPU)
    if free_gpu < 12 << 30:
        pytest.skip(f"needs 12 GiB free on the GPU, {free_gpu / 2**30:.1f} GiB are")
    free_disk = shutil.disk_usage(tmp_path).free
    if free_disk < 6 << 30:
        pytest.skip(f"needs 6 GiB free under {tmp_path}, {free_disk / 2**30:.1f} GiB are")
    width = 1021  # rows of an odd size: no offset is a round number
    rows = (4 << 30) // (width * 4) + 1000
    n = rows * width
    path = tmp_path / "huge.npy"
    try:
        array = np.lib.format.open_memmap(path, mode="w+", dtype=np.int32, shape=(rows, width))
        step = 1 << 14
        for start in range(0, rows, step):  # every element holds its own index
            stop = min(rows, start + step)
            block = np.arange(start * width, stop * width, dtype=np.int64).astype(np.int32)
            array[start:stop] = block.reshape(-1, width)
        array.flush()
        del array
        assert os.path.getsize(path) > 4 << 30

        got = stoker.load_npy(path, device="cuda")
        assert got.device == GPU and got.dtype == torch.int32 and tuple(got.shape) == (rows, width)
        flat = got.view(-1)
        chunk = 1 << 28
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            expected = torch.arange(start, stop, dtype=torch.int64, device=GPU).to(torch.int32)
            assert torch.equal(flat[start:stop], expected), f"elements {start}..{stop} differ"
            del expected
        mapped = np.load(path, mmap_mode="r")
        for r in (0, rows // 2, rows - 1):
            assert np.array_equal(got[r].cpu().numpy(), mapped[r])
        del got, flat

        # read_into past the 4 GiB mark, at an unaligned offset
        data_offset = _data_offset(path)
        element = (4 << 30) // 4 + 12345
        dst = torch.empty(1 << 18, dtype=torch.int32, device=GPU)  # 1 MiB
        stoker.read_into(dst, path, data_offset + element * 4)
        expected = torch.arange(element, element + (1 << 18), dtype=torch.int64, device=GPU)
        assert torch.equal(dst, expected.to(torch.int32))
    finally:
        if os.path.exists(path):
            os.unlink(path)


# ---- Loader(device="cuda"): device batches equal CPU batches ------------------------------


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_loader_fields_batches_equal_cpu_batches(tar_shards, device):
    ds = stoker.Dataset(tar_shards)
    kwargs = {"batch_size": 7, "shuffle": True, "seed": 3, "fields": TAR_FIELDS}
    on_gpu = stoker.Loader(ds, device=device, **kwargs)
    on_cpu = stoker.Loader(ds, **kwargs)
    assert len(on_gpu) == len(on_cpu)
    for epoch in range(2):  # every batch kept until the end: none is overwritten later
        gpu_batches, cpu_batches = list(on_gpu), list(on_cpu)
        assert len(gpu_batches) == len(cpu_batches) == len(on_cpu)
        torch.cuda.synchronize()
        for i, (g, c) in enumerate(zip(gpu_batches, cpu_batches)):
            assert isinstance(g["txt"], list)  # variable-length fields stay on the host
            assert_same(g, c, where=f"epoch {epoch} batch {i}")


def test_loader_npy_rows_equal_cpu_batches(npy_shards):
    ds = stoker.Dataset(npy_shards)
    kwargs = {"batch_size": 16, "shuffle": True, "seed": 4, "fields": {"npy": stoker.Npy()}}
    for i, (g, c) in enumerate(
        zip(stoker.Loader(ds, device="cuda", **kwargs), stoker.Loader(ds, **kwargs))
    ):
        assert_same(g, c, where=f"batch {i}")


def test_loader_integer_column_of_files_equals_cpu_batches(file_samples):
    root, names, labels = file_samples
    ds = stoker.Dataset.from_files(root, names, labels)
    fields = {"raw": stoker.Raw((3, 8, 8), "uint8"), "label": stoker.Int()}
    kwargs = {"batch_size": 8, "shuffle": True, "seed": 5, "fields": fields}
    for i, (g, c) in enumerate(
        zip(stoker.Loader(ds, device="cuda", **kwargs), stoker.Loader(ds, **kwargs))
    ):
        assert_same(g, c, where=f"batch {i}")


def test_loader_decoded_images_equal_cpu_batches(tmp_path):
    """Image() fields decoded by the reader's threads into a pinned slot, then copied over:
    the same pixels as the CPU loader's, crops and flips included."""
    if not stoker._core.image_support():
        pytest.skip("built without image support")
    from PIL import Image

    rng = np.random.default_rng(8)
    with tarfile.open(tmp_path / "images.tar", "w") as tar:
        for i in range(40):
            y, x = np.mgrid[0 : 150 + i, 0:200]
            pixels = np.stack([x % 256, y % 256, (x + y + 40 * i) % 256], -1).astype(np.uint8)
            out = io.BytesIO()
            Image.fromarray(pixels).save(out, "JPEG" if i % 3 else "PNG", quality=90)
            for name, data in ((f"{i:03d}.img", out.getvalue()), (f"{i:03d}.cls", b"%d" % i)):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    ds = stoker.Dataset(str(tmp_path / "images.tar"))
    fields = {"img": stoker.Image(size=(48, 64), crop="random", flip=True), "cls": stoker.Int()}
    kwargs = {"batch_size": 8, "shuffle": True, "seed": int(rng.integers(100)), "fields": fields}
    for i, (g, c) in enumerate(
        zip(stoker.Loader(ds, device="cuda", **kwargs), stoker.Loader(ds, **kwargs))
    ):
        assert g["img"].device.type == "cuda" and g["img"].shape == (8, 3, 48, 64)
        assert_same(g, c, where=f"batch {i}")


@pytest.mark.parametrize("collate", [None, _as_tuple], ids=["default-collate", "tuple-collate"])
def test_loader_map_batches_equal_cpu_batches(tar_shards, collate):
    ds = stoker.Dataset(tar_shards)
    kwargs = {"batch_size": 9, "shuffle": True, "seed": 6, "map": _decode, "collate": collate}
    on_gpu = stoker.Loader(ds, device="cuda:0", **kwargs)
    on_cpu = stoker.Loader(ds, **kwargs)
    count = 0
    for g, c in zip(on_gpu, on_cpu):
        assert_same(g, c, where=f"batch {count}")
        count += 1
    assert count == len(on_cpu)


def test_loader_batches_are_ready_on_a_side_stream(tar_shards):
    """Batches are safe to use on whatever stream is current when next() returns them:
    work queued there right away sees the copied bytes."""
    ds = stoker.Dataset(tar_shards)
    kwargs = {"batch_size": 5, "shuffle": True, "seed": 7, "fields": TAR_FIELDS}
    side = torch.cuda.Stream(GPU)
    snapshots = []
    with torch.cuda.stream(side):
        for batch in stoker.Loader(ds, device="cuda", **kwargs):
            snapshots.append({k: batch[k].clone() for k in ("npy", "cls", "raw")})
    torch.cuda.synchronize()
    cpu_batches = list(stoker.Loader(ds, **kwargs))
    assert len(snapshots) == len(cpu_batches)
    for i, (g, c) in enumerate(zip(snapshots, cpu_batches)):
        assert_same(g, {k: c[k] for k in g}, where=f"batch {i}")


def test_loader_with_little_pinned_memory_finishes(tar_shards):
    """A ring bounded to about two batches (fewer slots than prefetch + 2 would use) still
    delivers every batch, in order and exact: no deadlock."""
    result = _run(
        f"""
        import json, torch, stoker
        shards = {tar_shards!r}
        fields = {{"npy": stoker.Npy(), "cls": stoker.Int(), "raw": stoker.Raw((3, 100))}}
        kwargs = dict(batch_size=16, shuffle=True, seed=8, fields=fields)
        ds = stoker.Dataset(shards)
        # one batch: .npy headers and data, labels, raw bytes, and each region's padding
        per_batch = 16 * (128 + 4 * 3 * 8 * 8 + 8 + 300) + 4 * 4096
        gpu = stoker.Loader(ds, device="cuda", pinned_bytes=2 * per_batch, **kwargs)
        cpu = stoker.Loader(ds, **kwargs)
        same = count = 0
        for epoch in range(2):  # both loaders move on to epoch 1 together
            for g, c in zip(gpu, cpu):
                count += 1
                same += all(torch.equal(g[k].cpu(), c[k]) for k in ("npy", "cls", "raw"))
        print({MARK!r} + json.dumps({{"count": count, "same": same, "batches": 2 * len(gpu)}}))
        """,
        timeout=180,
    )
    assert result["count"] == result["same"] == result["batches"], result


# ---- no hidden synchronise ---------------------------------------------------------------------


def test_a_busy_consumer_stream_does_not_block_next(tar_shards):
    """With a long kernel queued on the consumer's stream, next() returns at once (no device
    or stream synchronise hides in it: the kernel is still running when it returns), the
    batch's copy overlaps the kernel (an event recorded on stoker's copy stream after next()
    completes while the consumer's stream is still busy: the copy does not queue behind the
    consumer's work), and the batch is right once the kernel is done. The kernel runs for
    about a second, so the margins hold on a shared machine."""
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        a = torch.randn(4096, 4096, device=GPU)
        out = torch.empty_like(a)

        def busy(count: int) -> None:
            for _ in range(count):
                torch.mm(a, a, out=out)

        busy(3)
        torch.cuda.synchronize()
        start = time.perf_counter()
        busy(5)
        torch.cuda.synchronize()
        each = (time.perf_counter() - start) / 5
        count = min(4000, max(5, math.ceil(1.0 / each)))
        start = time.perf_counter()
        busy(count)
        torch.cuda.synchronize()
        alone = time.perf_counter() - start  # the busy work's duration on its own

        ds = stoker.Dataset(tar_shards)
        kwargs = {"batch_size": 8, "shuffle": True, "seed": 9, "fields": TAR_FIELDS}
        on_gpu, on_cpu = (
            iter(stoker.Loader(ds, device="cuda", **kwargs)),
            iter(stoker.Loader(ds, **kwargs)),
        )
        assert_same(next(on_gpu), next(on_cpu))  # warm: ring, streams, allocations
        torch.cuda.synchronize()
        copies = stoker.cuda.copy_stream(0)  # the stream the Loader's copies run on
        consumer = torch.cuda.current_stream(GPU)
        results = []
        for _ in range(3):
            busy(count)  # queued: the host returns at once
            start = time.perf_counter()
            batch = next(on_gpu)
            waited = time.perf_counter() - start
            still_busy = not consumer.query()
            # Every copy queued so far (this batch's included) is done once this event is.
            copied = copies.record()
            overlapped, seen_after = None, None
            deadline = time.perf_counter() + max(60.0, 20 * alone)
            while overlapped is None and time.perf_counter() < deadline:
                # The copies first, then the kernel: copies seen done while the kernel is
                # still running finished while it ran.
                done = copied.query()
                kernel_running = not consumer.query()
                if done:
                    overlapped, seen_after = kernel_running, time.perf_counter() - start
                elif not kernel_running:
                    overlapped = False  # the kernel ended first: the copy waited for it
                else:
                    time.sleep(0.0002)
            snapshot = {k: batch[k].clone() for k in ("npy", "cls", "raw")}  # after the kernel
            torch.cuda.synchronize()
            expected = next(on_cpu)
            assert_same(batch, expected)
            assert_same(snapshot, {k: expected[k] for k in snapshot})
            results.append(
                {
                    "next_s": round(waited, 4),
                    "kernel_running_after_next": still_busy,
                    "copy_done_while_kernel_ran": overlapped,
                    "copy_seen_done_after_s": None if seen_after is None else round(seen_after, 4),
                }
            )
        print(f"busy work alone {alone:.3f} s ({count} matmuls); per batch: {results}")
        assert all(r["kernel_running_after_next"] for r in results), (
            f"the busy work had finished when next() returned: next() waited for the device "
            f"({results})"
        )
        assert all(r["next_s"] < alone / 2 for r in results), (
            f"next() took too long while {alone:.3f} s of work was queued: {results}"
        )
        assert all(r["copy_done_while_kernel_ran"] for r in results), (
            "the batch's copy did not complete while the consumer's kernel was running (it "
            f"was serialised behind the consumer's work, or never completed): {results}"
        )
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32


# ---- fallbacks ---------------------------------------------------------------------------


def test_cufile_forced_off_uses_the_pinned_ring_and_stays_exact(volume):
    result = _run(
        f"""
        import json, numpy as np, torch, stoker
        path = {volume!r}
        status = stoker.cuda_status()
        got = stoker.load_npy(path, device="cuda")
        same = bool(torch.equal(got.cpu(), torch.from_numpy(np.load(path))))
        dst = torch.empty(1_000_003, dtype=torch.uint8, device="cuda")
        stoker.read_into(dst, path, 4099)
        with open(path, "rb") as f:
            f.seek(4099)
            raw = np.frombuffer(f.read(dst.numel()), np.uint8)
        same_raw = bool(np.array_equal(dst.cpu().numpy(), raw))
        print({MARK!r} + json.dumps({{"status": status, "read_mode": stoker.gds.read_mode(path),
                                     "same": same, "same_raw": same_raw}}))
        """,
        env={"STOKER_GDS": "off"},
    )
    assert result["status"]["cuda"] is True, result
    assert result["status"]["mode"] == "bounce", result
    assert result["read_mode"] == "bounce", result
    assert result["same"] and result["same_raw"], result


def test_cufile_forced_on_is_exact_or_refused(volume):
    """STOKER_GDS=on where there may be no real GPUDirect: load_npy works (in cuFile's
    compatibility mode, or real GDS where the machine has it) or raises StokerError, and
    never returns wrong bytes."""
    result = _run(
        f"""
        import json, numpy as np, torch, stoker
        path = {volume!r}
        status = stoker.cuda_status()
        try:
            mode = stoker.gds.read_mode(path)
            got = stoker.load_npy(path, device="cuda")
            same = bool(torch.equal(got.cpu(), torch.from_numpy(np.load(path))))
            outcome = "exact" if same else "WRONG"
        except stoker.StokerError as e:
            mode, outcome = None, "refused: " + str(e)
        print({MARK!r} + json.dumps({{"status": status, "mode": mode, "outcome": outcome}}))
        """,
        env={"STOKER_GDS": "on"},
    )
    print(result)
    assert result["outcome"] == "exact" or result["outcome"].startswith("refused"), result
    if result["outcome"] == "exact" and result["status"]["cufile"]:
        assert result["mode"] in ("gds", "compat"), result
    if result["status"]["mode"] != "gds" and result["status"]["cufile"]:
        assert result["status"]["mode"] == "compat", result


def test_a_forked_child_gets_a_clear_error_not_a_hang(volume, tar_shards):
    result = _run(
        f"""
        import json, os, sys, numpy as np, torch, stoker
        path, shards = {volume!r}, {tar_shards!r}
        fields = {{"npy": stoker.Npy(), "cls": stoker.Int()}}
        got = stoker.load_npy(path, device="cuda")  # the parent uses the GPU path
        assert torch.equal(got.cpu(), torch.from_numpy(np.load(path)))
        loader = stoker.Loader(stoker.Dataset(shards), 4, device="cuda", fields=fields)
        it = iter(loader)
        next(it)
        torch.cuda.synchronize()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            outcome = {{}}
            attempts = {{
                "load_npy": lambda: stoker.load_npy(path, device="cuda"),
                "new Loader": lambda: next(iter(stoker.Loader(
                    stoker.Dataset(shards), 4, device="cuda", fields=fields))),
                "inherited Loader": lambda: next(iter(loader)),
            }}
            for name, attempt in attempts.items():
                try:
                    attempt()
                    outcome[name] = "no error"
                except stoker.StokerError as e:
                    outcome[name] = "StokerError: " + str(e)
                except BaseException as e:
                    outcome[name] = type(e).__name__ + ": " + str(e)
            os.write(write, json.dumps(outcome).encode())
            os._exit(0)
        os.close(write)
        chunks = []
        while True:
            chunk = os.read(read, 65536)
            if not chunk:
                break
            chunks.append(chunk)
        _, status = os.waitpid(pid, 0)
        child = json.loads(b"".join(chunks) or b"{{}}")
        # and the parent's GPU path still works after the fork
        again = stoker.load_npy(path, device="cuda")
        parent_ok = bool(torch.equal(again.cpu(), torch.from_numpy(np.load(path))))
        print({MARK!r} + json.dumps({{"child": child, "status": status, "parent_ok": parent_ok}}))
        """,
        timeout=120,
    )
    print(result)
    assert result["status"] == 0 and result["parent_ok"], result
    assert set(result["child"]) == {"load_npy", "new Loader", "inherited Loader"}, result
    for name, outcome in result["child"].items():
        assert outcome.startswith("StokerError") and "fork" in outcome.lower(), (name, outcome)
