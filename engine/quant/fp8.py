"""FP8 weights on FP8 matrix multiplies (``--quantization fp8``).

*Scheme* (W8A8, as vLLM's and SGLang's ``fp8``): each linear layer's weight ``[N, K]`` is held as
``float8_e4m3fn`` with one float32 scale per output row, and each call quantizes its activations per
token: ``x ≈ xq * sx`` with ``sx = max|x_row| / 448``. The product is ``torch._scaled_mm(xq, wq^T, sx,
sw)``: the FP8 tensor cores on CUDA (sm89+; a scale per row needs sm90), PyTorch's own kernel on a CPU.
Half of bfloat16's bytes a weight: a decode bound by reading the weights reads half as many. On CUDA the
activations are quantized in one Triton kernel of ours (engine/quant/fp8_tokens.py, the same bits).

*Where the weights come from*: an FP8 checkpoint whose scales are per tensor or per row (AutoFP8's
``quant_method: fp8`` with ``weight_scale``, compressed-tensors ``float-quantized`` with tensor or channel
strategy) is served with its own e4m3 values and scales (a tensor's scale spread over its rows), not
re-quantized; a full-precision checkpoint is quantized per row at load. A block-scaled checkpoint
(128 x 128, DeepSeek-V3, Qwen3's ``-FP8``) is served from its bytes weight-only on a Triton kernel
(engine/quant/fp8_block.py), where its scales vary along a row.

The served model is this W8A8 product, not the dequantized one: activations lose bits at every layer
(E4M3 keeps about two significant digits), and every speculative method is exact against it. Under the
batch-invariant mode a layer computes the same product in float32 on ``augur::invariant_linear``
(the weight dequantized per call): one order per output whatever the rows beside it.

A layer whose shape the FP8 kernels cannot take (rows or inputs not a multiple of 16) stays in full
precision, as the LM head always does.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from torch import nn

from engine.quant.install import ROUTERS, assemble, replace

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
TRITON = importlib.util.find_spec("triton") is not None  # the activations' quantization in one kernel on CUDA
FP8_MAX = 448.0


def fits(in_features: int, out_features: int) -> bool:
    return in_features % 16 == 0 and out_features % 16 == 0


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` → ``(e4m3 [N, K], float32 scale [N])``: each row's largest magnitude maps to 448."""
    w = weight.float()
    scale = (w.abs().amax(1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations ``[T, K]`` → ``(e4m3 [T, K], float32 scale [T, 1])``, a scale per token (row)."""
    xf = x.float()
    scale = (xf.abs().amax(1, keepdim=True) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8Linear(nn.Module):
    """A linear layer of e4m3 weights with a scale per row, multiplied by per-token e4m3 activations."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.contiguous())  # [N, K] e4m3
        self.register_buffer("weight_scale", scale.float().reshape(1, -1).contiguous())  # [1, N]
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.invariant = False  # on augur::invariant_linear (the batch-invariant mode)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        return cls(*quantize_rows(linear.weight.detach()), linear.bias)

    @staticmethod
    def tokens(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A call's activations ``[T, K]`` quantized per token: ``(e4m3 [T, K], float32 scale [T, 1])``."""
        if flat.is_cuda and TRITON:  # one kernel, the same bits (engine/quant/fp8_tokens.py)
            from engine.quant.fp8_tokens import quantize_tokens_kernel

            return quantize_tokens_kernel(flat)
        return quantize_tokens(flat)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        y = self.product(*self.tokens(flat), x.dtype).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def product(self, xq: torch.Tensor, sx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The quantized rows times the weight, for a model in ``dtype``."""
        if self.invariant:
            w = self.weight.float() * self.weight_scale.t()
            return torch.ops.augur.invariant_linear(xq.float() * sx, w, None)
        # CUDA's per-row scaled product returns bfloat16 only: another dtype is cast from it
        out = torch.bfloat16 if xq.is_cuda else dtype
        return torch._scaled_mm(xq, self.weight.t(), sx, self.weight_scale, out_dtype=out)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 weights, per-row scales"


def fp8_layer(name: str, linear: nn.Linear, skip: tuple[str, ...] = ("lm_head", *ROUTERS)) -> Fp8Linear | None:
    """``linear`` (at module path ``name``) quantized per row to an :class:`Fp8Linear`, or None where it
    stays in full precision: named in ``skip``, or a shape the kernels cannot take."""
    if name.rsplit(".", 1)[-1] in skip:
        return None
    if not fits(linear.in_features, linear.out_features):
        logger.info("fp8: %s %s stays in full precision (shape)", name, tuple(linear.weight.shape))
        return None
    return Fp8Linear.from_linear(linear)


def quantize_linears_fp8(model: nn.Module, skip: tuple[str, ...] = ("lm_head", *ROUTERS)) -> int:
    """Replace every ``nn.Linear`` of ``model`` the kernels can take, but those named in ``skip`` (the LM
    head, and a mixture's router), by an :class:`Fp8Linear` quantized per row from its loaded weight,
    one at a time. Returns how many were."""
    replaced = 0
    for name, module in list(model.named_modules()):
        layer = fp8_layer(name, module, skip) if isinstance(module, nn.Linear) else None
        if layer is not None:
            replace(model, name, layer)
            replaced += 1
    return replaced


def install_checkpoint_fp8(model: nn.Module, weights: dict, select=None, block_k: int | None = None) -> int:
    """Serve an FP8 checkpoint's own e4m3 weights and scales (``weights``: by checkpoint module, as
    :meth:`engine.quant.checkpoint.QuantizedReader.fp8_weights` gives them: values ``[out, in]`` and a
    scale per row and block of ``block_k`` inputs), each fused layer's parts stacked (``select``: a
    rank's cut under tensor parallelism, on block boundaries). A layer with one scale per row becomes
    an :class:`Fp8Linear`; one whose scales vary along its rows (128 x 128 blocks) an
    :class:`engine.quant.fp8_block.Fp8BlockLinear`, where its kernel runs (CUDA; Triton's interpreter).
    Other layers keep the dequantized weights they loaded. Returns how many were replaced."""
    from engine.quant.fp8_block import Fp8BlockLinear, kernel_serves

    replaced = 0
    for path, (linear, (w8, scale)) in assemble(model, weights, select, _fp8_rank_part(block_k)).items():
        device = linear.weight.device
        if scale.shape[1] == 1 and fits(linear.in_features, linear.out_features):
            layer = Fp8Linear(w8.to(device), scale[:, 0].to(device), linear.bias)
        elif scale.shape[1] > 1 and kernel_serves(device):
            layer = Fp8BlockLinear(w8.to(device), scale.to(device), (1, block_k), linear.bias)
        else:
            logger.info("fp8: %s stays dequantized (shape, or no block kernel on %s)", path, device.type)
            continue
        replace(model, path, layer)
        replaced += 1
    return replaced


def _fp8_rank_part(block_k: int | None):
    def part(parts, cut, module: str = ""):
        if cut is None:
            return parts
        if isinstance(cut, str):
            return None
        w8, scale = parts
        dim, start, length = cut
        if dim == 0:
            return w8.narrow(0, start, length), scale.narrow(0, start, length)
        if scale.shape[1] == 1:
            return w8.narrow(1, start, length), scale
        if start % block_k or (length % block_k and start + length != w8.shape[1]):
            return None  # a rank's inputs would split a block
        return w8.narrow(1, start, length), scale.narrow(1, start // block_k, -(-length // block_k))

    return part
