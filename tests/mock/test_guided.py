"""Guided decoding in ``openengine-mock``: every output satisfies its guide; what the mock cannot honour is refused.

Property tests over generated guides of the supported subset (``sidecar/testing/mock/guided.py``): JSON Schema
outputs validate with ``jsonschema``, regex outputs ``re.fullmatch``, grammar outputs are in the grammar's language,
choices come from the list. Then the same through the mock process over gRPC.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
from grpclib.const import Status
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openengine.v1 import generation_pb2
from sidecar.testing.mock.guided import GUIDE_KINDS, UnsupportedGuide, compile_guide, guided_text

from ._client import call, generate, make_request
from .conftest import StartMock

SEEDS = range(6)
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _validator(schema: Any) -> Any:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    cls.check_schema(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


# -- JSON Schema --------------------------------------------------------------------------------------------------

_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-1000, 1000),
    st.floats(-1000, 1000, allow_nan=False).map(lambda x: round(x, 3)),
    st.text(max_size=6),
)


@st.composite
def _string_schema(draw: st.DrawFn) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    kind = draw(st.sampled_from(["plain", "length", "pattern", "format"]))
    if kind == "length":
        lo = draw(st.integers(0, 20))
        schema["minLength"] = lo
        if draw(st.booleans()):
            schema["maxLength"] = lo + draw(st.integers(0, 20))
    elif kind == "pattern":
        schema["pattern"] = "^" + _regex_text(draw(_regex_trees())) + "$"
    elif kind == "format":
        schema["format"] = draw(st.sampled_from(["date-time", "date", "time", "email", "uuid", "uri", "ipv4", "ipv6"]))
    return schema


@st.composite
def _integer_schema(draw: st.DrawFn) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    lo = draw(st.integers(-(10**6), 10**6))
    step = draw(st.none() | st.integers(1, 50))
    width = draw(st.integers(0, 500)) + (2 * step if step else 2)
    if draw(st.booleans()):
        schema["exclusiveMinimum" if draw(st.booleans()) else "minimum"] = lo
    if draw(st.booleans()):
        schema["exclusiveMaximum" if draw(st.booleans()) else "maximum"] = lo + width
    if step is not None:
        schema["multipleOf"] = step
    return schema


@st.composite
def _number_schema(draw: st.DrawFn) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "number"}
    lo = draw(st.floats(-1e6, 1e6, allow_nan=False))
    if draw(st.booleans()):
        schema["exclusiveMinimum" if draw(st.booleans()) else "minimum"] = lo
    if draw(st.booleans()):
        schema["exclusiveMaximum" if draw(st.booleans()) else "maximum"] = lo + draw(st.floats(1.0, 1e4))
    if draw(st.booleans()):
        schema["multipleOf"] = draw(st.sampled_from([0.5, 0.25, 0.1, 2, 5]))
    return schema


_leaf_schemas = st.one_of(
    _string_schema(),
    _integer_schema(),
    _number_schema(),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(_scalars, min_size=1, max_size=5).map(lambda values: {"enum": values}),
    _scalars.map(lambda value: {"const": value}),
    st.just({"type": ["string", "null"]}),
    st.just({}),
)


@st.composite
def _object_schema(draw: st.DrawFn, children: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    properties = draw(st.dictionaries(_names, children, max_size=4))
    schema: dict[str, Any] = {"type": "object", "properties": properties, "title": "annotations are ignored"}
    if properties:
        schema["required"] = draw(st.lists(st.sampled_from(sorted(properties)), unique=True))
    if draw(st.booleans()):
        schema["additionalProperties"] = False
    return schema


@st.composite
def _array_schema(draw: st.DrawFn, children: st.SearchStrategy[dict[str, Any]]) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "array", "items": draw(children)}
    lo = draw(st.integers(0, 4))
    if draw(st.booleans()):
        schema["minItems"] = lo
    if draw(st.booleans()):
        schema["maxItems"] = lo + draw(st.integers(0, 3))
    return schema


def _extend(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        _object_schema(children),
        _array_schema(children),
        st.lists(children, min_size=1, max_size=3).map(lambda branches: {"anyOf": branches}),
        children.map(lambda child: {"allOf": [child]}),
        st.tuples(st.sampled_from(["string", "integer", "boolean", "null", "array"]), children).map(
            lambda pair: {"oneOf": [{"type": "object", "properties": {"x": pair[1]}}, {"type": pair[0]}]}
        ),
    )


_schemas = st.recursive(_leaf_schemas, _extend, max_leaves=12)


@st.composite
def _root_schemas(draw: st.DrawFn) -> dict[str, Any]:
    """A schema, sometimes reached through a local ``$ref`` as pydantic writes nested models."""
    schema = draw(_schemas)
    if draw(st.booleans()):
        return {"$defs": {"Inner": schema}, "type": "object", "properties": {"inner": {"$ref": "#/$defs/Inner"}}}
    return schema


@PROPERTY
@given(_root_schemas(), st.integers(0, 2**64 - 1))
def test_json_schema_outputs_validate(schema: dict[str, Any], seed: int) -> None:
    guide = compile_guide("json_schema", json.dumps(schema))
    validator = _validator(schema)
    for k in range(3):
        text = guide.text(seed + k)
        assert len(text) < 4000
        instance = json.loads(text)
        errors = sorted(validator.iter_errors(instance), key=str)
        assert not errors, (text, errors[0].message)


def test_json_schema_of_a_pydantic_style_model() -> None:
    schema = {
        "$defs": {
            "Unit": {"enum": ["celsius", "fahrenheit"], "title": "Unit", "type": "string"},
            "Place": {
                "properties": {"city": {"title": "City", "type": "string"}, "country": {"type": "string"}},
                "required": ["city", "country"],
                "title": "Place",
                "type": "object",
                "additionalProperties": False,
            },
        },
        "properties": {
            "place": {"$ref": "#/$defs/Place"},
            "unit": {"$ref": "#/$defs/Unit"},
            "days": {"items": {"type": "integer", "minimum": 1, "maximum": 14}, "type": "array", "maxItems": 3},
            "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
        },
        "required": ["place", "unit", "days", "note"],
        "title": "Forecast",
        "type": "object",
        "additionalProperties": False,
    }
    validator = _validator(schema)
    texts = {guided_text("json_schema", json.dumps(schema), seed=seed) for seed in range(30)}
    assert len(texts) > 20  # the seed matters
    for text in texts:
        validator.validate(json.loads(text))
    assert guided_text("json_schema", json.dumps(schema), seed=5) == guided_text(
        "json_schema", json.dumps(schema), seed=5
    )


@given(st.integers(0, 2**64 - 1))
def test_json_object_outputs_are_objects(seed: int) -> None:
    assert isinstance(json.loads(guided_text("json_object", "", seed=seed)), dict)


# -- regular expressions and grammars -----------------------------------------------------------------------------

# A tree renders both as a Python regex and as an xgrammar/GBNF rule, so the regex is the grammar's oracle too.
_Tree = tuple[Any, ...]
_LITERALS = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=3)
_CLASSES = st.sampled_from(["[a-z]", "[A-Z0-9_]", "[^a-z0-9]", "[-+.]", "[\\]\\\\]", "[é-ë]", "[\\d\\s]"])


def _regex_trees() -> st.SearchStrategy[_Tree]:
    leaves: st.SearchStrategy[_Tree] = st.one_of(
        _LITERALS.map(lambda text: ("lit", text)),
        _CLASSES.map(lambda cls: ("cls", cls)),
        st.sampled_from(["\\d", "\\w", "\\s"]).map(lambda esc: ("esc", esc)),
    )

    def extend(children: st.SearchStrategy[_Tree]) -> st.SearchStrategy[_Tree]:
        return st.one_of(
            st.lists(children, min_size=1, max_size=4).map(lambda items: ("seq", *items)),
            st.lists(children, min_size=2, max_size=3).map(lambda items: ("alt", *items)),
            st.tuples(children, st.sampled_from(["?", "*", "+", "{2}", "{1,3}", "{0,}", "*?", "{,2}"])).map(
                lambda pair: ("rep", *pair)
            ),
        )

    return st.recursive(leaves, extend, max_leaves=10)


def _regex_text(tree: _Tree) -> str:
    kind = tree[0]
    if kind == "lit":
        return "".join(re.escape(c) for c in tree[1])
    if kind in ("cls", "esc"):
        return str(tree[1])
    if kind == "seq":
        return "".join(f"(?:{_regex_text(t)})" for t in tree[1:])
    if kind == "alt":
        return "|".join(f"(?:{_regex_text(t)})" for t in tree[1:])
    return f"(?:{_regex_text(tree[1])}){tree[2]}"


_GBNF_ESCAPES = {"\\d": "[0-9]", "\\w": "[a-zA-Z0-9_]", "\\s": "[ \\t\\n]"}


def _gbnf(tree: _Tree, rules: list[str]) -> str:
    """The tree as a GBNF expression; sequences become rules of their own, as grammars are written."""
    kind = tree[0]
    if kind == "lit":
        return json.dumps(tree[1], ensure_ascii=False)
    if kind == "cls":
        return str(tree[1])
    if kind == "esc":
        return _GBNF_ESCAPES[tree[1]]
    if kind == "seq":
        name = f"part-{len(rules)}"
        rules.append("")
        rules[int(name.split("-")[1])] = f"{name} ::= " + " ".join(_gbnf(t, rules) for t in tree[1:])
        return name
    if kind == "alt":
        return "(" + " | ".join(_gbnf(t, rules) for t in tree[1:]) + ")"
    quantifier = str(tree[2]).rstrip("?") if len(tree[2]) > 1 else tree[2]  # GBNF has no lazy quantifiers
    return f"({_gbnf(tree[1], rules)}){quantifier}"


@PROPERTY
@given(_regex_trees(), st.integers(0, 2**64 - 1))
def test_regex_outputs_fullmatch(tree: _Tree, seed: int) -> None:
    pattern = _regex_text(tree)
    for k in range(3):
        text = guided_text("regex", pattern, seed=seed + k)
        assert re.fullmatch(pattern, text), (pattern, text)


@PROPERTY
@given(_regex_trees(), st.integers(0, 2**64 - 1))
def test_ebnf_outputs_are_in_the_language(tree: _Tree, seed: int) -> None:
    rules: list[str] = []
    root = _gbnf(tree, rules)
    grammar = "\n".join([f"root ::= {root}  # the start rule", *rules])
    pattern = _regex_text(tree)
    for k in range(3):
        text = guided_text("ebnf_grammar", grammar, seed=seed + k)
        assert re.fullmatch(pattern, text), (grammar, text)


def test_regex_practical_patterns() -> None:
    for pattern in (
        r"^\d{3}-\d{4}$",
        r"(?P<user>[a-z]+)@(example|test)\.(com|org)",
        r"[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8})?",
        r"(yes|no|maybe)!?",
        r"0x[0-9a-fA-F]{1,8}",
        r"\u00e9+\x41.\t",
        r"[^\n]{0,5}end",
    ):
        texts = {guided_text("regex", pattern, seed=seed) for seed in range(20)}
        assert all(re.fullmatch(pattern, text) for text in texts), (pattern, texts)
        assert len(texts) > 1 or pattern.startswith("\\u"), pattern


def test_recursive_grammar_ends_and_is_well_formed() -> None:
    grammar = r"""
        # arithmetic: the recursion must end however the seed falls
        root ::= expr
        expr ::= term ("+" term | "*" term)*
        term ::= num | "(" expr ")"
        num  ::= [1-9] [0-9]{0,2}
    """
    texts = [guided_text("ebnf_grammar", grammar, seed=seed) for seed in range(200)]
    for text in texts:
        assert len(text) < 2000
        node = ast.parse(text, mode="eval").body
        assert all(isinstance(n, ast.BinOp | ast.Constant | ast.Add | ast.Mult) for n in ast.walk(node)), text
    assert any("(" in text for text in texts)
    assert len(set(texts)) > 100


# -- choice and structural tags ---------------------------------------------------------------------------------------


@given(st.lists(st.text(max_size=10), min_size=1, max_size=8).filter(any), st.integers(0, 2**64 - 1))
def test_choice_is_one_of_the_choices(choices: list[str], seed: int) -> None:
    assert guided_text("choice", json.dumps(choices), seed=seed) in [c for c in choices if c]


def test_choice_depends_on_the_seed() -> None:
    assert {guided_text("choice", '["a", "b", "c"]', seed=seed) for seed in range(50)} == {"a", "b", "c"}


def test_structural_tag() -> None:
    weather = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    spec = {
        "type": "structural_tag",
        "structures": [
            {"begin": "<function=get_weather>", "schema": weather, "end": "</function>"},
            {"begin": "<function=get_time>", "schema": {"type": "object"}, "end": "</function>"},
        ],
        "triggers": ["<function="],
    }
    seen = set()
    for seed in range(20):
        text = guided_text("structural_tag", json.dumps(spec), seed=seed)
        match = re.fullmatch(r"<function=(get_weather|get_time)>(.*)</function>", text, re.S)
        assert match, text
        seen.add(match.group(1))
        body = json.loads(match.group(2))
        if match.group(1) == "get_weather":
            _validator(weather).validate(body)
        else:
            assert isinstance(body, dict)
    assert seen == {"get_weather", "get_time"}


def test_structural_tag_format_form() -> None:
    """xgrammar's ``format`` form, which TensorRT-LLM hands to xgrammar as it is (issue 27 item 5e): every output is
    a text the format accepts."""
    weather = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    call = {"type": "tag", "begin": "<tool=weather>", "content": {"type": "json_schema", "json_schema": weather}}
    spec = {
        "type": "structural_tag",
        "format": {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": "Answer:"},
                {"type": "or", "elements": [{"type": "regex", "pattern": " [0-9]{2}"}, {"type": "any_text"}]},
                {"type": "triggered_tags", "triggers": ["<tool="], "tags": [{**call, "end": "</tool>"}]},
                {
                    "type": "tags_with_separator",
                    "separator": ",",
                    "tags": [
                        {"begin": "<n>", "content": {"type": "grammar", "grammar": "root ::= [a-c]+"}, "end": "</n>"}
                    ],
                },
            ],
        },
    }
    shapes = set()
    for seed in range(40):
        text = guided_text("structural_tag", json.dumps(spec), seed=seed)
        match = re.fullmatch(
            r"Answer:( [0-9]{2}|[a-z ]+)<tool=weather>(.*)</tool>(<n>[a-c]+</n>(,<n>[a-c]+</n>)?)", text
        )
        assert match, text
        _validator(weather).validate(json.loads(match.group(2)))
        shapes.add((match.group(1)[1:].isdigit(), match.group(4) is not None))
    assert len(shapes) == 4, "every branch of or, one or two separated tags"


def test_any_text_keeps_out_of_its_tags_end() -> None:
    spec = {
        "type": "structural_tag",
        "format": {"type": "tag", "begin": "<", "content": {"type": "any_text"}, "end": " a"},
    }
    for seed in range(50):
        text = guided_text("structural_tag", json.dumps(spec), seed=seed)
        assert text.startswith("<"), text
        assert text.endswith(" a"), text
        assert " a" not in text[1:-2], text


# -- refusals -----------------------------------------------------------------------------------------------------

UNSUPPORTED: list[tuple[str, str]] = [
    ("json_schema", "{not json"),
    ("json_schema", json.dumps({"$ref": "https://example.com/schema.json"})),
    ("json_schema", json.dumps({"type": "object", "properties": {"next": {"$ref": "#"}}})),  # recursive
    ("json_schema", json.dumps({"type": "object", "patternProperties": {"^x": {"type": "string"}}})),
    ("json_schema", json.dumps({"allOf": [{"type": "string"}, {"minLength": 2}]})),
    ("json_schema", json.dumps({"not": {"type": "string"}})),
    ("json_schema", json.dumps({"if": {"type": "string"}, "then": {"minLength": 1}})),
    ("json_schema", json.dumps({"anyOf": [{"type": "string"}], "minLength": 1})),
    ("json_schema", json.dumps({"oneOf": [{"type": "string"}, {"type": "string", "minLength": 2}]})),
    ("json_schema", json.dumps({"oneOf": [{"type": "integer"}, {"type": "number"}]})),
    ("json_schema", json.dumps({"type": "array", "uniqueItems": True})),
    ("json_schema", json.dumps({"type": "array", "minItems": 100, "items": {"type": "array", "minItems": 100}})),
    ("json_schema", json.dumps({"type": "array", "prefixItems": [{"type": "string"}]})),
    ("json_schema", json.dumps({"type": "string", "format": "ipv9"})),
    ("json_schema", json.dumps({"type": "string", "pattern": "(?=a)a"})),
    ("json_schema", json.dumps({"type": "string", "pattern": "^[a-z]{10}$", "maxLength": 3})),
    ("json_schema", json.dumps({"type": "integer", "minimum": 5, "maximum": 4})),
    ("json_schema", json.dumps({"type": "integer", "multipleOf": 10, "minimum": 1, "maximum": 9})),
    ("json_schema", json.dumps({"type": "number", "exclusiveMinimum": 1, "exclusiveMaximum": 1})),
    ("json_schema", json.dumps({"type": "frobnicate"})),
    ("json_schema", json.dumps({"type": "object", "required": ["a"], "additionalProperties": False})),
    ("json_schema", json.dumps({"enum": ["a", 1], "type": "boolean"})),
    ("json_schema", "false"),
    ("regex", "(?=a)a"),
    ("regex", "(?!a)b"),
    ("regex", "(?<=a)b"),
    ("regex", "(a)\\1"),
    ("regex", "\\bword\\b"),
    ("regex", "(?i)abc"),
    ("regex", "a*+"),
    ("regex", "a^b"),
    ("regex", "a$b"),
    ("regex", "[unclosed"),
    ("regex", "a{1001}"),
    ("regex", "((a{100}){100}){100}"),  # each bound is fine, the shortest match is a million characters
    ("regex", "\\N{DIGIT ONE}"),
    ("ebnf_grammar", 'root ::= missing "a"'),
    ("ebnf_grammar", 'start ::= "a"'),
    ("ebnf_grammar", 'root ::= "a" root'),  # no finite derivation
    ("ebnf_grammar", 'root ::= "a" (= "b")'),
    ("ebnf_grammar", 'root ::= "a"\nroot ::= "b"'),
    ("ebnf_grammar", 'root ::= "unterminated'),
    ("ebnf_grammar", "root = 'a'"),
    (
        "structural_tag",
        json.dumps({"type": "structural_tag", "format": {"type": "qwen_xml_parameter", "json_schema": {}}}),
    ),
    ("structural_tag", json.dumps({"type": "structural_tag", "format": {"type": "const_string", "value": ""}})),
    (
        "structural_tag",
        json.dumps({"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "end": "</a>"}}),
    ),
    (
        "structural_tag",
        json.dumps(
            {
                "type": "structural_tag",
                "format": {
                    "type": "triggered_tags",
                    "triggers": ["<tool"],
                    "tags": [{"begin": "[x]", "content": {"type": "any_text"}, "end": "]"}],
                },
            }
        ),
    ),
    ("structural_tag", json.dumps({"type": "structural_tag", "structures": [], "triggers": ["<"]})),
    ("structural_tag", json.dumps({"structures": [{"begin": "[x]", "schema": {}, "end": "]"}], "triggers": ["<"]})),
    ("choice", "[]"),
    ("choice", '[""]'),
    ("choice", "[1, 2]"),
    ("grammar", "root ::= 'a'"),
]


@pytest.mark.parametrize(("kind", "spec"), UNSUPPORTED)
def test_unsupported_guides_are_refused(kind: str, spec: str) -> None:
    with pytest.raises(UnsupportedGuide) as refused:
        compile_guide(kind, spec)
    assert refused.value.message
    assert "\n" not in refused.value.message  # one line, for the status message


def test_every_oneof_member_is_a_kind() -> None:
    assert set(GUIDE_KINDS) == {f.name for f in generation_pb2.GuidedDecoding.DESCRIPTOR.oneofs_by_name["guide"].fields}


# -- through the mock process over gRPC ---------------------------------------------------------------------------

FORECAST = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 2, "maxLength": 30},
        "days": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 14}, "minItems": 1},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "alert": {"type": ["boolean", "null"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}


def _guided(guide: str, value: str | list[str], **options: Any) -> generation_pb2.GenerateRequest:
    request = make_request(**{"max_tokens": 400, **options})
    if guide == "choice":
        assert isinstance(value, list)
        request.guided.choice.choices.extend(value)
    elif guide == "json_object":
        request.guided.json_object.SetInParent()
    else:
        setattr(request.guided, guide, value)
    return request


def test_guided_outputs_over_grpc(start_mock: StartMock) -> None:
    mock = start_mock("--capability", "guided=true")
    validator = _validator(FORECAST)
    schema_text = json.dumps(FORECAST)

    async def scenario(ch: Any) -> None:
        texts = set()
        for seed in range(4):
            out = await generate(ch, _guided("json_schema", schema_text, seed=seed, n=2))
            assert out.status == Status.OK, out.details
            for index in (0, 1):
                validator.validate(json.loads(out.text(index)))
                texts.add(out.text(index))
            finished = out.finished()
            assert [f.reason for f in finished] == [generation_pb2.FINISH_REASON_STOP] * 2
            assert {f.stop_match.WhichOneof("match") for f in finished} == {"eos_token_id"}
        assert len(texts) > 4  # seeds and outputs differ

        pattern = r"[A-Z]{3}-\d{2,4}( OK)?"
        out = await generate(ch, _guided("regex", pattern, seed=1))
        assert re.fullmatch(pattern, out.text()), out.text()
        # xgrammar never builds a choice guide: TensorRT-LLM refuses it (the `full` profile honours it, below).
        out = await generate(ch, _guided("choice", ["north", "south"], temperature=0.0))
        assert (out.status, out.messages) == (Status.UNIMPLEMENTED, [])

        # Greedy: a function of the prompt only (not of the request id).
        first = await generate(ch, _guided("json_schema", schema_text, temperature=0.0))
        again = await generate(ch, _guided("json_schema", schema_text, temperature=0.0))
        assert first.text() == again.text()
        validator.validate(json.loads(first.text()))

        # max_tokens cuts the text: LENGTH, and the partial text is a prefix of the full one.
        cut = await generate(ch, _guided("json_schema", schema_text, temperature=0.0, max_tokens=3))
        assert [f.reason for f in cut.finished()] == [generation_pb2.FINISH_REASON_LENGTH]
        assert len(cut.tokens()) == 3
        assert first.text().startswith(cut.text())

        # Unsupported: UNIMPLEMENTED before acceptance, zero stream messages.
        refused = await generate(ch, _guided("json_schema", json.dumps({"type": "array", "uniqueItems": True})))
        assert (refused.status, refused.messages) == (Status.UNIMPLEMENTED, [])
        assert refused.details is not None
        assert "uniqueItems" in refused.details
        refused = await generate(ch, _guided("regex", "(?<=x)y"))
        assert (refused.status, refused.messages) == (Status.UNIMPLEMENTED, [])
        assert refused.details is not None
        assert "lookaround" in refused.details

    call(mock.address, scenario, timeout=60)


def test_choice_is_honoured_by_the_full_profile(start_mock: StartMock) -> None:
    mock = start_mock("--profile", "full", "--capability", "guided=true")

    async def scenario(ch: Any) -> None:
        for seed in range(3):
            out = await generate(ch, _guided("choice", ["north", "south"], seed=seed))
            assert out.status == Status.OK, out.details
            assert out.text() in ("north", "south")

    call(mock.address, scenario, timeout=60)


def test_guided_output_follows_extra_mock_tokens(start_mock: StartMock) -> None:
    """A scripted output (``extra.mock.tokens``) wins over the guide, as before guided decoding was honoured."""
    mock = start_mock("--capability", "guided=true")
    request = _guided("json_object", "", mock={"tokens": [268, 268]})
    out = call(mock.address, lambda ch: generate(ch, request))
    assert out.tokens() == [268, 268]
    assert [f.reason for f in out.finished()] == [generation_pb2.FINISH_REASON_LENGTH]


def test_guided_output_across_prefill_and_decode_legs(start_mock: StartMock) -> None:
    """The decode leg replays the prefill leg's first token and continues the same guided text after it."""
    mock = start_mock("--capability", "guided=true")
    schema_text = json.dumps(FORECAST)
    whole = _guided("json_schema", schema_text, seed=3)
    context_only = _guided("json_schema", schema_text, seed=3, max_tokens=1, extra={"request_type": "context_only"})
    decode = _guided("json_schema", schema_text, seed=3)

    async def scenario(ch: Any) -> tuple[str, str]:
        aggregated = await generate(ch, whole)
        first = await generate(ch, context_only)
        assert first.events == ["token", "prefill_ready"], first.events
        decode.kv.session.CopyFrom(first.final.prefill_ready.kv_session)
        rest = await generate(ch, decode)
        assert rest.tokens() == aggregated.tokens()
        return aggregated.text(), rest.text()

    aggregated, disaggregated = call(mock.address, scenario)
    assert disaggregated == aggregated
    _validator(FORECAST).validate(json.loads(disaggregated))
