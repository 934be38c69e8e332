"""Operator surface: metrics (and, later, the live state feed)."""
