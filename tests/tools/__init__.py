"""Tests of the command line and the plain file server (stoker.tools)."""
