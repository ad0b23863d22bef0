"""OpenAI request schemas (pydantic) and their translation into engine sampling parameters.

The server knows nothing of tensors: it validates requests here, turns them into
:class:`SamplingParams`, and formats what the engine returns.
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from engine.request.sampling_params import SamplingParams
from engine.request.structured import StructuredOutput
from server.fields import Refused, screen
from server.tools import template_call


class FieldError(ValueError):
    """A field's value is wrong in a way its type does not say (400 naming ``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class UnsupportedError(ValueError):
    """A known OpenAI feature Augur does not implement (400, never silently ignored)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class BadBodyError(ValueError):
    """The body is not a JSON object Augur can take (400)."""


def parse_json_body(raw: bytes) -> dict:
    """Parse a request body: a JSON object, UTF-8, with no NaN/Infinity literals and no lone UTF-16
    surrogates (which JSON's ``\\ud800`` escapes can smuggle into a string, and no tokenizer takes)."""

    def no_constant(name: str):
        raise BadBodyError(f"{name} is not a valid JSON value")

    try:
        body = json.loads(raw, parse_constant=no_constant)
    except RecursionError:
        raise BadBodyError("the request body is nested too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadBodyError("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadBodyError("the request body must be a JSON object")
    if _SURROGATE.search(raw):
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise BadBodyError("the request body contains a lone UTF-16 surrogate (invalid Unicode)") from None
        except RecursionError:
            raise BadBodyError("the request body is nested too deeply") from None
    return body


_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]", re.ASCII)  # a \uD800-\uDFFF escape: check it is paired

# Integers must be integers: JSON true/false or "12" are not token ids or counts.
TokenId = Annotated[StrictInt, Field(ge=0, lt=2**31)]
Seed = Annotated[StrictInt, Field(ge=-(2**63), lt=2**64)]


class Nested(BaseModel):
    """An object inside a request: ``null`` on one of its fields is the field's default, as on the body's
    own fields (:func:`nulls_as_defaults`: ``stream_options: {"include_usage": null}`` is no usage)."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        return nulls_as_defaults(data, cls)


class TypicalAcceptance(Nested):
    model_config = ConfigDict(extra="forbid")
    epsilon: float = Field(default=0.09, gt=0.0, le=1.0)
    delta: float = Field(default=0.3, gt=0.0)


class SpeculativeOptions(Nested):
    model_config = ConfigDict(extra="forbid")
    enabled: StrictBool = True
    num_draft_tokens: StrictInt | None = Field(default=None, ge=0, le=64)
    # Pin one of the proposers the server holds (GET /version: speculative_methods); absent: chosen per step.
    method: str | None = Field(default=None, min_length=1, max_length=64)
    # LOSSY opt-in: true (Medusa's epsilon 0.09, delta 0.3), {epsilon, delta}, or false (exact even when
    # the server's --typical-acceptance is on). Absent: the server's choice.
    typical_acceptance: StrictBool | TypicalAcceptance | None = None


class Contrastive(Nested):
    """Contrastive decoding: the target as expert, the served draft model as amateur."""

    model_config = ConfigDict(extra="forbid")
    alpha: float = Field(default=0.1, gt=0.0, le=1.0)  # plausibility: at least alpha x the expert's top prob
    beta: float = Field(default=0.5, ge=0.0, le=10.0)  # strength: (1 + beta) * expert - beta * amateur


class StreamOptions(Nested):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's (guidellm sends it): usage so far on every chunk
    include_obfuscation: StrictBool = False  # OpenAI's padding against side channels: none is added here
    # Augur's: each chunk's choice carries its tokens' provenance (docs/speculative.md, "Provenance")
    include_speculation: StrictBool = False


class JsonSchemaFormat(Nested):
    """``response_format.json_schema``: OpenAI's shape (what ``chat.completions.parse`` sends)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | StrictBool | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        if self.type != "json_schema" and self.json_schema is not None:  # it would constrain nothing
            raise ValueError(f"response_format of type {self.type} takes no json_schema (use type json_schema)")
        return self

    def structured(self) -> StructuredOutput | None:
        if self.type == "json_object":
            return StructuredOutput.json_schema({"type": "object"}, "response_format")
        if self.type == "json_schema":
            schema = self.json_schema.schema_
            return StructuredOutput.json_schema({} if schema is None else schema, "response_format")
        return None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a schema), ``regex``, ``choice``,
    ``grammar`` (Lark or GBNF) or ``json_object``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | StrictBool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, max_length=4096)
    grammar: str | None = None
    json_object: StrictBool | None = None
    whitespace_pattern: str | None = None

    @model_validator(mode="after")
    def _one(self):
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            names = ", ".join(k.rstrip("_") for k in given) or "none"
            raise ValueError(
                f"structured_outputs takes exactly one of json, regex, choice, grammar, json_object (got {names})"
            )
        if self.whitespace_pattern is not None and self.json_ is None and not self.json_object:
            raise ValueError("structured_outputs.whitespace_pattern applies to json and json_object only")
        return self

    def structured(self) -> StructuredOutput:
        param = "structured_outputs"
        if self.json_object:
            return StructuredOutput.json_schema({"type": "object"}, param, self.whitespace_pattern)
        if self.json_ is not None:
            schema = self.json_
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError:
                    raise FieldError("structured_outputs.json is not valid JSON", param) from None
                if not isinstance(schema, dict | bool):
                    raise FieldError("structured_outputs.json must be a JSON schema (an object or a boolean)", param)
            return StructuredOutput.json_schema(schema, param, self.whitespace_pattern)
        if self.regex is not None:
            return StructuredOutput("regex", self.regex, None, param)
        if self.choice is not None:
            if not self.choice or any(not c for c in self.choice):
                raise FieldError("structured_outputs.choice must be a non-empty list of non-empty strings", param)
            return StructuredOutput.choice(self.choice, param)
        return StructuredOutput("grammar", self.grammar, None, param)


# apply_chat_template's own parameters: a template variable of one of these names would be taken for
# the parameter (the request has fields for those that a request may set).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip


def check_template_kwargs(kwargs: dict[str, Any] | None, param: str = "chat_template_kwargs") -> None:
    """The chat template's own variables (``enable_thinking`` ...): names of apply_chat_template's
    parameters are refused, naming the request field that sets them where there is one."""
    for key in kwargs or {}:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise FieldError(f"{param} may not set {key!r}: it is not a template variable (use the request's own "
                             "field where it has one)", param)  # fmt: skip


Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


UNIONS = (typing.Union, types.UnionType)


def nulls_as_defaults(body: Any, model: type[BaseModel]) -> Any:
    """The body less the fields sent as ``null`` whose type has no null: OpenAI's API takes null for
    "the default" on every optional field (``n``, ``stream``, ``presence_penalty`` ...), and clients
    built on its spec send it. A field whose type does have null keeps it (its null means something:
    ``max_tokens: null`` on completions runs to the context's end)."""
    if not isinstance(body, dict):
        return body
    fields = {**model.model_fields, **{f.alias: f for f in model.model_fields.values() if f.alias}}
    return {k: v for k, v in body.items() if v is not None or k not in fields or _takes_null(fields[k].annotation)}


def _takes_null(annotation: Any) -> bool:
    if annotation is Any or annotation is None or annotation is type(None):
        return True
    if typing.get_origin(annotation) is Annotated:
        return _takes_null(typing.get_args(annotation)[0])
    return (
        any(_takes_null(a) for a in typing.get_args(annotation)) if typing.get_origin(annotation) in UNIONS else False
    )


class _Sampling(BaseModel):
    """Fields shared by both endpoints; Augur's extensions come through the SDK's ``extra_body``."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: StrictInt = Field(default=1, ge=1, le=128)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: Seed | None = None
    # vLLM's: the prefix cache shares KV only among requests with the same salt
    cache_salt: str | None = Field(default=None, min_length=1)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extensions.
    top_k: StrictInt = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    no_repeat_ngram_size: StrictInt = Field(default=0, ge=0)
    use_beam_search: StrictBool = False
    best_of: StrictInt | None = Field(default=None, ge=1, le=128)
    length_penalty: float = Field(default=1.0, ge=-100.0, le=100.0)
    early_stopping: StrictBool | Literal["never"] = False
    contrastive: Contrastive | None = None
    penalty_alpha: float = Field(default=0.0, ge=0.0, le=1.0)  # > 0: contrastive search among top_k candidates
    min_tokens: StrictInt = Field(default=0, ge=0)
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=64)
    speculative: SpeculativeOptions | None = None
    # Structured outputs: OpenAI's response_format, or vLLM's structured_outputs (not both).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # A structure (forced tool calls, a schema) that max_tokens would cut is closed within it; false:
    # cut as any text is (docs/structured.md).
    close_at_max_tokens: StrictBool = True
    # SGLang's names: a regex or an EBNF (GBNF) grammar for the output; no_stop_trim keeps the stop string.
    regex: str | None = None
    ebnf: str | None = None
    no_stop_trim: StrictBool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 16:
            raise ValueError("at most 16 stop sequences are allowed")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if v is None:
            return v
        if len(v) > 1024:
            raise ValueError(f"logit_bias may hold at most 1024 tokens, got {len(v)}")
        for key, bias in v.items():
            # Plain decimal digits only: int() would also take "1_0", " 7" or "+3".
            if not (key.isascii() and key.isdigit() and int(key) < 2**31):
                raise ValueError(f"logit_bias keys must be token ids (decimal integers), got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {key}")
        return v

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.use_beam_search and self.stream:
            raise UnsupportedError("beam search does not stream: its beams are not its answers until it ends", "stream")
        if not self.use_beam_search and self.best_of is not None and self.best_of != self.n:
            raise UnsupportedError("best_of other than n needs use_beam_search (sampling returns all n)", "best_of")
        given = [name for name in ("structured_outputs", "regex", "ebnf") if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.append("response_format")
        if len(given) > 1:
            raise FieldError(f"give one of response_format, structured_outputs, regex, ebnf (got {', '.join(given)})",
                             given[-1])  # fmt: skip
        return self

    def structured(self) -> StructuredOutput | None:
        """What the output must match, if the request constrains it."""
        if self.structured_outputs is not None:
            return self.structured_outputs.structured()
        if self.regex is not None:
            return StructuredOutput("regex", self.regex, None, "regex")
        if self.ebnf is not None:
            return StructuredOutput("grammar", self.ebnf, None, "ebnf")
        return self.response_format.structured() if self.response_format is not None else None

    def typical(self) -> tuple[float, float] | None:
        """The typical acceptance the request itself asked for (None: not asked for, or refused)."""
        opt = self.speculative.typical_acceptance if self.speculative is not None else None
        if opt is None or opt is False:
            return None
        opt = TypicalAcceptance() if opt is True else opt
        return (opt.epsilon, opt.delta)

    @classmethod
    def _screened(cls, body, endpoint: str):
        """The body less the fields that change nothing here (server/fields.py); a 400 naming any field
        that asks for what is not built, or that nothing knows."""
        declared = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        try:
            return nulls_as_defaults(screen(body, declared, endpoint), cls)
        except Refused as e:
            raise UnsupportedError(str(e), e.param) from None

    def default(self, name: str, defaults: dict | None, fallback):
        """A sampling field's value: the request's, else the model's default (generation_config.json,
        ``--generation-config auto``), else ``fallback``."""
        value = getattr(self, name) if name in self.model_fields_set else None
        if value is not None:
            return value
        return (defaults or {}).get(name, fallback)

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        typical_default: tuple[float, float] | None = None,
        defaults: dict | None = None,
    ):
        """``defaults``: the model's own sampling defaults, for the fields the request leaves out."""
        params = SamplingParams(
            n=self.n,
            temperature=float(self.default("temperature", defaults, 1.0)),
            top_p=float(self.default("top_p", defaults, 1.0)),
            top_k=int(self.default("top_k", defaults, 0)),
            min_p=float(self.default("min_p", defaults, 0.0)),
            repetition_penalty=float(self.default("repetition_penalty", defaults, 1.0)),
            no_repeat_ngram_size=self.no_repeat_ngram_size,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            seed=self.seed,
            cache_salt=self.cache_salt,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output or self.no_stop_trim,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            speculative=None if self.speculative is None or self.speculative.enabled else False,
            num_draft_tokens=(
                self.speculative.num_draft_tokens if self.speculative is not None and self.speculative.enabled else None
            ),
            speculative_method=self.speculative.method if self.speculative is not None else None,
            typical_acceptance=self.typical(),
            use_beam_search=self.use_beam_search,
            best_of=self.best_of,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
            contrastive=(self.contrastive.alpha, self.contrastive.beta) if self.contrastive is not None else None,
            penalty_alpha=self.penalty_alpha,
            structured=self.structured(),
            close_at_max_tokens=self.close_at_max_tokens,
            include_speculation=bool(self.stream_options and self.stream_options.include_speculation),
        )
        unsaid = self.speculative is None or self.speculative.typical_acceptance is None
        plain = not (params.use_beam_search or params.contrastive or params.contrastive_search)
        if typical_default is not None and unsaid and not params.greedy and params.seed is None and plain:
            # The server's lossy default reaches only unseeded sampling requests that said nothing.
            params = dataclasses.replace(params, typical_acceptance=typical_default)
        return params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    json_schema: str | None = None  # SGLang's: a JSON schema (as text) for the output
    # 0 with echo scores the prompt (its logprobs, nothing generated): the classic way to score a text.
    max_tokens: StrictInt | None = Field(default=16, ge=0)
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    echo: StrictBool = False
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v):
        """One clear message for a prompt of the wrong shape (not one per branch of the union); the
        range of token ids is the engine's to check, against the vocabulary."""

        def ids(x) -> bool:
            return isinstance(x, list) and all(type(t) is int for t in x)

        if isinstance(v, str) or (
            isinstance(v, list) and (all(isinstance(x, str) for x in v) or ids(v) or all(ids(x) for x in v))
        ):
            return v
        raise ValueError(
            "prompt must be a string, a list of strings, a list of token ids (integers) or a list of such lists"
        )

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, str):
            return v
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and all(isinstance(x, list) for x in v) and any(not x for x in v):
            raise ValueError("token-id prompts must not be empty")
        return v

    @model_validator(mode="before")
    @classmethod
    def _fields(cls, body):
        return cls._screened(body, "completions")

    @model_validator(mode="after")
    def _unsupported(self):
        if self.json_schema is not None:  # SGLang's field: the schema as structured_outputs' json
            if self.structured() is not None:
                raise FieldError("give one of response_format, structured_outputs, regex, ebnf, json_schema",
                                 "json_schema")  # fmt: skip
            self.structured_outputs = StructuredOutputs(json=self.json_schema)
        if self.suffix:
            raise UnsupportedError("suffix is not supported", "suffix")
        if self.max_tokens == 0 and not self.echo:
            raise UnsupportedError(
                "max_tokens 0 generates nothing: it is for scoring a prompt, with echo true", "max_tokens"
            )
        return self

    @property
    def scores_only(self) -> bool:
        """``max_tokens: 0`` with ``echo``: the prompt back with its logprobs, no token generated."""
        return self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ToolCallFunction(Nested):
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it back


class MessageToolCall(Nested):
    """An assistant message's ``tool_calls`` entry, replayed in the history."""

    id: str = ""
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this result answers
    # assistant: its thinking, replayed (vLLM's reasoning_content, and its newer name reasoning)
    reasoning_content: str | None = None
    reasoning: str | None = None
    function_call: Any = None  # the legacy calling's: refused unless null (check_messages)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise UnsupportedError(
                    f"content parts of type {part.get('type')!r} are not supported (only text)", "messages"
                )
            parts.append(part["text"])
        return "\n".join(parts)  # as vLLM joins them


def check_messages(messages: list[ChatMessage]) -> None:
    if not messages:
        raise ValueError("messages must not be empty")
    for i, m in enumerate(messages):
        if m.role not in ("system", "developer", "user", "assistant", "tool"):
            if m.role == "function":
                raise UnsupportedError(
                    f"messages[{i}]: role 'function' (the legacy function calling) is not supported; use tools",
                    "messages",
                )
            raise ValueError(f"messages[{i}]: unknown role {m.role!r}")
        if m.tool_calls and m.role != "assistant":
            raise ValueError(f"messages[{i}]: only assistant messages carry tool_calls")
        if m.function_call is not None:
            raise UnsupportedError(
                f"messages[{i}]: function_call (the legacy function calling) is not supported; replay the call "
                "as tool_calls",
                "messages",
            )


def check_continuation(req, last_role: str) -> None:
    """``continue_final_message``: the output continues the last message, which must be the
    assistant's, and no new turn is opened (``add_generation_prompt`` true is a contradiction)."""
    if not req.continue_final_message:
        return
    if "add_generation_prompt" in req.model_fields_set and req.add_generation_prompt:
        raise FieldError("continue_final_message and add_generation_prompt cannot both be true",
                         "continue_final_message")  # fmt: skip
    if last_role != "assistant":
        raise FieldError("continue_final_message continues an assistant message: the last message must be one",
                         "continue_final_message")  # fmt: skip


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as chat templates expect them: 'developer' is OpenAI's newer name for 'system'; an
    assistant's tool calls carry their arguments as an object (what templates serialise), a tool
    result its call id and name."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            d["tool_calls"] = [template_call(c.id, c.function.name, c.function.arguments) for c in m.tool_calls]
        thinking = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if m.role == "assistant" and thinking is not None:
            d["reasoning_content"] = thinking  # what reasoning models' templates read (Qwen3's)
        if m.role == "tool":
            d["tool_call_id"] = m.tool_call_id or ""
        if m.name:  # a participant's name (OpenAI's, on any role), or the function a tool result answers
            d["name"] = m.name
        out.append(d)
    return out


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None  # the arguments are always enforced under required / a named choice


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ToolChoiceRules:
    """What ``tools``, ``tool_choice`` and ``parallel_tool_calls`` decide, for the chat and the
    Responses API alike (they write a named function differently: a model, where the others are
    strings)."""

    tools: list | None
    tool_choice: Any
    parallel_tool_calls: bool | None

    @property
    def names_a_function(self) -> bool:
        return isinstance(self.tool_choice, BaseModel)

    @property
    def forces_tool_call(self) -> bool:
        """``required`` or a named function: the output is calls, by grammar."""
        return bool(self.tools) and (self.tool_choice == "required" or self.names_a_function)

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def parallel(self) -> bool:
        """Several calls in one turn: allowed unless asked otherwise; a named choice makes one."""
        return self.parallel_tool_calls is not False and not self.names_a_function


class ChatCompletionRequest(_Sampling, ToolChoiceRules):
    messages: list[ChatMessage]
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    tools: list[ToolDef] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    functions: Any = None
    function_call: Any = None
    add_generation_prompt: StrictBool = True
    # vLLM's: the output continues the final (assistant) message, rendered without its end.
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None  # the template's own variables (enable_thinking, ...)
    reasoning_effort: Effort | None = None
    thinking_token_budget: StrictInt | None = Field(default=None, ge=0)  # vLLM's: thinking tokens, then its end
    include_reasoning: StrictBool = True  # vLLM's: false leaves the thinking's fields out
    separate_reasoning: StrictBool = True  # SGLang's: false leaves the thinking inside content, as written

    @model_validator(mode="before")
    @classmethod
    def _fields(cls, body):
        return cls._screened(body, "chat")

    @model_validator(mode="after")
    def _check(self):
        check_messages(self.messages)
        check_continuation(self, self.messages[-1].role)
        check_template_kwargs(self.chat_template_kwargs)
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise UnsupportedError(f"{name} (the legacy function calling) is not supported: use tools", name)
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise FieldError("tools must have distinct function names", "tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            name = self.tool_choice.function.name
            raise FieldError(f"tool_choice names {name!r}, which is not among tools", "tool_choice")
        if self.tool_choice == "required" and not names:
            raise FieldError("tool_choice 'required' needs tools", "tool_choice")
        if self.forces_tool_call and self.structured() is not None:
            raise FieldError("a forced tool call and a response_format / structured_outputs: not both", "tool_choice")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def chat_messages(self) -> list[dict]:
        return template_messages(self.messages)

    @property
    def tool_functions(self) -> list[dict]:
        """The offered functions (OpenAI function objects); a named choice offers that one. Under
        ``tool_choice`` none they are shown and none is called (``parses_tool_calls``)."""
        if not self.tools:
            return []
        fns = [t.function.model_dump(exclude_none=True) for t in self.tools]
        if isinstance(self.tool_choice, NamedToolChoice):
            fns = [f for f in fns if f["name"] == self.tool_choice.function.name]
        return fns

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """``POST /tokenize``, in vLLM's shape: a ``prompt`` (tokenized as /v1/completions tokenizes it) or
    chat ``messages`` (rendered with the chat template as /v1/chat/completions renders them)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDef] | None = Field(default=None, max_length=128)  # rendered as chat renders them
    # Default: true for a prompt (BOS as completions add it), false for messages (the template has it).
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: StrictBool = False

    @model_validator(mode="before")
    @classmethod
    def _screen(cls, body):
        """A field it does not declare is refused or dropped as chat's are (server/fields.py), never ignored."""
        declared = set(cls.model_fields)
        try:
            return screen(body, declared, "tokenize")
        except Refused as e:
            raise FieldError(str(e), e.param) from None

    @model_validator(mode="after")
    def _check(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt (a string) or messages, not both")
        if self.tools is not None and self.messages is None:
            raise FieldError("tools are rendered with messages, not with a prompt", "tools")
        if self.messages is not None:
            check_messages(self.messages)
        both = self.continue_final_message and self.add_generation_prompt
        if both and "add_generation_prompt" in self.model_fields_set:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.chat_template_kwargs is not None and self.messages is None:
            raise FieldError("chat_template_kwargs apply to messages, not to a prompt", "chat_template_kwargs")
        check_template_kwargs(self.chat_template_kwargs)
        return self

    @property
    def special_tokens(self) -> bool:
        return self.add_special_tokens if self.add_special_tokens is not None else self.messages is None


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``, in vLLM's shape."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[TokenId]


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


Finish = Literal["stop", "length", "abort", "error"]
