"""Tool calling through a real server, with the official openai SDK: tool_choice required, named and
auto (calls parsed out of the text), parallel calls, streamed deltas that the SDK's stream helper
assembles into the non-streamed calls, history with tool results, templates with and without tools,
the three call syntaxes, and bad requests refused naming the field."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import httpx
import openai
import pytest
import torch
import transformers
from pydantic import BaseModel, Field

from conftest import VOCAB, build_model_dir
from engine.request.structured import StructuredOutput
from engine.structured.closing import ending
from server.app import ServerSettings, create_app
from server.tool_formats import detect_format
from server.tools import FALLBACK_SYSTEM, FORMATS, fallback_messages
from servers import Served, engine_factory, serve

MODEL = "tiny-llama"
PINNED = {"speculative": {"num_draft_tokens": 3}}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Weather(BaseModel):
    city: str = Field(max_length=10)
    unit: Literal["c", "f"]


class Lookup(BaseModel):
    query: str = Field(max_length=12)
    limit: int = Field(ge=1, le=9)


TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": Weather.model_json_schema()},
    },
    {"type": "function", "function": {"name": "lookup", "parameters": Lookup.model_json_schema()}},
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
MODELS = {"get_weather": Weather, "lookup": Lookup}

# A Hermes-style template that takes tools (as Qwen's and Hermes' do).
TOOL_TEMPLATE = (
    "{% if messages[0]['role'] == 'tool' %}{{ raise_exception('a tool result needs a call before it') }}{% endif %}"
    "{% if tools %}<|system|>\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call with <tool_call>{json}</tool_call>.{{ eos_token }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir):
    """A tiny Llama with room for tool descriptions in its prompt (2,048 positions)."""
    root = tmp_path_factory.mktemp("tools")
    return build_model_dir(root / "m", tokenizer_dir, "LlamaForCausalLM", max_position_embeddings=2048)


# The served model (named by the module's MODEL) and its tokenizer, for this module and for the syntax
# modules that take them with their own ``model_dir``
@pytest.fixture(scope="module")
def srv(request, model_dir) -> Iterator[Served]:
    with drafted_server(model_dir, request.module.MODEL) as s:
        yield s


@pytest.fixture(scope="module")
def tok(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def template_model(root, tokenizer_dir, template: str, tokenizer=None):
    """A tiny Llama with room for tool descriptions in its prompt (2,048 positions) under ``root``, its
    tokenizer (``tokenizer(model_dir)`` where the test adds tokens, else the tests' own) carrying
    ``template``."""
    d = build_model_dir(root / "m", tokenizer_dir, "LlamaForCausalLM", max_position_embeddings=2048)
    tok = tokenizer(d) if tokenizer is not None else transformers.AutoTokenizer.from_pretrained(d)
    tok.chat_template = template
    tok.save_pretrained(d)
    return d


def special_tokenizer(*tokens: str):
    """A tokenizer for :func:`template_model`: the tests' own with ``tokens`` added as special tokens
    (a family's markup, its roles), within the tests' vocabulary."""

    def make(model_dir) -> transformers.PreTrainedTokenizerFast:
        tok = transformers.AutoTokenizer.from_pretrained(model_dir)
        tok.add_tokens(list(tokens), special_tokens=True)
        assert len(tok) <= VOCAB
        return tok

    return make


@contextmanager
def drafted_server(model_dir, name: str) -> Iterator[Served]:
    """A real server for ``model_dir`` named ``name``, drafting with the model itself (4 tokens)."""
    factory = engine_factory(model_dir, draft_model=str(model_dir), num_speculative_tokens=4, max_model_len=2048)
    with serve(create_app(ServerSettings(served_model_name=name), factory)) as s:
        yield s


def assembled_calls(chunks) -> list[tuple[str, str]]:
    """The (name, arguments) of each call a stream's tool-call deltas make, joined by their index."""
    calls: dict[int, list[str]] = {}
    for d in (d for chunk in chunks for ch in chunk.choices for d in ch.delta.tool_calls or []):
        calls.setdefault(d.index, ["", ""])
        calls[d.index][0] += d.function.name or ""
        calls[d.index][1] += d.function.arguments or ""
    return [(name, args) for name, args in calls.values()]


def choice_of(client, stream: bool, **kw):
    """A chat request's first choice (``kw``: the whole request), whole or assembled by the SDK's stream
    helper."""
    if not stream:
        return client.chat.completions.create(**kw).choices[0]
    with client.chat.completions.stream(**kw) as s:
        return s.get_final_completion().choices[0]


def check_calls(message, names: set[str]) -> list[tuple[str, dict]]:
    assert message.tool_calls, message
    out = []
    for call in message.tool_calls:
        assert call.type == "function" and isinstance(call.id, str) and call.id
        assert call.function.name in names
        args = json.loads(call.function.arguments)
        MODELS[call.function.name].model_validate(args)  # the schema holds
        out.append((call.function.name, args))
    return out


# A tool whose one value a model may write without end (an open string, as code or a langchain schema has).
RUN = {
    "name": "run",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
}


def check_closed_within_the_budget(srv: Served, client, model: str) -> None:
    """A forced call of :data:`RUN`, written by a model that writes its value without end (a logit bias:
    "a" above all, a string opened with ``"`` alone, never the end of the output) under a ``max_tokens`` a
    little over the shortest call: cut where closing is off (the budget bites), whole where it is on
    (``tool_calls``, the arguments JSON with the code begun), streamed as whole, with speculation as
    without."""
    fmt = srv.app.state.augur.tool_format
    so = StructuredOutput("grammar", fmt.grammar([RUN], True), None, "tool_choice", closers=fmt.closers)
    state = srv.engine.grammars.start(so, left=10_000)
    assert state.closing is not None  # (an ending from the start: the call can be closed)
    shortest = len(ending(state.matcher, state.closing, torch.empty(state.words, dtype=torch.int32)))
    tok = srv.engine.tokenizer
    quoting = [t for t in range(len(tok)) if '"' in tok.decode([t]) and tok.decode([t]) != '"']
    bias = {str(t): -100 for t in [tok.eos_token_id, *quoting]} | {str(tok.convert_tokens_to_ids("a")): 100}
    tools = [{"type": "function", "function": RUN}]
    kw = dict(model=model, messages=[{"role": "user", "content": "Run it."}], tools=tools, tool_choice="required",
              temperature=0, max_tokens=shortest + 12)  # fmt: skip
    cut = client.chat.completions.create(**kw, extra_body={"logit_bias": bias, "close_at_max_tokens": False})
    assert cut.choices[0].finish_reason == "length" and not cut.choices[0].message.tool_calls, (
        shortest,
        cut.choices[0],
    )
    whole = client.chat.completions.create(**kw, extra_body={"logit_bias": bias})
    assert whole.choices[0].finish_reason == "tool_calls", whole.choices[0]
    [call] = whole.choices[0].message.tool_calls
    assert call.function.name == "run" and json.loads(call.function.arguments)["code"]
    streamed = assembled_calls(client.chat.completions.create(**kw, stream=True, extra_body={"logit_bias": bias}))
    assert streamed == [("run", call.function.arguments)]
    plain = client.chat.completions.create(**kw, extra_body={"logit_bias": bias, "speculative": {"enabled": False}})
    assert [c.function.arguments for c in plain.choices[0].message.tool_calls] == [call.function.arguments]


def create(client, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 200)
    kw.setdefault("messages", ASK)
    return client.chat.completions.create(model=MODEL, extra_body=PINNED, **kw)


def test_required_makes_valid_calls_and_one_when_parallel_calls_are_off(client):
    r = create(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls"
    assert len(check_calls(r.choices[0].message, {"get_weather", "lookup"})) == 1
    assert r.usage.speculative["draft_tokens"] > 0 and r.usage.speculative["forced_tokens"] > 0
    r = create(client, tools=TOOLS, tool_choice="required", temperature=1.0, seed=4, n=3)
    for c in r.choices:
        if c.finish_reason != "length":
            check_calls(c.message, {"get_weather", "lookup"})


def test_a_named_choice_calls_that_function(client):
    r = create(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "lookup"}})
    assert r.choices[0].finish_reason == "tool_calls"
    assert [n for n, _ in check_calls(r.choices[0].message, {"lookup"})] == ["lookup"]


def test_streamed_calls_assemble_to_the_non_streamed_ones(client):
    kw = dict(tools=TOOLS, tool_choice="required")
    whole = create(client, **kw).choices[0].message
    with client.chat.completions.stream(
        model=MODEL, messages=ASK, max_tokens=200, temperature=0, extra_body=PINNED, **kw
    ) as s:
        final = s.get_final_completion()
    streamed = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert whole.content is None and streamed.content is None  # (the role delta's content is null, as OpenAI's)
    assert [(c.function.name, c.function.arguments) for c in streamed.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.tool_calls
    ]
    # Raw deltas: the first of each call has its id, type and name; every one has its index.
    raw = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=200, temperature=0, stream=True, extra_body=PINNED, **kw
    )
    deltas = [d for chunk in raw for ch in chunk.choices for d in (ch.delta.tool_calls or [])]
    assert deltas and all(d.index is not None for d in deltas)
    firsts = [d for d in deltas if d.id]
    assert len(firsts) == len(whole.tool_calls) and all(d.function.name and d.type == "function" for d in firsts)
    assert all(d.function.name is None for d in deltas if not d.id)


CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_calls_out_of_the_text(client, stream):
    """Under auto the model writes freely; here a regex makes it write a call, which the parser reads."""
    forced = {
        "structured_outputs": {
            "regex": "Checking\\.\\n" + json.dumps(CALL_TEXT)[1:-1].replace("{", "\\{").replace("}", "\\}")
        }
    }
    kw = dict(
        model=MODEL, messages=ASK, max_tokens=200, temperature=0, tools=TOOLS, tool_choice="auto", extra_body=forced
    )
    msg = choice_of(client, stream, **kw)
    assert msg.finish_reason == "tool_calls"
    assert msg.message.content == "Checking."
    assert check_calls(msg.message, {"get_weather"}) == [("get_weather", {"city": "Paris", "unit": "c"})]


@pytest.mark.parametrize("lead", ["Let me check.", "\n  Let me check."])
def test_text_around_a_call_streams_as_it_answers_whole(client, lead):
    """The blank before a call is held back while streaming, so the joined content deltas equal the
    whole answer's content: the text before the call as written, then the text after it."""
    text = lead + "\n\n" + CALL_TEXT + "\nI called it."
    forced = {"structured_outputs": {"regex": re.escape(text)}}
    kw = dict(model=MODEL, messages=ASK, max_tokens=200, temperature=0, tools=TOOLS, tool_choice="auto",
              extra_body=forced)  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0].message
    assert whole.content == lead + "\nI called it." and len(whole.tool_calls) == 1
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(stream=True, **kw)
                       if ch.choices)  # fmt: skip
    assert streamed == whole.content


TWO_CALLS = CALL_TEXT + "\n" + CALL_TEXT.replace("Paris", "Oslo")


@pytest.mark.parametrize("stream", [False, True])
def test_auto_returns_the_first_call_alone_when_parallel_calls_are_off(client, stream):
    """vLLM's rule: with ``parallel_tool_calls`` false, of the calls a turn writes only the first is
    returned (the grammar makes one under required; under auto the model writes freely)."""
    forced = {"structured_outputs": {"regex": json.dumps(TWO_CALLS)[1:-1].replace("{", "\\{").replace("}", "\\}")}}

    def calls(parallel: bool) -> list:
        kw = dict(model=MODEL, messages=ASK, max_tokens=200, temperature=0, tools=TOOLS, tool_choice="auto",
                  parallel_tool_calls=parallel, extra_body=forced)  # fmt: skip
        msg = choice_of(client, stream, **kw)
        assert msg.finish_reason == "tool_calls" and not msg.message.content
        return check_calls(msg.message, {"get_weather"})

    paris, oslo = ("get_weather", {"city": "Paris", "unit": "c"}), ("get_weather", {"city": "Oslo", "unit": "c"})
    assert calls(True) == [paris, oslo]
    assert calls(False) == [paris]


def test_none_shows_the_tools_as_vllm_does_unless_the_server_leaves_them_out(client, model_dir):
    """Under tool_choice none the prompt is auto's (the model sees the tools; the conversation's cached
    prefix holds); ``--exclude-tools-when-tool-choice-none`` renders it without them."""

    def prompt_tokens(c, **kw) -> int:
        return c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, **kw).usage.prompt_tokens

    bare = prompt_tokens(client)
    assert prompt_tokens(client, tools=TOOLS, tool_choice="none") == prompt_tokens(client, tools=TOOLS) > bare
    settings = ServerSettings(served_model_name=MODEL, exclude_tools_when_tool_choice_none=True)
    with serve(create_app(settings, engine_factory(model_dir, max_model_len=2048))) as s:
        with openai.OpenAI(base_url=s.base + "/v1", api_key="x", max_retries=0) as c:
            assert prompt_tokens(c, tools=TOOLS, tool_choice="none") == bare < prompt_tokens(c, tools=TOOLS)


STRICT = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]


class Verdict(BaseModel):
    ok: bool
    score: int = Field(ge=0, le=9)


def test_auto_with_a_structured_answer_answers_to_the_schema_or_calls(client, tok):
    """Under auto a response_format (openai-agents' output_type beside its tools) constrains the
    answer, not the turn: the output is the schema's JSON, or calls whose arguments hold to their
    strict tools' schemas. Pushed off the answer's first character, the random model calls."""
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": Verdict.model_json_schema()}}
    kw = dict(model=MODEL, messages=ASK, max_tokens=200, temperature=0, tools=STRICT, tool_choice="auto",
              response_format=fmt, extra_body=PINNED)  # fmt: skip
    answer = client.chat.completions.create(**kw).choices[0]
    assert not answer.message.tool_calls and answer.finish_reason == "stop"
    Verdict.model_validate_json(answer.message.content)
    angle = {str(i): 100 for i in range(tok.vocab_size) if tok.decode([i]).startswith("<")}
    called = client.chat.completions.create(**{**kw, "logit_bias": angle}).choices[0]
    assert called.finish_reason == "tool_calls" and not called.message.content
    assert check_calls(called.message, set(MODELS))  # each call's arguments validate against its schema


def test_strict_tools_under_auto_hold_the_arguments_to_their_schemas(tok):
    """The grammar auto gets when a tool says strict, read with llguidance on the served tokenizer:
    text, text then calls, and loose tools' any object pass; a strict tool's wrong arguments, an
    unknown name, and a second call when parallel calls are off do not."""
    llg = pytest.importorskip("llguidance")
    import llguidance.hf

    functions = [{**STRICT[0]["function"]}, {**TOOLS[1]["function"]}]
    lexicon = llguidance.hf.from_tokenizer(tok)

    def reads(text: str, parallel: bool = True) -> bool:
        grammar = llg.LLMatcher.grammar_from_lark(FORMATS["hermes"].auto_grammar(functions, parallel))
        m = llg.LLMatcher(lexicon, grammar, log_level=0)
        return bool(m.consume_tokens(tok.encode(text, add_special_tokens=False))) and m.is_accepting()

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
    assert reads("No call here.") and reads("Checking.\n" + call) and reads(call + "\n" + call)
    assert reads(call + "\n") and reads("a " + call + "\n" + call + "\nDone.")  # text after the calls: content
    assert not reads(call + "\nThen " + call)  # (text may follow the calls; strict calls do not follow that text)
    assert reads('<tool_call>\n{"name": "lookup", "arguments": {"anything": [1]}}\n</tool_call>')  # not strict
    assert not reads(call.replace('"unit": "c"', '"unit": "k"'))
    assert not reads(call.replace("get_weather", "get_time"))
    assert not reads(call + "\n" + call, parallel=False)


def test_strict_tools_under_auto_leave_a_text_answer_to_max_tokens(client, tok):
    """Text or calls has no structure for max_tokens to close: a text answer cut by the limit ends
    as it would without the grammar (length), not forced to an early end."""
    kw = dict(model=MODEL, messages=ASK, max_tokens=6, temperature=0, tool_choice="auto",
              logit_bias={str(tok.eos_token_id): -100}, extra_body=PINNED)  # fmt: skip
    loose, strict = (client.chat.completions.create(tools=t, **kw) for t in (TOOLS, STRICT))
    assert strict.choices[0].finish_reason == loose.choices[0].finish_reason == "length"
    assert strict.usage.completion_tokens == loose.usage.completion_tokens == 6 and strict.choices[0].message.content
    # (the texts may differ: a grammar's text is whole UTF-8 characters, where the random model writes stray bytes)
    bad = {"type": "json_schema", "json_schema": {"name": "never", "schema": False}}  # admits nothing: a 400
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(tools=STRICT, response_format=bad, **kw)


def test_auto_without_a_call_is_content_and_none_parses_nothing(client):
    r = create(client, tools=TOOLS, tool_choice="auto", max_tokens=8)
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason in ("stop", "length")
    forced = {"structured_outputs": {"regex": json.dumps(CALL_TEXT)[1:-1].replace("{", "\\{").replace("}", "\\}")}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, temperature=0, tools=TOOLS,
                                       tool_choice="none", extra_body=forced)  # fmt: skip
    assert not r.choices[0].message.tool_calls and r.choices[0].message.content == CALL_TEXT


def test_history_with_tool_calls_and_results(client, model_dir):
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
                }
            ],
        },  # fmt: skip
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "21 C, sunny"},
    ]
    r = create(client, messages=history, tools=TOOLS, max_tokens=6)
    # This model's template takes no tools: the history is the Hermes-style conversation, written out
    # here by hand, and the model sees exactly its rendering (the same tokens, so the same greedy text).
    tools_text = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in TOOLS)
    hermes = [
        {"role": "system", "content": FALLBACK_SYSTEM.format(tools=tools_text)},
        ASK[0],
        {"role": "assistant", "content": CALL_TEXT},
        {"role": "user", "content": "<tool_response>\n21 C, sunny\n</tool_response>"},
    ]
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(hermes, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    assert r.usage.prompt_tokens == len(ids)
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, extra_body=PINNED)
    assert r.choices[0].message.content == plain.choices[0].text
    assert r.choices[0].finish_reason == plain.choices[0].finish_reason


def test_tokenize_renders_the_tools_as_chat_does(client, http):
    """vLLM's /tokenize takes the tools beside the messages: the count is the prompt chat would run."""
    r = create(client, tools=TOOLS, max_tokens=1)
    counted = http.post("/tokenize", json={"model": MODEL, "messages": ASK, "tools": TOOLS}).json()["count"]
    assert counted == r.usage.prompt_tokens > http.post("/tokenize", json={"messages": ASK}).json()["count"]
    for body, param in (
        ({"prompt": "a", "tools": TOOLS}, "tools"),  # tools go with messages
        ({"messages": ASK, "chat_template": "{{ 1 }}"}, "chat_template"),  # refused by name, as on chat
        ({"messages": ASK, "tool_spec": []}, "tool_spec"),  # no field is ignored in silence
    ):
        bad = http.post("/tokenize", json=body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text


@pytest.mark.parametrize(
    "body,param",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
                "tool_choice": "required",
            },
            "tool_choice",
        ),
    ],
)
def test_bad_tool_requests_are_400(http, body, param):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert param in (err["param"] or "") or param in err["message"], err


def with_template(tmp_path, model_dir, template: str):
    """A copy of the model at ``model_dir`` whose tokenizer's chat template is ``template``."""
    d = tmp_path / "tool-model"
    shutil.copytree(model_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    for f in d.glob("chat_template.*"):
        f.unlink()
    return d


def test_a_template_that_takes_tools_renders_them(tmp_path, model_dir):
    d = with_template(tmp_path, model_dir, TOOL_TEMPLATE)
    with serve(create_app(ServerSettings(served_model_name=MODEL), engine_factory(d, max_model_len=2048))) as s:
        eng = s.async_engine
        assert eng.chat_template_takes_tools and detect_format(eng.chat_template).name == "hermes"
        text = eng.engine.tokenizer.decode(eng.render_chat(ASK, True, TOOLS))
        assert "get_weather" in text and "Call with <tool_call>" in text
        with openai.OpenAI(base_url=s.base + "/v1", api_key="unused", max_retries=0) as c:
            r = create(c, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
            check_calls(r.choices[0].message, {"get_weather"})
            with pytest.raises(openai.BadRequestError) as e:  # the template's own check: a 400, not a 500
                create(c, messages=[{"role": "tool", "tool_call_id": "x", "content": "1"}], tools=TOOLS)
            assert "a tool result needs a call before it" in e.value.response.json()["error"]["message"]


# Phi-4-mini's tool syntax, as a template that takes tools writes it (the tools between <|tool|> markers in
# the system turn, an assistant's calls as one functools[...] list).
PHI4_TEMPLATE = (
    "{% if tools %}<|system|>Use the tools.<|tool|>{{ tools | tojson }}<|/tool|><|end|>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] or '' }}{% if m.get('tool_calls') %}functools["
    "{% for c in m['tool_calls'] %}{% set f = c['function'] %}"
    "{{ {'name': f['name'], 'arguments': f['arguments']} | tojson }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}]{% endif %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


# Granite 3's tool syntax, as its templates write it: the tools in an available_tools turn, an assistant's
# calls as one JSON list (each call's function object) after <|tool_call|>, a result in a tool_response turn.
GRANITE_TEMPLATE = (
    "{% if tools %}<|start_of_role|>available_tools<|end_of_role|>{{ tools | tojson }}<|end_of_text|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' and m.get('tool_calls') %}"
    "<|start_of_role|>assistant<|end_of_role|><|tool_call|>"
    "{{ m['tool_calls'] | map(attribute='function') | list | tojson }}<|end_of_text|>\n"
    "{% elif m['role'] == 'tool' %}<|start_of_role|>tool_response<|end_of_role|>{{ m['content'] }}<|end_of_text|>\n"
    "{% else %}<|start_of_role|>{{ m['role'] }}<|end_of_role|>{{ m['content'] or '' }}<|end_of_text|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start_of_role|>assistant<|end_of_role|>{% endif %}"
)


# The syntaxes that write one JSON list of calls after an opening of their own: the template, the syntax
# it is detected as, and what its history writes for a tool result.
JSON_LISTS = {
    "phi4_mini_json": (PHI4_TEMPLATE, "<|tool|>sunny<|end|>"),
    "granite": (GRANITE_TEMPLATE, "<|start_of_role|>tool_response<|end_of_role|>sunny"),
}


@pytest.mark.parametrize("syntax", list(JSON_LISTS))
def test_json_list_calls_are_written_and_read_in_their_syntax(tmp_path, model_dir, syntax):
    template, result = JSON_LISTS[syntax]
    d = with_template(tmp_path, model_dir, template)
    fmt = detect_format(template)
    assert fmt.name == syntax
    with serve(create_app(ServerSettings(served_model_name=MODEL), engine_factory(d, max_model_len=2048))) as s:
        with openai.OpenAI(base_url=s.base + "/v1", api_key="unused", max_retries=0) as c:
            r = create(c, tools=TOOLS, tool_choice="required", logprobs=True)
            calls = check_calls(r.choices[0].message, {"get_weather", "lookup"})
            text = "".join(t.token for t in r.choices[0].logprobs.content)
            assert text.startswith(fmt.open + "{") and r.choices[0].finish_reason == "tool_calls", text
            # Under auto the model's own list is read as its calls (a regex makes it write one).
            forced = {"structured_outputs": {"regex": "OK " + re.escape(fmt.render(calls))}}
            auto = c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, temperature=0, tools=TOOLS,
                                             extra_body={**PINNED, **forced})  # fmt: skip
            assert auto.choices[0].message.content == "OK"
            assert check_calls(auto.choices[0].message, set(MODELS)) == calls
        # The history's calls go back to the model in that syntax.
        call = r.choices[0].message.tool_calls[0]
        history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                   {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]  # fmt: skip
        got = httpx.post(s.base + "/tokenize", json={"model": MODEL, "messages": history, "tools": TOOLS}).json()
        prompt = transformers.AutoTokenizer.from_pretrained(d).decode(got["tokens"])
        want = f'{fmt.open}{{"name": "{call.function.name}", "arguments": {call.function.arguments}}}]'
        assert want in prompt and result in prompt, prompt


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_syntax_reads_what_it_writes_and_its_grammar_compiles(name, srv):
    fmt = FORMATS[name]
    calls = [("get_weather", {"city": "Oslo", "unit": "c"}), ("lookup", {"query": "x", "limit": 2})]
    content, parsed = fmt.parse(fmt.render(calls))
    assert content is None and [(c.name, json.loads(c.arguments)) for c in parsed] == calls
    assert fmt.parse("plain words") == ("plain words", [])
    cut = 3 + len(fmt.close)  # characters cut off the end: inside the last call, past the calls' closing
    # Cut short inside the second call: the whole first call is a call, the cut one neither call nor content.
    content, parsed = fmt.parse(fmt.render(calls)[:-cut], cut=True)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in parsed] == calls[:1]
    # Whole calls followed by words the model wrote: the calls, and the words as content.
    content, parsed = fmt.parse(fmt.render(calls) + " Done.")
    assert content == "Done." and len(parsed) == 2
    if not fmt.at_start_only:  # calls after more text are calls too (vLLM reads every call in an output)
        content, parsed = fmt.parse("First. " + fmt.render(calls[:1]) + " Then. " + fmt.render(calls[1:]) + " End.")
        assert content == "First.\nThen.\nEnd." and [(c.name, json.loads(c.arguments)) for c in parsed] == calls
        # A marker in prose opens no call; the calls after it are still read (vLLM finds every call).
        prose = f"Calls open with {fmt.marker} here."
        content, parsed = fmt.parse(prose + " " + fmt.render(calls))
        assert content == prose and [(c.name, json.loads(c.arguments)) for c in parsed] == calls
        content, parsed = fmt.parse(fmt.render(calls[:1]) + " " + prose + " " + fmt.render(calls[1:]))
        assert content == prose and [(c.name, json.loads(c.arguments)) for c in parsed] == calls
        # Cut in a later run, or in words after the calls: the words written before the cut are content.
        content, parsed = fmt.parse(
            "First. " + fmt.render(calls[:1]) + " Then. " + fmt.render(calls[1:])[:-cut], cut=True
        )
        assert content == "First.\nThen." and [(c.name, json.loads(c.arguments)) for c in parsed] == calls[:1]
        content, parsed = fmt.parse(fmt.render(calls) + " Now I will", cut=True)
        assert content == "Now I will" and len(parsed) == 2
        content, parsed = fmt.parse(fmt.render(calls) + " Now " + fmt.marker[:-1], cut=True)
        assert content == "Now" and len(parsed) == 2  # (the limit cut the marker: no markup as content)
        # The cut call begins at its own marker: a marker in the prose before it stays prose.
        prose = f"I used {fmt.marker} tags."
        content, parsed = fmt.parse(fmt.render(calls[:1]) + f" {prose} " + fmt.render(calls[1:])[:-cut], cut=True)
        assert content == prose and [c.name for c in parsed] == ["get_weather"]
    if fmt.name_sep:  # a call written inside the cut call's arguments (code about calls) is none
        inner = fmt.render([("lookup", {})])
        cut_call = fmt.render([("run", {"code": "x"})]).replace('"x"', json.dumps(f"s = '{inner}'\nprint(s)"))
        inside = cut_call[: -(8 + len(fmt.call_close + fmt.close))]  # (in the arguments' JSON)
        content, parsed = fmt.parse(fmt.render(calls[:1]) + inside, cut=True)
        assert content is None and [c.name for c in parsed] == ["get_weather"], (content, parsed)
    from engine.request.structured import StructuredOutput

    grammar = fmt.grammar([t["function"] for t in TOOLS], parallel=True)
    srv.engine.grammars.compile(StructuredOutput("grammar", grammar, None, "tool_choice"))


def test_fallback_history_is_hermes_style():
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "ok", "tool_call_id": "c"},
    ]
    out = fallback_messages(msgs, [t["function"] for t in TOOLS])
    assert out[0]["role"] == "system" and "Be brief." in out[0]["content"] and "get_weather" in out[0]["content"]
    assert out[1] == {"role": "assistant", "content": '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'}
    assert out[2] == {"role": "user", "content": "<tool_response>\nok\n</tool_response>"}
