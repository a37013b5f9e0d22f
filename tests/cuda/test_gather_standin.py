"""The cuFile gather (``_core.gather_to_device``, ``stoker.volumes.device_reads``) driven
through the host-memory stand-in for the CUDA driver and cuFile.

The stand-in's "device memory" is host memory, its cuFileRead a pread, its copies run late
on a stream worker thread, and it hashes every copy's source when the copy is queued and
again when it runs. So these tests check ORDERING AND LOGIC ONLY: the spans and the scratch
rounds, the 1-D and 2-D copies and where they land, that the scratch is never refilled
before the copies out of it have run, that the consumer's stream waits, the errors. They say
nothing about real GPUs or GPUDirect Storage; passing them is not GPU verification (that is
tests/gpu/test_patches_gpu.py and scripts/gpu_check.sh, on a machine with a GPU).

Each scenario runs in a fresh interpreter, since the driver is loaded once per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support import REPO, child_preamble

MARK = "GATHER-RESULT "
NO_CUFILE = "/nonexistent/stoker-standin/libcufile.so.0"
HEADER = 128  # np.save's header for these arrays


def _run(
    scenario: str,
    libs: tuple[str, str],
    *,
    cufile: bool = True,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> dict:
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("STOKER_", "FAKE_CUDA", "FAKE_CUFILE"))
    }
    environ["STOKER_LIBCUDA"] = libs[0]
    environ["STOKER_LIBCUFILE"] = libs[1] if cufile else NO_CUFILE
    environ.update(env or {})
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, environ.get("PYTHONPATH")]))
    kwargs["libs"] = list(libs)
    code = (
        child_preamble(__name__) + f"m._child({scenario!r}, json.loads({json.dumps(kwargs)!r}))\n"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"scenario {scenario} hung; stderr:\n{e.stderr}")
    if done.returncode != 0:
        pytest.fail(f"scenario {scenario} failed (exit {done.returncode}):\n{done.stderr[-8000:]}")
    for line in done.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    pytest.fail(f"scenario {scenario} reported nothing:\n{done.stdout}\n{done.stderr}")


def _child(scenario: str, kwargs: dict) -> None:
    result = globals()[f"_scenario_{scenario}"](**kwargs)
    print(MARK + json.dumps(result), flush=True)


# ---- what the scenarios share ---------------------------------------------------------------


def _setup(libs: list[str]) -> tuple[Any, Any, Any, Any]:
    """The stand-in's hooks, a consumer stream, and host memory posing as the device's."""
    import stoker.cuda
    from stoker import _core
    from tests.support.standin_lib import FakeCuda, FakeCuFile, HostMemory

    fake, fake_file = FakeCuda(libs[0]), FakeCuFile(libs[1])
    consumer = _core.CopyStream(0)
    memory = HostMemory(consumer.handle)
    stoker.cuda.use_device_memory(memory)
    return fake, fake_file, consumer, memory


def _volumes(root: str, count: int, shape: tuple[int, int, int], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = []
    for i in range(count):
        a = rng.integers(-30000, 30000, size=shape, dtype=np.int16)
        np.save(os.path.join(root, f"v{i}.npy"), a)
        arrays.append(a)
    return arrays


def _patch_runs(
    shape: tuple[int, int, int], start: tuple[int, int, int], size: tuple[int, int, int], at: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A patch's runs (one per row of each slice) of a C-order int16 .npy volume, as
    boxes.patch_runs gives them: file offsets, lengths, destination offsets."""
    (z0, y0, x0), (pz, py, px) = start, size
    z, y = np.meshgrid(np.arange(pz), np.arange(py), indexing="ij")
    offsets = HEADER + (((z0 + z) * shape[1] + (y0 + y)) * shape[2] + x0) * 2
    dests = at + (z * py + y) * px * 2
    return offsets.reshape(-1), np.full(offsets.size, px * 2), dests.reshape(-1)


def _random_runs(
    rng: np.random.Generator, sizes: list[int], count: int, longest: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """Runs of random files, offsets and lengths, packed in a random order into a
    destination with random gaps between them: (ids, offsets, lengths, dests, dest size)."""
    ids = rng.integers(0, len(sizes), count)
    lengths = rng.integers(1, longest + 1, count)
    offsets = np.array(
        [rng.integers(0, sizes[i] - n + 1) for i, n in zip(ids.tolist(), lengths.tolist())]
    )
    order = rng.permutation(count)
    gaps = rng.integers(0, 3, count) * rng.integers(1, 300, count)
    dests = np.empty(count, np.int64)
    at = 0
    for k in order.tolist():
        at += int(gaps[k])
        dests[k] = at
        at += int(lengths[k])
    return ids, offsets, lengths, dests, at + 17


def _expected(files: list[bytes], dest_size: int, ids, offsets, lengths, dests) -> np.ndarray:
    out = np.full(dest_size, 0xAB, np.uint8)
    for i, o, n, d in zip(ids.tolist(), offsets.tolist(), lengths.tolist(), dests.tolist()):
        out[d : d + n] = np.frombuffer(files[i], np.uint8, n, o)
    return out


# ---- scenarios ------------------------------------------------------------------------------


def _scenario_exact(libs: list[str], root: str) -> dict:
    """Random runs and patches' runs, through scratch of many sizes and alignments, with
    copies that run late: every byte lands where it should, and no copy's source in the
    scratch changed before the copy ran."""
    import torch

    from stoker.volumes.device_reads import DevicePatchReader
    from tests.support.standin_lib import DeviceView

    fake, _, consumer, _ = _setup(libs)
    fake.set_copy_delay_us(300)
    # Slices of 16 KiB: a patch's slices are more than the merge gap apart, a span each.
    shape = (20, 64, 128)
    arrays = _volumes(root, 3, shape, seed=1)
    paths = [os.path.join(root, f"v{i}.npy") for i in range(3)]
    files = [Path(p).read_bytes() for p in paths]
    rng = np.random.default_rng(5)
    cases: list[tuple[str, dict, Any]] = []
    for scratch, align, gap in [
        (1 << 20, 4096, 8192),
        (20_000, 4096, 8192),
        (20_000, 1, 8192),
        (777, 1, 8192),
        (5000, 1, 0),
        (1 << 20, 1, 1 << 20),
    ]:
        options = dict(scratch_bytes=scratch, align=align, merge_gap=gap)
        cases.append(
            (f"random {options}", options, _random_runs(rng, [len(f) for f in files], 300, 3000))
        )
    out: dict[str, Any] = {"wrong": [], "stats": {}}
    for name, options, (ids, offsets, lengths, dests, size) in cases:
        fake.reset()
        with DevicePatchReader(0, paths, **options) as reader:
            host = torch.full((size,), 0xAB, dtype=torch.uint8)
            stats = reader.read(DeviceView(host), ids, offsets, lengths, dests)
            consumer.record().wait()  # the consumer's stream was made to wait for the copies
            want = _expected(files, size, ids, offsets, lengths, dests)
            if not np.array_equal(host.numpy(), want):
                out["wrong"].append(name)
        out["stats"][name] = {"gathers": [stats], "fake": fake.stats()}

    # Patches: one file each, or several of one file in disjoint slabs; the batch's bytes
    # must equal numpy's slices, and each patch goes in one 2-D copy whatever the alignment.
    size = (8, 16, 32)
    starts = [(0, (0, 0, 0)), (1, (3, 7, 21)), (2, (12, 48, 96)), (1, (12, 2, 5))]
    per = int(np.prod(size)) * 2
    ids, offsets, lengths, dests = [], [], [], []
    for k, (f, start) in enumerate(starts):
        o, n, d = _patch_runs(shape, start, size, k * per)
        ids.append(np.full(o.size, f)), offsets.append(o), lengths.append(n), dests.append(d)
    runs = [np.concatenate(p) for p in (ids, offsets, lengths, dests)]
    want = np.concatenate(
        [
            arrays[f][s[0] : s[0] + size[0], s[1] : s[1] + size[1], s[2] : s[2] + size[2]]
            .reshape(-1)
            .view(np.uint8)
            for f, s in starts
        ]
    )
    for align in (1, 4096):
        name = f"patches align={align}"
        fake.reset()
        with DevicePatchReader(0, paths, align=align) as reader:
            host = torch.zeros(len(starts) * per, dtype=torch.uint8)
            stats = reader.read(DeviceView(host), *runs)
            consumer.record().wait()
            if not np.array_equal(host.numpy(), want):
                out["wrong"].append(name)
        out["stats"][name] = {"gathers": [stats], "fake": fake.stats(), "patches": len(starts)}

    # Two patches of one file overlapping in z: in file order their rows interleave, in
    # the destination's they do not, and the copies follow the destination.
    overlap = [(0, (2, 4, 8)), (0, (5, 10, 40))]
    parts = [_patch_runs(shape, start, size, k * per) for k, (_, start) in enumerate(overlap)]
    o, n, d = (np.concatenate(p) for p in zip(*parts))
    want2 = np.concatenate(
        [
            arrays[0][s[0] : s[0] + size[0], s[1] : s[1] + size[1], s[2] : s[2] + size[2]]
            .reshape(-1)
            .view(np.uint8)
            for _, s in overlap
        ]
    )
    fake.reset()
    with DevicePatchReader(0, paths) as reader:
        host = torch.zeros(2 * per, dtype=torch.uint8)
        stats = reader.read(DeviceView(host), np.zeros(o.size, np.int64), o, n, d)
        consumer.record().wait()
        if not np.array_equal(host.numpy(), want2):
            out["wrong"].append("overlapping patches")
    out["stats"]["overlapping patches"] = {"gathers": [stats], "fake": fake.stats()}

    # Patches through a scratch that holds only a few slices: many rounds, each reusing
    # the scratch only after its copies have run.
    fake.reset()
    with DevicePatchReader(0, paths, scratch_bytes=8000) as reader:
        host = torch.zeros(len(starts) * per, dtype=torch.uint8)
        stats = reader.read(DeviceView(host), *runs)
        stats2 = reader.read(DeviceView(host), *runs)  # the scratch again, waiting for the last
        consumer.record().wait()
        if not np.array_equal(host.numpy(), want):
            out["wrong"].append("patches, small scratch")
    out["stats"]["patches, small scratch"] = {"gathers": [stats, stats2], "fake": fake.stats()}
    return out


def _scenario_refused_2d(libs: list[str], root: str) -> dict:
    """A driver that refuses the 2-D copies: the rows go one by one, and still land."""
    import torch

    from stoker.volumes.device_reads import DevicePatchReader
    from tests.support.standin_lib import DeviceView

    fake, _, consumer, _ = _setup(libs)
    shape = (6, 10, 40)
    arrays = _volumes(root, 1, shape, seed=2)
    o, n, d = _patch_runs(shape, (1, 2, 3), (4, 5, 6), 0)
    with DevicePatchReader(0, [os.path.join(root, "v0.npy")]) as reader:
        host = torch.zeros(4 * 5 * 6 * 2, dtype=torch.uint8)
        stats = reader.read(DeviceView(host), np.zeros(o.size, np.int64), o, n, d)
        consumer.record().wait()
    want = arrays[0][1:5, 2:7, 3:9].reshape(-1).view(np.uint8)
    return {"exact": bool(np.array_equal(host.numpy(), want)), "stats": stats, "runs": o.size}


def _scenario_errors(libs: list[str], root: str) -> dict:
    import torch

    import stoker
    from stoker import _core
    from stoker.volumes.device_reads import DevicePatchReader
    from tests.support.standin_lib import DeviceView

    fake, fake_file, consumer, _ = _setup(libs)
    _volumes(root, 2, (4, 8, 64), seed=3)
    paths = [os.path.join(root, f"v{i}.npy") for i in range(2)]
    size = os.path.getsize(paths[1])
    out: dict[str, Any] = {}
    host = DeviceView(torch.zeros(4096, dtype=torch.uint8))

    def attempt(key: str, reader: Any, *runs: Any) -> None:
        before = fake_file.reads()
        try:
            reader.read(host, *[np.asarray(r) for r in runs])
            out[key] = None
        except stoker.StokerError as e:
            out[key] = {
                "type": type(e).__name__,
                "message": str(e),
                "path": getattr(e, "path", None),
                "offset": getattr(e, "offset", None),
                "reads": fake_file.reads() - before,
            }

    reader = DevicePatchReader(0, paths)
    out["available_before"] = reader.available()
    attempt("outside", reader, [0, 1], [200, 300], [100, 100], [0, 4000])
    attempt("bad_id", reader, [2], [0], [10], [0])
    attempt("past_end", reader, [1], [size - 50], [100], [0])
    # The second cuFileRead of the next read fails with EIO: runs of two files, far apart.
    reader2 = DevicePatchReader(0, paths, threads=1)
    attempt("warm", reader2, [0], [HEADER], [16], [0])
    fake_file.fail_read_at(fake_file.reads() + 2)
    attempt("eio", reader2, [0, 1], [HEADER, HEADER], [64, 64], [0, 64])
    out["available_after"] = reader2.available()
    out["reason_after"] = reader2.reason
    fake_file.fail_read_at(0)
    handle = _core.CuFile(paths[0], 0)
    try:
        _core.gather_to_device(
            [handle, None], 0, host.data_ptr(), 4096, host.data_ptr(), 4096,
            np.array([1], np.uint32), np.array([0], np.uint64), np.array([8], np.uint64),
            np.array([0], np.uint64), consumer.handle,
        )  # fmt: skip
        out["unopened"] = None
    except stoker.StokerError as e:
        out["unopened"] = str(e)
    out["changed_device_sources"] = fake.stats()["changed_device_sources"]
    return out


def _scenario_status(libs: list[str], root: str) -> dict:
    from stoker.volumes.device_reads import DevicePatchReader

    _setup(libs)
    path = os.path.join(root, "v.npy")
    np.save(path, np.zeros((4, 4), np.int16))
    reader = DevicePatchReader(0, [path])
    return {"available": reader.available(), "reason": reader.reason}


def _scenario_fork(libs: list[str], root: str) -> dict:
    """A forked child neither uses nor releases the parent's handles and scratch; the parent
    reads on afterwards."""
    import pickle

    import torch

    from stoker.volumes.device_reads import DevicePatchReader
    from tests.support.standin_lib import DeviceView

    _, _, consumer, _ = _setup(libs)
    arrays = _volumes(root, 1, (4, 8, 64), seed=4)
    want = arrays[0][1].reshape(-1).view(np.uint8)
    reader = DevicePatchReader(0, [os.path.join(root, "v0.npy")], scratch_bytes=1 << 16)
    runs = (np.array([0]), np.array([HEADER + 8 * 64 * 2]), np.array([8 * 64 * 2]), np.array([0]))

    def read() -> bool:
        host = torch.zeros(8 * 64 * 2, dtype=torch.uint8)
        reader.read(DeviceView(host), *runs)
        consumer.record().wait()
        return bool(np.array_equal(host.numpy(), want))

    out: dict[str, Any] = {"before": read()}
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running any teardown
        child: dict[str, Any] = {"available": reader.available(), "reason": reader.reason}
        try:
            reader.read(DeviceView(torch.zeros(1024, dtype=torch.uint8)), *runs)
            child["read"] = "no error"
        except Exception as e:
            child["read"] = f"{type(e).__name__}: {e}"
        reader.close()
        os.write(w, json.dumps(child).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out["child"] = json.loads(f.read())
    os.waitpid(pid, 0)
    out["after"] = read()
    copy = pickle.loads(pickle.dumps(reader))
    out["pickled"] = [copy.device, copy.paths == reader.paths, copy.scratch_bytes]
    reader.close()
    return out


def _scenario_patch_loader(libs: list[str], root: str) -> dict:
    """PatchLoader(device="cuda", gds=True): batches read by cuFile into "device" memory
    equal the CPU loader's, and the batches with a padded patch go through pinned memory."""
    import torch

    import stoker
    import stoker.cuda
    from tests.support.standin_lib import DeviceView, HostMemory

    fake, fake_file, consumer, _ = _setup(libs)

    class DeviceHostMemory(HostMemory):
        """Host buffers that say they are on cuda:0, as the reader checks."""

        def empty(self, nbytes: int, device: int, stream: int) -> tuple[Any, int]:
            buffer, address = super().empty(nbytes, device, stream)
            return DeviceView(buffer), address

        def view(self, buffer: Any, offset: int, nbytes: int, dtype: Any, shape: Any) -> Any:
            return super().view(buffer.tensor, offset, nbytes, dtype, shape)

    stoker.cuda.use_device_memory(DeviceHostMemory(consumer.handle))
    rng = np.random.default_rng(8)
    subjects = []
    for i in range(3):
        # .npy, not .nii: a .nii's patches are permuted by torch after the copy, and torch's
        # CPU ops on the stand-in's host "device" memory do not wait for its late copies.
        np.save(f"{root}/image{i}.npy", rng.integers(-999, 999, (20, 18, 16)).astype(np.int16))
        np.save(f"{root}/label{i}.npy", (rng.random((20, 18, 16)) > 0.7).astype(np.uint8))
        subjects.append({"image": f"{root}/image{i}.npy", "label": f"{root}/label{i}.npy"})
    volumes = stoker.Volumes(subjects)
    out: dict[str, Any] = {}
    for name, size in (("inside", 8), ("padded", 18)):
        options = dict(patches_per_subject=6, seed=2, sampler=stoker.GridSampler(overlap=2))
        cpu = list(stoker.PatchLoader(volumes, size, 4, **options))
        loader = stoker.PatchLoader(volumes, size, 4, device="cuda", gds=True, **options)
        before = fake_file.reads()
        dev = list(loader)
        consumer.record().wait()
        same = [
            i
            for i, (c, d) in enumerate(zip(cpu, dev))
            if not all(torch.equal(c[k], d[k].cpu()) for k in ("image", "label", "location"))
        ]
        out[name] = {
            "batches": [len(cpu), len(dev)],
            "differ": same,
            "cufile_reads": fake_file.reads() - before,
            "fake": fake.stats(),
        }
    return out


# ---- tests ----------------------------------------------------------------------------------


def test_runs_land_byte_exact(standin_libs, tmp_path):
    r = _run("exact", standin_libs, env={"STOKER_GDS": "on"}, root=str(tmp_path))
    assert r["wrong"] == []
    for name, s in r["stats"].items():
        gathers, fake = s["gathers"], s["fake"]
        # the scratch was never refilled while a copy out of it was pending
        assert fake["changed_device_sources"] == 0, name
        assert fake["no_context_calls"] == 0 and fake["pageable_copies"] == 0, name
        assert fake["copies"] == sum(g["copies"] + g["copies_2d"] for g in gathers), name
        # a full scratch is reused only after synchronising the stream: once a round
        assert fake["stream_syncs"] == sum(g["rounds"] - 1 for g in gathers), name
    stats = {name: s["gathers"][0] for name, s in r["stats"].items()}
    tiny = stats["random {'scratch_bytes': 777, 'align': 1, 'merge_gap': 8192}"]
    assert tiny["rounds"] > 100  # runs of up to 3000 bytes split across a 777-byte scratch
    no_gap = stats["random {'scratch_bytes': 5000, 'align': 1, 'merge_gap': 0}"]
    merged = stats["random {'scratch_bytes': 1048576, 'align': 1, 'merge_gap': 1048576}"]
    assert merged["spans"] < no_gap["spans"]  # runs a gap apart: one span
    for align in (1, 4096):
        s = stats[f"patches align={align}"]
        # 8 slices of 16 rows per patch: 128 runs, 8 spans, one 2-D copy; the first two
        # patches (next to each other in the batch, the first file's last and the second
        # file's first in file order) even share one
        assert s["copies_2d"] == 3 and s["copies"] == 0
        assert s["spans"] == 8 * 4 and s["rounds"] == 1
    overlapping = stats["overlapping patches"]
    assert overlapping["copies"] == 0 and overlapping["copies_2d"] <= 2 * 8
    small = r["stats"]["patches, small scratch"]["gathers"]
    assert small[0]["rounds"] > 8 and small[1]["rounds"] == small[0]["rounds"]


def test_refused_2d_copies_go_row_by_row(standin_libs, tmp_path):
    r = _run(
        "refused_2d",
        standin_libs,
        env={"STOKER_GDS": "on", "FAKE_CUDA_REFUSE_2D": "1"},
        root=str(tmp_path),
    )
    assert r["exact"]
    assert r["stats"]["copies_2d"] == 0 and r["stats"]["copies"] == r["runs"]


def test_errors_name_the_file(standin_libs, tmp_path):
    r = _run("errors", standin_libs, root=str(tmp_path))
    v0, v1 = (str(tmp_path / f"v{i}.npy") for i in range(2))
    outside = r["outside"]
    assert outside["type"] == "StokerError" and "outside its 4096" in outside["message"]
    assert outside["reads"] == 0  # checked before anything was read
    assert r["bad_id"]["type"] == "UsageError"
    past = r["past_end"]
    assert past["type"] == "CuFileError" and past["path"] == v1 and "ends before" in past["message"]
    assert r["warm"] is None
    eio = r["eio"]
    assert eio["type"] == "CuFileError" and eio["path"] == v1  # one thread: v0's span first
    # v1's span is read from its first run on, unaligned: its bytes then go on from v0's in
    # the scratch and in the destination, so one copy takes both
    assert eio["offset"] == HEADER and eio["path"] in eio["message"]
    # a cuFile failure rules cuFile out (STOKER_GDS is not "on")
    assert r["available_after"] is False and "cuFile failed" in r["reason_after"]
    assert "is not open" in r["unopened"]


@pytest.mark.parametrize(
    ("env", "cufile", "available", "words"),
    [
        ({"STOKER_GDS": "on"}, True, True, "STOKER_GDS=on"),
        ({"STOKER_GDS": "off"}, True, False, "STOKER_GDS=off"),
        ({}, False, False, "cannot load cuFile"),
        ({}, True, False, "compatibility mode"),  # no nvidia-fs: cuFile would only bounce
    ],
)
def test_available_says_why(standin_libs, tmp_path, env, cufile, available, words):
    r = _run("status", standin_libs, cufile=cufile, env=env, root=str(tmp_path))
    assert r["available"] is available
    assert words in r["reason"]


def test_forked_child_leaves_the_parents_handles(standin_libs, tmp_path):
    r = _run("fork", standin_libs, env={"STOKER_GDS": "on"}, root=str(tmp_path))
    assert r["before"] and r["after"]
    child = r["child"]
    assert child["available"] is False and "forked" in child["reason"]
    assert child["read"].startswith("CudaError") and "fork" in child["read"]
    assert r["pickled"] == [0, True, 1 << 16]


@pytest.mark.parametrize(
    ("nvme", "available", "words"), [("1", True, "GPUDirect Storage"), ("0", False, "NVMe only")]
)
def test_available_with_gpudirect(standin_libs, tmp_path, nvme, available, words):
    from stoker.cufile import _mount_of

    fstype = _mount_of(str(tmp_path))[0]
    if fstype not in ("ext4", "xfs"):
        pytest.skip(f"{tmp_path} is on {fstype}, which GPUDirect never reads")
    env = {"FAKE_CUFILE_NVFS": "1", "STOKER_GDS_ASSUME_NVME": nvme}
    r = _run("status", standin_libs, env=env, root=str(tmp_path))
    assert r["available"] is available
    assert words in r["reason"]


def test_patch_loader_reads_through_cufile(standin_libs, tmp_path):
    r = _run("patch_loader", standin_libs, env={"STOKER_GDS": "on"}, root=str(tmp_path))
    inside, padded = r["inside"], r["padded"]
    assert inside["batches"][0] == inside["batches"][1] > 0 and inside["differ"] == []
    assert inside["cufile_reads"] > 0  # every batch by cuFile
    assert padded["batches"][0] == padded["batches"][1] > 0 and padded["differ"] == []
    assert padded["cufile_reads"] == 0  # the volume is smaller than the patch: pinned path
    assert inside["fake"]["changed_device_sources"] == 0
