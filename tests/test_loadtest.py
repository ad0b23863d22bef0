"""The load generator: unit cases for its parts, and whole runs against a real in-process server
(uvicorn on 127.0.0.1 serving a tiny random-weight Llama on CPU)."""

from __future__ import annotations

import asyncio
import json
import random
import selectors
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn

from engine.config import EngineConfig
from engine.core.async_engine import AsyncEngine
from engine.core.llm_engine import LLMEngine
from loadtest.cli import main
from loadtest.client import RequestRecord, build_payload, send_request
from loadtest.config import LoadTestConfig
from loadtest.prompts import Prompt, load_prompts, parse_jsonl
from loadtest.report import build_report, server_acceptance_length, summarize
from loadtest.runner import RunResult, make_client, run_load
from server.app import ServerSettings, create_app
from servers import FIRST_LOAD_S

REPO = Path(__file__).resolve().parents[1]
TUTORIAL = [
    "The future of artificial intelligence is ",
    "Machine learning is transforming the world by ",
    "Natural language processing enables computers to understand ",
    "Generative models like GPT-3 can create ",
    "AI ethics and fairness are important considerations for ",
]
REPORT_KEYS = {
    "config",
    "label",
    "speculative_enabled",
    "model",
    "api",
    "mode",
    "concurrency",
    "rate",
    "started_at",
    "duration_s",
    "num_requests",
    "num_completed",
    "num_failed",
    "num_cancelled",
    "errors",
    "error_examples",
    "request_throughput",
    "output_throughput",
    "total_output_tokens",
    "total_prompt_tokens",
    "output_tokens_from_usage",
    "ttft_s",
    "tpot_s",
    "itl_s",
    "e2e_s",
    "goodput",
    "mean_acceptance_length",
    "server_metrics",
    "output_throughput_timeline",
    "requests",
}
RUN_KEYS = REPORT_KEYS - {"config"}
RECORD_KEYS = {
    "index",
    "prompt_index",
    "start_s",
    "status",
    "error",
    "error_message",
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "itl_s",
    "num_chunks",
    "completion_tokens",
    "prompt_tokens",
    "tokens_from_usage",
    "finish_reason",
    "speculative",
    "text",
}


# -- a real server ------------------------------------------------------------------------------------
@contextmanager
def serve(model_dir: Path, draft_dir: Path | None = None, **settings):
    def engine():
        cfg = EngineConfig(
            model=str(model_dir),
            draft_model=str(draft_dir) if draft_dir else None,
            device="cpu",
            dtype="float32",
            num_kv_blocks=256,
            block_size=4,
            max_model_len=256,
        )
        return AsyncEngine(LLMEngine(cfg))

    app = create_app(ServerSettings(served_model_name="tiny", **settings), engine)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + FIRST_LOAD_S
        while True:
            assert thread.is_alive(), "the server thread died"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not become healthy"
            time.sleep(0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()


@pytest.fixture(scope="module")
def server_url(tiny_demo):
    """A live demo server: the embedded pair (tiny build), speculating with its draft."""
    with serve(tiny_demo / "target", tiny_demo / "draft") as url:
        yield url


def run_cli(args: list[str], out: Path) -> dict:
    assert main([*args, "--output", str(out), "--no-progress"]) == 0
    return json.loads(out.read_text())


def check_run(run: dict, n: int, max_tokens: int) -> None:
    """Every field present and consistent for a run where all ``n`` requests succeeded with
    --ignore-eos (so each produced exactly ``max_tokens`` tokens)."""
    assert RUN_KEYS <= set(run)
    assert run["num_requests"] == run["num_completed"] == n
    assert run["num_failed"] == run["num_cancelled"] == 0 and run["errors"] == {}
    reqs = run["requests"]
    assert [r["index"] for r in reqs] == list(range(n))
    assert all(set(r) == RECORD_KEYS and r["status"] == "ok" and r["error"] is None for r in reqs)
    assert all(r["completion_tokens"] == max_tokens and r["tokens_from_usage"] for r in reqs)
    assert all(r["finish_reason"] == "length" and r["prompt_tokens"] > 0 for r in reqs)
    assert run["output_tokens_from_usage"] is True
    assert run["total_output_tokens"] == n * max_tokens
    assert run["total_prompt_tokens"] == sum(r["prompt_tokens"] for r in reqs)
    assert run["duration_s"] > 0
    assert run["request_throughput"] == pytest.approx(n / run["duration_s"])
    assert run["output_throughput"] == pytest.approx(n * max_tokens / run["duration_s"])
    for r in reqs:
        assert r["start_s"] >= 0 and 0 < r["ttft_s"] <= r["e2e_s"]
        assert r["start_s"] + r["e2e_s"] <= run["duration_s"] + 1e-6
        assert len(r["itl_s"]) == r["num_chunks"] - 1 and all(g >= 0 for g in r["itl_s"])
        assert r["tpot_s"] == pytest.approx((r["e2e_s"] - r["ttft_s"]) / (max_tokens - 1))
        assert r["ttft_s"] + sum(r["itl_s"]) <= r["e2e_s"] + 1e-6
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        s = run[key]
        assert s["count"] == n
        assert 0 < s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"]
        assert s["min"] <= s["mean"] <= s["max"]
    assert run["e2e_s"]["mean"] == pytest.approx(sum(r["e2e_s"] for r in reqs) / n)
    itl = run["itl_s"]
    assert itl["count"] == sum(len(r["itl_s"]) for r in reqs) > 0
    assert itl["p50"] <= itl["p90"] <= itl["p99"]
    mal = run["mean_acceptance_length"]
    assert run["server_metrics"]["available"] is True
    assert mal["server_metrics"] is None or mal["server_metrics"] >= 1.0
    assert mal["usage_responses"] == n and mal["usage"] >= 1.0  # plain decoding: one token per step
    tl = run["output_throughput_timeline"]
    assert len(tl["t_s"]) == len(tl["output_tokens_per_s"]) == 60
    assert sum(tl["output_tokens_per_s"]) * tl["bin_s"] == pytest.approx(n * max_tokens)


def overlap(reqs: list[dict]) -> int:
    """The most requests in flight at once."""
    events = sorted([(r["start_s"], 1) for r in reqs] + [(r["start_s"] + r["e2e_s"], -1) for r in reqs])
    most = now = 0
    for _, d in events:
        now += d
        most = max(most, now)
    return most


# -- whole runs -----------------------------------------------------------------------------------------
def test_closed_loop_chat(server_url, tmp_path, capsys):
    args = ["--url", server_url, "--api", "chat", "--concurrency", "4", "--num-requests", "12"]
    args += ["--max-tokens", "8", "--ignore-eos", "--slo-ttft", "30", "--slo-tpot", "30", "--plots", str(tmp_path)]
    report = run_cli(args, tmp_path / "r.json")
    assert set(report) == REPORT_KEYS
    check_run(report, n=12, max_tokens=8)
    assert report["model"] == "tiny" and report["api"] == "chat" and report["mode"] == "closed"
    assert report["config"]["concurrency"] == 4 and report["config"]["prompts"] == "chat"
    assert report["speculative_enabled"] is None
    assert overlap(report["requests"]) == 4
    good = report["goodput"]
    assert good["num_good"] == 12 and good["fraction_of_completed"] == 1.0
    assert good["requests_per_s"] == pytest.approx(report["request_throughput"])
    for name in ("ttft_cdf", "tpot_cdf", "e2e_cdf", "output_throughput"):
        png = tmp_path / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 2000
    out = capsys.readouterr().out
    assert "concurrency 4" in out and "TTFT" in out and "E2E" in out and "errors                none" in out


def test_completions_in_a_subprocess(server_url, tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "loadtest", "--url", server_url + "/v1", "--api", "completions"]
    cmd += ["--prompts", "tutorial", "--concurrency", "2", "--num-requests", "5", "--max-tokens", "6"]
    cmd += ["--ignore-eos", "--output", str(out), "--no-progress", "--model", "tiny"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "output throughput" in proc.stdout and "p99" in proc.stdout
    report = json.loads(out.read_text())
    check_run(report, n=5, max_tokens=6)
    assert sorted(r["prompt_index"] for r in report["requests"]) == [0, 1, 2, 3, 4]  # each prompt once
    assert report["goodput"] is None and report["api"] == "completions"


def test_open_loop_follows_poisson_arrivals(server_url, tmp_path):
    args = ["--url", server_url, "--api", "completions", "--rate", "40", "--num-requests", "12"]
    report = run_cli([*args, "--max-tokens", "4", "--ignore-eos", "--seed", "3"], tmp_path / "r.json")
    check_run(report, n=12, max_tokens=4)
    assert report["mode"] == "open" and report["rate"] == 40 and report["concurrency"] is None
    rng = random.Random(3 + 1)
    expected = [0.0]
    for _ in range(11):
        expected.append(expected[-1] + rng.expovariate(40))
    starts = [r["start_s"] for r in report["requests"]]
    for got, want in zip(starts, expected):
        assert want - 1e-3 <= got, (starts, expected)  # never early; how late is the host's (see below)


@pytest.mark.parametrize("rate", [40.0, 2.0])
def test_open_loop_sends_on_schedule_however_slow_the_server(rate):
    """On a virtual clock, against a scripted server that takes 1 s a request (longer than most gaps at
    40/s): every request goes out at its Poisson arrival, in flight or not, and is timed exactly."""

    async def body():
        await asyncio.sleep(1.0)
        for e in sse(chat_delta("x"), {"choices": [], "usage": {"completion_tokens": 1}}):
            yield e.encode()

    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body()))
    config = LoadTestConfig(url="http://127.0.0.1:9", num_requests=12, rate=rate, seed=3, progress=False)

    async def go() -> RunResult:
        async with make_client(config, transport) as client:
            return await run_load(config, [Prompt(text="hi")], "m", client=client)

    result = run_virtual(go())
    rng = random.Random(3 + 1)
    expected = [0.0]
    for _ in range(11):
        expected.append(expected[-1] + rng.expovariate(rate))
    assert [r.start_s for r in result.records] == pytest.approx(expected, abs=1e-9)
    assert all(r.status == "ok" and r.ttft_s == pytest.approx(1.0, abs=1e-9) for r in result.records)
    assert result.duration_s == pytest.approx(expected[-1] + 1.0, abs=1e-9)


def test_compare_speculation(server_url, tmp_path, capsys):
    args = ["--url", server_url, "--concurrency", "2", "--num-requests", "6", "--max-tokens", "5", "--ignore-eos"]
    args += ["--compare-speculation", "--warmup", "1", "--plots", str(tmp_path / "plots")]
    report = run_cli(args, tmp_path / "r.json")
    assert set(report) == {"config", "model", "runs", "ratios"}
    runs = report["runs"]
    assert set(runs) == {"speculative", "no_speculative"}
    assert runs["speculative"]["speculative_enabled"] is True
    assert runs["no_speculative"]["speculative_enabled"] is False
    for run in runs.values():
        check_run(run, n=6, max_tokens=5)  # the server accepted the "speculative" field both ways
    ratios = report["ratios"]
    for key in ("request_throughput", "output_throughput"):
        assert ratios[key] == pytest.approx(runs["speculative"][key] / runs["no_speculative"][key])
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert set(ratios[key]) == {"mean", "p50", "p90", "p99"} and all(v > 0 for v in ratios[key].values())
    assert ratios["e2e_s"]["p50"] == pytest.approx(
        runs["speculative"]["e2e_s"]["p50"] / runs["no_speculative"]["e2e_s"]["p50"]
    )
    assert ratios["same_output"] == {"compared": 6, "identical": 6}  # greedy: speculation changes nothing
    spec_mal = runs["speculative"]["mean_acceptance_length"]
    assert runs["no_speculative"]["mean_acceptance_length"]["usage"] == pytest.approx(1.0)
    assert spec_mal["server_metrics"] is not None and spec_mal["usage"] >= 1.0
    assert ratios["goodput"] is None
    assert len(list((tmp_path / "plots").glob("*.png"))) == 4
    out = capsys.readouterr().out
    assert "Speculation on vs off" in out and "[speculative]" in out and "[no_speculative]" in out


def test_wrong_api_key_is_counted_as_http_401(llama_dir, tmp_path, capsys):
    with serve(llama_dir, api_key="k") as url:
        base = ["--url", url, "--concurrency", "2", "--num-requests", "6", "--max-tokens", "4"]
        # No --model: reading GET /v1/models fails too, and the run goes on without a model name.
        bad = run_cli([*base, "--api-key", "wrong"], tmp_path / "bad.json")
        good = run_cli([*base, "--api-key", "k", "--ignore-eos"], tmp_path / "good.json")
    assert set(bad) == REPORT_KEYS
    assert bad["model"] is None and bad["config"]["api_key"] == "***"
    assert bad["num_requests"] == bad["num_failed"] == 6 and bad["num_completed"] == 0
    assert bad["errors"] == {"http_401": 6}
    assert "API key" in bad["error_examples"]["http_401"]
    assert all(r["status"] == "error" and r["error"] == "http_401" for r in bad["requests"])
    assert bad["request_throughput"] == bad["output_throughput"] == 0.0
    assert bad["ttft_s"]["count"] == 0 and bad["ttft_s"]["p50"] is None
    out = capsys.readouterr().out
    assert "http_401: 6" in out
    check_run(good, n=6, max_tokens=4)
    assert good["model"] == "tiny"


@pytest.mark.parametrize("load", [["--concurrency", "2"], ["--rate", "50"]])
def test_duration_bounds_the_run(server_url, tmp_path, load):
    args = ["--url", server_url, *load, "--num-requests", "100000", "--duration", "0.8"]
    report = run_cli([*args, "--max-tokens", "120", "--ignore-eos", "--api", "completions"], tmp_path / "r.json")
    # The run lasts until the deadline and is then cut. How soon after is timing (a busy machine stretches
    # it: not asserted); 100,000 requests would take over half an hour, so 60 s still catches an ignored cut.
    assert 0.8 <= report["duration_s"] < 60
    n = report["num_requests"]
    assert 0 < n < 100000
    assert report["num_completed"] + report["num_failed"] + report["num_cancelled"] == n
    assert report["num_failed"] == 0 and report["num_cancelled"] >= 1
    assert all(r["start_s"] < 0.8 for r in report["requests"])  # nothing sent after the deadline (by its clock)
    assert all(r["status"] == "ok" or r["ttft_s"] is None or r["e2e_s"] is None for r in report["requests"])
    # The server is still serving after the cancellations.
    assert httpx.get(f"{server_url}/health", timeout=5).status_code == 200


# -- parts ----------------------------------------------------------------------------------------------
def test_shipped_prompt_sets():
    assert [p.text for p in load_prompts("tutorial")] == TUTORIAL
    code = load_prompts("code")
    assert 35 <= len(code) <= 45 and all(p.text and p.messages is None for p in code)
    chat = load_prompts("chat")
    assert 25 <= len(chat) <= 35 and all(p.as_messages()[-1]["role"] == "user" for p in chat)
    assert 'loadtest = ["prompts/*.jsonl"]' in (REPO / "pyproject.toml").read_text()


def test_prompt_files(tmp_path):
    demo = tmp_path / "prompts.jsonl"
    demo.write_text('{"prompt": "import os\\n", "source": "os.py"}\n\n{"prompt": "def f():\\n", "source": "a.py"}\n')
    got = load_prompts(str(demo))
    assert [p.text for p in got] == ["import os\n", "def f():\n"]
    assert got[0].as_messages() == [{"role": "user", "content": "import os\n"}]
    conv = parse_jsonl('{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}')
    assert conv[0].as_messages()[1] == {"role": "user", "content": "hi"} and conv[0].as_text() == "be brief\nhi"
    assert parse_jsonl('"just a string"')[0].text == "just a string"
    with pytest.raises(ValueError, match=":2"):
        parse_jsonl('{"prompt": "ok"}\n{"source": "no prompt"}\n')
    with pytest.raises(ValueError, match="neither a shipped set"):
        load_prompts(str(tmp_path / "missing.jsonl"))


def test_payload():
    p = Prompt(text="def f():\n")
    chat = build_payload("chat", p, model="m", max_tokens=5, temperature=0.0, speculative=True)
    assert chat["messages"] == [{"role": "user", "content": "def f():\n"}] and chat["model"] == "m"
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert chat["speculative"] == {"enabled": True} and "seed" not in chat and "ignore_eos" not in chat
    comp = build_payload("completions", p, model=None, max_tokens=5, temperature=0.7, seed=9, speculative=False)
    assert comp["prompt"] == "def f():\n" and "model" not in comp and comp["seed"] == 9
    assert comp["speculative"] == {"enabled": False}
    assert "speculative" not in build_payload("chat", p, model="m", max_tokens=5, temperature=0.0)


# -- virtual time ----------------------------------------------------------------------------------------
class _NoWait(selectors.SelectSelector):
    """A selector that never waits: asked to wait ``timeout`` s for I/O, it moves the loop's clock on by
    that much and reports none (everything in a virtual-time run is in process: no socket is read)."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self.loop = loop

    def select(self, timeout=None):
        if timeout is None:
            raise RuntimeError("nothing is scheduled and nothing can come in: the run would wait forever")
        self.loop.now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock moves only from one timer to the next: sleeps take no wall time, and the
    load generator's times (read from ``loop.time()``) are exactly what the script says."""

    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(_NoWait(self))

    def time(self) -> float:
        return self.now


def run_virtual(coro):
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def sse(*chunks, done: bool = True) -> list:
    events = [f"data: {json.dumps(c)}\n\n" if isinstance(c, dict) else c for c in chunks]
    return events + (["data: [DONE]\n\n"] if done else [])


def run_one(events: list, api: str = "chat", status: int = 200, exc: Exception | None = None) -> RequestRecord:
    """Send one request to a scripted transport; a float in ``events`` is a pause in seconds (of virtual
    time: see :class:`VirtualTimeLoop`)."""

    async def body():
        for e in events:
            if isinstance(e, float):
                await asyncio.sleep(e)
            else:
                yield e.encode()

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.host == "127.0.0.1"
        if exc is not None:
            raise exc
        return httpx.Response(status, content=body())

    async def go():
        async with httpx.AsyncClient(base_url="http://127.0.0.1:9", transport=httpx.MockTransport(handler)) as c:
            record = RequestRecord(index=0, prompt_index=0)
            return await send_request(c, api, {}, record, asyncio.get_running_loop().time())

    return run_virtual(go())


def chat_delta(text: str | None = None, role: str | None = None, finish: str | None = None) -> dict:
    delta = {k: v for k, v in (("role", role), ("content", text)) if v is not None}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


class _WaitsForTheCut(httpx.AsyncByteStream):
    """A response body that arrives whole and whose connection then takes until the run's cut to close,
    or (``more``) one whose rest never comes: the read waits for it until the cut."""

    def __init__(self, events: list[str], more: bool) -> None:
        self.events, self.more = events, more

    async def __aiter__(self):
        for e in self.events:
            yield e.encode()
        if self.more:
            await asyncio.Event().wait()

    async def aclose(self) -> None:
        if not self.more:
            await asyncio.Event().wait()


@pytest.mark.parametrize("whole", [True, False])
def test_a_cut_while_the_connection_closes_keeps_a_whole_stream_ok(whole):
    """A ``--duration`` cut that lands after a stream's ``[DONE]``, while its connection closes, leaves
    a completed request: ok, with its latencies. One cut mid-stream is cancelled and has no end time."""
    events = sse(chat_delta("a"), chat_delta("b"), done=whole)

    async def go():
        stream = _WaitsForTheCut(events, more=not whole)
        transport = httpx.MockTransport(lambda request: httpx.Response(200, stream=stream))
        async with httpx.AsyncClient(base_url="http://127.0.0.1:9", transport=transport) as c:
            record = RequestRecord(index=0, prompt_index=0)
            task = asyncio.create_task(send_request(c, "chat", {}, record, asyncio.get_running_loop().time()))
            for _ in range(1000):  # until the body is in and the request waits (closing, or reading on)
                await asyncio.sleep(0)
            assert not task.done() and record.num_chunks == 2
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return record

    r = asyncio.run(go())
    assert r.ttft_s is not None and r.text == "ab"
    if whole:
        assert r.status == "ok" and r.e2e_s is not None and r.completion_tokens == 2
    else:
        assert r.status == "cancelled" and r.e2e_s is None


def test_stream_timing_and_usage():
    usage = {"prompt_tokens": 4, "completion_tokens": 3, "speculative": {"mean_acceptance_length": 1.5}}
    events = [
        f"data: {json.dumps(chat_delta('', role='assistant'))}\n\n",  # not a token: TTFT starts later
        0.06,
        ": a comment line\n\n",
        *sse(chat_delta("a"), done=False),
        0.1,
        *sse(chat_delta("bc"), chat_delta(finish="length"), {"choices": [], "usage": usage}),
    ]
    r = run_one(events)
    assert r.status == "ok" and r.text == "abc" and r.num_chunks == 2 and r.finish_reason == "length"
    assert r.ttft_s == pytest.approx(0.06, abs=1e-9) and r.e2e_s == pytest.approx(0.16, abs=1e-9)
    assert r.itl_s == [pytest.approx(0.1, abs=1e-9)]
    assert r.completion_tokens == 3 and r.tokens_from_usage and r.prompt_tokens == 4
    assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / 2)
    assert r.speculative == {"mean_acceptance_length": 1.5}


def test_stream_without_usage_counts_chunks():
    r = run_one(
        sse({"choices": [{"text": "x"}]}, {"choices": [{"text": ""}]}, {"choices": [{"text": "yz"}]}), "completions"
    )
    assert r.status == "ok" and r.text == "xyz" and r.completion_tokens == 2 and not r.tokens_from_usage


@pytest.mark.parametrize(
    "events, status, exc, kind",
    [
        (['{"error": {"message": "slow down"}}'], 429, None, "http_429"),
        (sse(chat_delta("a"), {"error": {"message": "engine died"}}), 200, None, "stream_error"),
        (sse(chat_delta("a"), done=False), 200, None, "stream_error"),
        (["data: {not json\n\n"], 200, None, "stream_error"),
        ([], 200, httpx.ConnectError("refused"), "connection"),
        ([], 200, httpx.ReadTimeout("slow"), "timeout"),
    ],
)
def test_errors_by_kind(events, status, exc, kind):
    r = run_one(events, status=status, exc=exc)
    assert r.status == "error" and r.error == kind and r.error_message
    if kind == "http_429":
        assert r.error_message == "slow down"


def test_summarize():
    s = summarize([float(x) for x in range(1, 101)])
    assert s["count"] == 100 and s["mean"] == 50.5 and s["p50"] == 50.5
    assert s["p90"] == pytest.approx(90.1) and s["p99"] == pytest.approx(99.01)
    assert summarize([]) == {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "min": None, "max": None}


def test_acceptance_length_from_metrics():
    def counters(acc, drafts):
        return (
            "# TYPE augur_spec_decode_num_accepted_tokens_total counter\n"
            f'augur_spec_decode_num_accepted_tokens_total{{model_name="m"}} {acc}\n'
            f'augur_spec_decode_num_drafts_total{{model_name="m",pos="a"}} {drafts / 2}\n'
            f'augur_spec_decode_num_drafts_total{{model_name="m",pos="b"}} {drafts / 2}\n'
            'augur_generation_tokens_total{model_name="m"} 5.0\n'
        )

    assert server_acceptance_length(counters(10, 5), counters(40, 15)) == (4.0, "counters")
    gauge = 'augur_spec_decode_mean_acceptance_length{model_name="m"} 2.5\n'
    assert server_acceptance_length(counters(10, 5), counters(40, 15) + gauge) == (2.5, "gauge")
    nan_gauge = 'augur_spec_decode_mean_acceptance_length{model_name="m"} NaN\n'  # no drafts yet
    assert server_acceptance_length(counters(10, 5), counters(40, 15) + nan_gauge) == (4.0, "counters")
    assert server_acceptance_length(None, counters(40, 15)) == (None, None)
    assert server_acceptance_length("", 'augur_generation_tokens_total{model_name="m"} 5.0\n') == (None, None)
    assert server_acceptance_length(counters(10, 5), counters(10, 5)) == (None, None)  # no drafts in the run
    assert server_acceptance_length(None, None) == (None, None)


def test_goodput_counts_requests_within_both_slos():
    def rec(i, ttft, e2e, tokens, status="ok"):
        return RequestRecord(i, 0, status=status, ttft_s=ttft, e2e_s=e2e, completion_tokens=tokens, num_chunks=tokens)

    records = [rec(0, 0.05, 0.45, 5), rec(1, 0.3, 0.7, 5), rec(2, 0.05, 2.05, 5), rec(3, 0.01, 0.01, 1)]
    records.append(rec(4, None, None, 0, status="error"))
    cfg = LoadTestConfig(url="http://127.0.0.1:1", num_requests=5, concurrency=1, slo_ttft=0.1, slo_tpot=0.2)
    result = RunResult(None, None, "m", "now", 2.0, records, None, None)
    report = build_report(result, cfg)
    # 0: ttft 0.05, tpot 0.1 -> good; 1: ttft too slow; 2: tpot 0.5 too slow; 3: one token, no tpot -> good.
    assert report["goodput"]["num_good"] == 2 and report["goodput"]["requests_per_s"] == 1.0
    assert report["goodput"]["fraction_of_completed"] == 0.5
    assert report["num_failed"] == 1 and report["request_throughput"] == 2.0
    assert report["mean_acceptance_length"] == {
        "server_metrics": None,
        "server_metrics_source": None,
        "usage": None,
        "usage_responses": 0,
    }


@pytest.mark.parametrize(
    "argv",
    [
        ["--concurrency", "2", "--rate", "1"],
        [],
        ["--rate", "0"],
        ["--concurrency", "0"],
        ["--concurrency", "1", "--max-tokens", "0"],
    ],
)
def test_cli_rejects_bad_arguments(argv):
    with pytest.raises(SystemExit) as e:
        main(["--url", "http://127.0.0.1:1", "--num-requests", "1", *argv])
    assert e.value.code == 2


def test_cli_rejects_missing_prompt_file(tmp_path, capsys):
    code = main(["--url", "http://127.0.0.1:1", "--concurrency", "1", "--num-requests", "1"] + ["--prompts", "nope"])
    assert code == 2 and "neither a shipped set" in capsys.readouterr().err
