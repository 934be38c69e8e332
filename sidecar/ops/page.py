"""The live state page: every machine's diagram (server-side SVG), state table and Mermaid source, kept live by the
page's own script over the ``/ws`` feed.

Self-contained on purpose: no CDN, no external script or font (operators' networks are often closed, and the tests
run without one), so the diagrams are laid out here, from the same tables ``docs/state-machines.md`` is generated
from, rather than by Mermaid in the browser. The Mermaid text is included for copying into other tools.

Layout: a state's row is its longest distance from the initial state along forward edges (back edges -- e.g.
``reconnecting -> discovering`` -- found by a depth-first search and drawn on the left); states of a row sit side by
side in table order. Edges to the next row are straight, longer forward edges curve out to the right.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from statemachines import KINDS

if TYPE_CHECKING:
    from collections.abc import Sequence

    from statemachines import MachineKind

__all__ = ["machine_model", "mermaid_source", "render_page"]

_BOX_W: Final = 150
_BOX_H: Final = 46
_ROW_H: Final = 84
_COL_W: Final = 180
_MARGIN: Final = 60


@dataclass(frozen=True, slots=True)
class _Edge:
    source: str
    dest: str
    events: tuple[str, ...]


def _edges(kind: MachineKind[Any, Any, Any]) -> list[_Edge]:
    """One edge per (source, dest) pair, with every event that moves along it, in table order."""
    grouped: dict[tuple[str, str], list[str]] = {}
    for (source, event), dest in kind.edges.items():
        grouped.setdefault((source, dest), []).append(event)
    return [_Edge(source, dest, tuple(events)) for (source, dest), events in grouped.items()]


def _layers(kind: MachineKind[Any, Any, Any], edges: Sequence[_Edge]) -> dict[str, int]:
    """Row of every state: longest forward distance from the initial state (back edges found by DFS are ignored)."""
    out: dict[str, list[str]] = {state: [] for state in kind.states}
    for edge in edges:
        out[edge.source].append(edge.dest)
    back: set[tuple[str, str]] = set()
    colour: dict[str, int] = {}  # 1 on the DFS stack, 2 done

    def visit(state: str) -> None:
        colour[state] = 1
        for dest in out[state]:
            if colour.get(dest) == 1:
                back.add((state, dest))
            elif dest not in colour:
                visit(dest)
        colour[state] = 2

    for state in (kind.initial, *kind.states):
        if state not in colour:
            visit(state)
    layer = {state: 0 for state in kind.states}
    for _ in kind.states:  # Bellman-Ford style relaxation on the DAG: at most |states| rounds
        changed = False
        for edge in edges:
            if (edge.source, edge.dest) not in back and layer[edge.dest] < layer[edge.source] + 1:
                layer[edge.dest] = layer[edge.source] + 1
                changed = True
        if not changed:
            break
    return layer


def mermaid_source(kind: MachineKind[Any, Any, Any]) -> str:
    """A Mermaid ``stateDiagram-v2`` of the kind, straight from its tables (for copying; the page draws SVG)."""
    lines = ["stateDiagram-v2", f"  [*] --> {kind.initial}"]
    lines += [f"  {e.source} --> {e.dest}: {' / '.join(e.events)}" for e in _edges(kind)]
    lines += [f"  {state} --> [*]" for state in kind.states if state in kind.terminal]
    return "\n".join(lines)


def _svg(kind: MachineKind[Any, Any, Any]) -> str:
    edges = _edges(kind)
    layer = _layers(kind, edges)
    rows: dict[int, list[str]] = {}
    for state in kind.states:
        rows.setdefault(layer[state], []).append(state)
    widest = max(len(states) for states in rows.values())
    width = widest * _COL_W + 2 * _MARGIN + 80
    height = (max(rows) + 1) * _ROW_H + _MARGIN
    centre: dict[str, tuple[float, float]] = {}
    for row, states in rows.items():
        left = (width - len(states) * _COL_W) / 2 + _COL_W / 2
        for i, state in enumerate(states):
            centre[state] = (left + i * _COL_W, _MARGIN / 2 + row * _ROW_H + _BOX_H / 2)
    name = kind.name
    parts = [
        f'<svg class="diagram" id="svg-{name}" viewBox="0 0 {width:.0f} {height:.0f}" '
        f'role="img" aria-label="{name} state diagram" xmlns="http://www.w3.org/2000/svg">',
        '<defs><marker id="arrow-' + name + '" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z"/></marker></defs>',
    ]
    for edge in edges:
        (x1, y1), (x2, y2) = centre[edge.source], centre[edge.dest]
        span = layer[edge.dest] - layer[edge.source]
        label = " / ".join(edge.events)
        if span == 1:
            sx, sy, ex, ey = x1, y1 + _BOX_H / 2, x2, y2 - _BOX_H / 2
            path = f"M {sx:.0f} {sy:.0f} L {ex:.0f} {ey:.0f}"
            lx, ly = (sx + ex) / 2 + 4, (sy + ey) / 2 + 4
            text = f'<text class="edge-label" x="{lx:.0f}" y="{ly:.0f}">{html.escape(label)}</text>'
        else:
            # Longer forward edges bulge right, back edges left; the bulge grows with the span so they fan out.
            side = 1 if span > 0 else -1
            bulge = side * (_BOX_W / 2 + 18 + 14 * abs(span))
            sx, sy = x1 + side * _BOX_W / 2, y1
            ex, ey = x2 + side * _BOX_W / 2, y2
            path = f"M {sx:.0f} {sy:.0f} C {x1 + bulge:.0f} {sy:.0f}, {x2 + bulge:.0f} {ey:.0f}, {ex:.0f} {ey:.0f}"
            text = ""
        edge_id = f"edge-{name}-{edge.source}-{edge.dest}"
        parts.append(
            f'<g class="edge" id="{edge_id}"><title>{html.escape(label)}: {edge.source} → {edge.dest}</title>'
            f'<path d="{path}" marker-end="url(#arrow-{name})"/>{text}</g>'
        )
    for state in kind.states:
        x, y = centre[state]
        classes = "state terminal" if state in kind.terminal else "state"
        if state == kind.initial:
            classes += " initial"
        parts.append(
            f'<g class="{classes}" id="state-{name}-{state}" data-state="{state}">'
            f"<title>{html.escape(kind.docs[state].meaning)}</title>"
            f'<rect x="{x - _BOX_W / 2:.0f}" y="{y - _BOX_H / 2:.0f}" width="{_BOX_W}" height="{_BOX_H}" rx="10"/>'
            f'<text class="name" x="{x:.0f}" y="{y - 4:.0f}">{state}</text>'
            f'<text class="count" id="count-{name}-{state}" x="{x:.0f}" y="{y + 14:.0f}">0</text></g>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _table(kind: MachineKind[Any, Any, Any]) -> str:
    rows = [
        f'<table class="states" id="table-{kind.name}"><thead><tr><th>state</th><th title="current for non-terminal '
        'states, total since start for terminal ones">count</th><th>meaning</th><th>what the operator sees</th>'
        "<th>what to do</th></tr></thead><tbody>"
    ]
    for state in kind.states:
        doc = kind.docs[state]
        marker = " (terminal)" if state in kind.terminal else ""
        rows.append(
            f'<tr id="row-{kind.name}-{state}"><td><code>{state}</code>{marker}</td>'
            f'<td class="num" id="cell-{kind.name}-{state}">0</td><td>{html.escape(doc.meaning)}</td>'
            f"<td>{html.escape(doc.operator_sees)}</td><td>{html.escape(doc.action)}</td></tr>"
        )
    rows.append("</tbody></table>")
    return "".join(rows)


def machine_model(kind: MachineKind[Any, Any, Any]) -> dict[str, Any]:
    """The static description of a kind the page's script (and ``openengine-sidecar watch``) works from."""
    return {
        "name": kind.name,
        "states": list(kind.states),
        "initial": kind.initial,
        "terminal": [state for state in kind.states if state in kind.terminal],
        "edges": [{"source": s, "event": e, "dest": d} for (s, e), d in kind.edges.items()],
    }


_STYLE: Final = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{padding:10px 20px;background:#1d2330;color:#fff;display:flex;gap:24px;align-items:baseline;flex-wrap:wrap}
header h1{font-size:18px;margin:0}
#conn[data-state=open]{color:#7ee2a8}#conn{color:#ffb3b3}
main{padding:0 20px 20px}
section.machine{background:#fff;border:1px solid #dde1e7;border-radius:8px;margin:16px 0;padding:12px 16px}
.cols{display:flex;gap:20px;flex-wrap:wrap}.cols>.diagram-box{flex:0 1 460px}.cols>.table-box{flex:1 1 480px}
svg.diagram{width:100%;height:auto;max-height:900px}
.state rect{fill:#eef1f5;stroke:#8792a2;stroke-width:1.5}
.state.terminal rect{stroke-width:3}
.state .name{font:600 14px system-ui,sans-serif;text-anchor:middle;fill:#1d2330}
.state .count{font:12px ui-monospace,monospace;text-anchor:middle;fill:#4a5568}
.state.busy rect{fill:#fff3c4;stroke:#b7791f}
.state.current rect{fill:#c6f6d5;stroke:#2f855a;stroke-width:3}
.state.current.bad rect{fill:#fed7d7;stroke:#c53030}
.edge path{fill:none;stroke:#a0aec0;stroke-width:1.2}
.edge{fill:#a0aec0}
.edge .edge-label{font:11px system-ui,sans-serif;fill:#718096}
.edge.fired path{stroke:#dd6b20;stroke-width:3}
.edge.fired{fill:#dd6b20}
table.states{border-collapse:collapse;width:100%;font-size:13px}
table.states th,table.states td{border-bottom:1px solid #e2e8f0;padding:4px 6px;text-align:left;vertical-align:top}
td.num{font:13px ui-monospace,monospace;text-align:right}
tr.current{background:#c6f6d5}tr.busy td.num{background:#fff3c4}
details pre{background:#f1f3f6;padding:8px;overflow:auto}
#events{font:12px ui-monospace,monospace;max-height:240px;overflow:auto;background:#fff;border:1px solid #dde1e7;
border-radius:8px;padding:8px;margin:0}
"""

_SCRIPT: Final = r"""
"use strict";
const MODEL = JSON.parse(document.getElementById("machines").textContent);
const BAD = new Set(["failed", "degraded", "stalled", "reconnecting"]);
const conn = document.getElementById("conn");
const log = document.getElementById("events");
let lastSeq = 0, retry = 500;
function setText(id, v) {
  const el = document.getElementById(id);
  if (el && el.textContent !== String(v)) el.textContent = v;
}
function applyCounts(counts) {
  for (const m of MODEL) {
    const c = counts[m.name] || {};
    for (const s of m.states) {
      const n = c[s] || 0;
      setText(`count-${m.name}-${s}`, n); setText(`cell-${m.name}-${s}`, n);
      const busy = n > 0 && !m.terminal.includes(s) && m.name !== "worker";
      document.getElementById(`state-${m.name}-${s}`).classList.toggle("busy", busy);
      document.getElementById(`row-${m.name}-${s}`).classList.toggle("busy", busy);
    }
  }
}
function applyWorker(w) {
  if (!w) return;
  for (const s of MODEL.find(m => m.name === "worker").states) {
    const on = s === w.state;
    const node = document.getElementById(`state-worker-${s}`);
    node.classList.toggle("current", on); node.classList.toggle("bad", on && BAD.has(s));
    document.getElementById(`row-worker-${s}`).classList.toggle("current", on);
  }
  setText("worker-state", w.state + (w.reason ? ` (${w.reason})` : ""));
  document.body.dataset.workerState = w.state;
}
function flash(ev) {
  const el = document.getElementById(`edge-${ev.machine}-${ev.from}-${ev.to}`);
  if (!el) return;
  el.classList.add("fired"); clearTimeout(el._t); el._t = setTimeout(() => el.classList.remove("fired"), 700);
}
function addLog(ev) {
  const line = document.createElement("div");
  const t = new Date(ev.t * 1000).toISOString().slice(11, 23);
  line.textContent = `${t} ${ev.machine} ${ev.id}: ${ev.from} -${ev.event}-> ${ev.to}`
    + (ev.reason ? ` (${ev.reason})` : "");
  log.prepend(line);
  while (log.childElementCount > 200) log.lastElementChild.remove();
}
function handle(msg) {
  if (msg.type === "snapshot" || msg.type === "events") {
    if (msg.type === "events") {
      for (const ev of msg.events) { flash(ev); addLog(ev); }
      if (msg.last_seq !== null) lastSeq = msg.last_seq;
    } else lastSeq = msg.seq;
    applyCounts(msg.counts); applyWorker(msg.worker);
    document.body.dataset.seq = lastSeq;
    setText("lost", msg.lost || 0);
  }
}
function connect() {
  const ws = new WebSocket(`${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/ws`);
  ws.onopen = () => { conn.textContent = "live"; conn.dataset.state = "open"; retry = 500; };
  ws.onmessage = (e) => handle(JSON.parse(e.data));
  ws.onclose = (e) => {
    conn.textContent = `disconnected${e.reason ? ": " + e.reason : ""}; retrying`; conn.dataset.state = "closed";
    setTimeout(connect, retry); retry = Math.min(retry * 2, 5000);
  };
}
connect();
"""


def render_page(kinds: Sequence[MachineKind[Any, Any, Any]] = KINDS, *, title: str = "openengine-sidecar") -> str:
    """The whole page (static: the live parts are filled in by its script from the feed)."""
    model = json.dumps([machine_model(kind) for kind in kinds]).replace("</", "<\\/")
    sections = []
    for kind in kinds:
        sections.append(
            f'<section class="machine" id="machine-{kind.name}"><h2>{kind.name}</h2><div class="cols">'
            f'<div class="diagram-box">{_svg(kind)}</div><div class="table-box">{_table(kind)}</div></div>'
            f"<details><summary>Mermaid source</summary><pre>{html.escape(mermaid_source(kind))}</pre></details>"
            "</section>"
        )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(title)} live state</title><style>{_STYLE}</style></head><body>"
        f'<header><h1>{html.escape(title)}</h1><span>worker: <b id="worker-state">?</b></span>'
        '<span id="conn">connecting</span><span>events lost: <span id="lost">0</span></span></header><main>'
        + "".join(sections)
        + '<section class="machine"><h2>recent transitions</h2><pre id="events"></pre></section></main>'
        f'<script type="application/json" id="machines">{model}</script><script>{_SCRIPT}</script></body></html>'
    )
