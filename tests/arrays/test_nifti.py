"""load_array and nifti_header on NIfTI-1/NIfTI-2 volumes (.nii and .nii.gz), on the CPU:
byte for byte against nibabel, which writes every file here (or wrote the file whose bytes a
test then damages). The same reads onto a GPU are in tests/gpu/test_nifti_gpu.py."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import stoker
from tests.support import child_preamble
from tests.support.nifti_volumes import (
    AFFINE,
    flip_byte,
    gzip_copy,
    reference,
    volume,
    with_trailing,
    write_nifti,
)

nib = pytest.importorskip("nibabel")

# Where each version's header keeps a field (byte offsets) and the field's type.
FIELDS = {
    1: {"dim": (40, "i2"), "datatype": (70, "i2"), "bitpix": (72, "i2"), "magic": 344,
        "vox_offset": (108, "f4"), "scl_slope": (112, "f4"), "scl_inter": (116, "f4")},
    2: {"dim": (16, "i8"), "datatype": (12, "i2"), "bitpix": (14, "i2"), "magic": 4,
        "vox_offset": (168, "i8"), "scl_slope": (176, "f8"), "scl_inter": (184, "f8")},
}  # fmt: skip


# ---- helpers (the volumes themselves: tests/nifti_volumes.py) -----------------------------


def _same(t, expected) -> bool:
    assert isinstance(t, torch.Tensor) and t.device.type == "cpu"
    got = t.numpy()
    return (
        tuple(t.shape) == expected.shape
        and got.dtype == expected.dtype.newbyteorder("=")
        and np.array_equal(got, expected)
    )


def _patch(path, at, kind, value, order="<"):
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(np.array(value, np.dtype(order + kind)).tobytes())


# ---- byte for byte against nibabel ---------------------------------------------------------


@pytest.mark.parametrize("suffix", [".nii", ".nii.gz"])
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize(
    "dtype, shape",
    [
        ("uint8", (7, 5, 3)),
        ("int16", (16, 12, 9)),
        ("float32", (9, 8, 7)),
        ("float64", (4, 6, 5, 3)),
        ("int64", (5, 3, 4)),
        ("RGB24", (6, 5, 4)),
        ("int16", (6, 4, 3, 5)),
        ("int8", (11,)),
        ("uint16", (5, 7)),
        ("complex64", (3, 4, 5)),
    ],
)
def test_load_array_matches_nibabel(tmp_path, suffix, version, dtype, shape):
    data = volume(dtype, shape, seed=version)
    path = write_nifti(tmp_path / f"vol{suffix}", data, version)
    expected = reference(path)
    t = stoker.load_array(path, device="cpu")
    assert _same(t, expected)
    if len(shape) > 1:  # a view with reversed axes over the stored bytes
        assert not t.is_contiguous()
        stored = tuple(reversed(range(len(shape)))) + (
            (len(shape),) if t.dim() > len(shape) else ()
        )
        assert t.permute(stored).is_contiguous()
    header = stoker.nifti_header(path)
    assert header["version"] == version and header["compressed"] == suffix.endswith(".gz")
    assert header["shape"] == expected.shape and header["nbytes"] == expected.nbytes
    assert header["dtype"] == expected.dtype and not header["big_endian"]
    assert header["offset"] == nib.load(path).dataobj.offset


def test_load_array_accepts_path_objects_and_npy(tmp_path):
    data = volume("int16", (4, 5, 6))
    path = tmp_path / "vol.nii.gz"
    write_nifti(path, data)
    assert _same(stoker.load_array(path, device="cpu"), data)
    np.save(tmp_path / "a.npy", data)
    t = stoker.load_array(tmp_path / "a.npy", device="cpu")
    assert _same(t, data) and t.is_contiguous()  # a .npy: exactly what load_npy does
    assert stoker.load_array(tmp_path / "a.npy", device="cpu", scale=True).dtype == torch.float32


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("suffix", [".nii", ".nii.gz"])
def test_header_extension(tmp_path, version, suffix):
    data = volume("float32", (5, 6, 7))
    path = write_nifti(tmp_path / f"ext{suffix}", data, version, extension=b"stoker test " * 20)
    offset = nib.load(path).dataobj.offset
    assert offset >= (384 if version == 1 else 576)  # past the extension
    assert stoker.nifti_header(path)["offset"] == offset
    assert _same(stoker.load_array(path, device="cpu"), reference(path))


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("suffix", [".nii", ".nii.gz"])
@pytest.mark.parametrize("dtype", ["int16", "float64", "uint32", "complex64", "RGB24"])
def test_big_endian(tmp_path, version, suffix, dtype):
    data = volume(dtype, (6, 5, 4), seed=3)
    path = write_nifti(tmp_path / f"be{suffix}", data, version, big_endian=True)
    with (gzip.open if suffix == ".nii.gz" else open)(path, "rb") as f:
        head = f.read(4)
    assert int.from_bytes(head, "big") == (348 if version == 1 else 540)  # really big-endian
    expected = reference(path)
    assert expected.dtype.byteorder == ">" or expected.dtype.itemsize == 1
    t = stoker.load_array(path, device="cpu")
    assert _same(t, expected)  # native values: byte-swapped after the read
    assert stoker.nifti_header(path)["big_endian"]


@pytest.mark.parametrize("members", [2, 3])
def test_multi_member_gzip(tmp_path, members):
    data = volume("int16", (20, 18, 7))
    plain = write_nifti(tmp_path / "vol.nii", data)
    path = gzip_copy(plain, members)  # the header, or the voxels, split between members
    assert _same(stoker.load_array(path, device="cpu"), data)
    # A member boundary inside the header, and one right at the first voxel.
    cut = [0, 100, 352, os.path.getsize(plain)]
    assert _same(stoker.load_array(gzip_copy(plain, cut=cut), device="cpu"), data)


def test_gzip_told_by_content_not_name(tmp_path):
    data = volume("float32", (3, 4, 5))
    gzipped = write_nifti(tmp_path / "a.nii.gz", data)
    os.rename(gzipped, tmp_path / "misnamed.nii")
    plain = write_nifti(tmp_path / "b.nii", data)
    os.rename(plain, tmp_path / "plain.nii.gz")
    for name in ("misnamed.nii", "plain.nii.gz"):
        assert _same(stoker.load_array(tmp_path / name, device="cpu"), data)


def test_empty_volume(tmp_path):
    for suffix in (".nii", ".nii.gz"):
        path = write_nifti(tmp_path / f"empty{suffix}", np.zeros((4, 0, 3), np.int16))
        assert _same(stoker.load_array(path, device="cpu"), np.zeros((4, 0, 3), np.int16))


# ---- scale=True --------------------------------------------------------------------------


def _set_scaling(path, version, slope, inter):
    at, kind = FIELDS[version]["scl_slope"]
    _patch(path, at, kind, slope)
    at, kind = FIELDS[version]["scl_inter"]
    _patch(path, at, kind, inter)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("dtype", ["int16", "uint8", "float32", "float64", "int32"])
@pytest.mark.parametrize("factors", [(2.5, -30.0), (0.0, 7.0), (float("nan"), 1.0)])
def test_scale(tmp_path, version, dtype, factors):
    data = volume(dtype, (6, 7, 5), seed=5)
    plain = write_nifti(tmp_path / "vol.nii", data, version)
    _set_scaling(plain, version, *factors)
    for path in (plain, gzip_copy(plain)):
        expected = np.asarray(nib.load(path).get_fdata())  # float64, scaled as nibabel does
        t = stoker.load_array(path, device="cpu", scale=True)
        assert t.dtype == torch.float32 and tuple(t.shape) == expected.shape
        np.testing.assert_allclose(t.numpy(), expected, rtol=1e-6, atol=1e-5)
        # unscaled by default: the stored values
        assert _same(stoker.load_array(path, device="cpu"), reference(path))
    header = stoker.nifti_header(plain)
    assert header["slope"] == factors[0] or np.isnan(factors[0]) and np.isnan(header["slope"])


def test_scale_refuses_rgb_and_a_bad_intercept(tmp_path):
    path = write_nifti(tmp_path / "rgb.nii", volume("RGB24", (3, 4, 5)))
    with pytest.raises(stoker.UsageError, match=r"rgb\.nii.*RGB24"):
        stoker.load_array(path, device="cpu", scale=True)
    path = write_nifti(tmp_path / "inter.nii", volume("int16", (3, 4, 5)))
    _set_scaling(path, 1, 2.0, float("inf"))
    with pytest.raises(stoker.ShardFormatError, match=r"inter\.nii: offset 116") as info:
        stoker.load_array(path, device="cpu", scale=True)
    assert "scl_inter" in str(info.value)
    stoker.load_array(path, device="cpu")  # the stored values are still readable


# ---- bad files ---------------------------------------------------------------------------


def _fails(path, offset=None, match=None):
    """load_array and nifti_header each raise a ShardFormatError naming `path` (at
    `offset`, and saying `match`, when given)."""
    name = re.escape(os.path.basename(path))
    for call in (stoker.load_array, stoker.nifti_header):
        args = (path, "cpu") if call is stoker.load_array else (path,)
        with pytest.raises(stoker.ShardFormatError, match=name) as info:
            call(*args)
        assert isinstance(info.value, stoker.StokerError) and isinstance(info.value, ValueError)
        if offset is not None:
            assert f"offset {offset}:" in str(info.value)
        if match is not None:
            assert re.search(match, str(info.value)), str(info.value)
    return info.value


@pytest.mark.parametrize("cut", ["inside-header", "inside-voxels"])
def test_truncated_nii(tmp_path, cut):
    path = write_nifti(tmp_path / "cut.nii", volume("float32", (10, 10, 10)))
    size = {"inside-header": 200, "inside-voxels": os.path.getsize(path) - 7}[cut]
    os.truncate(path, size)
    _fails(path, offset=size)


def test_truncated_nii_gz(tmp_path):
    path = write_nifti(tmp_path / "cut.nii.gz", volume("float32", (20, 20, 20)))
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(stoker.ShardFormatError, match=r"cut\.nii\.gz: offset \d+:.*ends"):
        stoker.load_array(path, device="cpu")
    with open(path, "wb") as f:
        f.write(data[:30])  # not even a header
    _fails(path)


def test_corrupt_nii_gz(tmp_path):
    path = write_nifti(tmp_path / "bad.nii.gz", volume("int16", (30, 30, 10)))
    with open(path, "rb") as f:
        data = bytearray(f.read())
    data[len(data) // 2 : len(data) // 2 + 40] = bytes(40)
    with open(path, "wb") as f:
        f.write(bytes(data))
    with pytest.raises(stoker.ShardFormatError, match=r"bad\.nii\.gz: offset \d+:.*corrupt"):
        stoker.load_array(path, device="cpu")


@pytest.mark.parametrize("field, at", [("CRC-32", -8), ("ISIZE", -3)])
@pytest.mark.parametrize("members", [1, 3])
def test_damaged_last_member_trailer(tmp_path, field, at, members):
    # The last member's trailer follows the last voxel: reading the voxels alone may
    # never look at it. load_array and GDSCache.put inflate to the stream's end.
    plain = write_nifti(tmp_path / "crc.nii", volume("int16", (20, 18, 7)))
    path = gzip_copy(plain, members)
    flip_byte(path, at)
    check = "data" if field == "CRC-32" else "length"
    with pytest.raises(stoker.ShardFormatError, match=rf"crc\.nii\.gz: offset \d+:.*{check} check"):
        stoker.load_array(path, device="cpu")
    cache = stoker.GDSCache(tmp_path / "cache")
    with pytest.raises(stoker.ShardFormatError, match=rf"crc\.nii\.gz: offset \d+:.*{check} check"):
        cache.put("crc", path)
    assert "crc" not in cache and os.listdir(tmp_path / "cache") == []
    assert stoker.nifti_header(path)["shape"] == (20, 18, 7)  # the header alone is sound


def test_damaged_checksum_of_a_member_after_the_voxels(tmp_path):
    # The voxels end with the first member: reading them never reaches the second.
    path, data = with_trailing(tmp_path / "tail.nii", 100, members=2)
    assert _same(stoker.load_array(path, device="cpu"), data)
    flip_byte(path, -8)
    with pytest.raises(stoker.ShardFormatError, match=r"tail\.nii\.gz: offset \d+:.*data check"):
        stoker.load_array(path, device="cpu")
    with pytest.raises(stoker.ShardFormatError, match=r"tail\.nii\.gz.*data check"):
        stoker.GDSCache(tmp_path / "cache").put("tail", path)


def test_bytes_after_the_voxels(tmp_path):
    path, data = with_trailing(tmp_path / "tail.nii", 1000)
    assert _same(stoker.load_array(path, device="cpu"), data)  # a little: ignored
    with open(path, "ab") as f:
        f.write(bytes(64))  # zero padding after the last member, as gzip accepts it
    assert _same(stoker.load_array(path, device="cpu"), data)
    with open(path, "ab") as f:
        f.write(b"junk")
    with pytest.raises(stoker.ShardFormatError, match=r"tail\.nii\.gz: offset \d+:.*neither"):
        stoker.load_array(path, device="cpu")
    path, data = with_trailing(tmp_path / "tail.nii", (1 << 20) + 1)  # more than finish's default
    with pytest.raises(stoker.ShardFormatError, match=r"tail\.nii\.gz: offset \d+:.*1048576"):
        stoker.load_array(path, device="cpu")
    path, data = with_trailing(tmp_path / "tail.nii", 5000, members=2)
    with open(path, "rb") as f:
        whole = f.read()
    with open(path, "wb") as f:
        f.write(whole[:-12])  # the file ends inside the member after the voxels
    with pytest.raises(stoker.ShardFormatError, match=r"tail\.nii\.gz: offset \d+:.*inside"):
        stoker.load_array(path, device="cpu")


def test_gzip_file_finish(tmp_path):
    path = tmp_path / "a.gz"
    path.write_bytes(gzip.compress(b"x" * 5000) + gzip.compress(b"y" * 3000))
    stream = stoker._core.GzipFile(str(path))
    stream.skip(4000)
    with pytest.raises(stoker.ShardFormatError, match=r"a\.gz: offset \d+:.*more than 3999"):
        stream.finish(max_trailing=3999)
    stream = stoker._core.GzipFile(str(path))
    stream.skip(4000)
    stream.finish(max_trailing=4000)
    assert stream.produced == 8000 and stream.at_end()


@pytest.mark.parametrize("version", [1, 2])
def test_nii_gz_dimensions_more_than_the_file_can_hold(tmp_path, version):
    plain = write_nifti(tmp_path / "huge.nii", volume("int16", (4, 5, 6)), version)
    at, kind = FIELDS[version]["dim"]
    _patch(plain, at + np.dtype(kind).itemsize, kind, [30000, 30000, 30000])  # 54 TB
    path = gzip_copy(plain)
    _fails(path, offset=at, match=r"ask for \d+ bytes.*more than the file can hold")
    with pytest.raises(stoker.ShardFormatError, match=r"huge\.nii\.gz: offset"):
        stoker.GDSCache(tmp_path / "cache").put("huge", path)


def test_nii_gz_compressed_as_far_as_deflate_goes(tmp_path):
    # Zeros deflate about 1030 to 1: as far as the bound on dimensions allows.
    data = np.zeros((256, 256, 128), np.uint8)
    path = gzip_copy(write_nifti(tmp_path / "zeros.nii", data))
    assert data.nbytes > 1000 * os.path.getsize(path)
    assert _same(stoker.load_array(path, device="cpu"), data)


@pytest.mark.parametrize(
    "version, value",
    [(1, -16), (1, "past-end"), (1, float("nan")), (1, 352.5), (2, -16), (2, "past-end")],
)
def test_impossible_vox_offset(tmp_path, version, value):
    path = write_nifti(tmp_path / "off.nii", volume("int16", (4, 5, 6)), version)
    at, kind = FIELDS[version]["vox_offset"]
    if value == "past-end":
        value = os.path.getsize(path) + 4096
    _patch(path, at, kind, value)
    _fails(path, offset=at, match="vox_offset")


def test_vox_offset_below_the_header_means_its_end(tmp_path):
    # The standard: a .nii's vox_offset under 352 means 352 (old writers left 0).
    data = volume("int16", (4, 5, 6))
    path = write_nifti(tmp_path / "zero.nii", data)
    _patch(path, 108, "f4", 0.0)
    assert stoker.nifti_header(path)["offset"] == 352
    assert _same(stoker.load_array(path, device="cpu"), data)


@pytest.mark.parametrize("version", [1, 2])
def test_bad_magic(tmp_path, version):
    path = write_nifti(tmp_path / "magic.nii", volume("int16", (4, 5, 6)), version)
    at = FIELDS[version]["magic"]
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(b"XYZ\0")
    _fails(path, offset=at, match="magic")
    _fails(gzip_copy(path), offset=at, match="magic")


def test_nifti2_magic_damaged_by_text_mode(tmp_path):
    path = write_nifti(tmp_path / "text.nii", volume("int16", (4, 5, 6)), 2)
    _patch(path, 8, "u1", np.frombuffer(b"\n\n\x1a\n", np.uint8))
    _fails(path, offset=4, match="text mode")


@pytest.mark.parametrize("pair", [nib.Nifti1Pair, nib.Nifti2Pair])
def test_hdr_img_pair_refused(tmp_path, pair):
    pair(volume("int16", (4, 5, 6)), AFFINE).to_filename(str(tmp_path / "pair.img"))
    header = str(tmp_path / "pair.hdr")
    _fails(header, match=r"\.hdr/\.img pair")
    with pytest.raises(stoker.ShardFormatError, match=r"pair\.img.*\.hdr/\.img pair"):
        stoker.load_array(tmp_path / "pair.img", device="cpu")
    os.rename(header, tmp_path / "renamed.nii")  # a pair's header, named as a single file
    _fails(str(tmp_path / "renamed.nii"), match="pair")


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize(
    "field, value, match",
    [
        ("datatype", 3, "datatype 3 is not"),
        ("datatype", 1536, "float128"),
        ("datatype", 1, "binary"),
        ("bitpix", 8, "bitpix is 8"),
        ("dim0", 0, r"dim\[0\]"),
        ("dim0", 9, r"dim\[0\]"),
        ("dim2", -3, r"dim\[2\] is -3"),
    ],
)
def test_bad_header_fields(tmp_path, version, field, value, match):
    path = write_nifti(tmp_path / "field.nii", volume("int16", (4, 5, 6)), version)
    if field.startswith("dim"):
        base, kind = FIELDS[version]["dim"]
        at = base + int(field[3:]) * np.dtype(kind).itemsize
    else:
        at, kind = FIELDS[version][field]
    _patch(path, at, kind, value)
    _fails(path, offset=at, match=match)
    _fails(gzip_copy(path), offset=at, match=match)


def test_not_nifti(tmp_path):
    path = tmp_path / "text.nii"
    path.write_bytes(b"hello, this is not a volume" * 30)
    _fails(str(path), offset=0, match="sizeof_hdr")
    with pytest.raises(stoker.ReadError, match=r"absent\.nii"):
        stoker.load_array(tmp_path / "absent.nii", device="cpu")
    with pytest.raises(stoker.UsageError, match=r"scan\.mha"):
        stoker.load_array(tmp_path / "scan.mha", device="cpu")


# ---- GDSCache from a file ----------------------------------------------------------------


def _data_offset(path) -> int:
    with open(path, "rb") as f:
        np.lib.format.read_magic(f)
        np.lib.format.read_array_header_1_0(f)
        return f.tell()


@pytest.mark.parametrize("suffix", [".nii.gz", ".nii"])
@pytest.mark.parametrize("big_endian", [False, True])
def test_gdscache_put_from_nifti(tmp_path, monkeypatch, suffix, big_endian):
    monkeypatch.setattr(stoker.gds, "_BOUNCE_CHUNK", 1000)  # many pieces, one partial
    data = volume("int16", (21, 17, 9, 2), seed=7)
    source = write_nifti(tmp_path / f"vol{suffix}", data, 2, big_endian=big_endian)
    expected = reference(source)
    cache = stoker.GDSCache(tmp_path / "cache")
    path = cache.put("vol", source)
    assert _data_offset(path) % 4096 == 0
    stored = np.load(path)  # nibabel's array, as numpy reads the file
    assert np.array_equal(stored, expected) and stored.dtype.isnative
    t = cache.get("vol", device="cpu")
    assert _same(t, expected)  # what load_array gives: the (x, y, z, t) view
    assert torch.equal(t, stoker.load_array(source, device="cpu"))
    assert os.listdir(tmp_path / "cache") == ["vol.npy"]


def test_gdscache_put_from_npy_and_rgb(tmp_path):
    cache = stoker.GDSCache(tmp_path / "cache")
    a = volume("float64", (30, 20))
    np.save(tmp_path / "a.npy", a)
    cache.put("a", str(tmp_path / "a.npy"))
    assert _same(cache.get("a", device="cpu"), a)
    source = write_nifti(tmp_path / "rgb.nii.gz", volume("RGB24", (5, 6, 7)))
    cache.put("rgb", source)
    t = cache.get("rgb", device="cpu")
    assert _same(t, reference(source)) and t.is_contiguous()


def test_gdscache_put_from_a_bad_file_leaves_nothing(tmp_path):
    path = write_nifti(tmp_path / "bad.nii.gz", volume("int16", (40, 40, 10)))
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) * 2 // 3])
    cache = stoker.GDSCache(tmp_path / "cache")
    with pytest.raises(stoker.ShardFormatError, match=r"bad\.nii\.gz"):
        cache.put("bad", path)
    assert "bad" not in cache and os.listdir(tmp_path / "cache") == []
    with pytest.raises(stoker.UsageError, match=r"vol\.mha"):
        cache.put("x", str(tmp_path / "vol.mha"))


# ---- device="cuda" on a machine without CUDA ---------------------------------------------

_PROBE = """
import json, stoker._core, torch
print(json.dumps(bool(stoker._core.cuda_driver_status()["available"])
                 or bool(torch.cuda.is_available())))
"""


def test_cuda_refused_without_cuda(tmp_path):
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True)
    if done.returncode or json.loads(done.stdout.strip().splitlines()[-1]):
        pytest.skip("CUDA is usable here (or cannot be ruled out): the refusal is for machines "
                    "without it")  # fmt: skip
    for suffix in (".nii", ".nii.gz"):
        path = write_nifti(tmp_path / f"vol{suffix}", volume("int16", (4, 5, 6)))
        with pytest.raises(stoker.StokerError, match=re.compile("cuda", re.I)):
            stoker.load_array(path, device="cuda")


# ---- the device paths, through the host-memory stand-in for the driver -------------------
# tests/cuda/test_cuda_standin.py describes the stand-in: it checks ordering and logic only (a
# pinned slot is never refilled before its copy has run, copies come from pinned memory),
# never a real GPU; tests/gpu/test_nifti_gpu.py does that.

STANDIN_MARK = "NIFTI-STANDIN-RESULT "


def _standin_scenario(libs: list[str], root: str) -> dict:
    """In a fresh interpreter driven by the stand-in: load_array of .nii and .nii.gz
    volumes onto "cuda" (host memory underneath), and GDSCache from a .nii.gz, with
    bounce slots small enough that a volume takes many and the ring is reused."""
    import stoker.cuda
    import stoker.gds
    from stoker import _core
    from tests.support.standin_lib import FakeCuda, HostMemory

    fake = FakeCuda(libs[0])
    fake.set_copy_delay_us(3000)  # copies run late: a slot refilled too early shows
    stoker.gds._BOUNCE_CHUNK = 64 << 10  # before the ring is made
    consumer = _core.CopyStream(0)
    stoker.cuda.use_device_memory(HostMemory(consumer.handle))
    paths = []
    for i, (version, dtype, shape) in enumerate(
        [(1, "int16", (130, 90, 21)), (2, "float32", (65, 47, 33)), (1, "RGB24", (80, 61, 9))]
    ):
        for suffix in (".nii", ".nii.gz"):
            paths.append(
                write_nifti(os.path.join(root, f"v{i}{suffix}"), volume(dtype, shape, i), version)
            )
    fake.reset()
    wrong = []
    for path in paths:
        t = stoker.load_array(path, device="cuda")
        consumer.record().wait()  # every copy handed to the consumer has landed
        if not _same(t, reference(path)):
            wrong.append(os.path.basename(path))
    cache = stoker.GDSCache(os.path.join(root, "cache"))
    cache.put("v1", paths[3])
    t = cache.get("v1", device="cuda")
    consumer.record().wait()
    if not _same(t, reference(paths[3])):
        wrong.append("GDSCache")
    return {"wrong": wrong, "stats": fake.stats()}


def test_device_paths_through_the_standin(standin_libs, tmp_path):
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("STOKER_", "FAKE_CUDA", "FAKE_CUFILE"))
    }
    environ["STOKER_LIBCUDA"] = standin_libs[0]
    environ["STOKER_LIBCUFILE"] = "/nonexistent/stoker-standin/libcufile.so.0"  # bounce
    code = (
        child_preamble(__name__)
        + f"r = m._standin_scenario({list(standin_libs)!r}, {str(tmp_path)!r})\n"
        f"print({STANDIN_MARK!r} + json.dumps(r), flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-8000:]
    lines = [x for x in done.stdout.splitlines() if x.startswith(STANDIN_MARK)]
    r = json.loads(lines[-1][len(STANDIN_MARK) :])
    assert r["wrong"] == []  # exact, .nii bounced and .nii.gz inflated
    s = r["stats"]
    assert s["copies"] > 40  # many slots per volume
    assert s["overwritten_sources"] == 0 and s["pageable_copies"] == 0
    assert s["unpinned_at_copy"] == 0 and s["no_context_calls"] == 0
