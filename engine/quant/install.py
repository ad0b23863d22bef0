"""A checkpoint's quantized layers, assembled into the model's own linear layers.

The model fuses q/k/v and gate/up into one linear each and cuts a rank's slices under tensor
parallelism (engine/models/llama.py: ``weight_target``, ``weight_slot``, ``checkpoint_slice``). A
format that serves its stored form (4-bit groups on the int4 kernels, FP8 weights on FP8 matmuls)
needs the same assembly of what it keeps per checkpoint module: :func:`assemble` places each module's
tensors (every one indexed by the layer's output rows first) into the fused layer's rows, as the
model's loader places the dequantized weights, and reports the layers whose every part arrived in
one shape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

logger = logging.getLogger(__name__)

Parts = tuple[torch.Tensor, ...]  # a layer's stored form: tensors whose first dimension is its output rows
# A mixture's router, by its module name: its scores pick the experts (quantized checkpoints leave it in
# full precision, and so do --quantization int4 and fp8).
ROUTERS = ("gate",)


def assemble(
    model: nn.Module,
    stored: dict[str, Parts],  # checkpoint module name → its stored form
    select: Callable[[str], object] | None,  # the model's checkpoint_slice under tensor parallelism
    rank_part: Callable[..., Parts | None],  # (form, cut, module) → a rank's part of it (None: none fits)
) -> dict[str, tuple[nn.Linear, Parts]]:
    """The stored forms of ``model``'s linear layers (by module path; the LM head left out): each
    fused layer's parts stacked along its rows in the model's slot order. A layer is left out where a
    part is missing, does not fit a rank's cut, or differs in shape from its siblings (another group
    size)."""
    layers: dict[str, _Layer] = {}  # by parameter name
    for module, form in stored.items():
        name = f"{module}.weight"
        form = rank_part(form, select(name) if select else None, module)
        target, shard = model.weight_target(model.checkpoint_name(name))
        path = target.removesuffix(".weight")
        linear = _linear(model, path)
        if linear is None or path.rsplit(".", 1)[-1] == "lm_head":
            continue
        layer = layers.get(target)
        if layer is None:
            layer = layers[target] = _Layer(linear, form)
        if form is None or layer.whole is None or len(form) != len(layer.whole):
            layer.fits = False
            continue
        for whole, part in zip(layer.whole, form):
            part = _bytes(part)
            slot = whole if shard is None else model.weight_slot(target, whole, shard)
            if slot.shape != part.shape or slot.dtype != part.dtype:
                layer.fits = False
                break
            slot.copy_(part)
        layer.filled.add(f"{target}:{shard}")
    out = {}
    for target, layer in layers.items():
        path = target.removesuffix(".weight")
        if layer.fits and layer.filled >= model.expected_slots(target):
            out[path] = (layer.linear, layer.parts())
        else:
            logger.info("%s stays dequantized (its stored parts do not fit the kernels)", path)
    return out


class _Layer:
    """One linear layer's stored form as its parts arrive: zeros of the layer's rows, filled slot by slot."""

    def __init__(self, linear: nn.Linear, first: Parts | None) -> None:
        self.linear = linear
        self.dtypes = None if first is None else tuple(t.dtype for t in first)
        rows = linear.out_features
        self.whole = None if first is None else tuple(_bytes(t).new_zeros(rows, *t.shape[1:]) for t in first)
        self.filled: set[str] = set()
        self.fits = first is not None

    def parts(self) -> Parts:
        return tuple(t.view(d) if t.dtype != d else t for t, d in zip(self.whole, self.dtypes, strict=True))


def replace(model: nn.Module, path: str, layer: nn.Module) -> None:
    parent, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, layer)


def _linear(model: nn.Module, path: str) -> nn.Linear | None:
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return None
    return module if isinstance(module, nn.Linear) else None


# 8-bit floats have no copy into a narrowed slice on every device: they travel as bytes.
def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t
