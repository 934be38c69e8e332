"""The kit fails the matching check when the engine really misbehaves (mock flags, no test hooks in the kit)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from .conftest import MOCK_SPEED, MockFactory, failed, run_kit

#: The checks these tests break (each run is kept to them: the rest of the kit is covered elsewhere).
ONLY = ("--only", "discovery", "--only", "control.health", "--only", "kv.sequence")


def test_broken_rules_fail_exactly_their_checks(mock_factory: MockFactory, capsys: pytest.CaptureFixture[str]) -> None:
    # The capacity and KV event rules need what only the richer engine advertises (capacity, SubscribeKvEvents).
    mock = mock_factory(
        *MOCK_SPEED,
        "--profile",
        "full",
        "--schema-release",
        "main",
        "--max-output-tokens",
        "4096",
        "--total-kv-blocks",
        "64",
        "--health",
        "degraded",
        "--kv-fault",
        "gap@2",
    )
    run = run_kit(capsys, "--engine", mock.address, "--json", *ONLY)
    assert run.code == 1
    fails = failed(run)
    assert list(fails) == [
        "discovery.schema_release",
        "discovery.capacity",
        "discovery.limits",
        "control.health",
        "kv.sequence",
    ]
    assert "'main' is not an immutable release id" in fails["discovery.schema_release"]
    assert "cannot hold one max_context_length 2048 request" in fails["discovery.capacity"]
    assert "max_output_tokens 4096 > max_context_length 2048" in fails["discovery.limits"]
    assert "the engine is DEGRADED" in fails["control.health"]
    assert "#3 where #2 was due" in fails["kv.sequence"]


@pytest.mark.parametrize(
    ("flags", "check_id", "evidence"),
    [
        (("--schema-release", "0123456789abcdef", "--kv-fault", "repeat@2"), "kv.sequence", "#2 where #3 was due"),
        (("--kv-fault", "error@2"), "kv.sequence", "the subscription sent an error"),
    ],
    ids=["kv-repeat", "kv-error"],
)
def test_kv_event_breaches_fail_the_sequence_check(
    mock_factory: MockFactory,
    capsys: pytest.CaptureFixture[str],
    flags: tuple[str, ...],
    check_id: str,
    evidence: str,
) -> None:
    mock = mock_factory(*MOCK_SPEED, "--profile", "full", *flags)
    run = run_kit(capsys, "--engine", mock.address, "--json", *ONLY)
    assert run.code == 1
    fails = failed(run)
    assert evidence in fails.pop(check_id)
    if "0123456789abcdef" in flags:
        assert "'0123456789abcdef' is not v0.1.0" in fails.pop("discovery.schema_release")
    assert fails == {}


def test_an_rpc_that_never_answers_fails_its_check_within_the_deadline(
    mock_factory: MockFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    mock = mock_factory(*MOCK_SPEED, "--fault-health-delay-ms", "20000")
    run = run_kit(capsys, "--engine", mock.address, "--json", "--only", "control.health", "--rpc-timeout", "1")
    assert run.code == 1
    assert failed(run) == {"control.health": "Health: no answer within 1 s"}
    assert run.report["seconds"] < 10  # type: ignore[operator]


@pytest.fixture
def silent_listener() -> Iterator[str]:
    """A loopback TCP port that accepts connections and never says a word (a hung engine)."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            accepted.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        server.close()
        for conn in accepted:
            conn.close()


def test_a_hung_engine_is_unreachable_within_the_deadline(
    silent_listener: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run = run_kit(capsys, "--engine", silent_listener, "--rpc-timeout", "1")
    assert run.code == 2
    assert run.out == ""
    assert run.err == f"openengine-conformance: cannot reach an engine at {silent_listener}: no answer within 1 s\n"
