"""Host time a compiled forward spends around its inductor graph: ``python -m loadtest.bench_call``.

Builds the engine compiled (the shipped demo pair by default; ``--model``/``--draft-model`` for
others), then times ``ModelRunner.execute`` of one decode forward (one sequence, ``--context``
cached tokens) of the target and of the draft, ``--calls`` times each, and inside it the inductor
graph's own call. Prints the median milliseconds of both, their difference (dynamo's frame
evaluation and guards, the AOT wrappers: what a compiled call costs around its graph) and how many
size arguments the graph takes (its Python wrapper turns each into a tensor on every call, ~2 µs
apiece on this CPU, inside the graph's time).

It reads the graph's call through ``torch._inductor.output_code.CompiledFxGraph``, an internal of
torch (2.11-2.13 here): a torch without it gets a clear error, not a figure.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass


@dataclass
class CallCost:
    execute_ms: float  # median of ModelRunner.execute
    graph_ms: float  # median of the inductor graph's own call within it
    overhead_ms: float  # median of their difference, call by call
    size_args: int  # symbolic sizes the graph is handed (each converted on every call)


def measure(runner, context: int = 200, calls: int = 2000) -> CallCost:
    """One decode forward of a compiled ``runner`` (one sequence of ``context`` cached tokens), timed."""
    try:
        from torch._inductor.output_code import CompiledFxGraph
    except ImportError as e:  # pragma: no cover - depends on the torch build
        raise SystemExit(f"this torch has no CompiledFxGraph to time ({e})") from e
    from engine.runner.model_runner import ForwardChunk

    if not runner.compiled:
        raise ValueError("the runner is not compiled: nothing to measure")
    table = list(range(context // runner.block_size + 2))
    runner.forward([ForwardChunk([5] * context, 0, table, 1)])
    batch = runner.prepare([ForwardChunk([7], context, table, 1)])
    last = {"s": 0.0, "sizes": -1}
    call = CompiledFxGraph.__call__

    def timed(self, inputs):
        last["sizes"] = sum(isinstance(x, int) for x in inputs)
        t0 = time.perf_counter()
        out = call(self, inputs)
        last["s"] = time.perf_counter() - t0
        return out

    CompiledFxGraph.__call__ = timed
    try:
        for _ in range(min(200, calls)):
            runner.execute(batch)
        total, graph = [], []
        for _ in range(calls):
            t0 = time.perf_counter()
            runner.execute(batch)
            total.append(time.perf_counter() - t0)
            graph.append(last["s"])
    finally:
        CompiledFxGraph.__call__ = call
    if last["sizes"] < 0:
        raise RuntimeError("the forward never reached a compiled graph (still served eagerly?)")
    over = [t - g for t, g in zip(total, graph)]
    ms = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    return CallCost(ms(total), ms(graph), ms(over), last["sizes"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench_call", description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--model", default=None, help="target model directory (default: the demo pair)")
    ap.add_argument("--draft-model", default=None)
    args = ap.parse_args(argv)

    from engine.core.llm_engine import LLMEngine
    from server.cli import apply_config_file, build_parser, engine_config_from_args

    serve = ["serve", "--compile-wait"]
    if args.model:
        serve += ["--model", args.model] + (["--draft-model", args.draft_model] if args.draft_model else [])
    engine = LLMEngine(engine_config_from_args(apply_config_file(build_parser(), serve)))
    runners = [("target", engine.runner)]
    draft = getattr(engine.proposer, "runner", None)
    if draft is not None and draft.compiled:
        runners.append(("draft", draft))
    print("| model | execute (ms) | graph (ms) | around the graph (ms) | size arguments |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, runner in runners:
        c = measure(runner, args.context, args.calls)
        print(f"| {name} | {c.execute_ms:.3f} | {c.graph_ms:.3f} | {c.overhead_ms:.3f} | {c.size_args} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
