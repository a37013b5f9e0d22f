"""Patches of volumes: byte for byte what numpy slicing of nibabel's and numpy's own reads
gives, for every layout and both edge rules; the samplers' statistics and coverage; the
aggregator; the loader's guarantees (threads, resume, ranks, workers); bad inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import stoker
from stoker.volumes.boxes import patch_runs
from stoker.volumes.samplers import block_bounds, start_around
from tests.support.nifti_volumes import flip_byte, reference, write_nifti
from tests.support.nifti_volumes import volume as random_volume
from tests.support.patches import all_batches, check_batches, expected_patch

nib = pytest.importorskip("nibabel")
torch = pytest.importorskip("torch")


def nifti(path, data, affine=None, *, big_endian=False, gz=False, qform=False, version=1):
    """`data` as path.nii (or path.nii.gz), written by nibabel."""
    name = str(path) + (".nii.gz" if gz else ".nii")
    options = {} if affine is None else {"affine": affine}
    return write_nifti(name, data, version, big_endian=big_endian, qform_only=qform, **options)


def volume(shape, dtype=np.int16, seed=0):
    return random_volume(dtype, shape, seed)


# -- layouts -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.int16, np.float32, np.uint8, np.float64])
@pytest.mark.parametrize("kind", ["nii", "nii.gz", "npy", "npy-fortran", "nii-big-endian"])
def test_patches_are_exact(tmp_path, kind, dtype):
    shapes = [(23, 17, 11), (9, 30, 14)]
    truth, subjects = [], []
    for i, shape in enumerate(shapes):
        data = volume(shape, dtype, seed=i)
        base = tmp_path / f"v{i}"
        if kind.startswith("nii"):
            path = nifti(base, data, gz=kind == "nii.gz", big_endian="big" in kind)
            data = reference(path)  # what nibabel reads
        else:
            path = str(base) + ".npy"
            np.save(path, np.asfortranarray(data) if "fortran" in kind else data)
            data = np.load(path)
        truth.append(np.asarray(data))
        subjects.append({"image": path, "id": f"s{i}"})
    vols = stoker.Volumes(subjects, cache_dir=tmp_path / "cache")
    loader = stoker.PatchLoader(vols, (8, 7, 12), 3, patches_per_subject=5, seed=1)
    assert check_batches(loader, truth) == 10
    grid = stoker.PatchLoader(
        vols, (8, 7, 12), 4, sampler=stoker.GridSampler(overlap=2), pad_value=5
    )
    assert check_batches(grid, truth, pad=5) > 10


def test_batches_kept_stay_whole_and_batches_let_go_are_reused(tmp_path):
    """CPU batches come from the reader's ring: a batch the caller holds is never handed
    out again, and one let go of is."""
    data = volume((40, 36, 30))
    np.save(tmp_path / "v.npy", data)
    vols = stoker.Volumes([{"image": str(tmp_path / "v.npy")}])
    loader = stoker.PatchLoader(vols, (8, 8, 8), 4, patches_per_subject=64, seed=3)
    kept = all_batches(loader)  # every batch of the epoch held at once
    assert check_batches(kept, [data], patch_size=loader.patch_size) == 64
    assert len({b["image"].data_ptr() for b in kept}) == len(kept)
    del kept
    loader.set_epoch(1)
    places = [b["image"].data_ptr() for b in loader]  # each let go of at once
    assert len(set(places)) < len(places)


def test_one_batch_of_subjects_stored_in_other_axis_orders(tmp_path):
    # A .nii (Fortran order), a .npy and a Fortran .npy of one cubic shape: their stored
    # boxes look alike, but each is turned into the patch's order by its own axes.
    shape = (20, 20, 20)
    truth, subjects = [], []
    for i, kind in enumerate(["nii", "npy", "npy-fortran"]):
        data = volume(shape, np.int16, seed=i)
        if kind == "nii":
            path = nifti(tmp_path / "v", data)
            data = reference(path)
        else:
            path = str(tmp_path / f"{kind}.npy")
            np.save(path, np.asfortranarray(data) if "fortran" in kind else data)
        truth.append(np.asarray(data))
        subjects.append({"image": path})
    vols = stoker.Volumes(subjects)
    loader = stoker.PatchLoader(vols, (6, 5, 7), 6, patches_per_subject=4, seed=2)
    assert check_batches(loader, truth) == 12
    assert any(len({int(s) for s in b["subject_index"]}) > 1 for b in loader)


@pytest.mark.parametrize(
    "shape,axes,dtype",
    [
        ((8, 64, 64, 64), (0, 3, 2, 1), np.int16),  # a batch of NIfTI patches, turned
        ((3, 1, 20, 9, 13), (0, 1, 4, 3, 2), np.uint8),
        ((5, 7, 3), (2, 0, 1), np.float64),
        ((6, 4), (1, 0), np.dtype("V3")),  # elements of no power-of-two size
        ((2, 9, 1, 5), (3, 2, 1, 0), np.int32),
        ((4, 33, 17), (0, 1, 2), np.int16),  # already in order
        ((11,), (0,), np.int8),
    ],
)
def test_permute_into_copies_any_strides_in_c_order(shape, axes, dtype):
    from stoker import _core

    item = np.dtype(dtype).itemsize
    raw = np.random.default_rng(0).integers(0, 256, int(np.prod(shape)) * item, np.uint8)
    view = np.transpose(raw.view(dtype).reshape(shape), axes)
    for src in (view, view[..., ::-1], view[::2]):  # negative and skipping strides too
        out = np.empty(src.shape, dtype)
        _core.permute_into(src, out)
        assert out.tobytes() == np.ascontiguousarray(src).tobytes()
    with pytest.raises(ValueError, match="C-contiguous"):
        _core.permute_into(view, np.empty((*view.shape[:-1], 2 * view.shape[-1]), dtype)[..., ::2])
    with pytest.raises(ValueError, match="shape"):
        _core.permute_into(view, np.empty((*view.shape[:-1], view.shape[-1] + 1), dtype))


def test_channels_of_a_4d_nifti_and_a_channel_first_npy(tmp_path):
    data = volume((12, 10, 8, 3), np.float32)
    path = nifti(tmp_path / "four", data)
    npy = tmp_path / "c.npy"
    np.save(npy, np.moveaxis(data, 3, 0))  # (C, X, Y, Z), MONAI's channel-first
    vols = stoker.Volumes([{"image": path, "other": str(npy)}])
    batch = next(iter(stoker.PatchLoader(vols, 5, 2, patches_per_subject=2, seed=3)))
    assert batch["image"].shape == (2, 3, 5, 5, 5)
    np.testing.assert_array_equal(batch["image"].numpy(), batch["other"].numpy())
    start = tuple(int(v) for v in batch["location"][0])
    want = np.moveaxis(expected_patch(data, start, (5, 5, 5)), 3, 0)
    np.testing.assert_array_equal(batch["image"][0].numpy(), want)


def test_two_d_images(tmp_path):
    data = volume((40, 33), np.uint8)
    np.save(tmp_path / "slide.npy", data)
    vols = stoker.Volumes([{"image": str(tmp_path / "slide.npy")}], spatial_dims=2)
    loader = stoker.PatchLoader(vols, (16, 16), 4, sampler=stoker.GridSampler())
    assert check_batches(loader, [data]) == 9


def test_affines_follow_nibabel(tmp_path):
    rotation = np.array([[0, -1, 0], [1, 0, 0], [0, 0, 1]], float)
    affine = np.eye(4)
    affine[:3, :3] = rotation * [0.7, 0.8, 2.0]
    affine[:3, 3] = [10.0, -20.0, 5.5]
    data = volume((10, 11, 12))
    for name, kwargs in (("sform", {}), ("qform", {"qform": True}), ("two", {"version": 2})):
        path = nifti(tmp_path / name, data, affine, **kwargs)
        header = stoker.nifti_header(path)
        np.testing.assert_allclose(header["affine"], nib.load(path).affine, atol=1e-5)
        np.testing.assert_allclose(header["spacing"], nib.load(path).header.get_zooms())
    # no sform, no qform: the voxel sizes alone, as nibabel's base affine
    img = nib.Nifti1Image(data, np.diag([0.5, 0.6, 0.7, 1]))
    img.set_sform(None, code=0)
    img.set_qform(None, code=0)
    img.to_filename(tmp_path / "none.nii")
    header = stoker.nifti_header(tmp_path / "none.nii")
    np.testing.assert_allclose(header["affine"], nib.load(tmp_path / "none.nii").affine, atol=1e-6)
    vols = stoker.Volumes([{"image": str(tmp_path / "sform.nii")}])
    batch = next(iter(stoker.PatchLoader(vols, 4, 2, patches_per_subject=2)))
    for b in range(2):
        start = batch["location"][b].numpy()
        world = nib.load(tmp_path / "sform.nii").affine @ np.append(start, 1)
        np.testing.assert_allclose(batch["affine"][b].numpy() @ [0, 0, 0, 1], world, atol=1e-5)


def test_a_nii_gz_is_inflated_once_into_the_cache(tmp_path):
    data = volume((20, 20, 20))
    path = nifti(tmp_path / "ct", data, gz=True)
    cache = tmp_path / "cache"
    first = stoker.Volumes([{"image": path}], cache_dir=cache)
    copies = os.listdir(cache / "volumes")
    copy = [c for c in copies if c.endswith(".raw")]
    # the voxels, then the 64-byte stamp of the boot that wrote them
    assert len(copy) == 1 and os.path.getsize(cache / "volumes" / copy[0]) == data.nbytes + 64
    mtime = os.path.getmtime(cache / "volumes" / copy[0])
    second = stoker.Volumes([{"image": path}], cache_dir=cache)
    assert os.path.getmtime(cache / "volumes" / copy[0]) == mtime  # not inflated again
    assert first.arrays[0]["image"].data_path == second.arrays[0]["image"].data_path


def test_a_copy_stamped_by_an_earlier_boot_is_inflated_again(tmp_path):
    """A copy is not synced to disk, so one found after a reboot (which a crash may have
    left with lost blocks) is not trusted: it is inflated again, and patches are exact."""
    data = volume((20, 20, 20))
    path = nifti(tmp_path / "ct", data, gz=True)
    cache = tmp_path / "cache"
    copy = stoker.Volumes([{"image": path}], cache_dir=cache).arrays[0]["image"].data_path
    with open(copy, "r+b") as f:
        f.write(b"\xff" * 512)  # blocks a crash lost ...
        f.seek(data.nbytes)
        f.write(b"stoker-inflated:boot=an-earlier-boot".ljust(64, b"\0"))  # ... in that boot
    vols = stoker.Volumes([{"image": path}], cache_dir=cache)
    assert vols.arrays[0]["image"].data_path == copy
    with open(copy, "rb") as f:
        assert f.read(data.nbytes) == data.transpose().tobytes()  # NIfTI keeps x fastest
    loader = stoker.PatchLoader(vols, 8, 2, patches_per_subject=4)
    assert check_batches(loader, [data]) == 4


def test_many_volumes_open_together_and_the_first_bad_one_in_order_is_named(tmp_path):
    """Arrays open on a thread a core (a .nii.gz inflates then); an error is the first
    subject's in order, as it would be opening them one by one."""
    datas = [volume((12, 12, 12), seed=s) for s in range(6)]
    paths = [nifti(tmp_path / f"ct{s}", d, gz=True) for s, d in enumerate(datas)]
    vols = stoker.Volumes([{"image": p} for p in paths], cache_dir=tmp_path / "cache")
    loader = stoker.PatchLoader(vols, 6, 3, patches_per_subject=2)
    assert check_batches(loader, datas) == 12
    for s in (2, 4):
        flip_byte(paths[s], -6)  # the gzip trailer's CRC-32
    with pytest.raises(stoker.StokerError, match="ct2.nii.gz"):
        stoker.Volumes([{"image": p} for p in paths], cache_dir=tmp_path / "other")


# -- edges -------------------------------------------------------------------------------


def test_a_volume_smaller_than_the_patch_is_padded_or_refused(tmp_path):
    data = volume((6, 20, 20))
    np.save(tmp_path / "small.npy", data)
    vols = stoker.Volumes([{"image": str(tmp_path / "small.npy"), "id": "tiny"}])
    loader = stoker.PatchLoader(vols, 10, 2, patches_per_subject=4, pad_value=7)
    assert check_batches(loader, [data], pad=7) == 4
    batch = next(iter(loader))
    assert (batch["location"][:, 0] == -2).all()  # centred along the short axis
    with pytest.raises(
        stoker.UsageError,
        match=r"subject 'tiny' \(.*small.npy\) is \(6, 20, 20\), smaller than "
        r"patch_size=\(10, 10, 10\)",
    ):
        stoker.PatchLoader(vols, 10, 2, edge="refuse")


def test_grid_edges_are_flush_and_cover_every_voxel(tmp_path):
    data = volume((21, 16, 9))
    np.save(tmp_path / "v.npy", data)
    vols = stoker.Volumes([{"image": str(tmp_path / "v.npy")}])
    loader = stoker.PatchLoader(vols, (8, 8, 8), 5, sampler=stoker.GridSampler(overlap=3))
    covered = np.zeros(data.shape, int)
    for batch in loader:
        for start in batch["location"].tolist():
            assert all(s >= 0 and s + 8 <= n for s, n in zip(start[:2], data.shape[:2]))
            covered[tuple(slice(max(s, 0), s + 8) for s in start)] += 1
    assert covered.min() >= 1
    assert check_batches(loader, [data]) == len(
        loader.sampler.grid_positions(data.shape, (8, 8, 8))
    )


def test_grid_positions_are_worked_out_once_per_subject(tmp_path, monkeypatch):
    """Every batch looks its patches up in the subjects' grids: a slide's is thousands of
    positions, and working one out again for each patch made the grid sampler slower than
    reading the patches."""
    vols, truth = many_subjects(tmp_path, n=3)
    sampler = stoker.GridSampler(overlap=1)
    want = sum(len(sampler.grid_positions(t.shape, (5, 5, 5))) for t in truth)
    calls = []
    axis_starts = stoker.GridSampler.axis_starts
    monkeypatch.setattr(
        stoker.GridSampler, "axis_starts", lambda self, *a: calls.append(a) or axis_starts(self, *a)
    )
    loader = stoker.PatchLoader(vols, 5, 3, sampler=sampler)
    for epoch in range(2):
        loader.set_epoch(epoch)
        assert check_batches(loader, truth) == want
    assert len(calls) == len(truth)


# -- samplers ----------------------------------------------------------------------------


def labelled(tmp_path, shape=(48, 48, 48)):
    """An image and a label whose foreground (1 and 2) is a block in the middle."""
    image = volume(shape)
    label = np.zeros(shape, np.uint8)
    label[16:32, 16:32, 16:24] = 1
    label[20:28, 20:28, 24:32] = 2
    ip = nifti(tmp_path / "img", image)
    lp = nifti(tmp_path / "lab", label)
    return stoker.Volumes([{"image": ip, "label": lp}], cache_dir=tmp_path / "cache"), label


def centre_labels(loader, label):
    out = []
    for batch in loader:
        for start in batch["location"].tolist():
            centre = tuple(s + p // 2 for s, p in zip(start, loader.patch_size))
            out.append(int(label[centre]))
    return np.array(out)


def within_binomial(hits, n, p, sigmas=4.0):
    return abs(hits - n * p) <= sigmas * np.sqrt(n * p * (1 - p)) + 1


def test_label_balanced_ratio(tmp_path):
    vols, label = labelled(tmp_path)
    sampler = stoker.LabelSampler("label", ratio=(1, 3))
    loader = stoker.PatchLoader(vols, 8, 16, sampler=sampler, patches_per_subject=800, seed=2)
    centres = centre_labels(loader, label)
    assert within_binomial((centres > 0).sum(), centres.size, 0.25)
    # the statistics are kept in the cache: a second loader finds them there
    assert os.listdir(tmp_path / "cache" / "volumes" / "occupancy")


def test_label_balanced_class_weights(tmp_path):
    vols, label = labelled(tmp_path)
    sampler = stoker.LabelSampler("label", class_weights={0: 1, 1: 1, 2: 2}, block=4)
    loader = stoker.PatchLoader(vols, 6, 16, sampler=sampler, patches_per_subject=800, seed=5)
    centres = centre_labels(loader, label)
    n = centres.size
    for value, p in ((0, 0.25), (1, 0.25), (2, 0.5)):
        assert within_binomial((centres == value).sum(), n, p), (value, np.bincount(centres))


def reference_label_starts(loader, label, epoch, batch):
    """The label-balanced draws as the docs state them, with a numpy generator a patch:
    a group by weight (Generator.choice), a block by its count of the group's voxels, then
    one of those voxels."""
    sampler, grid = loader.sampler, loader._occupancy_of(0)
    groups, weights = sampler.classes(grid.values)
    starts = []
    for s, k in batch:
        rng = np.random.default_rng([loader.seed, epoch, s, k])
        group = groups[int(rng.choice(len(groups), p=weights / weights.sum()))]
        cumulative = grid.group_counts(group)
        flat = int(np.searchsorted(cumulative, rng.integers(cumulative[-1]), side="right"))
        first, extent = block_bounds(grid, flat)
        values = label[tuple(slice(f, f + e) for f, e in zip(first, extent))]
        hits = np.flatnonzero(np.isin(values, group))
        voxel = np.unravel_index(int(hits[rng.integers(hits.size)]), values.shape)
        centre = tuple(f + int(v) for f, v in zip(first, voxel))
        starts.append(list(start_around(centre, label.shape, loader.patch_size)))
    return starts


@pytest.mark.parametrize(
    "sampler",
    [
        stoker.LabelSampler("label", ratio=(1, 2)),
        stoker.LabelSampler("label", class_weights={0: 1, 1: 3, 2: 1}, block=5),
    ],
    ids=["ratio", "class_weights"],
)
@pytest.mark.parametrize("seed", [3, 2**33 + 1])
def test_label_positions_are_each_patchs_keyed_draws(tmp_path, sampler, seed):
    """Each batch's centres, drawn in C++ for the batch and read ahead of its patches,
    are the ones a numpy generator a patch draws (for seeds of one word or more)."""
    vols, label = labelled(tmp_path)
    loader = stoker.PatchLoader(vols, 8, 6, sampler=sampler, patches_per_subject=60, seed=seed)
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        plan = loader._plan(epoch)
        for number, batch in enumerate(loader):
            want = reference_label_starts(loader, label, epoch, plan.batch(number))
            assert batch["location"].tolist() == want


@pytest.mark.parametrize("prefetch", [0, 2])
def test_label_blocks_are_read_ahead_of_their_patches(tmp_path, monkeypatch, prefetch):
    """A batch's label blocks are drawn and their reads started `prefetch` batches before
    its patches are, so that waiting for them does not wait for the patch reads queued
    first; a loop that stops early leaves no read behind, and the next one is whole."""
    vols, label = labelled(tmp_path)
    sampler = stoker.LabelSampler("label", ratio=(1, 1))
    loader = stoker.PatchLoader(
        vols, 8, 4, sampler=sampler, patches_per_subject=40, seed=1, prefetch=prefetch
    )
    events = []
    draw, starts = loader._draw_blocks, loader._label_starts
    monkeypatch.setattr(
        loader, "_draw_blocks", lambda e, b: events.append(("draw", b[0])) or draw(e, b)
    )
    monkeypatch.setattr(
        loader,
        "_label_starts",
        lambda blocks: events.append(("start", blocks.batch[0])) or starts(blocks),
    )
    whole = [b["location"].tolist() for b in loader]
    plan = loader._plan(0)
    batches = [plan.batch(n)[0] for n in range(len(plan))]
    draws = [k for kind, k in events if kind == "draw"]
    assert draws == batches
    # when batch i's starts are worked out, batches 0 to i + prefetch have been drawn
    for i, key in enumerate(batches):
        seen = events[: events.index(("start", key))]
        assert sum(kind == "draw" for kind, _ in seen) == min(i + 1 + prefetch, len(batches))
    loader.set_epoch(0)
    for n, _ in enumerate(loader):
        if n == 1:
            break
    loader.set_epoch(0)
    assert [b["location"].tolist() for b in loader] == whole


def test_a_loop_left_early_cancels_the_label_reads_ahead(tmp_path, monkeypatch):
    """Leaving the loop after one batch cancels every label read started for the batches
    ahead, and the patch reads queued, rather than leaving them to run into buffers
    nobody will read."""
    from stoker import _core

    vols, _ = labelled(tmp_path)
    sampler = stoker.LabelSampler("label", ratio=(1, 1))
    loader = stoker.PatchLoader(
        vols, 8, 4, sampler=sampler, patches_per_subject=40, seed=2, prefetch=3
    )
    started, waited, cancelled = [], [], []
    start_reads, values = loader._start_box_reads, loader._box_values
    monkeypatch.setattr(
        loader, "_start_box_reads", lambda boxes: started.append(start_reads(boxes)) or started[-1]
    )
    monkeypatch.setattr(loader, "_box_values", lambda r: waited.append(r) or values(r))
    cancel = _core.PendingRead.cancel
    monkeypatch.setattr(
        _core.PendingRead, "cancel", lambda read: cancelled.append(read) or cancel(read)
    )
    it = iter(loader)
    next(it)
    it.close()
    ahead = [r for reads in started if reads not in waited for r in reads.reads]
    assert len(ahead) >= 3  # the label blocks of the 3 batches read ahead
    assert all(any(r is c for c in cancelled) for r in ahead)
    assert len(cancelled) > len(ahead)  # the queued patch reads too


def test_a_draw_that_fails_ahead_fails_at_its_own_batch(tmp_path):
    """A subject whose label has none of the classes drawn is refused when its first batch
    is reached, not `prefetch` batches earlier while the draws read ahead: the batches
    before it are handed out."""
    image = volume((16, 16, 16))
    subjects = []
    for i, fill in enumerate((1, 0)):  # the second subject's label has no class 1
        label = np.zeros((16, 16, 16), np.uint8)
        label[4:12, 4:12, 4:12] = fill
        subjects.append(
            {"image": nifti(tmp_path / f"i{i}", image), "label": nifti(tmp_path / f"l{i}", label)}
        )
    vols = stoker.Volumes(subjects, cache_dir=tmp_path / "cache")
    sampler = stoker.LabelSampler("label", class_weights={1: 1})
    loader = stoker.PatchLoader(
        vols, 4, 2, sampler=sampler, patches_per_subject=8, shuffle=False, prefetch=3
    )
    handed = []
    with pytest.raises(stoker.UsageError, match=r"none of the classes the LabelSampler draws"):
        for batch in loader:
            handed.append(batch["subject_index"].tolist())
    assert handed == [[0, 0]] * 4


def test_label_balanced_batches_under_fork_workers_and_resumed(tmp_path):
    vols, label = labelled(tmp_path)
    sampler = stoker.LabelSampler("label", ratio=(1, 2))
    make = lambda: stoker.PatchLoader(  # noqa: E731
        vols, 8, 4, sampler=sampler, patches_per_subject=40, seed=6
    )
    whole = keys_of(all_batches(make()))
    workers = torch.utils.data.DataLoader(
        make().iterable_dataset(), batch_size=None, num_workers=2, multiprocessing_context="fork"
    )
    assert sorted(map(repr, keys_of(workers))) == sorted(map(repr, whole))
    again = make()
    it = iter(again)
    head = [next(it) for _ in range(3)]
    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(again.state_dict())))
    assert keys_of(head) + keys_of(all_batches(resumed)) == whole


def test_a_state_taken_mid_epoch_under_the_old_order_is_refused(tmp_path):
    vols, _ = many_subjects(tmp_path)
    loader = stoker.PatchLoader(vols, 5, 4, patches_per_subject=3, seed=9)
    state = loader.state_dict()
    del state["order"]  # as stoker wrote it before the keyed order
    loader.load_state_dict({**state, "batches": 0})  # an epoch's start: nothing to repeat
    with pytest.raises(stoker.UsageError, match=r"another order.*'batches' to 0"):
        loader.load_state_dict({**state, "batches": 2})
    loader.load_state_dict({**state, "batches": 2, "order": "keyed"})
    assert loader.state_dict()["batches"] == 2


def test_a_grid_sampler_that_chooses_its_positions_is_followed(tmp_path):
    """A GridSampler subclass's own grid_positions (a slide's tissue tiles only, say) are
    the patches read, not the full grid."""

    class EveryOther(stoker.GridSampler):
        def grid_positions(self, shape, patch_size):
            return super().grid_positions(shape, patch_size)[::2]

    vols, truth = many_subjects(tmp_path, n=2)
    sampler = EveryOther(overlap=1)
    loader = stoker.PatchLoader(vols, 5, 3, sampler=sampler)
    want = [
        (f"{s!r}", list(p))
        for s, t in enumerate(truth)
        for p in sampler.grid_positions(t.shape, (5, 5, 5))
    ]
    got = [
        (s, loc)
        for b in all_batches(loader)
        for s, loc in zip(b["subject"], b["location"].tolist())
    ]
    assert got == want
    assert check_batches(loader, truth) == len(want)


def test_a_label_block_without_the_voxels_its_grid_counted_is_named(tmp_path):
    """Labels that disagree with the occupancy grid kept for them (a grid counted for
    other contents) stop the loader with the file and the block, not an index error."""
    vols, label = labelled(tmp_path)
    sampler = stoker.LabelSampler("label", class_weights={1: 1}, block=8)
    loader = stoker.PatchLoader(vols, 8, 4, sampler=sampler, patches_per_subject=8, seed=0)
    grid = loader._occupancy_of(0)
    k = grid.values.index(1)
    moved = np.zeros_like(grid.counts[k])
    moved.reshape(-1)[0] = 5  # a corner block, all background in the file
    grid.counts[k] = moved
    grid.cumulative.clear()
    with pytest.raises(stoker.UsageError, match=r"lab.*block of \(8, 8, 8\) voxels at \(0, 0, 0\)"):
        next(iter(loader))


@pytest.mark.parametrize(
    "dtype", [np.uint8, np.int8, np.uint16, np.int16, np.int32, np.float32], ids=str
)
def test_occupancy_counts_every_value_per_block(tmp_path, dtype):
    """The occupancy grid against a count of every block by hand: blocks that do not
    divide the volume (short ones at the far edges), negative values, the commonest value
    (reckoned from the others) not first, and a NIfTI's transposed voxels."""
    from stoker.volumes.samplers import occupancy

    rng = np.random.default_rng(4)
    low = -3 if np.dtype(dtype).kind in "if" else 250
    choices = np.array([low, 0, 5, 7], dtype)
    label = rng.choice(choices, size=(21, 18, 11), p=[0.2, 0.1, 0.6, 0.1])
    path = nifti(tmp_path / "lab", label)
    array = stoker.Volumes([{"label": path}], cache_dir=tmp_path / "cache").arrays[0]["label"]
    for block in (4, 5):
        transposed = np.ascontiguousarray(label.T).T  # as the loader gives a NIfTI's voxels
        grid = occupancy(array, transposed, block, None)
        values = [int(v) for v in np.unique(label)]
        assert grid.values == values
        for k, v in enumerate(values):
            for index in np.ndindex(*grid.counts.shape[1:]):
                box = tuple(slice(i * block, (i + 1) * block) for i in index)
                assert grid.counts[(k, *index)] == (label[box] == v).sum(), (v, index)


def test_block_counts_of_any_rank_order_and_block():
    """The C++ count against numpy's, for 2-D to 4-D labels, views in any axis order
    (flipped too), blocks larger than the volume, one value only and an empty label."""
    from stoker.volumes.samplers import block_counts

    rng = np.random.default_rng(9)
    cases = [
        (rng.integers(0, 3, (300, 7), np.uint8), 16),
        (rng.integers(-2, 2, (9, 10, 11), np.int16).transpose(2, 0, 1), 4),
        (rng.integers(0, 4, (5, 6, 7, 3), np.uint8)[::-1, :, ::2], 3),
        (rng.integers(0, 2, (6, 5, 4), np.uint8), 50),
        (np.full((8, 8), 3, np.uint8), 3),
        (np.zeros((0, 4), np.uint8), 2),
    ]
    for labels, block in cases:
        values, counts = block_counts(labels, block, "x")
        assert values.dtype == labels.dtype
        assert list(values) == list(np.unique(labels))
        grid = tuple(-(-s // block) for s in labels.shape)
        assert counts.shape == (len(values), *grid)
        for k, v in enumerate(values):
            for index in np.ndindex(*grid):
                box = tuple(slice(i * block, (i + 1) * block) for i in index)
                assert counts[(k, *index)] == (labels[box] == v).sum(), (labels.shape, v, index)


def test_a_label_of_too_many_values_is_refused_by_name():
    from stoker.volumes.samplers import block_counts

    image = np.arange(70_000, dtype=np.float32).reshape(70, 1000)
    with pytest.raises(stoker.UsageError, match=r"ct\.nii.*70000 distinct values"):
        block_counts(image, 8, "ct.nii")


def test_aggregator_rebuilds_the_volume(tmp_path):
    data = volume((19, 22, 13), np.float32)
    np.save(tmp_path / "v.npy", data)
    vols = stoker.Volumes([{"image": str(tmp_path / "v.npy")}])
    for weights in ("uniform", "gaussian"):
        loader = stoker.PatchLoader(vols, 8, 3, sampler=stoker.GridSampler(overlap=0.5))
        aggregator = stoker.PatchAggregator(data.shape, (8, 8, 8), weights=weights)
        for batch in loader:
            aggregator.add(batch["image"], batch["location"])
        np.testing.assert_allclose(aggregator.result()[0].numpy(), data, rtol=1e-5, atol=1e-5)


# -- the loader's guarantees -------------------------------------------------------------


def many_subjects(tmp_path, n=6):
    subjects, truth = [], []
    for i in range(n):
        data = volume((14 + i, 12, 10), seed=i)
        np.save(tmp_path / f"s{i}.npy", data)
        subjects.append({"image": str(tmp_path / f"s{i}.npy"), "id": i})
        truth.append(data)
    return stoker.Volumes(subjects), truth


def keys_of(batches):
    return [(b["subject"], b["location"].tolist()) for b in batches]


def test_order_does_not_depend_on_threads_and_resumes_exactly(tmp_path):
    vols, _ = many_subjects(tmp_path)
    make = lambda: stoker.PatchLoader(vols, 5, 4, patches_per_subject=3, seed=9)  # noqa: E731
    whole = keys_of(all_batches(make()))
    from stoker._process import shared_reader

    reader = shared_reader()
    assert reader.num_threads >= 1
    again = make()
    it = iter(again)
    head = [next(it) for _ in range(2)]
    state = again.state_dict()
    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert keys_of(head) + keys_of(all_batches(resumed)) == whole
    other = make()
    other.set_epoch(1)
    assert keys_of(all_batches(other)) != whole


def test_keyed_generators_draw_as_numpys_generators():
    """Doubles and bounded integers taken in turns from keyed_generators' states equal
    numpy's default_rng(key).random and .integers: bounds of one, under 2**32 (32-bit
    draws, the spare half of a 64-bit one first, rejections), 2**32 - 1 and over, up to
    int64's largest; a state that is not a writable uint64 array is refused."""
    from stoker import _core
    from stoker.loader.sample_orders import seed_words

    rng = np.random.default_rng(12)
    edges = [1, 2, 3, 7, 2**31 + 1, 3 * 2**30, 2**32 - 1, 2**32, 2**32 + 1, 2**40 + 3, 2**63 - 1]
    for trial in range(300):
        seed, epoch = int(rng.integers(0, 2**40)), int(rng.integers(0, 50))
        keys = rng.integers(0, 2**32, size=(5, 2), dtype=np.uint64)
        states = _core.keyed_generators(
            np.array(seed_words(seed, epoch), np.uint32), keys.astype(np.uint32)
        )
        numpys = [np.random.default_rng([seed, epoch, int(s), int(k)]) for s, k in keys]
        for step in range(5):
            if (trial + step) % 3 == 0:
                got = _core.generator_uniforms(states, 2)
                assert np.array_equal(got, [g.random(2) for g in numpys])
                continue
            highs = np.array(
                [
                    edges[int(rng.integers(len(edges)))]
                    if step % 2
                    else int(rng.integers(1, 2 ** int(rng.integers(1, 63))))
                    for _ in numpys
                ],
                np.int64,
            )
            got = _core.generator_integers(states, highs)
            assert got.tolist() == [int(g.integers(int(h))) for g, h in zip(numpys, highs)]
    # keys past one 32-bit word each: numpy's own generators, the same draws in turn
    from stoker.volumes.samplers import PatchDraws

    for keys in ([(1, 2**33), (0, 5)], [(2**64 + 3, 1)]):
        draws = PatchDraws(7, 2, keys)
        numpys = [np.random.default_rng([7, 2, s, k]) for s, k in keys]
        assert np.array_equal(draws.random(1)[:, 0], [g.random() for g in numpys])
        highs = np.array([2**40 + 1] * len(keys), np.int64)
        assert draws.integers(highs).tolist() == [int(g.integers(2**40 + 1)) for g in numpys]
    with pytest.raises(TypeError):
        _core.generator_uniforms(states.astype(np.int64), 1)
    frozen = states.copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        _core.generator_uniforms(frozen, 1)
    with pytest.raises(ValueError, match="at least 1"):
        _core.generator_integers(states, np.zeros(len(states), np.int64))


@pytest.mark.parametrize("seed", [0, 7, 2**32 + 5, 2**70 + 1])
def test_uniform_positions_are_numpys_keyed_draws(seed, monkeypatch):
    """Each start comes from default_rng([seed, epoch, subject, k]).random(rank): worked out
    in C++ for a whole batch, or, for keys that are not one 32-bit word each, by numpy's
    generators themselves."""
    from stoker import _core
    from stoker.volumes import samplers

    calls = []
    keyed = _core.keyed_generators
    monkeypatch.setattr(samplers._core, "keyed_generators", lambda *a: calls.append(a) or keyed(*a))
    patch = (32, 64, 40)
    shapes = ((700, 90, 33), (64, 64, 64), (5, 200, 80))

    def numpys(epoch, batch):
        out = []
        for s, k in batch:
            draws = np.random.default_rng([seed, epoch, s, k]).random(len(patch))
            out.append(
                tuple(
                    min(int(u * (n - p + 1)), n - p) if n >= p else (n - p) // 2
                    for u, n, p in zip(draws.tolist(), shapes[s], patch)
                )
            )
        return out

    in_words = [(s, k) for s in range(3) for k in (0, 1, 2, 99, 2**31, 2**32 - 1)]
    for epoch in (0, 3, 2**40):
        for batch, by_core in ((in_words, True), ([(1, 2**33), (2, 0)], False)):
            calls.clear()
            got = samplers.uniform_starts(seed, epoch, batch, [shapes[s] for s, _ in batch], patch)
            assert got.tolist() == [list(start) for start in numpys(epoch, batch)]
            assert bool(calls) == by_core
    with pytest.raises(ValueError):
        samplers.uniform_starts(-1, 0, in_words, [shapes[s] for s, _ in in_words], patch)


def test_ranks_split_the_epoch(tmp_path):
    vols, _ = many_subjects(tmp_path)
    everything = set()
    lengths = set()
    for rank in range(3):
        loader = stoker.PatchLoader(
            vols, 5, 2, patches_per_subject=4, seed=1, rank=rank, world_size=3
        )
        mine = {
            (s, tuple(loc)) for b in loader for s, loc in zip(b["subject"], b["location"].tolist())
        }
        assert not mine & everything
        everything |= mine
        lengths.add(len(loader))
    single = stoker.PatchLoader(vols, 5, 2, patches_per_subject=4, seed=1, rank=0, world_size=1)
    assert everything == {
        (s, tuple(loc)) for b in single for s, loc in zip(b["subject"], b["location"].tolist())
    }
    assert len(lengths) == 1


def test_dataloader_fork_workers(tmp_path):
    vols, truth = many_subjects(tmp_path)
    loader = stoker.PatchLoader(vols, 5, 4, patches_per_subject=3, seed=4)
    alone = sorted(map(repr, keys_of(all_batches(loader))))
    loader.set_epoch(0)  # the epoch read to its end moved the loader on to the next one
    workers = torch.utils.data.DataLoader(
        loader.iterable_dataset(), batch_size=None, num_workers=2, multiprocessing_context="fork"
    )
    together = list(workers)
    assert sorted(map(repr, keys_of(together))) == alone
    for batch in together:
        for b, s in enumerate(batch["subject_index"].tolist()):
            start = tuple(batch["location"][b].tolist())
            want = expected_patch(truth[s], start, (5, 5, 5))
            np.testing.assert_array_equal(batch["image"][b, 0].numpy(), want)


def test_stats_show_a_patch_not_a_volume(tmp_path):
    """A patch's spans are at most 4x its bytes (boxes.SPAN_AMPLIFICATION); the reader also
    reads the gaps under 8 KiB between spans of a batch's patches that lie close (on this
    small volume, up to 4.7x over 60 seeds), where a whole-volume loader reads 64x."""
    data = np.zeros((128, 128, 128), np.int16)
    np.save(tmp_path / "v.npy", data)
    vols = stoker.Volumes([{"image": str(tmp_path / "v.npy")}])
    loader = stoker.PatchLoader(vols, 32, 4, patches_per_subject=8)
    all_batches(loader)
    stats = loader.stats()
    assert stats["patches"] == 8 and stats["patch_bytes"] == 8 * 32**3 * 2
    assert 1 <= stats["read_amplification"] <= 5
    assert stats["bytes_read_per_patch"] < data.nbytes / 10  # a 64th of it, read 4x


def test_runs_merge_rows_as_the_reader_does(tmp_path):
    np.save(tmp_path / "v.npy", np.zeros((64, 64, 64), np.int16))
    array = stoker.Volumes([{"image": str(tmp_path / "v.npy")}]).arrays[0]["image"]
    runs = patch_runs(array, (3, 5, 7), (16, 16, 16))
    assert runs.offsets.size == 16 * 16 and (runs.lengths == 32).all()
    whole_rows = patch_runs(array, (3, 5, 0), (16, 16, 64))
    assert whole_rows.offsets.size == 16 and (whole_rows.lengths == 16 * 64 * 2).all()


# The peak is the process's own (VmHWM, see peak_rss_bytes): getrusage's ru_maxrss carries
# over an exec the parent's size at the fork, and a pytest worker's is large by then.
MEMORY_CHILD = r"""
import sys, numpy as np, stoker
from stoker.tools.measure import peak_rss_bytes
vols = stoker.Volumes([{"image": sys.argv[1]}])
loader = stoker.PatchLoader(vols, 64, 4, patches_per_subject=64)
for batch in loader:
    pass
print(peak_rss_bytes())
"""


def test_memory_stays_bounded_on_a_volume_larger_than_it(tmp_path):
    # A 2 GiB volume (a sparse file: it costs no disk) read by a process whose peak
    # RSS must stay far under it.
    if "libasan" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("under ASan, shadow memory and the quarantine make RSS no measure of stoker's")
    path = tmp_path / "big.npy"
    big = np.lib.format.open_memmap(path, mode="w+", dtype=np.int16, shape=(1024, 1024, 1024))
    del big
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_CHILD, str(path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) < 700 << 20


# -- subjects and bad input --------------------------------------------------------------


def test_subjects_from_a_csv_and_from_folders(tmp_path):
    (tmp_path / "imagesTr").mkdir()
    (tmp_path / "labelsTr").mkdir()
    for name in ("a", "b"):
        nifti(tmp_path / "imagesTr" / name, volume((8, 8, 8)))
        nifti(tmp_path / "labelsTr" / name, np.zeros((8, 8, 8), np.uint8))
    vols = stoker.Volumes.from_folders(
        {"image": tmp_path / "imagesTr", "label": tmp_path / "labelsTr"}
    )
    assert len(vols) == 2 and vols.keys == ("image", "label") and vols.name(0) == "'a'"
    (tmp_path / "subjects.csv").write_text("id,image,label\nx,imagesTr/a.nii,labelsTr/a.nii\n")
    from_csv = stoker.Volumes(str(tmp_path / "subjects.csv"))
    assert from_csv.arrays[0]["image"].path == str(tmp_path / "imagesTr" / "a.nii")
    nifti(tmp_path / "imagesTr" / "c", volume((8, 8, 8)))
    with pytest.raises(stoker.UsageError, match=r"without a partner: c.nii \(no label\)"):
        stoker.Volumes.from_folders(
            {"image": tmp_path / "imagesTr", "label": tmp_path / "labelsTr"}
        )


def test_image_and_label_of_different_shapes(tmp_path):
    ip = nifti(tmp_path / "img", volume((10, 10, 10)))
    lp = nifti(tmp_path / "lab", np.zeros((10, 10, 9), np.uint8))
    with pytest.raises(
        stoker.UsageError,
        match=r"subject 'p7': 'label' \(.*lab.nii\) has spatial shape \(10, 10, 9\), "
        r"'image' \(.*img.nii\) has \(10, 10, 10\)",
    ):
        stoker.Volumes([{"id": "p7", "image": ip, "label": lp}])


def test_affines_that_disagree(tmp_path):
    ip = nifti(tmp_path / "img", volume((10, 10, 10)), np.eye(4))
    lp = nifti(tmp_path / "lab", np.zeros((10, 10, 10), np.uint8), np.diag([2, 1, 1, 1.0]))
    with pytest.raises(stoker.UsageError, match="affines of 'label'"):
        stoker.Volumes([{"image": ip, "label": lp}])


def test_a_truncated_nii_is_refused_naming_it(tmp_path):
    path = nifti(tmp_path / "cut", volume((16, 16, 16)))
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    with pytest.raises(stoker.ShardFormatError, match=r"cut.nii.*truncated"):
        stoker.Volumes([{"image": path}])


def test_a_corrupt_nii_gz_is_refused_and_no_copy_is_left(tmp_path):
    data = volume((16, 16, 16))
    path = nifti(tmp_path / "bad", data, gz=True)
    flip_byte(path, -6)  # in the CRC-32 of the gzip trailer
    with pytest.raises(stoker.StokerError, match="bad.nii.gz"):
        stoker.Volumes([{"image": path}], cache_dir=tmp_path / "cache")
    left = os.listdir(tmp_path / "cache" / "volumes")
    assert not [n for n in left if n.endswith((".raw", ".tmp"))], left


def test_a_truncated_nii_gz_names_the_file(tmp_path):
    path = nifti(tmp_path / "short", volume((16, 16, 16)), gz=True)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(stoker.StokerError, match="short.nii.gz"):
        stoker.Volumes([{"image": path}], cache_dir=tmp_path / "cache")


def test_a_file_that_is_not_npy(tmp_path):
    (tmp_path / "x.npy").write_bytes(b"not an array at all" * 10)
    with pytest.raises(stoker.ShardFormatError, match=r"x.npy.*not a .npy file"):
        stoker.Volumes([{"image": str(tmp_path / "x.npy")}])


def test_bad_arguments(tmp_path):
    np.save(tmp_path / "v.npy", volume((8, 8, 8)))
    vols = stoker.Volumes([{"image": str(tmp_path / "v.npy")}])
    with pytest.raises(stoker.UsageError, match="patch_size"):
        stoker.PatchLoader(vols, (4, 4), 2)
    with pytest.raises(stoker.UsageError, match="edge="):
        stoker.PatchLoader(vols, 4, 2, edge="wrap")
    with pytest.raises(stoker.UsageError, match="LabelSampler"):
        stoker.PatchLoader(vols, 4, 2, sampler=stoker.LabelSampler("label"))
    with pytest.raises(stoker.UsageError, match="overlap"):
        list(stoker.PatchLoader(vols, 4, 2, sampler=stoker.GridSampler(overlap=4)))
    with pytest.raises(stoker.UsageError, match=r"pad_value=-1 does not fit 'image''s uint8"):
        np.save(tmp_path / "u.npy", np.zeros((8, 8, 8), np.uint8))
        stoker.PatchLoader(stoker.Volumes([{"image": str(tmp_path / "u.npy")}]), 4, 2, pad_value=-1)
    with pytest.raises(stoker.UsageError, match="no subjects"):
        stoker.Volumes([])


def test_from_torchio(tmp_path):
    tio = pytest.importorskip("torchio")
    ip = nifti(tmp_path / "img", volume((8, 8, 8)))
    lp = nifti(tmp_path / "lab", np.zeros((8, 8, 8), np.uint8))
    subjects = tio.SubjectsDataset(
        [tio.Subject(image=tio.ScalarImage(ip), label=tio.LabelMap(lp), age=40)]
    )
    vols = stoker.Volumes.from_torchio(subjects)
    assert vols.keys == ("image", "label") and vols.metadata[0]["age"] == 40


def test_a_volume_cut_shorter_while_patches_are_read_names_it(tmp_path):
    # Spans are cut to their boxes from the file's mapping: a volume truncated after the
    # loader opened and read from it fails with a short read naming the file, no SIGBUS.
    np.save(tmp_path / "v.npy", volume((32, 32, 32)))
    vols = stoker.Volumes([{"image": str(tmp_path / "v.npy")}])
    loader = stoker.PatchLoader(vols, (8, 8, 8), 2, patches_per_subject=64, seed=0)
    batches = iter(loader)
    next(batches)
    with open(tmp_path / "v.npy", "r+b") as f:
        f.truncate(256)
    with pytest.raises(stoker.ShardFormatError, match=r"v\.npy.*(short read|truncated)"):
        for _ in batches:
            pass
