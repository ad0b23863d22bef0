"""Augur against its peers, one server at a time: ``python -m loadtest.peers --help``.

Augur's speed goals are ratios against the servers users would otherwise pick (vLLM, llama.cpp) on the
same model pair, prompts and machine. This tool starts each server in turn, waits until it answers,
drives it with the same closed-loop streaming load (``loadtest.runner``), stops its whole process group
and only then starts the next: two servers sharing a few CPU cores would measure each other.

A host whose speed drifts (a shared VM: ±25% over minutes here) blurs ratios of runs minutes apart.
``--resident`` starts every server once and keeps them up; in each round every concurrency level is
run by every server in turn, so the runs a ratio compares are back to back (seconds apart at one
request a time, not minutes). Still one server is under load at a time; the CPU seconds each idle one
spends during each run are counted, the worst named in the table, and one over ``IDLE_WARN`` of a core
called out: a server that burns CPU while idle (vLLM's polling engine loop) slows the one under load,
and is to be measured without ``--resident``. A server that dies is reported failed and left out of
later runs. The table of medians (any ``--rounds`` above 1) also gives the median
of each round's own ratio.

A server is a shell command that serves an OpenAI-compatible API on ``{port}`` (substituted as plain
text, so JSON braces in the command are safe): ``--server NAME=COMMAND``, or a built-in ``--preset``.
Peer presets call ``$AUGUR_PEERS_SCRIPTS/serve_{vllm,llamacpp}.sh MODE {port}`` (default: the
``shared/peers`` folder beside the repository); a peer whose script or install is missing is reported
as skipped, so one command works on any machine.

Every request sends ``ignore_eos`` so every server emits exactly ``--max-tokens`` tokens, and the table
reports output tok/s, TTFT and TPOT medians, tok/s relative to the baseline server at the same
concurrency, and the mean acceptance length (tokens per target forward) where the server reports one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from loadtest.config import LoadTestConfig
from loadtest.prompts import Prompt, load_prompts
from loadtest.report import build_report
from loadtest.runner import run_load

REPO = Path(__file__).resolve().parents[1]
_VENV_AUGUR = Path(sys.executable).with_name("augur")  # python -m from .venv: .venv/bin/augur
AUGUR_EXE = str(_VENV_AUGUR) if _VENV_AUGUR.exists() else "augur"
AUGUR_PRESETS = {
    "augur-default": "",
    "augur-plain": " --speculative-method none",
    "augur-eager": " --compile off",
    "augur-plain-eager": " --speculative-method none --compile off",
    "augur-ngram": " --speculative-method ngram",
    "augur-suffix": " --speculative-method suffix",
    "augur-trees": " --spec-tree-topk 2",
    "augur-bf16": " --dtype bfloat16",
    "augur-default-process": " --engine-process on",
    "augur-plain-process": " --speculative-method none --engine-process on",
    "augur-default-thread": " --engine-process off",
    "augur-plain-thread": " --speculative-method none --engine-process off",
    "augur-plain-async": " --speculative-method none --async-scheduling on",
    "augur-plain-ordinary": " --speculative-method none --async-scheduling off",
    "augur-default-ordinary": " --async-scheduling off",
    "augur-default-async": " --async-scheduling on",
}
PEER_PRESETS = {f"{peer}-{mode}": (peer, mode) for peer in ("vllm", "llamacpp") for mode in ("draft", "plain", "ngram")}
PRESETS = [*AUGUR_PRESETS, *PEER_PRESETS]
DESCRIPTION = "Start each server in turn (never two at once), drive it with the same streaming load, stop it, and \
tabulate tok/s, TTFT, TPOT and acceptance length. Servers run in command-line order; the baseline is the first. \
With --rounds N the list runs N times, every other time in reverse (a host whose speed drifts, or a server that pays \
for starting first, then weighs on every server alike), each round's ratios against its own baseline run, and a \
second table gives each server's median over the rounds. With --resident every server starts once and stays up \
(idle between its runs, the idle ones' CPU counted), so rounds are seconds apart rather than minutes."
IDLE_WARN = 0.10  # --resident: an idle server using more of a core than this beside a run is called out
PEER_FILES = {  # what setup_<peer>.sh leaves under $PEERS
    "vllm": ["vllm/venv/bin/python"],
    "llamacpp": [
        f"llamacpp/{f}" for f in ("build/bin/llama-server", *(f"models/demo-{m}-f32.gguf" for m in ("target", "draft")))
    ],
}


@dataclass
class ServerSpec:
    name: str
    command: str  # a shell command with a {port} placeholder
    skip: str | None = None  # why it cannot run on this machine; None: run it


@dataclass
class ServerResult:
    name: str
    command: str
    status: str = "pending"  # "ok" | "skipped" | "failed"
    reason: str | None = None
    model: str | None = None
    startup_s: float | None = None
    runs: list[dict] = field(default_factory=list)  # one summary per concurrency
    round: int = 1  # with --rounds: which pass over the servers measured it


# -- which servers ---------------------------------------------------------------------------------------
def peer_spec(name: str) -> ServerSpec:
    """A peer preset; skipped (not failed) when its serve script or install is absent."""
    peer, mode = PEER_PRESETS[name]
    scripts = Path(os.environ.get("AUGUR_PEERS_SCRIPTS") or REPO.parent / "shared" / "peers").expanduser()
    script = scripts / f"serve_{peer}.sh"
    command = f"{shlex.quote(str(script))} {mode} {{port}}"
    home = Path(os.environ.get("PEERS") or Path.home() / ".cache" / "augur-peers").expanduser()
    if not os.access(script, os.X_OK):
        return ServerSpec(name, command, f"no executable {script} (set AUGUR_PEERS_SCRIPTS)")
    missing = [str(home / n) for n in PEER_FILES[peer] if not (home / n).exists()]
    if missing:
        return ServerSpec(name, command, f"not installed: {missing[0]} missing (run {scripts}/setup_{peer}.sh)")
    return ServerSpec(name, command)


def parse_server(text: str) -> ServerSpec:
    name, sep, command = text.partition("=")
    if not sep or not name.strip() or "{port}" not in command:
        raise argparse.ArgumentTypeError(f"expected NAME=COMMAND with a {{port}} placeholder, got {text!r}")
    return ServerSpec(name.strip(), command.strip())


def parse_preset(name: str) -> ServerSpec:
    if name in AUGUR_PRESETS:
        # --compile-wait: ready means compiled, so no run measures the server while it compiles beside it.
        return ServerSpec(name, f"{shlex.quote(AUGUR_EXE)} serve --compile-wait --port {{port}}{AUGUR_PRESETS[name]}")
    if name in PEER_PRESETS:
        return peer_spec(name)
    raise argparse.ArgumentTypeError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")


def demo_dir() -> Path:
    """Asked of ``augur demo path`` rather than imported: keeps torch out of the load generator."""
    out = subprocess.run([AUGUR_EXE, "demo", "path"], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip().splitlines()[-1])


def machine() -> dict:
    """What the numbers were measured on: they mean little without it."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu, "cores": cores, "platform": platform.platform(), "python": platform.python_version()}


# -- one server's life ----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs (Linux ``/proc``). Zombies do not count: reparented
    ones wait for an init that may never reap them, and they hold no cores."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # exited meanwhile
        if int(pgrp) == pgid and state != "Z":
            return True
    return False


def group_cpu_seconds(pgid: int) -> float:
    """User and system CPU seconds the live processes of a group have spent (Linux ``/proc``)."""
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
        if int(fields[2]) == pgid:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def stop_all(procs: list[subprocess.Popen]) -> None:
    """:func:`stop` several servers: every group is sent SIGTERM first, so they all shut down at once."""
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for proc in procs:
        stop(proc)


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the whole process group (vLLM forks engine workers), SIGKILL what outlives the grace
    period, and return only once the group is gone, so the next server has the cores to itself."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader
            if not group_alive(proc.pid):
                return
            time.sleep(0.2)
    print(f"peers: process group {proc.pid} survived SIGKILL", file=sys.stderr)


async def wait_ready(
    url: str, proc: subprocess.Popen, timeout_s: float, model: str | None, api_key: str | None = None
) -> str | None:
    """Poll until ``/v1/models`` lists a model and a one-token completion succeeds (some servers list
    their model while still loading it); returns ``model`` or else the listed id. Raises if the server
    exits or is late. ``api_key``: sent as the bearer token."""
    deadline = time.monotonic() + timeout_s
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with httpx.AsyncClient(base_url=url, timeout=120.0, headers=headers) as client:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"exited with status {proc.returncode} before answering")
            if time.monotonic() > deadline:
                raise RuntimeError(f"did not answer within {timeout_s:.0f} s")
            try:
                models = (await client.get("/v1/models")).json().get("data") or []
                name = model or (models[0]["id"] if models else None)
                body = {"prompt": "def", "max_tokens": 1, "temperature": 0.0, **({"model": name} if name else {})}
                if (await client.post("/v1/completions", json=body)).status_code == 200:
                    return name
            except (httpx.HTTPError, OSError, ValueError, KeyError, TypeError, AttributeError):
                pass
            await asyncio.sleep(1.0)


def summarize_run(report: dict) -> dict:
    mal = report["mean_acceptance_length"]
    return {
        "concurrency": report["concurrency"],
        "output_tok_s": report["output_throughput"],
        "ttft_p50_s": report["ttft_s"]["p50"],
        "tpot_p50_s": report["tpot_s"]["p50"],
        "mean_acceptance_length": mal["usage"] if mal["usage"] is not None else mal["server_metrics"],
        "completed": report["num_completed"],
        "failed": report["num_failed"],
        "errors": report["error_examples"],
        "output_tokens": report["total_output_tokens"],
        "duration_s": report["duration_s"],
    }


@dataclass
class Live:
    """A started server: its process (group leader), base URL and log."""

    spec: ServerSpec
    proc: subprocess.Popen
    url: str
    log_path: Path


def start(spec: ServerSpec, log_dir: Path) -> Live:
    port = free_port()
    log_path = log_dir / f"{spec.name}.log"
    print(f"peers: starting {spec.name} on port {port} (log: {log_path})", file=sys.stderr)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            spec.command.replace("{port}", str(port)),
            shell=True,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Live(spec, proc, f"http://127.0.0.1:{port}", log_path)


async def ready(live: Live, args: argparse.Namespace, result: ServerResult) -> bool:
    """Wait for a started server to answer; False (the result marked failed) when it does not."""
    started = time.monotonic()
    try:
        result.model = await wait_ready(live.url, live.proc, args.startup_timeout, args.model)
    except RuntimeError as e:
        fail(result, e, live)
        return False
    result.startup_s = time.monotonic() - started
    return True


def log_tail(path: Path, lines: int = 15) -> str:
    """A server log's last ``lines`` lines, what a failure report shows."""
    return "\n".join(Path(path).read_text(errors="replace").strip().splitlines()[-lines:])


def fail(result: ServerResult, error: Exception, live: Live) -> None:
    result.status, result.reason = "failed", f"{error} (log: {live.log_path})"
    tail = log_tail(live.log_path)
    print(f"peers: {result.name} failed: {result.reason}; its last lines:\n{tail}", file=sys.stderr)


async def drive(
    live: Live, args: argparse.Namespace, prompts: list[Prompt], result: ServerResult, levels: list[int], idle=()
) -> None:
    """Run the load at each concurrency of ``levels`` against a ready server; ``idle``: the other
    resident servers, whose CPU seconds over each run (warm-up included) go into it as ``others_cpu_s``,
    and that window's length as ``others_window_s``."""
    try:
        for c in levels:
            config = LoadTestConfig(
                url=live.url,
                num_requests=args.num_prompts,
                concurrency=c,
                api="completions",
                prompts=args.prompts,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                model=result.model,
                ignore_eos=True,
                warmup=args.warmup,
                progress=not args.no_progress,
                seed=args.seed,
            )
            before = {o.spec.name: group_cpu_seconds(o.proc.pid) for o in idle}
            t0, started_at = time.monotonic(), time.time()
            run = await run_load(config, prompts, result.model, label=f"{result.name} c={c}")
            summary = {**summarize_run(build_report(run, config)), "started_at": started_at}
            if not summary["completed"]:  # no measurement: a server that died or answers nothing but errors
                raise RuntimeError(f"no request completed at concurrency {c}: {str(summary['errors'])[:200]}")
            if idle:  # (a process that exits meanwhile takes its seconds with it: never below 0)
                each = {o.spec.name: max(group_cpu_seconds(o.proc.pid) - before[o.spec.name], 0.0) for o in idle}
                summary["idle_cpu_s"], summary["others_cpu_s"] = each, sum(each.values())
                summary["others_window_s"] = time.monotonic() - t0
                for name, spent in each.items():
                    if spent > IDLE_WARN * summary["others_window_s"]:
                        print(f"peers: {name} used {100 * spent / summary['others_window_s']:.0f}% of a core while "
                              f"idle beside {result.name}'s run: it slows the server under load; measure it "
                              "without --resident", file=sys.stderr)  # fmt: skip
            result.runs.append(summary)
        result.status = "ok"
    except RuntimeError as e:
        fail(result, e, live)


async def measure(spec: ServerSpec, args: argparse.Namespace, prompts: list[Prompt], log_dir: Path) -> ServerResult:
    """Start one server, wait for it, run the load at each concurrency, and stop it whatever happens."""
    result = ServerResult(spec.name, spec.command)
    if spec.skip:
        result.status, result.reason = "skipped", spec.skip
        return result
    live = start(spec, log_dir)
    try:
        if await ready(live, args, result):
            await drive(live, args, prompts, result, args.concurrency)
    finally:
        stop(live.proc)
    return result


def measure_resident(specs: list[ServerSpec], args, prompts: list[Prompt], log_dir: Path, results: list) -> None:
    """``--resident``: start every server once, then ``args.rounds`` rounds; in a round each concurrency
    level is run by every server in turn (every other round in reverse order), one under load at a time,
    the others idle. A server that dies is reported failed and left out of later runs. Every server is
    stopped whatever happens; ``results`` gets each result as it is made (an interrupted run reports
    what finished)."""
    lives: list[tuple[Live, ServerResult]] = []  # each server and what its start found
    try:
        for spec in specs:  # one at a time: a server compiling beside another would slow its start
            first = ServerResult(spec.name, spec.command)
            if spec.skip:
                first.status, first.reason = "skipped", spec.skip
                results.append(first)
                continue
            lives.append((start(spec, log_dir), first))  # in the list before waiting: stopped however that ends
            if not run_async(ready(lives[-1][0], args, first)):
                stop(lives.pop()[0].proc)
                results.append(first)
        gone: set[str] = set()
        for rnd in range(1, args.rounds + 1):
            order = lives if rnd % 2 else lives[::-1]
            made: dict[str, ServerResult] = {}
            for c in args.concurrency:  # a level's runs back to back, server after server
                for live, first in order:
                    name = first.name
                    if name in gone:
                        continue
                    if name not in made:
                        made[name] = ServerResult(
                            name, first.command, model=first.model, startup_s=first.startup_s, round=rnd
                        )
                        results.append(made[name])
                    if live.proc.poll() is not None:
                        fail(made[name], RuntimeError(f"exited with status {live.proc.returncode}"), live)
                    else:
                        others = [other for other, o in lives if other is not live and o.name not in gone]
                        run_async(drive(live, args, prompts, made[name], [c], others))
                    if made[name].status == "failed":
                        gone.add(name)
    finally:
        stop_all([live.proc for live, _ in lives])


# -- the table -----------------------------------------------------------------------------------------
def _f(x: float | None, fmt: str, scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, fmt)


def add_ratios(results: list[ServerResult], baseline: str | None) -> str | None:
    """tok/s divided by the baseline server's tok/s at the same concurrency in the same round (above 1:
    faster). The baseline is ``baseline``, or the first server that ran in round 1."""
    first = next((r for r in results if r.status == "ok"), None)
    baseline = baseline or (first.name if first else None)
    found = None
    for rnd in sorted({r.round for r in results}):
        ok = [r for r in results if r.status == "ok" and r.round == rnd]
        base = next((r for r in ok if r.name == baseline), None)
        found = found or (base.name if base else None)
        by_c = {run["concurrency"]: run["output_tok_s"] for run in base.runs} if base else {}
        for r in ok:
            for run in r.runs:
                b = by_c.get(run["concurrency"])
                run["ratio"] = run["output_tok_s"] / b if b else None
    return found


def medians(results: list[ServerResult], baseline: str | None) -> list[dict]:
    """Per server and concurrency, in first-round order: every round's tok/s, their median, that median
    over the baseline's, and the median of the rounds' own ratios (each against its round's baseline run)."""
    table: dict[tuple[str, int], list[float]] = {}
    paired: dict[tuple[str, int], list[float]] = {}  # each round's ratio against that round's baseline run
    for r in results:
        for run in r.runs if r.status == "ok" else ():
            table.setdefault((r.name, run["concurrency"]), []).append(run["output_tok_s"])
            if run.get("ratio") is not None:
                paired.setdefault((r.name, run["concurrency"]), []).append(run["ratio"])
    mid = {key: statistics.median(v) for key, v in table.items()}
    return [
        {
            "server": name,
            "concurrency": c,
            "tok_s": v,
            "median_tok_s": mid[name, c],
            "ratio": mid[name, c] / mid[baseline, c] if (baseline, c) in mid else None,
            "round_ratios": paired.get((name, c), []),
            "median_round_ratio": statistics.median(paired[name, c]) if (name, c) in paired else None,
        }
        for (name, c), v in table.items()
    ]


def markdown(results: list[ServerResult], baseline: str | None, info: dict) -> str:
    m, load = info["machine"], info["load"]
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['platform']}). Load: {load['num_prompts']} prompts from "
        f"`{load['prompts']}`, {load['max_tokens']} tokens each (ignore_eos), temperature {load['temperature']}, "
        f"closed loop after {load['warmup']} warm-up request(s); {info['date']}.",
        "",
        f"| server | concurrency | tok/s | vs {baseline or '-'} | TTFT p50 (ms) | TPOT p50 (ms) | accept. len | ok |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    rounds = max((r.round for r in results), default=1)
    for r in results:
        label = r.name if rounds == 1 else f"{r.name} (round {r.round})"
        for run in r.runs:
            lines.append(
                f"| {label} | {run['concurrency']} | {run['output_tok_s']:.1f} | {_f(run.get('ratio'), '.2f')} | "
                f"{_f(run['ttft_p50_s'], '.0f', 1e3)} | {_f(run['tpot_p50_s'], '.1f', 1e3)} | "
                f"{_f(run['mean_acceptance_length'], '.2f')} | {run['completed']}/{run['completed'] + run['failed']} |"
            )
    if rounds > 1:
        lines += [
            "",
            f"Over {rounds} rounds (every other one in reverse order"
            f"{'; servers resident, one under load at a time' if info.get('resident') else ''}):",
            "",
            f"| server | concurrency | tok/s, round by round | median | vs {baseline or '-'} | "
            "median of the rounds' ratios |",
            "| --- | ---: | --- | ---: | ---: | ---: |",
        ]
        for m in medians(results, baseline):
            each = ", ".join(f"{x:.1f}" for x in m["tok_s"])
            lines.append(
                f"| {m['server']} | {m['concurrency']} | {each} | {m['median_tok_s']:.1f} | {_f(m['ratio'], '.2f')} | "
                f"{_f(m['median_round_ratio'], '.2f')} |"
            )
    idle = [
        (spent, run["others_window_s"], name)
        for r in results
        for run in r.runs
        for name, spent in run.get("idle_cpu_s", {}).items()
    ]
    if idle:
        cpu, dur, name = max(idle, key=lambda x: x[0] / max(x[1], 1e-9))
        share = cpu / max(dur, 1e-9)
        verdict = ": **it slowed the server under load; measure it without --resident**." if share > IDLE_WARN else "."
        lines += [
            "",
            f"While one server ran, an idle resident one used at most {100 * share:.1f}% of a core ({name}: {cpu:.2f} "
            f"CPU-seconds over a run's {dur:.1f} s, warm-up included; every run's figures are in --output-json)"
            + verdict,
        ]
    lines.append("")
    for r in results:
        if r.round == 1 or r.status != "ok":
            note = f" ({r.status}: {r.reason})" if r.status != "ok" and r.reason else ""
            lines.append(f"- {r.name}{'' if rounds == 1 else f' (round {r.round})'}: `{r.command}`{note}")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.peers", description=DESCRIPTION)
    many = {"dest": "servers", "action": "append"}  # one list, so servers run in command-line order
    p.add_argument(
        "--server", **many, type=parse_server, metavar="NAME=COMMAND", help="a shell command serving on {port}"
    )
    p.add_argument(
        "--preset",
        **many,
        type=parse_preset,
        metavar="NAME",
        help=f"{', '.join(PRESETS)} (default: all, in this order)",
    )
    p.add_argument("--baseline", help="ratios are tok/s over this server's (default: the first that ran)")
    p.add_argument("--prompts", help="a .jsonl prompt file (default: the demo pair's held-out prompts.jsonl)")
    p.add_argument("--num-prompts", type=int, default=16, help="requests per concurrency level")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=2, help="unrecorded requests before each measured run")
    p.add_argument("--model", help="model name sent to every server (default: each server's GET /v1/models)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for a server to answer")
    p.add_argument("--log-dir", help="server logs (default: a new temporary folder)")
    p.add_argument("--output-md", help="write the markdown table here")
    p.add_argument("--output-json", help="write every number here")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--rounds", type=int, default=1, help="run the servers this many times, every other in reverse")
    p.add_argument(
        "--resident",
        action="store_true",
        help="start every server once and keep them up, alternating the load between them (one at a time, "
        "the others idle, their CPU seconds counted): rounds seconds apart rather than minutes",
    )
    return p


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # so a SIGTERM to this tool still stops the server it started


def run_async(coro):
    """``asyncio.run(coro)``, where a SIGTERM cancels the work at its next ``await`` (as asyncio's own
    Ctrl-C handling does) and then comes out as ``KeyboardInterrupt``.

    A ``KeyboardInterrupt`` raised straight from a signal handler lands wherever the interpreter happens
    to be: inside httpx's connect (an anyio task group) it comes out wrapped in an exception group that
    ``except KeyboardInterrupt`` does not catch, and the tool dies with its servers' table unprinted. A
    cancellation is something every awaited library unwinds from cleanly. Outside the main thread (no
    signals there) this is ``asyncio.run``."""
    if threading.current_thread() is not threading.main_thread():
        return asyncio.run(coro)
    termed = False

    async def guarded():
        nonlocal termed
        loop, task = asyncio.get_running_loop(), asyncio.current_task()

        def on_term(signum, frame) -> None:
            nonlocal termed
            termed = True
            loop.call_soon_threadsafe(task.cancel)

        previous = signal.signal(signal.SIGTERM, on_term)
        try:
            return await coro
        finally:
            signal.signal(signal.SIGTERM, previous)

    try:
        return asyncio.run(guarded())
    except asyncio.CancelledError:
        if termed:
            raise KeyboardInterrupt from None
        raise


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if min(args.num_prompts, args.max_tokens, args.rounds, *args.concurrency) < 1 or args.warmup < 0:
        parser.error("--num-prompts, --max-tokens, --rounds and --concurrency must be at least 1, --warmup at least 0")
    signal.signal(signal.SIGTERM, _interrupt)
    specs: list[ServerSpec] = args.servers or [parse_preset(n) for n in PRESETS]
    try:
        args.prompts = args.prompts or str(demo_dir() / "prompts.jsonl")
        prompts = load_prompts(args.prompts)[: args.num_prompts]
    except (ValueError, OSError, subprocess.CalledProcessError) as e:
        parser.error(f"--prompts: {e}")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="augur-peers-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    load = {
        k: getattr(args, k)
        for k in ("prompts", "num_prompts", "max_tokens", "concurrency", "temperature", "warmup", "seed")
    }
    info = {"machine": machine(), "load": load, "date": time.strftime("%Y-%m-%d %H:%M %Z"), "resident": args.resident}
    results = []
    try:
        if args.resident:
            measure_resident(specs, args, prompts, log_dir, results)
        else:
            for rnd in range(1, args.rounds + 1):
                round_dir = log_dir if args.rounds == 1 else log_dir / f"round{rnd}"
                round_dir.mkdir(parents=True, exist_ok=True)
                for spec in specs if rnd % 2 else specs[::-1]:
                    results.append(run_async(measure(spec, args, prompts, round_dir)))
                    results[-1].round = rnd
    except KeyboardInterrupt:
        print("peers: interrupted; reporting what finished", file=sys.stderr)
    baseline = add_ratios(results, args.baseline)
    if args.baseline and baseline is None:
        print(f"peers: baseline {args.baseline!r} did not run; no ratios", file=sys.stderr)
    table = markdown(results, baseline, info)
    print(table)
    if args.output_md:
        Path(args.output_md).write_text(table, encoding="utf-8")
    if args.output_json:
        out = {**info, "baseline": baseline, "servers": [asdict(r) for r in results]}
        if args.rounds > 1:
            out["medians"] = medians(results, baseline)
        Path(args.output_json).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    return 0 if any(r.status == "ok" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
