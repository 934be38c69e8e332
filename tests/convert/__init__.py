"""Table-driven tests of ``sidecar.convert`` (pure: no I/O, no trio)."""
