"""JSON-schema generation with and without speculation, with and without jump-forward.

``python -m loadtest.bench_structured [--model DIR --draft DIR] [--requests N] [--json OUT]`` runs the
engine in process (no HTTP) on the demo pair by default, greedy, every request under one JSON schema
(an object with an enum, an integer, a boolean, a bounded string and a bounded array: the shape of a
tool call's arguments), at concurrency 1 and 8, in four configurations measured one after another in
the same run: plain decoding, plain + jump-forward, draft-model speculation, speculation +
jump-forward. It prints output tokens/s for each and the ratios against plain decoding, and checks on
the way that every configuration wrote the same tokens (exactness, not a speed claim).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from engine.assets import shipped_demo
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.request.sampling_params import SamplingParams
from engine.request.structured import StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "action": {"enum": ["search", "open", "close", "list"]},
        "path": {"type": "string", "maxLength": 24},
        "depth": {"type": "integer", "minimum": 0, "maximum": 9},
        "recursive": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["action", "path", "depth", "recursive", "tags"],
    "additionalProperties": False,
}
CONFIGS = {  # name: (speculative, jump-forward)
    "plain": (False, False),
    "plain+jump": (False, True),
    "spec": (True, False),
    "spec+jump": (True, True),
}


def run(eng: LLMEngine, prompts: list[str], concurrency: int, max_tokens: int) -> tuple[float, list[list[int]]]:
    """Output tokens/s over all prompts, ``concurrency`` at a time, and each prompt's tokens."""
    so = StructuredOutput.json_schema(SCHEMA, "response_format")
    outs: list[list[int]] = []
    tokens, t0 = 0, time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        batch = prompts[i : i + concurrency]
        res = eng.generate(batch, SamplingParams(temperature=0.0, max_tokens=max_tokens, structured=so))
        for r in res:
            outs.append(r.outputs[0].delta_token_ids)
            tokens += len(outs[-1])
    return tokens / (time.perf_counter() - t0), outs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    demo = shipped_demo()
    ap.add_argument("--model", default=str(demo / "target"))
    ap.add_argument("--draft", default=str(demo / "draft"))
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--compile", default="off", help="engine compile setting (on: minutes of warm-up per config)")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args(argv)

    prompts = [json.loads(line)["prompt"] for line in open(demo / "prompts.jsonl")][: args.requests]
    prompts = [f"{p}\n# the call, as JSON:\n" for p in prompts]
    results: dict[str, dict[int, float]] = {}
    reference: dict[int, list[list[int]]] = {}
    for name, (spec, jump) in CONFIGS.items():
        kw = {"draft_model": args.draft} if spec else {}
        eng = LLMEngine(EngineConfig(model=args.model, compile=args.compile, grammar_jump_forward=jump, **kw))
        run(eng, prompts[:2], 2, 16)  # warm-up
        results[name] = {}
        for c in (1, 8):
            rate, outs = run(eng, prompts, c, args.max_tokens)
            results[name][c] = rate
            if reference.setdefault(c, outs) != outs:
                raise SystemExit(f"{name} at c={c} wrote other tokens than {next(iter(CONFIGS))}: not exact")
        del eng

    print(f"JSON-schema generation, greedy, {args.requests} requests, torch threads {torch.get_num_threads()}")
    print("| config | c=1 tok/s | vs plain | c=8 tok/s | vs plain |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        base = results["plain"]
        print(f"| {name} | {r[1]:.1f} | {r[1] / base[1]:.2f}x | {r[8]:.1f} | {r[8] / base[8]:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
