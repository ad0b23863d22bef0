"""The batch-invariant operators: ``augur::invariant_linear``, ``invariant_rms_norm``,
``invariant_act_mul`` and ``invariant_softcap``, each output one float32 computation in one order.

A request's tokens must not depend on what else is in its step (docs/speculative.md, "The promise"). A
linear layer is where they would first: a BLAS chooses how to split and order each output's sum over
the inner dimension by the shape of the call, so the same row reduces one way in a one-row decode,
another in a sixteen-row batch or a verify, a third in a prefill chunk; in bfloat16, and now and then
in float32, the last bits that differ change a token. Norms and activations would next: torch's kernels
and inductor's fused ones treat an element by where the flat tensor's split over threads and vectors
puts it, and a compiled forward rounds its intermediates otherwise than the eager one. The kernels
(``invariant_cpu.cpp``, built on first use like the attention kernel) give every output one value
whatever the rows around it, eager or compiled.

Under the batch-invariant mode (``--batch-invariant``, engine/config.py) the loader swaps every linear
layer of the target, its tied output layer included, for an :class:`InvariantLinear`, and the model's
norms, MLP activations and logit soft cap for these operators (``use_invariant_ops`` of
engine/models/llama.py); what is left of a forward (embedding look-ups, RoPE's products and sums, the
residual sums) is exactly rounded element by element, and a compiled forward keeps eager's roundings
(``emulate_precision_casts``, engine/runner/model_runner.py). On CUDA the operators run Triton kernels
(engine/models/invariant_cuda.py, registered when the mode loads a model there); elsewhere their
references (the eager expressions they replace), which keep no promise.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.cpu_kernel import build_cpu_extension

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("invariant_cpu.cpp")

_lib = torch.library.Library("augur", "FRAGMENT")
_lib.define("invariant_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor")
_lib.define("invariant_rms_norm(Tensor x, Tensor weight, float eps, bool unit_offset=False) -> Tensor")
_lib.define("invariant_act_mul(Tensor gate_up, str act) -> Tensor")
_lib.define("invariant_softcap(Tensor x, float cap) -> Tensor")

# The MLP activations of the families served, by the names their configs give (hidden_act, Gemma's
# hidden_activation), as transformers defines them. Not transformers.activations itself: importing it
# costs 0.65 s (its kernel hub), paid by every process that loads a model (a tensor-parallel worker too).
ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),  # (Arcee's: ReLU squared)
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"the MLP activation {name!r} is not supported (supported: {sorted(ACTIVATIONS)})")
    return ACTIVATIONS[name]


# The references (the eager expressions each operator replaces), for devices without a kernel.
def _rms_norm(x, weight, eps, unit_offset=False) -> torch.Tensor:
    y = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return (y * (1.0 + weight.float())).to(x.dtype) if unit_offset else weight * y.to(x.dtype)


def _act_mul(gate_up, act) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return ACTIVATIONS[act](gate) * up


def _softcap(x, cap) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


def _fake_linear(x, weight, bias=None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def _fake_act_mul(gate_up, act) -> torch.Tensor:
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


for _name, _ref, _fake in [
    ("invariant_linear", F.linear, _fake_linear),
    ("invariant_rms_norm", _rms_norm, lambda x, *_: torch.empty_like(x)),
    ("invariant_act_mul", _act_mul, _fake_act_mul),
    ("invariant_softcap", _softcap, lambda x, cap: torch.empty_like(x)),
]:
    _lib.impl(_name, _ref, "CompositeExplicitAutograd")
    torch.library.register_fake(f"augur::{_name}", _fake, lib=_lib)


@functools.cache
def load_invariant_kernels() -> bool:
    """Build (first use) and register the CPU kernels; whether they serve. Where it cannot be built the
    mode cannot hold its promise on a CPU: the caller refuses it (it never serves a variant kernel
    under the invariant mode's name)."""
    try:
        build_cpu_extension("augur_invariant_cpu", SOURCE, flags=("-ffp-contract=off", "-fopenmp"))
    except Exception as exc:
        logger.warning("the batch-invariant kernels are unavailable (%s)", exc)
        return False
    return True


class InvariantLinear(nn.Module):
    """A linear layer on ``augur::invariant_linear``, with its weight as loaded."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("weight", weight.detach().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.augur.invariant_linear(x.reshape(-1, self.in_features), self.weight, self.bias)
        return y.view(*lead, self.out_features)
