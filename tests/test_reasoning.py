"""Reasoning models and template controls through a real server, with the official openai SDK: a tiny
Qwen3-style checkpoint whose chat template takes ``enable_thinking`` and whose tokenizer has
``<think>`` / ``</think>`` tokens; ``chat_template_kwargs`` per request and as the server's default,
``reasoning_effort``, the thinking split into ``reasoning_content`` (streamed and not), a thinking
budget that forces the end of thinking (with speculation on, exactly as without), tool calls and
schemas applied after the thinking, the Responses API's reasoning items, and ``generation_config.json``
defaults. The random model never ends its thinking by itself: a thinking budget ends it, at a known
token, which is what lets these tests know what the output must be."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import transformers
from pydantic import BaseModel, Field
from tokenizers import AddedToken

from conftest import build_model_dir
from server.app import ServerSettings, create_app
from server.reasoning import FIELDS, SYNTAXES, ReasoningFrame, ReasoningStream
from servers import Served, engine_factory, serve

MODEL = "tiny-qwen3"
SPEC_ON = {"speculative": {"num_draft_tokens": 3}}
SPEC_OFF = {"speculative": {"enabled": False}}

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Qwen3's conventions in a small template: tools described in a system turn, an assistant turn's
# reasoning_content replayed between think tags, and thinking turned off by writing an empty thinking.
TEMPLATE = (
    "{% if tools %}<|bos|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call with <tool_call>{json}</tool_call>.\n{% endif %}"
    "{% for m in messages %}<|bos|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and m.get('reasoning_content') %}<think>\n{{ m['reasoning_content'] }}\n"
    "</think>\n\n{% endif %}{{ m['content'] or '' }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
# DeepSeek-R1's: the generation prompt opens the thinking itself.
R1_TEMPLATE = (
    "{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n<think>\n{% endif %}"
)


class Answer(BaseModel):
    word: str = Field(max_length=8)
    n: int = Field(ge=0, le=9)


def thinking_model(root: Path, tokenizer_dir: Path, template: str, generation: dict | None = None) -> Path:
    """A tiny Qwen3 whose tokenizer has the think tokens (not special, as Qwen3's are not)."""
    d = build_model_dir(root, tokenizer_dir, "Qwen3ForCausalLM", max_position_embeddings=1024)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                    AddedToken("</think>", special=False, normalized=False)])  # fmt: skip
    tok.chat_template = template
    for f in d.glob("chat_template.*"):
        f.unlink()
    tok.save_pretrained(d)
    if generation is not None:
        gen = json.loads((d / "generation_config.json").read_text())
        (d / "generation_config.json").write_text(json.dumps({**gen, **generation}))
    return d


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, tokenizer_dir) -> Path:
    return thinking_model(tmp_path_factory.mktemp("qwen3") / "m", tokenizer_dir, TEMPLATE)


@pytest.fixture(scope="module")
def tok(qwen_dir):
    return transformers.AutoTokenizer.from_pretrained(qwen_dir)


def settings(**kw) -> ServerSettings:
    return ServerSettings(served_model_name=MODEL, reasoning_parser="qwen3", **kw)


@pytest.fixture(scope="module")
def srv(qwen_dir) -> Iterator[Served]:
    factory = engine_factory(qwen_dir, draft_model=str(qwen_dir), num_speculative_tokens=3, max_model_len=1024)
    with serve(create_app(settings(), factory)) as s:
        yield s


def rendered(tok, messages, **kw) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw),
                      add_special_tokens=False)  # fmt: skip


ASK = [{"role": "user", "content": "Think, then answer."}]
OPEN = {"logit_bias": {"376": 100}}  # makes the model open its thinking (the grammar allows it only first)
NO_THINK_TOKENS = {"logit_bias": {"376": -100, "377": -100}}  # the random model never writes a marker itself


def chat(client, budget: int | None = 4, extra: dict | None = None, **kw):
    body = {**SPEC_ON, **(extra or {})}
    if budget is not None:
        body["thinking_token_budget"] = budget
    kw.setdefault("max_tokens", 24)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", ASK), extra_body=body, **kw)


def assert_budget(usage, budget: int, opened_by_model: bool) -> None:
    """The thinking ended where its budget was spent: its tokens are the opening marker (when the model
    wrote it), ``budget`` thinking tokens, up to three more where the budget ran out inside a character
    (the thinking is whole characters), and the end marker."""
    least = budget + 1 + opened_by_model
    assert least <= usage.completion_tokens_details.reasoning_tokens <= least + 3, usage


# -- template controls ----------------------------------------------------------------------------------------
def test_the_think_tokens(tok):
    assert tok.convert_tokens_to_ids(["<think>", "</think>"]) == [376, 377]


def test_chat_template_kwargs_render_per_request(client, tok):
    on, off = rendered(tok, ASK), rendered(tok, ASK, enable_thinking=False)
    assert len(off) > len(on)
    r = chat(client, budget=None, max_tokens=2)
    assert r.usage.prompt_tokens == len(on)
    r = chat(client, budget=None, max_tokens=2, extra={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens == len(off)


def test_tokenize_renders_them_the_same_way(http, tok):
    body = {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}
    assert http.post("/tokenize", json=body).json()["tokens"] == rendered(tok, ASK, enable_thinking=False)


def test_server_default_kwargs_and_a_request_overriding_them(qwen_dir, tok):
    defaults = {"enable_thinking": False}
    with serve(create_app(settings(default_chat_template_kwargs=defaults), engine_factory(qwen_dir))) as s:
        with openai.OpenAI(base_url=s.base + "/v1", api_key="x", max_retries=0) as c:
            assert chat(c, budget=None, max_tokens=2).usage.prompt_tokens == len(rendered(tok, ASK, **defaults))
            r = chat(c, budget=None, max_tokens=2, extra={"chat_template_kwargs": {"enable_thinking": True}})
            assert r.usage.prompt_tokens == len(rendered(tok, ASK, enable_thinking=True))


@pytest.mark.parametrize(
    "body,param",
    [
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
        ({"continue_final_message": True}, "continue_final_message"),  # the last message is the user's
        ({"reasoning_effort": "lots"}, "reasoning_effort"),
        ({"thinking_token_budget": -1}, "thinking_token_budget"),
    ],
)
def test_bad_template_and_reasoning_fields_are_400(http, body, param):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert param in (err["param"] or "") or param in err["message"], err


def test_continue_final_message_continues_it(client, tok):
    messages = ASK + [{"role": "assistant", "content": "The answer is"}]
    r = chat(client, budget=None, messages=messages, max_tokens=4, extra={"continue_final_message": True,
                                                                         "add_generation_prompt": False})  # fmt: skip
    text = tok.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text.endswith("The answer is") and r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))
    plain = client.completions.create(model=MODEL, prompt=tok.encode(text, add_special_tokens=False), max_tokens=4,
                                      temperature=0)  # fmt: skip
    assert r.choices[0].message.content == plain.choices[0].text


# -- the split ---------------------------------------------------------------------------------------------------
def test_budget_forces_the_end_of_thinking_and_the_split(client, tok):
    r = chat(client, budget=4, extra=OPEN)
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] and m.model_extra["reasoning_content"] == m.model_extra["reasoning"]
    assert_budget(r.usage, 4, opened_by_model=True)
    assert "<think>" not in (m.content or "") and "</think>" not in (m.content or "")
    # The output is what the same request decoding the raw text says: thinking, then the answer.
    raw = chat(client, budget=4, extra={**OPEN, "include_reasoning": False})
    assert "reasoning_content" not in (raw.choices[0].message.model_extra or {})
    assert raw.choices[0].message.content == m.content


@pytest.mark.parametrize("spec", [SPEC_ON, SPEC_OFF], ids=["speculation", "plain"])
def test_streamed_deltas_join_to_the_whole_message(client, spec):
    whole = chat(client, budget=5, extra={**OPEN, **spec}).choices[0].message
    stream = chat(client, budget=5, extra={**OPEN, **spec}, stream=True)
    reasoning = content = ""
    for chunk in stream:
        for ch in chunk.choices:
            extra = ch.delta.model_extra or {}
            assert extra.get("reasoning_content") == extra.get("reasoning")
            reasoning += extra.get("reasoning_content") or ""
            content += ch.delta.content or ""
    assert reasoning == whole.model_extra["reasoning_content"] and content == (whole.content or "")


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_one_reasoning_field_and_openai_agents_streams_one_copy(qwen_dir, field):
    """``--reasoning-field``: the thinking comes back under that one name, streamed and whole. openai-agents'
    streamed reasoning item reads both names, each into its own part (the summary and the content), so
    served both it holds the text twice; served one, once."""
    with serve(create_app(settings(reasoning_fields=FIELDS[field]), engine_factory(qwen_dir))) as s:
        with openai.OpenAI(base_url=s.base + "/v1", api_key="x", max_retries=0) as c:
            whole = chat(c, budget=4, extra=OPEN).choices[0].message
            assert {"reasoning", "reasoning_content"} & set(whole.model_extra) == {field}
            thinking, streamed = whole.model_extra[field], ""
            for chunk in chat(c, budget=4, extra=OPEN, stream=True):
                for ch in chunk.choices:
                    extra = ch.delta.model_extra or {}
                    assert {"reasoning", "reasoning_content"} & set(extra) <= {field}, extra
                    streamed += extra.get(field) or ""
            assert thinking and streamed == thinking
        assert httpx.get(s.base + "/version").json()["reasoning_fields"] == [field]
        agents = pytest.importorskip("agents")
        agents.set_tracing_disabled(True)  # the SDK would export traces to OpenAI's servers
        aclient = openai.AsyncOpenAI(base_url=s.base + "/v1", api_key="x", max_retries=0)
        model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=aclient)
        body = {**OPEN, **SPEC_ON, "thinking_token_budget": 4}
        agent = agents.Agent(
            name="a", model=model, model_settings=agents.ModelSettings(max_tokens=24, temperature=0, extra_body=body)
        )

        async def run():
            result = agents.Runner.run_streamed(agent, ASK[0]["content"], max_turns=1)
            async for _ in result.stream_events():
                pass
            await aclient.close()
            return result

        items = [i.raw_item for i in asyncio.run(run()).new_items if i.type == "reasoning_item"]
        assert len(items) == 1
        assert [p.text for p in items[0].summary] + [p.text for p in items[0].content or []] == [thinking]


def test_speculation_is_exact_through_the_thinking_and_the_answer(client):
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": Answer.model_json_schema()}}
    for budget in (0, 3, 7):
        for fmt in (None, schema):  # a free answer, and a schema's after the thinking
            kw = dict(budget=budget, max_tokens=40) | ({"response_format": fmt} if fmt else {})
            on = chat(client, extra={**OPEN, **SPEC_ON}, **kw)
            off = chat(client, extra={**OPEN, **SPEC_OFF}, **kw)
            assert on.choices[0].message == off.choices[0].message
            assert on.usage.speculative["draft_tokens"] > 0


def test_a_schema_applies_after_the_thinking(client):
    r = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Answer, max_tokens=80,
                                      temperature=0, extra_body={"thinking_token_budget": 3, **OPEN})  # fmt: skip
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.message.parsed is not None
    assert c.message.model_extra["reasoning_content"]  # thought first, then the schema's JSON


def test_forced_tool_calls_after_the_thinking(client):
    tools = [{"type": "function", "function": {"name": "answer", "parameters": Answer.model_json_schema()}}]
    kw = dict(tools=tools, tool_choice="required", parallel_tool_calls=False, max_tokens=100, extra=OPEN)
    r = chat(client, budget=2, **kw)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content is None
    assert m.model_extra["reasoning_content"] and Answer.model_validate_json(m.tool_calls[0].function.arguments)
    calls, reasoning = {}, ""
    for chunk in chat(client, budget=2, stream=True, **kw):
        for ch in chunk.choices:
            reasoning += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            for d in ch.delta.tool_calls or []:
                calls.setdefault(d.index, ["", ""])
                calls[d.index][0] += d.function.name or ""
                calls[d.index][1] += d.function.arguments or ""
    assert reasoning == m.model_extra["reasoning_content"]
    assert [tuple(v) for v in calls.values()] == [(c.function.name, c.function.arguments) for c in m.tool_calls]


# -- effort --------------------------------------------------------------------------------------------------------
def test_reasoning_effort_maps_to_the_templates_switch(client, tok):
    off = chat(client, budget=None, max_tokens=2, reasoning_effort="none")
    assert off.usage.prompt_tokens == len(rendered(tok, ASK, enable_thinking=False, reasoning_effort="none"))
    on = chat(client, budget=None, max_tokens=2, reasoning_effort="high")
    assert on.usage.prompt_tokens == len(rendered(tok, ASK, enable_thinking=True))
    # Thinking off: the output does not start in thinking, and a budget has nothing to bound.
    r = chat(client, budget=None, max_tokens=6, reasoning_effort="minimal", extra=NO_THINK_TOKENS)
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


def test_effort_is_refused_where_the_server_has_no_reasoning_parser(qwen_dir):
    with serve(create_app(ServerSettings(served_model_name=MODEL), engine_factory(qwen_dir))) as s:
        body = {"model": MODEL, "messages": ASK, "max_tokens": 2}
        for extra, param in [({"reasoning_effort": "high"}, "reasoning_effort"),
                             ({"thinking_token_budget": 4}, "thinking_token_budget")]:  # fmt: skip
            r = httpx.post(s.base + "/v1/chat/completions", json={**body, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        r = httpx.post(s.base + "/v1/responses", json={"model": MODEL, "input": "hi", "reasoning": {"effort": "low"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning.effort", r.text
        # "none" asks for nothing a model without reasoning cannot give
        r = httpx.post(s.base + "/v1/chat/completions", json={**body, "reasoning_effort": "none"})
        assert r.status_code == 200, r.text


def test_a_template_that_opens_the_thinking(tmp_path, tokenizer_dir):
    d = thinking_model(tmp_path / "r1", tokenizer_dir, R1_TEMPLATE)
    st = ServerSettings(served_model_name=MODEL, reasoning_parser="deepseek_r1")
    with serve(create_app(st, engine_factory(d))) as s, openai.OpenAI(base_url=s.base + "/v1", api_key="x") as c:
        r = chat(c, budget=3, extra=NO_THINK_TOKENS)  # the prompt opened the thinking; the budget ends it
        m = r.choices[0].message
        assert m.model_extra["reasoning_content"]
        assert_budget(r.usage, 3, opened_by_model=False)
        cut = chat(c, budget=None, max_tokens=5, extra=NO_THINK_TOKENS)  # cut inside the thinking: all reasoning
        assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content is None
        assert cut.usage.completion_tokens_details.reasoning_tokens == 5


# Magistral's and Ministral 3's: markers that are special tokens of the tokenizer, the model opening the thinking.
MISTRAL_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}[INST]{{ m['content'] }}[/INST]"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


def test_mistral_markers_are_special_tokens_kept_for_the_reader(tmp_path, tokenizer_dir):
    """[THINK] and [/THINK] are special tokens (flagged special, as Mistral's tokenizers have them):
    decoding would leave them out, so the output keeps them for the reader, which takes them out."""
    d = build_model_dir(tmp_path / "m", tokenizer_dir, "LlamaForCausalLM")
    tok = transformers.AutoTokenizer.from_pretrained(d)
    tok.add_tokens(["[THINK]", "[/THINK]"], special_tokens=True)
    tok.chat_template = MISTRAL_TEMPLATE
    tok.save_pretrained(d)
    assert tok.convert_tokens_to_ids(["[THINK]", "[/THINK]"]) == [376, 377]  # (OPEN's bias opens the thinking)
    assert SYNTAXES["mistral"].kept_ids(tok) == (376, 377)
    st = ServerSettings(served_model_name=MODEL, reasoning_parser="mistral")
    with serve(create_app(st, engine_factory(d))) as s, openai.OpenAI(base_url=s.base + "/v1", api_key="x") as c:
        for stream in (False, True):
            r = chat(c, budget=3, extra=OPEN, stream=stream)
            if stream:
                chunks = [ch for chunk in r for ch in chunk.choices]
                reasoning = "".join((ch.delta.model_extra or {}).get("reasoning_content") or "" for ch in chunks)
                content = "".join(ch.delta.content or "" for ch in chunks)
            else:
                m = r.choices[0].message
                reasoning, content = m.model_extra["reasoning_content"], m.content or ""
                assert_budget(r.usage, 3, opened_by_model=True)
            assert reasoning and "[THINK]" not in reasoning + content and "[/THINK]" not in reasoning + content
        plain = c.completions.create(model=MODEL, prompt="x", max_tokens=3, logit_bias={"376": 100}, temperature=0)
        assert plain.choices[0].text == ""  # without a parser to read it, a special token is left out as always


# Gemma 4's: a thought channel, its markers special tokens, the thinking labelled "thought" after its opening.
GEMMA4_TEMPLATE = (
    "{% for m in messages %}<|turn>{{ m['role'] }}\n{{ m['content'] }}<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% if not enable_thinking | default(true) %}"
    "<|channel>thought\n<channel|>{% endif %}{% endif %}"
)


@pytest.mark.parametrize("size", [1, 2, 5, 100])
def test_gemma4s_thought_channel_is_the_reasoning_without_its_label(size):
    gemma = SYNTAXES["gemma4"]
    assert gemma.frame("<|turn>model\n").opened is False  # the model opens it, or answers
    assert gemma.frame("<|turn>model\n<|channel>thought\n<channel|>").opened is None  # turned off
    for text, want in [
        ("<|channel>thought\nTwo and two.\n<channel|>Four.", ("Two and two.", "Four.")),
        ("<|channel>thoughtful words<channel|>Four.", ("thoughtful words", "Four.")),  # (no label: all reasoning)
        ("<|channel>thought\nstill thinking", ("still thinking", "")),  # cut inside
        ("<|channel>thoug", ("", "")),  # cut inside the label
        ("Four.", (None, "Four.")),
    ]:
        stream = ReasoningStream(gemma, ReasoningFrame(False))
        parts = [stream.feed(text[i : i + size]) for i in range(0, len(text), size)] + [stream.finish()]
        got = ("".join(p[0] for p in parts) if stream.thought else None, "".join(p[1] for p in parts))
        assert got == want == gemma.split(text, ReasoningFrame(False)), text


def test_gemma4s_markers_are_special_tokens_kept_for_the_reader(tmp_path, tokenizer_dir):
    """Served: the thinking the model opens ends at its budget with ``<channel|>``, and neither marker
    reaches the text; enable_thinking false closes the channel in the prompt (no reasoning)."""
    d = build_model_dir(tmp_path / "g", tokenizer_dir, "LlamaForCausalLM")
    tok = transformers.AutoTokenizer.from_pretrained(d)
    tok.add_tokens(["<|channel>", "<channel|>"], special_tokens=True)
    tok.chat_template = GEMMA4_TEMPLATE
    tok.save_pretrained(d)
    assert SYNTAXES["gemma4"].kept_ids(tok) == (376, 377)  # (OPEN's bias opens the thinking)
    st = ServerSettings(served_model_name=MODEL, reasoning_parser="gemma4")
    with serve(create_app(st, engine_factory(d))) as s, openai.OpenAI(base_url=s.base + "/v1", api_key="x") as c:
        r = chat(c, budget=8, extra=OPEN, messages=[{"role": "user", "content": "a b c"}])
        m = r.choices[0].message
        assert m.model_extra["reasoning_content"] and "channel" not in m.model_extra["reasoning_content"] + m.content
        assert_budget(r.usage, 8, opened_by_model=True)
        off = chat(c, budget=None, extra={"chat_template_kwargs": {"enable_thinking": False}, **NO_THINK_TOKENS})
        assert not off.choices[0].message.model_extra.get("reasoning_content") and off.choices[0].message.content


# -- the Responses API ------------------------------------------------------------------------------------------
def test_responses_reasoning_items_streamed_and_not(client):
    yes_no = {"structured_outputs": {"choice": ["yes", "no"]}}  # the answer ends: the response completes
    kw = dict(model=MODEL, input="Think, then answer.", max_output_tokens=40, temperature=0,
              extra_body={"thinking_token_budget": 4, **OPEN, **SPEC_ON, **yes_no})  # fmt: skip
    r = client.responses.create(**kw)
    assert r.status == "completed" and [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text and r.output_text in ("yes", "no")
    assert 6 <= r.usage.output_tokens_details.reasoning_tokens <= 9
    with client.responses.stream(**kw) as s:
        events = list(s)
        final = s.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == r.output[0].content[0].text == final.output[0].content[0].text
    assert [i.type for i in final.output] == ["reasoning", "message"] and final.output_text == r.output_text
    # reasoning.effort maps as chat's reasoning_effort does
    off = client.responses.create(**{**kw, "extra_body": SPEC_ON}, reasoning={"effort": "none"})
    assert off.reasoning.effort == "none" and all(i.type != "reasoning" for i in off.output)


def test_a_replayed_reasoning_item_reaches_the_template(client, tok):
    first = client.responses.create(model=MODEL, input="Think.", max_output_tokens=12, temperature=0, store=False,
                                    extra_body={"thinking_token_budget": 2, **OPEN})  # fmt: skip
    thought = first.output[0].content[0].text
    items = [{"role": "user", "content": "Think."}, *[i.model_dump(exclude_none=True) for i in first.output],
             {"role": "user", "content": "Again."}]  # fmt: skip
    r = client.responses.create(model=MODEL, input=items, max_output_tokens=2, temperature=0)
    answer = "".join(p.text for i in first.output if i.type == "message" for p in i.content)
    history = [{"role": "user", "content": "Think."},
               {"role": "assistant", "content": answer, "reasoning_content": thought},
               {"role": "user", "content": "Again."}]  # fmt: skip
    assert r.usage.input_tokens == len(rendered(tok, history))


# -- generation_config.json --------------------------------------------------------------------------------------
def test_generation_config_defaults_are_applied_and_overridden(tmp_path, tokenizer_dir):
    d = thinking_model(tmp_path / "g", tokenizer_dir, TEMPLATE, {"temperature": 0.0, "max_new_tokens": 5})
    with serve(create_app(ServerSettings(served_model_name=MODEL), engine_factory(d))) as s:
        assert httpx.get(s.base + "/version").json()["sampling_defaults"] == {"temperature": 0.0, "max_tokens": 5}
        with openai.OpenAI(base_url=s.base + "/v1", api_key="x", max_retries=0) as c:
            full = {"ignore_eos": True}
            default = c.chat.completions.create(model=MODEL, messages=ASK, extra_body=full)  # the model's T 0, 5 tokens
            greedy = c.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=5, extra_body=full)
            assert default.usage.completion_tokens == 5 and default.choices[0].finish_reason == "length"
            assert default.choices[0].message.content == greedy.choices[0].message.content
            sampled = {c.chat.completions.create(model=MODEL, messages=ASK, temperature=1.5, seed=i, max_tokens=8)
                       .choices[0].message.content for i in range(4)}  # fmt: skip
            assert len(sampled) > 1  # the request's temperature wins
            text = c.completions.create(model=MODEL, prompt="Hello").choices[0].text  # completions too
            greedy = c.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=5)
            assert text == greedy.choices[0].text
    off = ServerSettings(served_model_name=MODEL, generation_config="none")
    with serve(create_app(off, engine_factory(d))) as s:
        assert httpx.get(s.base + "/version").json()["sampling_defaults"] == {}
        r = httpx.post(s.base + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "ignore_eos": True}).json()
        assert r["usage"]["completion_tokens"] == 16  # OpenAI's default, not the model's 5


def test_a_default_max_tokens_is_capped_at_the_room_each_prompt_leaves(tmp_path, tokenizer_dir):
    """The model's default length (none given) past the context is capped per prompt, as vLLM caps it,
    not refused for a max_tokens the client never sent; one the client sends is still refused."""
    d = thinking_model(tmp_path / "g", tokenizer_dir, TEMPLATE, {"max_new_tokens": 40})
    tok = transformers.AutoTokenizer.from_pretrained(d)
    short, long = "Hello", " ".join(["word"] * 30)
    limit = len(tok.encode(long)) + 12  # the long prompt leaves 12 tokens, the short one more than 40
    with serve(create_app(ServerSettings(served_model_name=MODEL), engine_factory(d, max_model_len=limit))) as s:
        with openai.OpenAI(base_url=s.base + "/v1", api_key="x", max_retries=0) as c:
            r = c.completions.create(model=MODEL, prompt=[short, long], temperature=0, extra_body={"ignore_eos": True})
            by = {ch.index: ch for ch in r.choices}
            assert r.usage.completion_tokens == 40 + 12
            assert by[0].finish_reason == by[1].finish_reason == "length"
            assert len(tok.encode(by[1].text, add_special_tokens=False)) <= 12 < 40
            chat = [{"role": "user", "content": " ".join(["word"] * 20)}]
            text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            room = limit - len(tok.encode(text, add_special_tokens=False))
            assert 0 < room < 40
            r = c.chat.completions.create(model=MODEL, messages=chat, temperature=0, extra_body={"ignore_eos": True})
            assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (room, "length")
            with pytest.raises(openai.BadRequestError, match="max_tokens"):
                c.completions.create(model=MODEL, prompt=long, max_tokens=13)
            # A min_tokens past the room the default was capped at: a 400 naming it, on either endpoint.
            for call in (
                lambda: c.completions.create(model=MODEL, prompt=[short, long], extra_body={"min_tokens": 20}),
                lambda: c.chat.completions.create(model=MODEL, messages=chat, extra_body={"min_tokens": 39}),
            ):
                with pytest.raises(openai.BadRequestError) as e:
                    call()
                assert e.value.body["param"] == "min_tokens"
    # Contrastive search sizes its KV at the length a request runs to: the capped default, not the room.
    tight = engine_factory(d, max_model_len=64, num_kv_blocks=16)  # 64 slots of KV: the context, no more
    with serve(create_app(ServerSettings(served_model_name=MODEL), tight)) as s:
        r = httpx.post(
            s.base + "/v1/completions",
            json={
                "model": MODEL,
                "prompt": short,
                "temperature": 0,
                "penalty_alpha": 0.5,
                "top_k": 4,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40, r.text


def test_chat_template_override(tmp_path, tokenizer_dir, llama_dir):
    d = tmp_path / "no-template"
    shutil.copytree(llama_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    for f in d.glob("chat_template.*"):
        f.unlink()
    body = {"model": MODEL, "messages": ASK, "max_tokens": 2}
    with serve(create_app(ServerSettings(served_model_name=MODEL), engine_factory(d))) as s:
        r = httpx.post(s.base + "/v1/chat/completions", json=body)
        assert r.status_code == 400 and "--chat-template" in r.json()["error"]["message"]
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
    with serve(create_app(ServerSettings(served_model_name=MODEL, chat_template=template), engine_factory(d))) as s:
        r = httpx.post(s.base + "/v1/chat/completions", json=body)
        tok = transformers.AutoTokenizer.from_pretrained(d)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(
            tok.encode("[user] Think, then answer.\n[assistant] ", add_special_tokens=False)
        )
        assert httpx.get(s.base + "/tokenizer_info").json()["chat_template"] == template


# -- the parser alone -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("opened", [True, False, None])
@pytest.mark.parametrize(
    "text",
    [
        "<think>\nplan it\n</think>\n\nThe answer.",
        "  <think>a</think>b",
        "plan it</think>answer",
        "just an answer",
        "<think>cut inside",
        "<thi",
        "</thin",
        "<think></think>",
        "a</think>\n\n<tool_call>x",
    ],
)
def test_any_chunking_of_a_stream_splits_as_the_whole_text(text, opened):
    syntax = SYNTAXES["qwen3"]
    frame = ReasoningFrame(opened)
    whole = syntax.split(text, frame)
    for size in (1, 2, 3, 7):
        stream = ReasoningStream(syntax, frame)
        parts = [stream.feed(text[i : i + size]) for i in range(0, len(text), size)] + [stream.finish()]
        reasoning = "".join(p[0] for p in parts)
        assert (reasoning if stream.thought else None, "".join(p[1] for p in parts)) == whole, size
    if opened is not True and not text.lstrip().startswith("<think>"):
        assert whole == (None, text)  # an output that did not open its thinking is all content


def test_the_frame_is_read_from_the_turns_opening():
    qwen, r1 = SYNTAXES["qwen3"], SYNTAXES["deepseek_r1"]
    assert qwen.frame("<|im_start|>assistant\n").opened is False  # the model may open it
    assert qwen.frame("<|im_start|>assistant\n<think>\n\n</think>\n\n").opened is None  # turned off
    assert qwen.frame("<|im_start|>assistant\n<think>\n").opened is True  # opened by the template
    assert r1.frame("<｜Assistant｜>").opened is True  # R1 thinks first
