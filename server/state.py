"""What the server keeps between requests: its settings, the engine once loaded, its metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.core.async_engine import AsyncEngine
from server.metrics import Metrics
from server.tokens import TokenTexts
from server.tools import FORMATS, ToolFormat, detect_format


@dataclass
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    max_queue_len: int = 256
    disconnect_poll_s: float = 0.2
    max_request_bytes: int = 16 * 2**20  # larger bodies get 413
    body_timeout_s: float = 30.0  # a body not received within this gets 408
    # LOSSY, opt-in: Medusa's typical acceptance (epsilon, delta) for sampling requests that do not say
    # otherwise (unseeded, temperature > 0); None: every request is verified exactly.
    typical_acceptance: tuple[float, float] | None = None
    metrics_compat: str = "vllm"  # also export vLLM's metric names ("none": only augur_*)
    # How the model writes tool calls: auto (from its chat template) | hermes | llama3_json | mistral.
    tool_call_parser: str = "auto"


@dataclass
class ServerState:
    settings: ServerSettings
    engine: AsyncEngine | None = None
    load_error: str | None = None
    token_texts: TokenTexts | None = None  # the served tokenizer's token texts, for logprobs
    metrics: Metrics = field(init=False)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.settings.served_model_name, self.settings.metrics_compat)

    @property
    def tool_format(self) -> ToolFormat:
        name = self.settings.tool_call_parser
        return detect_format(self.engine.chat_template) if name == "auto" else FORMATS[name]

    def attach(self, engine: AsyncEngine) -> None:
        self.metrics.bind_engine(engine)
        engine.step_hooks.append(self.metrics.on_step)
        engine.start()
        self.token_texts = TokenTexts(engine.tokenizer)
        self.engine = engine
