"""Tests of the operator surface (``sidecar.ops``): metrics, logs, live state feed and page, operator subcommands.

In-process tests drive the machines with their own lifecycle models and talk to a real ops server over loopback
with a real trio-websocket client; ``test_stack.py`` and ``test_browser.py`` run the real frontend, openengine-mock
and openengine-sidecar processes (marked ``e2e``). Every I/O test runs under ``trio.fail_after``.
"""
