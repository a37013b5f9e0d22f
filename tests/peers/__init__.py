"""Tests of datasets other loaders wrote, read in place (stoker.peers)."""
