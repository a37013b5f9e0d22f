"""The host-memory stand-in for the CUDA driver and cuFile (tests/standin/*.c): building
it, reading its counters, and a DeviceMemory provider on host memory.

The stand-in checks stoker's ordering and logic on machines without a GPU (copies that
finish late on worker threads, events that fire late, refills caught by hashing the
source). It says nothing about real GPUs: results obtained with it are never GPU
verification.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent.parent
SOURCES = {"cuda": TESTS / "standin" / "fake_cuda.c", "cufile": TESTS / "standin" / "fake_cufile.c"}
FLAGS = ["-shared", "-fPIC", "-O1", "-pthread"]

#: A folder holding the stand-in built beforehand (``python -m tests.support.standin_lib
#: DIR``), for test runs that have no compiler: .ci/run builds it there before the tests.
PREBUILT_ENV = "STOKER_TEST_STANDIN_DIR"

_built: dict[str, tuple[str, str]] = {}


class StandinUnavailable(Exception):
    """The stand-in cannot be built here (no C compiler, or it failed)."""


def _compiler() -> list[str]:
    if os.environ.get("CC"):
        cc = shlex.split(os.environ["CC"])
        if cc and shutil.which(cc[0]):
            return cc
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return [name]
    raise StandinUnavailable("no C compiler (cc, gcc, clang or $CC) to build the CUDA stand-in")


def find_or_build_standin(tmp_dir: str | os.PathLike[str]) -> tuple[str, str]:
    """The stand-in's (libcuda, libcufile): the prebuilt ones ``$STOKER_TEST_STANDIN_DIR``
    holds, else built into `tmp_dir`."""
    prebuilt = os.environ.get(PREBUILT_ENV)
    if prebuilt:
        libs = tuple(os.path.join(prebuilt, f"libfake_{name}.so") for name in SOURCES)
        missing = [lib for lib in libs if not os.path.isfile(lib)]
        if missing:
            raise StandinUnavailable(f"${PREBUILT_ENV} lacks {missing}")
        return libs[0], libs[1]
    return build_standin(tmp_dir)


def build_standin(tmp_dir: str | os.PathLike[str]) -> tuple[str, str]:
    """Compiles the stand-in libcuda and libcufile into `tmp_dir` (once per process) and
    returns their paths (libcuda, libcufile)."""
    key = os.fspath(tmp_dir)
    if key in _built:
        return _built[key]
    cc = _compiler()
    out = {}
    for name, source in SOURCES.items():
        target = os.path.join(key, f"libfake_{name}.so")
        cmd = [*cc, *FLAGS, "-o", target, str(source)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise StandinUnavailable(
                f"building {source.name} failed: {shlex.join(cmd)}\n{done.stderr}"
            )
        out[name] = target
    _built[key] = (out["cuda"], out["cufile"])
    return _built[key]


STAT_FIELDS = (
    "copies",
    "bytes_copied",
    "overwritten_sources",
    "pageable_copies",
    "registered_bytes",
    "max_registered_bytes",
    "stream_waits",
    "event_syncs",
    "stream_syncs",
    "unregister_errors",
    "register_overlaps",
    "registrations",
    "no_context_calls",
    "unpinned_at_copy",
    "copies_2d",
    "changed_device_sources",
)


class _Stats(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in STAT_FIELDS]


class FakeCuda:
    """The stand-in driver's test hooks. Loading it by the same path stoker loads it
    (STOKER_LIBCUDA) gives the same library, so these counters are the ones stoker moves."""

    def __init__(self, path: str) -> None:
        self.lib = ctypes.CDLL(path)
        self.lib.fake_cuda_set_copy_delay_us.argtypes = [ctypes.c_uint]
        self.lib.fake_cuda_stats.argtypes = [ctypes.POINTER(_Stats)]

    def stats(self) -> dict[str, int]:
        s = _Stats()
        self.lib.fake_cuda_stats(ctypes.byref(s))
        return {name: int(getattr(s, name)) for name in STAT_FIELDS}

    def reset(self) -> None:
        self.lib.fake_cuda_reset()

    def set_copy_delay_us(self, us: int) -> None:
        self.lib.fake_cuda_set_copy_delay_us(us)


class FakeCuFile:
    """The stand-in cuFile's test hooks."""

    def __init__(self, path: str) -> None:
        self.lib = ctypes.CDLL(path)
        self.lib.fake_cufile_reads.restype = ctypes.c_uint64
        self.lib.fake_cufile_last_flags.restype = ctypes.c_int
        self.lib.fake_cufile_fail_read_at.argtypes = [ctypes.c_uint64]

    def reads(self) -> int:
        return int(self.lib.fake_cufile_reads())

    def last_flags(self) -> int:
        return int(self.lib.fake_cufile_last_flags())

    def fail_read_at(self, n: int) -> None:
        """Make the n-th cuFileRead call of the process fail with -EIO (0: none)."""
        self.lib.fake_cufile_fail_read_at(n)


class HostMemory:
    """stoker.cuda.DeviceMemory on host memory, for the stand-in: "device" buffers are
    CPU tensors whose addresses the stand-in's copies write to.

    `consumer_stream` is the stream stoker should make wait for its copies (a stand-in
    CUstream handle); recording an event on it and waiting for that event is how a test
    knows every copy handed to it has landed. Buffers handed over are kept alive, as
    torch's record_stream keeps device memory from being reused before the stream's work
    is done."""

    def __init__(self, consumer_stream: int = 0) -> None:
        self.stream = consumer_stream
        self.allocated: list[int] = []  # sizes asked for
        self.kept: list[Any] = []

    def check(self, device: int) -> None:
        """Every device index the stand-in reports (one) is usable."""

    def empty(self, nbytes: int, device: int, stream: int) -> tuple[Any, int]:
        import torch

        buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.allocated.append(nbytes)
        return buffer, buffer.data_ptr()

    def consumer_stream(self, device: int) -> int:
        return self.stream

    current_stream = consumer_stream  # the name the interface notes first gave it

    def hand_over(self, buffer: Any, *where: Any) -> None:
        self.kept.append(buffer)

    def view(self, buffer: Any, offset: int, nbytes: int, dtype: Any, shape: Any) -> Any:
        import numpy as np
        import torch

        if not isinstance(dtype, torch.dtype):
            dtype = torch.from_numpy(np.empty(0, dtype=np.dtype(dtype))).dtype
        return buffer[offset : offset + nbytes].view(dtype).view(tuple(shape))


class DeviceView:
    """A host tensor dressed as a tensor on cuda:0, so that stoker.read_into takes its
    device path (and writes through the stand-in) for memory that is really on the host."""

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor

    @property
    def device(self) -> Any:
        import torch

        return torch.device("cuda", 0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tensor, name)


if __name__ == "__main__":  # python -m tests.support.standin_lib DIR: build it beforehand
    os.makedirs(sys.argv[1], exist_ok=True)
    print(*build_standin(sys.argv[1]), sep="\n")
