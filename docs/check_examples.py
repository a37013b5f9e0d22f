"""Run the Python examples of the documentation: every ```python block of docs/*.md.

Each block runs in a fresh process, in a fresh temporary folder, with the small data it
needs written there first. The HTML comment on the line before a block says how:

    <!-- run with: shards, my_collate -->   the fixtures it needs (files, or names defined
                                            before the block's first line)
    <!-- not run: needs a GPU -->           skipped, for the reason given

A block with no comment runs with no fixtures. The run lists every block it skipped and
why, and exits non-zero when a block that runs fails (or names an unknown fixture).

    python docs/check_examples.py [docs/loader.md ...]
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

DOCS = Path(__file__).resolve().parent
# The repository's root, for tests.support (the peers' placeholder imports): this script
# runs from any folder.
sys.path.insert(0, str(DOCS.parent))
TIMEOUT_S = 120  # a block that needs longer than this is not an example any more

_FENCE_OPEN = re.compile(r"^```python\s*$")
_FENCE_CLOSE = re.compile(r"^```\s*$")
_RUN_WITH = re.compile(r"^<!--\s*run with:\s*(.*?)\s*-->$")
_NOT_RUN = re.compile(r"^<!--\s*not run:\s*(.*?)\s*-->$")


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, counted from 1
    code: str
    fixtures: list[str] = field(default_factory=list)
    skip_reason: str | None = None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(DOCS.parent)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").split("\n")
    found = []
    i = 0
    while i < len(lines):
        if not _FENCE_OPEN.match(lines[i]):
            i += 1
            continue
        start = i
        i += 1
        while i < len(lines) and not _FENCE_CLOSE.match(lines[i]):
            i += 1
        block = Block(page, start + 1, "\n".join(lines[start + 1 : i]) + "\n")
        before = next((s.strip() for s in reversed(lines[:start]) if s.strip()), "")
        if match := _NOT_RUN.match(before):
            block.skip_reason = match.group(1)
        elif match := _RUN_WITH.match(before):
            block.fixtures = [f.strip() for f in match.group(1).split(",") if f.strip()]
        found.append(block)
        i += 1
    return found


# -- fixtures: what a block needs, written into its folder --------------------------


def _jpeg(i: int, size: tuple[int, int] = (64, 48)) -> bytes:
    from PIL import Image

    image = Image.new("RGB", size, (i * 37 % 256, 90, 200 - i * 11 % 200))
    out = io.BytesIO()
    image.save(out, "JPEG", quality=90)
    return out.getvalue()


def _png(i: int) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (32, 32), (10, i * 7 % 256, 60)).save(out, "PNG")
    return out.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def make_shards(root: Path) -> None:
    """data/shard-000000.tar ... shard-000099.tar, 4 samples each (jpg, cls, raw), and
    their stoker.json."""
    from stoker.manifest import write_manifest

    folder = root / "data"
    folder.mkdir()
    jpegs = [_jpeg(i) for i in range(8)]
    paths = []
    for shard in range(100):
        path = folder / f"shard-{shard:06d}.tar"
        with tarfile.open(path, "w") as tar:
            for j in range(4):
                n = shard * 4 + j
                key = f"n{n % 10:08d}/{n:04d}"
                _add(tar, f"{key}.jpg", jpegs[n % len(jpegs)])
                _add(tar, f"{key}.cls", str(n % 10).encode())
                _add(tar, f"{key}.raw", bytes([n % 256]) * (3 * 64 * 64))
        paths.append(path)
    write_manifest(paths, folder)


def make_csv(root: Path) -> None:
    """labels_train.csv (filename,label rows) and the 32 PNGs of labels_train/."""
    folder = root / "labels_train"
    folder.mkdir()
    rows = []
    for i in range(32):
        (folder / f"img{i:03d}.png").write_bytes(_png(i))
        rows.append(f"img{i:03d}.png,{(i + 3) % 10}")
    (root / "labels_train.csv").write_text("filename,label\n" + "\n".join(rows) + "\n")


def make_two_tars(root: Path) -> None:
    """a.tar and b.tar, each a few KiB of members."""
    for name in ("a.tar", "b.tar"):
        with tarfile.open(root / name, "w") as tar:
            for i in range(4):
                _add(tar, f"{i:04d}.bin", bytes(range(256)) * 4)


def make_arrays(root: Path) -> None:
    """train.h5 and train.zarr: 512 rows of images (3, 64, 64) uint8 and meta/labels
    int64, in chunks of 64 rows."""
    import h5py
    import zarr

    rows = 512
    images = np.random.default_rng(0).integers(0, 256, (rows, 3, 64, 64), dtype=np.uint8)
    labels = np.arange(rows, dtype=np.int64) % 10
    with h5py.File(root / "train.h5", "w") as f:
        f.create_dataset("images", data=images, chunks=(64, 3, 64, 64))
        f.create_dataset("meta/labels", data=labels)
    group = zarr.open_group(root / "train.zarr", mode="w")
    group.create_array("images", shape=images.shape, chunks=(64, 3, 64, 64), dtype="uint8")
    group["images"][:] = images
    meta = group.create_group("meta")
    meta.create_array("labels", shape=labels.shape, chunks=(64,), dtype="int64")
    meta["labels"][:] = labels


def make_volumes(root: Path) -> None:
    """ct/patient-0001.nii.gz: a small int16 volume, written by nibabel."""
    import nibabel

    (root / "ct").mkdir()
    volume = np.arange(4 * 5 * 6, dtype=np.int16).reshape(4, 5, 6)
    nibabel.save(nibabel.Nifti1Image(volume, np.eye(4)), root / "ct" / "patient-0001.nii.gz")


def make_subjects(root: Path) -> None:
    """imagesTr/ and labelsTr/ as the Medical Segmentation Decathlon keeps them: four
    48^3 int16 CT-like volumes (.nii.gz) and their uint8 labels, written by nibabel."""
    import nibabel

    rng = np.random.default_rng(0)
    for folder in ("imagesTr", "labelsTr"):
        (root / folder).mkdir()
    for i in range(4):
        image = rng.integers(-1000, 1000, (48, 48, 48)).astype(np.int16)
        label = np.zeros((48, 48, 48), np.uint8)
        label[16:32, 16:32, 16:32] = 1
        affine = np.diag([0.8, 0.8, 1.5, 1.0])
        name = f"case_{i:03d}.nii.gz"
        nibabel.save(nibabel.Nifti1Image(image, affine), root / "imagesTr" / name)
        nibabel.save(nibabel.Nifti1Image(label, affine), root / "labelsTr" / name)


_LITDATA_WRITER = textwrap.dedent(
    """
    import sys

    import litdata
    import numpy as np


    def sample(i):
        return {"image": np.full((3, 64, 64), i % 256, np.uint8), "label": i}


    if __name__ == "__main__":
        litdata.optimize(fn=sample, inputs=list(range(300)), output_dir=sys.argv[1],
                         chunk_size=100, num_workers=1)
    """
)


def make_peers(root: Path) -> None:
    """mds_out/ as MosaicML Streaming's MDSWriter writes it, optimized/ as LitData's
    optimize() does: 300 samples of image (3, 64, 64) uint8 and an int label."""
    from tests.support.peer_imports import import_streaming

    streaming = import_streaming()
    columns = {"image": "ndarray:uint8:3,64,64", "label": "int"}
    with streaming.MDSWriter(out=str(root / "mds_out"), columns=columns) as writer:
        for i in range(300):
            writer.write({"image": np.full((3, 64, 64), i % 256, np.uint8), "label": i})
    script = root.parent / "write_litdata.py"
    script.write_text(_LITDATA_WRITER)
    result = subprocess.run(
        [sys.executable, str(script), str(root / "optimized")],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    if result.returncode != 0:
        raise RuntimeError(f"litdata.optimize failed:\n{result.stderr[-2000:]}")


# Names a block uses without defining them, defined before its first line.
_RECORDS = """\
import io as _io

import numpy as _np
from PIL import Image as _Image


def _jpeg_bytes(i):
    out = _io.BytesIO()
    _Image.new("RGB", (32, 24), (i * 20 % 256, 80, 160)).save(out, "JPEG")
    return out.getvalue()


records = [
    (_jpeg_bytes(i), i % 10, _np.full(8, i, _np.float32), {"source": "example", "i": i})
    for i in range(50)
]
"""

_MY_COLLATE = """\
def my_collate(samples):
    return samples
"""

FIXTURES: dict[str, tuple[Callable[[Path], None] | None, str]] = {
    "shards": (make_shards, ""),
    "csv": (make_csv, ""),
    "two_tars": (make_two_tars, ""),
    "arrays": (make_arrays, ""),
    "volumes": (make_volumes, ""),
    "subjects": (make_subjects, ""),
    "peers": (make_peers, ""),
    "records": (None, _RECORDS),
    "my_collate": (None, _MY_COLLATE),
}


# -- running -----------------------------------------------------------------------


def run_block(block: Block) -> tuple[bool, str]:
    """(whether it passed, what to say about it)."""
    unknown = [f for f in block.fixtures if f not in FIXTURES]
    if unknown:
        return False, f"unknown fixture(s) {', '.join(unknown)}: known are {', '.join(FIXTURES)}"
    with tempfile.TemporaryDirectory(prefix="stoker-example-") as scratch:
        folder = Path(scratch) / "work"
        folder.mkdir()
        preamble = []
        for name in block.fixtures:
            make, code = FIXTURES[name]
            if make is not None:
                make(folder)
            preamble.append(code)
        script = Path(scratch) / "example.py"  # outside the folder the block sees
        script.write_text("".join(preamble) + block.code)
        env = dict(os.environ)
        env["STOKER_CACHE"] = str(Path(scratch) / "node-cache")  # not the user's cache
        env.pop("STOKER_GDS", None)
        try:
            result = subprocess.run(
                [sys.executable, str(script)],
                cwd=folder,
                env=env,
                capture_output=True,
                text=True,
                timeout=TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            return False, f"still running after {TIMEOUT_S} s"
    if result.returncode != 0:
        tail = textwrap.indent(result.stderr[-3000:], "    ")
        return False, f"exit status {result.returncode}:\n{tail}"
    return True, ""


def main(argv: list[str]) -> int:
    pages = [Path(a).resolve() for a in argv] or sorted(DOCS.glob("*.md"))
    blocks = [b for page in pages for b in blocks_of(page)]
    skipped = [b for b in blocks if b.skip_reason is not None]
    failed = []
    ran = 0
    for block in blocks:
        if block.skip_reason is not None:
            continue
        start = time.perf_counter()
        passed, message = run_block(block)
        took = time.perf_counter() - start
        ran += 1
        fixtures = f" [{', '.join(block.fixtures)}]" if block.fixtures else ""
        print(f"{'ok  ' if passed else 'FAIL'} {block.where}{fixtures} ({took:.1f} s)")
        if not passed:
            failed.append(block)
            print(message)
    for block in skipped:
        print(f"skip {block.where}: {block.skip_reason}")
    summary = {"blocks": len(blocks), "ran": ran, "failed": len(failed), "skipped": len(skipped)}
    print(json.dumps(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
