"""Mixture-of-experts feed-forward blocks: a router picks each token's top-k experts (gated MLPs) and
the block returns their outputs weighted by the router's probabilities.

Terms: ``E`` experts, each a gated MLP of inner size ``I`` (``moe_intermediate_size``); ``k``
(``num_experts_per_tok``) experts per token; a *slot* is one (token, choice) pair, ``T * k`` of them.

How the experts run (``augur::moe_experts``): the slots are sorted by expert, so that each expert's
rows are one contiguous block multiplied in one matrix product per projection, not one call per
token; the outputs go back to slot order and each token's ``k`` outputs are summed in its choice
order (first choice first) in float32, element by element, then rounded once to the hidden dtype.
That sum's order depends on nothing but the token, so a token's output is the same whatever else is
in the step as long as each expert's product is: under the batch-invariant mode the products run on
``augur::invariant_linear`` and the activation on ``augur::invariant_act_mul``
(engine/models/invariant.py), which keep a row's bits whatever rows come with it.

The operator is opaque to ``torch.compile`` (how many rows each expert gets is data the host reads:
one sync a layer), so a compiled forward compiles around it instead of recompiling per routing. On
CUDA it runs Triton kernels instead (engine/models/moe_triton.py): no sync, one launch per
projection, so a mixture's forward is captured in CUDA graphs like a dense one's; the routing
(``augur::moe_route``) is one kernel there too under the fused operators.

Tensor parallelism (``-tp``) splits every expert like a dense MLP, each rank holding its slice of
each expert's inner dimension (Megatron's layout, every rank's experts all of them): the router is
replicated, so every rank routes alike, and the block's partial sums take one all-reduce, as a dense
MLP's do. Whole experts per rank (expert parallelism) would balance worse at decode batch sizes,
where a step's few tokens touch few experts.

Mixtral, Qwen2-MoE and Qwen3-MoE route the same way (softmax over the experts' logits in float32,
the top k, optionally renormalized to sum to one: ``norm_topk_prob``; Mixtral always renormalizes);
Qwen2-MoE adds a *shared expert*, a dense MLP every token goes through, scaled by a sigmoid gate.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from types import SimpleNamespace

import torch
from torch import nn

from engine.models.invariant import ACTIVATIONS, activation
from engine.models.llama import LlamaMLP, layer_slice
from engine.parallel import SINGLE, TensorParallel

_lib = torch.library.Library("augur", "FRAGMENT")
_lib.define(
    "moe_experts(Tensor x, Tensor ids, Tensor weights, Tensor gate_up, Tensor down, Tensor? gate_up_bias, "
    "Tensor? down_bias, str act, str ops, float alpha=1.0, float limit=0.0) -> Tensor"
)

_lib.define("moe_route(Tensor logits, int top_k, bool renormalize, bool softmax_after_topk) -> (Tensor, Tensor)")

OPS = ("eager", "invariant", "fused")  # the products' and activation's operators (see SparseMoE.ops)
CLAMPED_SWIGLU = "clamped_swiglu"  # gpt-oss's expert activation (see _clamped_swiglu)


def _clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float, ops: str) -> torch.Tensor:
    """gpt-oss's activation: ``(up + 1) * gate * sigmoid(alpha * gate)``, gate clamped above at
    ``limit`` and up to ``[-limit, limit]``. Under the invariant operators it runs as
    ``silu(alpha * gate) * (up + 1) / alpha`` on ``augur::invariant_act_mul`` (the same function, its
    sigmoid on a kernel that treats every element alike)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    if ops == "invariant":
        return torch.ops.augur.invariant_act_mul(torch.cat([gate * alpha, (up + 1) / alpha], dim=-1), "silu")
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _act_mul(gate_up: torch.Tensor, act: str, ops: str, alpha: float = 1.0, limit: float = 0.0) -> torch.Tensor:
    if act == CLAMPED_SWIGLU:
        return _clamped_swiglu(gate_up, alpha, limit, ops)
    if ops == "invariant":
        return torch.ops.augur.invariant_act_mul(gate_up, act)
    if ops == "fused":
        return torch.ops.augur.fused_act_mul(gate_up, act)
    gate, up = gate_up.chunk(2, dim=-1)
    return ACTIVATIONS[act](gate) * up


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, ops: str) -> torch.Tensor:
    if ops == "invariant":
        return torch.ops.augur.invariant_linear(x, w, b)
    return torch.nn.functional.linear(x, w, b)


def moe_experts(
    x, ids, weights, gate_up, down, gate_up_bias, down_bias, act: str, ops: str, alpha: float = 1.0, limit: float = 0.0
) -> torch.Tensor:
    """x [T, H]; ids [T, k] the chosen experts; weights [T, k] float32 their router weights;
    gate_up [E, 2I, H] (gate rows, then up rows); down [E, H, I]; the biases [E, 2I] and [E, H] or
    None. ``alpha`` and ``limit``: the clamped SwiGLU's (``act`` "clamped_swiglu"). Returns [T, H] in
    x's dtype."""
    T, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # slots grouped by expert, in slot order within one
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    rows = x.index_select(0, order // k)
    out = torch.empty(T * k, down.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            b1 = None if gate_up_bias is None else gate_up_bias[e]
            b2 = None if down_bias is None else down_bias[e]
            h = _act_mul(_linear(rows[start : start + n], gate_up[e], b1, ops), act, ops, alpha, limit)
            out[start : start + n] = _linear(h, down[e], b2, ops)
            start += n
    by_slot = torch.empty_like(out)
    by_slot[order] = out
    by_slot = by_slot.view(T, k, -1)
    acc = by_slot[:, 0].float() * weights[:, :1]
    for j in range(1, k):  # the token's choices in order, each product and sum rounded alone
        acc = acc + by_slot[:, j].float() * weights[:, j : j + 1]
    return acc.to(x.dtype)


_lib.impl("moe_experts", moe_experts, "CompositeExplicitAutograd")
torch.library.register_fake("augur::moe_experts", lambda x, *_, **__: torch.empty_like(x), lib=_lib)


def moe_route(
    logits: torch.Tensor, top_k: int, renormalize: bool, softmax_after_topk: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] the router's → (ids [T, k] int64, weights [T, k] float32): each token's experts,
    most probable first. The softmax over every expert in float32, its k largest (``renormalize``:
    divided by their sum: ``norm_topk_prob``); or (``softmax_after_topk``, gpt-oss) the k largest
    logits and the softmax of those. On CUDA one Triton kernel (engine/models/moe_triton.py).

    Of equal values the lower-numbered expert comes first, here and in the kernel: bfloat16 router
    logits tie often (two of 128 experts, or the k-th and the next of 8), and ``torch.topk`` leaves
    the order of ties unspecified, which at the k-th place decides which expert a token reads."""
    if softmax_after_topk:
        top, ids = largest(logits, top_k)
        return ids, torch.softmax(top.float(), dim=-1)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = largest(probs, top_k)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def largest(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of each row's k largest, largest first, a tie taken by the lower index."""
    top, ids = torch.sort(values, dim=-1, descending=True, stable=True)
    return top[..., :k], ids[..., :k]


def _fake_route(logits, top_k, *_):
    shape = (logits.shape[0], top_k)
    return logits.new_empty(shape, dtype=torch.int64), logits.new_empty(shape, dtype=torch.float32)


_lib.impl("moe_route", moe_route, "CompositeExplicitAutograd")
torch.library.register_fake("augur::moe_route", _fake_route, lib=_lib)


class SparseMoE(nn.Module):
    """A mixture-of-experts MLP block (see the module docstring). Parameters: ``gate`` (the router,
    [E, H]), ``experts_gate_up`` [E, 2I, H] and ``experts_down`` [E, H, I] (this rank's I), and a
    ``shared_expert`` with its ``shared_expert_gate`` where the family has one."""

    invariant = False  # the products and activation on the batch-invariant operators (use_invariant_ops)
    fused = False  # the routing on augur::moe_route, the activation on augur::fused_act_mul (use_fused_ops)

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        act: str,
        tp: TensorParallel = SINGLE,
        shared_intermediate: int = 0,
        biases: bool = False,
        softmax_after_topk: bool = False,
        swiglu: tuple[float, float] | None = None,
        shared_gate: bool = True,
    ) -> None:
        """``shared_intermediate``: the inner size of a shared expert (0: none), scaled by a sigmoid
        gate of its own (Qwen2-MoE) or, without ``shared_gate``, added as it is (GLM-4.5's).
        ``biases``: the router and every expert projection have biases (gpt-oss).
        ``softmax_after_topk``: the weights are the softmax of the k largest logits (gpt-oss), not
        the top k of the softmax over all experts. ``swiglu``: (alpha, limit) of gpt-oss's clamped
        SwiGLU, which then replaces ``act``."""
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{num_experts} (the experts), got {top_k}")
        self.tp = tp
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.softmax_after_topk = softmax_after_topk
        self.act_name = CLAMPED_SWIGLU if swiglu else act
        self.alpha, self.limit = swiglu or (1.0, 0.0)
        if not swiglu:
            activation(act)  # an unknown activation fails at construction
        self.intermediate_size = tp.split(intermediate, "experts' inner size")  # this rank's
        self.gate = nn.Linear(hidden, num_experts, bias=biases)
        self.experts_gate_up = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate_size, hidden))
        self.experts_down = nn.Parameter(torch.empty(num_experts, hidden, self.intermediate_size))
        self.experts_gate_up_bias: nn.Parameter | None = None
        self.experts_down_bias: nn.Parameter | None = None
        if biases:  # (the down projection's is added on rank 0 only: its other ranks load zeros)
            self.experts_gate_up_bias = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate_size))
            self.experts_down_bias = nn.Parameter(torch.empty(num_experts, hidden))
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shared_intermediate:
            mine = tp.split(shared_intermediate, "shared expert's inner size")
            shape = SimpleNamespace(hidden_size=hidden, intermediate_size=mine, hidden_act=act)
            # This rank's slice, its partial sums added before the block's one all-reduce (so no tp here).
            self.shared_expert = LlamaMLP(shape, bias=False, tp=SINGLE)
            if shared_gate:
                self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    @property
    def ops(self) -> str:
        return "invariant" if self.invariant else "fused" if self.fused else "eager"

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [T, k], weights [T, k] float32): each token's experts, most probable first
        (:func:`moe_route`; under the fused operators its one-kernel form on CUDA)."""
        route = torch.ops.augur.moe_route if self.fused else moe_route
        return route(self.gate(x), self.top_k, self.norm_topk_prob, self.softmax_after_topk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        out = torch.ops.augur.moe_experts(
            x, ids, weights, self.experts_gate_up, self.experts_down, self.experts_gate_up_bias,
            self.experts_down_bias, self.act_name, self.ops, self.alpha, self.limit,
        )  # fmt: skip
        if self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return self.tp.all_reduce(out)


class MoEWeights:
    """Checkpoint loading for a model with :class:`SparseMoE` blocks, mixed into a
    ``LlamaForCausalLM`` subclass: each expert's ``gate_proj`` / ``up_proj`` / ``down_proj`` (as the
    checkpoints ship them, one matrix per expert) into its slot of the stacked parameters, and, under
    tensor parallelism, this rank's slice of each."""

    EXPERT_PIECES = {"gate_proj": 0, "up_proj": 1, "down_proj": None}

    @staticmethod
    def _expert_parts(name: str) -> tuple[str, int, str, str] | None:
        """(the block's path, expert index, projection, "" or "_bias") of
        ``...mlp.experts.{e}.{proj}.weight`` (or ``.bias``)."""
        block, sep, rest = name.partition(".experts.")
        if not sep:
            return None
        e, _, proj = rest.partition(".")
        proj, dot, kind = proj.rpartition(".")
        if not e.isdigit() or proj not in MoEWeights.EXPERT_PIECES or kind not in ("weight", "bias") or not dot:
            return None
        return block, int(e), proj, "_bias" if kind == "bias" else ""

    def weight_target(self, name: str) -> tuple[str, object]:
        parts = self._expert_parts(name)
        if parts is None:
            return super().weight_target(name)
        block, e, proj, bias = parts
        piece = MoEWeights.EXPERT_PIECES[proj]
        if piece is None:
            return f"{block}.experts_down{bias}", (e, None)
        return f"{block}.experts_gate_up{bias}", (e, piece)

    def weight_slot(self, target: str, param: torch.Tensor, shard) -> torch.Tensor:
        if not isinstance(shard, tuple):
            return super().weight_slot(target, param, shard)
        e, piece = shard
        if piece is None:
            return param[e]
        inter = param.shape[1] // 2
        return param[e].narrow(0, piece * inter, inter)

    def expected_slots(self, pname: str) -> set[str]:
        if pname.endswith((".experts_gate_up", ".experts_gate_up_bias")):
            n = self.get_submodule(pname.rsplit(".", 1)[0]).num_experts
            return {f"{pname}:{(e, p)}" for e in range(n) for p in (0, 1)}
        if pname.endswith((".experts_down", ".experts_down_bias")):
            n = self.get_submodule(pname.rsplit(".", 1)[0]).num_experts
            return {f"{pname}:{(e, None)}" for e in range(n)}
        return super().expected_slots(pname)

    def checkpoint_slice(self, name: str) -> tuple[int, int, int] | str | None:
        if self.tp.size == 1:
            return None
        ours = self.checkpoint_name(name)
        parts = self._expert_parts(ours)
        if parts is not None:
            inter = self.get_submodule(parts[0]).intermediate_size
            if parts[2] == "down_proj":  # row-parallel: a bias is added once (rank 0's)
                return (1, self.tp.rank * inter, inter) if not parts[3] else None if self.tp.rank == 0 else "zeros"
            return 0, self.tp.rank * inter, inter
        if ".shared_expert." in ours:
            inter = self.get_submodule(ours.split(".shared_expert.")[0]).shared_expert.intermediate_size
            dim = 1 if ".down_proj." in ours else 0
            return dim, self.tp.rank * inter, inter
        if ".mlp.gate." in ours or ".shared_expert_gate." in ours:
            return None  # the router and the shared expert's gate: replicated
        if ".mlp." in ours:  # a dense layer's MLP: the mixture's model may mix both
            layer = self.get_submodule(ours.split(".mlp.")[0])
            return layer_slice(ours, layer.self_attn, layer.mlp, self.tp.rank)
        return super().checkpoint_slice(name)


def has_experts(model: nn.Module) -> bool:
    return any(isinstance(m, SparseMoE) for m in model.modules())


def is_sparse_layer(config, i: int) -> bool:
    """Whether layer ``i`` of a Qwen-MoE config is a mixture (``decoder_sparse_step``,
    ``mlp_only_layers``), as transformers builds it."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    only_mlp = getattr(config, "mlp_only_layers", None) or []
    return i not in only_mlp and getattr(config, "num_experts", 0) > 0 and (i + 1) % step == 0


class StackedExperts:
    """A mixin before :class:`MoEWeights` for checkpoints that store each layer's experts stacked, as
    transformers 5 saves a family it keeps no per-expert conversion for (Mistral 4's):
    ``mlp.experts.gate_up_proj [E, 2I, H]`` (each expert's gate rows, then its up rows) and
    ``mlp.experts.down_proj [E, H, I]``. Each stack is read whole and handed on one expert at a time,
    under tensor parallelism as this rank's slice of the inner dimension (gate and up are two slices of
    the fused rows, which one checkpoint slice could not name). A stack stored in FP8 is multiplied by
    its scale (``gate_up_proj_scale_inv`` or ``_scale``: one per expert or one for all) one expert at a
    time as it goes; its activation scales are dropped."""

    _STACKS = (".experts.gate_up_proj", ".experts.down_proj")
    _DROPPED = ("_activation_scale", "_input_scale")
    _SCALES = ("_scale_inv", "_scale")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._unstacked(weights))

    def _stack_of(self, name: str) -> tuple[str, str] | None:
        """(the stack's name, "stack" / "scale" / "dropped") of a stack's tensor, None for any other."""
        if name.endswith(self._STACKS):
            return name, "stack"
        for kind, suffixes in (("dropped", self._DROPPED), ("scale", self._SCALES)):
            for suffix in suffixes:
                if name.endswith(suffix) and name.removesuffix(suffix).endswith(self._STACKS):
                    return name.removesuffix(suffix), kind
        return None

    def _unstacked(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        waiting: dict[str, dict[str, torch.Tensor]] = {}  # an FP8 stack and its scale, whichever came first
        for name, tensor in weights:
            found = self._stack_of(name)
            if found is None:
                yield name, tensor
                continue
            stack, kind = found
            if kind == "dropped":
                continue
            if kind == "stack" and tensor.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
                yield from self._experts(stack, tensor, None)
                continue
            got = waiting.setdefault(stack, {})
            got[kind] = tensor
            if len(got) == 2:
                del waiting[stack]
                yield from self._experts(stack, got["stack"], got["scale"])
        if waiting:
            stack, got = next(iter(waiting.items()))
            missing = "scale" if "stack" in got else "FP8 stack"
            raise ValueError(f"checkpoint has {stack}'s {next(iter(got))} without its {missing}")

    def _experts(
        self, name: str, stack: torch.Tensor, scale: torch.Tensor | None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """One expert's tensors at a time, this rank's slice, times the expert's scale where stored in FP8."""
        block, _, proj = self.checkpoint_name(name).rpartition(".experts.")
        inter, r = self.get_submodule(block).intermediate_size, self.tp.rank  # this rank's inner size
        mine = slice(r * inter, (r + 1) * inter)
        scales = None if scale is None else scale.float().reshape(-1)
        for e in range(stack.shape[0]):
            w = stack[e] if scales is None else stack[e].float() * scales[e if scales.numel() > 1 else 0]
            if proj == "down_proj":
                yield f"{block}.experts.{e}.down_proj.weight", w[:, mine].contiguous()
                continue
            whole = w.shape[0] // 2
            yield f"{block}.experts.{e}.gate_proj.weight", w[mine].contiguous()
            yield f"{block}.experts.{e}.up_proj.weight", w[whole + mine.start : whole + mine.stop].contiguous()

    def checkpoint_slice(self, name: str) -> tuple[int, int, int] | str | None:
        if self._stack_of(self.checkpoint_name(name)) is not None:
            return None  # (whole: _experts cuts this rank's)
        return super().checkpoint_slice(name)
