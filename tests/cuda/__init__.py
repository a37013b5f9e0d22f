"""Tests of the CUDA path through the host-memory stand-in, and GDS on the CPU."""
