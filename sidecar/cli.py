"""Command line and ``DYN_*`` environment → one frozen :class:`SidecarConfig`.

Every flag has an environment twin in Dynamo's conventions (``DYN_NAMESPACE``, ``DYN_SIDECAR_GRPC_ENDPOINT``, …);
the flag wins over the variable. Validation happens here, before anything starts, so a bad flag fails fast with
one line naming the flag (exit status 2, like argparse).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

DisaggregationMode = Literal["agg", "prefill", "decode"]
ENDPOINT_TYPES = ("chat", "completions")


@dataclass(frozen=True, slots=True)
class SidecarConfig:
    """Everything the worker needs to know, validated."""

    grpc_endpoint: str
    grpc_connections: int
    grpc_connect_attempt_timeout_s: float
    grpc_retry_interval_s: float
    grpc_startup_deadline_s: float
    grpc_rpc_timeout_s: float
    model_path: Path
    served_model_name: str | None
    context_length: int | None
    namespace: str
    component: str | None
    endpoint: str
    endpoint_types: tuple[str, ...]
    disaggregation_mode: DisaggregationMode | None
    expected_engine: str | None
    expected_schema_release: str | None
    model: str | None
    tool_call_parser: str | None
    reasoning_parser: str | None
    discovery_backend: str
    request_plane: str
    event_plane: str
    abort_timeout_s: float
    drain_timeout_s: float
    request_inactivity_timeout_s: float
    log_level: str


class ConfigError(ValueError):
    """A flag (or its environment twin) has a bad value; the message names it."""


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def _positive(kind: Callable[[str], float | int]) -> Callable[[str], float | int]:
    def parse(text: str) -> float | int:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="openengine-sidecar",
        description=(
            "A Dynamo backend worker that serves one OpenEngine engine (e.g. `trtllm-serve --grpc --grpc-protocol "
            "openengine`, or openengine-mock) over gRPC. Each flag has a DYN_* environment twin; the flag wins."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    engine = parser.add_argument_group("engine connection")

    def add(group: argparse._ArgumentGroup, flag: str, env: str, help_text: str, **kwargs: object) -> None:
        default = kwargs.pop("default", None)
        env_value = _env(env)
        group.add_argument(
            flag,
            default=env_value if env_value is not None else default,
            help=f"{help_text} [env {env}]",
            **kwargs,  # type: ignore[arg-type]
        )

    add(
        engine,
        "--grpc-endpoint",
        "DYN_SIDECAR_GRPC_ENDPOINT",
        "OpenEngine gRPC endpoint: host:port, http://host:port or grpc://host:port (plaintext h2c)",
    )
    add(
        engine,
        "--grpc-connections",
        "DYN_SIDECAR_GRPC_CONNECTIONS",
        "independent HTTP/2 connections to the engine; Generate streams are spread round-robin",
        default=8,
        type=_positive(int),
    )
    add(
        engine,
        "--grpc-connect-attempt-timeout-secs",
        "DYN_SIDECAR_GRPC_CONNECT_ATTEMPT_TIMEOUT_SECS",
        "bound on one connection attempt",
        default=30.0,
        type=_positive(float),
    )
    add(
        engine,
        "--grpc-retry-interval-secs",
        "DYN_SIDECAR_GRPC_RETRY_INTERVAL_SECS",
        "pause between connection attempts while the engine is not up yet",
        default=1.0,
        type=_positive(float),
    )
    add(
        engine,
        "--grpc-startup-deadline-secs",
        "DYN_SIDECAR_GRPC_STARTUP_DEADLINE_SECS",
        "bound on each startup phase (connect, engine readiness); the worker refuses to start after it",
        default=1800.0,
        type=_positive(float),
    )
    add(
        engine,
        "--grpc-rpc-timeout-secs",
        "DYN_SIDECAR_GRPC_RPC_TIMEOUT_SECS",
        "deadline of every unary Control RPC",
        default=30.0,
        type=_positive(float),
    )
    add(
        engine,
        "--expected-engine",
        "DYN_SIDECAR_EXPECTED_ENGINE",
        "refuse to start unless ServerInfo.engine_name equals this (e.g. tensorrt_llm)",
    )
    add(
        engine,
        "--expected-schema-release",
        "DYN_SIDECAR_EXPECTED_SCHEMA_RELEASE",
        "refuse to start unless the engine's schema_release matches this immutable id (prefix match, >= 12 hex)",
    )
    add(
        engine,
        "--model",
        "DYN_SIDECAR_MODEL",
        "which of the engine's supported_models to serve; required when it serves several",
    )

    model = parser.add_argument_group("model registration")
    add(
        model,
        "--model-path",
        "DYN_MODEL_PATH",
        "local directory with the tokenizer and chat template the frontend uses (no weights needed)",
    )
    add(
        model,
        "--served-model-name",
        "DYN_SERVED_MODEL_NAME",
        "name clients use in `model`; default: the engine's served_model_name",
    )
    add(
        model,
        "--context-length",
        "DYN_CONTEXT_LENGTH",
        "context window in tokens; wins over the engine's max_context_length (a disagreement is logged)",
        type=_positive(int),
    )
    add(
        model,
        "--endpoint-types",
        "DYN_ENDPOINT_TYPES",
        "comma-separated OpenAI endpoints to register: chat, completions",
        default="chat,completions",
    )
    add(
        model,
        "--dyn-tool-call-parser",
        "DYN_TOOL_CALL_PARSER",
        "tool-call parser name for the frontend; default: ModelInfo.tool_call_parser",
    )
    add(
        model,
        "--dyn-reasoning-parser",
        "DYN_REASONING_PARSER",
        "reasoning parser name for the frontend; default: ModelInfo.reasoning_parser",
    )
    add(
        model,
        "--disaggregation-mode",
        "DYN_DISAGGREGATION_MODE",
        "agg, prefill or decode; used when the engine reports no role (TensorRT-LLM reports UNSPECIFIED)",
        choices=("agg", "prefill", "decode"),
    )

    dynamo = parser.add_argument_group("Dynamo")
    add(dynamo, "--namespace", "DYN_NAMESPACE", "Dynamo namespace", default="dynamo")
    add(
        dynamo,
        "--component",
        "DYN_COMPONENT",
        "Dynamo component; default: backend (aggregated, decode) or prefill (prefill role)",
    )
    add(dynamo, "--endpoint", "DYN_ENDPOINT", "Dynamo endpoint name", default="generate")
    add(
        dynamo,
        "--discovery-backend",
        "DYN_DISCOVERY_BACKEND",
        "service discovery: file (one machine, DYN_FILE_KV), etcd, kubernetes",
        default="file",
        choices=("file", "etcd", "kubernetes", "mem"),
    )
    add(dynamo, "--request-plane", "DYN_REQUEST_PLANE", "request plane", default="tcp", choices=("tcp", "nats"))
    add(dynamo, "--event-plane", "DYN_EVENT_PLANE", "event plane", default="zmq", choices=("zmq", "nats"))

    lifecycle = parser.add_argument_group("requests and lifecycle")
    add(
        lifecycle,
        "--abort-timeout-secs",
        "DYN_SIDECAR_ABORT_TIMEOUT_SECS",
        "bound on the shielded Control.Abort sent when a request is cancelled",
        default=2.0,
        type=_positive(float),
    )
    add(
        lifecycle,
        "--drain-timeout-secs",
        "DYN_SIDECAR_DRAIN_TIMEOUT_SECS",
        "on SIGTERM, how long in-flight requests may run before they are cancelled",
        default=30.0,
        type=_positive(float),
    )
    add(
        lifecycle,
        "--request-inactivity-timeout-secs",
        "DYN_SIDECAR_REQUEST_INACTIVITY_TIMEOUT_SECS",
        "fail a request whose engine stream sends nothing for this long (a hung engine)",
        default=120.0,
        type=_positive(float),
    )
    add(lifecycle, "--log-level", "DYN_LOG", "log level", default="info", choices=("debug", "info", "warning", "error"))
    return parser


def _endpoint_types(text: str) -> tuple[str, ...]:
    kinds = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [k for k in kinds if k not in ENDPOINT_TYPES]
    if not kinds or unknown:
        raise ConfigError(f"--endpoint-types: expected a comma-separated subset of chat,completions, got {text!r}")
    return kinds


def parse_config(argv: Sequence[str] | None = None) -> SidecarConfig:
    """Parse flags (and their environment twins); exit 2 with a message naming the flag on bad input."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        _check_env_choices(parser, ns)
        return _validate(ns)
    except ConfigError as exc:
        parser.error(str(exc))


def _check_env_choices(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    # argparse checks `choices` only for values typed on the command line, not for defaults from DYN_* variables.
    for action in parser._actions:
        value = getattr(ns, action.dest, None)
        if action.choices is not None and value is not None and value not in action.choices:
            flag = action.option_strings[0]
            raise ConfigError(f"{flag}: expected one of {', '.join(map(str, action.choices))}, got {value!r}")


def _number(ns: argparse.Namespace, name: str, flag: str, kind: Callable[[str], float | int]) -> float:
    # Values from the environment arrive as strings and skipped argparse's type check.
    raw = getattr(ns, name)
    try:
        value = kind(str(raw))
    except ValueError:
        raise ConfigError(f"{flag}: not a number: {raw!r}") from None
    if value <= 0:
        raise ConfigError(f"{flag}: must be > 0, got {raw!r}")
    return value


def _validate(ns: argparse.Namespace) -> SidecarConfig:
    if not ns.grpc_endpoint:
        raise ConfigError("--grpc-endpoint is required (or DYN_SIDECAR_GRPC_ENDPOINT)")
    if not ns.model_path:
        raise ConfigError("--model-path is required (or DYN_MODEL_PATH): the frontend needs the tokenizer")
    model_path = Path(ns.model_path)
    if not model_path.is_dir():
        raise ConfigError(f"--model-path: not a directory: {ns.model_path}")
    if not (model_path / "tokenizer.json").is_file() and not (model_path / "tokenizer_config.json").is_file():
        raise ConfigError(f"--model-path: no tokenizer.json or tokenizer_config.json in {ns.model_path}")
    # Endpoint syntax is checked by the engine client's parser so both share one rule set.
    from sidecar.engine import EndpointError, parse_endpoint

    try:
        parse_endpoint(ns.grpc_endpoint)
    except EndpointError as exc:
        raise ConfigError(f"--grpc-endpoint: {exc}") from None
    context_length = None if ns.context_length is None else int(_number(ns, "context_length", "--context-length", int))
    for flag, value in (("--namespace", ns.namespace), ("--endpoint", ns.endpoint)):
        if not value or "." in value or "/" in value:
            raise ConfigError(f"{flag}: must be a non-empty name without '.' or '/', got {value!r}")
    return SidecarConfig(
        grpc_endpoint=ns.grpc_endpoint,
        grpc_connections=int(_number(ns, "grpc_connections", "--grpc-connections", int)),
        grpc_connect_attempt_timeout_s=_number(
            ns, "grpc_connect_attempt_timeout_secs", "--grpc-connect-attempt-timeout-secs", float
        ),
        grpc_retry_interval_s=_number(ns, "grpc_retry_interval_secs", "--grpc-retry-interval-secs", float),
        grpc_startup_deadline_s=_number(ns, "grpc_startup_deadline_secs", "--grpc-startup-deadline-secs", float),
        grpc_rpc_timeout_s=_number(ns, "grpc_rpc_timeout_secs", "--grpc-rpc-timeout-secs", float),
        model_path=model_path.resolve(),
        served_model_name=ns.served_model_name,
        context_length=context_length,
        namespace=ns.namespace,
        component=ns.component,
        endpoint=ns.endpoint,
        endpoint_types=_endpoint_types(ns.endpoint_types),
        disaggregation_mode=ns.disaggregation_mode,
        expected_engine=ns.expected_engine,
        expected_schema_release=ns.expected_schema_release,
        model=ns.model,
        tool_call_parser=ns.dyn_tool_call_parser,
        reasoning_parser=ns.dyn_reasoning_parser,
        discovery_backend=ns.discovery_backend,
        request_plane=ns.request_plane,
        event_plane=ns.event_plane,
        abort_timeout_s=_number(ns, "abort_timeout_secs", "--abort-timeout-secs", float),
        drain_timeout_s=_number(ns, "drain_timeout_secs", "--drain-timeout-secs", float),
        request_inactivity_timeout_s=_number(
            ns, "request_inactivity_timeout_secs", "--request-inactivity-timeout-secs", float
        ),
        log_level=ns.log_level,
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``openengine-sidecar``."""
    config = parse_config(argv)
    from sidecar.worker import run_worker

    sys.exit(run_worker(config))
