"""The engine's one self-validating configuration, built from CLI flags or a YAML file."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import torch

from engine.attention import BACKENDS as ATTENTION_BACKENDS
from engine.attention.kv_dtype import KV_CACHE_DTYPES
from engine.platform import cpu_has_bf16_units

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The speculative methods whose drafter --draft-tensor-parallel-size can shard like the target.
SHARDABLE_DRAFTERS = ("draft", "ouroboros", "medusa", "eagle")
PREFIX_CACHE_SCOPES = ("shared", "api-key")  # EngineConfig.prefix_cache_scope


@dataclass
class EngineConfig:
    model: str
    tokenizer: str | None = None  # defaults to the model's directory
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: bfloat16 on GPU and bf16-capable CPUs)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # Weight quantization at load: None (as the checkpoint is) | nf4 (every linear layer but the LM head in
    # 4-bit NF4, dequantized on each call: less memory, not faster; checkpoints saved by bitsandbytes in
    # NF4 load as NF4 without it) | int4 (grouped affine 4-bit on PyTorch's int4 matmul kernels: less
    # memory and faster decoding; bf16 activations at those layers; on a 4-bit GPTQ / AWQ / compressed-tensors
    # checkpoint: its own groups on those kernels, not re-quantized) | fp8 (e4m3 weights with a scale per row and
    # per-token e4m3 activations on torch._scaled_mm; an FP8 checkpoint's own weights where its scales are per
    # tensor or row; engine/quant/fp8.py).
    quantization: str | None = None
    # LoRA adapters in PEFT's format served over the base model, by name → directory (engine/lora): a
    # request picks one by its ``model`` field. max_loras: adapters held in the forward's slots at once;
    # max_lora_rank: the largest rank an adapter may have (slots are sized by it).
    lora_modules: dict[str, str] = field(default_factory=dict)
    max_loras: int = 4
    max_lora_rank: int = 16
    # Adapters loaded and unloaded while serving (POST /v1/load_lora_adapter, /v1/unload_lora_adapter):
    # more may be known than max_loras slots hold, the least recently used idle one giving up its slot.
    enable_runtime_lora: bool = False
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    block_size: int = 16
    num_kv_blocks: int | None = None  # sizes the KV pool exactly; else from kv_cache_memory_fraction
    kv_cache_memory_fraction: float = 0.85  # of free GPU memory (CUDA) or of available RAM (CPU, capped)
    # What the KV pool stores: auto (the model's dtype) | fp8 (float8 e4m3 with per-layer, per-head scales from
    # the checkpoint, else 1.0: half the bytes a token; engine/attention/kv_dtype.py). Draft caches too.
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    # Whose requests share cached prompt KV: "shared", every request's (a cache_salt narrows it); "api-key",
    # only requests under the same API key (SamplingParams.tenant), so no key can probe another's prompts
    # through its hits (time to first token). Requests without a key (no --api-key) share as before.
    prefix_cache_scope: str = "shared"
    seed: int = 0
    # torch.compile the target and draft forwards: auto | on | off. auto: the AUGUR_COMPILE environment
    # variable (on/off) if set, else on for CPUs (measured 1.06-1.27x per target forward, 1.2-1.9x per
    # draft forward: docs/benchmarks.md), off on GPUs, where decode and verify run as CUDA graphs instead.
    compile: str = "auto"
    # With compile: answer at once with the eager forwards, compile in a background thread and swap the
    # compiled ones in between two steps when they are ready (a server's default: a cold start
    # answers within seconds of loading instead of after the compile). Off: compile before the first
    # step (benchmarks, which time the compiled forwards).
    compile_background: bool = False
    # GPUs: run every forward eagerly, without capturing CUDA graphs (engine/runner/cuda_graphs.py).
    enforce_eager: bool = False
    # Run-ahead decoding (engine/core/ahead.py): while every running request decodes plainly, launch the
    # next forward before reading the last one's tokens, so that output processing overlaps the
    # device's work. Exact; plain engines, and speculative ones while their controller drafts nothing
    # (not beside EAGLE, Medusa or MTP heads); one rank. auto | on | off (a bool is on/off); auto: on
    # for CPUs, where served medians measured 1.03-1.22x at c = 1 and 1.00-1.09x at c = 8 (its leaner
    # step: nothing overlaps there), off on GPUs until measured there (docs/benchmarks.md).
    async_scheduling: str = "auto"
    # Attention backend: auto | sdpa | triton (engine/attention). auto: triton on CUDA where Triton imports,
    # else sdpa (the CPU path and the reference).
    attention_backend: str = "auto"
    # Batch invariance (docs/speculative.md, "The promise"): a request's tokens depend on nothing but the
    # request. The target runs on operators whose every output is one computation in one order whatever
    # the rows beside it (engine/models/invariant.py), attention on one path for every query (a decode's,
    # a verify's, a prefill chunk's), and compiled forwards round as eager ones do. auto | on | off; auto:
    # on for CPUs (float32, bfloat16; int4 and NF4 weights too), where it is faster than the batch-variant
    # path (docs/benchmarks.md); off on GPUs, where "on" runs Triton kernels (engine/models/invariant_cuda.py)
    # whose cost is not measured yet.
    batch_invariant: str = "auto"
    # Speculative decoding.
    # none | draft | ouroboros | ngram | suffix | lookahead | layer-skip | medusa | eagle | mtp
    # (engine/speculative/methods).
    # None: the method whose layout the --draft-model directory has (medusa for Medusa heads, ..., else draft)
    # or none; resolved and checked when the engine is built (LLMEngine), as it may read the directory.
    speculative_method: str | None = None
    draft_model: str | None = None
    num_speculative_tokens: int = 4  # the most draft positions (tree depth) per request and step
    # children per expanded node; 1 = chains. None: chains on CPU (where every verified token costs real
    # matmul time, chains measured faster than trees in almost every cell), trees (2) on GPU.
    spec_tree_topk: int | None = None
    spec_tree_budget: int = 12  # the most draft-tree nodes per request and step
    ngram_min: int = 1  # ngram (prompt lookup): the shortest suffix matched
    ngram_max: int = 4  # ... and the longest, tried first
    suffix_order: int = 8  # suffix: the longest context whose continuations are counted
    suffix_cache_tokens: int = 100_000  # suffix: tokens of finished outputs kept (~2 KB each at worst)
    # lookahead (engine/speculative/methods/lookahead.py): the Jacobi window's width W and n-gram size N
    # (N - 1 levels), and the most pooled n-grams G verified a step; shared: one pool per prompt family.
    # None: W = G = 2 on CPU (every row of a forward costs matmul time there: the narrowest window
    # measured fastest, docs/benchmarks.md), 4 on GPU (rows ride nearly free up to a graph's width).
    lookahead_window: int | None = None
    lookahead_ngram: int = 4
    lookahead_guesses: int | None = None
    lookahead_shared: bool = False
    # ouroboros (engine/speculative/methods/ouroboros.py): the longest pooled phrase the draft model tries
    # a forward, and the most rejected phrase tails verified beside its chain. None: 1 on CPU, 3 on GPU.
    ouroboros_phrase: int = 4
    ouroboros_branches: int | None = None
    layer_skip_config: str | None = None  # layer-skip: JSON of skipped sublayers (default: the middle half)
    # Model-based drafters stop a draft early where their top-1 probability falls below a threshold that
    # adapts so that this fraction of the drafted tokens is accepted (Draft & Verify). 0: off; None: the
    # method's default (on, 0.7, for layer-skip; off for a draft model).
    spec_early_stop: float | None = None
    # Structured outputs: emit the tokens a request's grammar allows alone without a forward for them
    # (jump-forward; exact: such a token has probability 1 under the masked distribution).
    grammar_jump_forward: bool = True
    grammar_cache_size: int = 256  # compiled grammars kept (by spec), least recently used out first
    # Tensor parallelism (engine/parallel, engine/runner/parallel.py): the target sharded over this many
    # ranks, one process each (rank 0 the engine, the others workers it starts), joined over gloo (CPU)
    # or NCCL (one GPU a rank: cuda:0 .. cuda:N-1). A collective or a join that takes longer than
    # tp_timeout_s seconds ends the server.
    tensor_parallel_size: int = 1
    tp_timeout_s: float = 600.0
    # A draft model's (or Medusa heads', or an EAGLE head's) ranks under tensor parallelism: 1 (unsharded
    # on rank 0, the default: its forwards cost no collective) or tensor_parallel_size (sharded like the
    # target over the same ranks: each rank holds 1/N of it). docs/parallel.md has the measurement behind
    # the default.
    draft_tensor_parallel_size: int = 1
    # Several hosts: the ranks are split evenly over nnodes hosts, host node_rank running ranks
    # node_rank * N / nnodes onwards (host 0 runs rank 0, the engine, and serves HTTP; the others run
    # headless workers); all meet at master_addr:master_port (0: a free port, one host only).
    # first_gpu: the GPU of this host's first rank (torchrun's LOCAL_RANK, where it starts each rank).
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    first_gpu: int = 0

    def __post_init__(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        check(bool(self.model), "a model path or hub id is required")
        check(self.tensor_parallel_size >= 1, "tensor_parallel_size must be at least 1")
        check(self.tp_timeout_s > 0, "tp_timeout_s must be positive")
        check(
            self.draft_tensor_parallel_size in (1, self.tensor_parallel_size),
            f"--draft-tensor-parallel-size must be 1 or the target's --tensor-parallel-size "
            f"({self.tensor_parallel_size}), got {self.draft_tensor_parallel_size}",
        )
        check(self.nnodes >= 1 and 0 <= self.node_rank < self.nnodes, "node_rank must be in [0, nnodes)")
        check(
            self.tensor_parallel_size % self.nnodes == 0,
            f"--nnodes {self.nnodes} must divide --tensor-parallel-size {self.tensor_parallel_size}",
        )
        check(self.nnodes == 1 or self.master_port > 0, "--nnodes > 1 needs --master-port (and --master-addr)")
        check(self.dtype == "auto" or self.dtype in _DTYPES, f"dtype must be auto or one of {sorted(_DTYPES)}")
        if isinstance(self.async_scheduling, bool):
            self.async_scheduling = "on" if self.async_scheduling else "off"
        check(self.async_scheduling in ("auto", "on", "off"), "async_scheduling must be auto, on or off")
        from engine.quant import QUANTIZATIONS

        check(
            self.quantization is None or self.quantization in QUANTIZATIONS,
            f"quantization must be one of {list(QUANTIZATIONS)} (or unset), got {self.quantization!r}",
        )
        check(
            self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
            f"device must be auto, cpu or cuda[:N], got {self.device!r}",
        )
        check(self.max_loras >= 1 and self.max_lora_rank >= 1, "--max-loras and --max-lora-rank must be positive")
        if self.lora_enabled:
            check(self.compile != "on", "LoRA adapters are served by the eager forward: --compile on cannot be used")
        check(self.block_size >= 1, f"block_size must be positive, got {self.block_size}")
        check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks must be positive")
        check(0.0 < self.kv_cache_memory_fraction <= 1.0, "kv_cache_memory_fraction must be in (0, 1]")
        check(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}",
        )
        check(
            self.prefix_cache_scope in PREFIX_CACHE_SCOPES,
            f"prefix_cache_scope must be one of {list(PREFIX_CACHE_SCOPES)}, got {self.prefix_cache_scope!r}",
        )
        check(self.max_num_seqs >= 1, "max_num_seqs must be positive")
        check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be positive")
        check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be at least 2")
        check(self.compile in ("auto", "on", "off"), f"compile must be auto, on or off, got {self.compile!r}")
        check(self.batch_invariant in ("auto", "on", "off"), "batch_invariant must be auto, on or off")
        check(
            self.attention_backend in ("auto", *ATTENTION_BACKENDS),
            f"attention_backend must be auto or one of {list(ATTENTION_BACKENDS)}, got {self.attention_backend!r}",
        )
        env = os.environ.get("AUGUR_COMPILE", "")
        check(env in ("", "on", "off"), f"AUGUR_COMPILE must be on or off, got {env!r}")
        if self.speculative_method in ("draft", "ouroboros"):
            check(bool(self.draft_model), f"speculative_method {self.speculative_method} needs --draft-model")
        check(
            self.draft_tensor_parallel_size == 1 or self.speculative_method in (None, "auto", *SHARDABLE_DRAFTERS),
            f"--draft-tensor-parallel-size shards a draft model (speculative_method draft or ouroboros), Medusa "
            f"heads or an EAGLE head, not {self.speculative_method}",
        )
        check(0 <= self.num_speculative_tokens <= 32, "num_speculative_tokens must be in [0, 32]")
        if self.spec_tree_topk is None:
            self.spec_tree_topk = 2 if self.torch_device.type == "cuda" else 1
        check(self.spec_tree_topk >= 1, "spec_tree_topk must be at least 1")
        check(self.spec_tree_budget >= 1, "spec_tree_budget must be at least 1")
        check(1 <= self.ngram_min <= self.ngram_max, "need 1 <= ngram_min <= ngram_max")
        check(self.suffix_order >= 1, "suffix_order must be at least 1")
        check(self.suffix_cache_tokens >= 0, "suffix_cache_tokens must be non-negative")
        check(self.lookahead_window is None or self.lookahead_window >= 1, "lookahead_window must be at least 1")
        check(self.lookahead_ngram >= 3, "lookahead_ngram must be at least 3")
        check(self.lookahead_guesses is None or self.lookahead_guesses >= 1, "lookahead_guesses must be at least 1")
        check(self.ouroboros_phrase >= 1, "ouroboros_phrase must be at least 1")
        check(self.ouroboros_branches is None or self.ouroboros_branches >= 0, "ouroboros_branches must be >= 0")
        check(
            self.spec_early_stop is None or 0.0 <= self.spec_early_stop < 1.0,
            "spec_early_stop must be in [0, 1) (0 turns it off)",
        )

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} requested but CUDA is not available")
        return torch.device(self.device)

    @property
    def compile_enabled(self) -> bool:
        if self.lora_enabled:  # the adapters' weights change at run time: a frozen compiled graph would keep them
            return False
        if self.compile != "auto":
            return self.compile == "on"
        env = os.environ.get("AUGUR_COMPILE")
        if env:
            return env == "on"
        return self.torch_device.type == "cpu"

    @property
    def lora_enabled(self) -> bool:
        """Whether the target carries LoRA slots (engine/lora): adapters given at start, or loadable."""
        return bool(self.lora_modules) or self.enable_runtime_lora

    @property
    def batch_invariant_enabled(self) -> bool:
        """Whether the target runs the batch-invariant operators. auto: on where they are built (a CPU,
        float32 or bfloat16, the sdpa attention backend), compiled or not, quantized or not: there they
        are faster than the variant path (docs/benchmarks.md)."""
        if self.batch_invariant != "auto":
            return self.batch_invariant == "on"
        covered = self.torch_dtype in (torch.float32, torch.bfloat16) and self.attention_backend in ("auto", "sdpa")
        return self.torch_device.type == "cpu" and covered

    @property
    def async_scheduling_enabled(self) -> bool:
        if self.async_scheduling != "auto":
            return self.async_scheduling == "on"
        return self.torch_device.type == "cpu"

    @property
    def cuda_graph_max_seqs(self) -> int:
        """The largest batch the model runners capture as CUDA graphs; 0 (none) off CUDA or when eager."""
        if self.enforce_eager or self.torch_device.type != "cuda" or self.tensor_parallel_size > 1:
            return 0  # (tensor-parallel forwards are not captured yet: their collectives run eagerly)
        return self.max_num_seqs

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            if self.torch_device.type == "cuda" or cpu_has_bf16_units():
                return torch.bfloat16
            return torch.float32
        return _DTYPES[self.dtype]

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]
