"""Structures closed within ``max_tokens`` (engine/structured/closing.py), through a real server with the
official openai SDK: forced tool calls with parallel calls on, under a budget too small for a second
call, end with whole calls only, on chat and the Responses API, streamed and not; a schema's JSON is
closed instead of cut; ``close_at_max_tokens: false`` cuts as before (the proof that these budgets do
bite); speculation stays exact with it; openai-agents' default model runs a required tool with parallel
calls on."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import openai
import pytest
import torch
import transformers
from pydantic import BaseModel

from conftest import VOCAB, build_model_dir
from engine.request.structured import StructuredOutput
from engine.structured.closing import ending
from engine.structured.grammar import Grammars
from server.app import ServerSettings, create_app
from server.tool_formats import TOOL_PARSERS
from server.tool_gemma4 import GEMMA4
from server.tool_kimi import KIMI
from server.tools import DEEPSEEK, FORMATS
from servers import Served, engine_factory, serve

MODEL = "tiny-llama"
SPEC_ON = {"speculative": {"num_draft_tokens": 3}}
SPEC_OFF = {"speculative": {"enabled": False}}
NO_CLOSING = {"close_at_max_tokens": False}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Note(BaseModel):  # a list without bounds: a model may write it without end
    flags: list[bool]


TOOLS = [{"type": "function", "function": {"name": "note", "parameters": Note.model_json_schema()}}]
ASK = [{"role": "user", "content": "Write notes."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir):
    """A tiny Llama with room for the tools' description in its prompt (2,048 positions)."""
    return build_model_dir(tmp_path_factory.mktemp("closing") / "m", tokenizer_dir, "LlamaForCausalLM",
                           max_position_embeddings=2048)  # fmt: skip


@pytest.fixture(scope="module")
def srv(model_dir) -> Iterator[Served]:
    factory = engine_factory(model_dir, draft_model=str(model_dir), num_speculative_tokens=3, max_model_len=2048)
    with serve(create_app(ServerSettings(served_model_name=MODEL), factory)) as s:
        yield s


def shortest(srv: Served, structured: StructuredOutput) -> int:
    """The tokens of the ending from the start: the shortest output the grammar takes, as closing finds it."""
    state = srv.engine.grammars.start(structured, left=10_000)
    return len(ending(state.matcher, state.closing, torch.empty(state.words, dtype=torch.int32)))


@pytest.fixture(scope="module")
def one_call(srv) -> int:
    grammar = srv.app.state.augur.tool_format.grammar([t["function"] for t in TOOLS], True)
    return shortest(srv, StructuredOutput("grammar", grammar, None, "tool_choice"))


@pytest.fixture(scope="module")
def long_writer(model_dir) -> dict:
    """A logit bias that makes the model write lists without end and never end its output: what a budget
    cuts. Where a mask allows one token alone it is still picked (a bias cannot undo a mask)."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    closers = [t for t in range(len(tok)) if "]" in tok.decode([t])]
    return {"logit_bias": {str(t): -100 for t in [tok.eos_token_id, *closers]}}


def calls_of(message) -> list[dict]:
    return [Note.model_validate_json(c.function.arguments).model_dump() for c in message.tool_calls or []]


NAMED = {"type": "function", "function": {"name": "note"}}


@pytest.mark.parametrize("choice", ["required", "named"])
@pytest.mark.parametrize("extra", [6, 30, 72])  # tokens beyond the shortest call: a second does not fit
def test_forced_calls_end_whole_under_a_budget_too_small_for_a_second(client, one_call, long_writer, extra, choice):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required" if choice == "required" else NAMED,
              temperature=0, max_tokens=one_call + min(extra, one_call))  # fmt: skip
    cut = client.chat.completions.create(**kw, extra_body={**SPEC_ON, **NO_CLOSING, **long_writer})
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == kw["max_tokens"]
    assert len(calls_of(cut.choices[0].message)) == 0  # the budget bites: the one call was cut
    r = client.chat.completions.create(**kw, extra_body={**SPEC_ON, **long_writer})
    whole = r.choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert len(calls_of(whole.message)) == 1  # closed within the budget, and no second call begun
    # streamed: the same calls, their arguments as written
    chunks = list(client.chat.completions.create(**kw, stream=True, extra_body={**SPEC_ON, **long_writer}))
    streamed: dict[int, list[str]] = {}
    for ch in (c for chunk in chunks for c in chunk.choices):
        assert not ch.delta.content
        for d in ch.delta.tool_calls or []:
            streamed.setdefault(d.index, ["", ""])
            streamed[d.index][0] += d.function.name or ""
            streamed[d.index][1] += d.function.arguments or ""
    assert [tuple(v) for v in streamed.values()] == [(c.function.name, c.function.arguments)
                                                     for c in whole.message.tool_calls]  # fmt: skip
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_responses_forced_calls_complete(client, one_call, long_writer, stream):
    tools = [{"type": "function", "name": "note", "parameters": Note.model_json_schema()}]
    kw = dict(model=MODEL, input="Write notes.", tools=tools, tool_choice="required", temperature=0,
              max_output_tokens=one_call + 20, extra_body={**SPEC_ON, **long_writer})  # fmt: skip
    if stream:
        with client.responses.stream(**kw) as s:
            r = s.get_final_response()  # raises unless the response completed
    else:
        r = client.responses.create(**kw)
    assert r.status == "completed" and [i.type for i in r.output] == ["function_call"]
    assert r.output[0].status == "completed" and Note.model_validate_json(r.output[0].arguments)
    cut = client.responses.create(**{**kw, "extra_body": {**SPEC_ON, **NO_CLOSING, **long_writer}})
    assert cut.status == "incomplete" and cut.output[-1].status == "incomplete"


def test_a_schema_is_closed_instead_of_cut(srv, client, long_writer):
    need = shortest(srv, StructuredOutput.json_schema(Note.model_json_schema(), "response_format"))
    kw = dict(model=MODEL, messages=ASK, temperature=0, max_tokens=need + 8)
    r = client.chat.completions.parse(**kw, response_format=Note, extra_body={**SPEC_ON, **long_writer})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.parsed is not None
    schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": Note.model_json_schema()}}
    cut = client.chat.completions.create(**kw, response_format=schema,
                                         extra_body={**SPEC_ON, **NO_CLOSING, **long_writer})  # fmt: skip
    assert cut.choices[0].finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.choices[0].message.content)


@pytest.mark.parametrize("budget", [0, 7, 23])
def test_speculation_is_exact_with_closing(client, one_call, long_writer, budget):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0,
              max_tokens=one_call + budget)  # fmt: skip
    on = client.chat.completions.create(**kw, extra_body={**SPEC_ON, **long_writer})
    off = client.chat.completions.create(**kw, extra_body={**SPEC_OFF, **long_writer})
    assert [(c.function.name, c.function.arguments) for c in on.choices[0].message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in off.choices[0].message.tool_calls
    ]
    assert on.usage.completion_tokens == off.usage.completion_tokens
    assert on.usage.speculative["draft_tokens"] > 0 or budget < 20  # little room: nearly all of it is forced
    seeded = dict(kw, temperature=1.0, seed=5)
    on = client.chat.completions.create(**seeded, extra_body={**SPEC_ON, **long_writer}).choices[0].message
    off = client.chat.completions.create(**seeded, extra_body={**SPEC_OFF, **long_writer}).choices[0].message
    assert [c.function.arguments for c in on.tool_calls] == [c.function.arguments for c in off.tool_calls]


def test_openai_agents_default_model_runs_a_required_tool_with_parallel_calls(srv, one_call, long_writer):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # the SDK would export traces to OpenAI's servers
    calls = []

    @agents.function_tool
    def note(flags: list[bool]) -> str:
        """Keep a note."""
        calls.append(flags)
        return "kept"

    client = openai.AsyncOpenAI(base_url=srv.base + "/v1", api_key="unused")
    model = agents.OpenAIProvider(openai_client=client).get_model(MODEL)
    assert type(model).__name__ == "OpenAIResponsesModel"
    # A model that would write calls without end: the budget closes the first and begins no second, so
    # the response completes (the SDK fails an incomplete one).
    settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=True, max_tokens=one_call + 20,
                                    temperature=0, extra_body=long_writer)  # fmt: skip
    agent = agents.Agent(name="a", instructions="Keep notes.", tools=[note], model=model, model_settings=settings,
                         tool_use_behavior="stop_on_first_tool")  # fmt: skip
    result = asyncio.run(agents.Runner.run(agent, "Note this.", max_turns=2))
    assert len(calls) == 1 and result.final_output == "kept"


def test_an_ending_is_found_mid_character_and_near_the_budget_no_character_is_begun(srv):
    """Inside a string, after a token holding a character's first bytes only, the grammar allows nothing
    but the character's next byte: the ending takes it (it used to find none, and the row was left
    unclosed: ~15% of sampled `{"type": "object"}` outputs came back cut). Near the budget such a
    token is left out with those that open structure: its remaining bytes would lengthen the ending."""
    state = srv.engine.grammars.start(StructuredOutput.json_schema({"type": "object"}, "response_format"), left=10_000)
    m, vocab = state.matcher, state.closing.vocab
    scratch = torch.empty(state.words, dtype=torch.int32)
    tok = vocab.tokenizer
    opening = tok.tokenize_str('{"')
    assert m.try_consume_tokens(opening) == len(opening)
    lead = None
    for t in range(tok.vocab_size):
        data = tok.decode_bytes([t])
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as e:
            if e.reason == "unexpected end of data" and m.consume_token(t):
                lead = t
                break
    assert lead is not None, "the tokenizer has a token of a character's first bytes"
    end = ending(m, state.closing, scratch)
    assert end is not None
    body = [t for t in end if t not in vocab.eos]
    assert m.try_consume_tokens(body) == len(body) and (m.is_stopped() or m.is_accepting())
    assert (int(vocab.opening[lead >> 5]) >> (lead & 31)) & 1


# Each call syntax's forced calls, with the pieces of its markup that its families' tokenizers make special
# tokens (none: all of it as text).
SPECIAL_MARKUP = {
    "deepseek_v3": DEEPSEEK,
    "deepseek_v31": DEEPSEEK,
    "kimi_k2": KIMI,
    "mistral_v11": ("[TOOL_CALLS]", "[ARGS]"),
    "glm45": ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
    "minimax_m2": ("<minimax:tool_call>", "</minimax:tool_call>"),
    "gemma4": GEMMA4,
}
SYNTAX_CASES = [(name, ()) for name in TOOL_PARSERS if name != "harmony"] + list(SPECIAL_MARKUP.items())
RUN = {
    "name": "run",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
}


@pytest.mark.parametrize(
    ("syntax", "specials"), SYNTAX_CASES, ids=[f"{n}{'-special' * bool(s)}" for n, s in SYNTAX_CASES]
)
def test_every_call_syntax_is_closed_from_its_start_and_from_inside_a_value(tokenizer_dir, syntax, specials):
    """A forced call is closed within the budget in every syntax: an ending is found from the output's
    start and from inside a value the model is writing, each row's ending is the one before it less its
    first token (what closing relies on: a row that allows an ending's first token alone is followed
    by rows whose endings still fit), and what it completes is read back as the call with the value
    begun. (A value that is text ends only at its syntax's closing tag, which none of
    JSON's closers writes: XML values, and DeepSeek's and Kimi's runs of calls, were not closed at all,
    and such calls ran past ``max_tokens`` and were dropped.)"""
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_tokens(list(specials), special_tokens=True)
    fmt = {**FORMATS, **TOOL_PARSERS}[syntax].bind(tok)
    grammars = Grammars(tok, VOCAB, [tok.eos_token_id])
    scratch = torch.empty(grammars.words, dtype=torch.int32)
    written = fmt.render([("run", {"code": "print(1)\nx = 2"})])
    cases = [(RUN, "", ""), (RUN, written[: written.index("x = ") + 3], "print(1)\nx =")]
    if syntax not in ("pythonic", "gemma4"):  # a key the schema does not name, begun (those grammars take none)
        extra = fmt.render([("run", {"code": "x", "extra": 1})])
        cases.append((RUN, extra[: extra.index("extra") + 2], "x"))
    if syntax == "pythonic":  # an untyped value in single quotes, which JSON's closers do not close
        cases.append(({"name": "run", "parameters": {"type": "object"}}, "[run(code='pri", "pri"))
    short = {
        "name": "run",
        "parameters": {**RUN["parameters"], "properties": {"code": {"type": "string", "maxLength": 3}}},
    }
    full = fmt.render([("run", {"code": "abc"})])  # a value one character short of its bound: closed as it is
    cases.append((short, full[: full.index("abc") + 2], "ab"))
    for tool, prefix, begun in cases:
        so = StructuredOutput("grammar", fmt.grammar([tool], True), None, "tool_choice", closers=fmt.closers)
        state = grammars.start(so, left=10_000)
        assert state.closing is not None, "no ending from the output's start"
        ids = tok.encode(prefix, add_special_tokens=False)
        assert state.advance(ids) == len(ids), state.error
        end = ending(state.matcher, state.closing, scratch)
        assert end is not None, f"no ending after {prefix!r}"
        body = [t for t in end if t != tok.eos_token_id]
        for i, t in enumerate(body):  # each row's ending is the one before it less its first token
            assert state.advance([t]) == 1
            assert ending(state.matcher, state.closing, scratch) == end[i + 1 :], (prefix, i)
        assert state.matcher.is_stopped() or state.matcher.is_accepting()
        _, calls = fmt.for_tools([tool]).parse(tok.decode(ids + body, skip_special_tokens=False))
        assert [c.name for c in calls] == ["run"]
        code = json.loads(calls[0].arguments)["code"]
        assert code.startswith(begun) and (tool is not short or code == begun), (prefix, code)
