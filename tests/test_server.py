"""The HTTP server end to end: a real uvicorn on a loopback port, driven by the official ``openai`` SDK,
and by raw ``httpx`` where the SDK would hide what is on the wire (error bodies, headers, SSE framing).

Every server here is the real app over a real engine on a tiny random-weight Llama. Random weights
make text look like noise, so tests that need a known output steer the model with ``logit_bias``
(a +100 bias makes the biased tokens the only candidates) instead of trusting what it would say.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from conftest import VOCAB
from engine.config import EngineConfig
from engine.core.async_engine import AsyncEngine
from engine.core.llm_engine import LLMEngine
from engine.core.output_processor import OutputProcessor
from engine.request.sampling_params import SamplingParams
from server.app import ServerSettings, create_app
from servers import FIRST_LOAD_S, MAX_LEN, NUM_BLOCKS, Served, engine_factory, serve, wait_until

MODEL = "tiny-llama"
API_KEY = "sk-test-0123456789"
REPLACEMENT = "\ufffd"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def srv(llama_dir) -> Iterator[Served]:
    with serve(create_app(ServerSettings(served_model_name=MODEL), engine_factory(llama_dir))) as s:
        yield s


@pytest.fixture(scope="module")
def tok(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


@pytest.fixture(scope="module")
def word_tokens(tok) -> list[int]:
    """Ids of tokens that decode to at least two printable ASCII characters (none is a partial character)."""
    ids = []
    for i in range(VOCAB):
        s = tok.decode([i])
        if len(s) >= 2 and s.isascii() and s.isprintable() and s.strip() and i not in tok.all_special_ids:
            ids.append(i)
    assert len(ids) >= 20
    return ids


# -- helpers --------------------------------------------------------------------------------------------
def wait_idle(s: Served) -> None:
    """Until the engine holds no request and every KV block is back in the free pool."""
    eng = s.engine
    bm = eng.block_manager

    def idle() -> bool:
        return not eng.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks

    wait_until(idle, "the engine to go idle and free every KV block")
    assert bm.num_blocks == NUM_BLOCKS and s.async_engine.num_unstarted == 0


def greedy(client: openai.OpenAI, prompt, max_tokens: int = 8, **kw):
    """A greedy completion that ignores EOS, so it is exactly ``max_tokens`` long (a random model may
    otherwise end at any step)."""
    extra = kw.pop("extra_body", {})
    return client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True, **extra},
        **kw,
    )


def assert_error(resp: httpx.Response, status: int, *, param: str | None = None, contains: str = "") -> dict:
    """An OpenAI-shaped error body with ``status``; returns the inner error object."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] is not None and err["param"].split(".")[0] == param, err
    assert contains.lower() in err["message"].lower(), err
    return err


def sse_events(raw: str) -> list[dict]:
    """Check the SSE framing (``data: {json}`` + blank line each, ``data: [DONE]`` last); return the JSON."""
    assert raw.endswith("\n\n"), raw[-50:]
    events = raw[:-2].split("\n\n")
    assert events[-1] == "data: [DONE]"
    for e in events:
        assert e.startswith("data: ") and "\n" not in e, repr(e)
    return [json.loads(e[len("data: ") :]) for e in events[:-1]]


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape(http: httpx.Client) -> list[tuple[str, dict[str, str], float]]:
    resp = http.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    return parse_metrics(resp.text)


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text format as (name, labels, value) samples."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, line
        samples.append((m[1], dict(_LABEL.findall(m[2] or "")), float(m[3])))
    return samples


def _matching(samples, name: str, labels: dict[str, str]) -> list[float]:
    return [v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items())]


def metric(samples, name: str, **labels: str) -> float:
    found = _matching(samples, name, labels)
    assert found, f"no sample {name}{labels}"
    return sum(found)


def grown(before, after, name: str, **labels: str) -> float:
    """How much a counter grew between two scrapes (a labelled child appears on first use)."""
    return sum(_matching(after, name, labels)) - sum(_matching(before, name, labels))


@contextmanager
def watch_steps(s: Served, gate: threading.Event | None = None, free_steps: int = 0) -> Iterator[list[str]]:
    """Record the ids of requests that finish, through the engine's public step hooks; with ``gate``,
    the engine also waits for it after each step that had outputs, past the first ``free_steps`` of
    them (so a test can act while a request is mid-flight, however fast the engine is)."""
    finished: list[str] = []
    stepped = [0]

    def hook(outputs, _elapsed) -> None:
        finished.extend(o.request_id for o in outputs if o.finished)
        if outputs:
            stepped[0] += 1
        if gate is not None and stepped[0] > free_steps:
            gate.wait(60)

    hooks = s.async_engine.step_hooks
    hooks.append(hook)
    try:
        yield finished
    finally:
        if gate is not None:
            gate.set()
        hooks.remove(hook)


# -- /v1/completions --------------------------------------------------------------------------------------
def test_prompt_forms_and_choice_indices(client, tok):
    a, b = "Hello world", "import string"
    ga, gb = greedy(client, a, 6), greedy(client, b, 6)
    text_a, text_b = ga.choices[0].text, gb.choices[0].text
    assert text_a != text_b, "the two prompts should continue differently"
    assert ga.usage.completion_tokens == 6 and ga.choices[0].finish_reason == "length"

    ids_a, ids_b = tok.encode(a), tok.encode(b)
    assert greedy(client, ids_a, 6).choices[0].text == text_a  # token ids mean the same prompt

    for prompt in ([a, b], [ids_a, ids_b]):
        r = greedy(client, prompt, 6, n=2)
        assert [c.index for c in r.choices] == [0, 1, 2, 3]  # prompt_index * n + i
        assert [c.text for c in r.choices] == [text_a, text_a, text_b, text_b]
        assert r.usage.prompt_tokens == len(ids_a) + len(ids_b)
        assert r.usage.completion_tokens == 4 * 6


def test_max_tokens_and_greedy_determinism(client):
    r1 = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=3, temperature=0)
    assert 1 <= r1.usage.completion_tokens <= 3
    assert (r1.choices[0].finish_reason == "length") == (r1.usage.completion_tokens == 3)
    longer = [greedy(client, "Hello world", 10).choices[0].text for _ in range(2)]
    assert longer[0] == longer[1]
    assert longer[0].startswith(greedy(client, "Hello world", 4).choices[0].text)


def test_sampling_filters_that_leave_one_token_equal_greedy(client):
    prompt = "The future of"
    base = greedy(client, prompt, 8).choices[0].text
    for extra in ({"top_p": 1e-6}, {"extra_body": {"top_k": 1}}, {"extra_body": {"min_p": 1.0}}):
        extra_body = {"ignore_eos": True, **extra.pop("extra_body", {})}
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=11, extra_body=extra_body, **extra
        )
        assert r.choices[0].text == base, extra_body
    # The same filters loosened: the sample is no longer the argmax path (seeded, so this is fixed).
    loose = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, top_p=0.95, seed=11, extra_body={"ignore_eos": True}
    )
    assert loose.choices[0].text != base


def test_seed_reproducibility_and_n(client):
    def sample(seed: int, n: int = 1):
        return client.completions.create(
            model=MODEL,
            prompt="Hello",
            max_tokens=12,
            temperature=1.0,
            seed=seed,
            n=n,
            logprobs=0,
            extra_body={"ignore_eos": True},
        )

    def key(choice):
        return choice.text, tuple(choice.logprobs.token_logprobs)

    first, again, other = sample(42), sample(42), sample(43)
    assert key(first.choices[0]) == key(again.choices[0])
    assert key(first.choices[0]) != key(other.choices[0])

    multi = sample(7, n=3)
    assert [c.index for c in multi.choices] == [0, 1, 2]
    assert len({key(c) for c in multi.choices}) == 3  # each choice samples on its own
    assert multi.usage.completion_tokens == 36


def test_stop_strings_across_token_boundaries(client, tok, word_tokens):
    # Bias the model towards whole ASCII word pieces so that token boundaries are known characters.
    bias = {str(t): 50 for t in word_tokens}
    ref = greedy(client, "Hello", 10, logit_bias=bias, logprobs=0).choices[0]
    text, tokens, offsets = ref.text, ref.logprobs.tokens, ref.logprobs.text_offset
    assert "".join(tokens) == text and all(len(t) >= 2 for t in tokens)
    b = offsets[5]  # the boundary between the 5th and the 6th token
    stop = text[b - 2 : b + 2]  # two characters of each
    expected = text[: text.find(stop)]
    tease = text[offsets[2] - 2 : offsets[2]] + "\u2603"  # its prefix shows up early; it never completes
    stops = [stop, tease]

    r = greedy(client, "Hello", 10, logit_bias=bias, stop=stops)
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    assert stop not in r.choices[0].text

    # Streamed: the pieces never carry part of a stop string, held back or not.
    pieces, reasons = [], []
    for chunk in greedy(client, "Hello", 10, logit_bias=bias, stop=stops, stream=True):
        for c in chunk.choices:
            pieces.append(c.text)
            reasons.append(c.finish_reason)
    assert "".join(pieces) == expected
    assert reasons[-1] == "stop" and all(x is None for x in reasons[:-1])

    # Logprobs streamed while the tease holds text back (and with the prompt echoed) carry the
    # whole answer's text offsets.
    for echo in (False, True):
        kw = dict(logit_bias=bias, stop=[tease], logprobs=0, echo=echo)
        whole = greedy(client, "Hello", 10, **kw).choices[0].logprobs
        streamed = [o for ch in greedy(client, "Hello", 10, stream=True, **kw) for c in ch.choices if c.logprobs
                    for o in c.logprobs.text_offset]  # fmt: skip
        assert streamed == whole.text_offset and len(streamed) == 10 + (len(tok.encode("Hello")) if echo else 0)


def test_penalties_accepted_and_applied(client, tok, word_tokens):
    x = word_tokens[0]
    piece = tok.decode([x])
    bias = {str(x): 10}  # enough to make x the argmax at every step, not enough to outweigh the penalties
    plain = greedy(client, "Hi", 8, logit_bias=bias)
    assert plain.choices[0].text == piece * 8
    penalised = greedy(client, "Hi", 8, logit_bias=bias, presence_penalty=2.0, frequency_penalty=2.0, user="alice")
    assert penalised.usage.completion_tokens == 8
    assert penalised.choices[0].text != piece * 8, "the penalties should break the repetition"
    # repetition_penalty: the word tokens the only candidates (+50 each), their raw logits choosing. Unpenalised,
    # greedy repeats itself; at 2 no token of the prompt or of the output comes again.
    words = {str(t): 50 for t in word_tokens}
    pieces = {tok.decode([t]): t for t in word_tokens}

    def tokens(prompt, n: int, **extra) -> list[str]:
        return greedy(client, prompt, n, logit_bias=words, logprobs=0, extra_body=extra).choices[0].logprobs.tokens

    looping = tokens("Hi", 12)
    assert len(set(looping)) < 12
    prompt = tok.encode("Hi") + [pieces[t] for t in looping]
    assert set(tokens(prompt, 8)) & set(looping), "unpenalised, it repeats the prompt's tokens"
    fresh = tokens(prompt, 8, repetition_penalty=2.0)
    assert len(set(fresh)) == 8 and not set(fresh) & set(looping)


def test_logit_bias_forces_and_forbids(client, tok, word_tokens):
    forced = word_tokens[3]
    r = greedy(client, "Hello world", 5, logit_bias={str(forced): 100}, logprobs=0)
    assert r.choices[0].text == tok.decode([forced]) * 5
    assert r.choices[0].logprobs.tokens == [tok.decode([forced])] * 5

    # Forbidding the token the (word-biased) model picks first makes it pick another.
    bias = {str(t): 50 for t in word_tokens}
    first = greedy(client, "Hello world", 1, logit_bias=bias).choices[0].text
    (first_id,) = [t for t in word_tokens if tok.decode([t]) == first]
    other = greedy(client, "Hello world", 1, logit_bias={**bias, str(first_id): -100}).choices[0].text
    assert other != first and other in {tok.decode([t]) for t in word_tokens}


def test_logprobs_shape(client):
    k, n_tok = 3, 6
    r = greedy(client, "import string", n_tok, logprobs=k)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n_tok
    assert lp.text_offset[0] == 0
    for i in range(n_tok):
        assert lp.token_logprobs[i] <= 0.0
        # The k best and the chosen token (OpenAI's legacy rule), keyed by text: equal texts collapse.
        assert 1 <= len(lp.top_logprobs[i]) <= k + 1 and lp.tokens[i] in lp.top_logprobs[i]
        # Greedy: the sampled token is the model's argmax, so nothing in the top list beats it.
        assert lp.token_logprobs[i] >= max(lp.top_logprobs[i].values()) - 1e-5
        if i:
            assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])
    zero = greedy(client, "import string", n_tok, logprobs=0).choices[0].logprobs
    assert zero.token_logprobs == pytest.approx(lp.token_logprobs)
    # logprobs 0: the chosen token alone, as OpenAI's legacy completions return it.
    assert zero.top_logprobs == [{t: v} for t, v in zip(zero.tokens, zero.token_logprobs)]


def test_echo(client, tok):
    prompt = "import string"
    plain = greedy(client, prompt, 4).choices[0].text
    echoed = greedy(client, prompt, 4, echo=True).choices[0]
    assert echoed.text == prompt + plain

    r = greedy(client, prompt, 4, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    num_prompt = len(tok.encode(prompt))
    assert r.usage.prompt_tokens == num_prompt and r.usage.completion_tokens == 4
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == num_prompt + 4
    assert "".join(lp.tokens[:num_prompt]) == prompt  # the prompt's tokens come first
    assert lp.token_logprobs[0] is None  # nothing predicts the first token
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset[num_prompt] == len(prompt)
    assert r.choices[0].text.startswith(prompt)


def test_stream_matches_non_streamed(client):
    expected = greedy(client, "Hello world", 10).choices[0].text
    chunks = list(greedy(client, "Hello world", 10, stream=True))
    assert all(ch.object == "text_completion" and ch.model == MODEL for ch in chunks)
    assert "".join(c.text for ch in chunks for c in ch.choices) == expected
    reasons = [c.finish_reason for ch in chunks for c in ch.choices]
    assert reasons[-1] == "length" and all(x is None for x in reasons[:-1])
    assert all(ch.usage is None for ch in chunks)

    with_usage = list(greedy(client, "Hello world", 10, stream=True, stream_options={"include_usage": True}))
    last = with_usage[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 10 and last.usage.total_tokens == last.usage.prompt_tokens + 10
    assert all(ch.choices for ch in with_usage[:-1])
    assert "".join(c.text for ch in with_usage for c in ch.choices) == expected


def test_unsupported_completion_fields_are_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, suffix="!")
    assert "not supported" in e.value.response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, best_of=3, n=1)
    assert "needs use_beam_search" in e.value.response.json()["error"]["message"]
    ok = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, best_of=2, n=2, temperature=0)
    assert len(ok.choices) == 2


def test_extension_fields(client, tok):
    eos = tok.eos_token_id
    to_eos = {str(eos): 100}  # the model would end at once

    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=8, temperature=0, logit_bias=to_eos)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (1, "stop")
    assert r.choices[0].text == ""

    r = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=8, temperature=0, logit_bias=to_eos, extra_body={"min_tokens": 4}
    )
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (5, "stop")  # 4 forced, then EOS

    r = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=6, temperature=0, logit_bias=to_eos, extra_body={"ignore_eos": True}
    )
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (6, "length")

    r = client.completions.create(
        model=MODEL,
        prompt="Hi",
        max_tokens=4,
        temperature=0.7,
        extra_body={
            "top_k": 20,
            "min_p": 0.01,
            "repetition_penalty": 1.1,
            "ignore_eos": True,
            "speculative": {"enabled": True, "num_draft_tokens": 4},
        },
    )
    assert r.usage.completion_tokens == 4
    assert r.usage.model_dump()["speculative"]["method"] == "none"


def test_usage(client, tok):
    prompt = "The future of artificial intelligence is"
    r = greedy(client, prompt, 7)
    u = r.usage
    assert u.prompt_tokens == len(tok.encode(prompt))
    assert u.completion_tokens == 7 and u.total_tokens == u.prompt_tokens + 7
    spec = u.model_dump()["speculative"]
    assert spec == {
        "method": "none",
        "proposers": {},
        "reason": "disabled",  # the server does not speculate
        "draft_tokens": 0,
        "accepted_tokens": 0,
        "verify_steps": 7,  # no speculation: one target forward per token
        "mean_acceptance_length": 1.0,
        "forced_tokens": 0,  # emitted without a forward: only under a grammar (structured outputs)
        "acceptance": "exact",  # typical acceptance (lossy) only when asked for
        "lossy": False,
        "lora_adapter": None,  # the base model verified (docs/lora.md)
    }


# -- /v1/chat/completions ---------------------------------------------------------------------------------
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": "How are you?"},
]


def template_ids(tok, messages) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out) if isinstance(out, list) else list(out["input_ids"])


def chat(client, messages=CHAT, max_tokens: int = 6, **kw):
    extra = kw.pop("extra_body", {})
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=max_tokens,
        extra_body={"ignore_eos": True, **extra},
        **kw,
    )


def test_a_message_name_reaches_the_template_on_every_role_and_a_legacy_call_is_refused(llama_dir, tok):
    """OpenAI's ``name`` (a participant's) goes to the template on any role, as vLLM passes it; an
    assistant message's legacy ``function_call`` is a 400 (null, as the SDK replays it, is fine)."""
    template = ("{% for m in messages %}[{{ m['role'] }}{% if m.name %}:{{ m.name }}{% endif %}] {{ m['content'] }}\n"
                "{% endfor %}[assistant] ")  # fmt: skip
    messages = [{"role": "system", "content": "Be brief.", "name": "boss"},
                {"role": "user", "content": "Hi", "name": "ann"},
                {"role": "assistant", "content": "Hello", "name": "bot", "function_call": None, "refusal": None},
                {"role": "user", "content": "Bye"}]  # fmt: skip
    body = {"model": MODEL, "messages": messages, "max_tokens": 1}
    settings = ServerSettings(served_model_name=MODEL, chat_template=template)
    with serve(create_app(settings, engine_factory(llama_dir))) as s:
        r = httpx.post(s.base + "/v1/chat/completions", json=body)
        text = "[system:boss] Be brief.\n[user:ann] Hi\n[assistant:bot] Hello\n[user] Bye\n[assistant] "
        assert r.status_code == 200
        assert r.json()["usage"]["prompt_tokens"] == len(tok.encode(text, add_special_tokens=False))
        calls = [{"role": "assistant", "content": None, "name": "bot",
                  "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                 {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "42"}]  # fmt: skip
        for history in (messages, [*messages[:3], *calls, messages[3]]):  # /tokenize renders as chat does
            counted = httpx.post(s.base + "/tokenize", json={"model": MODEL, "messages": history}).json()["count"]
            r = httpx.post(s.base + "/v1/chat/completions", json={**body, "messages": history})
            assert counted == r.json()["usage"]["prompt_tokens"], r.text
        legacy = {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}
        r = httpx.post(s.base + "/v1/chat/completions", json={**body, "messages": [*messages[:2], legacy, messages[3]]})
        assert_error(r, 400, param="messages", contains="function_call")


def test_chat_renders_the_template(client, tok):
    r = chat(client)
    assert r.object == "chat.completion" and r.model == MODEL
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant" and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(template_ids(tok, CHAT))
    assert r.usage.completion_tokens == 6 and r.usage.total_tokens == r.usage.prompt_tokens + 6
    # The rendered prompt is what /v1/completions would continue the same way.
    rendered = tok.decode(template_ids(tok, CHAT))
    assert choice.message.content == greedy(client, tok.encode(rendered), 6).choices[0].text

    # Text parts are joined by newlines (as vLLM joins them), then rendered as one content.
    parts = [
        *CHAT[:3],
        {"role": "user", "content": [{"type": "text", "text": "How"}, {"type": "text", "text": "are you?"}]},
    ]
    joined = [*CHAT[:3], {"role": "user", "content": "How\nare you?"}]
    r2 = chat(client, parts)
    assert r2.usage.prompt_tokens == len(template_ids(tok, joined)) != r.usage.prompt_tokens
    assert r2.choices[0].message.content == chat(client, joined).choices[0].message.content

    developer = [{"role": "developer", "content": "You are terse."}, *CHAT[1:]]
    assert chat(client, developer).choices[0].message.content == choice.message.content


def test_chat_limits_logprobs_and_n(client):
    assert chat(client, max_tokens=3).usage.completion_tokens == 3
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"
    both = chat(client, max_tokens=9, max_completion_tokens=2)
    assert both.usage.completion_tokens == 2  # the newer field wins

    r = chat(client, max_tokens=5, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2
        assert item.logprob >= max(t.logprob for t in item.top_logprobs) - 1e-5  # greedy
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert bytes(item.bytes).decode("utf-8") == item.token
    assert chat(client, max_tokens=2).choices[0].logprobs is None

    multi = chat(client, max_tokens=3, n=3, temperature=1.0, seed=5)
    assert [c.index for c in multi.choices] == [0, 1, 2]
    assert multi.usage.completion_tokens == 9


def test_chat_stream(client, http):
    expected = chat(client, max_tokens=8).choices[0].message.content
    chunks = list(chat(client, max_tokens=8, stream=True, stream_options={"include_usage": True}))
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.delta.role in (None, "assistant") for ch in chunks[1:] for c in ch.choices)
    with_choices = [ch for ch in chunks if ch.choices]
    assert "".join(c.delta.content or "" for ch in with_choices for c in ch.choices) == expected
    reasons = [ch.choices[0].finish_reason for ch in with_choices]
    assert reasons[-1] == "length" and all(x is None for x in reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8

    # The wire format itself.
    body = {
        "model": MODEL,
        "messages": CHAT,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert len({e["id"] for e in events}) == 1 and events[0]["id"].startswith("chatcmpl-")
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"]) == expected
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_chat_logprob_bytes_of_part_of_a_character(client, tok):
    lead = tok.encode("你")[0]  # the token of the character's first byte alone
    r = chat(client, max_tokens=1, logprobs=True, logit_bias={str(lead): 100})
    assert r.choices[0].logprobs.content[0].bytes == list("你".encode())[:1]


@pytest.mark.parametrize(
    "extra",
    [
        {"functions": [{"name": "f", "parameters": {"type": "object"}}]},
        {"function_call": "auto"},
    ],
    ids=["functions", "function_call"],
)
def test_chat_unsupported_features_are_400(client, extra):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, **extra)
    err = e.value.response.json()["error"]
    assert e.value.status_code == 400 and "not supported" in err["message"]
    assert err["param"] == next(iter(extra))


def test_chat_bad_messages_are_400(http):
    def post(messages):
        return http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2})

    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    err = assert_error(post([{"role": "user", "content": [image]}]), 400, contains="not supported")
    assert err["param"] == "messages"
    assert_error(post([]), 400, contains="empty")
    assert_error(post([{"role": "wizard", "content": "hi"}]), 400, contains="role")
    assert_error(post([{"role": "function", "name": "f", "content": "42"}]), 400, contains="not supported")
    assert_error(http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2}), 400, param="messages")


# -- incremental detokenization over SSE -----------------------------------------------------------------
def test_stream_never_splits_a_character(client, tok):
    """A character spread over several tokens reaches the client whole, never as U+FFFD halves.

    The +100 bias leaves only the three byte tokens of one CJK character as candidates and the
    penalties make a repeat unlikely, so many of the 64 seeded choices spell the character in order.
    """
    char = "你"
    pieces = tok.encode(char)
    assert len(pieces) == 3 and all(tok.decode([p]) == REPLACEMENT for p in pieces)
    kw = dict(
        model=MODEL,
        prompt="Hello",
        max_tokens=3,
        n=64,
        temperature=1.0,
        seed=1234,
        presence_penalty=2.0,
        frequency_penalty=2.0,
        logit_bias={str(p): 100 for p in pieces},
        extra_body={"ignore_eos": True},
    )
    final = {c.index: c.text for c in client.completions.create(**kw).choices}
    assert sorted(final) == list(range(64))
    whole = [i for i, text in final.items() if text == char]
    assert len(whole) >= 3, "too few choices spelled the character to test anything"

    deltas: dict[int, list[str]] = {i: [] for i in range(64)}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            deltas[c.index].append(c.text)
    for i, text in final.items():
        assert "".join(deltas[i]) == text, i
        if REPLACEMENT not in text:
            assert not any(REPLACEMENT in d for d in deltas[i]), (i, deltas[i])
    assert all(deltas[i][-1] == char for i in whole)  # held back until the last byte arrived


# -- plain endpoints ------------------------------------------------------------------------------------
def test_models_health_version(client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    card = http.get("/v1/models").json()["data"][0]
    assert card["object"] == "model" and card["owned_by"] == "augur" and card["max_model_len"] == MAX_LEN
    assert http.get("/health").status_code == 200 and http.get("/health").json() == {"status": "ok", "compile": "off"}
    v = http.get("/version")
    assert v.status_code == 200 and isinstance(v.json()["version"], str) and v.json()["version"]


METRIC_NAMES = [
    "augur_prompt_tokens_total",
    "augur_generation_tokens_total",
    "augur_request_success_total",
    "augur_time_to_first_token_seconds_count",
    "augur_inter_token_latency_seconds_count",
    "augur_time_per_output_token_seconds_count",
    "augur_e2e_request_latency_seconds_count",
    "augur_num_requests_running",
    "augur_num_requests_waiting",
    "augur_kv_cache_usage_ratio",
    "augur_generation_tokens_per_second",
]


def test_metrics(srv, client, http, tok):
    wait_idle(srv)
    before = scrape(http)
    r = greedy(client, "Hello world", 5)
    stopped = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=4, temperature=0, logit_bias={str(tok.eos_token_id): 100}
    )
    assert stopped.choices[0].finish_reason == "stop"
    wait_idle(srv)
    after = scrape(http)
    names = {n for n, _, _ in after}
    assert set(METRIC_NAMES) <= names, set(METRIC_NAMES) - names
    unlabelled = [(n, lab) for n, lab, _ in after if n in METRIC_NAMES and lab.get("model_name") != MODEL]
    assert not unlabelled, unlabelled

    def grew(name: str, **labels: str) -> float:
        return grown(before, after, name, **labels)

    assert grew("augur_prompt_tokens_total") == r.usage.prompt_tokens + stopped.usage.prompt_tokens
    assert grew("augur_generation_tokens_total") == 5 + 1
    assert grew("augur_request_success_total", finish_reason="length") == 1
    assert grew("augur_request_success_total", finish_reason="stop") == 1
    assert grew("augur_time_to_first_token_seconds_count") == 2
    assert grew("augur_e2e_request_latency_seconds_count") == 2
    assert grew("augur_time_per_output_token_seconds_count") == 1  # only the request with > 1 token
    assert grew("augur_inter_token_latency_seconds_count") >= 1
    assert metric(after, "augur_num_requests_running") == 0
    assert metric(after, "augur_num_requests_waiting") == 0
    assert metric(after, "augur_kv_cache_usage_ratio") == 0
    assert metric(after, "augur_generation_tokens_per_second") > 0


# -- errors ---------------------------------------------------------------------------------------------
BAD_COMPLETIONS = [
    ({"temperature": "hot"}, "temperature", ""),
    ({"max_tokens": "ten"}, "max_tokens", ""),
    ({"prompt": 123}, "prompt", ""),
    ({"n": "two"}, "n", ""),
    ({"stop": 5}, "stop", ""),
    ({"temperature": 5}, "temperature", ""),
    ({"top_p": 0}, "top_p", ""),
    ({"n": 0}, "n", ""),
    ({"logprobs": 50}, "logprobs", ""),
    ({"max_tokens": 0}, "max_tokens", ""),
    ({"presence_penalty": 3}, "presence_penalty", ""),
    ({"stop": ["ok", ""]}, "stop", "empty"),
    ({"logit_bias": {"the": 1}}, "logit_bias", "token id"),
    ({"logit_bias": {"5": 500}}, "logit_bias", ""),
    ({"logit_bias": {str(VOCAB + 1): 1}}, None, "out of range"),
    ({"top_k": -2}, "top_k", ""),
    ({"min_p": 1.5}, "min_p", ""),
    ({"repetition_penalty": 0}, "repetition_penalty", ""),
    ({"min_tokens": 9, "max_tokens": 4}, None, "min_tokens"),
    ({"speculative": {"num_draft_tokens": 1000}}, "speculative", ""),
    ({"speculative": {"draft": "yes"}}, "speculative", ""),
    ({"stream_options": {"include_usage": True}}, None, "stream"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": [[1, 2], []]}, "prompt", "empty"),
    ({"prompt": [VOCAB + 5, 3]}, "prompt", "out of range"),
    ({"prompt": [-1]}, "prompt", "out of range"),
    ({"prompt": [[5, 6], [7, VOCAB]]}, "prompt", "out of range"),
    ({"logit_bias": {str(VOCAB + 5): 1.0}}, "logit_bias", "out of range"),
    ({"max_tokens": MAX_LEN}, "prompt", "context length"),
    ({"prompt": [5] * MAX_LEN, "max_tokens": 1}, "prompt", "context length"),
]


@pytest.mark.parametrize(
    ("fields", "param", "contains"), BAD_COMPLETIONS, ids=[str(b[0])[:40] for b in BAD_COMPLETIONS]
)
def test_completion_bad_requests_are_400(http, fields, param, contains):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **fields}
    err = assert_error(http.post("/v1/completions", json=body), 400, param=param, contains=contains)
    assert err["type"] == "invalid_request_error"


def test_malformed_bodies_are_400(http):
    for path in ("/v1/completions", "/v1/chat/completions"):
        headers = {"content-type": "application/json"}
        assert_error(http.post(path, content=b'{"model": "x", "prompt": ', headers=headers), 400, contains="JSON")
        assert_error(http.post(path, content=b"\xff\xfe not json", headers=headers), 400, contains="JSON")
        assert_error(http.post(path, json=["a", "list"]), 400, contains="JSON object")
    bad_chat = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "top_logprobs": 3}  # without logprobs
    assert_error(http.post("/v1/chat/completions", json=bad_chat), 400, contains="logprobs")


def test_unknown_model_and_route_are_404(client, http):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=2)
    for path, body in (
        ("/v1/completions", {"model": "no-such-model", "prompt": "Hi"}),
        ("/v1/chat/completions", {"model": "no-such-model", "messages": CHAT}),
    ):
        err = assert_error(http.post(path, json=body), 404, param="model", contains="no-such-model")
        assert (err["type"], err["code"]) == ("invalid_request_error", "model_not_found")
    assert_error(http.get("/v1/nowhere"), 404)
    # The SDK's models.retrieve: the served model's card, as /v1/models lists it; another is a 404.
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.model_dump() == client.models.list().data[0].model_dump()
    err = assert_error(http.get("/v1/models/no-such-model"), 404, param="model")
    assert err["code"] == "model_not_found"
    wrong = http.get("/v1/completions")  # a method the route does not take: 405, saying which it does
    assert_error(wrong, 405)
    assert wrong.headers["allow"] == "POST"


# -- auth ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def auth_srv(llama_dir) -> Iterator[Served]:
    app = create_app(ServerSettings(served_model_name=MODEL, api_key=API_KEY), engine_factory(llama_dir))
    with serve(app) as s:
        yield s


def test_api_key(auth_srv):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    with httpx.Client(base_url=auth_srv.base, timeout=60) as c:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": API_KEY}, {"x-api-key": API_KEY}):
            for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
                resp = c.request(method, path, json=body if method == "POST" else None, headers=headers)
                err = assert_error(resp, 401, contains="API key")
                assert err["type"] == "authentication_error"
        # Probes and scrapes stay open.
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200
        ok = c.post("/v1/completions", json=body, headers={"authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200 and ok.json()["choices"]

    url = auth_srv.base + "/v1"
    with openai.OpenAI(base_url=url, api_key="sk-wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    with openai.OpenAI(base_url=url, api_key=API_KEY, max_retries=0) as good:
        assert good.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1
        assert good.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2).choices


# -- overload and failures --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def queue_srv(llama_dir) -> Iterator[Served]:
    """One seat in the batch (max_num_seqs=1) and room for one request waiting (max_queue_len=1)."""
    app = create_app(
        ServerSettings(served_model_name=MODEL, max_queue_len=1), engine_factory(llama_dir, max_num_seqs=1)
    )
    with serve(app) as s:
        yield s


QUEUE_PROMPT = [11, 12, 13]
QUEUE_BODY = {"model": MODEL, "prompt": QUEUE_PROMPT, "max_tokens": 20, "temperature": 0, "ignore_eos": True}


async def until(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def test_full_queue_is_429(queue_srv):
    """One seat and a queue of one. The engine is held after each step, so whoever got in stays put:
    A runs, B waits, and the concurrent requests after them are refused; released, A and B finish."""
    gate = threading.Event()

    async def fire() -> tuple[list[httpx.Response], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=queue_srv.base, timeout=120) as c:
            before = parse_metrics((await c.get("/metrics")).text)

            async def grew(name: str, amount: float) -> bool:
                return grown(before, parse_metrics((await c.get("/metrics")).text), name) >= amount

            a = asyncio.ensure_future(c.post("/v1/completions", json=QUEUE_BODY))
            await until(lambda: grew("augur_generation_tokens_total", 1), "A to start")
            b = asyncio.ensure_future(c.post("/v1/completions", json=QUEUE_BODY))
            await until(lambda: grew("augur_prompt_tokens_total", 2 * len(QUEUE_PROMPT)), "B to be queued")
            refusals = asyncio.gather(*(c.post("/v1/completions", json=QUEUE_BODY) for _ in range(4)))
            try:  # held engine: only a refusal can answer; the bound keeps a missing one from hanging
                rest = await asyncio.wait_for(refusals, timeout=30)
            except asyncio.TimeoutError:
                pytest.fail("requests were admitted past a full queue")
            async with openai.AsyncOpenAI(base_url=queue_srv.base + "/v1", api_key="unused", max_retries=0) as ac:
                with pytest.raises(openai.RateLimitError):  # the SDK's view of the same 429
                    await ac.completions.create(model=MODEL, prompt=QUEUE_PROMPT, max_tokens=20)
            gate.set()
            return [await a, await b], list(rest)

    with watch_steps(queue_srv, gate):
        served, refused = asyncio.run(fire())
    for r in refused:
        err = assert_error(r, 429, contains="queue")
        assert err["type"] == "rate_limit_error"
        assert int(r.headers["retry-after"]) >= 1
    for r in served:
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 20
    wait_idle(queue_srv)


def test_more_choices_than_batch_seats_do_not_hang(queue_srv, llama_dir):
    """n = 2 with one seat in the batch: counted in engine steps, not seconds, the request ends (a hang is
    a request that no step ever serves); then the same through the server."""
    eng = LLMEngine(EngineConfig(model=str(llama_dir), device="cpu", dtype="float32", num_kv_blocks=64,
                                 block_size=4, max_num_seqs=1))  # fmt: skip
    eng.add_request("r", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=2, n=2, ignore_eos=True))
    tokens: dict[int, list[int]] = {0: [], 1: []}
    for _ in range(2 * 2 * 2):  # a step per token per choice, twice over: far more than it needs
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            for c in out.outputs:
                tokens[c.index] += c.delta_token_ids
    assert not eng.has_unfinished_requests(), "the request was accepted but no step served it"
    assert [len(t) for t in tokens.values()] == [2, 2]

    wait_idle(queue_srv)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "n": 2, "stream": True}
    try:  # (streamed: a client that gives up closes the stream, which aborts the request server-side)
        resp = httpx.post(queue_srv.base + "/v1/completions", json=body, timeout=120)
    finally:
        wait_idle(queue_srv)
    assert resp.status_code == 200, resp.text  # served: both choices come back
    assert {e["choices"][0]["index"] for e in sse_events(resp.text) if e["choices"]} == {0, 1}


MARKER = 7  # a token id that only the doomed prompts contain


def test_engine_failure_is_confined_to_its_request(srv, client, http, monkeypatch):
    """A request that raises inside the engine fails alone (500, or an SSE error event); requests batched
    with it finish as they would alone, and the server keeps serving."""
    prompts = [[40 + i, 50 + i, 60 + i, 70 + i] for i in range(3)]
    assert all(MARKER not in p for p in prompts)
    alone = [greedy(client, p, 12).choices[0].text for p in prompts]

    original = OutputProcessor.append

    def faulty(self, seq, tokens, logprobs, provenance=None):
        if MARKER in seq.prompt_ids:
            raise RuntimeError("injected fault")
        return original(self, seq, tokens, logprobs, provenance)

    monkeypatch.setattr(OutputProcessor, "append", faulty)
    wait_idle(srv)
    before = scrape(http)
    doomed = {"model": MODEL, "prompt": [MARKER, 20, 30], "max_tokens": 12, "temperature": 0}

    async def run():
        async with (
            openai.AsyncOpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0) as ac,
            httpx.AsyncClient(base_url=srv.base, timeout=120) as hc,
        ):
            return await asyncio.gather(
                hc.post("/v1/completions", json=doomed),
                hc.post("/v1/completions", json={**doomed, "stream": True}),
                *(
                    ac.completions.create(
                        model=MODEL, prompt=p, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
                    )
                    for p in prompts
                ),
            )

    failed, failed_stream, *others = asyncio.run(run())
    err = assert_error(failed, 500, contains="injected fault")
    assert err["type"] == "server_error"  # OpenAI's type for a failure of its own
    assert failed_stream.status_code == 200  # the headers went out before the failure
    events = sse_events(failed_stream.text)
    assert "error" in events[-1] and "injected fault" in events[-1]["error"]["message"]
    assert [o.choices[0].text for o in others] == alone
    assert all(o.choices[0].finish_reason == "length" for o in others)

    wait_idle(srv)
    after = scrape(http)
    assert grown(before, after, "augur_request_failure_total", reason="engine_error") == 2
    # Still serving, the failing prompt included once the fault is gone.
    assert http.get("/health").status_code == 200
    monkeypatch.undo()
    assert greedy(client, [MARKER, 20, 30], 3).usage.completion_tokens == 3
    assert greedy(client, prompts[0], 12).choices[0].text == alone[0]


# -- concurrency and disconnects --------------------------------------------------------------------------
def test_concurrent_streams_match_sequential(srv, client):
    prompts = [f"Request {i}: the {'quick ' * (i % 4)}fox" for i in range(32)]
    sequential = [greedy(client, p, 6).choices[0].text for p in prompts]
    assert len(set(sequential)) > 1

    async def one(ac: openai.AsyncOpenAI, prompt: str) -> tuple[str, str | None]:
        stream = await ac.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        pieces, reason = [], None
        async for chunk in stream:
            for c in chunk.choices:
                pieces.append(c.text)
                reason = c.finish_reason or reason
        return "".join(pieces), reason

    async def run():
        async with openai.AsyncOpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0, timeout=120) as ac:
            return await asyncio.gather(*(one(ac, p) for p in prompts))

    results = asyncio.run(run())
    assert [text for text, _ in results] == sequential
    assert all(reason == "length" for _, reason in results)
    wait_idle(srv)


LONG = MAX_LEN - 8  # output tokens of a request that only an abort can end early


def test_cache_salt_keeps_prefix_cache_hits_among_requests_with_the_same_salt(client, http):
    """vLLM's ``cache_salt``: a prompt cached without a salt, or under another, is computed afresh; a
    second request with the same salt hits the first one's blocks; the text is the same in every case
    (the salt changes what is cached, never what is said). An empty salt is a 400 naming it."""
    prompt = "salted prompt " * 6 + "one two three four five six seven eight"

    def run(salt):
        extra = {} if salt is None else {"cache_salt": salt}
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body=extra)
        return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens

    plain, _ = run(None)
    assert run(None)[1] > 0  # unsalted requests share the cache
    first, cached = run("tenant-a")
    assert cached == 0 and first == plain
    again, cached = run("tenant-a")
    assert cached > 0 and again == plain
    other, cached = run("tenant-b")
    assert cached == 0 and other == plain
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def test_prefix_cache_scope_api_key_keeps_each_keys_cached_prompts_its_own(llama_dir):
    """``--prefix-cache-scope api-key``: a prompt one key cached is computed afresh for another key (no
    key learns from a hit what another sent), and hits again under the first; a cache_salt narrows a
    key's own cache further; the text is the same in every case. The default shares across keys."""
    prompt = "scoped prompt " * 6 + "one two three four five six seven eight"
    keys = ["key-a", "key-b"]

    def run(base, key, **extra):
        client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body=extra)
        return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens

    settings = ServerSettings(served_model_name=MODEL, api_key=keys)
    with serve(create_app(settings, engine_factory(llama_dir, prefix_cache_scope="api-key"))) as s:
        text, cached = run(s.base, "key-a")
        assert cached == 0
        assert run(s.base, "key-b") == (text, 0)  # another key: computed afresh
        again, cached = run(s.base, "key-a")
        assert again == text and cached > 0  # its own key: a hit
        assert run(s.base, "key-b")[1] > 0
        assert run(s.base, "key-a", cache_salt="s") == (text, 0)  # a salt within a key: its own again
        assert run(s.base, "key-a", cache_salt="s")[1] > 0 and run(s.base, "key-b", cache_salt="s")[1] == 0
    with serve(create_app(settings, engine_factory(llama_dir))) as s:  # the default: shared by every key
        text, _ = run(s.base, "key-a")
        other, cached = run(s.base, "key-b")
        assert other == text and cached > 0


def test_stream_disconnect_aborts(srv, http):
    wait_idle(srv)
    before = scrape(http)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True}

    def noticed() -> bool:
        return grown(before, scrape(http), "augur_request_failure_total", reason="client_disconnect") == 1

    # Two steps run freely (two events); after that the engine waits for the gate after each step, so
    # the request cannot run to its end before the client leaves, however fast this machine is.
    gate = threading.Event()
    with watch_steps(srv, gate, free_steps=2) as finished:
        try:
            with httpx.Client(base_url=srv.base, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                events = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(json.loads(line[len("data: ") :]))
                    if len(events) == 2:
                        break
                assert srv.engine.has_unfinished_requests()
                assert srv.engine.block_manager.num_free_blocks < NUM_BLOCKS  # it holds KV blocks now
            # leaving the with-blocks closed the connection mid-stream
            wait_until(noticed, "the server to notice the disconnect", timeout=5.0)
        finally:
            gate.set()
            wait_idle(srv)
    assert finished == [], "the request ran to the end instead of being aborted"
    assert grown(before, scrape(http), "augur_request_failure_total", reason="client_disconnect") == 1


def test_non_streaming_client_timeout_aborts(srv, http):
    wait_idle(srv)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": LONG, "temperature": 0, "ignore_eos": True}
    before = scrape(http)

    def noticed() -> bool:
        return grown(before, scrape(http), "augur_request_failure_total", reason="client_disconnect") == 1

    gate = threading.Event()  # holds the engine after each step, so the request cannot finish first
    with watch_steps(srv, gate) as finished:
        try:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(srv.base + "/v1/completions", json=body, timeout=httpx.Timeout(60.0, read=0.3))
            # The server polls every disconnect_poll_s (0.2 s); the bound only keeps a broken server from
            # stalling the suite for long.
            wait_until(noticed, "the server to notice the disconnect", timeout=5.0)
        finally:
            gate.set()
            wait_idle(srv)
    assert finished == [], "the request ran to the end instead of being aborted"


# -- start-up -------------------------------------------------------------------------------------------
def test_health_is_503_while_loading(llama_dir):
    release = threading.Event()
    make = engine_factory(llama_dir)

    def slow_factory() -> AsyncEngine:
        assert release.wait(120), "the test never released the loader"
        return make()

    app = create_app(ServerSettings(served_model_name=MODEL), slow_factory)
    try:
        with serve(app, wait_ready=False) as s, httpx.Client(base_url=s.base, timeout=60) as c:
            resp = c.get("/health")
            assert (resp.status_code, resp.json()) == (503, {"status": "loading"})
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
            assert_error(c.post("/v1/completions", json=body), 503, contains="not ready")
            assert_error(c.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT}), 503)
            assert c.get("/v1/models").json()["data"][0]["id"] == MODEL  # known before the weights are

            release.set()
            wait_until(lambda: c.get("/health").status_code == 200, "/health to turn 200 after loading", FIRST_LOAD_S)
            assert c.get("/health").json() == {"status": "ok", "compile": "off"}
            resp = c.post("/v1/completions", json=body)
            assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] >= 1
    finally:
        release.set()


def test_health_reports_a_failed_load():
    def broken() -> AsyncEngine:
        raise FileNotFoundError("no weights in /nowhere")

    with serve(create_app(ServerSettings(served_model_name=MODEL), broken), wait_ready=False) as s:
        wait_until(lambda: httpx.get(s.base + "/health").json()["status"] != "loading", "the load to fail")
        resp = httpx.get(s.base + "/health")
        assert resp.status_code == 503
        assert resp.json() == {"status": "error", "error": "FileNotFoundError: no weights in /nowhere"}
        assert_error(httpx.post(s.base + "/v1/completions", json={"model": MODEL, "prompt": "Hi"}), 503)
