"""Dynamo's own TensorRT-LLM sidecar, flag by flag (issue 36 §1): every flag and variable of
``python -m dynamo.trtllm.sidecar`` (ai-dynamo 1.6.1, its ``--help`` read from the installed wheel) means the same to
this worker, with the same default, or is refused in one line that says why.

What each one does once the worker runs (the card, the planes, the RL endpoint, a Hugging Face model id) is tested
through the real frontend in ``tests/e2e/test_dynamo_flags.py`` and, with the flags exactly as in Dynamo's manifests,
in ``tests/e2e/test_dynamo_drop_in.py``; the flag table of ``docs/operator-guide.md`` is held to the same ``--help``
in ``tests/test_docs_dynamo_flags.py``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from sidecar.cli import build_parser, parse_config, worker_namespace
from tests.helpers.cli import TheirFlag, base_argv, dynamo_sidecar_flags
from tests.helpers.stack import MODEL_DIR

#: What Dynamo 1.6.1's runtime uses when the flag and its variable are unset (its help shows no default: observed
#: by starting its sidecar without the variable; an unset discovery backend connects to etcd at localhost:2379).
RUNTIME_DEFAULTS = {"--discovery-backend": "etcd", "--request-plane": "tcp", "--response-plane": "tcp"}
RUNTIME_DEFAULTS["--event-plane"] = "zmq"
#: Their default, spelled differently here, with the same effect (ours: unset = the engine's role, which
#: TensorRT-LLM never reports, so agg; unset component = backend, or prefill for a prefill worker, as theirs).
SAME_EFFECT = {"--disaggregation-mode": ("agg", None), "--component": ("backend", None)}


@pytest.fixture(scope="module")
def theirs() -> list[TheirFlag]:
    return dynamo_sidecar_flags()


def _ours(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    (action,) = [a for a in parser._actions if flag in a.option_strings]
    return action


def _same(their_default: str, our_default: object) -> bool:
    if isinstance(our_default, float | int) and not isinstance(our_default, bool):
        return float(their_default) == float(our_default)
    return their_default == our_default


def test_every_flag_of_theirs_is_ours_with_its_variable_values_and_default(
    theirs: list[TheirFlag], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [*(f.env for f in theirs if f.env), "DYN_CONTEXT_LENGTH"]:
        monkeypatch.delenv(name, raising=False)
    parser = build_parser()
    assert len(theirs) >= 23, "the --help of Dynamo's sidecar was not read"
    for their in theirs:
        ours = _ours(parser, their.flag)
        assert (ours.nargs != 0) == their.takes_value, their.flag
        if their.env is not None:
            assert f"{their.env}]" in (ours.help or "") or f"{their.env}," in (ours.help or ""), their.flag
        if their.choices:
            assert ours.choices is not None, their.flag
            assert set(their.choices) <= set(ours.choices), their.flag
        if their.flag in SAME_EFFECT:
            assert (their.default, ours.default) == SAME_EFFECT[their.flag], their.flag
        elif their.default is not None:
            assert _same(their.default, ours.default), (their.flag, their.default, ours.default)
        elif their.flag in RUNTIME_DEFAULTS:
            assert ours.default == RUNTIME_DEFAULTS[their.flag], their.flag
        elif their.takes_value:
            assert ours.default is None, their.flag
        else:
            assert ours.default is False, their.flag


def _template(tmp_path: Path) -> str:
    path = tmp_path / "chat.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    return str(path)


#: (their flag, a value, their variable, the config field, what the field holds). Each is given to the worker as
#: Dynamo's manifests give it: on the command line, then alone in its variable.
CASES = [
    ("--discovery-backend", "kubernetes", "DYN_DISCOVERY_BACKEND", "discovery_backend", "kubernetes"),
    ("--discovery-backend", "mem", "DYN_DISCOVERY_BACKEND", "discovery_backend", "mem"),
    ("--request-plane", "nats", "DYN_REQUEST_PLANE", "request_plane", "nats"),
    ("--response-plane", "quic", "DYN_RESPONSE_PLANE", "response_plane", "quic"),
    ("--event-plane", "nats", "DYN_EVENT_PLANE", "event_plane", "nats"),
    ("--namespace", "team", "DYN_NAMESPACE", "namespace", "team"),
    ("--component", "ctx", "DYN_COMPONENT", "component", "ctx"),
    ("--endpoint", "serve", "DYN_ENDPOINT", "endpoint", "serve"),
    ("--endpoint-types", "chat", "DYN_ENDPOINT_TYPES", "endpoint_types", ("chat",)),
    ("--custom-jinja-template", "{template}", "DYN_CUSTOM_JINJA_TEMPLATE", "custom_jinja_template", "{template}"),
    ("--dyn-tool-call-parser", "hermes", "DYN_TOOL_CALL_PARSER", "tool_call_parser", "hermes"),
    ("--dyn-reasoning-parser", "qwen3", "DYN_REASONING_PARSER", "reasoning_parser", "qwen3"),
    (
        "--exclude-tools-when-tool-choice-none",
        "false",
        "DYN_EXCLUDE_TOOLS_WHEN_TOOL_CHOICE_NONE",
        "exclude_tools_when_tool_choice_none",
        False,
    ),
    ("--disaggregation-mode", "decode", "DYN_DISAGGREGATION_MODE", "disaggregation_mode", "decode"),
    ("--grpc-connections", "3", "DYN_SIDECAR_GRPC_CONNECTIONS", "grpc_connections", 3),
    (
        "--grpc-connect-attempt-timeout-secs",
        "7",
        "DYN_SIDECAR_GRPC_CONNECT_ATTEMPT_TIMEOUT_SECS",
        "grpc_connect_attempt_timeout_s",
        7.0,
    ),
    ("--grpc-retry-interval-secs", "3", "DYN_SIDECAR_GRPC_RETRY_INTERVAL_SECS", "grpc_retry_interval_s", 3.0),
    ("--grpc-startup-deadline-secs", "11", "DYN_SIDECAR_GRPC_STARTUP_DEADLINE_SECS", "grpc_startup_deadline_s", 11.0),
    ("--dyn-default-thinking-mode", "disabled", "DYN_DEFAULT_THINKING_MODE", "default_thinking_mode", "disabled"),
    ("--context-length", "4096", "TRTLLM_CONTEXT_LENGTH", "context_length", 4096),
]


@pytest.mark.parametrize(("flag", "value", "variable", "field", "expected"), CASES, ids=[c[0] for c in CASES])
def test_each_of_their_flags_and_variables_sets_the_same_thing(
    flag: str, value: str, variable: str, field: str, expected: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    template = _template(tmp_path)
    value = value.format(template=template)
    if expected == "{template}":
        expected = Path(template)
    assert getattr(parse_config(base_argv(flag, value)), field) == expected
    monkeypatch.setenv(variable, value)
    assert getattr(parse_config(base_argv()), field) == expected


def test_their_switches_read_their_variables_as_clap_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """clap reads a switch's variable as ``true`` or ``false`` (anything else is refused, below): ``false`` is
    accepted for ``--route-to-encoder`` too, which only ``true`` asks for."""
    monkeypatch.setenv("DYN_SYSTEM_PORT", "0")
    monkeypatch.setenv("DYN_ROUTE_TO_ENCODER", "false")
    monkeypatch.setenv("DYN_ENABLE_RL", "false")
    assert parse_config(base_argv()).enable_rl is False
    monkeypatch.setenv("DYN_ENABLE_RL", "true")
    assert parse_config(base_argv()).enable_rl is True
    monkeypatch.delenv("DYN_ENABLE_RL")
    assert parse_config(base_argv()).enable_rl is False
    assert parse_config(base_argv("--enable-rl")).enable_rl is True


def test_the_grpc_endpoint_comes_from_their_variable_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_SIDECAR_GRPC_ENDPOINT", "grpc://127.0.0.1:50052")
    assert parse_config(["--model-path", str(MODEL_DIR)]).grpc_endpoint == "grpc://127.0.0.1:50052"
    for form in ("127.0.0.1:50051", "http://127.0.0.1:50051", "grpc://127.0.0.1:50051"):
        assert parse_config(["--grpc-endpoint", form, "--model-path", str(MODEL_DIR)]).grpc_endpoint == form


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (base_argv("--disaggregation-mode", "encode"), {}, "--disaggregation-mode encode: an encode worker runs"),
        (base_argv(), {"DYN_DISAGGREGATION_MODE": "encode"}, "OpenEngine v0.1.0 has no encode RPC"),
        (base_argv("--route-to-encoder"), {}, "--route-to-encoder: it declares an upstream encode worker"),
        (base_argv(), {"DYN_ROUTE_TO_ENCODER": "true"}, "no OpenEngine v0.1.0 engine can be one"),
        (base_argv(), {"DYN_ROUTE_TO_ENCODER": "1"}, "DYN_ROUTE_TO_ENCODER must be true or false"),
        (base_argv(), {"DYN_ENABLE_RL": "yes", "DYN_SYSTEM_PORT": "0"}, "DYN_ENABLE_RL must be true or false"),
        (base_argv("--enable-rl"), {}, "--enable-rl: the RL endpoint describes the system port's routes; set"),
        (base_argv("--enable-rl"), {"DYN_SYSTEM_PORT": "0", "DYN_RL_ENDPOINT": "a.b"}, "DYN_RL_ENDPOINT must be"),
        (base_argv("--enable-rl"), {"DYN_SYSTEM_PORT": "0", "DYN_RL_ENDPOINT": "generate"}, "is --endpoint"),
        (base_argv("--endpoint-types", "chat,embeddings"), {}, "embeddings cannot be served here: OpenEngine v0.1.0"),
        (base_argv("--endpoint-types", "tensor"), {}, "tensor cannot be served here"),
        (base_argv("--endpoint-types", "prefill"), {}, "a prefill worker is --disaggregation-mode prefill"),
        (base_argv("--exclude-tools-when-tool-choice-none", "no"), {}, "invalid choice: 'no'"),
        (base_argv(), {"DYN_EXCLUDE_TOOLS_WHEN_TOOL_CHOICE_NONE": "1"}, "expected one of true, false, got '1'"),
        (base_argv(), {"DYN_DEFAULT_THINKING_MODE": "adaptive"}, "--dyn-default-thinking-mode: expected one of"),
        (base_argv(), {"DYN_RESPONSE_PLANE": "udp"}, "--response-plane: expected one of tcp, quic"),
        (base_argv("--custom-jinja-template", "/nonexistent.jinja"), {}, "--custom-jinja-template: no such file"),
        (base_argv(), {"TRTLLM_CONTEXT_LENGTH": "0"}, "--context-length: TRTLLM_CONTEXT_LENGTH must be > 0"),
        (base_argv(), {"TRTLLM_CONTEXT_LENGTH": "many"}, "TRTLLM_CONTEXT_LENGTH is not a number"),
        (
            base_argv(),
            {"TRTLLM_CONTEXT_LENGTH": "4096", "DYN_CONTEXT_LENGTH": "2048"},
            "DYN_CONTEXT_LENGTH=2048 and TRTLLM_CONTEXT_LENGTH=4096 disagree",
        ),
        (["--grpc-endpoint", "127.0.0.1:1", "--model-path", "org/name/extra"], {}, "nor a Hugging Face model id"),
        (["--grpc-endpoint", "127.0.0.1:1", "--model-path", "./missing"], {}, "nor a Hugging Face model id"),
    ],
)
def test_what_openengine_cannot_carry_is_refused_in_one_line_that_says_why(
    argv: list[str],
    env: dict[str, str],
    needle: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("DYN_SYSTEM_PORT", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exited:
        parse_config(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("openengine-sidecar: error: "), err
    assert needle in err


@pytest.mark.parametrize(
    ("namespace", "suffix", "expected"),
    [
        ("ns", None, "ns"),
        ("ns", "", "ns"),
        ("ns", "abc", "ns-abc"),
        ("ns-abc", "abc", "ns-abc"),
        ("x-abc-y", "abc", "x-abc-y-abc"),
        ("abc", "abc", "abc-abc"),
    ],
)
def test_the_operators_worker_suffix_is_appended_as_dynamo_appends_it(
    namespace: str, suffix: str | None, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Observed with Dynamo's sidecar 1.6.1 (its discovery keys): appended unless empty or already the end."""
    environ = {} if suffix is None else {"DYN_NAMESPACE_WORKER_SUFFIX": suffix}
    assert worker_namespace(namespace, environ) == expected
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    assert parse_config(base_argv("--namespace", namespace)).namespace == expected


def test_a_model_path_is_a_local_directory_or_a_hugging_face_id_and_names_the_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    local = parse_config(base_argv())
    assert local.model_path == str(MODEL_DIR.resolve())
    assert local.model_path_given == str(MODEL_DIR)
    monkeypatch.chdir(MODEL_DIR.parent)
    relative = parse_config(["--grpc-endpoint", "127.0.0.1:1", "--model-path", MODEL_DIR.name])
    assert (relative.model_path, relative.model_path_given) == (str(MODEL_DIR.resolve()), MODEL_DIR.name)
    for model_id in ("Qwen/Qwen3-0.6B", "gpt2"):
        hub = parse_config(["--grpc-endpoint", "127.0.0.1:1", "--model-path", model_id])
        assert (hub.model_path, hub.model_path_given) == (model_id, model_id), "Dynamo fetches it when it registers"


def test_context_length_the_flag_wins_over_both_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRTLLM_CONTEXT_LENGTH", "4096")
    assert parse_config(base_argv()).context_length == 4096
    monkeypatch.setenv("DYN_CONTEXT_LENGTH", "4096")
    assert parse_config(base_argv()).context_length == 4096, "both set and agreeing"
    monkeypatch.setenv("DYN_CONTEXT_LENGTH", "2048")
    assert parse_config(base_argv("--context-length", "1024")).context_length == 1024
    monkeypatch.delenv("TRTLLM_CONTEXT_LENGTH")
    assert parse_config(base_argv()).context_length == 2048


def test_their_defaults_fill_the_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DYN_DISCOVERY_BACKEND", "DYN_RESPONSE_PLANE", "DYN_EXCLUDE_TOOLS_WHEN_TOOL_CHOICE_NONE"):
        monkeypatch.delenv(name, raising=False)
    config = parse_config(base_argv())
    assert config.discovery_backend == "etcd"
    assert config.response_plane == "tcp"
    assert config.exclude_tools_when_tool_choice_none is True
    assert (config.default_thinking_mode, config.custom_jinja_template, config.enable_rl) == (None, None, False)
    assert config.rl_endpoint == "rl"
