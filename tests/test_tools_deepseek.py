"""DeepSeek's tool calls as its tokenizers have them, through a real server and the official openai SDK.

DeepSeek's call markers (``<｜tool▁calls▁begin｜>``, ``<｜tool▁call▁begin｜>``, ``<｜tool▁sep｜>``,
``<｜tool▁call▁end｜>``, ``<｜tool▁calls▁end｜>``) are tokens of its vocabulary: a forced call names
them by id, and an output read for calls keeps them. Two syntaxes: V3's and R1's (each call's type,
its name and its arguments in a fenced JSON block, a line between calls) and V3.1's (the name and the
arguments alone). The tokenizer here is the tests' own with the markers added as special tokens, under
two templates of our own written in the two syntaxes."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import pytest
import test_tools
from test_tools import (
    MODELS,
    TOOLS,
    check_calls,
    check_closed_within_the_budget,
    choice_of,
    special_tokenizer,
    template_model,
)
from test_tools_mistral import ids_of

from conftest import VOCAB
from server.tool_formats import detect_format
from server.tools import DEEPSEEK

MODEL = "tiny-deepseek"
ASK = [{"role": "user", "content": "Weather in Paris?"}]
srv, tok = test_tools.srv, test_tools.tok  # (fixtures: this module's model_dir, served)
CALLS_BEGIN, CALL_BEGIN, SEP, CALL_END, CALLS_END = DEEPSEEK
ROLES = ["<｜User｜>", "<｜Assistant｜>"]

_HEAD = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% if tools and loop.last %}## Tools\n{{ tools | tojson }}\n{% endif %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] or '' }}"
    "{% if m.get('tool_calls') %}<｜tool▁calls▁begin｜>{% for c in m['tool_calls'] %}"
)
_TAIL = (
    "{% endfor %}<｜tool▁calls▁end｜>{% endif %}{{ eos_token }}{% elif m['role'] == 'tool' %}"
    "<｜tool▁output▁begin｜>{{ m['content'] }}<｜tool▁output▁end｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)
TEMPLATES = {  # V3's (R1's) and V3.1's way of writing an assistant's calls; V3's joins the arguments as
    # text, as DeepSeek's own templates do, V3.1's writes them with tojson (as vLLM's example templates do)
    "deepseek_v3": _HEAD
    + "{% if not loop.first %}{{ '\\n' }}{% endif %}{{ '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' "
    "+ c['function']['name'] + '\\n```json\\n' + c['function']['arguments'] + '\\n```<｜tool▁call▁end｜>' }}" + _TAIL,
    "deepseek_v31": _HEAD + "<｜tool▁call▁begin｜>{{ c['function']['name'] }}<｜tool▁sep｜>"
    "{{ c['function']['arguments'] | tojson }}<｜tool▁call▁end｜>" + _TAIL,
}
CALL = ("get_weather", {"city": "Paris", "unit": "c"})


deepseek_tokenizer = special_tokenizer(*DEEPSEEK, *ROLES)


@pytest.fixture(scope="module", params=list(TEMPLATES))
def syntax(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir, syntax):
    return template_model(tmp_path_factory.mktemp(syntax), tokenizer_dir, TEMPLATES[syntax], deepseek_tokenizer)


def written(tok, syntax: str, name: str, args: dict) -> str:
    """A Lark grammar for exactly one call as the model writes it in this syntax, its markers by id."""
    begin, call, sep, end, close = (f"<[{tok.convert_tokens_to_ids(m)}]>" for m in DEEPSEEK)
    body = json.dumps(json.dumps(args))
    if syntax == "deepseek_v3":
        head = json.dumps(name + "\n```json\n")
        return f'{begin} {call} "function" {sep} {head} {body} "\\n```" {end} {close}'
    return f"{begin} {call} {json.dumps(name)} {sep} {body} {end} {close}"


def create(client, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 200)
    kw.setdefault("messages", ASK)
    return client.chat.completions.create(model=MODEL, **kw)


def test_the_template_picks_the_syntax_and_the_grammars_name_the_markers(srv, syntax, tok):
    fmt = srv.app.state.augur.tool_format
    assert fmt.name == syntax and fmt == detect_format(TEMPLATES[syntax]).bind(tok)
    assert fmt.text_arguments is (syntax == "deepseek_v3")  # (the template joins them to text)
    assert sorted(fmt.special_ids) == sorted(tok.convert_tokens_to_ids(list(DEEPSEEK)))
    functions = [t["function"] for t in TOOLS]
    llt = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB, eos_token=[1])
    rendered = fmt.render([CALL, ("lookup", {"query": "x", "limit": 2})])
    as_model = ids_of(tok, rendered)  # (each marker's text encodes as its one token)
    assert as_model.count(tok.convert_tokens_to_ids(CALL_BEGIN)) == 2
    for grammar in (fmt.grammar(functions, True), fmt.auto_grammar(functions, True)):
        m = llguidance.LLMatcher(llt, grammar, log_level=0)
        assert m.consume_tokens(as_model) and m.is_accepting(), m.get_error()
    # A marker's text written in ordinary tokens is not the marker: the forced grammar refuses it.
    spelled = ids_of(tok, "<｜tool▁", "calls▁begin｜>") + ids_of(tok, rendered[len(CALLS_BEGIN) :])
    m = llguidance.LLMatcher(llt, fmt.grammar(functions, True), log_level=0)
    assert not m.consume_tokens(spelled)
    content, calls = fmt.parse("Let me see." + rendered)
    assert content == "Let me see." and [c.name for c in calls] == ["get_weather", "lookup"]


@pytest.mark.parametrize("stream", [False, True])
def test_forced_calls_are_written_with_the_markers_and_read_back(client, stream):
    # (one call: the random model, offered "\n" and another call or the closing marker, keeps calling)
    choice = choice_of(client, stream, model=MODEL, messages=ASK, max_tokens=200, temperature=0, tools=TOOLS,
                       tool_choice="required", parallel_tool_calls=False)  # fmt: skip
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    check_calls(choice.message, set(MODELS))
    named = create(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "lookup"}})
    assert [n for n, _ in check_calls(named.choices[0].message, {"lookup"})] == ["lookup"]


def test_a_forced_call_is_closed_within_max_tokens(srv, client, syntax):
    """A run of calls ends at its closing marker (none of JSON's closers): a model that writes its call's
    string without end gets the call, and the run, closed within the budget."""
    check_closed_within_the_budget(srv, client, MODEL)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_a_call_the_model_writes_with_its_markers(client, tok, syntax, stream):
    """Under auto the model writes freely; here a grammar makes it write text, then a call in its
    syntax with the markers as the tokens they are. The parser finds them in the text."""
    grammar = f'start: "Checking." {written(tok, syntax, *CALL)}'
    kw = dict(model=MODEL, messages=ASK, max_tokens=200, temperature=0, tools=TOOLS, tool_choice="auto",
              extra_body={"structured_outputs": {"grammar": grammar}})  # fmt: skip
    choice = choice_of(client, stream, **kw)
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    assert check_calls(choice.message, {"get_weather"}) == [CALL]
    # Without tools the same output is text, and its special tokens are left out as always.
    plain = client.chat.completions.create(**{**kw, "tools": None, "tool_choice": None})
    assert CALLS_BEGIN not in plain.choices[0].message.content


def test_history_renders_the_calls_in_the_syntax(client, http, tok, syntax):
    first = create(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False).choices[0].message
    call = first.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "21 C"},
    ]
    r = create(client, messages=history, tools=TOOLS, max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")
    rendered = tok.decode(http.post("/tokenize", json={"model": MODEL, "messages": history}).json()["tokens"])
    args = json.dumps(json.loads(call.function.arguments))
    if syntax == "deepseek_v3":
        want = f"{CALL_BEGIN}function{SEP}{call.function.name}\n```json\n{args}\n```{CALL_END}"
    else:
        want = f"{CALL_BEGIN}{call.function.name}{SEP}{args}{CALL_END}"
    assert f"{CALLS_BEGIN}{want}{CALLS_END}" in rendered, rendered
