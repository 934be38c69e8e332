"""Guided-decoding output for ``openengine-mock``: a short text that satisfies a guide, chosen by a seed.

TensorRT-LLM (xgrammar) masks the logits so that every output satisfies the guide. The mock has no logits worth
masking; it *constructs* a text in the guide's language instead, and the engine streams its tokenization followed by
EOS. What it cannot construct faithfully it refuses up front (:class:`UnsupportedGuide` → ``UNIMPLEMENTED`` before
acceptance), as TensorRT-LLM refuses a guide its backend cannot build.

Supported, per kind (``spec`` is the ``GuidedDecoding`` member's text; for ``choice`` a JSON array of strings):

* ``json_schema`` — ``type`` (one or a list of: object, array, string, number, integer, boolean, null), ``enum``,
  ``const``, ``properties``, ``required``, ``additionalProperties``, ``items``, ``minItems``, ``maxItems``,
  ``uniqueItems: false``, ``minLength``, ``maxLength``, ``pattern`` (the regex subset below), ``format`` (date-time,
  date, time, email, uuid, uri, ipv4, ipv6, hostname), ``minimum``, ``maximum``, ``exclusiveMinimum``,
  ``exclusiveMaximum``, ``multipleOf``; ``anyOf`` (its supported branches), ``oneOf`` with provably disjoint branches,
  single-element ``allOf``; local non-recursive ``$ref`` into ``$defs``/``definitions``; annotations are ignored.
  Any other keyword is refused: honouring a schema partially would produce output that fails it.
* ``json_object`` — some JSON object.
* ``regex`` — Python ``re`` syntax without lookarounds, backreferences, word boundaries, inline flags or possessive
  quantifiers; ``^``/``$`` only at the very ends. The output ``re.fullmatch``-es the pattern.
* ``ebnf_grammar`` — xgrammar/GBNF rules (``name ::= body``; string literals, character classes, rule references,
  grouping, ``|``, ``? * + {m,n}``, ``#`` comments); the start rule is ``root``. Lookahead assertions are refused.
* ``structural_tag`` — ``{"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...]}``:
  one structure, its ``begin``, a JSON instance of its schema, its ``end``. The newer ``format`` form is refused.
* ``choice`` — one of the non-empty choices (TensorRT-LLM never offers it; the mock does when told to).

Pure: no I/O; the only shared state is a cache of compiled guides. ``random.Random(seed)`` drives every choice, so a
seed always yields the same text.
"""

from __future__ import annotations

import functools
import json
import math
import random
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

__all__ = ["GUIDE_KINDS", "Guide", "UnsupportedGuide", "compile_guide", "guided_text"]

GUIDE_KINDS: Final = ("json_schema", "json_object", "regex", "ebnf_grammar", "structural_tag", "choice")
"""The ``GuidedDecoding.guide`` oneof members, as :func:`compile_guide` names them."""

_PRINTABLE: Final = "".join(chr(c) for c in range(0x20, 0x7F))
_DIGITS: Final = "0123456789"
_WORD: Final = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_"
_SPACE: Final = " "
_WORDS: Final = ("river", "stone", "lantern", "harbor", "meadow", "cedar", "ember", "willow", "falcon", "amber")
_MAX_REPEAT: Final = 1000  # a regex/grammar bound above this is refused: the text must stay short
_EXTRA_REPEATS: Final = 2  # how far past its minimum an open-ended repetition may go
_DEPTH_LIMIT: Final = 6  # grammar rule nesting before every choice takes the shortest way out
_LENGTH_BUDGET: Final = 100  # characters of grammar output before the same happens
_MAX_ITEMS: Final = 100
_MAX_COST: Final = 20_000  # bound on a regex/grammar's shortest text (in cost units, ≥ characters)
_MAX_ELEMENTS: Final = 2_000  # bound on the product of array lengths along one path of a JSON Schema
_CLASS_SAMPLE: Final = 32  # characters taken from a range outside printable ASCII
_BEYOND_ASCII: Final = "éßλж中"  # what a negated class may still offer when it excludes all of ASCII
_REPEAT: Final = re.compile(r"\{(\d*)(,?)(\d*)\}")


class UnsupportedGuide(Exception):
    """A guide the mock cannot honour (or cannot parse): refused with ``UNIMPLEMENTED`` before acceptance."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Guide:
    """A checked guide; :meth:`text` constructs one output for a seed."""

    __slots__ = ("_emit", "kind")

    def __init__(self, kind: str, emit: Callable[[random.Random], str]) -> None:
        self.kind = kind
        self._emit = emit

    def text(self, seed: int) -> str:
        """A text that satisfies the guide; the same ``seed`` always gives the same text."""
        return self._emit(random.Random(seed))

    def __repr__(self) -> str:
        return f"Guide({self.kind!r})"


def guided_text(kind: str, spec: str, *, seed: int) -> str:
    """One output for the guide ``kind``/``spec`` (see the module docstring); raises :class:`UnsupportedGuide`."""
    return compile_guide(kind, spec).text(seed)


@functools.lru_cache(maxsize=256)  # clients repeat their schemas; a Guide is immutable
def compile_guide(kind: str, spec: str) -> Guide:
    """Check ``spec`` once (every refusal happens here, none later); the result makes texts for any seed."""
    try:
        return _compile(kind, spec)
    except RecursionError:
        raise UnsupportedGuide(f"{kind}: nested too deeply") from None


def _compile(kind: str, spec: str) -> Guide:
    if kind == "json_object":
        return Guide(kind, lambda rng: _dumps(_any_object(rng)))
    if kind == "json_schema":
        generate = _SchemaCompiler(_load_json(spec, kind)).root()
        return Guide(kind, lambda rng: _dumps(generate(rng)))
    if kind == "regex":
        return Guide(kind, _regex(spec).text)
    if kind == "ebnf_grammar":
        return Guide(kind, _Grammar(spec).text)
    if kind == "structural_tag":
        return Guide(kind, _structural_tag(_load_json(spec, kind)))
    if kind == "choice":
        return Guide(kind, _choice(spec))
    raise UnsupportedGuide(f"unknown guide kind {kind!r}")


def _load_json(spec: str, kind: str) -> Any:
    try:
        return json.loads(spec)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise UnsupportedGuide(f"{kind} is not valid JSON: {exc}") from None


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _choice(spec: str) -> Callable[[random.Random], str]:
    choices = _load_json(spec, "choice")
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise UnsupportedGuide("choice must be a JSON array of strings")
    options = [c for c in choices if c]
    if not options:
        raise UnsupportedGuide("choice needs at least one non-empty choice")
    return lambda rng: rng.choice(options)


def _any_scalar(rng: random.Random) -> Any:
    pick = rng.randrange(4)
    if pick == 0:
        return rng.choice(_WORDS)
    if pick == 1:
        return rng.randint(0, 100)
    if pick == 2:
        return rng.random() < 0.5
    return round(rng.uniform(0, 100), 2)


def _any_object(rng: random.Random) -> dict[str, Any]:
    keys = rng.sample(_WORDS, rng.randint(1, 3))
    return {key: _any_scalar(rng) for key in keys}


# -- regular expressions and grammars: one tree, one generator ----------------------------------------------------


class _Node:
    """A piece of a regular expression or grammar rule. ``cost`` bounds the shortest text it can make."""

    __slots__ = ()

    def emit(self, g: _Gen, depth: int) -> None:
        raise NotImplementedError

    def cost(self, rules: Mapping[str, float]) -> float:
        raise NotImplementedError


class _Lit(_Node):
    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def emit(self, g: _Gen, depth: int) -> None:
        g.put(self.text)

    def cost(self, rules: Mapping[str, float]) -> float:
        return 1.0 + len(self.text)


class _Chars(_Node):
    __slots__ = ("chars",)

    def __init__(self, chars: str) -> None:
        self.chars = chars

    def emit(self, g: _Gen, depth: int) -> None:
        g.put(g.rng.choice(self.chars))

    def cost(self, rules: Mapping[str, float]) -> float:
        return 2.0


class _Seq(_Node):
    __slots__ = ("items",)

    def __init__(self, items: Sequence[_Node]) -> None:
        self.items = tuple(items)

    def emit(self, g: _Gen, depth: int) -> None:
        for item in self.items:
            item.emit(g, depth)

    def cost(self, rules: Mapping[str, float]) -> float:
        return 1.0 + math.fsum(item.cost(rules) for item in self.items)


class _Alt(_Node):
    __slots__ = ("options",)

    def __init__(self, options: Sequence[_Node]) -> None:
        self.options = tuple(options)

    def emit(self, g: _Gen, depth: int) -> None:
        costs = [g.cost(option) for option in self.options]
        if g.minimal(depth):
            best = min(costs)
            option = self.options[costs.index(best)]
        else:  # never an option with no finite text: it would not end
            option = g.rng.choice([o for o, c in zip(self.options, costs, strict=True) if math.isfinite(c)])
        option.emit(g, depth)

    def cost(self, rules: Mapping[str, float]) -> float:
        return 1.0 + min(option.cost(rules) for option in self.options)


class _Rep(_Node):
    __slots__ = ("hi", "lo", "node")

    def __init__(self, node: _Node, lo: int, hi: int | None) -> None:
        self.node, self.lo, self.hi = node, lo, hi

    def emit(self, g: _Gen, depth: int) -> None:
        count = self.lo
        if not g.minimal(depth) and math.isfinite(g.cost(self.node)):
            top = self.lo + _EXTRA_REPEATS + (1 if self.lo == 0 else 0)
            count = g.rng.randint(self.lo, top if self.hi is None else min(self.hi, top))
        for _ in range(count):
            self.node.emit(g, depth)

    def cost(self, rules: Mapping[str, float]) -> float:
        return 1.0 + (self.lo * self.node.cost(rules) if self.lo else 0.0)


class _Ref(_Node):
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def emit(self, g: _Gen, depth: int) -> None:
        g.rules[self.name].emit(g, depth + 1)

    def cost(self, rules: Mapping[str, float]) -> float:
        return 1.0 + rules[self.name]


class _Gen:
    """One generation's state: the random source, the rules and their costs, the text so far."""

    __slots__ = ("costs", "memo", "parts", "rng", "rules", "size")

    def __init__(
        self, rng: random.Random, rules: Mapping[str, _Node], costs: Mapping[str, float], memo: dict[int, float]
    ) -> None:
        self.rng, self.rules, self.costs, self.memo = rng, rules, costs, memo
        self.parts: list[str] = []
        self.size = 0

    def put(self, text: str) -> None:
        self.parts.append(text)
        self.size += len(text)

    def cost(self, node: _Node) -> float:
        """``node.cost`` under the final rule costs, computed once per node of the tree."""
        cost = self.memo.get(id(node))
        if cost is None:
            cost = self.memo[id(node)] = node.cost(self.costs)
        return cost

    def minimal(self, depth: int) -> bool:
        """Past the depth or length budget every choice takes its cheapest way out, so generation always ends."""
        return depth > _DEPTH_LIMIT or self.size > _LENGTH_BUDGET


def _rule_costs(rules: Mapping[str, _Node]) -> dict[str, float]:
    """Fixed point of each rule's cheapest text (every step costs ≥ 1, so following the cheapest choice ends)."""
    costs = dict.fromkeys(rules, math.inf)
    changed = True
    while changed:
        changed = False
        for name, body in rules.items():
            cost = body.cost(costs)
            if cost < costs[name]:
                costs[name] = cost
                changed = True
    return costs


class _Tree:
    """A parsed regular expression or grammar: ``text(rng)`` emits one member of its language."""

    def __init__(self, root: _Node, rules: Mapping[str, _Node], what: str) -> None:
        self.root = root
        self.rules = dict(rules)
        self.costs = _rule_costs(self.rules)
        self.memo: dict[int, float] = {}  # node id → cost; the tree keeps its nodes alive
        shortest = root.cost(self.costs)
        if not math.isfinite(shortest):
            raise UnsupportedGuide(f"{what}: the root rule has no finite derivation")
        if shortest > _MAX_COST:  # nested bounds multiply: (a{1000}){1000} is a million characters
            raise UnsupportedGuide(f"{what}: the shortest text it accepts is too long for openengine-mock")

    def text(self, rng: random.Random) -> str:
        g = _Gen(rng, self.rules, self.costs, self.memo)
        self.root.emit(g, 0)
        return "".join(g.parts)


def _complement(chars: str) -> str:
    return "".join(c for c in _PRINTABLE if c not in chars)


_CLASS_ESCAPES: Final = {
    "d": _DIGITS,
    "w": _WORD,
    "s": _SPACE,
    "D": _complement(_DIGITS),
    "W": _complement(_WORD),
    "S": _complement(_SPACE),
}
_CONTROL_ESCAPES: Final = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a"}
_HEX_ESCAPES: Final = {"x": 2, "u": 4, "U": 8}


class _Scanner:
    """Shared by the regex and grammar parsers: position, errors and the escapes both languages spell alike."""

    def __init__(self, text: str, what: str) -> None:
        self.s = text
        self.i = 0
        self.what = what

    def fail(self, message: str) -> UnsupportedGuide:
        return UnsupportedGuide(f"{self.what}: {message} (at offset {self.i})")

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.s[j] if j < len(self.s) else ""

    def escaped_char(self) -> str:
        """After a backslash: a control, hex/unicode or quoted character (the caller handled classes)."""
        c = self.peek()
        if not c:
            raise self.fail("a trailing backslash")
        self.i += 1
        if c in _CONTROL_ESCAPES:
            return _CONTROL_ESCAPES[c]
        if c in _HEX_ESCAPES:
            width = _HEX_ESCAPES[c]
            digits = self.s[self.i : self.i + width]
            if len(digits) != width or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.fail(f"a malformed \\{c} escape")
            self.i += width
            code = int(digits, 16)
            if 0xD800 <= code <= 0xDFFF or code > 0x10FFFF:
                raise self.fail("a surrogate or out-of-range code point")
            return chr(code)
        if c.isdigit():
            raise self.fail("backreferences and octal escapes are not supported")
        if c in "bBAZzG":
            raise self.fail(f"the anchor \\{c} is not supported")
        if c.isalnum():
            raise self.fail(f"the escape \\{c} is not supported")
        return c

    def char_class(self) -> str:
        """``[...]`` after the ``[``: the characters the output may use (printable ASCII first)."""
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            c = self.peek()
            if not c:
                raise self.fail("an unterminated character class")
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            if c == "[" and self.peek(1) in ":=.":
                raise self.fail("POSIX classes are not supported")
            if c == "\\" and self.peek(1) in _CLASS_ESCAPES:
                ranges.extend((ord(ch), ord(ch)) for ch in _CLASS_ESCAPES[self.peek(1)])
                self.i += 2
                continue
            low = self._class_char()
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.i += 1
                if self.peek() == "\\" and self.peek(1) in _CLASS_ESCAPES:
                    raise self.fail("a range ending in a class escape")
                high = self._class_char()
                if ord(high) < ord(low):
                    raise self.fail("a reversed range")
                ranges.append((ord(low), ord(high)))
            else:
                ranges.append((ord(low), ord(low)))

        def inside(code: int) -> bool:
            return any(lo <= code <= hi for lo, hi in ranges)

        if negated:
            chars = "".join(c for c in _PRINTABLE + _BEYOND_ASCII if not inside(ord(c)))
        else:
            chars = "".join(c for c in _PRINTABLE if inside(ord(c)))
            for lo, hi in ranges:  # a class with nothing printable (\n, CJK, ...) still has members
                if hi < 0x20 or lo >= 0x7F:
                    chars += "".join(
                        chr(code) for code in range(lo, min(hi, lo + _CLASS_SAMPLE) + 1) if not 0xD800 <= code <= 0xDFFF
                    )
        if not chars:
            raise self.fail("a character class with no usable member")
        return chars

    def _class_char(self) -> str:
        c = self.peek()
        self.i += 1
        if c == "\\":
            if self.peek() == "b":  # inside a class, \b is a backspace
                self.i += 1
                return "\b"
            return self.escaped_char()
        return c

    def repeat_bounds(self) -> tuple[int, int | None] | None:
        """``{m}``, ``{m,}``, ``{,n}``, ``{m,n}``, ``{,}`` at the current ``{`` (as Python's ``re`` reads them), or
        None when it is not a quantifier (then ``{`` is a literal)."""
        match = _REPEAT.match(self.s, self.i)
        if match is None or match.group() == "{}":
            return None
        lo = int(match.group(1) or 0)
        hi = int(match.group(3)) if match.group(3) else (None if match.group(2) else lo)
        if hi is not None and hi < lo:
            raise self.fail("a repetition with max < min")
        if lo > _MAX_REPEAT or (hi is not None and hi > _MAX_REPEAT):
            raise self.fail(f"a repetition bound above {_MAX_REPEAT}")
        self.i = match.end()
        return lo, hi


class _RegexParser(_Scanner):
    """Python ``re`` syntax (the supported subset) → a :class:`_Node` tree."""

    def parse(self) -> _Node:
        node = self.alternation()
        if self.i < len(self.s):
            raise self.fail("an unbalanced ')'")
        return node

    def alternation(self) -> _Node:
        options = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            options.append(self.sequence())
        return options[0] if len(options) == 1 else _Alt(options)

    def sequence(self) -> _Node:
        items: list[_Node] = []
        while self.peek() and self.peek() not in "|)":
            atom = self.atom()
            if atom is not None:
                items.append(self.quantified(atom))
        return items[0] if len(items) == 1 else _Seq(items)

    def atom(self) -> _Node | None:
        c = self.peek()
        start = self.i
        self.i += 1
        if c == "(":
            if self.peek() == "?":
                self._group_prefix()
            node = self.alternation()
            if self.peek() != ")":
                raise self.fail("an unbalanced '('")
            self.i += 1
            return node
        if c == "[":
            return _Chars(self.char_class())
        if c == ".":
            return _Chars(_PRINTABLE)
        if c == "^":
            if start != 0:
                raise self.fail("'^' is supported only at the start of the pattern")
            return None
        if c == "$":
            if self.i != len(self.s):
                raise self.fail("'$' is supported only at the end of the pattern")
            return None
        if c == "\\":
            if self.peek() in _CLASS_ESCAPES:
                self.i += 1
                return _Chars(_CLASS_ESCAPES[self.s[self.i - 1]])
            return _Lit(self.escaped_char())
        if c in "*+?":
            raise self.fail("nothing to repeat")
        return _Lit(c)

    def _group_prefix(self) -> None:
        rest = self.s[self.i :]
        if rest.startswith("?:"):
            self.i += 2
            return
        named = re.compile(r"\?P<[A-Za-z_][A-Za-z0-9_]*>").match(rest)
        if named is not None:
            self.i += named.end()
            return
        if rest[:2] in ("?=", "?!") or rest[:3] in ("?<=", "?<!"):
            raise self.fail("lookaround assertions are not supported")
        raise self.fail(f"the group syntax '({rest[:3]}' is not supported")

    def quantified(self, atom: _Node) -> _Node:
        node = atom
        while True:
            c = self.peek()
            if c == "?":
                self.i += 1
                node = _Rep(node, 0, 1)
            elif c == "*":
                self.i += 1
                node = _Rep(node, 0, None)
            elif c == "+":
                self.i += 1
                node = _Rep(node, 1, None)
            elif c == "{":
                bounds = self.repeat_bounds()
                if bounds is None:
                    return node  # a literal '{', as Python reads it
                node = _Rep(node, *bounds)
            else:
                return node
            if self.peek() == "?":  # lazy: the same language
                self.i += 1
            elif self.peek() == "+":
                raise self.fail("possessive quantifiers are not supported")
            if self.peek() in ("*", "+", "?") or (self.peek() == "{" and self.repeat_bounds() is not None):
                raise self.fail("a repeated quantifier")


def _regex(pattern: str) -> _Tree:
    try:
        re.compile(pattern)
    except re.error as exc:
        raise UnsupportedGuide(f"regex: invalid pattern: {exc}") from None
    except RecursionError:
        raise UnsupportedGuide("regex: the pattern is nested too deeply") from None
    return _Tree(_RegexParser(pattern, "regex").parse(), {}, "regex")


_RULE_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_DEFINES: Final = re.compile(r"\s*::=")


class _Grammar(_Tree, _Scanner):
    """xgrammar's EBNF (GBNF): ``name ::= alternatives``; the start rule is ``root``."""

    def __init__(self, text: str) -> None:
        _Scanner.__init__(self, text, "ebnf_grammar")
        rules: dict[str, _Node] = {}
        self._space()
        while self.i < len(self.s):
            name = self._rule_head()
            if name is None:
                raise self.fail("expected a rule 'name ::= ...'")
            if name in rules:
                raise self.fail(f"rule {name!r} is defined twice")
            rules[name] = self._alternation()
            self._space()
        if "root" not in rules:
            raise UnsupportedGuide("ebnf_grammar: no 'root' rule")
        for body in rules.values():
            self._check_refs(body, rules)
        _Tree.__init__(self, _Ref("root"), rules, "ebnf_grammar")

    def _check_refs(self, node: _Node, rules: Mapping[str, _Node]) -> None:
        if isinstance(node, _Ref) and node.name not in rules:
            raise UnsupportedGuide(f"ebnf_grammar: rule {node.name!r} is not defined")
        children: Sequence[_Node] = ()
        if isinstance(node, _Seq):
            children = node.items
        elif isinstance(node, _Alt):
            children = node.options
        elif isinstance(node, _Rep):
            children = (node.node,)
        for child in children:
            self._check_refs(child, rules)

    def _space(self) -> None:
        while self.i < len(self.s):
            c = self.s[self.i]
            if c == "#":
                end = self.s.find("\n", self.i)
                self.i = len(self.s) if end < 0 else end + 1
            elif c.isspace():
                self.i += 1
            else:
                return

    def _rule_head(self) -> str | None:
        """``name ::=`` at the cursor: consume it and return the name (None, cursor unmoved, otherwise)."""
        match = _RULE_NAME.match(self.s, self.i)
        if match is None:
            return None
        defines = _DEFINES.match(self.s, match.end())
        if defines is None:
            return None
        self.i = defines.end()
        return match.group()

    def _alternation(self) -> _Node:
        options = [self._sequence()]
        while True:
            self._space()
            if self.peek() != "|":
                break
            self.i += 1
            options.append(self._sequence())
        return options[0] if len(options) == 1 else _Alt(options)

    def _sequence(self) -> _Node:
        items: list[_Node] = []
        while True:
            self._space()
            c = self.peek()
            if not c or c in "|)":
                break
            mark = self.i
            if self._rule_head() is not None:  # the next rule starts: this body is over
                self.i = mark
                break
            items.append(self._quantified(self._atom()))
        return items[0] if len(items) == 1 else _Seq(items)

    def _atom(self) -> _Node:
        c = self.peek()
        if c == '"':
            self.i += 1
            chars: list[str] = []
            while self.peek() != '"':
                if not self.peek():
                    raise self.fail("an unterminated string literal")
                if self.peek() == "\\":
                    self.i += 1
                    chars.append(self.escaped_char())
                else:
                    chars.append(self.peek())
                    self.i += 1
            self.i += 1
            return _Lit("".join(chars))
        if c == "[":
            self.i += 1
            return _Chars(self.char_class())
        if c == "(":
            self.i += 1
            self._space()
            if self.peek() == "=":
                raise self.fail("lookahead assertions are not supported")
            node = self._alternation()
            self._space()
            if self.peek() != ")":
                raise self.fail("an unbalanced '('")
            self.i += 1
            return node
        match = _RULE_NAME.match(self.s, self.i)
        if match is not None:
            self.i = match.end()
            return _Ref(match.group())
        raise self.fail(f"unexpected {c!r}")

    def _quantified(self, atom: _Node) -> _Node:
        node = atom
        while True:
            c = self.peek()
            if c == "?":
                node = _Rep(node, 0, 1)
            elif c == "*":
                node = _Rep(node, 0, None)
            elif c == "+":
                node = _Rep(node, 1, None)
            elif c == "{":
                bounds = self.repeat_bounds()
                if bounds is None:
                    raise self.fail("a malformed repetition")
                node = _Rep(node, *bounds)
                continue
            else:
                return node
            self.i += 1


# -- JSON Schema ----------------------------------------------------------------------------------------------------

_Make = Callable[[random.Random], Any]

_ANNOTATIONS: Final = frozenset(
    {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly", "writeOnly"}
)
_CONTAINERS: Final = frozenset({"$defs", "definitions"})
_OBJECT_KEYWORDS: Final = frozenset({"properties", "required", "additionalProperties"})
_ARRAY_KEYWORDS: Final = frozenset({"items", "minItems", "maxItems", "uniqueItems"})
_STRING_KEYWORDS: Final = frozenset({"minLength", "maxLength", "pattern", "format"})
_NUMBER_KEYWORDS: Final = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
_VALUE_KEYWORDS: Final = frozenset({"enum", "const"})
_COMBINATORS: Final = frozenset({"anyOf", "oneOf", "allOf", "$ref"})
_TYPED: Final = _OBJECT_KEYWORDS | _ARRAY_KEYWORDS | _STRING_KEYWORDS | _NUMBER_KEYWORDS
_KNOWN: Final = _ANNOTATIONS | _CONTAINERS | _TYPED | _VALUE_KEYWORDS | _COMBINATORS | {"type"}
_TYPES: Final = ("object", "array", "string", "number", "integer", "boolean", "null")
_DEFAULT_SPAN: Final = 100  # an unbounded number side gets this much room


def _json_type(value: Any) -> str:
    """The JSON Schema type of a JSON value, ``integer`` folded into ``number`` (``1.0`` is both)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _has_type(value: Any, type_name: str) -> bool:
    if type_name == "integer":
        return isinstance(value, int | float) and not isinstance(value, bool) and float(value).is_integer()
    return _json_type(value) == type_name


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _multiple_ok(value: float, step: Any) -> bool:
    """``multipleOf`` exactly as the reference validator (``jsonschema``) decides it, float quirks included."""
    if isinstance(step, float):
        quotient = value / step
        return math.isfinite(quotient) and int(quotient) == quotient
    return not value % step


def _format_value(name: str, rng: random.Random) -> str:
    word = rng.choice(_WORDS)
    if name == "date-time":
        return f"{_format_value('date', rng)}T{_format_value('time', rng)}"
    if name == "date":
        return f"{rng.randint(2000, 2030):04d}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if name == "time":
        return f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}Z"
    if name == "email":
        return f"{word}{rng.randint(1, 99)}@example.com"
    if name == "uuid":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    if name == "uri":
        return f"https://example.com/{word}"
    if name == "ipv4":
        return ".".join(str(rng.randint(1, 254)) for _ in range(4))
    if name == "ipv6":
        return f"2001:db8::{rng.randint(1, 0xFFFF):x}"
    return f"{word}.example.com"  # hostname


_FORMATS: Final = frozenset({"date-time", "date", "time", "email", "uuid", "uri", "ipv4", "ipv6", "hostname"})


class _SchemaCompiler:
    """A JSON Schema → a function of a ``random.Random`` returning a valid instance (refusals all happen here)."""

    def __init__(self, schema: Any) -> None:
        self._root = schema
        self._resolving: list[str] = []
        self._weight = 1  # how many times the schema being compiled may be instantiated (nested arrays multiply)

    def root(self) -> _Make:
        return self.compile(self._root, "#")

    def fail(self, path: str, message: str) -> UnsupportedGuide:
        return UnsupportedGuide(f"json_schema at {path}: {message}")

    def compile(self, schema: Any, path: str) -> _Make:
        if schema is True:
            return _any_scalar
        if not isinstance(schema, dict):
            raise self.fail(path, "a schema must be an object or true")
        unknown = sorted(set(schema) - _KNOWN)
        if unknown:
            raise self.fail(path, f"keyword {unknown[0]!r} is not supported")
        constraints = set(schema) - _ANNOTATIONS - _CONTAINERS
        if constraints & _COMBINATORS:
            if len(constraints) != 1:
                raise self.fail(path, f"{' '.join(sorted(constraints))}: combine anyOf/oneOf/allOf/$ref with nothing")
            (keyword,) = constraints
            return self._combinator(keyword, schema[keyword], path)
        types = self._types(schema, path)
        if constraints & _VALUE_KEYWORDS:
            return self._values(schema, types, constraints, path)
        if not types:
            return _any_scalar
        makers = [self._typed(t, schema, path) for t in types]
        return makers[0] if len(makers) == 1 else (lambda rng: rng.choice(makers)(rng))

    def _types(self, schema: Mapping[str, Any], path: str) -> list[str]:
        """The declared types; without ``type``, the type the present keywords constrain (they bind no other)."""
        declared = schema.get("type")
        if declared is None:
            present = set(schema)
            for name, keywords in (
                ("object", _OBJECT_KEYWORDS),
                ("array", _ARRAY_KEYWORDS),
                ("string", _STRING_KEYWORDS),
                ("number", _NUMBER_KEYWORDS),
            ):
                if present & keywords:
                    return [name]
            return []
        names = declared if isinstance(declared, list) else [declared]
        if not names or not all(isinstance(n, str) and n in _TYPES for n in names) or len(set(names)) != len(names):
            raise self.fail(path, f"type must be one of {', '.join(_TYPES)} or a list of them, got {declared!r}")
        return list(names)

    def _values(self, schema: Mapping[str, Any], types: list[str], constraints: set[str], path: str) -> _Make:
        if constraints - _VALUE_KEYWORDS - {"type"}:
            raise self.fail(path, "enum/const combined with other constraints is not supported")
        if "const" in schema:
            values = [schema["const"]]
            if "enum" in schema and schema["const"] not in (schema["enum"] or []):
                values = []
        else:
            enum = schema["enum"]
            if not isinstance(enum, list):
                raise self.fail(path, "enum must be an array")
            values = list(enum)
        if types:
            values = [v for v in values if any(_has_type(v, t) for t in types)]
        if not values:
            raise self.fail(path, "no value satisfies enum/const and type")
        return lambda rng: rng.choice(values)

    def _combinator(self, keyword: str, value: Any, path: str) -> _Make:
        if keyword == "$ref":
            return self._ref(value, path)
        if not isinstance(value, list) or not value:
            raise self.fail(path, f"{keyword} must be a non-empty array")
        if keyword == "allOf":
            if len(value) != 1:
                raise self.fail(path, "allOf with more than one schema is not supported")
            return self.compile(value[0], f"{path}/allOf/0")
        branches: list[_Make] = []
        refusal: UnsupportedGuide | None = None
        for i, branch in enumerate(value):
            try:
                branches.append(self.compile(branch, f"{path}/{keyword}/{i}"))
            except UnsupportedGuide as exc:
                if keyword == "oneOf":
                    raise
                refusal = exc  # anyOf: any one satisfiable branch is enough
        if not branches:
            assert refusal is not None
            raise refusal
        if keyword == "oneOf":
            self._check_disjoint(value, path)
        return lambda rng: rng.choice(branches)(rng)

    def _check_disjoint(self, branches: list[Any], path: str) -> None:
        """``oneOf`` needs the instance to match exactly one branch: honoured only when no two can share one."""
        kinds = [self._kind(branch) for branch in branches]
        for i, a in enumerate(kinds):
            for b in kinds[i + 1 :]:
                if a is None or b is None or _overlap(a, b):
                    raise self.fail(path, "oneOf with branches that may overlap is not supported")

    def _kind(self, schema: Any, seen: tuple[str, ...] = ()) -> tuple[str, frozenset[str]] | None:
        """What a branch can match: ``("values", JSON texts)`` or ``("types", JSON types)``; None = unknown."""
        if not isinstance(schema, dict):
            return None
        if set(schema) - _ANNOTATIONS - _CONTAINERS == {"$ref"}:
            ref = schema["$ref"]
            return None if ref in seen else self._kind(self._resolve(ref, "#"), (*seen, ref))
        if "const" in schema:
            return "values", frozenset({_dumps(schema["const"])})
        if isinstance(schema.get("enum"), list):
            return "values", frozenset(_dumps(v) for v in schema["enum"])
        declared = schema.get("type")
        names = declared if isinstance(declared, list) else [declared] if declared is not None else []
        if not names:
            return None
        return "types", frozenset("number" if n == "integer" else str(n) for n in names)

    def _resolve(self, ref: Any, path: str) -> Any:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise self.fail(path, f"only local $ref ('#/...') is supported, got {ref!r}")
        node: Any = self._root
        for raw in ref[2:].split("/") if ref != "#" else []:
            part = raw.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdecimal() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise self.fail(path, f"$ref {ref!r} points nowhere")
        return node

    def _ref(self, ref: Any, path: str) -> _Make:
        target = self._resolve(ref, path)
        assert isinstance(ref, str)
        if ref in self._resolving:
            raise self.fail(path, f"recursive $ref {ref!r} is not supported")
        self._resolving.append(ref)
        try:
            return self.compile(target, ref)
        finally:
            self._resolving.pop()

    def _typed(self, type_name: str, schema: Mapping[str, Any], path: str) -> _Make:
        if type_name == "object":
            return self._object(schema, path)
        if type_name == "array":
            return self._array(schema, path)
        if type_name == "string":
            return self._string(schema, path)
        if type_name in ("number", "integer"):
            return self._number(schema, path, integer=type_name == "integer")
        if type_name == "boolean":
            return lambda rng: rng.random() < 0.5
        return lambda rng: None

    def _object(self, schema: Mapping[str, Any], path: str) -> _Make:
        properties = schema.get("properties", {})
        if not isinstance(properties, dict):
            raise self.fail(path, "properties must be an object")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise self.fail(path, "required must be an array of strings")
        additional = schema.get("additionalProperties", True)
        if not isinstance(additional, bool | dict):
            raise self.fail(path, "additionalProperties must be a boolean or a schema")
        makers = {name: self.compile(sub, f"{path}/properties/{name}") for name, sub in properties.items()}
        needed = set(required)
        extra: dict[str, _Make] = {}
        for name in dict.fromkeys(required):
            if name in makers:
                continue
            if additional is False:
                raise self.fail(path, f"required {name!r} is neither a property nor allowed as an additional one")
            extra[name] = self.compile(additional, f"{path}/additionalProperties")

        def make(rng: random.Random) -> dict[str, Any]:
            out = {name: make(rng) for name, make in makers.items() if name in needed or rng.random() < 0.5}
            out.update((name, make(rng)) for name, make in extra.items())
            return out

        return make

    def _array(self, schema: Mapping[str, Any], path: str) -> _Make:
        if schema.get("uniqueItems", False) is not False:
            raise self.fail(path, "uniqueItems is not supported")
        lo = self._count(schema, "minItems", path) or 0
        hi = self._count(schema, "maxItems", path)
        if hi is not None and hi < lo:
            raise self.fail(path, "maxItems < minItems")
        if lo > _MAX_ITEMS:
            raise self.fail(path, f"minItems above {_MAX_ITEMS}")
        items = schema.get("items", True)
        if items is False:
            if lo > 0:
                raise self.fail(path, "items: false with minItems > 0")
            return lambda rng: []
        top = max(lo, 1) + _EXTRA_REPEATS
        top = top if hi is None else min(hi, top)
        outer = self._weight
        self._weight = outer * max(top, 1)
        if self._weight > _MAX_ELEMENTS:
            raise self.fail(path, "nested arrays too long for openengine-mock")
        try:
            make = self.compile(items, f"{path}/items")
        finally:
            self._weight = outer
        return lambda rng: [make(rng) for _ in range(rng.randint(lo, top))]

    def _count(self, schema: Mapping[str, Any], key: str, path: str) -> int | None:
        value = schema.get(key)
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise self.fail(path, f"{key} must be a non-negative integer")
        return value

    def _string(self, schema: Mapping[str, Any], path: str) -> _Make:
        lo = self._count(schema, "minLength", path) or 0
        hi = self._count(schema, "maxLength", path)
        if hi is not None and hi < lo:
            raise self.fail(path, "maxLength < minLength")
        pattern, fmt = schema.get("pattern"), schema.get("format")
        if pattern is not None and fmt is not None:
            raise self.fail(path, "pattern together with format is not supported")
        if pattern is None and fmt is None:
            if lo > _LENGTH_BUDGET * 4:
                raise self.fail(path, "minLength is too large")
            return lambda rng: _words_of_length(rng, lo, hi)
        base = self._pattern(pattern, path) if pattern is not None else self._format(fmt, path)
        if lo == 0 and hi is None:
            return base

        def fits(text: str) -> bool:
            return lo <= len(text) and (hi is None or len(text) <= hi)

        # A length limit on a pattern/format is met by search: found now, or refused now (never a late failure).
        fallback = next((t for t in (base(random.Random(k)) for k in range(64)) if fits(t)), None)
        if fallback is None:
            raise self.fail(path, "no string found that meets both the pattern/format and the length limits")
        found: str = fallback

        def make(rng: random.Random) -> str:
            for _ in range(8):
                text = str(base(rng))
                if fits(text):
                    return text
            return found

        return make

    def _pattern(self, pattern: Any, path: str) -> _Make:
        if not isinstance(pattern, str):
            raise self.fail(path, "pattern must be a string")
        try:
            return _regex(pattern).text  # fullmatch output also passes JSON Schema's unanchored search
        except UnsupportedGuide as exc:
            raise self.fail(path, exc.message) from None

    def _format(self, fmt: Any, path: str) -> _Make:
        if fmt not in _FORMATS:
            raise self.fail(path, f"format {fmt!r} is not supported")
        name = str(fmt)
        return lambda rng: _format_value(name, rng)

    def _number(self, schema: Mapping[str, Any], path: str, *, integer: bool) -> _Make:
        bounds: dict[str, float] = {}
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"):
            if key in schema:
                value = schema[key]
                if not _is_number(value):
                    raise self.fail(path, f"{key} must be a number")
                bounds[key] = value
        lows = [(bounds["minimum"], False)] if "minimum" in bounds else []
        lows += [(bounds["exclusiveMinimum"], True)] if "exclusiveMinimum" in bounds else []
        highs = [(bounds["maximum"], False)] if "maximum" in bounds else []
        highs += [(bounds["exclusiveMaximum"], True)] if "exclusiveMaximum" in bounds else []
        low = max(lows, key=lambda b: (b[0], b[1])) if lows else None
        high = min(highs, key=lambda b: (b[0], not b[1])) if highs else None

        def inside(v: float) -> bool:
            if low is not None and (v < low[0] or (low[1] and v == low[0])):
                return False
            return not (high is not None and (v > high[0] or (high[1] and v == high[0])))

        lo = low[0] if low is not None else (high[0] - _DEFAULT_SPAN if high is not None else 0)
        hi = high[0] if high is not None else lo + _DEFAULT_SPAN
        step = bounds.get("multipleOf")
        candidates: list[float]
        if step is not None:
            if step <= 0:
                raise self.fail(path, "multipleOf must be > 0")
            first = math.ceil(lo / step)
            candidates = []
            for k in range(first, min(math.floor(hi / step), first + 200) + 1):
                v: float = k * step
                if integer:
                    if not float(v).is_integer():
                        continue
                    v = int(v)
                if inside(v) and _multiple_ok(v, step):
                    candidates.append(v)
            if not candidates:
                raise self.fail(path, "no number in range is a multipleOf")
            return lambda rng: rng.choice(candidates)
        if integer:
            ilo, ihi = math.ceil(lo), math.floor(hi)
            ilo += 1 if low is not None and low[1] and ilo == low[0] else 0
            ihi -= 1 if high is not None and high[1] and ihi == high[0] else 0
            if ilo > ihi:
                raise self.fail(path, "no integer in range")
            return lambda rng: rng.randint(ilo, ihi)
        middle = lo + (hi - lo) / 2
        if not inside(middle):
            raise self.fail(path, "no number in range")

        def make(rng: random.Random) -> float:
            v = round(rng.uniform(lo, hi), 2)
            return v if inside(v) else middle

        return make


def _overlap(a: tuple[str, frozenset[str]], b: tuple[str, frozenset[str]]) -> bool:
    if a[0] == b[0]:
        return bool(a[1] & b[1])
    values, types = (a, b) if a[0] == "values" else (b, a)
    return any(_json_type(json.loads(v)) in types[1] for v in values[1])


def _words_of_length(rng: random.Random, lo: int, hi: int | None) -> str:
    if lo == 0 and hi is None:
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 2)))
    top = lo + 12 if hi is None else min(hi, lo + 12)
    length = rng.randint(lo, top)
    text = ""
    while len(text) < length:
        text += (" " if text else "") + rng.choice(_WORDS)
    text = text[:length]
    return text[:-1] + "a" if text.endswith(" ") else text


# -- structural tags ------------------------------------------------------------------------------------------------


def _structural_tag(spec: Any) -> Callable[[random.Random], str]:
    if not isinstance(spec, dict):
        raise UnsupportedGuide("structural_tag must be a JSON object")
    if "format" in spec:
        raise UnsupportedGuide("structural_tag: the 'format' form is not supported (use structures + triggers)")
    if spec.get("type", "structural_tag") != "structural_tag":
        raise UnsupportedGuide(f"structural_tag: unknown type {spec.get('type')!r}")
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise UnsupportedGuide("structural_tag: structures must be a non-empty array")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise UnsupportedGuide("structural_tag: triggers must be a non-empty array of strings")
    tags: list[tuple[str, _Make, str]] = []
    for i, structure in enumerate(structures):
        if not isinstance(structure, dict):
            raise UnsupportedGuide(f"structural_tag: structures[{i}] must be an object")
        begin, end = structure.get("begin"), structure.get("end")
        if not isinstance(begin, str) or not isinstance(end, str):
            raise UnsupportedGuide(f"structural_tag: structures[{i}] needs string begin and end")
        if not any(begin.startswith(t) for t in triggers):
            raise UnsupportedGuide(f"structural_tag: structures[{i}].begin starts with no trigger")
        if "schema" not in structure:
            raise UnsupportedGuide(f"structural_tag: structures[{i}] needs a schema")
        schema = structure["schema"]
        tags.append((begin, _SchemaCompiler(schema).root(), end))

    def emit(rng: random.Random) -> str:
        begin, make, end = rng.choice(tags)
        return begin + _dumps(make(rng)) + end

    return emit
