"""Training scripts the tests run under torchrun, as users' own would be."""

import os
import socket
import subprocess
import sys
import textwrap

#: DDP on gloo over a stoker Loader: argv[1] a dataset, argv[2] a folder for rank<N>.json
#: (rank, world size, length, and the keys each epoch gave).
DDP_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    import stoker

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ds = stoker.Dataset(sys.argv[1])
    # rank and world size come from torch.distributed
    loader = stoker.Loader(ds, 8, fields={"cls": stoker.Int()}, drop_last=True, seed=3)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    epochs = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        keys = []
        for batch in loader:  # every rank takes as many steps: DDP's all-reduce would hang
            loss = model(batch["cls"].float()[:, None]).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            keys.extend(batch["__key__"])
        epochs.append(keys)
    out = {"rank": loader.rank, "world": loader.world_size, "len": len(loader), "epochs": epochs}
    with open(f"{sys.argv[2]}/rank{rank}.json", "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
    # torch 2.13's gloo works launched inside backward() hold a Python object (the context
    # backward stashes), and a gloo thread frees the last all-reduce's work after the step
    # has returned. If that thread asks for the GIL while the interpreter is finalizing,
    # the process aborts (one run in 15 here; a barrier alone made it rarer, not rare).
    # Nothing is left to write, so the process leaves without finalizing.
    os._exit(0)
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script, args, *, nodes: int, per_node: int, timeout: float = 300) -> None:
    """`nodes` torchrun agents at once, one per node, `per_node` processes each."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    port = free_port()
    agents = []
    for node in range(nodes):
        command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}"]
        command += [f"--node_rank={node}", f"--nproc_per_node={per_node}"]
        command += ["--master_addr=127.0.0.1", f"--master_port={port}", str(script), *args]
        agents.append(
            subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
            )
        )
    for agent in agents:
        _, err = agent.communicate(timeout=timeout)
        assert agent.returncode == 0, err[-3000:]
