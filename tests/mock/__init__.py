"""Tests of ``openengine-mock``: unit tests of its parts and black-box tests against a real subprocess.

Black-box tests start ``python -m sidecar.testing.mock --port 0 --port-file … --speedup 0`` through the fixtures in
``conftest.py`` (which always stop it) and talk to it with a plain grpclib asyncio client over the upb stubs
(``_client.py``). They are sync tests that run their asyncio code with ``asyncio.run`` under a ``wait_for`` bound.
"""
