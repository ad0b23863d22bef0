"""Structured outputs through a real server, with the official openai SDK: response_format (the SDK's
``chat.completions.parse`` with a pydantic model, json_object, json_schema) and vLLM's
``structured_outputs`` (json, regex, choice, grammar), streamed and not, speculation on and off, and
bad specs refused with a 400 that names the field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from server.app import ServerSettings, create_app
from servers import Served, engine_factory, serve

MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "Describe a pet as JSON."}]
PINNED = {"speculative": {"num_draft_tokens": 3}}  # draft every step (the controller might not, on a CPU)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Pet(BaseModel):
    name: str = Field(max_length=8)
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    vaccinated: bool


@pytest.fixture(scope="module")
def srv(llama_dir) -> Iterator[Served]:
    # The target drafts for itself: drafts are long and accepted, so the grammar meets real trees.
    factory = engine_factory(llama_dir, draft_model=str(llama_dir), num_speculative_tokens=4)
    with serve(create_app(ServerSettings(served_model_name=MODEL), factory)) as s:
        yield s


def test_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(
        model=MODEL, messages=MESSAGES, response_format=Pet, temperature=0, max_tokens=200, extra_body=PINNED
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Pet)
    assert list(json.loads(choice.message.content)) == ["name", "kind", "age", "vaccinated"]  # the schema's order
    assert r.usage.speculative["draft_tokens"] > 0


def test_json_object(client):
    """Every choice ends (none is cut) and parses as an object; sampled, one has a member (this seed)."""
    kw = dict(model=MODEL, messages=MESSAGES, response_format={"type": "json_object"}, max_tokens=60)
    greedy = client.chat.completions.create(temperature=0, **kw).choices
    sampled = client.chat.completions.create(temperature=1, seed=5, n=4, extra_body=PINNED, **kw).choices
    objects = []
    for c in greedy + sampled:
        assert c.finish_reason == "stop", c.message.content
        objects.append(json.loads(c.message.content))
        assert isinstance(objects[-1], dict)
    assert any(objects)


@pytest.mark.parametrize(
    "spec,check",
    [
        ({"json": {**Pet.model_json_schema(), "additionalProperties": False}}, lambda t: Pet.model_validate_json(t)),
        ({"regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t) or pytest.fail(t)),
        ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue") or pytest.fail(t)),
        (
            {"grammar": 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9]/'},
            lambda t: re.fullmatch(r"\([1-9](\+[1-9])*\)", t) or pytest.fail(t),
        ),
        ({"grammar": 'root ::= "x" [a-c] "y"'}, lambda t: re.fullmatch(r"x[a-c]y", t) or pytest.fail(t)),
    ],
    ids=["json", "regex", "choice", "lark", "gbnf"],
)
def test_structured_outputs_kinds_on_both_endpoints(client, spec, check):
    extra = {"structured_outputs": spec}
    r = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=120, temperature=0, extra_body=extra)
    assert r.choices[0].finish_reason == "stop", r.choices[0].text
    check(r.choices[0].text)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=120, temperature=0, extra_body=extra)
    assert r.choices[0].finish_reason == "stop"
    check(r.choices[0].message.content)


def test_streamed_equals_non_streamed_and_speculation_changes_nothing(client):
    strict = {**Pet.model_json_schema(), "additionalProperties": False}
    schema = {"type": "json_schema", "json_schema": {"name": "pet", "schema": strict, "strict": True}}
    kw = dict(model=MODEL, messages=MESSAGES, response_format=schema, max_tokens=200)
    whole = client.chat.completions.create(temperature=0, extra_body=PINNED, **kw)
    plain = client.chat.completions.create(temperature=0, extra_body={"speculative": {"enabled": False}}, **kw)
    assert whole.choices[0].message.content == plain.choices[0].message.content
    assert plain.usage.speculative["draft_tokens"] == 0
    assert whole.usage.speculative["draft_tokens"] > 0
    assert whole.usage.speculative["forced_tokens"] > 0  # the keys and punctuation the schema dictates
    stream = client.chat.completions.create(temperature=0, stream=True, **kw)
    text, reasons = "", []
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            reasons.append(c.finish_reason)
    assert text == whole.choices[0].message.content
    assert reasons[-1] == whole.choices[0].finish_reason == "stop"
    sampled = client.chat.completions.create(temperature=1.0, seed=5, n=3, **kw)
    for c in sampled.choices:
        if c.finish_reason == "stop":
            Pet.model_validate_json(c.message.content)


@pytest.mark.parametrize(
    "body,param,contains",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format",
            "invalid json",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
        ({"response_format": {"type": "yaml"}}, "response_format", ""),
        ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "invalid regex"),
        ({"structured_outputs": {"grammar": "start: x\nx: 'a' |"}}, "structured_outputs", "invalid grammar"),
        ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs", "invalid grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"choices": ["a"]}}, "structured_outputs", ""),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "not valid JSON"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty"),
        (
            {"structured_outputs": {"json": {}}, "response_format": {"type": "json_object"}},
            "response_format",
            "give one of",
        ),  # fmt: skip
        ({"regex": "a+", "ebnf": 'root ::= "a"'}, "ebnf", "give one of"),
        (
            {"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {"type": "integer"}}}},
            "response_format",
            "takes no json_schema",
        ),  # fmt: skip
        (
            {"structured_outputs": {"json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/nowhere"}}}}},
            "structured_outputs",
            "",
        ),
    ],
)
def test_bad_specs_are_400_naming_the_field(http, body, param, contains):
    for path, base in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "x"})):
        r = http.post(path, json={"model": MODEL, "max_tokens": 4, **base, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert contains in err["message"]
        if param is not None:
            assert param in (err["param"] or "") or param in err["message"], err


def test_a_hostile_schema_is_refused_and_the_server_goes_on(http, client):
    deep: dict = {"type": "string"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    r = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4, "structured_outputs": {"json": deep}}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs"
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20_000)}}
    r = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4, "structured_outputs": {"json": wide}}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs"
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text is not None


def test_metrics_count_constrained_requests_and_what_the_grammar_did(http, client):
    schema = {
        "type": "json_schema",
        "json_schema": {"name": "pet", "schema": {**Pet.model_json_schema(), "additionalProperties": False}},
    }
    client.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format=schema, max_tokens=100, temperature=0, extra_body=PINNED
    )
    text = http.get("/metrics").text

    def value(prefix: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))

    assert value('augur_structured_requests_total{kind="json",model_name="tiny-llama"}') >= 1
    assert value("augur_structured_grammar_seconds_count") >= 1
    assert value('augur_structured_tokens_total{model_name="tiny-llama",what="forced"}') > 0
    assert value('augur_structured_tokens_total{model_name="tiny-llama",what="drafted"}') > 0
