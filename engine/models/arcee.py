"""Arcee (AFM-4.5B): Llama's decoder with an MLP that has no gate, ``down(act(up(x)))``, ReLU squared
in the release (``hidden_act: relu2``), and Llama 3's or YaRN's RoPE scaling.

:class:`UngatedMLP` is that MLP (Apertus's too, with its own activation): ``up_proj`` column-parallel,
``down_proj`` row-parallel under ``-tp``, one all-reduce, as Llama's gated MLP. Its checkpoint names
are its own (``up_proj`` is not fused with a gate).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.invariant import activation
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.parallel import SINGLE, TensorParallel


class UngatedMLP(nn.Module):
    """``down(act(up(x)))``. ``act``: an activation's name, or a module with parameters of its own
    (Apertus's xIELU), held as ``act_fn`` as the checkpoints name it."""

    def __init__(self, config, bias: bool, act: str | nn.Module, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate_size = tp.split(config.intermediate_size, "MLP inner size")  # this rank's
        self.up_proj = nn.Linear(config.hidden_size, self.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = act if isinstance(act, nn.Module) else activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.act_fn(self.up_proj(x))))


class UngatedWeights:
    """A mixin before a Llama-shaped class whose MLPs are :class:`UngatedMLP`: its fusion table fuses
    q/k/v only (Llama's would file ``up_proj`` as the second half of a gate/up pair: the loader, NF4's
    and the streamed quantizers read the table)."""

    _fused = {k: v for k, v in LlamaForCausalLM._fused.items() if k not in (".gate_proj.", ".up_proj.")}


class ArceeForCausalLM(UngatedWeights, LlamaForCausalLM):
    def decoder_layer(self, config, i: int, qkv_bias: bool, o_bias: bool, tp: TensorParallel) -> nn.Module:
        mlp = UngatedMLP(config, bool(getattr(config, "mlp_bias", False)), config.hidden_act, tp)
        return LlamaDecoderLayer(config, i, qkv_bias, o_bias, self.qk_norm, tp, mlp=mlp)
