"""Runs of bytes of volumes (``boxes.patch_runs``) read with cuFile straight into device
memory, for a PatchLoader on a GPU with GPUDirect Storage.

The CPU path reads a batch's runs into a pinned slot and copies the slot to the device.
Here the C++ core (``_core.gather_to_device``) has cuFile read each span of a file (runs
under 8 KiB apart merged, as the CPU reader merges them) into device scratch memory, and
device-to-device copies on stoker's copy stream put every run in its place in the batch,
runs of one length at constant strides in one 2-D copy: a 64^3 patch of a 256^3 volume is
64 reads of 32 KiB and one copy. The consumer's stream waits for the copies on the device.

Whether cuFile is worth using is decided as ``stoker.load_npy`` decides it
(``stoker.cuda_status()`` and each file system's verdict in ``stoker.cufile``): where it
is not, ``available()`` is false and ``reason`` says why, and the caller reads the other
way. A cuFile failure rules cuFile out for that file system (unless STOKER_GDS=on), as it
does for load_npy.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

import stoker._core as _core
import stoker.cuda as cuda
from stoker._process import ProcessLocal
from stoker.cufile import file_mode, rule_out
from stoker.errors import CuFileError, UsageError
from stoker.volumes.boxes import MERGE_GAP

#: Device memory each reader reads spans into before they are copied to their places (a
#: batch of eight 64^3 int16 patches reads about 16 MiB); a batch larger than this is read
#: in rounds, each waiting on the host for the last one's copies.
SCRATCH_BYTES = 32 << 20
#: Files a reader keeps registered with cuFile (an O_DIRECT descriptor each) beyond those
#: the batch being read needs.
MAX_OPEN = 64


class _ProcessState:
    """What a reader holds in one process: cuFile handles, the scratch, and the event after
    the last gather's copies (the scratch is free once it has fired)."""

    def __init__(self, device: int, scratch_bytes: int) -> None:
        self.pid = os.getpid()
        self.handles: OrderedDict[int, Any] = OrderedDict()
        stream = cuda.copy_stream(device)
        # Allocated for the copy stream, the only one that ever reads it.
        self.scratch, self.address = cuda.memory().empty(scratch_bytes, device, stream.handle)
        self.last: Any = None


class DevicePatchReader:
    """Reads runs of bytes of `paths` into device tensors with cuFile.

    Args:
        device: The CUDA device index the batches go to.
        paths: The files, indexed by the file ids ``read`` is given.
        scratch_bytes: Device memory read into before the copies (allocated once, on the
            first read).
        threads: cuFile reads at once; 0: one per core, at most 8.
        merge_gap: Runs of one file closer than this are read as one span, gap and all.
        align: Spans start and end on multiples of this where that adds no copy (O_DIRECT's
            unit); 1: never.

    A forked child neither uses nor frees its parent's handles and memory; in a child of a
    process that used CUDA, ``available()`` is false (the driver does not survive a fork).
    """

    def __init__(
        self,
        device: int,
        paths: Sequence[str | os.PathLike[str]],
        *,
        scratch_bytes: int = SCRATCH_BYTES,
        threads: int = 0,
        merge_gap: int = MERGE_GAP,
        align: int = 4096,
    ) -> None:
        if scratch_bytes < 1 or threads < 0 or merge_gap < 0 or align < 1:
            raise UsageError(
                f"DevicePatchReader: scratch_bytes={scratch_bytes} and align={align} must be "
                f"at least 1, threads={threads} and merge_gap={merge_gap} at least 0"
            )
        self.device = int(device)
        self.paths = [os.fspath(p) for p in paths]
        self.scratch_bytes = int(scratch_bytes)
        self.threads = int(threads)
        self.merge_gap = int(merge_gap)
        self.align = int(align)
        self._lock = ProcessLocal(threading.Lock)  # one read at a time: they share the scratch
        self._state: _ProcessState | None = None
        self._parents: list[_ProcessState] = []  # a forked child's: kept, never touched
        self._verdict: tuple[int, bool, str] | None = None  # (pid, available, reason)

    # -- whether to use it -----------------------------------------------------------

    def available(self) -> bool:
        """Whether cuFile should read these files here (GPUDirect Storage, or cuFile's
        compatibility mode where STOKER_GDS=on asks for it)."""
        return self._decide()[0]

    @property
    def reason(self) -> str:
        """Why ``available()`` says what it says."""
        return self._decide()[1]

    def _decide(self) -> tuple[bool, str]:
        pid = os.getpid()
        if self._verdict is None or self._verdict[0] != pid:
            self._verdict = (pid, *self._verdict_now())
        return self._verdict[1], self._verdict[2]

    def _verdict_now(self) -> tuple[bool, str]:
        status = cuda.cuda_status()
        if status["mode"] not in ("gds", "compat"):
            return False, status["reason"]
        if self.device >= status["devices"]:
            return (
                False,
                f"device cuda:{self.device} does not exist ({status['devices']} device(s))",
            )
        modes = set()
        devices: set[int] = set()
        for path in self.paths:  # one file per file system: the verdicts are per file system
            try:
                st_dev = os.stat(path).st_dev
            except OSError as e:
                return False, f"{path}: cannot read: {e.strerror or e}"
            if st_dev in devices:
                continue
            devices.add(st_dev)
            mode, why = file_mode(path)
            if mode not in ("gds", "compat"):
                return False, why or f"{path} would be read in {mode} mode"
            modes.add(mode)
        if "compat" in modes or status["mode"] == "compat":
            return True, "STOKER_GDS=on: cuFile reads, in its POSIX compatibility mode where needed"
        return True, status["reason"]

    # -- reading ---------------------------------------------------------------------

    def read(
        self,
        dest: Any,
        file_ids: Any,
        offsets: Any,
        lengths: Any,
        dest_offsets: Any,
        *,
        wait_for_consumer: bool = True,
    ) -> dict[str, int]:
        """Read run i (`lengths[i]` bytes at `offsets[i]` of file `file_ids[i]`) into bytes
        from ``dest_offsets[i]`` on of `dest`, a contiguous uint8 tensor on this reader's device.

        The copies run on stoker's copy stream; work queued on the caller's current stream
        afterwards sees the bytes (it waits on the device, not the host), and so may torch's
        allocator reuse `dest`'s memory once the caller drops it, if it was allocated on that
        stream (with wait_for_consumer=False: on the copy stream). Bytes of `dest` no run
        covers are left as they were.

        Args:
            dest: The batch's bytes.
            file_ids, offsets, lengths, dest_offsets: The runs (1-D integer arrays).
            wait_for_consumer: The copies first wait for work already queued on the current
                stream (which may still use `dest`). False where `dest` is new memory of the
                copy stream (``cuda.memory().empty(..., copy_stream(device).handle)``): then
                reusing the scratch next time waits for stoker's copies only.

        Returns:
            Counts: spans and reads (cuFile calls), bytes_read (gaps and alignment
            included), copies and copies_2d, rounds (fillings of the scratch).

        Raises:
            UsageError: `dest` is not a contiguous uint8 tensor on the device, or a file id
                is out of range.
            StokerError: A run lies outside `dest`.
            CuFileError: A read failed (naming the file and offset); unless STOKER_GDS=on,
                cuFile is then ruled out for its file system and ``available()`` is false.
            CudaError: CUDA is not usable in this process (a forked child, say).
        """
        torch = cuda.require_torch()
        if dest.dtype != torch.uint8 or not dest.is_contiguous():
            raise UsageError("DevicePatchReader.read: dest must be a contiguous uint8 tensor")
        where = dest.device
        if where.type != "cuda" or (where.index if where.index is not None else 0) != self.device:
            raise UsageError(
                f"DevicePatchReader.read: dest is on {where}; this reader reads into "
                f"cuda:{self.device}"
            )
        ids = np.asarray(file_ids)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self.paths)):
            raise UsageError(
                f"DevicePatchReader.read: file ids {ids.min()}..{ids.max()}, for "
                f"{len(self.paths)} files"
            )
        with self._lock.get():
            state = self._process_state()
            handles = self._handles(state, ids)
            mem = cuda.memory()
            stream = cuda.copy_stream(self.device)
            consumer = mem.consumer_stream(self.device)
            if state.last is not None:  # cuFile writes the scratch from the host
                state.last.wait()
                state.last = None
            if wait_for_consumer:
                stream.wait_for(consumer)
            try:
                out = _core.gather_to_device(
                    handles,
                    self.device,
                    dest.data_ptr(),
                    dest.numel(),
                    state.address,
                    self.scratch_bytes,
                    ids,
                    offsets,
                    lengths,
                    dest_offsets,
                    stream.handle,
                    consumer,
                    self.threads,
                    self.merge_gap,
                    self.align,
                )
            except CuFileError as e:
                self._ruled_out(e)
                raise
            state.last = out.pop("event")
        return out

    def _ruled_out(self, error: CuFileError) -> None:
        if cuda.gds_setting() == "on":
            return  # insisted on: the next batch tries again
        path = getattr(error, "path", None)
        if path:
            with contextlib.suppress(OSError):  # a vanished file says nothing of its disk
                rule_out(path, str(error))
        self._verdict = (os.getpid(), False, f"cuFile failed: {error}")

    def _process_state(self) -> _ProcessState:
        state = self._state
        if state is None or state.pid != os.getpid():
            if state is not None:
                self._parents.append(state)  # the parent's driver objects mean nothing here
            cuda.require_cuda(self.device)  # in a forked child of a CUDA process: raises
            state = self._state = _ProcessState(self.device, self.scratch_bytes)
        return state

    def _handles(self, state: _ProcessState, ids: np.ndarray) -> list[Any]:
        """One registered handle (or None) per path, for every file the runs name; the
        least recently used others closed beyond MAX_OPEN."""
        used = np.flatnonzero(np.bincount(ids.reshape(-1).astype(np.int64), minlength=0))
        for i in used.tolist():
            handle = state.handles.get(i)
            if handle is None:
                handle = _core.CuFile(self.paths[i], self.device)
                state.handles[i] = handle
            state.handles.move_to_end(i)
        while len(state.handles) > max(MAX_OPEN, used.size):
            state.handles.popitem(last=False)[1].close()
        out: list[Any] = [None] * len(self.paths)
        for i in used.tolist():
            out[i] = state.handles[i]
        return out

    def close(self) -> None:
        """Wait for the last copies out of the scratch, then release the handles and the
        scratch (in the process that made them; a forked child only forgets them)."""
        with self._lock.get():
            state, self._state = self._state, None
            if state is None or state.pid != os.getpid():
                if state is not None:
                    self._parents.append(state)
                return
            if state.last is not None:
                state.last.wait()
            for handle in state.handles.values():
                handle.close()
            state.handles.clear()
            state.scratch = None

    def __enter__(self) -> DevicePatchReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its settings: the other side opens its own handles and scratch."""
        return (
            _rebuild,
            (
                self.device,
                self.paths,
                {
                    "scratch_bytes": self.scratch_bytes,
                    "threads": self.threads,
                    "merge_gap": self.merge_gap,
                    "align": self.align,
                },
            ),
        )


def _rebuild(device: int, paths: list[str], options: dict[str, int]) -> DevicePatchReader:
    return DevicePatchReader(device, paths, **options)


def read_patches_to_device(
    reader: DevicePatchReader,
    arrays: Sequence[Any],
    file_ids: Sequence[int],
    starts: Sequence[tuple[int, ...]],
    places: Sequence[int],
    patch_size: tuple[int, ...],
    total: int,
) -> tuple[Any, dict[str, int]] | None:
    """A batch's patches read with cuFile into a new device buffer of `total` bytes: patch i
    of VolumeArray ``arrays[i]`` (file ``file_ids[i]`` of the reader) at spatial
    ``starts[i]``, into the buffer from ``places[i]`` on, in stored order, as the CPU path
    lays them out. None where the batch cannot go this way (a chunked array, a big-endian
    file, a patch reaching past its volume's edge: those are padded and swapped on the
    host), or cuFile has been ruled out: the caller then reads it the other way."""
    from stoker.volumes.boxes import patch_runs

    if not reader.available():
        return None
    pieces = []
    for array, file_id, start, at in zip(arrays, file_ids, starts, places):
        if array.layout is not None or array.swap_unit:
            return None
        runs = patch_runs(array, start, patch_size)
        if runs.padded:
            return None
        ids = np.full(runs.offsets.shape, file_id, np.int64)
        pieces.append((ids, runs.offsets, runs.lengths, runs.dest_offsets + at))
    ids, offsets, lengths, dests = (np.concatenate(p) for p in zip(*pieces))
    device = reader.device
    buffer, _ = cuda.memory().empty(total, device, cuda.copy_stream(device).handle)
    try:
        stats = reader.read(buffer, ids, offsets, lengths, dests, wait_for_consumer=False)
    except CuFileError:
        if reader.available():
            raise  # STOKER_GDS=on: cuFile was asked for, and its failure is the answer
        return None
    return buffer, stats
