"""A large .npy straight into GPU memory: stoker.load_npy against kvikio, torch's GdsFile and
numpy.load + .cuda().

    python benchmarks/gds.py [--gib 4] [--runs 3] [--dir bench-data/gds] [--only NAME ...]
                             [--timeout SECONDS] [--budget SECONDS] [--json FILE] [--clean]
                             [--quick]

One int32 volume of --gib GiB (slices of 512x512, every value a hash of its position, so a
byte in the wrong place changes the checksums) is written once under --dir twice: as a
plain ``numpy.save`` file (data at byte 128) and through ``stoker.GDSCache.put`` (data on a
4 KiB boundary). --dir should be on the local disk: on a tmpfs nothing can be cold and
O_DIRECT/GDS cannot work (the benchmark names the file system and warns). The methods:

- stoker: ``stoker.load_npy(path, device="cuda")``, in the mode ``stoker.gds.read_mode``
  names (``gds``: cuFile with real GPUDirect; ``compat``: cuFile's POSIX mode, only with
  STOKER_GDS=on; ``bounce``: stoker's pinned ring);
- kvikio, when it imports: ``kvikio.CuFile(path, "r").pread(buffer, size, offset).get()``
  into a torch CUDA buffer, with KVIKIO_NTHREADS set to the core count (at most 16) unless
  it is set already; its mode is kvikio's compat setting (ON: POSIX reads, no cuFile);
- torch's ``torch.cuda.gds.GdsFile(path, os.O_RDONLY)`` (O_DIRECT added by torch),
  ``load_storage`` into a CUDA storage, when this torch has it: cuFile, which runs as real
  GDS or in its compatibility mode by what the system offers (``stoker.cuda_status()``
  reports which);
- ``numpy.load(path)`` then ``torch.from_numpy(a).cuda()``: the baseline.

Each method reads both files cold and then both warm, in a fresh process per method and
round (the methods take turns for --runs rounds, stoker and numpy first since the headline
ratios need them, then GdsFile, then kvikio; tables show medians). Cold: the file is fsynced
and evicted from the page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)`` first; this is
best effort, so the share of its pages still resident (``mincore``) is reported. Warm: the
file is read through the page cache just before (methods that open with O_DIRECT bypass
that cache by design, so warm and cold can coincide for them). Before its first timed read
each process reserves the device memory once in the pool it allocates from (stoker's
load_npy allocates on stoker's copy stream, the others on the default stream) and reads a
small file in the same folder with the same method, so driver start-up, cudaMalloc and
cuFile's start are not timed. The clock covers allocating the destination, the read and
``torch.cuda.synchronize()``. For stoker, ``stoker.gds.read_mode`` is asked before and
again after each read (a cuFile failure makes stoker fall back at run time), and every
warning caught (a ``stoker.FallbackWarning`` says why) is shown, the warm-up read's too.
Every result is verified on the GPU: the sum of all values and eight 16 KiB windows (the
first, the last, six at pseudo-random places) must equal the source's. GB/s counts the
array's bytes (1 GB = 1e9 bytes).

Each read's result is printed the moment it finishes. A method process that runs past
--timeout seconds is killed and reported as timed out, keeping the reads it finished; with
--budget, nothing starts or runs past that many seconds from the start; on SIGTERM or
Ctrl-C the running process is killed. In every case the tables and the headline are
printed from whatever finished. --quick (what scripts/gpu_check.sh runs): 1 GiB, one
round. Without a usable CUDA device the benchmark says so and exits with status 0.
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
import subprocess
import sys
import time
import warnings

import _runner
import numpy as np
from _runner import say

SLICE = (512, 512)  # one slice: 1 MiB of int32
# in the order they run: the headline ratios (stoker, numpy) first
METHODS = ["stoker", "numpy.load + .cuda()", "GdsFile", "kvikio"]
BASELINE = "numpy.load + .cuda()"
FILES = {"np.save": "plain.npy", "GDSCache": None}  # GDSCache's path comes from put()
WINDOW = 4096  # elements per verified window
TARGET_BEST, TARGET_NUMPY = 1.0, 2.0


def values(start: int, stop: int) -> np.ndarray:
    """The volume's elements [start, stop): a hash of each position, as int32."""
    i = np.arange(start, stop, dtype=np.uint64)
    h = (i * np.uint64(2654435761) + np.uint64(0x9E3779B9)) & np.uint64(0xFFFFFFFF)
    h ^= h >> np.uint64(15)
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


def prepare(folder: str, gib: float) -> dict:
    """Write the two files and a small warm-up file unless a stamp says they are there."""
    slices = max(1, round(gib * 1024))
    stamp_path = os.path.join(folder, "stamp.json")
    if os.path.exists(stamp_path):
        with open(stamp_path) as f:
            stamp = json.load(f)
        if stamp.get("slices") == slices and all(
            os.path.exists(p) for p in stamp["files"].values()
        ):
            return stamp
        os.unlink(stamp_path)
    import torch

    import stoker

    shutil.rmtree(os.path.join(folder, "cache"), ignore_errors=True)
    for name in (FILES["np.save"], "warmup.npy"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(folder, name))
    os.makedirs(folder, exist_ok=True)
    need = 2 * slices * (1 << 20) + (64 << 20)
    free = shutil.disk_usage(folder).free
    if free < need:
        sys.exit(
            f"gds: {folder} has {free / 2**30:.1f} GiB free; the files need {need / 2**30:.1f}"
        )
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
    plain = os.path.join(folder, FILES["np.save"])
    np.save(plain + ".part.npy", volume)
    os.replace(plain + ".part.npy", plain)
    cache = stoker.GDSCache(os.path.join(folder, "cache"))
    aligned = cache.put(f"volume-{slices}", torch.from_numpy(volume))
    warmup = os.path.join(folder, "warmup.npy")
    np.save(warmup, volume[: min(slices, 16)])
    for path in (plain, aligned, warmup):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    stamp = {
        "slices": slices,
        "shape": list(shape),
        "nbytes": volume.nbytes,
        "sum": total,
        "files": {"np.save": plain, "GDSCache": aligned},
        "warmup": warmup,
    }
    with open(stamp_path, "w") as f:
        json.dump(stamp, f)
    return stamp


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


def evict(path: str) -> None:
    """Best effort: write back, then ask the kernel to drop the file's cached pages."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm(path: str) -> None:
    buffer = bytearray(64 << 20)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass


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


def verify(out, stamp: dict) -> str | None:
    """None if the device tensor holds the volume's bytes, else what differs."""
    import torch

    n = stamp["nbytes"] // 4
    if out.device.type != "cuda":
        return f"the result is on {out.device}"
    if out.numel() * out.element_size() != stamp["nbytes"]:
        return f"{out.numel() * out.element_size()} bytes, not {stamp['nbytes']}"
    flat = out.reshape(-1).view(torch.uint8).view(torch.int32)
    total = sum(int(part.sum(dtype=torch.int64)) for part in flat.split(1 << 28))
    if total != stamp["sum"]:
        return f"the values sum to {total}, not {stamp['sum']}"
    for start in windows(n):
        stop = min(n, start + WINDOW)
        if not np.array_equal(flat[start:stop].cpu().numpy(), values(start, stop)):
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
        # method allocates from: stoker.load_npy allocates on stoker's copy stream, whose
        # pool a reserve on the default stream would not warm; the others allocate on the
        # default stream. Then start the method's machinery (driver, handles, threads) on a
        # small file in the same folder. Neither is timed.
        pool = torch.cuda.current_stream()
        if name == "stoker":
            handle = stoker.cuda.copy_stream(torch.cuda.current_device()).handle
            pool = torch.cuda.ExternalStream(handle, device=torch.cuda.current_device())
        with torch.cuda.stream(pool):
            reserve = torch.empty(stamp["nbytes"] + (64 << 20), dtype=torch.uint8, device="cuda")
        del reserve
        try:
            warmup = read(stamp["warmup"])
        except Exception as e:
            emit("skip", reason=f"the warm-up read failed: {type(e).__name__}: {e}")
            return
        torch.cuda.synchronize()
        del warmup
        info = {"cuda_status": stoker.cuda_status(), "warmup_warnings": new_warnings(0)}
        try:
            info["warmup_mode"] = mode(stamp["warmup"])
        except Exception as e:
            info["warmup_mode"] = f"unknown ({type(e).__name__}: {e})"
        if name == "kvikio":
            info["kvikio_threads"] = os.environ["KVIKIO_NTHREADS"]
        emit("info", **info)
        for temperature in ("cold", "warm"):  # the headline (cold, np.save) first
            for label, path in stamp["files"].items():
                if temperature == "cold":
                    evict(path)
                else:
                    warm(path)
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
                if name == "stoker":  # a fallback at run time shows here
                    try:
                        m["mode_after"] = stoker.gds.read_mode(path)
                    except Exception as e:
                        m["mode_after"] = f"unknown ({type(e).__name__}: {e})"
                m["warnings"] = new_warnings(since)
                if result is not None:
                    m["wrong"] = verify(result, stamp)
                    if name == "stoker" and m["wrong"] is None:
                        if tuple(result.shape) != tuple(stamp["shape"]):
                            m["wrong"] = f"shape {tuple(result.shape)}, not {tuple(stamp['shape'])}"
                        elif result.dtype != torch.int32:
                            m["wrong"] = f"dtype {result.dtype}, not torch.int32"
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
    if rate and stoker_rate and name != "stoker":
        text += f"; stoker / {name} here, this run: {stoker_rate / rate:.2f}x"
    return text


def report(args, stamp: dict, results: dict[str, list[dict]], fs: str) -> dict:
    gb = stamp["nbytes"] / 1e9
    say(
        f"\n{stamp['nbytes'] / 2**30:.2f} GiB int32 volume {tuple(stamp['shape'])} into GPU "
        f"memory, from {args.dir} ({fs}); median of up to {args.runs} run(s), each method in "
        f"a fresh process per run, {os.cpu_count()} cores."
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
        for label in stamp["files"]:
            cells, shares, modes, notes = [], [], set(), set()
            for r in rs:
                notes.update(f"warm-up: {w[:200]}" for w in r.get("warmup_warnings", []))
            for temperature in ("cold", "warm"):
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
                    rate = statistics.median(gb / m["seconds"] for m in good)
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
    ratios: dict[str, float] = {}
    say()
    for temperature in ("cold", "warm"):
        for label in stamp["files"]:
            mine = rates.get(("stoker", label, temperature))
            others = {
                n: r
                for (n, f, t), r in rates.items()
                if (f, t) == (label, temperature) and n != "stoker"
            }
            where = f"{temperature}, {label} file"
            if mine is None:
                say(f"stoker / best other ({where}): n/a (stoker did not finish it)")
                continue
            if others:
                best = max(others, key=others.get)
                ratio = mine / others[best]
                ratios[f"best_other/{temperature}/{label}"] = ratio
                say(
                    f"stoker / best other ({where}): {ratio:.2f}x against {best} "
                    f"(target >= {TARGET_BEST:g})"
                )
            if BASELINE in others:
                ratio = mine / others[BASELINE]
                ratios[f"numpy/{temperature}/{label}"] = ratio
                say(
                    f"stoker / (numpy.load + .cuda()) ({where}): {ratio:.2f}x "
                    f"(target >= {TARGET_NUMPY:g})"
                )
    best = ratios.get("best_other/cold/np.save")
    base = ratios.get("numpy/cold/np.save")
    stoker_modes = sorted(
        {
            _mode_text(m)
            for r in results.get("stoker", [])
            for m in r.get("measurements", [])
            if (m["file"], m["temperature"]) == ("np.save", "cold")
        }
    )
    say(
        "\nheadline (cold, np.save file): stoker / best other = "
        + (f"{best:.2f}x" if best is not None else "n/a")
        + f" (target >= {TARGET_BEST:g}), stoker / (numpy.load + .cuda()) = "
        + (f"{base:.2f}x" if base is not None else "n/a")
        + f" (target >= {TARGET_NUMPY:g}); stoker's mode: "
        + ("; ".join(stoker_modes) or "n/a")
    )
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, help="size of the volume (default 4, --quick 1)")
    parser.add_argument("--runs", type=int, help="rounds (default 3, --quick 1)")
    parser.add_argument(
        "--dir",
        default=os.path.join("bench-data", "gds"),
        help="where the files go: a local disk, not a tmpfs (default: bench-data/gds)",
    )
    parser.add_argument("--only", nargs="*", help="substrings of the method names to run")
    _runner.add_arguments(
        parser,
        timeout=900,
        timeout_help="seconds per method process (killed after it; the reads it finished are kept)",
        measured="processes",
        json_help="write the raw results and the ratios here",
    )
    parser.add_argument("--clean", action="store_true", help="delete the files at the end")
    parser.add_argument("--quick", action="store_true", help="1 GiB, 1 run (gpu_check)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    limits = _runner.Limits(parser, args)
    args.gib = args.gib or (1.0 if args.quick else 4.0)
    args.runs = args.runs or (1 if args.quick else 3)
    if args.gib <= 0 or args.runs < 1:
        parser.error("--gib and --runs must be positive")
    if args.child:
        with open(os.path.join(args.dir, "stamp.json")) as f:
            stamp = json.load(f)
        child(args.child, args, stamp)
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
    names = [n for n in METHODS if not args.only or any(o in n for o in args.only)]
    if "kvikio" in names and importlib.util.find_spec("kvikio") is None:
        say("kvikio: skipped: not installed (pip install kvikio-cu12 or -cu13 to include it)")
        names.remove("kvikio")
    results: dict[str, list[dict]] = {n: [] for n in names}
    stamp = None
    measuring = _runner.Interruptible("gds")
    try:
        with measuring:
            t0 = time.monotonic()
            stamp = prepare(args.dir, args.gib)
            say(f"data ready in {args.dir} ({fs}, {time.monotonic() - t0:.0f} s)")
            gb = stamp["nbytes"] / 1e9
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
                            mine = None
                            if len(results.get("stoker", [])) > run and name != "stoker":
                                for m in results["stoker"][run].get("measurements", []):
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
