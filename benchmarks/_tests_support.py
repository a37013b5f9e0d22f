"""Puts the repository's root on ``sys.path``, so the benchmarks (scripts, run from any
folder) import what they share with the tests from ``tests.support``: its HTTP server
with a link model, SeaweedFS as an S3 store, the peers' placeholder imports. Import it
before any ``tests.support`` import."""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
