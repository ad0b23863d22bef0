"""Checkpoints saved quantized, read by their ``quantization_config``: GPTQ, AWQ (GEMM layout),
compressed-tensors (``pack-quantized``, ``naive-quantized``, ``int-quantized``, ``float-quantized``)
and FP8 (``quant_method: fp8``, per-tensor, per-channel or 128 x 128 blocks).

Each format stores a linear layer's weight as a few tensors beside each other (packed integers or
8-bit floats, their scales, zero points, a group index). :func:`checkpoint_format` reads the config
and returns the format's reader, or raises naming what is not served; the reader turns the stream of
checkpoint tensors into the stream the model loads: each quantized layer's tensors become its
``weight``, dequantized exactly (every stored value times its scale, minus its zero point: what the
format's own library computes), in float32; every other tensor passes as it is. So every family
loads every format, mixture experts included, and the model's own loader never knows.

The weights are served in the model's dtype: the checkpoint's values, rounded once. Activations are
not quantized (a ``W8A8`` or static ``input_scale`` scheme runs its weights with full-precision
activations): the target served is the checkpoint's dequantized model, which is what transformers
runs for it on a CPU and what every speculative method stays exact against.

Terms: ``out`` x ``in`` is a linear layer's weight shape (rows are outputs); a *group* is ``group_size``
consecutive input columns sharing a scale (and zero point); ``g_idx`` (GPTQ's act order) gives each
input column its group where the columns were quantized out of order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

FORMATS = ("gptq", "awq", "compressed-tensors", "fp8")
CT_FORMATS = ("pack-quantized", "naive-quantized", "int-quantized", "float-quantized")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's GEMM packing: nibble i of a word holds column AWQ_ORDER[i]


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned ``bits``-bit values packed into int32 words along ``dim``, the lowest bits first."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    words = packed.to(torch.int32).movedim(dim, -1).unsqueeze(-1)
    return ((words >> shifts) & ((1 << bits) - 1)).flatten(-2).movedim(-1, dim)


class QuantizedReader:
    """A format's reader: :meth:`read` dequantizes a checkpoint's stream of tensors. A layer's
    tensors are gathered until :meth:`needed` has them all (they may come from several files), then
    its weight goes out; ``dropped`` tensors (activation scales) are read and not passed on."""

    name = ""
    parts: tuple[str, ...] = ()  # suffixes of a quantized layer's tensors (after "<module>.")
    dropped: tuple[str, ...] = ()

    def read(
        self, weights: Iterable[tuple[str, torch.Tensor]], keep: Callable[[str, dict], None] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream with each quantized layer's tensors replaced by its dequantized ``weight``; ``keep``
        sees each layer's stored tensors first (by module name): a loader serving the stored form
        (:meth:`int4_groups`, :meth:`fp8_weights`) takes it there."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in weights:
            module, _, suffix = key.rpartition(".")
            if suffix in self.dropped:
                continue
            if suffix not in self.parts or not self.is_part(suffix, tensor):
                yield key, tensor
                continue
            got = pending.setdefault(module, {})
            got[suffix] = tensor
            if all(p in got for p in self.needed(got)):
                del pending[module]
                if keep is not None:
                    keep(module, got)
                yield f"{module}.weight", self.dequantize(module, got)
        for module, got in pending.items():
            missing = [p for p in self.needed(got) if p not in got]
            raise ValueError(f"{self.name} checkpoint: {module} has {sorted(got)} but not {missing}")

    def is_part(self, suffix: str, tensor: torch.Tensor) -> bool:
        return True

    def needed(self, got: dict[str, torch.Tensor]) -> list[str]:
        raise NotImplementedError

    def dequantize(self, module: str, got: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    int4 = False  # whether the format can hold 4-bit integer groups (--quantization int4 serves those)
    fp8 = False  # whether it can hold FP8 weights (--quantization fp8 serves those)

    def int4_groups(self, got: dict[str, torch.Tensor]) -> Int4Groups | None:
        """A layer's weight as 4-bit groups of consecutive input columns, where it is stored so: None
        for another layout (other widths, act order out of order, a scale per channel or tensor)."""
        return None

    fp8_block_k: int | None = None  # FP8 block scales: the block's width along the input (None: per row)

    def fp8_weights(self, got: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A layer's weight as e4m3 values ``[out, in]`` and float32 scales ``[out, in blocks]``, one per
        row and block of ``fp8_block_k`` inputs (a tensor's scale spread over its rows; a row's or
        tensor's: one block), where it is stored so: None for another layout."""
        return None


@dataclass
class Int4Groups:
    """A weight ``[out, in]`` as ``q * scale + lo``, ``q`` in 0..15 (uint8 ``[out, in]``), ``scale`` and
    ``lo`` float32 ``[out, in / group]``: the form PyTorch's int4 kernels take (engine/quant/int4.py).
    Act order: ``perm`` [in] lists the input columns in the order the groups hold them (``q``'s columns
    are in that order: the layer takes ``x[:, perm]``); None where they are in their own order."""

    q: torch.Tensor
    scale: torch.Tensor
    lo: torch.Tensor
    perm: torch.Tensor | None = None

    @classmethod
    def of(
        cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, g_idx=None, size: int = 0
    ) -> Int4Groups | None:
        """From ``(q - zero) * scale``, each ``[out, ...]``, column ``i`` in group ``g_idx[i]`` (None: ``i //
        size``). None where the groups are not all ``size`` columns (no order makes them contiguous)."""
        scale = scale.float()
        perm = None
        if g_idx is not None and not in_order(g_idx, q.shape[1], size):
            perm = torch.argsort(g_idx.long(), stable=True)
            if not in_order(g_idx[perm], q.shape[1], size):
                return None
            q = q[:, perm]
        return cls(q.to(torch.uint8).contiguous(), scale.contiguous(), (-zero.float() * scale).contiguous(), perm)

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]


def in_order(g_idx: torch.Tensor | None, n_in: int, group_size: int) -> bool:
    """Whether a group index (act order) puts every input column in group ``column // group_size``."""
    return g_idx is None or torch.equal(g_idx.long(), torch.arange(n_in) // group_size)


class GPTQReader(QuantizedReader):
    """GPTQ (AutoGPTQ / GPTQModel / optimum): ``qweight`` int32 [in * bits / 32, out] (values packed
    along the input), ``qzeros`` int32 [groups, out * bits / 32], ``scales`` [groups, out], ``g_idx``
    [in] (each input column's group; ``desc_act`` orders them by activation). The original
    (``checkpoint_format: gptq``) stores each zero point minus one; ``gptq_v2`` stores it as it is.
    W[out, in] = scales[g, out] * (q[in, out] - zeros[g, out]), g = g_idx[in]."""

    name = "gptq"
    parts = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, config: dict) -> None:
        self.bits = int(config.get("bits", 4))
        if self.bits not in (2, 4, 8):
            raise ValueError(f"GPTQ with {self.bits} bits is not supported (supported: 2, 4, 8)")
        self.group_size = int(config.get("group_size", 128))
        fmt = config.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (supported: gptq, gptq_v2)")
        self.zero_offset = 1 if fmt == "gptq" else 0
        # Writers save g_idx always (in order without act order); where one did not, a group is
        # group_size columns in order.
        self.g_idx = bool(config.get("desc_act", False))

    def needed(self, got) -> list[str]:
        return ["qweight", "qzeros", "scales"] + (["g_idx"] if self.g_idx else [])

    def dequantize(self, module: str, got: dict[str, torch.Tensor]) -> torch.Tensor:
        q = unpack_int32(got["qweight"], self.bits, 0)  # [in, out]
        zeros = unpack_int32(got["qzeros"], self.bits, 1) + self.zero_offset  # [groups, out]
        scales = got["scales"].float()
        n_in = q.shape[0]
        g_idx = got.get("g_idx")
        if g_idx is None:
            size = self.group_size if self.group_size > 0 else n_in
            g_idx = torch.arange(n_in) // size
        g_idx = g_idx.long()
        w = (q.float() - zeros[g_idx, : q.shape[1]].float()) * scales[g_idx, : q.shape[1]]
        return w.t().contiguous()

    @property
    def int4(self) -> bool:
        return self.bits == 4

    def int4_groups(self, got: dict[str, torch.Tensor]) -> Int4Groups | None:
        q = unpack_int32(got["qweight"], self.bits, 0)  # [in, out]
        n_out = q.shape[1]
        if self.bits != 4 or self.group_size <= 0:
            return None
        zeros = unpack_int32(got["qzeros"], self.bits, 1)[:, :n_out] + self.zero_offset  # [groups, out]
        return Int4Groups.of(q.t(), got["scales"].t(), zeros.t(), got.get("g_idx"), self.group_size)


class AWQReader(GPTQReader):
    """AWQ, GEMM layout (AutoAWQ, GPTQModel): ``qweight`` int32 [in, out / 8] and ``qzeros`` int32
    [groups, out / 8], eight 4-bit values a word along the output in AWQ's order (:data:`AWQ_ORDER`),
    ``scales`` [groups, out]; W[out, in] = scales[g, out] * (q[in, out] - zeros[g, out]),
    g = in // group_size."""

    name = "awq"
    parts = ("qweight", "qzeros", "scales")

    def __init__(self, config: dict) -> None:
        self.bits = int(config.get("bits", config.get("w_bit", 4)))
        self.group_size = int(config.get("group_size", config.get("q_group_size", 128)))
        version = str(config.get("version", "gemm")).lower()
        if self.bits != 4 or version != "gemm":
            raise ValueError(f"AWQ {version} with {self.bits} bits is not supported (supported: gemm, 4 bits)")
        if config.get("zero_point", True) is False:
            raise ValueError("AWQ without zero points is not supported")

    def needed(self, got) -> list[str]:
        return list(self.parts)

    @staticmethod
    def unpack(packed: torch.Tensor) -> torch.Tensor:
        """[rows, out / 8] words → [rows, out], undoing AWQ's column order."""
        nibbles = unpack_int32(packed, 4, 1).view(packed.shape[0], -1, 8)  # nibble i of each word
        out = torch.empty_like(nibbles)
        out[..., list(AWQ_ORDER)] = nibbles
        return out.flatten(1)

    def dequantize(self, module: str, got: dict[str, torch.Tensor]) -> torch.Tensor:
        q, zeros, scales = self.unpack(got["qweight"]), self.unpack(got["qzeros"]), got["scales"].float()
        g = torch.arange(q.shape[0]) // self.group_size
        return ((q - zeros[g]).float() * scales[g]).t().contiguous()

    int4 = True

    def int4_groups(self, got: dict[str, torch.Tensor]) -> Int4Groups | None:
        q, zeros = self.unpack(got["qweight"]), self.unpack(got["qzeros"])
        return Int4Groups.of(q.t(), got["scales"].t(), zeros.t())


class FP8Reader(QuantizedReader):
    """``quant_method: fp8``: ``weight`` float8_e4m3fn [out, in] and its multiplier, per 128 x 128 block
    (``weight_scale_inv`` [out / 128, in / 128], DeepSeek-V3 and Qwen3's ``-FP8``) or per tensor or
    row (``weight_scale``, AutoFP8; ``weight_scale_inv`` without blocks, Mistral's own FP8 exports, a
    multiplier all the same). A static ``activation_scale`` / ``input_scale`` is dropped."""

    name = "fp8"
    parts = ("weight", "weight_scale_inv", "weight_scale")
    dropped = ("activation_scale", "input_scale")

    def __init__(self, config: dict) -> None:
        self.block = config.get("weight_block_size")
        fmt = config.get("fmt", "e4m3")
        if fmt not in ("e4m3", "float8_e4m3fn"):
            raise ValueError(f"FP8 format {fmt!r} is not supported (supported: e4m3)")

    def is_part(self, suffix: str, tensor: torch.Tensor) -> bool:
        # A layer's weight is a part only where it is stored in FP8; the others load as they are.
        return suffix != "weight" or tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)

    def needed(self, got) -> list[str]:
        return ["weight", "weight_scale_inv" if self.block or "weight_scale_inv" in got else "weight_scale"]

    @staticmethod
    def _unblocked_scale(got: dict[str, torch.Tensor]) -> torch.Tensor:
        """A tensor's or its rows' multiplier, under either name."""
        return got["weight_scale"] if "weight_scale" in got else got["weight_scale_inv"]

    def dequantize(self, module: str, got: dict[str, torch.Tensor]) -> torch.Tensor:
        w = got["weight"].float()
        if self.block:
            return w * expand_blocks(got["weight_scale_inv"].float(), w.shape, tuple(self.block))
        scale = self._unblocked_scale(got).float()
        return w * (scale.reshape(()) if scale.numel() == 1 else scale.reshape(-1, 1))

    fp8 = True

    @property
    def fp8_block_k(self) -> int | None:
        return int(self.block[1]) if self.block else None

    def fp8_weights(self, got: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
        w = got["weight"]
        if w.dtype != torch.float8_e4m3fn:
            return None
        if self.block:
            return w, rows_of_blocks(got["weight_scale_inv"], w.shape[0], int(self.block[0]))
        return w, self._unblocked_scale(got).float().reshape(-1, 1).expand(w.shape[0], 1).contiguous()


def rows_of_blocks(scale: torch.Tensor, rows: int, block_rows: int) -> torch.Tensor:
    """Block scales ``[ceil(out / bo), in blocks]`` (blocks ``block_rows`` tall) as one row of them per
    output row ``[out, in blocks]``."""
    scale = scale.float().reshape(scale.shape[0], -1)
    return scale.repeat_interleave(block_rows, 0)[:rows].contiguous()


def expand_blocks(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int] | None = None) -> torch.Tensor:
    """A per-block scale [ceil(out / bo), ceil(in / bi)] spread over the weight's [out, in] (the last
    blocks may be partial). ``block``: (bo, bi); None: the smallest that cover the weight (those are
    the block's size wherever the blocks' count is not rounded up)."""
    out, inp = shape
    bo, bi = block or (-(-out // scale.shape[0]), -(-inp // scale.shape[1]))
    return scale.repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inp]


class CompressedTensorsReader(QuantizedReader):
    """compressed-tensors (llm-compressor's output): every quantized layer's weight by its config
    group's scheme (``num_bits``, ``type`` int or float, ``strategy`` tensor / channel / group / block,
    ``group_size``, ``block_structure``, ``symmetric``), stored by the checkpoint's ``format``:

    - ``pack-quantized``: ``weight_packed`` int32 [out, in * bits / 32] (signed values offset to
      unsigned, packed along the input), ``weight_scale``, ``weight_zero_point`` (asymmetric; packed
      along the output), ``weight_shape``, ``weight_g_idx`` (act order);
    - ``naive-quantized`` / ``int-quantized``: ``weight`` int8 with its scale (and zero point);
    - ``float-quantized``: ``weight`` float8_e4m3fn with its scale.

    W = (q - zero_point) * scale, each scale and zero point spread over its channel, group or block."""

    name = "compressed-tensors"
    parts = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx", "weight")
    dropped = ("input_scale", "input_zero_point")

    def __init__(self, config: dict) -> None:
        fmt = config.get("format")
        groups = config.get("config_groups") or {}
        self.schemes: list[dict] = []
        for group in groups.values():
            weights = group.get("weights")
            if weights is None:
                continue
            group_fmt = group.get("format") or fmt
            if group_fmt not in CT_FORMATS:
                raise ValueError(
                    f"compressed-tensors format {group_fmt!r} is not supported (supported: {', '.join(CT_FORMATS)})"
                )
            kind, bits = weights.get("type", "int"), int(weights.get("num_bits", 8))
            if (kind, bits) not in (("int", 4), ("int", 8), ("float", 8)):
                raise ValueError(f"compressed-tensors {kind} weights of {bits} bits are not supported "
                                 "(supported: int 4, int 8, float 8)")  # fmt: skip
            strategy = weights.get("strategy", "tensor")
            if strategy not in ("tensor", "channel", "group", "block", "tensor_group"):
                raise ValueError(f"compressed-tensors weight strategy {strategy!r} is not supported")
            if strategy == "tensor_group":
                raise ValueError("compressed-tensors tensor_group (NVFP4) weights are not supported")
            self.schemes.append({**weights, "format": group_fmt})
        if not self.schemes:
            raise ValueError("compressed-tensors config without weight quantization: nothing to load")
        if len({(s["num_bits"], s.get("type"), s["format"]) for s in self.schemes}) > 1:
            raise ValueError("compressed-tensors checkpoints with several weight schemes are not supported")
        self.scheme = self.schemes[0]
        self.bits = int(self.scheme["num_bits"])
        self.packed = self.scheme["format"] == "pack-quantized"
        self.symmetric = bool(self.scheme.get("symmetric", True))

    def is_part(self, suffix: str, tensor: torch.Tensor) -> bool:
        if suffix == "weight":  # quantized only where stored as integers or FP8
            return tensor.dtype in (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
        return True

    def needed(self, got) -> list[str]:
        need = ["weight_packed", "weight_shape"] if self.packed else ["weight"]
        need.append("weight_scale")
        if not self.symmetric:
            need.append("weight_zero_point")
        if self.scheme.get("actorder") == "group":
            need.append("weight_g_idx")
        return need

    def dequantize(self, module: str, got: dict[str, torch.Tensor]) -> torch.Tensor:
        if "weight_packed" in got:
            out, inp = (int(x) for x in got["weight_shape"].tolist())
            q = unpack_int32(got["weight_packed"], self.bits, 1)[:, :inp].float() - 2 ** (self.bits - 1)
        elif "weight" in got:
            q = got["weight"].float()
            out, inp = q.shape
        else:
            raise ValueError(f"compressed-tensors checkpoint: {module} has a weight_scale but no weight")
        scale = got["weight_scale"].float()
        zero = got.get("weight_zero_point")
        if zero is not None and zero.dtype == torch.int32 and self.packed and zero.numel() * (32 // self.bits) >= out:
            zero = unpack_int32(zero, self.bits, 0)[:out].float() - 2 ** (self.bits - 1)  # packed along the output
        zero = None if zero is None else zero.float()
        spread = self._spreader(scale, (out, inp), got.get("weight_g_idx"))
        w = q - spread(zero) if zero is not None else q
        return w * spread(scale)

    @property
    def int4(self) -> bool:
        return self.packed and self.bits == 4 and self.scheme.get("type", "int") == "int"

    @property
    def fp8(self) -> bool:
        return self.scheme.get("type") == "float" and self.bits == 8

    def _block(self) -> tuple[int, int]:
        """A block strategy's (rows, columns) (compressed-tensors' ``block_structure``; 128 x 128 if unsaid)."""
        rows, cols = self.scheme.get("block_structure") or (128, 128)
        return int(rows), int(cols)

    @property
    def fp8_block_k(self) -> int | None:
        return self._block()[1] if self.scheme.get("strategy") == "block" else None

    def fp8_weights(self, got: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
        w = got.get("weight")
        if not self.fp8 or w is None or w.dtype != torch.float8_e4m3fn or not self.symmetric:
            return None
        strategy = self.scheme.get("strategy", "tensor")
        if strategy == "block":
            return w, rows_of_blocks(got["weight_scale"], w.shape[0], self._block()[0])
        if strategy not in ("tensor", "channel"):
            return None
        return w, got["weight_scale"].float().reshape(-1, 1).expand(w.shape[0], 1).contiguous()

    def int4_groups(self, got: dict[str, torch.Tensor]) -> Int4Groups | None:
        if not self.int4 or self.scheme.get("strategy") != "group" or "weight_packed" not in got:
            return None
        out, inp = (int(x) for x in got["weight_shape"].tolist())
        size = int(self.scheme["group_size"])
        u = unpack_int32(got["weight_packed"], 4, 1)[:, :inp]  # the signed values plus 8: 0..15
        scale = got["weight_scale"].float().reshape(out, -1)
        zero = got.get("weight_zero_point")
        if zero is None:
            signed_zero = torch.zeros_like(scale)
        elif zero.dtype == torch.int32 and zero.numel() * 8 >= out:  # (as dequantize reads it)
            signed_zero = unpack_int32(zero, 4, 0)[:out].float() - 8  # packed along the output
        else:
            signed_zero = zero.float().reshape(out, -1)
        return Int4Groups.of(u, scale, signed_zero + 8, got.get("weight_g_idx"), size)  # (u - 8 - zero) * scale

    def _spreader(self, scale: torch.Tensor, shape: tuple[int, int], g_idx: torch.Tensor | None):
        """A function spreading a per-(tensor | channel | group | block) tensor over the weight."""
        out, inp = shape
        strategy = self.scheme.get("strategy", "tensor")

        def spread(t: torch.Tensor) -> torch.Tensor:
            if strategy == "tensor" or t.numel() == 1:
                return t.reshape(()).expand(out, inp)
            if strategy == "channel":
                return t.reshape(out, 1).expand(out, inp)
            if strategy == "block":
                return expand_blocks(t.reshape(t.shape[0], -1), torch.Size((out, inp)), self._block())
            groups = g_idx.long() if g_idx is not None else torch.arange(inp) // int(self.scheme["group_size"])
            return t.reshape(out, -1)[:, groups]

        return spread


def checkpoint_format(quantization_config: dict | None) -> QuantizedReader | None:
    """The reader of a checkpoint saved quantized in one of :data:`FORMATS`; None for another
    ``quant_method`` (bitsandbytes, or a family's own such as gpt-oss's mxfp4: their loaders decide)."""
    if not quantization_config:
        return None
    qc = dict(quantization_config)
    method = qc.get("quant_method")
    if method == "gptq":
        return GPTQReader(qc)
    if method == "awq":
        return AWQReader(qc)
    if method == "fp8":
        return FP8Reader(qc)
    if method == "compressed-tensors":
        return CompressedTensorsReader(qc)
    return None
