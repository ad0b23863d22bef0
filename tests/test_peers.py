"""``python -m loadtest.peers`` end to end: it starts a real Augur server (the tiny demo pair) as a
subprocess, measures it at two concurrencies, stops it, and reports a peer whose scripts are missing as
skipped rather than failing."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from loadtest.peers import AUGUR_EXE
from servers import processes_mentioning

REPO = Path(__file__).resolve().parents[1]


def run_peers(tiny_demo: Path, tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """``python -m loadtest.peers`` over the tiny pair's Augur server and a vLLM preset whose scripts are
    missing; returns the finished process and its markdown and JSON outputs."""
    target = tiny_demo / "target"
    serve = (
        f"{shlex.quote(AUGUR_EXE)} serve --port {{port}} --model {shlex.quote(str(target))} "
        f"--draft-model {shlex.quote(str(tiny_demo / 'draft'))} --served-model-name tiny --device cpu "
        "--dtype float32 --num-kv-blocks 256 --block-size 4 --max-model-len 256"
    )
    md, js = tmp_path / "peers.md", tmp_path / "peers.json"
    cmd = [
        sys.executable, "-m", "loadtest.peers", "--server", f"tiny={serve}", "--preset", "vllm-plain",
        "--prompts", str(tiny_demo / "prompts.jsonl"), "--num-prompts", "4", "--max-tokens", "8",
        "--concurrency", "1", "2", "--warmup", "1", "--startup-timeout", "60", "--no-progress",
        "--log-dir", str(tmp_path / "logs"), "--output-md", str(md), "--output-json", str(js), *extra,
    ]  # fmt: skip
    env = {**os.environ, "AUGUR_PEERS_SCRIPTS": str(tmp_path / "no-such-scripts")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, md, js


def test_peers_measures_one_server_at_a_time_and_skips_missing_peers(tiny_demo, tmp_path):
    target = tiny_demo / "target"
    proc, md, js = run_peers(tiny_demo, tmp_path)

    report = json.loads(js.read_text())
    assert report["machine"]["cores"] >= 1 and report["machine"]["cpu"]
    assert report["baseline"] == "tiny"
    tiny, vllm = report["servers"]
    assert tiny["name"] == "tiny" and tiny["status"] == "ok" and tiny["model"] == "tiny"
    assert [run["concurrency"] for run in tiny["runs"]] == [1, 2]
    for run in tiny["runs"]:
        assert run["output_tok_s"] > 0 and run["completed"] == 4 and run["failed"] == 0
        assert run["output_tokens"] == 4 * 8  # ignore_eos: every request ran to max_tokens
        assert run["ttft_p50_s"] > 0 and run["tpot_p50_s"] > 0
        assert run["mean_acceptance_length"] >= 1.0  # Augur reports it; peers would show '-'
    assert tiny["runs"][0]["ratio"] == 1.0
    assert vllm["name"] == "vllm-plain" and vllm["status"] == "skipped" and vllm["runs"] == []
    assert "no-such-scripts" in vllm["reason"]

    table = md.read_text()
    assert table in proc.stdout
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| tiny ")]
    assert [int(r[1]) for r in rows] == [1, 2] and all(float(r[2]) > 0 for r in rows)
    assert "vllm-plain" in table and "skipped" in table

    # The server is gone: neither its process group nor any process serving the tiny pair is left.
    logs = list((tmp_path / "logs").glob("tiny.log"))
    assert logs and "serving" in logs[0].read_text()
    assert processes_mentioning(str(target)) == []


def test_rounds_reverse_the_order_and_report_medians(tiny_demo, tmp_path):
    """``--rounds 2``: the list runs twice, the second time in reverse; each round's ratios are against
    its own baseline run, and the medians over the rounds are tabulated."""
    proc, md, js = run_peers(tiny_demo, tmp_path, "--rounds", "2", "--concurrency", "1")
    report = json.loads(js.read_text())
    order = [(s["round"], s["name"]) for s in report["servers"]]
    assert order == [(1, "tiny"), (1, "vllm-plain"), (2, "vllm-plain"), (2, "tiny")]
    tiny = [s for s in report["servers"] if s["name"] == "tiny"]
    assert all(s["status"] == "ok" and s["runs"][0]["ratio"] == 1.0 for s in tiny)
    [median] = report["medians"]  # the skipped peer has none
    runs = [s["runs"][0]["output_tok_s"] for s in tiny]
    assert median["server"] == "tiny" and median["tok_s"] == runs and median["ratio"] == 1.0
    assert min(runs) <= median["median_tok_s"] <= max(runs)
    table = md.read_text()
    assert "| tiny (round 1) | 1 |" in table and "| tiny (round 2) | 1 |" in table
    assert "Over 2 rounds" in table
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["round1", "round2"]


def test_resident_servers_start_once_and_take_the_load_in_turn(tiny_demo, tmp_path):
    """``--resident --rounds 2``: both servers start once (one log each, one "starting" line each) and
    stay up; in each round every level is run by both in turn (the second round in reverse), each run
    counting the CPU seconds the idle one spent meanwhile; every process is gone at the end."""
    target = tiny_demo / "target"
    plain = (
        f"{shlex.quote(AUGUR_EXE)} serve --port {{port}} --model {shlex.quote(str(target))} "
        "--speculative-method none --served-model-name tiny --device cpu --dtype float32 --num-kv-blocks 256 "
        "--block-size 4 --max-model-len 256"
    )
    proc, md, js = run_peers(
        tiny_demo, tmp_path, "--server", f"plain={plain}", "--resident", "--rounds", "2", "--concurrency", "1", "2"
    )
    report = json.loads(js.read_text())
    order = [(s["round"], s["name"], s["status"]) for s in report["servers"]]
    assert order == [(1, "vllm-plain", "skipped"), (1, "tiny", "ok"), (1, "plain", "ok"), (2, "plain", "ok"),
                     (2, "tiny", "ok")]  # fmt: skip
    assert proc.stderr.count("peers: starting tiny ") == 1 and proc.stderr.count("peers: starting plain ") == 1
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["plain.log", "tiny.log"]
    for server in report["servers"][1:]:
        assert [run["concurrency"] for run in server["runs"]] == [1, 2]
        for run in server["runs"]:
            assert run["completed"] == 4 and run["output_tokens"] == 4 * 8 and server["startup_s"] > 0
            other = "plain" if server["name"] == "tiny" else "tiny"
            assert list(run["idle_cpu_s"]) == [other] and run["others_cpu_s"] == run["idle_cpu_s"][other]
            assert 0 <= run["others_cpu_s"] < run["others_window_s"]  # the other server idled beside the load
            assert run["others_window_s"] >= run["duration_s"]  # the window holds the measured run (and warm-up)
    # Each level is run by both servers back to back before the next level starts.
    starts = sorted((run["started_at"], s["round"], s["name"], run["concurrency"]) for s in report["servers"]
                    for run in s["runs"])  # fmt: skip
    assert [x[1:] for x in starts] == [(1, "tiny", 1), (1, "plain", 1), (1, "tiny", 2), (1, "plain", 2),
                                       (2, "plain", 1), (2, "tiny", 1), (2, "plain", 2), (2, "tiny", 2)]  # fmt: skip
    medians = {(m["server"], m["concurrency"]): m for m in report["medians"]}
    for c in (1, 2):
        assert medians["tiny", c]["median_round_ratio"] == 1.0 and len(medians["plain", c]["round_ratios"]) == 2
        ratios = medians["plain", c]["round_ratios"]
        assert min(ratios) <= medians["plain", c]["median_round_ratio"] <= max(ratios)
    table = md.read_text()
    assert "servers resident, one under load at a time" in table and "an idle resident one used at most" in table
    assert processes_mentioning(str(target)) == []


def test_resident_servers_are_stopped_when_interrupted_while_one_starts(tmp_path):
    """SIGTERM while a resident server is still starting: the tool reports and exits, and the server it
    was waiting for is gone with it."""
    import signal
    import time

    marker = f"sleep {os.getpid() % 1000 + 1000}.5"  # a command line no other process has
    cmd = [
        sys.executable, "-m", "loadtest.peers", "--server", f"slow=exec {marker} # {{port}}", "--resident",
        "--prompts", str(REPO / "engine" / "assets" / "demo" / "prompts.jsonl"), "--num-prompts", "1",
        "--startup-timeout", "120", "--no-progress", "--log-dir", str(tmp_path / "logs"),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def server() -> list[str]:  # the sleep itself (the tool's own command line mentions it too)
        return [c for c in processes_mentioning(marker) if c.startswith("sleep")]

    deadline = time.monotonic() + 60
    while not server() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server(), "the server never started"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=90)
    assert "interrupted" in err
    assert processes_mentioning(marker) == []


SIGTERM_IN_A_TASK_GROUP = """
import os, signal, sys
import anyio
from loadtest.peers import _interrupt
{runner}

signal.signal(signal.SIGTERM, _interrupt)
unwound = []


async def child():
    os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, inside this task's step
    await anyio.sleep(30)


async def work():
    try:
        async with anyio.create_task_group() as tg:  # what httpx's connect runs its attempts in
            tg.start_soon(child)
            tg.start_soon(anyio.sleep, 30)
    finally:
        unwound.append(True)


try:
    runner(work())
except KeyboardInterrupt:
    print("interrupted", unwound)
"""


def test_a_sigterm_inside_a_task_group_cancels_the_work_and_comes_out_as_an_interrupt():
    """A SIGTERM that lands while a task of an anyio task group runs (httpx's connect, mid-start-up in
    CI) cancels the work, which unwinds, and surfaces as KeyboardInterrupt with nothing on stderr;
    ``asyncio.run`` with the handler raising there instead leaves an exception group behind."""
    runners = {
        "run_async": "from loadtest.peers import run_async as runner",
        "asyncio": "from asyncio import run as runner",
    }
    ran = {
        name: subprocess.run([sys.executable, "-c", SIGTERM_IN_A_TASK_GROUP.format(runner=line)],
                             capture_output=True, text=True, timeout=60, cwd=REPO)
        for name, line in runners.items()
    }  # fmt: skip
    ok = ran["run_async"]
    assert ok.returncode == 0 and ok.stdout.strip() == "interrupted [True]" and ok.stderr == "", ok.stderr
    assert "TaskGroup" in ran["asyncio"].stderr  # the failure this guards against, still there without it
