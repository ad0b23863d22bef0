"""The OpenAI-compatible HTTP front: routes, streaming, auth, errors, metrics.

Handlers validate a request, turn it into engine requests (one per prompt) and relay the engine's
outputs, as one JSON body or as server-sent events in OpenAI's chunk format. Nothing here touches
a tensor. A bad request gets an OpenAI-shaped error; a request that fails inside the engine fails
alone (500) while the server keeps serving everyone else.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.core.async_engine import AsyncEngine, EngineDeadError
from engine.request.checks import InvalidRequestError
from engine.request.outputs import RequestOutput
from engine.request.sampling_params import SamplingParams
from engine.request.sequence import TokenLogprob
from server.limits import BodyLimits
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    UnsupportedError,
    error_body,
)
from server.routes.common import (
    APIError,
    bad_request,
    check_model,
    off_loop,
    parse_request,
    ready_engine,
    request_body,
)
from server.routes.tokenize import add_tokenizer_routes
from server.state import ServerSettings, ServerState

logger = logging.getLogger(__name__)

try:
    AUGUR_VERSION = version("augur")
except PackageNotFoundError:  # running from a source tree that was not installed
    AUGUR_VERSION = "0.0.0+local"


class BearerAuth:
    """Require ``Authorization: Bearer KEY`` (compared in constant time) except on open paths.

    A plain ASGI middleware rather than ``@app.middleware("http")``: Starlette's BaseHTTPMiddleware
    wraps ``receive`` so that ``Request.is_disconnected()`` never sees the client leave, and a
    non-streaming request would then run to completion for nobody."""

    def __init__(self, app, key: str, open_paths: set[str]) -> None:
        self.app, self.key, self.open_paths = app, key.encode(), open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            given = dict(scope["headers"]).get(b"authorization", b"")
            token = given[7:] if given[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.key):
                body = error_body("invalid or missing API key", "authentication_error", code="invalid_api_key")
                await JSONResponse(body, 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(
    settings: ServerSettings,
    engine_factory: Callable[[], AsyncEngine],
    on_load_failure: Callable[[str], None] | None = None,
) -> FastAPI:
    """The app. ``engine_factory`` runs on a background thread at start-up, so /health can answer
    503 while the model loads. If it fails, /health reports why, and ``on_load_failure(reason)`` is
    called: ``augur serve`` then stops the server and exits non-zero, so that Docker, Kubernetes or
    ``make serve`` see the failure (and restart with the reason logged) instead of a server that
    answers 503 forever."""
    state = ServerState(settings)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        def load() -> None:
            try:
                state.attach(engine_factory())
                logger.info("engine ready: serving %s", settings.served_model_name)
            except Exception as e:
                logger.exception("engine failed to load")
                state.load_error = f"{type(e).__name__}: {e}"
                if on_load_failure is not None:
                    on_load_failure(state.load_error)

        loader = threading.Thread(target=load, name="augur-load", daemon=True)
        loader.start()
        yield
        if state.engine is not None:
            state.engine.shutdown()

    # No redirect_slashes: `POST /v1/completions/` is a 404 in OpenAI's shape, not an empty 307.
    app = FastAPI(title="Augur", version=AUGUR_VERSION, lifespan=lifespan, redirect_slashes=False)
    app.state.augur = state
    m = state.metrics
    labels = m.labels

    # -- errors ---------------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_req, exc: APIError):
        return JSONResponse(exc.body(), exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            msg, loc = "the request body is not valid JSON", []
        ctx_err = (first.get("ctx") or {}).get("error")
        if isinstance(ctx_err, UnsupportedError):
            return JSONResponse(error_body(str(ctx_err), "invalid_request_error", ctx_err.param), 400)
        param = ".".join(loc) or None
        return JSONResponse(error_body(f"{param + ': ' if param else ''}{msg}", "invalid_request_error", param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req, exc: StarletteHTTPException):
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), type_), exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(_req, exc: Exception):
        logger.exception("unhandled error")
        m.request_failure.labels(**labels, reason="internal").inc()
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "internal_error"), 500)

    # -- limits and auth (the last added runs first: auth, then the body limits) ------------------------
    app.add_middleware(BodyLimits, max_bytes=settings.max_request_bytes, timeout_s=settings.body_timeout_s)
    if settings.api_key:
        app.add_middleware(BearerAuth, key=settings.api_key, open_paths={"/health", "/metrics"})

    # -- plain endpoints ------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if state.load_error:
            return JSONResponse({"status": "error", "error": state.load_error}, 503)
        if state.engine is None:
            return JSONResponse({"status": "loading"}, 503)
        if not state.engine.is_running:
            return JSONResponse({"status": "dead", "error": state.engine.dead_error}, 503)
        return {"status": "ok"}

    @app.get("/version")
    async def get_version():
        return {"version": AUGUR_VERSION}

    @app.get("/metrics")
    async def metrics():
        return Response(m.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        card = {"id": settings.served_model_name, "object": "model", "created": state.created, "owned_by": "augur"}
        if state.engine is not None:
            card["max_model_len"] = state.engine.engine.max_model_len
        return {"object": "list", "data": [card]}

    # -- generation -----------------------------------------------------------------------------------
    def admit(eng: AsyncEngine, request_ids: list[str]) -> None:
        """Reserve queue places now (429 if full), before any await lets another request in."""
        check_queue_bound(len(request_ids))
        if not eng.reserve(request_ids, settings.max_queue_len):
            raise APIError(
                429,
                f"the request queue is full ({settings.max_queue_len} requests waiting); retry shortly",
                "rate_limit_error",
                headers={"Retry-After": "1"},
            )

    def check_queue_bound(num_prompts: int) -> None:
        if num_prompts > settings.max_queue_len:  # would never fit, however long the client waited
            raise bad_request(
                f"{num_prompts} prompts exceed the server's queue of {settings.max_queue_len} requests", "prompt"
            )

    async def prepare(eng: AsyncEngine, prompts: list[str | list[int]], params: SamplingParams) -> list[list[int]]:
        def work() -> list[list[int]]:
            ids = []
            for p in prompts:
                tokens = eng.engine.tokenize(p)
                eng.engine.validate(tokens, params)
                ids.append(tokens)
            return ids

        try:
            return await off_loop(work, sum(len(p) for p in prompts))
        except InvalidRequestError as e:
            raise bad_request(str(e), "prompt") from None

    def make_params(req, max_tokens, logprobs, prompt_logprobs=None) -> SamplingParams:
        try:
            return req.sampling_params(max_tokens, logprobs, prompt_logprobs, state.settings.typical_acceptance)
        except ValueError as e:
            raise bad_request(str(e)) from None

    async def run_request(
        eng: AsyncEngine, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """One engine request's outputs, with latency metrics recorded as they pass."""
        start = time.monotonic()
        first = last = None
        tokens = 0
        m.request_started(len(prompt_ids))
        finished = False
        try:
            async for out in eng.generate(request_id, prompt_ids, params):
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
                        lossy = params.typical_acceptance is not None
                        m.request_finished(reason or "stop", now - start, tpot, len(prompt_ids), tokens, lossy)
                yield out
        finally:
            if not finished:  # the client went away (stream closed or request cancelled): aborted
                m.request_failed("client_disconnect")

    async def merged(
        eng, base_id: str, prompt_ids: list[list[int]], params
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of one engine request per prompt, interleaved as they come: (prompt index, output)."""
        if len(prompt_ids) == 1:
            async for out in run_request(eng, f"{base_id}-0", prompt_ids[0], params):
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, ids: list[int]) -> None:
            try:
                async for out in run_request(eng, f"{base_id}-{i}", ids, params):
                    await queue.put((i, out))
            except BaseException as e:  # handed to the consumer, which re-raises it
                await queue.put((i, e))
            finally:
                await queue.put((i, done))

        tasks = [asyncio.create_task(pump(i, ids)) for i, ids in enumerate(prompt_ids)]
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

    async def until_disconnect(request: Request, work):
        """Run ``work`` (a coroutine) but abort it if the client goes away first."""
        task = asyncio.ensure_future(work)
        try:
            while not task.done():
                done, _ = await asyncio.wait({task}, timeout=settings.disconnect_poll_s)
                if not done and await request.is_disconnected():
                    task.cancel()
                    raise APIError(499, "client disconnected", "client_disconnect")
            return task.result()
        finally:
            if not task.done():
                task.cancel()

    def engine_failure(out: RequestOutput) -> APIError:
        return APIError(500, f"the request failed inside the engine: {out.error}", "internal_error")

    def usage(prompt_tokens: int, completion_tokens: int, outputs: list[RequestOutput], params: SamplingParams) -> dict:
        steps = sum(o.stats.num_decode_steps for o in outputs)
        drafted = sum(o.stats.num_draft_tokens for o in outputs)
        lossy = params.typical_acceptance is not None
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "speculative": {
                "method": state.engine.engine.spec_method if drafted else "none",
                "draft_tokens": drafted,
                "accepted_tokens": sum(o.stats.num_accepted_tokens for o in outputs),
                "verify_steps": steps,
                "mean_acceptance_length": completion_tokens / steps if steps else 0.0,
                # Typical acceptance trades exactness for acceptance: said wherever it was used.
                "acceptance": "typical (lossy)" if lossy else "exact",
                "lossy": lossy,
            },
        }

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    tokenizer_cache: dict[int, str] = {}

    def token_text(eng: AsyncEngine, token_id: int) -> str:
        text = tokenizer_cache.get(token_id)
        if text is None:
            text = eng.engine.tokenizer.decode([token_id])
            if len(tokenizer_cache) < 200_000:
                tokenizer_cache[token_id] = text
        return text

    byte_decoder = None

    def token_bytes(eng: AsyncEngine, token_id: int) -> list[int]:
        """The token's own bytes — for part of a multi-byte character, that part, not U+FFFD."""
        nonlocal byte_decoder
        tok = eng.engine.tokenizer
        piece = tok.convert_ids_to_tokens(token_id)
        if piece is None:
            return []
        if byte_decoder is None:
            byte_decoder = {}
            decoder = getattr(getattr(tok, "backend_tokenizer", None), "decoder", None)
            if decoder is not None and "ByteLevel" in type(decoder).__name__ + repr(decoder):
                from transformers.convert_slow_tokenizer import bytes_to_unicode

                byte_decoder = {c: b for b, c in bytes_to_unicode().items()}
        if byte_decoder and all(c in byte_decoder for c in piece):
            return [byte_decoder[c] for c in piece]
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
            return [int(piece[3:5], 16)]
        return list(token_text(eng, token_id).encode("utf-8"))

    # -- /v1/completions ------------------------------------------------------------------------------
    def top_entry(eng, e: TokenLogprob) -> dict[str, float]:
        """A position's ``top_logprobs``: the ``logprobs`` best tokens and, as OpenAI's legacy completions
        always add it, the chosen token (so ``logprobs: 0`` gives the chosen token alone)."""
        top = {token_text(eng, t): lp for t, lp in e.top}
        top.setdefault(token_text(eng, e.token_id), e.logprob)
        return top

    def completion_logprobs(eng, entries: list[TokenLogprob | None], offset: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        pos = offset
        for e in entries:
            if e is None:
                continue
            text = token_text(eng, e.token_id)
            tokens.append(text)
            token_lps.append(e.logprob)
            tops.append(top_entry(eng, e))
            offsets.append(pos)
            pos += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def prompt_logprob_entries(eng, out: RequestOutput) -> dict:
        """The echoed prompt's logprobs (``None`` at the first token, which nothing predicts)."""
        entries = out.prompt_logprobs or []
        res = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        pos = 0
        for tok, e in zip(out.prompt_token_ids, entries):
            text = token_text(eng, tok)
            res["tokens"].append(text)
            res["token_logprobs"].append(None if e is None else e.logprob)
            res["top_logprobs"].append(None if e is None else top_entry(eng, e))
            res["text_offset"].append(pos)
            pos += len(text)
        return res

    def echoed_logprobs(prompt_lp: dict | None, shift: int, lp: dict) -> dict:
        """The prompt's logprobs followed by the completion's (its offsets shifted past the prompt)."""
        pl = prompt_lp or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        return {
            "tokens": pl["tokens"] + lp["tokens"],
            "token_logprobs": pl["token_logprobs"] + lp["token_logprobs"],
            "top_logprobs": pl["top_logprobs"] + lp["top_logprobs"],
            "text_offset": pl["text_offset"] + [o + shift for o in lp["text_offset"]],
        }

    def scored(c):
        """A ``max_tokens: 0`` choice: the engine ran it for one token, which nobody asked for; it is
        dropped (text, logprobs, count) and the choice ends as OpenAI ends it, at the length limit."""
        reason = "length" if c.finished else None
        return dataclasses.replace(
            c, text="", delta_text="", delta_token_ids=[], delta_logprobs=[], num_tokens=0, finish_reason=reason,
            stop_reason=None,
        )  # fmt: skip

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(request: Request):
        req: CompletionRequest = await parse_request(request, CompletionRequest)
        check_model(state, req.model)
        eng = ready_engine(state)
        want_lp = req.logprobs
        # Scoring (max_tokens 0) runs one token, the least the engine generates, and drops it.
        max_tokens = 1 if req.scores_only else req.max_tokens
        params = make_params(req, max_tokens, want_lp, want_lp if req.echo and want_lp is not None else None)
        prompts = req.prompts()
        check_queue_bound(len(prompts))
        prompt_ids = await prepare(eng, prompts, params)
        rid = f"cmpl-{uuid.uuid4().hex}"
        admit(eng, [f"{rid}-{i}" for i in range(len(prompts))])
        created = int(time.time())
        name = settings.served_model_name
        n = req.n

        def prompt_text(i: int) -> str:
            p = prompts[i]
            return p if isinstance(p, str) else eng.engine.tokenizer.decode(p)

        if req.stream:

            async def stream():
                finals: dict[int, RequestOutput] = {}
                completion_tokens = 0
                echoed: set[int] = set()
                ended: set[int] = set()  # choices whose finish_reason was sent: nothing more for them
                try:
                    async for i, out in merged(eng, rid, prompt_ids, params):
                        if out.error:
                            yield sse(engine_failure(out).body())
                            break
                        for c in out.outputs:
                            idx = i * n + c.index
                            if idx in ended:
                                continue
                            if req.scores_only:
                                c = scored(c)
                            if c.finished:
                                ended.add(idx)
                            text = c.delta_text
                            lp = None
                            if want_lp is not None:
                                lp = completion_logprobs(eng, c.delta_logprobs or [], len(c.text) - len(c.delta_text))
                            if req.echo and idx not in echoed:
                                echoed.add(idx)
                                ptext = prompt_text(i)
                                text = ptext + text
                                if lp is not None:
                                    lp = echoed_logprobs(prompt_logprob_entries(eng, out), len(ptext), lp)
                            completion_tokens += len(c.delta_token_ids)
                            if not text and not c.finished and not c.delta_token_ids:
                                continue
                            choice = {"index": idx, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}
                            yield sse(
                                {
                                    "id": rid,
                                    "object": "text_completion",
                                    "created": created,
                                    "model": name,
                                    "choices": [choice],
                                }
                            )
                        if out.finished:
                            finals[i] = out
                    else:
                        if req.include_usage:
                            prompt_tokens = sum(len(p) for p in prompt_ids)
                            yield sse(
                                {
                                    "id": rid,
                                    "object": "text_completion",
                                    "created": created,
                                    "model": name,
                                    "choices": [],
                                    "usage": usage(prompt_tokens, completion_tokens, list(finals.values()), params),
                                }
                            )
                except EngineDeadError as e:
                    yield sse(error_body(str(e), "internal_error"))
                yield "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")

        async def collect():
            texts: dict[int, str] = {}
            lps: dict[int, list] = {}
            finals: dict[int, RequestOutput] = {}
            reasons: dict[int, str | None] = {}
            prompt_lp: dict[int, dict] = {}
            tokens = 0
            async for i, out in merged(eng, rid, prompt_ids, params):
                if out.error:
                    raise engine_failure(out)
                if out.prompt_logprobs is not None:
                    prompt_lp[i] = prompt_logprob_entries(eng, out)
                for c in out.outputs:
                    c = scored(c) if req.scores_only else c
                    idx = i * n + c.index
                    texts[idx] = c.text
                    lps.setdefault(idx, []).extend(c.delta_logprobs or [])
                    reasons[idx] = c.finish_reason
                    tokens += len(c.delta_token_ids)
                if out.finished:
                    finals[i] = out
            choices = []
            for idx in sorted(texts):
                i = idx // n
                text = texts[idx]
                lp = None
                if want_lp is not None:
                    lp = completion_logprobs(eng, lps[idx], 0)
                if req.echo:
                    ptext = prompt_text(i)
                    if lp is not None:
                        lp = echoed_logprobs(prompt_lp.get(i), len(ptext), lp)
                    text = ptext + text
                choices.append({"index": idx, "text": text, "logprobs": lp, "finish_reason": reasons[idx]})
            prompt_tokens = sum(len(p) for p in prompt_ids)
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": name,
                "choices": choices,
                "usage": usage(prompt_tokens, tokens, list(finals.values()), params),
            }

        return JSONResponse(await until_disconnect(request, collect()))

    # -- /v1/chat/completions -------------------------------------------------------------------------
    def chat_logprobs(eng, entries: list[TokenLogprob]) -> list[dict]:
        def item(tok: int, lp: float) -> dict:
            return {"token": token_text(eng, tok), "logprob": lp, "bytes": token_bytes(eng, tok)}

        return [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        req: ChatCompletionRequest = await parse_request(request, ChatCompletionRequest)
        check_model(state, req.model)
        eng = ready_engine(state)
        tok = eng.engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise bad_request("this model has no chat template; use /v1/completions", "messages")
        try:
            messages = req.chat_messages()
        except UnsupportedError as e:
            raise bad_request(str(e), e.param) from None

        def render() -> list[int]:
            rendered = tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=req.add_generation_prompt
            )
            eng.engine.check_text_fits(rendered)
            return tok.encode(rendered, add_special_tokens=False)

        try:
            prompt_ids = await off_loop(render, sum(len(m["content"]) for m in messages))
        except InvalidRequestError as e:
            raise bad_request(str(e), "messages") from None
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.completion_limit
        if max_tokens is None:
            max_tokens = max(1, eng.engine.max_model_len - len(prompt_ids))
        params = make_params(req, max_tokens, logprobs)
        ids = await prepare(eng, [prompt_ids], params)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        admit(eng, [f"{rid}-0"])
        created = int(time.time())
        name = settings.served_model_name

        def chunk(choices: list[dict], **extra) -> str:
            return sse(
                {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": name,
                    "choices": choices,
                    **extra,
                }
            )

        if req.stream:

            async def stream():
                final: RequestOutput | None = None
                tokens = 0
                started: set[int] = set()
                ended: set[int] = set()  # choices whose finish_reason was sent: nothing more for them
                try:
                    async for _, out in merged(eng, rid, ids, params):
                        if out.error:
                            yield sse(engine_failure(out).body())
                            break
                        for c in out.outputs:
                            if c.index in ended:
                                continue
                            if c.finished:
                                ended.add(c.index)
                            if c.index not in started:
                                started.add(c.index)
                                first = {"index": c.index, "delta": {"role": "assistant", "content": ""}}
                                yield chunk([{**first, "logprobs": None, "finish_reason": None}])
                            tokens += len(c.delta_token_ids)
                            if not c.delta_text and not c.finished and not c.delta_token_ids:
                                continue
                            lp = {"content": chat_logprobs(eng, c.delta_logprobs or [])} if req.logprobs else None
                            delta = {"content": c.delta_text} if (c.delta_text or not c.finished) else {}
                            yield chunk(
                                [{"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": c.finish_reason}]
                            )
                        if out.finished:
                            final = out
                    else:
                        if req.include_usage:
                            yield chunk([], usage=usage(len(ids[0]), tokens, [final] if final else [], params))
                except EngineDeadError as e:
                    yield sse(error_body(str(e), "internal_error"))
                yield "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")

        async def collect():
            texts: dict[int, str] = {}
            lps: dict[int, list] = {}
            reasons: dict[int, str | None] = {}
            tokens = 0
            final = None
            async for _, out in merged(eng, rid, ids, params):
                if out.error:
                    raise engine_failure(out)
                for c in out.outputs:
                    texts[c.index] = c.text
                    lps.setdefault(c.index, []).extend(c.delta_logprobs or [])
                    reasons[c.index] = c.finish_reason
                    tokens += len(c.delta_token_ids)
                if out.finished:
                    final = out
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": texts[i]},
                    "logprobs": {"content": chat_logprobs(eng, lps[i])} if req.logprobs else None,
                    "finish_reason": reasons[i],
                }
                for i in sorted(texts)
            ]
            return {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": name,
                "choices": choices,
                "usage": usage(len(ids[0]), tokens, [final] if final else [], params),
            }

        return JSONResponse(await until_disconnect(request, collect()))

    add_tokenizer_routes(app, state)
    publish_request_schemas(app, [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest])
    return app


def publish_request_schemas(app: FastAPI, models: list) -> None:
    """Put the pydantic request models (and the models they nest) into /openapi.json's components,
    where :func:`request_body` points: generated clients and fuzzers see the real schema."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(js.pop("$defs", {}))
                components[model.__name__] = js
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
