"""Tests of http(s) and s3:// sources, the node cache, faults and soak (stoker.remote)."""
