"""``POST /v1/chat/completions``: messages rendered with the model's chat template, relayed by
:mod:`server.relay` as chat completion chunks or one chat completion."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import FastAPI, Request

from engine.request.checks import InvalidRequestError
from engine.request.outputs import CompletionOutput, RequestOutput
from engine.request.sequence import TokenLogprob
from server.common import bad_request, check_model, off_loop, parse_request, ready_engine, request_body
from server.protocol import ChatCompletionRequest, UnsupportedError
from server.relay import Job, prepare, respond, sampling_params
from server.state import ServerState
from server.tokens import TokenTexts


def add_chat_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(request: Request):
        req: ChatCompletionRequest = await parse_request(request, ChatCompletionRequest)
        check_model(state, req.model)
        eng = ready_engine(state)
        if not eng.has_chat_template:
            raise bad_request("this model has no chat template; use /v1/completions", "messages")
        try:
            messages = req.chat_messages()
        except UnsupportedError as e:
            raise bad_request(str(e), e.param) from None
        try:
            render = lambda: eng.render_chat(messages, req.add_generation_prompt)  # noqa: E731
            prompt_ids = await off_loop(render, sum(len(m["content"]) for m in messages))
        except InvalidRequestError as e:
            raise bad_request(str(e), "messages") from None
        max_tokens = req.completion_limit
        if max_tokens is None:  # as long as the context allows
            max_tokens = max(1, eng.max_model_len - len(prompt_ids))
        params = sampling_params(state, req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
        ids = await prepare(eng, [prompt_ids], params)
        job = Job.admit(state, eng, request, "chatcmpl", ids, params, req.n, req.stream, req.include_usage)
        return await respond(job, ChatFormat(req.logprobs, state.token_texts))


@dataclass
class ChatFormat:
    logprobs: bool
    texts: TokenTexts
    started: set[int] = field(default_factory=set)  # streamed choices whose role chunk was sent

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
        delta = {"content": c.delta_text} if (c.delta_text or not c.finished) else {}
        choices.append({"index": idx, "delta": delta, "logprobs": lp, "finish_reason": c.finish_reason})
        return choices

    def choice(self, idx: int, text: str, logprobs: list, reason: str | None, prompt_out: RequestOutput | None) -> dict:
        return {
            "index": idx,
            "message": {"role": "assistant", "content": text},
            "logprobs": {"content": self._logprobs(logprobs)} if self.logprobs else None,
            "finish_reason": reason,
        }

    def _logprobs(self, entries: list[TokenLogprob]) -> list[dict]:
        def item(tok: int, lp: float) -> dict:
            return {"token": self.texts.text(tok), "logprob": lp, "bytes": self.texts.bytes(tok)}

        return [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]
