"""Command line and ``DYN_*`` environment → one frozen :class:`SidecarConfig`.

Every flag has an environment twin in Dynamo's conventions (``DYN_NAMESPACE``, ``DYN_SIDECAR_GRPC_ENDPOINT``, …);
the flag wins over the variable. Validation happens here, before anything starts, so a bad flag fails fast with
one line naming the flag (exit status 2, like argparse).

Every flag and variable of Dynamo's own TensorRT-LLM sidecar (``python -m dynamo.trtllm.sidecar``, ai-dynamo 1.6.1)
is accepted with its meaning and default, so that a manifest can swap the command and keep its arguments
(``docs/operator-guide.md``, "Dynamo's own sidecar, flag by flag"); what OpenEngine v0.1.0 cannot carry is refused
in one line that says why.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from sidecar.config import ENDPOINT_TYPES, ConfigError, SidecarConfig

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, MutableMapping, Sequence


#: ``--context-length``'s twins: ours, then the one Dynamo's own TensorRT-LLM sidecar reads.
CONTEXT_LENGTH_VARIABLES = ("DYN_CONTEXT_LENGTH", "TRTLLM_CONTEXT_LENGTH")


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


class _Parser(argparse.ArgumentParser):
    """argparse whose refusals are one line: ``openengine-sidecar: error: <flag>: <problem>``, exit status 2.

    argparse's own ``error`` prints the usage first -- forty-odd lines of flags above the one that names the problem.
    ``--help`` still prints the whole usage.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="openengine-sidecar",
        description=(
            "A Dynamo backend worker that serves one OpenEngine engine (e.g. `trtllm-serve --grpc --grpc-protocol "
            "openengine`, or openengine-mock) over gRPC. Each flag has a DYN_* environment twin; the flag wins."
        ),
        epilog="Operator subcommands: `openengine-sidecar status|watch|probe --help`.",
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
        "OpenEngine gRPC endpoint: host:port, http://host:port or grpc://host:port (plaintext h2c); https://host:port "
        "or grpcs://host:port with --grpc-tls-ca (TLS); unix:///path/to/engine.sock or unix:path (a Unix-domain "
        "socket, plaintext)",
    )
    add(
        engine,
        "--grpc-connections",
        "DYN_SIDECAR_GRPC_CONNECTIONS",
        "independent HTTP/2 connections to the engine for Generate streams (spread round-robin); Control RPCs use one "
        "more of their own, so they never wait behind streams for a stream slot",
        default=8,
        type=_positive(int),
    )
    add(
        engine,
        "--grpc-receive",
        "DYN_SIDECAR_GRPC_RECEIVE",
        "how Generate streams are received: direct = straight from the HTTP/2 events (no grpclib stream or task per "
        "message: about a third less CPU per engine message, docs/architecture.md); grpclib = through grpclib's "
        "streams",
        default="direct",
        choices=("direct", "grpclib"),
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
        "refuse to start unless the engine's schema_release matches this immutable id (prefix match, >= 12 hex); an "
        "engine reporting none is refused too",
    )
    add(
        engine,
        "--model",
        "DYN_SIDECAR_MODEL",
        "which of the engine's supported_models to serve; required when it serves several",
    )

    add(
        engine,
        "--grpc-tls-ca",
        "DYN_SIDECAR_GRPC_TLS_CA",
        "CA bundle to verify the engine's certificate; enables TLS (https:// and grpcs:// endpoints need it). TLS "
        "files are read again on a reconnect whenever they changed on disk (rotation needs no restart)",
    )
    add(
        engine,
        "--grpc-tls-cert",
        "DYN_SIDECAR_GRPC_TLS_CERT",
        "client certificate for mutual TLS (with --grpc-tls-key)",
    )
    add(engine, "--grpc-tls-key", "DYN_SIDECAR_GRPC_TLS_KEY", "client private key for mutual TLS")
    add(
        engine,
        "--grpc-tls-key-password-file",
        "DYN_SIDECAR_GRPC_TLS_KEY_PASSWORD_FILE",
        "file holding the passphrase of an encrypted --grpc-tls-key (an encrypted key without it is refused)",
    )

    model = parser.add_argument_group("model registration")
    add(
        model,
        "--model-path",
        "DYN_MODEL_PATH",
        "the model's tokenizer and chat template for the frontend (no weights needed): a local directory, or a "
        "Hugging Face model id (org/name) Dynamo fetches through the hub and its cache (HF_HOME, HF_TOKEN, "
        "HF_HUB_OFFLINE), as Dynamo's own sidecar does. Also the model's name unless --served-model-name is given",
    )
    add(
        model,
        "--served-model-name",
        "DYN_SERVED_MODEL_NAME",
        "name clients use in `model`; default: --model-path exactly as given (Dynamo's own sidecar names the model "
        "so); the engine's own model names are registered as aliases either way",
    )
    model.add_argument(
        "--context-length",
        default=None,
        type=_positive(int),
        help="context window in tokens; wins over the engine's max_context_length (a disagreement is logged). The "
        "flag wins over both variables; set both and they must agree (TRTLLM_CONTEXT_LENGTH is the variable of "
        f"Dynamo's own sidecar) [env {CONTEXT_LENGTH_VARIABLES[0]}, {CONTEXT_LENGTH_VARIABLES[1]}]",
    )
    add(
        model,
        "--total-kv-blocks",
        "DYN_TOTAL_KV_BLOCKS",
        "the engine's KV cache pool in blocks, for the model card; wins over the engine's capacity.total_kv_blocks (a "
        "disagreement is logged). TensorRT-LLM reports none: without it Dynamo's --active-decode-blocks-threshold "
        "cannot judge this worker's published KV usage (TensorRT-LLM logs its pool size at start-up)",
        type=_positive(int),
    )
    add(
        model,
        "--endpoint-types",
        "DYN_ENDPOINT_TYPES",
        "comma-separated OpenAI endpoints to register: chat, completions (embeddings, tensor and prefill are refused: "
        "OpenEngine v0.1.0 carries none of them)",
        default="chat,completions",
    )
    add(
        model,
        "--custom-jinja-template",
        "DYN_CUSTOM_JINJA_TEMPLATE",
        "a Jinja chat template file for the model card, used by the frontend instead of the model's own",
    )
    add(
        model,
        "--exclude-tools-when-tool-choice-none",
        "DYN_EXCLUDE_TOOLS_WHEN_TOOL_CHOICE_NONE",
        "the model card tells the frontend to leave the tools out of the chat template when a request's tool_choice "
        "is none",
        default="true",
        choices=("true", "false"),
    )
    add(
        model,
        "--dyn-default-thinking-mode",
        "DYN_DEFAULT_THINKING_MODE",
        "the deployment's default thinking mode, published in the model card for the frontend's chat template (a "
        "request's own thinking controls win); unset: the template's default",
        choices=("enabled", "disabled"),
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
        "agg, prefill or decode; used when the engine reports no role (TensorRT-LLM reports UNSPECIFIED); unset: "
        "the engine's role, else agg. encode is refused: an encode worker runs a multimodal encoder, which OpenEngine "
        "v0.1.0 has no RPC for",
        choices=("agg", "prefill", "decode", "encode"),
    )
    model.add_argument(
        "--route-to-encoder",
        action="store_const",
        const="true",
        default=_env("DYN_ROUTE_TO_ENCODER") or False,
        help="refused when set: it declares an upstream encode worker, which no OpenEngine v0.1.0 engine can be "
        "(DYN_ROUTE_TO_ENCODER=false is accepted, as Dynamo's sidecar accepts it) [env DYN_ROUTE_TO_ENCODER]",
    )

    dynamo = parser.add_argument_group("Dynamo")
    add(
        dynamo,
        "--namespace",
        "DYN_NAMESPACE",
        "Dynamo namespace; DYN_NAMESPACE_WORKER_SUFFIX (set by Dynamo's operator during rolling updates) is appended "
        "as -SUFFIX unless it is empty or the namespace already ends with it",
        default="dynamo",
    )
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
        "service discovery: etcd (ETCD_ENDPOINTS, default http://localhost:2379; ETCD_AUTH_* as for Dynamo's "
        "workers; the default, as for Dynamo's frontend and workers), kubernetes, file (one machine, DYN_FILE_KV), "
        "mem (this process only: nothing else can discover the worker)",
        default="etcd",
        choices=("etcd", "kubernetes", "file", "mem"),
    )
    add(
        dynamo,
        "--request-plane",
        "DYN_REQUEST_PLANE",
        "request plane: tcp (the worker listens on DYN_TCP_RPC_HOST) or nats (NATS_SERVER, default nats://localhost:4222)",
        default="tcp",
        choices=("tcp", "nats"),
    )
    add(
        dynamo,
        "--response-plane",
        "DYN_RESPONSE_PLANE",
        "response plane (how streamed answers reach the frontend): tcp or quic; the frontends must use the same",
        default="tcp",
        choices=("tcp", "quic"),
    )
    add(
        dynamo,
        "--dynamo-egress",
        "DYN_SIDECAR_DYNAMO_EGRESS",
        "how chunks reach Dynamo: push = through Dynamo's ResponseSender (one handoff per chunk, no thread crossing "
        "on the loop; docs/architecture.md, push egress); pull = Dynamo's threads take each chunk from the handler's "
        "iterator (two GIL crossings and a loop wakeup per chunk, the path before issue 37)",
        default="push",
        choices=("push", "pull"),
    )
    add(
        dynamo,
        "--event-plane",
        "DYN_EVENT_PLANE",
        "event plane for KV events: zmq (advertised as DYN_EVENT_PLANE_HOST) or nats (NATS_SERVER); must match the "
        "frontends",
        default="zmq",
        choices=("zmq", "nats"),
    )
    dynamo.add_argument(
        "--enable-rl",
        action="store_const",
        const="true",
        default=_env("DYN_ENABLE_RL") or False,
        help="serve the RL discovery endpoint <namespace>.<component>.DYN_RL_ENDPOINT (default rl), as Dynamo's "
        'workers do: {"method": "routes"} answers with the system port\'s /engine routes and its URL (needs '
        "DYN_SYSTEM_PORT) [env DYN_ENABLE_RL]",
    )
    add(
        dynamo,
        "--control-plane-deadline-secs",
        "DYN_SIDECAR_CONTROL_PLANE_DEADLINE_SECS",
        "bound on reaching etcd and NATS at start-up; the worker refuses to start after it (sets Dynamo's "
        "ETCD_STARTUP_CONNECT_TIMEOUT_SECONDS and NATS_STARTUP_CONNECT_TIMEOUT_SECONDS unless those are set)",
        default=60.0,
        type=_positive(float),
    )

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
        "fail a request whose engine stream sends nothing for this long (a hung engine); when no request got "
        "anything from the engine for as long, the worker also withdraws until a canary generation succeeds",
        default=60.0,
        type=_positive(float),
    )
    add(
        lifecycle,
        "--health-poll-interval-secs",
        "DYN_SIDECAR_HEALTH_POLL_INTERVAL_SECS",
        "how often Control.Health is polled while serving",
        default=2.0,
        type=_positive(float),
    )
    add(
        lifecycle,
        "--health-timeout-secs",
        "DYN_SIDECAR_HEALTH_TIMEOUT_SECS",
        "deadline of one Control.Health poll",
        default=5.0,
        type=_positive(float),
    )
    add(
        lifecycle,
        "--health-failure-threshold",
        "DYN_SIDECAR_HEALTH_FAILURE_THRESHOLD",
        "consecutive bad health polls before the worker degrades (not READY) or reconnects (engine unreachable)",
        default=3,
        type=_positive(int),
    )
    lifecycle.add_argument(
        "--exit-on-engine-loss",
        action=argparse.BooleanOptionalAction,
        default=_env("DYN_SIDECAR_EXIT_ON_ENGINE_LOSS") in ("1", "true", "yes"),
        help="exit (status 1) when the engine is lost instead of reconnecting, for supervisors that restart the pair "
        "[env DYN_SIDECAR_EXIT_ON_ENGINE_LOSS]",
    )
    add(
        lifecycle,
        "--reconnect-backoff-max-secs",
        "DYN_SIDECAR_RECONNECT_BACKOFF_MAX_SECS",
        "cap of the exponential backoff between reconnection attempts",
        default=30.0,
        type=_positive(float),
    )
    add(
        lifecycle,
        "--registration-check-interval-secs",
        "DYN_SIDECAR_REGISTRATION_CHECK_INTERVAL_SECS",
        "how often the worker checks that its discovery entry still exists (and restores it)",
        default=5.0,
        type=_positive(float),
    )
    add(
        lifecycle,
        "--engine-detokenize",
        "DYN_SIDECAR_ENGINE_DETOKENIZE",
        "whether the engine detokenizes its output (the frontend detokenizes from the token ids anyway): auto = ask "
        "TensorRT-LLM not to (extra.detokenize=false), others yes; on = always; off = ask every engine not to. "
        "Requests with top or prompt logprobs or stop strings keep it (token strings; the text it holds back shows a "
        "stop string completing). Only an engine that reads extra.detokenize saves the work: TensorRT-LLM's merged "
        "OpenEngine server ignores it and detokenizes anyway (its newer revisions honour it)",
        default="auto",
        choices=("auto", "on", "off"),
    )
    add(
        lifecycle,
        "--cpu-scheduling",
        "DYN_SIDECAR_CPU_SCHEDULING",
        "Linux scheduling policy of the worker's threads: batch = SCHED_BATCH (a thread woken by another of the worker "
        "does not preempt it: a decode step's hand-overs from the edge loop to Dynamo's threads run as one burst, "
        "about a fifth less CPU per token at an engine's pace, docs/performance.md); normal = SCHED_OTHER",
        default="batch",
        choices=("batch", "normal"),
    )
    add(
        lifecycle,
        "--log-level",
        "DYN_LOG",
        "log level (debug, info, warning, error), then optional LOGGER=LEVEL overrides, comma-separated, e.g. "
        "info,sidecar.kv=debug; Dynamo's own logging reads the same text (its targets, e.g. dynamo_runtime=debug). "
        "hpack, h2 and grpclib stay at warning unless named (hpack=debug)",
        default="info",
    )

    routing = parser.add_argument_group("routing signals (load and KV cache events for Dynamo's router)")
    add(
        routing,
        "--kv-events",
        "DYN_SIDECAR_KV_EVENTS",
        "auto: forward the engine's KV cache events when it advertises them and register for KV-aware routing; "
        "off: never (load only)",
        default="auto",
        choices=("auto", "off"),
    )
    routing.add_argument(
        "--kv-events-allow-plaintext",
        action=argparse.BooleanOptionalAction,
        default=_env("DYN_SIDECAR_KV_EVENTS_ALLOW_PLAINTEXT") in ("1", "true", "yes"),
        help="with a TLS engine, still use its KV events over ZMQ from a non-loopback address (ZMQ is plaintext: "
        "the token ids of every prompt cross the network readable) [env DYN_SIDECAR_KV_EVENTS_ALLOW_PLAINTEXT]",
    )
    add(
        routing,
        "--load-poll-interval-secs",
        "DYN_SIDECAR_LOAD_POLL_INTERVAL_SECS",
        "how often GetLoad is polled for the per-rank KV usage published to the router",
        default=1.0,
        type=_positive(float),
    )
    add(
        routing,
        "--load-max-age-secs",
        "DYN_SIDECAR_LOAD_MAX_AGE_SECS",
        "a GetLoad snapshot stamped longer ago than this is not published",
        default=5.0,
        type=_positive(float),
    )

    lora = parser.add_argument_group(
        "LoRA adapters (load_lora / unload_lora / list_loras, served when the engine advertises supports_lora)"
    )
    add(
        lora,
        "--lora-root",
        "DYN_LORA_PATH",
        "directory adapters may be loaded from (symlinks out of it are refused) and remote ones are fetched into; "
        "unset: every load_lora is refused",
    )
    add(
        lora,
        "--lora-load-timeout-secs",
        "DYN_SIDECAR_LORA_LOAD_TIMEOUT_SECS",
        "bound on Control.LoadLora / UnloadLora",
        default=120.0,
        type=_positive(float),
    )
    add(
        lora,
        "--lora-fetch-timeout-secs",
        "DYN_SIDECAR_LORA_FETCH_TIMEOUT_SECS",
        "bound on fetching a remote adapter (s3://, hf://) into --lora-root",
        default=600.0,
        type=_positive(float),
    )

    ops = parser.add_argument_group("operator surface (metrics are on Dynamo's system port, DYN_SYSTEM_PORT)")
    add(
        ops,
        "--log-format",
        "DYN_SIDECAR_LOG_FORMAT",
        "text or json; one line per event, each with the request id and the worker state",
        default="text",
        choices=("text", "json"),
    )
    add(
        ops,
        "--dynamo-system-port",
        "DYN_SIDECAR_DYNAMO_SYSTEM_PORT",
        "port of Dynamo's own system server, to which the system port relays /metrics, /engine/<control> and the "
        "model-card files (on DYN_SYSTEM_HOST; at most 32767); 0: a free port the OS picks when Dynamo binds, "
        "logged. Set it when a firewall or NetworkPolicy must name it (frontends fetch model cards from it); only "
        "with a system port of the sidecar's own (DYN_SYSTEM_PORT > 0)",
        default=0,
    )
    add(ops, "--ops-host", "DYN_SIDECAR_OPS_HOST", "address of the live state page and feed", default="127.0.0.1")
    add(
        ops,
        "--ops-port",
        "DYN_SIDECAR_OPS_PORT",
        "port of the live state page (/) and websocket feed (/ws); unset: off, 0: the OS picks (logged)",
    )
    return parser


#: Endpoint types Dynamo's workers accept that an OpenEngine v0.1.0 engine cannot serve, and why.
_UNSERVABLE_ENDPOINT_TYPES = {
    "embedding": "OpenEngine v0.1.0 has no embeddings RPC",
    "embeddings": "OpenEngine v0.1.0 has no embeddings RPC",
    "tensor": "OpenEngine v0.1.0 carries tokens and text, not tensors",
    "prefill": "a prefill worker is --disaggregation-mode prefill",
}


def _endpoint_types(text: str) -> tuple[str, ...]:
    kinds = tuple(part.strip() for part in text.split(",") if part.strip())
    for kind in kinds:
        if kind in _UNSERVABLE_ENDPOINT_TYPES:
            raise ConfigError(f"--endpoint-types: {kind} cannot be served here: {_UNSERVABLE_ENDPOINT_TYPES[kind]}")
    unknown = [k for k in kinds if k not in ENDPOINT_TYPES]
    if not kinds or unknown:
        raise ConfigError(f"--endpoint-types: expected a comma-separated subset of chat,completions, got {text!r}")
    return kinds


#: A Hugging Face model id: ``name`` or ``org/name`` (what Dynamo fetches when ``--model-path`` is no directory).
_HF_MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


def _model_path(raw: str) -> str:
    """A local directory (its absolute path) or a Hugging Face model id (as given), for the model card."""
    path = Path(raw)
    if path.is_dir():
        if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
            raise ConfigError(f"--model-path: no tokenizer.json or tokenizer_config.json in {raw}")
        return str(path.resolve())
    if path.exists():
        raise ConfigError(f"--model-path: not a directory: {raw}")
    if not _HF_MODEL_ID.fullmatch(raw) or ".." in raw:
        raise ConfigError(f"--model-path: not a directory, nor a Hugging Face model id (org/name): {raw}")
    return raw


def _clap_bool(value: object, flag: str, variable: str) -> bool:
    """A boolean as Dynamo's sidecar (clap) reads it: ``true`` or ``false``, nothing else."""
    if isinstance(value, bool):
        return value
    if value in ("true", "false"):
        return value == "true"
    raise ConfigError(f"{flag}: {variable} must be true or false (as Dynamo's sidecar reads it), got {value!r}")


def _context_length(ns: argparse.Namespace, environ: Mapping[str, str]) -> int | None:
    """The flag, else ``DYN_CONTEXT_LENGTH`` or ``TRTLLM_CONTEXT_LENGTH`` (refused when both are set and disagree:
    which one an operator meant cannot be told)."""
    if ns.context_length is not None:
        return int(ns.context_length)
    found = {name: environ[name] for name in CONTEXT_LENGTH_VARIABLES if environ.get(name)}
    values = {name: _positive_number(name, raw) for name, raw in found.items()}
    if len(set(values.values())) > 1:
        ours, theirs = CONTEXT_LENGTH_VARIABLES
        raise ConfigError(
            f"--context-length: {ours}={found[ours]} and {theirs}={found[theirs]} disagree; set one, or pass "
            "--context-length"
        )
    return next(iter(values.values()), None)


def _positive_number(name: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"--context-length: {name} is not a number: {raw!r}") from None
    if value <= 0:
        raise ConfigError(f"--context-length: {name} must be > 0, got {raw!r}")
    return value


#: Set by Dynamo's operator on workers during a rolling update: their namespace becomes ``<namespace>-<suffix>``.
WORKER_SUFFIX_VARIABLE = "DYN_NAMESPACE_WORKER_SUFFIX"


def worker_namespace(namespace: str, environ: Mapping[str, str]) -> str:
    """``--namespace`` with ``DYN_NAMESPACE_WORKER_SUFFIX`` appended as ``-suffix``, unless the suffix is empty or
    the namespace already ends with it (Dynamo's sidecar 1.6.1, observed)."""
    suffix = environ.get(WORKER_SUFFIX_VARIABLE, "")
    if not suffix or namespace.endswith(f"-{suffix}"):
        return namespace
    return f"{namespace}-{suffix}"


def _custom_template(raw: str | None) -> Path | None:
    if raw is None:
        return None
    path = Path(raw)
    if not path.is_file():
        raise ConfigError(f"--custom-jinja-template: no such file: {raw}")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"--custom-jinja-template: not readable: {raw}")
    return path.resolve()


def _refuse_what_openengine_cannot_carry(ns: argparse.Namespace) -> None:
    """Dynamo's flags for multimodal encode workers: accepted by the parser as Dynamo's sidecar accepts them, refused
    here (Dynamo's TensorRT-LLM sidecar refuses them too, but only after connecting to the engine)."""
    if ns.disaggregation_mode == "encode":
        raise ConfigError(
            "--disaggregation-mode encode: an encode worker runs a multimodal encoder and hands Dynamo its result; "
            "OpenEngine v0.1.0 has no encode RPC"
        )
    if _clap_bool(ns.route_to_encoder, "--route-to-encoder", "DYN_ROUTE_TO_ENCODER"):
        raise ConfigError(
            "--route-to-encoder: it declares an upstream encode worker, and no OpenEngine v0.1.0 engine can be one"
        )


_RL_ENDPOINT = re.compile(r"[A-Za-z0-9_-]+")


def _rl_endpoint(enabled: bool, endpoint: str, environ: Mapping[str, str]) -> str:
    """``DYN_RL_ENDPOINT`` (default ``rl``), checked as Dynamo checks it; ``--enable-rl`` needs a system port."""
    name = environ.get("DYN_RL_ENDPOINT", "rl").strip()
    if not enabled:
        return name or "rl"
    if not name or not _RL_ENDPOINT.fullmatch(name):
        raise ConfigError(f"--enable-rl: DYN_RL_ENDPOINT must be letters, digits, '-' or '_', got {name!r}")
    if name == endpoint:
        raise ConfigError(f"--enable-rl: DYN_RL_ENDPOINT {name!r} is --endpoint, the serving endpoint")
    if not environ.get("DYN_SYSTEM_PORT"):
        raise ConfigError(
            "--enable-rl: the RL endpoint describes the system port's routes; set DYN_SYSTEM_PORT (0: a port the OS "
            "picks)"
        )
    return name


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


def _tls_paths(ns: argparse.Namespace) -> tuple[Path | None, Path | None, Path | None, Path | None]:
    # The engine client's own checks (the same as `probe`'s): partner flags, files present and usable, one line each.
    from sidecar.engine import TlsFilesError, tls_files_from_flags

    try:
        files = tls_files_from_flags(ns.grpc_tls_ca, ns.grpc_tls_cert, ns.grpc_tls_key, ns.grpc_tls_key_password_file)
    except TlsFilesError as exc:
        raise ConfigError(str(exc)) from None
    if files is None:
        return None, None, None, None
    return files.ca, files.cert, files.key, files.key_password_file


def _validate(ns: argparse.Namespace) -> SidecarConfig:
    if not ns.grpc_endpoint:
        raise ConfigError("--grpc-endpoint is required (or DYN_SIDECAR_GRPC_ENDPOINT)")
    if not ns.model_path:
        raise ConfigError("--model-path is required (or DYN_MODEL_PATH): the frontend needs the tokenizer")
    model_path = _model_path(ns.model_path)
    _refuse_what_openengine_cannot_carry(ns)
    tls = _tls_paths(ns)
    # Endpoint syntax is checked by the engine client's parser so both share one rule set.
    from sidecar.engine import EndpointError, expected_release_problem, parse_endpoint, unix_path_problem

    try:
        engine_endpoint = parse_endpoint(ns.grpc_endpoint, tls=tls[0] is not None)
    except EndpointError as exc:
        raise ConfigError(f"--grpc-endpoint: {exc}") from None
    if engine_endpoint.path is not None and (problem := unix_path_problem(engine_endpoint.path)) is not None:
        raise ConfigError(f"--grpc-endpoint: {problem}")
    if (
        ns.expected_schema_release is not None
        and (problem := expected_release_problem(ns.expected_schema_release)) is not None
    ):
        raise ConfigError(f"--expected-schema-release: {problem}")
    context_length = _context_length(ns, os.environ)
    _check_control_plane_env(ns)
    _check_system_port(os.environ)
    dynamo_system_port = _dynamo_system_port(ns.dynamo_system_port, os.environ)
    namespace = worker_namespace(ns.namespace or "", os.environ)
    for flag, value in (("--namespace", namespace), ("--endpoint", ns.endpoint)):
        if not value or "." in value or "/" in value:
            raise ConfigError(f"{flag}: must be a non-empty name without '.' or '/', got {value!r}")
    enable_rl = _clap_bool(ns.enable_rl, "--enable-rl", "DYN_ENABLE_RL")
    return SidecarConfig(
        grpc_endpoint=ns.grpc_endpoint,
        grpc_connections=int(_number(ns, "grpc_connections", "--grpc-connections", int)),
        grpc_connect_attempt_timeout_s=_number(
            ns, "grpc_connect_attempt_timeout_secs", "--grpc-connect-attempt-timeout-secs", float
        ),
        grpc_retry_interval_s=_number(ns, "grpc_retry_interval_secs", "--grpc-retry-interval-secs", float),
        grpc_startup_deadline_s=_number(ns, "grpc_startup_deadline_secs", "--grpc-startup-deadline-secs", float),
        grpc_rpc_timeout_s=_number(ns, "grpc_rpc_timeout_secs", "--grpc-rpc-timeout-secs", float),
        model_path=model_path,
        model_path_given=ns.model_path,
        served_model_name=ns.served_model_name,
        context_length=context_length,
        namespace=namespace,
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
        health_poll_interval_s=_number(ns, "health_poll_interval_secs", "--health-poll-interval-secs", float),
        health_timeout_s=_number(ns, "health_timeout_secs", "--health-timeout-secs", float),
        health_failure_threshold=int(_number(ns, "health_failure_threshold", "--health-failure-threshold", int)),
        exit_on_engine_loss=bool(ns.exit_on_engine_loss),
        reconnect_backoff_max_s=_number(ns, "reconnect_backoff_max_secs", "--reconnect-backoff-max-secs", float),
        registration_check_interval_s=_number(
            ns, "registration_check_interval_secs", "--registration-check-interval-secs", float
        ),
        grpc_tls_ca=tls[0],
        grpc_tls_cert=tls[1],
        grpc_tls_key=tls[2],
        grpc_tls_key_password_file=tls[3],
        kv_events_allow_plaintext=bool(ns.kv_events_allow_plaintext),
        log_level=_log_level(ns.log_level),
        log_format=ns.log_format,
        ops_host=ns.ops_host,
        ops_port=_ops_port(ns.ops_port),
        kv_events=ns.kv_events,
        load_poll_interval_s=_number(ns, "load_poll_interval_secs", "--load-poll-interval-secs", float),
        load_max_age_s=_number(ns, "load_max_age_secs", "--load-max-age-secs", float),
        control_plane_deadline_s=_number(ns, "control_plane_deadline_secs", "--control-plane-deadline-secs", float),
        lora_root=_lora_root(ns.lora_root),
        lora_load_timeout_s=_number(ns, "lora_load_timeout_secs", "--lora-load-timeout-secs", float),
        lora_fetch_timeout_s=_number(ns, "lora_fetch_timeout_secs", "--lora-fetch-timeout-secs", float),
        engine_detokenize=ns.engine_detokenize,
        total_kv_blocks=None
        if ns.total_kv_blocks is None
        else int(_number(ns, "total_kv_blocks", "--total-kv-blocks", int)),
        dynamo_system_port=dynamo_system_port,
        grpc_receive=ns.grpc_receive,
        response_plane=ns.response_plane,
        dynamo_egress=ns.dynamo_egress,
        cpu_scheduling=ns.cpu_scheduling,
        custom_jinja_template=_custom_template(ns.custom_jinja_template),
        exclude_tools_when_tool_choice_none=ns.exclude_tools_when_tool_choice_none == "true",
        default_thinking_mode=ns.dyn_default_thinking_mode,
        enable_rl=enable_rl,
        rl_endpoint=_rl_endpoint(enable_rl, ns.endpoint, os.environ),
    )


def _log_level(raw: str) -> str:
    from sidecar.ops.logs import parse_levels

    try:
        parse_levels(raw)
    except ValueError as exc:
        raise ConfigError(f"--log-level: {exc}") from None
    return raw


def _lora_root(raw: str | None) -> Path | None:
    if raw is None:
        return None
    path = Path(raw)
    if not path.is_absolute():
        raise ConfigError(f"--lora-root: must be an absolute path, got {raw!r}")
    if not path.is_dir():
        raise ConfigError(f"--lora-root: not a directory: {raw}")
    return path.resolve()


def _check_control_plane_env(ns: argparse.Namespace) -> None:
    """Dynamo reads ETCD_ENDPOINTS and NATS_SERVER itself; catch what it would only refuse after its deadline."""
    if ns.discovery_backend == "etcd":
        endpoints = os.environ.get("ETCD_ENDPOINTS")
        if endpoints is not None and not all(part.strip() for part in endpoints.split(",")):
            raise ConfigError(f"ETCD_ENDPOINTS: expected comma-separated URLs (http://host:2379), got {endpoints!r}")
    if "nats" in (ns.request_plane, ns.event_plane):
        server = os.environ.get("NATS_SERVER")
        if server is not None and not server.startswith(("nats://", "tls://")):
            raise ConfigError(f"NATS_SERVER: must start with nats:// or tls://, got {server!r}")


#: The largest ``DYN_SYSTEM_PORT`` Dynamo 1.6.1 accepts: it reads the variable as a signed 16-bit number and fails
#: (a 43-line traceback, after the engine is connected) on anything above.
SYSTEM_PORT_MAX = 32767


def _system_port_number(name: str, raw: object, why: str) -> int:
    """A port Dynamo 1.6.1 can read from ``DYN_SYSTEM_PORT``: 0..32767 (it parses a signed 16-bit number)."""
    try:
        port = int(str(raw))
    except ValueError:
        port = -1
    if not 0 <= port <= SYSTEM_PORT_MAX:
        raise ConfigError(f"{name}: must be a port in 0..{SYSTEM_PORT_MAX} ({why}), got {raw!r}")
    return port


def _check_system_port(environ: Mapping[str, str]) -> None:
    raw = environ.get("DYN_SYSTEM_PORT")
    if raw:
        _system_port_number("DYN_SYSTEM_PORT", raw, "Dynamo 1.6.1 reads it as a signed 16-bit number")


def _dynamo_system_port(raw: object, environ: Mapping[str, str]) -> int:
    """``--dynamo-system-port``: 0 (the OS picks) or a port Dynamo can read, apart from the sidecar's own."""
    why = "0: the OS picks; Dynamo 1.6.1 reads DYN_SYSTEM_PORT as a signed 16-bit number"
    port = _system_port_number("--dynamo-system-port", raw, why)
    if port:
        own = environ.get("DYN_SYSTEM_PORT") or "0"
        if own in ("0", ""):
            raise ConfigError(
                "--dynamo-system-port: needs a system port of the sidecar's own (DYN_SYSTEM_PORT > 0), which "
                "relays to it; with DYN_SYSTEM_PORT unset or 0, Dynamo's system server is the only one"
            )
        if int(own) == port:
            raise ConfigError(f"--dynamo-system-port: {port} is DYN_SYSTEM_PORT, the sidecar's own system port")
    return port


#: Dynamo's own start-up bounds on reaching etcd and NATS (read by the runtime when it is created).
CONTROL_PLANE_TIMEOUT_VARIABLES = ("ETCD_STARTUP_CONNECT_TIMEOUT_SECONDS", "NATS_STARTUP_CONNECT_TIMEOUT_SECONDS")


def apply_control_plane_deadline(config: SidecarConfig, environ: MutableMapping[str, str]) -> list[str]:
    """Bound the runtime's connection to etcd and NATS by ``--control-plane-deadline-secs``: set Dynamo's startup
    timeouts (whole seconds, rounded up) unless the operator set them. Returns the variables it set."""
    seconds = str(max(1, math.ceil(config.control_plane_deadline_s)))
    applied = [name for name in CONTROL_PLANE_TIMEOUT_VARIABLES if not environ.get(name)]
    for name in applied:
        environ[name] = seconds
    return applied


def _ops_port(raw: object) -> int | None:
    if raw is None:
        return None
    try:
        port = int(str(raw))
    except ValueError:
        raise ConfigError(f"--ops-port: not a number: {raw!r}") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"--ops-port: must be in 0..65535, got {raw!r}")
    return port


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``openengine-sidecar`` (``status``, ``watch`` and ``probe`` are operator subcommands)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] in ("status", "watch", "probe"):
        from sidecar.ops.cli import main as ops_main

        sys.exit(ops_main(args))
    config = parse_config(argv)
    apply_control_plane_deadline(config, os.environ)
    # Dynamo's own Python workers set it too: parts of the runtime read the variable, not the constructor's argument.
    os.environ["DYN_RESPONSE_PLANE"] = config.response_plane
    from sidecar.ops.logs import dynamo_logging_environment

    # Before anything imports `dynamo`: its logging reads these once, at import.
    dynamo_logging_environment(config.log_level, config.log_format, os.environ, tty=sys.stderr.isatty())
    from sidecar.dynamo import ControlPlaneError, ControlPlaneUnreachable
    from sidecar.worker import run_worker

    try:
        status = run_worker(config)
    except* ControlPlaneError as group:
        # One line for the operator (no traceback): etcd/NATS unreachable at start-up, or lost while serving.
        error = _first_leaf(group)
        refused = "refusing to start: " if isinstance(error, ControlPlaneUnreachable) else ""
        logging.getLogger("sidecar.worker").error("%s%s", refused, error)
        status = 1
    sys.exit(status)


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error
