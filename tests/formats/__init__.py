"""Tests of tar, zip and npy shards, crafted malformed ones, the C++ reader."""
