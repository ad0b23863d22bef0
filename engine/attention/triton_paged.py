"""The GPU attention backend: one Triton kernel that reads K/V straight from the paged pool.

Prefill chunks, decode tokens and draft trees of many sequences run in the same launch, without
gathering any sequence's K/V into a padded copy and without a dense mask:

- A *program* takes up to ``BLOCK_Q`` new tokens of one sequence and one KV head. Its rows are those
  tokens times the ``G = H / Hkv`` query heads that share the KV head (GQA), so each K/V tile it loads
  serves every query head of the group.
- It walks the sequence's keys in tiles of ``BLOCK_N``, finding each key's slot through the block
  table, and keeps a running (flash) softmax in float32: no score matrix is ever stored.
- Visibility is computed per (query, key) in the kernel: cached keys are visible; new keys are
  causal, or read from the sequence's own tree mask (a ``q x width`` byte matrix, packed with the other
  sequences' into one flat tensor); the sliding window and the soft-cap are compile-time options.
  Tiles past the causal horizon, or before the sliding window, are never loaded.
- A batch of few programs (a decode or a draft's verify of one long sequence: ``Hkv`` programs) splits
  each program's keys into up to ``MAX_SPLITS`` ranges on a third grid axis (flash-decoding); a
  second kernel rescales the ranges' partial outputs to their common maximum and normalises once.
  Without the split a 4-token verify of an 8B model at 1,024 tokens of context ran its attention on
  8 of an H200's 132 multiprocessors: 5.6x the decode's attention time (docs/benchmarks-history.md).

Memory is the output and per-sequence metadata (``O(T * H * D + B * blocks + tree masks)``), whatever
the context lengths. One assumption the window skip relies on: a key's position never exceeds its
context index (a draft tree's node sits at a slot at or past its position), so a key before
``min(query position) - window + 1`` is out of every query's window.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from engine.attention.common import optional_inputs, padded_block_tables, triton_interpreted
from engine.attention.kv_dtype import is_fp8, write_rows
from engine.attention.staging import Pack, direct_pack
from engine.platform import sm_count

# ``seq_info`` has one int32 row per sequence: context length, KV length (context + new tokens), its
# first token in the flat batch, new tokens, offset of its tree mask in ``masks`` (-1: causal), first key
# the mask covers (a causal sequence's KV length, so that no key reads a mask), mask width, padding.
SEQ_FIELDS = 8
BLOCK_Q_CHUNK = 16  # most new tokens of one sequence a program takes (fewer where no sequence feeds as many)
MAX_SPLITS = 16  # most key ranges one token's keys are split into
MIN_KEYS_PER_SPLIT = 256
SPLIT_SCRATCH_TOKENS = 1024  # splits x new tokens at most: bounds the float32 scratch of a split batch


@dataclass
class TritonMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot each new token's K/V is written to
    block_tables: torch.Tensor  # [B, max_blocks] int32 (padding → 0, never read)
    seq_info: torch.Tensor  # [B, SEQ_FIELDS] int32 (see SEQ_FIELDS)
    programs: torch.Tensor  # [P, 2] int32: (sequence, first new token) of each program
    positions: torch.Tensor  # [T] int64: each new token's position (the sliding window reads them)
    masks: torch.Tensor  # [sum q * width] uint8: every tree mask, row-major, back to back (≥ 1 element)
    block_size: int
    block_q: int
    sliding_window: int  # 0: the model has none
    max_kv_len: int
    num_splits: int  # key ranges per program (0: chosen from the GPU's size and the batch's tokens)
    num_seqs: int

    def kv_write_slots(self, kv_pool: torch.Tensor) -> torch.Tensor | None:
        """The slot mapping, for a pool in the model's dtype (fused RoPE writes K/V there: one kernel where
        ``attend`` would launch two copies); None for an FP8 pool, whose rows ``attend`` quantizes."""
        return None if is_fp8(kv_pool) else self.slot_mapping

    def tie_shapes(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Nothing declared: the GPU runs small batches as captured graphs, where no compiled wrapper is
        called per step, and a padded batch's sizes are not the unpadded ones."""

    def attend(
        self, q, k, v, kv_pool, layer: int, scale: float, sliding: bool, softcap: float, sinks=None, kv_scales=None
    ):
        window = self.sliding_window if sliding else 0
        return torch.ops.augur.triton_paged_attention(
            q, k, v, kv_pool, layer, self.slot_mapping, self.block_tables, self.seq_info, self.programs,
            self.positions, self.masks, self.block_size, self.block_q, window, scale, softcap, self.max_kv_len,
            self.num_splits, **optional_inputs(sinks, kv_scales),
        )  # fmt: skip


def build_triton_metadata(
    q_lens: list[int],
    ctx_lens: list[int],
    block_tables: list[list[int]] | np.ndarray,  # or their padded rows [B, >= max blocks]
    block_size: int,
    positions: torch.Tensor | int,  # [T] int64 on the target device, or its index in ``pack``
    new_token_masks: list[torch.Tensor | None] | None = None,  # per sequence [q_len, ctx+q_len-mask_start] bool
    mask_starts: list[int] | None = None,  # per sequence: first key index the mask covers (default: ctx_len)
    sliding_window: int | None = None,
    device: torch.device | str = "cpu",
    num_splits: int = 0,
    write_lens: list[int] | None = None,  # per sequence: how many new tokens are real (the rest are padding)
    scratch_slot: int = -1,  # ... and the slot padding tokens write to
    pack: Pack | None = None,  # the forward's other inputs: the metadata joins their one copy
    invariant: bool = False,  # the batch-invariant mode: one program size and no key split for every batch
) -> TritonMetadata:
    """Metadata for sequences laid out back to back in the flat batch (same arguments and meaning as
    :func:`engine.attention.sdpa.build_sdpa_metadata`). Everything is built on the host from the lists
    and joins ``pack``, sent in one copy with the forward's other inputs (engine/attention/staging.py);
    nothing here depends on the context lengths but the block tables.

    ``num_splits`` > 0 forces how many key ranges each program's keys are split into (the tests use
    it, and captured graphs, whose launch grid is fixed); 0 lets the operator choose from the GPU's
    size (:func:`key_splits`). Padding tokens (a sequence's new tokens past ``write_lens``) write
    their K/V to ``scratch_slot`` instead of the block table's slot, which is not theirs.

    ``invariant`` (the batch-invariant mode): every batch takes the same program size
    (``BLOCK_Q_CHUNK`` tokens) and no key split, whatever ``num_splits`` says, so a query walks its keys
    in the same tiles, in the same order, with the same products, in a decode, a verify or a prefill
    chunk: tiles past its own position are masked whole for it, and a masked tile leaves its running
    softmax as it was."""
    pack = pack if pack is not None else direct_pack(device)
    B = len(q_lens)
    kv_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    if not isinstance(block_tables, np.ndarray):  # else already padded (PersistentBlockTables.rows)
        block_tables = padded_block_tables(block_tables, kv_lens, block_size)

    block_q = BLOCK_Q_CHUNK if invariant else program_tokens(max(q_lens, default=0))
    num_splits = 1 if invariant else num_splits
    info: list[list[int]] = []
    programs: list[tuple[int, int]] = []
    host_masks: list[np.ndarray] = []
    device_masks: list[tuple[int, torch.Tensor]] = []  # (offset, mask) of tree masks already on the device
    mask_len = 0
    q_start = 0
    for b in range(B):
        q, c = q_lens[b], ctx_lens[b]
        m = None if new_token_masks is None else new_token_masks[b]
        start = c if mask_starts is None else mask_starts[b]
        if m is None:  # causal: no key is read from a mask
            off, start, width = -1, c + q, 0
        else:
            off, width = mask_len, c + q - start
            if tuple(m.shape) != (q, width):
                raise ValueError(f"sequence {b}: tree mask shape {tuple(m.shape)}, expected {(q, width)}")
            if m.device.type == "cpu":
                host_masks.append(np.asarray(m.reshape(-1).numpy(), dtype=np.uint8))
            else:
                host_masks.append(np.zeros(q * width, dtype=np.uint8))
                device_masks.append((mask_len, m))
            mask_len += q * width
        info.append([c, c + q, q_start, q, off, start, width, 0])
        programs.extend((b, i) for i in range(0, q, block_q))
        q_start += q

    # Each new token's slot: the block table entry of its context index.
    q_np, ctx_np = np.asarray(q_lens, dtype=np.int64), np.asarray(ctx_lens, dtype=np.int64)
    seq_of_tok = np.repeat(np.arange(B), q_np)
    index = (ctx_np - (np.cumsum(q_np) - q_np))[seq_of_tok] + np.arange(q_start)  # each new token's context index
    table = np.asarray(block_tables, dtype=np.int32)
    slots = table[seq_of_tok, index // block_size].astype(np.int64) * block_size + index % block_size
    if write_lens is not None:
        real = (ctx_np + np.asarray(write_lens, dtype=np.int64))[seq_of_tok]
        slots = np.where(index < real, slots, scratch_slot)

    masks = np.concatenate(host_masks) if host_masks else np.zeros(1, dtype=np.uint8)
    info_np = np.asarray(info, dtype=np.int32).reshape(B, SEQ_FIELDS)
    arrays = (slots, table, info_np, np.asarray(programs, dtype=np.int32).reshape(-1, 2), masks)
    staged = [pack.add(a) for a in arrays]
    pack.send()
    masks_t = pack[staged[4]]
    for off, m in device_masks:
        masks_t[off : off + m.numel()] = m.reshape(-1).to(torch.uint8)
    return TritonMetadata(
        slot_mapping=pack[staged[0]],
        block_tables=pack[staged[1]],
        seq_info=pack[staged[2]],
        programs=pack[staged[3]],
        positions=pack[positions] if isinstance(positions, int) else positions,
        masks=masks_t,
        block_size=block_size,
        block_q=block_q,
        sliding_window=sliding_window or 0,
        max_kv_len=max(kv_lens),
        num_splits=num_splits,
        num_seqs=B,
    )


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, H * D]
    partial_ptr,  # SPLIT: [splits, T, H, D] float32, each key range's unnormalised output
    ml_ptr,  # SPLIT: [splits, T, H, 2] float32, each key range's running max and sum (base 2)
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_slots, Hkv, D]: this layer's keys
    v_cache_ptr,  # [num_slots, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    seq_info_ptr,  # [B, SEQ_FIELDS] int32
    programs_ptr,  # [P, 2] int32
    positions_ptr,  # [T] int64
    masks_ptr,  # flat uint8 tree masks
    sinks_ptr,  # SINKS: [H] float32, each query head's sink logit
    kv_scales_ptr,  # SCALED: [2, Hkv] float32, an FP8 pool's K and V scale of each KV head
    stride_qt,
    stride_qh,
    stride_ot,
    stride_cs,  # K/V cache: slot stride
    stride_ch,  # K/V cache: head stride
    stride_bt,
    scale,
    softcap,
    window,
    num_tokens,
    num_heads,
    num_splits,
    G: tl.constexpr,  # query heads per KV head
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,  # >= BLOCK_Q * G, a power of two >= 16
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,  # tokens per KV block
    SOFTCAP: tl.constexpr,
    SLIDING: tl.constexpr,
    SINKS: tl.constexpr,  # a sink logit per head joins each softmax (added where the sums are final)
    FP8: tl.constexpr,  # the pool holds 8-bit floats: tiles are converted to the queries' dtype as loaded
    SCALED: tl.constexpr,  # FP8 with scales (else 1.0): K's multiplies the scores, V's the output
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,  # multiply in float32 (Triton's interpreter multiplies 16-bit floats wrongly)
    SPLIT: tl.constexpr,  # the third grid axis splits the keys into num_splits ranges (flash-decoding)
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(programs_ptr + pid * 2)
    q0 = tl.load(programs_ptr + pid * 2 + 1)
    info = seq_info_ptr + seq * 8  # SEQ_FIELDS
    ctx = tl.load(info + 0)
    kv_len = tl.load(info + 1)
    q_start = tl.load(info + 2)
    q_len = tl.load(info + 3)
    mask_off = tl.load(info + 4)
    mask_start = tl.load(info + 5)
    mask_width = tl.load(info + 6)

    rows = tl.arange(0, BLOCK_M)
    qi = q0 + rows // G  # the row's new-token index within its sequence
    head = kv_head * G + rows % G
    row_ok = (rows < BLOCK_Q * G) & (qi < q_len)
    tok = q_start + qi
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    # Keys this program may see: a causal block stops at its last token; a tree sees all new keys.
    is_tree = (mask_off >= 0).to(tl.int32)
    hi = kv_len - (1 - is_tree) * (kv_len - tl.minimum(kv_len, ctx + q0 + BLOCK_Q))
    lo = 0
    if SLIDING:
        q_pos = tl.load(positions_ptr + tok, mask=row_ok, other=0)
        first = tl.min(tl.where(row_ok, q_pos, 2**62), axis=0)
        lo = tl.maximum(first - window + 1, 0).to(tl.int32) // BLOCK_N * BLOCK_N
    if SPLIT:  # this program's share of the keys, whole tiles each (the last shares may be empty)
        per = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_N) * BLOCK_N
        lo = lo + tl.program_id(2) * per
        hi = tl.minimum(hi, lo + per)

    k_scale = 1.0
    v_scale = 1.0
    if SCALED:
        k_scale = tl.load(kv_scales_ptr + kv_head)
        v_scale = tl.load(kv_scales_ptr + tl.num_programs(1) + kv_head)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    qk_scale = scale * 1.4426950408889634  # log2(e): the softmax runs in base 2
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        page = tl.load(block_tables_ptr + seq * stride_bt + n // PAGE, mask=n_ok, other=0)
        slot = page.to(tl.int64) * PAGE + n % PAGE
        kv_offs = slot[:, None] * stride_cs + kv_head * stride_ch + d[None, :]
        kv_ok = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_ok, other=0.0)
        if FP8:
            k = k.to(q.dtype)  # (exact: every 8-bit float is one of the queries' dtype)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if SCALED:
            s = s * k_scale
        if SOFTCAP:
            # softcap * tanh(s * scale / softcap), tanh written with exp (stable at both ends)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s * scale / softcap) + 1.0)) * 1.4426950408889634
        else:
            s = s * qk_scale

        in_tree = n >= mask_start  # (a causal sequence's mask_start is its kv_len)
        bits = tl.load(
            masks_ptr + mask_off + qi[:, None] * mask_width + (n - mask_start)[None, :],
            mask=row_ok[:, None] & (in_tree & n_ok)[None, :],
            other=0,
        )
        causal = n[None, :] <= (ctx + qi)[:, None]
        visible = tl.where(in_tree[None, :], bits != 0, causal) & n_ok[None, :] & row_ok[:, None]
        if SLIDING:
            k_pos = tl.load(positions_ptr + q_start + n - ctx, mask=n_ok & (n >= ctx), other=0)
            k_pos = tl.where(n < ctx, n.to(tl.int64), k_pos)
            visible = visible & ((q_pos[:, None] - k_pos[None, :]) < window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
        p = tl.exp2(s - shift[:, None])
        alpha = tl.exp2(m_i - shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_ok, other=0.0)
        if FP8:
            v = v.to(q.dtype)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if SCALED:
        acc = acc * v_scale

    if SPLIT:
        at = (tl.program_id(2) * num_tokens + tok) * num_heads + head  # [BLOCK_M]
        tl.store(partial_ptr + at[:, None] * D + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(ml_ptr + at * 2, m_i, mask=row_ok)
        tl.store(ml_ptr + at * 2 + 1, l_i, mask=row_ok)
    else:
        if SINKS:  # one more term of the softmax's sum: exp(sink - max), in base 2
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0) * 1.4426950408889634
            l_i = l_i + tl.exp2(sink - tl.where(m_i == float("-inf"), sink, m_i))
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # (padding rows saw nothing)
        tl.store(
            out_ptr + tok[:, None] * stride_ot + head[:, None] * D + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def _combine_splits_kernel(
    out_ptr,  # [T, H * D]
    partial_ptr,  # [splits, T, H, D] float32
    ml_ptr,  # [splits, T, H, 2] float32
    sinks_ptr,  # SINKS: [H] float32
    stride_ot,
    num_tokens,
    num_heads,
    num_splits,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
    SINKS: tl.constexpr,
):
    """One (token, head): rescale each key range's output to the common max and normalise once."""
    tok = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    s_ok = s < num_splits
    at = (s * num_tokens + tok) * num_heads + head
    m = tl.load(ml_ptr + at * 2, mask=s_ok, other=float("-inf"))
    l_s = tl.load(ml_ptr + at * 2 + 1, mask=s_ok, other=0.0)
    top = tl.max(m, axis=0)
    w = tl.exp2(m - top)  # an empty range (max -inf) weighs 0
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    acc = tl.load(partial_ptr + at[:, None] * D + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    total = tl.sum(l_s * w, axis=0)
    if SINKS:  # the head's sink, once: one more term of the sum (base 2, at the common max)
        total = total + tl.exp2(tl.load(sinks_ptr + head) * 1.4426950408889634 - top)
    out = tl.sum(acc * w[:, None], axis=0) / total
    tl.store(out_ptr + tok * stride_ot + head * D + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


_lib = torch.library.Library("augur", "FRAGMENT")
_lib.define(
    "triton_paged_attention(Tensor q, Tensor? k, Tensor? v, Tensor(a!) kv_pool, int layer, Tensor slot_mapping, "
    "Tensor block_tables, Tensor seq_info, Tensor programs, Tensor positions, Tensor masks, int block_size, "
    "int block_q, int window, float scale, float softcap, int max_kv_len, int num_splits, Tensor? sinks=None, "
    "Tensor? kv_scales=None) -> Tensor"
)


@functools.cache
def program_tokens(max_q_len: int) -> int:
    """New tokens one kernel program takes in a batch whose longest sequence feeds ``max_q_len``. A
    program's rows are those tokens x G heads: a short verify (2-16 tokens) gets no more rows than it
    fills, so its K/V tiles meet a 16-row product instead of a 64-row one at G = 4."""
    return min(BLOCK_Q_CHUNK, triton.next_power_of_2(max(1, max_q_len)))


def programs_per_sequence(q_len: int) -> int:
    """Kernel programs (per KV head) of a sequence feeding ``q_len`` new tokens in a batch whose
    longest sequence feeds as many."""
    return -(-q_len // program_tokens(q_len))


def key_splits(programs: int, tokens: int, max_kv_len: int, device: torch.device) -> int:
    """Key ranges per program: enough programs to fill the GPU about twice, at least
    ``MIN_KEYS_PER_SPLIT`` keys each, at most ``SPLIT_SCRATCH_TOKENS`` tokens' partial outputs in all
    (a long prefill fills the GPU without splitting). A decode or verify of one long sequence otherwise
    runs on ``Hkv`` of the GPU's streaming multiprocessors."""
    if device.type != "cuda":
        return 1
    want = -(-2 * sm_count(device) // programs)
    return max(1, min(MAX_SPLITS, want, max_kv_len // MIN_KEYS_PER_SPLIT, SPLIT_SCRATCH_TOKENS // max(tokens, 1)))


def _triton_paged_attention_impl(
    q, k, v, kv_pool, layer, slot_mapping, block_tables, seq_info, programs, positions, masks,
    block_size, block_q, window, scale, softcap, max_kv_len, num_splits, sinks=None, kv_scales=None,
):  # fmt: skip
    T, H, D = q.shape
    k_cache, v_cache = kv_pool[layer, 0], kv_pool[layer, 1]  # [num_slots, Hkv, D]
    k_scale, v_scale = (None, None) if kv_scales is None else kv_scales.unbind(0)
    if k is not None:  # (None: the caller wrote the new K/V at slot_mapping already)
        write_rows(k_cache, slot_mapping, k, k_scale)
        write_rows(v_cache, slot_mapping, v, v_scale)
    out = q.new_empty(T, H * D)
    if T == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    G = H // k_cache.shape[1]
    block_m = max(16, triton.next_power_of_2(block_q * G))
    d_pad = max(16, triton.next_power_of_2(D))
    Hkv = k_cache.shape[1]
    splits = num_splits or key_splits(programs.shape[0] * Hkv, T, max_kv_len, q.device)
    partial = ml = out  # (unused unless split)
    if splits > 1:
        partial = torch.empty(splits, T, H, D, dtype=torch.float32, device=q.device)
        ml = torch.empty(splits, T, H, 2, dtype=torch.float32, device=q.device)
    upcast = triton_interpreted() and q.dtype != torch.float32
    sinks = out if sinks is None else sinks.float().contiguous()  # (unused unless SINKS)
    fp8 = is_fp8(kv_pool)
    scales = out if kv_scales is None or not fp8 else kv_scales.float().contiguous()  # (unused unless SCALED)
    _paged_attention_kernel[(programs.shape[0], Hkv, splits)](
        out, partial, ml, q, k_cache, v_cache, block_tables, seq_info, programs, positions, masks, sinks, scales,
        q.stride(0), q.stride(1), out.stride(0), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        scale, softcap if softcap > 0.0 else 1.0, window, T, H, splits,
        G=G, D=D, D_PAD=d_pad, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=64 if d_pad <= 128 else 32,
        PAGE=block_size, SOFTCAP=softcap > 0.0, SLIDING=window > 0, SINKS=sinks is not out,
        FP8=fp8, SCALED=scales is not out, UPCAST=upcast, SPLIT=splits > 1,
        PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32",
        num_warps=8 if block_m >= 128 else 4,
    )  # fmt: skip
    if splits > 1:
        _combine_splits_kernel[(T, H)](
            out, partial, ml, sinks, out.stride(0), T, H, splits, D=D, D_PAD=d_pad,
            S_PAD=triton.next_power_of_2(splits), SINKS=sinks is not out,
        )  # fmt: skip
    return out


def _triton_paged_attention_fake(
    q, k, v, kv_pool, layer, slot_mapping, block_tables, seq_info, programs, positions, masks,
    block_size, block_q, window, scale, softcap, max_kv_len, num_splits, sinks=None, kv_scales=None,
):  # fmt: skip
    # The output; a split batch also takes float32 scratch of at most SPLIT_SCRATCH_TOKENS tokens' outputs.
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


_lib.impl("triton_paged_attention", _triton_paged_attention_impl, "CompositeExplicitAutograd")
torch.library.register_fake("augur::triton_paged_attention", _triton_paged_attention_fake, lib=_lib)
