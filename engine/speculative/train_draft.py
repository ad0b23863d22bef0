"""``augur train-draft``: train draft heads on the target by self-distillation.

The heads must predict what *the target* says, not what some corpus says, so the training text is
the target's own: Augur generates continuations of the training prompts with the target (greedy and
sampled at T = 1, the two ways it is served), then the target's final hidden states over those
continuations are computed once and cached (``cache.pt``; a second run on the same target, prompts
and continuation length reuses it). Training reads
only that cache: for each position ``t`` the target's distribution over token ``t + 2 + k`` is
``softmax(lm_head(h[t + 1 + k]))``, so head ``k`` learns from ``h[t]`` with a KL loss to it, weighted
``0.8 ** k`` (far heads are right less often and matter less: a draft stops at its first miss).

Heads start as the target's own output layer (each head's output layer a copy of the target's, its
residual blocks zero, so head ``k`` first guesses the *next* token) — a far better start than random.
Progress is checkpointed (``checkpoint.pt``) every ``save_every`` steps and at the end; ``--resume``
continues from it. The output directory is what ``--draft-model`` serves, with a ``report.json``:
each head's KL to the target and top-1 agreement with it on held-out positions, before and after.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.loader import resolve_model_path
from engine.speculative.medusa import MedusaHeads

METHODS = ("medusa",)


@dataclass
class TrainConfig:
    method: str = "medusa"
    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head
    gen_tokens: int = 128  # continuation length generated per prompt and temperature
    steps: int = 1500
    batch_size: int = 256  # positions per step
    lr: float = 1e-3
    head_decay: float = 0.8  # loss weight of head k: head_decay ** k
    heldout_frac: float = 0.05
    save_every: int = 200
    seed: int = 0


def self_distill_data(engine_config: EngineConfig, prompts: list[str], gen_tokens: int, progress: bool = True):
    """The target's own continuations of ``prompts`` (greedy and T = 1), as token-id lists."""
    from tqdm import tqdm

    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(dataclasses.replace(engine_config, speculative_method="none", draft_model=None))
    ids = [engine.tokenize(p)[-engine.max_model_len // 2 :] for p in prompts]
    out = []
    for t in tqdm((0.0, 1.0), desc="target continuations (T = 0, 1)", disable=not progress):
        for p, o in zip(ids, engine.generate(ids, SamplingParams(temperature=t, max_tokens=gen_tokens))):
            out.append((p, list(o.outputs[0].delta_token_ids)))
    return out


@torch.inference_mode()
def hidden_cache(model_path: Path, samples: list[tuple[list[int], list[int]]], progress: bool = True) -> dict:
    """The target's final (normed) hidden states over each continuation, and its output layer.

    Positions kept: the last prompt token and every generated token (where the heads are used when
    serving). Stored in bfloat16; ``starts`` marks where each sequence's rows begin."""
    import transformers
    from tqdm import tqdm

    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    rows, starts = [], [0]
    for prompt, gen in tqdm(samples, desc="target hidden states", disable=not progress):
        if not gen:
            continue
        ids = torch.tensor([prompt + gen])
        h = model(ids, output_hidden_states=True).hidden_states[-1][0]  # [T, hidden], after the final norm
        rows.append(h[len(prompt) - 1 :].to(torch.bfloat16))
        starts.append(starts[-1] + rows[-1].shape[0])
    return {
        "hidden": torch.cat(rows),
        "starts": torch.tensor(starts),
        "lm_head": model.get_output_embeddings().weight.detach().clone(),
    }


def usable_positions(starts: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Row indices ``t`` whose sequence has a row ``t + num_heads`` (the last head's target)."""
    parts = [torch.arange(int(a), int(b) - num_heads) for a, b in zip(starts[:-1], starts[1:]) if b - a > num_heads]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)


def head_losses(heads: MedusaHeads, hidden: torch.Tensor, lm_head: torch.Tensor, idx: torch.Tensor):
    """Per head: KL(target || head) averaged over the positions ``idx``, and top-1 agreement."""
    x = hidden[idx].float()
    logits = heads(x)  # [B, K, V]
    kls, agree = [], []
    for k in range(heads.num_heads):
        p = torch.log_softmax(hidden[idx + k + 1].float() @ lm_head.T, -1)  # target's log p of token t + 2 + k
        q = torch.log_softmax(logits[:, k], -1)
        kls.append((p.exp() * (p - q)).sum(-1).mean())
        agree.append((q.argmax(-1) == p.argmax(-1)).float().mean())
    return kls, agree


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
    # The cache is reused only for the same target, prompts and continuation length.
    key = hashlib.sha256(json.dumps([str(model_path), prompts, cfg.gen_tokens]).encode()).hexdigest()
    cache = torch.load(cache_file, weights_only=True) if cache_file.is_file() else None
    if cache is None or cache.get("key") != key:
        samples = self_distill_data(engine_config, prompts, cfg.gen_tokens, progress)
        cache = {**hidden_cache(model_path, samples, progress), "key": key}
        torch.save(cache, cache_file)
    t_data = time.perf_counter() - t0
    hidden, lm_head = cache["hidden"], cache["lm_head"].float()
    pos = usable_positions(cache["starts"], cfg.num_heads)
    if len(pos) < 2 * cfg.batch_size:
        raise ValueError(f"only {len(pos)} training positions: give more or longer prompts")
    g = torch.Generator().manual_seed(cfg.seed)
    pos = pos[torch.randperm(len(pos), generator=g)]
    n_held = max(cfg.batch_size, int(len(pos) * cfg.heldout_frac))
    held, train = pos[:n_held], pos[n_held:]

    torch.manual_seed(cfg.seed)
    heads = MedusaHeads(hidden.shape[1], lm_head.shape[0], cfg.num_heads, cfg.num_layers)
    with torch.no_grad():
        for head in heads.heads:
            head[-1].weight.copy_(lm_head)
            for block in head[:-1]:
                block.linear.weight.zero_()
                block.linear.bias.zero_()
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, weight_decay=0.0)
    step, ckpt = 0, out / "checkpoint.pt"

    def evaluate() -> dict[str, list[float]]:
        with torch.no_grad():
            kls, agree = head_losses(heads, hidden, lm_head, held)
        return {"kl": [float(f"{x:.5g}") for x in kls], "top1_agreement": [round(float(x), 4) for x in agree]}

    before = evaluate()
    if resume and ckpt.is_file():
        state = torch.load(ckpt, weights_only=True)
        heads.load_state_dict(state["heads"])
        opt.load_state_dict(state["optimizer"])
        step, before = state["step"], state["before"]
    weights = [cfg.head_decay**k for k in range(cfg.num_heads)]
    bar = tqdm(total=cfg.steps, initial=step, desc=f"augur train-draft ({cfg.method})", disable=not progress)
    t1 = time.perf_counter()
    while step < cfg.steps:
        for group in opt.param_groups:  # cosine decay to 10% of the peak
            group["lr"] = cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * step / cfg.steps)))
        idx = train[torch.randint(len(train), (cfg.batch_size,), generator=g)]
        kls, _ = head_losses(heads, hidden, lm_head, idx)
        loss = sum(w * kl for w, kl in zip(weights, kls)) / sum(weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        bar.update(1)
        if step % 20 == 0:  # the loss reaches the host now and then, not every step
            bar.set_postfix(kl=f"{loss.item():.3f}")
        if step % cfg.save_every == 0 or step == cfg.steps:
            torch.save(
                {"heads": heads.state_dict(), "optimizer": opt.state_dict(), "step": step, "before": before}, ckpt
            )
    bar.close()
    after = evaluate()
    heads.save(out, {"base_model_name_or_path": str(model_path), "trained_by": "augur train-draft"})
    report = {
        "method": cfg.method,
        "model": str(model_path),
        "config": dataclasses.asdict(cfg),
        "positions": {"train": len(train), "heldout": len(held)},
        "heldout_before": before,  # per head: KL(target || head) and top-1 agreement with the target
        "heldout_after": after,
        "seconds": {"data": round(t_data, 1), "train": round(time.perf_counter() - t1, 1)},
    }
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
