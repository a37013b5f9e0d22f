"""Tests of opening and describing datasets, grouping, member indexes (stoker.dataset)."""
