"""stoker under the frameworks its users train with, run for real: Lightning's Trainer
(epochs, checkpoints, ckpt_path resume), torchrun with DDP on gloo, and torchdata's
StatefulDataLoader over a stoker.Dataset with worker processes."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import stoker
from tests.support.shards import write_tar
from tests.support.training import DDP_SCRIPT

BATCH = 8


@pytest.fixture
def shards(tmp_path) -> str:
    folder = tmp_path / "shards"
    folder.mkdir()
    for s in range(3):
        samples = [(f"s{s}/{i:02d}", {"cls": b"%d" % (i % 5)}) for i in range(20)]
        write_tar(folder / f"shard-{s}.tar", samples)
    return str(folder)


@pytest.fixture
def parquet(tmp_path) -> str:
    """The same 60 labels as `shards`, as three Parquet files written by pyarrow in row
    groups of 5: a table source, indexed a piece at a time, under the same loops."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    folder = tmp_path / "parquet"
    folder.mkdir()
    for s in range(3):
        table = pa.table({"cls": pa.array([i % 5 for i in range(20)], pa.int64())})
        pq.write_table(table, folder / f"part-{s}.parquet", row_group_size=5)
    return str(folder)


def _loader(shards: str) -> stoker.Loader:
    return stoker.Loader(stoker.Dataset(shards), BATCH, fields={"cls": stoker.Int()}, seed=7)


# -- Lightning -----------------------------------------------------------------------------


def _fit(
    shards: str, root, seen: list, ckpt_path: str | None = None, callbacks=(), make_loader=None
) -> None:
    """Lightning's Trainer over `make_loader(shards)` (default: the labels only) for 3 epochs;
    `seen` gets (epoch, keys) per step, and the batch's image bytes where it has images."""
    lightning = pytest.importorskip("lightning", reason="lightning is a test dependency")

    class Model(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(1))

        def training_step(self, batch, batch_idx):
            step = (self.current_epoch, tuple(batch["__key__"]))
            seen.append((*step, batch["jpg"].numpy().tobytes()) if "jpg" in batch else step)
            return (self.weight * batch["cls"].float()).mean()

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
        loader = (make_loader or _loader)(shards)
        trainer.fit(Model(), train_dataloaders=loader, ckpt_path=ckpt_path)


@pytest.mark.parametrize("source", ["shards", "parquet"])
def test_lightning_epochs_reshuffle_and_resume_exactly(source, request, tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    shards = request.getfixturevalue(source)
    every_steps = ModelCheckpoint(
        dirpath=tmp_path / "steps", every_n_train_steps=3, save_top_k=-1, filename="{step}"
    )
    every_epoch = ModelCheckpoint(
        dirpath=tmp_path / "epochs", save_top_k=-1, filename="end-{epoch}-{step}"
    )
    seen: list = []
    _fit(shards, tmp_path, seen, callbacks=[every_steps, every_epoch])
    per_epoch = [[keys for epoch, keys in seen if epoch == e] for e in range(3)]
    assert [len(batches) for batches in per_epoch] == [8, 8, 8]  # 60 samples, batches of 8
    flat = [[k for keys in batches for k in keys] for batches in per_epoch]
    assert sorted(flat[0]) == sorted(flat[1]) == sorted(flat[2])  # every sample, every epoch
    assert flat[0] != flat[1] and flat[1] != flat[2] and flat[0] != flat[2]  # reshuffled
    # The orders are stoker's own epochs 0, 1, 2: Lightning's epochs and stoker's agree.
    reference = _loader(shards)
    for epoch, batches in enumerate(per_epoch):
        reference.set_epoch(epoch)
        assert [tuple(b["__key__"]) for b in reference] == batches

    # Resumed from any checkpoint, mid-epoch or at an epoch's end, a new process's loader
    # goes on with exactly the batches the first run had next.
    stream = [keys for _, keys in seen]
    checkpoints = sorted((tmp_path / "steps").iterdir()) + sorted((tmp_path / "epochs").iterdir())
    assert len(checkpoints) >= 8
    for checkpoint in checkpoints:
        step = torch.load(checkpoint, weights_only=False)["global_step"]
        resumed: list = []
        _fit(shards, tmp_path, resumed, ckpt_path=str(checkpoint))
        assert [keys for _, keys in resumed] == stream[step:], checkpoint.name


def _image_loader(shards: str) -> stoker.Loader:
    image = stoker.Image(size=16, crop="random", flip=True)
    fields = {"jpg": image, "cls": stoker.Int()}
    return stoker.Loader(stoker.Dataset(shards), BATCH, fields=fields, seed=7)


def test_lightning_image_crops_change_each_epoch_and_resume_exactly(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint
    from PIL import Image

    folder = tmp_path / "images"
    folder.mkdir()
    for s in range(2):
        samples = []
        for i in range(12):
            pixels = torch.arange(48 * 64 * 3, dtype=torch.int64).reshape(48, 64, 3)
            pixels = ((pixels * (i + 1) + s * 31) % 251).to(torch.uint8).numpy()
            out = io.BytesIO()
            Image.fromarray(pixels).save(out, "JPEG", quality=90)
            samples.append((f"s{s}/{i:02d}", {"jpg": out.getvalue(), "cls": b"%d" % i}))
        write_tar(folder / f"shard-{s}.tar", samples)
    steps = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    seen: list = []
    _fit(str(folder), tmp_path, seen, callbacks=[steps], make_loader=_image_loader)
    # Per epoch, each sample's crop: a new crop of the same image every epoch.
    crops = [{} for _ in range(3)]
    for epoch, keys, pixels in seen:
        per_sample = len(pixels) // len(keys)
        for n, key in enumerate(keys):
            crops[epoch][key] = pixels[n * per_sample : (n + 1) * per_sample]
    assert all(len(c) == 24 for c in crops)
    assert sum(crops[0][k] != crops[1][k] for k in crops[0]) > 20
    # The crops are stoker's own epochs' crops, and resuming reproduces them exactly.
    reference = _image_loader(str(folder))
    reference.set_epoch(2)
    for batch in reference:
        for n, key in enumerate(batch["__key__"]):
            assert batch["jpg"][n].numpy().tobytes() == crops[2][key]
    # Three steps an epoch: step 4 is one batch into epoch 1.
    (checkpoint,) = (tmp_path / "ckpt").glob("*step=4.ckpt")
    step = torch.load(checkpoint, weights_only=False)["global_step"]
    assert step == 4
    resumed: list = []
    _fit(str(folder), tmp_path, resumed, ckpt_path=str(checkpoint), make_loader=_image_loader)
    assert resumed == seen[step:]


# -- torchrun, DDP on gloo ---------------------------------------------------------------
# (the training script: tests/support/training.py, DDP_SCRIPT)


@pytest.mark.parametrize("source", ["shards", "parquet"])
def test_torchrun_ddp_ranks_are_disjoint_and_step_together(source, request, tmp_path):
    shards = request.getfixturevalue(source)
    script = tmp_path / "train.py"
    script.write_text(DDP_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node=2", str(script), shards, str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["rank"], r["world"]) for r in ranks] == [(0, 2), (1, 2)]
    assert ranks[0]["len"] == ranks[1]["len"] == 3  # 60 samples: 30 a rank, 3 full batches
    for epoch in range(2):
        a, b = (set(r["epochs"][epoch]) for r in ranks)
        assert len(a) == len(b) == 24 and not a & b  # disjoint
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1]  # set_epoch reshuffles


# -- torchdata's StatefulDataLoader over a stoker.Dataset ------------------------------


def keys_of(samples: list[dict]) -> list[str]:
    return [s["__key__"] for s in samples]


@pytest.mark.parametrize("source", ["shards", "parquet"])
def test_torchdata_stateful_dataloader_with_workers_resumes_exactly(source, request):
    shards = request.getfixturevalue(source)
    stateful = pytest.importorskip(
        "torchdata.stateful_dataloader", reason="torchdata is a test dependency"
    )

    def make():
        return stateful.StatefulDataLoader(
            stoker.Dataset(shards),
            batch_size=BATCH,
            shuffle=True,
            num_workers=2,
            collate_fn=keys_of,
            generator=torch.Generator().manual_seed(0),
        )

    first = make()
    it = iter(first)
    head = [next(it) for _ in range(3)]
    state = first.state_dict()
    tail = list(it)
    assert sorted(k for keys in head + tail for k in keys) == sorted(
        keys_of(stoker.Dataset(shards).get_batch(range(60)))
    )
    resumed = make()
    resumed.load_state_dict(state)
    assert list(resumed) == tail
