"""The chunk codecs whose libraries are opened at run time (zstd, blosc), never linked:
where they are looked for, and whether each can be used."""

from __future__ import annotations

import glob
import importlib.util
import os
from collections.abc import Sequence
from typing import Any

import stoker._core as _core

#: The codecs whose libraries are opened at run time (never linked).
RUNTIME_CODECS = {"zstd": _core.ChunkFilter.ZSTD, "blosc": _core.ChunkFilter.BLOSC}


def codec_library_dirs(packages: Sequence[str] = ("blosc",)) -> list[str]:
    """The folders where the installed `packages` put their shared libraries.

    Each is found from where the package itself is imported from, and the record of
    files its installer left beside it (``<name>-<version>.dist-info/RECORD``), so a
    package installed anywhere Python imports from (a venv, ``pip install --user``, a
    folder another environment links in with a .pth file) is found, not only one under
    ``sys.prefix``. (Not importlib.metadata: importing it costs every ``import stoker``
    40 ms.)"""
    found: list[str] = []
    for name in packages:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.origin:
            continue
        site = os.path.dirname(os.path.dirname(spec.origin))
        for record in glob.glob(os.path.join(site, f"{name}-*.dist-info", "RECORD")):
            with open(record, encoding="utf-8", errors="replace") as f:
                for line in f:
                    file = line.split(",", 1)[0]
                    base = os.path.basename(file)
                    if base.startswith("lib") and ".so" in base:
                        folder = os.path.dirname(os.path.realpath(os.path.join(site, file)))
                        if folder not in found and os.path.isdir(folder):
                            found.append(folder)
    return found


def codec_status() -> dict[str, dict[str, Any]]:
    """Each codec library stoker opens at run time (``zstd``, ``blosc``): whether it can be
    used, the file it was loaded from, and else why not and what to install.

    libblosc is looked for first beside the ``blosc`` package Python imports, then on the
    system's loader path.

    Returns:
        For each codec's name, a dict of ``available`` (bool), ``library`` (the file it was
        loaded from) and ``reason`` (why it cannot be used, or ``""``).
    """
    status = {}
    for name, codec in RUNTIME_CODECS.items():
        reason = _core.codec_unavailable(codec)
        status[name] = {
            "available": not reason,
            "library": _core.codec_library(codec),
            "reason": reason,
        }
    return status


_core.set_codec_search_dirs(codec_library_dirs())
