"""How stoker's open, first batch, epoch boundary, memory and throughput move from 1M to 1B
samples.

    python benchmarks/scale.py [--sizes 1M,10M,100M,1B] [--runs 3] [--worlds 8,64]
        [--configs 0/8,7/8] [--steps 400] [--timeout 600] [--rss-limit 12] [--skip-long]
        [--skip-together] [--root /tmp/stoker-scale] [--prepare] [--json OUT]
        [--format tar|parquet] [--file-rows 1000000]

One real tar shard of 10,000 samples (a 16-byte ``.bin`` and an ASCII ``.cls`` each, written
by ``tarfile``, indexed by ``stoker index``); for each size a folder of hard links to it and to
its member-index sidecar, and a ``stoker.json`` listing them: 1M, 10M, 100M, 1B samples are
100, 1,000, 10,000, 100,000 shards. The shards share an inode (or two), so every read is from
the page cache: this measures stoker's own costs as the dataset grows, not the disk.

With ``--format parquet``, one Parquet file of --file-rows rows written by pyarrow in row
groups of 1,000 (``bin``, 16 bytes as FIXED_LEN_BYTE_ARRAY, and ``cls``, int64; snappy, as
pyarrow writes by default), hard-linked into a folder of as many files as each size needs
and opened as that folder, with no manifest: every file's footer is looked at when it
opens.

With ``--format patches``, a ``PatchLoader`` (16^3 patches, uniform) over 1,000 subjects,
hard links of one 64^3 uint8 ``.npy`` volume written by numpy, with as many patches per
subject as the size needs (1B: a million each): what grows is the epoch's plan, not
the data.

With ``--format npy`` or ``--format hdf5``, one file of as many rows as the size's samples:
a .npy of (rows, 16) uint8 written by numpy, or an HDF5 file written by h5py with a
contiguous (rows, 16) uint8 ``bin`` and a (rows,) int64 ``cls``, their data holes (sparse
files) but for the last row; opened as that one file and read as ``Npy()``, or two
``Row()`` fields.

Each measurement is a fresh process (this script with --child), killed when it runs past
--timeout or its RSS passes --rss-limit GB (10^9 bytes; polled every 0.1 s), so that it reads
"> 12 GB (killed)" rather than swapping the machine. For each size, and rank 0 and rank W-1
of each world size W, ``Loader(batch_size=256, shuffle=True, seed=0, drop_last=True)`` over
a Raw and an Int field, medians of --runs processes, the configurations taking turns:

- ``Dataset(manifest)`` seconds; ``Loader(...)`` plus its first batch (torch is imported
  first, untimed, as a training script has it already);
- steady samples/s over the next --steps batches;
- resuming at the last batch of epoch 0 (``load_state_dict``, then that batch), and the epoch
  boundary: from that last batch to the first batch of epoch 1, StopIteration included;
- RSS after the first batch (and less what python, numpy and torch hold: stoker's own), and
  the peak (ru_maxrss).

Once per size, unless --skip-long / --skip-together: rank 7 of 8 reads 1,000 shards' worth
(10M samples, or its whole epoch where that is less) and reports its RSS growth; and ranks
0..7 of 8 run at once to 50 batches past the first, each sampling its RSS and PSS while all 8
are alive (the RSS limit then holds for their sum).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from io import BytesIO
from typing import Any

from stoker.tools.measure import SIBLING_FAILED, proc_status_bytes, run_children

SHARD_SAMPLES = 10_000
SIZES = {"1M": 100, "10M": 1_000, "100M": 10_000, "1B": 100_000}  # label -> shards
SHARD = "shard-000000.tar"
PARQUET_GROUP = 1_000
BATCH = 256
LONG_SAMPLES = 10_000_000  # 1,000 shards' worth
WORLD, TOGETHER_BATCHES = 8, 50  # the long read's and the ranks-at-once world
GB = 1e9
PATCH_SUBJECTS, PATCH_SIZE = 1_000, 16  # --format patches


def say(*parts: object) -> None:
    print(*parts, flush=True)


# -- the data -------------------------------------------------------------------------------


def write_base(folder: str) -> dict:
    """The one real shard, indexed by the CLI; its manifest entry."""
    manifest = os.path.join(folder, "stoker.json")
    if not os.path.exists(manifest):
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, "shard.tmp")
        with tarfile.open(tmp, "w") as tar:
            for i in range(SHARD_SAMPLES):
                for ext, data in (("bin", os.urandom(16)), ("cls", str(i % 1000).encode())):
                    info = tarfile.TarInfo(f"{i:06d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, BytesIO(data))
        os.replace(tmp, os.path.join(folder, SHARD))
        cli = [sys.executable, "-m", "stoker.tools.cli", "index", folder]
        subprocess.run(cli, check=True, stdout=subprocess.DEVNULL)
    with open(manifest) as f:
        (entry,) = json.load(f)["shards"]
    return entry


def another_copy(base: str, folder: str, sha256: str, timeout: float) -> None:
    """A copy of the shard and its sidecar that the sidecar still accepts: it records the
    shard's size and mtime, and a shard whose sidecar is stale is walked header by header."""
    accepted = os.path.join(folder, f".accepted-{sha256}")
    if os.path.exists(accepted):
        return
    os.makedirs(folder, exist_ok=True)
    names = [SHARD, SHARD + ".stoker-idx"]
    for name in names:
        shutil.copy2(os.path.join(base, name), os.path.join(folder, name))
    for attempt in range(2):
        spec = {"kind": "check", "shard": os.path.join(folder, SHARD)}
        (outcome,) = run_group([spec], timeout, 4 * GB)
        if outcome.failed:
            raise SystemExit(f"checking the copy's sidecar failed: {outcome.failed}")
        if not outcome.result["warnings"]:
            open(accepted, "w").close()
            return
        if attempt == 0:
            say(f"the copy's sidecar is stale ({outcome.result['warnings'][0][:80]}...)")
            for name in names:
                st = os.stat(os.path.join(base, name))
                os.utime(os.path.join(folder, name), ns=(st.st_atime_ns, st.st_mtime_ns))
    raise SystemExit("the copy's sidecar is still stale after setting its mtime")


def make_dataset(root: str, label: str, entry: dict, timeout: float) -> tuple[str, float | None]:
    """The manifest of `label`'s dataset and the seconds making it took (None: reused)."""
    shards = SIZES[label]
    folder = os.path.join(root, label)
    manifest = os.path.join(folder, "stoker.json")
    if _complete(manifest, shards, entry):
        return manifest, None
    start = time.perf_counter()
    os.makedirs(folder, exist_ok=True)
    base, copy, entries = os.path.join(root, "base"), 1, []
    for i in range(shards):
        name = f"shard-{i:06d}.tar"
        while True:
            source = os.path.join(base if copy == 1 else f"{base}{copy}", SHARD)
            try:
                for suffix in ("", ".stoker-idx"):
                    _link(source + suffix, os.path.join(folder, name + suffix))
                break
            except OSError as e:  # ext4 allows 65,000 links to an inode, over every size here
                if e.errno != errno.EMLINK:
                    raise
                copy += 1
                another_copy(base, f"{base}{copy}", entry["sha256"], timeout)
        entries.append({**entry, "path": name})
    with open(manifest + ".tmp", "w") as f:  # indented as `stoker index` writes it
        json.dump({"version": 1, "shards": entries}, f, indent=1)
    os.replace(manifest + ".tmp", manifest)  # a run cut short leaves no manifest to reuse
    return manifest, time.perf_counter() - start


def write_parquet_base(folder: str, rows: int) -> str:
    """The one real Parquet file of `rows` rows."""
    path = os.path.join(folder, f"rows-{rows}.parquet")
    if not os.path.exists(path):
        import numpy as np
        import pyarrow as pa
        import pyarrow.parquet as pq

        os.makedirs(folder, exist_ok=True)
        rng = np.random.default_rng(0)
        bins = rng.integers(0, 256, (rows, 16), np.uint8).reshape(-1)
        table = pa.table(
            {
                "bin": pa.FixedSizeBinaryArray.from_buffers(
                    pa.binary(16), rows, [None, pa.py_buffer(bins.tobytes())]
                ),
                "cls": pa.array(np.arange(rows, dtype=np.int64) % 1000),
            }
        )
        pq.write_table(table, path + ".tmp", row_group_size=PARQUET_GROUP)
        os.replace(path + ".tmp", path)
    return path


def make_parquet_dataset(root: str, label: str, base: str, rows: int) -> tuple[str, float | None]:
    """The folder of `label`'s Parquet dataset (hard links of `base`), and the seconds making
    it took (None: reused)."""
    files = SIZES[label] * SHARD_SAMPLES // rows
    folder = os.path.join(root, f"parquet-{rows}-{label}")
    last = os.path.join(folder, f"part-{files - 1:06d}.parquet")
    if os.path.exists(last) and len(os.listdir(folder)) == files:
        return folder, None
    start = time.perf_counter()
    os.makedirs(folder, exist_ok=True)
    source, copy = base, 1
    for i in range(files):
        while True:
            try:
                _link(source, os.path.join(folder, f"part-{i:06d}.parquet"))
                break
            except OSError as e:  # ext4 allows 65,000 links to an inode: another copy
                if e.errno != errno.EMLINK:
                    raise
                copy += 1
                source = f"{base}.{copy}"
                if not os.path.exists(source):
                    shutil.copy2(base, source + ".tmp")
                    os.replace(source + ".tmp", source)
    return folder, time.perf_counter() - start


def make_array_file(root: str, label: str, fmt: str) -> tuple[str, float | None]:
    """One file of `label`'s samples (rows): a .npy of (rows, 16) uint8 written by numpy,
    or an HDF5 file written by h5py with a contiguous (rows, 16) uint8 ``bin`` and a
    (rows,) int64 ``cls``. Their data are holes but for the first and last rows (a sparse
    file costs no disk): what is measured is opening and planning, not the disk."""
    rows = SIZES[label] * SHARD_SAMPLES
    path = os.path.join(root, f"{fmt}-{label}.{'npy' if fmt == 'npy' else 'h5'}")
    if os.path.exists(path):
        return path, None
    import numpy as np

    start = time.perf_counter()
    os.makedirs(root, exist_ok=True)
    tmp = path + ".tmp"
    if fmt == "npy":
        array = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint8, shape=(rows, 16))
        array[[0, rows - 1]] = 7
        array.flush()
        del array
    else:
        import h5py

        with h5py.File(tmp, "w") as f:
            for name, shape, dtype in (("bin", (rows, 16), np.uint8), ("cls", (rows,), np.int64)):
                space = h5py.h5s.create_simple(shape)
                plist = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
                plist.set_fill_time(h5py.h5d.FILL_TIME_NEVER)  # allocated, never written
                h5py.h5d.create(f.id, name.encode(), h5py.h5t.py_create(dtype), space, plist)
                f[name][rows - 1] = 7
    os.replace(tmp, path)
    return path, time.perf_counter() - start


def make_patch_subjects(root: str) -> tuple[str, float | None]:
    """PATCH_SUBJECTS hard links of one 64^3 uint8 .npy volume, for --format patches; the
    folder holding them."""
    folder = os.path.join(root, "patches")
    last = os.path.join(folder, f"v{PATCH_SUBJECTS - 1:05d}.npy")
    if os.path.exists(last):
        return folder, None
    import numpy as np

    start = time.perf_counter()
    os.makedirs(folder, exist_ok=True)
    base = os.path.join(folder, "base.npy")
    np.save(base, np.arange(64**3, dtype=np.uint32).astype(np.uint8).reshape(64, 64, 64))
    for i in range(PATCH_SUBJECTS):
        _link(base, os.path.join(folder, f"v{i:05d}.npy"))
    return folder, time.perf_counter() - start


def _link(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except FileExistsError:  # left by a run cut short, or by another base shard
        if not os.path.samefile(src, dst):
            os.unlink(dst)
            os.link(src, dst)


def _complete(manifest: str, shards: int, entry: dict) -> bool:
    try:
        with open(manifest) as f:
            listed = json.load(f)["shards"]
    except (OSError, ValueError, KeyError):
        return False
    last = os.path.join(os.path.dirname(manifest), f"shard-{shards - 1:06d}.tar.stoker-idx")
    same = all(e.get("sha256") == entry["sha256"] for e in (listed[0], listed[-1]))
    return len(listed) == shards and same and os.path.exists(last)


# -- a measurement, in its own process -----------------------------------------------------


def emit(**values: Any) -> None:
    """One line per finished step: a child killed later still leaves these."""
    print(json.dumps(values), flush=True)


def child(spec: dict) -> None:
    import gc
    import logging

    import stoker

    if spec["kind"] == "check":
        said: list[str] = []

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                said.append(record.getMessage())

        logging.getLogger("stoker").addHandler(Keep())
        ds = stoker.Dataset([spec["shard"]])  # no manifest: indexed (its sidecar read) now
        ds[len(ds) - 1]
        emit(warnings=[w for w in said if "member index" in w])
        return

    start = time.perf_counter()
    import torch  # noqa: F401  (the Loader would import it, and a training script has it)

    gc.collect()  # else the first step timed pays ~0.1 s for a full pass over torch's objects
    rss_torch = proc_status_bytes("VmRSS:")
    emit(torch_import_s=time.perf_counter() - start, rss_torch=rss_torch)
    split = {"rank": spec["rank"], "world_size": spec["world"]}
    if spec["format"] == "patches":
        folder = spec["manifest"]
        start = time.perf_counter()
        subjects = [{"image": os.path.join(folder, f"v{i:05d}.npy")} for i in range(PATCH_SUBJECTS)]
        volumes = stoker.Volumes(subjects)
        emit(open_s=time.perf_counter() - start, rss_open=proc_status_bytes("VmRSS:"))
        start = time.perf_counter()
        per_subject = spec["samples"] // PATCH_SUBJECTS
        loader: Any = stoker.PatchLoader(
            volumes,
            PATCH_SIZE,
            BATCH,
            patches_per_subject=per_subject,
            seed=0,
            drop_last=True,
            **split,
        )
        _first_batch(loader, start, rss_torch, spec)
        return
    start = time.perf_counter()
    ds = stoker.Dataset(spec["manifest"])
    emit(open_s=time.perf_counter() - start, rss_open=proc_status_bytes("VmRSS:"))
    start = time.perf_counter()
    fields: dict[str, Any] = {"bin": stoker.Raw((16,), "uint8"), "cls": stoker.Int()}
    if spec["format"] == "npy":
        fields = {"npy": stoker.Npy()}
    elif spec["format"] == "hdf5":
        fields = {"bin": stoker.Row(), "cls": stoker.Row()}
    loader = stoker.Loader(ds, BATCH, **split, shuffle=True, seed=0, drop_last=True, fields=fields)
    _first_batch(loader, start, rss_torch, spec)


def _first_batch(loader: Any, start: float, rss_torch: int, spec: dict) -> None:
    """Times the loader's first batch (from `start`, before it was made), then the kind of
    measurement `spec` asks for."""
    made = time.perf_counter()
    it = iter(loader)
    next(it)
    first = time.perf_counter() - start
    rss = proc_status_bytes("VmRSS:")
    emit(loader_s=made - start, first_s=first, rss_first=rss, rss_added=rss - rss_torch)
    if spec["kind"] == "single":
        steady_and_boundary(loader, it, spec["steps"])
    elif spec["kind"] == "long":
        long_read(loader, it)
    else:
        together(it, spec["barrier"])
    emit(peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0)


def steady_and_boundary(loader: Any, it: Any, steps: int) -> None:
    # Short of the epoch's last batch: a PatchLoader is at the next epoch once it hands
    # that one out, and the resume below is into epoch 0.
    steps = min(steps, len(loader) - 2)
    start = time.perf_counter()
    for _ in range(steps):
        next(it)
    emit(steady_sps=steps * BATCH / (time.perf_counter() - start), steady_batches=steps)
    it.close()  # its reads ahead are cancelled, as when a loop is left early

    state = loader.state_dict()
    state["batches" if "batches" in state else "batches_done"] = len(loader) - 1
    start = time.perf_counter()
    loader.load_state_dict(state)
    it = iter(loader)
    next(it)
    emit(resume_s=time.perf_counter() - start)
    start = time.perf_counter()  # a training loop's `for` sees StopIteration, then iterates
    if next(it, None) is not None:
        raise RuntimeError("a batch after the last one of epoch 0")
    next(iter(loader))
    emit(boundary_s=time.perf_counter() - start)
    if (epoch := loader.state_dict()["epoch"]) != 1:
        raise RuntimeError(f"the batch after the boundary is of epoch {epoch}, not 1")


def long_read(loader: Any, it: Any) -> None:
    """Memory that grows with the shards read grows without end at scale, however large
    the dataset is. Anonymous memory apart too: a Parquet file's pages are read through its
    mapping, and the page cache's pages mapped in count in RSS (once per hard link, here)."""
    steps = min(LONG_SAMPLES // BATCH, len(loader) - 1)
    anon = proc_status_bytes("RssAnon:")
    high = base = proc_status_bytes("VmRSS:")
    start = time.perf_counter()
    for i in range(steps):
        next(it)
        if i % 500 == 0:
            high = max(high, proc_status_bytes("VmRSS:"))
    took, end = time.perf_counter() - start, proc_status_bytes("VmRSS:")
    emit(long_samples=steps * BATCH, long_s=took, long_rss_start=base, long_rss_end=end)
    emit(long_rss_high=max(high, end), long_anon_growth=proc_status_bytes("RssAnon:") - anon)


def together(it: Any, barrier: str) -> None:
    for _ in range(TOGETHER_BATCHES):
        next(it)
    # Twice: every rank is alive when any samples (a shared page's PSS is split among the
    # processes that map it), and none exits before all have sampled.
    _wait_all(barrier, "ready")
    pss = proc_status_bytes("Pss:", "/proc/self/smaps_rollup")
    emit(together_rss=proc_status_bytes("VmRSS:"), together_pss=pss)
    _wait_all(barrier, "sampled")


def _wait_all(barrier: str, stage: str) -> None:
    open(os.path.join(barrier, f"{stage}-{os.getpid()}"), "w").close()
    while sum(n.startswith(stage + "-") for n in os.listdir(barrier)) < WORLD:
        time.sleep(0.02)  # (a rank that died makes the parent kill the rest)


# -- running children -----------------------------------------------------------------------


@dataclass
class Outcome:
    result: dict = field(default_factory=dict)
    failed: str | None = None  # "> 12 GB (killed)", "timed out after 600 s", "error: ..."
    max_rss: float = 0.0  # its peak RSS as the parent last saw it


def run_group(specs: list[dict], timeout: float, rss_limit: float) -> list[Outcome]:
    """One child per spec, all at once; all are killed when their summed RSS passes
    `rss_limit`, when `timeout` passes, or when one fails (the others would wait at the
    barrier for it)."""
    script = os.path.abspath(__file__)
    commands = [[sys.executable, script, "--child", json.dumps(spec)] for spec in specs]
    outcomes = []
    for run in run_children(commands, timeout=timeout, rss_limit=rss_limit):
        outcome = Outcome(max_rss=run.peak_rss)
        for line in run.lines:
            if line.startswith("{"):
                outcome.result.update(json.loads(line))
        if run.returncode != 0:
            lines = [ln.strip() for ln in run.stderr.splitlines()]
            lines = [ln for ln in lines if ln] or [f"killed by signal {-run.returncode}"]
            if run.returncode > 0 or run.killed is None:  # not killed by us
                outcome.failed = f"error: {lines[-1][:160]}"
            elif run.killed == SIBLING_FAILED:
                outcome.failed = "killed: another rank failed"
            else:
                outcome.failed = run.killed
        outcomes.append(outcome)
    return outcomes


# -- the report -----------------------------------------------------------------------------


def seconds(v: float) -> str:
    return f"{v:.3f} s" if v < 10 else f"{v:.1f} s"


def memory(v: float) -> str:
    return f"{v / 1e6:.0f} MB" if v < GB else f"{v / GB:.2f} GB"


def median_cell(outcomes: list[Outcome], key: str, show: Callable[[float], str]) -> str:
    """The median over runs, or why a run has no value."""
    for o in outcomes:
        if key not in o.result:
            return (o.failed or "not reached").replace("|", "/")
    return show(statistics.median(o.result[key] for o in outcomes)) if outcomes else "-"


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    say(f"\n{title}\n")
    for row in [header, ["---"] * len(header), *rows]:
        say("| " + " | ".join(row) + " |")


def report(results: dict, args: argparse.Namespace) -> None:
    names = [f"rank {c.replace('/', ' / ')}" for c in args.configs]
    patches = args.format == "patches"
    opened, made = ("Volumes", "PatchLoader") if patches else ("Dataset", "Loader")
    for title, key, show in [
        (f"`{opened}(...)` open", "open_s", seconds),
        (f"`{made}(...)` + first batch", "first_s", seconds),
        (f"steady samples/s over {args.steps} batches after the first", "steady_sps", None),
        ("resume: `load_state_dict` at epoch 0's last batch + that batch", "resume_s", seconds),
        ("epoch boundary: last batch of epoch 0 to first batch of epoch 1", "boundary_s", seconds),
        ("RSS after the first batch", "rss_first", memory),
        ("RSS added from after `import torch` to after the first batch", "rss_added", memory),
        ("peak RSS (ru_maxrss)", "peak", memory),
    ]:
        rows = []
        for label in args.sizes:
            cells = []
            for name in names:
                runs = results[label]["single"].get(name, [])
                if show is not None:
                    cells.append(median_cell(runs, key, show))
                    continue
                cell = median_cell(runs, key, lambda v: f"{v:,.0f}/s")
                fewer = runs[0].result.get("steady_batches", args.steps) if runs else args.steps
                cells.append(cell + (f" ({fewer} batches)" if fewer < args.steps else ""))
            rows.append([label, *cells])
        table(f"{title}, median of {args.runs}:", ["N", *names], rows)

    if not args.skip_long:
        rows = []
        for label in args.sizes:
            (o,) = results[label]["long"] or [Outcome(failed="not run")]
            r = o.result
            if "long_rss_high" not in r:
                rows.append([label, (o.failed or "not reached").replace("|", "/"), *[""] * 6])
                continue
            samples, before = r["long_samples"], r["long_rss_start"]
            note = "" if samples * 2 > LONG_SAMPLES else " (the whole epoch)"
            rows.append(
                [label, f"{samples:,} = {samples / SHARD_SAMPLES:,.1f} shards{note}"]
                + [seconds(r["long_s"]), memory(before), memory(r["long_rss_end"])]
                + [memory(r["long_rss_end"] - before), memory(r["long_rss_high"] - before)]
                + [memory(r.get("long_anon_growth", float("nan")))]
            )
        table(
            f"RSS while reading 1,000 shards' worth after the first batch, rank {WORLD - 1} / "
            f"{WORLD}, one run:",
            ["N", "samples read", "seconds", "RSS before", "RSS after", "growth", "most growth"]
            + ["anonymous growth"],
            rows,
        )

    if not args.skip_together:
        rows = []
        for label in args.sizes:
            outs = results[label]["together"]
            if outs and all("together_pss" in o.result for o in outs):
                rss = sum(o.result["together_rss"] for o in outs)
                pss = sum(o.result["together_pss"] for o in outs)
                slowest = [seconds(max(o.result[k] for o in outs)) for k in ("open_s", "first_s")]
                rows.append([label, memory(rss), memory(pss), *slowest])
            else:
                bad = next((o.failed for o in outs if o.failed), "not reached")
                seen = memory(sum(o.max_rss for o in outs)) if outs else "-"
                rows.append([label, bad.replace("|", "/"), f"(summed RSS seen: {seen})", "", ""])
        table(
            f"ranks 0..{WORLD - 1} of {WORLD} at once, each sampled after its first batch + "
            f"{TOGETHER_BATCHES} while all are alive, one run:",
            ["N", "sum of RSS", "sum of PSS", "slowest open", "slowest Loader + first batch"],
            rows,
        )


# -- the run --------------------------------------------------------------------------------


def measure(label: str, manifest: str, args: argparse.Namespace, into: dict, raw: list) -> None:
    # which fields the children ask for (and, for patches, how many an epoch)
    data = {"format": args.format, "samples": SIZES[label] * SHARD_SAMPLES}

    def run(what: str, specs: list[dict]) -> list[Outcome]:
        start = time.perf_counter()
        outs = run_group(specs, args.timeout, args.rss_limit * GB)
        took = time.perf_counter() - start
        failed = next((o.failed for o in outs if o.failed), None)
        say(f"  {label} {what}: {took:.1f} s" + (f", {failed}" if failed else ""))
        raw.append({"size": label, "what": what, "seconds": took, "specs": specs})
        raw[-1]["outcomes"] = [vars(o) for o in outs]
        return outs

    for i in range(args.runs):  # configurations take turns, so drift hits them alike
        for config in args.configs:
            r, w = map(int, config.split("/"))
            spec = {"kind": "single", "manifest": manifest, "rank": r, "world": w, **data}
            name = f"rank {r} / {w}"
            outs = run(f"{name}, run {i + 1}", [{**spec, "steps": args.steps}])
            into["single"].setdefault(name, []).extend(outs)
    if not args.skip_long:
        spec = {"kind": "long", "manifest": manifest, "rank": WORLD - 1, "world": WORLD, **data}
        into["long"] = run("long read", [spec])
    if not args.skip_together:
        barrier = tempfile.mkdtemp(prefix="stoker-scale-barrier-")
        spec = {"kind": "together", "manifest": manifest, "world": WORLD, "barrier": barrier}
        spec.update(data)
        specs = [{**spec, "rank": r} for r in range(WORLD)]
        into["together"] = run(f"{WORLD} ranks at once", specs)
        shutil.rmtree(barrier, ignore_errors=True)


def _stop(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # the children are killed on the way out, the tables printed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default=",".join(SIZES), help="of 1M,10M,100M,1B")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--worlds", default="8,64")
    parser.add_argument("--configs", help="RANK/WORLD,... (default: 0 and W-1 of each world)")
    parser.add_argument("--steps", type=int, default=400, help="batches timed for samples/s")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per child")
    parser.add_argument("--rss-limit", type=float, default=12, help="GB per child (or group)")
    parser.add_argument("--skip-long", action="store_true")
    parser.add_argument("--skip-together", action="store_true")
    parser.add_argument("--root", default="/tmp/stoker-scale")
    parser.add_argument("--prepare", action="store_true", help="make the datasets, measure nothing")
    parser.add_argument("--json", help="write every raw result here")
    parser.add_argument(
        "--format", choices=("tar", "parquet", "npy", "hdf5", "patches"), default="tar"
    )
    parser.add_argument("--file-rows", type=int, default=1_000_000, help="parquet: rows a file")
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    args.sizes = args.sizes.split(",")
    if unknown := [s for s in args.sizes if s not in SIZES]:
        parser.error(f"unknown sizes {unknown}: choose from {','.join(SIZES)}")
    worlds = [int(w) for w in args.worlds.split(",")]
    default = [f"{r}/{w}" for w in worlds for r in (0, w - 1)]
    args.configs = args.configs.split(",") if args.configs else default

    command = shlex.join(["python", *sys.argv])
    git = ["git", "-C", os.path.dirname(os.path.abspath(__file__))]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True)
    dirty = subprocess.run([*git, "status", "-s", ":/python", ":/csrc"], capture_output=True)
    version = commit.stdout.decode().strip() + (" + uncommitted changes" if dirty.stdout else "")
    say(f"$ {command}")
    say(f"stoker at {version}; {os.cpu_count()} cores; batches of {BATCH}")

    made: dict[str, float | None] = {}
    manifests = {}
    if args.format == "patches":
        folder, took = make_patch_subjects(args.root)
        for label in args.sizes:
            manifests[label], made[label] = folder, took
            patches = SIZES[label] * SHARD_SAMPLES
            say(f"{label}: {PATCH_SUBJECTS:,} subjects of {patches // PATCH_SUBJECTS:,} patches")
    elif args.format in ("npy", "hdf5"):
        for label in args.sizes:
            manifests[label], made[label] = make_array_file(args.root, label, args.format)
            how = "reused" if made[label] is None else f"made in {made[label]:.3f} s"
            say(f"{label}: one {args.format} file of {SIZES[label] * SHARD_SAMPLES:,} rows, {how}")
    elif args.format == "parquet":
        base = write_parquet_base(os.path.join(args.root, "base"), args.file_rows)
        for label in args.sizes:
            manifests[label], made[label] = make_parquet_dataset(
                args.root, label, base, args.file_rows
            )
            how = "reused" if made[label] is None else f"made in {made[label]:.3f} s"
            files = SIZES[label] * SHARD_SAMPLES // args.file_rows
            say(f"{label}: {files:,} Parquet files of {args.file_rows:,} rows, {how}")
    else:
        entry = write_base(os.path.join(args.root, "base"))
        for label in args.sizes:
            manifests[label], made[label] = make_dataset(args.root, label, entry, args.timeout)
            how = "reused" if made[label] is None else f"made in {made[label]:.3f} s"
            say(f"{label}: {SIZES[label]:,} shards of {SHARD_SAMPLES:,} samples, {how}")
    if args.prepare:
        return

    results = {label: {"single": {}, "long": [], "together": []} for label in args.sizes}
    raw: list[dict] = []
    signal.signal(signal.SIGTERM, _stop)
    try:
        for label in args.sizes:
            began = time.perf_counter()
            measure(label, manifests[label], args, results[label], raw)
            say(f"{label}: {time.perf_counter() - began:.0f} s in all")
    except KeyboardInterrupt:
        say("stopped: the tables hold what finished")
    report(results, args)
    if args.json:
        with open(args.json, "w") as f:
            out = {"command": command, "stoker": version, "made_s": made, "runs": raw}
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
