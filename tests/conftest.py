"""Test rulebook (trio-websocket style).

* Servers bind loopback only, on ports the OS picks (port 0); nothing listens on 0.0.0.0.
* Timing is asserted in virtual time (``autojump_clock``) wherever the code under test is pure trio.
* Every test that does real I/O runs under an absolute bound (``fail_after``) so a hang fails, never blocks CI.
* Every load loop is bounded in count and in time and stops by itself.
* Processes started by a test are stopped by the same test (fixtures own them), even when it fails.
"""
