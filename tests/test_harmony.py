"""gpt-oss's harmony format through a real server, with the official openai SDK: the analysis channel as
``reasoning_content``, the final channel as ``content``, messages ``to=functions.NAME`` as ``tool_calls``
(auto, required, named; streamed and not), ``reasoning_effort`` reaching the template, the Responses
API, and the markers never in content.

There is no gpt-oss tokenizer here: the test tokenizer gets the harmony markers as special tokens, and a
small harmony chat template (below) renders the conversation. Outputs are made two ways, both through
the real engine: a Lark grammar that writes a whole harmony text (on a server without a reasoning
parser, where a grammar applies from the first token), and the random model writing freely inside the
harmony prelude's grammar (``--reasoning-parser harmony``), where what it wrote is read back from the
logprobs' token bytes and split by a reference reading in this file."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import httpx
import openai
import pytest
import transformers
from pydantic import BaseModel, Field

from conftest import build_model_dir
from engine.request.structured import Prelude, StructuredOutput
from server.app import ServerSettings, create_app
from server.harmony import MARKERS, HarmonyStream, HarmonyVocab, prelude_lark
from server.reasoning import HARMONY, effort_switch, reads_effort
from server.tool_formats import TOOL_PARSERS, detect_format
from servers import Served, engine_factory, serve, wait_until

MODEL = "tiny-gpt-oss"
SPEC_ON = {"speculative": {"num_draft_tokens": 3}}
SPEC_OFF = {"speculative": {"enabled": False}}
HARMONY_FMT = TOOL_PARSERS["harmony"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# The harmony conventions in a small template: a system message with the reasoning level, the tools in a
# developer message, each message <|start|>{role}<|message|>{content}<|end|>, an assistant's call as a
# commentary message to=functions.NAME ended by <|call|>, and the generation prompt <|start|>assistant.
TEMPLATE = (
    "<|start|>system<|message|>You are a test model.\nReasoning: "
    "{{ reasoning_effort if reasoning_effort is defined else 'medium' }}\n"
    "# Valid channels: analysis, commentary, final.<|end|>"
    "{% if tools %}<|start|>developer<|message|># Tools\nnamespace functions {\n"
    "{% for t in tools %}type {{ t['function']['name'] }} = (_: {{ t['function']['parameters'] | tojson }}) => any;\n"
    "{% endfor %}}<|end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] in ('system', 'developer') %}<|start|>developer<|message|>{{ m['content'] }}<|end|>"
    "{% elif m['role'] == 'user' %}<|start|>user<|message|>{{ m['content'] }}<|end|>"
    "{% elif m['role'] == 'assistant' and m.get('tool_calls') %}{% for c in m['tool_calls'] %}"
    "<|start|>assistant<|channel|>commentary to=functions.{{ c['function']['name'] }} <|constrain|>json<|message|>"
    "{{ c['function']['arguments'] | tojson }}<|call|>{% endfor %}"
    "{% elif m['role'] == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m['content'] }}<|end|>"
    "{% elif m['role'] == 'tool' %}<|start|>functions.{{ m.get('name') or 'tool' }} to=assistant<|channel|>"
    "commentary<|message|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


class Weather(BaseModel):
    city: str = Field(max_length=10)
    unit: Literal["c", "f"]


class Lookup(BaseModel):
    query: str = Field(max_length=12)
    limit: int = Field(ge=1, le=9)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": Weather.model_json_schema()}},
    {"type": "function", "function": {"name": "lookup", "parameters": Lookup.model_json_schema()}},
]
MODELS = {"get_weather": Weather, "lookup": Lookup}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def harmony_model(root: Path, tokenizer_dir: Path, arch: str = "Qwen3ForCausalLM", **overrides) -> Path:
    """A tiny random model whose tokenizer has the harmony markers as special tokens (ids 376 to 382),
    ``<|return|>`` and ``<|call|>`` ending generation as gpt-oss's generation_config says."""
    if arch == "GptOssForCausalLM":
        from test_gpt_oss import build_dir

        d = build_dir(root, tokenizer_dir, max_position_embeddings=2048, **overrides)
    else:
        d = build_model_dir(root, tokenizer_dir, arch, max_position_embeddings=2048, **overrides)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    tok.add_special_tokens({"additional_special_tokens": list(MARKERS)})
    tok.chat_template = TEMPLATE
    for f in d.glob("chat_template.*"):
        f.unlink()
    tok.save_pretrained(d)
    gen = json.loads((d / "generation_config.json").read_text())
    gen["eos_token_id"] = [1, *tok.convert_tokens_to_ids(["<|return|>", "<|call|>"])]
    (d / "generation_config.json").write_text(json.dumps(gen))
    return d


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir) -> Path:
    return harmony_model(tmp_path_factory.mktemp("harmony") / "m", tokenizer_dir)


@pytest.fixture(scope="module")
def tok(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def srv(model_dir) -> Iterator[Served]:
    """--reasoning-parser harmony (the tool parser is auto: harmony, from the template)."""
    factory = engine_factory(model_dir, draft_model=str(model_dir), num_speculative_tokens=3, max_model_len=2048)
    with serve(create_app(ServerSettings(served_model_name=MODEL, reasoning_parser="harmony"), factory)) as s:
        yield s


@pytest.fixture(scope="module")
def plain(model_dir) -> Iterator[openai.OpenAI]:
    """No reasoning parser: harmony is read all the same (the template selects the harmony tool parser),
    and a request's grammar applies from the output's first token, so it can write a whole harmony text."""
    factory = engine_factory(model_dir, max_model_len=2048)
    with serve(create_app(ServerSettings(served_model_name=MODEL), factory)) as s:
        with openai.OpenAI(base_url=s.base + "/v1", api_key="x", max_retries=0, timeout=120) as c:
            yield c


def lark_writing(text: str) -> str:
    """A Lark grammar that writes exactly ``text``, its markers as the special tokens."""
    parts = re.split("(" + "|".join(re.escape(m) for m in MARKERS) + ")", text)
    return "start: " + " ".join(p if p in MARKERS else json.dumps(p) for p in parts if p) + "\n"


def scripted(client, text: str, **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 200)
    return client.chat.completions.create(model=MODEL, temperature=0, extra_body={"structured_outputs": {
        "grammar": lark_writing(text)}}, **kw)  # fmt: skip


def no_markers(*texts) -> None:
    for t in texts:
        assert t is None or not any(m in t for m in MARKERS), t


# -- a reference reading (independent of server/harmony.py) ------------------------------------------------
def reference(raw: str) -> tuple[str | None, str, list[tuple[str, str]]]:
    """(reasoning, content, calls) of a whole harmony output: messages split at <|start|>assistant, each a
    header and a body up to its end marker."""
    reasoning, content, calls = [], [], []
    for part in raw.split("<|start|>assistant"):
        if "<|message|>" not in part:
            continue
        header, body = part.split("<|message|>", 1)
        body = re.split(r"<\|(?:end|return|call)\|>", body)[0]
        channel = re.search(r"<\|channel\|>(\w+)", header)
        to = re.search(r"to=([\w.]+)", header)
        if to:  # a call, or a message to a built-in tool, which is not read
            if to.group(1).startswith("functions."):
                calls.append((to.group(1).removeprefix("functions."), body))
        elif channel and channel.group(1) == "analysis":
            reasoning.append(body)
        else:
            content.append(body)
    return ("\n\n".join(reasoning) if reasoning else None), "\n\n".join(x for x in content if x), calls


def raw_text(logprobs) -> tuple[str, list[str]]:
    """What the model wrote, from the logprobs' token bytes (markers included), and its tokens' texts."""
    raw = b"".join(bytes(e.bytes) for e in logprobs.content).decode("utf-8")
    return raw, [bytes(e.bytes).decode("utf-8", "replace") for e in logprobs.content]  # (a marker is whole)


def analysis_tokens(pieces: list[str]) -> int:
    """Tokens of the analysis messages: from the <|start|> that began one (or the output's start) up to and
    including its end marker."""
    count, message = 0, []
    for p in pieces + ["<|start|>"]:
        if p == "<|start|>" and message:
            header = "".join(message).split("<|message|>")[0]
            if re.search(r"<\|channel\|>analysis", header) and "to=" not in header:
                ends = [i for i, q in enumerate(message) if q in ("<|end|>", "<|return|>", "<|call|>")]
                count += ends[0] + 1 if ends else len(message)
            message = []
        message.append(p)
    return count


def tokens_starting(tok, words: list[str]) -> dict[str, int]:
    """A logit bias keeping the model from starting any of ``words`` by itself (a grammar's closing
    within max_tokens may still write them)."""
    ids = [i for i in range(len(tok)) if (t := tok.decode([i])) and any(w.startswith(t) for w in words)]
    return {str(i): -100 for i in ids}


# -- the reading alone ---------------------------------------------------------------------------------------------
OPENING = "<|start|>user<|message|>hi<|end|><|start|>assistant"
OUTPUTS = [
    "<|channel|>analysis<|message|>Think <b>.<|end|><|start|>assistant<|channel|>final<|message|>The answer.",
    "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
    "<|start|>assistant<|channel|>final<|message|>c<|return|>",
    "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather"
    ' <|constrain|>json<|message|>{"city":"Paris","unit":"c"}<|call|>',
    ' to=functions.lookup<|channel|>commentary json<|message|>{"query":"x","limit":2}',  # recipient first
    "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.lookup"
    '<|constrain|>json<|message|>{"query":"y","limit":1}',  # a preamble, then a call
    "<|channel|>analysis to=browser.search<|message|>{}<|end|><|start|>assistant<|channel|>final<|message|>ok",
    "<|channel|>analysis<|message|>cut inside the analy",
    "<|channel|>final<|message|>just an answer, 1 < 2 <|",
    "plain words from a model that does not speak harmony",
    "<|channel|>analysis<|message|>x<|end|>\n<|start|>assistant<|channel|>final<|message|><|end|>",
]


@pytest.mark.parametrize("text", OUTPUTS)
@pytest.mark.parametrize("calls", [True, False])
def test_any_chunking_of_a_stream_reads_as_the_whole_text(text, calls):
    reader = HARMONY.reader(_Tok(), HARMONY.frame(OPENING), calls)
    whole = reader.split(text)
    rng = random.Random(text)
    for _ in range(8):
        stream = reader.stream()
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        parts = [stream.feed(text[i:j]) for i, j in zip([0, *cuts], [*cuts, len(text)])] + [stream.finish()]
        reasoning = "".join(p[0] for p in parts)
        assert (reasoning if stream.thought else None, "".join(p[1] for p in parts)) == whole
    reasoning, content = whole
    no_markers(reasoning)
    if not calls:  # calls are dropped: nothing of a marker reaches the content
        no_markers(content)
    harmony = "<|message|>" in text
    ref_reasoning, ref_content, ref_calls = reference("<|start|>assistant" + text) if harmony else (None, text, [])
    assert reasoning == ref_reasoning
    parsed, found = HARMONY_FMT.parse(content)  # the tool parser reads what the split leaves
    assert [(c.name, c.arguments) for c in found] == (ref_calls if calls else [])
    assert (parsed or "") == ref_content
    no_markers(parsed)


class _Tok:
    """Enough of a tokenizer for HarmonyVocab: each marker one token (the reading itself needs no ids)."""

    def encode(self, text, add_special_tokens=False):
        return [MARKERS.index(text)] if text in MARKERS else list(text.encode())

    def decode(self, ids, **kw):
        return "".join(MARKERS[i] for i in ids)


def test_headers_and_what_a_message_is():
    for text, channel, recipient, kind in [
        ("assistant<|channel|>analysis", "analysis", None, "reasoning"),
        ("assistant<|channel|>final", "final", None, "content"),
        ("assistant<|channel|>commentary", "commentary", None, "content"),  # a preamble
        ("assistant<|channel|>commentary to=functions.f <|constrain|>json", "commentary", "functions.f", "call"),
        ("assistant to=functions.f<|channel|>commentary json", "commentary", "functions.f", "call"),
        ("assistant<|channel|>analysis to=python code", "analysis", "python", "other"),
        ("assistant", None, None, "content"),
    ]:
        stream = HarmonyStream("<|start|>")
        events = stream.feed(text + "<|message|>body")
        assert events == [("open", events[0][1]), ("text", "body")]
        header = events[0][1]
        assert (header.channel, header.recipient, header.kind) == (channel, recipient, kind), text


def test_the_markers_are_special_tokens(tok):
    assert tok.convert_tokens_to_ids(list(MARKERS)) == list(range(376, 383))
    assert set(range(376, 383)) <= set(tok.all_special_ids)
    assert tok.decode(
        tok.encode("<|channel|>final<|message|>x", add_special_tokens=False), skip_special_tokens=True
    ) == (
        "finalx"  # what skipping them gives: the reason harmony is read with them kept
    )


def test_a_tokenizer_without_the_markers_is_refused(tokenizer_dir, model_dir):
    with pytest.raises(ValueError, match=re.escape("'<|start|>' is not one token of this tokenizer")):
        HarmonyVocab.of(transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
    qwen = build_model_dir(model_dir.parent / "qwen3", tokenizer_dir, "Qwen3ForCausalLM")
    for flag, field in [("--reasoning-parser harmony", "reasoning_parser"), ("--tool-call-parser harmony",
                                                                            "tool_call_parser")]:  # fmt: skip
        st = ServerSettings(served_model_name=MODEL, **{field: "harmony"})
        with serve(create_app(st, engine_factory(qwen)), wait_ready=False) as s:
            wait_until(lambda: httpx.get(s.base + "/health").json()["status"] != "loading", "the load to end", 120)
            health = httpx.get(s.base + "/health").json()
            assert health["status"] == "error" and f"{flag}: '<|start|>' is not one token" in health["error"], health


def test_reasoning_tokens_are_the_analysis_messages_tokens(tok):
    vocab = HarmonyVocab.of(tok)
    for text in OUTPUTS:
        ids = tok.encode(text, add_special_tokens=False)
        pieces = [tok.decode([i], skip_special_tokens=False) for i in ids]
        assert vocab.reasoning_tokens(ids, OPENING) == analysis_tokens(pieces), text


def test_the_format_reads_what_it_writes():
    calls = [("get_weather", {"city": "Oslo", "unit": "c"}), ("lookup", {"query": "x", "limit": 2})]
    text = HARMONY_FMT.render(calls)
    content, parsed = HARMONY_FMT.parse(text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in parsed] == calls
    assert HARMONY_FMT.parse("plain words") == ("plain words", [])
    content, parsed = HARMONY_FMT.parse(text[: -len("<|call|>") - 3], cut=True)
    assert content is None and [c.name for c in parsed] == ["get_weather"]
    content, parsed = HARMONY_FMT.parse("Checking." + text + " Done.")
    assert content == "Checking.\n\nDone." and len(parsed) == 2


def test_templates_select_harmony_and_effort():
    assert detect_format(TEMPLATE).name == "harmony" and detect_format("<tool_call>").name == "hermes"
    assert reads_effort(TEMPLATE) and not reads_effort("{{ messages }}")
    # gpt-oss reads an assistant message's ``thinking``: that is no switch that turns thinking off
    assert effort_switch("{% if message.thinking %}{{ message['thinking'] }}{% endif %}") is None
    assert effort_switch("{% if enable_thinking is false %}") == "enable_thinking"


def test_the_grammars_compile(tok):
    from engine.structured.grammar import Grammars

    grammars = Grammars(tok, 384, [1, *tok.convert_tokens_to_ids(["<|return|>", "<|call|>"])])
    calls = StructuredOutput("grammar", HARMONY_FMT.grammar([t["function"] for t in TOOLS], True), None, "tool_choice")
    for answer in (calls, StructuredOutput.json_schema(Weather.model_json_schema(), "response_format")):
        for opened in (False, True):
            lark = prelude_lark(answer is calls, opened)
            grammars.compile(StructuredOutput(answer.kind, answer.spec, None, "x", prelude=Prelude(lark)))


# -- scripted outputs, no reasoning parser ---------------------------------------------------------------------
CALL = (
    "<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris","unit":"c"}<|call|>'
)
FINAL = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>"


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_under_auto_is_parsed(plain, stream):
    kw = dict(tools=TOOLS, tool_choice="auto")
    if not stream:
        choice = scripted(plain, CALL, **kw).choices[0]
    else:
        with plain.chat.completions.stream(model=MODEL, messages=ASK, max_tokens=200, temperature=0, extra_body={
                "structured_outputs": {"grammar": lark_writing(CALL)}}, **kw) as s:  # fmt: skip
            choice = s.get_final_completion().choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content in (None, "")
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    assert call.function.arguments == '{"city":"Paris","unit":"c"}'
    assert "reasoning_content" not in (choice.message.model_extra or {})  # no reasoning parser: left out


def test_the_final_channel_is_the_content_and_the_markers_never_are(plain):
    r = scripted(plain, FINAL)
    assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens_details is None  # no reasoning parser: no reasoning counted
    content = "".join(ch.delta.content or "" for chunk in scripted(plain, FINAL, stream=True) for ch in chunk.choices)
    assert content == "It is sunny."
    # the raw text is there, markers and all, for who asks the completions endpoint
    raw = plain.completions.create(model=MODEL, prompt="x", max_tokens=80, temperature=0, extra_body={
        "skip_special_tokens": False, "structured_outputs": {"grammar": lark_writing(FINAL)}})  # fmt: skip
    assert raw.choices[0].text == FINAL.removesuffix("<|return|>")


def test_recipient_first_and_none_and_a_preamble(plain):
    text = ' to=functions.lookup<|channel|>commentary json<|message|>{"query":"rain","limit":3}<|call|>'
    m = scripted(plain, text, tools=TOOLS).choices[0].message
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [
        ("lookup", {"query": "rain", "limit": 3})
    ]
    r = scripted(plain, CALL, tools=TOOLS, tool_choice="none")  # calls not read: dropped, never content
    assert r.choices[0].message.content == "" and not r.choices[0].message.tool_calls
    text = "<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant" + CALL[CALL.index("<|channel|>c") :]
    r = scripted(plain, text, tools=TOOLS)
    assert r.choices[0].message.content == "Let me look." and r.choices[0].message.tool_calls


def test_effort_reaches_the_template_without_a_reasoning_parser(plain, tok):
    counts = {}
    for effort in ("low", "medium", "high"):
        r = plain.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, reasoning_effort=effort)
        text = tok.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True, reasoning_effort=effort)
        assert f"Reasoning: {effort}\n" in text
        assert r.usage.prompt_tokens == counts.setdefault(effort, len(tok.encode(text, add_special_tokens=False)))
    assert len(set(counts.values())) > 1  # the levels tokenize apart: the counts do tell them apart
    with pytest.raises(openai.BadRequestError, match="no switch that turns its thinking off"):
        plain.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, reasoning_effort="none")


# -- --reasoning-parser harmony: the model writes inside the prelude's grammar ------------------------------------
def thinking_request(client, tok, stream: bool = False, **kw):
    """The model thinks (it may not start a final message or a preamble by itself), then its answer is
    closed within max_tokens."""
    kw.setdefault("max_tokens", 48)
    extra = {**SPEC_ON, **kw.pop("extra", {})}
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", ASK), temperature=0, logprobs=True,
                                          logit_bias=tokens_starting(tok, ["final", "commentary"]), extra_body=extra,
                                          stream=stream, **kw)  # fmt: skip


YES_NO = {"structured_outputs": {"choice": ["yes", "no"]}}


def test_analysis_is_reasoning_and_final_is_content(client, tok):
    r = thinking_request(client, tok, extra=YES_NO)
    m, choice = r.choices[0].message, r.choices[0]
    raw, pieces = raw_text(choice.logprobs)
    reasoning, content, calls = reference("<|start|>assistant" + raw)
    assert reasoning and m.model_extra["reasoning_content"] == m.model_extra["reasoning"] == reasoning
    assert m.content == content in ("yes", "no") and not calls and choice.finish_reason == "stop"
    assert r.usage.completion_tokens_details.reasoning_tokens == analysis_tokens(pieces) > 0
    no_markers(m.content, reasoning)


@pytest.mark.parametrize("stream", [False, True])
def test_separate_reasoning_false_keeps_the_analysis_in_the_content(client, tok, stream):
    """SGLang's ``separate_reasoning: false``: the analysis stays in the content where it was written,
    a blank line before the final message, with no marker; nothing is reasoning."""
    reference_msg = thinking_request(client, tok, extra=YES_NO).choices[0].message
    thought, answer = reference_msg.model_extra["reasoning_content"], reference_msg.content
    extra = {**YES_NO, "separate_reasoning": False}
    if not stream:
        r = thinking_request(client, tok, extra=extra)
        m = r.choices[0].message
        content, reasoning = m.content, m.model_extra.get("reasoning_content")
        assert not r.usage.completion_tokens_details or not r.usage.completion_tokens_details.reasoning_tokens
    else:
        content, reasoning = "", None
        for chunk in thinking_request(client, tok, stream=True, extra=extra):
            for ch in chunk.choices:
                content += ch.delta.content or ""
                reasoning = reasoning or (ch.delta.model_extra or {}).get("reasoning_content")
    assert thought and reasoning is None and content == thought + "\n\n" + answer
    no_markers(content, None)


@pytest.mark.parametrize("spec", [SPEC_ON, SPEC_OFF], ids=["speculation", "plain"])
def test_streamed_deltas_join_to_the_whole_message(client, tok, spec):
    whole = thinking_request(client, tok, extra={**YES_NO, **spec}).choices[0].message
    reasoning = content = ""
    for chunk in thinking_request(client, tok, stream=True, extra={**YES_NO, **spec}):
        for ch in chunk.choices:
            extra = ch.delta.model_extra or {}
            assert extra.get("reasoning_content") == extra.get("reasoning")
            reasoning += extra.get("reasoning_content") or ""
            content += ch.delta.content or ""
            no_markers(ch.delta.content, extra.get("reasoning_content"))
    assert reasoning == whole.model_extra["reasoning_content"] and content == whole.content


def test_a_schema_is_the_final_message(client, tok):
    r = thinking_request(client, tok, max_tokens=80, response_format={
        "type": "json_schema", "json_schema": {"name": "w", "schema": Weather.model_json_schema()}})  # fmt: skip
    m = r.choices[0].message
    Weather.model_validate_json(m.content)
    assert m.model_extra["reasoning_content"] and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "lookup"}}])
def test_forced_calls_after_the_analysis(client, tok, choice):
    kw = dict(tools=TOOLS, tool_choice=choice, max_tokens=90)
    r = thinking_request(client, tok, **kw)
    c = r.choices[0]
    raw, pieces = raw_text(c.logprobs)
    reasoning, _, calls = reference("<|start|>assistant" + raw)
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert c.message.model_extra["reasoning_content"] == reasoning
    assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls] == calls
    for t in c.message.tool_calls:
        MODELS[t.function.name].model_validate_json(t.function.arguments)
    if isinstance(choice, dict):
        assert [t.function.name for t in c.message.tool_calls] == ["lookup"]
    assert r.usage.completion_tokens_details.reasoning_tokens == analysis_tokens(pieces)
    # streamed: the same calls, each delta with its index, the first with its id, type and name
    deltas, reasoning = [], ""
    for chunk in thinking_request(client, tok, stream=True, **kw):
        for ch in chunk.choices:
            reasoning += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            deltas += ch.delta.tool_calls or []
            assert not ch.delta.content
    assert reasoning == c.message.model_extra["reasoning_content"]
    assert all(d.index == 0 for d in deltas) and deltas[0].id and deltas[0].type == "function"
    assert all(d.function.name is None for d in deltas[1:])
    name = deltas[0].function.name
    assert [(name, "".join(d.function.arguments or "" for d in deltas))] == calls
    # speculation is exact through the analysis and the call
    off = thinking_request(client, tok, extra=SPEC_OFF, **kw).choices[0].message
    assert [(t.function.name, t.function.arguments) for t in off.tool_calls] == calls


def test_the_responses_api_reads_harmony(client, tok):
    kw = dict(model=MODEL, input="Weather in Paris?", max_output_tokens=48, temperature=0,
              extra_body={**YES_NO, "logit_bias": tokens_starting(tok, ["final", "commentary"])})  # fmt: skip
    r = client.responses.create(**kw)
    assert r.status == "completed" and [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text and r.output_text in ("yes", "no")
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    with client.responses.stream(**kw) as s:
        events = list(s)
        final = s.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == r.output[0].content[0].text == final.output[0].content[0].text
    kw.update(extra_body={"logit_bias": kw["extra_body"]["logit_bias"]}, max_output_tokens=90)
    forced = client.responses.create(**kw, tools=[{"type": "function", **TOOLS[0]["function"]}],
                                     tool_choice="required")  # fmt: skip
    assert [i.type for i in forced.output] == ["reasoning", "function_call"]
    Weather.model_validate_json(forced.output[1].arguments)


def test_refused_and_left_alone(srv, client):
    r = httpx.post(srv.base + "/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 4,
                                                             "thinking_token_budget": 4})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget", r.text
    assert "not supported with --reasoning-parser harmony" in r.json()["error"]["message"]
    # include_reasoning false: the same answer, without the reasoning
    on = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=0)
    off = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=0,
                                         extra_body={"include_reasoning": False})  # fmt: skip
    assert off.choices[0].message.content == on.choices[0].message.content
    assert "reasoning_content" not in (off.choices[0].message.model_extra or {})
    no_markers(on.choices[0].message.content, (on.choices[0].message.model_extra or {}).get("reasoning_content"))
    # completions are not chat: special tokens are skipped as before
    text = client.completions.create(model=MODEL, prompt="x", max_tokens=12, temperature=0).choices[0].text
    no_markers(text)


def test_a_gpt_oss_model_end_to_end(tmp_path, tokenizer_dir):
    """The same on the gpt-oss architecture itself (tiny, random): a scripted call and a free answer."""
    d = harmony_model(tmp_path / "gpt-oss", tokenizer_dir, "GptOssForCausalLM")
    st = ServerSettings(served_model_name=MODEL, reasoning_parser="harmony")
    with serve(create_app(st, engine_factory(d, max_model_len=2048))) as s:
        with openai.OpenAI(base_url=s.base + "/v1", api_key="x", max_retries=0, timeout=120) as c:
            tok = transformers.AutoTokenizer.from_pretrained(d)
            r = thinking_request(c, tok, tools=TOOLS, tool_choice="required", max_tokens=90, extra=SPEC_OFF)
            m = r.choices[0].message
            assert r.choices[0].finish_reason == "tool_calls" and m.model_extra["reasoning_content"]
            MODELS[m.tool_calls[0].function.name].model_validate_json(m.tool_calls[0].function.arguments)
