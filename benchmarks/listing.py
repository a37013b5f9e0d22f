"""Remote datasets of 100,000 objects: listing a store prefix, and opening a remote manifest
that lists them, against a local S3-compatible store (SeaweedFS's ``weed mini``).

    python benchmarks/listing.py [--objects 100000] [--runs 5] [--root /tmp]

The store holds --objects small objects under ``shards/`` (each a few bytes: listing and
opening read no shard) and a ``stoker.json`` listing them as 10,000-sample tar shards, as
``stoker index`` writes it. Side by side, each a fresh process, medians of --runs, taking
turns:

- listing the prefix with botocore's ``list_objects_v2`` paginator (what boto3, s3fs and
  the peers' S3 readers do), and with stoker's fetcher (the listing a ``Dataset("s3://...")``
  of a prefix makes);
- ``stoker.Dataset("s3://bench/stoker.json")``: the manifest fetched and parsed and every
  shard described from it (no request per shard), and its peak RSS.

Uploading the objects is not timed (about 3 ms each through botocore).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import _tests_support  # noqa: F401  (tests.support, below)

from stoker.tools import measure

BUCKET = "bench"
TIMEOUT = 600  # seconds per measurement, far over any at the default size: a hang stops the run


def child(kind: str) -> None:
    import botocore.session

    import stoker
    from stoker.remote import FetchOptions, fetcher_for

    start = time.perf_counter()  # (imports untimed: a training script has them already)
    if kind == "botocore":
        client = botocore.session.get_session().create_client(
            "s3", endpoint_url=os.environ["AWS_ENDPOINT_URL_S3"]
        )
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix="shards/")
        found = sum(len(page.get("Contents", ())) for page in pages)
    elif kind == "stoker-list":
        fetcher = fetcher_for(FetchOptions())
        url = f"s3://{BUCKET}/shards/"
        fetcher.cache_url(url)
        found = len(fetcher.call(fetcher.list_objects(url)))
    else:
        found = len(stoker.Dataset(f"s3://{BUCKET}/stoker.json").shards)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "found": found, "rss": measure.peak_rss_bytes()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child")
    parser.add_argument("--objects", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--root", default=None)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    from tests.support.object_store import SeaweedS3

    with SeaweedS3() as store:
        env = {
            **os.environ,
            "AWS_ENDPOINT_URL_S3": store.endpoint,
            "AWS_ACCESS_KEY_ID": store.access_key,
            "AWS_SECRET_ACCESS_KEY": store.secret_key,
            "AWS_REGION": store.region,
            "AWS_EC2_METADATA_DISABLED": "true",
            "STOKER_CACHE": os.path.join(str(store.root), "cache"),
        }
        store.make_bucket(BUCKET)
        start = time.perf_counter()
        names = [f"shards/shard-{i:06d}.tar" for i in range(args.objects)]
        store.put_many(BUCKET, {name: b"tar" for name in names})
        entries = [
            {"path": name, "bytes": 3, "samples": 10_000, "fields": ["bin", "cls"]}
            for name in names
        ]
        manifest = json.dumps({"version": 1, "shards": entries}, indent=1).encode()
        store.put(BUCKET, "stoker.json", manifest)
        print(
            f"{args.objects} objects and a {len(manifest) / 1e6:.1f} MB manifest uploaded in "
            f"{time.perf_counter() - start:.0f} s",
            flush=True,
        )
        kinds = ["botocore", "stoker-list", "stoker-open"]
        got: dict[str, list[dict]] = {k: [] for k in kinds}
        for _ in range(args.runs):
            for kind in kinds:
                done = measure.run_child(
                    [sys.executable, __file__, "--child", kind], timeout=TIMEOUT, env=env
                )
                result = done.result
                if done.failed is not None or result is None:
                    raise SystemExit(f"{kind}: {done.failed or 'no result'}\n{done.stderr}")
                assert result["found"] == args.objects, (kind, result)
                got[kind].append(result)
        base = statistics.median(r["seconds"] for r in got["botocore"])
        print(f"\n{args.objects} objects, medians of {args.runs} processes")
        print("| what | seconds | vs botocore | peak RSS |")
        print("|---|---:|---:|---:|")
        for kind in kinds:
            s = statistics.median(r["seconds"] for r in got[kind])
            rss = statistics.median(r["rss"] for r in got[kind]) / 1e6
            print(f"| {kind} | {s:.2f} | {base / s:.2f}x | {rss:.0f} MB |")


if __name__ == "__main__":
    main()
