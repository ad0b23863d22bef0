"""Linear layers on prepacked weights, for CPU inference.

On a CPU, a plain ``F.linear`` with more than one row (a verify forward, a batch) repacks the whole
weight matrix into the GEMM kernel's blocked layout on every call: for a model whose weights do not
fit in cache that doubles its memory traffic, so a 5-token verify forward cost 1.5x a 1-token one.
oneDNN can keep the weights in its blocked layout once and for all (``_reorder_linear_weight``);
its matmul then reads each weight once per forward, whatever the number of rows. On the demo
target that makes a 1-token forward's matmuls 1.6x faster and a 5-token one's 2x faster, which is
what speculation needs: verifying a draft tree should cost about what decoding one token does.

oneDNN's per-call overhead (tens of microseconds) only pays off when the weights stream from
memory: a small model whose weights stay in the CPU's caches (the 2.5M-parameter demo draft) runs
faster unpacked (1.2 vs 2.3 ms a forward), so only models whose linear weights exceed
:data:`MIN_PACKED_BYTES` are packed.

The packed weight replaces the original (no extra memory), so packing is for inference only.
"""

from __future__ import annotations

import torch
from torch import nn

MIN_PACKED_BYTES = 32 * 2**20  # about a large L3 cache


def linear_weight_bytes(model: nn.Module) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, nn.Linear))


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous()))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed, self.bias, "none", [], "")
        return y.view(*lead, self.out_features)


def pack_linears(model: nn.Module, layer: type[nn.Module] = PackedLinear) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a ``layer(weight, bias)`` (:class:`PackedLinear`, or a
    subclass: ``engine.models.small_linear.SmallRowsLinear``; or ``engine.models.invariant.InvariantLinear``);
    returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, layer(child.weight, child.bias))
                count += 1
    return count
