"""``POST /v1/chat/completions``: messages rendered with the model's chat template, relayed by
:mod:`server.relay` as chat completion chunks or one chat completion."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fastapi import FastAPI, Request

from engine.request.checks import InvalidRequestError
from engine.request.outputs import CompletionOutput, RequestOutput
from engine.request.sequence import TokenLogprob
from engine.request.structured import StructuredOutput
from server.common import bad_request, check_model, off_loop, parse_request, ready_engine, request_body
from server.protocol import ChatCompletionRequest, UnsupportedError
from server.relay import Job, prepare, respond, sampling_params
from server.state import ServerState
from server.tokens import TokenTexts
from server.tools import ToolFormat, argument_pieces, fallback_messages


@dataclass
class ChatTurn:
    """The conversation of a chat-shaped request, whichever API it came through (chat completions or
    the Responses API); the request model itself says the rest (its tools and limits)."""

    messages: list[dict]  # as chat templates take them (server.protocol.template_messages)
    logprobs: int | None = None  # top logprobs per token (None: no logprobs)
    add_generation_prompt: bool = True
    param: str = "messages"  # the request field the conversation came in (errors name it)


async def chat_job(state: ServerState, request: Request, req, turn: ChatTurn, prefix: str) -> Job:
    """The one path from a chat-shaped request to an admitted :class:`Job`: the messages rendered
    with the chat template (tools through it, or the fallback), the sampling parameters, a forced
    call's grammar, the prompt checked and the grammar compiled, queue places reserved. ``req`` is the
    request model: its sampling fields, ``n``, ``stream``, ``completion_limit``, its offered
    ``tool_functions`` and its :class:`~server.protocol.ToolChoiceRules`."""
    eng = ready_engine(state)
    if not eng.has_chat_template:
        raise bad_request("this model has no chat template; use /v1/completions", turn.param)
    messages = turn.messages
    functions = req.tool_functions
    tools = [{"type": "function", "function": f} for f in functions] or None
    if not eng.chat_template_takes_tools:  # described in a system message, history in the Hermes style
        messages, tools = fallback_messages(messages, functions), None
    try:
        render = lambda: eng.render_chat(messages, turn.add_generation_prompt, tools)  # noqa: E731
        prompt_ids = await off_loop(render, sum(len(m["content"]) for m in messages))
    except InvalidRequestError as e:
        raise bad_request(str(e), turn.param) from None
    max_tokens = req.completion_limit
    if max_tokens is None:  # as long as the context allows
        max_tokens = max(1, eng.max_model_len - len(prompt_ids))
    params = sampling_params(state, req, max_tokens, turn.logprobs)
    if req.forces_tool_call:  # required / a named function: the calls are the output, by grammar
        grammar = StructuredOutput("grammar", state.tool_format.grammar(functions, req.parallel), None, "tool_choice")
        params = dataclasses.replace(params, structured=grammar)
    ids = await prepare(eng, [prompt_ids], params)
    return Job.admit(state, eng, request, prefix, ids, params, req.n, req.stream, req.include_usage)


def add_chat_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        req: ChatCompletionRequest = await parse_request(request, ChatCompletionRequest)
        check_model(state, req.model)
        try:
            messages = req.chat_messages()
        except UnsupportedError as e:
            raise bad_request(str(e), e.param) from None
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        job = await chat_job(state, request, req, ChatTurn(messages, logprobs, req.add_generation_prompt), "chatcmpl")
        tools = state.tool_format if req.parses_tool_calls else None
        return await respond(job, ChatFormat(req.logprobs, state.token_texts, tools))


@dataclass
class ChatFormat:
    logprobs: bool
    texts: TokenTexts
    tools: ToolFormat | None = None  # tool calls are parsed out of the text (tool_choice not none)
    started: set[int] = field(default_factory=set)  # streamed choices whose role chunk was sent
    # Streams with tools: each choice's text so far, and how much of it went out as content.
    text: dict[int, str] = field(default_factory=dict)
    sent: dict[int, int] = field(default_factory=dict)

    chunk_object = "chat.completion.chunk"
    object = "chat.completion"

    def adjust(self, c: CompletionOutput) -> CompletionOutput:
        return c

    def stream_choices(self, i: int, idx: int, out: RequestOutput, c: CompletionOutput) -> list[dict]:
        choices = []
        if idx not in self.started:  # the role comes first, alone, once per choice
            self.started.add(idx)
            role = {"role": "assistant", "content": ""}
            choices.append({"index": idx, "delta": role, "logprobs": None, "finish_reason": None})
        if not c.delta_text and not c.finished and not c.delta_token_ids:
            return choices
        lp = {"content": self._logprobs(c.delta_logprobs or [])} if self.logprobs else None
        if self.tools is not None:
            return choices + self._tool_stream(idx, c, lp)
        delta = {"content": c.delta_text} if (c.delta_text or not c.finished) else {}
        choices.append({"index": idx, "delta": delta, "logprobs": lp, "finish_reason": c.finish_reason})
        return choices

    def _tool_stream(self, idx: int, c: CompletionOutput, lp: dict | None) -> list[dict]:
        """Content as it comes, held back from where calls may begin; at the end, each call: its id,
        type and name in one delta, then its arguments in pieces (every delta with its ``index``)."""
        text = self.text[idx] = self.text.get(idx, "") + c.delta_text
        sent = self.sent.get(idx, 0)
        out = []
        if not c.finished:
            safe = self.tools.content_end(text)
            if safe > sent:
                out.append({"index": idx, "delta": {"content": text[sent:safe]}, "logprobs": lp, "finish_reason": None})
                self.sent[idx] = safe
            return out
        content, calls = self.tools.parse(text)
        rest = (text if not calls else (content or ""))[sent:]
        if rest:
            out.append({"index": idx, "delta": {"content": rest}, "logprobs": lp, "finish_reason": None})
        for k, call in enumerate(calls):
            head = {"index": k, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
            out.append({"index": idx, "delta": {"tool_calls": [head]}, "logprobs": None, "finish_reason": None})
            for args in argument_pieces(call.arguments):
                piece = {"index": k, "function": {"arguments": args}}
                out.append({"index": idx, "delta": {"tool_calls": [piece]}, "logprobs": None, "finish_reason": None})
        reason = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
        out.append({"index": idx, "delta": {}, "logprobs": None, "finish_reason": reason})
        return out

    def choice(self, idx: int, text: str, logprobs: list, reason: str | None, prompt_out: RequestOutput | None) -> dict:
        message: dict = {"role": "assistant", "content": text}
        if self.tools is not None:
            content, calls = self.tools.parse(text)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": [c.openai() for c in calls]}
                reason = "tool_calls" if reason == "stop" else reason
        return {
            "index": idx,
            "message": message,
            "logprobs": {"content": self._logprobs(logprobs)} if self.logprobs else None,
            "finish_reason": reason,
        }

    def _logprobs(self, entries: list[TokenLogprob]) -> list[dict]:
        def item(tok: int, lp: float) -> dict:
            return {"token": self.texts.text(tok), "logprob": lp, "bytes": self.texts.bytes(tok)}

        return [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]
