"""Fault-injection suite: real processes over loopback (frontend, openengine-mock, openengine-sidecar).

Rulebook: every case asserts its outcome end to end — each request gets its complete output or a typed error (never
a truncated success), the engine holds no request afterwards (GetLoad), and the worker ends in the expected state
(its own log and exit status). Loopback only; every wait bounded; every process killed by the fixture that started
it. The table of cases is ``docs/faults.md``.
"""
