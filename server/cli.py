"""The ``augur`` command line: ``serve``, ``generate``, ``bench``, ``tune-layer-skip``, ``train-draft``, ``demo``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from pathlib import Path

from engine.attention import BACKENDS as ATTENTION_BACKENDS
from engine.attention.kv_dtype import KV_CACHE_DTYPES
from engine.config import PREFIX_CACHE_SCOPES, EngineConfig
from engine.quant import QUANTIZATIONS
from engine.speculative.methods import known_methods
from server.metrics import COMPAT
from server.reasoning import FIELDS as REASONING_FIELDS
from server.reasoning import SYNTAXES as REASONING_SYNTAXES


def add_engine_args(p: argparse.ArgumentParser, engine_seed: bool = True) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="local Hugging Face directory or a hub id in the local cache (default: the embedded demo target)",
    )
    g.add_argument("--tokenizer", default=None, help="tokenizer directory or hub id (default: the model's)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument(
        "--quantization",
        default=None,
        choices=list(QUANTIZATIONS),
        help="quantize the linear layers at load, LM head kept (nf4: 4-bit NormalFloat, dequantized per call; "
        "int4: grouped 4-bit on PyTorch's int4 kernels; on a 4-bit GPTQ/AWQ/compressed-tensors checkpoint, its own "
        "groups; fp8: e4m3 weights and per-token activations on torch._scaled_mm, an FP8 checkpoint's own weights); "
        "checkpoints saved quantized (GPTQ, AWQ, compressed-tensors, FP8, bitsandbytes NF4) load without "
        "it, dequantized (docs/quantization.md)",
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        type=_lora_module,
        metavar="NAME=PATH",
        help="LoRA adapters in PEFT's format (adapter_config.json + adapter_model.safetensors) served over the "
        "model: a request picks one by its model field; /v1/models lists them (docs/lora.md)",
    )
    g.add_argument(
        "--enable-runtime-lora",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key)",
    )
    g.add_argument(
        "--max-loras",
        type=int,
        default=4,
        help="LoRA adapters in a slot at once (one forward serves them all; more may be loaded: the least "
        "recently used idle one gives up its slot)",
    )
    g.add_argument("--max-lora-rank", type=int, default=16, help="the largest LoRA rank served (slots are sized by it)")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (overrides the fraction)")
    g.add_argument(
        "--kv-cache-memory-fraction",
        type=float,
        default=0.85,
        help="fraction of free GPU memory (or available RAM on CPU) for the KV pool",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPES),
        help="what the KV cache stores: auto (the model's dtype) | fp8 (8-bit floats, e4m3, with the checkpoint's "
        "K/V scales or 1.0: twice the tokens in the same memory; docs/quantization.md)",
    )
    g.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument(
        "--prefix-cache-scope",
        default="shared",
        choices=list(PREFIX_CACHE_SCOPES),
        help="whose requests share cached prompt KV: shared (all; a request's cache_salt narrows it) | api-key "
        "(only requests under the same --api-key: no key can probe another's prompts through its cache hits)",
    )
    g.add_argument(
        "--compile",
        default="auto",
        choices=["auto", "on", "off"],
        help="torch.compile the forwards (auto: $AUGUR_COMPILE, else on for CPU; augur generate: off unless asked). "
        "augur serve answers eagerly at once and swaps the compiled forwards in when ready (see --compile-wait)",
    )
    g.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", *ATTENTION_BACKENDS],
        help="paged attention kernels (auto: triton on CUDA where Triton imports, else sdpa, the CPU reference)",
    )
    g.add_argument(
        "--batch-invariant",
        default="auto",
        choices=["auto", "on", "off"],
        help="a request's tokens depend on nothing but the request (not its batch, the step budget, speculation, "
        "the prefix cache, compiled or eager forwards): the target on operators whose every output has one order "
        "of operations whatever the rows, attention on one path (auto: on for CPUs, float32 or bfloat16; off on "
        "GPUs, where on runs Triton kernels, one GPU, full-precision weights; docs/speculative.md)",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="GPU: run every forward eagerly instead of replaying captured CUDA graphs for decode and verify",
    )
    g.add_argument(
        "--async-scheduling",
        nargs="?",
        const="on",
        default="auto",
        choices=["auto", "on", "off"],
        help="run-ahead decoding: launch each forward before reading the last one's tokens, overlapping output "
        "processing with the device (exact; plain decoding, and speculative engines while they draft nothing, "
        "EAGLE/Medusa/MTP excepted; one rank; auto: on for CPUs; alone: on)",
    )
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="shard the target over N ranks, one process each, started here (gloo on CPU; NCCL over cuda:0..N-1); "
        "heads and lookups run on rank 0",
    )
    g.add_argument(
        "--draft-tensor-parallel-size",
        "-dtp",
        type=int,
        default=1,
        help="a draft model's, Medusa heads' or an EAGLE head's ranks under -tp: 1 (unsharded on rank 0, "
        "no collectives) or N (sharded like the target)",
    )
    g.add_argument("--nnodes", type=int, default=1, help="hosts the tensor-parallel ranks span (an even share each)")
    g.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this host's index: 0 runs rank 0 and serves HTTP; the others run headless workers",
    )
    g.add_argument("--master-addr", default="127.0.0.1", help="host 0's address, where the ranks meet")
    g.add_argument("--master-port", type=int, default=0, help="the port there (0: a free one, one host only)")
    g.add_argument(
        "--tp-timeout",
        dest="tp_timeout_s",
        type=float,
        default=600.0,
        help="seconds a tensor-parallel collective or join may take before the server ends",
    )
    sp = p.add_argument_group("speculative decoding")
    sp.add_argument(
        "--speculative-method",
        default="auto",
        choices=["none", *known_methods()],
        help="auto (default): several proposers at once, the lookups (suffix, ngram) and whatever --draft-model "
        "is, each request drafted step by step by the one that pays for it (or none); "
        "draft: a separate draft model; ouroboros: the draft model drafting by pooled phrases; "
        "ngram: prompt lookup; suffix: suffix-tree trees; "
        "lookahead: Jacobi window and n-gram pool, no draft model; "
        "layer-skip: the target with sublayers skipped; medusa, eagle, mtp: heads on the target's hidden states "
        "(--draft-model DIR); dflash: a block drafter (--draft-model DIR); nextn: the checkpoint's own "
        "multi-token-prediction layer (GLM-4.5's, DeepSeek-V3's); none: plain decoding",
    )
    sp.add_argument(
        "--draft-model",
        default=None,
        help="draft model directory or cached hub id (same tokenizer), or a directory of Medusa heads",
    )
    sp.add_argument("--num-speculative-tokens", type=int, default=4, help="most draft positions per request and step")
    sp.add_argument(
        "--spec-tree-topk", type=int, default=None, help="children per tree node; 1 = chains (default: 1 CPU, 2 GPU)"
    )
    sp.add_argument("--spec-tree-budget", type=int, default=12, help="most draft-tree nodes per request and step")
    sp.add_argument("--ngram-min", type=int, default=1, help="ngram: shortest suffix to look up")
    sp.add_argument("--ngram-max", type=int, default=4, help="ngram: longest suffix to look up (tried first)")
    sp.add_argument("--suffix-order", type=int, default=8, help="suffix: longest context counted")
    sp.add_argument(
        "--lookahead-window", type=int, default=None, help="lookahead: the Jacobi window's width W (2 CPU, 4 GPU)"
    )
    sp.add_argument("--lookahead-ngram", type=int, default=4, help="lookahead: n-gram size N (N-1 levels)")
    sp.add_argument(
        "--lookahead-guesses", type=int, default=None, help="lookahead: most n-grams G verified a step (2 CPU, 4 GPU)"
    )
    sp.add_argument(
        "--lookahead-shared",
        action="store_true",
        help="lookahead: one n-gram pool per prompt family (prompts sharing their first 16 tokens)",
    )
    sp.add_argument(
        "--ouroboros-phrase", type=int, default=4, help="ouroboros: the longest pooled phrase tried a draft forward"
    )
    sp.add_argument(
        "--ouroboros-branches",
        type=int,
        default=None,
        help="ouroboros: most rejected phrase tails verified beside the draft (1 CPU, 3 GPU)",
    )
    sp.add_argument(
        "--layer-skip-config", default=None, help="layer-skip: JSON of skipped sublayers (default: the middle half)"
    )
    sp.add_argument(
        "--spec-early-stop",
        type=float,
        default=None,
        metavar="RATE",
        help="draft-model and layer-skip drafts stop where the drafter's confidence falls below a threshold "
        "adapted to accept this fraction of drafted tokens; 0 = off (default: 0.7 layer-skip, off draft)",
    )
    sp.add_argument(
        "--suffix-cache-tokens", type=int, default=100_000, help="suffix: tokens of finished outputs to draft from"
    )
    so = p.add_argument_group("structured outputs")
    so.add_argument(
        "--no-grammar-jump-forward",
        dest="grammar_jump_forward",
        action="store_false",
        help="feed every token a grammar forces through a forward (default: emit it at once; exact either way)",
    )
    so.add_argument("--grammar-cache-size", type=int, default=256, help="compiled grammars kept, by spec (LRU)")
    if engine_seed:  # `generate` uses --seed for its one request instead
        g.add_argument("--seed", type=int, default=0, help="engine seed for unseeded sampling")


def _lora_module(text: str) -> str:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules takes NAME=PATH, got {text!r}")
    return text


def engine_argv(args: argparse.Namespace, skip: tuple[str, ...] = ()) -> list[str]:
    """The inverse of :func:`add_engine_args`: the engine flags of ``args`` that differ from their
    defaults, as ``augur serve`` arguments (learnt from a scratch parser, so a new engine flag is passed
    on without a change here). ``augur bench --suite`` starts its server with them."""
    scratch = argparse.ArgumentParser(add_help=False)
    add_engine_args(scratch)
    argv: list[str] = []
    for action in scratch._actions:
        if not action.option_strings or action.dest in skip or not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        flag = max(action.option_strings, key=len)
        if action.nargs == 0:  # store_true / store_false: differing from the default means given
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the flags; no --model means the shipped demo pair (engine/assets/demo)."""
    fields = EngineConfig.field_names()
    values = {k: v for k, v in vars(args).items() if k in fields}
    modules = values.pop("lora_modules", None) or []
    values["lora_modules"] = dict(m.split("=", 1) for m in modules)
    if len(values["lora_modules"]) < len(modules):
        raise SystemExit("augur: error: --lora-modules names an adapter twice")
    if not values.get("model"):
        from engine.assets import shipped_demo

        demo = shipped_demo()
        if demo is None:  # a checkout without the shipped pair: build it from the recipe
            from engine.offline.demo import ensure_demo

            demo = ensure_demo()
        values["model"] = str(demo / "target")
        # The demo pair speculates with its own draft by default.
        if values.get("speculative_method") in (None, "auto", "draft", "ouroboros") and not values.get("draft_model"):
            values["draft_model"] = str(demo / "draft")
    return EngineConfig(**values)


def cmd_generate(args: argparse.Namespace) -> int:
    import dataclasses
    import os

    from engine.core.llm_engine import LLMEngine
    from engine.request.sampling_params import SamplingParams

    config = engine_config_from_args(args)
    if args.compile == "auto" and not os.environ.get("AUGUR_COMPILE"):  # one prompt: not worth a compile
        config = dataclasses.replace(config, compile="off")
    engine = LLMEngine(config)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        max_tokens=args.max_tokens,
        seed=args.seed_request,
        stop=args.stop or [],
        ignore_eos=args.ignore_eos,
        repetition_penalty=args.repetition_penalty,
    )
    out = engine.generate([args.prompt], params)[0]
    sys.stdout.write(out.outputs[0].text)
    if not out.outputs[0].text.endswith("\n"):
        sys.stdout.write("\n")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    import uvicorn

    from engine.core.async_engine import AsyncEngine
    from engine.core.llm_engine import LLMEngine
    from server.app import ServerSettings, create_app
    from server.limits import uvicorn_config

    demo = not args.model
    _torchrun_ranks(args)
    config = engine_config_from_args(args)  # builds the demo pair first when no model is given
    if config.node_rank > 0:  # a host of workers only: rank 0's host serves
        from engine.runner.parallel import ranks_here, serve_headless

        here = ranks_here(config)
        print(
            f"Augur tensor-parallel ranks {here.start}..{here.stop - 1} of {config.tensor_parallel_size}, "
            f"joining {config.master_addr}:{config.master_port}",
            file=sys.stderr,
        )
        return serve_headless(config)
    name = args.served_model_name or ("augur-demo" if demo else os.path.basename(os.path.normpath(config.model)))
    if name in config.lora_modules:
        raise SystemExit(f"augur: error: the LoRA adapter {name!r} has the served model's name; rename one")
    # Several keys: --api-key given more than once, or AUGUR_API_KEY with commas between them.
    env_keys = os.environ.get("AUGUR_API_KEY") or ""
    api_key = args.api_key or [k.strip() for k in env_keys.split(",") if k.strip()]
    if config.prefix_cache_scope == "api-key" and not api_key:
        raise SystemExit("augur: error: --prefix-cache-scope api-key scopes the cache by API key: give --api-key")
    from server.protocol import check_template_kwargs

    check_template_kwargs(args.default_chat_template_kwargs, "--default-chat-template-kwargs")
    settings = ServerSettings(
        served_model_name=name,
        api_key=api_key,
        max_queue_len=args.max_queue_len,
        max_request_bytes=args.max_request_bytes,
        body_timeout_s=args.body_timeout,
        typical_acceptance=tuple(args.typical_acceptance) if args.typical_acceptance else None,
        tool_call_parser=args.tool_call_parser,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        metrics_compat=args.metrics_compat,
        responses_store_max=args.responses_store_max,
        responses_store_bytes=int(args.responses_store_mb * 2**20),
        chat_template=args.chat_template,
        default_chat_template_kwargs=args.default_chat_template_kwargs,
        reasoning_parser=args.reasoning_parser,
        reasoning_fields=REASONING_FIELDS[args.reasoning_field],
        lora_modules=dict(config.lora_modules),
        enable_runtime_lora=config.enable_runtime_lora,
        playground=args.playground,
        generation_config=args.generation_config,
    )
    server: uvicorn.Server | None = None

    def give_up(reason: str) -> None:  # the engine cannot load: stop serving, exit non-zero (below)
        if server is not None:
            server.should_exit = True

    own_process = args.engine_process == "on" or (args.engine_process == "auto" and config.torch_device.type == "cpu")

    def build_engine():
        if own_process:
            from engine.core.engine_core import ProcessEngine

            return ProcessEngine(config)
        return AsyncEngine(LLMEngine(config))

    app = create_app(settings, build_engine, on_load_failure=give_up)
    print(f"Augur serving {name!r} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    server_config = uvicorn_config(
        app,
        args.host,
        args.port,
        args.log_level.lower(),
        header_timeout_s=args.header_timeout,
        timeout_keep_alive_s=args.timeout_keep_alive,
        limit_concurrency=args.limit_concurrency or None,
    )
    server = uvicorn.Server(server_config)
    died: list[str] = []
    if config.tensor_parallel_size > 1:  # a rank lost ends the server (the others cannot go on without it)
        threading.Thread(target=_end_when_dead, args=(app.state.augur, server, died), daemon=True).start()
    server.run()
    error = app.state.augur.load_error
    if error is not None:
        print(f"augur: error: the engine failed to load: {error}", file=sys.stderr)
        return 1
    if died:
        print(f"augur: error: the engine died: {died[0]}", file=sys.stderr)
        return 1
    return 0


def _torchrun_ranks(args: argparse.Namespace) -> None:
    """Started by torchrun (``torchrun --nproc-per-node N ... -m server.launch serve``): each process
    is one rank of a group of WORLD_SIZE, meeting in torchrun's own store; rank 0 serves."""
    import os

    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    args.tensor_parallel_size, args.nnodes, args.node_rank = world, world, rank
    args.master_addr, args.master_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    args.first_gpu = int(os.environ.get("LOCAL_RANK", 0))


def _end_when_dead(state, server, died: list[str]) -> None:
    """Stop ``server`` once its engine is dead (a tensor-parallel rank exited: its front, /health,
    says so first), noting why in ``died``."""
    while not server.should_exit:
        engine = state.engine
        reason = getattr(engine, "dead_error", None) if engine is not None else None
        if reason is not None:
            died.append(reason)
            server.should_exit = True
            return
        time.sleep(0.2)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.suite is not None:  # measures servers over HTTP: no engine in this process
        from loadtest.suite_bench import run_suite

        return run_suite(args, engine_argv(args), engine_argv(args, skip=("model", "seed")))
    if args.servers:
        raise ValueError("--url and --server measure the prompt suite: add --suite")
    if args.num_prompts is None:
        args.num_prompts = 16
    config = engine_config_from_args(args)
    if args.speculative:
        from loadtest.bench_speculative import run_spec_bench

        return run_spec_bench(config, args)
    if args.methods:
        from loadtest.bench_methods import run_methods_bench

        return run_methods_bench(config, args)
    from loadtest.bench import run_bench

    return run_bench(config, args)


def cmd_tune_layer_skip(args: argparse.Namespace) -> int:
    import dataclasses

    from engine.offline.measure import demo_prompts
    from engine.offline.tune_layer_skip import tune_layer_skip, write_result
    from engine.runner.loader import load_tokenizer, resolve_model_path
    from loadtest.prompts import load_prompts

    config = engine_config_from_args(args)
    if args.compile == "auto":  # each skip set would compile its own graph: tune eagerly
        config = dataclasses.replace(config, compile="off")
    tokenizer = load_tokenizer(resolve_model_path(config.tokenizer or config.model))
    if args.prompts:
        prompts = [_prompt_ids(tokenizer, p) for p in load_prompts(args.prompts)][: args.num_prompts]
    else:
        prompts = demo_prompts(tokenizer, resolve_model_path(config.model), args.num_prompts)
        if prompts is None:
            raise ValueError("--prompts FILE is needed for a model other than the demo target")
    result = tune_layer_skip(
        config,
        prompts,
        trials=args.trials,
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        temperature=args.temperature,
        seed=args.tune_seed,
    )
    out = write_result(result, args.output, config.model)
    best = result.best
    print(
        f"best: skip attention {sorted(best.skip.attn)}, mlp {sorted(best.skip.mlp)}: "
        f"{best.tokens_per_s:.1f} tok/s vs plain {result.plain_tokens_per_s:.1f} "
        f"({best.tokens_per_s / result.plain_tokens_per_s:.2f}x), "
        f"{best.mean_acceptance_length:.2f} tokens per verify step"
    )
    print(f"wrote {out}: serve it with --speculative-method layer-skip --layer-skip-config {out}")
    return 0


def _prompt_ids(tokenizer, prompt) -> list[int]:
    """A prompt set's entry as token ids: a conversation through the chat template when there is one."""
    if prompt.messages is not None and getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(prompt.as_messages(), add_generation_prompt=True, tokenize=True))
    return tokenizer.encode(prompt.as_text())


def cmd_train_draft(args: argparse.Namespace) -> int:
    import dataclasses
    from pathlib import Path

    from engine.offline.train_draft import TrainConfig, train_draft

    demo = not args.model
    config = engine_config_from_args(args)
    if args.data:
        from loadtest.prompts import load_prompts

        prompts = [p.as_text() for p in load_prompts(args.data)][: args.num_prompts]
    elif demo:
        from engine.offline.demo import DemoRecipe, make_prompts, split_corpus

        recipe = dataclasses.replace(DemoRecipe(), num_prompts=args.num_prompts)
        prompts = [p["prompt"] for p in make_prompts(split_corpus(recipe)[0], recipe)]  # train files only
    else:
        raise ValueError("--data FILE (a .jsonl prompt file) is needed for a model other than the demo target")
    if args.output:
        out = Path(args.output)
    elif demo:
        out = Path(config.model).parent / args.method
    else:
        raise ValueError("--output DIR is needed for a model other than the demo target")
    cfg = TrainConfig(
        method=args.method,
        num_heads=args.num_heads,
        num_layers=args.num_layers or (2 if args.method == "dflash" else 1),
        gen_tokens=args.gen_tokens,
        steps=args.steps,
        batch_size=args.batch_size or (512 if args.method in ("eagle", "dflash") else 256),
        lr=args.lr,
        unroll=args.unroll,
        head_decay=args.head_decay if args.head_decay is not None else (0.3 if args.method == "dflash" else 0.8),
        draft_vocab=args.draft_vocab,
        block_size=args.dflash_block,
        anchors=args.dflash_anchors,
    )
    report = train_draft(config, out, prompts, cfg, resume=args.resume)
    before, after = report["heldout_before"], report["heldout_after"]
    for k, (kb, ka, ab, aa) in enumerate(
        zip(before["kl"], after["kl"], before["top1_agreement"], after["top1_agreement"])
    ):
        print(f"depth {k + 1}: held-out KL to the target {kb:.3f} -> {ka:.3f}, top-1 agreement {ab:.2f} -> {aa:.2f}")
    print(f"wrote {out}: serve it with --draft-model {out}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    import json

    from engine.offline.demo import DemoRecipe, build_demo, check_build, demo_dir, ensure_demo, format_report

    if args.demo_command == "path":
        print(ensure_demo())
        return 0
    if args.check:
        from engine.assets import shipped_demo

        reference = Path(args.reference) if args.reference else shipped_demo()
        if reference is None:
            raise ValueError("no shipped demo pair to check against: name one with --reference DIR")
        out, misses, notes = check_build(reference, device=args.device, force=args.force)
        print(format_report(json.loads((out / "report.json").read_text())))
        for note in notes:
            print(f"note: {note}")
        for miss in misses:
            print(f"MISMATCH {miss}")
        verdict = "does not match" if misses else "matches"
        print(f"{out}: the rebuild {verdict} {reference}")
        return 1 if misses else 0
    recipe = DemoRecipe.tiny() if args.tiny else DemoRecipe()
    out = build_demo(demo_dir(), recipe, device=args.device, force=args.force)
    print(format_report(json.loads((out / "report.json").read_text())))
    print(out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="augur", description="Augur: LLM inference with lossless speculative decoding"
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default="WARNING", help="logging level (logs go to stderr)")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub, common)
    _generate_parser(sub, common)
    _bench_parser(sub, common)
    _tune_layer_skip_parser(sub, common)
    _train_draft_parser(sub, common)
    _demo_parser(sub, common)
    return parser


def _serve_parser(sub, common: argparse.ArgumentParser) -> None:
    """``augur serve``: the engine flags and the HTTP server's."""
    serve = sub.add_parser("serve", parents=[common], help="the OpenAI-compatible HTTP server")
    add_engine_args(serve)
    serve.add_argument(
        "--compile-wait",
        dest="compile_background",
        action="store_false",
        help="compile the forwards before answering anything (default: answer at once with the eager forwards, "
        "compile in the background, swap the compiled ones in between two steps)",
    )
    serve.add_argument(
        "--engine-process",
        choices=["auto", "on", "off"],
        default="auto",
        help="on: the engine steps in a process of its own, the API process tokenizes, streams and serves HTTP "
        "(engine/core/engine_core.py); off: on a thread of the API process; auto: on for an engine on a CPU "
        "(measured faster there), off on a GPU (not measured yet)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require this bearer key (repeat for several; or AUGUR_API_KEY, comma-separated)",
    )
    serve.add_argument("--responses-store-max", type=int, default=1024,
                       help="Responses API: the most stored responses kept (oldest out first)")  # fmt: skip
    serve.add_argument("--responses-store-mb", type=float, default=128,
                       help="Responses API: the most MiB of stored responses kept (oldest out first)")  # fmt: skip
    serve.add_argument("--served-model-name", default=None, help="default: augur-demo, or the model directory's name")
    serve.add_argument(
        "--no-playground",
        dest="playground",
        action="store_false",
        help="do not serve the playground page (/playground, and / pointing to it)",
    )
    serve.add_argument("--max-queue-len", type=int, default=256, help="requests waiting beyond this get 429")
    serve.add_argument(
        "--max-request-bytes", type=int, default=16 * 2**20, help="larger request bodies get 413 (default 16 MiB)"
    )
    serve.add_argument("--body-timeout", type=float, default=30.0, help="seconds to receive a request body (else 408)")
    serve.add_argument(
        "--header-timeout", type=float, default=10.0, help="seconds to receive a request's headers (else closed)"
    )
    serve.add_argument("--timeout-keep-alive", type=float, default=5.0, help="seconds an idle connection stays open")
    serve.add_argument(
        "--limit-concurrency", type=int, default=1024, help="most open connections; beyond, 503 (0: no limit)"
    )
    serve.add_argument(
        "--typical-acceptance",
        type=float,
        nargs=2,
        default=None,
        metavar=("EPSILON", "DELTA"),
        help="LOSSY: verify unseeded sampling requests by Medusa's typical acceptance (e.g. 0.09 0.3) unless they "
        "opt out; output is then not exactly the target's distribution (usage and metrics say so)",
    )
    serve.add_argument(
        "--metrics-compat",
        choices=COMPAT,
        default="vllm",
        help="also export /metrics under vLLM's names (vllm:*), which Kubernetes LLM routers and vLLM "
        "dashboards read (default); none: only augur_*",
    )
    serve.add_argument(
        "--tool-call-parser",
        choices=[
            "auto",
            "hermes",
            "llama3_json",
            "mistral",
            "qwen3_coder",
            "seed_oss",
            "glm45",
            "glm47",
            "minimax_m2",
            "pythonic",
            "phi4_mini_json",
            "granite",
            "deepseek_v3",
            "deepseek_v31",
            "kimi_k2",
            "gemma4",
            "harmony",
        ],
        default="auto",
        help="how the model writes tool calls (auto: from its chat template; Hermes-style where it says nothing; "
        "mistral: [TOOL_CALLS]NAME[ARGS]{...} or the JSON list after [TOOL_CALLS], as the template writes them; "
        "qwen3_coder: Qwen3-Coder's and Qwen3.5's <function=NAME><parameter=KEY> XML; "
        "seed_oss: Seed-OSS's, the same in <seed:tool_call>; "
        "glm45 / glm47: GLM-4.5's and 4.6's <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>, a "
        "line each, and GLM-4.7's without line ends; "
        'minimax_m2: MiniMax-M2\'s <invoke name="NAME"><parameter name="KEY"> elements in one <minimax:tool_call>; '
        "pythonic: a Python list of calls, [f(a=1), g(b='x')] (Llama 3.2/4's, Gemma 3's with vLLM's templates); "
        "phi4_mini_json: Phi-4-mini's functools[{...}, ...]; granite: Granite 3's <|tool_call|>[{...}, ...]; "
        "deepseek_v3 / deepseek_v31: DeepSeek-V3's and R1's <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME and a "
        "fenced JSON block, V3.1's <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}; "
        "kimi_k2: Kimi K2's <|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{...}<|tool_call_end|>; "
        'gemma4: Gemma 4\'s <|tool_call>call:NAME{key:<|"|>text<|"|>,n:1}<tool_call|>; '
        "harmony: gpt-oss's messages to functions.NAME)",
    )
    serve.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help="leave a request's tools out of the prompt under tool_choice none (by default the model sees them and "
        "calls none, as vLLM serves it, and the prompt's prefix stays the one the conversation cached)",
    )
    serve.add_argument(
        "--chat-template",
        type=_chat_template,
        default=None,
        help="chat template to serve instead of the tokenizer's: a file, or the Jinja text itself",
    )
    serve.add_argument(
        "--default-chat-template-kwargs",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="chat template variables for every request, e.g. '{\"enable_thinking\": false}' (a request's own "
        "chat_template_kwargs win)",
    )
    serve.add_argument(
        "--reasoning-parser",
        choices=list(REASONING_SYNTAXES),
        default=None,
        help="split a reasoning model's thinking into reasoning_content (qwen3: Qwen3/QwQ <think>; glm45: GLM-4.5 "
        "to 4.7's <think>, as qwen3; minimax_m2 / kimi_k2: MiniMax-M2's and Kimi's <think>, as qwen3; seed_oss: "
        "Seed-OSS's <seed:think>, which it opens itself; deepseek_r1: "
        "DeepSeek-R1, which thinks first; mistral: Magistral's and Ministral 3's [THINK]; gemma4: Gemma 4's "
        "<|channel>thought ... <channel|>; harmony: gpt-oss's "
        "analysis channel); enables reasoning_effort and "
        "thinking_token_budget (not with harmony)",
    )
    serve.add_argument(
        "--reasoning-field",
        choices=list(REASONING_FIELDS),
        default="both",
        help="the chat fields the thinking comes back in, streamed and not: both (reasoning_content, DeepSeek's "
        "and SGLang's name, and reasoning, vLLM's since late 2025 and its only one since 2026), or one of "
        "them (openai-agents' streamed reasoning item reads both, as two copies of the text: serve it one)",
    )
    serve.add_argument(
        "--generation-config",
        choices=["auto", "none"],
        default="auto",
        help="auto: requests' missing sampling fields (temperature, top_p, top_k, min_p, repetition_penalty, "
        "max tokens) come from the model's generation_config.json; none: OpenAI's defaults",
    )
    serve.add_argument("--config", default=None, help="YAML file of flags (the command line overrides it)")
    serve.set_defaults(func=cmd_serve)


def _generate_parser(sub, common: argparse.ArgumentParser) -> None:
    """``augur generate``: one prompt, its completion printed."""
    gen = sub.add_parser("generate", parents=[common], help="complete one prompt and print only the completion")
    add_engine_args(gen, engine_seed=False)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--seed", dest="seed_request", type=int, default=None, help="sampling seed of the request")
    gen.set_defaults(func=cmd_generate)


def _bench_parser(sub, common: argparse.ArgumentParser) -> None:
    """``augur bench``: in-process benchmarks, and the prompt suite over HTTP (``--suite``)."""
    bench = sub.add_parser(
        "bench",
        parents=[common],
        help="tokens/s against Hugging Face transformers generate, same run; --suite: per task category, "
        "speculative vs plain, or any OpenAI-compatible servers (--url)",
    )
    add_engine_args(bench)
    bench.add_argument(
        "--num-prompts", type=int, default=None, help="default 16; with --suite: prompts per category (default: all)"
    )
    bench.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    bench.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=None,
        help="default: 1 16 (plain), 1 8 32 (--speculative), 1 (--suite)",
    )
    bench.add_argument("--prompt-lens", type=int, nargs=2, default=[8, 128], metavar=("MIN", "MAX"))
    bench.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    bench.add_argument(
        "--speculative",
        action="store_true",
        help="plain vs chain vs tree speculation (needs a draft; the demo pair has one)",
    )
    bench.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="with --speculative")
    bench.add_argument(
        "--dtypes", nargs="+", default=None, help="with --speculative: dtypes to measure (default: float32 bfloat16)"
    )
    bench.add_argument(
        "--fresh-runs", type=int, default=5, help="with --speculative: fresh engines whose acceptance lengths compare"
    )
    bench.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="with --speculative: rounds per cell, interleaved (plain, trees, chains, ...); with --async-scheduling: "
        "rounds of ordinary and run-ahead steps, interleaved; medians are reported",
    )
    bench.add_argument(
        "--methods",
        nargs="+",
        default=None,
        type=_method_spec,
        metavar="METHOD[=DIR]",
        help="drafting methods side by side against plain decoding (T x concurrency x prompt set; default "
        "concurrency 1 8); one that loads a draft takes it as METHOD=DIR (draft alone: the demo's draft)",
    )
    bench.add_argument(
        "--prompt-sets",
        nargs="+",
        default=["held-out", "copy"],
        choices=["held-out", "copy"],
        help="with --methods: held-out prompts, and prompts whose continuation copies from the prompt",
    )
    bench.add_argument(
        "--pin-depth",
        type=int,
        default=None,
        metavar="K",
        help="with --methods: every request drafts K tokens a step (the controller's choice set aside)",
    )
    bench.add_argument("--output", default=None, help="write the results as JSON")
    _suite_args(bench)
    bench.set_defaults(func=cmd_bench)


def _suite_args(bench: argparse.ArgumentParser) -> None:
    """``augur bench --suite``: the prompt suite over HTTP, against any OpenAI-compatible servers."""
    suite = bench.add_argument_group("prompt suite (--suite): see docs/bench-suite.md")
    suite.add_argument(
        "--suite",
        nargs="?",
        const="suite",
        default=None,
        metavar="FILE",
        help="measure per category (code, chat, summarization, retrieval, math) over HTTP: the shipped suite, or "
        "a .jsonl file with a 'category' on every line. Without --url, starts `augur serve` with these engine "
        "flags and runs each category with speculation and plain",
    )
    servers = {"dest": "servers", "action": "append"}  # one list: servers run in command-line order
    suite.add_argument(
        "--url",
        **servers,
        type=lambda text: ("url", text),
        metavar="[NAME=]URL",
        help="measure this running OpenAI-compatible server rather than starting Augur (repeatable; ratios are "
        "against the first server); --model is then the model name sent (default: GET /v1/models)",
    )
    suite.add_argument(
        "--server",
        **servers,
        type=lambda text: ("command", text),
        metavar="NAME=COMMAND|PRESET",
        help="start this shell command serving on {port} (or a `python -m loadtest.peers` preset such as vllm-draft), "
        "measure it and stop it before the next (repeatable, in order with --url)",
    )
    suite.add_argument(
        "--plain-baseline",
        action="store_true",
        help='with --url/--server: also run each category with "speculative": {"enabled": false} on every Augur '
        "server (one whose /v1/models names Augur as owner; others ignore the field and run once)",
    )
    suite.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="above 1: start every server once and keep them up, and run every category this many times, the "
        "servers' runs back to back (one under load at a time, every other round in reverse): medians of each "
        "round's own ratio. A server the bench starts takes each run under its own API key (fresh drafting stores)",
    )
    suite.add_argument("--api-key", default=None, help="sent to the servers as 'Authorization: Bearer KEY'")
    suite.add_argument(
        "--api",
        choices=["auto", "chat", "completions"],
        default="auto",
        help="auto: chat for conversations, completions for plain prompts",
    )
    suite.add_argument("--categories", nargs="+", default=None, help="only these categories, in this order")
    suite.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request")
    suite.add_argument("--warmup", type=int, default=2, help="unrecorded requests per API before measuring a server")
    suite.add_argument("--plots", default=None, metavar="DIR", help="write PNGs of tok/s and acceptance per category")
    suite.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for a started server to answer")
    suite.add_argument("--request-timeout", type=float, default=600.0, help="seconds without progress before a timeout")
    suite.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")


def _tune_layer_skip_parser(sub, common: argparse.ArgumentParser) -> None:
    """``augur tune-layer-skip``: the layer-skip draft's skip set, by Bayesian optimisation."""
    tune = sub.add_parser(
        "tune-layer-skip",
        parents=[common],
        help="find the layer-skip draft's skipped sublayers by Bayesian optimisation of measured tokens/s",
    )
    add_engine_args(tune)
    tune.add_argument(
        "--prompts",
        default=None,
        help="a .jsonl prompt file or a shipped set (code, chat, tutorial); default: the demo pair's held-out prompts",
    )
    tune.add_argument("--num-prompts", type=int, default=8)
    tune.add_argument("--max-tokens", type=int, default=64, help="output tokens per prompt and trial")
    tune.add_argument("--concurrency", type=int, default=1, help="requests in flight while timing")
    tune.add_argument("--temperature", type=float, default=0.0)
    tune.add_argument("--trials", type=int, default=40, help="skip sets measured")
    tune.add_argument("--tune-seed", type=int, default=0, help="the optimiser's seed")
    tune.add_argument("--output", default="layer-skip.json", help="the JSON --layer-skip-config loads")
    tune.set_defaults(func=cmd_tune_layer_skip)


def _train_draft_parser(sub, common: argparse.ArgumentParser) -> None:
    """``augur train-draft``: Medusa, EAGLE or MTP heads or a DFlash drafter, self-distilled from the target."""
    train = sub.add_parser(
        "train-draft",
        parents=[common],
        help="train drafters (medusa, eagle, mtp heads; a dflash block drafter) on the target by self-distillation",
    )
    add_engine_args(train)
    train.add_argument("--method", default="medusa", choices=["medusa", "eagle", "mtp", "dflash"])
    train.add_argument(
        "--data", default=None, help="a .jsonl prompt file or a shipped set; default: the demo's training files"
    )
    train.add_argument("--num-prompts", type=int, default=256, help="prompts the target continues")
    train.add_argument("--gen-tokens", type=int, default=128, help="tokens generated per prompt (greedy and T=1)")
    train.add_argument("--num-heads", type=int, default=4, help="medusa, mtp: heads (the deepest draft)")
    train.add_argument(
        "--num-layers",
        type=int,
        default=None,
        help="medusa, mtp: residual blocks per head (1); dflash: drafter layers (2)",
    )
    train.add_argument(
        "--dflash-block",
        type=int,
        default=8,
        help="dflash: block size (the root and N - 1 mask positions: the deepest draft)",
    )
    train.add_argument("--dflash-anchors", type=int, default=32, help="dflash: blocks trained per sequence and step")
    train.add_argument("--unroll", type=int, default=3, help="eagle: steps per row, the later ones on its own outputs")
    train.add_argument(
        "--head-decay",
        type=float,
        default=None,
        help="the loss weight of draft depth k is DECAY ** (k - 1) (0.8; dflash: 0.3, where one block's seven "
        "depths share the drafter and the first one pays most)",
    )
    train.add_argument(
        "--draft-vocab", type=int, default=0, help="eagle: a reduced draft vocabulary of N ids (0: the target's)"
    )
    train.add_argument("--steps", type=int, default=1500)
    train.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="positions per step (eagle, dflash: rows of whole sequences); 256, eagle and dflash: 512",
    )
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--resume", action="store_true", help="continue from the output's checkpoint.pt")
    train.add_argument("--output", default=None, help="output directory (default for the demo: beside its target)")
    train.set_defaults(func=cmd_train_draft)


def _demo_parser(sub, common: argparse.ArgumentParser) -> None:
    """``augur demo build | path``: the embedded demo pair."""
    demo = sub.add_parser("demo", parents=[common], help="the embedded demo target/draft pair")
    demo_sub = demo.add_subparsers(dest="demo_command", required=True)
    build = demo_sub.add_parser(
        "build", help="train the pair from its recipe into $AUGUR_HOME/demo (cached: a second run is instant)"
    )
    build.add_argument("--force", action="store_true", help="rebuild even if a matching build exists")
    build.add_argument("--device", default="auto", help="auto | cpu | cuda")
    build.add_argument("--tiny", action="store_true", help="a small variant through the same code path (tests)")
    build.add_argument(
        "--check",
        action="store_true",
        help="rebuild the shipped pair from its recorded recipe and report whether the numbers match (exit 1 if not)",
    )
    build.add_argument(
        "--reference", default=None, help="with --check: the pair to check against (default: the shipped one)"
    )
    demo_sub.add_parser("path", help="print the directory of the demo pair augur serve uses")
    demo.set_defaults(func=cmd_demo)


def _method_spec(spec: str) -> str:
    method = spec.partition("=")[0]
    if method not in known_methods():
        raise argparse.ArgumentTypeError(f"unknown method {method!r}; known: {', '.join(known_methods())}")
    return spec


def _chat_template(value: str) -> str:
    """--chat-template: a file's text, or the value itself when it is no file (Jinja has braces)."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{" not in value:
        raise argparse.ArgumentTypeError(f"{value!r} is neither a file nor a Jinja template")
    return value


def _json_object(value) -> dict:
    """A JSON object given as text (the command line) or as a mapping (a YAML config)."""
    if isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return parsed


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._subparsers._group_actions:  # argparse keeps its subparsers here
        if name in action.choices:
            return action.choices[name]
    raise KeyError(name)


def apply_config_file(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse argv; if it names --config FILE, the file's keys become defaults the command line overrides.

    Keys are flag names with dashes or underscores (``max-num-seqs`` or ``max_num_seqs``). A key that is
    not a flag of the command is an error that names it."""
    args = parser.parse_args(argv)
    path = getattr(args, "config", None)
    if not path:
        return args
    import yaml

    try:
        data = yaml.safe_load(open(path)) or {}
    except OSError as e:
        parser.error(f"cannot read config file {path}: {e}")
    except yaml.YAMLError as e:
        parser.error(f"config file {path} is not valid YAML: {e}")
    if not isinstance(data, dict):
        parser.error(f"config file {path} must be a mapping of flag names to values")
    sub = _subparser(parser, args.command)
    dests = {a.dest: a for a in sub._actions if a.dest not in ("help", "config", "func")}
    defaults = {}
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest == "prefix_caching":
            dest, value = "enable_prefix_caching", bool(value)
        if dest not in dests:
            parser.error(f"unknown key {key!r} in config file {path}")
        action = dests[dest]
        if isinstance(value, bool) and action.choices is not None and {"on", "off"} <= set(action.choices):
            value = "on" if value else "off"  # YAML reads a bare on / off as a boolean
        if value is not None and action.type is not None and not isinstance(value, list):
            try:
                value = action.type(value)
            except (TypeError, ValueError):
                parser.error(f"config key {key!r}: invalid value {value!r}")
        if action.choices is not None and value not in action.choices:
            parser.error(f"config key {key!r}: {value!r} is not one of {list(action.choices)}")
        defaults[dest] = value
    sub.set_defaults(**defaults)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = apply_config_file(build_parser(), argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"augur: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
