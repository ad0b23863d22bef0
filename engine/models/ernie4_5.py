"""ERNIE 4.5 (``Ernie4_5ForCausalLM``: ERNIE-4.5-0.3B) and ERNIE 4.5 MoE (``Ernie4_5_MoeForCausalLM``:
ERNIE-4.5-21B-A3B, ERNIE-4.5-300B-A47B), their text models.

What differs from Llama's:

- *RoPE turns interleaved pairs* (dimensions 2i and 2i + 1 of a head, GPT-J's layout). The q and k
  projections' rows (and biases) are reordered per head as they load, each head's even dimensions first
  and its odd ones after: the pairs become Llama's halves and Llama's attention (its fused RoPE kernel
  too) computes the same scores, since queries and keys are reordered alike and values are not touched.
  Its tables are in the model's dtype, as Llama's (transformers turns ERNIE's in float32: in bfloat16 a
  turned query may differ in its last bit). A checkpoint's linear weights are therefore not streamed
  into quantized layers (``--quantization int4`` / ``fp8`` quantize after the reorder); NF4, and
  checkpoints stored quantized, are refused (their q and k rows would reach the model unreordered).
- ``use_bias``: biases on q/k/v/o and on the dense MLPs (the releases have none).
- *the mixture* (ERNIE 4.5 MoE, :class:`ErnieMoE`): a softmax router in float32 whose experts are picked
  by the probabilities plus a learned per-expert bias (``moe_statics.e_score_correction_bias``), weighted
  by the probabilities alone, renormalized over the chosen ones (their sum at least ``moe_norm_min``);
  shared experts (``moe_num_shared_experts`` times an expert's size) added without a gate; mixtures in
  the layers ``moe_layer_start_index`` to ``moe_layer_end_index`` every ``moe_layer_interval``, dense
  MLPs elsewhere. The checkpoints' multi-token-prediction tensors (``mtp_*``) are not read.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from engine.models.glm4_moe import SigmoidRouter
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from engine.models.moe import MoEWeights, SparseMoE, largest
from engine.parallel import SINGLE, TensorParallel
from engine.quant import NF4Linear

_QK = re.compile(r"\.self_attn\.[qk]_proj\.(weight|bias)$")


def pairs_as_halves(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """A q or k projection's rows (or bias), ``head_dim`` a head, each head's interleaved pairs reordered
    as halves: its even dimensions, then its odd ones."""
    heads = t.shape[0] // head_dim
    return t.reshape(heads, head_dim // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()


class ErnieMoE(SparseMoE):
    """ERNIE 4.5's mixture (the module docstring)."""

    def __init__(self, config, tp: TensorParallel = SINGLE) -> None:
        shared = config.moe_num_shared_experts or 0
        if shared and config.use_bias:
            raise ValueError(
                "ERNIE 4.5 MoE with use_bias and shared experts is not supported (the releases have no biases)"
            )
        super().__init__(
            config.hidden_size, config.moe_intermediate_size, config.moe_num_experts, config.moe_k, True,
            config.hidden_act, tp, shared_intermediate=config.moe_intermediate_size * shared, shared_gate=False,
        )  # fmt: skip
        self.gate = SigmoidRouter(config.hidden_size, config.moe_num_experts)  # (float32 weight and expert bias)
        self.norm_min = float(config.moe_norm_min)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.gate(x), dim=-1)  # (float32 logits)
        ids = largest(probs + self.gate.e_score_correction_bias, self.top_k)[1]
        weights = probs.gather(1, ids)
        return ids, weights / weights.sum(dim=-1, keepdim=True).clamp(min=self.norm_min)


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    """ERNIE 4.5's dense model: Llama's, its RoPE pairs turned as halves (the module docstring)."""

    streams_linear_weights = False  # (the q and k rows are reordered in load_weights)

    def __init__(self, config, max_positions: int | None = None, tp: TensorParallel = SINGLE) -> None:
        if getattr(config, "quantization_config", None):
            raise ValueError(
                "a quantized ERNIE 4.5 checkpoint (GPTQ, AWQ, FP8, ...) is not supported: its q and k rows, stored "
                "quantized, would need reordering for RoPE; serve the full-precision checkpoint (with "
                "--quantization int4 or fp8 if it must be smaller)"
            )
        super().__init__(config, max_positions, tp)

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        bias = bool(getattr(config, "use_bias", False))
        return bias, bias

    def decoder_layer(self, config, i: int, qkv_bias: bool, o_bias: bool, tp: TensorParallel) -> nn.Module:
        mlp = LlamaMLP(config, bias=bool(getattr(config, "use_bias", False)), tp=tp)
        return LlamaDecoderLayer(config, i, qkv_bias, o_bias, False, tp, mlp=mlp)

    def checkpoint_skips(self, name: str) -> bool:
        """The multi-token-prediction tensors (``model.mtp_block.…``, ``model.mtp_emb_norm.…``, ...)."""
        return any(part.startswith("mtp") for part in name.split("."))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if any(isinstance(m, NF4Linear) for m in self.modules()):  # (NF4 takes q and k before they are reordered)
            raise ValueError("--quantization nf4 cannot load ERNIE 4.5 (its q and k rows are reordered as they load): "
                             "use --quantization int4 or fp8")  # fmt: skip
        super().load_weights(self._as_halves(weights))

    def _as_halves(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        head_dim = self.layers[0].self_attn.head_dim
        for name, tensor in weights:
            yield name, pairs_as_halves(tensor, head_dim) if _QK.search(name) else tensor


class Ernie4_5_MoeForCausalLM(MoEWeights, Ernie4_5ForCausalLM):
    """ERNIE 4.5 MoE: the dense model with :class:`ErnieMoE` in its sparse layers."""

    def decoder_layer(self, config, i: int, qkv_bias: bool, o_bias: bool, tp: TensorParallel) -> nn.Module:
        if not self.sparse(config, i):
            return super().decoder_layer(config, i, qkv_bias, o_bias, tp)
        return LlamaDecoderLayer(config, i, qkv_bias, o_bias, False, tp, mlp=ErnieMoE(config, tp))

    @staticmethod
    def sparse(config, i: int) -> bool:
        start, end = config.moe_layer_start_index, config.moe_layer_end_index
        end = config.num_hidden_layers - 1 if end is None or end < 0 else end
        return (i + 1) % (config.moe_layer_interval or 1) == 0 and start <= i <= end

    def checkpoint_name(self, name: str) -> str:
        name = super().checkpoint_name(name).replace(".mlp.shared_experts.", ".mlp.shared_expert.")
        return name.replace(".mlp.moe_statics.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(
            (n, t.reshape(-1) if n.endswith(".moe_statics.e_score_correction_bias") else t) for n, t in weights
        )
