"""What tensor parallelism costs a step on this host: ``python -m loadtest.bench_parallel``.

Two parts, each printed as a markdown table:

1. **The collectives alone**, two ranks over gloo (one process each, one thread each), rank 0 timing:
   the message rank 0 sends its workers before a decode forward (``broadcast_object_list`` of the
   runner's call, as :class:`engine.runner.parallel.Workers` sends it), and one all-reduce of a decode's
   hidden state (``[sequences, hidden]``, what each layer pays twice) — median microseconds.
2. **The engine**, in-process: the same greedy requests decoded at ``-tp 1`` and ``-tp N`` (rank 0 in
   this process, the workers started by it), tokens/s and milliseconds a step, one after the other.
3. **A draft model beside the sharded target**: the same requests speculated with a draft model (the
   target's first two layers, with its embedding, norm and head), 4 tokens a step, at ``-tp 1``, then
   at ``-tp N`` with the draft unsharded on rank 0 (``--draft-tensor-parallel-size 1``) and sharded
   like the target (``N``): tokens/s, the mean acceptance length, and the milliseconds the proposer
   took per drafted token (its whole ``propose``, messages and collectives included).

The model is ``--model``, or by default a random-weight Llama at about the demo target's size whose
heads two ranks can share (the demo target's 5 heads cannot be split in two): 6 layers, hidden 384,
6 heads (2 KV heads), MLP 1,024, the demo's tokenizer and vocabulary (4,096). Weights' values do not
change a forward's speed. ``--compile`` as the engine's flag. Speed is read as the ratio of the two
runs, taken one after the other on the same host.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time


def _collectives(rank: int, size: int, init: str, hidden: int, seqs: int, reps: int, out) -> None:
    import torch
    import torch.distributed as dist

    from engine.parallel import control_group, join
    from engine.runner.model_runner import ForwardChunk

    torch.set_num_threads(1)
    tp = join(rank, size, init, torch.device("cpu"), 120.0)
    group = control_group()
    # A decode forward's call as rank 0 sends it: the prepared batch of `seqs` sequences, 300 tokens each.
    msg = None
    if rank == 0:
        from engine.attention.sdpa import build_sdpa_metadata

        chunks = [ForwardChunk([5], 300, list(range(i * 20, i * 20 + 20)), 1) for i in range(seqs)]
        pos = torch.full((seqs,), 300)
        meta = build_sdpa_metadata([1] * seqs, [300] * seqs, [c.block_table for c in chunks], 16, pos)
        msg = ("execute", (torch.full((seqs,), 5), pos, meta, torch.arange(seqs)), {})
    x = torch.randn(seqs, hidden)
    times = {"message": [], "all_reduce": []}
    for _ in range(reps):
        dist.barrier(group)
        t0 = time.perf_counter()
        box = [msg]
        dist.broadcast_object_list(box, src=0, group=group)
        times["message"].append(time.perf_counter() - t0)
        dist.barrier(group)
        t0 = time.perf_counter()
        tp.all_reduce(x)
        times["all_reduce"].append(time.perf_counter() - t0)
    if rank == 0:
        out.put({k: statistics.median(v) * 1e6 for k, v in times.items()})
    dist.destroy_process_group()


def measure_collectives(hidden: int, seqs: int, reps: int = 2000) -> dict[str, float]:
    from engine.runner.parallel import free_port

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_collectives, args=(r, 2, init, hidden, seqs, reps, out)) for r in range(2)]
    for p in procs:
        p.start()
    result = out.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    return result


def measure_engine(model: str, tp: int, compile_: str, prompts: int, tokens: int, *flags: str) -> dict[str, float]:
    """Decode ``prompts`` greedy requests of ``tokens`` tokens, 4 at a time (after a warm-up): tokens/s,
    ms a step, and with a proposer (``flags``) the mean acceptance length and ms of ``propose`` a drafted
    token."""
    from engine.core.llm_engine import LLMEngine
    from engine.request.sampling_params import SamplingParams
    from server.cli import apply_config_file, build_parser, engine_config_from_args

    argv = ["serve", "--model", model, "--speculative-method", "none", "--compile", compile_, "-tp", str(tp)]
    argv += ["--max-num-seqs", "4", *flags]
    engine = LLMEngine(engine_config_from_args(apply_config_file(build_parser(), argv)))
    proposing = [0.0]
    if engine.proposer is not None:
        propose = engine.proposer.propose

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return propose(*args, **kwargs)
            finally:
                proposing[0] += time.perf_counter() - t0

        engine.proposer.propose = timed
    try:
        depth = 4 if engine.proposer is not None else None
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, num_draft_tokens=depth)
        for i in range(4):  # warm-up
            engine.add_request(f"w{i}", [5 + i, 6, 7, 8], params)
        while engine.has_unfinished_requests():
            engine.step()
        stats, proposing[0] = engine.spec_stats, 0.0
        drafts0, drafted0, accepted0 = stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens
        for i in range(prompts):
            engine.add_request(f"r{i}", [5 + i % 50, 6, 7, 8, 9, 10], params)
        steps, t0 = 0, time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        seconds = time.perf_counter() - t0
        out = {"tok/s": prompts * tokens / seconds, "ms a step": seconds / steps * 1e3}
        drafts, drafted = stats.num_drafts - drafts0, stats.num_draft_tokens - drafted0
        if drafts:
            out["mean acceptance length"] = 1 + (stats.num_accepted_tokens - accepted0) / drafts
            out["propose ms a drafted token"] = proposing[0] / drafted * 1e3
        return out
    finally:
        engine.close()


def draft_of(model: str, path: str, layers: int = 2) -> str:
    """A draft for ``model``: its first ``layers`` layers, with its embedding, final norm and head,
    saved as a Hugging Face directory at ``path`` (same tokenizer, same head counts: shardable alike)."""
    import torch
    import transformers

    target = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    config = transformers.AutoConfig.from_pretrained(model)
    config.num_hidden_layers = layers
    draft = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    draft.load_state_dict(target.state_dict(), strict=False)  # (the layers past `layers` are not the draft's)
    draft.save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(model).save_pretrained(path)
    return path


def random_llama(path: str) -> str:
    """The default model (see the module's text), saved as a Hugging Face directory at ``path``."""
    import torch
    import transformers

    from engine.assets import shipped_demo
    from engine.offline.demo import ensure_demo

    demo = shipped_demo() or ensure_demo()
    config = transformers.LlamaConfig(
        vocab_size=4096, hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(demo / "target").save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench_parallel", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="target model directory (default: the demo target)")
    ap.add_argument("-tp", "--tensor-parallel-size", type=int, default=2)
    ap.add_argument("--compile", default="off", choices=["on", "off"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args(argv)

    import tempfile

    from engine.runner.loader import load_config, resolve_model_path

    model = args.model or random_llama(tempfile.mkdtemp(prefix="augur-bench-tp-"))
    hidden = load_config(resolve_model_path(model)).hidden_size
    print("| sequences | message to the workers (µs) | all-reduce [sequences, hidden] (µs) |")
    print("| ---: | ---: | ---: |")
    for seqs in (1, 8):
        c = measure_collectives(hidden, seqs)
        print(f"| {seqs} | {c['message']:.1f} | {c['all_reduce']:.1f} |")
    print()
    print("| -tp | tok/s | ms a step |")
    print("| ---: | ---: | ---: |")
    n = args.tensor_parallel_size
    for tp in (1, n):
        r = measure_engine(model, tp, args.compile, args.prompts, args.tokens)
        print(f"| {tp} | {r['tok/s']:.1f} | {r['ms a step']:.3f} |")
    print()
    draft = draft_of(model, tempfile.mkdtemp(prefix="augur-bench-tp-draft-"))
    print("| -tp | draft | tok/s | ms a step | mean acceptance length | propose ms a drafted token |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for tp, dtp in ((1, 1), (n, 1), (n, n)):
        flags = ("--speculative-method", "draft", "--draft-model", draft, "--draft-tensor-parallel-size", str(dtp))
        r = measure_engine(model, tp, args.compile, args.prompts, args.tokens, *flags)
        where = "unsharded" if tp == 1 else ("unsharded on rank 0" if dtp == 1 else f"sharded over {dtp} ranks")
        accepted, cost = (
            r.get("mean acceptance length", float("nan")),
            r.get("propose ms a drafted token", float("nan")),
        )
        print(f"| {tp} | {where} | {r['tok/s']:.1f} | {r['ms a step']:.3f} | {accepted:.2f} | {cost:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
