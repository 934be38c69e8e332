"""Test doubles for the sidecar: ``openengine-mock`` (``sidecar.testing.mock``) and its fault helpers.

Production code never imports this package (``docs/architecture.md``).
"""
