"""gpt-oss (gpt-oss-20b, gpt-oss-120b): a mixture-of-experts decoder with attention sinks.

What differs from the Llama family:
- attention has biases on q/k/v/o and a learned *sink* logit per head, which joins every softmax as
  a key without a value (engine/attention: ``sinks``);
- layers alternate sliding-window (128 tokens) and full attention (``layer_types``); RoPE is YaRN-scaled;
- every MLP is a mixture (engine/models/moe.py) whose router has a bias and weighs a token's k
  experts by the softmax of their k logits; the experts' projections have biases and a clamped
  SwiGLU, ``(up + 1) * gate * sigmoid(1.702 * gate)`` with gate at most 7 and up within ±7.

The checkpoints store each layer's experts as stacked tensors, gate and up interleaved (gate in the
even rows of the fused projection): in bfloat16, ``gate_up_proj`` [E, H, 2I] and ``down_proj``
[E, I, H] (inputs first, as transformers saves them); as OpenAI ships them, in MXFP4
(``*_blocks`` / ``*_scales``, [E, out, ...]: engine/quant/mxfp4.py), dequantized to full precision at
load. :meth:`GptOssForCausalLM.load_weights` hands both to the mixture's loader one expert at a time.

Its chat format, harmony, is the tokenizer's chat template; the server reads harmony output (the
analysis channel as ``reasoning_content``, calls ``to=functions.NAME`` as ``tool_calls``) with
``--reasoning-parser harmony`` and the ``harmony`` tool parser (server/harmony.py, docs/reasoning.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from engine.models.moe import MoEWeights, SparseMoE
from engine.parallel import TensorParallel
from engine.quant.mxfp4 import BLOCK, dequantize_mxfp4

_EXPERTS = ".mlp.experts."
# The clamped SwiGLU's slope and clamp: constants of the model that older transformers' configs omit (the
# published config.json has the clamp, 7.0; transformers 5.17's GptOssConfig has neither)
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


class GptOssAttention(LlamaAttention):
    def __init__(self, config, layer_idx: int, tp: TensorParallel) -> None:
        bias = bool(getattr(config, "attention_bias", True))
        super().__init__(config, layer_idx, qkv_bias=bias, o_bias=bias, qk_norm=False, tp=tp)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))


class GptOssForCausalLM(MoEWeights, LlamaForCausalLM):
    # quantization_config methods this family reads itself (the loader lets them through)
    checkpoint_quantizations = ("mxfp4",)

    def decoder_layer(self, config, i: int, qkv_bias: bool, o_bias: bool, tp: TensorParallel) -> nn.Module:
        swiglu = (getattr(config, "swiglu_alpha", SWIGLU_ALPHA), getattr(config, "swiglu_limit", SWIGLU_LIMIT))
        moe = SparseMoE(
            config.hidden_size,
            config.intermediate_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            False,
            "silu",
            tp,
            biases=True,
            softmax_after_topk=True,
            swiglu=(float(swiglu[0]), float(swiglu[1])),
        )
        attn = GptOssAttention(config, i, tp)
        return LlamaDecoderLayer(config, i, qkv_bias, o_bias, False, tp, mlp=moe, attn=attn)

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        bias = bool(getattr(config, "attention_bias", True))
        return bias, bias

    def checkpoint_name(self, name: str) -> str:
        return super().checkpoint_name(name).replace(".mlp.router.", ".mlp.gate.")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._per_expert(weights))

    @staticmethod
    def _per_expert(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's stacked expert tensors as one weight (and bias) per expert and projection,
        the names Qwen-MoE checkpoints use; every other tensor as it is."""
        waiting: dict[tuple[str, str], dict[str, torch.Tensor]] = {}  # MXFP4 blocks without scales or back
        for name, tensor in weights:
            stem, sep, kind = name.partition(_EXPERTS)
            if not sep:
                yield name, tensor
                continue
            if kind.endswith(("_blocks", "_scales")):
                proj, _, part = kind.rpartition("_")
                got = waiting.setdefault((stem, proj), {})
                got[part] = tensor
                if len(got) == 2:
                    del waiting[(stem, proj)]
                    yield from _split(stem, proj, dequantize_mxfp4(got["blocks"], got["scales"]), "weight")
            elif kind.endswith("_bias"):
                yield from _split(stem, kind.removesuffix("_bias"), tensor.unsqueeze(-1), "bias")
            elif kind in ("gate_up_proj", "down_proj"):
                yield from _split(stem, kind, tensor.transpose(1, 2), "weight")  # [E, in, out] → [E, out, in]
            else:
                raise ValueError(f"unexpected weight in checkpoint: {name}")
        if waiting:
            (stem, proj), got = next(iter(waiting.items()))
            raise ValueError(f"checkpoint has {stem}{_EXPERTS}{proj}_{next(iter(got))} without its pair")

    def checkpoint_slice(self, name: str) -> tuple[int, int, int] | str | None:
        """Under -tp, each rank reads its slice of every expert's inner dimension: gate and up are
        interleaved, so rank r's inner rows [r I', (r+1) I') are the fused rows [2 r I', 2 (r+1) I')."""
        if self.tp.size == 1:
            return None
        stem, sep, kind = self.checkpoint_name(name).partition(_EXPERTS)
        r = self.tp.rank
        if sep:
            inter = self.get_submodule(f"{stem}.mlp").intermediate_size  # this rank's
            if kind.startswith("gate_up_proj"):
                dim = 2 if kind == "gate_up_proj" else 1  # bf16's [E, H, 2I]; blocks, scales, bias [E, 2I, ...]
                return dim, 2 * r * inter, 2 * inter
            if kind == "down_proj":  # [E, I, H]
                return 1, r * inter, inter
            if kind in ("down_proj_blocks", "down_proj_scales"):  # [E, H, I / 32, ...]
                if inter % BLOCK:
                    raise ValueError(
                        f"--tensor-parallel-size {self.tp.size} splits the experts' MXFP4 blocks: each rank's inner "
                        f"size ({inter}) must be a multiple of {BLOCK}"
                    )
                return 2, r * inter // BLOCK, inter // BLOCK
            if kind == "down_proj_bias":  # added once, by rank 0
                return None if r == 0 else "zeros"
        if name.endswith(".self_attn.sinks"):
            heads = self.layers[0].self_attn.num_heads
            return 0, r * heads, heads
        return super().checkpoint_slice(name)


def _split(stem: str, proj: str, stacked: torch.Tensor, kind: str) -> Iterator[tuple[str, torch.Tensor]]:
    """One expert's tensors from a stack [E, out, in] (a bias: [E, out, 1]); a fused gate_up's gate
    rows are the even ones, its up rows the odd ones."""
    for e in range(stacked.shape[0]):
        t = stacked[e] if kind == "weight" else stacked[e, :, 0]
        at = f"{stem}{_EXPERTS}{e}"
        if proj == "gate_up_proj":
            yield f"{at}.gate_proj.{kind}", t[0::2].contiguous()
            yield f"{at}.up_proj.{kind}", t[1::2].contiguous()
        elif proj == "down_proj":
            yield f"{at}.down_proj.{kind}", t.contiguous()
        else:
            raise ValueError(f"unexpected expert projection {stem}{_EXPERTS}{proj}")
