"""The GPU path: what CUDA and cuFile can do here (``stoker.cuda_status()``), where device
memory comes from, and the stage that moves a Loader's batches onto a device through the
pinned ring.

Nothing here touches CUDA at import: the driver is loaded by the first call that needs it.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

import stoker._core as _core
from stoker._process import per_process
from stoker.errors import CudaError, StokerError

ALIGN = _core.ALIGN  # bytes between tensors packed into one slot: any dtype's alignment

_GDS_SETTINGS = ("auto", "on", "off")


class FallbackWarning(UserWarning):
    """stoker took a slower path than the one asked for (say, cuFile failed); the result is
    still exact. Issued once per reason."""


_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, FallbackWarning, stacklevel=3)


def gds_setting() -> str:
    value = os.environ.get("STOKER_GDS", "auto").strip().lower() or "auto"
    if value not in _GDS_SETTINGS:
        raise StokerError(f"STOKER_GDS={value!r}: use one of {', '.join(_GDS_SETTINGS)}")
    return value


@functools.lru_cache(maxsize=1)
def _cufile_candidates() -> list[str]:
    """libcufile inside the nvidia-cufile wheel, when it is installed (its folder differs
    between the CUDA 12 and CUDA 13 wheels)."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    found = []
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        for folder in ("cufile", "cu13", "cu12"):
            path = os.path.join(root, folder, "lib", "libcufile.so.0")
            if os.path.exists(path):
                found.append(path)
    return found


def cuda_status() -> dict[str, Any]:
    """What the GPU path will do here, and why: ``{"cuda", "cufile", "mode", "reason", ...}``.

    mode is ``gds`` (cuFile reads disk to GPU directly: nvidia-fs or PCI P2PDMA is there),
    ``compat`` (cuFile's own POSIX compatibility mode, only with STOKER_GDS=on), ``bounce``
    (stoker's pinned ring: parallel preads overlapped with asynchronous copies) or ``cpu``
    (no usable CUDA). The first call loads the driver; nothing else does.

    ``STOKER_GDS=auto|on|off`` (default ``auto``) decides whether cuFile is used: ``on``
    insists on it (its failures are raised), ``off`` never loads it.

    Returns:
        ``cuda`` (whether the driver and a device are usable), ``cufile`` (whether cuFile
        loaded), ``mode``, ``reason`` (why that mode, in words), ``libcuda`` and
        ``libcufile`` (the files loaded), ``driver_version``, ``cufile_version``,
        ``devices`` (how many), and in ``gds`` mode ``filesystems`` (those cuFile's driver
        supports).

    Raises:
        StokerError: ``STOKER_GDS`` is set to something other than auto, on or off.
    """
    setting = gds_setting()
    driver = _core.cuda_driver_status()
    status: dict[str, Any] = {
        "cuda": driver["available"],
        "cufile": False,
        "mode": "cpu",
        "reason": driver["reason"],
        "libcuda": driver["library"],
        "libcufile": "",
        "driver_version": driver["version"],
        "cufile_version": 0,
        "devices": driver["devices"],
    }
    if not driver["available"]:
        return status
    if setting == "off":
        status["mode"] = "bounce"
        status["reason"] = "STOKER_GDS=off: cuFile is not used; reads go through the pinned ring"
        return status
    cufile = _core.cufile_status(_cufile_candidates())
    status.update(
        cufile=cufile["available"], libcufile=cufile["library"], cufile_version=cufile["version"]
    )
    if not cufile["available"]:
        status["mode"] = "bounce"
        status["reason"] = f"{cufile['reason']}; reads go through the pinned ring"
    elif cufile["nvfs"] or cufile["p2p"]:
        status["mode"] = "gds"
        status["reason"] = f"GPUDirect Storage: {cufile['reason']}"
        status["filesystems"] = cufile["filesystems"]
    elif setting == "on":
        status["mode"] = "compat"
        status["reason"] = f"STOKER_GDS=on: {cufile['reason']}"
    else:
        status["mode"] = "bounce"
        status["reason"] = (
            f"{cufile['reason']}; the pinned ring is used instead, overlapping parallel reads "
            "with copies (STOKER_GDS=on forces cuFile)"
        )
    return status


def require_torch() -> Any:
    """torch, which the Loader and the GPU path hand out tensors of."""
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is a test dependency
        raise StokerError("stoker hands out torch tensors: pip install torch") from e
    return torch


def device_index(device: Any) -> int | None:
    """The CUDA device a ``device=`` argument names, or None for the CPU."""
    text = str(device)
    if text == "cpu":
        return None
    if text == "cuda":
        torch = require_torch()
        return torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    if text.startswith("cuda:"):
        index = text[5:]
        if not (index.isascii() and index.isdigit()):
            raise StokerError(f"device={device!r}: not a CUDA device")
        return int(index)
    raise StokerError(f"device={device!r}: stoker moves batches to 'cpu', 'cuda' or 'cuda:N'")


def require_cuda(device: int) -> None:
    """Raise CudaError, saying why, unless `device` can be used in this process."""
    torch = require_torch()
    in_bad_fork = getattr(torch.cuda, "_is_in_bad_fork", lambda: False)
    if in_bad_fork():
        raise CudaError(
            "this process was forked after CUDA was initialised in its parent; a forked child "
            "cannot use CUDA. Start workers with the 'spawn' method, or keep the GPU path in "
            "the parent"
        )
    driver = _core.cuda_driver_status()  # the driver only: cuFile is not needed yet
    if not driver["available"]:
        raise CudaError(
            f"device 'cuda:{device}' needs CUDA, which is not usable here: {driver['reason']}"
        )
    if device >= driver["devices"]:
        raise CudaError(f"device 'cuda:{device}' does not exist ({driver['devices']} device(s))")
    memory().check(device)


class DeviceMemory(Protocol):
    """Where stoker's device buffers come from. torch's caching allocator by default, so
    users' memory accounting stays in torch; a host stand-in replaces it in the tests of the
    ring's ordering on machines without a GPU."""

    def check(self, device: int) -> None: ...

    def empty(self, nbytes: int, device: int, stream: int) -> tuple[Any, int]:
        """A uint8 tensor of `nbytes` on `device` for use on `stream`, and its address."""

    def consumer_stream(self, device: int) -> int:
        """The handle of the caller's current stream on `device`."""

    def hand_over(self, buffer: Any, device: int) -> None:
        """`buffer` is used on the current stream from now on (record_stream)."""

    def view(self, buffer: Any, offset: int, nbytes: int, dtype: Any, shape: tuple) -> Any:
        """A tensor of `dtype` and `shape` over bytes [offset, offset + nbytes) of `buffer`."""


class TorchMemory:
    """Device memory from torch's caching allocator."""

    def __init__(self) -> None:
        self._streams: dict[tuple[int, int], Any] = {}

    def check(self, device: int) -> None:
        torch = require_torch()
        if not torch.cuda.is_available():
            raise CudaError(
                f"device 'cuda:{device}': this torch ({torch.__version__}) cannot use CUDA; "
                "install a CUDA build of torch"
            )

    def _external(self, device: int, stream: int) -> Any:
        key = (device, stream)
        found = self._streams.get(key)
        if found is None:
            found = require_torch().cuda.ExternalStream(stream, device=f"cuda:{device}")
            self._streams[key] = found
        return found

    def empty(self, nbytes: int, device: int, stream: int) -> tuple[Any, int]:
        torch = require_torch()
        # Allocated for the copy stream, so the allocator orders its reuse after the copy;
        # hand_over then ties its release to the consumer's stream as well.
        with torch.cuda.stream(self._external(device, stream)):
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
        return buffer, buffer.data_ptr()

    def consumer_stream(self, device: int) -> int:
        return int(require_torch().cuda.current_stream(device).cuda_stream)

    def hand_over(self, buffer: Any, device: int) -> None:
        buffer.record_stream(require_torch().cuda.current_stream(device))

    def view(self, buffer: Any, offset: int, nbytes: int, dtype: Any, shape: tuple) -> Any:
        return buffer[offset : offset + nbytes].view(dtype).view(shape)


_memory: DeviceMemory = TorchMemory()


def memory() -> DeviceMemory:
    return _memory


def use_device_memory(provider: DeviceMemory) -> DeviceMemory:
    """For tests: where device buffers come from (by default torch's caching allocator).
    The tests with the host stand-in for the driver give host memory here. Returns the
    provider used until now."""
    global _memory
    previous, _memory = _memory, provider
    return previous


def copy_stream(device: int) -> Any:
    """This process's copy stream for `device` (made again in a forked child, where the
    driver then refuses with a clear error)."""
    return per_process(("copy-stream", device), lambda: _core.CopyStream(device))


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class DeviceStage:
    """Moves CPU batches onto one device: tensors already in a pinned slot (the fields= fast
    path reads straight into one) go in one copy of that slot; others are packed into a
    pinned slot first. Copies run on the copy stream; the consumer's stream waits on their
    event on the device, and the slot is reused only after the event."""

    def __init__(self, device: int, pinned_bytes: int, slots: int) -> None:
        self.device = device
        self.pinned_bytes = pinned_bytes
        self.ring = _core.PinnedRing(slots, pinned_bytes, device=device)
        self.pid = os.getpid()

    def acquire(self, nbytes: int, wait: bool = True) -> np.ndarray | None:
        """A pinned slot of `nbytes`; None, without waiting, when `wait` is false and every
        slot is taken."""
        if os.getpid() != self.pid:
            require_cuda(self.device)  # raises: a forked child
        try:
            return self.ring.acquire(nbytes, timeout=None if wait else 0.0)
        except TimeoutError:
            return None
        except StokerError as e:
            if nbytes > self.pinned_bytes:
                raise StokerError(
                    f"a batch of {nbytes} bytes does not fit the loader's {self.pinned_bytes} "
                    "bytes of pinned memory: raise Loader(pinned_bytes=...)"
                ) from e
            raise

    def to_device(self, batch: Any, slot: np.ndarray | None = None) -> Any:
        torch = require_torch()
        leaves: list[Any] = []
        _collect(batch, torch, leaves)
        if not leaves:
            return batch
        stream = copy_stream(self.device)
        mem = memory()
        consumer = mem.consumer_stream(self.device)
        placed: dict[int, Any] = {}
        in_slot, staged = [], []
        base = slot.ctypes.data if slot is not None else 0
        end = base + (slot.nbytes if slot is not None else 0)
        for t in leaves:
            where = t.data_ptr()
            inside = slot is not None and base <= where and where + _nbytes(t) <= end
            if inside and t.is_contiguous():
                in_slot.append((t, where - base))
            else:
                staged.append(t)
        regions = []
        if in_slot:
            assert slot is not None  # only a tensor inside the slot is in in_slot
            low = min(offset for _, offset in in_slot)
            high = max(offset + _nbytes(t) for t, offset in in_slot)
            regions.append((slot[low:high], [(t, offset - low) for t, offset in in_slot]))
        if staged:
            offsets, at = [], 0
            for t in staged:
                offsets.append(at)
                at += _aligned(_nbytes(t))
            packed = self.acquire(at)
            assert packed is not None  # None only for wait=False
            host = torch.from_numpy(packed)
            for t, offset in zip(staged, offsets):
                n = _nbytes(t)
                host[offset : offset + n].view(t.dtype).view(t.shape).copy_(t)
            regions.append((packed, list(zip(staged, offsets))))
        for source, members in regions:
            buffer, address = mem.empty(max(source.nbytes, 1), self.device, stream.handle)
            if source.nbytes:
                stream.copy(source, address, consumer)
            mem.hand_over(buffer, self.device)
            for t, offset in members:
                placed[id(t)] = mem.view(buffer, offset, _nbytes(t), t.dtype, tuple(t.shape))
        return _rebuild(batch, torch, placed)


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size()


def _collect(value: Any, torch: Any, out: list[Any]) -> None:
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu":
            out.append(value)
    elif isinstance(value, Mapping):
        for v in value.values():
            _collect(v, torch, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect(v, torch, out)


def _rebuild(value: Any, torch: Any, placed: dict[int, Any]) -> Any:
    if isinstance(value, torch.Tensor):
        return placed.get(id(value), value)
    if isinstance(value, Mapping):
        items = {k: _rebuild(v, torch, placed) for k, v in value.items()}
        try:
            # Mapping declares no constructor; a subclass's that takes no dict is caught.
            return items if type(value) is dict else type(value)(items)  # type: ignore[call-arg]
        except TypeError:  # a mapping type that cannot be made from a dict
            return items
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_rebuild(v, torch, placed) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_rebuild(v, torch, placed) for v in value)
    return value
