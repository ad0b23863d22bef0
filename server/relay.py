"""One HTTP generation request, from its prepared prompts to the bytes on the wire.

A :class:`Job` is a request's engine requests (one per prompt, each with ``n`` choices) after they
were admitted to the queue. :func:`respond` runs it and relays the engine's outputs as server-sent
events in OpenAI's chunk format (``stream: true``) or as one JSON body, recording the latency
metrics as outputs pass. Completions and chat share all of it; what differs between them (the
choice shapes, echo, the role chunk, logprobs) is their :class:`Format`.

A request that fails inside the engine fails alone: a 500 (or an error event on a stream that has
begun), while every other request goes on. A client that goes away aborts its engine requests.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.core.async_engine import AsyncEngine, EngineDeadError
from engine.request.checks import InvalidRequestError
from engine.request.outputs import CompletionOutput, RequestOutput
from engine.request.sampling_params import SamplingParams
from server.common import APIError, bad_request, off_loop
from server.protocol import error_body
from server.state import API_KEY_SCOPE, ServerState


# -- before the engine: parameters, prompts, queue places ---------------------------------------------------
def sampling_params(state: ServerState, req, max_tokens, logprobs, prompt_logprobs=None) -> SamplingParams:
    """The request's sampling parameters, its missing fields from the model's defaults (a 400 if
    they are wrong)."""
    try:
        typical = state.settings.typical_acceptance
        params = req.sampling_params(max_tokens, logprobs, prompt_logprobs, typical, state.sampling_defaults)
    except ValueError as e:
        raise bad_request(str(e), getattr(e, "param", None)) from None
    if req.model in state.settings.lora_modules:  # the request's model is one of the LoRA adapters
        params.lora = req.model
    return params


def check_queue_bound(state: ServerState, num_prompts: int) -> None:
    limit = state.settings.max_queue_len
    if num_prompts > limit:  # would never fit, however long the client waited
        raise bad_request(f"{num_prompts} prompts exceed the server's queue of {limit} requests", "prompt")


async def prepare(eng: AsyncEngine, prompts: list[str | list[int]], params: SamplingParams) -> list[list[int]]:
    """Each prompt tokenized and checked against the engine's limits (off the event loop when big),
    and the request's grammar compiled (off the event loop, with a deadline), if it has one."""
    try:
        ids = await off_loop(lambda: eng.prepare(prompts, params), sum(len(p) for p in prompts))
        if params.structured is not None:
            await eng.compile_grammar(params.structured)
        return ids
    except InvalidRequestError as e:
        raise bad_request(str(e), e.param or "prompt") from None


def fit_default(params: SamplingParams, prompt_ids: list[int], max_model_len: int) -> SamplingParams:
    """``params`` with a default max_tokens (the request gave none) capped at the room the prompt
    leaves in the context, as vLLM caps it; InvalidRequestError where the request's own min_tokens
    does not fit that room."""
    room = max_model_len - len(prompt_ids)
    if params.max_tokens is None or params.max_tokens <= room or room < 1:  # (a prompt that fills it is refused)
        return params
    if params.min_tokens > room:
        raise InvalidRequestError(f"min_tokens ({params.min_tokens}) exceeds the {room} tokens the prompt leaves "
                                  f"in the context of {max_model_len}", "min_tokens")  # fmt: skip
    return replace(params, max_tokens=room)


async def prepare_capped(eng: AsyncEngine, prompts: list[str | list[int]], params: SamplingParams) -> list[list[int]]:
    """:func:`prepare` for a request whose max_tokens is a default: each prompt is checked at the
    length it will run to (:func:`fit_default`), not refused for a length nobody asked for."""
    ids = await prepare(eng, prompts, replace(params, max_tokens=1, min_tokens=0))  # each prompt fits at all

    def check() -> None:
        for p in ids:
            eng.limits.check(p, fit_default(params, p, eng.max_model_len))

    try:
        await off_loop(check, sum(len(p) for p in ids))
    except InvalidRequestError as e:
        raise bad_request(str(e), e.param or "prompt") from None
    return ids


ENDPOINTS = {"cmpl": "completions", "chatcmpl": "chat_completions", "resp": "responses"}  # by id prefix


@dataclass
class Job:
    state: ServerState
    eng: AsyncEngine
    request: Request
    id: str  # the response's id; engine request i is f"{id}-{i}"
    prompt_ids: list[list[int]]
    params: SamplingParams
    n: int  # choices per prompt: choice c of prompt i is index i * n + c
    stream: bool
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))
    continuous_usage: bool = False  # streamed: every chunk carries the usage so far (vLLM's continuous_usage_stats)
    cap_max_tokens: bool = False  # params.max_tokens is a default, capped per prompt at the room it leaves

    @property
    def model(self) -> str:
        """The model the response names: the LoRA adapter the request ran under, else the served model."""
        return self.params.lora or self.state.settings.served_model_name

    @classmethod
    def admit(cls, state: ServerState, eng: AsyncEngine, request: Request, prefix: str, prompt_ids, params, n, stream,
              include_usage) -> Job:  # fmt: skip
        """Reserve the request's queue places now (429 if full), before any await lets another in."""
        params.tenant = request.scope.get(API_KEY_SCOPE)  # drafting data is shared within one API key only
        job = cls(state, eng, request, f"{prefix}-{uuid.uuid4().hex}", prompt_ids, params, n, stream, include_usage)
        check_queue_bound(state, len(prompt_ids))
        state.metrics.api_request(ENDPOINTS.get(prefix, prefix), params.lora)
        limit = state.settings.max_queue_len
        if not eng.reserve([f"{job.id}-{i}" for i in range(len(prompt_ids))], limit):
            raise APIError(
                429,
                f"the request queue is full ({limit} requests waiting); retry shortly",
                "rate_limit_error",
                headers={"Retry-After": "1"},
            )
        return job

    def params_for(self, prompt_ids: list[int]) -> SamplingParams:
        """One prompt's engine request's parameters: the request's, its default max_tokens (when it
        gave none: ``cap_max_tokens``) capped at the context the prompt leaves."""
        return fit_default(self.params, prompt_ids, self.eng.max_model_len) if self.cap_max_tokens else self.params

    def running_usage(self, completion_tokens: int) -> dict:
        """The token counts so far, as a stream's chunks carry them with ``continuous_usage_stats``."""
        prompt_tokens = sum(len(p) for p in self.prompt_ids)
        total = prompt_tokens + completion_tokens
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total}

    def usage(self, completion_tokens: int, outputs: list[RequestOutput]) -> dict:
        prompt_tokens = sum(len(p) for p in self.prompt_ids)
        steps = sum(o.stats.num_decode_steps for o in outputs)
        drafted = sum(o.stats.num_draft_tokens for o in outputs)
        forced = sum(o.stats.num_forced_tokens for o in outputs)
        lossy = self.params.typical_acceptance is not None
        # proposer → [drafted, accepted], over the request's choices. Every proposer the server holds is
        # there, zeros where it did not draft: every usage has the same keys (langchain adds usages up
        # key by key, and refuses a key one of them lacks).
        by: dict[str, list[int]] = {name: [0, 0] for name in self.eng.limits.spec_methods}
        reasons: dict[str, int] = {}
        for o in outputs:
            for name, (d, a) in o.stats.drafted_by.items():
                tally = by.setdefault(name, [0, 0])
                tally[0], tally[1] = tally[0] + d, tally[1] + a
            for word, n in o.stats.spec_reasons.items():
                reasons[word] = reasons.get(word, 0) + n
        if self.eng.spec_method == "none" or self.params.speculative is False:
            reason = "disabled"
        else:  # the reason it was most often not drafted (none if it was drafted every step)
            reason = max(reasons, key=lambda w: (reasons[w], w)) if reasons else None
        names = sorted((n for n in by if by[n][0]), key=lambda n: -by[n][0])
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(o.stats.num_cached_prompt_tokens for o in outputs)},
            "speculative": {
                # The proposer(s) that drafted, most tokens first ("none": none did, for ``reason``).
                "method": "+".join(names) if names else ("none" if not drafted else self.eng.spec_method),
                "proposers": {n: {"draft_tokens": d, "accepted_tokens": a} for n, (d, a) in by.items()},
                "reason": None if drafted else reason,
                "draft_tokens": drafted,
                "accepted_tokens": sum(o.stats.num_accepted_tokens for o in outputs),
                "verify_steps": steps,
                # Tokens per target forward; a grammar's forced tokens had none and are not counted.
                "mean_acceptance_length": (completion_tokens - forced) / steps if steps else 0.0,
                "forced_tokens": forced,
                # Typical acceptance trades exactness for acceptance: said wherever it was used.
                "acceptance": "typical (lossy)" if lossy else "exact",
                "lossy": lossy,
                "lora_adapter": self.params.lora,  # the adapted target that verified (None: the base model)
            },
        }


class Format(Protocol):
    """What one API makes of the engine's outputs."""

    chunk_object: str  # "object" of a streamed chunk
    object: str  # "object" of the whole response

    def adjust(self, c: CompletionOutput) -> CompletionOutput:
        """The choice as this request shows it (e.g. a scoring request drops its one token)."""

    def stream_choices(self, i: int, idx: int, out: RequestOutput, c: CompletionOutput) -> list[dict]:
        """The chunks' choices for what is new in ``c`` (choice ``idx`` of prompt ``i``); [] sends none."""

    def choice(self, idx: int, text: str, logprobs: list, reason: str | None, prompt_out: RequestOutput | None) -> dict:
        """Choice ``idx`` of the whole response."""

    def usage(self, usage: dict) -> dict:
        """The response's ``usage`` with what this API adds (chat: reasoning tokens)."""


async def respond(job: Job, fmt: Format):
    if job.stream:
        return StreamingResponse(_stream(job, fmt), media_type="text/event-stream")
    return JSONResponse(await until_disconnect(job, _collect(job, fmt)))


# -- relaying ---------------------------------------------------------------------------------------------
def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _chunk(job: Job, fmt: Format, choices: list[dict], **extra) -> str:
    body = {
        "id": job.id,
        "object": fmt.chunk_object,
        "created": job.created,
        "model": job.model,
    }
    return sse({**body, "choices": choices, **extra})


def _engine_failure(out: RequestOutput) -> APIError:
    return APIError(500, f"the request failed inside the engine: {out.error}", "server_error")


async def _stream(job: Job, fmt: Format) -> AsyncIterator[str]:
    finals: dict[int, RequestOutput] = {}
    tokens = 0
    ended: set[int] = set()  # choices whose finish_reason was sent: nothing more for them
    provenance: dict[int, list] = {}  # include_speculation: each choice's tokens not yet sent with a chunk
    try:
        async for i, out in outputs(job):
            if out.error:
                yield sse(_engine_failure(out).body())
                break
            for c in out.outputs:
                idx = i * job.n + c.index
                if idx in ended:
                    continue
                c = fmt.adjust(c)
                if c.finished:
                    ended.add(idx)
                tokens += len(c.delta_token_ids)
                choices = fmt.stream_choices(i, idx, out, c)
                if c.delta_provenance:
                    provenance.setdefault(idx, []).extend(zip(c.delta_token_ids, c.delta_provenance, strict=True))
                if choices and provenance.get(idx):  # (text held back: they ride with the choice's next chunk)
                    choices[-1]["speculation"] = _speculation(provenance.pop(idx), job.state.token_texts)
                for choice in choices:
                    if job.continuous_usage:
                        yield _chunk(job, fmt, [choice], usage=job.running_usage(tokens))
                    else:
                        yield _chunk(job, fmt, [choice])
            if out.finished:
                finals[i] = out
        else:
            if job.include_usage:
                yield _chunk(job, fmt, [], usage=fmt.usage(job.usage(tokens, list(finals.values()))))
    except EngineDeadError as e:
        yield sse(error_body(str(e), "server_error"))
    yield "data: [DONE]\n\n"


def _speculation(tokens: list, texts) -> list[dict]:
    """``stream_options.include_speculation``: how each token of a chunk came (``text``: the token's
    own text, as logprobs show it)."""
    return [
        {"token_id": t, "text": texts.text(t), "kind": kind, "proposer": proposer, "depth": depth}
        for t, (kind, proposer, depth) in tokens
    ]


async def _collect(job: Job, fmt: Format) -> dict:
    texts: dict[int, str] = {}
    lps: dict[int, list] = {}
    reasons: dict[int, str | None] = {}
    prompt_outs: dict[int, RequestOutput] = {}  # an output of prompt i that carries its prompt logprobs
    finals: dict[int, RequestOutput] = {}
    tokens = 0
    async for i, out in outputs(job):
        if out.error:
            raise _engine_failure(out)
        if out.prompt_logprobs is not None:
            prompt_outs[i] = out
        for c in out.outputs:
            c = fmt.adjust(c)
            idx = i * job.n + c.index
            texts[idx] = c.text
            lps.setdefault(idx, []).extend(c.delta_logprobs or [])
            reasons[idx] = c.finish_reason
            tokens += len(c.delta_token_ids)
        if out.finished:
            finals[i] = out
    choices = [fmt.choice(x, texts[x], lps[x], reasons[x], prompt_outs.get(x // job.n)) for x in sorted(texts)]
    return {
        "id": job.id,
        "object": fmt.object,
        "created": job.created,
        "model": job.model,
        "choices": choices,
        "usage": fmt.usage(job.usage(tokens, list(finals.values()))),
    }


async def until_disconnect(job: Job, work):
    """Run ``work`` (a coroutine) but abort it if the client goes away first."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=job.state.settings.disconnect_poll_s)
            if not done and await job.request.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected", "client_disconnect")
        return task.result()
    finally:
        if not task.done():
            task.cancel()


async def outputs(job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of one engine request per prompt, interleaved as they come: (prompt index, output)."""
    if len(job.prompt_ids) == 1:
        async for out in _run(job, f"{job.id}-0", job.prompt_ids[0]):
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, ids: list[int]) -> None:
        try:
            async for out in _run(job, f"{job.id}-{i}", ids):
                await queue.put((i, out))
        except BaseException as e:  # handed to the consumer, which re-raises it
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, ids)) for i, ids in enumerate(job.prompt_ids)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _run(job: Job, request_id: str, prompt_ids: list[int]) -> AsyncIterator[RequestOutput]:
    """One engine request's outputs, with latency metrics recorded as they pass."""
    m = job.state.metrics
    start = time.monotonic()
    first = last = None
    tokens = 0
    m.request_started(len(prompt_ids))
    finished = False
    try:
        async for out in job.eng.generate(request_id, prompt_ids, job.params_for(prompt_ids)):
            now = time.monotonic()
            new = sum(len(c.delta_token_ids) for c in out.outputs)
            if new:
                if first is None:
                    first = now
                    m.first_token(now - start)
                m.tokens(new, None if last is None else (now - last) / new)
                last = now
                tokens += new
            if out.finished:
                finished = True
                if out.error:
                    m.request_failed("engine_error")
                else:
                    reason = out.outputs[0].finish_reason if out.outputs else None
                    tpot = (now - first) / (tokens - 1) if first is not None and tokens > 1 else None
                    lossy = job.params.typical_acceptance is not None
                    m.request_finished(reason or "stop", now - start, tpot, len(prompt_ids), tokens, lossy)
                    if job.params.lora is not None:
                        m.lora_speculation(job.params.lora, out.stats.num_draft_tokens, out.stats.num_accepted_tokens)
                    if job.params.structured is not None:
                        m.grammar_request(job.params.structured.kind, out.stats.grammar_seconds)
            yield out
    finally:
        if not finished:  # the client went away (stream closed or request cancelled): aborted
            m.request_failed("client_disconnect")
