"""Kimi K2's tool calls as its tokenizers have them, through a real server and the official openai SDK.

Kimi's call markers (``<|tool_calls_section_begin|>``, ``<|tool_call_begin|>``,
``<|tool_call_argument_begin|>``, ``<|tool_call_end|>``, ``<|tool_calls_section_end|>``) are tokens of
its vocabulary, and what a call names is its id, ``functions.NAME:INDEX``: the API returns the id the
model wrote, and a history's calls reach the template with ids of that shape (a client's own ids
rewritten by their place in the conversation, the tool results with them). The tokenizer here is the
tests' own with Kimi's markers and role tokens added as special tokens, under a template of our own in
Kimi's conventions (the tools declared in a system turn, each history call written by its id, each
result after ``## Return of`` its call's id)."""

from __future__ import annotations

import json
import re

import llguidance
import llguidance.hf
import pytest
import test_tools
from test_tools import (
    MODELS,
    TOOLS,
    assembled_calls,
    check_calls,
    check_closed_within_the_budget,
    choice_of,
    special_tokenizer,
    template_model,
)
from test_tools_mistral import ids_of

from conftest import VOCAB
from server.tool_formats import detect_format
from server.tool_kimi import KIMI, KIMI_ID

MODEL = "tiny-kimi"
ASK = [{"role": "user", "content": "Weather in Paris?"}]
srv, tok = test_tools.srv, test_tools.tok  # (fixtures: this module's model_dir, served)
SECTION_BEGIN, CALL_BEGIN, ARGS, CALL_END, SECTION_END = KIMI
ROLES = ["<|im_user|>", "<|im_assistant|>", "<|im_end|>"]  # (the tests' vocabulary has room for three)
TEMPLATE = (
    "{% if tools %}system tool_declare: {{ tools | tojson }}<|im_end|>{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}<|im_user|>user: {{ m['content'] }}<|im_end|>"
    "{% elif m['role'] == 'assistant' %}<|im_assistant|>assistant: {{ m['content'] or '' }}"
    "{% if m.get('tool_calls') %}<|tool_calls_section_begin|>{% for c in m['tool_calls'] %}"
    "<|tool_call_begin|>{{ c['id'] }}<|tool_call_argument_begin|>{% if c['function']['arguments'] is string %}"
    "{{ c['function']['arguments'] }}{% else %}{{ c['function']['arguments'] | tojson }}{% endif %}<|tool_call_end|>"
    "{% endfor %}<|tool_calls_section_end|>{% endif %}<|im_end|>"
    "{% elif m['role'] == 'tool' %}system tool: ## Return of {{ m['tool_call_id'] }}\n"
    "{{ m['content'] }}<|im_end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant: {% endif %}"
)
CALL = ("get_weather", {"city": "Paris", "unit": "c"})


kimi_tokenizer = special_tokenizer(*KIMI, *ROLES)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir):
    return template_model(tmp_path_factory.mktemp("kimi"), tokenizer_dir, TEMPLATE, kimi_tokenizer)


def marker(tok, piece: str) -> str:
    return f"<[{tok.convert_tokens_to_ids(piece)}]>"


def create(client, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 200)
    kw.setdefault("messages", ASK)
    return client.chat.completions.create(model=MODEL, **kw)


def check_ids(message) -> list[int]:
    """Each call's id is Kimi's, naming the call's function; the indices they carry."""
    indices = []
    for call in message.tool_calls:
        m = KIMI_ID.fullmatch(call.id)
        assert m is not None and m.group(1) == call.function.name, call.id
        indices.append(int(m.group(2)))
    return indices


def test_the_template_picks_the_syntax_and_the_grammars_name_the_markers(srv, tok):
    fmt = srv.app.state.augur.tool_format
    assert fmt.name == "kimi_k2" and fmt == detect_format(TEMPLATE).bind(tok)
    assert sorted(fmt.special_ids) == sorted(tok.convert_tokens_to_ids(list(KIMI)))
    functions = [t["function"] for t in TOOLS]
    llt = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB, eos_token=[1])
    rendered = fmt.render([CALL, ("lookup", {"query": "x", "limit": 2})])
    assert (
        f"{CALL_BEGIN}functions.get_weather:0{ARGS}" in rendered and f"{CALL_BEGIN}functions.lookup:1{ARGS}" in rendered
    )
    as_model = ids_of(tok, rendered)  # (each marker's text encodes as its one token)
    assert as_model.count(tok.convert_tokens_to_ids(CALL_BEGIN)) == 2
    for grammar in (fmt.grammar(functions, True), fmt.auto_grammar(functions, True)):
        m = llguidance.LLMatcher(llt, grammar, log_level=0)
        assert m.consume_tokens(as_model) and m.is_accepting(), m.get_error()
    # The grammar names the function: a call of one the request does not offer is refused.
    m = llguidance.LLMatcher(llt, fmt.grammar(functions, True), log_level=0)
    assert not m.consume_tokens(ids_of(tok, fmt.render([("delete_all", {})])))
    content, calls = fmt.parse("Let me see." + rendered)
    assert content == "Let me see." and [(c.name, c.id) for c in calls] == [
        ("get_weather", "functions.get_weather:0"),
        ("lookup", "functions.lookup:1"),
    ]
    # Cut inside the second call: the first is a call, the cut one neither call nor content.
    content, calls = fmt.parse(rendered[: rendered.rindex(CALL_END) - 4], cut=True)
    assert content is None and [c.id for c in calls] == ["functions.get_weather:0"]


@pytest.mark.parametrize("stream", [False, True])
def test_forced_calls_carry_the_ids_the_model_wrote(client, stream):
    choice = choice_of(client, stream, model=MODEL, messages=ASK, max_tokens=200, temperature=0, tools=TOOLS,
                       tool_choice="required", parallel_tool_calls=False)  # fmt: skip
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    check_calls(choice.message, set(MODELS))
    check_ids(choice.message)
    named = create(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "lookup"}})
    assert [n for n, _ in check_calls(named.choices[0].message, {"lookup"})] == ["lookup"]
    check_ids(named.choices[0].message)


def test_a_forced_call_is_closed_within_max_tokens(srv, client):
    """The index and the run of calls end at markers (none of JSON's closers): a model that writes its
    call's string without end gets the call, and the run, closed within the budget."""
    check_closed_within_the_budget(srv, client, MODEL)


def test_a_streamed_forced_call_is_the_whole_one(client):
    kw = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    whole = create(client, **kw).choices[0].message
    chunks = list(create(client, stream=True, **kw))
    assert assembled_calls(chunks) == [(c.function.name, c.function.arguments) for c in whole.tool_calls]
    ids = [d.id for chunk in chunks for ch in chunk.choices for d in ch.delta.tool_calls or [] if d.id]
    assert ids == [c.id for c in whole.tool_calls]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_a_call_by_the_id_the_model_writes(client, tok, stream):
    """Under auto the model writes freely; here a grammar makes it write text, then a call with its
    markers as the tokens they are and an id of its own: the API returns that id."""
    begin, call, args, end, close = (marker(tok, m) for m in KIMI)
    body = json.dumps(json.dumps(CALL[1]))
    grammar = f'start: "Checking." {begin} {call} "functions.get_weather:3" {args} {body} {end} {close}'
    kw = dict(model=MODEL, messages=ASK, max_tokens=200, temperature=0, tools=TOOLS, tool_choice="auto",
              extra_body={"structured_outputs": {"grammar": grammar}})  # fmt: skip
    choice = choice_of(client, stream, **kw)
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    assert check_calls(choice.message, {"get_weather"}) == [CALL]
    assert [c.id for c in choice.message.tool_calls] == ["functions.get_weather:3"]


def test_history_writes_each_call_by_a_kimi_id(client, http, tok):
    """A call with Kimi's id keeps it; one with another id (a client's own) gets the id its place in the
    conversation gives, and the tool result answering it says the same id."""
    args = json.dumps({"city": "Oslo", "unit": "c"})
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "functions.get_weather:0", "type": "function",
             "function": {"name": "get_weather", "arguments": args}},
            {"id": "call_abc", "type": "function", "function": {"name": "lookup", "arguments": '{"query": "x"}'}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "21 C"},
        {"role": "tool", "tool_call_id": "call_abc", "content": "none found"},
    ]  # fmt: skip
    r = create(client, messages=history, tools=TOOLS, max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")
    rendered = tok.decode(http.post("/tokenize", json={"model": MODEL, "messages": history}).json()["tokens"])
    assert f"{CALL_BEGIN}functions.get_weather:0{ARGS}{args}{CALL_END}" in rendered, rendered
    assert f'{CALL_BEGIN}functions.lookup:1{ARGS}{{"query": "x"}}{CALL_END}' in rendered, rendered
    assert re.findall(r"## Return of (\S+)", rendered) == ["functions.get_weather:0", "functions.lookup:1"]
    assert "call_abc" not in rendered


@pytest.mark.parametrize("stream", [False, True])
def test_responses_return_the_ids_the_model_wrote(client, stream):
    """The Responses API's function calls carry the same ids (``call_id``) the chat API returns."""
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    kw = dict(model=MODEL, input="Weather in Paris?", tools=tools, tool_choice="required", max_output_tokens=200,
              temperature=0, parallel_tool_calls=False)  # fmt: skip
    if stream:
        with client.responses.stream(**kw) as s:
            r = s.get_final_response()
    else:
        r = client.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls
    for call in calls:
        m = KIMI_ID.fullmatch(call.call_id)
        assert m is not None and m.group(1) == call.name, call.call_id


def test_an_outputs_repeated_id_and_a_historys_taken_index_are_not_reused(srv):
    """Ids are how tool results find their calls: a second call with the id of the first gets a free
    index, and a client's id renamed in a history takes an index no kept id holds."""
    fmt = srv.app.state.augur.tool_format
    one = fmt.render([CALL])
    _, calls = fmt.parse(one + "Then." + one)
    assert [c.id for c in calls] == ["functions.get_weather:0", "functions.get_weather:1"]
    scanner = fmt.scanner()
    events = [e for k in range(0, 2 * len(one), 7) for e in scanner.feed((one + one)[k : k + 7]) if e[0] == "call"]
    assert events == [
        ("call", "get_weather", "functions.get_weather:0"),
        ("call", "get_weather", "functions.get_weather:1"),
    ]
    history = [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "functions.lookup:0", "type": "function", "function": {"name": "lookup", "arguments": {}}},
            {"id": "mine", "type": "function", "function": {"name": "lookup", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "mine", "content": "x"},
    ]  # fmt: skip
    renamed = fmt.history(history)
    assert [c["id"] for c in renamed[0]["tool_calls"]] == ["functions.lookup:0", "functions.lookup:1"]
    assert renamed[1]["tool_call_id"] == "functions.lookup:1"
    # Calls without ids (the API allows none): each its own, and the results answer them in turn
    call = {"type": "function", "function": {"name": "lookup", "arguments": {}}}
    history = [{"role": "assistant", "content": None, "tool_calls": [call, call]},
               {"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}]  # fmt: skip
    renamed = fmt.history(history)
    assert [c["id"] for c in renamed[0]["tool_calls"]] == ["functions.lookup:0", "functions.lookup:1"]
    assert [m["tool_call_id"] for m in renamed[1:]] == ["functions.lookup:0", "functions.lookup:1"]
