"""Tests of patches from volumes: Volumes, PatchLoader, the samplers, the aggregator
(stoker.volumes)."""
