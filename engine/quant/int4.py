"""4-bit integer weights on PyTorch's own int4 matmul kernels: the fast path.

*Scheme* (asymmetric, grouped, as torchao's int4 weight-only): each row of a weight ``W [N, K]`` is cut
into groups of ``group_size`` consecutive input features; a group keeps ``scale = (max - min) / 15``
and its ``min``, and stores ``q = round((w - min) / scale)`` in 0..15. Dequantized: ``q * scale + min``.
The kernels take the zero point in their own convention, ``(q - 8) * scale + zero``, so
``zero = min + 8 * scale``.

*Kernels*: ``aten._weight_int4pack_mm_for_cpu`` on a CPU and ``aten._weight_int4pack_mm`` on CUDA
(sm80+, bfloat16 activations), each on weights packed for it by ``_convert_weight_to_int4pack[_for_cpu]``.
They ship with PyTorch (torchao's int4 layouts call the same operators), so no other package is
needed. They multiply straight from the packed 4-bit weights: less memory and, in a memory-bound
decode, less time (``docs/benchmarks.md``). Both run on bfloat16 activations (CUDA's takes nothing
else; the CPU one's float32 path is several times slower than its bfloat16 one, and slower than a
dense float32 matmul): a float32 model's activations are rounded to bfloat16 at each int4 layer and
its output comes back in float32. Next to 4-bit weights that rounding is small.

A layer whose shape the kernels cannot take (rows not a multiple of 16, inputs not a multiple of
32) stays in full precision, as the LM head always does.

*Many rows on CUDA* (a prefill, a wide verify): the CUDA kernel is built for a few rows, and its time
grows with them (2,048 rows at the 8B shape took about 1 s against bfloat16's 63 ms on an H200). From
``DENSE_ROWS`` rows on, a layer dequantizes its weight to bfloat16 for the call and multiplies on the
dense GEMM, reading the packed weight itself: no second copy is kept. The packed layout is PyTorch's
own and undocumented, so it is not written down here but read off the device at load: packing three
probe matrices whose nibbles spell each element's position gives where each element of a tile lands
(:func:`tile_order`). The batch-invariant mode keeps every row count on the kernel (one order per
output).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine.quant.install import ROUTERS, assemble, replace

logger = logging.getLogger(__name__)

GROUP_SIZES = (128, 64, 32)  # tried in order: the first that divides the input features
COMPUTE_DTYPE = torch.bfloat16  # the kernels' activations and statistics
DENSE_ROWS = 128  # CUDA: from this many rows a call dequantizes and runs the dense GEMM
TILE_ROWS = 8  # the CUDA layout's tile: 8 output rows by 16 * inner_k_tiles inputs


def group_size_for(in_features: int, out_features: int) -> int | None:
    """The group size a layer of this shape is quantized with, or None if the kernels cannot take it."""
    if out_features % 16:
        return None
    return next((g for g in GROUP_SIZES if in_features % g == 0), None)


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` → ``(q [N, K] uint8 in 0..15, scale [N, K/g], min [N, K/g])``, float32 statistics."""
    N, K = weight.shape
    w = weight.float().reshape(N, K // group_size, group_size)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    q = ((w - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    return q.reshape(N, K), scale, lo


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    N, K = q.shape
    groups = scale.shape[1]
    return (q.reshape(N, groups, K // groups).float() * scale[..., None] + lo[..., None]).reshape(N, K)


def _pairs(q: torch.Tensor) -> torch.Tensor:
    """``q [N, K]`` in 0..15 → ``[N, K/2]`` uint8, the even column in the high nibble: what the CUDA
    packer takes."""
    return ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8).contiguous()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """A packed ``[N/8, K/tk, 32, inner_k_tiles/2]`` int32 weight → ``[N/8, K/tk, 8 * tk]`` uint8: each
    tile's 4-bit fields in memory order (the low nibble of each byte first, bytes little-endian)."""
    tiles = packed.shape[:2]
    octets = packed.contiguous().view(torch.uint8).reshape(*tiles, -1)
    return torch.stack((octets & 15, octets >> 4), dim=-1).reshape(*tiles, -1)


def tile_order(pack, inner_k_tiles: int, device) -> torch.Tensor:
    """``[8 * tk]`` int64, ``tk = 16 * inner_k_tiles``: for each element of a tile, in row-major order
    (row ``n``, input ``k`` at ``n * tk + k``), where ``pack`` (``q [N, K]`` in 0..15 → its packed int32
    weight) puts its nibble among the tile's nibbles in memory order. Read off ``pack`` itself: each of
    three probes holds one hexadecimal digit of every element's position in its tile, over a matrix of
    two tiles each way, and every tile must spell the same permutation (a layout that is not one tile's
    pattern repeated is refused: :class:`ValueError`)."""
    tk = 16 * inner_k_tiles
    rows, cols = 2 * TILE_ROWS, 2 * tk
    n = torch.arange(rows, device=device)[:, None]
    k = torch.arange(cols, device=device)[None, :]
    local = (n % TILE_ROWS) * tk + k % tk  # each element's position in its tile
    spelled = torch.zeros(2, 2, TILE_ROWS * tk, dtype=torch.int64, device=device)
    for digit in range(3):  # 8 * tk <= 1,024 < 16 ** 3
        probe = ((local >> (4 * digit)) & 15).to(torch.uint8)
        spelled += _nibbles(pack(probe)).to(torch.int64) << (4 * digit)
    order = spelled[0, 0]  # memory slot → element
    every = torch.arange(order.numel(), device=device)
    if not bool((spelled == order).all()) or not torch.equal(order.sort().values, every):
        raise ValueError("the int4 packed layout is not one tile's permutation repeated")
    return order.argsort()  # element → memory slot


def unpack_tiles(packed: torch.Tensor, order: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The ``[N, K]`` uint8 integers (0..15) of a packed weight whose tiles hold their elements at
    ``order`` (:func:`tile_order`)."""
    tk = order.numel() // TILE_ROWS
    tiles = _nibbles(packed).index_select(-1, order)  # [N/8, K/tk, 8 * tk], each tile row-major
    tiles = tiles.reshape(out_features // TILE_ROWS, in_features // tk, TILE_ROWS, tk)
    return tiles.permute(0, 2, 1, 3).reshape(out_features, in_features)


_TILE_ORDERS: dict[tuple[str, int], torch.Tensor | None] = {}  # (device, inner_k_tiles) → its tile_order


def _cuda_tile_order(device: torch.device, inner_k_tiles: int) -> torch.Tensor | None:
    """The tile order of PyTorch's CUDA packer on ``device``, or None (every row count on the kernel,
    as before this path) where the layout cannot be read: a PyTorch whose packer is not tile-local."""
    key = (str(device), inner_k_tiles)
    if key not in _TILE_ORDERS:
        pack = lambda q: torch._convert_weight_to_int4pack(_pairs(q), inner_k_tiles)  # noqa: E731
        try:
            _TILE_ORDERS[key] = tile_order(pack, inner_k_tiles, device)
        except (ValueError, RuntimeError) as exc:
            logger.warning("int4: the packed layout could not be read (%s); many rows stay on the kernel", exc)
            _TILE_ORDERS[key] = None
    return _TILE_ORDERS[key]


class Int4Linear(nn.Module):
    """A linear layer whose weight is packed int4 for its device's kernel (built by :meth:`from_linear`)."""

    def __init__(self, in_features: int, out_features: int, group_size: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.register_buffer("packed", torch.empty(0, dtype=torch.uint8), persistent=False)
        self.register_buffer("scales_and_zeros", torch.empty(0), persistent=False)  # [K/g, N, 2]
        # [K] int64: the input columns in the order the groups were made (act order), None: as they come
        self.register_buffer("perm", None, persistent=False)
        # CUDA: where the packed layout puts each element of a tile (:func:`tile_order`), for the calls
        # of DENSE_ROWS rows or more; None on a CPU (its kernel is fast at every row count)
        self.register_buffer("order", None, persistent=False)
        self.invariant = False  # the batch-invariant mode: every row count on the kernel
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int) -> Int4Linear:
        weight = linear.weight.detach()
        layer = cls(linear.in_features, linear.out_features, group_size, linear.bias)
        layer.set_weight(*quantize_int4(weight, group_size), device=weight.device)
        return layer

    def set_weight(self, q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, device) -> None:
        """Pack ``q`` (``[N, K]`` in 0..15) for ``device``'s kernel, with its statistics in bfloat16."""
        zero = lo + 8 * scale
        self.scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).contiguous().to(device, COMPUTE_DTYPE)
        q = q.to(device)
        if device.type == "cuda":
            inner_k_tiles = next(t for t in (8, 4, 2) if self.in_features % (t * 16) == 0)
            self.packed = torch._convert_weight_to_int4pack(_pairs(q), inner_k_tiles)
            self.order = _cuda_tile_order(device, inner_k_tiles)
        else:
            self.packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(COMPUTE_DTYPE)
        if self.perm is not None:
            flat = flat.index_select(1, self.perm)
        y = self.product(flat).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat [T, K]`` (bfloat16, inputs in the groups' order) times the weight, in bfloat16."""
        if self.order is not None and flat.shape[0] >= DENSE_ROWS and not self.invariant:
            return F.linear(flat, self.dequantized())
        if flat.is_cuda:
            return torch.ops.aten._weight_int4pack_mm(flat, self.packed, self.group_size, self.scales_and_zeros)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size, self.scales_and_zeros)

    def integers(self) -> torch.Tensor:
        """The weight's ``[N, K]`` integers (0..15), read from the packed tiles (the CUDA layout only:
        ``order`` set)."""
        return unpack_tiles(self.packed, self.order, self.out_features, self.in_features)

    def dequantized(self) -> torch.Tensor:
        """The ``[N, K]`` bfloat16 weight the kernel multiplies by: ``(q - 8) * scale + zero`` per group,
        in float32 and rounded once (the CUDA layout only: ``order`` set)."""
        q = self.integers()
        groups = self.in_features // self.group_size
        stats = self.scales_and_zeros.float().transpose(0, 1)  # [N, K/g, 2]
        w = (q.reshape(self.out_features, groups, self.group_size).float() - 8) * stats[..., :1] + stats[..., 1:]
        return w.reshape(self.out_features, self.in_features).to(COMPUTE_DTYPE)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


def int4_layer(name: str, linear: nn.Linear, skip: tuple[str, ...] = ("lm_head", *ROUTERS)) -> Int4Linear | None:
    """``linear`` (at module path ``name``) quantized to an :class:`Int4Linear`, or None where it stays in
    full precision: named in ``skip``, or a shape the kernels cannot take."""
    if name.rsplit(".", 1)[-1] in skip:
        return None
    group = group_size_for(linear.in_features, linear.out_features)
    if group is None:
        logger.info("int4: %s %s stays in full precision (shape)", name, tuple(linear.weight.shape))
        return None
    return Int4Linear.from_linear(linear, group)


def quantize_linears_int4(model: nn.Module, skip: tuple[str, ...] = ("lm_head", *ROUTERS)) -> int:
    """Replace every ``nn.Linear`` of ``model`` but those named in ``skip`` by an :class:`Int4Linear`, one
    at a time (each full-precision weight is freed as its layer is replaced). Returns how many were."""
    replaced = 0
    for name, module in list(model.named_modules()):
        layer = int4_layer(name, module, skip) if isinstance(module, nn.Linear) else None
        if layer is not None:
            replace(model, name, layer)
            replaced += 1
    return replaced


KERNEL_GROUP_SIZES = (32, 64, 128, 256)  # the group sizes the int4 kernels take


def install_checkpoint_int4(model: nn.Module, groups: dict, select=None) -> int:
    """Serve a 4-bit checkpoint's own groups on the int4 kernels (``--quantization int4`` on a GPTQ, AWQ or
    compressed-tensors int4 checkpoint): each linear layer whose every checkpoint part (q/k/v, gate/up)
    came as 4-bit groups (:class:`engine.quant.checkpoint.Int4Groups`, by checkpoint module) of one size
    the kernels take becomes an :class:`Int4Linear` of those groups, not re-quantized: the same integers,
    scales and zero points (rounded to bfloat16, as the kernels keep them). ``select`` is the model's
    ``checkpoint_slice`` under tensor parallelism: a rank's rows, or its columns where they fall on
    group boundaries. Other layers keep the dequantized weights they loaded. Returns how many were replaced."""
    # Act order: a layer's groups hold its input columns in ``perm``'s order, so its columns are stored
    # so and its inputs taken so (exact). The parts of a fused layer share their input, and must share
    # the order; a rank's share of a row-parallel layer's inputs is no share of the permuted ones.
    perms: dict[str, list] = {}  # layer path → the orders of its parts
    for module, g in groups.items():
        target, _ = model.weight_target(model.checkpoint_name(f"{module}.weight"))
        perms.setdefault(target.removesuffix(".weight"), []).append(g.perm)
    stored = {module: (g.q, g.scale, g.lo) for module, g in groups.items()}
    permuted = {m for m, g in groups.items() if g.perm is not None}
    replaced = 0
    for path, (linear, (q, scale, lo)) in assemble(model, stored, select, _int4_rank_part(permuted)).items():
        g = q.shape[1] // scale.shape[1]
        orders = perms[path]
        same = all(o is None for o in orders) or all(o is not None and torch.equal(o, orders[0]) for o in orders)
        if g not in KERNEL_GROUP_SIZES or linear.out_features % 16 or not same:
            logger.info("int4: %s stays dequantized (group size %d, %d rows, act orders alike: %s)",
                        path, g, linear.out_features, same)  # fmt: skip
            continue
        layer = Int4Linear(linear.in_features, linear.out_features, g, linear.bias)
        layer.set_weight(q, scale, lo, device=linear.weight.device)
        if orders[0] is not None:
            layer.perm = orders[0].to(linear.weight.device)
        replace(model, path, layer)
        replaced += 1
    return replaced


def _int4_rank_part(permuted: set[str]):
    """A rank's part of a layer's groups (``cut`` as ``checkpoint_slice`` gives it), or None where its
    columns would split a group or the layer's inputs are permuted (act order)."""

    def part(parts, cut, module: str = ""):
        if cut is None:
            return parts
        if isinstance(cut, str):
            return None
        q, scale, lo = parts
        dim, start, length = cut
        if dim == 0:
            return tuple(t.narrow(0, start, length) for t in parts)
        g = q.shape[1] // scale.shape[1]
        if start % g or length % g or module in permuted:
            return None
        return (
            q.narrow(1, start, length),
            scale.narrow(1, start // g, length // g),
            lo.narrow(1, start // g, length // g),
        )

    return part
