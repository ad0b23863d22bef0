"""Apertus (the Swiss AI models, 8B and 70B): Llama's decoder with q and k normalized per head (Qwen3's
norms), an MLP without a gate (``engine.models.arcee.UngatedMLP``) whose activation is xIELU, and
Llama 3's RoPE scaling. Its layer norms are named ``attention_layernorm`` and ``feedforward_layernorm``.

xIELU (arXiv 2411.13010) has two learned parameters a layer, kept as pre-softplus values
(``alpha_p``, ``alpha_n``) with two constants (``beta``, ``eps``) beside them in the checkpoint::

    a_p = softplus(alpha_p);  a_n = beta + softplus(alpha_n)
    f(x) = a_p x^2 + beta x               for x > 0
           a_n (expm1(min(x, eps)) - x) + beta x   otherwise

computed in the model's dtype, as transformers' Python version computes it.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.arcee import UngatedMLP, UngatedWeights
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.parallel import TensorParallel


class XIELU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # (all four from the checkpoint; transformers keeps beta and eps as buffers it saves)
        self.alpha_p, self.alpha_n = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
        self.beta, self.eps = nn.Parameter(torch.zeros(())), nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a_p = nn.functional.softplus(self.alpha_p)
        a_n = self.beta + nn.functional.softplus(self.alpha_n)
        negative = (torch.expm1(torch.minimum(x, self.eps)) - x) * a_n + self.beta * x
        return torch.where(x > 0, a_p * x * x + self.beta * x, negative)


class ApertusForCausalLM(UngatedWeights, LlamaForCausalLM):
    qk_norm = True
    _NORMS = {".attention_layernorm.": ".input_layernorm.", ".feedforward_layernorm.": ".post_attention_layernorm."}

    def decoder_layer(self, config, i: int, qkv_bias: bool, o_bias: bool, tp: TensorParallel) -> nn.Module:
        if config.hidden_act != "xielu":
            raise ValueError(f"Apertus with hidden_act {config.hidden_act!r} is not supported (only xielu)")
        mlp = UngatedMLP(config, bool(getattr(config, "mlp_bias", False)), XIELU(), tp)
        return LlamaDecoderLayer(config, i, qkv_bias, o_bias, self.qk_norm, tp, mlp=mlp)

    def checkpoint_name(self, name: str) -> str:
        name = super().checkpoint_name(name)
        for theirs, ours in self._NORMS.items():
            name = name.replace(theirs, ours)
        return name
