"""``augur train-draft --method dflash``: a DFlash block drafter (engine/speculative/methods/dflash.py)
self-distilled from the target, on the cache ``engine/offline/train_draft.py`` builds.

A training block is what serving drafts: an *anchor* row ``t`` of a sequence (from its last prompt
token on), the block ``[token t, MASK x (B - 1)]`` at positions ``t .. t + B - 1``, whose rows attend to
the fused target features of every row of the sequence before ``t`` and to all of the block; block row
``k`` learns the target's distribution of token ``t + k`` (its final hidden state at row ``t + k - 1``),
by KL, depth ``k`` weighted ``head_decay ** (k - 1)``. ``anchors`` random anchors per sequence and step,
their blocks side by side, never seeing each other. The embedding (the mask token's row too) and the
output layer are the target's and stay frozen, as in the published drafters; the drafter's final norm
starts as the target's, its layers at random with their residual branches at zero.

The target layers read: up to three, spread from layer 1 to the last (:func:`feature_layers`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from engine.models.llama import apply_rope
from engine.offline.draft_training import SequenceTrainer, kl_and_agreement
from engine.speculative.methods.dflash import DFlashDrafter


def feature_layers(num_layers: int) -> list[int]:
    """The target's decoder layers (0-based) a trained drafter fuses: layer 1, the middle and the last."""
    return sorted({min(1, num_layers - 1), num_layers // 2, num_layers - 1})


def mask_token(config: dict) -> int:
    """The id whose (frozen) embedding fills the block's mask positions: the padding token where the
    target has one (it never appears in text the target reads), else the last id."""
    pad = config.get("pad_token_id")
    return int(pad) if isinstance(pad, int) and 0 <= pad < config["vocab_size"] else config["vocab_size"] - 1


def block_logits(m: DFlashDrafter, b: dict) -> torch.Tensor:
    """The drafter's logits ``[n, B, V]`` for a pack of blocks (``DFlashTrainer._pack``'s fields: the
    context rows' raw target features, their sequence and position; each block's ids, positions and
    sequence), every block row attending as serving attends: to its sequence's context rows before
    its anchor and to all of its own block."""
    n, B = b["block_ids"].shape
    T = len(b["pos"])
    # Block row (i, j) sees its sequence's context rows before its anchor, and all of its own block:
    # the scores against the context are one [n B, T] product, those within blocks [n, B, B] (not
    # the dense [n B, n B] of all blocks, most of it masked), softmaxed together.
    sees_ctx = (b["block_doc"][:, None] == b["doc"][None, :]) & (b["pos"][None, :] < b["block_pos"][:, :1])
    sees_ctx = sees_ctx[:, None, :].expand(n, B, T).reshape(n * B, T)
    ctx = m.fuse(b["feats"])
    x = m.embed_tokens(b["block_ids"].reshape(-1))
    bpos = b["block_pos"].reshape(-1)
    for layer in m.layers:
        a = layer.self_attn
        H, Hkv, D = a.num_heads, a.num_kv_heads, a.head_dim
        h = layer.input_layernorm(x)

        def qkv(src, positions, a=a, H=H, Hkv=Hkv, D=D):
            q, k, v = a.qkv_proj(src).split([a.q_size, a.kv_size, a.kv_size], -1)
            q, k = q.view(len(src), H, D), k.view(len(src), Hkv, D)
            if a.q_norm is not None:
                q, k = a.q_norm(q), a.k_norm(k)
            cos, sin = m.rope_cos[positions].unsqueeze(1), m.rope_sin[positions].unsqueeze(1)
            return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.view(len(src), Hkv, D)

        q, kb, vb = qkv(h, bpos)
        _, kc, vc = qkv(ctx, b["pos"])
        kc, vc = kc.repeat_interleave(H // Hkv, 1), vc.repeat_interleave(H // Hkv, 1)  # [T, H, D]
        kb = kb.repeat_interleave(H // Hkv, 1).view(n, B, H, D)
        vb = vb.repeat_interleave(H // Hkv, 1).view(n, B, H, D)
        s_ctx = torch.einsum("qhd,khd->hqk", q, kc) * a.scale  # [H, n B, T]
        s_ctx = s_ctx.masked_fill(~sees_ctx[None], float("-inf"))
        s_blk = torch.einsum("nihd,njhd->hnij", q.view(n, B, H, D), kb) * a.scale  # [H, n, B, B]
        w = torch.cat([s_ctx, s_blk.reshape(H, n * B, B)], -1).softmax(-1)
        w_ctx, w_blk = w[..., :T], w[..., T:].reshape(H, n, B, B)
        o = torch.einsum("hqk,khd->qhd", w_ctx, vc)
        o = o + torch.einsum("hnij,njhd->nihd", w_blk, vb).reshape(n * B, H, D)
        x = x + a.o_proj(o.reshape(len(h), H * D))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return m.compute_logits(m.norm(x)).view(n, B, -1)


class DFlashTrainer(SequenceTrainer):
    def __init__(self, cache, cfg, g, device) -> None:
        super().__init__(cache, cfg, g, device)
        if cfg.block_size < 2:
            raise ValueError("a DFlash block needs at least 2 positions (its root and a mask)")
        tc = cache["config"]
        self.ids = feature_layers(tc["num_hidden_layers"])
        self.mask_id = mask_token(tc)
        embed = nn.Embedding.from_pretrained(cache["embed"].float(), freeze=True)
        lm_head = self.lm_head
        config = self.layer_config(max(cfg.num_layers, 1))
        self.module = DFlashDrafter(
            config, len(self.ids), tc["hidden_size"], embed, lambda x: x @ lm_head.T, config.max_position_embeddings
        )
        self.start(self.module)
        with torch.no_grad():
            self.module.norm.weight.copy_(cache["norm"])
        self.module.to(device)
        self.module.init_rope()

    @staticmethod
    def layers_for(config: dict) -> list[int]:
        return feature_layers(config["num_hidden_layers"])

    # -- batches --------------------------------------------------------------------------------
    def feature(self, rows: torch.Tensor, layer: int) -> torch.Tensor:
        """Target layer ``layer``'s output at ``rows`` as serving hands it over: Hugging Face's
        ``hidden_states[layer + 1]``, which for the last layer is after the final norm."""
        x = self.rows("layers", rows, layer)
        if layer == self.cache["config"]["num_hidden_layers"] - 1:
            eps = self.cache["config"].get("rms_norm_eps", 1e-6)
            x = nn.functional.rms_norm(x, (x.shape[-1],), eps=eps) * self.cache["norm"].to(x.device)
        return x

    def _pack(self, seqs: torch.Tensor, g: torch.Generator) -> dict:
        """Whole sequences' rows (the context) and ``anchors`` blocks in each."""
        c, B = self.cache, self.cfg.block_size
        rows, doc, pos, anchors = [], [], [], []
        for d, s in enumerate(seqs.tolist()):
            a, b, f = int(c["starts"][s]), int(c["starts"][s + 1]), int(c["first"][s])
            rows.append(torch.arange(a, b))
            doc.append(torch.full((b - a,), d))
            pos.append(torch.arange(b - a))
            usable = torch.arange(f, b - 1)  # an anchor with at least one token after it
            if len(usable):
                pick = usable[torch.randperm(len(usable), generator=g)[: self.cfg.anchors]]
                anchors += [(d, int(t), a, b) for t in pick]
        rows, doc, pos = torch.cat(rows), torch.cat(doc), torch.cat(pos)
        feats = torch.cat([self.feature(rows, i) for i in self.ids], -1)
        n = len(anchors)
        block_ids = torch.full((n, B), self.mask_id, dtype=torch.long)
        block_pos = torch.zeros(n, B, dtype=torch.long)
        block_doc = torch.zeros(n, dtype=torch.long)
        target_rows = torch.zeros(n, B - 1, dtype=torch.long)
        weight = torch.zeros(n, B - 1)
        for i, (d, t, a, b) in enumerate(anchors):
            block_ids[i, 0] = c["tokens"][t]
            block_pos[i] = torch.arange(t - a, t - a + B)
            block_doc[i] = d
            k = torch.arange(1, B)
            valid = t + k < b
            target_rows[i] = torch.where(valid, t + k - 1, t)
            weight[i] = valid.float()
        dev = self.device
        return {
            "feats": feats,
            "doc": doc.to(dev),
            "pos": pos.to(dev),
            "block_ids": block_ids.to(dev),
            "block_pos": block_pos.to(dev),
            "block_doc": block_doc.to(dev),
            "target_rows": target_rows,
            "weight": weight.to(dev),
        }

    def batch(self) -> dict:
        order = self.train_seqs[torch.randperm(len(self.train_seqs), generator=self.g)]
        return self._pack(self._pack_under(order, self.cfg.batch_size)[0], self.g)

    def held_batches(self) -> list[dict]:
        g = torch.Generator().manual_seed(self.cfg.seed + 1)  # the same held-out blocks before and after
        return [self._pack(p, g) for p in self._pack_under(self.held_seqs, self.cfg.batch_size)]

    # -- the loss -------------------------------------------------------------------------------
    def losses(self, b: dict):
        B = self.cfg.block_size
        logits = block_logits(self.module, b)
        out = []
        for j in range(1, B):  # block row j drafts token t + j: the target's distribution at row t + j - 1
            target = self.target_logp(b["target_rows"][:, j - 1])
            out.append(kl_and_agreement(target, logits[:, j], b["weight"][:, j - 1]))
        return out

    def save(self, out: Path, extra: dict) -> None:
        L = self.cache["config"]["num_hidden_layers"]
        self.module.save(out, self.ids, self.cfg.block_size, self.mask_id, L, extra)
