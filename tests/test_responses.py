"""The Responses API (``/v1/responses``) through a real server, with the official openai SDK and
openai-agents' default model: text, streamed events in order and equal to the collected response,
forced function calls whose arguments match their schema, argument deltas that reassemble, a turn
carrying function_call_output, previous_response_id with retrieve and delete, the store's bounds and
its keys, text.format and responses.parse, bad requests refused naming the field, greedy identity
with speculation on and off, and the same output as chat completions for the same conversation.
openai-agents' default model runs a tool in tests/test_agent_clients.py."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import openai
import pytest
from test_tools import MODELS, Lookup, Weather

from conftest import build_model_dir
from server.app import ServerSettings, create_app
from server.responses.output import OutputBuilder
from server.responses.store import ResponseStore
from server.tools import FORMATS, CallScanner
from servers import Served, engine_factory, serve

MODEL = "tiny-llama"
PINNED = {"speculative": {"num_draft_tokens": 3}}
OFF = {"speculative": {"enabled": False}}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather now",
        "parameters": Weather.model_json_schema(),
    },
    {"type": "function", "name": "lookup", "parameters": Lookup.model_json_schema()},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("responses")
    return build_model_dir(root / "m", tokenizer_dir, "LlamaForCausalLM", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def srv(model_dir) -> Iterator[Served]:
    factory = engine_factory(model_dir, draft_model=str(model_dir), num_speculative_tokens=4, max_model_len=2048)
    settings = ServerSettings(served_model_name=MODEL, responses_store_max=4)
    with serve(create_app(settings, factory)) as s:
        yield s


def respond(client, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_output_tokens", 24)
    kw.setdefault("input", "Tell me a story.")
    extra = {**PINNED, **kw.pop("extra_body", {})}
    return client.responses.create(model=MODEL, extra_body=extra, **kw)


def chat_text(client, messages, max_tokens=24, **kw) -> str:
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                       extra_body=PINNED, **kw)  # fmt: skip
    return r.choices[0].message.content


# -- text ------------------------------------------------------------------------------------------------------
def test_text_is_what_chat_completions_says_for_the_same_conversation(client):
    r = respond(client, instructions="Be brief.")
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status in ("completed", "incomplete") and len(r.output) == 1
    msg = r.output[0]
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
    assert r.output_text == chat_text(client, messages)
    u = r.usage
    assert u.output_tokens > 0 and u.total_tokens == u.input_tokens + u.output_tokens
    assert u.input_tokens_details.cached_tokens >= 0 and u.output_tokens_details.reasoning_tokens == 0
    assert u.model_extra["speculative"]["draft_tokens"] > 0  # speculation ran
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert r.instructions == "Be brief." and r.max_output_tokens == 24 and r.temperature == 0


def test_greedy_identity_with_speculation_on_and_off(client):
    on = respond(client, max_output_tokens=40)
    off = respond(client, max_output_tokens=40, extra_body=OFF)
    assert on.output_text == off.output_text
    assert off.usage.model_extra["speculative"]["draft_tokens"] == 0


# At most 16 characters, so at most 16 tokens: it ends within max_output_tokens whatever the model picks.
SENTENCE = {"structured_outputs": {"regex": "[a-z]{1,3}( [a-z]{1,3}){1,2}[.]"}}


@pytest.mark.parametrize("extra,status", [({}, "incomplete"), (SENTENCE, "completed")], ids=["cut", "completed"])
def test_streamed_events_come_in_order_and_equal_the_collected_response(client, extra, status):
    whole = respond(client, max_output_tokens=30, extra_body=extra)
    assert whole.status == status
    events = list(respond(client, max_output_tokens=30, stream=True, extra_body=extra))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]  # fmt: skip
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text
    assert set(types[4:-4]) == {"response.output_text.delta"}
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    if status == "incomplete":
        assert whole.incomplete_details.reason == "max_output_tokens"
        return  # the SDK's stream helper wants response.completed
    with client.responses.stream(model=MODEL, input="Tell me a story.", max_output_tokens=30, temperature=0,
                                 extra_body={**PINNED, **extra}) as s:  # fmt: skip
        texts = [e.delta for e in s if e.type == "response.output_text.delta"]
        helper = s.get_final_response()
    assert "".join(texts) == helper.output_text == whole.output_text


# -- function calls ----------------------------------------------------------------------------------------
def check_calls(output, names: set[str]) -> list[tuple[str, dict]]:
    calls = [o for o in output if o.type == "function_call"]
    assert calls, output
    out = []
    for call in calls:
        assert call.call_id and call.id and call.status == "completed" and call.name in names
        args = json.loads(call.arguments)
        MODELS[call.name].model_validate(args)  # the schema holds
        out.append((call.name, args))
    return out


def test_required_and_named_choices_make_valid_calls(client):
    r = respond(client, input="Weather in Paris?", tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                max_output_tokens=200)  # fmt: skip
    assert r.status == "completed" and len(check_calls(r.output, set(MODELS))) == 1
    assert r.usage.model_extra["speculative"]["forced_tokens"] > 0
    r = respond(client, input="Find it.", tools=TOOLS, tool_choice={"type": "function", "name": "lookup"},
                max_output_tokens=200)  # fmt: skip
    assert [n for n, _ in check_calls(r.output, {"lookup"})] == ["lookup"]
    assert r.tool_choice.name == "lookup" and [t.name for t in r.tools] == ["get_weather", "lookup"]


def test_streamed_argument_deltas_reassemble_to_the_arguments(client):
    kw = dict(input="Weather in Paris?", tools=TOOLS, tool_choice="required", max_output_tokens=200)
    whole = respond(client, **kw)
    events = list(respond(client, stream=True, **kw))
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert [(o.name, o.arguments) for o in final.output] == [(o.name, o.arguments) for o in whole.output]
    for idx, item in enumerate(final.output):
        mine = [e for e in events if getattr(e, "output_index", None) == idx]
        assert mine[0].type == "response.output_item.added" and mine[0].item.name == item.name
        assert mine[0].item.arguments == "" and mine[0].item.status == "in_progress"
        deltas = [e.delta for e in mine if e.type == "response.function_call_arguments.delta"]
        assert len(deltas) > 1 and "".join(deltas) == item.arguments
        (done,) = [e for e in mine if e.type == "response.function_call_arguments.done"]
        assert done.arguments == item.arguments and done.name == item.name
        assert mine[-1].type == "response.output_item.done" and mine[-1].item.status == "completed"
    with client.responses.stream(model=MODEL, temperature=0, extra_body=PINNED, **kw) as s:
        helper = s.get_final_response()
    assert [(o.name, o.arguments) for o in helper.output] == [(o.name, o.arguments) for o in whole.output]


def test_a_turn_carrying_a_function_call_output_is_the_chat_conversation(client):
    args = '{"city": "Paris", "unit": "c"}'
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": args},
        {"type": "function_call_output", "call_id": "call_1", "output": "21 C, sunny"},
    ]
    r = respond(client, input=items, tools=TOOLS)
    assert r.status in ("completed", "incomplete") and r.output_text
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "21 C, sunny"},
    ]  # fmt: skip
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
    assert r.output_text == chat_text(client, messages, tools=chat_tools)


# -- state -------------------------------------------------------------------------------------------------
def test_previous_response_id_continues_and_retrieve_and_delete(client, http):
    first = respond(client, input="Hello there.", max_output_tokens=12)
    second = respond(client, input="And then?", previous_response_id=first.id, max_output_tokens=12)
    assert second.previous_response_id == first.id
    messages = [
        {"role": "user", "content": "Hello there."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    assert second.output_text == chat_text(client, messages, max_tokens=12)
    assert second.usage.input_tokens_details.cached_tokens > 0  # the prefix cache held the first turn
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text and got.status == first.status
    items = client.responses.input_items.list(second.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text == "And then?"
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        respond(client, input="More.", previous_response_id=first.id)
    assert e.value.body["param"] == "previous_response_id"
    # The continuation does not depend on its ancestor once stored: it keeps its conversation.
    third = respond(client, input="More.", previous_response_id=second.id, max_output_tokens=8)
    messages += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "More."}]
    assert third.output_text == chat_text(client, messages, max_tokens=8)


def test_store_false_keeps_nothing_and_the_store_is_bounded(client, srv):
    r = respond(client, store=False, max_output_tokens=4)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    ids = [respond(client, max_output_tokens=2).id for _ in range(5)]  # the store keeps 4
    with pytest.raises(openai.NotFoundError, match="evicted"):
        client.responses.retrieve(ids[0])
    assert client.responses.retrieve(ids[-1]).id == ids[-1]
    text = httpx.get(srv.base + "/metrics").text
    assert f'augur_responses_stored{{model_name="{MODEL}",what="count"}} 4.0' in text
    assert 'augur_api_requests_total{endpoint="responses"' in text


def test_the_store_bounds_count_and_bytes_oldest_out():
    store = ResponseStore(max_count=3, max_bytes=10_000)
    history: list[dict] = []
    for i in range(5):
        history = history + [{"role": "user", "content": f"turn {i}"}]
        store.put({"id": f"r{i}"}, history, [], None)
    assert [store.get(f"r{i}", None) is not None for i in range(5)] == [False, False, True, True, True]
    assert store.get("r4", "someone else") is None  # another key's response does not exist for it
    big = {"id": "big", "text": "x" * 6000}
    store.put(big, [], [], None)
    store.put({"id": "big2", "text": "y" * 6000}, [], [], None)
    assert store.get("big", None) is None and store.get("big2", None) is not None and store.bytes <= 10_000
    store.put({"id": "huge", "text": "z" * 20_000}, [], [], None)  # could never fit: not kept, nothing lost
    assert store.get("huge", None) is None and store.get("big2", None) is not None
    # A continuation is counted with the conversation it holds, whether or not its ancestor is kept.
    store = ResponseStore(max_count=10, max_bytes=100_000)
    first = [{"role": "user", "content": "x" * 30_000}]
    store.put({"id": "a"}, first, [], None)
    store.put({"id": "b"}, first + [{"role": "user", "content": "more"}], [], None)
    store.delete("a")
    assert store.bytes > 30_000 and store.get("b", None) is not None
    store.put({"id": "c"}, [{"role": "user", "content": "y" * 80_000}], [], None)  # b must make room
    assert store.get("b", None) is None and store.bytes <= 100_000


def test_a_stored_response_belongs_to_the_key_that_made_it(model_dir):
    settings = ServerSettings(served_model_name=MODEL, api_key=["key-a", "key-b"])
    with serve(create_app(settings, engine_factory(model_dir, max_model_len=2048))) as s:
        a = openai.OpenAI(base_url=s.base + "/v1", api_key="key-a", max_retries=0)
        b = openai.OpenAI(base_url=s.base + "/v1", api_key="key-b", max_retries=0)
        r = a.responses.create(model=MODEL, input="Hi.", max_output_tokens=4, temperature=0)
        assert a.responses.retrieve(r.id).id == r.id
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            b.responses.create(model=MODEL, input="Go on.", previous_response_id=r.id, max_output_tokens=4)
        with pytest.raises(openai.NotFoundError):
            b.responses.delete(r.id)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.base + "/v1", api_key="key-c", max_retries=0).responses.retrieve(r.id)


# -- structured output -------------------------------------------------------------------------------------
def test_text_format_json_schema_and_parse(client):
    parsed = client.responses.parse(model=MODEL, input="Weather?", text_format=Weather, max_output_tokens=200,
                                    temperature=0, extra_body=PINNED)  # fmt: skip
    assert isinstance(parsed.output_parsed, Weather)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}  # fmt: skip
    fmt = {"format": {"type": "json_schema", "name": "num", "schema": schema, "strict": True}}
    r = respond(client, text=fmt, max_output_tokens=100)
    assert r.status == "completed" and set(json.loads(r.output_text)) == {"n"}
    assert r.text.format.type == "json_schema" and r.text.format.name == "num"
    r = respond(client, text={"format": {"type": "json_object"}}, max_output_tokens=100)
    assert r.status != "completed" or isinstance(json.loads(r.output_text), dict)


# -- bad requests ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body,param",
    [
        ({"frobnicate": 1}, "frobnicate"),
        ({"messages": [{"role": "user", "content": "x"}]}, "messages"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"max_tokens": 5}, "max_tokens"),
        ({"n": 2}, "n"),
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]}, "input"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[" * 100_000}]}, "input"),
        ({"include": ["reasoning.encrypted_content", "message.output_text.logprobs"]}, "include"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"truncation": "auto"}, "truncation"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "response_format"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"stream": True, "stream_options": {"include_speculation": True}}, "stream_options.include_speculation"),
        ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage"),
    ],
)
def test_bad_requests_are_400_naming_the_field(http, body, param):
    r = http.post("/v1/responses", json={"model": MODEL, "input": "Hi.", "max_output_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and param in (err["param"] or "") + err["message"], err


def test_a_codex_shaped_request_streams(http):
    """What Codex CLI sends (docs/responses.md): developer and user message items, non-strict function
    tools, a reasoning summary, encrypted reasoning asked to be included, cache key and client metadata."""
    body = {
        "model": MODEL,
        "instructions": None,
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are a coder."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hello."}]},
        ],
        "tools": [{"type": "function", "name": "exec_command", "description": "Run a command.", "strict": False,
                   "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"],
                                  "additionalProperties": False}}],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "thread-1",
        "client_metadata": {"x-codex-turn-metadata": "{}"},
        "max_output_tokens": 8,
    }  # fmt: skip
    with http.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("event: ")]
    assert lines[0] == "event: response.created" and lines[-1] in ("event: response.completed",
                                                                    "event: response.incomplete")  # fmt: skip


def test_unknown_ids_and_models_are_404(http):
    assert http.get("/v1/responses/resp_nope").status_code == 404
    assert http.delete("/v1/responses/resp_nope").status_code == 404
    r = http.post("/v1/responses", json={"model": "other", "input": "Hi."})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_auto_keeps_the_first_call_alone_when_parallel_calls_are_off(client):
    """As on chat: under auto the model writes two calls (a regex makes it); ``parallel_tool_calls``
    false returns the first alone, streamed or not."""
    two = ('<tool_call>\n{"name": "lookup", "arguments": {"query": "a", "limit": 1}}\n</tool_call>\n'
           '<tool_call>\n{"name": "lookup", "arguments": {"query": "b", "limit": 2}}\n</tool_call>')  # fmt: skip
    regex = {"structured_outputs": {"regex": re.escape(two)}}
    kw = dict(input="Find it.", tools=TOOLS, tool_choice="auto", max_output_tokens=200, extra_body=regex)
    both = respond(client, parallel_tool_calls=True, **kw)
    assert check_calls(both.output, {"lookup"}) == [("lookup", {"query": "a", "limit": 1}),
                                                    ("lookup", {"query": "b", "limit": 2})]  # fmt: skip
    one = respond(client, parallel_tool_calls=False, **kw)
    assert check_calls(one.output, {"lookup"}) == [("lookup", {"query": "a", "limit": 1})]
    final = list(respond(client, parallel_tool_calls=False, stream=True, **kw))[-1].response
    assert [(o.name, o.arguments) for o in final.output] == [(o.name, o.arguments) for o in one.output]


def test_text_after_the_calls_stays_in_the_message(client):
    """As chat keeps it in the content: the message holds the text before and after the calls."""
    text = 'Checking.\n<tool_call>\n{"name": "lookup", "arguments": {"query": "a", "limit": 1}}\n</tool_call>\nDone.'
    kw = dict(input="Find it.", tools=TOOLS, tool_choice="auto", max_output_tokens=200,
              extra_body={"structured_outputs": {"regex": re.escape(text)}})  # fmt: skip
    for r in (respond(client, **kw), list(respond(client, stream=True, **kw))[-1].response):
        assert [o.type for o in r.output] == ["message", "function_call"]
        assert r.output[0].content[0].text == "Checking.\nDone."


# -- the builder, token by token ---------------------------------------------------------------------------
CALLS_TEXT = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "unit": "c"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "lookup", "arguments": {"query": "[x]", "limit": 3}}\n</tool_call>')  # fmt: skip


@pytest.mark.parametrize("cut", range(1, len(CALLS_TEXT)))
def test_forced_calls_are_announced_as_they_are_written(cut):
    """However the text is split, each call is announced as soon as its name is complete, and its
    arguments (the exact text written) follow in pieces that join to the call's arguments."""
    b = OutputBuilder(FORMATS["hermes"], forced=True)
    events = b.feed(CALLS_TEXT[:cut])
    header = '"arguments": '
    announced = [e["item"]["name"] for e in events if e["type"] == "response.output_item.added"]
    expect = [n for n, at in (("get_weather", CALLS_TEXT.index(header)),
                              ("lookup", CALLS_TEXT.rindex(header))) if cut >= at + len(header) + 1]  # fmt: skip
    assert announced == expect
    events += b.feed(CALLS_TEXT[cut:]) + b.finish("stop")
    assert [i["arguments"] for i in b.items] == ['{"city": "Pa\\"ris}", "unit": "c"}', '{"query": "[x]", "limit": 3}']
    for idx, item in enumerate(b.items):
        pieces = [e["delta"] for e in events if e.get("output_index") == idx and "delta" in e]
        assert "".join(pieces) == item["arguments"] and item["status"] == "completed"


def test_a_forced_call_cut_short_ends_incomplete():
    b = OutputBuilder(FORMATS["llama3_json"], forced=True)
    b.feed('{"name": "lookup", "parameters": {"query": "ab')
    events = b.finish("length")
    assert b.items[0]["status"] == "incomplete" and b.items[0]["arguments"] == '{"query": "ab'
    assert [e["type"] for e in events] == ["response.function_call_arguments.done", "response.output_item.done"]


def test_auto_holds_back_a_call_and_sends_it_at_the_end():
    b = OutputBuilder(FORMATS["hermes"], forced=False)
    text = 'Checking.\n<tool_call>\n{"name": "lookup", "arguments": {"query": "q", "limit": 1}}\n</tool_call>'
    events = [e for ch in text for e in b.feed(ch)]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Checking."
    assert not any(e["type"].startswith("response.function_call") for e in events)
    events = b.finish("stop")
    assert [i["type"] for i in b.items] == ["message", "function_call"]
    assert b.items[0]["content"][0]["text"] == "Checking." and b.items[1]["name"] == "lookup"
    s = CallScanner(FORMATS["mistral"])
    found = s.feed('[TOOL_CALLS][{"name": "f", "arguments": 7}, {"name": "g", "arguments": "x"}]')
    assert found == [("call", "f"), ("args", "7"), ("end",), ("call", "g"), ("args", '"x"'), ("end",)]
