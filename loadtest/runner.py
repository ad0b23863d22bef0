"""Drive the load: a closed loop at fixed concurrency or an open loop of Poisson arrivals.

Closed loop: ``concurrency`` workers each send a request, wait for it to finish, and send the next,
so the server sets the pace. Open loop: requests are sent at exponentially distributed intervals
(mean ``1/rate``) whether or not earlier ones have finished, so a slow server builds a queue, as
real traffic would. Both stop issuing at ``num_requests``; ``duration`` is a hard cap on the whole
run, after which requests still in flight are cancelled (and recorded as "cancelled"). Every time is
the running event loop's (``loop.time()``), the clock that its sleeps and timeouts keep.
"""

from __future__ import annotations

import asyncio
import random
import sys
from dataclasses import dataclass
from datetime import datetime, timezone

import httpx
from tqdm import tqdm

from loadtest.client import RequestRecord, build_payload, send_request
from loadtest.config import LoadTestConfig
from loadtest.prompts import Prompt


@dataclass
class RunResult:
    label: str | None
    speculative: bool | None  # the "speculative.enabled" sent with every request; None: field not sent
    model: str | None
    started_at: str  # ISO 8601, UTC
    duration_s: float
    records: list[RequestRecord]
    metrics_before: str | None  # the server's /metrics text, None when it could not be read
    metrics_after: str | None


def make_client(config: LoadTestConfig, transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    # Open loop: never queue inside the client, or its pool would hide the server's queueing.
    limits = httpx.Limits(max_connections=config.concurrency, max_keepalive_connections=config.concurrency)
    timeout = httpx.Timeout(config.request_timeout, connect=min(config.request_timeout, 30.0))
    return httpx.AsyncClient(
        base_url=config.base_url, headers=headers, timeout=timeout, limits=limits, transport=transport
    )


async def resolve_model(client: httpx.AsyncClient) -> str | None:
    """The first model id from GET /v1/models, or None (with a warning) when it cannot be read."""
    try:
        resp = await client.get("/v1/models")
        if resp.status_code == 200:
            data = resp.json().get("data") or []
            if data and isinstance(data[0], dict) and data[0].get("id"):
                return str(data[0]["id"])
        reason = f"HTTP {resp.status_code}"
    except (httpx.HTTPError, OSError, ValueError, AttributeError) as e:
        reason = f"{type(e).__name__}: {e}"
    print(f"loadtest: could not read the model name from GET /v1/models ({reason}); sending none", file=sys.stderr)
    return None


async def scrape_metrics(client: httpx.AsyncClient) -> str | None:
    try:
        resp = await client.get("/metrics", timeout=10.0)
    except (httpx.HTTPError, OSError):
        return None
    return resp.text if resp.status_code == 200 else None


def _now() -> float:
    return asyncio.get_running_loop().time()


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - _now())


async def _cancel(tasks) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def run_load(
    config: LoadTestConfig,
    prompts: list[Prompt],
    model: str | None,
    *,
    speculative: bool | None = None,
    label: str | None = None,
    client: httpx.AsyncClient | None = None,
) -> RunResult:
    """Run one load against the server and return every request's record."""
    own_client = client is None
    client = client or make_client(config)
    try:
        return await _run(config, prompts, model, speculative, label, client)
    finally:
        if own_client:
            await client.aclose()


async def _run(config, prompts, model, speculative, label, client) -> RunResult:
    order = list(range(len(prompts)))
    random.Random(config.seed).shuffle(order)
    arrivals = random.Random(config.seed + 1)

    def payload(i: int, prompt_index: int) -> dict:
        return build_payload(
            config.api,
            prompts[prompt_index],
            model=model,
            max_tokens=config.max_tokens,
            temperature=config.temperature,
            # A seed per request keeps sampled outputs comparable across runs (and with/without speculation).
            seed=config.seed + i if config.temperature > 0 else None,
            ignore_eos=config.ignore_eos,
            speculative=speculative,
        )

    for w in range(config.warmup):
        await send_request(client, config.api, payload(w, order[w % len(order)]), RequestRecord(-1, -1), 0.0)

    metrics_before = await scrape_metrics(client)
    records: list[RequestRecord] = []
    bar = tqdm(
        total=config.num_requests,
        desc=f"loadtest{f' [{label}]' if label else ''}",
        unit="req",
        file=sys.stderr,
        disable=not config.progress,
        dynamic_ncols=True,
    )
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    run_start = _now()
    deadline = run_start + config.duration if config.duration is not None else None

    async def one(i: int) -> None:
        now = _now()
        if deadline is not None and now >= deadline:
            return  # a late-scheduled arrival: nothing is sent after the deadline
        prompt_index = order[i % len(order)]
        record = RequestRecord(index=i, prompt_index=prompt_index)
        records.append(record)
        # Sent "now": the time the deadline was checked against, so a start never reads past it.
        await send_request(client, config.api, payload(i, prompt_index), record, run_start, sent=now)
        bar.update(1)

    try:
        if config.concurrency is not None:
            await _closed_loop(config, one, deadline)
        else:
            await _open_loop(config, one, deadline, arrivals, run_start)
    finally:
        duration = _now() - run_start
        bar.close()
    metrics_after = await scrape_metrics(client)
    records.sort(key=lambda r: r.index)
    return RunResult(
        label=label,
        speculative=speculative,
        model=model,
        started_at=started_at,
        duration_s=duration,
        records=records,
        metrics_before=metrics_before,
        metrics_after=metrics_after,
    )


async def _closed_loop(config: LoadTestConfig, one, deadline: float | None) -> None:
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < config.num_requests and (deadline is None or _now() < deadline):
            i, next_index = next_index, next_index + 1
            await one(i)

    workers = [asyncio.create_task(worker()) for _ in range(min(config.concurrency, config.num_requests))]
    done, pending = await asyncio.wait(workers, timeout=_remaining(deadline))
    await _cancel(pending)
    for task in done:
        task.result()  # a bug in the load generator surfaces here rather than vanishing


async def _open_loop(config: LoadTestConfig, one, deadline: float | None, rng: random.Random, run_start) -> None:
    in_flight: set[asyncio.Task] = set()

    async def arrivals() -> None:
        at = run_start
        for i in range(config.num_requests):
            if i:
                at += rng.expovariate(config.rate)
            if deadline is not None and at >= deadline:
                return
            delay = at - _now()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(i))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)

    generator = asyncio.create_task(arrivals())
    try:
        done, pending = await asyncio.wait({generator}, timeout=_remaining(deadline))
        await _cancel(pending)
        for task in done:
            task.result()
        while in_flight:
            remaining = _remaining(deadline)
            if remaining == 0.0:
                break
            await asyncio.wait(set(in_flight), timeout=remaining)
    finally:
        await _cancel(list(in_flight))
