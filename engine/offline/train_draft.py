"""``augur train-draft --method medusa|eagle|mtp|dflash``: train drafters on the target by self-distillation.

The heads must predict what *the target* says, not what some corpus says, so the training text is
the target's own: Augur generates continuations of the training prompts with the target (greedy and
sampled at T = 1, the two ways it is served), then runs the target once over each prompt and its
continuation and caches what the heads read (``cache.pt``; a second run on the same target, prompts,
continuation length and layers reuses it): the final hidden states (the target's distribution at
every position is ``softmax(lm_head(final[t]))``) and the outputs of the layers the method reads.
Training reads only that cache, with a KL loss to the target's distribution; draft depth ``k`` is
weighted ``head_decay ** k`` (far drafts are right less often and matter less: a draft stops at its
first miss). Positions from the prompt's last token on are trained (where the heads draft when serving).

- **medusa**: head ``k`` reads ``final[t]`` and learns the distribution of token ``t + 2 + k``. Heads start
  as the target's own output layer (residual blocks zero), so head ``k`` first guesses the *next* token.
- **mtp** (chained heads): head 0 reads the last layer's output at ``t`` and token ``t + 1``; head ``k``
  reads head ``k - 1``'s output and token ``t + 1 + k`` (teacher forcing with the target's own tokens),
  and learns token ``t + 2 + k``. Each head starts as the identity on its state (the target's norm and
  output layer then give the target's next-token guess).
- **eagle**: the head runs over whole sequences (packed, attention within each) on the fused features
  of its layers, then ``unroll - 1`` more steps on *its own outputs*, as when drafting (EAGLE-3's
  training-time test): at step ``j`` row ``t`` reads its step ``j - 1`` output and token ``t + 1 + j`` at
  position ``t + j``, attending to step 0's rows up to ``t`` and its own rows of the steps before,
  which is exactly the attention of a draft node at depth ``j + 1``. Its feature layers are low, middle
  and the last (Hugging Face indices ``2, L // 2, L``); its output layer starts as the target's
  (restricted to a reduced draft vocabulary of the most frequent ids, ``--draft-vocab``), its
  residual branches at zero, and ``fc`` picks the last layer's output, so it first guesses the next
  token too.

- **dflash**: a block drafter (``engine/offline/train_dflash.py``): blocks ``[token t, MASK ...]`` at random
  anchors, each mask row learning the target's distribution at its position from the fused features
  of the rows before the anchor.

Progress is checkpointed (``checkpoint.pt``) every ``save_every`` steps and at the end; ``--resume``
continues from it. The output directory is what ``--draft-model`` serves (the method is recognised
from its layout), with a ``report.json``: each depth's KL to the target and top-1 agreement with it on
held-out data, before and after training.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path

import torch
from torch import nn

from engine.config import EngineConfig
from engine.models.llama import apply_rope
from engine.offline.draft_training import SequenceTrainer, TrainConfig, Trainer, kl_and_agreement, lr_at
from engine.offline.train_dflash import DFlashTrainer
from engine.runner.loader import resolve_model_path
from engine.speculative.methods.eagle import EagleHead
from engine.speculative.methods.medusa import MedusaHeads
from engine.speculative.methods.mtp import ChainedHeads

METHODS = ("medusa", "eagle", "mtp", "dflash")


def self_distill_data(engine_config: EngineConfig, prompts: list[str], gen_tokens: int, progress: bool = True):
    """The target's own continuations of ``prompts`` (greedy and T = 1), as token-id lists."""
    from tqdm import tqdm

    from engine.core.llm_engine import LLMEngine
    from engine.request.sampling_params import SamplingParams

    engine = LLMEngine(dataclasses.replace(engine_config, speculative_method="none", draft_model=None))
    ids = [engine.tokenize(p)[-engine.max_model_len // 2 :] for p in prompts]
    out = []
    for t in tqdm((0.0, 1.0), desc="target continuations (T = 0, 1)", disable=not progress):
        for p, o in zip(ids, engine.generate(ids, SamplingParams(temperature=t, max_tokens=gen_tokens))):
            out.append((p, list(o.outputs[0].delta_token_ids)))
    return out


@torch.no_grad()  # not inference mode: the cached tensors feed training
def hidden_cache(
    model_path: Path, samples, layers: list[int], progress: bool = True, device="cpu", dtype=torch.float32
) -> dict:
    """The target over each prompt + continuation: token ids, final (normed) hidden states, the outputs
    of decoder ``layers`` (0-based, before any norm), and its embedding, final norm and output layer.

    Rows are sequences back to back (``starts``); ``first[s]`` is the row of sequence ``s``'s last prompt
    token. The target runs on ``device`` in ``dtype``; the cache is kept in host memory, in bfloat16."""
    import transformers
    from tqdm import tqdm

    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    decoder = model.get_decoder()
    seen: dict[int, torch.Tensor] = {}

    def keep(i):
        return lambda module, args, out: seen.__setitem__(i, out[0] if isinstance(out, tuple) else out)

    hooks = [decoder.layers[i].register_forward_hook(keep(i)) for i in layers]
    tokens, final, outs, starts, first = [], [], {i: [] for i in layers}, [0], []
    try:
        for prompt, gen in tqdm(samples, desc="target hidden states", disable=not progress):
            if not gen:
                continue
            ids = prompt + gen
            h = model(torch.tensor([ids], device=device), output_hidden_states=True).hidden_states[-1][0]
            first.append(starts[-1] + len(prompt) - 1)
            tokens.append(torch.tensor(ids))
            final.append(h.to(torch.bfloat16).cpu())  # after the final norm
            for i in layers:
                outs[i].append(seen[i][0].to(torch.bfloat16).cpu())
            starts.append(starts[-1] + len(ids))
    finally:
        for hook in hooks:
            hook.remove()
    return {
        "tokens": torch.cat(tokens),
        "starts": torch.tensor(starts),
        "first": torch.tensor(first),
        "final": torch.cat(final),
        "layers": {i: torch.cat(v) for i, v in outs.items()},
        "embed": model.get_input_embeddings().weight.detach().float().cpu(),
        "norm": decoder.norm.weight.detach().float().cpu(),
        "lm_head": model.get_output_embeddings().weight.detach().float().cpu(),
        "config": model.config.to_dict(),
    }


def usable_positions(starts: torch.Tensor, first: torch.Tensor, depth: int) -> torch.Tensor:
    """Rows ``t`` from each sequence's last prompt token on that have a row ``t + depth`` (the deepest target)."""
    parts = [torch.arange(int(f), int(b) - depth) for f, b in zip(first, starts[1:]) if b - f > depth]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)


class _PositionTrainer(Trainer):
    """Medusa and chained heads: independent positions, every depth's target row ahead of them."""

    def __init__(self, cache, cfg, g, device) -> None:
        super().__init__(cache, cfg, g, device)
        pos = usable_positions(cache["starts"], cache["first"], cfg.num_heads)
        if len(pos) < 2 * cfg.batch_size:
            raise ValueError(f"only {len(pos)} training positions: give more or longer prompts")
        pos = pos[torch.randperm(len(pos), generator=g)]
        n_held = max(cfg.batch_size, int(len(pos) * cfg.heldout_frac))
        self.held, self.train = pos[:n_held], pos[n_held:]

    def batch(self) -> torch.Tensor:
        return self.train[torch.randint(len(self.train), (self.cfg.batch_size,), generator=self.g)]

    def held_batches(self) -> list[torch.Tensor]:
        return [self.held]


class MedusaTrainer(_PositionTrainer):
    def __init__(self, cache, cfg, g, device) -> None:
        super().__init__(cache, cfg, g, device)
        final = cache["final"]
        self.module = MedusaHeads(final.shape[1], self.lm_head.shape[0], cfg.num_heads, cfg.num_layers)
        with torch.no_grad():
            for head in self.module.heads:
                head[-1].weight.copy_(self.lm_head)
                for block in head[:-1]:
                    block.linear.weight.zero_()
                    block.linear.bias.zero_()
        self.module.to(device)

    def losses(self, idx: torch.Tensor):
        logits = self.module(self.rows("final", idx))  # [B, K, V]
        return [kl_and_agreement(self.target_logp(idx + k + 1), logits[:, k]) for k in range(self.module.num_heads)]

    def save(self, out: Path, extra: dict) -> None:
        self.module.save(out, extra)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * nn.functional.rms_norm(x, (x.shape[-1],), eps=eps)


class MTPTrainer(_PositionTrainer):
    def __init__(self, cache, cfg, g, device) -> None:
        super().__init__(cache, cfg, g, device)
        self.eps = cache["config"].get("rms_norm_eps", 1e-6)
        hidden = cache["final"].shape[1]
        self.module = ChainedHeads(hidden, cfg.num_heads, cfg.num_layers, self.eps)
        with torch.no_grad():
            for head in self.module.heads:  # the identity on the (normed) state; blocks add nothing yet
                head.proj.weight.zero_()
                head.proj.weight[:, :hidden].copy_(torch.eye(hidden))
                for block in head.blocks:
                    block.linear.weight.zero_()
                    block.linear.bias.zero_()
        self.module.to(device)
        self.embed, self.norm = cache["embed"].float().to(device), cache["norm"].float().to(device)

    @staticmethod
    def layers_for(config: dict) -> list[int]:
        return [config["num_hidden_layers"] - 1]

    def losses(self, idx: torch.Tensor):
        c = self.cache
        state = self.rows("layers", idx, self.layers_for(c["config"])[0])
        out = []
        for k, head in enumerate(self.module.heads):
            state = head(state, self.embed[c["tokens"][idx + 1 + k].to(self.device)])
            logits = _rms_norm(state, self.norm, self.eps) @ self.lm_head.T
            out.append(kl_and_agreement(self.target_logp(idx + 1 + k), logits))
        return out

    def save(self, out: Path, extra: dict) -> None:
        self.module.save(out, extra)


def eagle_layer_ids(num_layers: int) -> list[int]:
    """The feature layers Augur's EAGLE heads are trained on (Hugging Face ``hidden_states`` indices)."""
    return [min(2, num_layers), max(num_layers // 2, 1), num_layers]


class EagleTrainer(SequenceTrainer):
    def __init__(self, cache, cfg, g, device) -> None:
        super().__init__(cache, cfg, g, device)
        tc = cache["config"]
        self.ids = eagle_layer_ids(tc["num_hidden_layers"])
        V = tc["vocab_size"]
        if cfg.draft_vocab and cfg.draft_vocab < V:  # the most frequent ids of the target's continuations
            counts = torch.bincount(cache["tokens"], minlength=V)
            self.draft_ids = counts.topk(cfg.draft_vocab).indices.sort().values
        else:
            self.draft_ids = torch.arange(V)
        dv, h = len(self.draft_ids), tc["hidden_size"]
        embed = nn.Embedding.from_pretrained(cache["embed"].float(), freeze=True)
        config = self.layer_config(1)
        self.module = EagleHead(config, len(self.ids), h, dv, embed, config.max_position_embeddings)
        self.start(self.module)
        with torch.no_grad():
            self.module.fc.weight.zero_()
            self.module.fc.weight[:, -h:].copy_(torch.eye(h))  # the last feature layer passes through
            self.module.norm.weight.copy_(cache["norm"])
            self.module.lm_head.weight.copy_(self.lm_head[self.draft_ids])
            self.module.d2t.copy_(self.draft_ids - torch.arange(dv))
            self.module.t2d.zero_().index_fill_(0, self.draft_ids, True)
        self.module.to(device)
        self.module.init_buffers()

    @staticmethod
    def layers_for(config: dict) -> list[int]:
        return [j - 1 for j in eagle_layer_ids(config["num_hidden_layers"])]

    def _pack(self, seqs: torch.Tensor) -> dict:
        """Rows of whole sequences (all but each one's last), with what every unroll step needs."""
        c, U = self.cache, self.cfg.unroll
        starts, first = c["starts"], c["first"]
        rows, doc, pos, end, loss_from = [], [], [], [], []
        for d, s in enumerate(seqs.tolist()):
            a, b = int(starts[s]), int(starts[s + 1])
            rows.append(torch.arange(a, b - 1))
            doc.append(torch.full((b - 1 - a,), d))
            pos.append(torch.arange(b - 1 - a))
            end.append(torch.full((b - 1 - a,), b))
            loss_from.append(torch.full((b - 1 - a,), int(first[s])))
        rows, doc, pos, end, loss_from = map(torch.cat, (rows, doc, pos, end, loss_from))
        feats = torch.cat([self.rows("layers", rows, i) for i in self.layers_for(c["config"])], -1)
        steps = []
        dev = self.device
        for j in range(U):  # step j: token t + 1 + j, target row t + 1 + j, both inside the sequence
            valid = (rows + 1 + j < end) & (rows >= loss_from)
            nxt = torch.where(rows + 1 + j < end, rows + 1 + j, rows)
            steps.append((c["tokens"][nxt].to(dev), nxt, valid.float().to(dev)))
        return {"feats": feats, "doc": doc.to(dev), "pos": pos.to(dev), "steps": steps}

    def batch(self) -> dict:
        order = self.train_seqs[torch.randperm(len(self.train_seqs), generator=self.g)]
        return self._pack(self._pack_under(order, self.cfg.batch_size)[0])

    def held_batches(self) -> list[dict]:
        return [self._pack(p) for p in self._pack_under(self.held_seqs, self.cfg.batch_size)]

    def target_logp(self, rows: torch.Tensor) -> torch.Tensor:
        """Over the draft vocabulary (the head can say nothing else), renormalized."""
        logits = self.rows("final", rows) @ self.lm_head[self.draft_ids.to(self.device)].T
        return torch.log_softmax(logits, -1)

    def losses(self, b: dict):
        head = self.module
        layer = head.layers[0]
        attn = layer.self_attn
        T = len(b["pos"])
        H, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
        rep = H // Hkv
        visible = (b["doc"][:, None] == b["doc"][None, :]) & (b["pos"][None, :] <= b["pos"][:, None])  # [T, T]
        state = head.fc(b["feats"])
        k0 = v0 = None
        own_k, own_v, out = [], [], []
        for j, (tokens, target_rows, weight) in enumerate(b["steps"]):
            x, residual = layer.attention_input(head.embed_tokens(tokens), state)
            q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], -1)
            cos, sin = head.rope(b["pos"] + j, q.dtype)
            q = apply_rope(q.view(T, H, D), cos, sin)
            k = apply_rope(k.view(T, Hkv, D), cos, sin).repeat_interleave(rep, 1)
            v = v.view(T, Hkv, D).repeat_interleave(rep, 1)
            if j == 0:
                k0, v0 = k, v
            else:
                own_k.append(k)
                own_v.append(v)
            scores = torch.einsum("thd,shd->ths", q, k0).masked_fill(~visible[:, None], float("-inf"))
            if own_k:  # the row's own earlier drafts (and itself), at depths 2 .. j + 1
                scores = torch.cat([scores, torch.stack([(q * kk).sum(-1) for kk in own_k], -1)], -1)
            w = (scores * attn.scale).softmax(-1)
            o = torch.einsum("ths,shd->thd", w[..., :T], v0)
            for i, vv in enumerate(own_v):
                o = o + w[..., T + i, None] * vv
            state = layer.finish(attn.o_proj(o.reshape(T, H * D)), residual)
            logits = head.lm_head(head.norm(state))
            out.append(kl_and_agreement(self.target_logp(target_rows), logits, weight))
        return out

    def save(self, out: Path, extra: dict) -> None:
        self.module.save(out, eagle_layer_ids(self.cache["config"]["num_hidden_layers"]), extra)


TRAINERS = {"medusa": MedusaTrainer, "mtp": MTPTrainer, "eagle": EagleTrainer, "dflash": DFlashTrainer}


def cache_layers(method: str, config: dict) -> list[int]:
    return [] if method == "medusa" else TRAINERS[method].layers_for(config)


def train_draft(
    engine_config: EngineConfig,
    out: str | Path,
    prompts: list[str],
    cfg: TrainConfig,
    *,
    resume: bool = False,
    progress: bool = True,
) -> dict:
    """Train heads for ``engine_config.model`` into ``out`` (see the module doc); returns the report."""
    from tqdm import tqdm

    if cfg.method not in METHODS:
        raise ValueError(f"unknown draft method {cfg.method!r}; known: {list(METHODS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model_path(engine_config.model)
    t0 = time.perf_counter()
    cache_file = out / "cache.pt"
    target_config = json.loads((model_path / "config.json").read_text())
    layers = cache_layers(cfg.method, target_config)
    # The cache is reused only for the same target, prompts, continuation length and layers.
    key = hashlib.sha256(json.dumps([str(model_path), prompts, cfg.gen_tokens, layers]).encode()).hexdigest()
    cache = torch.load(cache_file, weights_only=True) if cache_file.is_file() else None
    if cache is None or cache.get("key") != key:
        samples = self_distill_data(engine_config, prompts, cfg.gen_tokens, progress)
        hidden = hidden_cache(
            model_path, samples, layers, progress, engine_config.torch_device, engine_config.torch_dtype
        )
        cache = {**hidden, "key": key}
        torch.save(cache, cache_file)
    t_data = time.perf_counter() - t0

    g = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    trainer = TRAINERS[cfg.method](cache, cfg, g, engine_config.torch_device)
    module = trainer.module
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    step, ckpt = 0, out / "checkpoint.pt"
    held = trainer.held_batches()

    def evaluate() -> dict[str, list[float]]:
        with torch.no_grad():
            parts = [trainer.losses(b) for b in held]
        depth = len(parts[0])
        kl = [sum(float(p[k][0]) for p in parts) / len(parts) for k in range(depth)]
        agree = [sum(float(p[k][1]) for p in parts) / len(parts) for k in range(depth)]
        return {"kl": [float(f"{x:.5g}") for x in kl], "top1_agreement": [round(x, 4) for x in agree]}

    before = evaluate()
    if resume and ckpt.is_file():
        state = torch.load(ckpt, weights_only=True)
        module.load_state_dict(state["heads"])
        opt.load_state_dict(state["optimizer"])
        step, before = state["step"], state["before"]
        g.set_state(state["generator"])
    bar = tqdm(total=cfg.steps, initial=step, desc=f"augur train-draft ({cfg.method})", disable=not progress)
    t1 = time.perf_counter()
    while step < cfg.steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.steps, cfg.lr, cfg.warmup_frac)
        kls = [kl for kl, _ in trainer.losses(trainer.batch())]
        weights = [cfg.head_decay**k for k in range(len(kls))]
        loss = sum(w * kl for w, kl in zip(weights, kls)) / sum(weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.clip)
        opt.step()
        step += 1
        bar.update(1)
        if step % 20 == 0:  # the loss reaches the host now and then, not every step
            bar.set_postfix(kl=f"{loss.item():.3f}")
        if step % cfg.save_every == 0 or step == cfg.steps:
            state = {"heads": module.state_dict(), "optimizer": opt.state_dict(), "step": step, "before": before}
            torch.save({**state, "generator": g.get_state()}, ckpt)
    bar.close()
    after = evaluate()
    trainer.save(out, {"base_model_name_or_path": str(model_path), "trained_by": "augur train-draft"})
    report = {
        "method": cfg.method,
        "model": str(model_path),
        "config": dataclasses.asdict(cfg),
        "data": {"sequences": len(cache["first"]), "rows": len(cache["tokens"])},
        "heldout_before": before,  # per draft depth: KL(target || heads) and top-1 agreement with the target
        "heldout_after": after,
        "seconds": {"data": round(t_data, 1), "train": round(time.perf_counter() - t1, 1)},
    }
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
