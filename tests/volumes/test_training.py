"""PatchLoader in the training loops its users run: Lightning's Trainer (epochs and exact
resume from its checkpoints) and torchrun with two nodes, each with its own node cache
(each node inflates the .nii.gz volumes once), DDP stepping on every rank."""

from __future__ import annotations

import json
import textwrap
import warnings

import numpy as np
import pytest

import stoker
from tests.support.nifti_volumes import volume, write_nifti
from tests.support.training import torchrun

torch = pytest.importorskip("torch")


@pytest.fixture
def subjects(tmp_path):
    rows = []
    for i in range(4):
        image = volume(np.int16, (20, 18, 16), i)
        label = (volume(np.uint8, (20, 18, 16), 10 + i) > 180).astype(np.uint8)
        rows.append(
            {
                "id": f"s{i}",
                "image": write_nifti(str(tmp_path / f"ct{i}.nii.gz"), image),
                "label": write_nifti(str(tmp_path / f"seg{i}.nii.gz"), label),
            }
        )
    return rows


def make_loader(subjects, cache):
    volumes = stoker.Volumes(subjects, cache_dir=str(cache))
    return stoker.PatchLoader(
        volumes, 8, 2, sampler=stoker.LabelSampler("label"), patches_per_subject=3, seed=11
    )


def fit(subjects, root, seen, ckpt_path=None, callbacks=()):
    lightning = pytest.importorskip("lightning")

    class Model(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(1))

        def training_step(self, batch, batch_idx):
            seen.append((self.current_epoch, batch["subject"], batch["location"].tolist()))
            return (self.weight * batch["image"].float()).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = lightning.Trainer(
        max_epochs=3,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        callbacks=list(callbacks),
        default_root_dir=str(root),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on DataLoader workers
        trainer.fit(
            Model(), train_dataloaders=make_loader(subjects, root / "cache"), ckpt_path=ckpt_path
        )


def test_lightning_epochs_and_exact_resume(subjects, tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    every = ModelCheckpoint(
        dirpath=tmp_path / "steps", every_n_train_steps=4, save_top_k=-1, filename="{step}"
    )
    seen: list = []
    fit(subjects, tmp_path, seen, callbacks=[every])
    per_epoch = [[s for s in seen if s[0] == e] for e in range(3)]
    assert [len(e) for e in per_epoch] == [6, 6, 6]  # 12 patches an epoch, batches of 2
    reference = make_loader(subjects, tmp_path / "cache")
    for epoch, steps in enumerate(per_epoch):  # Lightning's epochs are stoker's
        reference.set_epoch(epoch)
        assert [b["location"].tolist() for b in reference] == [s[2] for s in steps]
    assert per_epoch[0] != per_epoch[1]
    stream = [s[1:] for s in seen]
    checkpoints = sorted((tmp_path / "steps").iterdir())
    assert len(checkpoints) >= 3
    for checkpoint in checkpoints:
        step = torch.load(checkpoint, weights_only=False)["global_step"]
        resumed: list = []
        fit(subjects, tmp_path, resumed, ckpt_path=str(checkpoint))
        assert [s[1:] for s in resumed] == stream[step:], checkpoint.name


DDP_PATCHES = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    import stoker

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    subjects, cache, out = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    node = os.environ["GROUP_RANK"]
    volumes = stoker.Volumes(subjects, cache_dir=os.path.join(cache, f"node{node}"))
    loader = stoker.PatchLoader(volumes, 8, 2, patches_per_subject=5, seed=4)  # ranks: dist's
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    epochs = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        patches = []
        for batch in loader:
            loss = model(batch["image"].float().mean(dim=(1, 2, 3, 4))[:, None]).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            patches += [[s, at] for s, at in zip(batch["subject"], batch["location"].tolist())]
        epochs.append(patches)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": loader.rank, "world": loader.world_size, "epochs": epochs}, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # as tests/support/training.py's DDP script does, and why
    """
)


def test_torchrun_two_nodes_split_the_patches(subjects, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(DDP_PATCHES)
    out = tmp_path / "out"
    out.mkdir()
    torchrun(script, [json.dumps(subjects), str(tmp_path / "cache"), str(out)], nodes=2, per_node=1)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world"] for r in ranks] == [2, 2]
    alone = stoker.PatchLoader(
        stoker.Volumes(subjects, cache_dir=str(tmp_path / "alone")),
        8,
        2,
        patches_per_subject=5,
        seed=4,
        rank=0,
        world_size=1,
    )
    for epoch in range(2):
        alone.set_epoch(epoch)
        everything = [[s, at] for b in alone for s, at in zip(b["subject"], b["location"].tolist())]
        mine = [r["epochs"][epoch] for r in ranks]
        assert len(mine[0]) == len(mine[1]) == 10  # 20 patches, two equal stretches
        assert mine[0] + mine[1] == everything
    # each node inflated the volumes (4 images, 4 labels) into its own cache, once
    for node in range(2):
        assert len(list((tmp_path / "cache" / f"node{node}" / "volumes").glob("*.raw"))) == 8
