"""The command line and what it runs: ``stoker demo | pack | index | inspect | fetch |
bench``, and a small HTTP server for tests and benchmarks (``python -m stoker.tools.serve``).
Nothing in the runtime packages imports from here."""
