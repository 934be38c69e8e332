"""Test rulebook (trio-websocket style).

* Servers bind loopback only, on ports the OS picks (port 0); nothing listens on 0.0.0.0.
* Timing is asserted in virtual time (``autojump_clock``) wherever the code under test is pure trio.
* Every test that does real I/O runs under an absolute bound (``fail_after``) so a hang fails, never blocks CI.
* Every test also has a wall-clock bound (pytest-timeout, ``timeout`` in pyproject.toml: 300 s, fixtures included):
  virtual time cannot bound a loop that never blocks. A test that needs longer says so with
  ``@pytest.mark.timeout(seconds)``, its own bound plus a margin.
* Tests wait on events, never on time: a sleep never stands for "by now X happened"; wait for X with
  ``tests.helpers.waits.wait_until`` (one polling helper, bounded). A sleep that remains paces a load or makes a fake
  slow on purpose, and its comment says so.
* Every load loop is bounded in count and in time and stops by itself.
* Processes started by a test are stopped by the same test (fixtures own them), even when it fails.
"""
