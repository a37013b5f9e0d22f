"""Tests of the Loader, its sampler, and the frameworks' own loops (stoker.loader)."""
