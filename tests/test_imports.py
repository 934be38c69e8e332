"""The map is the law: ``docs/architecture.md``'s rooms table is read here and every module is held to it.

Static: every Python module under ``sidecar/``, ``statemachines/`` and ``protos/`` is parsed (never imported) and each
of its imports resolved (relative ones too). The table's grammar is written under the table itself; in short:

* a module belongs to the row whose path is its longest prefix, and every module belongs to a row;
* *may import* is the whole list of what a room imports besides itself; the standard library is always allowed except
  ``asyncio``, which a room imports only when it lists it (trio decides, asyncio stays at the edges);
* *never imports* wins over *may import*; a **bold** name must not even be *loaded*: neither imported by the room nor by
  anything the room imports from this repository, package ``__init__`` files included (the way the conformance kit
  once reached trio through ``sidecar.engine/__init__``);
* ``production code never imports it``: no other room imports this one unless its own *may import* names it.

Which imports count: every import statement, those inside functions and under ``TYPE_CHECKING`` included, for the
room's own rules (a type-only import still ties a room to another: the name, the dependency direction and mypy's view
of it are real). **Bold** rules follow what runs: ``TYPE_CHECKING`` imports load nothing, so they are not followed.
The same full graph is checked for cycles.

Every break is reported at once. A break the code still has on purpose, while its fix lands elsewhere, is listed in
:data:`KNOWN_BREAKS` with its issue; an entry that no longer breaks fails too, so the list is emptied as fixes land.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Final

import pytest

REPO: Final = Path(__file__).resolve().parents[1]
MAP: Final = REPO / "docs" / "architecture.md"
#: Where the modules live, and the directory their import names are relative to.
SOURCE_ROOTS: Final = {"sidecar": REPO, "statemachines": REPO, "protos": REPO / "protos"}
TABLE_HEADING: Final = "## Rooms and what each may import"
PRODUCTION_NEVER: Final = "production code never imports it"
EVERYTHING_ELSE: Final = "everything else"
STDLIB: Final = "stdlib"
#: Lines shown per broken rule (a rule broken through a package ``__init__`` is broken by every module of the room).
REPORT_LINES: Final = 6

#: Breaks the code has today on purpose, each while its fix lands in another branch: ``(room path, rule) -> why``.
#: ``rule`` is the rule's text as :func:`check` reports it. Remove an entry when its fix merges (the test says when).
KNOWN_BREAKS: Final[dict[tuple[str, str], str]] = {}


# -- the map ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """One name of a *may import* / *never imports* cell."""

    name: str
    loads: bool = False  # bold: not even loaded through another room


@dataclass
class Room:
    """One row of the rooms table."""

    paths: list[str]
    may: list[Rule] = field(default_factory=list)
    never: list[Rule] = field(default_factory=list)
    closed: bool = False  # "production code never imports it"

    @property
    def key(self) -> str:
        return self.paths[0]

    def inside(self, other: Room) -> bool:
        """Whether this row is nested in ``other``'s directory (``sidecar/kv/_convert.py`` in ``sidecar/kv/``)."""
        return self is not other and any(
            directory.endswith("/") and path.startswith(directory) for path in self.paths for directory in other.paths
        )

    def owns(self, path: str) -> int:
        """The length of this row's path that ``path`` (repo-relative) falls under; 0 when it does not."""
        best = 0
        for pattern in self.paths:
            if (pattern.endswith("/") and path.startswith(pattern)) or path == pattern or fnmatch(path, pattern):
                best = max(best, len(pattern))
        return best


class MapError(ValueError):
    """The rooms table does not follow its grammar."""


_NAME = re.compile(r"[A-Za-z_][\w.]*")


def _split_items(cell: str) -> list[str]:
    """Comma-separated items; commas inside parentheses belong to the item's comment."""
    items, depth, current = [], 0, ""
    for char in cell:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    items.append(current)
    return [item.strip() for item in items if item.strip()]


def _strip_comment(item: str) -> str:
    """An item without its parenthesised comments (nested parentheses included)."""
    while True:
        stripped = re.sub(r"\([^()]*\)", "", item)
        if stripped == item:
            return item.strip()
        item = stripped


def _rules(cell: str, row: str, column: str) -> tuple[list[Rule], set[str]]:
    """The names and keywords of one cell."""
    rules: list[Rule] = []
    keywords: set[str] = set()
    if cell.strip() in ("—", "-", ""):
        return rules, keywords
    for item in _split_items(cell):
        text = _strip_comment(item)
        bold = text.startswith("**") and text.endswith("**") and len(text) > 4
        text = text.strip("*").replace("`", "").strip()
        if text in (STDLIB, EVERYTHING_ELSE, PRODUCTION_NEVER):
            keywords.add(text)
        elif _NAME.fullmatch(text):
            rules.append(Rule(text, loads=bold))
        else:
            raise MapError(
                f"{MAP.name}, row {row}, {column}: cannot read {item!r} (a module name, optionally in "
                f"backticks or **bold**, then an optional comment in parentheses)"
            )
    return rules, keywords


def parse_map(text: str) -> list[Room]:
    """The rooms of the table under :data:`TABLE_HEADING` in ``text``."""
    lines = text.splitlines()
    try:
        start = lines.index(TABLE_HEADING)
    except ValueError:
        raise MapError(f"{MAP.name}: no heading {TABLE_HEADING!r}") from None
    rows = [line for line in _table_lines(lines[start + 1 :])]
    if len(rows) < 3 or [c.strip().lower() for c in _cells(rows[0])] != [
        "path",
        "holds",
        "may import",
        "never imports",
    ]:
        raise MapError(f"{MAP.name}: the rooms table must have the columns path | holds | may import | never imports")
    rooms = []
    for line in rows[2:]:
        cells = _cells(line)
        if len(cells) != 4:
            raise MapError(f"{MAP.name}: a row of {len(cells)} cells: {line!r}")
        paths = re.findall(r"`([^`]+)`", _strip_comment(cells[0]))
        if not paths:
            raise MapError(f"{MAP.name}: a row without a path in backticks: {line!r}")
        may, may_keywords = _rules(cells[2], paths[0], "may import")
        never, never_keywords = _rules(cells[3], paths[0], "never imports")
        if may_keywords - {STDLIB} or never_keywords - {EVERYTHING_ELSE, PRODUCTION_NEVER}:
            raise MapError(f"{MAP.name}, row {paths[0]}: a keyword in the wrong column")
        rooms.append(Room(paths, may, never, closed=PRODUCTION_NEVER in never_keywords))
    return rooms


def _table_lines(lines: list[str]) -> list[str]:
    rows: list[str] = []
    for line in lines:
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break
    return rows


def _cells(line: str) -> list[str]:
    # A `|` inside backticks would split a cell: the table has none, and a row of the wrong width fails loudly.
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


# -- the code ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    """One imported name of one module: a module of ours (resolved) or a third-party / stdlib dotted name."""

    target: str
    line: int
    runs: bool  # False under TYPE_CHECKING
    ours: bool


@dataclass
class Module:
    name: str
    path: str  # repo-relative, with "/"
    imports: list[Import] = field(default_factory=list)

    @property
    def parents(self) -> list[str]:
        """The packages Python runs before this module (their ``__init__``), outermost first."""
        parts = self.name.split(".")
        return [".".join(parts[:i]) for i in range(1, len(parts))]


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """The ids of every node under an ``if TYPE_CHECKING:`` body (its ``else`` runs)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for statement in node.body:
                found.update(id(child) for child in ast.walk(statement))
    return found


def scan(sources: dict[str, str]) -> dict[str, Module]:
    """Parse ``{repo-relative path: source}`` into modules with their resolved imports."""
    modules: dict[str, Module] = {}
    trees: dict[str, ast.AST] = {}
    for path, source in sources.items():
        top = path.split("/")[0]
        root = Path(SOURCE_ROOTS[top].relative_to(REPO)) if top in SOURCE_ROOTS else Path()
        name = _module_name(Path(path), root)
        modules[name] = Module(name, path)
        trees[name] = ast.parse(source, filename=path)
    for name, module in modules.items():
        tree = trees[name]
        hidden = _type_checking_nodes(tree)
        package = name if module.path.endswith("__init__.py") else name.rpartition(".")[0]
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    source_module = f"{base}.{node.module}" if node.module else base
                else:
                    source_module = node.module or ""
                # `from package import module` imports the module; `from module import name` the module.
                subs = [f"{source_module}.{alias.name}" for alias in node.names]
                found = [sub for sub in subs if sub in modules]
                targets = found if found and len(found) == len(subs) else [source_module, *found]
            else:
                continue
            for target in targets:
                resolved = _resolve(target, modules)
                module.imports.append(
                    Import(resolved or target, node.lineno, id(node) not in hidden, ours=resolved is not None)
                )
    return modules


def _resolve(name: str, modules: dict[str, Module]) -> str | None:
    """The module of ours that ``name`` names (a name inside a module resolves to the module), else None."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def repository_sources() -> dict[str, str]:
    sources: dict[str, str] = {}
    for top in SOURCE_ROOTS:
        for path in sorted((REPO / top).rglob("*.py")):
            sources[path.relative_to(REPO).as_posix()] = path.read_text(encoding="utf-8")
    return sources


# -- the check --------------------------------------------------------------------------------------------------------


def _covers(name: str, target: str) -> bool:
    return target == name or target.startswith(name + ".")


def _is_stdlib(target: str) -> bool:
    top = target.split(".")[0]
    return top in sys.stdlib_module_names and top != "asyncio"


def owners(rooms: list[Room], modules: dict[str, Module]) -> tuple[dict[str, Room], list[str]]:
    """Each module's room, and the problems: modules in no room, rows that hold no module."""
    owner: dict[str, Room] = {}
    problems: list[str] = []
    for name, module in sorted(modules.items()):
        best = max(rooms, key=lambda room: room.owns(module.path))
        if best.owns(module.path):
            owner[name] = best
        else:
            problems.append(f"{module.path}: in no room of the map (add a row, or widen a row's path)")
    held = {id(room) for room in owner.values()}
    for room in rooms:
        if id(room) not in held and any(p.endswith(("/", ".py")) for p in room.paths):
            problems.append(f"row {room.key}: holds no module (a stale path?)")
    return owner, problems


def _loads(start: Module, modules: dict[str, Module]) -> dict[str, list[str]]:
    """Everything running ``start`` loads, each with the chain of imports that gets there (shortest first).

    Python runs a module's packages (their ``__init__``) before the module itself: they are followed too."""
    chains: dict[str, list[str]] = {}
    frontier = [(name, [name]) for name in [*start.parents, start.name] if name in modules]
    seen = {name for name, _ in frontier}
    while frontier:
        current, chain = frontier.pop(0)
        for item in modules[current].imports:
            if not item.runs:
                continue
            reached = [*modules[item.target].parents, item.target] if item.ours else [item.target]
            for target in reached:
                if target in seen:
                    continue
                seen.add(target)
                chains[target] = [*chain, target]
                if target in modules:
                    frontier.append((target, chains[target]))
    return chains


def check(rooms: list[Room], modules: dict[str, Module]) -> dict[tuple[str, str], list[str]]:
    """Every break of the map: ``(room path, rule) -> what breaks it``."""
    owner, problems = owners(rooms, modules)
    breaks: dict[tuple[str, str], list[str]] = {}
    used: dict[int, set[str]] = {}
    if problems:
        breaks[("map", "every module in one room")] = problems
    for name, module in sorted(modules.items()):
        room = owner.get(name)
        if room is None:
            continue
        for item in module.imports:
            target_room = owner.get(item.target) if item.ours else None
            if target_room is not None and (target_room is room or target_room.inside(room)):
                continue  # its own modules, or a room nested in its directory (with stricter rules of its own)
            where = f"{module.path}:{item.line} imports {item.target}"
            for rule in room.never:
                if _covers(rule.name, item.target):
                    breaks.setdefault((room.key, f"never imports {rule.name}"), []).append(where)
            allowed = _is_stdlib(item.target) or any(_covers(rule.name, item.target) for rule in room.may)
            if not allowed:
                breaks.setdefault((room.key, "may import"), []).append(where)
            if target_room is not None and target_room.closed and not _names(room, target_room, item.target, owner):
                breaks.setdefault((target_room.key, PRODUCTION_NEVER), []).append(where)
        used.setdefault(id(room), set()).update(
            rule.name for item in module.imports for rule in room.may if _covers(rule.name, item.target)
        )
        loaded_rules = [rule for rule in room.never if rule.loads]
        if loaded_rules:
            chains = _loads(module, modules)
            own = set(module.parents)
            for rule in loaded_rules:
                hits = sorted(
                    (chain for target, chain in chains.items() if _covers(rule.name, target) and target not in own),
                    key=len,
                )
                if hits:
                    breaks.setdefault((room.key, f"never loads {rule.name}"), []).append(
                        f"{module.path}: " + " → ".join(hits[0])
                    )
    for room in rooms:
        stale = [rule.name for rule in room.may if rule.name not in used.get(id(room), set())]
        if stale and id(room) in used:
            breaks[(room.key, "may import: every name used")] = [f"nothing imports {name}" for name in stale]
    return breaks


def _names(room: Room, closed: Room, target: str, owner: dict[str, Room]) -> bool:
    """Whether ``room``'s *may import* names ``target`` by a name inside ``closed`` (not by a wider package)."""
    return any(_covers(rule.name, target) and owner.get(rule.name) is closed for rule in room.may)


def _report(breaks: dict[tuple[str, str], list[str]]) -> str:
    lines = []
    for (room, rule), what in sorted(breaks.items()):
        lines.append(f"{room} — {rule}:")
        lines.extend(f"    {line}" for line in what[:REPORT_LINES])
        if len(what) > REPORT_LINES:
            lines.append(f"    … and {len(what) - REPORT_LINES} more")
    return "\n".join(lines)


# -- cycles -----------------------------------------------------------------------------------------------------------


def graph(modules: dict[str, Module]) -> dict[str, set[str]]:
    """Module → the modules of ours it imports. A package's ``__init__`` re-exporting its own private modules is the
    one allowed way back: an edge from a private submodule to its own package is not counted."""
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, module in modules.items():
        for item in module.imports:
            if not item.ours or item.target == name:
                continue
            if name.rpartition(".")[2].startswith("_") and name.startswith(item.target + "."):
                continue
            edges[name].add(item.target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


# -- the tests --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rooms() -> list[Room]:
    return parse_map(MAP.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def modules() -> dict[str, Module]:
    return scan(repository_sources())


def test_every_module_keeps_the_rules_of_its_room(rooms: list[Room], modules: dict[str, Module]) -> None:
    breaks = check(rooms, modules)
    unknown = {key: what for key, what in breaks.items() if key not in KNOWN_BREAKS}
    mended = sorted(f"{room} — {rule}" for room, rule in KNOWN_BREAKS if (room, rule) not in breaks)
    assert not unknown, "the code breaks the map (docs/architecture.md): fix the code or the rule\n" + _report(unknown)
    assert not mended, f"mended: remove from KNOWN_BREAKS: {mended}"


def test_the_map_names_the_rooms_that_matter(rooms: list[Room], modules: dict[str, Module]) -> None:
    owner, _ = owners(rooms, modules)
    assert len(modules) > 100
    for name in (
        "sidecar.startup",
        "sidecar.dynamo._entries",
        "sidecar.testing.h2pair",
    ):
        assert owner[name].paths == [modules[name].path], f"{name} has a row of its own"


def test_no_import_cycles(modules: dict[str, Module]) -> None:
    assert cycles(graph(modules)) == []


def test_configuration_is_read_not_the_cli(modules: dict[str, Module]) -> None:
    edges = graph(modules)
    importers = sorted(name for name, targets in edges.items() if "sidecar.cli" in targets)
    # ops.guide renders the operator guide's flag tables from the parser itself.
    assert importers == ["sidecar.__main__", "sidecar.ops.guide"]


# -- the checker, on a map and code of its own ------------------------------------------------------------------------

_TOY_MAP = f"""\
{TABLE_HEADING}

| path | holds | may import | never imports |
|---|---|---|---|
| `pkg/__init__.py` | the package | — | — |
| `pkg/core/` | decisions | `pkg.pure` (its helpers, kept pure), trio, stdlib | **asyncio**, grpclib |
| `pkg/pure.py` | pure functions | `pkg.wire` | **trio** |
| `pkg/wire/` | the wire | asyncio, grpclib | {PRODUCTION_NEVER} |
| `pkg/app.py` | everything | `pkg`, trio | — |

Prose.
"""


def _toy(sources: dict[str, str], *, stale: bool = False) -> dict[tuple[str, str], list[str]]:
    """The breaks of the toy map for ``sources``; unused allowances only with ``stale`` (a toy uses few)."""
    files = {"pkg/__init__.py": "", "pkg/core/__init__.py": "", "pkg/wire/__init__.py": "", "pkg/app.py": ""}
    files["pkg/pure.py"] = ""
    breaks = check(parse_map(_TOY_MAP), scan({**files, **sources}))
    return {key: what for key, what in breaks.items() if stale or not key[1].endswith("every name used")}


def test_the_checker_passes_code_that_keeps_the_rules() -> None:
    sources = {
        "pkg/core/a.py": "from __future__ import annotations\nimport os\nimport trio\nfrom pkg import pure\n",
        "pkg/pure.py": "import json\n",
        "pkg/wire/x.py": "import asyncio\nimport grpclib\n",
        "pkg/app.py": "import trio\nfrom pkg.core import a\n",
    }
    assert _toy(sources) == {}


@pytest.mark.parametrize(
    ("sources", "expected"),
    [
        pytest.param({"pkg/core/a.py": "import httpx\n"}, {("pkg/core/", "may import")}, id="not-listed"),
        pytest.param(
            {"pkg/core/a.py": "import grpclib.client\n"},
            {("pkg/core/", "never imports grpclib"), ("pkg/core/", "may import")},
            id="never",
        ),
        pytest.param(
            {"pkg/app.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import asyncio\n"},
            {("pkg/app.py", "may import")},
            id="asyncio-only-where-listed-type-checking-counts",
        ),
        pytest.param(
            {"pkg/core/a.py": "def f() -> None:\n    import grpclib\n"},
            {("pkg/core/", "never imports grpclib"), ("pkg/core/", "may import")},
            id="an-import-in-a-function-counts",
        ),
        pytest.param(
            {"pkg/app.py": "from pkg.wire import x\n", "pkg/wire/x.py": ""},
            {("pkg/wire/", PRODUCTION_NEVER)},
            id="a-closed-room-reached-through-a-wider-name",
        ),
        pytest.param(
            {
                "pkg/core/a.py": "from pkg import pure\n",
                "pkg/pure.py": "from . import wire\n",
                "pkg/wire/__init__.py": "import asyncio\n",
            },
            {("pkg/core/", "never loads asyncio")},
            id="loaded-through-another-room",
        ),
        pytest.param(
            {"pkg/pure.py": "from .wire.x import f\n", "pkg/wire/__init__.py": "import trio\n", "pkg/wire/x.py": ""},
            {("pkg/pure.py", "never loads trio"), ("pkg/wire/", "may import")},
            id="loaded-through-a-package-init",
        ),
        pytest.param({"pkg/stray.py": ""}, {("map", "every module in one room")}, id="a-module-in-no-room"),
    ],
)
def test_the_checker_finds_each_kind_of_break(sources: dict[str, str], expected: set[tuple[str, str]]) -> None:
    assert set(_toy(sources)) == expected


def test_an_unused_allowance_is_stale() -> None:
    breaks = _toy({"pkg/app.py": "from pkg.core import a\n", "pkg/core/a.py": "import trio\n"}, stale=True)
    assert breaks[("pkg/app.py", "may import: every name used")] == ["nothing imports trio"]
    assert breaks[("pkg/core/", "may import: every name used")] == ["nothing imports pkg.pure"]


def test_a_type_checking_import_loads_nothing() -> None:
    pure = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.wire import x\n"
    assert _toy({"pkg/pure.py": pure, "pkg/wire/x.py": "import trio\n"}) == {
        ("pkg/wire/", "may import"): ["pkg/wire/x.py:1 imports trio"]
    }


def test_every_break_is_reported_with_where_and_how() -> None:
    breaks = _toy(
        {
            "pkg/core/a.py": "import httpx\nfrom pkg import pure\n",
            "pkg/pure.py": "import pkg.wire\n",
            "pkg/wire/__init__.py": "import asyncio\n",
        }
    )
    assert breaks == {
        ("pkg/core/", "may import"): ["pkg/core/a.py:1 imports httpx"],
        ("pkg/core/", "never loads asyncio"): ["pkg/core/a.py: pkg.core.a → pkg.pure → pkg.wire → asyncio"],
    }


def test_a_malformed_row_is_named() -> None:
    with pytest.raises(MapError, match=re.escape("row pkg/pure.py, may import: cannot read 'the wire'")):
        parse_map(_TOY_MAP.replace("`pkg.wire` |", "the wire, really |"))


def test_cycle_detector_sees_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
