"""Write a few tar shards with the standard library, then read them with stoker.

python examples/quickstart.py
"""

import io
import os
import tarfile
import tempfile
import time

import numpy as np

import stoker

with tempfile.TemporaryDirectory() as folder:
    rng = np.random.default_rng(0)
    for s in range(4):  # 4 shards x 1,000 samples: a 3x64x64 image and a label each
        with tarfile.open(os.path.join(folder, f"shard-{s:06d}.tar"), "w") as tar:
            for i in range(1000):
                for field, data in [
                    ("raw", rng.integers(0, 256, 3 * 64 * 64, dtype=np.uint8).tobytes()),
                    ("cls", str(i % 10).encode()),
                ]:
                    info = tarfile.TarInfo(f"{s:02d}{i:05d}.{field}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))

    ds = stoker.Dataset(os.path.join(folder, "shard-{000000..000003}.tar"))
    print(ds)
    sample = ds[123]
    image = sample["raw"].reshape(3, 64, 64)  # a zero-copy view of the bytes read
    print("sample", sample["__key__"], "image", image.shape, "label", bytes(sample["cls"]).decode())

    order = np.random.default_rng(1).permutation(len(ds))
    start = time.perf_counter()
    for i in range(0, len(ds), 64):
        batch = ds.get_batch(order[i : i + 64])
    seconds = time.perf_counter() - start
    print(f"read {len(ds)} shuffled samples in batches of 64: {len(ds) / seconds:,.0f} samples/s")
