"""The XML tool calls through a real server and the official openai SDK: Qwen3-Coder's and Qwen3.5's
(``<function=NAME>`` with one ``<parameter=KEY>`` element per argument), Seed-OSS's (the same in
``<seed:tool_call>``, a value on its tags' line), GLM-4.5's (``<tool_call>NAME`` with
``<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>`` pairs, a line each), GLM-4.7's (the same without
line ends) and MiniMax-M2's (``<invoke name="NAME">`` elements of ``<parameter name="KEY">`` ones, the
calls in one ``<minimax:tool_call>`` block). The template picks the syntax, forced calls hold every
argument to its schema, calls written under auto are read back with the tools' types (a string
parameter's "123" stays a string), streamed calls assemble to the whole ones, and the history renders
as the template writes it. Each syntax's reading and writing are checked against each other and against
the grammar."""

from __future__ import annotations

import json
from typing import Literal

import llguidance
import llguidance.hf
import pytest
import test_tools
import transformers
from pydantic import BaseModel, Field
from test_tools import (
    MODELS,
    TOOLS,
    assembled_calls,
    check_calls,
    check_closed_within_the_budget,
    choice_of,
    template_model,
)

from conftest import VOCAB
from server.tool_formats import detect_format
from server.tool_xml import GLM45, GLM47, MINIMAX_M2, QWEN3_CODER, SEED_OSS, XmlCallFormat

MODEL = "tiny-qwen-coder"
ASK = [{"role": "user", "content": "Weather in Paris?"}]
srv, tok = test_tools.srv, test_tools.tok  # (fixtures: this module's model_dir, served)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Qwen3.5's conventions in a small template of our own: the tools listed in a system turn, each call an
# XML element, a string argument as its text and any other as JSON.
TEMPLATE = (
    "{% if tools %}<|bos|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    "Call as <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>\n"
    "{% endif %}{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}\n<tool_call>\n<function={{ c['function']['name'] }}>\n"
    "{% for k, v in c['function']['arguments'].items() %}<parameter={{ k }}>\n"
    "{{ v | tojson if v is mapping or (v is sequence and v is not string) else v | string }}\n</parameter>\n"
    "{% endfor %}</function>\n</tool_call>{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)
# GLM-4.5's conventions, likewise: the name after <tool_call>, then a key and a value element a line each.
GLM45_TEMPLATE = (
    "{% if tools %}<|bos|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call as <tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n"
    "...\n</tool_call>\n{% endif %}{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}\n<tool_call>{{ c['function']['name'] }}\n"
    "{% for k, v in c['function']['arguments'].items() %}<arg_key>{{ k }}</arg_key>\n"
    "<arg_value>{{ v | tojson if v is not string else v }}</arg_value>\n{% endfor %}</tool_call>{% endfor %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)
# GLM-4.7's: the same elements without line ends.
GLM47_TEMPLATE = (
    "{% if tools %}<|bos|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call as <tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>..."
    "</tool_call>\n{% endif %}{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function']['name'] }}"
    "{% for k, v in c['function']['arguments'].items() %}<arg_key>{{ k }}</arg_key>"
    "<arg_value>{{ v | tojson if v is not string else v }}</arg_value>{% endfor %}</tool_call>{% endfor %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)
# Seed-OSS's: Qwen's elements in <seed:tool_call>, a value on its tags' line, written as GLM's are.
SEED_TEMPLATE = (
    "{% if tools %}<|bos|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call as <seed:tool_call>\n<function=NAME>\n<parameter=KEY>VALUE</parameter>\n</function>\n</seed:tool_call>\n"
    "{% endif %}{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}\n<seed:tool_call>\n<function={{ c['function']['name'] }}>\n"
    "{% for k, v in c['function']['arguments'].items() %}<parameter={{ k }}>{{ v | tojson if v is not string else v }}"
    "</parameter>\n{% endfor %}</function>\n</seed:tool_call>{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)
# MiniMax-M2's: the tools as <tool> elements, the calls of a turn in one block, a value as GLM's.
MINIMAX_TEMPLATE = (
    "{% if tools %}<|bos|>system\n# Tools\n<tools>\n{% for t in tools %}<tool>{{ t | tojson }}</tool>\n{% endfor %}"
    '</tools>\nCall as <minimax:tool_call>\n<invoke name="tool-name-1">\n<parameter name="param-key-1">param-value-1'
    "</parameter>\n...\n</invoke>\n</minimax:tool_call>\n{% endif %}{% for m in messages %}<|bos|>{{ m['role'] }}\n"
    "{{ m['content'] or '' }}{% if m.get('tool_calls') %}\n<minimax:tool_call>\n{% for c in m['tool_calls'] %}"
    "<invoke name=\"{{ c['function']['name'] }}\">\n{% for k, v in c['function']['arguments'].items() %}"
    '<parameter name="{{ k }}">{{ v | tojson if v is not string else v }}</parameter>\n{% endfor %}</invoke>\n'
    "{% endfor %}</minimax:tool_call>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)
SYNTAXES = {
    "qwen3_coder": (TEMPLATE, QWEN3_CODER),
    "seed_oss": (SEED_TEMPLATE, SEED_OSS),
    "glm45": (GLM45_TEMPLATE, GLM45),
    "glm47": (GLM47_TEMPLATE, GLM47),
    "minimax_m2": (MINIMAX_TEMPLATE, MINIMAX_M2),
}
# The tags each family's tokenizers make special tokens.
SPECIAL_TAGS = {
    **{k: [markup.open, markup.close, *markup.pieces] for k, (_, markup) in SYNTAXES.items()},
    "minimax_m2": ["<minimax:tool_call>", "</minimax:tool_call>"],
}


class Search(BaseModel):
    query: str = Field(max_length=12)
    zip: str = Field(max_length=5)
    exact: bool
    tags: list[str] = Field(max_length=2)
    mode: Literal["fast", "deep"] = "fast"


FUNCTIONS = [t["function"] for t in TOOLS] + [{"name": "search", "parameters": Search.model_json_schema()}]
# The tools closed to other parameters (as strict tools are): a random model would otherwise write
# parameters of its own, of any length.
CLOSED = [
    {"type": "function", "function": {**f, "parameters": {**f["parameters"], "additionalProperties": False}}}
    for f in (t["function"] for t in TOOLS)
]


@pytest.fixture(scope="module", params=list(SYNTAXES))
def syntax(request) -> str:
    return request.param


def xml(syntax: str) -> XmlCallFormat:
    return XmlCallFormat(syntax, SYNTAXES[syntax][1])


def element(fmt: XmlCallFormat, key: str, value: str) -> str:
    """One argument as the syntax writes it."""
    return fmt.markup.param.format(key=key) + value + fmt.markup.value_close


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir, syntax):
    return template_model(tmp_path_factory.mktemp("xml"), tokenizer_dir, SYNTAXES[syntax][0])


def create(client, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 300)
    kw.setdefault("messages", ASK)
    return client.chat.completions.create(model=MODEL, **kw)


# -- the syntax ----------------------------------------------------------------------------------------------
CALLS = [
    ("search", {"query": 'a "b"\nc', "zip": "01234", "exact": True, "tags": ["x"], "mode": "deep"}),
    ("get_weather", {"city": "Oslo", "unit": "c"}),
]


def test_it_reads_what_it_writes_by_the_tools_types(syntax):
    fmt = xml(syntax).for_tools(FUNCTIONS)
    m = fmt.markup
    text = fmt.render(CALLS)
    assert element(fmt, "zip", "01234") in text and element(fmt, "exact", "true") in text
    content, calls = fmt.parse("Let me look.\n\n" + text + "\nDone.")
    assert content == "Let me look.\nDone." and [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    # The schema decides: "01234" is a string here (json would make it 1234, or refuse the leading zero),
    # a template's Python-style True is true, and a parameter no schema names is read as JSON where it parses.
    body = element(fmt, "zip", "01234") + element(fmt, "exact", "True") + element(fmt, "n", "7")
    assert fmt.arguments("search", body) == {"zip": "01234", "exact": True, "n": 7}
    assert fmt.arguments("search", element(fmt, "query", "123")) == {"query": "123"}
    assert xml(syntax).arguments("search", element(fmt, "query", "123")) == {"query": 123}

    # Cut inside the second call: the first is a call, the cut one neither call nor content.
    def in_last_call(written: str) -> str:
        return written[: written.rindex(m.close) - 3]

    content, calls = fmt.parse(in_last_call(text), cut=True)
    assert content is None and [c.name for c in calls] == ["search"]
    content, calls = fmt.parse(fmt.render(CALLS[:1]) + "\nThen.\n" + in_last_call(fmt.render(CALLS[1:])), cut=True)
    assert content == "Then." and [c.name for c in calls] == ["search"]  # (the words before the cut call)
    # A call written inside the cut call's value (code about this syntax; no value can hold the tag that
    # ends it) is none, wherever the limit cut: in the name, an argument's tags, the value, the closing.
    first, code = fmt.render(CALLS[:1]), "s = '" + fmt.render([("lookup", {})]) + "'\nprint(s)"
    cut_call = fmt.render([("run", {"code": code})])
    start, inner = cut_call.index(m.open), cut_call.index(m.open, cut_call.index(code))
    closing = cut_call.rindex(m.close) + 4
    for at in (start + len(m.open) + 2, cut_call.index(code) - 3, inner + 3, cut_call.index(m.close) + 4, closing):
        content, calls = fmt.parse(first + "\n" + cut_call[:at], cut=True)
        assert content is None and [c.name for c in calls] == ["search"], (at, content, calls)
    # The cut call begins at its own marker: a marker in the prose before it stays prose.
    prose = f"I used {m.marker} tags."
    second = fmt.render(CALLS[1:])
    for k in (len(second) - len(in_last_call(second)), 30, len(second) - second.index(m.open) - len(m.open) - 2):
        content, calls = fmt.parse(first + f"\n{prose}\n" + second[:-k], cut=True)
        assert content == prose and [c.name for c in calls] == ["search"], (k, content, calls)
    assert fmt.parse("no calls here") == ("no calls here", [])
    if m.block_open:  # text a model writes between two calls of a block: every call read, the text neither
        i = text.index(m.open, text.index(m.open) + 1)
        content, calls = fmt.parse("Hi.\n" + text[:i] + "and then\n" + text[i:] + "\nBye.")
        assert content == "Hi.\nBye." and [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
        j = text.rindex(m.block_close.strip())  # and between the last call and the block's end
        content, calls = fmt.parse("Hi.\n" + text[:j] + "so\n" + text[j:] + "\nBye.")
        assert content == "Hi.\nBye." and [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    content, calls = fmt.parse("First.\n" + fmt.render(CALLS[:1]) + "\nThen.\n" + fmt.render(CALLS[1:]))
    assert content == "First.\nThen." and [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    content, calls = fmt.parse(f"Calls open with {m.marker} here.\n" + fmt.render(CALLS))
    assert content == f"Calls open with {m.marker} here." and [c.name for c in calls] == [n for n, _ in CALLS]
    # Forced calls stream as they are written: each call's name, then its arguments when it closes.
    scanner, events = fmt.scanner(), []
    for k in range(0, len(text), 7):
        events += scanner.feed(text[k : k + 7])
    assert [e for e in events if e[0] != "args"] == [("call", "search"), ("end",), ("call", "get_weather"), ("end",)]
    assert [json.loads(e[1]) for e in events if e[0] == "args"] == [a for _, a in CALLS]


def test_the_grammars_hold_each_argument_to_its_schema(tok, syntax):
    fmt = xml(syntax).for_tools(FUNCTIONS)
    llt = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB, eos_token=[1])

    def accepts(grammar: str, text: str) -> bool:
        m = llguidance.LLMatcher(llt, grammar, log_level=0)
        return bool(m.consume_tokens(tok.encode(text, add_special_tokens=False))) and m.is_accepting()

    forced, auto = fmt.grammar(FUNCTIONS, True), fmt.auto_grammar(FUNCTIONS, True)
    text = fmt.render(CALLS)
    assert accepts(forced, text) and accepts(auto, text) and accepts(auto, "Sure.\n\n" + text)
    assert accepts(auto, "No call: just words.") and not accepts(forced, "No call.")
    assert not accepts(forced, fmt.render([("search", {**CALLS[0][1], "zip": "0123456"})]))  # maxLength 5
    assert not accepts(forced, fmt.render([("get_weather", {"city": "Oslo", "unit": "k"})]))  # not in its enum
    assert not accepts(forced, fmt.render([("lookup", {"query": "x", "limit": 12})]))  # maximum 9
    assert not accepts(fmt.grammar(FUNCTIONS, False), text)  # one call only
    true = element(fmt, "exact", "true")
    assert accepts(forced, text.replace(true, element(fmt, "exact", "True")))  # a boolean as the templates write it too


def test_a_value_may_hold_the_closing_tags_and_other_parameters_come_where_the_schema_allows(tok, syntax):
    """Code about this syntax holds its tags: a call is read element by element, streamed or whole. A
    tool whose schema does not close its properties takes others beside them (MCP tools often have none)."""
    tools = [{"name": "run", "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}},
             {"name": "closed", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}},
                                               "additionalProperties": False}}]  # fmt: skip
    fmt = xml(syntax).for_tools(tools)
    calls = [
        (
            "run",
            {"code": "print('</tool_call>')\nx = '</function>' + '<arg_key>k</arg_key></invoke>'", "cwd": "/", "n": 2},
        )
    ]
    text = fmt.render(calls)
    assert [(c.name, json.loads(c.arguments)) for c in fmt.parse(text)[1]] == calls
    scanner = fmt.scanner()
    events = [e for k in range(0, len(text), 5) for e in scanner.feed(text[k : k + 5])]
    assert [json.loads(e[1]) for e in events if e[0] == "args"] == [calls[0][1]]
    llt = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB, eos_token=[1])
    forced = fmt.grammar(tools, False)
    for call, ok in ((calls[0], True), (("closed", {"a": 1}), True), (("closed", {"a": 1, "b": 2}), False)):
        m = llguidance.LLMatcher(llt, forced, log_level=0)
        assert (m.consume_tokens(tok.encode(fmt.render([call]), add_special_tokens=False)) and m.is_accepting()) is ok


def test_the_grammars_name_the_tags_where_they_are_special_tokens(tok, syntax):
    """(GLM's tokenizers make each of its tags a special token.)"""
    special = transformers.AutoTokenizer.from_pretrained(tok.name_or_path)
    tags = SPECIAL_TAGS[syntax]
    special.add_tokens(tags, special_tokens=True)
    fmt = xml(syntax).bind(special).for_tools(FUNCTIONS)
    assert [p for p, _ in fmt.specials] == tags
    llt = llguidance.hf.from_tokenizer(special, n_vocab=VOCAB, eos_token=[1])
    text = "Sure.\n\n" + fmt.render(CALLS)
    for grammar, written in ((fmt.grammar(FUNCTIONS, True), text[7:]), (fmt.auto_grammar(FUNCTIONS, True), text)):
        m = llguidance.LLMatcher(llt, grammar, log_level=0)
        assert m.consume_tokens(special.encode(written, add_special_tokens=False)) and m.is_accepting(), m.get_error()


def test_the_template_picks_it():
    assert [detect_format(template).name for template, _ in SYNTAXES.values()] == list(SYNTAXES)
    assert detect_format("<tool_call>{{ c | tojson }}</tool_call>").name == "hermes"


# -- served --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_forced_calls_hold_to_their_schemas(client, stream):
    kw = dict(model=MODEL, messages=ASK, max_tokens=300, temperature=0, tools=CLOSED, tool_choice="required")
    choice = choice_of(client, stream, **kw)
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    check_calls(choice.message, set(MODELS))
    named = create(client, tools=CLOSED, tool_choice={"type": "function", "function": {"name": "lookup"}})
    assert [n for n, _ in check_calls(named.choices[0].message, {"lookup"})] == ["lookup"]


def test_a_forced_call_is_closed_within_max_tokens(srv, client, syntax):
    """A value that is text ends only at its closing tag (none of JSON's closers): a model that writes it
    without end gets it closed within the budget, where it used to run past it and lose the call."""
    check_closed_within_the_budget(srv, client, MODEL)


def test_streamed_forced_calls_assemble_to_the_whole_ones(client):
    kw = dict(tools=CLOSED, tool_choice="required")
    whole = create(client, **kw).choices[0].message
    streamed = assembled_calls(create(client, stream=True, **kw))
    assert streamed == [(c.function.name, c.function.arguments) for c in whole.tool_calls]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_a_call_by_the_tools_types(client, stream, syntax):
    """Under auto the model writes freely; here a grammar makes it write text, then a call whose string
    argument looks like a number. The parser reads it by the tool's schema: still a string."""
    args = {"query": "123", "zip": "00501", "exact": False, "tags": ["a", "b"]}
    text = "Checking.\n\n" + xml(syntax).render([("search", args)])
    tools = [{"type": "function", "function": f} for f in FUNCTIONS]
    kw = dict(model=MODEL, messages=ASK, max_tokens=300, temperature=0, tools=tools, tool_choice="auto",
              extra_body={"structured_outputs": {"grammar": f"start: {json.dumps(text)}"}})  # fmt: skip
    choice = choice_of(client, stream, **kw)
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    [call] = choice.message.tool_calls
    assert call.function.name == "search" and json.loads(call.function.arguments) == args
    Search.model_validate_json(call.function.arguments)


def test_history_renders_as_the_template_writes_calls(client, http, tok, syntax):
    args = {"query": "x", "zip": "12345", "exact": True, "tags": []}
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "none found"},
    ]  # fmt: skip
    tools = [{"type": "function", "function": f} for f in FUNCTIONS]
    r = create(client, messages=history, tools=tools, max_tokens=2)
    ids = http.post("/tokenize", json={"model": MODEL, "messages": history, "tools": tools}).json()["tokens"]
    assert len(ids) == r.usage.prompt_tokens
    rendered = xml(syntax).render([("search", args)])
    assert (rendered.replace("true", "True") if syntax == "qwen3_coder" else rendered) in tok.decode(ids)
