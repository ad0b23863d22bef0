"""The reference attention backend: gather each sequence's K/V, then SDPA with a dense mask.

It builds the metadata once per forward (shared by all layers) and computes attention with
``scaled_dot_product_attention`` on padded ``[B, Qmax]`` queries and ``[B, Kmax]`` gathered keys (the
terms are defined in ``engine.attention``). Its memory grows with ``B * Qmax * Kmax``: it is the CPU
path and the reference the other backends are tested against, not a large-batch GPU path.
*Soft-capping* (Gemma-2: ``scores = cap * tanh(scores / cap)`` before the mask and softmax) and
*attention sinks* (gpt-oss: a logit per head in every softmax, with no value) have no SDPA form, so a
layer with either gets its scores from plain matmuls instead (cap and softmax in float32).

Attention is the custom operator ``torch.ops.augur.paged_attention``: it writes the KV pool in place,
which ``torch.compile`` keeps opaque (a compiled model calls it as it is, and never copies the pool).
An FP8 pool (``kv_dtype.py``) is written quantized with the layer's ``kv_scales`` and read dequantized.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.attention.common import optional_inputs, padded_block_tables
from engine.attention.kv_dtype import read_rows, write_rows
from engine.attention.staging import Pack, direct_pack


@dataclass
class SdpaMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot each new token's K/V is written to
    kv_slots: torch.Tensor  # [B, Kmax] int64: cache slots of each sequence's keys (padding → 0)
    mask: torch.Tensor  # [B, 1, Qmax, Kmax] bool, True = may attend
    sliding_mask: torch.Tensor | None  # same, with the sliding window applied (None if no layer needs it)
    q_index: torch.Tensor  # [T] int64: flat token → row of the padded [B * Qmax] queries
    num_seqs: int
    max_q: int
    # Batch-invariant mode: every query takes one path (augur::paged_attention_rows), so a token's output
    # does not depend on how many queries came with it.
    rows_only: bool = False

    def levels(self) -> list[SdpaMetadata]:
        """A batch of causal chunks of one length ``L`` (no padding, no tree masks) as ``L`` forwards of
        one token per sequence, in order: level ``d`` is every chunk's token ``d``, which sees the
        context and the chunk's tokens up to itself. Slices of this metadata, no host work."""
        B, L = self.num_seqs, self.max_q
        rows = torch.arange(B, device=self.q_index.device)
        slots = self.slot_mapping.view(B, L).t().contiguous()
        level = lambda m, d: None if m is None else m[:, :, d : d + 1].contiguous()  # noqa: E731
        return [
            SdpaMetadata(
                slots[d], self.kv_slots, level(self.mask, d), level(self.sliding_mask, d), rows, B, 1, self.rows_only
            )
            for d in range(L)
        ]

    def kv_write_slots(self, kv_pool: torch.Tensor) -> None:
        return None  # the operator writes the new K/V itself

    def tie_shapes(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        T = input_ids.size(0)
        torch._check(positions.size(0) == T)
        torch._check(self.slot_mapping.size(0) == T)
        torch._check(self.q_index.size(0) == T)
        torch._check(self.kv_slots.size(0) == self.mask.size(0))
        torch._check(self.kv_slots.size(1) == self.mask.size(3))

    def attend(
        self, q, k, v, kv_pool, layer: int, scale: float, sliding: bool, softcap: float, sinks=None, kv_scales=None
    ):
        mask = self.sliding_mask if sliding else self.mask
        op = torch.ops.augur.paged_attention_rows if self.rows_only else torch.ops.augur.paged_attention
        args = (q, k, v, kv_pool, layer, self.slot_mapping, self.kv_slots, mask, self.q_index, scale, softcap)
        return op(*args, **optional_inputs(sinks, kv_scales))


def build_sdpa_metadata(
    q_lens: list[int],
    ctx_lens: list[int],
    block_tables: list[list[int]] | np.ndarray,  # or their padded rows [B, >= max blocks]
    block_size: int,
    positions: torch.Tensor | int,  # [T] int64 on the target device, or its index in ``pack``
    new_token_masks: list[torch.Tensor | None] | None = None,  # per sequence [q_len, ctx+q_len-mask_start] bool
    mask_starts: list[int] | None = None,  # per sequence: first key index the mask covers (default: ctx_len)
    sliding_window: int | None = None,
    device: torch.device | str = "cpu",
    pack: Pack | None = None,  # the forward's other inputs: the metadata joins their one copy
    rows_only: bool = False,  # the batch-invariant mode: every query on one path (SdpaMetadata.rows_only)
) -> SdpaMetadata:
    """Build attention metadata for sequences laid out back to back in the flat batch.

    Sequence ``b`` owns flat tokens ``sum(q_lens[:b]) ...`` and its new token ``i`` is stored at context
    index ``ctx_lens[b] + i`` (for a draft tree that is the node's slot, not its position).

    A given mask covers keys ``mask_starts[b] .. ctx_lens[b] + q_lens[b]``: by default just the new
    tokens, but a draft tree expanded level by level reaches back over its earlier levels, which
    are already in the cache (a node must see its ancestors there, and not its cousins).

    The index arithmetic runs in numpy on the host (a few microseconds an operation, where each small
    torch operation costs several: this is per forward, a real share of a small model's step); the
    results join ``pack`` (engine/attention/staging.py), which this sends: one copy with the forward's
    other inputs. Tree masks on the host are applied there; any already on the device, there.
    """
    pack = pack if pack is not None else direct_pack(device)
    B = len(q_lens)
    q_np = np.asarray(q_lens, dtype=np.int64)
    ctx_np = np.asarray(ctx_lens, dtype=np.int64)
    kv_np = ctx_np + q_np
    max_q, max_k, T = int(q_np.max()), int(kv_np.max()), int(q_np.sum())

    # Slots of every context index of every sequence, from the block tables: [B, Kmax] (padding → 0).
    if not isinstance(block_tables, np.ndarray):  # else already padded (PersistentBlockTables.rows)
        block_tables = padded_block_tables(block_tables, kv_np.tolist(), block_size)
    table = np.asarray(block_tables, dtype=np.int64)
    k_idx = np.arange(max_k)
    in_ctx = k_idx[None, :] < kv_np[:, None]
    kv_slots = np.where(in_ctx, table[:, k_idx // block_size] * block_size + k_idx % block_size, 0)

    if max_q == 1 and new_token_masks is None and sliding_window is None:
        # Every sequence decodes one token (the step most steps are): it sees its whole context and
        # itself, is written at index ctx, and is row b of the queries.
        rows = np.arange(B)
        staged = [pack.add(a) for a in (kv_slots[rows, ctx_np], kv_slots, in_ctx.reshape(B, 1, max_k), rows)]
        pack.send()
        return SdpaMetadata(
            slot_mapping=pack[staged[0]],
            kv_slots=pack[staged[1]],
            mask=pack[staged[2]][:, None],
            sliding_mask=None,
            q_index=pack[staged[3]],
            num_seqs=B,
            max_q=1,
            rows_only=rows_only,
        )

    # Flat token → (sequence, new-token index).
    seq_of_tok = np.repeat(np.arange(B), q_np)
    idx_in_seq = np.arange(T) - (np.cumsum(q_np) - q_np)[seq_of_tok]
    new_cols = ctx_np[seq_of_tok] + idx_in_seq
    slot_mapping = kv_slots[seq_of_tok, new_cols]

    # Causal mask over [cached | new] keys: query i sees key j iff j <= ctx + i; padding query rows
    # also see key 0, so softmax never meets an all-masked row.
    q_idx = np.arange(max_q)
    mask = (k_idx[None, None, :] - ctx_np[:, None, None]) <= q_idx[None, :, None]  # [B, Qmax, Kmax]
    mask &= in_ctx[:, None, :]
    pad_row = q_idx[None, :] >= q_np[:, None]  # [B, Qmax]
    mask[:, :, 0] |= pad_row

    on_device = []  # (sequence, mask) of tree masks already on the device
    for b, m in enumerate(new_token_masks or []):
        if m is not None:
            if m.device.type == "cpu":
                q, c = q_lens[b], ctx_lens[b]
                mask[b, :q, (c if mask_starts is None else mask_starts[b]) : c + q] = m.numpy()
            else:
                on_device.append((b, m))

    window_ok = None
    if sliding_window is not None:
        # Key positions: cached keys sit at their own index; new keys at the positions given.
        pos = pack.arrays[positions] if isinstance(positions, int) else positions.cpu().numpy()
        pos_pad = np.zeros((B, max_q), dtype=np.int64)
        pos_pad[seq_of_tok, idx_in_seq] = pos
        k_pos = np.broadcast_to(k_idx[None, :], (B, max_k)).copy()
        k_pos[seq_of_tok, new_cols] = pos
        window_ok = (pos_pad[:, :, None] - k_pos[:, None, :]) < sliding_window
        window_ok[:, :, 0] |= pad_row

    staged = [pack.add(a) for a in (slot_mapping, kv_slots, mask, seq_of_tok * max_q + idx_in_seq)]
    sliding = None
    if window_ok is not None:
        sliding = pack.add(window_ok if on_device else mask & window_ok)
    pack.send()
    mask_t = pack[staged[2]]
    for b, m in on_device:
        q, c = q_lens[b], ctx_lens[b]
        mask_t[b, :q, (c if mask_starts is None else mask_starts[b]) : c + q] = m
    sliding_mask = None
    if sliding is not None:
        sliding_mask = (mask_t & pack[sliding] if on_device else pack[sliding])[:, None]
    return SdpaMetadata(
        slot_mapping=pack[staged[0]],
        kv_slots=pack[staged[1]],
        mask=mask_t[:, None],
        sliding_mask=sliding_mask,
        q_index=pack[staged[3]],
        num_seqs=B,
        max_q=max_q,
        rows_only=rows_only,
    )


_lib = torch.library.Library("augur", "DEF")
_lib.define(
    "paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_pool, int layer, Tensor slot_mapping, "
    "Tensor kv_slots, Tensor mask, Tensor q_index, float scale, float softcap=0.0, Tensor? sinks=None, "
    "Tensor? kv_scales=None) -> Tensor"
)


def _paged_attention_impl(
    q, k, v, kv_pool, layer, slot_mapping, kv_slots, mask, q_index, scale, softcap=0.0, sinks=None, kv_scales=None
):
    T, H, D = q.shape
    B, Q = kv_slots.shape[0], mask.shape[2]
    k_cache, v_cache = kv_pool[layer, 0], kv_pool[layer, 1]
    k_scale, v_scale = (None, None) if kv_scales is None else kv_scales.unbind(0)
    write_rows(k_cache, slot_mapping, k, k_scale)
    write_rows(v_cache, slot_mapping, v, v_scale)
    flat_slots = kv_slots.view(-1)
    kv_shape = (B, -1, *k_cache.shape[1:])
    keys = read_rows(k_cache, flat_slots, k_scale, q.dtype).view(kv_shape).transpose(1, 2)  # [B, Hkv, Kmax, D]
    values = read_rows(v_cache, flat_slots, v_scale, q.dtype).view(kv_shape).transpose(1, 2)
    if Q == 1:  # one new token per sequence: the flat batch is already [B, 1]
        qp = q.view(B, 1, H, D)
    else:
        qp = q.new_zeros(B * Q, H, D)
        qp.index_copy_(0, q_index, q)
        qp = qp.view(B, Q, H, D)
    if softcap > 0.0 or sinks is not None:
        out = _scored_attention(qp.transpose(1, 2), keys, values, mask, scale, softcap, sinks)
    else:
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), keys, values, attn_mask=mask, scale=scale, enable_gqa=keys.shape[1] != H
        )  # [B, H, Q, D]
    out = out.transpose(1, 2).reshape(B * Q, H * D)
    return out if Q == 1 else out.index_select(0, q_index)


def _scored_attention(
    q: torch.Tensor,  # [B, H, Q, D]
    keys: torch.Tensor,  # [B, Hkv, Kmax, D]
    values: torch.Tensor,  # [B, Hkv, Kmax, D]
    mask: torch.Tensor,  # [B, 1, Q, Kmax] bool, True = may attend
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None = None,  # [H]
) -> torch.Tensor:  # [B, H, Q, D]
    """Attention from explicit scores: soft-capped (``softcap`` > 0), and with a sink logit per head
    joining each softmax (then dropped: it has no value). Query head ``h`` reads KV head
    ``h // (H // Hkv)``: the query heads are grouped per KV head instead of repeating the keys."""
    B, H, Q, D = q.shape
    Hkv = keys.shape[1]
    qg = q.reshape(B, Hkv, H // Hkv, Q, D)
    scores = torch.matmul(qg, keys.unsqueeze(2).transpose(-1, -2)).float() * scale  # [B, Hkv, G, Q, Kmax]
    if softcap > 0.0:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, Hkv, H // Hkv, 1, 1).expand(B, -1, -1, Q, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].to(values.dtype)
    else:
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values.unsqueeze(2)).reshape(B, H, Q, D)


def _paged_attention_fake(
    q, k, v, kv_pool, layer, slot_mapping, kv_slots, mask, q_index, scale, softcap=0.0, sinks=None, kv_scales=None
):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


_lib.impl("paged_attention", _paged_attention_impl, "CompositeExplicitAutograd")
torch.library.register_fake("augur::paged_attention", _paged_attention_fake, lib=_lib)
# The same attention with every query on one path (the batch-invariant mode): its CPU kernel is the
# C++ one's fused path; elsewhere the reference serves (the mode is built for CPUs only).
_lib.define(
    "paged_attention_rows(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_pool, int layer, Tensor slot_mapping, "
    "Tensor kv_slots, Tensor mask, Tensor q_index, float scale, float softcap=0.0, Tensor? sinks=None, "
    "Tensor? kv_scales=None) -> Tensor"
)
_lib.impl("paged_attention_rows", _paged_attention_impl, "CompositeExplicitAutograd")
torch.library.register_fake("augur::paged_attention_rows", _paged_attention_fake, lib=_lib)
