"""Model registry keyed by the ``architectures`` entry of a Hugging Face config.

Adding a family is one new file plus one line here. Entries name the module and class, imported on
first use: a process imports only the family it serves.
"""

from __future__ import annotations

import importlib

from torch import nn

MODEL_REGISTRY: dict[str, str] = {  # architecture → "module:class" under engine.models
    "ApertusForCausalLM": "apertus:ApertusForCausalLM",
    "ArceeForCausalLM": "arcee:ArceeForCausalLM",
    "DeepseekV2ForCausalLM": "deepseek_v3:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "deepseek_v3:DeepseekV3ForCausalLM",
    "Ernie4_5ForCausalLM": "ernie4_5:Ernie4_5ForCausalLM",
    "Ernie4_5_MoeForCausalLM": "ernie4_5:Ernie4_5_MoeForCausalLM",
    "Exaone4ForCausalLM": "exaone4:Exaone4ForCausalLM",
    "Gemma2ForCausalLM": "gemma2:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "gemma3:Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration": "gemma3:Gemma3TextForCausalLM",
    "Gemma4ForCausalLM": "gemma4:Gemma4ForCausalLM",
    "Gemma4ForConditionalGeneration": "gemma4:Gemma4TextForCausalLM",
    "Glm4MoeForCausalLM": "glm4_moe:Glm4MoeForCausalLM",
    "KimiK25ForConditionalGeneration": "deepseek_v3:KimiK25TextForCausalLM",
    "Kimi_K25ForConditionalGeneration": "deepseek_v3:KimiK25TextForCausalLM",
    "Glm4MoeLiteForCausalLM": "deepseek_v3:Glm4MoeLiteForCausalLM",
    "GptOssForCausalLM": "gpt_oss:GptOssForCausalLM",
    "GraniteForCausalLM": "granite:GraniteForCausalLM",
    "LlamaForCausalLM": "llama:LlamaForCausalLM",
    "MiniMaxM2ForCausalLM": "minimax_m2:MiniMaxM2ForCausalLM",
    "MistralForCausalLM": "llama:MistralForCausalLM",
    "Ministral3ForCausalLM": "mistral3:Ministral3ForCausalLM",
    "Mistral3ForConditionalGeneration": "mistral3:Mistral3TextForCausalLM",
    "Mistral4ForCausalLM": "mistral4:Mistral4ForCausalLM",
    "MixtralForCausalLM": "mixtral:MixtralForCausalLM",
    "Olmo2ForCausalLM": "olmo2:Olmo2ForCausalLM",
    "Olmo3ForCausalLM": "olmo3:Olmo3ForCausalLM",
    "Phi3ForCausalLM": "phi3:Phi3ForCausalLM",
    "Qwen2ForCausalLM": "llama:Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM": "qwen3_moe:Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM": "llama:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "qwen3_moe:Qwen3MoeForCausalLM",
    "SeedOssForCausalLM": "llama:SeedOssForCausalLM",
    "SmolLM3ForCausalLM": "smollm3:SmolLM3ForCausalLM",
}

# Multimodal architectures served by their language model alone (engine/models/text_tower.py): the
# loader hands their class the checkpoint's text_config.
TEXT_TOWERS = frozenset(
    {
        "Gemma3ForConditionalGeneration",
        "Gemma4ForConditionalGeneration",
        "Mistral3ForConditionalGeneration",
        "KimiK25ForConditionalGeneration",
        "Kimi_K25ForConditionalGeneration",
    }
)


# A multimodal architecture whose language model is of another family by its text config's model_type:
# (architecture, model_type) → "module:class", before MODEL_REGISTRY's entry for the architecture.
TOWER_DECODERS: dict[tuple[str, str], str] = {
    ("Mistral3ForConditionalGeneration", "mistral4"): "mistral4:Mistral4TextForCausalLM",  # Mistral Small 4
}


class UnsupportedModelError(ValueError):
    pass


def model_class(arch: str, model_type: str | None = None) -> type[nn.Module]:
    """The class serving architecture ``arch`` (a key of MODEL_REGISTRY), for a text config of
    ``model_type`` where TOWER_DECODERS names one."""
    module, name = TOWER_DECODERS.get((arch, model_type), MODEL_REGISTRY[arch]).split(":")
    return getattr(importlib.import_module(f"engine.models.{module}"), name)


def model_class_for(config) -> type[nn.Module]:
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return model_class(arch, getattr(config, "model_type", None))
    raise UnsupportedModelError(
        f"unsupported model architecture {archs or '(none given in config.json)'}; "
        f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
    )
