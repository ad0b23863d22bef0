"""OLMo 3 (``Olmo3ForCausalLM``): OLMo 2's decoder with sliding-window layers and RoPE by layer type.

What differs from ``engine.models.olmo2``:

- ``layer_types``: three sliding-window layers (``sliding_window`` positions, 4,096 in the releases)
  to one full-attention layer, the default pattern where a config gives none;
- ``rope_parameters`` keyed by layer type: the released long-context models scale only their
  full-attention layers' RoPE (YaRN, from the checkpoint's ``rope_scaling``), the sliding ones turn at
  the plain base. The model keeps both tables (:class:`~engine.models.layer_rope.LayerTypeRope`).

Post-norms, q/k norms over whole projections, the RMSNorm's rounding, weight names and
tensor-parallel sharding (the q/k norms' mean squares summed over ranks) are OLMo 2's.
"""

from __future__ import annotations

from torch import nn

from engine.models.layer_rope import LOCAL, LayerTypeRope, check_layer_types
from engine.models.olmo2 import Olmo2DecoderLayer, Olmo2ForCausalLM
from engine.parallel import SINGLE, TensorParallel


class Olmo3DecoderLayer(Olmo2DecoderLayer):
    """OLMo 2's layer; ``local``: a sliding-window layer, handed the local RoPE table."""

    def __init__(self, config, layer_idx: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, layer_idx, tp)
        self.local = config.layer_types[layer_idx] == LOCAL


class Olmo3ForCausalLM(LayerTypeRope, Olmo2ForCausalLM):
    """OLMo 3 causal LM over a paged KV cache: OLMo 2's model with a RoPE table per layer type (each
    layer's sliding window follows ``layer_types``, as in Llama's attention)."""

    def __init__(self, config, max_positions: int | None = None, tp: TensorParallel = SINGLE) -> None:
        check_layer_types(config, "OLMo 3")
        super().__init__(config, max_positions, tp)

    def decoder_layer(self, config, i: int, qkv_bias: bool, o_bias: bool, tp: TensorParallel) -> nn.Module:
        return Olmo3DecoderLayer(config, i, tp)
