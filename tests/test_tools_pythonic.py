"""Pythonic tool calls (a Python list of calls with keyword literals: Llama 3.2's and 4's, Gemma 3's),
through a real server and the official openai SDK: the template picks the syntax, forced calls hold
every argument to its schema as a Python literal, calls written under auto are read as Python reads
them, streamed calls assemble to the whole ones, and the history renders as the template writes it.
The syntax's reading and writing are checked against each other and against the grammar."""

from __future__ import annotations

import json
from typing import Literal

import llguidance
import llguidance.hf
import pytest
import test_tools
from pydantic import BaseModel, Field
from test_tools import MODELS, TOOLS, assembled_calls, check_calls, choice_of, template_model

from conftest import VOCAB
from server.tool_formats import detect_format
from server.tool_pythonic import PythonicCallFormat

MODEL = "tiny-pythonic"
ASK = [{"role": "user", "content": "Weather in Paris?"}]
srv, tok = test_tools.srv, test_tools.tok  # (fixtures: this module's model_dir, served)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# The pythonic templates' conventions in a small template of our own: the tools and the templates' own
# example of the syntax in a system turn, each call of the history in a Python list.
TEMPLATE = (
    "{% if tools %}<|bos|>system\nTo call functions, answer only with "
    "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% if m.get('tool_calls') %}[{% for c in m['tool_calls'] %}{{ c['function']['name'] }}("
    "{% for k, v in c['function']['arguments'].items() %}{{ k }}={{ v | tojson }}{% if not loop.last %}, {% endif %}"
    "{% endfor %}){% if not loop.last %}, {% endif %}{% endfor %}]{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)


class Search(BaseModel):
    query: str = Field(max_length=12)
    exact: bool
    tags: list[str] = Field(max_length=2)
    mode: Literal["fast", "deep"] = "fast"
    near: dict[str, int] | None = None


FUNCTIONS = [t["function"] for t in TOOLS] + [{"name": "search", "parameters": Search.model_json_schema()}]
CALLS = [
    ("search", {"query": 'it\'s "x"', "exact": True, "tags": ["a"], "mode": "deep", "near": None}),
    ("get_weather", {"city": "Oslo", "unit": "c"}),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir):
    return template_model(tmp_path_factory.mktemp("pythonic"), tokenizer_dir, TEMPLATE)


def create(client, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 300)
    kw.setdefault("messages", ASK)
    return client.chat.completions.create(model=MODEL, **kw)


def read(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


# -- the syntax ----------------------------------------------------------------------------------------------
def test_it_reads_what_it_writes_and_python_literals():
    fmt = PythonicCallFormat()
    text = fmt.render(CALLS)
    assert text.startswith('[search(query="it\'s \\"x\\"", exact=True, tags=["a"], mode="deep", near=None), ')
    content, calls = fmt.parse(text)
    assert content is None and read(calls) == CALLS
    content, calls = fmt.parse("\n " + text + "\nDone.")  # after a blank; words after the list are content
    assert content == "Done." and read(calls) == CALLS
    # Python's own literals: single quotes, a tuple, None in a dict, a negative float.
    content, calls = fmt.parse("[f(a='q)]', b=(1, 2), c={'k': None}, d=-0.5)]")
    assert content is None and read(calls) == [("f", {"a": "q)]", "b": [1, 2], "c": {"k": None}, "d": -0.5})]
    # JSON's true / false / null as a template's tojson writes them into the history are read too.
    assert read(fmt.parse("[f(a=true, b=[null, false])]")[1]) == [("f", {"a": True, "b": [None, False]})]
    # Cut inside the second call: the first is a call, the cut one neither call nor content.
    content, calls = fmt.parse(text[:-8], cut=True)
    assert content is None and [c.name for c in calls] == ["search"]
    # Not calls: no list, a list of no calls, a variable, a positional argument, a call inside text, a
    # list with an item that is no call or never closed (all content, as vLLM reads it).
    for answer in ("Plain words.", "[1] is cited.", "[f(x=y)]", "[f(1)]", "See [f(a=1)].", "[f(a=1), g(x)]",
                   "[f(a=1), g(b=2) and more", "[]"):  # fmt: skip
        assert fmt.parse(answer) == (answer, []), answer
    # Names Python would refuse are read as written (a tool may be get-weather, a parameter from); a
    # trailing comma; a surrogate pair as JSON reads it.
    content, calls = fmt.parse('[get-weather(from="x", user-id=2,), g(s="\\ud83d\\ude00"),]')
    assert content is None and read(calls) == [("get-weather", {"from": "x", "user-id": 2}), ("g", {"s": "\U0001f600"})]
    assert fmt.parse('[g(s="\\ud83d")]') == ('[g(s="\\ud83d")]', [])  # a lone surrogate has no JSON
    assert read(fmt.parse("[.f(my key=1, b = 'x\\ty')]")[1]) == [(".f", {"my key": 1, "b": "x\ty"})]
    # A schema's strings are written as JSON, which may escape a slash: read as JSON reads it (an escaped
    # backslash before a slash, and a Python string's own escapes, stay as they are).
    got = read(fmt.parse('[f(u="https:\\/\\/x.org", b="a\\\\/b", c={"k": ["\\/"]}, d=\'\\\\/\')]')[1])
    assert got == [("f", {"u": "https://x.org", "b": "a\\/b", "c": {"k": ["/"]}, "d": "\\/"})]
    # Only a plain double-quoted string is read so: a raw string keeps its backslash, and strings are found as
    # Python finds them (an escaped line end inside one does not end it).
    got = read(fmt.parse('[f(a=r"x\\/y", b="m\\\nn", c=\'p\\/q"\')]')[1])
    assert got == [("f", {"a": "x\\/y", "b": "mn", "c": 'p\\/q"'})]
    # Forced calls stream as they are written: each call's name, then its arguments when it closes.
    scanner, events = fmt.scanner(), []
    for k in range(0, len(text), 5):
        events += scanner.feed(text[k : k + 5])
    assert [e for e in events if e[0] != "args"] == [("call", "search"), ("end",), ("call", "get_weather"), ("end",)]
    assert [json.loads(e[1]) for e in events if e[0] == "args"] == [a for _, a in CALLS]


def test_the_grammars_hold_each_argument_to_its_schema(tok):
    fmt = PythonicCallFormat()
    llt = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB, eos_token=[1])

    def accepts(grammar: str, text: str) -> bool:
        m = llguidance.LLMatcher(llt, grammar, log_level=0)
        assert not m.is_error(), m.get_error()  # (the grammar compiled)
        return bool(m.consume_tokens(tok.encode(text, add_special_tokens=False))) and m.is_accepting()

    forced, auto = fmt.grammar(FUNCTIONS, True), fmt.auto_grammar(FUNCTIONS, True)
    text = fmt.render(CALLS)
    assert accepts(forced, text) and accepts(auto, text) and accepts(auto, "\n" + text)
    assert accepts(auto, "No call: just words.") and not accepts(forced, "No call.")
    search = CALLS[0][1]
    for name, args in (
        ("search", {**search, "query": "far too long a query"}),  # maxLength 12
        ("search", {**search, "exact": "yes"}),  # a boolean
        ("search", {**search, "tags": ["a", 1]}),  # strings
        ("search", {**search, "tags": ["a", "b", "c"]}),  # maxItems 2
        ("search", {**search, "near": {"x": "1"}}),  # an object of integers, or None
        ("search", {k: v for k, v in search.items() if k != "exact"}),  # required
        ("get_weather", {"unit": "c", "city": "Oslo"}),  # in the schema's order
        ("get_weather", {"city": "Oslo", "unit": "k"}),  # not in its enum
        ("lookup", {"query": "x", "limit": 12}),  # maximum 9
        ("get_time", {}),  # no such tool
    ):
        assert not accepts(forced, fmt.render([(name, args)])), (name, args)
    assert accepts(forced, fmt.render([("search", {"query": "", "exact": False, "tags": [], "near": {"x": 1}})]))
    assert not accepts(fmt.grammar(FUNCTIONS, False), text)  # one call only
    assert accepts(fmt.grammar(FUNCTIONS, False), fmt.render(CALLS[1:]))
    # Under auto a tool that is not strict takes any keyword literals; a strict one holds to its schema.
    strict = [{**f, "strict": True} if f["name"] == "get_weather" else f for f in FUNCTIONS]
    loose = fmt.auto_grammar(strict, True)
    assert accepts(loose, "[lookup(anything=[1, 'two', None])]")
    assert not accepts(loose, "[get_weather(city='Oslo', unit='k')]") and not accepts(loose, "[x()]")
    # Any literal is one Python reads as JSON: no infinite float, no raw carriage return, no unknown escape.
    assert accepts(loose, "[lookup(a=1e99, b='x\\ty')]")
    for bad in ("[lookup(a=1e999)]", "[lookup(a='x\ry')]", "[lookup(a='\\q')]"):
        assert not accepts(loose, bad), bad


class Node(BaseModel):
    label: str
    children: list[Node] = []


def test_awkward_schemas_make_grammars_whose_calls_read_back(tok):
    """Names Python refuses, one-item arrays, a recursive model and an allOf-wrapped reference: each
    grammar compiles, and what it admits reads back as the same call."""
    fmt = PythonicCallFormat()
    llt = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB, eos_token=[1])
    one = {"type": "object", "properties": {"from": {"type": "string"}, "pair": {"type": "array", "maxItems": 1,
           "items": {"type": "integer"}}, "unit": {"allOf": [{"$ref": "#/$defs/U"}], "description": "d"}},
           "required": ["from"], "$defs": {"U": {"enum": ["c", "f"]}}}  # fmt: skip
    tools = [{"name": "get-weather", "parameters": one}, {"name": "tree", "parameters": Node.model_json_schema()}]
    grammar = fmt.grammar(tools, True)
    cases = [
        ([("get-weather", {"from": "x", "pair": [1], "unit": "c"})], True),
        ([("get-weather", {"from": "x", "pair": [1, 2]})], False),  # maxItems 1
        ([("get-weather", {"from": "x", "unit": "k"})], False),  # the referenced enum
        ([("tree", {"label": "a", "children": [{"label": "b", "children": [{"label": "c"}]}]})], True),
        ([("tree", {"label": 1})], False),
    ]
    for calls, ok in cases:
        m = llguidance.LLMatcher(llt, grammar, log_level=0)
        assert not m.is_error(), m.get_error()
        text = fmt.render(calls)
        assert (bool(m.consume_tokens(tok.encode(text, add_special_tokens=False))) and m.is_accepting()) is ok, text
        if ok:
            assert read(fmt.parse(text)[1]) == calls


def test_the_template_picks_it():
    assert detect_format(TEMPLATE).name == "pythonic"


# -- served --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_forced_calls_hold_to_their_schemas(client, stream):
    kw = dict(model=MODEL, messages=ASK, max_tokens=300, temperature=0, tools=TOOLS, tool_choice="required")
    choice = choice_of(client, stream, logprobs=not stream, **kw)
    if not stream:
        assert "".join(t.token for t in choice.logprobs.content).startswith("[")
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    check_calls(choice.message, set(MODELS))
    named = create(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "lookup"}})
    assert [n for n, _ in check_calls(named.choices[0].message, {"lookup"})] == ["lookup"]


def test_streamed_forced_calls_assemble_to_the_whole_ones(client):
    kw = dict(tools=TOOLS, tool_choice="required")
    whole = create(client, **kw).choices[0].message
    streamed = assembled_calls(create(client, stream=True, **kw))
    assert streamed == [(c.function.name, c.function.arguments) for c in whole.tool_calls]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_the_list_the_model_writes(client, stream):
    """Under auto the model writes freely; here a grammar makes it write a list of calls in Python's own
    literals, which the parser reads as Python does."""
    text = "[search(query='x', exact=False, tags=('a',), near={'k': 2}), get_weather(city='Oslo', unit='f')]"
    tools = [{"type": "function", "function": f} for f in FUNCTIONS]
    kw = dict(model=MODEL, messages=ASK, max_tokens=300, temperature=0, tools=tools, tool_choice="auto",
              extra_body={"structured_outputs": {"grammar": f"start: {json.dumps(text)}"}})  # fmt: skip
    choice = choice_of(client, stream, **kw)
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("search", {"query": "x", "exact": False, "tags": ["a"], "near": {"k": 2}}),
        ("get_weather", {"city": "Oslo", "unit": "f"}),
    ]


def test_history_renders_as_the_template_writes_calls(client, http, tok):
    args = {"query": "x", "exact": True, "tags": []}
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "none found"},
    ]  # fmt: skip
    tools = [{"type": "function", "function": f} for f in FUNCTIONS]
    r = create(client, messages=history, tools=tools, max_tokens=2)
    ids = http.post("/tokenize", json={"model": MODEL, "messages": history, "tools": tools}).json()["tokens"]
    assert len(ids) == r.usage.prompt_tokens
    assert '[search(query="x", exact=true, tags=[])]' in tok.decode(ids)  # (the template's tojson)
