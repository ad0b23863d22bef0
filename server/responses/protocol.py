"""The Responses API's request (``POST /v1/responses``) and what it asks of the chat path.

A request is validated here into a :class:`ResponsesRequest`: its ``input`` items become chat
messages (``message`` items with text parts, ``function_call`` items as an assistant's tool calls,
``function_call_output`` items as tool results), its flat function tools the chat API's function
objects, its ``text.format`` the grammar of a ``response_format``. Every other field of OpenAI's API
is either served or refused with a 400 that names it: nothing is silently ignored.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictInt, model_validator

from server.protocol import (
    Effort,
    FieldError,
    FunctionDef,
    JsonSchemaFormat,
    ResponseFormat,
    ToolChoiceRules,
    UnsupportedError,
    _Sampling,
    check_template_kwargs,
    nulls_as_defaults,
)
from server.tools import template_call

# Fields of the chat and completions APIs that the Responses API names otherwise (or not at all).
RENAMED = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "n": None,
    "best_of": None,
    "functions": "tools",
    "function_call": "tool_choice",
    "logprobs": None,
}
# Hints that change nothing in what is generated here: accepted, echoed where OpenAI echoes them.
HINTS = {"prompt_cache_key", "prompt_cache_retention", "safety_identifier", "service_tier", "max_tool_calls",
         "client_metadata"}  # fmt: skip
# ``include`` values that change nothing here: reasoning items carry their text in the clear, never
# encrypted (so a client asking for the encrypted form, to replay it, gets items it can replay as they are).
VACUOUS_INCLUDES = {"reasoning.encrypted_content"}
# OpenAI's fields that Augur does not build: refused unless absent, null, or their default.
UNBUILT = {
    "background": "background responses are not supported: send the request and wait (or stream)",
    "conversation": "conversation objects are not supported: continue with previous_response_id",
    "prompt": "prompt templates are not supported: send the input itself",
    "context_management": "context management is not supported",
}


class FunctionTool(FunctionDef):
    """A function tool in the Responses API's flat shape: ``{"type": "function", "name", ...}``."""

    type: Literal["function"]


class NamedFunctionChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with its fields flat."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | StrictBool | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None

    def response_format(self) -> ResponseFormat:
        if self.type != "json_schema":
            return ResponseFormat(type=self.type)
        if self.schema_ is None:
            raise FieldError("text.format of type json_schema needs a schema", "text.format")
        js = JsonSchemaFormat(name=self.name or "response", description=self.description, schema=self.schema_,
                              strict=self.strict)  # fmt: skip
        return ResponseFormat(type="json_schema", json_schema=js)

    def echo(self) -> dict:
        return self.model_dump(by_alias=True, exclude_none=True)


class ReasoningConfig(BaseModel):
    """``reasoning``: ``effort`` maps to the chat template's thinking switch (as chat's
    ``reasoning_effort``); a ``summary`` asked for is not written (the reasoning item carries the
    reasoning text itself, and an empty summary)."""

    model_config = ConfigDict(extra="forbid")
    effort: Effort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # the deprecated name of summary


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(_Sampling, ToolChoiceRules):
    """``POST /v1/responses``. Augur's sampling extensions (``top_k``, ``speculative``,
    ``structured_outputs``, ...) are taken as on chat completions."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    metadata: dict[str, str] | None = None
    store: StrictBool = True
    previous_response_id: str | None = None
    include: list[str] | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["disabled", "auto"] | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    # Hints (HINTS): nothing to do for them here.
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    max_tool_calls: StrictInt | None = Field(default=None, ge=1)
    client_metadata: dict[str, Any] | None = None  # Codex CLI's description of itself
    # Extensions, as on chat completions: the chat template's variables, a thinking budget.
    chat_template_kwargs: dict[str, Any] | None = None
    thinking_token_budget: StrictInt | None = Field(default=None, ge=0)
    # Validated once, by _check: the tools as function tools, the input as chat messages.
    _function_tools: list[FunctionTool] = PrivateAttr(default_factory=list)
    _messages: list[dict] = PrivateAttr(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, body):
        if not isinstance(body, dict):
            return body
        for key, value in body.items():
            if key in UNBUILT:
                if value not in (None, False):
                    raise UnsupportedError(UNBUILT[key], key)
            elif key in RENAMED:
                better = RENAMED[key]
                hint = f": use {better}" if better else ""
                raise UnsupportedError(f"{key} is not a parameter of the Responses API{hint}", key)
            elif key not in cls.model_fields:
                raise UnsupportedError(f"Unknown parameter: '{key}'.", key)
        return nulls_as_defaults({k: v for k, v in body.items() if k not in UNBUILT}, cls)

    @model_validator(mode="after")
    def _check(self):
        self._function_tools = _function_tools(self.tools or [])
        names = [t.name for t in self._function_tools]
        if len(set(names)) != len(names):
            raise FieldError("tools must have distinct function names", "tools")
        if isinstance(self.tool_choice, NamedFunctionChoice) and self.tool_choice.name not in names:
            raise FieldError(f"tool_choice names {self.tool_choice.name!r}, which is not among tools", "tool_choice")
        if self.tool_choice == "required" and not names:
            raise FieldError("tool_choice 'required' needs tools", "tool_choice")
        opts = self.stream_options
        for name in ("include_speculation", "continuous_usage_stats"):  # chat's and completions' chunks carry them
            if opts is not None and getattr(opts, name):
                raise UnsupportedError(f"stream_options.{name} is not built for the Responses API's events: chat "
                                       "and completions streams carry it", f"stream_options.{name}")  # fmt: skip
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            raise UnsupportedError("text.verbosity other than medium is not supported", "text.verbosity")
        if self.text is not None and self.text.format is not None and self.text.format.type != "text":
            if self.structured_outputs is not None:
                raise FieldError("give text.format or structured_outputs, not both", "text.format")
            self.response_format = self.text.format.response_format()
        if self.forces_tool_call and self.structured() is not None:
            raise FieldError("a forced tool call and a text.format / structured_outputs: not both", "tool_choice")
        refused = [v for v in self.include or [] if v not in VACUOUS_INCLUDES]
        if refused:
            raise UnsupportedError(f"include values are not supported: {', '.join(refused)}", "include")
        if self.top_logprobs:
            raise UnsupportedError("top_logprobs is not supported on the Responses API", "top_logprobs")
        if self.truncation == "auto":
            raise UnsupportedError("truncation 'auto' is not supported: the input must fit the context", "truncation")
        check_template_kwargs(self.chat_template_kwargs)
        if self.metadata is not None and (
            len(self.metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in self.metadata.items())
        ):
            raise FieldError("metadata holds at most 16 pairs, keys up to 64 and values up to 512 characters",
                             "metadata")  # fmt: skip
        self._messages = input_messages(self.input)
        return self

    # -- what the chat path needs --------------------------------------------------------------------
    @property
    def tool_functions(self) -> list[dict]:
        """The offered functions as chat's function objects (a named choice offers that one; under
        ``tool_choice`` none they are shown and none is called)."""
        fns = [t.model_dump(exclude_none=True, exclude={"type"}) for t in self._function_tools]
        if isinstance(self.tool_choice, NamedFunctionChoice):
            fns = [f for f in fns if f["name"] == self.tool_choice.name]
        return fns

    @property
    def messages(self) -> list[dict]:
        """The input as chat-template messages (server.protocol.template_messages' shape)."""
        return self._messages

    @property
    def completion_limit(self) -> int | None:
        return self.max_output_tokens

    @property
    def effort(self) -> str | None:
        return self.reasoning.effort if self.reasoning is not None else None

    @property
    def input_items(self) -> list[dict]:
        """The input as items (a string is one user message), for ``GET .../input_items``."""
        if isinstance(self.input, str):
            text = [{"type": "input_text", "text": self.input}]
            return [{"id": new_id("msg"), "type": "message", "role": "user", "content": text}]
        prefixes = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
        out = []
        for item in self.input:
            kind = item.get("type", "message")
            out.append({**item, "type": kind, "id": item.get("id") or new_id(prefixes[kind])})
        return out

    def echo(self) -> dict:
        """The request's settings as a response object repeats them."""
        fmt = self.text.format.echo() if self.text is not None and self.text.format is not None else {"type": "text"}
        choice = self.tool_choice or "auto"
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "previous_response_id": self.previous_response_id,
            "reasoning": {"effort": self.effort, "summary": None},
            "store": self.store,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "text": {"format": fmt, "verbosity": "medium"},
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in self._function_tools],
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "truncation": "disabled",
            "user": self.user,
            "prompt_cache_key": self.prompt_cache_key,
            "safety_identifier": self.safety_identifier,
            "service_tier": "default",
            "background": False,
        }


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _function_tools(tools: list[dict]) -> list[FunctionTool]:
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise UnsupportedError(f"tools[{i}]: tools of type {kind!r} are not supported (only function)", "tools")
        if "function" in tool and "name" not in tool:
            raise FieldError(f"tools[{i}]: the Responses API takes function tools flat: "
                             '{"type": "function", "name", "parameters"}', "tools")  # fmt: skip
        try:
            out.append(FunctionTool.model_validate(tool))
        except ValueError as e:
            raise FieldError(f"tools[{i}]: {e}", "tools") from None
    return out


# -- input items -> chat messages --------------------------------------------------------------------------
TEXT_PARTS = {"input_text", "output_text", "text", "reasoning_text"}


def input_messages(input_: str | list[dict]) -> list[dict]:
    """``input`` as chat messages. Consecutive ``function_call`` items are one assistant turn's calls
    (joined to the assistant message right before them); a ``function_call_output`` is a tool result,
    named after its call where the call is in the same input."""
    if isinstance(input_, str):
        return [{"role": "user", "content": input_}]
    if not input_:
        raise FieldError("input must not be empty", "input")
    out: list[dict] = []
    names: dict[str, str] = {}  # call_id -> function name
    last_kind = None
    for i, item in enumerate(input_):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise FieldError(f"{where}: unknown role {role!r}", "input")
            text = _text(item.get("content"), where)
            if role == "assistant" and last_kind == "reasoning":  # the turn its reasoning item opened
                out[-1]["content"] = text
            else:
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call_id, name, args = (_string(item, k, where) for k in ("call_id", "name", "arguments"))
            names[call_id] = name
            call = template_call(call_id, name, args)
            if not (out and out[-1]["role"] == "assistant" and last_kind in ("message", "function_call", "reasoning")):
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "reasoning":
            # An earlier turn's reasoning item, replayed: its text goes with the assistant turn that
            # follows it (where reasoning models' templates read it), opened here if none is yet.
            text = _text(item.get("content") or [], where) or _summary(item.get("summary"), where)
            out.append({"role": "assistant", "content": "", "reasoning_content": text})
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, where, "output")
            message = {"role": "tool", "content": text, "tool_call_id": call_id}
            if call_id in names:
                message["name"] = names[call_id]
            out.append(message)
        else:
            raise UnsupportedError(f"{where}: items of type {kind!r} are not supported (message, function_call, "
                                   "function_call_output, reasoning)", "input")  # fmt: skip
        last_kind = kind
    return out


def _text(content: Any, where: str, field: str = "content") -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldError(f"{where}.{field} must be a string or a list of content parts", "input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append(part["refusal"])
        elif kind in TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append(part["text"])
        else:
            raise UnsupportedError(f"{where}.{field}[{j}]: content parts of type {kind!r} are not supported "
                                   "(only text)", "input")  # fmt: skip
    return "\n".join(parts)  # as chat joins them (vLLM's way)


def _summary(summary: Any, where: str) -> str:
    """A reasoning item's summary parts as text (what it has where its content was left out)."""
    if summary is None:
        return ""
    if not isinstance(summary, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                for p in summary):  # fmt: skip
        raise FieldError(f"{where}.summary must be a list of summary_text parts", "input")
    return "\n".join(p["text"] for p in summary)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise FieldError(f"{where}: {key} must be a string", "input")
    return value
