"""Tests of ShardWriter and the manifest (stoker.writer)."""
