"""Benchmarks, run as modules (``python -m bench.<name>``); not imported by the sidecar."""
