"""Packing JPEGs re-encoded at 256: ``stoker pack --image-size 256`` in one process, the same
with ``--ray`` on one and on two Ray workers, LitData's ``optimize`` with two workers, and
webdataset's ``ShardWriter`` fed by a ``multiprocessing.Pool`` of two; plus Ray's fixed
costs (starting a local cluster, and one empty task). The ``--ray`` entries run twice:
starting a local cluster of their own, as ``--ray`` alone does, and joining one started
beforehand (``ray start --head``, outside the timing), as on a cluster that is already up.

    python benchmarks/pack.py [--images 20000] [--runs 3] [--only NAME ...]

The data (written once under --data): --images JPEGs of photographs at ImageNet's usual
sizes (quality 90, as benchmarks/decode.py makes them) in 100 class folders. Every entry
reads them all, makes each one's shorter side 256 pixels (JPEG quality 90) and writes
shards of about 64 MB. The peers re-encode with Pillow, its JPEG draft mode first (the
decoder's own downscaling by 1/2, 1/4 or 1/8, as a careful user would ask for) then a
resize; stoker decodes with libjpeg-turbo's scaled IDCT and resizes on its C++ threads.
Each measurement is a fresh process, timed from its start (imports and a Ray cluster's
start-up included, since a user pays them) to its last shard written. The entries take
turns for --runs rounds; the table shows medians, images/s and the ratio to LitData.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
import statistics
import sys
import time

import decode  # the photographs (benchmarks/ is on sys.path: these run as scripts)

from stoker.tools import measure

SIZE = 256
QUALITY = 90
CLASSES = 100
SHARD_BYTES = 64 << 20
TIMEOUT = 3600.0  # seconds a measurement may take


def prepare(folder: str, n: int) -> str:
    """The class-per-folder tree of `n` JPEGs under `folder` (made once)."""
    from PIL import Image

    tree = os.path.join(folder, "images")
    stamp = os.path.join(folder, f"done-{n}")
    if not os.path.exists(stamp):
        shutil.rmtree(folder, ignore_errors=True)
        rng = random.Random(0)
        photos = [Image.fromarray(p) for p in decode._photos()]
        for i in range(n):
            label = i % CLASSES
            where = os.path.join(tree, f"class{label:03d}")
            os.makedirs(where, exist_ok=True)
            with open(os.path.join(where, f"{i:06d}.jpg"), "wb") as f:
                f.write(decode.photo_jpeg(photos[i % len(photos)], rng))
        open(stamp, "w").close()
    return tree


def images_of(tree: str) -> list[tuple[str, int]]:
    return [
        (os.path.join(tree, folder, name), c)
        for c, folder in enumerate(sorted(os.listdir(tree)))
        for name in sorted(os.listdir(os.path.join(tree, folder)))
    ]


def pillow_resized(path: str) -> bytes:
    """The peers' re-encode: shorter side SIZE, with the decoder's draft downscaling."""
    from PIL import Image

    with Image.open(path) as image:
        image.draft("RGB", (SIZE, SIZE))  # the largest 1/2^k scale still at least SIZE
        image = image.convert("RGB")
        scale = SIZE / min(image.size)
        if scale < 1:
            size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
            image = image.resize(size, Image.BILINEAR)
        out = io.BytesIO()
        image.save(out, "JPEG", quality=QUALITY)
        return out.getvalue()


# -- the entries (each in a child process) -------------------------------------------


def run_stoker(tree: str, out: str, ray: int | None, address: str | None = None) -> dict:
    from stoker.tools.cli import main

    extra: list[str] = ["--ray", address] if address else []
    started = None
    if ray is not None:
        import ray as ray_module

        t = time.perf_counter()
        ray_module.init(num_cpus=ray, include_dashboard=False, log_to_driver=False)
        started = time.perf_counter() - t
        extra = ["--ray"]
    args = [tree, out, "--image-size", str(SIZE), "--quality", str(QUALITY)]
    code = main(["pack", *args, "--shard-size", str(SHARD_BYTES), "--quiet", *extra])
    if code:
        raise SystemExit(f"stoker pack exited with {code}")
    return {"ray_start_s": started} if started is not None else {}


def litdata_item(item: tuple[str, int]) -> dict:
    path, label = item
    return {"jpg": pillow_resized(path), "cls": label}


def run_litdata(tree: str, out: str) -> dict:
    from litdata import optimize

    optimize(
        fn=litdata_item,
        inputs=images_of(tree),
        output_dir=out,
        chunk_bytes=SHARD_BYTES,
        num_workers=2,
        verbose=False,
    )
    return {}


def wds_item(item: tuple[int, str, int]) -> dict:
    i, path, label = item
    return {"__key__": f"{i:06d}", "jpg": pillow_resized(path), "cls": str(label).encode()}


def run_webdataset(tree: str, out: str) -> dict:
    import multiprocessing

    import webdataset as wds

    os.makedirs(out)
    items = [(i, p, c) for i, (p, c) in enumerate(images_of(tree))]
    pattern = os.path.join(out, "shard-%06d.tar")
    with (
        multiprocessing.get_context("fork").Pool(2) as pool,
        wds.ShardWriter(pattern, maxsize=SHARD_BYTES, verbose=0) as sink,
    ):
        for sample in pool.imap(wds_item, items, chunksize=64):
            sink.write(sample)
    return {}


def run_ray_costs(tree: str, out: str) -> dict:
    """Ray's fixed costs: a local cluster's start, and an empty task's round trip after
    the first (through run_each, as the pack's tasks go)."""
    import ray

    from stoker.ray.tasks import run_each

    t = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    start = time.perf_counter() - t
    t = time.perf_counter()
    list(run_each(1, str))
    first = time.perf_counter() - t
    t = time.perf_counter()
    tasks = 40
    list(run_each(tasks, str))
    return {
        "ray_start_s": start,
        "first_job_s": first,
        "per_task_s": (time.perf_counter() - t) / tasks,
    }


ENTRIES = {
    "stoker pack": lambda tree, out: run_stoker(tree, out, None),
    "stoker pack --ray, 1 worker": lambda tree, out: run_stoker(tree, out, 1),
    "stoker pack --ray, 2 workers": lambda tree, out: run_stoker(tree, out, 2),
    "LitData optimize(num_workers=2)": run_litdata,
    "webdataset ShardWriter + Pool(2)": run_webdataset,
}
#: The --ray entries joining a cluster already up: its CPUs.
JOINING = {"--ray auto, 1 worker (cluster up)": 1, "--ray auto, 2 workers (cluster up)": 2}
RAY_PORT = 6391


def ray_command(*args: str) -> None:
    import subprocess

    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    subprocess.run([ray, *args], check=True, capture_output=True, timeout=300)


def child(name: str, tree: str, out: str) -> dict:
    began = time.perf_counter()
    if name == "ray costs":
        return run_ray_costs(tree, out)
    # (joining by "auto": Ray then reads the token `ray start` made, see docs/cluster.md)
    joined = name in JOINING
    extra = run_stoker(tree, out, None, "auto") if joined else ENTRIES[name](tree, out)
    return {"seconds": time.perf_counter() - began, **extra}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--data", default="/tmp/stoker-bench-pack")
    parser.add_argument("--only", nargs="+", choices=[*ENTRIES, *JOINING], help="run only these")
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.tree, args.out)))
        return
    tree = prepare(args.data, args.images)
    names = args.only or [*ENTRIES, *JOINING]
    results: dict[str, list[dict]] = {n: [] for n in [*names, "ray costs"]}
    failed: dict[str, str] = {}
    out = os.path.join(args.data, "out")
    for round_ in range(args.runs):
        for name in [*names, "ray costs"]:
            if name in failed:
                continue
            shutil.rmtree(out, ignore_errors=True)
            command = [sys.executable, __file__, "--child", name, "--tree", tree, "--out", out]
            if name in JOINING:
                ray_command(
                    "start",
                    "--head",
                    f"--port={RAY_PORT}",
                    f"--num-cpus={JOINING[name]}",
                    "--include-dashboard=false",
                    "--disable-usage-stats",
                )
            try:
                run = measure.run_child(command, timeout=TIMEOUT)
            finally:
                if name in JOINING:
                    ray_command("stop", "--force")
            if run.failed:
                failed[name] = f"{run.failed}: {run.stderr[-400:]}"
                print(f"{name}: {failed[name]}", flush=True)
                continue
            figures = json.loads(run.lines[-1])
            figures["peak_rss"] = run.peak_rss
            results[name].append(figures)
            seconds = figures.get("seconds")
            said = f"{seconds:.1f} s" if seconds else json.dumps(figures)
            print(f"round {round_ + 1}: {name}: {said}", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    report(results, failed, args.images)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"images": args.images, "results": results, "failed": failed}, f, indent=1)


def report(results: dict[str, list[dict]], failed: dict[str, str], images: int) -> None:
    median = {
        n: statistics.median(r["seconds"] for r in runs)
        for n, runs in results.items()
        if runs and "seconds" in runs[0]
    }
    base = median.get("LitData optimize(num_workers=2)")
    print(f"\n{images:,} JPEGs re-encoded at {SIZE} (medians of {max(map(len, results.values()))})")
    print(f"{'entry':40} {'seconds':>8} {'images/s':>9} {'vs LitData':>10} {'peak RSS':>9}")
    for name, seconds in median.items():
        ratio = f"{base / seconds:.2f}x" if base else "-"
        rss = max(r["peak_rss"] for r in results[name]) / 1e6
        print(f"{name:40} {seconds:8.1f} {images / seconds:9.0f} {ratio:>10} {rss:8.0f}M")
    for one, two in [
        ("stoker pack --ray, 1 worker", "stoker pack --ray, 2 workers"),
        (*JOINING,),
    ]:
        if median.get(one) and median.get(two):
            print(f"{two}: {median[one] / median[two]:.2f}x its 1-worker figure")
    costs = results.get("ray costs") or []
    if costs:
        get = lambda key: statistics.median(c[key] for c in costs)  # noqa: E731
        print(
            f"Ray's fixed costs: start-up {get('ray_start_s'):.1f} s, a first job "
            f"{get('first_job_s'):.2f} s, then {1e3 * get('per_task_s'):.0f} ms a task"
        )
    for name, why in failed.items():
        print(f"{name}: failed: {why}")


if __name__ == "__main__":
    main()
