"""Importing stoker and reading on the CPU must never initialise CUDA (it would break fork)."""

import subprocess
import sys


def test_import_does_not_initialise_cuda(tmp_path):
    code = (
        "import torch, numpy as np, stoker\n"
        f"np.save({str(tmp_path / 'a.npy')!r}, np.arange(10))\n"
        f"stoker.Dataset({str(tmp_path / 'a.npy')!r}).get_batch(range(10))\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
