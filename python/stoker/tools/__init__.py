"""The command line and what it runs: ``stoker demo | pack | index | inspect | fetch |
bench``, and a plain HTTP file server for a folder of shards (``python -m stoker.tools.serve``).
Nothing in the runtime packages imports from here."""
