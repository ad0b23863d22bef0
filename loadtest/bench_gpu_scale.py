"""Step costs by batch size, a prefill against the compute bound, the drafters' steps, and what
speculation returns at each, with the controller's own choice: ``python -m loadtest.bench_gpu_scale``.

``loadtest.bench_gpu`` measures one sequence. This measures, for one target shape (random weights,
``loadtest.bench_gpu.build``), with CUDA graphs as served and every sequence holding ``--context``
tokens of K/V:

The target, the draft model and the head run on the fused kernels where the loader would serve them
so (engine/models/fused.py).

* **decode at batch B** (``--batch-sizes``) against the larger of its two bounds: the bytes it must read
  (the weights, once, and every sequence's K/V) over the device-to-device copy bandwidth, and the
  floating-point work it must do (two per weight per token, the LM head on every row, attention
  over the context) over a large matrix product's measured rate, both measured in the same run;
* **a prefill** of ``--prefill`` tokens (one sequence, logits for its last row) against the compute bound;
* **chain verifies** of ``k + 1`` tokens per sequence (``--depths``) and a 60-node tree at batch 1;
* **the drafters' steps**: the family's small draft model (``SHAPES[...]['draft']``) and an EAGLE-3
  head at the target's shape (one decoder layer over three fused target features, a 32,000-token draft
  vocabulary): a level forward (one token per sequence) and a catch-up (two, the EAGLE head's through
  its feature projection ``fc`` too);
  and a DFlash block drafter at the published 8B drafter's proportions (``DFLASH_LAYERS`` layers at the
  target's width over ``DFLASH_FEATURES`` fused target layers): one forward of a 16-row block after two
  context rows per sequence, which drafts up to 15 tokens (its "catch-up"; it has no level forward);
* **speculation from those costs**: a chain of depth ``k`` costs one catch-up, ``k - 1`` level forwards
  and one verify, and yields ``(1 - alpha^(k+1)) / (1 - alpha)`` tokens per sequence when each drafted
  token is accepted with probability ``alpha``: its tokens/s over plain decoding's at the same batch;
* **the controller's choice** (``engine.speculative.controller.SpecController``, planning as it serves)
  for each batch size and alpha, its cost model seeded with the forwards measured here: the depth it
  drafts, beside the best depth in the table.

``--fused on off`` measures the batch-1 decode, a 4-token verify and the tree with the fused kernels
(engine/models/fused.py) and without them, in the same run; ``--skinny on off`` the same with every
linear layer's calls of up to 64 rows on ``augur::skinny_linear`` (engine/models/skinny_linear.py)
and on cuBLAS. ``--shape tiny`` runs it all on CPU
(the tests do). Results print as tables and go to ``--output`` as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import traceback

import torch
import transformers
from torch import nn

from engine.models.llama import use_fused_ops
from engine.request.sampling_params import SamplingParams
from engine.request.sequence import SequenceGroup
from engine.runner.loader import fused_ops_serve
from engine.runner.model_runner import ForwardChunk, ModelRunner
from engine.sampling.tree import tree_layout
from engine.speculative.controller import CostModel, SpecController
from engine.speculative.methods.dflash import DFlashDrafter
from engine.speculative.methods.eagle import EagleHead
from engine.speculative.proposer import CostShape, Proposer
from loadtest.bench_gpu import (
    BLOCK,
    SHAPES,
    TREE_NODES,
    build,
    copy_bandwidth,
    decode_bytes,
    device_name,
    model_config,
    random_tree,
    sync,
    time_forward,
)

EAGLE_DRAFT_VOCAB = 32000  # EAGLE-3's published heads for Llama-3.1-8B draft over 32k target tokens
EAGLE_FEATURES = 3
DFLASH_LAYERS, DFLASH_FEATURES, DFLASH_BLOCK = 5, 5, 16  # z-lab's Qwen3-8B drafter: 5 layers over 5 target layers


def matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a large square matrix product, the best of a few: the compute bound's rate."""
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(6):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def linear_flops(model: nn.Module, experts_per_token: int = 0) -> tuple[float, float]:
    """(FLOPs per token of the decoder layers, of the LM head): two per weight of each matrix product; of
    a mixture's stacked experts (``[E, out, in]``) only the ``experts_per_token`` a token is routed to."""
    head = model.lm_head.weight if model.lm_head is not None else model.embed_tokens.weight
    layers = 0
    for n, p in model.named_parameters():
        if n.startswith("layers.") and p.dim() == 2:
            layers += p.numel()
        elif n.startswith("layers.") and p.dim() == 3 and ".experts_" in n:
            layers += p[0].numel() * experts_per_token
    return 2.0 * layers, 2.0 * head.numel()


def attention_flops(config, context: int) -> float:
    """FLOPs of one token's attention over ``context`` keys: scores and the weighted sum, every layer."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 4.0 * config.num_hidden_layers * heads * head_dim * context


def tables(num_seqs: int, blocks_each: int) -> list[list[int]]:
    return [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(num_seqs)]


def fill_pool(runner: ModelRunner) -> None:
    """K/V of unit scale in every slot (what a step reads costs the same whatever its values)."""
    with torch.no_grad():
        runner.kv_cache.normal_(0.0, 1.0)


def timed(fn, device, repeats: int) -> float:
    """Median seconds of ``fn()`` after two warm-up calls."""
    times = []
    with torch.inference_mode():
        for i in range(repeats + 2):
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            if i >= 2:
                times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


class ChainCosts(Proposer):
    """A chain drafter as the controller prices it: one catch-up and one forward a level (``per_level``;
    a block drafter such as DFlash drafts every depth in its one catch-up), timed in the cost model's
    ``kind`` table, and one KV slot a drafted token. The benchmark plans with it; it never drafts."""

    method = "chain"

    def __init__(self, kind: str, per_level: bool = True) -> None:
        self.kind, self.per_level = kind, per_level

    @classmethod
    def build(cls, config, target, *, tokenizer, eos_token_ids):
        raise TypeError("ChainCosts prices drafts for the step benchmark; it does not serve")

    def slots_needed(self, depth: int, greedy: bool = True) -> int:
        return depth

    def cost_for(self, route):
        return CostShape(kind=self.kind, per_level=self.per_level)

    def cost_kinds(self) -> tuple[str, ...]:
        return (self.kind,)

    def propose(self, seqs, depths, ctx):
        raise TypeError("ChainCosts prices drafts for the step benchmark; it does not draft")


def controller_depth(
    batch: int, alpha: float, max_depth: int, decode: float, verify: dict[int, float], level: float, catch_up: float,
    per_level: bool = True,
) -> int:
    """The depth the serving controller plans for ``batch`` greedy requests accepting ``alpha`` per
    position, its cost model holding these measured forwards (seconds); ``per_level=False``: a block
    drafter's (one catch-up for every depth, as DFlash's proposer declares its cost)."""
    cost = CostModel()
    for _ in range(3):
        cost.observe("target", batch, batch, decode)
        for k, t in verify.items():
            cost.observe("target", batch, batch * (k + 1), t)
        cost.observe("draft", batch, batch, level)
        cost.observe("draft", batch, 2 * batch, catch_up)
    ctl = SpecController(max_depth, ChainCosts("draft", per_level), cost=cost)
    ctl.trial_steps = 0  # no trial drafts: the estimates below are the requests' own
    ctl.guard.min_samples = 0  # and no early plain probes: this asks for the plan alone
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    seqs = [SequenceGroup(f"r{i}", [5] * 8, params, 0.0).seqs[0] for i in range(batch)]
    for s in seqs:
        ctl.estimate(s).alpha = [alpha] * max_depth
    depths = ctl.plan(seqs, 0)
    return max(set(depths), key=depths.count)


def eagle_head(target_config, device, dtype, max_positions: int) -> tuple[EagleHead, object]:
    """An EAGLE-3 head at the target's shape with random weights, built on ``device``."""
    cfg = transformers.LlamaConfig(
        vocab_size=target_config.vocab_size, hidden_size=target_config.hidden_size,
        intermediate_size=target_config.intermediate_size, num_hidden_layers=1,
        num_attention_heads=target_config.num_attention_heads, num_key_value_heads=target_config.num_key_value_heads,
        max_position_embeddings=max_positions, rope_parameters=getattr(target_config, "rope_parameters", None),
    )  # fmt: skip
    with torch.device("meta"):
        embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        draft_vocab = min(EAGLE_DRAFT_VOCAB, cfg.vocab_size // 2)  # (toy shapes have small vocabularies)
        head = EagleHead(cfg, EAGLE_FEATURES, cfg.hidden_size, draft_vocab, embed, max_positions)
    head = head.to_empty(device=device).to(dtype)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.02, generator=g) if p.dim() > 1 else p.fill_(1.0)
        head.d2t.zero_()
    head.init_buffers()
    return head.eval(), cfg


def dflash_drafter(target_config, device, dtype, max_positions: int) -> tuple[DFlashDrafter, object]:
    """A DFlash drafter at the target's width with random weights, on ``device``, with an output layer
    of the target's vocabulary (the served drafter reads out with the target's)."""
    cfg = transformers.LlamaConfig(
        vocab_size=target_config.vocab_size, hidden_size=target_config.hidden_size,
        intermediate_size=target_config.intermediate_size,
        num_hidden_layers=min(DFLASH_LAYERS, target_config.num_hidden_layers),
        num_attention_heads=target_config.num_attention_heads, num_key_value_heads=target_config.num_key_value_heads,
        max_position_embeddings=max_positions, rope_parameters=getattr(target_config, "rope_parameters", None),
    )  # fmt: skip
    with torch.device("meta"):
        embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        drafter = DFlashDrafter(cfg, DFLASH_FEATURES, cfg.hidden_size, embed, None, max_positions)
        drafter.lm_head = lm_head
    drafter = drafter.to_empty(device=device).to(dtype)
    drafter.head = lambda h: drafter.lm_head(h).float()
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0.0, 0.02, generator=g) if p.dim() > 1 else p.fill_(1.0)
    drafter.init_rope()
    return drafter.eval(), cfg


def block_costs(runner, batch_sizes, context, blocks_each, repeats, features: int) -> dict:
    """A DFlash drafter's one forward per step: two context rows (their fused features as input) and a
    block of ``DFLASH_BLOCK`` rows per sequence, seconds per batch size, as its catch-up (no level)."""
    out = {"level": {}, "catch_up": {}}
    q = 2 + DFLASH_BLOCK
    mask = torch.ones(q, q, dtype=torch.bool)
    mask[:2, 2:] = False
    for B in batch_sizes:
        chunks = [ForwardChunk([-1, -1] + [5] * DFLASH_BLOCK, context, t, DFLASH_BLOCK - 1, tree_mask=mask)
                  for t in tables(B, blocks_each)]  # fmt: skip
        batch = runner.prepare(chunks)
        feats = torch.randn(batch.num_tokens, features, device=runner.device, dtype=runner.dtype)
        out["catch_up"][B] = timed(lambda b=batch, f=feats: runner.execute(b, hidden_in=f), runner.device, repeats)
        out["level"][B] = 0.0
    return out


def step_costs(runner, batch_sizes, depths, context, blocks_each, repeats, prefill: int) -> dict:
    """Decode and chain-verify seconds per batch size (and the tree and a prefill at batch 1)."""
    out: dict = {"decode": {}, "verify": {}}
    for B in batch_sizes:
        tbl = tables(B, blocks_each)
        out["decode"][B] = time_forward(runner, [ForwardChunk([5], context, t, 1) for t in tbl], repeats)
        out["verify"][B] = {
            k: time_forward(runner, [ForwardChunk([5] * (k + 1), context, t, k + 1) for t in tbl], repeats)
            for k in depths
        }
    tree = random_tree(TREE_NODES)
    lay = tree_layout(tree)
    chunk = ForwardChunk([5, *tree.tokens], context, tables(1, blocks_each)[0], len(tree) + 1,
                         [context + d for d in lay.depths], lay.mask)  # fmt: skip
    out["tree"] = time_forward(runner, [chunk], repeats)
    if prefill:
        ids = [(7 * i) % 1000 + 3 for i in range(prefill)]
        chunk = ForwardChunk(ids, 0, list(range(-(-prefill // BLOCK))), 1)
        out["prefill"] = time_forward(runner, [chunk], max(3, repeats // 4))
    return out


def drafter_costs(runner, batch_sizes, context, blocks_each, repeats, feature_in=None) -> dict:
    """A drafter's level forward (one token a sequence) and catch-up (two) per batch size, seconds.
    ``feature_in(rows)``: the per-row features an EAGLE head is fed (through its ``fc`` at a catch-up)."""
    out = {"level": {}, "catch_up": {}}
    for B in batch_sizes:
        tbl = tables(B, blocks_each)
        for key, width in (("level", 1), ("catch_up", 2)):
            batch = runner.prepare([ForwardChunk([5] * width, context, t, width) for t in tbl])
            if feature_in is None:
                out[key][B] = timed(lambda b=batch: runner.execute(b), runner.device, repeats)
            else:
                feats = feature_in(B * width, catch_up=width == 2)
                out[key][B] = timed(lambda b=batch, f=feats: runner.execute(b, hidden_in=f()), runner.device, repeats)
    return out


def speculation(costs: dict, drafter: dict, batch_sizes, alphas, depths, max_depth: int) -> list[dict]:
    rows = []
    for B in batch_sizes:
        if B not in drafter["level"]:
            continue
        decode, verify = costs["decode"][B], costs["verify"][B]
        level, catch_up = drafter["level"][B], drafter["catch_up"][B]
        for alpha in alphas:
            chosen = controller_depth(B, alpha, max_depth, decode, verify, level, catch_up, per_level=level > 0)
            for k in depths:
                tokens = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1.0
                step = catch_up + (k - 1) * level + verify[k]
                rows.append(dict(batch=B, alpha=alpha, depth=k, step_ms=step * 1e3, speedup=tokens / step * decode,
                                 controller_depth=chosen))  # fmt: skip
    return rows


def _use_skinny(model: nn.Module, on: bool) -> None:
    if on:
        from engine.models.skinny_linear import use_skinny_linear  # (needs Triton)

        use_skinny_linear(model)


def run(args) -> dict:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    bandwidth = copy_bandwidth(device, 1 << 30 if device.type == "cuda" else 1 << 26)
    rate = matmul_rate(device, dtype)
    head = f"device: {device_name(device)}; copy {bandwidth / 1e9:.0f} GB/s; matmul {rate / 1e12:.1f} TFLOP/s"
    print(f"{head}; {args.dtype}; {args.shape}; context {args.context}", flush=True)
    report: dict = dict(device=device_name(device), dtype=args.dtype, shape=args.shape, context=args.context,
                        copy_bandwidth_gb_s=bandwidth / 1e9, matmul_tflops=rate / 1e12, torch=torch.__version__,
                        errors=[])  # fmt: skip
    depths = sorted(set(args.depths) | {1, 3})  # 1: the controller may plan it; 3: a 4-token verify
    max_positions = args.context + TREE_NODES + 8
    blocks_each = -(-max_positions // BLOCK)
    graphs = args.cuda_graphs == "on"
    B_max = max(args.batch_sizes)
    num_blocks = max(B_max * blocks_each, -(-args.prefill // BLOCK)) + 1
    positions = max(max_positions, args.prefill + 8)

    def section(name, fn):
        try:
            return fn()
        except Exception as exc:  # one failing section must not lose the others' figures
            traceback.print_exc()
            report["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
            return None

    # -- the fused kernels, and the few-rows linear kernel, on and off: batch 1 ------------------------
    for key, label, states, switch in (
        ("fused", "fused kernels", args.fused, use_fused_ops),
        ("skinny", "few-rows linear kernel", args.skinny, _use_skinny),
    ):
        rows = {}
        for state in states:

            def one(state=state, switch=switch):
                runner, _ = build(args.shape, device, dtype, positions, "auto", graphs)
                switch(runner.model, state == "on")
                runner.allocate_kv(num_blocks)
                fill_pool(runner)
                costs = step_costs(runner, [1], [3], args.context, blocks_each, args.repeats, 0)
                del runner
                return dict(decode_ms=costs["decode"][1] * 1e3, verify4_ms=costs["verify"][1][3] * 1e3,
                            tree_ms=costs["tree"] * 1e3)  # fmt: skip

            r = section(f"{key} {state}", one)
            if r:
                rows[state] = r
                print(f"{label} {state}: decode {r['decode_ms']:.2f} ms, 4-token verify {r['verify4_ms']:.2f} ms, "
                      f"{TREE_NODES}-node tree {r['tree_ms']:.2f} ms", flush=True)  # fmt: skip
            if device.type == "cuda":
                torch.cuda.empty_cache()
        report[key] = rows

    # -- the target by batch size (as served: fused kernels where they serve) -------------------------
    runner, config = build(args.shape, device, dtype, positions, "auto", graphs)
    runner.cuda_graph_max_seqs = B_max if runner.cuda_graph_max_seqs else 0  # (graphs need triton attention)
    runner.allocate_kv(num_blocks)
    fill_pool(runner)
    nbytes = decode_bytes(runner, 0)
    kv_token = runner.kv_bytes_per_token
    layer_flops, head_flops = linear_flops(runner.model, getattr(config, "num_experts_per_tok", 0))
    costs = section("target", lambda r=runner: step_costs(r, args.batch_sizes, depths, args.context, blocks_each,
                                                 args.repeats, args.prefill))  # fmt: skip
    del runner
    gc.collect()  # (a runner's graphs hold their memory pool until its cycles are collected)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if costs is None:
        return report
    rows = []
    for B in args.batch_sizes:
        step = costs["decode"][B]
        memory = (nbytes + B * args.context * kv_token) / bandwidth
        compute = B * (layer_flops + head_flops + attention_flops(config, args.context)) / rate
        bound = max(memory, compute)
        rows.append(dict(batch=B, decode_ms=step * 1e3, memory_bound_ms=memory * 1e3, compute_bound_ms=compute * 1e3,
                         fraction_of_bound=bound / step, tokens_per_s=B / step,
                         verify_ms={k: costs["verify"][B][k] * 1e3 for k in depths},
                         verify_vs_decode={k: costs["verify"][B][k] / step for k in depths}))  # fmt: skip
        r = rows[-1]
        print(f"batch {B}: decode {r['decode_ms']:.2f} ms ({r['tokens_per_s']:.0f} tok/s), bounds: memory "
              f"{r['memory_bound_ms']:.2f} / compute {r['compute_bound_ms']:.2f} ms -> {r['fraction_of_bound']:.0%} "
              "of the larger; chain verify k=" + ", ".join(f"{k}: {v:.2f}x" for k, v in r["verify_vs_decode"].items()),
              flush=True)  # fmt: skip
    report["batches"] = rows
    report["tree_ms"] = costs["tree"] * 1e3
    report["tree_vs_decode"] = costs["tree"] / costs["decode"][args.batch_sizes[0]]
    print(f"{TREE_NODES}-node tree verify at batch {args.batch_sizes[0]}: {report['tree_ms']:.2f} ms = "
          f"{report['tree_vs_decode']:.2f}x a decode", flush=True)  # fmt: skip
    if args.prefill:
        flops = args.prefill * layer_flops + head_flops + attention_flops(config, args.prefill) * args.prefill / 2
        report["prefill"] = dict(tokens=args.prefill, ms=costs["prefill"] * 1e3, compute_bound_ms=flops / rate * 1e3,
                                 fraction_of_bound=flops / rate / costs["prefill"])  # fmt: skip
        p = report["prefill"]
        print(f"prefill {args.prefill} tokens: {p['ms']:.2f} ms vs compute bound {p['compute_bound_ms']:.2f} ms "
              f"({p['fraction_of_bound']:.0%})", flush=True)  # fmt: skip

    # -- the drafters ---------------------------------------------------------------------------------
    spec_batches = [B for B in args.batch_sizes if B <= args.spec_max_batch]
    drafters = {}
    draft_shape = SHAPES[args.shape].get("draft")
    if draft_shape:

        def small():
            druns, _ = build(draft_shape, device, dtype, positions, "auto", graphs)
            druns.cuda_graph_max_seqs = max(spec_batches) if druns.cuda_graph_max_seqs else 0
            druns.allocate_kv(num_blocks)
            fill_pool(druns)
            return drafter_costs(druns, spec_batches, args.context, blocks_each, args.repeats)

        drafters[draft_shape] = section("draft model", small)

    def eagle():
        head, cfg = eagle_head(model_config(args.shape, positions), device, dtype, positions)
        if fused_ops_serve(device, dtype):  # as load_eagle serves it
            use_fused_ops(head)
        hruns = ModelRunner(head, cfg, device, dtype, BLOCK, attention_backend="auto",
                            cuda_graph_max_seqs=max(spec_batches) if graphs else 0)  # fmt: skip
        hruns.allocate_kv(num_blocks)
        fill_pool(hruns)
        hidden = cfg.hidden_size

        def feature_in(rows, catch_up):
            raw = torch.randn(rows, EAGLE_FEATURES * hidden if catch_up else hidden, device=device, dtype=dtype)
            return (lambda: head.fc(raw)) if catch_up else (lambda: raw)

        return drafter_costs(hruns, spec_batches, args.context, blocks_each, args.repeats, feature_in)

    drafters["eagle-3 head"] = section("eagle head", eagle)

    def dflash():
        drafter, cfg = dflash_drafter(model_config(args.shape, positions), device, dtype, positions)
        druns = ModelRunner(drafter, cfg, device, dtype, BLOCK, attention_backend="auto",
                            cuda_graph_max_seqs=max(spec_batches) if graphs else 0)  # fmt: skip
        druns.allocate_kv(num_blocks)
        fill_pool(druns)
        return block_costs(druns, spec_batches, args.context, blocks_each, args.repeats, cfg.hidden_size)

    drafters["dflash drafter"] = section("dflash drafter", dflash)
    report["drafters"] = {}
    report["speculation"] = {}
    for name, d in drafters.items():
        if d is None:
            continue
        report["drafters"][name] = {k: {B: t * 1e3 for B, t in v.items()} for k, v in d.items()}
        print(f"drafter {name}: level " + ", ".join(f"B={B} {t * 1e3:.2f}" for B, t in d["level"].items())
              + " ms; catch-up " + ", ".join(f"B={B} {t * 1e3:.2f}" for B, t in d["catch_up"].items()) + " ms",
              flush=True)  # fmt: skip
        rows = section(f"speculation {name}",
                       lambda d=d: speculation(costs, d, spec_batches, args.alphas, depths, max(depths)))  # fmt: skip
        if not rows:
            continue
        report["speculation"][name] = rows
        for B in spec_batches:
            for alpha in args.alphas:
                cells = [r for r in rows if r["batch"] == B and r["alpha"] == alpha and r["depth"] in args.depths]
                if not cells:
                    continue
                best = max(cells, key=lambda r: r["speedup"])
                line = ", ".join(f"k={r['depth']} {r['speedup']:.2f}x" for r in cells)
                chosen = cells[0]["controller_depth"]
                at = next((r["speedup"] for r in rows if r["batch"] == B and r["alpha"] == alpha
                           and r["depth"] == chosen), 1.0)  # fmt: skip
                print(f"  {name} B={B} alpha {alpha}: {line}; best k={best['depth']}; the controller drafts "
                      f"k={chosen} ({at:.2f}x)", flush=True)  # fmt: skip
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=SHAPES)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--context", type=int, default=1024, help="tokens already in each sequence's cache")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--spec-max-batch", type=int, default=32, help="speculation is priced up to this batch size")
    ap.add_argument("--prefill", type=int, default=2048, help="tokens of the prefill measured (0: none)")
    ap.add_argument("--depths", type=int, nargs="+", default=[2, 3, 4, 5, 6, 15],
                    help="chain depths verified and priced (15: a DFlash 16-row block's whole draft)")  # fmt: skip
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.6, 0.7, 0.8])
    ap.add_argument("--fused", nargs="*", default=["on", "off"], choices=["on", "off"],
                    help="measure batch 1 with the fused kernels on and off (none: skip)")  # fmt: skip
    ap.add_argument("--skinny", nargs="*", default=["on", "off"], choices=["on", "off"],
                    help="measure batch 1 with the few-rows linear kernel on and off (none: skip)")  # fmt: skip
    ap.add_argument("--cuda-graphs", choices=["on", "off"], default="on")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--output", default=None, help="write the results as JSON")
    args = ap.parse_args(argv)
    report = run(args)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)
    if report["errors"]:
        print("errors: " + "; ".join(report["errors"]))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
