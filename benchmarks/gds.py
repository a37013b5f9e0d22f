"""A large .npy straight into GPU memory: stoker.load_npy against kvikio, torch's GdsFile and
numpy.load + .cuda(); and the same volume as NIfTI (.nii, and a smaller .nii.gz):
stoker.load_array against nibabel + .cuda().

    python benchmarks/gds.py [--gib 4] [--gz-gib 0.5] [--runs 3] [--dir bench-data/gds]
                             [--only NAME ...] [--timeout SECONDS] [--budget SECONDS]
                             [--json FILE] [--clean] [--quick]

One int32 volume of --gib GiB (slices of 512x512, every value a hash of its position, so a
byte in the wrong place changes the checksums) is written once under --dir three times: as
a plain ``numpy.save`` file (data at byte 128), through ``stoker.GDSCache.put`` (data on a
4 KiB boundary) and as a single-file NIfTI-1 ``.nii`` (a 348-byte header written here with
struct, no nibabel needed; vox_offset 352; dims x=512, y=512, z=slices, so its voxels are
the .npy's bytes). A second, smaller volume of --gz-gib GiB (default min(--gib, 0.5),
--quick min(--gib, 0.25)) is written as a ``.nii.gz`` (gzip level 1, one member): the same
hash kept to its low 12 bits, as a CT's values, since gzip cannot shrink a full 32-bit hash
(zlib would store it and inflating would be a copy); so it has real inflating to do. Each
part is written once and reused while its stamp says it is complete. --dir should be on the
local disk: on a tmpfs nothing can be cold and O_DIRECT/GDS cannot work (the benchmark names
the file system and warns). The methods, by the files they read:

- stoker (np.save and GDSCache files): ``stoker.load_npy(path, device="cuda")``, in the
  mode ``stoker.gds.read_mode`` names (``gds``: cuFile with real GPUDirect; ``compat``:
  cuFile's POSIX mode, only with STOKER_GDS=on; ``bounce``: stoker's pinned ring);
- kvikio, when it imports: ``kvikio.CuFile(path, "r").pread(buffer, size, offset).get()``
  into a torch CUDA buffer, with KVIKIO_NTHREADS set to the core count (at most 16) unless
  it is set already; its mode is kvikio's compat setting (ON: POSIX reads, no cuFile);
- torch's ``torch.cuda.gds.GdsFile(path, os.O_RDONLY)`` (O_DIRECT added by torch),
  ``load_storage`` into a CUDA storage, when this torch has it: cuFile, which runs as real
  GDS or in its compatibility mode by what the system offers (``stoker.cuda_status()``
  reports which);
- ``numpy.load(path)`` then ``torch.from_numpy(a).cuda()``: the baseline for the .npy;
- stoker load_array .nii and stoker load_array .nii.gz: ``stoker.load_array(path,
  device="cuda")``; a .nii takes load_npy's path (the mode is read_mode's), a .nii.gz is
  inflated by the C++ core into pinned slots, each copied while the next is inflated;
- nibabel + .cuda() .nii and nibabel + .cuda() .nii.gz, when nibabel imports (skipped with
  a note otherwise): ``torch.from_numpy(np.asarray(nibabel.load(path).dataobj
  .get_unscaled())).cuda()``, the baseline for NIfTI (nibabel maps a .nii, and inflates a
  .nii.gz with Python's gzip, or indexed_gzip where it is installed).

The targets are load_npy's for both formats: stoker at least as fast as the best other
reader and at least 2x its format's baseline (numpy.load + .cuda(); nibabel + .cuda()).
Nothing else here reads NIfTI onto the GPU, so the .nii is also held against the best other
reader of the np.save file (the same bytes), and stoker's .nii against stoker's .npy, which
should be about 1.0 (the same path; only the header differs).

Each method reads its files cold and then warm, in a fresh process per method and round (the
methods take turns for --runs rounds, in the order above but with the headlines' first:
stoker, numpy, the .nii pair, GdsFile, kvikio, then the .nii.gz pair; tables show medians).
The .nii.gz is read warm only: inflating runs on one core, several times slower than the
disk reads the compressed file, so a cold read would measure the same inflate with the
small disk read of its compressed bytes ahead of it and double the time the pair takes.
Cold: the file is fsynced and evicted from the page cache with
``posix_fadvise(POSIX_FADV_DONTNEED)`` first; this is best effort, so the share of its
pages still resident (``mincore``) is reported. Warm: the file is read through the page
cache just before (methods that open with O_DIRECT bypass that cache by design, so warm and
cold can coincide for them). Before its first timed read each process reserves the device
memory once in the pool it allocates from (stoker's load_npy and load_array allocate on
stoker's copy stream, the others on the default stream) and reads a small file of the same
kind in the same folder with the same method, so driver start-up, cudaMalloc and cuFile's
start are not timed. The clock covers allocating the destination, the read and
``torch.cuda.synchronize()``. For stoker, ``stoker.gds.read_mode`` is asked before and
again after each read (a cuFile failure makes stoker fall back at run time), and every
warning caught (a ``stoker.FallbackWarning`` says why) is shown, the warm-up read's too.
Every result is verified on the GPU: the sum of all values and eight 16 KiB windows (the
first, the last, six at pseudo-random places) must equal the source's, and a typed result
must have the volume's shape and dtype. A NIfTI result is indexed [x, y, z] (load_array's
and nibabel's view with reversed axes), so it is permuted back to the stored C order first.
GB/s counts the array's bytes (1 GB = 1e9 bytes; for the .nii.gz, the inflated voxels).

Each read's result is printed the moment it finishes. A method process that runs past
--timeout seconds is killed and reported as timed out, keeping the reads it finished; with
--budget, nothing starts or runs past that many seconds from the start; on SIGTERM or
Ctrl-C the running process is killed. In every case the tables and the headlines are
printed from whatever finished. --only takes method names (an exact name selects only that
method, so "stoker load_array .nii" leaves out the .nii.gz one) or text a name contains
(".nii.gz", "nibabel", "stoker"). --quick (what scripts/gpu_check.sh runs): 1 GiB, a
0.25 GiB .nii.gz, one round. Without a usable CUDA device the benchmark says so and exits
with status 0.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import time
import warnings
import zlib

import _runner
import numpy as np
from _runner import say

from stoker.tools.measure import evict_from_page_cache, read_through

SLICE = (512, 512)  # one slice: 1 MiB of int32
NPY_FILES = ("np.save", "GDSCache")
MAIN_FILES = (*NPY_FILES, ".nii")  # the --gib volume's files; ".nii.gz" holds the smaller one
# method -> the files it reads; in the order they run: the headline ratios (stoker, numpy,
# then the .nii pair) first, the .nii.gz pair (the slowest to start, the least asked) last
METHODS = {
    "stoker": NPY_FILES,
    "numpy.load + .cuda()": NPY_FILES,
    "stoker load_array .nii": (".nii",),
    "nibabel + .cuda() .nii": (".nii",),
    "GdsFile": NPY_FILES,
    "kvikio": NPY_FILES,
    "stoker load_array .nii.gz": (".nii.gz",),
    "nibabel + .cuda() .nii.gz": (".nii.gz",),
}
# per file: stoker's method for it and the baseline it is held to TARGET_BASELINE against
STOKER = {label: "stoker" for label in NPY_FILES}
STOKER |= {".nii": "stoker load_array .nii", ".nii.gz": "stoker load_array .nii.gz"}
BASELINE = {label: "numpy.load + .cuda()" for label in NPY_FILES}
BASELINE |= {".nii": "nibabel + .cuda() .nii", ".nii.gz": "nibabel + .cuda() .nii.gz"}
RAW = ("GdsFile", "kvikio")  # they return the bytes (uint8), not a typed array
WINDOW = 4096  # elements per verified window
TARGET_BEST, TARGET_BASELINE = 1.0, 2.0
GZ_MASK = 0xFFF  # the .nii.gz volume's values: 12 bits, as a CT's
WARMUP_SLICES = 16
LAYOUT = 2  # the main stamp's layout: 2 added the .nii and a spec per file


def temperatures(label: str) -> tuple[str, ...]:
    """A .nii.gz is read warm only (the module's docstring says why)."""
    return ("warm",) if label == ".nii.gz" else ("cold", "warm")


def is_nifti(label: str) -> bool:
    return label.startswith(".nii")


def values(start: int, stop: int, mask: int | None = None) -> np.ndarray:
    """The volume's elements [start, stop): a hash of each position, as int32 (with `mask`,
    only those bits of it)."""
    i = np.arange(start, stop, dtype=np.uint64)
    h = (i * np.uint64(2654435761) + np.uint64(0x9E3779B9)) & np.uint64(0xFFFFFFFF)
    h ^= h >> np.uint64(15)
    if mask is not None:
        h &= np.uint64(mask)
    return h.astype(np.uint32).view(np.int32)


def windows(n: int) -> list[int]:
    rng = np.random.default_rng(7)
    inner = sorted(int(x) for x in rng.integers(1, max(2, n - WINDOW), 6))
    return [0, *inner, max(0, n - WINDOW)]


# -- data ---------------------------------------------------------------------


def fs_type(path: str) -> str:
    try:
        out = subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def nifti1_header(dims: tuple[int, ...]) -> bytes:
    """A single-file NIfTI-1 header for int32 voxels of nibabel's shape `dims` (x fastest):
    the 348 bytes and 4 zero extension-flag bytes, so the voxels start at 352; 1 mm voxels,
    an identity sform, no scaling."""
    if not 1 <= len(dims) <= 7:
        raise ValueError(f"NIfTI has 1 to 7 dimensions, not {len(dims)}")
    h = bytearray(352)
    struct.pack_into("<i", h, 0, 348)  # sizeof_hdr
    h[38] = ord("r")  # regular
    struct.pack_into("<8h", h, 40, len(dims), *dims, *[1] * (7 - len(dims)))  # dim
    struct.pack_into("<hh", h, 70, 8, 32)  # datatype NIFTI_TYPE_INT32, bitpix
    struct.pack_into("<8f", h, 76, *[1.0] * 8)  # pixdim (pixdim[0], qfac, 1)
    struct.pack_into("<3f", h, 108, 352.0, 1.0, 0.0)  # vox_offset, scl_slope, scl_inter
    h[123] = 2  # xyzt_units: mm
    descrip = b"stoker benchmarks/gds.py"
    h[148 : 148 + len(descrip)] = descrip
    struct.pack_into("<hh", h, 252, 0, 2)  # qform_code 0, sform_code 2 (aligned)
    struct.pack_into("<12f", h, 280, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0)  # srow_x, _y, _z
    h[344:348] = b"n+1\0"
    return bytes(h)


def write_nii(path: str, volume: np.ndarray) -> None:
    """`volume` (C order, int32, indexed [z, y, x]) as a .nii whose voxels are its bytes."""
    if volume.dtype != np.int32 or not volume.flags.c_contiguous:
        raise ValueError("write_nii takes a C-contiguous int32 array")
    with open(path + ".part", "wb") as f:
        f.write(nifti1_header(volume.shape[::-1]))
        f.write(memoryview(volume).cast("B"))
    os.replace(path + ".part", path)


def write_nii_gz(path: str, shape: tuple[int, ...], mask: int) -> int:
    """The volume of `shape` (C order) whose elements are ``values(..., mask)`` as a .nii.gz
    (gzip level 1, one member), generated piece by piece; returns the sum of its values."""
    n = int(np.prod(shape))
    deflate = zlib.compressobj(1, zlib.DEFLATED, 31)  # 31: a gzip header and trailer
    total = 0
    step = 1 << 24
    with open(path + ".part", "wb") as f:
        f.write(deflate.compress(nifti1_header(tuple(shape[::-1]))))
        for start in range(0, n, step):
            part = values(start, min(n, start + step), mask)
            total += int(part.sum(dtype=np.int64))
            f.write(deflate.compress(part))
        f.write(deflate.flush())
    os.replace(path + ".part", path)
    return total


def fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def need_space(folder: str, need: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < need:
        sys.exit(
            f"gds: {folder} has {free / 2**30:.1f} GiB free; the files need {need / 2**30:.1f}"
        )


def complete(stamp: dict | None, labels: tuple[str, ...]) -> bool:
    """The stamp lists every file of `labels`, and they are all there."""
    files = (stamp or {}).get("files", {})
    return all(
        isinstance(files.get(label), dict)
        and os.path.exists(files[label]["path"])
        and os.path.exists(files[label]["warmup"])
        for label in labels
    )


def prepare(folder: str, gib: float, gz_gib: float | None) -> dict:
    """Write the --gib volume's files (and with `gz_gib`, the .nii.gz) and a small warm-up
    file of each kind, each part unless its stamp says it is there; returns the stamps in
    one dict (read_stamps's)."""
    os.makedirs(folder, exist_ok=True)
    slices = max(1, round(gib * 1024))
    path = os.path.join(folder, "stamp.json")
    want = {"slices": slices, "layout": LAYOUT}
    if not complete(_runner.stamp_if_current(path, want), MAIN_FILES):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        write_main(folder, slices, path)
    if gz_gib:
        gz_slices = max(1, round(gz_gib * 1024))
        path = os.path.join(folder, "stamp-nii-gz.json")
        if not complete(_runner.stamp_if_current(path, {"slices": gz_slices}), (".nii.gz",)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            write_gz(folder, gz_slices, path)
    return read_stamps(folder)


def read_stamps(folder: str) -> dict:
    """The main stamp, with the .nii.gz's file added to its "files" when it was written."""
    with open(os.path.join(folder, "stamp.json")) as f:
        stamp = json.load(f)
    gz = os.path.join(folder, "stamp-nii-gz.json")
    if os.path.exists(gz):
        with open(gz) as f:
            stamp["files"].update(json.load(f)["files"])
    return stamp


def write_main(folder: str, slices: int, stamp_path: str) -> None:
    import torch

    import stoker

    shutil.rmtree(os.path.join(folder, "cache"), ignore_errors=True)
    for name in ("plain.npy", "warmup.npy", "volume.nii", "warmup.nii"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(folder, name))
    need_space(folder, 3 * slices * (1 << 20) + (64 << 20))
    shape = (slices, *SLICE)
    n = int(np.prod(shape))
    volume = np.empty(n, np.int32)
    total = 0
    step = 1 << 24
    for start in range(0, n, step):
        stop = min(n, start + step)
        volume[start:stop] = values(start, stop)
        total += int(volume[start:stop].sum(dtype=np.int64))
    volume = volume.reshape(shape)
    plain = os.path.join(folder, "plain.npy")
    np.save(plain + ".part.npy", volume)
    os.replace(plain + ".part.npy", plain)
    cache = stoker.GDSCache(os.path.join(folder, "cache"))
    aligned = cache.put(f"volume-{slices}", torch.from_numpy(volume))
    nii = os.path.join(folder, "volume.nii")
    write_nii(nii, volume)
    warmup_npy = os.path.join(folder, "warmup.npy")
    np.save(warmup_npy, volume[: min(slices, WARMUP_SLICES)])
    warmup_nii = os.path.join(folder, "warmup.nii")
    write_nii(warmup_nii, volume[: min(slices, WARMUP_SLICES)])
    for path in (plain, aligned, nii, warmup_npy, warmup_nii):
        fsync(path)
    volume_spec = {"shape": list(shape), "nbytes": volume.nbytes, "sum": total, "mask": None}
    paths = {"np.save": (plain, warmup_npy), "GDSCache": (aligned, warmup_npy)}
    paths[".nii"] = (nii, warmup_nii)
    stamp = {
        "slices": slices,
        "layout": LAYOUT,
        **volume_spec,
        "files": {
            label: {"path": path, "warmup": warmup, **volume_spec}
            for label, (path, warmup) in paths.items()
        },
    }
    with open(stamp_path, "w") as f:
        json.dump(stamp, f)


def write_gz(folder: str, slices: int, stamp_path: str) -> None:
    path = os.path.join(folder, "volume.nii.gz")
    warmup = os.path.join(folder, "warmup.nii.gz")
    for name in (path, warmup):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)
    need_space(folder, slices * (1 << 20) + (16 << 20))  # 12 bits of 32 deflate to under it
    shape = (slices, *SLICE)
    total = write_nii_gz(path, shape, GZ_MASK)
    write_nii_gz(warmup, (min(slices, WARMUP_SLICES), *SLICE), GZ_MASK)
    for name in (path, warmup):
        fsync(name)
    nbytes = int(np.prod(shape)) * 4
    spec = {"path": path, "warmup": warmup, "shape": list(shape), "nbytes": nbytes}
    spec |= {"sum": total, "mask": GZ_MASK, "compressed": os.path.getsize(path)}
    with open(stamp_path, "w") as f:
        json.dump({"slices": slices, "files": {".nii.gz": spec}}, f)


def data_range(path: str) -> tuple[int, int, np.dtype, tuple[int, ...]]:
    """(offset of the data, its bytes, dtype, shape) from the .npy header."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        read = (
            np.lib.format.read_array_header_1_0
            if version == (1, 0)
            else np.lib.format.read_array_header_2_0
        )
        shape, _, dtype = read(f)
        offset = f.tell()
    return offset, int(np.prod(shape)) * dtype.itemsize, dtype, tuple(shape)


# -- the page cache -------------------------------------------------------------


def resident(path: str) -> float | None:
    """The share of the file's pages in the page cache (mincore), or None if unknown."""
    size = os.path.getsize(path)
    if size == 0:
        return 1.0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
        libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        page = os.sysconf("SC_PAGE_SIZE")
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        finally:
            os.close(fd)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            vec = np.zeros((size + page - 1) // page, np.uint8)
            if libc.mincore(addr, size, vec.ctypes.data) != 0:
                return None
            return float((vec & 1).mean())
        finally:
            libc.munmap(addr, size)
    except (OSError, AttributeError):
        return None


# -- the methods, in a child process ----------------------------------------------


class Skip(Exception):
    """The method is not available here."""


def method(name: str):
    """(read(path) -> a CUDA tensor holding the array's bytes, mode(path) -> str)."""
    import torch

    if name == "stoker":
        import stoker

        return (lambda path: stoker.load_npy(path, device="cuda")), stoker.gds.read_mode
    if name.startswith("stoker load_array"):
        import stoker

        def stoker_array(path: str):
            return stoker.load_array(path, device="cuda")

        if name.endswith(".nii.gz"):
            return stoker_array, lambda path: "inflated by the C++ core into pinned slots + H2D"
        return stoker_array, stoker.gds.read_mode
    if name.startswith("nibabel"):
        try:
            import nibabel
        except ImportError as e:
            raise Skip(f"nibabel does not import ({e})") from e

        def nibabel_read(path: str):
            image = nibabel.load(path)
            return torch.from_numpy(np.asarray(image.dataobj.get_unscaled())).cuda()

        if name.endswith(".nii.gz"):
            gz = "indexed_gzip" if importlib.util.find_spec("indexed_gzip") else "Python's gzip"
            how = f"nibabel {nibabel.__version__}: inflated by {gz}, pageable host copy"
        else:
            how = f"nibabel {nibabel.__version__}: memory-mapped, pageable host copy"
        return nibabel_read, lambda path: how
    if name == "kvikio":
        try:
            import kvikio
        except ImportError as e:
            raise Skip(f"kvikio does not import ({e})") from e

        def kvikio_read(path: str):
            offset, nbytes, _, _ = data_range(path)
            out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            f = kvikio.CuFile(path, "r")
            try:
                got = f.pread(out, nbytes, offset).get()
            finally:
                f.close()
            if got != nbytes:
                raise OSError(f"kvikio read {got} of {nbytes} bytes")
            return out

        return kvikio_read, lambda path: f"kvikio compat_mode={kvikio_compat(kvikio)}"
    if name == "GdsFile":
        gds = getattr(torch.cuda, "gds", None)
        if gds is None or not hasattr(gds, "GdsFile"):
            raise Skip(f"torch {torch.__version__} has no torch.cuda.gds.GdsFile")

        def gds_read(path: str):
            offset, nbytes, _, _ = data_range(path)
            out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            f = gds.GdsFile(path, os.O_RDONLY)
            try:
                f.load_storage(out.untyped_storage(), offset)
            finally:
                with contextlib.suppress(Exception):
                    f.deregister_handle()
            return out

        return gds_read, lambda path: "cuFile (real GDS or cuFile's compat mode)"

    def numpy_read(path: str):
        return torch.from_numpy(np.load(path)).cuda()

    return numpy_read, lambda path: "pageable host copy"


def kvikio_compat(kvikio) -> str:
    defaults = kvikio.defaults
    for get in (lambda: defaults.get("compat_mode"), lambda: defaults.compat_mode()):
        try:
            return str(get())
        except Exception:
            continue
    return "unknown"


def verify(out, spec: dict, label: str, typed: bool) -> str | None:
    """None if the device tensor holds the volume's bytes (and with `typed`, its shape and
    dtype), else what differs. A NIfTI result (indexed [x, y, z]) is permuted back to the
    stored C order [z, y, x] first: for stoker and nibabel that is a view of their memory."""
    import torch

    n = spec["nbytes"] // 4
    if out.device.type != "cuda":
        return f"the result is on {out.device}"
    if typed:
        want = tuple(spec["shape"])
        if is_nifti(label):
            want = want[::-1]
        if tuple(out.shape) != want:
            return f"shape {tuple(out.shape)}, not {want}"
        if out.dtype != torch.int32:
            return f"dtype {out.dtype}, not torch.int32"
    if is_nifti(label):
        out = out.permute(*reversed(range(out.dim()))).contiguous()  # a no-op if it is a view
    if out.numel() * out.element_size() != spec["nbytes"]:
        return f"{out.numel() * out.element_size()} bytes, not {spec['nbytes']}"
    flat = out.reshape(-1).view(torch.uint8).view(torch.int32)
    total = sum(int(part.sum(dtype=torch.int64)) for part in flat.split(1 << 28))
    if total != spec["sum"]:
        return f"the values sum to {total}, not {spec['sum']}"
    for start in windows(n):
        stop = min(n, start + WINDOW)
        if not np.array_equal(flat[start:stop].cpu().numpy(), values(start, stop, spec["mask"])):
            return f"elements {start}..{stop} differ"
    return None


TAG = "GDS-BENCH "  # the child's result lines start with it


def child(name: str, args, stamp: dict) -> None:
    """One method's process: prints a line (TAG + JSON) the moment each step finishes, so
    a process killed for taking too long still leaves the reads it finished."""

    def emit(kind: str, **data) -> None:
        print(TAG + json.dumps({"kind": kind, **data}), flush=True)

    if name == "kvikio":
        os.environ.setdefault("KVIKIO_NTHREADS", str(min(16, os.cpu_count() or 1)))
    import torch

    import stoker

    try:
        read, mode = method(name)
    except Skip as e:
        emit("skip", reason=str(e))
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # stoker issues each FallbackWarning once a process

        def new_warnings(since: int) -> list[str]:
            return [f"{w.category.__name__}: {w.message}" for w in caught[since:]][:3]

        torch.zeros(1, device="cuda")
        # Reserve the device memory once (torch's caching allocator keeps it) in the pool the
        # method allocates from: stoker's load_npy and load_array allocate on stoker's copy
        # stream, whose pool a reserve on the default stream would not warm; the others
        # allocate on the default stream. Then start the method's machinery (driver, handles,
        # threads) on a small file of the same kind in the same folder. Neither is timed.
        labels = METHODS[name]
        specs = {label: stamp["files"][label] for label in labels}
        pool = torch.cuda.current_stream()
        if name.startswith("stoker"):
            handle = stoker.cuda.copy_stream(torch.cuda.current_device()).handle
            pool = torch.cuda.ExternalStream(handle, device=torch.cuda.current_device())
        most = max(spec["nbytes"] for spec in specs.values())
        with torch.cuda.stream(pool):
            reserve = torch.empty(most + (64 << 20), dtype=torch.uint8, device="cuda")
        del reserve
        warmup_path = specs[labels[0]]["warmup"]
        try:
            warmup = read(warmup_path)
        except Exception as e:
            emit("skip", reason=f"the warm-up read failed: {type(e).__name__}: {e}")
            return
        torch.cuda.synchronize()
        del warmup
        info = {"cuda_status": stoker.cuda_status(), "warmup_warnings": new_warnings(0)}
        try:
            info["warmup_mode"] = mode(warmup_path)
        except Exception as e:
            info["warmup_mode"] = f"unknown ({type(e).__name__}: {e})"
        if name == "kvikio":
            info["kvikio_threads"] = os.environ["KVIKIO_NTHREADS"]
        emit("info", **info)
        for temperature in ("cold", "warm"):  # the headline (cold, np.save) first
            for label, spec in specs.items():
                if temperature not in temperatures(label):
                    continue
                path = spec["path"]
                if temperature == "cold":
                    evict_from_page_cache(path)
                else:
                    read_through([path])
                before = resident(path)
                m = {"file": label, "temperature": temperature, "resident": before}
                try:
                    m["mode"] = mode(path)
                except Exception as e:
                    m["mode"] = f"unknown ({type(e).__name__}: {e})"
                since = len(caught)
                try:
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    result = read(path)
                    torch.cuda.synchronize()
                    m["seconds"] = time.perf_counter() - start
                except Exception as e:
                    m["error"] = f"{type(e).__name__}: {e}"
                    result = None
                if name.startswith("stoker"):  # a fallback at run time shows here
                    try:
                        m["mode_after"] = mode(path)
                    except Exception as e:
                        m["mode_after"] = f"unknown ({type(e).__name__}: {e})"
                m["warnings"] = new_warnings(since)
                if result is not None:
                    m["wrong"] = verify(result, spec, label, typed=name not in RAW)
                    del result
                    torch.cuda.synchronize()
                emit("measurement", **m)


# -- the parent ---------------------------------------------------------------


def measure(name: str, args, slot: _runner.Slot, on_line, sink: list[dict]) -> dict:
    """One method's process (its own process group), killed when `slot` runs out;
    `on_line(kind, item)` is called with each result line it prints the moment it arrives.
    What it reported goes into `sink` at once (so a run stopped meanwhile keeps it) and is
    returned: {"skipped"} or {"measurements", "cuda_status", ...}, with "failed" if it timed
    out, died or was stopped (the measurements it finished are kept)."""
    command = [sys.executable, __file__, "--child", name, "--dir", args.dir]
    command += ["--gib", repr(args.gib)]
    out: dict = {"measurements": []}
    sink.append(out)

    def on_child_line(line: str) -> None:
        if not line.startswith(TAG):  # not one of child()'s lines
            return
        try:
            item = json.loads(line[len(TAG) :])
        except ValueError:
            return
        kind = item.pop("kind")
        if kind == "skip":
            out.clear()
            out["skipped"] = item["reason"]
        elif kind == "info":
            out.update(item)
        else:
            out["measurements"].append(item)
        on_line(kind, item)

    try:
        done = _runner.run_child(command, slot, on_child_line)
    except (_runner.Stop, KeyboardInterrupt):  # SIGTERM, the budget or Ctrl-C while waiting
        out["failed"] = "stopped while running"
        raise
    if done.failed is not None:
        out["failed"] = done.failed
        out["stderr"] = done.stderr
    return out


def _mode_text(m: dict) -> str:
    after = m.get("mode_after")
    if after is None or after == m.get("mode"):
        return m.get("mode", "?")
    return f"{m.get('mode', '?')}, after the read: {after}"


def measurement_line(name: str, m: dict, gb: float, stoker_rate: float | None) -> str:
    where = f"{name} | {m['file']} | {m['temperature']}:"
    share = "?" if m.get("resident") is None else f"{m['resident']:.0%}"
    if "seconds" in m:
        rate = gb / m["seconds"]
        text = f"{where} {rate:.2f} GB/s ({m['seconds']:.3f} s)"
    else:
        rate = None
        text = f"{where} failed: {m.get('error', '?')[:300]}"
    text += f", resident before {share}, mode {_mode_text(m)}"
    if m.get("wrong"):
        text += f", WRONG: {m['wrong']}"
    elif "wrong" in m:
        text += ", exact"
    if m.get("warnings"):
        text += f"; caught: {' | '.join(w[:300] for w in m['warnings'])}"
    if rate and stoker_rate and not name.startswith("stoker"):
        text += f"; stoker / {name} here, this run: {stoker_rate / rate:.2f}x"
    return text


def _gb(stamp: dict, label: str) -> float:
    return stamp["files"][label]["nbytes"] / 1e9


def report(args, stamp: dict, results: dict[str, list[dict]], fs: str) -> dict:
    say(
        f"\n{stamp['nbytes'] / 2**30:.2f} GiB int32 volume {tuple(stamp['shape'])} into GPU "
        f"memory, from {args.dir} ({fs}); median of up to {args.runs} run(s), each method in "
        f"a fresh process per run, {os.cpu_count()} cores."
    )
    gz = stamp["files"].get(".nii.gz")
    if gz is not None and any(".nii.gz" in METHODS[name] for name in results):
        say(
            f"The .nii.gz: a {gz['nbytes'] / 2**30:.2f} GiB int32 volume {tuple(gz['shape'])} "
            f"of 12-bit values, gzip level 1 to {gz['compressed'] / gz['nbytes']:.0%} of its "
            "size; GB/s counts its inflated voxels. Read warm only: inflating on one core is "
            "far slower than the disk, so a cold read adds little but time."
        )
    say(
        "cold: fsync + posix_fadvise(DONTNEED) first, best effort (the 'resident' column is "
        "the share of the file still in the page cache just before the read); warm: the file "
        "was just read through the page cache."
    )
    status = next(
        (r["cuda_status"] for rs in results.values() for r in rs if "cuda_status" in r), None
    )
    if status is not None:
        say(f"stoker.cuda_status(): {status}")
    rates: dict[tuple[str, str, str], float] = {}
    say("\n| method | file | cold GB/s | warm GB/s | resident cold / warm | mode |")
    say("|---|---|---:|---:|---:|---|")
    for name, rs in results.items():
        skipped = next((r["skipped"] for r in rs if "skipped" in r), None)
        if skipped:
            say(f"| {name} | - | skipped: {skipped} | | | |")
            continue
        if not any(r.get("measurements") for r in rs):
            why = sorted({r["failed"] for r in rs if "failed" in r}) or ["not run"]
            say(f"| {name} | - | {'; '.join(why)} | | | |")
            continue
        cut = sorted({r["failed"] for r in rs if "failed" in r})
        for label in METHODS[name]:
            cells, shares, modes, notes = [], [], set(), set()
            for r in rs:
                notes.update(f"warm-up: {w[:200]}" for w in r.get("warmup_warnings", []))
            for temperature in ("cold", "warm"):
                if temperature not in temperatures(label):
                    cells.append(f"{temperature} not read")
                    shares.append("-")
                    continue
                ms = [
                    m
                    for r in rs
                    for m in r.get("measurements", [])
                    if (m["file"], m["temperature"]) == (label, temperature)
                ]
                good = [m for m in ms if "seconds" in m and not m.get("wrong")]
                for m in ms:
                    modes.add(_mode_text(m))
                    if m.get("error"):
                        notes.add(f"error: {m['error'][:160]}")
                    if m.get("wrong"):
                        notes.add(f"WRONG: {m['wrong']}")
                    notes.update(f"caught: {w[:200]}" for w in m.get("warnings", []))
                if good:
                    rate = statistics.median(_gb(stamp, label) / m["seconds"] for m in good)
                    rates[(name, label, temperature)] = rate
                    cells.append(f"{rate:.2f}")
                else:
                    cells.append("failed" if ms else ("; ".join(cut) or "-"))
                known = [m["resident"] for m in ms if m.get("resident") is not None]
                shares.append(f"{statistics.median(known):.0%}" if known else "?")
            mode = "; ".join(sorted(modes)) or "-"
            say(f"| {name} | {label} | {cells[0]} | {cells[1]} | {' / '.join(shares)} | {mode} |")
            for note in sorted(notes):
                say(f"|   | {note} | | | | |")

    def skipped(name: str) -> str | None:
        return next((r["skipped"] for r in results.get(name, []) if "skipped" in r), None)

    def best_other(label: str, temperature: str) -> tuple[str, float] | None:
        others = {
            n: r
            for (n, f, t), r in rates.items()
            if (f, t) == (label, temperature) and not n.startswith("stoker")
        }
        return max(others.items(), key=lambda item: item[1]) if others else None

    ratios: dict[str, float] = {}
    say()
    for temperature in ("cold", "warm"):
        for label in (*MAIN_FILES, ".nii.gz"):
            mine_name, base = STOKER[label], BASELINE[label]
            if temperature not in temperatures(label) or (
                mine_name not in results and base not in results
            ):
                continue
            mine = rates.get((mine_name, label, temperature))
            where = f"{temperature}, {label} file"
            short = base.removesuffix(f" {label}")  # "nibabel + .cuda()", without the file
            if mine is None:
                say(f"{mine_name} / others ({where}): n/a ({mine_name} did not finish it)")
                continue
            best = best_other(label, temperature)
            if label in NPY_FILES and best is not None:
                ratios[f"best_other/{temperature}/{label}"] = mine / best[1]
                say(
                    f"stoker / best other ({where}): {mine / best[1]:.2f}x against {best[0]} "
                    f"(target >= {TARGET_BEST:g})"
                )
            if (base, label, temperature) in rates:
                ratio = mine / rates[(base, label, temperature)]
                kind = "numpy" if label in NPY_FILES else "nibabel"
                ratios[f"{kind}/{temperature}/{label}"] = ratio
                say(f"stoker / ({short}) ({where}): {ratio:.2f}x (target >= {TARGET_BASELINE:g})")
            elif skipped(base):
                say(f"stoker / ({short}) ({where}): n/a ({base} skipped: {skipped(base)})")
    for temperature in ("cold", "warm"):  # the .nii against the .npy: the same bytes
        nii = rates.get(("stoker load_array .nii", ".nii", temperature))
        if nii is None:
            continue
        npy = rates.get(("stoker", "np.save", temperature))
        if npy is not None:
            ratios[f"nii/npy/{temperature}"] = nii / npy
            say(
                f"stoker load_array .nii / stoker load_npy, np.save file ({temperature}): "
                f"{nii / npy:.2f}x (expected about 1: the same bytes by the same path)"
            )
        best = best_other("np.save", temperature)
        if best is not None:
            ratios[f"nii_best_other/{temperature}"] = nii / best[1]
            say(
                f"stoker load_array .nii / best other on the np.save file ({temperature}, the "
                f"same bytes): {nii / best[1]:.2f}x against {best[0]} (target >= {TARGET_BEST:g})"
            )
    best = ratios.get("best_other/cold/np.save")
    base = ratios.get("numpy/cold/np.save")
    say(
        "\nheadline (cold, np.save file): stoker / best other = "
        + (f"{best:.2f}x" if best is not None else "n/a")
        + f" (target >= {TARGET_BEST:g}), stoker / (numpy.load + .cuda()) = "
        + (f"{base:.2f}x" if base is not None else "n/a")
        + f" (target >= {TARGET_BASELINE:g}); stoker's mode: "
        + ("; ".join(_modes(results, "stoker", "np.save")) or "n/a")
    )
    if any(is_nifti(label) for name in results for label in METHODS[name]):
        say(nifti_headline(ratios, results, skipped))
    return ratios


def _modes(results: dict[str, list[dict]], name: str, label: str) -> list[str]:
    """The modes `name` read `label` in (cold, or warm for a file read warm only)."""
    temperature = temperatures(label)[0]
    return sorted(
        {
            _mode_text(m)
            for r in results.get(name, [])
            for m in r.get("measurements", [])
            if (m["file"], m["temperature"]) == (label, temperature)
        }
    )


def nifti_headline(ratios: dict, results: dict[str, list[dict]], skipped=None) -> str:
    """The line gpu_check.sh takes the NIfTI row from."""

    def ratio(key: str, base: str) -> str:
        if key in ratios:
            return f"{ratios[key]:.2f}x"
        why = skipped(base) if skipped is not None else None
        return f"n/a ({why})" if why else "n/a"

    nii, gz = BASELINE[".nii"], BASELINE[".nii.gz"]
    return (
        "headline NIfTI (cold .nii, warm .nii.gz): stoker / (nibabel + .cuda()) = "
        + ratio("nibabel/cold/.nii", nii)
        + " .nii, "
        + ratio("nibabel/warm/.nii.gz", gz)
        + f" .nii.gz (target >= {TARGET_BASELINE:g}); stoker .nii / stoker .npy = "
        + ratio("nii/npy/cold", "")
        + " (expected about 1); stoker's modes: "
        + ("; ".join(_modes(results, STOKER[".nii"], ".nii")) or "n/a")
        + " | "
        + ("; ".join(_modes(results, STOKER[".nii.gz"], ".nii.gz")) or "n/a")
    )


def selected(only: list[str] | None) -> list[str]:
    """The methods --only names, in METHODS's order: an exact name selects only that method
    ("stoker load_array .nii" without its .nii.gz twin), other text every name containing it."""
    if not only:
        return list(METHODS)
    return [n for n in METHODS if any(o == n or (o not in METHODS and o in n) for o in only)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, help="size of the volume (default 4, --quick 1)")
    parser.add_argument(
        "--gz-gib",
        type=float,
        help="size of the .nii.gz volume (default min(--gib, 0.5), --quick min(--gib, 0.25))",
    )
    parser.add_argument("--runs", type=int, help="rounds (default 3, --quick 1)")
    parser.add_argument(
        "--dir",
        default=os.path.join("bench-data", "gds"),
        help="where the files go: a local disk, not a tmpfs (default: bench-data/gds)",
    )
    parser.add_argument(
        "--only",
        nargs="*",
        help="methods to run: an exact name selects that method alone, other text every "
        f"method whose name contains it ({', '.join(METHODS)})",
    )
    _runner.add_arguments(
        parser,
        timeout=900,
        timeout_help="seconds per method process (killed after it; the reads it finished are kept)",
        measured="processes",
        json_help="write the raw results and the ratios here",
    )
    parser.add_argument("--clean", action="store_true", help="delete the files at the end")
    parser.add_argument(
        "--quick", action="store_true", help="1 GiB, a 0.25 GiB .nii.gz, 1 run (gpu_check)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    limits = _runner.Limits(parser, args)
    args.gib = args.gib or (1.0 if args.quick else 4.0)
    args.gz_gib = args.gz_gib or min(args.gib, 0.25 if args.quick else 0.5)
    args.runs = args.runs or (1 if args.quick else 3)
    if args.gib <= 0 or args.gz_gib <= 0 or args.runs < 1:
        parser.error("--gib, --gz-gib and --runs must be positive")
    if args.child:
        child(args.child, args, read_stamps(args.dir))
        return
    missing = _runner.why_no_cuda()
    if missing:
        say(f"gds: skipped: {missing}")
        return
    os.makedirs(args.dir, exist_ok=True)
    fs = fs_type(args.dir)
    if fs in ("tmpfs", "ramfs"):
        say(
            f"warning: {args.dir} is on a {fs}: every read comes from memory, cold means "
            "nothing and O_DIRECT/GDS cannot work there; use --dir on a local disk"
        )
    names = selected(args.only)
    if not names:
        parser.error(f"--only {' '.join(args.only)} names none of: {', '.join(METHODS)}")
    if "kvikio" in names and importlib.util.find_spec("kvikio") is None:
        say("kvikio: skipped: not installed (pip install kvikio-cu12 or -cu13 to include it)")
        names.remove("kvikio")
    results: dict[str, list[dict]] = {n: [] for n in names}
    nibabel = [n for n in names if n.startswith("nibabel")]
    if nibabel and importlib.util.find_spec("nibabel") is None:
        why = "nibabel is not installed (pip install nibabel to include it)"
        say(f"{', '.join(nibabel)}: skipped: {why}")
        for name in nibabel:
            results[name].append({"skipped": why})
    gz_gib = args.gz_gib if any(".nii.gz" in METHODS[n] for n in names) else None
    stamp = None
    measuring = _runner.Interruptible("gds")
    try:
        with measuring:
            t0 = time.monotonic()
            stamp = prepare(args.dir, args.gib, gz_gib)
            say(f"data ready in {args.dir} ({fs}, {time.monotonic() - t0:.0f} s)")
            for run in range(args.runs):
                for name in names:
                    if any("skipped" in r for r in results[name]):
                        continue
                    slot = limits.next_slot()
                    t0 = time.monotonic()

                    def on_line(
                        kind: str, item: dict, name: str = name, run: int = run, t0: float = t0
                    ) -> None:
                        prefix = f"run {run + 1}/{args.runs}"
                        if kind == "skip":
                            say(f"{prefix} {name}: skipped: {item['reason']}")
                        elif kind == "info":
                            caught = item.get("warmup_warnings") or []
                            say(
                                f"{prefix} {name}: ready after {time.monotonic() - t0:.0f} s "
                                f"(warm-up read's mode: {item.get('warmup_mode', '?')})"
                                + (f"; warm-up caught: {' | '.join(caught)}" if caught else "")
                            )
                        else:
                            gb = _gb(stamp, item["file"])
                            ours, mine = STOKER[item["file"]], None
                            if len(results.get(ours, [])) > run and name != ours:
                                for m in results[ours][run].get("measurements", []):
                                    same = (m["file"], m["temperature"])
                                    if same == (item["file"], item["temperature"]):
                                        mine = gb / m["seconds"] if "seconds" in m else None
                            say(f"{prefix} {measurement_line(name, item, gb, mine)}")

                    r = measure(name, args, slot, on_line, results[name])
                    if "failed" in r:
                        tail = r.get("stderr", "").strip()
                        say(
                            f"run {run + 1}/{args.runs} {name}: {r['failed']}; "
                            f"{len(r.get('measurements', []))} read(s) finished"
                            + (f"\n{tail}" if tail else "")
                        )
    finally:
        if args.clean:
            shutil.rmtree(args.dir, ignore_errors=True)
    if stamp is None:
        say("gds: no data was written, nothing was measured")
        say("\nheadline (cold, np.save file): n/a (stopped before the data was written)")
        if any(is_nifti(label) for name in names for label in METHODS[name]):
            say(nifti_headline({}, {}))
        return
    ratios = report(args, stamp, results, fs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"results": results, "ratios": ratios, "fs": fs, "stopped": measuring.stopped},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
