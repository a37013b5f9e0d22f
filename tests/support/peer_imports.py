"""Importing the peers stoker is compared with, where their packages import more than the
parts the tests and benchmarks use: MosaicML Streaming imports torchvision (for its vision
datasets) and transformers (for its dataloader's batch types) at import time. Where one of
them cannot be imported (PyPI's torchvision does not load beside the CPU torch CI installs;
transformers is not installed), placeholder modules stand in for it, so that the real
StreamingDataset and MDSWriter are what run; they hold what other libraries look up in a
module they find in sys.modules (datasets: transformers.PreTrainedTokenizerBase). They
leave sys.modules once streaming is imported (it takes what it needs from them then):
other libraries in the same process ask sys.modules whether torchvision is installed
(torchmetrics, under Lightning, then imports torchvision.models)."""

from __future__ import annotations

import importlib.machinery
import sys
import types
from typing import Any


def _placeholders(modules: list[tuple[str, dict[str, Any]]], added: list[str]) -> None:
    for name, attrs in modules:
        added.append(name)
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__path__ = []
        module.__version__ = "0.0.0"
        module.__dict__.update(attrs)
        sys.modules[name] = module


def import_streaming() -> Any:
    """mosaicml-streaming (ImportError when it is not installed)."""
    added: list[str] = []
    try:
        return _import_streaming(added)
    finally:
        for name in added:
            sys.modules.pop(name, None)


def _import_streaming(added: list[str]) -> Any:
    try:
        import torchvision  # noqa: F401
    except Exception:

        class VisionDataset:  # only streaming.vision refers to it, which is not used
            pass

        _placeholders(
            [
                ("torchvision", {}),
                ("torchvision.datasets", {"VisionDataset": VisionDataset}),
                ("torchvision.transforms", {}),
                ("torchvision.transforms.functional", {"to_tensor": None}),
            ],
            added,
        )
    try:
        import transformers  # noqa: F401
    except Exception:

        class BatchFeature(dict):
            pass

        class BatchEncoding(dict):
            pass

        class PreTrainedTokenizerBase:  # what datasets' pickler looks for once the module is in
            pass  # sys.modules: no object is one

        _placeholders(
            [
                ("transformers", {"PreTrainedTokenizerBase": PreTrainedTokenizerBase}),
                ("transformers.feature_extraction_utils", {"BatchFeature": BatchFeature}),
                ("transformers.tokenization_utils_base", {"BatchEncoding": BatchEncoding}),
                ("transformers.models", {}),
                ("transformers.models.auto", {}),
                ("transformers.models.auto.tokenization_auto", {"AutoTokenizer": None}),
            ],
            added,
        )
    import streaming

    return streaming
