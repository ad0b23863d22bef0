"""RoPE by layer type: models whose sliding-window and full-attention layers rotate differently.

Transformers 5 keys ``config.rope_parameters`` by layer type for these families (``sliding_attention``
and ``full_attention``, the names ``config.layer_types`` uses): Gemma 3 turns its local layers with a
base of 10 000 and its global ones with 1 000 000 (linearly scaled on the larger models); OLMo 3
scales only its full-attention layers (YaRN). :class:`LayerTypeRope` keeps one cos/sin table per type
and Llama's forward hands each layer the table of its own type (a layer's ``local`` attribute says
which).
"""

from __future__ import annotations

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.models.llama import rope_rows

LOCAL, GLOBAL = "sliding_attention", "full_attention"  # the two layer types (transformers' names)


def check_layer_types(config, family: str) -> None:
    """Refuse a config whose ``layer_types`` names a type this module does not know."""
    unknown = sorted(set(config.layer_types) - {LOCAL, GLOBAL})
    if unknown:
        raise ValueError(f"{family} layer types {unknown} are not supported (only {LOCAL} and {GLOBAL})")


def rope_tables(config, layer_type: str, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_positions, head_dim] for the layers of ``layer_type``, from that type's
    entry of ``config.rope_parameters`` (a ``default`` or a scaled RoPE, computed by transformers)."""
    by_type = getattr(config, "rope_parameters", None) or {}
    params = by_type.get(layer_type)
    if not isinstance(params, dict):
        raise ValueError(f"the config has no RoPE parameters for {layer_type} layers: {by_type}")
    rope_type = params.get("rope_type", "default")
    if rope_type == "dynamic":
        raise ValueError("dynamic NTK RoPE scaling is not supported (its frequencies change with length)")
    if rope_type == "default":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        inv_freq, scaling = 1.0 / (params["rope_theta"] ** exponents), 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", layer_type=layer_type)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


class LayerTypeRope:
    """A mixin before a Llama-shaped model class: ``rope_cos`` / ``rope_sin`` hold the full-attention
    layers' table (what code outside reads for the model's positions), ``rope_local_cos`` /
    ``rope_local_sin`` the sliding-window layers'; Llama's forward hands each layer the one its
    ``local`` names (:meth:`rope_at`, :meth:`layer_rope`)."""

    def register_rope_buffers(self) -> None:
        for name in ("rope_cos", "rope_sin", "rope_local_cos", "rope_local_sin"):  # [max_positions, head_dim]
            self.register_buffer(name, torch.empty(0), persistent=False)

    def init_buffers(self, max_positions: int) -> None:
        """(Re)compute both tables, e.g. after construction on the meta device."""
        if "rope_local_cos" not in self._buffers:  # (built by Llama's constructor, which registers the global pair)
            self.register_rope_buffers()
        device = self.embed_tokens.weight.device
        if device.type == "meta":
            return
        cos, sin = rope_tables(self.config, GLOBAL, max_positions)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)
        cos, sin = rope_tables(self.config, LOCAL, max_positions)
        self.rope_local_cos, self.rope_local_sin = cos.to(device), sin.to(device)

    def rope_at(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        """Both tables' rows for these positions, by whether a layer is local: ``(cos, sin)``, each
        ``[T, 1, D]`` in ``dtype``."""
        dtype = self.rope_dtype or dtype
        return {
            False: rope_rows(self.rope_cos, self.rope_sin, positions, dtype),
            True: rope_rows(self.rope_local_cos, self.rope_local_sin, positions, dtype),
        }

    def layer_rope(self, rope: dict[bool, tuple[torch.Tensor, torch.Tensor]], i: int):
        return rope[self.layers[i].local]
