"""Stitching per-patch predictions back into a volume, on the device they are on."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stoker.cuda import require_torch
from stoker.errors import UsageError

WEIGHTS = ("uniform", "gaussian")


class PatchAggregator:
    """Sums predictions of patches (a GridSampler's, typically) into one volume, each
    voxel the weighted mean of the patches that cover it, as MONAI's
    ``sliding_window_inference`` and TorchIO's ``GridAggregator`` do.

    Args:
        spatial_shape: The volume's spatial shape.
        patch_size: The patches' spatial size.
        channels: Channels of the predictions.
        weights: ``"uniform"``, or ``"gaussian"``: a patch's voxels weigh by a Gaussian
            of its centre, of standard deviation ``sigma_scale * patch_size`` per axis,
            so that overlaps favour the middle of patches, where predictions are best.
        sigma_scale: For Gaussian weights.
        device: Where the volume is summed (default: the first predictions' device).
        dtype: The sums' type (default: float32).

    ``add(predictions, locations)`` takes a batch: ``(B, C, *patch_size)`` predictions
    and the batch's ``"location"``; parts of a patch outside the volume (padding) are
    dropped. ``result()`` is the ``(C, *spatial_shape)`` volume; voxels no patch covered
    are 0.
    """

    def __init__(
        self,
        spatial_shape: Sequence[int],
        patch_size: Sequence[int],
        channels: int = 1,
        *,
        weights: str = "uniform",
        sigma_scale: float = 0.125,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        if weights not in WEIGHTS:
            raise UsageError(f"PatchAggregator(weights={weights!r}): one of {WEIGHTS}")
        if len(spatial_shape) != len(patch_size):
            raise UsageError(
                f"PatchAggregator: spatial_shape {tuple(spatial_shape)} and patch_size "
                f"{tuple(patch_size)} have different numbers of axes"
            )
        self.spatial_shape = tuple(int(s) for s in spatial_shape)
        self.patch_size = tuple(int(p) for p in patch_size)
        self.channels = channels
        self.weights = weights
        self.sigma_scale = sigma_scale
        self._device = device
        self._dtype = dtype
        self._sum: Any = None
        self._weight: Any = None
        self._patch_weight: Any = None

    def _start(self, like: Any) -> None:
        torch = require_torch()
        device = self._device if self._device is not None else like.device
        dtype = self._dtype if self._dtype is not None else torch.float32
        self._sum = torch.zeros((self.channels, *self.spatial_shape), dtype=dtype, device=device)
        self._weight = torch.zeros(self.spatial_shape, dtype=dtype, device=device)
        if self.weights == "uniform":
            self._patch_weight = torch.ones(self.patch_size, dtype=dtype, device=device)
        else:
            ramp = []
            for p in self.patch_size:
                x = torch.arange(p, dtype=torch.float64) - (p - 1) / 2
                sigma = max(self.sigma_scale * p, 1e-6)
                ramp.append(torch.exp(-0.5 * (x / sigma) ** 2))
            w = ramp[0]
            for r in ramp[1:]:
                w = w[..., None] * r
            w = w / w.max()
            # No voxel may weigh 0: a voxel covered only by patch edges still gets a value.
            w = torch.clamp(w, min=1e-3)
            self._patch_weight = w.to(dtype=dtype, device=device)

    def add(self, predictions: Any, locations: Any) -> None:
        """Add a batch of predictions at their patches' locations."""
        if self._sum is None:
            self._start(predictions)
        if tuple(predictions.shape[2:]) != self.patch_size:
            raise UsageError(
                f"PatchAggregator.add: predictions of spatial shape "
                f"{tuple(predictions.shape[2:])}, patches are {self.patch_size}"
            )
        if predictions.shape[1] != self.channels:
            raise UsageError(
                f"PatchAggregator.add: predictions of {predictions.shape[1]} channels, "
                f"the aggregator has {self.channels}"
            )
        predictions = predictions.to(device=self._sum.device, dtype=self._sum.dtype)
        for prediction, location in zip(predictions, locations.tolist()):
            inside, within = [], []
            for start, p, s in zip(location, self.patch_size, self.spatial_shape):
                lo, hi = max(start, 0), min(start + p, s)
                if lo >= hi:
                    break
                inside.append(slice(lo, hi))
                within.append(slice(lo - start, hi - start))
            else:
                w = self._patch_weight[tuple(within)]
                every_channel = (slice(None),)
                self._sum[every_channel + tuple(inside)] += (
                    prediction[every_channel + tuple(within)] * w
                )
                self._weight[tuple(inside)] += w

    def result(self) -> Any:
        """The volume: each voxel's weighted mean over the patches that covered it."""
        if self._sum is None:
            raise UsageError("PatchAggregator.result: no predictions were added")
        torch = require_torch()
        covered = self._weight > 0
        return torch.where(covered, self._sum / torch.where(covered, self._weight, 1), 0)
