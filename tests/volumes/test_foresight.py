"""Foresight: a PatchLoader tells the reader which JPEG tiles the batches ahead touch, so a
tile several batches share is decoded once, in the part they take, and kept until the
last of them. Whatever it was told, every patch must equal tifffile's whole-tile decode,
and telling it nothing, or the wrong thing, only costs decoding."""

from __future__ import annotations

import numpy as np
import pytest

import stoker
import stoker.volumes.patches as patches
from stoker._process import DECODED_CACHE_VARIABLE, shared_reader
from tests.volumes.test_slides import check, rgb_image, slide_loader

tifffile = pytest.importorskip("tifffile")
pytest.importorskip("imagecodecs")
pytest.importorskip("torch")


@pytest.fixture
def jpeg_slide(tmp_path):
    image = rgb_image((512, 768), seed=5)
    path = tmp_path / "slide.tif"
    tifffile.imwrite(path, image, tile=(256, 256), compression="jpeg")
    return path, tifffile.imread(path)


def unforeseen(loader):
    loader._jpeg_arrays = {}  # (what __init__ found to foresee: nothing)
    return loader


def bytes_read(loader):
    for _ in loader:
        pass
    return loader.stats()["bytes_read"]


@pytest.mark.parametrize("sampler", ["uniform", "grid"])
def test_foreseen_patches_equal_whole_decodes(jpeg_slide, sampler):
    path, decoded = jpeg_slide
    grid = stoker.GridSampler(overlap=0.4) if sampler == "grid" else None
    for k, patch in enumerate([(100, 100), (7, 300), (300, 9)]):
        loader = slide_loader(path, patch=patch, batch=3, sampler=grid, n=90, seed=k)
        assert check(loader, decoded) > 0


def test_a_tile_many_batches_share_is_decoded_once(jpeg_slide, monkeypatch):
    # 6 tiles, 200 patches of 120^2 in 50 batches: without foresight a patch's small part
    # of a tile is decoded for that patch alone, each time; with it, once for them all.
    path, decoded = jpeg_slide
    monkeypatch.setenv(DECODED_CACHE_VARIABLE, "")  # (restored after the test)
    stoker.set_decoded_cache_bytes(256 << 20)  # (a fresh cache: none of the tiles kept)
    foreseen = bytes_read(slide_loader(path, patch=120, batch=4, n=200, seed=1))
    stoker.set_decoded_cache_bytes(256 << 20)
    plain = bytes_read(unforeseen(slide_loader(path, patch=120, batch=4, n=200, seed=1)))
    with tifffile.TiffFile(path) as tif:
        tile_bytes = sum(tif.pages[0].databytecounts)
    assert foreseen <= tile_bytes < plain / 4
    assert check(slide_loader(path, patch=120, batch=4, n=200, seed=1), decoded) == 200


def test_a_loop_left_early_leaves_nothing_wrong_behind(jpeg_slide):
    # Foreseen tasks never read (a loop left after one batch) and parts kept for them must
    # not serve the next epoch's other boxes.
    path, decoded = jpeg_slide
    loader = slide_loader(path, patch=90, batch=2, n=60, seed=3)
    next(iter(loader))
    for epoch in range(3):
        loader.set_epoch(epoch)
        assert check(loader, decoded) == 60


def test_wrong_foresight_costs_decoding_never_pixels(jpeg_slide, monkeypatch):
    # The reader is told a 1-pixel part of every tile, wanted by two batches (so kept), for
    # each window: every box read asks for more than was kept, and the part kept is decoded
    # again, wider, in place of the first (or the box's own part alone, at the last task).
    path, decoded = jpeg_slide
    loader = slide_loader(path, patch=(64, 200), batch=2, n=80, seed=4)
    (array_id,) = loader._jpeg_arrays.values()

    def foresee_wrongly(subjects, starts, owners, fresh):
        tiles = [(ty * 256 + 200, tx * 256 + 200) for ty in range(2) for tx in range(3)]
        starts = np.array([(y, x, 0) for y, x in tiles for _ in (0, 1)], np.int64)
        extents = np.tile(np.array([1, 1, 3], np.int64), (len(starts), 1))
        owners = np.array([owners[0], owners[-1] + 1] * len(tiles), np.int64)
        ids = np.full(len(starts), array_id, np.uint32)
        shared_reader().foresee_boxes(loader._files, ids, starts, extents, owners, fresh)

    monkeypatch.setattr(loader, "_foresee", foresee_wrongly)
    monkeypatch.setattr(patches, "FORESIGHT_PATCHES", 8)  # a window every 4 batches
    assert check(loader, decoded) == 80


def test_foresee_boxes_refuses_what_a_read_would(jpeg_slide):
    path, _ = jpeg_slide
    loader = slide_loader(path)
    (array_id,) = loader._jpeg_arrays.values()
    reader = shared_reader()
    ids = np.array([array_id], np.uint32)
    inside = np.array([[0, 0, 0]], np.int64)
    with pytest.raises(stoker.StokerError, match="not inside the array"):
        reader.foresee_boxes(loader._files, ids, np.array([[500, 0, 0]]), [[64, 64, 3]], [0], True)
    with pytest.raises(ValueError, match="batches has 2 entries"):
        reader.foresee_boxes(loader._files, ids, inside, [[64, 64, 3]], [0, 1], True)
    with pytest.raises(ValueError, match="may not be negative"):
        reader.foresee_boxes(loader._files, ids, -inside - 1, [[64, 64, 3]], [0], True)


def test_with_no_decoded_cache_nothing_is_kept_and_patches_are_whole(jpeg_slide, monkeypatch):
    path, decoded = jpeg_slide
    monkeypatch.setenv(DECODED_CACHE_VARIABLE, "")  # (restored after the test)
    stoker.set_decoded_cache_bytes(0)
    try:
        assert check(slide_loader(path, patch=120, batch=4, n=100, seed=2), decoded) == 100
    finally:
        stoker.set_decoded_cache_bytes(256 << 20)
