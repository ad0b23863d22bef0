"""Gemma 4's tool calls as its tokenizers have them, through a real server and the official openai SDK.

Gemma 4 writes each call as ``<|tool_call>call:NAME{key:value,...}<tool_call|>``, its arguments in its
own notation (bare keys, strings between ``<|"|>`` markers, written raw), and the three markers are
tokens of its vocabulary. The tokenizer here is the tests' own with those markers added as special
tokens, under a template of our own in Gemma's turn conventions."""

from __future__ import annotations

import json

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
from server.tool_gemma4 import GEMMA4, QUOTE, read_value, write_value

MODEL = "tiny-gemma4"
ASK = [{"role": "user", "content": "Weather in Paris?"}]
srv, tok = test_tools.srv, test_tools.tok  # (fixtures: this module's model_dir, served)
BEGIN, END = GEMMA4[:2]
TEMPLATE = (
    "{% if tools %}<start_of_turn>system\nTools: {{ tools | tojson }}<end_of_turn>\n{% endif %}"
    "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}<|tool_call>call:{{ c['function']['name'] }}"
    "{{ c['function']['arguments'] | tojson }}<tool_call|>{% endfor %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
CALL = ("get_weather", {"city": "Paris", "unit": "c"})

gemma4_tokenizer = special_tokenizer(*GEMMA4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir):
    return template_model(tmp_path_factory.mktemp("gemma4"), tokenizer_dir, TEMPLATE, gemma4_tokenizer)


def marker(tok, piece: str) -> str:
    return f"<[{tok.convert_tokens_to_ids(piece)}]>"


def create(client, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 200)
    kw.setdefault("messages", ASK)
    return client.chat.completions.create(model=MODEL, **kw)


def test_values_read_as_written_and_a_cut_one_is_none():
    value = {"s": 'a,b}c:"d"\n', "n": -1.5e3, "i": 7, "t": True, "f": False, "z": None, "l": [[], {}, ["x", 2]]}
    written = write_value(value)
    assert written.startswith("{f:false,i:7,l:[[],{},[" + QUOTE + "x" + QUOTE + ",2]],n:-1500.0,s:" + QUOTE)  # (sorted)
    assert read_value(written, 0) == (value, len(written))
    for k in range(1, len(written)):  # cut anywhere: no value (a number's digits may go on)
        assert read_value(written[:k], 0) is None, written[:k]
    assert read_value("{city:Paris,n:1}", 0)[0] == {"city": "Paris", "n": 1}  # (a bare word: its string)
    # Keys are written raw: blanks, a leading digit, a dollar, letters beyond ASCII
    odd = {"first name": "Ann", "1st": 2, "$ref": "x", "città": True}
    assert read_value(write_value(odd), 0)[0] == odd


def test_the_template_picks_the_syntax_and_the_grammars_name_the_markers(srv, tok):
    fmt = srv.app.state.augur.tool_format
    assert fmt.name == "gemma4" and fmt == detect_format(TEMPLATE).bind(tok)
    assert sorted(fmt.special_ids) == sorted(tok.convert_tokens_to_ids(list(GEMMA4)))
    functions = [t["function"] for t in TOOLS]
    llt = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB, eos_token=[1])
    rendered = fmt.render([CALL, ("lookup", {"query": "tides, today", "limit": 2})])
    assert rendered == (
        f"{BEGIN}call:get_weather{{city:{QUOTE}Paris{QUOTE},unit:{QUOTE}c{QUOTE}}}{END}"
        f"{BEGIN}call:lookup{{limit:2,query:{QUOTE}tides, today{QUOTE}}}{END}"  # (keys sorted, as the template)
    )
    as_model = ids_of(tok, rendered)  # (each marker's text encodes as its one token)
    assert as_model.count(tok.convert_tokens_to_ids(QUOTE)) == 6
    for grammar in (fmt.grammar(functions, True), fmt.auto_grammar(functions, True)):
        m = llguidance.LLMatcher(llt, grammar, log_level=0)
        assert m.consume_tokens(as_model) and m.is_accepting(), m.get_error()
    # The grammar holds the schema: an unknown function, a city past its 10 characters, a unit not in its
    # enum, a missing required key are refused.
    for bad in [("delete_all", {}), ("get_weather", {"city": "Llanfairpwll", "unit": "c"}),
                ("get_weather", {"city": "Oslo", "unit": "k"}), ("get_weather", {"city": "Oslo"})]:  # fmt: skip
        m = llguidance.LLMatcher(llt, fmt.grammar(functions, True), log_level=0)
        assert not (m.consume_tokens(ids_of(tok, fmt.render([bad]))) and m.is_accepting()), bad
    # Keys the schema names, however written, and any key of a tool without a schema: the grammar writes
    # what the reader reads
    odd = {"$ref": "x", "1st": 2, "città": True, "first name": "Ann"}
    for tool in ({"name": "f", "parameters": {"type": "object", "properties": {k: {} for k in odd}}}, {"name": "f"}):
        m = llguidance.LLMatcher(llt, fmt.grammar([tool], False), log_level=0)
        assert m.consume_tokens(ids_of(tok, fmt.render([("f", odd)]))) and m.is_accepting(), m.get_error()
        assert [json.loads(c.arguments) for c in fmt.parse(fmt.render([("f", odd)]))[1]] == [odd]
    content, calls = fmt.parse("Let me see. " + rendered + " Done.")
    assert content == "Let me see.\nDone."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        CALL,
        ("lookup", {"query": "tides, today", "limit": 2}),
    ]
    # Cut inside the second call: the first is a call, the cut one neither call nor content.
    content, calls = fmt.parse(rendered[: rendered.rindex("query")], cut=True)
    assert content is None and [c.name for c in calls] == ["get_weather"]
    # Read as they are written, a character at a time: the name once its arguments open, then the arguments.
    scanner, events = fmt.scanner(), []
    for ch in rendered:
        events += scanner.feed(ch)
    assert [e[0] for e in events] == ["call", "args", "end"] * 2
    assert [json.loads(e[1]) for e in events if e[0] == "args"] == [CALL[1], {"query": "tides, today", "limit": 2}]


@pytest.mark.parametrize("stream", [False, True])
def test_forced_calls_hold_the_schema(client, stream):
    choice = choice_of(client, stream, model=MODEL, messages=ASK, max_tokens=200, temperature=0, tools=TOOLS,
                       tool_choice="required", parallel_tool_calls=False)  # fmt: skip
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    check_calls(choice.message, set(MODELS))
    named = create(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "lookup"}})
    assert [n for n, _ in check_calls(named.choices[0].message, {"lookup"})] == ["lookup"]


def test_a_forced_call_is_closed_within_max_tokens(srv, client):
    """A string ends at its marker (none of JSON's closers): a model that writes its call's string
    without end gets the string and the call closed within the budget."""
    check_closed_within_the_budget(srv, client, MODEL)


def test_a_streamed_forced_call_is_the_whole_one(client):
    kw = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    whole = create(client, **kw).choices[0].message
    chunks = list(create(client, stream=True, **kw))
    assert assembled_calls(chunks) == [(c.function.name, c.function.arguments) for c in whole.tool_calls]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_a_call_after_text(client, tok, stream):
    """Under auto the model writes freely; here a grammar makes it write text, then a call with its
    markers as the tokens they are: the API returns the call and the text as content."""
    begin, end, q = (marker(tok, m) for m in GEMMA4)
    grammar = f'start: "Checking." {begin} "call:get_weather{{city:" {q} "Paris" {q} ",unit:" {q} "c" {q} "}}" {end}'
    kw = dict(model=MODEL, messages=ASK, max_tokens=200, temperature=0, tools=TOOLS, tool_choice="auto",
              extra_body={"structured_outputs": {"grammar": grammar}})  # fmt: skip
    choice = choice_of(client, stream, **kw)
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    assert check_calls(choice.message, {"get_weather"}) == [CALL]
