"""stoker's CUDA path driven through a host-memory stand-in for the driver and cuFile.

The stand-in (tests/standin/fake_cuda.c, fake_cufile.c) runs each stream's copies late
on a worker thread, fires events late and hashes every host source twice (when its copy
is queued and right before it runs). It checks ORDERING AND LOGIC ONLY: that a ring slot
is never refilled before its copy's event, that the consumer stream is made to wait,
that nothing synchronises the host, that status, fallbacks and fork handling are right.
It says nothing about real GPUs; passing these tests is not GPU verification (that is
tests/gpu/ and scripts/gpu_check.sh, on a machine with a GPU).

The driver is loaded once per process, so each scenario runs in a fresh interpreter
(`_run`), with STOKER_LIBCUDA / STOKER_LIBCUFILE pointing at the stand-in, and reports
back as JSON on stdout. The scenario bodies are the `_scenario_*` functions below.
"""

from __future__ import annotations

import ctypes.util
import io
import json
import os
import select
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support import REPO, child_preamble
from tests.support.shards import write_tar

MARK = "STANDIN-RESULT "
NO_CUFILE = "/nonexistent/stoker-standin/libcufile.so.0"
PAGE = 4096


# ---- running scenarios in a fresh interpreter -------------------------------------------


def _run(
    scenario: str,
    libs: tuple[str, str] | None,
    *,
    cufile: bool = False,
    env: dict[str, str] | None = None,
    timeout: float = 60,
    **kwargs: Any,
) -> dict:
    """Runs `_scenario_<scenario>(**kwargs)` in a new interpreter and returns its result.
    libs: the stand-in (libcuda, libcufile), or None for no STOKER_LIBCUDA at all;
    cufile: whether STOKER_LIBCUFILE names the stand-in (else a path that does not exist)."""
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("STOKER_", "FAKE_CUDA", "FAKE_CUFILE"))
    }
    if libs is not None:
        environ["STOKER_LIBCUDA"] = libs[0]
        environ["STOKER_LIBCUFILE"] = libs[1] if cufile else NO_CUFILE
        kwargs.setdefault("libs", list(libs))
    environ.update(env or {})
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, environ.get("PYTHONPATH")]))
    code = (
        child_preamble(__name__) + f"m._child({scenario!r}, json.loads({json.dumps(kwargs)!r}))\n"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code],
            env=environ,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"scenario {scenario} hung for {timeout} s; stderr:\n{e.stderr}")
    if done.returncode != 0:
        pytest.fail(f"scenario {scenario} failed (exit {done.returncode}):\n{done.stderr[-8000:]}")
    for line in done.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    pytest.fail(f"scenario {scenario} reported nothing:\n{done.stdout}\n{done.stderr}")


def _child(scenario: str, kwargs: dict) -> None:
    result = globals()[f"_scenario_{scenario}"](**kwargs)
    sys.stdout.flush()
    print(MARK + json.dumps(result), flush=True)


def _hooks(libs: list[str]) -> tuple[Any, Any]:
    from tests.support import standin_lib

    return standin_lib.FakeCuda(libs[0]), standin_lib.FakeCuFile(libs[1])


def _mapped(*names: str) -> list[str]:
    """Lines of /proc/self/maps that name any of `names`."""
    with open("/proc/self/maps") as f:
        return [line.strip() for line in f if any(n in line for n in names)]


# ---- the stand-in itself ----------------------------------------------------------------


def _scenario_selftest(libs: list[str]) -> dict:
    """The stand-in's own semantics, straight through ctypes (no stoker)."""
    import threading

    fake, _ = _hooks(libs)
    lib = fake.lib
    c_void_p, byref = ctypes.c_void_p, ctypes.byref
    ptr, size, uint = c_void_p, ctypes.c_size_t, ctypes.c_uint
    signatures = {
        "cuMemcpyHtoDAsync_v2": [ctypes.c_ulonglong, ptr, size, ptr],
        "cuMemcpyDtoDAsync_v2": [ctypes.c_ulonglong, ctypes.c_ulonglong, size, ptr],
        "cuMemHostRegister_v2": [ptr, size, uint],
        "cuStreamWaitEvent": [ptr, ptr, uint],
        "cuEventRecord": [ptr, ptr],
    }
    for name in (
        "cuMemHostUnregister",
        "cuEventQuery",
        "cuEventSynchronize",
        "cuStreamSynchronize",
        "cuCtxSetCurrent",
        "cuEventDestroy_v2",
        "cuStreamDestroy_v2",
    ):
        signatures[name] = [ptr]
    for name, argtypes in signatures.items():
        getattr(lib, name).argtypes = argtypes
    out: dict[str, Any] = {"before_init": lib.cuDeviceGetCount(byref(ctypes.c_int()))}
    assert lib.cuInit(0) == 0
    ctx, stream, other, event, never = (c_void_p() for _ in range(5))
    assert lib.cuDevicePrimaryCtxRetain(byref(ctx), 0) == 0
    out["stream_without_context"] = lib.cuStreamCreate(byref(stream), 1)
    assert lib.cuCtxSetCurrent(ctx) == 0
    assert lib.cuStreamCreate(byref(stream), 1) == 0
    assert lib.cuStreamCreate(byref(other), 1) == 0
    assert lib.cuEventCreate(byref(event), 2) == 0
    assert lib.cuEventCreate(byref(never), 2) == 0
    out["never_recorded_query"] = lib.cuEventQuery(never)

    src = np.full(1 << 16, 7, np.uint8)
    dst = np.zeros_like(src)
    assert lib.cuMemHostRegister_v2(src.ctypes.data, src.nbytes, 1) == 0
    fake.set_copy_delay_us(50_000)
    fake.reset()
    out["overlap"] = lib.cuMemHostRegister_v2(src.ctypes.data + 100, 10, 1)
    assert lib.cuMemcpyHtoDAsync_v2(dst.ctypes.data, src.ctypes.data, src.nbytes, stream) == 0
    assert lib.cuEventRecord(event, stream) == 0
    out["query_pending"] = lib.cuEventQuery(event)
    # the other stream waits for the event, then copies dst onward: FIFO + wait order
    onward = np.zeros_like(src)
    assert lib.cuStreamWaitEvent(other, event, 0) == 0
    assert lib.cuMemcpyDtoDAsync_v2(onward.ctypes.data, dst.ctypes.data, src.nbytes, other) == 0
    src[:] = 9  # refilled before its copy ran: the stand-in must notice
    assert lib.cuStreamSynchronize(other) == 0
    out["query_done"] = lib.cuEventQuery(event)
    out["dst_is_refill"] = bool((dst == 9).all())
    out["onward_is_refill"] = bool((onward == 9).all())
    pageable = np.ones(100, np.uint8)
    assert lib.cuMemcpyHtoDAsync_v2(dst.ctypes.data, pageable.ctypes.data, 100, stream) == 0
    assert lib.cuEventRecord(event, stream) == 0
    assert lib.cuEventSynchronize(event) == 0
    out["unknown_unregister"] = lib.cuMemHostUnregister(dst.ctypes.data)
    assert lib.cuMemHostUnregister(src.ctypes.data) == 0
    codes = []
    thread = threading.Thread(target=lambda: codes.append(lib.cuEventCreate(byref(c_void_p()), 0)))
    thread.start()
    thread.join()
    out["event_on_thread_without_context"] = codes[0]
    assert lib.cuEventDestroy_v2(event) == 0
    out["destroyed_event_query"] = lib.cuEventQuery(event)
    assert lib.cuStreamDestroy_v2(stream) == 0 and lib.cuStreamDestroy_v2(other) == 0
    out["stats"] = fake.stats()
    return out


def _scenario_cufile_selftest(libs: list[str], root: str) -> dict:
    """The stand-in cuFile's own semantics, through ctypes."""
    import ctypes as C

    class Error(C.Structure):
        _fields_ = [("err", C.c_int), ("cu_err", C.c_int)]

    class Nvfs(C.Structure):
        _fields_ = [
            ("major_version", C.c_uint), ("minor_version", C.c_uint),
            ("poll_thresh_size", C.c_size_t), ("max_direct_io_size", C.c_size_t),
            ("dstatusflags", C.c_uint), ("dcontrolflags", C.c_uint),
        ]  # fmt: skip

    class Props(C.Structure):
        _fields_ = [("nvfs", Nvfs)] + [(n, C.c_uint) for n in "abcdef"]

    class Handle(C.Union):
        _fields_ = [("fd", C.c_int), ("handle", C.c_void_p)]

    class Descr(C.Structure):
        _fields_ = [("type", C.c_int), ("handle", Handle), ("fs_ops", C.c_void_p)]

    _, hooks = _hooks(libs)
    lib = hooks.lib
    for name in ("cuFileDriverOpen", "cuFileDriverGetProperties", "cuFileHandleRegister"):
        getattr(lib, name).restype = Error
    lib.cuFileRead.restype = C.c_ssize_t
    lib.cuFileRead.argtypes = [C.c_void_p, C.c_void_p, C.c_size_t, C.c_long, C.c_long]
    props = Props()
    out: dict[str, Any] = {"props_closed": lib.cuFileDriverGetProperties(C.byref(props)).err}
    assert lib.cuFileDriverOpen().err == 0
    assert lib.cuFileDriverGetProperties(C.byref(props)).err == 0
    out["nvfs"] = [props.nvfs.major_version, props.nvfs.dstatusflags, props.nvfs.dcontrolflags]
    path = os.path.join(root, "f.bin")
    data = np.arange(10_000, dtype=np.uint32).view(np.uint8)
    data.tofile(path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    handle = C.c_void_p()
    assert lib.cuFileHandleRegister(C.byref(handle), C.byref(Descr(1, Handle(fd=fd)))).err == 0
    out["direct"] = bool(hooks.last_flags() & os.O_DIRECT)
    dst = np.zeros(5000, np.uint8)
    out["reads"] = [lib.cuFileRead(handle, dst.ctypes.data, 3000, 7, 11) for _ in range(3)]
    out["exact"] = bool(np.array_equal(dst[11:3011], data[7:3007]))
    out["at_end"] = lib.cuFileRead(handle, dst.ctypes.data, 100, data.size - 40, 0)
    out["calls"] = hooks.reads()
    return out


def test_standin_cufile_semantics(standin_libs, tmp_path):
    env = {"FAKE_CUFILE_NVFS": "1", "FAKE_CUFILE_FAIL_READ_AT": "2"}
    r = _run("cufile_selftest", standin_libs, cufile=True, env=env, root=str(tmp_path))
    assert r["props_closed"] == 5001  # not opened yet
    assert r["nvfs"] == [2, 1 << 4, 1 << 1]  # nvidia-fs 2, NVMe, compat mode allowed
    assert r["reads"] == [3000, -5, 3000]  # the second call fails with -EIO
    assert r["exact"] and r["at_end"] == 40 and r["calls"] == 4
    assert r["direct"]


def test_standin_semantics(standin_libs):
    r = _run("selftest", standin_libs)
    s = r["stats"]
    assert r["before_init"] == 3  # CUDA_ERROR_NOT_INITIALIZED
    assert r["stream_without_context"] == 201 and r["event_on_thread_without_context"] == 201
    assert r["never_recorded_query"] == 0  # never recorded: complete, as in CUDA
    assert r["overlap"] == 712 and s["register_overlaps"] == 1
    assert r["query_pending"] == 600 and r["query_done"] == 0
    assert r["dst_is_refill"] and r["onward_is_refill"]
    assert s["overwritten_sources"] == 1 and s["pageable_copies"] == 1
    assert s["copies"] == 3 and s["stream_waits"] == 1 and s["stream_syncs"] == 1
    assert s["event_syncs"] == 1
    assert r["unknown_unregister"] == 713 and s["unregister_errors"] == 1
    assert s["registered_bytes"] == 0 and s["max_registered_bytes"] == 1 << 16
    assert r["destroyed_event_query"] == 400


# ---- a. status without CUDA, and import loads nothing ------------------------------------


def _scenario_status(libs: list[str] | None = None) -> dict:
    import stoker

    loaded_by_import = _mapped("libcuda", "fake_cuda", "libcufile", "fake_cufile")
    status = stoker.cuda_status()
    return {
        "import": loaded_by_import,
        "status": status,
        "after": _mapped("fake_cuda", "fake_cufile"),
    }


STATUS_KEYS = {
    "cuda",
    "cufile",
    "mode",
    "reason",
    "libcuda",
    "libcufile",
    "driver_version",
    "cufile_version",
    "devices",
}


@pytest.mark.skipif(
    ctypes.util.find_library("cuda") is not None, reason="a real CUDA driver is installed here"
)
def test_status_without_cuda():
    r = _run("status", None)
    s = r["status"]
    assert r["import"] == []
    assert set(s) >= STATUS_KEYS
    assert (s["cuda"], s["cufile"], s["mode"]) == (False, False, "cpu")
    assert "libcuda" in s["reason"]


def test_import_loads_nothing_even_when_pointed_at_the_standin(standin_libs):
    r = _run("status", standin_libs, cufile=True)
    assert r["import"] == []  # importing stoker dlopens nothing
    assert any("fake_cuda" in line for line in r["after"])  # cuda_status() did


# ---- b. status and mode with the stand-in ------------------------------------------------


@pytest.mark.parametrize(
    "cufile, env, expect",
    [
        (False, {}, {"cuda": True, "cufile": False, "mode": "bounce"}),
        (False, {"FAKE_CUDA_INIT_FAIL": "1"}, {"cuda": False, "cufile": False, "mode": "cpu"}),
        (True, {"FAKE_CUFILE_NVFS": "1"}, {"cuda": True, "cufile": True, "mode": "gds"}),
        (True, {"FAKE_CUFILE_P2P": "1"}, {"cuda": True, "cufile": True, "mode": "gds"}),
        (True, {}, {"cuda": True, "cufile": True, "mode": "bounce"}),
        (True, {"STOKER_GDS": "on"}, {"cuda": True, "cufile": True, "mode": "compat"}),
        (True, {"STOKER_GDS": "off", "FAKE_CUFILE_NVFS": "1"}, {"cuda": True, "mode": "bounce"}),
        (True, {"FAKE_CUFILE_OPEN_FAIL": "1"}, {"cuda": True, "cufile": False, "mode": "bounce"}),
    ],
    ids=[
        "no-cufile",
        "init-fails",
        "nvfs",
        "p2p",
        "compat-auto",
        "compat-on",
        "gds-off",
        "cufile-open-fails",
    ],
)
def test_status_with_standin(standin_libs, cufile, env, expect):
    r = _run("status", standin_libs, cufile=cufile, env=env)
    s = r["status"]
    assert set(s) >= STATUS_KEYS
    assert {k: s[k] for k in expect} == expect, s
    reason = s["reason"]
    assert reason
    if env.get("FAKE_CUDA_INIT_FAIL"):
        assert "cuInit" in reason
    elif env.get("STOKER_GDS") == "off":
        assert "STOKER_GDS" in reason
    elif env.get("FAKE_CUFILE_OPEN_FAIL"):
        assert "cuFileDriverOpen" in reason
    elif not cufile:
        assert "cufile" in reason.lower()  # says why cuFile is not there
        assert s["libcuda"] == standin_libs[0]
    if s["cuda"]:
        assert s["driver_version"] == 12080 and s["devices"] == 1


# ---- c. the ordering test ------------------------------------------------------------------


def _scenario_ordering(libs: list[str], delay_us: int, rounds: int) -> dict:
    import gc

    import stoker
    from stoker import _core

    fake, _ = _hooks(libs)
    fake.set_copy_delay_us(delay_us)
    ring = _core.PinnedRing(2, 1 << 20, device=0)
    stream = _core.CopyStream(0)
    consumer = _core.CopyStream(0)
    fake.reset()
    rng = np.random.default_rng(1)
    expected, dsts, events = [], [], []
    first_pending = None
    largest = 0
    max_slots = 0
    for i in range(rounds):
        n = int(rng.choice([1, 4095, 4096, 4097, int(rng.integers(1, 1 << 18))]))
        largest = max(largest, n)
        slot = ring.acquire(n)
        view = slot[:n]
        pattern = rng.integers(0, 256, n, dtype=np.uint8)
        pattern[: min(n, 4)] = np.frombuffer(np.uint32(i).tobytes(), np.uint8)[: min(n, 4)]
        view[:] = pattern
        dst = np.zeros(n, np.uint8)
        event = stream.copy(view, dst.ctypes.data, consumer.handle)
        if first_pending is None:
            first_pending = not event.query()  # the copy is still running: no host sync
        del slot, view  # the slot may be refilled, but only after `event`
        max_slots = max(max_slots, ring.slots)
        expected.append(pattern)
        dsts.append(dst)
        events.append(event)
    for event in events:
        event.wait()
    consumer.record().wait()
    stats = fake.stats()
    wrong = [i for i, (d, e) in enumerate(zip(dsts, expected)) if not np.array_equal(d, e)]
    out = {
        "wrong": wrong,
        "stats": stats,
        "copies": rounds,
        "max_slots": max_slots,
        "largest": largest,
        "first_pending": first_pending,
        "all_done": all(e.query() for e in events),
    }

    # Bounds of the pinned ring: a request over the byte bound, and a full ring.
    errors = {}
    try:
        ring.acquire((1 << 20) + 1)
    except stoker.StokerError as e:
        errors["too_big"] = str(e)
    a, b = ring.acquire(100), ring.acquire(100)
    try:
        ring.acquire(100, timeout=0.2)
    except TimeoutError:
        errors["full"] = "TimeoutError"
    del a
    c = ring.acquire(100, timeout=5)  # a slot came back
    del b, c
    out["errors"] = errors

    # Negative controls: the checks have teeth.
    fake.reset()
    try:
        stream.copy(np.zeros(64, np.uint8), dsts[0].ctypes.data, consumer.handle)
    except stoker.StokerError as e:
        errors["pageable"] = str(e)
    plain = _core.PinnedRing()
    try:
        stream.copy(plain.acquire(64), dsts[0].ctypes.data, consumer.handle)
    except stoker.StokerError as e:
        errors["unpinned_ring"] = str(e)
    slot = ring.acquire(4096)
    slot[:] = 1
    dst = np.zeros(4096, np.uint8)
    event = stream.copy(slot, dst.ctypes.data, consumer.handle)
    slot[:] = 2  # refilled while its copy is pending: the bug the stand-in must see
    event.wait()
    out["refill"] = {"stats": fake.stats(), "dst_saw_refill": bool((dst == 2).all())}
    del slot

    del ring, plain, event
    gc.collect()
    out["final"] = fake.stats()
    return out


@pytest.mark.parametrize(
    "env",
    [{}, {"FAKE_CUDA_REGISTER_FAIL": "1"}],
    ids=["registered", "host-alloc"],  # where registration is refused: cuMemHostAlloc slots
)
def test_ring_slots_are_never_refilled_before_their_copy_event(standin_libs, env):
    r = _run("ordering", standin_libs, delay_us=25_000, rounds=50, env=env)
    s = r["stats"]
    assert r["wrong"] == []  # every destination holds its own pattern
    assert r["first_pending"] and r["all_done"]
    assert s["overwritten_sources"] == 0  # no slot refilled before its copy ran
    assert s["pageable_copies"] == 0 and s["unpinned_at_copy"] == 0
    assert s["copies"] == r["copies"]
    assert s["stream_waits"] == r["copies"]  # the consumer stream waits on every copy
    assert s["stream_syncs"] == 0  # and nothing synchronises a stream or the device
    assert r["max_slots"] <= 2
    assert s["registrations"] < r["copies"]  # slots were reused, not made afresh each time
    # Slot capacities are rounded up, by at most a quarter, to reuse slots across sizes.
    slot_bound = 2 * (r["largest"] + r["largest"] // 4 + PAGE)
    assert s["max_registered_bytes"] <= min(1 << 20, slot_bound)
    assert s["unregister_errors"] == 0 and s["register_overlaps"] == 0
    assert s["no_context_calls"] == 0


def test_ring_bounds_and_refusals(standin_libs):
    r = _run("ordering", standin_libs, delay_us=5_000, rounds=4)
    errors = r["errors"]
    assert "too_big" in errors and errors["full"] == "TimeoutError"
    assert "pageable" in errors and "unpinned_ring" in errors
    # the negative control: a refill while the copy is pending IS detected
    assert r["refill"]["stats"]["overwritten_sources"] > 0
    assert r["refill"]["dst_saw_refill"]
    final = r["final"]
    assert final["registered_bytes"] == 0  # every slot unpinned when the ring went
    assert final["unregister_errors"] == 0 and final["no_context_calls"] == 0


# ---- d. Loader(device="cuda") through the stand-in ---------------------------------------


def _npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def _write_loader_data(root: Path) -> dict[str, list[str]]:
    rng = np.random.default_rng(5)
    npy_paths = []
    for i in range(2):
        path = root / f"rows-{i}.npy"
        np.save(path, rng.standard_normal((13, 3, 5)).astype(np.float32))
        npy_paths.append(str(path))
    tar_paths = []
    for i in range(2):
        path = root / f"shard-{i}.tar"
        samples = [
            (
                f"s{i}-{j:03d}",
                {
                    "npy": _npy_bytes(rng.integers(-1000, 1000, (2, 7), dtype=np.int16)),
                    "cls": str(int(rng.integers(0, 10))).encode(),
                },
            )
            for j in range(11)
        ]
        tar_paths.append(write_tar(path, samples))
    return {"npy": npy_paths, "tar": tar_paths}


def _double(sample: dict) -> dict:
    arr = np.load(io.BytesIO(bytes(sample["npy"])))
    return {"x": arr * 2, "cls": int(bytes(sample["cls"])), "n": len(arr)}


def _collate_first(samples: list) -> dict:
    import torch

    return {
        "x": torch.from_numpy(np.stack([s["x"] for s in samples])),
        "cls": torch.tensor([s["cls"] for s in samples]),
        "names": [str(s["n"]) for s in samples],
    }


def _loader_cases(data: dict[str, list[str]]) -> list[tuple[str, list[str], dict]]:
    import stoker

    return [
        ("npy-fields", data["npy"], {"fields": {"npy": stoker.Npy()}}),
        ("tar-fields", data["tar"], {"fields": {"npy": stoker.Npy(), "cls": stoker.Int()}}),
        ("tar-map", data["tar"], {"map": _double}),
        ("tar-map-collate", data["tar"], {"map": _double, "collate": _collate_first}),
    ]


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, (bytes, bytearray, memoryview)):
        return bytes(a) == bytes(b)
    return a == b


def _scenario_context(libs: list[str]) -> dict:
    """What context is current on the calling thread before and after stoker's driver
    calls: stoker must put back what was there (torch's current device follows it)."""
    import ctypes

    from stoker import _core

    fake = ctypes.CDLL(libs[0])

    def current() -> int:
        ctx = ctypes.c_void_p()
        assert fake.cuCtxGetCurrent(ctypes.byref(ctx)) == 0
        return ctx.value or 0

    assert _core.cuda_driver_status()["available"]  # cuInit: the driver answers from here on
    before = current()
    ring = _core.PinnedRing(2, 1 << 20, device=0)
    stream = _core.CopyStream(0)
    slot = ring.acquire(4096)
    dst = np.zeros(4096, np.uint8)
    stream.copy(slot, dst.ctypes.data, stream.handle).wait()
    stream.wait_for(stream.handle)
    stream.record().query()
    del slot, ring
    return {"before": before, "after": current()}


def test_driver_calls_leave_the_callers_context_alone(standin_libs):
    r = _run("context", standin_libs)
    assert r["before"] == 0
    assert r["after"] == r["before"]


def _scenario_loader(libs: list[str], root: str) -> dict:
    import stoker
    import stoker.cuda
    from stoker import _core
    from tests.support.standin_lib import HostMemory

    fake, _ = _hooks(libs)
    data = _write_loader_data(Path(root))
    consumer = _core.CopyStream(0)
    memory = HostMemory(consumer.handle)
    stoker.cuda.use_device_memory(memory)
    out: dict[str, Any] = {"cases": {}}

    fake.set_copy_delay_us(0)
    for name, paths, kwargs in _loader_cases(data):
        ds = stoker.Dataset(paths)
        cpu = list(stoker.Loader(ds, 4, seed=7, device="cpu", **kwargs))
        before = fake.stats()["copies"]
        dev = list(stoker.Loader(ds, 4, seed=7, device="cuda", **kwargs))
        consumer.record().wait()  # every copy handed to the consumer stream has landed
        out["cases"][name] = {
            "batches": [len(cpu), len(dev)],
            "keys": [sorted(cpu[0]), sorted(dev[0])],
            "equal": [i for i, (c, d) in enumerate(zip(cpu, dev)) if not _same(c, d)],
            "copies": fake.stats()["copies"] - before,
        }

    # Slow copies and a small pinned budget: slots must wait for their events.
    fake.set_copy_delay_us(20_000)
    fake.reset()
    name, paths, kwargs = _loader_cases(data)[1]
    ds = stoker.Dataset(paths)
    pinned = 3 * PAGE
    loader = stoker.Loader(ds, 4, seed=9, device="cuda", pinned_bytes=pinned, **kwargs)
    reference = stoker.Loader(ds, 4, seed=9, device="cpu", **kwargs)
    got, want = [], []
    for epoch in range(2):
        loader.set_epoch(epoch)
        reference.set_epoch(epoch)
        got += list(loader)
        want += list(reference)
    consumer.record().wait()
    out["slow"] = {
        "stats": fake.stats(),
        "pinned_bytes": pinned,
        "batches": len(got),
        "equal": [i for i, (c, d) in enumerate(zip(want, got)) if not _same(c, d)],
    }
    out["allocations"] = len(memory.allocated)

    # A batch larger than the whole pinned budget: a clear error that names the knob.
    try:
        next(iter(stoker.Loader(ds, 4, seed=9, device="cuda", pinned_bytes=1, **kwargs)))
        out["too_big"] = "no error"
    except stoker.StokerError as e:
        out["too_big"] = str(e)
    return out


def test_loader_device_batches_equal_cpu_batches(standin_libs, tmp_path):
    r = _run("loader", standin_libs, root=str(tmp_path), timeout=90)
    assert r["allocations"] > 0  # batches went through the memory provider
    assert "raise Loader(pinned_bytes=...)" in r["too_big"]
    for name, case in r["cases"].items():
        assert case["batches"][0] == case["batches"][1] > 0, name
        assert case["keys"][0] == case["keys"][1], name
        assert case["equal"] == [], f"{name}: batches {case['equal']} differ"
        assert case["copies"] > 0, name
    slow = r["slow"]
    s = slow["stats"]
    assert slow["equal"] == [] and slow["batches"] > 0
    assert s["overwritten_sources"] == 0
    assert s["pageable_copies"] == 0 and s["unpinned_at_copy"] == 0
    assert s["stream_syncs"] == 0
    assert s["stream_waits"] >= slow["batches"]
    assert s["max_registered_bytes"] <= slow["pinned_bytes"]
    assert s["registrations"] < slow["batches"]  # slots were reused under the small budget
    assert s["no_context_calls"] == 0


def _scenario_patches(libs: list[str], root: str) -> dict:
    """PatchLoader's device path: patches read into pinned slots, one copy per batch."""
    import stoker
    import stoker.cuda
    from stoker import _core
    from tests.support.standin_lib import HostMemory

    fake, _ = _hooks(libs)
    consumer = _core.CopyStream(0)
    memory = HostMemory(consumer.handle)
    stoker.cuda.use_device_memory(memory)
    rng = np.random.default_rng(3)
    subjects = []
    for i in range(3):
        np.save(f"{root}/image{i}.npy", rng.integers(-999, 999, (20, 18, 16)).astype(np.int16))
        np.save(f"{root}/label{i}.npy", (rng.random((20, 18, 16)) > 0.7).astype(np.uint8))
        subjects.append({"image": f"{root}/image{i}.npy", "label": f"{root}/label{i}.npy"})
    volumes = stoker.Volumes(subjects, cache_dir=f"{root}/cache")
    out: dict[str, Any] = {}
    for delay, pinned in ((0, 64 << 20), (20_000, 3 * 8 * 8**3 * 3)):
        fake.set_copy_delay_us(delay)
        fake.reset()
        options = dict(sampler=stoker.LabelSampler("label"), patches_per_subject=8, seed=5)
        cpu = list(stoker.PatchLoader(volumes, 8, 8, **options))
        dev = list(stoker.PatchLoader(volumes, 8, 8, device="cuda", pinned_bytes=pinned, **options))
        consumer.record().wait()
        out[f"delay {delay}"] = {
            "batches": [len(cpu), len(dev)],
            "equal": [i for i, (c, d) in enumerate(zip(cpu, dev)) if not _same(c, d)],
            "stats": fake.stats(),
        }
    return out


def test_patch_loader_device_batches_equal_cpu_batches(standin_libs, tmp_path):
    r = _run("patches", standin_libs, root=str(tmp_path), timeout=120)
    for name, case in r.items():
        assert case["batches"][0] == case["batches"][1] == 3, name
        assert case["equal"] == [], f"{name}: batches {case['equal']} differ"
        s = case["stats"]
        assert s["copies"] >= 3 and s["overwritten_sources"] == 0, name
        assert s["pageable_copies"] == 0 and s["no_context_calls"] == 0, name


# ---- e. load_npy, read_into, GDSCache through the stand-in -------------------------------

DTYPES = ["float32", "int16", "uint8", "bool", "float64", "complex64"]
SHAPES = [(), (0,), (1,), (3, 0, 2), (7,), (5, 3), (4095,), (2, 4097), (3, 5, 7, 11)]
BIG_ITEMS = 9_000_001  # float32: 36 MB, more than two 16 MiB chunks, and an odd tail


def _write_arrays(root: Path, few: bool) -> list[str]:
    rng = np.random.default_rng(11)
    paths = []
    for dtype in DTYPES[:2] if few else DTYPES:
        for shape in SHAPES[-2:] if few else SHAPES:
            if dtype == "bool":
                a = rng.integers(0, 2, shape).astype(bool)
            elif dtype == "complex64":
                a = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
            else:
                a = (rng.standard_normal(shape) * 100).astype(dtype)
            path = root / f"{dtype}-{'x'.join(map(str, shape)) or 'scalar'}.npy"
            np.save(path, a)
            paths.append(str(path))
    if not few:
        big = root / "big.npy"
        np.save(big, rng.standard_normal(BIG_ITEMS).astype(np.float32))
        paths.append(str(big))
    return paths


def _read_cases(size: int) -> list[tuple[int, int]]:
    """(offset, size) pairs: empty, one byte, unaligned heads and tails, page-aligned,
    several chunks, and random ones."""
    rng = np.random.default_rng(3)
    cases = [
        (0, 0), (0, 1), (1, 1), (PAGE - 1, 2), (PAGE + 1, 2 * PAGE - 1), (0, PAGE),
        (PAGE, 3 * PAGE), (13, size - 13), (size - 1, 1), (size, 0), (12_345, 33 << 20),
    ]  # fmt: skip
    for _ in range(10):
        offset = int(rng.integers(0, size - 1))
        cases.append((offset, int(rng.integers(0, min(size - offset, 3 << 20)))))
    return cases


def _direct_allowed(path: str) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return False
    return True


def _read_all(paths: list[str], memory: Any, consumer: Any, few: bool) -> dict:
    """load_npy every file, and (unless `few`) read_into and GDSCache, checking each result
    against numpy once the consumer stream has seen every copy."""
    import torch

    import stoker
    import stoker.gds
    from tests.support.standin_lib import DeviceView

    out: dict[str, Any] = {"modes": set(), "wrong": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for path in paths:
            out["modes"].add(stoker.gds.read_mode(path))
            t = stoker.load_npy(path, device="cuda")
            consumer.record().wait()
            if not _same_array(t, np.load(path)):
                name = os.path.basename(path)
                out["wrong"].append(f"load_npy {name}: {t.dtype} {tuple(t.shape)}")
        if not few:
            raw = paths[-1]  # big.npy, read as raw bytes
            data = np.fromfile(raw, dtype=np.uint8)
            for offset, size in _read_cases(data.size):
                t = DeviceView(memory.empty(size, 0, consumer.handle)[0])
                got = stoker.read_into(t, raw, offset)
                consumer.record().wait()
                if not np.array_equal(t.tensor.numpy(), data[offset : offset + size]):
                    out["wrong"].append(f"read_into offset {offset} size {size}")
                if got is not t and getattr(got, "tensor", got) is not t.tensor:
                    out["wrong"].append("read_into returned another tensor")
            buffer = memory.empty(4000, 0, consumer.handle)[0]
            typed = DeviceView(memory.view(buffer, 0, 4000, torch.float32, (10, 100)))
            stoker.read_into(typed, raw, 6)
            consumer.record().wait()
            if not np.array_equal(buffer.numpy(), data[6:4006]):
                out["wrong"].append("read_into a float32 tensor")
            cache = stoker.GDSCache(os.path.join(os.path.dirname(raw), "cache"))
            volume = np.random.default_rng(8).standard_normal((17, 33, 9)).astype(np.float32)
            cache.put("vol", torch.from_numpy(volume))
            back = cache.get("vol", device="cuda")
            consumer.record().wait()
            if not _same_array(back, volume):
                out["wrong"].append("GDSCache round trip")
    out["warnings"] = [str(w.message) for w in caught]
    out["modes"] = sorted(out["modes"])
    return out


def _scenario_arrays(
    libs: list[str], root: str, nvme: bool | None, few: bool, force_after: bool
) -> dict:
    """load_npy / read_into / GDSCache.get onto "device" memory (HostMemory). `nvme`
    stands in for the answer to "is this file's disk NVMe" (None: ask the machine);
    `force_after`: then read the files again with STOKER_GDS=on."""
    import stoker
    import stoker.cuda
    import stoker.gds
    from stoker import _core
    from tests.support.standin_lib import HostMemory

    fake, fake_file = _hooks(libs)
    fake.set_copy_delay_us(0)
    if nvme is not None:  # read when GDS mode is first judged, which is after this
        os.environ["STOKER_GDS_ASSUME_NVME"] = "1" if nvme else "0"
    consumer = _core.CopyStream(0)
    memory = HostMemory(consumer.handle)
    stoker.cuda.use_device_memory(memory)
    paths = _write_arrays(Path(root), few)
    fake.reset()
    out = _read_all(paths, memory, consumer, few)
    out.update(stats=fake.stats(), cufile_reads=fake_file.reads())
    if force_after:
        os.environ["STOKER_GDS"] = "on"
        fake.reset()
        forced = _read_all(paths, memory, consumer, few)
        forced.update(stats=fake.stats(), cufile_reads=fake_file.reads() - out["cufile_reads"])
        forced["last_flags"] = fake_file.last_flags()
        out["forced"] = forced
    out["last_flags"] = fake_file.last_flags()
    out["direct_allowed"] = _direct_allowed(paths[0])
    return out


def _same_array(t: Any, a: np.ndarray) -> bool:
    got = t.numpy()
    return tuple(t.shape) == a.shape and got.dtype == a.dtype and np.array_equal(got, a)


def _check_read(r: dict, mode: str, why: str | None) -> None:
    assert r["wrong"] == []  # exact, whatever the path
    s = r["stats"]
    assert s["overwritten_sources"] == 0 and s["pageable_copies"] == 0
    assert s["unpinned_at_copy"] == 0 and s["no_context_calls"] == 0
    assert r["modes"] == [mode]
    if mode in ("gds", "compat"):
        assert r["warnings"] == []  # nothing fell back
        assert r["cufile_reads"] > 0  # cuFile read the bytes
    else:
        assert r["cufile_reads"] == 0
        assert s["copies"] > 0  # bounced through pinned slots
        assert len(r["warnings"]) == 1, r["warnings"]  # once, saying why
        assert why in r["warnings"][0]


@pytest.mark.parametrize(
    "case, cufile, env, nvme",
    [
        ("bounce", False, {}, None),  # no cuFile at all
        ("gds", True, {"FAKE_CUFILE_NVFS": "1"}, True),  # nvidia-fs, and an NVMe disk
        ("not-nvme", True, {"FAKE_CUFILE_NVFS": "1"}, False),  # a disk GDS cannot read
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_arrays_exact_through_standin(standin_libs, tmp_path, case, cufile, env, nvme):
    few = case == "not-nvme"
    r = _run(
        "arrays", standin_libs, cufile=cufile, env=env, root=str(tmp_path), nvme=nvme,
        few=few, force_after=few, timeout=120,
    )  # fmt: skip
    if case == "bounce":
        _check_read(r, "bounce", why="cuFile")
    elif case == "gds":
        _check_read(r, "gds", why=None)
    else:
        _check_read(r, "bounce", why="NVMe")
        # STOKER_GDS=on: cuFile reads the file anyway, in its compatibility mode
        _check_read(r["forced"], "compat", why=None)
    registered = r["cufile_reads"] or r.get("forced", {}).get("cufile_reads")
    if registered and r["direct_allowed"]:  # O_DIRECT where the file system allows it
        assert r["last_flags"] & os.O_DIRECT


def _scenario_failed_read(libs: list[str], root: str) -> dict:
    import stoker
    import stoker.cuda
    import stoker.gds
    from stoker import _core
    from tests.support.standin_lib import HostMemory

    fake, fake_file = _hooks(libs)
    fake.set_copy_delay_us(0)
    os.environ["STOKER_GDS_ASSUME_NVME"] = "1"  # the file's disk counts as NVMe
    consumer = _core.CopyStream(0)
    stoker.cuda.use_device_memory(HostMemory(consumer.handle))
    rng = np.random.default_rng(12)
    arrays = {
        "big": rng.standard_normal(BIG_ITEMS).astype(np.float32),  # more than two chunks
        "small": np.arange(1000, dtype=np.int16),
        "tiny": np.array(3.5),
    }
    for name, a in arrays.items():
        np.save(Path(root) / f"{name}.npy", a)
    out: dict[str, Any] = {"mode": stoker.gds.read_mode(str(Path(root) / "big.npy"))}

    # STOKER_GDS=on asks for cuFile and nothing else: a failed read is an error then.
    os.environ["STOKER_GDS"] = "on"
    fake_file.fail_read_at(fake_file.reads() + 1)
    try:
        stoker.load_npy(str(Path(root) / "big.npy"), device="cuda")
        out["forced"] = "no error"
    except stoker.StokerError as e:
        out["forced"] = f"{type(e).__name__}: {e}"
    del os.environ["STOKER_GDS"]

    # auto: the second cuFile read from here on fails, and stoker falls back, exactly
    fake_file.fail_read_at(fake_file.reads() + 2)
    before = fake_file.reads()
    wrong = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, a in arrays.items():
            t = stoker.load_npy(str(Path(root) / f"{name}.npy"), device="cuda")
            consumer.record().wait()
            if not _same_array(t, a):
                wrong.append(name)
    out.update(
        wrong=wrong,
        warnings=[f"{w.category.__name__}: {w.message}" for w in caught],
        reads=fake_file.reads() - before,
        stats=fake.stats(),
    )
    return out


def test_failed_cufile_read_falls_back_with_one_warning(standin_libs, tmp_path):
    r = _run(
        "failed_read", standin_libs, cufile=True, root=str(tmp_path), timeout=90,
        env={"FAKE_CUFILE_NVFS": "1"},
    )  # fmt: skip
    assert r["mode"] == "gds"
    assert r["forced"].startswith("CuFileError") and "big.npy" in r["forced"]
    assert r["reads"] >= 2  # the failure was injected
    assert r["wrong"] == []  # the result is still exact
    assert len(r["warnings"]) == 1, r["warnings"]
    assert "cufile" in r["warnings"][0].lower()  # says why it fell back
    assert r["stats"]["overwritten_sources"] == 0


# ---- f. fork safety ----------------------------------------------------------------------


def _scenario_fork(libs: list[str], root: str) -> dict:
    import stoker
    from stoker import _core

    path = os.path.join(root, "a.npy")
    np.save(path, np.arange(10))
    # The parent has initialised the driver, and its stream stays alive, idle, over the
    # fork: the stand-in runs a thread per stream, and a thread starting or ending while
    # the process forks can hold the ASan allocator's lock (gcc 12's libasan takes no
    # lock at fork), which deadlocks the child's first malloc.
    stream = _core.CopyStream(0)
    stream.record().wait()
    parent_status = stoker.cuda_status()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        result: dict[str, Any] = {}
        try:
            try:
                _core.CopyStream(0)
                result["copy_stream"] = "no error"
            except stoker.StokerError as e:
                result["copy_stream"] = str(e)
                result["cuda_error"] = isinstance(e, _core.CudaError)
            try:
                stoker.load_npy(path, device="cuda")
                result["load_cuda"] = "no error"
            except stoker.StokerError as e:
                result["load_cuda"] = str(e)
            result["status"] = stoker.cuda_status()
            result["cpu_ok"] = bool(
                np.array_equal(stoker.load_npy(path, device="cpu").numpy(), np.arange(10))
            )
        except BaseException as e:  # report, never fall into the parent's code
            result["crash"] = repr(e)
        finally:
            os.write(write_end, json.dumps(result).encode())
            os._exit(0)
    os.close(write_end)
    # (the child imports torch: 15 s under ASan on 2 busy cores)
    ready, _, _ = select.select([read_end], [], [], 60)
    if not ready:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        return {"hang": True}
    chunks = []
    while chunk := os.read(read_end, 65536):
        chunks.append(chunk)
    os.waitpid(pid, 0)
    del stream
    return {"hang": False, "parent": parent_status, "child": json.loads(b"".join(chunks))}


def test_forked_child_gets_a_clear_error(standin_libs, tmp_path):
    r = _run("fork", standin_libs, root=str(tmp_path), timeout=120)
    assert not r["hang"]
    child = r["child"]
    assert "crash" not in child, child
    assert child["cuda_error"] and "fork" in child["copy_stream"]
    assert "fork" in child["load_cuda"]
    assert child["cpu_ok"]
    assert r["parent"]["cuda"] is True
    assert child["status"]["cuda"] is False and "fork" in child["status"]["reason"]


def test_device_stage_keeps_the_batch_structure():
    """The structure around the tensors survives the trip (no device needed to check it)."""
    import collections

    import torch

    from stoker.cuda import _rebuild

    Pair = collections.namedtuple("Pair", "x y")
    t = torch.arange(3)
    batch = collections.OrderedDict(a=t, b=[t, "k"], c=(t,), d=Pair(t, 1))
    out = _rebuild(batch, torch, {id(t): "moved"})
    assert type(out) is collections.OrderedDict
    assert out == collections.OrderedDict(
        a="moved", b=["moved", "k"], c=("moved",), d=Pair("moved", 1)
    )
