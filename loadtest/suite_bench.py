"""``augur bench --suite``: tokens/s and acceptance per task category, for Augur and any peer.

Every server is driven by the same client (``loadtest.runner``: streaming, a closed loop at each
concurrency, ``ignore_eos`` so every server emits exactly ``--max-tokens`` tokens per request), one
category at a time, each prompt of the category once per run. The servers, in command-line order:

* none given: start ``augur serve`` with the engine flags given to ``augur bench`` on a free loopback
  port, measure it, and stop it whatever happens. Each category runs twice on that server: with its
  default speculation, then with ``"speculative": {"enabled": false}`` (plain decoding), so the
  speculative/plain ratio comes from one server in one run;
* ``--url [NAME=]URL``: a running OpenAI-compatible server (Augur, vLLM, llama.cpp, ...);
* ``--server NAME=COMMAND`` or a ``loadtest.peers`` preset: started on a free port, measured, and
  stopped before the next one starts (servers sharing a few cores would measure each other).

With ``--url``/``--server``, ``--plain-baseline`` adds the plain run per category, which needs Augur's
``speculative`` request field (a plain run in which the server's draft counters still move is flagged).
Only servers whose ``GET /v1/models`` names Augur as the owner get it: another server ignores the
field, and its "plain" run would repeat its default one.

Ratios divide tok/s by the baseline row's at the same category and concurrency: the first server's plain
run where there is one (so above 1 means speculation helps), else the first server's run.

Mean acceptance length (tokens per target forward; plain decoding is 1) comes from the responses'
``usage.speculative`` (Augur) or else from the Prometheus counters scraped around the run, under
Augur's or vLLM's names. A category a server cannot do (an HTTP error, no chat template, a prompt over
its context) is reported as failed with the server's message, and the rest still runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from loadtest.client import RequestRecord, build_payload, send_request
from loadtest.config import LoadTestConfig
from loadtest.peers import (
    free_port,
    log_tail,
    machine,
    parse_preset,
    parse_server,
    run_async,
    stop,
    stop_all,
    wait_ready,
)
from loadtest.prompts import Prompt, load_prompts
from loadtest.report import build_report, counter_acceptance_length, usage_acceptance_length
from loadtest.runner import RunResult, make_client, run_load
from loadtest.suite import by_category

WARMUP_PROMPT = Prompt(text="def main():\n")  # in no category, so warm-up never primes a measured prompt
MODES = {"default": None, "plain": False}  # the "speculative.enabled" sent; None: the server's default


@dataclass
class Server:
    name: str
    url: str | None = None  # set on start for a server this tool starts
    command: str | None = None  # a shell command with a {port} placeholder, when this tool starts it
    status: str = "pending"  # "ok" | "failed" | "skipped"
    reason: str | None = None
    model: str | None = None
    startup_s: float | None = None
    log: str | None = None
    keyed: bool = False  # started by the bench with its run keys (see run_key): each run its own stores
    rows: list[dict] = field(default_factory=list)


# -- command line ----------------------------------------------------------------------------------------
def parse_url(text: str) -> Server:
    """``NAME=URL`` or a bare ``URL`` (then named by its host:port)."""
    name, sep, url = text.partition("=")
    if not sep or "://" in name:
        name, url = "", text
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--url: expected [NAME=]URL such as augur=http://127.0.0.1:8000, got {text!r}")
    return Server(name.strip() or parts.netloc, url=url)


def parse_command(text: str) -> Server:
    """``NAME=COMMAND`` (a shell command serving on ``{port}``) or a ``loadtest.peers`` preset name
    (vllm-draft, llamacpp-plain, augur-ngram, ...); a peer that is not installed is skipped."""
    try:
        spec = parse_server(text) if "=" in text else parse_preset(text)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"--server: {e}") from None
    return Server(spec.name, command=spec.command, status="skipped" if spec.skip else "pending", reason=spec.skip)


def load_suite(args: argparse.Namespace) -> dict[str, list[Prompt]]:
    """The categories to run and their prompts (the first ``--num-prompts`` of each)."""
    groups = by_category(load_prompts(args.suite))
    if args.categories:
        unknown = [c for c in args.categories if c not in groups]
        if unknown:
            raise ValueError(f"--categories: {', '.join(unknown)} not in the suite ({', '.join(groups)})")
        groups = {c: groups[c] for c in args.categories}
    if args.num_prompts is not None:
        if args.num_prompts < 1:
            raise ValueError("--num-prompts must be at least 1")
        groups = {c: ps[: args.num_prompts] for c, ps in groups.items()}
    return groups


def category_api(prompts: list[Prompt], api: str) -> str:
    """``auto``: chat for a category of conversations, completions for one of plain prompts."""
    if api != "auto":
        return api
    return "chat" if any(p.messages is not None for p in prompts) else "completions"


# -- measuring one server -----------------------------------------------------------------------------------
def make_row(server: str, mode: str, category: str, run: RunResult, report: dict) -> dict:
    """One table row: a server in one mode, on one category at one concurrency."""
    usage, _ = usage_acceptance_length(run.records)
    counters, counter_source = counter_acceptance_length(run.metrics_before, run.metrics_after)
    acceptance, source = (usage, "usage") if usage is not None else (counters, counter_source)
    completed = report["num_completed"]
    row = {
        "server": server,
        "mode": mode,
        "label": server if mode == "default" else f"{server} {mode}",
        "category": category,
        "api": report["api"],
        "concurrency": report["concurrency"],
        "status": "ok" if completed else "failed",
        "error": "; ".join(f"{kind}: {msg}" for kind, msg in report["error_examples"].items()) or None,
        "output_tok_s": report["output_throughput"] if completed else None,
        "ratio": None,
        "ttft_p50_s": report["ttft_s"]["p50"],
        "tpot_p50_s": report["tpot_s"]["p50"],
        "mean_acceptance_length": acceptance,
        "acceptance_source": source if acceptance is not None else None,
        "acceptance": {"usage": usage, "counters": counters, "counters_source": counter_source},
        "completed": completed,
        "total": report["num_requests"],
        "output_tokens": report["total_output_tokens"],
        "duration_s": report["duration_s"],
        "latency_s": {k: report[k] for k in ("ttft_s", "tpot_s", "itl_s", "e2e_s")},
        "note": None,
    }
    if mode == "plain" and counters is not None:
        row["note"] = "the server kept drafting: it ignores Augur's speculative.enabled=false"
    return row


async def measure(server: Server, args: argparse.Namespace, suite: dict[str, list[Prompt]], modes: list[str]) -> None:
    """Every category at every concurrency in every mode, against one running server."""
    await measure_rounds([server], args, suite, {server.name: modes}, rounds=1)


async def measure_rounds(
    servers: list[Server], args: argparse.Namespace, suite: dict[str, list[Prompt]], modes: dict[str, list[str]],
    rounds: int,
) -> None:  # fmt: skip
    """``rounds`` rounds against running servers: in each, every category, and in it every concurrency,
    is run by every server in each of its ``modes`` back to back (every other round in reverse order),
    so the runs a ratio compares are seconds apart. A server the bench started with its run keys
    (``Server.keyed``) gets each run under its own API key (:func:`run_key`), so no run drafts from
    another run's answers to the same prompts (suffix decoding's store is per key)."""
    clients: dict[str, httpx.AsyncClient] = {}

    def client_for(server: Server, key: str) -> httpx.AsyncClient:
        client = clients[server.name]
        if server.keyed:
            client.headers["Authorization"] = f"Bearer {key}"
        return client

    async with contextlib.AsyncExitStack() as stack:
        for server in servers:
            base = LoadTestConfig(
                url=server.url,
                num_requests=1,
                concurrency=max(args.concurrency),
                max_tokens=args.max_tokens,
                api_key=args.api_key,
                request_timeout=args.request_timeout,
            )
            client = clients[server.name] = await stack.enter_async_context(make_client(base))
            client_for(server, run_key(0, 0, "warmup"))
            try:
                resp = await client.get("/v1/models")
            except httpx.TransportError as e:
                server.status, server.reason = "failed", f"cannot reach {server.url}: {type(e).__name__}: {e}"
                del clients[server.name]
                continue
            server.model = server.model or _listed_model(resp)
            if "plain" in modes[server.name] and not _is_augur(resp):
                modes = {**modes, server.name: [m for m in modes[server.name] if m != "plain"]}
                print(f"bench: {server.name} is not an Augur server: no plain run (it ignores "
                      "speculative.enabled)", file=sys.stderr)  # fmt: skip
            apis = {category_api(ps, args.api) for ps in suite.values()}
            for _ in range(args.warmup):
                for api in sorted(apis):
                    payload = build_payload(
                        api, WARMUP_PROMPT, model=server.model, max_tokens=args.max_tokens, temperature=0.0,
                        ignore_eos=True,
                    )  # fmt: skip
                    await send_request(client, api, payload, RequestRecord(-1, -1), 0.0)
        live = [s for s in servers if s.name in clients]

        for rnd in range(1, rounds + 1):
            order = live if rnd % 2 else live[::-1]
            for category, prompts in suite.items():
                for server in order:
                    await prime(client_for(server, run_key(rnd, 0, "prime")), server, args, prompts)
                for c in args.concurrency:
                    for server in order:
                        for mode in modes[server.name] if rnd % 2 else modes[server.name][::-1]:
                            client = client_for(server, run_key(rnd, c, mode))
                            row = await measure_one(client, server, args, category, prompts, c, mode)
                            row["round"] = rnd
                            server.rows.append(row)
        for server in live:
            server.status = "ok"


def run_key(rnd: int, concurrency: int, mode: str) -> str:
    """The API key of one run (a round's runs at one concurrency in one mode; ``prime``: a round's
    unrecorded priming requests, ``warmup`` the warm-up's) against a server the bench started with them."""
    return f"augur-bench-r{rnd}-c{concurrency}-{mode}"


def run_keys(args: argparse.Namespace, modes: list[str]) -> list[str]:
    """Every key :func:`measure_rounds` may send (what a server the bench starts accepts)."""
    rounds = range(1, args.rounds + 1)
    return (
        [run_key(0, 0, "warmup")]
        + [run_key(r, 0, "prime") for r in rounds]
        + [run_key(r, c, m) for r in rounds for c in args.concurrency for m in modes]
    )


def _model_cards(resp: httpx.Response) -> list:
    """The ``data`` list of a GET /v1/models answer (empty for an error or a body without one)."""
    if resp.status_code != 200:
        return []
    try:
        data = resp.json().get("data") or []
    except (ValueError, AttributeError):
        return []
    return data if isinstance(data, list) else []


def _is_augur(resp: httpx.Response) -> bool:
    """Whether a GET /v1/models answer is Augur's (its models' ``owned_by``): the servers that read the
    ``speculative`` request field, so the ones a plain run (``--plain-baseline``) means something on."""
    return any(isinstance(card, dict) and card.get("owned_by") == "augur" for card in _model_cards(resp))


def _listed_model(resp: httpx.Response) -> str | None:
    """The first id of a GET /v1/models answer; None (the field is then left out) when there is none."""
    first = next(iter(_model_cards(resp)), None)
    return str(first["id"]) if isinstance(first, dict) and first.get("id") else None


async def prime(client: httpx.AsyncClient, server: Server, args: argparse.Namespace, prompts: list[Prompt]) -> None:
    """Send each prompt once for one token, unrecorded, so that every measured run finds its prompts in
    the server's prefix cache alike: otherwise the second run of a prompt (the plain one, or the next
    concurrency) would prefill less than the first, and the order of the runs would decide the ratio."""
    config = LoadTestConfig(
        url=server.url,
        num_requests=len(prompts),
        concurrency=max(args.concurrency),
        api=category_api(prompts, args.api),
        max_tokens=1,
        model=server.model,
        api_key=args.api_key,
        progress=False,
        request_timeout=args.request_timeout,
    )
    await run_load(config, prompts, server.model, client=client)


async def measure_one(
    client: httpx.AsyncClient,
    server: Server,
    args: argparse.Namespace,
    category: str,
    prompts: list[Prompt],
    concurrency: int,
    mode: str,
) -> dict:
    """One category at one concurrency in one mode: each prompt once, closed loop."""
    config = LoadTestConfig(
        url=server.url,
        num_requests=len(prompts),
        concurrency=concurrency,
        api=category_api(prompts, args.api),
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        model=server.model,
        api_key=args.api_key,
        ignore_eos=True,
        seed=args.seed,
        progress=not args.no_progress,
        request_timeout=args.request_timeout,
    )
    label = f"{server.name}{'' if mode == 'default' else ' ' + mode} {category} c={concurrency}"
    started_at = time.time()
    run = await run_load(config, prompts, server.model, speculative=MODES[mode], label=label, client=client)
    row = {**make_row(server.name, mode, category, run, build_report(run, config)), "started_at": started_at}
    if row["status"] != "ok":
        print(f"bench: {label} failed: {row['error']}", file=sys.stderr)
    return row


def augur_command(args: argparse.Namespace, engine_flags: list[str]) -> str:
    """``augur serve`` with the bench's engine flags on ``{port}``, through this interpreter (the same
    install)."""
    argv = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--log-level", args.log_level]
    return f"{shlex.join([*argv, *engine_flags])} --port {{port}}"


def launch(server: Server, args: argparse.Namespace, log_dir: Path, keys: list[str] | None = None) -> subprocess.Popen:
    """Start the server's command on a free port (its own process group; ``keys``: the API keys an Augur
    accepts, as ``AUGUR_API_KEY``) and wait until it answers; the server is marked failed, with its
    log's last lines, if it does not."""
    env = {**os.environ, "AUGUR_API_KEY": ",".join(keys)} if keys else None
    server.keyed = bool(keys)
    port = free_port()
    server.url = f"http://127.0.0.1:{port}"
    log_path = log_dir / f"{server.name}.log"
    server.log = str(log_path)
    command = server.command.replace("{port}", str(port))
    print(f"bench: starting {server.name}: {command} (log: {log_path})", file=sys.stderr)
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command, shell=True, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    try:
        key = keys[0] if keys else args.api_key
        server.model = run_async(wait_ready(server.url, proc, args.startup_timeout, server.model, key))
        server.startup_s = time.monotonic() - started
    except RuntimeError as e:
        _failed(server, e)
    return proc


def _failed(server: Server, error: Exception) -> None:
    tail = log_tail(server.log) if server.log else ""
    server.status, server.reason = "failed", f"{error}; its last lines:\n{tail}"
    print(f"bench: {server.name} failed: {server.reason}", file=sys.stderr)


def start_and_measure(
    server: Server, args: argparse.Namespace, suite: dict[str, list[Prompt]], modes: list[str], log_dir: Path
) -> None:
    """Start the server's command, measure it, and stop its whole process group whatever happens
    (before the next server starts: two would share the cores)."""
    proc = launch(server, args, log_dir, run_keys(args, modes) if args.api_key is None else None)
    try:
        if server.status != "failed":
            run_async(measure(server, args, suite, modes))
    except RuntimeError as e:
        _failed(server, e)
    finally:
        stop(proc)


def measure_resident(
    given: list[Server],
    args: argparse.Namespace,
    suite: dict[str, list[Prompt]],
    modes: list[str],
    log_dir: Path | None,
) -> None:
    """``--rounds`` above 1: start every server once (one at a time: one compiling beside another would
    slow its start), keep them all up, and run the rounds (:func:`measure_rounds`): one server under load
    at a time, the others idle. Servers this starts accept every run's key (:func:`run_keys`), unless
    ``--api-key`` is given. Every started server is stopped whatever happens."""
    keys = run_keys(args, modes) if args.api_key is None else None
    procs: list[subprocess.Popen] = []
    try:
        for server in given:
            if server.command and server.status != "skipped":
                procs.append(launch(server, args, log_dir, keys))
        live = [s for s in given if s.status not in ("skipped", "failed")]
        run_async(measure_rounds(live, args, suite, {s.name: modes for s in live}, args.rounds))
    finally:
        stop_all(procs)


# -- the report ----------------------------------------------------------------------------------------
def add_ratios(servers: list[Server]) -> str | None:
    """tok/s over the baseline row's at the same category and concurrency in the same round; returns
    the baseline label."""
    first = next((s for s in servers if s.rows), None)
    if first is None:
        return None
    modes = {r["mode"] for r in first.rows}
    baseline = first.name + (" plain" if "plain" in modes else "")
    base = {
        (r.get("round", 1), r["category"], r["concurrency"]): r["output_tok_s"]
        for r in first.rows
        if r["label"] == baseline
    }
    for s in servers:
        for r in s.rows:
            b = base.get((r.get("round", 1), r["category"], r["concurrency"]))
            r["ratio"] = r["output_tok_s"] / b if b and r["output_tok_s"] is not None else None
    return baseline


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def across_rounds(rows: list[dict]) -> list[dict]:
    """One row per server, mode, category and concurrency: the medians over its rounds (the ratio is the
    median of each round's own ratio), ``ratio_range`` the rounds' lowest and highest ratio, and the
    requests of every round counted together. Rows of a single round come back as they are."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["label"], r["category"], r["concurrency"]), []).append(r)
    if all(len(g) == 1 for g in groups.values()):
        return rows
    out = []
    for group in groups.values():
        ratios = [r["ratio"] for r in group if r["ratio"] is not None]
        row = {**group[0], "rounds": len(group), "ratio_range": [min(ratios), max(ratios)] if ratios else None}
        for key in ("output_tok_s", "ratio", "ttft_p50_s", "tpot_p50_s", "mean_acceptance_length"):
            row[key] = _median([r[key] for r in group])
        row["completed"], row["total"] = sum(r["completed"] for r in group), sum(r["total"] for r in group)
        failed = [r for r in group if r["status"] != "ok"]
        row["status"] = "ok" if row["output_tok_s"] is not None else "failed"
        row["error"] = "; ".join(f"round {r['round']}: {r['error']}" for r in failed if r["error"]) or None
        row["note"] = next((r["note"] for r in group if r["note"]), None)
        out.append(row)
    return out


def _f(x: float | None, fmt: str, scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, fmt)


def _geomean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def markdown(servers: list[Server], baseline: str | None, info: dict) -> str:
    m, load = info["machine"], info["load"]
    rows = across_rounds([r for s in servers for r in s.rows])
    rounds = load.get("rounds", 1)
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['platform']}); {info['date']}. Suite `{load['suite']}`: "
        f"{load['max_tokens']} tokens per request (ignore_eos), temperature {load['temperature']}, each prompt "
        f"once per run, closed loop. Ratio: tok/s over `{baseline or '-'}` in the same category and concurrency.",
    ]
    if load.get("run_keys"):
        lines[0] += (
            " Each run (a server's round at one concurrency in one mode) of a server the bench started went "
            "under its own API key: its own drafting stores, so no run drafts from another's answers to the "
            "same prompts."
        )
    if rounds > 1:
        lines[0] += (
            f" {rounds} rounds, servers resident, one under load at a time, every other round in reverse "
            "order: medians over the rounds; a ratio is the median of each round's own ratio, its range the "
            "rounds' lowest and highest."
        )
    spread = rounds > 1
    for category in info["categories"]:
        mine = [r for r in rows if r["category"] == category]
        if not mine:
            continue
        lines += [
            "",
            f"### {category} ({info['categories'][category]} prompts, {mine[0]['api']} API)",
            "",
            "| server | concurrency | tok/s | ratio |"
            + (" ratio range |" if spread else "")
            + " TTFT p50 (ms) | TPOT p50 (ms) | accept. len | ok |",
            "| --- | ---: | ---: | ---: |" + (" ---: |" if spread else "") + " ---: | ---: | ---: | ---: |",
        ]
        for r in sorted(mine, key=lambda r: r["concurrency"]):
            span = r.get("ratio_range")
            spread_cell = (f"{span[0]:.2f}-{span[1]:.2f} | " if span else "- | ") if spread else ""
            lines.append(
                f"| {r['label']} | {r['concurrency']} | {_f(r['output_tok_s'], '.1f')} | {_f(r['ratio'], '.2f')} | "
                + spread_cell
                + f"{_f(r['ttft_p50_s'], '.0f', 1e3)} | {_f(r['tpot_p50_s'], '.1f', 1e3)} | "
                f"{_f(r['mean_acceptance_length'], '.2f')} | {r['completed']}/{r['total']} |"
            )
    labels = list(dict.fromkeys((r["label"], r["concurrency"]) for r in rows))
    if baseline and labels:
        cats = [c for c in info["categories"] if any(r["category"] == c for r in rows)]
        ratio = {(r["label"], r["concurrency"], r["category"]): r["ratio"] for r in rows}
        lines += [
            "",
            f"### Summary: tok/s ratio over `{baseline}`",
            "",
            f"| server | concurrency | {' | '.join(cats)} | geometric mean |",
            "| --- | ---: |" + " ---: |" * (len(cats) + 1),
        ]
        for label, c in labels:
            values = [ratio.get((label, c, cat)) for cat in cats]
            cells = " | ".join(_f(v, ".2f") for v in values)
            lines.append(f"| {label} | {c} | {cells} | {_f(_geomean(values), '.2f')} |")
    notes = [f"- {s.name}: {s.status}: {s.reason}" for s in servers if s.status in ("failed", "skipped")]
    for r in rows:
        if r["status"] != "ok" or r["error"]:
            notes.append(f"- {r['label']} / {r['category']} c={r['concurrency']}: {r['status']}: {r['error']}")
        if r["note"]:
            notes.append(f"- {r['label']} / {r['category']} c={r['concurrency']}: {r['note']}")
    for s in servers:
        where = f"`{s.command}`" if s.command else s.url
        notes.append(f"- {s.name}: {where}" + (f", model `{s.model}`" if s.model else ""))
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # a SIGTERM to the bench still stops the server it started


def run_suite(args: argparse.Namespace, engine_flags: list[str], ignored_flags: list[str]) -> int:
    """The whole ``augur bench --suite`` run; 0 when at least one category completed somewhere.
    ``engine_flags``: the bench's engine flags that differ from their defaults, as ``augur serve``
    arguments (``server.cli.engine_argv``), for the Augur this starts when no server is given;
    ``ignored_flags``: those that then do nothing (all but the model name and seed), to say so."""
    args.concurrency = sorted(args.concurrency or [1])
    if min(args.concurrency) < 1 or args.max_tokens < 1 or args.warmup < 0 or args.rounds < 1:
        raise ValueError("--concurrency, --max-tokens and --rounds must be at least 1, --warmup at least 0")
    given = [parse_url(text) if kind == "url" else parse_command(text) for kind, text in args.servers or []]
    names = [server.name for server in given]
    if len(set(names)) < len(names):
        raise ValueError(f"--url/--server: two servers share a name ({', '.join(names)}); name them NAME=...")
    suite = load_suite(args)
    if given:
        if ignored_flags:
            ignored = " ".join(ignored_flags)
            print(f"bench: engine flags only shape the Augur it starts; ignored: {ignored}", file=sys.stderr)
        for server in given:
            server.model = args.model  # the name to send (default: GET /v1/models)
    info = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "load": {
            "suite": args.suite,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "concurrency": args.concurrency,
            "warmup": args.warmup,
            "seed": args.seed,
            "api": args.api,
            "rounds": args.rounds,
        },
        "categories": {c: len(ps) for c, ps in suite.items()},
    }
    if given:
        modes = ["default", "plain"] if args.plain_baseline else ["default"]
    else:
        if not args.model:
            from engine.offline.demo import ensure_demo

            ensure_demo()  # built here, with its progress bar, rather than inside the server's start-up
        given, modes = [Server("augur", command=augur_command(args, engine_flags))], ["default", "plain"]
    info["load"]["run_keys"] = args.api_key is None and any(s.command for s in given)
    log_dir = Path(tempfile.mkdtemp(prefix="augur-bench-")) if any(s.command for s in given) else None
    servers: list[Server] = []
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if main_thread else None
    interrupted = False
    try:
        for server in given:
            if server.status == "skipped":
                print(f"bench: {server.name} skipped: {server.reason}", file=sys.stderr)
        if args.rounds > 1:
            servers = given
            measure_resident(given, args, suite, modes, log_dir)
        else:
            for server in given:
                servers.append(server)
                if server.status == "skipped":
                    continue
                if server.command:
                    start_and_measure(server, args, suite, modes, log_dir)
                else:
                    run_async(measure(server, args, suite, modes))
    except KeyboardInterrupt:
        interrupted = True
        print("bench: interrupted; reporting what finished", file=sys.stderr)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    baseline = add_ratios(servers)
    table = markdown(servers, baseline, info)
    print(table)
    if args.output:
        out = {**info, "baseline": baseline, "servers": [asdict(s) for s in servers]}
        if args.rounds > 1:  # each server's rows are its rounds'; these are their medians
            out["across_rounds"] = across_rounds([r for s in servers for r in s.rows])
        path = Path(args.output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1, allow_nan=False) + "\n", encoding="utf-8")
        print(f"bench: wrote {path}", file=sys.stderr)
    if args.plots:
        from loadtest.plots import write_suite_plots

        files = write_suite_plots(across_rounds([r for s in servers for r in s.rows]), args.plots)
        print(f"bench: plots {', '.join(map(str, files))}", file=sys.stderr)
    if interrupted:
        return 130
    return 0 if any(r["status"] == "ok" for s in servers for r in s.rows) else 1
