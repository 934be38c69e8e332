"""Tests of ``sidecar.edge``, the trio ⇄ asyncio bridge.

Rulebook (on top of ``tests/conftest.py``):

* Real threads and real time: the edge loop runs on its own thread, so ``autojump_clock`` does not apply. Every test
  runs under ``trio.fail_after`` so that a lost wake-up fails instead of hanging.
* Each test gets its own edge (the ``edge`` fixture), closed at teardown; lifecycle tests open their own.
* What happens on the asyncio side is recorded by the asyncio code itself, on the edge thread, into plain lists or
  counters; trio reads them only after the bridge handed control back, or by polling under the test's bound.
* Timing assertions are about the bridge, not the machine: generous bounds, or a median over several runs, so a
  noisy 2-core runner does not flake them.
"""
