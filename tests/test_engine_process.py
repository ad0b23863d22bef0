"""The engine in a process of its own (``--engine-process on``, engine/core/engine_core.py): the same
answers as the engine on a thread, and every failure path across the process boundary: a client
leaving, the engine process killed, an engine that cannot load, steps that keep failing, the API
process dying."""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import zmq

from conftest import build_model_dir
from engine.config import EngineConfig
from engine.core.engine_core import _STEP_DECODER, EngineCore, ProcessEngine
from engine.core.llm_engine import LLMEngine
from engine.request.sampling_params import SamplingParams
from server.app import ServerSettings, create_app
from servers import FIRST_LOAD_S, NUM_BLOCKS, Served, engine_factory, serve, wait_until

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MODEL = "tiny"


def process_factory(model_dir, **kw):
    defaults = dict(device="cpu", dtype="float32", num_kv_blocks=NUM_BLOCKS, block_size=4, max_model_len=512)
    return lambda: ProcessEngine(EngineConfig(model=str(model_dir), **{**defaults, **kw}))


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory, tokenizer_dir):
    """The tiny Llama with room for 4,000 new tokens (seconds of decoding): a request still running
    when the test acts on it, whatever the machine's load."""
    return build_model_dir(
        tmp_path_factory.mktemp("long"), tokenizer_dir, "LlamaForCausalLM", max_position_embeddings=4096
    )


LONG = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def servers(llama_dir) -> Iterator[tuple[Served, Served]]:
    """The same model served with the engine on a thread and in a process of its own."""
    settings = ServerSettings(served_model_name=MODEL)
    with serve(create_app(settings, engine_factory(llama_dir))) as thread_srv:
        with serve(create_app(settings, process_factory(llama_dir))) as process_srv:
            yield thread_srv, process_srv


def client(srv: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0)


def metric(srv: Served, name: str) -> float:
    for line in httpx.get(srv.base + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def answers(srv: Served) -> list:
    """Greedy, seeded n = 2 with logprobs, a stop string, a streamed chat, a JSON schema."""
    c = client(srv)
    out = []
    r = c.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=16, temperature=0)
    out.append((r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens))
    r = c.completions.create(
        model=MODEL, prompt=[5, 6, 7, 8], max_tokens=8, temperature=1.0, seed=7, n=2, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    out.append([(ch.index, ch.text, ch.logprobs.tokens, ch.logprobs.token_logprobs) for ch in r.choices])
    full = c.completions.create(model=MODEL, prompt="The quick", max_tokens=24, temperature=0).choices[0].text
    stop = next(ch for ch in full[1:] if ch.isascii() and ch.isalnum())  # one the greedy text reaches
    r = c.completions.create(model=MODEL, prompt="The quick", max_tokens=24, temperature=0, stop=[stop])
    out.append((r.choices[0].text, r.choices[0].finish_reason, full[: full.index(stop)]))
    chunks = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    text, usage = "", None
    for ch in chunks:
        if ch.choices:
            text += ch.choices[0].delta.content or ""
        if ch.usage is not None:
            usage = ch.usage.completion_tokens
    out.append((text, usage))
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    r = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a number"}], max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    )  # fmt: skip
    out.append(r.choices[0].message.content)
    return out


def test_the_process_engine_answers_as_the_thread_engine(servers):
    thread_srv, process_srv = servers
    got, want = answers(process_srv), answers(thread_srv)
    assert got == want
    assert re.fullmatch(r'\{\s*"n"\s*:\s*-?\d*\s*\}?', got[-1])  # the grammar held in the engine process too
    assert got[2][1] == "stop" and got[2][0] == got[2][2], got[2]  # cut where the stop string began
    # The metrics cross the boundary: tokens counted, nothing left running.
    assert metric(process_srv, "augur_generation_tokens_total") >= sum(len(x[3]) for x in got[1])
    wait_until(lambda: metric(process_srv, "augur_num_requests_running") == 0, "the requests to finish")


def test_an_idle_engine_process_says_when_its_compiled_forwards_are_in(llama_dir):
    """Compiled in the background with no request in sight: the engine process swaps the compiled
    forwards in while idle, and /health says so without waiting for a request (it used to say
    ``pending`` until the next step published a message)."""
    factory = process_factory(llama_dir, compile="on", compile_background=True)
    with serve(create_app(ServerSettings(served_model_name=MODEL), factory)) as srv:
        assert httpx.get(srv.base + "/health").json()["compile"] in ("pending", "on")
        wait_until(lambda: httpx.get(srv.base + "/health").json()["compile"] == "on", "the idle swap", FIRST_LOAD_S)
        r = client(srv).completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0)
        assert r.usage.completion_tokens == 4


def test_a_client_leaving_frees_its_blocks_in_the_engine_process(long_dir):
    app = create_app(ServerSettings(served_model_name=MODEL), process_factory(long_dir, max_model_len=4096))
    with serve(app) as srv:
        with httpx.stream("POST", srv.base + "/v1/completions", json=LONG, timeout=60) as r:
            lines = r.iter_lines()
            assert next(ln for ln in lines if ln.startswith("data:"))
            wait_until(lambda: metric(srv, "augur_num_requests_running") == 1, "the request to run")
        wait_until(lambda: metric(srv, "augur_num_requests_running") == 0, "the abort to reach the engine process")
        wait_until(lambda: metric(srv, "augur_kv_cache_usage_ratio") == 0.0, "the blocks to come back")
        assert metric(srv, "augur_generation_tokens_total") < 4000  # it was cut short, not finished
        r = client(srv).completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0)
        assert r.choices[0].finish_reason in ("length", "stop")  # still serving


def test_a_killed_engine_process_fails_streams_health_and_new_requests(long_dir):
    app = create_app(ServerSettings(served_model_name=MODEL), process_factory(long_dir, max_model_len=4096))
    with serve(app) as srv:
        engine: ProcessEngine = srv.async_engine
        with httpx.stream("POST", srv.base + "/v1/completions", json=LONG, timeout=60) as r:
            lines = r.iter_lines()
            assert next(ln for ln in lines if ln.startswith("data:"))
            os.kill(engine.process.pid, signal.SIGKILL)
            rest = list(lines)  # the stream ends, with an error event, instead of hanging
        errors = [json.loads(ln[5:]) for ln in rest if ln.startswith("data:") and '"error"' in ln]
        assert errors and "engine" in errors[0]["error"]["message"]
        h = httpx.get(srv.base + "/health")
        assert h.status_code == 503 and h.json()["status"] == "dead" and "exit code" in h.json()["error"]
        body = {**LONG, "stream": False, "max_tokens": 2}
        r = httpx.post(srv.base + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["message"]


def test_an_engine_that_cannot_load_says_why(tmp_path):
    failures = []
    bad = tmp_path / "no-model"
    bad.mkdir()
    app = create_app(ServerSettings(served_model_name=MODEL), process_factory(bad), on_load_failure=failures.append)
    with serve(app, wait_ready=False) as srv:
        wait_until(lambda: bool(failures), "the load to fail")
        h = httpx.get(srv.base + "/health")
        assert h.status_code == 503 and h.json()["status"] == "error" and h.json()["error"]


def test_steps_that_keep_failing_kill_the_engine_core(llama_dir, monkeypatch):
    """The engine process's loop, run here on real sockets: a step that raises fails its requests;
    three in a row end the loop with ``dead`` after the error outputs."""
    engine = LLMEngine(EngineConfig(model=str(llama_dir), device="cpu", num_kv_blocks=64, block_size=4))

    def broken_step():
        raise RuntimeError("the step itself is broken")

    monkeypatch.setattr(engine, "step", broken_step)
    ctx, where = zmq.Context(), tempfile.mkdtemp()
    commands, outputs = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    commands.bind(f"ipc://{where}/c")
    outputs.bind(f"ipc://{where}/o")
    core_in, core_out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    core_in.connect(f"ipc://{where}/c")
    core_out.connect(f"ipc://{where}/o")
    core = EngineCore(engine, core_in, core_out, None)
    loop = threading.Thread(target=core.run, daemon=True)
    loop.start()
    params = SamplingParams(temperature=0.0, max_tokens=4)
    commands.send(pickle.dumps(("add", "r1", [5, 6, 7], params, time.monotonic())))
    kinds, finals = [], []
    while not kinds or kinds[-1] != b"dead":
        assert outputs.poll(60_000), "the engine core went silent"
        kind, payload = outputs.recv_multipart()
        kinds.append(kind)
        if kind == b"step":
            finals += [o for o in _STEP_DECODER.decode(payload).outputs if o.finished]
    loop.join(timeout=30)
    assert not loop.is_alive()
    assert [o.request_id for o in finals] == ["r1"] and finals[0].error
    assert pickle.loads(payload) == "the engine failed 3 steps in a row"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    for s in (commands, outputs, core_in, core_out):
        s.close(linger=0)
    ctx.term()


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def test_the_engine_process_exits_with_the_api_process(llama_dir, tmp_path):
    cmd = [
        sys.executable, "-m", "server.cli", "serve", "--model", str(llama_dir), "--engine-process", "on",
        "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64", "--block-size", "4", "--port", "0",
    ]  # fmt: skip
    env = {**os.environ, "AUGUR_COMPILE": "off"}
    api = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "log", "w"))
    try:
        wait_until(lambda: any(_is_engine(c) for c in children(api.pid)), "the engine process to start", 120)
        engine_pid = next(c for c in children(api.pid) if _is_engine(c))
        os.kill(api.pid, signal.SIGKILL)
        api.wait(timeout=30)
        wait_until(lambda: not os.path.exists(f"/proc/{engine_pid}") or _zombie(engine_pid), "the engine to exit", 60)
    finally:
        if api.poll() is None:
            api.kill()


def _is_engine(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"spawn_main" in f.read()
    except OSError:
        return False


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_the_engine_process_leaves_a_cpu_to_the_api_process_beyond_two(monkeypatch):
    import engine.platform as platform

    monkeypatch.delenv("AUGUR_ENGINE_THREADS", raising=False)
    for usable, threads in ((1, 1), (2, 2), (3, 2), (8, 7)):
        monkeypatch.setattr(platform, "usable_cpus", lambda usable=usable: usable)
        assert platform.engine_process_threads() == threads
    monkeypatch.setenv("AUGUR_ENGINE_THREADS", "3")
    assert platform.engine_process_threads() == 3


def test_the_queue_bound_holds_in_front_of_an_engine_process(long_dir):
    """One seat, room for one waiting request: A runs, B waits in the engine process, C is refused
    with 429 before it crosses; A's client leaves, and B runs to its end."""
    settings = ServerSettings(served_model_name=MODEL, max_queue_len=1)
    with serve(create_app(settings, process_factory(long_dir, max_model_len=4096, max_num_seqs=1))) as srv:
        url = srv.base + "/v1/completions"
        short = {**LONG, "stream": False, "max_tokens": 300}
        done: dict[str, httpx.Response] = {}
        b = threading.Thread(target=lambda: done.update(b=httpx.post(url, json=short, timeout=120)))
        with httpx.stream("POST", url, json=LONG, timeout=120) as a:
            lines = a.iter_lines()  # (kept: dropping the iterator closes the response)
            assert next(ln for ln in lines if ln.startswith("data:"))  # A holds the one seat
            b.start()
            wait_until(lambda: metric(srv, "augur_num_requests_waiting") == 1, "B to wait in the engine process")
            c = httpx.post(url, json={**short, "max_tokens": 2}, timeout=30)
            assert c.status_code == 429 and "queue" in c.json()["error"]["message"] and c.headers["retry-after"]
        b.join(timeout=120)
        assert done["b"].status_code == 200 and done["b"].json()["usage"]["completion_tokens"] == 300
