"""Tests that need a CUDA device (skipped as a whole without one)."""
