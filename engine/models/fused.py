"""A decoder layer's small operators fused into one Triton kernel each, for GPUs: ``augur::fused_rope``,
``augur::fused_rms_norm``, ``augur::fused_add_rms_norm`` and ``augur::fused_act_mul``.

At batch 1 a decode is bound by reading the weights, and everything between the matrix products is
overhead. On an H200 at the Llama-3.1-8B shape (docs/benchmarks.md, ``loadtest.profile_gpu``) the
products took 4.15 ms of a 6.65 ms decode; the rest was ~2 ms of small kernels, each a few bytes of
work and a launch: RoPE as six (two products, a negation, a concatenation and a sum per q and k, on
strided views), an RMSNorm as four (to float32, the norm, back, the weight's product), the residual
sums and the MLP's activation and product. Here each is one kernel:

- ``fused_rope(qkv, cos, sin, heads, kv_heads[, q_norm, k_norm, eps, unit_offset])``: the rotated q
  and k, read from the qkv projection's output, computed with the roundings of the eager expression
  (``apply_rope``): each product rounded to the dtype, then their sum. It gives the same bits in
  bfloat16 and float16. A family that normalizes each head before RoPE (Qwen3 and Qwen3-MoE, Gemma 3)
  passes its norms' weights: the head's norm is taken in the same program, with the bits
  ``fused_rms_norm`` gives it (eagerly those norms and the rotation were about twelve kernels a layer:
  the norms' copies out of the strided qkv view, and RoPE's six per q and k). Given the layer's KV
  pool and the tokens' slots (the triton attention backend's ``kv_write_slots``, for a pool in the
  model's dtype), a key head's program also stores its rotated key and copies its value into the
  token's slot: the attention operator then writes nothing, where it launched two copies a layer.
- ``fused_rms_norm(x, weight, eps, unit_offset)`` and ``fused_add_rms_norm(x, delta, ...)``
  (``x + delta``, rounded as torch's sum is, then its norm: both returned): one program a row, the
  sum of squares in float32, then Llama's order (normalized, rounded to the dtype, times the weight)
  or Gemma's (times ``1 + weight`` in float32). The sum of squares is reduced in another order than
  torch's kernel, so a row's result can differ from eager torch's in its last bit; it never depends
  on the other rows.
- ``fused_act_mul(gate_up, act)``: ``act(gate) * up`` for SiLU and tanh-GELU, the activation rounded
  to the dtype before the product, as the eager expression does.

The loader turns them on for a model in bfloat16 or float16 on CUDA where Triton imports
(``LlamaForCausalLM.use_fused_ops``); float32 keeps the eager expressions (a compiler may contract a
float32 product and sum into one fused multiply-add, which would change RoPE's bits). On CPU tensors
the same kernels run in Triton's interpreter (``TRITON_INTERPRET=1``): the tests check them there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_lib = torch.library.Library("augur", "FRAGMENT")
_lib.define(
    "fused_rope(Tensor qkv, Tensor cos, Tensor sin, int heads, int kv_heads, Tensor? q_norm=None, "
    "Tensor? k_norm=None, float eps=0.0, bool unit_offset=False, Tensor(a!)? kv_pool=None, int layer=0, "
    "Tensor? slots=None) -> (Tensor, Tensor)"
)
_lib.define("fused_rms_norm(Tensor x, Tensor weight, float eps, bool unit_offset=False) -> Tensor")
_lib.define(
    "fused_add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps, bool unit_offset=False) -> (Tensor, Tensor)"
)
_lib.define("fused_act_mul(Tensor gate_up, str act) -> Tensor")

FUSED_ACTIVATIONS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1}  # act name → the kernel's ACT
_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # the kernels' DT


@triton.jit
def _round(x, DT: tl.constexpr):
    """Float32 ``x`` rounded to the model's dtype (``DT``: 0 float32, 1 float16, 2 bfloat16), returned in
    float32. On the bits (to nearest, ties to even; finite values): a compiler may fold a conversion to
    a narrower float and back away (on an H200 one did, in bfloat16 and float16, and RoPE's products
    went unrounded), never integer arithmetic; Triton's interpreter also truncates where a GPU rounds."""
    if DT == 2:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        y = bits.to(tl.float32, bitcast=True)
    elif DT == 1:  # float16's 10 bits of mantissa on the bits; below its normal range, multiples of 2**-24
        bits = x.to(tl.uint32, bitcast=True)
        normal = (((bits + 0xFFF + ((bits >> 13) & 1)) >> 13) << 13).to(tl.float32, bitcast=True)
        tiny = (tl.abs(x) + 0.75) - 0.75  # the float32 sum's last place is 2**-24 there: float16's rounding
        tiny = tl.where((bits >> 31) == 1, -tiny, tiny)  # (the sign kept, of a zero too)
        y = tl.where(tl.abs(x) < 6.103515625e-05, tiny, normal)
    else:
        y = x
    return y


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, qkv_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, kc_ptr, vc_ptr, slots_ptr,
    qkv_stride, cs_stride, H, HKV, n_dim, eps, stride_cs, stride_ch,
    D: tl.constexpr, D_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, DT: tl.constexpr,
    NORM: tl.constexpr, CACHE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)  # below H: a query head; from H on: a key head
    cols = tl.arange(0, HALF_PAD)
    m = cols < HALF
    src = qkv_ptr + t * qkv_stride + h * D
    x1 = tl.load(src + cols, mask=m, other=0.0)
    x2 = tl.load(src + HALF + cols, mask=m, other=0.0)
    row = t * cs_stride
    c1 = tl.load(cos_ptr + row + cols, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + row + HALF + cols, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + row + cols, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + row + HALF + cols, mask=m, other=0.0).to(tl.float32)
    dt = x1.dtype
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    if NORM > 0:  # the head's RMSNorm first (Qwen3's, Gemma 3's q/k norms), as _rms_norm_kernel computes it
        full = tl.arange(0, D_PAD)
        xf = tl.load(src + full, mask=full < D, other=0.0).to(tl.float32)  # the whole head: the same sum
        r = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_dim + eps)  # (n_dim = D, a runtime value as there)
        if h < H:
            w_ptr = qn_ptr
        else:
            w_ptr = kn_ptr
        w1 = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + cols, mask=m, other=0.0).to(tl.float32)
        if NORM == 2:  # Gemma: y * (1 + w) in float32
            a1, a2 = _round(a1 * r * (1.0 + w1), DT), _round(a2 * r * (1.0 + w2), DT)
        else:  # Llama: y rounded to the dtype, then times the weight
            a1, a2 = _round(_round(a1 * r, DT) * w1, DT), _round(_round(a2 * r, DT) * w2, DT)
    # x * cos + cat(-x2, x1) * sin, each product rounded to the dtype before the sum (as eager torch).
    o1 = _round(_round(a1 * c1, DT) + _round(-a2 * s1, DT), DT).to(dt)
    o2 = _round(_round(a2 * c2, DT) + _round(a1 * s2, DT), DT).to(dt)
    if h < H:
        dst = q_ptr + (t * H + h) * D
    else:
        dst = k_ptr + (t * HKV + (h - H)) * D
    tl.store(dst + cols, o1, mask=m)
    tl.store(dst + HALF + cols, o2, mask=m)
    if CACHE:  # a key head also writes its rotated key, and copies its value, to the token's pool slot
        if h >= H:
            row = tl.load(slots_ptr + t) * stride_cs + (h - H) * stride_ch
            tl.store(kc_ptr + row + cols, o1, mask=m)
            tl.store(kc_ptr + row + HALF + cols, o2, mask=m)
            full = tl.arange(0, D_PAD)
            value = tl.load(src + HKV * D + full, mask=full < D)  # v's head: HKV heads past the key's
            tl.store(vc_ptr + row + full, value, mask=full < D)


@triton.jit
def _rms_norm_kernel(
    out_ptr, sum_ptr, x_ptr, d_ptr, w_ptr, x_stride, d_stride, N, eps,
    BLOCK: tl.constexpr, ADD: tl.constexpr, UNIT_OFFSET: tl.constexpr, DT: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    x = tl.load(x_ptr + row * x_stride + cols, mask=m, other=0.0)
    dt = x.dtype
    xf = x.to(tl.float32)
    if ADD:  # the residual sum, rounded to the dtype as torch's is, then normed
        d = tl.load(d_ptr + row * d_stride + cols, mask=m, other=0.0)
        xf = _round(xf + d.to(tl.float32), DT)
        tl.store(sum_ptr + row * N + cols, xf.to(dt), mask=m)
    y = xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    if UNIT_OFFSET:  # Gemma: y * (1 + w) in float32
        out = y * (1.0 + w)
    else:  # Llama: y rounded to the dtype, then times the weight
        out = _round(y, DT) * w
    tl.store(out_ptr + row * N + cols, _round(out, DT).to(dt), mask=m)


@triton.jit
def _act_mul_kernel(out_ptr, x_ptr, x_stride, inner, BLOCK: tl.constexpr, ACT: tl.constexpr, DT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < inner
    gate = tl.load(x_ptr + row * x_stride + cols, mask=m, other=0.0)
    up = tl.load(x_ptr + row * x_stride + inner + cols, mask=m, other=0.0)
    g = gate.to(tl.float32)
    if ACT == 0:  # SiLU
        a = g / (1.0 + tl.exp(-g))
    else:  # GELU, tanh approximation, 1 + tanh(u) summed as torch does (tanh(u) = 1 - 2 / (exp(2u) + 1))
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = 0.5 * g * (1.0 + (1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)))
    a = _round(a, DT)  # the activation rounded to the dtype, then the product
    tl.store(out_ptr + row * inner + cols, _round(a * up.to(tl.float32), DT).to(gate.dtype), mask=m)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as [rows, last] with unit stride in the last dimension (a view where it can be)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def fused_rope(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    kv_heads: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
    unit_offset: bool = False,
    kv_pool: torch.Tensor | None = None,
    layer: int = 0,
    slots: torch.Tensor | None = None,
):
    """qkv [T, (heads + 2 kv_heads) * D]; cos/sin [T, D] (or [T, 1, D]) in qkv's dtype → q [T, heads, D],
    k [T, kv_heads, D], rotated (rotate-half convention). ``q_norm`` / ``k_norm`` [D]: each head is
    RMS-normalized with them first (Qwen3's and Gemma 3's q/k norms; ``unit_offset``: Gemma's ``1 +
    weight``), the bits :func:`fused_rms_norm` gives. ``kv_pool`` [layers, 2, num_slots, kv_heads, D]
    (in qkv's dtype) and ``slots`` [T]: each token's rotated k and its v are also written to its slot
    of ``kv_pool[layer]``, as the attention operator would write them."""
    qkv = _rows(qkv)
    T = qkv.shape[0]
    D = qkv.shape[1] // (heads + 2 * kv_heads)
    cos, sin = _rows(cos), _rows(sin)
    q = qkv.new_empty(T, heads, D)
    k = qkv.new_empty(T, kv_heads, D)
    if (q_norm is None) != (k_norm is None):
        raise ValueError("fused_rope normalizes both q and k or neither")
    if kv_pool is not None:
        if slots is None or kv_pool.dtype != qkv.dtype or kv_pool.shape[3:] != (kv_heads, D):
            raise ValueError("fused_rope writes K/V to a pool of qkv's dtype and heads, at the tokens' slots")
        k_cache, v_cache = kv_pool[layer, 0], kv_pool[layer, 1]
    if T:
        half = D // 2
        norm = 0 if q_norm is None else 2 if unit_offset else 1
        cache = kv_pool is not None
        _rope_kernel[(T, heads + kv_heads)](
            q, k, qkv, cos, sin, qkv if q_norm is None else q_norm, qkv if k_norm is None else k_norm,
            k_cache if cache else qkv, v_cache if cache else qkv, slots if cache else qkv,
            qkv.stride(0), cos.stride(0), heads, kv_heads, D, eps,
            k_cache.stride(0) if cache else 0, k_cache.stride(1) if cache else 0,
            D=D, D_PAD=triton.next_power_of_2(D), HALF=half, HALF_PAD=triton.next_power_of_2(half),
            DT=_DTYPES[qkv.dtype], NORM=norm, CACHE=cache, num_warps=1 if D <= 128 else 2,
        )  # fmt: skip
    return q, k


def _norm(x, delta, weight, eps, unit_offset):
    shape = x.shape
    x2 = _rows(x)
    N = x2.shape[1]
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    total = torch.empty_like(out) if delta is not None else out
    d2 = _rows(delta) if delta is not None else x2
    if x2.shape[0]:
        block = triton.next_power_of_2(N)
        _rms_norm_kernel[(x2.shape[0],)](
            out, total, x2, d2, weight, x2.stride(0), d2.stride(0), N, eps,
            BLOCK=block, ADD=delta is not None, UNIT_OFFSET=unit_offset, DT=_DTYPES[x.dtype],
            num_warps=min(16, max(1, block // 512)),
        )  # fmt: skip
    return out.view(shape), total.view(shape)


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    return _norm(x, None, weight, eps, unit_offset)[0]


def fused_add_rms_norm(x, delta, weight, eps: float, unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm of ``x + delta``, ``x + delta``)."""
    return _norm(x, delta, weight, eps, unit_offset)


def fused_act_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """gate_up [..., 2 I] → act(gate) * up [..., I]."""
    shape = gate_up.shape
    x = _rows(gate_up)
    inner = x.shape[1] // 2
    out = x.new_empty(x.shape[0], inner)
    if x.shape[0]:
        block = min(1024, triton.next_power_of_2(inner))
        _act_mul_kernel[(x.shape[0], triton.cdiv(inner, block))](
            out, x, x.stride(0), inner, BLOCK=block, ACT=FUSED_ACTIVATIONS[act], DT=_DTYPES[x.dtype], num_warps=4
        )
    return out.view(*shape[:-1], inner)


def _fake_rope(qkv, cos, sin, heads, kv_heads, *_, **__):
    D = qkv.shape[-1] // (heads + 2 * kv_heads)
    return qkv.new_empty(qkv.shape[0], heads, D), qkv.new_empty(qkv.shape[0], kv_heads, D)


for _name, _impl, _fake in [
    ("fused_rope", fused_rope, _fake_rope),
    ("fused_rms_norm", fused_rms_norm, lambda x, *_: torch.empty_like(x)),
    ("fused_add_rms_norm", fused_add_rms_norm, lambda x, *_: (torch.empty_like(x), torch.empty_like(x))),
    ("fused_act_mul", fused_act_mul, lambda g, act: g.new_empty(*g.shape[:-1], g.shape[-1] // 2)),
]:
    _lib.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"augur::{_name}", _fake, lib=_lib)
