"""Patches from large volumes: subjects of arrays on one grid (``Volumes``), batches of
patches that read only the bytes each patch needs (``PatchLoader``), where patches go
(``UniformSampler``, ``LabelSampler``, ``GridSampler``), and predictions stitched back
into a volume (``PatchAggregator``)."""

from stoker.volumes.aggregate import PatchAggregator
from stoker.volumes.patches import PatchLoader
from stoker.volumes.samplers import GridSampler, LabelSampler, PatchSampler, UniformSampler
from stoker.volumes.subjects import Volumes

__all__ = [
    "GridSampler",
    "LabelSampler",
    "PatchAggregator",
    "PatchLoader",
    "PatchSampler",
    "UniformSampler",
    "Volumes",
]
