"""Operator subcommands of ``openengine-sidecar``: ``status``, ``watch`` (the ops feed) and ``probe`` (engine health).

    openengine-sidecar status --ops-url ws://127.0.0.1:9345/ws [--json]
    openengine-sidecar watch  --ops-url ws://127.0.0.1:9345/ws
    openengine-sidecar probe  --grpc-endpoint 127.0.0.1:50051          # exit 0 iff Control.Health is READY
    openengine-sidecar probe  --grpc-endpoint https://engine:50051 --grpc-tls-ca ca.pem [--grpc-tls-cert ...]

``status`` and ``watch`` read the worker's live state feed (``--ops-port``); without ``--ops-url`` they use
``DYN_SIDECAR_OPS_HOST``/``DYN_SIDECAR_OPS_PORT`` like the worker. ``probe`` is meant for Kubernetes exec probes of
the engine container: it does one ``Control.Health`` call, bounded by ``--timeout-secs``, over the same transport
as the worker (TLS with the worker's ``--grpc-tls-*`` flags and ``DYN_SIDECAR_GRPC_TLS_*`` variables, or a Unix socket).

Exit statuses, for scripts (:data:`EXIT_OK`, :data:`EXIT_NOT_SERVING`, :data:`EXIT_UNREACHABLE`):

* ``status``: 0 the worker is ``serving``; 1 reachable but not serving (its state and reason printed); 2 unreachable
  or an unusable URL (the reason printed, one line).
* ``probe``: 0 the engine reports READY; 1 not READY or unreachable; 2 an unusable ``--grpc-endpoint`` or TLS flag.
* ``watch``: 0 after ``--duration-secs``; 1 the feed closed; 2 unreachable.

Every refusal is one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import deque
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit

import trio
from rich.console import Console, Group
from rich.live import Live
from rich.text import Text
from trio_websocket import ConnectionClosed, ConnectionRejected, HandshakeError, open_websocket_url

from sidecar.engine import EndpointError

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    from sidecar.engine import EngineClientConfig

__all__ = ["EXIT_NOT_SERVING", "EXIT_OK", "EXIT_UNREACHABLE", "SUBCOMMANDS", "build_parser", "main"]

SUBCOMMANDS: Final = ("status", "watch", "probe")

EXIT_OK: Final = 0
EXIT_NOT_SERVING: Final = 1
EXIT_UNREACHABLE: Final = 2

_BAD_STATES: Final = frozenset({"failed", "degraded", "stalled", "reconnecting"})


def _default_url() -> str | None:
    port = os.environ.get("DYN_SIDECAR_OPS_PORT")
    if not port:
        return None
    host = os.environ.get("DYN_SIDECAR_OPS_HOST") or "127.0.0.1"
    return f"ws://{host}:{port}/ws"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="openengine-sidecar",
        description="Operator subcommands: read a worker's live state feed, or probe an engine's health.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    default_url = _default_url()
    url_help = "the worker's ops feed, ws://HOST:PORT/ws [default from DYN_SIDECAR_OPS_HOST/DYN_SIDECAR_OPS_PORT]"
    for name, text in (
        ("status", "print a snapshot of the worker state and requests per state, then exit"),
        ("watch", "live terminal view of the worker state, requests per state and transitions (Ctrl-C ends)"),
    ):
        cmd = sub.add_parser(name, help=text, description=text, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        cmd.add_argument("--ops-url", default=default_url, help=url_help)
        cmd.add_argument("--timeout-secs", type=float, default=5.0, help="bound on connecting and the first message")
        if name == "status":
            cmd.add_argument("--json", action="store_true", help="print the raw snapshot as JSON")
        else:
            cmd.add_argument("--duration-secs", type=float, default=None, help="stop after this long (default: never)")
            cmd.add_argument("--events", type=int, default=15, help="how many recent transitions to show")
    probe = sub.add_parser(
        "probe",
        help="exit 0 iff the engine's Control.Health reports READY (for Kubernetes exec probes)",
        description="One Control.Health RPC to an OpenEngine engine; exit 0 if READY, 1 otherwise.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    probe.add_argument(
        "--grpc-endpoint",
        default=os.environ.get("DYN_SIDECAR_GRPC_ENDPOINT") or "127.0.0.1:50051",
        help="the engine's OpenEngine endpoint [env DYN_SIDECAR_GRPC_ENDPOINT]",
    )
    for flag, env, text in (
        ("--grpc-tls-ca", "DYN_SIDECAR_GRPC_TLS_CA", "CA bundle verifying the engine's certificate; enables TLS"),
        ("--grpc-tls-cert", "DYN_SIDECAR_GRPC_TLS_CERT", "client certificate for mutual TLS (with --grpc-tls-key)"),
        ("--grpc-tls-key", "DYN_SIDECAR_GRPC_TLS_KEY", "client private key for mutual TLS"),
        (
            "--grpc-tls-key-password-file",
            "DYN_SIDECAR_GRPC_TLS_KEY_PASSWORD_FILE",
            "file holding the passphrase of an encrypted --grpc-tls-key",
        ),
    ):
        # The worker's flags and variables, so a probe runs with the worker's own environment.
        probe.add_argument(flag, default=os.environ.get(env) or None, help=f"{text} [env {env}]")
    probe.add_argument("--timeout-secs", type=float, default=3.0, help="bound on the whole probe")
    probe.add_argument("--quiet", action="store_true", help="print nothing, only set the exit status")
    return parser


# -- the feed client -------------------------------------------------------------------------------------------------


class FeedView:
    """What a client knows from the feed: the worker state, counts per machine and state, recent transitions."""

    def __init__(self, snapshot: dict[str, Any], events: int = 15) -> None:
        self.machines: list[dict[str, Any]] = snapshot.get("machines", [])
        self.worker: dict[str, Any] | None = snapshot.get("worker")
        self.counts: dict[str, dict[str, int]] = snapshot.get("counts", {})
        self.seq: int = snapshot.get("seq", 0)
        self.lost: int = snapshot.get("lost", 0)
        self.recent: deque[dict[str, Any]] = deque(maxlen=max(events, 0))

    def apply(self, message: dict[str, Any]) -> None:
        if message.get("type") != "events":
            return
        self.worker = message.get("worker")
        self.counts = message.get("counts", self.counts)
        self.lost += int(message.get("lost") or 0)
        if message.get("last_seq") is not None:
            self.seq = int(message["last_seq"])
        self.recent.extend(message.get("events", []))

    def render(self) -> Group:
        """One line each: the worker, every other machine's non-zero counts, then the recent transitions (as many as
        ``events`` allows); nothing wraps, so the view keeps its height on an 80x24 terminal."""
        state = (self.worker or {}).get("state", "?")
        reason = (self.worker or {}).get("reason")
        style = "bold red" if state in _BAD_STATES else "bold green" if state == "serving" else "bold yellow"
        head = _line(Text.assemble("worker ", (state, style), f"  ({reason})" if reason else "", f"   seq {self.seq}"))
        if self.lost:
            head.append(f"   {self.lost} transition(s) not shown (feed overflow)", style="yellow")
        lines = [head]
        for machine in self.machines:
            name = machine["name"]
            if name == "worker":
                continue  # its one state is the head line
            terminal = set(machine.get("terminal", []))
            counts = self.counts.get(name, {})
            now = [f"{s} {counts[s]}" for s in machine["states"] if s not in terminal and counts.get(s)]
            total = [f"{s} {counts[s]}" for s in machine["states"] if s in terminal and counts.get(s)]
            text = f"{name}: now {', '.join(now) or 'none'} | total {', '.join(total) or 'none'}"
            lines.append(_line(Text(text)))
        if self.recent.maxlen:
            lines.append(_line(Text("recent transitions", style="bold")))
            for ev in self.recent:
                reason_text = f"  {ev['reason']}" if ev.get("reason") else ""
                lines.append(
                    _line(Text(f"{ev['seq']:>6} {ev['machine']} {ev['id']} {ev['from']} -{ev['event']}-> {ev['to']}"))
                )
                if reason_text:
                    lines[-1].append(reason_text, style="dim")
        return Group(*lines)


def _line(text: Text) -> Text:
    text.no_wrap = True
    text.overflow = "ellipsis"
    return text


# -- status and watch ------------------------------------------------------------------------------------------------


class Unreachable(Exception):
    """The feed cannot be read at this URL; the message is the reason, one line."""


def _check_url(url: str) -> None:
    parsed = urlsplit(url)
    if parsed.scheme not in ("ws", "wss") or not parsed.hostname:
        raise Unreachable(f"not a websocket URL (expected ws://HOST:PORT/ws): {url!r}")
    if parsed.path != "/ws":
        raise Unreachable(f"the feed is at path /ws (expected ws://HOST:PORT/ws), not {parsed.path or '/'!r}")


def _why(exc: BaseException) -> str:
    """The innermost reason of a connection failure, one line (trio-websocket wraps the OSError that says it)."""
    if isinstance(exc, ConnectionRejected):
        return f"HTTP {exc.status_code} instead of a websocket upgrade: is this a worker's ops port?"
    if isinstance(exc, trio.TooSlowError):
        return "no answer in time"
    while not str(exc) and (exc.__cause__ or exc.__context__) is not None:
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return " ".join(str(exc).split()) or type(exc).__name__


@asynccontextmanager
async def _feed(url: str, timeout_s: float) -> AsyncIterator[tuple[Any, dict[str, Any]]]:
    """The websocket and its first message (the snapshot); connecting and the snapshot are bounded by ``timeout_s``."""
    _check_url(url)
    with trio.CancelScope(deadline=trio.current_time() + timeout_s) as connecting:
        try:
            async with open_websocket_url(url) as ws:
                snapshot = json.loads(await ws.get_message())
                connecting.deadline = float("inf")
                yield ws, snapshot
                return
        except (OSError, HandshakeError, ConnectionClosed, ValueError) as exc:
            raise Unreachable(_why(exc)) from None
    if connecting.cancelled_caught:
        raise Unreachable(f"no answer within {timeout_s:g}s")


async def _status(url: str, timeout_s: float, as_json: bool, console: Console) -> int:
    async with _feed(url, timeout_s) as (_, snapshot):
        pass
    if as_json:
        console.print_json(data=snapshot)
    else:
        console.print(FeedView(snapshot, events=0).render())
    worker = snapshot.get("worker") or {}
    if worker.get("state") == "serving":
        return EXIT_OK
    if not as_json:
        reason = f": {worker['reason']}" if worker.get("reason") else ""
        print(f"openengine-sidecar status: not serving ({worker.get('state', 'unknown')}{reason})", file=sys.stderr)
    return EXIT_NOT_SERVING


async def _watch(url: str, timeout_s: float, duration_s: float | None, events: int, console: Console) -> int:
    with trio.move_on_after(duration_s if duration_s is not None else float("inf")):
        async with _feed(url, timeout_s) as (ws, snapshot):
            view = FeedView(snapshot, events=_fit(events, snapshot, console))
            with Live(view.render(), console=console, refresh_per_second=8) as live:
                while True:
                    try:
                        message = json.loads(await ws.get_message())
                    except ConnectionClosed as exc:
                        console.print(f"feed closed: {exc.reason}")
                        return EXIT_NOT_SERVING
                    view.apply(message)
                    live.update(view.render())
    return EXIT_OK


def _fit(events: int, snapshot: dict[str, Any], console: Console) -> int:
    """How many transitions fit under the head, one line per machine and the transitions' title."""
    fixed = 2 + sum(1 for machine in snapshot.get("machines", []) if machine.get("name") != "worker")
    return max(0, min(events, console.size.height - fixed - 1))


def _probe_config(args: argparse.Namespace) -> EngineClientConfig | str:
    """The probe's engine client configuration, or the one-line usage error (exit 2)."""
    from sidecar.engine import (
        EngineClientConfig,
        TlsFilesError,
        parse_endpoint,
        tls_files_from_flags,
        unix_path_problem,
    )

    try:
        tls = tls_files_from_flags(
            args.grpc_tls_ca, args.grpc_tls_cert, args.grpc_tls_key, args.grpc_tls_key_password_file
        )
    except TlsFilesError as exc:
        return str(exc)
    try:
        endpoint = parse_endpoint(args.grpc_endpoint, tls=tls is not None)
    except EndpointError as exc:
        return f"--grpc-endpoint: {exc}"
    if endpoint.path is not None and (problem := unix_path_problem(endpoint.path)) is not None:
        return f"--grpc-endpoint: {problem}"
    return EngineClientConfig(
        endpoint=endpoint,
        connections=1,
        rpc_timeout_s=args.timeout_secs,
        tls_ca=tls.ca if tls else None,
        tls_cert=tls.cert if tls else None,
        tls_key=tls.key if tls else None,
        tls_key_password_file=tls.key_password_file if tls else None,
    )


async def _probe(config: EngineClientConfig, timeout_s: float, quiet: bool) -> int:
    from sidecar.edge import open_edge
    from sidecar.engine import open_engine_client
    from sidecar.errors import EngineRpcError

    endpoint = config.endpoint
    with trio.move_on_after(timeout_s + 1) as bound:
        async with open_edge() as edge, open_engine_client(edge, config) as client:
            try:
                response = await client.health(timeout_s=timeout_s)
            except EngineRpcError as exc:
                if not quiet:
                    print(f"probe: {endpoint}: {exc}", file=sys.stderr)
                return 1
    if bound.cancelled_caught:
        if not quiet:
            print(f"probe: {endpoint}: no answer within {timeout_s:g}s", file=sys.stderr)
        return 1
    name = getattr(response.state, "name", str(response.state))
    ready = int(response.state) == 2  # HEALTH_STATE_READY
    if not quiet:
        details = "; ".join(f"{c.name}: {c.message}" for c in response.checks if c.message)
        print(f"probe: {endpoint}: {name}" + (f" ({details})" if details else ""))
    return 0 if ready else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; returns the exit status (see the module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    console = Console()
    try:
        if args.command == "probe":
            config = _probe_config(args)
            if isinstance(config, str):
                print(f"openengine-sidecar probe: {config}", file=sys.stderr)
                return EXIT_UNREACHABLE
            return trio.run(_probe, config, args.timeout_secs, args.quiet)
        if not args.ops_url:
            parser.error("--ops-url is required (or set DYN_SIDECAR_OPS_PORT)")
        if args.command == "status":
            return trio.run(_status, args.ops_url, args.timeout_secs, args.json, console)
        return trio.run(_watch, args.ops_url, args.timeout_secs, args.duration_secs, args.events, console)
    except Unreachable as exc:
        print(f"openengine-sidecar {args.command}: {args.ops_url}: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except KeyboardInterrupt:
        return 130
