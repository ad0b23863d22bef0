"""``POST /v1/chat/completions``: messages rendered with the model's chat template, relayed by
:mod:`server.relay` as chat completion chunks or one chat completion."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from fastapi import FastAPI, Request

from engine.request.checks import InvalidRequestError
from engine.request.outputs import CompletionOutput, RequestOutput
from engine.request.sequence import TokenLogprob
from engine.request.structured import StructuredOutput
from server.common import bad_request, check_model, off_loop, parse_request, ready_engine, request_body
from server.protocol import ChatCompletionRequest, UnsupportedError
from server.reasoning import (
    FIELDS,
    HARMONY,
    OFF_EFFORTS,
    HarmonyReader,
    HarmonyReasoningStream,
    ReasoningReader,
    ReasoningStream,
    effort_switch,
    reads_effort,
)
from server.relay import Job, fit_default, prepare, respond, sampling_params
from server.state import ServerState
from server.tokens import TokenTexts
from server.tool_formats import CallSyntax
from server.tool_pythonic import PythonicCallScanner
from server.tool_xml import XmlCallScanner
from server.tools import (
    CallScanner,
    HarmonyCallScanner,
    HarmonyFormat,
    argument_pieces,
    fallback_messages,
    json_answer,
    scanned_call_id,
)


@dataclass
class ChatTurn:
    """The conversation of a chat-shaped request, whichever API it came through (chat completions or
    the Responses API); the request model itself says the rest (its tools and limits)."""

    messages: list[dict]  # as chat templates take them (server.protocol.template_messages)
    logprobs: int | None = None  # top logprobs per token (None: no logprobs)
    add_generation_prompt: bool = True
    param: str = "messages"  # the request field the conversation came in (errors name it)
    continue_final_message: bool = False  # the output continues the last (assistant) message
    template_kwargs: dict | None = None  # the request's own chat template variables
    effort: str | None = None  # reasoning effort, mapped to the template's thinking switch
    effort_param: str = "reasoning_effort"
    thinking_budget: int | None = None  # thinking tokens before the end of thinking is forced


def template_kwargs(state: ServerState, chat_template: str | None, turn: ChatTurn) -> dict:
    """The chat template's variables for one request: the server's defaults, then what the reasoning
    effort sets, then the request's own ``chat_template_kwargs`` (which win)."""
    kw = dict(state.settings.default_chat_template_kwargs or {})
    if turn.effort is not None:
        off = turn.effort in OFF_EFFORTS
        level = reads_effort(chat_template)  # the template reads the level itself (gpt-oss's)
        if state.reasoning is None and not off and not level:
            raise bad_request(f"{turn.effort_param} {turn.effort!r}: this model does not reason (the server was "
                              "started without --reasoning-parser)", turn.effort_param)  # fmt: skip
        switch = effort_switch(chat_template)
        if switch is not None:
            kw[switch] = not off
        elif off and (state.reasoning is not None or level):
            raise bad_request(f"{turn.effort_param} {turn.effort!r}: this model's chat template has no switch that "
                              "turns its thinking off", turn.effort_param)  # fmt: skip
        kw["reasoning_effort"] = turn.effort  # templates that read the level itself (gpt-oss's)
    kw.update(turn.template_kwargs or {})
    return kw


async def chat_job(state: ServerState, request: Request, req, turn: ChatTurn, prefix: str
                   ) -> tuple[Job, ReasoningReader | HarmonyReader | None]:  # fmt: skip
    """The one path from a chat-shaped request to an admitted :class:`Job`: the messages rendered
    with the chat template (tools through it, or the fallback), the sampling parameters, a forced
    call's grammar behind the thinking of a reasoning model, the prompt checked and the grammar
    compiled, queue places reserved. ``req`` is the request model: its sampling fields, ``n``,
    ``stream``, ``completion_limit``, its offered ``tool_functions`` and its
    :class:`~server.protocol.ToolChoiceRules`. Also returns how its outputs' thinking is read
    (None: the server has no reasoning parser, or the request keeps the thinking in its content).

    A harmony output (gpt-oss's: ``--reasoning-parser harmony``, or the harmony tool format, which a
    harmony chat template selects) is detokenized with its markers, which the reader takes out: its
    analysis is reasoning where the reasoning parser is harmony, and left out otherwise."""
    eng = ready_engine(state)
    if not eng.has_chat_template:
        raise bad_request("this model has no chat template (serve it with --chat-template, or use /v1/completions)",
                          turn.param)  # fmt: skip
    syntax = state.reasoning
    if turn.thinking_budget is not None and syntax is None:
        raise bad_request("thinking_token_budget bounds a reasoning model's thinking: the server was started "
                          "without --reasoning-parser", "thinking_token_budget")  # fmt: skip
    if turn.thinking_budget is not None and not syntax.budgets:
        raise bad_request(f"thinking_token_budget is not supported with --reasoning-parser {syntax.name}: no one "
                          "token ends gpt-oss's analysis (it is a message, ended by <|end|> and followed by "
                          "another)", "thinking_token_budget")  # fmt: skip
    harmony = syntax is HARMONY or isinstance(state.tool_format, HarmonyFormat)
    messages = turn.messages
    functions = req.tool_functions
    if req.tool_choice == "none" and state.settings.exclude_tools_when_tool_choice_none:
        functions = []
    tools = [{"type": "function", "function": f} for f in functions] or None
    if not eng.chat_template_takes_tools:  # described in a system message, history in the Hermes style
        messages, tools = fallback_messages(messages, functions), None
    else:  # call ids its template takes (Mistral's refuse all but their own shape)
        messages = state.tool_format.history(messages)
    kwargs = template_kwargs(state, eng.chat_template, turn)

    def render() -> tuple[list[int], str]:
        text = eng.render_chat_text(messages, turn.add_generation_prompt, tools, turn.continue_final_message, kwargs)
        opening = _opening(eng, messages, tools, turn, kwargs, text) if syntax is not None or harmony else ""
        return eng.tokenizer.encode(text, add_special_tokens=False), opening

    try:
        prompt_ids, opening = await off_loop(render, sum(len(m["content"]) for m in messages))
    except InvalidRequestError as e:
        raise bad_request(str(e), turn.param) from None
    frame = syntax.frame(opening) if syntax is not None else None
    separate = getattr(req, "separate_reasoning", True)  # SGLang's false: the thinking stays in the content
    harmony_calls = req.parses_tool_calls and isinstance(state.tool_format, HarmonyFormat)  # calls are messages
    reader = None
    if harmony:  # markers are never content: an analysis not shown as reasoning (or inline) is left out
        visible = syntax is HARMONY and separate
        reader = HARMONY.reader(eng.tokenizer, HARMONY.frame(opening), harmony_calls, visible, inline=not separate)
    elif syntax is not None and separate:
        reader = syntax.reader(eng.tokenizer, frame, harmony_calls)
    max_tokens = req.completion_limit
    capped = max_tokens is None  # the model's default, capped at the room the prompt leaves (fit_default)
    if capped:
        max_tokens = state.sampling_defaults.get("max_tokens") or max(1, eng.max_model_len - len(prompt_ids))
    params = sampling_params(state, req, max_tokens, turn.logprobs)
    if capped:
        try:
            params = fit_default(params, prompt_ids, eng.max_model_len)
        except InvalidRequestError as e:
            raise bad_request(str(e), e.param) from None
    structured = params.structured
    if req.forces_tool_call:  # required / a named function: the calls are the output, by grammar
        calls = state.tool_format.grammar(functions, req.parallel)
        structured = StructuredOutput("grammar", calls, None, "tool_choice", closers=state.tool_format.closers)
    elif req.parses_tool_calls:  # auto: strict arguments, and a structured answer beside the calls
        composed = auto_calls(state.tool_format, functions, req.parallel, structured)
        if structured is None and composed is not None and "close_at_max_tokens" not in req.model_fields_set:
            # Text or calls: no structure for max_tokens to close (a call it cuts is dropped, as without strict).
            params = dataclasses.replace(params, close_at_max_tokens=False)
        structured = composed
    if syntax is not None:  # the grammar applies to the answer, after the thinking; a budget needs one
        structured = syntax.behind(structured, eng.tokenizer, frame, turn.thinking_budget, req.forces_tool_call)
    params = dataclasses.replace(params, structured=structured)
    if harmony:  # the markers are read (and taken out) by the reader
        params = dataclasses.replace(params, skip_special_tokens=False)
    else:  # markup that is special tokens (Mistral's [TOOL_CALLS], [THINK]): the parsers read it in the text
        kept = state.tool_format.special_ids if req.parses_tool_calls else ()
        kept += syntax.kept_ids(eng.tokenizer) if syntax is not None else ()
        if kept:
            params = dataclasses.replace(params, kept_special_ids=kept)
    ids = await prepare(eng, [prompt_ids], params)
    job = Job.admit(state, eng, request, prefix, ids, params, req.n, req.stream, req.include_usage)
    job.continuous_usage = req.continuous_usage
    return job, reader


def auto_calls(fmt: CallSyntax, functions: list[dict], parallel: bool, structured: StructuredOutput | None
               ) -> StructuredOutput | None:  # fmt: skip
    """What constrains an output under ``tool_choice`` auto. Free text and calls as the model likes,
    unless a tool says ``strict`` (its arguments then held to its schema) or the answer has a JSON
    schema (response_format: the answer matches it, or the output is calls). A harmony model, a
    regex / choice / grammar answer, and a JSON answer where the calls are the whole output too (Llama-3's
    bare JSON, the pythonic list) keep the answer's own constraint: they are not composed with calls
    (docs/structured.md)."""
    if isinstance(fmt, HarmonyFormat):  # (its channels are its own grammar's)
        return structured
    if structured is None:
        strict = any(f.get("strict") for f in functions)
        grammar = fmt.auto_grammar(functions, parallel)
        return StructuredOutput("grammar", grammar, None, "tools", closers=fmt.closers) if strict else None
    schema = json.loads(structured.spec) if structured.kind == "json" else None
    schema = {} if schema is True else schema
    if not isinstance(schema, dict) or fmt.at_start_only or structured.thinking is not None:
        return structured  # (a schema of false admits nothing: its own grammar says so)
    answer = json_answer(schema, structured.whitespace_pattern)
    grammar = fmt.auto_grammar(functions, parallel, answer)
    return StructuredOutput("grammar", grammar, None, structured.param, closers=fmt.closers)


def _opening(eng, messages: list[dict], tools, turn: ChatTurn, kwargs: dict, text: str) -> str:
    """The text the template wrote for the output's own turn: what decides whether the output starts
    inside a reasoning model's thinking. The generation prompt (the rendering less the rendering
    without it), or the final message being continued."""
    if turn.continue_final_message:
        return messages[-1].get("content") or ""
    if not turn.add_generation_prompt:
        return ""
    try:
        base = eng.render_chat_text(messages, False, tools, False, kwargs)
    except InvalidRequestError:
        return text
    return text[len(base) :] if text.startswith(base) else text


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
        turn = ChatTurn(
            messages, logprobs, req.add_generation_prompt,
            continue_final_message=req.continue_final_message, template_kwargs=req.chat_template_kwargs,
            effort=req.reasoning_effort, thinking_budget=req.thinking_token_budget,
        )  # fmt: skip
        job, reader = await chat_job(state, request, req, turn, "chatcmpl")
        tools = state.tool_format.for_tools(req.tool_functions) if req.parses_tool_calls else None
        fields = state.settings.reasoning_fields if req.include_reasoning else ()
        fmt = ChatFormat(req.logprobs, state.token_texts, tools, req.forces_tool_call, reader, fields,
                         one_call=not req.parallel)  # fmt: skip
        return await respond(job, fmt)


@dataclass
class ChoiceState:
    """One choice of a chat response, as its outputs arrive."""

    reasoning: ReasoningStream | HarmonyReasoningStream | None = None  # splits its thinking off (a reasoning model's)
    started: bool = False  # streamed: its role chunk was sent
    token_ids: list[int] = field(default_factory=list)
    thought: bool = False  # its output had a thinking part
    content: str = ""  # streamed with tools: the content so far, and how much of it went out
    sent: int = 0
    scanner: CallScanner | HarmonyCallScanner | XmlCallScanner | PythonicCallScanner | None = (
        None  # streamed forced calls: read as they are written
    )
    calls: int = 0  # streamed forced calls opened so far
    logprobs: list = field(default_factory=list)  # streamed: logprobs not yet sent with a chunk


@dataclass
class ChatFormat:
    logprobs: bool
    texts: TokenTexts
    tools: CallSyntax | None = None  # tool calls are parsed out of the text (tool_choice not none)
    forced: bool = False  # required / a named function: the answer is calls only, by grammar
    reader: ReasoningReader | HarmonyReader | None = None  # a reasoning model's thinking is split off
    reasoning_fields: tuple[str, ...] = FIELDS["both"]  # none: include_reasoning false
    one_call: bool = False  # parallel_tool_calls false: a turn's first call alone is returned (as vLLM does)
    choices: dict[int, ChoiceState] = field(default_factory=dict)

    chunk_object = "chat.completion.chunk"
    object = "chat.completion"

    def _state(self, idx: int) -> ChoiceState:
        st = self.choices.get(idx)
        if st is None:
            st = self.choices[idx] = ChoiceState(self.reader.stream() if self.reader is not None else None)
            if self.forced and self.tools is not None:
                st.scanner = self.tools.scanner()
        return st

    def adjust(self, c: CompletionOutput) -> CompletionOutput:
        self._state(c.index).token_ids.extend(c.delta_token_ids)  # one prompt: the choice's index is its own
        return c

    def usage(self, usage: dict) -> dict:
        if self.reader is not None and self.reader.visible:
            count = sum(self.reader.count(s.token_ids, s.thought) for s in self.choices.values())
            usage["completion_tokens_details"] = {"reasoning_tokens": count}
        return usage

    # -- streamed -----------------------------------------------------------------------------------------
    def stream_choices(self, i: int, idx: int, out: RequestOutput, c: CompletionOutput) -> list[dict]:
        st = self._state(idx)
        choices = []
        if not st.started:  # the role comes first, alone, once per choice
            st.started = True
            # (content null where the answer is calls alone, as OpenAI's forced calls stream: assembled, it
            # reads as the whole answer's null)
            role = {"role": "assistant", "content": None if self.forced else ""}
            choices.append({"index": idx, "delta": role, "logprobs": None, "finish_reason": None})
        if not c.delta_text and not c.finished and not c.delta_token_ids:
            return choices
        st.logprobs.extend(c.delta_logprobs or [])
        reasoning, content = c.delta_text, ""
        if st.reasoning is not None:
            reasoning, content = st.reasoning.feed(c.delta_text)
            if c.finished:
                more_reasoning, more_content = st.reasoning.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
            st.thought = st.reasoning.thought
        else:
            reasoning, content = "", c.delta_text
        deltas: list[dict] = []
        if reasoning and self.reasoning_fields:
            deltas.append(dict.fromkeys(self.reasoning_fields, reasoning))
        reason = c.finish_reason
        if st.scanner is not None:
            deltas += self._forced_stream(st, content)
            reason = "tool_calls" if reason == "stop" and st.calls else reason
        elif self.tools is not None:
            more, reason = self._tool_stream(st, content, c.finish_reason)
            deltas += more
        elif content:
            deltas.append({"content": content})
        if c.finished:
            deltas.append({})
        for k, delta in enumerate(deltas):
            last = c.finished and k == len(deltas) - 1
            text = "content" in delta or not delta.keys().isdisjoint(self.reasoning_fields)
            lp = self._take_logprobs(st) if (text or last) else None
            choices.append({"index": idx, "delta": delta, "logprobs": lp, "finish_reason": reason if last else None})
        return choices

    def _take_logprobs(self, st: ChoiceState) -> dict | None:
        """The logprobs of the tokens since the last chunk that carried some (None without logprobs)."""
        if not self.logprobs:
            return None
        entries, st.logprobs = st.logprobs, []
        return {"content": self._logprobs(entries)}

    def _forced_stream(self, st: ChoiceState, content: str) -> list[dict]:
        """Forced calls as they are written: each call's id, type and name in one delta once its name
        is complete, then its arguments piece by piece (every delta with the call's ``index``)."""
        deltas = []
        for kind, *value in st.scanner.feed(content):
            if kind == "call":
                head = {"index": st.calls, "id": scanned_call_id(self.tools, value), "type": "function",
                        "function": {"name": value[0], "arguments": ""}}  # fmt: skip
                deltas.append({"tool_calls": [head]})
                st.calls += 1
            elif kind == "args":
                deltas.append({"tool_calls": [{"index": st.calls - 1, "function": {"arguments": value[0]}}]})
        return deltas

    def _tool_stream(self, st: ChoiceState, content: str, reason: str | None) -> tuple[list[dict], str | None]:
        """Content as it comes, held back from where calls may begin; at the end, each whole call: its
        id, type and name in one delta, then its arguments in pieces (every delta with its ``index``)."""
        text = st.content = st.content + content
        out = []
        if reason is None:  # (a blank that may be all that stands before a call waits: the calls' content drops it)
            safe = len(text[: self.tools.content_end(text)].rstrip())
            if safe > st.sent:
                out.append({"content": text[st.sent : safe]})
                st.sent = safe
            return out, reason
        parsed, calls = self.tools.parse(text, cut=reason == "length")
        calls = calls[:1] if self.one_call else calls
        rest = (text if not calls else (parsed or ""))[st.sent :]  # what went out is the start of either
        if rest:
            out.append({"content": rest})
        for k, call in enumerate(calls):
            head = {"index": k, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
            out.append({"tool_calls": [head]})
            for args in argument_pieces(call.arguments):
                out.append({"tool_calls": [{"index": k, "function": {"arguments": args}}]})
        return out, ("tool_calls" if calls and reason == "stop" else reason)

    # -- whole ----------------------------------------------------------------------------------------------
    def choice(self, idx: int, text: str, logprobs: list, reason: str | None, prompt_out: RequestOutput | None) -> dict:
        st = self._state(idx)
        reasoning, content = self.reader.split(text) if self.reader is not None else (None, text)
        st.thought = reasoning is not None
        message: dict = {"role": "assistant", "content": content}
        if self.tools is not None:
            parsed, calls = self.tools.parse(content, cut=reason == "length")
            calls = calls[:1] if self.one_call else calls
            if self.forced:
                parsed = None  # the answer is calls alone (a call cut short is dropped, not shown)
            if calls or self.forced:
                message["content"] = parsed
            if calls:
                message["tool_calls"] = [c.openai() for c in calls]
                reason = "tool_calls" if reason == "stop" else reason
        if reasoning is not None:
            if not message["content"]:
                message["content"] = None
            message.update(dict.fromkeys(self.reasoning_fields, reasoning))
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
