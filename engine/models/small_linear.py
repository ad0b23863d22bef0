"""Linear layers for the few rows of a decode, on a CPU with bfloat16 units: ``augur::small_linear``.

A decode step feeds a linear layer one row a sequence, a draft level one or two, a verify a few: a
matrix-vector product, whose speed is how fast the weights stream. On this project's CPU
(AVX512-BF16) oneDNN's bfloat16 GEMM streams the demo target's weights at 16-23 GB/s at one to
eight rows, a quarter of what the memory gives; the C++ kernel (``small_linear_cpu.cpp``, built on
first use like the attention kernel) does a layer's one or two rows in about half oneDNN's time
(docs/benchmarks.md). It serves bfloat16 inputs of one to three rows; past that the sums are
compute-bound and oneDNN's prepacked GEMM is faster, so more rows go there. Other dtypes, and every
CPU without AVX512-BF16, run ``F.linear`` (the op's Python reference, used on every other device).

Each output of the kernel is one float32 sum in a fixed order whatever the number of rows, so a
short verify's row is bit for bit the decode of that row (up to :data:`MAX_ROWS` rows).

A layer keeps its weight and a oneDNN-packed copy: the memory a compiled model's frozen graph took,
since the op is opaque to ``torch.compile`` (as ``augur::paged_attention`` is) and inductor makes
no copy of its own. A large model served eagerly keeps only the packed weights instead, as before
(``engine.runner.loader.load_model``).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.attention.cpu_kernel import build_cpu_extension
from engine.models.packed import PackedLinear
from engine.platform import cpu_flags

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("small_linear_cpu.cpp")
MAX_ROWS = 3  # the kernel's rows (kMaxRows in the C++ source); more go to oneDNN's packed weights

_lib = torch.library.Library("augur", "FRAGMENT")
_lib.define("small_linear(Tensor x, Tensor weight, Tensor? packed=None, Tensor? bias=None) -> Tensor")


def _small_linear_reference(x, weight, packed=None, bias=None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _small_linear_fake(x, weight, packed=None, bias=None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


_lib.impl("small_linear", _small_linear_reference, "CompositeExplicitAutograd")
torch.library.register_fake("augur::small_linear", _small_linear_fake, lib=_lib)


@functools.cache
def load_small_linear() -> bool:
    """Build (first use) and register the kernel where this CPU has AVX512-BF16; whether it serves."""
    if "avx512_bf16" not in cpu_flags():
        return False
    try:
        build_cpu_extension("augur_small_linear_cpu", SOURCE)
    except Exception as exc:  # no compiler, no ninja, a build error: oneDNN's GEMM serves
        logger.warning("the C++ small-batch linear kernel is unavailable (%s); using F.linear", exc)
        return False
    return True


def small_rows_serve(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a model of ``dtype`` on ``device`` gets the kernel (building it on first use)."""
    return device.type == "cpu" and dtype == torch.bfloat16 and load_small_linear()


class SmallRowsLinear(PackedLinear):
    """A :class:`PackedLinear` that also keeps its weight as loaded: one to three rows go through the
    kernel on it, more through oneDNN on the packed copy (both in ``augur::small_linear``). A model's
    layers become these through ``model.pack_for_cpu(SmallRowsLinear)`` (``engine.runner.loader``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight, bias)
        self.register_buffer("weight", weight.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.augur.small_linear(x.reshape(-1, self.in_features), self.weight, self.packed, self.bias)
        return y.view(*lead, self.out_features)
