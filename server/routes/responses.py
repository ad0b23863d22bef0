"""The Responses API: ``POST /v1/responses`` (streamed or not), ``GET`` and ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``.

A request takes the chat path (:func:`server.routes.chat.chat_job`: the same rendering, tools,
grammars, speculation and queue), with the conversation of ``previous_response_id`` before its
input. Its output is made into items by :class:`~server.responses.output.OutputBuilder`; a stream
sends OpenAI's events as they happen, each with its ``sequence_number``. A stored response
(``store``, the default) keeps its conversation in the bounded :class:`ResponseStore`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.core.async_engine import EngineDeadError
from server.common import APIError, check_model, parse_request, request_body
from server.reasoning import HarmonyReader, ReasoningReader
from server.relay import Job, outputs, until_disconnect
from server.responses.output import OutputBuilder
from server.responses.protocol import ResponsesRequest
from server.routes.chat import ChatTurn, chat_job
from server.state import API_KEY_SCOPE, ServerState
from server.tools import template_call


def add_response_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/responses", openapi_extra=request_body(ResponsesRequest))
    async def create_response(request: Request):
        req: ResponsesRequest = await parse_request(request, ResponsesRequest)
        check_model(state, req.model)
        owner = request.scope.get(API_KEY_SCOPE)
        history: list[dict] = []
        if req.previous_response_id is not None:
            history = list(_stored(state, req.previous_response_id, owner, "previous_response_id").history)
        new = req.messages
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        turn = ChatTurn(
            system + history + new,
            param="input",
            template_kwargs=req.chat_template_kwargs,
            effort=req.effort,
            effort_param="reasoning.effort",
            thinking_budget=req.thinking_token_budget,
        )
        job, reader = await chat_job(state, request, req, turn, "resp")
        run = ResponseRun(state, req, job, history + new, owner, reader)
        if req.stream:
            return StreamingResponse(run.stream(), media_type="text/event-stream")
        return JSONResponse(await until_disconnect(job, run.collect()))

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str):
        return _stored(state, response_id, request.scope.get(API_KEY_SCOPE)).response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str):
        _stored(state, response_id, request.scope.get(API_KEY_SCOPE))
        state.responses.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(request: Request, response_id: str, order: str = "desc", limit: int = 20,
                          after: str | None = None):  # fmt: skip
        items = list(_stored(state, response_id, request.scope.get(API_KEY_SCOPE)).input_items)
        if order not in ("asc", "desc") or not 1 <= limit <= 100:
            raise APIError(400, "order is asc or desc, limit 1 to 100", "invalid_request_error", "order")
        items = items if order == "asc" else items[::-1]
        if after is not None:
            ids = [i["id"] for i in items]
            items = items[ids.index(after) + 1 :] if after in ids else []
        page = items[:limit]
        first, last = (page[0]["id"], page[-1]["id"]) if page else (None, None)
        return {"object": "list", "data": page, "first_id": first, "last_id": last, "has_more": len(items) > limit}


def _stored(state: ServerState, response_id: str, owner: str | None, param: str | None = None):
    item = state.responses.get(response_id, owner)
    if item is None:
        message = (f"Response with id '{response_id}' not found: it was never stored (store: false), was "
                   "deleted, or was evicted from the store (docs/responses.md)")  # fmt: skip
        raise APIError(404, message, "invalid_request_error", param, "response_not_found")
    return item


class ResponseRun:
    """One response: the engine's outputs made into items and events, the final object, the store."""

    def __init__(self, state: ServerState, req: ResponsesRequest, job: Job, history: list[dict],
                 owner: str | None, reader: ReasoningReader | HarmonyReader | None = None) -> None:  # fmt: skip
        self.state, self.req, self.job = state, req, job
        self.history, self.owner, self.reader = history, owner, reader
        self.id = "resp_" + job.id.rsplit("-", 1)[-1]
        self.created = time.time()
        tools = state.tool_format.for_tools(req.tool_functions) if req.parses_tool_calls else None
        self.builder = OutputBuilder(tools, req.forces_tool_call, reader.stream() if reader is not None else None,
                                     one_call=not req.parallel)  # fmt: skip
        self.seq = 0
        self.tokens = 0
        self.token_ids: list[int] = []
        self.reason: str | None = None
        self.finals = []

    def body(self, status: str, error: dict | None = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": int(self.created),
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "model": self.job.model,
            "output": self.builder.items if status != "in_progress" else [],
            "usage": self.usage() if status in ("completed", "incomplete") else None,
            **self.req.echo(),
        }

    def usage(self) -> dict:
        chat = self.job.usage(self.tokens, self.finals)
        cached = chat["prompt_tokens_details"]["cached_tokens"]
        written = chat["prompt_tokens"] - cached if self.job.eng.cache_info.prefix_caching else 0
        return {
            "input_tokens": chat["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
            "output_tokens": chat["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": chat["total_tokens"],
            "speculative": chat["speculative"],
        }

    @property
    def reasoning_tokens(self) -> int:
        if self.reader is None or self.builder.reasoning is None:
            return 0
        return self.reader.count(self.token_ids, self.builder.reasoning.thought)

    async def _events(self) -> AsyncIterator[dict]:
        """The output's events as they happen, then the closing ones (without the framing ones)."""
        async for _, out in outputs(self.job):
            if out.error:
                raise _EngineFailure(out.error)
            for c in out.outputs:
                self.tokens += len(c.delta_token_ids)
                self.token_ids.extend(c.delta_token_ids)
                for event in self.builder.feed(c.delta_text):
                    yield event
                if c.finished:
                    self.reason = c.finish_reason
            if out.finished:
                self.finals.append(out)
        for event in self.builder.finish(self.reason):
            yield event

    def _final(self) -> dict:
        status = "completed" if self.reason == "stop" else "incomplete"
        if self.reason not in ("stop", "length"):
            status = "failed"
        final = self.body(status)
        if status != "failed" and self.req.store:
            output = _output_messages(self.builder.items)
            self.state.responses.put(final, self.history + output, self.req.input_items, self.owner)
        return final

    async def collect(self) -> dict:
        try:
            async for _ in self._events():
                pass
        except _EngineFailure as e:
            raise APIError(500, f"the request failed inside the engine: {e}", "server_error") from None
        return self._final()

    async def stream(self) -> AsyncIterator[str]:
        yield self._sse({"type": "response.created", "response": self.body("in_progress")})
        yield self._sse({"type": "response.in_progress", "response": self.body("in_progress")})
        try:
            async for event in self._events():
                yield self._sse(event)
        except (_EngineFailure, EngineDeadError) as e:
            error = {"code": "server_error", "message": f"the request failed inside the engine: {e}"}
            yield self._sse({"type": "error", "code": error["code"], "message": error["message"], "param": None})
            yield self._sse({"type": "response.failed", "response": self.body("failed", error)})
            return
        final = self._final()
        yield self._sse({"type": f"response.{final['status']}", "response": final})

    def _sse(self, event: dict) -> str:
        event["sequence_number"] = self.seq
        self.seq += 1
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class _EngineFailure(Exception):
    pass


def _output_messages(items: list[dict]) -> list[dict]:
    """A response's output items as the assistant turn they are in the conversation (its reasoning
    where reasoning models' templates read it)."""
    text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    calls = [template_call(i["call_id"], i["name"], i["arguments"]) for i in items if i["type"] == "function_call"]
    message: dict = {"role": "assistant", "content": text}
    thought = "".join(p["text"] for i in items if i["type"] == "reasoning" for p in i["content"])
    if thought:
        message["reasoning_content"] = thought
    if calls:
        message["tool_calls"] = calls
    return [message]
