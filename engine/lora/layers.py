"""Many LoRA adapters in one forward: every row of the batch with its own adapter, or none.

*Layout.* Each adaptable linear layer (q/k/v, o, gate/up, down: our fused modules) keeps, for
``max_loras`` slots, one block of ``P = parts * max_rank`` columns a slot: ``a [slots * P, in]`` and
``b [out, slots * P]``. A fused layer's parts (q, k, v; gate, up) each take ``max_rank`` of a slot's
columns, and a part's ``b`` fills only its own rows of the layer's output, so one pair of products
serves the whole fused layer. An adapter of a smaller rank, or one that leaves a module alone, leaves
zeros; the LoRA scale is folded into ``b`` (engine/lora/adapters.py).

*Tensor parallelism.* Each rank holds its layers' share: ``B``'s rows of a column-parallel layer
(q/k/v, gate/up), ``A``'s input columns of a row-parallel one (o, down), whose ranks each add
``B (A_r x_r)`` before the layer's all-reduce sums them to ``B A x``.

*The product* (segment-free, two matrix multiplies a layer): ``h = x a^T`` gives every row its
products with every slot's ``A``; a per-row mask keeps the columns of the row's own slot (a base-model
row keeps none), and ``delta = h b^T`` adds that slot's ``B``. The mask multiplies by exactly 0 or 1,
so a row's delta is its own adapter's sum with exact zeros between its terms: it does not depend on
which adapters the other rows use or which are loaded, and a base-model row's output is the base
layer's, bit for bit. The shapes are static (no per-adapter loop, no sync, nothing data-dependent),
so the forward can be captured in a CUDA graph: the weights and the mask are written in place. The
cost is ``2 * slots * P * (in + out)`` multiply-adds a row, next to the layer's ``in * out``. Under the
batch-invariant mode both products run on ``augur::invariant_linear``, whose order per output does
not depend on the rows beside it.

On CUDA, two Triton kernels do each row's own share instead (engine/lora/triton_lora.py): a row
gathers its slot's ``A`` and ``B`` from a device tensor of the rows' slots, the others' columns
untouched.

The weights and the mask are plain tensors of :class:`LoraSlots`, not the model's parameters or
buffers: a compiled CPU forward freezes those into its graph, and these change at run time.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

from engine.lora.adapters import Adapter, AdapterError, LoraPair

ADAPTABLE = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# From this many rows a forward's adapters take two matrix products over every slot (their other slots'
# columns zeroed) rather than the kernels' row by row gather, which re-reads a slot's weights for each
# row; not in the batch-invariant mode, where a row's sums must not depend on how many rows came with it.
DENSE_ROWS = 256


class LoraLinear(nn.Module):
    """A linear layer (any of ours: dense, packed, quantized, invariant) plus its rows' adapters."""

    def __init__(self, base: nn.Module, slots: LoraSlots, parts: list[str]) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.parts = parts  # the checkpoint slots the layer fuses (["q", "k", "v"], ["0", "1"] or ["None"])
        width = slots.max_loras * len(parts) * slots.max_rank
        self.__dict__["slots"] = slots  # not a submodule: no state, nothing for a compile to freeze
        self.__dict__["a"] = torch.zeros(width, self.in_features, dtype=slots.dtype, device=slots.device)
        self.__dict__["b"] = torch.zeros(self.out_features, width, dtype=slots.dtype, device=slots.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        slots = self.slots
        used = slots.used  # the slots up to the highest any row of this forward uses (0: none)
        if not used:
            return y
        flat = x.reshape(-1, self.in_features)
        if slots.kernel and (flat.shape[0] < DENSE_ROWS or slots.invariant):
            from engine.lora.triton_lora import lora_delta  # each row gathers its own slot

            delta = lora_delta(flat, self.a, self.b, slots.rows[: flat.shape[0]], len(self.parts) * slots.max_rank)
            return y + delta.to(y.dtype).view(y.shape)
        # Two matrix products over the slots, each row's other slots' columns zeroed: the slots up to the
        # highest a row uses, by the mask; on the kernels' device (a prefill's many rows) every slot, by
        # the rows' slots (a captured graph knows only whether any row uses one)
        rows = flat.shape[0]
        if slots.kernel:
            used = slots.max_loras
            own = (slots.rows[:rows, None] == torch.arange(used, device=flat.device)).to(self.a.dtype)
        else:
            own = slots.mask[:rows, :used]
        cols = used * len(self.parts) * slots.max_rank
        linear = torch.ops.augur.invariant_linear if slots.invariant else F.linear
        h = linear(flat.to(self.a.dtype), self.a[:cols], None)
        h = (h.view(rows, used, -1) * own[:, :, None]).view(rows, cols)
        return y + linear(h, self.b[:, :cols], None).to(y.dtype).view(y.shape)

    def extra_repr(self) -> str:
        return f"parts={self.parts}, slots={self.slots.max_loras}, max_rank={self.slots.max_rank}"


def _rank_pair(name: str, module: str, pair, cut):
    """A rank's share of ``pair`` for the rank's ``cut`` of the module's weight (``checkpoint_slice``).
    A row-parallel layer's ranks each add ``B (A_r x_r)`` before the layer's all-reduce, which sums
    them to ``B A x``."""
    if cut is None:
        return pair
    if isinstance(cut, str):
        raise AdapterError(f"adapter {name!r}: {module} cannot be sharded over tensor-parallel ranks here")
    dim, start, length = cut
    if dim == 0:
        return LoraPair(pair.a, pair.b.narrow(0, start, length))
    return LoraPair(pair.a.narrow(1, start, length), pair.b)


class LoraSlots:
    """The adapters' weights over every adaptable layer of one model, in ``max_loras`` slots, and which
    slot each row of the current forward uses. Built by :meth:`attach` on a loaded model."""

    def __init__(self, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device, invariant: bool):
        self.max_loras, self.max_rank = max_loras, max_rank
        self.dtype, self.device, self.invariant = dtype, device, invariant
        self.layers: dict[str, LoraLinear] = {}  # module path → its layer
        self.model: nn.Module | None = None
        self.mask = torch.zeros(0, max_loras, dtype=dtype, device=device)  # [rows, slots] 0/1
        self.used = 0  # slots 0 .. used - 1 are multiplied in the next forward: the highest a row uses, + 1
        # On CUDA the rows gather their own slots on two Triton kernels, which read each row's slot here
        self.kernel = device.type == "cuda" and importlib.util.find_spec("triton") is not None
        self.rows = torch.full((0,), -1, dtype=torch.int64, device=device)  # [rows] each row's slot
        self.generation = 0  # how often ``rows`` was replaced by a larger buffer (captured graphs read the old)

    @classmethod
    def attach(cls, model: nn.Module, max_loras: int, max_rank: int, rows: int, invariant: bool = False) -> LoraSlots:
        """Wrap every adaptable layer of ``model`` in a :class:`LoraLinear` over new slots, and return
        them (``rows``: the most rows a forward feeds; the mask grows if one feeds more)."""
        param = next(model.parameters())
        self = cls(
            max_loras, max_rank, param.dtype if param.is_floating_point() else torch.float32, param.device, invariant
        )
        self.model = model
        for name, module in list(model.named_modules()):
            if name.rsplit(".", 1)[-1] not in ADAPTABLE or not hasattr(module, "in_features"):
                continue
            target = f"{name}.weight"
            # a family that loads its fused tensors whole (Phi-3) is adapted whole, as PEFT adapts it
            fused = getattr(model, "streams_linear_weights", False)
            parts = sorted(s.rsplit(":", 1)[1] for s in model.expected_slots(target)) if fused else ["None"]
            layer = LoraLinear(module, self, parts)
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, layer)
            self.layers[name] = layer
        self.mask = torch.zeros(rows, max_loras, dtype=self.dtype, device=self.device)
        if self.kernel:  # one buffer from the start, so captured graphs keep reading the one they were taken over
            self.rows = torch.full((rows,), -1, dtype=torch.int64, device=self.device)
        model.lora = self
        return self

    def place(self, adapter: Adapter) -> list[tuple[LoraLinear, int, torch.Tensor, torch.Tensor]]:
        """Where each of ``adapter``'s pairs goes: (layer, part index, a, b cut to the part's rows), or
        an :class:`AdapterError` naming a module the model does not adapt or a shape not the model's."""
        model, out = self.model, []
        if adapter.rank > self.max_rank:
            raise AdapterError(
                f"adapter {adapter.name!r} has rank {adapter.rank}, over --max-lora-rank {self.max_rank}"
            )
        sharded = getattr(getattr(model, "tp", None), "size", 1) > 1
        aliases = getattr(model, "checkpoint_aliases", lambda name: ())
        # (a module that is another too, Gemma 4's keys-as-values k_proj: both adapted alike)
        pairs = [(m, pair) for module, pair in adapter.pairs.items() for m in (module, *aliases(module))]
        for module, pair in pairs:
            if sharded:  # this rank's part: B's rows of a column-parallel layer, A's inputs of a row-parallel one
                pair = _rank_pair(adapter.name, module, pair, model.checkpoint_slice(f"{module}.weight"))
            target, shard = model.weight_target(model.checkpoint_name(f"{module}.weight"))
            path = target.removesuffix(".weight")
            layer = self.layers.get(path)
            if layer is None:
                have = ", ".join(sorted({p.rsplit(".", 1)[-1] for p in self.layers}))
                raise AdapterError(
                    f"adapter {adapter.name!r} adapts {module}, which is not a layer LoRA serves on this model "
                    f"(adapted here: {have}; embeddings, the LM head and mixture experts are not)"
                )
            if str(shard) not in layer.parts:
                raise AdapterError(f"adapter {adapter.name!r}: {module} is not a part of {path} this model loads")
            part = layer.parts.index(str(shard))
            rows = layer.out_features
            if shard is not None:
                rows = model.weight_slot(target, torch.empty(layer.out_features, 0), shard).shape[0]
            if pair.a.shape[1] != layer.in_features or pair.b.shape[0] != rows:
                raise AdapterError(
                    f"adapter {adapter.name!r}: {module} maps {pair.a.shape[1]} -> {pair.b.shape[0]} features where "
                    f"the model's takes {layer.in_features} -> {rows} (an adapter of another base model?)"
                )
            out.append((layer, part, target, shard, pair))
        return out

    def load(self, slot: int, adapter: Adapter) -> None:
        """Write ``adapter`` into ``slot`` (checked first: a bad adapter changes nothing)."""
        placed = self.place(adapter)
        self.clear(slot)
        R = self.max_rank
        for layer, part, target, shard, pair in placed:
            start = (slot * len(layer.parts) + part) * R
            r = pair.rank
            layer.a[start : start + r].copy_(pair.a)
            b_rows = self.model.weight_slot(target, layer.b, shard) if shard is not None else layer.b
            b_rows[:, start : start + r].copy_(pair.b)

    def clear(self, slot: int) -> None:
        for layer in self.layers.values():
            width = len(layer.parts) * self.max_rank
            layer.a[slot * width : (slot + 1) * width].zero_()
            layer.b[:, slot * width : (slot + 1) * width].zero_()

    def graph_key(self) -> tuple[bool, int]:
        """What a captured graph of the Triton kernels' forward depends on besides its shape: whether
        any row uses a slot (a forward of base rows alone skips the adapters' products), and which
        ``rows`` buffer it reads. Valid after :meth:`set_rows`."""
        return self.used > 0, self.generation

    def set_rows(self, slots: torch.Tensor | None, rows: int, used: int) -> None:
        """The slot of each of the next forward's ``rows`` rows (``slots [rows]`` int64 on the device,
        -1 for the base model; None: every row the base model), and ``used``: the highest slot a row
        uses, + 1 (known on the host: no sync). Only slots below it are multiplied: a forward of base
        rows alone costs nothing more than the base model's, and one adapter in slot 0 a quarter of
        four. The columns left out hold exact zeros for every row, so a row's sums are the same."""
        self.used = 0 if slots is None else used
        if slots is None:
            return
        if self.kernel:
            if rows > self.rows.shape[0]:  # a new buffer: graphs captured over the old one are not replayed
                self.rows = torch.full((rows,), -1, dtype=torch.int64, device=self.device)
                self.generation += 1
            self.rows[:rows].copy_(slots[:rows])
            return
        if rows > self.mask.shape[0]:
            self.mask = torch.zeros(rows, self.max_loras, dtype=self.dtype, device=self.device)
        ids = torch.arange(self.max_loras, device=self.device)
        self.mask[:rows] = (slots[:rows, None] == ids).to(self.dtype)
