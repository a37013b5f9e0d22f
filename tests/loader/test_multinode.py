"""More than one node, for real: torchrun with two "nodes" on this machine (two torchrun
agents, --nnodes=2, each with 2 processes and a node cache of its own) over shards served
by HTTP. Every sample is read once an epoch across the 4 ranks, every rank steps as often,
each node downloads only the shards its ranks read, all 4 ranks resume exactly from a
mid-epoch state, and one node of 3 ranks resumes it elastically."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from stoker.tools.cli import main as cli
from tests.support.server import ShardServer
from tests.support.shards import write_tar
from tests.support.training import torchrun

SHARDS, PER_SHARD, BATCH = 16, 40, 8

NODE_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch.distributed as dist
    import stoker

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    source, cache, out, mode = sys.argv[1:5]
    node = os.environ["GROUP_RANK"]  # torchrun's number of this node
    ds = stoker.Dataset(source, cache_dir=os.path.join(cache, f"node{node}"))
    loader = stoker.Loader(
        ds, BATCH, fields={"cls": stoker.Int()}, drop_last=True, seed=5, shuffle_window=2
    )
    result = {"rank": rank, "world": dist.get_world_size(), "len": len(loader)}
    if mode == "run":
        keys, state = [], None
        for i, batch in enumerate(loader):
            keys.append(batch["__key__"])
            if i == 1:
                state = loader.state_dict()  # after 2 batches: any rank's serves every rank
        result.update(keys=keys, state=state)
    else:
        with open(os.path.join(out, "state.json")) as f:
            loader.load_state_dict(json.load(f))
        result["keys"] = [batch["__key__"] for batch in loader]
    with open(os.path.join(out, f"{mode}-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    """
).replace("BATCH", str(BATCH))


@pytest.fixture(scope="module", params=["manifest", "bare"])
def served(tmp_path_factory, request):
    """SHARDS tar shards (tarfile) behind an HTTP server, and the source to open: their
    manifest (`stoker index`), or (bare) the shards alone, named by a brace pattern: no
    manifest and no member index beside them, so that opening must look into them."""
    folder = tmp_path_factory.mktemp("served")
    keys = []
    for s in range(SHARDS):
        samples = [
            (f"s{s:02d}-{i:03d}", {"cls": str(i).encode(), "bin": bytes([s, i]) * 600})
            for i in range(PER_SHARD)
        ]
        keys += [k for k, _ in samples]
        write_tar(folder / f"shard-{s:02d}.tar", samples)
    if request.param == "manifest":
        assert cli(["index", str(folder)]) == 0
    shard_bytes = sum(os.path.getsize(folder / f"shard-{s:02d}.tar") for s in range(SHARDS))
    with ShardServer(str(folder)) as server:
        source = server.url_for("stoker.json")
        if request.param == "bare":
            source = f"{server.url}/shard-{{00..{SHARDS - 1:02d}}}.tar"
        yield server, source, keys, shard_bytes


def _results(out, mode: str, world: int) -> list[dict]:
    return [json.loads((out / f"{mode}-rank{r}.json").read_text()) for r in range(world)]


def test_two_nodes_read_every_sample_once_and_resume(served, tmp_path):
    server, source, keys, shard_bytes = served
    script = tmp_path / "node.py"
    script.write_text(NODE_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    server.reset_counters()
    torchrun(script, [source, str(tmp_path / "cache"), str(out), "run"], nodes=2, per_node=2)
    run = _results(out, "run", 4)
    assert [r["world"] for r in run] == [4] * 4
    assert len({r["len"] for r in run}) == 1  # every rank steps as often (DDP needs it)
    read = [k for r in run for batch in r["keys"] for k in batch]
    assert sorted(read) == sorted(keys)  # 640 = 4 ranks x 20 batches of 8: nothing dropped
    # Each node fetched the shards its own ranks read, once: about the dataset in all
    # (a shard two nodes' stretches share is fetched by both). Without a manifest too: a
    # node downloads, to count their samples, only the shards its ranks will read.
    tar_bytes = sum(
        size for method, path, size in _sent(server) if method == "GET" and path.endswith(".tar")
    )
    print(f"two nodes were sent {tar_bytes / shard_bytes:.2f}x the dataset's shard bytes")
    assert tar_bytes <= 1.25 * shard_bytes, (tar_bytes, shard_bytes)

    # All 4 ranks, from the state one of them saved after 2 batches.
    (out / "state.json").write_text(json.dumps(run[1]["state"]))
    torchrun(script, [source, str(tmp_path / "cache"), str(out), "resume"], nodes=2, per_node=2)
    resumed = _results(out, "resume", 4)
    for before, after in zip(run, resumed):
        assert after["keys"] == before["keys"][2:]

    # Elastic: one node of 3 ranks shares out what the 4 had not read.
    elastic = tmp_path / "elastic"
    elastic.mkdir()
    (elastic / "state.json").write_text(json.dumps(run[0]["state"]))
    torchrun(script, [source, str(tmp_path / "cache"), str(elastic), "resume"], nodes=1, per_node=3)
    rest = _results(elastic, "resume", 3)
    assert len({len(r["keys"]) for r in rest}) == 1
    done = [k for r in run for batch in r["keys"][:2] for k in batch]
    later = [k for r in rest for batch in r["keys"] for k in batch]
    assert sorted(done + later) == sorted(keys)  # each sample once, none lost


def _sent(server) -> list[tuple[str, str, int]]:
    """(method, path, bytes of body) of each answered request, from its Range header or the
    file's size."""
    found = []
    for record in server.requests:
        if record.status >= 400:  # (the look for a manifest beside bare shards)
            continue
        size = os.path.getsize(os.path.join(server.root, record.path))
        if record.range:
            lo, _, hi = record.range.split("=", 1)[1].partition("-")
            size = min(size - 1, int(hi) if hi else size - 1) - int(lo or 0) + 1
        found.append((record.method, record.path, size if record.method == "GET" else 0))
    return found
