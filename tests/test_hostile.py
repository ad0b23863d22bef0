"""A hostile or careless client against a real server: every bad request gets a 4xx in OpenAI's error
shape, a greedy stream running beside them is unchanged, and the KV cache is empty afterwards."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import torch

from engine.config import EngineConfig
from engine.core.async_engine import AsyncEngine, EngineDeadError
from engine.core.llm_engine import LLMEngine
from engine.request.outputs import RequestOutput
from engine.request.sampling_params import SamplingParams
from server.app import ServerSettings, create_app
from servers import NUM_BLOCKS, Served, engine_factory, serve, wait_until

MODEL = "tiny-llama"
MAX_BYTES = 1 << 20
QUEUE = 8


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def srv(llama_dir):
    settings = ServerSettings(
        served_model_name=MODEL, max_queue_len=QUEUE, max_request_bytes=MAX_BYTES, body_timeout_s=1.5
    )
    with serve(create_app(settings, engine_factory(llama_dir)), header_timeout_s=1.5) as s:
        yield s


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.base, timeout=60) as c:
        yield c


def idle(srv: Served) -> bool:
    eng: LLMEngine = srv.engine
    return not eng.has_unfinished_requests() and eng.block_manager.num_free_blocks == NUM_BLOCKS


def completion(**kw) -> dict:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 4, **kw}


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


BIG = "a" * (MAX_BYTES + 10)
USER_X = {"role": "user", "content": "x"}
USER_IMAGE = {"role": "user", "content": [{"type": "image_url"}]}
# (id, path, request kwargs for httpx, expected status)
CASES = [
    ("seed-2^64", "/v1/completions", {"json": completion(seed=2**64)}, 400),
    ("seed-below-int64", "/v1/completions", {"json": completion(seed=-(2**63) - 1)}, 400),
    ("seed-2^80-n3", "/v1/completions", {"json": completion(seed=2**80, n=3)}, 400),
    ("seed-float", "/v1/completions", {"json": completion(seed=1.5)}, 400),
    ("seed-string", "/v1/completions", {"json": completion(seed="12")}, 400),
    ("deep-list", "/v1/completions", {"content": '{"prompt": ' + nested(1000) + "}"}, 400),
    ("deep-dict", "/v1/completions", {"content": '{"a": ' + '{"a": ' * 1000 + "1" + "}" * 1001}, 400),
    ("deep-900", "/v1/completions", {"content": '{"model": "tiny-llama", "prompt": ' + nested(900) + "}"}, 400),
    ("lone-high-surrogate", "/v1/completions", {"content": '{"prompt": "a\\ud800b"}'}, 400),
    ("lone-low-surrogate", "/v1/completions", {"content": '{"prompt": "\\udc00"}'}, 400),
    ("lone-surrogate-stop", "/v1/completions", {"content": '{"prompt": "hi", "stop": ["\\udfff"]}'}, 400),
    (
        "lone-surrogate-chat",
        "/v1/chat/completions",
        {"content": '{"messages": [{"role": "user", "content": "\\ud83d"}]}'},
        400,
    ),
    ("nan-temperature", "/v1/completions", {"content": '{"prompt": "hi", "temperature": NaN}'}, 400),
    ("infinity-bias", "/v1/completions", {"content": '{"prompt": "hi", "logit_bias": {"5": Infinity}}'}, 400),
    ("prompt-bool-ids", "/v1/completions", {"json": completion(prompt=[[False]])}, 400),
    ("prompt-bool-id", "/v1/completions", {"json": completion(prompt=[True, 5])}, 400),
    ("prompt-negative-id", "/v1/completions", {"json": completion(prompt=[-3])}, 400),
    ("prompt-id-2^40", "/v1/completions", {"json": completion(prompt=[2**40])}, 400),
    ("prompt-id-out-of-vocab", "/v1/completions", {"json": completion(prompt=[100000])}, 400),
    ("prompt-empty-list", "/v1/completions", {"json": completion(prompt=[])}, 400),
    ("prompt-null", "/v1/completions", {"json": completion(prompt=None)}, 400),
    ("max-tokens-true", "/v1/completions", {"json": completion(max_tokens=True)}, 400),
    ("max-tokens-string", "/v1/completions", {"json": completion(max_tokens="5")}, 400),
    ("max-tokens-zero", "/v1/completions", {"json": completion(max_tokens=0)}, 400),
    ("max-tokens-huge", "/v1/completions", {"json": completion(max_tokens=10**9)}, 400),
    ("n-true", "/v1/completions", {"json": completion(n=True)}, 400),
    ("n-129", "/v1/completions", {"json": completion(n=129)}, 400),
    ("stream-string", "/v1/completions", {"json": completion(stream="yes")}, 400),
    ("logit-bias-underscore", "/v1/completions", {"json": completion(logit_bias={"1_0": 1})}, 400),
    ("logit-bias-space", "/v1/completions", {"json": completion(logit_bias={" 7": 1})}, 400),
    ("logit-bias-plus", "/v1/completions", {"json": completion(logit_bias={"+3": 1})}, 400),
    ("logit-bias-huge-id", "/v1/completions", {"json": completion(logit_bias={"99999999999": 1})}, 400),
    ("logit-bias-value", "/v1/completions", {"json": completion(logit_bias={"5": 101})}, 400),
    ("stop-token-negative", "/v1/completions", {"json": completion(stop_token_ids=[-1])}, 400),
    ("stop-token-2^70", "/v1/completions", {"json": completion(stop_token_ids=[2**70])}, 400),
    ("stop-token-bool", "/v1/completions", {"json": completion(stop_token_ids=[True])}, 400),
    ("temperature-negative", "/v1/completions", {"json": completion(temperature=-1)}, 400),
    ("top-p-zero", "/v1/completions", {"json": completion(top_p=0)}, 400),
    ("logprobs-21", "/v1/completions", {"json": completion(logprobs=21)}, 400),
    ("best-of-above-n", "/v1/completions", {"json": completion(best_of=3)}, 400),
    ("stream-options-no-stream", "/v1/completions", {"json": completion(stream_options={"include_usage": True})}, 400),
    ("trailing-slash", "/v1/completions/", {"json": completion()}, 404),
    ("trailing-slash-chat", "/v1/chat/completions/", {"json": {"messages": [{"role": "user", "content": "x"}]}}, 404),
    ("unknown-path", "/v1/nothing", {"json": {}}, 404),
    ("unknown-model", "/v1/completions", {"json": completion(model="gpt-9")}, 404),
    ("more-prompts-than-queue", "/v1/completions", {"json": completion(prompt=["a"] * (QUEUE + 1))}, 400),
    ("body-too-large", "/v1/completions", {"content": '{"prompt": "' + BIG + '"}'}, 413),
    ("prompt-cannot-fit", "/v1/completions", {"json": completion(prompt="word " * 150_000)}, 400),
    ("not-json", "/v1/completions", {"content": "{prompt: hi}"}, 400),
    ("json-array", "/v1/completions", {"content": "[1, 2]"}, 400),
    ("json-string", "/v1/completions", {"content": '"hi"'}, 400),
    ("empty-body", "/v1/completions", {"content": ""}, 400),
    ("invalid-utf8", "/v1/completions", {"content": b'{"prompt": "\xff\xfe"}'}, 400),
    ("messages-empty", "/v1/chat/completions", {"json": {"messages": []}}, 400),
    (
        "messages-function-role",
        "/v1/chat/completions",
        {"json": {"messages": [{"role": "function", "content": "x"}]}},
        400,
    ),
    (
        "messages-image",
        "/v1/chat/completions",
        {"json": {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}},
        400,
    ),
    (
        "chat-logprobs-string",
        "/v1/chat/completions",
        {"json": {"messages": [{"role": "user", "content": "x"}], "logprobs": "true"}},
        400,
    ),
]


def test_hostile_requests_get_clean_4xx_and_leave_others_alone(srv, http):
    canary = {"model": MODEL, "prompt": "The canary sings", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    alone = http.post("/v1/completions", json=canary).json()["choices"][0]["text"]
    result: dict = {}

    def run_canary():
        with http.stream("POST", "/v1/completions", json={**canary, "stream": True}) as r:
            text = []
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text.append(json.loads(line[6:])["choices"][0]["text"])
            result["text"] = "".join(text)

    t = threading.Thread(target=run_canary)
    t.start()
    failures = []
    with httpx.Client(base_url=srv.base, timeout=60) as c:
        for name, path, kw, status in CASES:
            r = c.post(path, **kw)
            try:
                body = r.json()
                err = body["error"]
                ok = r.status_code == status and isinstance(err["message"], str) and err["message"] and "type" in err
            except (ValueError, KeyError, TypeError):
                ok = False
            if not ok:
                failures.append(f"{name}: {r.status_code} {r.text[:200]!r}")
    t.join(timeout=120)
    assert not failures, "\n".join(failures)
    assert result["text"] == alone
    assert http.get("/health").status_code == 200
    wait_until(lambda: idle(srv), "the engine to go idle with every KV block free")


def test_extreme_but_valid_values_behave_as_their_limits(srv, http):
    prompt = "def main():\n    return"
    greedy = http.post("/v1/completions", json=completion(prompt=prompt, max_tokens=8, temperature=0)).json()
    # top_p -> 0 keeps only the most likely token: the greedy text, whatever the seed.
    for seed in (1, 2, 3):
        tiny = http.post(
            "/v1/completions", json=completion(prompt=prompt, max_tokens=8, temperature=1, top_p=1e-300, seed=seed)
        ).json()
        assert tiny["choices"][0]["text"] == greedy["choices"][0]["text"]
    # A vanishing repetition penalty still samples real tokens (it used to divide by zero: empty text).
    for penalty in (1e-300, 1e-40):
        for temperature in (0, 1):
            r = http.post(
                "/v1/completions",
                json=completion(
                    prompt=prompt,
                    max_tokens=8,
                    temperature=temperature,
                    repetition_penalty=penalty,
                    seed=5,
                    ignore_eos=True,
                ),
            )
            assert r.status_code == 200
            assert r.json()["usage"]["completion_tokens"] == 8
            assert r.json()["choices"][0]["text"]


def test_seeds_at_the_edge_of_64_bits_serve_every_choice(srv, http):
    """seed + choice index used to overflow 64 bits inside the batched step (500 for everyone in it, and
    a leaked block); now the choices' seeds wrap, and the last valid seeds serve like any other."""
    for seed in (2**64 - 1, 2**64 - 2, -(2**63)):
        r = http.post("/v1/completions", json=completion(seed=seed, n=3, temperature=1, max_tokens=6))
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 3
        again = http.post("/v1/completions", json=completion(seed=seed, n=3, temperature=1, max_tokens=6)).json()
        assert [c["text"] for c in again["choices"]] == [c["text"] for c in r.json()["choices"]]
    wait_until(lambda: idle(srv), "every KV block free")


def test_streamed_choices_finish_once(srv, http):
    body = completion(prompt=["one", "two"], n=3, temperature=1, seed=9, max_tokens=12, stream=True)
    for path, req in (
        ("/v1/completions", body),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 3, "max_tokens": 12, "stream": True},
        ),
    ):
        with http.stream("POST", path, json=req) as r:
            finishes: dict[int, int] = {}
            after_finish = []
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                for choice in json.loads(line[6:])["choices"]:
                    i = choice["index"]
                    if i in finishes:
                        after_finish.append(choice)
                    if choice["finish_reason"] is not None:
                        finishes[i] = finishes.get(i, 0) + 1
        expected = 6 if path == "/v1/completions" else 3
        assert sorted(finishes) == list(range(expected)) and set(finishes.values()) == {1}, finishes
        assert not after_finish


def test_non_streamed_choices_are_the_streamed_text(srv, http):
    """A choice's text is its tokens' decoding, streamed or not: a U+FFFD in it is a byte the model
    sampled that is no valid UTF-8 (a random tiny model at temperature 1 samples many), never one
    made by cutting a character between two chunks."""
    body = completion(n=3, temperature=1, seed=11, max_tokens=40)
    whole = http.post("/v1/completions", json=body).json()["choices"]
    pieces: dict[int, list[str]] = {}
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    pieces.setdefault(c["index"], []).append(c["text"])
    assert {c["index"]: c["text"] for c in whole} == {i: "".join(p) for i, p in pieces.items()}


def test_slow_body_gets_408_and_slow_headers_are_cut(srv):
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        s.sendall(b"Content-Length: 100\r\n\r\n{")
        data = s.recv(65536)  # the server answers after --body-timeout, not never
        assert data.startswith(b"HTTP/1.1 408")
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        t0 = time.monotonic()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHo")
        closed = False
        while time.monotonic() - t0 < 8:
            try:
                s.sendall(b"s")
                if s.recv(1, socket.MSG_DONTWAIT) == b"":
                    closed = True
                    break
            except BlockingIOError:
                pass
            except (ConnectionError, OSError):
                closed = True
                break
            time.sleep(0.2)
        assert closed, "a client dribbling its headers kept the connection"


def test_big_prompt_does_not_stall_the_front(srv, monkeypatch):
    """A prompt just under the body limit is refused (it cannot fit the context) without tokenizing it
    on the event loop: the four requests' tokenizing is held on an event, and /health answers while it
    is held (held on the loop, it could not; the bound on the hold only turns that hang into a failure)."""
    big = {"model": MODEL, "prompt": "x " * (MAX_BYTES // 2 - 100)}
    eng, held, threads = srv.async_engine, threading.Event(), []
    prepare = eng.prepare

    def held_prepare(prompts, params):
        threads.append(threading.current_thread().name)
        if not held.wait(30):
            held.set()  # the loop was stuck here: let the rest through at once
        return prepare(prompts, params)

    monkeypatch.setattr(eng, "prepare", held_prepare)

    async def run():
        async with httpx.AsyncClient(base_url=srv.base, timeout=120) as c:
            posts = [asyncio.create_task(c.post("/v1/completions", json=big)) for _ in range(4)]
            while len(threads) < 4 and not held.is_set():
                await asyncio.sleep(0.01)
            health = await c.get("/health")
            answered_while_held = not held.is_set()
            held.set()
            return health, answered_while_held, await asyncio.gather(*posts)

    health, answered_while_held, posts = asyncio.run(run())
    assert health.status_code == 200 and answered_while_held
    assert len(threads) == 4 and "test-uvicorn" not in threads  # on worker threads, not the server's loop
    assert all(p.status_code == 400 and "cannot fit" in p.json()["error"]["message"] for p in posts)


def test_openapi_publishes_the_request_schemas(http):
    spec = http.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for path, name in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{name}"
        assert {"model", "temperature", "seed"} <= set(schemas[name]["properties"])
    assert "prompt" in schemas["CompletionRequest"]["required"]
    assert "messages" in schemas["ChatCompletionRequest"]["required"]


def test_metrics_scrapes_during_load_never_fail(srv, http):
    async def run():
        async with openai.AsyncOpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0) as ac:
            async with httpx.AsyncClient(base_url=srv.base, timeout=60) as hc:
                load = [
                    asyncio.create_task(ac.completions.create(model=MODEL, prompt=f"p{i}", max_tokens=16))
                    for i in range(8)
                ]
                statuses = []
                while not all(t.done() for t in load):
                    statuses.append((await hc.get("/metrics")).status_code)
                await asyncio.gather(*load)
                return statuses

    statuses = asyncio.run(run())
    assert statuses and set(statuses) == {200}


# -- failures inside the engine stay confined ------------------------------------------------------------
def drain(eng: LLMEngine) -> dict[str, tuple[list[int], RequestOutput]]:
    """Step until idle: each request's tokens (choice 0) and final output."""
    tokens: dict[str, list[int]] = {}
    final: dict[str, RequestOutput] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            tokens.setdefault(o.request_id, []).extend(o.outputs[0].delta_token_ids if o.outputs else [])
            if o.finished:
                final[o.request_id] = o
    return {r: (tokens.get(r, []), o) for r, o in final.items()}


def test_a_request_failing_as_it_forks_fails_alone(llama_dir, monkeypatch):
    eng = LLMEngine(EngineConfig(model=str(llama_dir), device="cpu", num_kv_blocks=64, block_size=4))
    mate = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    eng.add_request("alone", [5, 6, 7], mate)
    alone = drain(eng)["alone"][0]

    original = eng.outputs.init_sequence

    def faulty(seq):
        if seq.group.request_id == "doomed" and seq.index == 1:  # its second choice, as it forks
            raise RuntimeError("injected fork fault")
        return original(seq)

    monkeypatch.setattr(eng.outputs, "init_sequence", faulty)
    eng.add_request("doomed", [9, 10, 11], SamplingParams(n=3, seed=12345, temperature=1.0, max_tokens=5))
    eng.add_request("mate", [5, 6, 7], mate)
    done = drain(eng)
    assert done["doomed"][1].error is not None and "injected fork fault" in done["doomed"][1].error
    assert done["mate"][1].error is None and done["mate"][0] == alone
    assert eng.block_manager.num_free_blocks == 64


def test_a_dead_engine_fails_waiting_streams_and_refuses_new_ones(llama_dir, monkeypatch):
    eng = LLMEngine(EngineConfig(model=str(llama_dir), device="cpu", num_kv_blocks=64, block_size=4))

    def broken_step():
        raise RuntimeError("the step itself is broken")

    monkeypatch.setattr(eng, "step", broken_step)
    params = SamplingParams(temperature=0.0, max_tokens=4)

    async def run():
        ae = AsyncEngine(eng)
        ae.start()
        try:
            outs = [o async for o in ae.generate("first", [5, 6], params)]
            with pytest.raises(EngineDeadError):
                async for _ in ae.generate("second", [5, 6], params):
                    pass
            return outs, ae.is_running
        finally:
            ae.shutdown()

    outs, running = asyncio.run(asyncio.wait_for(run(), 60))
    assert outs[-1].finished and outs[-1].error
    assert not running


def test_out_of_memory_shrinks_the_step_instead_of_failing_it(llama_dir, monkeypatch):
    """A forward that runs out of memory preempts its step and retries smaller: every request still
    gets exactly its greedy output; one that cannot fit even alone in the smallest step fails alone;
    the engine keeps serving and frees every block."""
    cfg = dict(model=str(llama_dir), device="cpu", num_kv_blocks=128, block_size=4, max_num_batched_tokens=64)
    prompts = [[20 + i, 30 + i, 40 + i, 50 + i, 60 + i] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    reference = LLMEngine(EngineConfig(**cfg))
    for i, p in enumerate(prompts):
        reference.add_request(f"r{i}", p, params)
    expected = {r: toks for r, (toks, _) in drain(reference).items()}

    eng = LLMEngine(EngineConfig(**cfg))
    original = eng.runner.execute
    marker = 77
    ooms = []

    def tight(batch, *a, **kw):
        if batch.num_tokens > 12 or bool((batch.input_ids == marker).any()):
            ooms.append(batch.num_tokens)
            raise torch.OutOfMemoryError("injected: out of memory")
        return original(batch, *a, **kw)

    monkeypatch.setattr(eng.runner, "execute", tight)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    eng.add_request("huge", [marker, 5, 6], params)
    done = drain(eng)
    assert ooms, "the injected limit was never hit"
    assert {r: done[r][0] for r in expected} == expected
    assert all(done[r][1].error is None for r in expected)
    assert "out of memory" in (done["huge"][1].error or "")
    assert eng.block_manager.num_free_blocks == 128
    assert eng.scheduler.max_num_batched_tokens < 64  # shrunk; regrows after steps that fit
