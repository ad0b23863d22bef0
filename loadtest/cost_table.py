"""``python -m loadtest.cost_table``: where a served token's time goes, stage by stage.

Starts a server (``augur serve`` on the demo pair by default, or ``--server COMMAND`` on ``{port}``),
warms it up, then for each concurrency drives it with the load generator (closed loop, streaming,
``ignore_eos``) while py-spy samples every thread of the server's processes (wall clock, idle
included, ``--nonblocking`` so the server is never paused). Each sample's stack is put in one stage:

- the API thread (the event loop): HTTP and SSE (uvicorn, h11/httptools, starlette, FastAPI, the
  stream writers), JSON (pydantic, json), tokenizing (tokenizers, chat templates), the hand-off to
  the engine, its other host work, and idle (waiting in the selector);
- the engine thread: the queue (taking requests in, delivering outputs), scheduling, the
  controller's planning, drafting's host work and its forwards, batch metadata (flattening chunks,
  tree layouts, ``prepare``), the target forward, sampling and verification, output processing
  (detokenizing, stops), bookkeeping (commit, KV moves, the proposer's hooks), and idle (waiting for
  work).

Each stage is reported in milliseconds per generated token: its share of its thread's samples times
the run's wall time over the tokens generated. The two threads share one interpreter lock, so their
columns overlap in time rather than add. The samples' frames are matched by function and file; a
stack matching nothing is "other" in its thread, so the table always sums to the whole.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from loadtest.config import LoadTestConfig
from loadtest.peers import demo_dir, free_port, log_tail, machine, stop, wait_ready
from loadtest.prompts import load_prompts
from loadtest.runner import run_load

ENGINE_THREAD = "augur-engine"
RECEIVER_THREAD = "augur-engine-outputs"  # --engine-process on: the API process's thread taking outputs in
RECEIVER_STAGES = ["outputs in (decode, hand-off to streams, hooks)", "idle"]
# Display order; a stage missing from a run shows as 0.
API_STAGES = ["HTTP and SSE", "JSON", "tokenize", "hand-off to the engine", "other API work", "idle"]
ENGINE_STAGES = [
    "queue (requests in, outputs out)",
    "scheduling",
    "controller (planning depths)",
    "drafting: host work",
    "drafting: draft forwards",
    "batch metadata",
    "target forward",
    "tensor parallel: messages to the workers",
    "tensor parallel: collectives (all-reduce, gather)",
    "sampling and verification",
    "output processing (detokenize, stops)",
    "bookkeeping (commit, KV moves, hooks)",
    "other engine work",
    "idle",
]
FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")


def _frames(stack: str) -> list[tuple[str, str]]:
    out = []
    for part in stack.split(";"):
        m = FRAME.match(part)
        out.append((m["func"], m["file"]) if m else (part, ""))
    return out


def _has(frames, func: str | None = None, file: str | None = None) -> int:
    """The index (root = 0) of the deepest frame matching, or -1."""
    for i in range(len(frames) - 1, -1, -1):
        f, path = frames[i]
        if (func is None or f.endswith(func)) and (file is None or file in path):
            return i
    return -1


def ahead_stage(frames: list[tuple[str, str]]) -> str:
    """A run-ahead step (engine/core/ahead.py; no Step.run in it): the same stages, from its own calls."""
    if _has(frames, "Step.plan") >= 0 or _has(frames, "SpecController.observe_ahead") >= 0:
        return "controller (planning depths)"  # (a speculative engine's plan of the step launched ahead)
    if _has(frames, "ModelRunner.prepare") >= 0:
        return "batch metadata"
    if _has(frames, "ModelRunner.execute") >= 0:
        return "target forward"
    if _has(frames, "RunAhead._draw") >= 0 or _has(frames, "Ticket.tolist") >= 0:
        return "sampling and verification"  # (the read waits for the device, as an ordinary step's accept does)
    if _has(frames, file="output_processor.py") >= 0 or _has(frames, file="detokenizer.py") >= 0:
        return "output processing (detokenize, stops)"
    if _has(frames, "LLMEngine._computed_ahead") >= 0 or _has(frames, "ModelRunner.copy_blocks") >= 0:
        return "bookkeeping (commit, KV moves, hooks)"
    if _has(frames, file="core/ahead.py") >= 0:  # whether the batch is the same again, its KV slots
        return "scheduling"
    return "other engine work"


def engine_stage(frames: list[tuple[str, str]]) -> str:
    leaf = frames[-1][0] if frames else ""
    if _has(frames, "LLMEngine._step_ahead") >= 0 or _has(frames, "LLMEngine._start_ahead") >= 0:
        return ahead_stage(frames)
    if _has(frames, "Step.run") < 0:
        queue = ("_drain_commands", "_deliver", "_deliver_all", "_publish_load", "EngineCore._drain")
        queue += ("EngineCore._publish", "EngineCore._admit_compiled", "EngineCore._add")
        if any(_has(frames, f) >= 0 for f in queue):
            return "queue (requests in, outputs out)"
        if leaf.endswith(".wait") or _has(frames, "Event.wait") >= 0 or _has(frames, "Condition.wait") >= 0:
            return "idle"
        if _has(frames, "Poller.poll") >= 0:  # the engine process waiting for commands
            return "idle"
        if _has(frames, file="output_processor.py") >= 0 or _has(frames, file="detokenizer.py") >= 0:
            return "output processing (detokenize, stops)"
        return "other engine work"
    # Inside a step, under -tp: what crossing to the other ranks costs, wherever in the step it is.
    if _has(frames, "Workers.send") >= 0:
        return "tensor parallel: messages to the workers"
    if any(_has(frames, f, file="engine/parallel") >= 0 for f in ("_all_reduce", "_gather_last")):
        return "tensor parallel: collectives (all-reduce, gather)"
    # Inside a step: the innermost stage function wins.
    marks = [
        ("controller (planning depths)", _has(frames, "Step.plan")),
        ("scheduling", _has(frames, file="core/scheduler.py")),
        ("drafting: host work", _has(frames, "Step.propose")),
        ("batch metadata", max(_has(frames, "Step.build"), _has(frames, "ModelRunner.prepare"))),
        ("batch metadata", _has(frames, "ModelRunner.prepare_levels")),
        ("target forward", _has(frames, "Step.target_forward")),
        ("sampling and verification", _has(frames, "Step.accept")),
        ("bookkeeping (commit, KV moves, hooks)", max(_has(frames, "Step.commit"), _has(frames, "Step.advance"))),
        ("bookkeeping (commit, KV moves, hooks)", _has(frames, "Step.feedback")),
    ]
    stage, depth = max(marks, key=lambda m: m[1])
    if depth < 0:
        return "other engine work"
    if stage == "drafting: host work" and _has(frames, "ModelRunner.execute") > depth:
        return "drafting: draft forwards"
    if stage == "drafting: host work" and _has(frames, "ModelRunner.chain") > depth:
        return "drafting: draft forwards"
    return stage


def receiver_stage(frames: list[tuple[str, str]]) -> str:
    """The API process's receiver thread (--engine-process on): waiting, or taking a step's outputs in."""
    leaf = frames[-1][0] if frames else ""
    if leaf.endswith("poll") or _has(frames, "Poller.poll") >= 0 or _has(frames, "Socket.poll") >= 0:
        return "idle"
    return "outputs in (decode, hand-off to streams, hooks)"


def api_stage(frames: list[tuple[str, str]]) -> str:
    files = [p for _, p in frames]
    leaf_func = frames[-1][0] if frames else ""
    if any("selectors.py" in p for p in files[-3:]) or leaf_func.endswith(("select", "poll", "epoll")):
        return "idle"
    if any(k in p for p in files for k in ("tokenizers", "tokenization_utils", "chat_template", "jinja2")):
        return "tokenize"
    if any(k in p for p in files[-6:] for k in ("pydantic", "json/", "orjson", "json.py")):
        return "JSON"
    if any("async_engine.py" in p or "engine_core.py" in p for p in files):
        return "hand-off to the engine"
    if any(k in p for p in files for k in ("uvicorn", "h11", "httptools", "starlette", "fastapi", "anyio", "sse")):
        return "HTTP and SSE"
    return "other API work"


def classify_raw(text: str) -> dict[str, Counter]:
    """py-spy's raw (collapsed) output → samples per stage, per thread kind ("api", "engine", "other")."""
    out = {"api": Counter(), "engine": Counter(), "receiver": Counter(), "other": Counter()}
    for line in text.splitlines():
        line = line.strip()
        engine_process = helper_process = False
        if line.startswith("process "):  # --subprocesses: 'process PID:"COMMAND";thread (...)'
            command = line[: line.find(";thread (")]
            engine_process = "spawn_main" in command  # --engine-process on
            helper_process = "multiprocessing" in command and not engine_process  # its resource tracker
            line = line[line.find(";thread (") + 1 :]
        if not line.startswith("thread ("):
            continue
        stack, _, count = line.rpartition(" ")
        head, _, rest = stack.partition(";")
        frames = _frames(rest) if rest else []
        name = head.split(":", 1)[1].strip() if ":" in head else ""
        if helper_process:
            out["other"]["multiprocessing helper"] += int(count)
        elif name == ENGINE_THREAD or (engine_process and name == "MainThread"):
            out["engine"][engine_stage(frames)] += int(count)
        elif name == RECEIVER_THREAD:
            out["receiver"][receiver_stage(frames)] += int(count)
        elif name == "MainThread":  # uvicorn's event loop (a coroutine's samples start at its task)
            out["api"][api_stage(frames)] += int(count)
        else:
            out["other"][name or "unnamed"] += int(count)
    return out


def per_token_ms(samples: Counter, stages: list[str], recorded_s: float, load_s: float, tokens: int) -> dict:
    """Milliseconds per token of each busy stage (its samples at the rate the thread was really
    sampled at over the recording), and idle as what the load's wall time leaves (the recording
    starts before the load and ends after it: its idle samples would overcount)."""
    total = sum(samples.values())
    if not total or not tokens:
        return {s: 0.0 for s in stages}
    scale = recorded_s / total * 1000.0 / tokens
    keys = stages + sorted(k for k in samples if k not in stages)
    out = {s: samples.get(s, 0) * scale for s in keys if s != "idle"}
    out["idle"] = max(load_s * 1000.0 / tokens - sum(out.values()), 0.0)
    return {s: out[s] for s in keys}


async def _drive(url: str, model: str | None, prompts, c: int, n: int, max_tokens: int) -> tuple[int, float]:
    config = LoadTestConfig(
        url=url, num_requests=n, concurrency=c, api="completions", max_tokens=max_tokens,
        model=model, ignore_eos=True, progress=False,
    )  # fmt: skip
    t0 = time.perf_counter()
    run = await run_load(config, prompts, model, label=f"c={c}")
    seconds = time.perf_counter() - t0
    tokens = sum(r.completion_tokens or 0 for r in run.records if r.status == "ok")
    failed = [r for r in run.records if r.status != "ok"]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0].error}")
    return tokens, seconds


def profile(url: str, pid: int, model, prompts, c: int, n: int, max_tokens: int, rate: int, out: Path) -> dict:
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    cmd = [spy, "record", "--pid", str(pid), "--subprocesses", "--threads", "--idle", "--nonblocking",
           "--format", "raw", "--rate", str(rate), "-o", str(out)]  # fmt: skip
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # py-spy attaches
    try:
        tokens, seconds = asyncio.run(_drive(url, model, prompts, c, n, max_tokens))
    finally:
        proc.send_signal(signal.SIGINT)
        recorded = time.perf_counter() - started
        _, err = proc.communicate(timeout=60)
    if not out.exists():
        raise RuntimeError(f"py-spy wrote nothing: {err.decode(errors='replace')[-500:]}")
    classes = classify_raw(out.read_text())
    return {
        "concurrency": c,
        "tokens": tokens,
        "seconds": seconds,
        "ms_per_token": seconds * 1000.0 / tokens,
        "api": per_token_ms(classes["api"], API_STAGES, recorded, seconds, tokens),
        "engine": per_token_ms(classes["engine"], ENGINE_STAGES, recorded, seconds, tokens),
        "receiver": per_token_ms(classes["receiver"], RECEIVER_STAGES, recorded, seconds, tokens),
        "samples": {k: sum(v.values()) for k, v in classes.items()},
    }


def markdown(runs: list[dict], info: dict) -> str:
    cs = [r["concurrency"] for r in runs]
    head = "| thread | stage | " + " | ".join(f"c = {c} (ms/token)" for c in cs) + " |"
    lines = [
        f"Cost table: {info['command']} on {info['machine']['cpu']} ({info['machine']['cores']} cores); "
        f"{info['num_prompts']} prompts x {info['max_tokens']} tokens a concurrency, py-spy at {info['rate']} Hz.",
        "",
        head,
        "| --- | --- | " + " | ".join("---:" for _ in cs) + " |",
        "| all | wall time per token | " + " | ".join(f"{r['ms_per_token']:.3f}" for r in runs) + " |",
    ]
    threads = [("engine", ENGINE_STAGES), ("api", API_STAGES)]
    if any(r.get("samples", {}).get("receiver") for r in runs):
        threads.append(("receiver", RECEIVER_STAGES))
    for thread, stages in threads:
        keys = list(dict.fromkeys([*stages, *(k for r in runs for k in r[thread])]))
        for k in keys:
            lines.append(f"| {thread} | {k} | " + " | ".join(f"{r[thread].get(k, 0.0):.3f}" for r in runs) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.cost_table", description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", default=None, help="command serving on {port} (default: augur serve --compile-wait)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", default=None, help="a .jsonl prompt file (default: the demo pair's held-out prompts)")
    ap.add_argument("--rate", type=int, default=500, help="py-spy samples per second")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--output", default=None, help="write the table as JSON")
    args = ap.parse_args(argv)
    prompts = load_prompts(args.prompts or str(demo_dir() / "prompts.jsonl"))[: args.num_prompts]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = (args.server or f"{sys.executable} -m server.cli serve --compile-wait --port {{port}}").replace(
        "{port}", str(port)
    )
    info = {"command": command, "machine": machine(), "num_prompts": len(prompts), "max_tokens": args.max_tokens}
    info["rate"] = args.rate
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "server.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(command, shell=True, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            model = asyncio.run(wait_ready(url, proc, args.startup_timeout, None))
            asyncio.run(_drive(url, model, prompts, max(args.concurrency), len(prompts), 16))  # warm-up
            for c in args.concurrency:
                runs.append(profile(url, proc.pid, model, prompts, c, len(prompts), args.max_tokens, args.rate,
                                    Path(tmp) / f"c{c}.txt"))  # fmt: skip
        except RuntimeError as e:
            tail = log_tail(log_path)
            print(f"cost_table: {e}; the server's last lines:\n{tail}", file=sys.stderr)
            return 1
        finally:
            stop(proc)
    print(markdown(runs, info))
    if args.output:
        Path(args.output).write_text(json.dumps({**info, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
