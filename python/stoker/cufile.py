"""cuFile on the GPU paths: which files GPUDirect may read (a file's mount, its file system
and block device, against what cuFile's driver supports, remembered per file system and
across forks), and this process's registered cuFile handles."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any

import stoker.cuda as cuda
from stoker._core import CuFile
from stoker._process import per_process
from stoker.errors import ReadError, located

# File systems GPUDirect can read, by the name cuFile's driver properties give them.
_GDS_FILESYSTEMS = {
    "ext4": "nvme",
    "xfs": "nvme",
    "nfs": "nfs",
    "nfs4": "nfs",
    "lustre": "lustre",
    "gpfs": "gpfs",
    "beegfs": "beegfs",
    "wekafs": "wekafs",
}


def _mount_of(path: str) -> tuple[str, str, str]:
    """(file system type, device "major:minor", mount options) of the mount holding
    `path`."""
    st = os.stat(path)
    device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and fields[2] == device and " - " in line:
                    tail = line.split(" - ", 1)[1].split()
                    return tail[0], device, tail[2] if len(tail) > 2 else ""
    except OSError:
        pass
    return "unknown", device, ""


def _on_nvme(device: str) -> bool:
    """Whether block device `device` (major:minor) is an NVMe namespace or partition, or
    an md array built only of them: its sysfs path, or each member's, runs through an
    nvme controller. (Device-mapper volumes, LVM, are not read by GPUDirect.) For tests on
    machines without NVMe, STOKER_GDS_ASSUME_NVME=1 (or 0) decides instead."""
    if os.environ.get("STOKER_GDS_ASSUME_NVME") in ("0", "1"):
        return os.environ["STOKER_GDS_ASSUME_NVME"] == "1"  # a test's machine
    real = os.path.realpath(f"/sys/dev/block/{device}")
    if "/nvme" in real:
        return True
    slaves = os.path.join(real, "slaves")
    if not os.path.basename(real).startswith("md") or not os.path.isdir(slaves):
        return False
    names = os.listdir(slaves)
    return bool(names) and all(
        "/nvme" in os.path.realpath(os.path.join(slaves, name)) for name in names
    )


# What is known of file systems holds in every process: kept across forks.
_verdicts_lock = threading.Lock()
_cufile_failed: dict[str, str] = {}  # by device: the cuFile failure that ruled it out
_fs_verdicts: dict[str, str] = {}  # by device: why GPUDirect cannot read it ("" if it can)


def read_mode(path: str | os.PathLike[str]) -> str:
    """The path ``load_npy`` takes for this file now: gds, compat, bounce or cpu (after a
    cuFile failure on its file system, bounce)."""
    return file_mode(os.fspath(path))[0]


def file_mode(path: str) -> tuple[str, str]:
    """(mode, why it is not GPUDirect: to be said once) for a file, from cuda_status() and
    the file's mount. With STOKER_GDS=on a file GPUDirect cannot read still goes through
    cuFile, which then reads it in its compatibility mode."""
    status = cuda.cuda_status()
    mode = status["mode"]
    if mode != "gds":
        return mode, status["reason"] if mode == "bounce" else ""
    try:
        fstype, device, options = _mount_of(path)
    except OSError as e:
        raise located(ReadError, path, 0, f"cannot read: {e.strerror or e}") from e
    forced = cuda.gds_setting() == "on"
    if device in _cufile_failed and not forced:
        return "bounce", ""  # said when it failed
    why = _fs_verdicts.get(device)
    if why is None:
        need = _GDS_FILESYSTEMS.get(fstype)
        supported = status.get("filesystems", [])
        if need is None:
            why = f"GPUDirect cannot read files on {fstype} (such as {path})"
        elif need == "nvme" and not _on_nvme(device):
            why = f"GPUDirect reads {fstype} on NVMe only; {path} is on block device {device}"
        elif need == "nfs" and "proto=rdma" not in options.split(","):
            why = f"GPUDirect reads NFS over RDMA only; {path} is on NFS without proto=rdma"
        elif need not in supported and not (need == "nvme" and "nvme-p2p" in supported):
            why = (
                f"cuFile's driver does not support {need} (it supports "
                f"{', '.join(supported) or 'nothing'}), where {path} is"
            )
        else:
            why = ""
        with _verdicts_lock:
            _fs_verdicts[device] = why
    if not why:
        return "gds", ""
    if forced:
        return "compat", ""
    return "bounce", why + "; reads go through the pinned ring"


def rule_out(path: str, failure: str) -> None:
    """cuFile failed on `path` (`failure`): files on its file system are not tried with it
    again (unless STOKER_GDS=on)."""
    with _verdicts_lock:
        _cufile_failed[_mount_of(path)[1]] = failure


_MAX_HANDLES = 64  # registered files kept open (an O_DIRECT descriptor each)


class _Handles:
    """This process's registered cuFile handles: one per file (again if the file
    changed), the least recently used closed beyond _MAX_HANDLES."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: OrderedDict[tuple[str, int], tuple[tuple[int, int, int], Any]] = OrderedDict()

    def get(self, path: str, device: int) -> Any:
        st = os.stat(path)
        identity = (st.st_ino, st.st_size, st.st_mtime_ns)
        key = (os.path.realpath(path), device)
        with self.lock:
            found = self.open.get(key)
            if found is not None and found[0] == identity:
                self.open.move_to_end(key)
                return found[1]
        handle = CuFile(path, device)
        with self.lock:
            stale = self.open.pop(key, None)
            self.open[key] = (identity, handle)
            while len(self.open) > _MAX_HANDLES:
                self.open.pop(next(iter(self.open)))[1].close()
        if stale is not None:
            stale[1].close()
        return handle


def cufile_handle(path: str, device: int) -> Any:
    """This process's registered cuFile handle of `path` for `device`."""
    return per_process("cufile-handles", _Handles).get(path, device)
