"""Linear layers converted as the checkpoint streams in, so a quantized model's load never holds its
full-precision weights.

Converting after the load (quantize every linear of a loaded model) peaks at the full-precision
model: a 70B model in bfloat16 is 140 GB before it becomes 70 GB of FP8 or 37 GB of int4, and an
80 GB GPU cannot hold it. So, before the model is allocated, :class:`StreamedLayers` swaps every
linear layer it converts for a :class:`Pending` one that holds no weight (its bias, if any, still
loads as a parameter); it then takes those layers' weights out of the stream the model loads,
gathers each layer's checkpoint tensors into one full-precision buffer of its rows (the parts of a
fused q/k/v or gate/up layer, in the slots the model's own loader would fill), and the moment the
last part has arrived hands the layer to ``convert`` (quantize it, or serve the checkpoint's stored
form) and frees the buffer. The load peaks at the converted model plus the layers in flight: one
or two with a checkpoint in the usual per-layer order.

The placement is the model's own: ``checkpoint_name``, ``weight_target``, ``weight_slot`` and
``expected_slots`` (engine/models/llama.py), the names the families that load through Llama's
``load_weights`` declare. A family that reads its linears otherwise (Phi-3's fused checkpoint
tensors, a multimodal checkpoint's prefixed names) says ``streams_linear_weights = False`` and is
converted after its load instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from engine.quant.install import replace

# (module path, the loaded full-precision layer) → the layer to serve, or None to serve it as it is
Convert = Callable[[str, nn.Linear], nn.Module | None]


class Pending(nn.Module):
    """A linear layer whose weight has not arrived: its shape, and its bias as a parameter (a bias
    loads as it always does, into the fused rows it fills)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a linear layer was called before its checkpoint weight arrived")


class StreamedLayers:
    """Every ``nn.Linear`` of ``model`` but ``skip`` (by last name), converted by ``convert`` as its
    weight completes; build it before the model is allocated (on the meta device), load the model
    from :meth:`intercept`'s stream (on the model's device), then call :meth:`finish`."""

    def __init__(
        self, model: nn.Module, convert: Convert, dtype: torch.dtype, skip: tuple[str, ...] = ("lm_head",)
    ) -> None:
        self.model = model
        self.dtype = dtype  # the model's: a layer left in full precision holds its weight so
        self.convert = convert
        self.layers: dict[str, Pending] = {}  # module path → its placeholder, until converted
        for name, module in list(model.named_modules()):
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in skip:
                layer = Pending(module.in_features, module.out_features, module.bias is not None)
                replace(model, name, layer)
                self.layers[name] = layer
        self.buffers: dict[str, torch.Tensor] = {}  # module path → its full-precision rows so far
        self.filled: dict[str, set[str]] = {}
        self.converted = 0  # how many layers ``convert`` replaced
        self.in_flight = 0  # bytes of the buffers held now
        self.peak_bytes = 0  # the most bytes of full-precision weights held at once

    def intercept(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``weights`` without the converted layers' weights, each taken into its layer's buffer."""
        model = self.model
        for key, tensor in weights:
            name = model.checkpoint_name(key)
            target, shard = model.weight_target(name)
            path = target.removesuffix(".weight")
            if not target.endswith(".weight") or path not in self.layers:
                yield key, tensor
                continue
            layer = self.layers[path]
            buffer = self.buffers.get(path)
            if buffer is None:
                buffer = torch.empty(layer.out_features, layer.in_features, dtype=self.dtype, device=tensor.device)
                self.buffers[path] = buffer
                self.in_flight += buffer.nbytes
                self.peak_bytes = max(self.peak_bytes, self.in_flight)
            slot = buffer if shard is None else model.weight_slot(target, buffer, shard)
            if slot.shape != tensor.shape:
                raise ValueError(
                    f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, model {tuple(slot.shape)}"
                )
            slot.copy_(tensor)
            filled = self.filled.setdefault(path, set())
            filled.add(f"{target}:{shard}")
            if filled >= model.expected_slots(target):
                self._complete(path)

    def _complete(self, path: str) -> None:
        placeholder = self.layers.pop(path)
        weight = self.buffers.pop(path)
        del self.filled[path]
        linear = nn.Linear(placeholder.in_features, placeholder.out_features, bias=False, device="meta")
        linear.weight = nn.Parameter(weight, requires_grad=False)
        linear.bias = placeholder.bias
        replace(self.model, path, linear)  # in place first: ``convert`` may read it from the model
        served = self.convert(path, linear)
        if served is not None:
            replace(self.model, path, served)
            self.converted += 1
        self.in_flight -= weight.nbytes

    def finish(self) -> None:
        """Check that every swapped layer's weight arrived whole."""
        if self.layers:
            path = sorted(self.layers)[0]
            got = sorted(self.filled.get(path, ()))
            more = f" (and {len(self.layers) - 1} more layers)" if len(self.layers) > 1 else ""
            raise ValueError(f"checkpoint is missing the weight of {path}{more}" + (f"; it has {got}" if got else ""))
