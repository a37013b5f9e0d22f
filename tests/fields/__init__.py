"""Tests of the field decoders: stoker.Image."""
