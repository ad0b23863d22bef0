"""docs/fields.md, walked against a live server: every row's example is sent, and the answer must be
what the row says (honoured and accepted: 200; refused: a 400 whose ``param`` names the field). Every
field the request models declare, and every field server/fields.py accepts or refuses, must have a row;
a field no table knows is refused by name."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_reasoning import TEMPLATE, thinking_model

from server.app import ServerSettings, create_app
from server.fields import NO_EFFECT, REFUSED
from server.protocol import ChatCompletionRequest, CompletionRequest
from servers import Served, engine_factory, serve

MODEL = "tiny-qwen3"
DOC = Path(__file__).resolve().parents[1] / "docs" / "fields.md"
ROW = re.compile(r"^\| `([a-z_0-9]+)` \| ([^|]+) \| (honoured|accepted|refused) \| (—|`.*`) \| ([^|]*) \|$")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def table(endpoint: str) -> dict[str, tuple[str, dict | None]]:
    """``field -> (status, example)`` of the page's table for ``endpoint`` ("chat" or "completions")."""
    text = DOC.read_text(encoding="utf-8")
    heading = {"chat": "## `/v1/chat/completions`", "completions": "## `/v1/completions`"}[endpoint]
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    rows: dict[str, tuple[str, dict | None]] = {}
    for line in section.splitlines():
        m = ROW.match(line.strip())
        if m is None:
            assert not line.startswith("| `"), f"a row the test cannot read: {line}"
            continue
        name, _, status, example, _ = m.groups()
        assert name not in rows, f"{name} twice"
        rows[name] = (status, None if example == "—" else json.loads(example[1:-1]))
    return rows


CHAT, COMPLETIONS = table("chat"), table("completions")
BASE = {
    "chat": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 2},
}
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@pytest.fixture(scope="module")
def srv(tmp_path_factory, tokenizer_dir) -> Iterator[Served]:
    d = thinking_model(tmp_path_factory.mktemp("fields") / "m", tokenizer_dir, TEMPLATE)
    factory = engine_factory(d, draft_model=str(d), max_model_len=1024)  # a draft: contrastive decoding's amateur
    with serve(create_app(ServerSettings(served_model_name=MODEL, reasoning_parser="qwen3"), factory)) as s:
        yield s


def rows(endpoint: str, rows_: dict) -> list:
    return [pytest.param(endpoint, name, status, example, id=f"{endpoint}-{name}")
            for name, (status, example) in rows_.items() if example is not None]  # fmt: skip


@pytest.mark.parametrize("endpoint,name,status,example", rows("chat", CHAT) + rows("completions", COMPLETIONS))
def test_each_row_is_what_the_server_does(http, endpoint, name, status, example):
    r = http.post(PATHS[endpoint], json={**BASE[endpoint], **example})
    if status == "refused":
        assert r.status_code == 400, r.text[:300]
        assert r.json()["error"]["param"] == name, r.text
    else:
        assert r.status_code == 200, r.text[:300]


@pytest.mark.parametrize("endpoint,model,rows_", [("chat", ChatCompletionRequest, CHAT),
                                                   ("completions", CompletionRequest, COMPLETIONS)])  # fmt: skip
def test_every_declared_field_has_a_row(endpoint, model, rows_):
    missing = set(model.model_fields) - set(rows_)
    assert not missing, f"{endpoint}: declared but not in docs/fields.md: {sorted(missing)}"
    declared_refused = {n for n, (s, _) in rows_.items() if s == "refused" and n in model.model_fields}
    assert declared_refused <= {"functions", "function_call", "suffix"}, declared_refused  # refused by validation


def test_every_screened_field_has_a_row():
    rows_ = set(CHAT) | set(COMPLETIONS)
    assert set(NO_EFFECT) | set(REFUSED) <= rows_, sorted((set(NO_EFFECT) | set(REFUSED)) - rows_)
    for name in NO_EFFECT:
        assert CHAT[name][0] == "accepted", name
    for name in REFUSED:  # mm_payload's example is a value that asks for nothing
        assert {**COMPLETIONS, **CHAT}[name][0] == "refused" or name == "mm_payload", name


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_field_nothing_knows_is_refused_by_name(http, endpoint):
    r = http.post(PATHS[endpoint], json={**BASE[endpoint], "temprature": 0.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temprature", r.text
    assert "Unknown parameter" in r.json()["error"]["message"]


ASKING_NOTHING = [("priority", 0), ("spaces_between_special_tokens", True), ("stream_reasoning", True),
                  ("echo", False)]  # fmt: skip


@pytest.mark.parametrize("name,default", ASKING_NOTHING)
def test_a_refused_field_asking_for_nothing_is_accepted(http, name, default):
    r = http.post(PATHS["chat"], json={**BASE["chat"], name: default})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_prompt_logprobs_zero_asks_for_the_prompt_tokens_own_logprobs_and_is_refused(http, endpoint):
    """vLLM answers ``prompt_logprobs: 0`` with each prompt token's own logprob: not nothing."""
    r = http.post(PATHS[endpoint], json={**BASE[endpoint], "prompt_logprobs": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
    assert "chat" not in r.json()["error"]["message"]  # the same words on either endpoint
    assert http.post(PATHS[endpoint], json={**BASE[endpoint], "prompt_logprobs": None}).status_code == 200


NULLABLE = ["n", "stream", "presence_penalty", "frequency_penalty", "top_k", "min_p", "repetition_penalty",
            "min_tokens", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
            "use_beam_search"]  # fmt: skip


@pytest.mark.parametrize("endpoint", ["chat", "completions", "responses"])
def test_null_is_the_default_for_every_optional_field(http, endpoint):
    """OpenAI's spec takes null for each optional field, and clients built on it send it: the request
    answers as if the field were left out."""
    nulls = {k: None for k in NULLABLE}
    if endpoint == "chat":
        nulls["logprobs"] = nulls["add_generation_prompt"] = None
    elif endpoint == "completions":
        nulls["echo"] = None
    if endpoint == "responses":
        path, body = "/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 3, "temperature": 0}
        nulls = {"stream": None, "store": None, "top_k": None, "parallel_tool_calls": None, "min_tokens": None}
    else:
        path, body = PATHS[endpoint], {**BASE[endpoint], "max_tokens": 3, "temperature": 0}
    plain, null = http.post(path, json=body), http.post(path, json={**body, **nulls})
    assert plain.status_code == null.status_code == 200, null.text
    text = {"chat": lambda r: r["choices"][0]["message"], "completions": lambda r: r["choices"][0]["text"],
            "responses": lambda r: [o.get("content") for o in r["output"]]}[endpoint]  # fmt: skip
    counts = {k: v for k, v in plain.json()["usage"].items() if isinstance(v, int)}  # (the prefix cache differs)
    assert text(null.json()) == text(plain.json()) and counts and counts.items() <= null.json()["usage"].items()


def test_null_is_the_default_inside_request_objects_too(http):
    """A field of an object in the body (stream_options, a history's call, Augur's speculative options)
    sent as null is its default as well: the answer is the one without it."""
    body = {**BASE["chat"], "max_tokens": 3, "temperature": 0}
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "", "content": "ok"}]  # fmt: skip
    nulled = [history[0], {**history[1], "tool_calls": [{**call, "id": None}]}, history[2]]
    usage = {"include_usage": True}

    def chunks(r) -> list[dict]:
        return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]

    for plain, null in (
        ({"stream_options": usage}, {"stream_options": {**usage, "include_obfuscation": None}}),
        ({"messages": history}, {"messages": nulled}),
        ({"speculative": {"num_draft_tokens": 2}}, {"speculative": {"num_draft_tokens": 2, "enabled": None}}),
    ):
        stream = "stream_options" in plain
        got = [http.post(PATHS["chat"], json={**body, **b, "stream": stream}) for b in (plain, null)]
        assert [r.status_code for r in got] == [200, 200], got[1].text
        if stream:  # the text, and a usage chunk, alike
            texts = ["".join(ch["delta"].get("content") or "" for c in chunks(r) for ch in c["choices"]) for r in got]
            assert texts[0] == texts[1] and all(chunks(r)[-1]["usage"] for r in got)
        else:
            assert got[0].json()["choices"][0]["message"] == got[1].json()["choices"][0]["message"]
    r = http.post(PATHS["chat"], json={**body, "stream": True, "stream_options": {"include_usage": None}})
    assert r.status_code == 200 and not any(c.get("usage") for c in chunks(r)), r.text


def test_continuous_usage_counts_on_every_chunk(http):
    body = {**BASE["completions"], "max_tokens": 4, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    r = httpx.post(http.base_url.join(PATHS["completions"]), json=body, timeout=60)
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts == sorted(counts) and counts[-1] == 4 and chunks[-1]["usage"]["completion_tokens"] == 4
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
               for c in chunks)  # fmt: skip


def test_sglang_names_constrain_as_ours_do(http):
    for body in ({"regex": "[a-c]{3}"}, {"ebnf": 'root ::= "abc"'}):
        r = http.post(PATHS["chat"], json={**BASE["chat"], "max_tokens": 8, **body}).json()
        assert re.fullmatch("[a-c]{3}", r["choices"][0]["message"]["content"]), r
    r = http.post(PATHS["completions"], json={**BASE["completions"], "max_tokens": 40,
                                              "json_schema": json.dumps({"type": "object"})}).json()  # fmt: skip
    assert isinstance(json.loads(r["choices"][0]["text"]), dict)
    both = http.post(PATHS["chat"], json={**BASE["chat"], "regex": "a", "structured_outputs": {"regex": "b"}})
    assert both.status_code == 400
