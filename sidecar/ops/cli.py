"""Operator subcommands of ``openengine-sidecar``: ``status``, ``watch`` (the ops feed) and ``probe`` (engine health).

    openengine-sidecar status --ops-url ws://127.0.0.1:9345/ws [--json]
    openengine-sidecar watch  --ops-url ws://127.0.0.1:9345/ws
    openengine-sidecar probe  --grpc-endpoint 127.0.0.1:50051          # exit 0 iff Control.Health is READY
    openengine-sidecar probe  --grpc-endpoint https://engine:50051 --grpc-tls-ca ca.pem [--grpc-tls-cert ...]

``status`` and ``watch`` read the worker's live state feed (``--ops-port``); without ``--ops-url`` they use
``DYN_SIDECAR_OPS_HOST``/``DYN_SIDECAR_OPS_PORT`` like the worker. ``probe`` is meant for Kubernetes exec probes of
the engine container: it does one ``Control.Health`` call, bounded by ``--timeout-secs``, over the same transport
as the worker (TLS with the worker's ``--grpc-tls-*`` flags and ``DYN_SIDECAR_GRPC_TLS_*`` variables, or a Unix socket).
Exit statuses: 0 ok, 1 not ready / unreachable, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import deque
from typing import TYPE_CHECKING, Any, Final

import trio
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text
from trio_websocket import ConnectionClosed, HandshakeError, open_websocket_url

if TYPE_CHECKING:
    from collections.abc import Sequence

    from sidecar.engine import EngineClientConfig

__all__ = ["SUBCOMMANDS", "build_parser", "main"]

SUBCOMMANDS: Final = ("status", "watch", "probe")

_BAD_STATES: Final = frozenset({"failed", "degraded", "reconnecting"})


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
        state = (self.worker or {}).get("state", "?")
        reason = (self.worker or {}).get("reason")
        style = "bold red" if state in _BAD_STATES else "bold green" if state == "serving" else "bold yellow"
        head = Text.assemble("worker ", (state, style), f"  ({reason})" if reason else "", f"   seq {self.seq}")
        if self.lost:
            head.append(f"   {self.lost} transition(s) not shown (feed overflow)", style="yellow")
        tables = []
        for machine in self.machines:
            name = machine["name"]
            terminal = set(machine.get("terminal", []))
            table = Table(title=f"{name} states", title_justify="left", expand=False)
            table.add_column("state")
            table.add_column("count", justify="right")
            table.add_column("", no_wrap=True)
            counts = self.counts.get(name, {})
            for s in machine["states"]:
                n = int(counts.get(s, 0))
                marker = "total" if s in terminal else "now"
                highlight = "bold green" if name == "worker" and s == state else ""
                table.add_row(Text(s, style=highlight), str(n), marker)
            tables.append(table)
        events = Table(title="recent transitions", title_justify="left", expand=False)
        for column in ("seq", "machine", "id", "transition", "reason"):
            events.add_column(column, overflow="fold")
        for ev in self.recent:
            events.add_row(
                str(ev["seq"]), ev["machine"], ev["id"], f"{ev['from']} -{ev['event']}-> {ev['to']}", ev["reason"] or ""
            )
        return Group(head, *tables, events) if self.recent.maxlen else Group(head, *tables)


async def _status(url: str, timeout_s: float, as_json: bool, console: Console) -> int:
    with trio.fail_after(timeout_s):
        async with open_websocket_url(url) as ws:
            snapshot = json.loads(await ws.get_message())
    if as_json:
        console.print_json(data=snapshot)
    else:
        console.print(FeedView(snapshot, events=0).render())
    return 0


async def _watch(url: str, timeout_s: float, duration_s: float | None, events: int, console: Console) -> int:
    with trio.move_on_after(duration_s if duration_s is not None else float("inf")):
        # Bound connecting and the first message only; the view itself runs until the duration or Ctrl-C.
        with trio.CancelScope(deadline=trio.current_time() + timeout_s) as connecting:
            async with open_websocket_url(url) as ws:
                view = FeedView(json.loads(await ws.get_message()), events=events)
                connecting.deadline = float("inf")
                with Live(view.render(), console=console, refresh_per_second=8) as live:
                    while True:
                        try:
                            message = json.loads(await ws.get_message())
                        except ConnectionClosed as exc:
                            console.print(f"feed closed: {exc.reason}")
                            return 1
                        view.apply(message)
                        live.update(view.render())
        if connecting.cancelled_caught:
            raise trio.TooSlowError
    return 0


def _probe_config(args: argparse.Namespace) -> EngineClientConfig | str:
    """The probe's engine client configuration, or the one-line usage error (exit 2)."""
    from sidecar.engine import (
        EndpointError,
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
    """Run one subcommand; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    console = Console()
    try:
        if args.command == "probe":
            config = _probe_config(args)
            if isinstance(config, str):
                print(f"openengine-sidecar probe: {config}", file=sys.stderr)
                return 2
            return trio.run(_probe, config, args.timeout_secs, args.quiet)
        if not args.ops_url:
            parser.error("--ops-url is required (or set DYN_SIDECAR_OPS_PORT)")
        if args.command == "status":
            return trio.run(_status, args.ops_url, args.timeout_secs, args.json, console)
        return trio.run(_watch, args.ops_url, args.timeout_secs, args.duration_secs, args.events, console)
    except (OSError, HandshakeError, ConnectionClosed, trio.TooSlowError) as exc:
        what = args.ops_url if args.command != "probe" else args.grpc_endpoint
        print(f"openengine-sidecar {args.command}: {what}: {exc or type(exc).__name__}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
