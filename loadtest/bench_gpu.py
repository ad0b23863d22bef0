"""Step costs at real model shapes with random weights: no download, speed does not depend on values.

``python -m loadtest.bench_gpu --shapes llama-3.1-8b qwen2.5-7b gemma-2-9b`` builds each target (and a
small draft of the same family) at its published shape, with random weights, straight on the device.
It measures, on the device it names:

* **decode step vs the HBM bound**: one sequence, one new token, ``--context`` tokens in the cache.
  The bound is the bytes a decode must read (every weight but the embedding table, which is read
  only as the tied LM head or as one row, plus the context's K/V) divided by the bandwidth of a
  device-to-device copy measured in the same run. The ratio is ``bound / step``: the fraction of
  the bound achieved.
* **tree verify vs decode**: the same sequence verifying a 60-node draft tree (61 tokens with an
  ancestor mask) in one forward, against the 1-token decode step.
* **speculative tokens/s at fixed acceptance patterns**: a draft chain of depth ``k`` costs ``k``
  draft decode steps and one ``k + 1``-token verify step (both measured). With each drafted token
  accepted with probability ``alpha`` independently, a step yields ``(1 - alpha**(k+1)) / (1 - alpha)``
  tokens in expectation. That gives tokens/s for each (alpha, k) against plain decoding. The
  figure leaves out the host work of the accept stage; ``augur bench --speculative`` measures that
  end to end.

Forwards replay captured CUDA graphs (``engine/runner/cuda_graphs.py``, the serving default on a GPU) with
the triton backend; ``--cuda-graphs on off`` measures both that and eager forwards.

``--shapes tiny`` runs the same code on toy shapes (the tests run it on CPU). Results print as a
table and go to ``--output`` as JSON, with the device named.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import random
import statistics
import time
import traceback
from dataclasses import asdict, dataclass

import torch
import transformers

from engine.attention import BACKENDS as ATTENTION_BACKENDS
from engine.models import model_class_for
from engine.models.invariant import load_invariant_kernels
from engine.models.llama import use_fused_ops
from engine.models.moe import has_experts
from engine.runner.loader import fused_ops_serve
from engine.runner.model_runner import ForwardChunk, ModelRunner
from engine.sampling.tree import DraftTree, tree_layout

# Published shapes (config.json of each model); a draft of the same family and vocabulary beside each.
SHAPES: dict[str, dict] = {
    "llama-3.1-8b": dict(
        cls="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False, draft="llama-3.2-1b",
    ),
    "llama-3.2-1b": dict(
        cls="LlamaForCausalLM", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        cls="Qwen2ForCausalLM", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False, draft="qwen2.5-0.5b",
    ),
    "qwen2.5-0.5b": dict(
        cls="Qwen2ForCausalLM", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(  # q/k normalized per head (inside RoPE's kernel on the fused operators)
        cls="Qwen3ForCausalLM", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
    ),
    "gemma-2-9b": dict(
        cls="Gemma2ForCausalLM", vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, tie_word_embeddings=True, draft="gemma-2-2b",
    ),
    "gemma-2-2b": dict(
        cls="Gemma2ForCausalLM", vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, tie_word_embeddings=True,
    ),
    # Mixtures at their published shapes (issue 59): the bound is what the routed experts read.
    "qwen3-30b-a3b": dict(
        cls="Qwen3MoeForCausalLM", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False,
    ),
    "gpt-oss-20b": dict(
        cls="GptOssForCausalLM", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
        sliding_window=128, swiglu_limit=7.0, tie_word_embeddings=False,
    ),
    "tiny": dict(
        cls="LlamaForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, draft="tiny-draft",
    ),
    "tiny-draft": dict(
        cls="LlamaForCausalLM", vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
    ),
    "tiny-moe": dict(
        cls="Qwen3MoeForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False,
    ),
}  # fmt: skip

_CONFIGS = {
    "LlamaForCausalLM": transformers.LlamaConfig,
    "Qwen2ForCausalLM": transformers.Qwen2Config,
    "Qwen3ForCausalLM": transformers.Qwen3Config,
    "Gemma2ForCausalLM": transformers.Gemma2Config,
    "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
    "GptOssForCausalLM": transformers.GptOssConfig,
}
BLOCK = 16
TREE_NODES = 60


@dataclass
class ShapeResult:
    shape: str
    attention_backend: str
    cuda_graphs: bool  # forwards replayed captured graphs (the triton backend only)
    params_b: float  # billions of parameters
    decode_bytes_gb: float  # what one decode step must read
    decode_ms: float
    hbm_bound_ms: float
    fraction_of_bound: float  # hbm_bound_ms / decode_ms
    verify_tree_ms: float  # 60-node tree, one forward
    verify_vs_decode: float
    draft: str | None = None
    draft_decode_ms: float | None = None
    chain_verify_ms: dict[int, float] | None = None  # depth k → (k + 1)-token verify
    speculative: list[dict] | None = None  # per (alpha, k): tokens/s and speedup over plain decoding


def model_config(name: str, max_positions: int):
    """The transformers config of ``name``'s shape."""
    spec = dict(SHAPES[name])
    cls_name = spec.pop("cls")
    spec.pop("draft", None)
    return _CONFIGS[cls_name](**spec, max_position_embeddings=max_positions, architectures=[cls_name])


def build(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
    attention_backend: str = "auto",
    graphs: bool = False,
    prepare=None,
    invariant: bool = False,
) -> tuple[ModelRunner, object]:
    """The model at ``name``'s shape with random weights (N(0, 0.02); norms at 1), built on ``device``,
    on the fused kernels where the loader would put it on them (engine/models/fused.py), or on the
    batch-invariant operators with ``invariant`` (as ``--batch-invariant on`` serves it); ``prepare(model)``
    then changes it as a serving option would (quantized layers, LoRA slots) before its runner is built."""
    config = model_config(name, max_positions)
    cls_name = config.architectures[0]
    with torch.device("meta"):
        model = model_class_for(config)(config, max_positions)
    model = model.to(dtype).to_empty(device=device)  # (in its dtype at once: a 30B mixture fits once, not twice)
    model.init_buffers(max_positions)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02, generator=g)
            else:
                p.fill_(0.0 if cls_name == "Gemma2ForCausalLM" else 1.0)  # Gemma's norms scale by 1 + w
    if device.type == "cuda" and has_experts(model):
        import engine.models.moe_triton  # noqa: F401  (the mixture's GPU kernels, as the loader serves them)
    if invariant:
        if device.type == "cuda":
            from engine.models import invariant_cuda  # noqa: F401  (registers its CUDA kernels)
        elif not load_invariant_kernels():
            raise RuntimeError("the batch-invariant kernels could not be built (a C++ compiler is needed)")
        model.use_invariant_ops()
    elif fused_ops_serve(device, dtype):  # the small operators on fused kernels, as the loader serves them
        use_fused_ops(model)
    if prepare is not None:
        prepare(model)
    runner = ModelRunner(
        model.eval(), config, device, dtype, BLOCK, attention_backend=attention_backend,
        cuda_graph_max_seqs=int(graphs), batch_invariant=invariant,
    )  # fmt: skip
    return runner, config


def decode_bytes(runner: ModelRunner, context: int) -> int:
    """Bytes one decode step reads: the weights (an untied embedding table only one row of), the K/V."""
    model = runner.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:  # the input embedding is a lookup; the LM head reads its own matrix
        emb = model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
    return total + context * runner.kv_bytes_per_token


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy (read + write), the best of a few."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / best


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(calls: list, device: torch.device, repeats: int) -> float:
    """Median seconds of one call, ``calls`` run in turn (on CUDA: captured once, replayed)."""
    if device.type == "cuda":
        for call in calls:  # (compiles a kernel before the capture)
            call()
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        graph.replay()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / len(calls))
        return statistics.median(times)
    times = []
    for _ in range(max(1, repeats)):
        sync(device)
        t0 = time.perf_counter()
        for call in calls:
            call()
        sync(device)
        times.append((time.perf_counter() - t0) / len(calls))
    return statistics.median(times)


def record_each(report: dict, key: str, runs, output: str | None, device: torch.device) -> dict:
    """``report[key][name] = measure()`` for each ``(name, measure)`` of ``runs``, in turn: one failing
    must not lose the others' figures (it is noted in ``report["errors"]``), and ``output`` is rewritten
    after each, so a run cut short by its time limit keeps what it measured."""
    for name, measure in runs:
        print(f"{name}:", flush=True)
        try:
            report[key][name] = measure()
        except Exception as exc:
            traceback.print_exc()
            report["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
        if output:
            with open(output, "w") as f:
                json.dump(report, f, indent=1)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return report


def time_forward(runner: ModelRunner, chunks: list[ForwardChunk], repeats: int) -> float:
    """Median seconds of one forward over ``chunks`` (after two warm-up runs)."""
    batch = runner.prepare(chunks)
    times = []
    with torch.inference_mode():
        for i in range(repeats + 2):
            sync(runner.device)
            t0 = time.perf_counter()
            runner.execute(batch)
            sync(runner.device)
            if i >= 2:
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def random_tree(nodes: int, seed: int = 0) -> DraftTree:
    """A bushy random tree: each node hangs under the root or an earlier node (depth at most 8)."""
    rng = random.Random(seed)
    parents, depth = [], []
    for i in range(nodes):
        choices = [-1] + [j for j in range(i) if depth[j] < 8]
        p = rng.choice(choices)
        parents.append(p)
        depth.append(1 if p < 0 else depth[p] + 1)
    return DraftTree([rng.randrange(3, 100) for _ in range(nodes)], parents)


def measure(
    name: str, backend: str, graphs: bool, device, dtype, context: int, repeats: int, alphas, depths, bandwidth: float
) -> ShapeResult:
    max_positions = context + TREE_NODES + 8
    runner, _ = build(name, device, dtype, max_positions, backend, graphs)
    runner.allocate_kv(-(-max_positions // BLOCK) + 1)
    table = list(range(runner.num_blocks))
    ids = [random.Random(1).randrange(3, 100) for _ in range(context)]
    with torch.inference_mode():
        runner.forward([ForwardChunk(ids, 0, table, 1)])  # the context's K/V
    decode = time_forward(runner, [ForwardChunk([5], context, table, 1)], repeats)
    tree = random_tree(TREE_NODES)
    lay = tree_layout(tree)
    chunk = ForwardChunk([5] + tree.tokens, context, table, len(tree) + 1, [context + d for d in lay.depths], lay.mask)
    verify = time_forward(runner, [chunk], repeats)
    nbytes = decode_bytes(runner, context)
    chains = {k: time_forward(runner, [ForwardChunk([5] * (k + 1), context, table, k + 1)], repeats) for k in depths}
    params = sum(p.numel() for p in runner.model.parameters())
    bound = nbytes / bandwidth
    graphed = runner.graphs is not None
    result = ShapeResult(
        name, runner.attention_backend, graphed, params / 1e9, nbytes / 1e9, decode * 1e3, bound * 1e3,
        bound / decode, verify * 1e3, verify / decode,
    )  # fmt: skip
    del runner
    draft = SHAPES[name].get("draft")
    if draft:
        druns, _ = build(draft, device, dtype, max_positions, backend, graphs)
        druns.allocate_kv(-(-max_positions // BLOCK) + 1)
        with torch.inference_mode():
            druns.forward([ForwardChunk(ids, 0, table, 1)])
        d = time_forward(druns, [ForwardChunk([5], context, table, 1)], repeats)
        del druns
        result.draft, result.draft_decode_ms = draft, d * 1e3
        result.chain_verify_ms = {k: t * 1e3 for k, t in chains.items()}
        result.speculative = []
        for alpha in alphas:
            for k in depths:
                tokens = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1.0
                step = k * d + chains[k]
                result.speculative.append(
                    dict(alpha=alpha, depth=k, tokens_per_s=tokens / step, speedup=(tokens / step) * decode)
                )
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU ({torch.get_num_threads()} threads)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["llama-3.1-8b", "qwen2.5-7b", "gemma-2-9b"], choices=SHAPES)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--context", type=int, default=1024, help="tokens already in the cache")
    ap.add_argument(
        "--attention-backends", nargs="+", default=["auto"], choices=["auto", *ATTENTION_BACKENDS],
        help="measure each shape with each of these (engine.attention; auto: triton on CUDA)",
    )  # fmt: skip
    ap.add_argument(
        "--cuda-graphs", nargs="+", default=["on"], choices=["on", "off"],
        help="replay captured graphs (on: the triton backend only) or run eagerly (off); both: on off",
    )  # fmt: skip
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.6, 0.8])
    ap.add_argument("--depths", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--output", default=None, help="write the results as JSON")
    args = ap.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    bandwidth = copy_bandwidth(device, 1 << 30 if device.type == "cuda" else 1 << 26)
    head = f"device: {device_name(device)}; copy bandwidth {bandwidth / 1e9:.0f} GB/s"
    print(f"{head}; {args.dtype}; context {args.context}")
    results = []
    for name, backend, graphs in itertools.product(args.shapes, args.attention_backends, args.cuda_graphs):
        r = measure(
            name, backend, graphs == "on", device, dtype, args.context, args.repeats, args.alphas, args.depths,
            bandwidth,
        )  # fmt: skip
        results.append(r)
        mode = "graphs" if r.cuda_graphs else "eager"
        print(
            f"{name} ({r.attention_backend} attention, {mode}): {r.params_b:.2f}B params, decode {r.decode_ms:.2f} ms "
            f"vs HBM bound {r.hbm_bound_ms:.2f} ms "
            f"({r.fraction_of_bound:.0%} of the bound); {TREE_NODES}-node tree verify {r.verify_tree_ms:.2f} ms "
            f"= {r.verify_vs_decode:.2f}x a decode"
        )
        for s in r.speculative or []:
            print(
                f"  draft {r.draft} ({r.draft_decode_ms:.2f} ms/step), alpha {s['alpha']}, depth {s['depth']}: "
                f"{s['tokens_per_s']:.1f} tok/s, {s['speedup']:.2f}x plain decoding"
            )
    if args.output:
        out = dict(
            device=device_name(device), dtype=args.dtype, context=args.context,
            copy_bandwidth_gb_s=bandwidth / 1e9, torch=torch.__version__, results=[asdict(r) for r in results],
        )  # fmt: skip
        with open(args.output, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
