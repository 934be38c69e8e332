"""Tests of the lifecycle state machines (pure, synchronous: no trio needed)."""
