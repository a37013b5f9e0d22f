"""PatchLoader with the medical-imaging frameworks its users have, as they use them: MONAI's
data lists, loaders and dictionary transforms, TorchIO's subjects, images and transforms;
a patch equals the same crop of what their own loaders read."""

from __future__ import annotations

import json

import numpy as np
import pytest

import stoker
from tests.support.nifti_volumes import write_nifti

monai = pytest.importorskip("monai")
tio = pytest.importorskip("torchio")
torch = pytest.importorskip("torch")

from monai.data import decollate_batch, list_data_collate, load_decathlon_datalist  # noqa: E402
from monai.transforms import (  # noqa: E402
    Compose,
    EnsureChannelFirstd,
    LoadImaged,
    RandFlipd,
    ScaleIntensityRanged,
    SpatialCropd,
)


@pytest.fixture
def decathlon(tmp_path):
    """A Medical Segmentation Decathlon task folder: imagesTr/, labelsTr/ and its
    dataset.json, the volumes written by nibabel with a non-trivial affine."""
    rng = np.random.default_rng(0)
    (tmp_path / "imagesTr").mkdir()
    (tmp_path / "labelsTr").mkdir()
    training = []
    affine = np.array([[0.8, 0, 0, -40], [0, 0.7, 0, 12], [0, 0, 1.5, 3], [0, 0, 0, 1]])
    truth = []
    for i, shape in enumerate([(40, 36, 30), (32, 44, 28)]):
        image = rng.integers(-1000, 1000, shape).astype(np.int16)
        label = np.zeros(shape, np.uint8)
        label[8:20, 10:22, 6:18] = 1 + i
        name = f"case_{i:03d}.nii.gz"
        write_nifti(str(tmp_path / "imagesTr" / name), image, 1, affine=affine)
        write_nifti(str(tmp_path / "labelsTr" / name), label, 1, affine=affine)
        training.append({"image": f"./imagesTr/{name}", "label": f"./labelsTr/{name}"})
        truth.append((image, label))
    (tmp_path / "dataset.json").write_text(json.dumps({"name": "test", "training": training}))
    return tmp_path, truth


def test_a_decathlon_datalist_patch_equals_monais_crop(decathlon):
    root, _ = decathlon
    datalist = load_decathlon_datalist(str(root / "dataset.json"), True, "training")
    volumes = stoker.Volumes.from_monai(datalist, cache_dir=str(root / "cache"))
    loader = stoker.PatchLoader(volumes, (16, 12, 10), 4, patches_per_subject=4)
    load = Compose([LoadImaged(["image", "label"]), EnsureChannelFirstd(["image", "label"])])
    loaded = [load(item) for item in datalist]
    checked = 0
    for batch in loader:
        for b in range(len(batch["subject_index"])):
            start = [int(v) for v in batch["location"][b]]
            end = [s + p for s, p in zip(start, loader.patch_size)]
            item = loaded[int(batch["subject_index"][b])]
            crop = SpatialCropd(["image", "label"], roi_start=start, roi_end=end)(item)
            for key in ("image", "label"):
                want = np.asarray(crop[key])
                np.testing.assert_array_equal(batch[key][b].numpy(), want.astype(want.dtype))
            # MONAI's meta tensor carries the volume's affine; stoker's is the patch's own.
            volume_affine = np.asarray(item["image"].affine, np.float64)
            shift = np.eye(4)
            shift[:3, 3] = start
            np.testing.assert_allclose(batch["affine"][b].numpy(), volume_affine @ shift)
            checked += 1
    assert checked == 8


def test_monai_dictionary_transforms_take_a_decollated_batch(decathlon):
    root, _ = decathlon
    datalist = load_decathlon_datalist(str(root / "dataset.json"), True, "training")
    volumes = stoker.Volumes.from_monai(datalist, cache_dir=str(root / "cache"))
    loader = stoker.PatchLoader(
        volumes, 16, 4, sampler=stoker.LabelSampler("label", ratio=(1, 1)), patches_per_subject=4
    )
    transforms = Compose(
        [
            ScaleIntensityRanged("image", a_min=-1000, a_max=1000, b_min=0.0, b_max=1.0, clip=True),
            RandFlipd(["image", "label"], prob=0.5, spatial_axis=0),
        ]
    )
    for batch in loader:
        samples = decollate_batch({"image": batch["image"].float(), "label": batch["label"]})
        out = list_data_collate([transforms(s) for s in samples])
        assert out["image"].shape == (4, 1, 16, 16, 16)
        assert float(out["image"].min()) >= 0 and float(out["image"].max()) <= 1
        assert out["label"].shape == (4, 1, 16, 16, 16)


def torchio_subjects(root):
    return tio.SubjectsDataset(
        [
            tio.Subject(
                image=tio.ScalarImage(root / "imagesTr" / f"case_{i:03d}.nii.gz"),
                label=tio.LabelMap(root / "labelsTr" / f"case_{i:03d}.nii.gz"),
                age=40 + i,
            )
            for i in range(2)
        ]
    )


def test_a_torchio_subjects_dataset_patch_equals_torchios_own_read(decathlon):
    root, _ = decathlon
    subjects = torchio_subjects(root)
    volumes = stoker.Volumes.from_torchio(subjects, cache_dir=str(root / "cache"))
    assert volumes.metadata[1]["age"] == 41
    loader = stoker.PatchLoader(
        volumes, 12, 4, sampler=stoker.LabelSampler("label", class_weights={0: 1, 1: 3, 2: 3})
    )
    for batch in loader:
        for b in range(len(batch["subject_index"])):
            subject = subjects[int(batch["subject_index"][b])]
            x, y, z = (int(v) for v in batch["location"][b])
            for key in ("image", "label"):
                want = subject[key].data[:, x : x + 12, y : y + 12, z : z + 12]
                np.testing.assert_array_equal(
                    batch[key][b].numpy(), want.numpy().astype(batch[key].numpy().dtype)
                )
            np.testing.assert_allclose(
                batch["affine"][b].numpy()[:3, :3], subject["image"].affine[:3, :3]
            )


def test_torchio_transforms_take_a_patch_as_a_subject(decathlon):
    root, _ = decathlon
    volumes = stoker.Volumes.from_torchio(torchio_subjects(root), cache_dir=str(root / "cache"))
    transform = tio.Compose([tio.RandomFlip(axes=(0,)), tio.RescaleIntensity((0, 1))])
    for batch in stoker.PatchLoader(volumes, 16, 2, patches_per_subject=2):
        for b in range(2):
            affine = batch["affine"][b].numpy()
            patch = tio.Subject(
                image=tio.ScalarImage(tensor=batch["image"][b].float(), affine=affine),
                label=tio.LabelMap(tensor=batch["label"][b], affine=affine),
            )
            out = transform(patch)
            assert out["image"].data.shape == (1, 16, 16, 16)
            assert float(out["image"].data.max()) <= 1


def test_stoker_grid_and_aggregator_rebuild_what_monai_sliding_window_does(decathlon):
    root, truth = decathlon
    from monai.inferers import sliding_window_inference

    volumes = stoker.Volumes.from_folders(
        {"image": root / "imagesTr", "label": root / "labelsTr"}, cache_dir=str(root / "cache")
    )
    image = torch.from_numpy(truth[0][0].astype(np.float32))[None, None]

    def model(x):
        return x * 2 + 1

    monai_out = sliding_window_inference(image, (16, 16, 16), 4, model, overlap=0.25)[0]
    grid = stoker.PatchLoader(volumes, 16, 4, sampler=stoker.GridSampler(overlap=0.25))
    aggregator = stoker.PatchAggregator(volumes.spatial_shape(0), (16, 16, 16), channels=1)
    for batch in grid:
        keep = batch["subject_index"] == 0
        aggregator.add(model(batch["image"][keep].float()), batch["location"][keep])
    torch.testing.assert_close(aggregator.result(), monai_out)
