"""``/tokenize``, ``/detokenize`` and ``/tokenizer_info``: the served model's tokenizer, remotely.

Clients count and score with the server's own tokenizer through these (lm-eval's remote tokenizer
asks ``GET /tokenizer_info`` first, then ``POST /tokenize``); they keep vLLM's paths and shapes.
They sit behind the same API key and body limits as the generation routes. A text is tokenized
whatever its length, as counting it is often the point (the count and ``max_model_len`` come back
together); a big one is tokenized off the event loop.
"""

from __future__ import annotations

import jinja2
from fastapi import FastAPI, Request

from server.common import bad_request, check_model, off_loop, parse_request, ready_engine, request_body
from server.protocol import DetokenizeRequest, TokenizeRequest, UnsupportedError, template_messages
from server.state import ServerState
from server.tools import fallback_messages

# The tokenizer's own settings that /tokenizer_info passes on when it has them (besides the special
# tokens): what a client needs to tokenize as the server does.
_TOKENIZER_FIELDS = (
    "add_bos_token",
    "add_eos_token",
    "clean_up_tokenization_spaces",
    "padding_side",
    "truncation_side",
)


def add_tokenizer_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/tokenize", openapi_extra=request_body(TokenizeRequest))
    async def tokenize(request: Request):
        req: TokenizeRequest = await parse_request(request, TokenizeRequest)
        check_model(state, req.model)
        eng = ready_engine(state)
        tok = eng.tokenizer
        if req.messages is not None and not getattr(tok, "chat_template", None):
            raise bad_request("this model has no chat template: tokenize a prompt instead", "messages")
        functions = [t.function.model_dump(exclude_none=True) for t in req.tools or []]
        tools = [{"type": "function", "function": f} for f in functions] or None
        try:
            messages = template_messages(req.messages) if req.messages is not None else None
            if messages is not None and not eng.chat_template_takes_tools:  # as chat renders them
                messages, tools = fallback_messages(messages, functions), None
            elif messages is not None:  # (call ids as the template takes them)
                messages = state.tool_format.history(messages)
        except UnsupportedError as e:
            raise bad_request(str(e), e.param) from None

        kwargs = {**(state.settings.default_chat_template_kwargs or {}), **(req.chat_template_kwargs or {})}
        if tools:
            kwargs["tools"] = tools

        def work() -> list[int]:
            text = req.prompt
            if messages is not None:  # rendered as chat completions render them (the length is not checked)
                text = tok.apply_chat_template(
                    messages,
                    tokenize=False,
                    add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
                    continue_final_message=req.continue_final_message,
                    **kwargs,
                )
            return tok.encode(text, add_special_tokens=req.special_tokens)

        size = len(req.prompt) if messages is None else sum(len(m["content"]) for m in messages)
        try:
            ids = await off_loop(work, size)
        except (ValueError, jinja2.TemplateError) as e:  # the template refused the messages (nothing to continue)
            raise bad_request(f"the chat template refused these messages: {e}", "messages") from None
        strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": eng.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
    async def detokenize(request: Request):
        req: DetokenizeRequest = await parse_request(request, DetokenizeRequest)
        check_model(state, req.model)
        eng = ready_engine(state)
        vocab = max(eng.vocab_size, len(eng.tokenizer))
        bad = [t for t in req.tokens if t >= vocab]
        if bad:
            raise bad_request(f"token ids out of range [0, {vocab}): {bad[:5]}", "tokens")
        text = await off_loop(lambda: eng.tokenizer.decode(req.tokens), len(req.tokens))
        return {"prompt": text}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        eng = ready_engine(state)
        tok = eng.tokenizer
        info: dict = {"tokenizer_class": type(tok).__name__}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            info[name] = getattr(tok, name, None)
        info["additional_special_tokens"] = list(getattr(tok, "additional_special_tokens", None) or [])
        for name in _TOKENIZER_FIELDS:
            value = tok.init_kwargs.get(name)
            if isinstance(value, (bool, int, float, str)):
                info[name] = value
        info["model_max_length"] = eng.max_model_len
        info["vocab_size"] = len(tok)
        template = getattr(tok, "chat_template", None)
        info["chat_template"] = template if isinstance(template, str) else None
        return info
