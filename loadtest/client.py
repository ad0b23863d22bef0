"""One streaming request and what it measured.

Terms, per request (all times in seconds, from the moment the request is sent):

* **TTFT** (time to first token): until the first chunk with non-empty content (a chat stream's
  opening ``{"role": "assistant", "content": ""}`` chunk does not count).
* **ITL** (inter-token latency): the gaps between consecutive content chunks. A chunk can carry
  several tokens (speculative decoding emits all accepted tokens of a step at once), so an ITL is a
  gap between deliveries, not strictly between tokens.
* **TPOT** (time per output token): ``(e2e - ttft) / (completion_tokens - 1)``, defined when at
  least two tokens came back.
* **E2E**: until ``data: [DONE]``.

``completion_tokens`` comes from the stream's usage chunk (requested with
``stream_options.include_usage``); servers that send none fall back to counting content chunks.

Times are read from the running event loop's clock (``loop.time()``, monotonic), the clock its
timers keep: a test's virtual-time loop makes every measured time exact.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import httpx

from loadtest.prompts import Prompt

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass
class RequestRecord:
    index: int
    prompt_index: int
    start_s: float = 0.0  # when it was sent, seconds after the run started
    status: str = "pending"  # "ok" | "error" | "cancelled" (cut off by --duration)
    error: str | None = None  # "http_<status>" | "timeout" | "connection" | "stream_error"
    error_message: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # [num_chunks - 1]
    num_chunks: int = 0  # chunks with non-empty content
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    tokens_from_usage: bool = False
    finish_reason: str | None = None
    speculative: dict | None = None  # the response's usage.speculative, when the server sends one
    text: str = ""

    @property
    def tpot_s(self) -> float | None:
        if self.status != "ok" or self.ttft_s is None or self.e2e_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)

    def fail(self, kind: str, message: str) -> None:
        self.status, self.error, self.error_message = "error", kind, message[:500]

    def to_json(self) -> dict:
        return {
            "index": self.index,
            "prompt_index": self.prompt_index,
            "start_s": self.start_s,
            "status": self.status,
            "error": self.error,
            "error_message": self.error_message,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "e2e_s": self.e2e_s,
            "itl_s": self.itl_s,
            "num_chunks": self.num_chunks,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens": self.prompt_tokens,
            "tokens_from_usage": self.tokens_from_usage,
            "finish_reason": self.finish_reason,
            "speculative": self.speculative,
            "text": self.text,
        }


def build_payload(
    api: str,
    prompt: Prompt,
    *,
    model: str | None,
    max_tokens: int,
    temperature: float,
    seed: int | None = None,
    ignore_eos: bool = False,
    speculative: bool | None = None,
) -> dict:
    """The JSON body of one streaming request. ``speculative`` None leaves the server's default."""
    body: dict = {}
    if model is not None:
        body["model"] = model
    if api == "chat":
        body["messages"] = prompt.as_messages()
    else:
        body["prompt"] = prompt.as_text()
    body.update(
        max_tokens=max_tokens,
        temperature=temperature,
        stream=True,
        stream_options={"include_usage": True},
    )
    if seed is not None:
        body["seed"] = seed
    if ignore_eos:
        body["ignore_eos"] = True
    if speculative is not None:
        body["speculative"] = {"enabled": speculative}
    return body


def sse_data(line: str) -> str | None:
    """The payload of an SSE ``data:`` line; None for blank lines, comments and other fields."""
    if not line.startswith("data:"):
        return None
    data = line[5:]
    return data[1:] if data.startswith(" ") else data


def _error_text(body: bytes) -> str:
    try:
        obj = json.loads(body)
        message = obj.get("error", {}).get("message") if isinstance(obj, dict) else None
        if isinstance(message, str):
            return message
    except (ValueError, AttributeError):
        pass
    return body.decode("utf-8", "replace")


def _content(api: str, choice: dict) -> str:
    if api == "chat":
        delta = choice.get("delta") or {}
        return delta.get("content") or ""
    return choice.get("text") or ""


async def send_request(
    client: httpx.AsyncClient,
    api: str,
    payload: dict,
    record: RequestRecord,
    run_start: float,
    sent: float | None = None,
) -> RequestRecord:
    """Send one streaming request and fill ``record`` in. Never raises, except to pass on cancellation
    (then ``record.status`` is "cancelled"). ``run_start``: the run's start on the loop's clock;
    ``sent``: when it was issued on that clock (default: now)."""
    clock = asyncio.get_running_loop().time
    sent = clock() if sent is None else sent
    record.start_s = sent - run_start
    received = False  # any byte of the response: tells a broken stream from a failed connection
    last = sent
    parts: list[str] = []
    try:
        async with client.stream("POST", ENDPOINTS[api], json=payload) as resp:
            received = True
            if resp.status_code != 200:
                record.fail(f"http_{resp.status_code}", _error_text(await resp.aread()))
                return record
            done = False
            async for line in resp.aiter_lines():
                data = sse_data(line)
                if data is None:
                    continue
                if data.strip() == "[DONE]":
                    done = True
                    break
                now = clock()
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError:
                    record.fail("stream_error", f"malformed chunk: {data[:200]}")
                    return record
                if not isinstance(chunk, dict):
                    record.fail("stream_error", f"unexpected chunk: {data[:200]}")
                    return record
                if "error" in chunk:
                    err = chunk["error"]
                    record.fail("stream_error", str(err.get("message") if isinstance(err, dict) else err))
                    return record
                for choice in chunk.get("choices") or []:
                    text = _content(api, choice)
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
                    if not text:
                        continue
                    if record.ttft_s is None:
                        record.ttft_s = now - sent
                    else:
                        record.itl_s.append(now - last)
                    last = now
                    record.num_chunks += 1
                    parts.append(text)
                usage = chunk.get("usage")
                if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                    record.completion_tokens = int(usage["completion_tokens"])
                    record.prompt_tokens = usage.get("prompt_tokens")
                    record.tokens_from_usage = True
                    spec = usage.get("speculative")
                    record.speculative = spec if isinstance(spec, dict) else None
            record.e2e_s = clock() - sent
            record.text = "".join(parts)
            if not done:
                record.fail("stream_error", "the stream ended before data: [DONE]")
                return record
        _completed(record)
    except asyncio.CancelledError:
        # A cut while the connection closes leaves a request that failed failed, and one whose whole
        # stream had arrived ([DONE]; its end timed) completed: cancelled, it would carry a full latency.
        if record.status == "pending" and record.e2e_s is not None:
            _completed(record)
        elif record.status == "pending":
            record.status = "cancelled"
            record.text = "".join(parts)
        raise
    except httpx.TimeoutException as e:
        record.fail("timeout", f"{type(e).__name__}: {e}")
    except httpx.HTTPError as e:
        record.fail("stream_error" if received else "connection", f"{type(e).__name__}: {e}")
    except OSError as e:
        record.fail("connection", f"{type(e).__name__}: {e}")
    return record


def _completed(record: RequestRecord) -> None:
    """A stream that arrived whole, to its ``[DONE]``: counted from its chunks where no usage came."""
    if not record.tokens_from_usage:
        record.completion_tokens = record.num_chunks
    record.status = "ok"
