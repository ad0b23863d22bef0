"""Model registry keyed by the ``architectures`` entry of a Hugging Face config.

Adding a family is one new file plus one line here.
"""

from __future__ import annotations

from torch import nn

from engine.models.gemma2 import Gemma2ForCausalLM
from engine.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


class UnsupportedModelError(ValueError):
    pass


def model_class_for(config) -> type[nn.Module]:
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise UnsupportedModelError(
        f"unsupported model architecture {archs or '(none given in config.json)'}; "
        f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
    )
