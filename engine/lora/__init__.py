"""LoRA adapters over one base model: PEFT's format read and checked (:mod:`engine.lora.adapters`), and
many adapters served in one forward (:mod:`engine.lora.layers`)."""

from engine.lora.adapters import Adapter, AdapterError, LoraPair, read_adapter
from engine.lora.layers import LoraLinear, LoraSlots

__all__ = ["Adapter", "AdapterError", "LoraLinear", "LoraPair", "LoraSlots", "read_adapter"]
