"""parse_endpoint: accepted forms and one named refusal per problem."""

from __future__ import annotations

import pytest

from sidecar.engine import Endpoint, EndpointError, parse_endpoint


@pytest.mark.parametrize(
    ("text", "host", "port"),
    [
        ("localhost:50051", "localhost", 50051),
        ("127.0.0.1:1", "127.0.0.1", 1),
        ("http://engine:8000", "engine", 8000),
        ("grpc://engine.ns.svc.cluster.local:65535", "engine.ns.svc.cluster.local", 65535),
        ("HTTP://Engine:8000", "Engine", 8000),
        ("http://engine:8000/", "engine", 8000),
        ("[::1]:50051", "::1", 50051),
        ("grpc://[fe80::1]:9", "fe80::1", 9),
        ("  trtllm_worker:8001 \n", "trtllm_worker", 8001),
    ],
)
def test_accepted(text: str, host: str, port: int) -> None:
    assert parse_endpoint(text) == Endpoint(host, port)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("https://engine:443", "TLS is not enabled"),
        ("grpcs://engine:443", "TLS is not enabled"),
        ("GRPCS://engine:443", "TLS is not enabled"),
        ("unix://tmp/sock:1", "three slashes"),
        ("unix://", "three slashes"),
        ("unix:", "empty socket path"),
        ("unix-abstract:engine", "abstract Unix sockets are not supported"),
        ("unix:/" + "a" * 107, "at most 107"),
        ("unix:/run/e\0.sock", "NUL"),
        ("ftp://engine:21", "unsupported scheme"),
        ("1http://engine:21", "malformed scheme"),
        ("http://user:pw@engine:8000", "userinfo"),
        ("user@engine:8000", "userinfo"),
        ("http://engine:8000/v1", "path"),
        ("http://engine:8000?x=1", "query"),
        ("http://engine:8000#frag", "fragment"),
        ("engine", "missing port"),
        ("engine:", "missing port"),
        ("[::1]", "missing port"),
        ("[::1]:", "missing port"),
        ("engine:http", "bad port"),
        ("engine:-1", "bad port"),
        ("engine:+80", "bad port"),
        ("engine:٣٣", "bad port"),
        ("engine:0", "out of range"),
        ("engine:65536", "out of range"),
        (":8000", "empty host"),
        ("http://:8000", "empty host"),
        ("[]:8000", "empty host"),
        ("", "empty endpoint"),
        ("   ", "empty endpoint"),
        ("::1:8000", "must be bracketed"),
        ("[::1:8000", "unterminated"),
        ("[zz::1]:8000", "invalid IPv6"),
        ("[::1]x:8000", "unexpected"),
        ("en gine:80", "invalid host"),
        ("-engine:80", "invalid host"),
    ],
)
def test_refused_with_named_problem(text: str, problem: str) -> None:
    with pytest.raises(EndpointError, match=problem):
        parse_endpoint(text)


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ("unix:///run/engine.sock", "/run/engine.sock"),
        ("unix:/run/engine.sock", "/run/engine.sock"),
        ("UNIX:/run/engine.sock", "/run/engine.sock"),
        ("unix:engine.sock", "engine.sock"),
        ("unix:run/engine.sock", "run/engine.sock"),
        ("  unix:///a b/engine.sock\n", "/a b/engine.sock"),
    ],
)
def test_unix_sockets_accepted_in_grpc_naming(text: str, path: str) -> None:
    endpoint = parse_endpoint(text)
    assert endpoint == Endpoint.unix(path)
    assert (endpoint.path, endpoint.host, endpoint.tls) == (path, "localhost", False)
    assert str(endpoint) == f"unix:{path}"
    assert parse_endpoint(str(endpoint)) == endpoint


def test_a_unix_socket_with_tls_is_refused_as_a_contradiction() -> None:
    with pytest.raises(EndpointError, match=r"plaintext.*--grpc-tls-ca"):
        parse_endpoint("unix:///run/engine.sock", tls=True)


def test_endpoint_error_is_value_error() -> None:
    assert issubclass(EndpointError, ValueError)


def test_str_round_trips() -> None:
    for text in ("engine:80", "[::1]:80", "10.0.0.1:9"):
        assert str(parse_endpoint(text)) == text
        assert parse_endpoint(str(parse_endpoint(text))) == parse_endpoint(text)
