"""What the server keeps between requests: its settings, the engine once loaded, its metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.core.async_engine import EngineFront
from server.harmony import HarmonyVocab
from server.metrics import Metrics
from server.reasoning import FIELDS, SYNTAXES, HarmonySyntax, ReasoningSyntax
from server.responses.store import ResponseStore
from server.tokens import TokenTexts
from server.tool_formats import CallSyntax, tool_format


@dataclass
class ServerSettings:
    served_model_name: str
    # Bearer keys the server takes (one, or several: a stored response is readable only with its own).
    api_key: str | list[str] | None = None
    max_queue_len: int = 256
    disconnect_poll_s: float = 0.2
    max_request_bytes: int = 16 * 2**20  # larger bodies get 413
    body_timeout_s: float = 30.0  # a body not received within this gets 408
    # LOSSY, opt-in: Medusa's typical acceptance (epsilon, delta) for sampling requests that do not say
    # otherwise (unseeded, temperature > 0); None: every request is verified exactly.
    typical_acceptance: tuple[float, float] | None = None
    metrics_compat: str = "vllm"  # also export vLLM's metric names ("none": only augur_*)
    # How the model writes tool calls: auto (from its chat template) | hermes | llama3_json | mistral | harmony.
    tool_call_parser: str = "auto"
    # tool_choice none: the tools stay in the prompt (vLLM's default: the model sees them, calls none, and
    # the prompt's prefix is the one its other turns cached), unless this leaves them out.
    exclude_tools_when_tool_choice_none: bool = False
    # The Responses API's store (store: true): oldest out first past either bound.
    responses_store_max: int = 1024
    responses_store_bytes: int = 128 * 2**20
    # Chat templates: the template to serve instead of the tokenizer's (its text), and variables every
    # request's template gets unless the request sets them (chat_template_kwargs).
    chat_template: str | None = None
    default_chat_template_kwargs: dict | None = None
    # A reasoning model's thinking convention (server.reasoning.SYNTAXES), or None.
    reasoning_parser: str | None = None
    # The chat fields its thinking comes back in (--reasoning-field): DeepSeek's name, vLLM's newer one,
    # or both (each client reads the one it knows; openai-agents' stream reads both, twice the text).
    reasoning_fields: tuple[str, ...] = FIELDS["both"]
    # LoRA adapters served over the model (--lora-modules), name → directory: a request's ``model`` picks one.
    lora_modules: dict[str, str] = field(default_factory=dict)
    enable_runtime_lora: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (server/routes/lora.py)
    playground: bool = True  # the page at /playground, and / pointing to it (server/routes/playground.py)
    # Where requests' missing sampling fields come from: "auto", the model's generation_config.json;
    # "none", OpenAI's defaults (temperature 1, top_p 1).
    generation_config: str = "auto"

    @property
    def api_keys(self) -> list[str]:
        keys = [self.api_key] if isinstance(self.api_key, str) else list(self.api_key or [])
        return [k for k in keys if k]


API_KEY_SCOPE = "augur.api_key"  # the ASGI scope's entry naming the key a request came with (a digest)


@dataclass
class ServerState:
    settings: ServerSettings
    engine: EngineFront | None = None
    load_error: str | None = None
    token_texts: TokenTexts | None = None  # the served tokenizer's token texts, for logprobs
    metrics: Metrics = field(init=False)
    created: int = field(default_factory=lambda: int(time.time()))
    responses: ResponseStore = field(init=False)
    reasoning: ReasoningSyntax | HarmonySyntax | None = None  # set by attach when --reasoning-parser names one
    _tool_format: tuple[str | None, CallSyntax] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.settings.served_model_name, self.settings.metrics_compat)
        self.responses = ResponseStore(self.settings.responses_store_max, self.settings.responses_store_bytes)
        self.metrics.bind_store(self.responses)

    @property
    def tool_format(self) -> CallSyntax:
        """How the served model writes tool calls, bound to its vocabulary (built once per chat template)."""
        template = self.engine.chat_template
        if self._tool_format is None or self._tool_format[0] != template:
            self._tool_format = (template, tool_format(self.settings.tool_call_parser, template, self.engine.tokenizer))
        return self._tool_format[1]

    @property
    def sampling_defaults(self) -> dict:
        """The model's sampling defaults for requests' missing fields (none under --generation-config none)."""
        return self.engine.generation_config if self.settings.generation_config == "auto" else {}

    def attach(self, engine: EngineFront) -> None:
        try:
            if self.settings.chat_template is not None:
                engine.use_chat_template(self.settings.chat_template)
            if self.settings.reasoning_parser is not None:
                self.reasoning = SYNTAXES[self.settings.reasoning_parser]
                self.reasoning.check(engine.tokenizer)  # ValueError: not this model's markers
            if self.settings.tool_call_parser == "harmony":
                HarmonyVocab.of(engine.tokenizer, "--tool-call-parser harmony")
        except Exception:
            engine.shutdown()  # refused: an engine process would otherwise outlive the server
            raise
        self.metrics.bind_engine(engine)
        engine.step_hooks.append(self.metrics.on_step)
        engine.start()
        self.token_texts = TokenTexts(engine.tokenizer)
        self.engine = engine
