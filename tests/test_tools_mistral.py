"""Mistral's tool calls as its tokenizers have them, through a real server and the official openai SDK.

Mistral's ``[TOOL_CALLS]`` (and v11's ``[ARGS]``, Small 3.2's ``[CALL_ID]``) are special tokens: a
grammar cannot spell them with text, and decoding leaves them out unless asked to keep them. So a
forced call must name the token itself, an output read for calls must keep it, and the call ids must
be the 9 letters and digits that Mistral's templates check. The tokenizer here is the tests' own with
those markers added as special tokens (flagged special, not named in ``all_special_ids``: as Mistral's
are), under three templates written in the three syntaxes: v11 with the model's own call ids
(Mistral Small 3.2's), v11 without (Ministral 3's, Magistral's, Devstral's) and the JSON list (7B v0.3's,
Nemo's)."""

from __future__ import annotations

import json
import re

import llguidance
import llguidance.hf
import pytest
import test_tools
import transformers
from test_tools import MODELS, TOOLS, check_calls, choice_of, template_model

from conftest import VOCAB
from server.tool_formats import detect_format
from server.tools import short_id

MODEL = "tiny-mistral"
ASK = [{"role": "user", "content": "Weather in Paris?"}]
srv, tok = test_tools.srv, test_tools.tok  # (fixtures: this module's model_dir, served)
MARKERS = ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[INST]", "[/INST]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]

# Mistral-style templates of our own: tools before the last user turn, calls in each syntax, and the
# check Mistral's templates make that every call id is 9 characters.
_CHECK = (
    "{% macro check(i) %}{% if i is not string or i | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}{% endmacro %}"
)
_HEAD = (
    _CHECK + "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST]{{ m['content'] }}[/INST]{% elif m['role'] == 'assistant' %}{{ m['content'] or '' }}"
)
_TAIL = (
    "{{ eos_token }}{% elif m['role'] == 'tool' %}{{ check(m['tool_call_id']) }}"
    "[TOOL_RESULTS]{{ m['tool_call_id'] }}:{{ m['content'] }}[/TOOL_RESULTS]{% endif %}{% endfor %}"
)
TEMPLATES = {
    "v11_ids": _HEAD + "{% for c in m.get('tool_calls') or [] %}{{ check(c['id']) }}[TOOL_CALLS]"
    "{{ c['function']['name'] }}[CALL_ID]{{ c['id'] }}[ARGS]{{ c['function']['arguments'] | tojson }}{% endfor %}"
    + _TAIL,
    "v11": _HEAD + "{% for c in m.get('tool_calls') or [] %}{{ check(c['id']) }}[TOOL_CALLS]"
    "{{ c['function']['name'] }}[ARGS]{{ c['function']['arguments'] | tojson }}{% endfor %}" + _TAIL,
    "list": _HEAD + "{% if m.get('tool_calls') %}[TOOL_CALLS][{% for c in m['tool_calls'] %}{{ check(c['id']) }}"
    '{"name": {{ c["function"]["name"] | tojson }}, "arguments": {{ c["function"]["arguments"] | tojson }}, '
    '"id": {{ c["id"] | tojson }}}{% if not loop.last %}, {% endif %}{% endfor %}]{% endif %}' + _TAIL,
}
CALL = ("get_weather", {"city": "Paris", "unit": "c"})
ID = re.compile(r"[A-Za-z0-9]{9}")


def mistral_tokenizer(model_dir) -> transformers.PreTrainedTokenizerFast:
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    tok.add_tokens(MARKERS, special_tokens=True)
    assert len(tok) <= VOCAB and tok.convert_tokens_to_ids("[TOOL_CALLS]") not in tok.all_special_ids
    return tok


@pytest.fixture(scope="module", params=list(TEMPLATES))
def syntax(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir, syntax):
    return template_model(tmp_path_factory.mktemp(syntax), tokenizer_dir, TEMPLATES[syntax], mistral_tokenizer)


def ids_of(tok, *pieces: str) -> list[int]:
    return [i for p in pieces for i in tok.encode(p, add_special_tokens=False)]


def written(tok, syntax: str, name: str, args: dict) -> str:
    """A Lark grammar for exactly one call as the model writes it in this syntax, its markers by id."""
    calls, a, own_id = (f"<[{tok.convert_tokens_to_ids(m)}]>" for m in ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"))
    body = json.dumps(json.dumps(args))
    if syntax == "list":
        return f"{calls} {json.dumps('[' + json.dumps({'name': name, 'arguments': args}) + ']')}"
    head = f"{calls} {json.dumps(name)}"
    return f'{head} {own_id} "abcDEF123" {a} {body}' if syntax == "v11_ids" else f"{head} {a} {body}"


def create(client, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 200)
    kw.setdefault("messages", ASK)
    return client.chat.completions.create(model=MODEL, **kw)


def test_the_template_picks_the_syntax_and_the_grammars_name_the_special_tokens(srv, syntax, tok):
    fmt = srv.app.state.augur.tool_format
    assert fmt.name == ("mistral" if syntax == "list" else "mistral_v11")
    assert (fmt.id_sep == "[CALL_ID]") is (syntax == "v11_ids")
    assert fmt == detect_format(TEMPLATES[syntax]).bind(tok)
    functions = [t["function"] for t in TOOLS]
    llt = llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB, eos_token=[1])
    rendered = fmt.render([CALL])
    if syntax == "v11_ids":  # the model writes its own id before [ARGS]
        rendered = rendered.replace("[ARGS]", "[CALL_ID]abcDEF123[ARGS]")
    as_model = ids_of(tok, rendered)  # (each marker's text encodes as its one token)
    spelled = ids_of(tok, "[TOOL_", "CALLS]") + ids_of(tok, rendered[len("[TOOL_CALLS]") :])
    for grammar in (fmt.grammar(functions, True), fmt.auto_grammar(functions, True)):
        m = llguidance.LLMatcher(llt, grammar, log_level=0)
        assert m.consume_tokens(as_model) and m.is_accepting(), m.get_error()
    # The marker's text written in ordinary tokens is not the marker (under auto it would be text).
    m = llguidance.LLMatcher(llt, fmt.grammar(functions, True), log_level=0)
    assert not m.consume_tokens(spelled)


def test_a_blank_beside_the_markup_is_read_whichever_way_the_template_writes_it(tok):
    """A SentencePiece model writes "[TOOL_CALLS] [" where Nemo's template wrote "[TOOL_CALLS][", and
    the other way round: both read as the calls."""
    for template in (TEMPLATES["list"], TEMPLATES["list"].replace("[TOOL_CALLS][", "[TOOL_CALLS] [")):
        fmt = detect_format(template).bind(tok)
        for written in (
            '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]',
            '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}]',
        ):
            content, calls = fmt.parse(written)
            assert content is None and [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}')]


@pytest.mark.parametrize("stream", [False, True])
def test_forced_calls_are_written_with_the_markers_and_read_back(client, stream):
    kw = dict(model=MODEL, messages=ASK, max_tokens=200, temperature=0, tools=TOOLS, tool_choice="required")
    choice = choice_of(client, stream, **kw)
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    check_calls(choice.message, set(MODELS))
    assert all(ID.fullmatch(c.id) for c in choice.message.tool_calls)  # Mistral's templates take no other
    named = create(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "lookup"}}, stream=stream)
    if stream:
        deltas = [d for chunk in named for ch in chunk.choices for d in (ch.delta.tool_calls or [])]
        assert [d.function.name for d in deltas if d.id] == ["lookup"] and all(
            ID.fullmatch(d.id) for d in deltas if d.id
        )
        args = "".join(d.function.arguments or "" for d in deltas)
        MODELS["lookup"].model_validate_json(args)
    else:
        assert [n for n, _ in check_calls(named.choices[0].message, {"lookup"})] == ["lookup"]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_a_call_the_model_writes_with_special_tokens(client, tok, syntax, stream):
    """Under auto the model writes freely; here a grammar makes it write text, then a call in its
    syntax with the markers as the special tokens they are. The parser finds them in the text."""
    grammar = f'start: "Checking." {written(tok, syntax, *CALL)}'
    kw = dict(model=MODEL, messages=ASK, max_tokens=200, temperature=0, tools=TOOLS, tool_choice="auto",
              extra_body={"structured_outputs": {"grammar": grammar}})  # fmt: skip
    choice = choice_of(client, stream, **kw)
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    assert check_calls(choice.message, {"get_weather"}) == [CALL]
    assert ID.fullmatch(choice.message.tool_calls[0].id)
    # Without tools the same output is text, and its special tokens are left out as always.
    plain = client.chat.completions.create(**{**kw, "tools": None, "tool_choice": None})
    assert "[TOOL_CALLS]" not in plain.choices[0].message.content


def test_history_takes_call_ids_of_any_shape(client, http, tok, syntax):
    """Ids the server gave go back as they are; another shape (OpenAI's ``call_...``) becomes 9
    characters of its digest, the same in the call and in its result, so Mistral's templates take it."""
    first = create(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False).choices[0].message
    for given in (first.tool_calls[0].id, "call_Xy12"):
        history = ASK + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": given, "type": "function", "function": {"name": CALL[0], "arguments": json.dumps(CALL[1])}}]},
            {"role": "tool", "tool_call_id": given, "content": "21 C"},
        ]  # fmt: skip
        r = create(client, messages=history, tools=TOOLS, max_tokens=4)
        assert r.choices[0].finish_reason in ("stop", "length")
        counted = http.post("/tokenize", json={"model": MODEL, "messages": history, "tools": TOOLS}).json()["count"]
        assert counted == r.usage.prompt_tokens  # (the template takes the tools: /tokenize renders them too)
        rendered = tok.decode(http.post("/tokenize", json={"model": MODEL, "messages": history}).json()["tokens"])
        assert f"[TOOL_RESULTS]{short_id(given)}:21 C" in rendered
        if syntax != "v11":
            assert rendered.count(short_id(given)) == 2  # (the call's id too, where the template writes it)
    assert short_id("call_Xy12") != "call_Xy12" and short_id(first.tool_calls[0].id) == first.tool_calls[0].id
