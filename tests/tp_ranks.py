"""Ranks of a sharded model in processes of their own, for tests/test_tensor_parallel.py: each joins a
gloo group and returns rank 0's logits (or its parameter bytes). A module of its own, light to import:
the ranks fork from multiprocessing's fork server, which imports it once."""

from __future__ import annotations

import multiprocessing
import traceback

import torch

from engine.runner.loader import load_config, load_model
from engine.runner.model_runner import ForwardChunk, ModelRunner
from engine.runner.parallel import WORKER_PRELOAD, free_port


def _chunks() -> list[list[ForwardChunk]]:
    """Two forwards: a prefill of two sequences, then a decode of both and a 3-token chunk."""
    a, b = list(range(3, 40)), [7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27]
    return [
        [ForwardChunk(a, 0, [0, 1, 2], len(a)), ForwardChunk(b, 0, [3], len(b))],
        [ForwardChunk([41], len(a), [0, 1, 2], 1), ForwardChunk([29, 31, 33], len(b), [3, 4], 3)],
    ]


def model_logits(model_dir, tp=None, quantization=None) -> list[torch.Tensor]:
    from engine.parallel import SINGLE
    from engine.speculative.methods.eagle import load_eagle
    from engine.speculative.methods.medusa import load_medusa

    tp, cpu = tp or SINGLE, torch.device("cpu")
    if isinstance(model_dir, tuple):  # (kind, a drafter's directory, its target's): the drafter's logits
        kind, drafter_dir, target_dir = model_dir
        config = load_config(target_dir)
        seed = torch.Generator().manual_seed(3)
        if kind == "medusa":  # over fixed states
            heads = load_medusa(drafter_dir, config.hidden_size, config.vocab_size, torch.float32, cpu, tp)
            return [heads(torch.randn(5, config.hidden_size, generator=seed))]
        # An EAGLE head over the chunks with fixed features, embedding with the (sharded) target's table.
        target = load_model(target_dir, config, torch.float32, cpu, 256, pack=False, tp=tp)
        head, _ = load_eagle(drafter_dir, config, target.embed, torch.float32, cpu, 256, tp)
        runner = ModelRunner(head, head.config, cpu, torch.float32, 16, num_blocks=8)
        out = []
        for chunks in _chunks():
            feats = torch.randn(sum(len(c.token_ids) for c in chunks), config.hidden_size, generator=seed)
            out.append(runner.execute(runner.prepare(chunks), hidden_in=feats).logits)
        return out
    config = load_config(model_dir)
    cpu = torch.device("cpu")
    model = load_model(model_dir, config, torch.float32, cpu, 256, pack=False, quantization=quantization, tp=tp)
    runner = ModelRunner(model, config, torch.device("cpu"), torch.float32, 16, num_blocks=8)
    return [runner.forward(chunks).logits for chunks in _chunks()]


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _rank_main(rank: int, size: int, init: str, dirs: list, results, weights: bool = False, quant=None) -> None:
    try:
        from engine.parallel import join

        torch.set_num_threads(1)
        tp = join(rank, size, init, torch.device("cpu"), 120.0)
        if weights:  # this rank's parameter bytes, loaded as the engine loads them
            out = [
                weight_bytes(load_model(d, load_config(d), torch.float32, torch.device("cpu"), 64, tp=tp)) for d in dirs
            ]
        else:  # (arrays, by value: a tensor would pass a file descriptor the process takes with it)
            out = [[t.numpy() for t in model_logits(d, tp, quant)] for d in dirs]
        if rank == 0:
            results.put(("ok", out))
        torch.distributed.destroy_process_group()
    except BaseException:
        results.put(("error", f"rank {rank}: {traceback.format_exc()}"))


def sharded_logits(dirs: list, size: int, weights: bool = False, quantization=None) -> list:
    """Rank 0's logits (or with ``weights`` its parameter bytes), every rank a process of its own
    joined over gloo."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([*WORKER_PRELOAD, __name__])  # (the engine's, where it started the server first)
    results = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    args = (size, init, dirs, results, weights, quantization)
    procs = [ctx.Process(target=_rank_main, args=(r, *args)) for r in range(size)]
    for p in procs:
        p.start()
    try:
        kind, payload = results.get(timeout=300)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    assert kind == "ok", payload
    return payload if weights else [[torch.from_numpy(a) for a in per_model] for per_model in payload]
