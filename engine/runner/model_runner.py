"""The model runner owns every device tensor: the weights, the KV pool and each step's inputs.

Others hand it plain metadata (:class:`ForwardChunk` lists) and get logits or sampled tokens back.
It decides no policy: what runs, and what is accepted, is the engine's business.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import logging
import os
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.attention import AttentionMetadata, metadata_builder, resolve_backend
from engine.attention.common import PersistentBlockTables
from engine.attention.cpu_kernel import load_cpu_kernel
from engine.attention.kv_dtype import pool_dtype, raw
from engine.attention.staging import Staging, to_device
from engine.models.layer_skip import LayerSkip
from engine.models.packed import linear_weight_bytes
from engine.runner.timing import Lap

if TYPE_CHECKING:  # graphs import Triton, which only the triton backend needs
    from engine.runner.cuda_graphs import CudaGraphs, GraphShape

logger = logging.getLogger(__name__)


@dataclass
class ForwardChunk:
    """One sequence's part of a flattened forward."""

    token_ids: list[int]  # the new tokens fed this step
    ctx_len: int  # tokens of this sequence already in the cache
    block_table: list[int]
    num_logits: int  # how many trailing new tokens need logits (0 mid-prefill, 1 for decode)
    positions: list[int] | None = None  # None → ctx_len, ctx_len + 1, ...
    tree_mask: torch.Tensor | None = None  # [q, ctx_len + q - mask_start] bool; None → causal
    mask_start: int | None = None  # first key the tree mask covers (default ctx_len: the new tokens only)
    lora: int = -1  # the LoRA slot its tokens run under (engine/lora/layers.py); -1: the base model


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [N, vocab] float32, rows of every chunk's trailing num_logits tokens, in order
    hidden_states: dict[int, torch.Tensor]  # layer → [T, hidden] for the layers asked for (every fed token)
    final_hidden: torch.Tensor | None = None  # [T, hidden] the final-normed states the LM head reads


@dataclass
class ForwardBatch:
    """A forward's device inputs, built once from :class:`ForwardChunk` metadata (see :meth:`ModelRunner.prepare`).

    Drafting loops prepare a level's batch on the host and feed it token ids that are still on the
    device (the previous level's output), so no level waits for the host."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # [N] int64 rows of the tokens needing logits
    num_seqs: int
    num_tokens: int
    graph: GraphShape | None = None  # padded to a captured shape (positions and meta are padded; the rest is not)
    lora: torch.Tensor | None = None  # [T] int64 each row's LoRA slot (-1: none; padded rows too); None: no adapter
    lora_used: int = 0  # the highest LoRA slot a row uses, + 1


class LogitsForward(torch.nn.Module):
    """The model's forward and output layer, on the rows that need logits: what gets compiled. Its
    final-normed hidden states come out too (contrastive search reads them; they exist anyway)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, positions, meta, kv_cache, logit_rows, skip, hidden_layers, hidden_in=None):
        # hidden_in: a per-token input besides the token (an EAGLE head's features), for models that take one
        extra = {} if hidden_in is None else {"hidden_in": hidden_in}
        meta.tie_shapes(input_ids, positions)
        hidden, captured = self.model(input_ids, positions, meta, kv_cache, skip, hidden_layers, **extra)
        return self.model.compute_logits(hidden.index_select(0, logit_rows)), captured, hidden


def chain_pick(logits, temperature=None, noise=None):
    """A chain level's next token from its logits ``[B, V]``: the argmax, or with a ``temperature``
    ``[B]`` a draw from ``q = softmax(logits / T)`` by the exponential race against ``noise``
    ``[B, V]`` (Exp(1)); returns the tokens and ``q`` (None for argmax)."""
    if temperature is None:
        return logits.argmax(-1), None
    q = torch.softmax(logits.float() / temperature[:, None], -1)
    return (q / noise).argmax(-1), q


class ChainForward(torch.nn.Module):
    """Several draft levels of chains in one call: each level feeds one token per sequence and the
    token :func:`chain_pick` takes from its logits is the next level's, without leaving the device
    (or, compiled, the graph). Level ``d`` runs with ``metas[d]`` at ``positions[d]`` (and
    ``noise[d]``); returns the tokens ``[B, L]`` and, sampled, each level's ``q`` ``[B, L, V]``."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, positions, metas, kv_cache, skip, temperature=None, noise=None):
        out, qs = [], []
        for d, (pos, meta) in enumerate(zip(positions, metas)):
            hidden, _ = self.model(input_ids, pos, meta, kv_cache, skip, ())
            level_noise = None if noise is None else noise[d]
            input_ids, q = chain_pick(self.model.compute_logits(hidden), temperature, level_noise)
            out.append(input_ids)
            qs.append(q)
        return torch.stack(out, 1), None if noise is None else torch.stack(qs, 1)


def compile_forward(fn: torch.nn.Module, device: torch.device, freeze: bool = True, eager_roundings: bool = False):
    """``torch.compile`` a forward for every batch shape at once.

    Shapes are dynamic from the first call and sizes 0 and 1 are not special-cased where that can be
    avoided (``backed_size_oblivious``): one graph serves every forward of several tokens (a verify
    chunk, a mixed batch), a second one a lone token (fake tensors' stride rules tell a dimension of
    1 apart), and :meth:`ModelRunner.warmup` compiles both, so nothing recompiles mid-serving.
    Attention is an opaque custom operator (``augur::paged_attention``), so the graph never copies the
    KV pool.

    On a CPU, ``freeze`` turns the weights into constants that inductor prepacks for oneDNN's GEMM
    kernels (a second copy of the linear weights, taken at the first call): they win from a few rows
    up, but each call costs more than a plain ``mm``, so a model that runs a row or two at a time (a
    proposer's draft levels) is compiled unfrozen. The graph's wrapper is C++ there (``cpp_wrapper``):
    the Python one cost about 0.5 ms per forward of the demo target in kernel launches alone.

    ``eager_roundings`` (the batch-invariant mode): a fused kernel rounds every intermediate to its
    dtype as the eager operators do, so that the compiled forward computes eager's values bit for bit
    (the rest of such a forward is the invariant operators, opaque to inductor).
    """
    compile_settings(device)
    # Dynamo keeps compiled graphs, and checks their guards, per code object: this forward gets a
    # code object of its own, so that a call never walks past the guards of another model's graphs.
    method = type(fn).forward
    own = types.FunctionType(method.__code__.replace(), method.__globals__, method.__name__, method.__defaults__)
    fn.forward = types.MethodType(own, fn)
    cpu = device.type == "cpu"
    options = {"freezing": freeze and cpu, "cpp_wrapper": cpu, "guard_filter_fn": _module_guards}
    if eager_roundings:
        options["emulate_precision_casts"] = True
    return torch.compile(fn, dynamic=True, options=options)


def compile_settings(device: torch.device) -> None:
    """The dynamo and inductor settings :func:`compile_forward`'s graphs are made and guarded with.
    torch keeps its settings in context variables, one value per thread: a thread that compiles or
    runs compiled forwards sets them first (or runs in a copy of the context that did)."""
    import torch._dynamo
    import torch._inductor.config
    import torch.fx.experimental._config as fx_config

    fx_config.backed_size_oblivious = True
    fx_config.use_duck_shape = False  # equal sizes seen once are not assumed equal forever
    # Inductor's on-disk cache keys a graph by its code, not by what its custom operators (ours) take
    # or do: code compiled against an older augur::paged_attention called the new one with the old
    # arguments and crashed. Our code's hash in the key: another version of Augur compiles afresh.
    user_tag = os.environ.get("TORCH_COMPILE_CACHE_KEY_TAG", "")
    torch.compiler.config.cache_key_tag = f"{user_tag}augur-{engine_code_hash()}"
    # A module's float attributes (norm epsilons, attention scales) are constants, not graph inputs
    # guarded by Python lambdas on every call (the model never changes; see _module_guards).
    torch._dynamo.config.specialize_float = True
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    if device.type == "cpu":
        # Dynamo reads the global flag when it traces (whether a graph may be frozen at all); each
        # compile's option then says whether its graph is.
        torch._inductor.config.freezing = True


@functools.cache
def engine_code_hash() -> str:
    """A hash of the engine's Python and C++ sources (where its custom operators are defined)."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha1()
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".cpp") and path.is_file():
            digest.update(path.relative_to(root).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _module_guards(entries) -> list[bool]:
    """Which of dynamo's guards a compiled forward keeps: all but those on the model's modules'
    attributes (about 900 for a 6-layer model, checked on every call), bar the identities of its
    parameters and buffers. A runner's model is built once and never changes, and its compiled graphs
    are its own (see compile_forward), so the identities alone tell that a graph is this model's."""
    return [e.guard_type == "ID_MATCH" or not _on_module(e) for e in entries]


def _on_module(entry) -> bool:
    source = getattr(getattr(entry, "orig_guard", None), "source", None)  # kept where a torch lacks them
    return source is not None and source.is_unspecialized_nn_module()


def mark_pool_static(pool: torch.Tensor) -> None:
    """A KV pool's sizes as compiled forwards see them: static but for its slots (a compile view's
    scratch pool has fewer than the live one, and both must run the same graphs), not five symbolic
    sizes a compiled forward is handed, and converts, on every call."""
    torch._dynamo.mark_static(pool, [d for d in range(pool.dim()) if d != 2])


def kv_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """The KV pool's ``(layers, KV heads, head dim)`` on this rank, as :meth:`ModelRunner.allocate_kv`
    lays it out (``[layers, K/V, slots, KV heads, head dim]``): the model's ``kv_shape`` where it
    declares one (a family whose layers' K/V differ in shape, or share a layer's: Gemma 4), else every
    layer's own K/V in its first layer's shape (one latent for multi-head latent attention)."""
    declared = getattr(model, "kv_shape", None)
    if declared is not None:
        return declared
    attn = model.layers[0].self_attn
    return model.num_layers, attn.num_kv_heads, attn.head_dim


def kv_bytes_per_token(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """K and V of one token, all layers, in the pool :meth:`ModelRunner.allocate_kv` lays out."""
    layers, heads, head_dim = kv_shape(model)
    return 2 * layers * heads * head_dim * torch.empty((), dtype=dtype).element_size()


def kv_pool_blocks(runner: ModelRunner, extra_bytes_per_token: int, config, max_len: int) -> int:
    """KV blocks that fit the memory left (``config.kv_cache_memory_fraction`` of it); each token
    also pays ``extra_bytes_per_token`` (a proposer's own cache, one slot per target slot)."""
    per_block = (runner.kv_bytes_per_token + extra_bytes_per_token) * config.block_size
    available = available_memory_bytes(runner.device)
    if runner.frozen:
        available -= linear_weight_bytes(runner.model)  # the frozen copy compilation will make
    blocks = int(available * config.kv_cache_memory_fraction) // per_block
    if runner.device.type == "cpu":
        # On a CPU the pool shares RAM with everything else: take no more than a full batch needs.
        blocks = min(blocks, config.max_num_seqs * (-(-max_len // config.block_size) + 1))
    if blocks < 1:
        raise ValueError("no memory left for the KV cache")
    return blocks


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        hf_config,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        num_blocks: int | None = None,
        compile: bool = False,
        attention_backend: str = "auto",
        freeze: bool = True,  # compiled on a CPU: weights as prepacked constants (see compile_forward)
        cuda_graph_max_seqs: int = 0,  # largest batch run as a captured graph (engine.runner.cuda_graphs); 0: none
        batch_invariant: bool = False,  # attention on one path for every query (engine/models/invariant.py)
        kv_cache_dtype: str = "auto",  # what the KV pool stores: auto (the model's dtype) | fp8 (kv_dtype.py)
    ) -> None:
        self.model = model
        self.lora = getattr(model, "lora", None)  # its LoRA slots, where adapters are served (engine/lora)
        self.hf_config = hf_config
        self.device = device
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.pool_dtype = pool_dtype(kv_cache_dtype, dtype)
        self.block_size = block_size
        self.vocab_size = hf_config.vocab_size
        self.kv_bytes_per_token = kv_bytes_per_token(model, self.pool_dtype)
        self.attention_backend = resolve_backend(attention_backend, device)  # see engine.attention
        if self.attention_backend == "triton" and not getattr(model.layers[0].self_attn, "triton_paged", True):
            # (a model whose attention the Triton kernel's tiles do not fit: latent attention's wide head)
            if attention_backend != "auto":
                raise ValueError(
                    f"{type(model).__name__}'s attention is not built for the triton attention backend: serve "
                    "with --attention-backend sdpa (or auto)"
                )
            logger.info("%s: the sdpa attention backend (the triton one is not built for its attention)",
                        type(model).__name__)  # fmt: skip
            self.attention_backend = "sdpa"
        self._build_metadata = metadata_builder(self.attention_backend)
        self.batch_invariant = batch_invariant
        if batch_invariant:
            if (device.type, self.attention_backend) not in (("cpu", "sdpa"), ("cuda", "triton")):
                raise ValueError(
                    "the batch-invariant mode is built for CPUs (the sdpa attention backend) and CUDA (the triton "
                    f"backend), not {device.type} with {self.attention_backend}"
                )
            flag = "rows_only" if self.attention_backend == "sdpa" else "invariant"
            self._build_metadata = functools.partial(self._build_metadata, **{flag: True})
        self._block_rows = PersistentBlockTables()  # block tables kept as array rows between forwards
        self.staging = Staging(device)  # a forward's inputs in one copy, from a pinned ring
        if device.type == "cpu" and self.attention_backend == "sdpa":
            # the op's C++ kernel for CPU tensors (built on first use); the batch-invariant mode needs it
            if not load_cpu_kernel() and batch_invariant:
                raise RuntimeError("the batch-invariant mode needs the C++ attention kernel, which could not be built")
        self.num_blocks = 0
        self.kv_cache = torch.empty(0)
        # Graphs need the triton backend's static-shaped metadata; they are set up with the pool.
        self.cuda_graph_max_seqs = cuda_graph_max_seqs if self.attention_backend == "triton" else 0
        self.graphs: CudaGraphs | None = None
        if num_blocks is not None:
            self.allocate_kv(num_blocks)
        self.compiled = compile  # compiled forwards asked for (served from construction, or see serve_eager)
        self.frozen = compile and freeze and device.type == "cpu"
        self._eager = (LogitsForward(model), ChainForward(model))
        self._compiled = self._eager
        if compile:
            run, chain = self._eager
            # A frozen graph of the chain would take a second copy of the weights: it stays eager.
            self._compiled = (
                compile_forward(run, device, freeze, eager_roundings=batch_invariant),
                chain if self.frozen else compile_forward(chain, device, freeze, eager_roundings=batch_invariant),
            )
        self._run, self._chain = self._compiled
        # The chain graphs warmed up (see warm_chains), by (levels, several sequences, sampled). Shared
        # with compile views (a view warms them up for its runner). With ``defer_chains`` (a background
        # compile: see serve_eager) a chain whose compiled graph is not among them runs its levels one
        # compiled forward each.
        self._chains_ready: set[tuple[int, bool, bool]] = set()
        self.defer_chains = False

    # -- LoRA slots (engine/lora) -------------------------------------------------------------------
    def write_lora(self, slot: int, adapter) -> None:
        """Write ``adapter`` (:class:`engine.lora.Adapter`) into LoRA ``slot`` (between two forwards)."""
        self.lora.load(slot, adapter)

    def clear_lora(self, slot: int) -> None:
        self.lora.clear(slot)

    # -- compiled or eager ------------------------------------------------------------------------
    def serve_eager(self) -> None:
        """Run the eager forwards until :meth:`use_compiled`: a server answers at once while its
        compiled forwards are warmed up through a :meth:`compile_view` in the background (its chain
        graphs last: until each is warm, :meth:`chain` runs its levels one compiled forward each)."""
        self._run, self._chain = self._eager
        self.defer_chains = True

    def use_compiled(self) -> None:
        """Run the compiled forwards (those of a runner built with ``compile``; the eager ones else).
        Called between steps: a forward already running finishes with the function it started with."""
        self._run, self._chain = self._compiled

    def compile_view(self, scratch_tokens: int = 256) -> ModelRunner:
        """This runner for compiling in the background: the same model and compiled forwards, over a
        scratch KV pool of its own (blocks for ``scratch_tokens`` tokens: warm-up's longest chain) and
        without CUDA graphs, so that warming it up (:meth:`warm_compiled`) never reads or writes the
        live pool a step is using."""
        num_blocks = -(-scratch_tokens // self.block_size)
        view = copy.copy(self)
        view._run, view._chain = self._compiled
        view.graphs = None
        view._block_rows = PersistentBlockTables()  # its thread's own
        view.staging = Staging(self.device)
        view.num_blocks = num_blocks
        view.kv_cache = torch.zeros(
            (self.kv_cache.shape[0], 2, num_blocks * self.block_size, *self.kv_cache.shape[3:]),
            dtype=self.pool_dtype,
            device=self.device,
        )
        mark_pool_static(view.kv_cache)  # marked as the live pool is: its graphs are the live pool's
        return view

    def allocate_kv(self, num_blocks: int) -> None:
        """Allocate the KV pool, once its size is known (it is shared out with any proposer's cache).
        With graphs, one more block past the pool's is their padding tokens' scratch."""
        layers, heads, head_dim = kv_shape(self.model)
        self.num_blocks = num_blocks
        scratch = int(self.cuda_graph_max_seqs > 0)
        # [layers, K/V, slots, kv_heads, head_dim]: one contiguous pool; slot = block * block_size + offset.
        self.kv_cache = torch.zeros(
            layers,
            2,
            (num_blocks + scratch) * self.block_size,
            heads,
            head_dim,
            dtype=self.pool_dtype,
            device=self.device,
        )
        mark_pool_static(self.kv_cache)
        logger.info(
            "KV pool: %d blocks x %d tokens (%.1f MiB, %s)",
            num_blocks,
            self.block_size,
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**20,
            str(self.pool_dtype).removeprefix("torch."),
        )
        if scratch:  # (new graphs: the old ones read the old pool)
            from engine.runner.cuda_graphs import CudaGraphs

            self.graphs = CudaGraphs(self.device, self.cuda_graph_max_seqs, num_blocks, self.block_size, heads)

    # -- KV blocks --------------------------------------------------------------------------------
    def move_slots(self, src: list[int], dst: list[int]) -> None:
        """Move single tokens' K/V (all layers) between slots: accepted draft-tree nodes into place.
        All sources are read before any destination is written, so overlapping moves are safe."""
        if not src:
            return
        s, d = to_device([src, dst], self.device, torch.int64)
        pool = raw(self.kv_cache)  # (8-bit floats have no index operations on CPUs: their bytes move)
        pool[:, :, d] = pool[:, :, s].clone()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks' K/V (all layers) from src to dst."""
        if not copies:
            return
        bs = self.block_size
        offsets = torch.arange(bs, device=self.device)
        src, dst = to_device(copies, self.device, torch.int64).unbind(1)
        src, dst = (src[:, None] * bs + offsets).flatten(), (dst[:, None] * bs + offsets).flatten()
        pool = raw(self.kv_cache)
        pool[:, :, dst] = pool[:, :, src]

    # -- forward ----------------------------------------------------------------------------------
    def prepare(self, chunks: list[ForwardChunk]) -> ForwardBatch:
        """Host metadata → device tensors for one flattened forward (shared by every layer): padded
        to a captured shape where the batch has one (see engine.runner.cuda_graphs)."""
        if self.graphs is not None:
            back = any(c.tree_mask is not None and c.mask_start not in (None, c.ctx_len) for c in chunks)
            shape = self.graphs.shape_for([len(c.token_ids) for c in chunks], back)
            if shape is not None:
                return self._prepare_padded(chunks, *shape)
        token_ids: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []
        for c in chunks:
            start = len(token_ids)
            token_ids.extend(c.token_ids)
            q = len(c.token_ids)
            positions.extend(c.positions if c.positions is not None else range(c.ctx_len, c.ctx_len + q))
            logit_rows.extend(range(start + q - c.num_logits, start + q))
        # One copy to the device for all of it, metadata included (engine/attention/staging.py).
        pack = self.staging.pack()
        ids, pos, rows = (pack.add(np.asarray(a, dtype=np.int64)) for a in (token_ids, positions, logit_rows))
        lora = self._lora_rows(chunks, pack)
        masks = [c.tree_mask for c in chunks]
        kv_lens = [c.ctx_len + len(c.token_ids) for c in chunks]
        meta = self._build_metadata(
            q_lens=[len(c.token_ids) for c in chunks],
            ctx_lens=[c.ctx_len for c in chunks],
            block_tables=self._block_rows.rows([c.block_table for c in chunks], kv_lens, self.block_size),
            block_size=self.block_size,
            positions=pos,
            new_token_masks=masks if any(m is not None for m in masks) else None,
            mask_starts=[c.ctx_len if c.mask_start is None else c.mask_start for c in chunks],
            sliding_window=self.model.sliding_window,
            device=self.device,
            pack=pack,
        )
        return ForwardBatch(
            pack[ids],
            pack[pos],
            meta,
            pack[rows],
            len(chunks),
            len(token_ids),
            lora=None if lora is None else pack[lora],
            lora_used=max(c.lora for c in chunks) + 1,
        )

    def _prepare_padded(self, chunks: list[ForwardChunk], num_seqs: int, width: int) -> ForwardBatch:
        """:meth:`prepare` for a captured shape: every sequence padded to ``width`` new tokens and the
        batch to ``num_seqs`` sequences. Padding repeats a sequence's last position (a padding sequence
        has position 0 and no blocks), writes the scratch slot, and no real token sees it: it comes after
        a causal sequence's tokens, and a tree mask is padded with zero columns (a padding row sees itself)."""
        token_ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []  # each real token's padded row
        logit_rows: list[int] = []  # the padded rows needing logits
        real_logit_rows: list[int] = []  # ... and the same tokens' rows in the unpadded batch
        masks: list[torch.Tensor | None] = []
        for b, c in enumerate(chunks):
            q, start = len(c.token_ids), b * width
            real_logit_rows.extend(range(len(token_ids) + q - c.num_logits, len(token_ids) + q))
            token_ids.extend(c.token_ids)
            pos = list(c.positions) if c.positions is not None else list(range(c.ctx_len, c.ctx_len + q))
            positions.extend(pos + pos[-1:] * (width - q))
            rows.extend(range(start, start + q))
            logit_rows.extend(range(start + q - c.num_logits, start + q))
            mask = c.tree_mask
            if mask is not None and q < width:
                mask = torch.eye(width, dtype=torch.bool)
                mask[:q, :q] = c.tree_mask
            masks.append(mask)
        pads = num_seqs - len(chunks)
        positions.extend([0] * (pads * width))
        # One copy to the device: the token ids, their padded rows, the padded and unpadded rows
        # needing logits, the positions and the metadata (engine/attention/staging.py).
        pack = self.staging.pack()
        ids, rows_t, logits_t, real_t, pos = (
            pack.add(np.asarray(a, dtype=np.int64)) for a in (token_ids, rows, logit_rows, real_logit_rows, positions)
        )
        lora = self._lora_rows(chunks, pack, width, pads)
        tables = [c.block_table for c in chunks] + [[]] * pads
        kv_lens = [c.ctx_len + width for c in chunks] + [width] * pads
        meta = self._build_metadata(
            q_lens=[width] * num_seqs,
            ctx_lens=[c.ctx_len for c in chunks] + [0] * pads,
            block_tables=self._block_rows.rows(tables, kv_lens, self.block_size),
            block_size=self.block_size,
            positions=pos,
            new_token_masks=masks + [None] * pads if any(m is not None for m in masks) else None,
            sliding_window=self.model.sliding_window,
            device=self.device,
            num_splits=self.graphs.key_splits(num_seqs, width),
            write_lens=[len(c.token_ids) for c in chunks] + [0] * pads,
            scratch_slot=self.graphs.scratch_slot,
            pack=pack,
        )
        from engine.runner.cuda_graphs import GraphShape

        shape = GraphShape(num_seqs, width, pack[rows_t], pack[logits_t])
        return ForwardBatch(
            pack[ids], pack[pos], meta, pack[real_t], len(chunks), len(token_ids), shape,
            lora=None if lora is None else pack[lora], lora_used=max(c.lora for c in chunks) + 1,
        )  # fmt: skip

    def _lora_rows(self, chunks: list[ForwardChunk], pack, width: int = 0, pads: int = 0):
        """Each row's LoRA slot, added to ``pack`` (its handle), or None where no chunk has an adapter
        (every row the base model). ``width``: rows padded to it per chunk, and ``pads`` chunks more."""
        if self.lora is None or all(c.lora < 0 for c in chunks):
            return None
        slots: list[int] = []
        for c in chunks:
            slots.extend([c.lora] * max(len(c.token_ids), width))
        slots.extend([-1] * (pads * width))
        return pack.add(np.asarray(slots, dtype=np.int64))

    @torch.inference_mode()
    def execute(
        self,
        batch: ForwardBatch,
        input_ids: torch.Tensor | None = None,  # [T] overrides batch.input_ids (tokens still on the device)
        skip: LayerSkip | None = None,
        hidden_layers: tuple[int, ...] = (),
        hidden_in: torch.Tensor | None = None,  # [T, ...] per-token features for a model that takes them
    ) -> ForwardOutput:
        ids = batch.input_ids if input_ids is None else input_ids
        if self.lora is not None:
            rows = ids.shape[0] if batch.graph is None else batch.positions.shape[0]
            self.lora.set_rows(batch.lora, rows, batch.lora_used)
        if batch.graph is not None:  # the output layer runs after the graph (see engine.runner.cuda_graphs)
            captured, final, at_logits = self.graphs.run(
                self._run, batch, ids, self.kv_cache, skip, hidden_layers, hidden_in,
                variant=None if self.lora is None else self.lora.graph_key(),
            )  # fmt: skip
            return ForwardOutput(self.model.compute_logits(at_logits), captured, final)
        logits, captured, final = self._run(
            ids, batch.positions, batch.meta, self.kv_cache, batch.logit_rows, skip, hidden_layers, hidden_in
        )
        return ForwardOutput(logits=logits, hidden_states=captured, final_hidden=final)

    def prepare_levels(self, chunks: list[ForwardChunk]) -> list[ForwardBatch]:
        """Causal chunks of one length ``L`` (one per sequence; their token ids are not read) as ``L``
        batches of one token per sequence, level ``d`` holding every chunk's token ``d``: the levels of
        greedy chains. One metadata build where the backend's metadata splits into levels (sdpa's
        ``levels()``), one per level otherwise."""
        L, B = len(chunks[0].token_ids), len(chunks)
        if self.attention_backend != "sdpa":
            one = lambda d: [ForwardChunk([0], c.ctx_len + d, c.block_table, 1, lora=c.lora) for c in chunks]  # noqa: E731
            return [self.prepare(one(d)) for d in range(L)]
        whole = self.prepare(chunks)
        ids, pos = whole.input_ids.view(B, L), whole.positions.view(B, L)
        lora = None if whole.lora is None else whole.lora.view(B, L)  # (the LoRA slot of each sequence's rows)
        rows = torch.arange(B, device=self.device)
        return [
            ForwardBatch(
                ids[:, d],
                pos[:, d],
                m,
                rows,
                B,
                B,
                lora=None if lora is None else lora[:, d],
                lora_used=whole.lora_used,
            )  # fmt: skip
            for d, m in enumerate(whole.meta.levels())
        ]

    def chain(
        self,
        batches: list[ForwardBatch],
        input_ids: torch.Tensor,  # [B] the first level's tokens, on the device
        temperature: torch.Tensor | None = None,  # [B] sampled chains (None: greedy)
        noise: torch.Tensor | None = None,  # [L, B, V] Exp(1) draws, one row per level and sequence
        skip: LayerSkip | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``len(batches)`` levels of chains in one call (see :class:`ChainForward`): level ``d``
        feeds one token per sequence with ``batches[d]``'s metadata (:meth:`prepare_levels`); returns
        each level's token ``[B, L]`` and, sampled, the ``q`` each was drawn from ``[B, L, V]``.
        Captured levels replay one graph each, still without a host sync between them, and so do the
        levels of a compiled chain whose graph is not warmed up yet (:meth:`warm_chains`)."""
        key = (len(batches), input_ids.shape[0] > 1, temperature is not None)
        # (Outside inference mode: the compiled forwards were warmed up on ordinary tensors, and guard
        # on it; a level passes on ordinary ones, which execute reads under inference mode.)
        deferred = self.defer_chains and self._chain is not self._eager[1] and key not in self._chains_ready
        if self.graphs is not None or deferred:
            out, qs = [], []
            for d, b in enumerate(batches):
                if self.graphs is None:  # (a level's positions are a column of all levels': a strided view)
                    b = dataclasses.replace(b, positions=b.positions.contiguous())
                logits = self.execute(b, input_ids, skip).logits
                input_ids, q = chain_pick(logits, temperature, None if noise is None else noise[d])
                out.append(input_ids)
                qs.append(q)
            return torch.stack(out, 1), None if noise is None else torch.stack(qs, 1)
        return self._fused_chain(batches, input_ids, temperature, noise, skip)

    @torch.inference_mode()
    def _fused_chain(self, batches, input_ids, temperature, noise, skip):
        if self.lora is not None:  # every level has the same rows: the sequences', in order
            self.lora.set_rows(batches[0].lora, batches[0].num_tokens, batches[0].lora_used)
        positions, metas = [b.positions for b in batches], [b.meta for b in batches]
        return self._chain(input_ids, positions, metas, self.kv_cache, skip, temperature, noise)

    def forward(
        self,
        chunks: list[ForwardChunk],
        skip: LayerSkip | None = None,
        hidden_layers: tuple[int, ...] = (),
    ) -> ForwardOutput:
        return self.execute(self.prepare(chunks), skip=skip, hidden_layers=hidden_layers)

    def warmup(self, hidden_layers: tuple[int, ...] = (), skip: LayerSkip | None = None, chain_levels: int = 0) -> None:
        """:meth:`warm_compiled`, then capture the CUDA graphs (:meth:`capture_graphs`), so that no
        request waits for either."""
        self.warm_compiled(hidden_layers, skip, chain_levels)
        self.capture_graphs(hidden_layers, skip)

    def warm_compiled(
        self,
        hidden_layers: tuple[int, ...] = (),
        skip: LayerSkip | None = None,
        chain_levels: int = 0,
        sampled_chains: bool = True,
        chains: bool = False,
    ) -> None:
        """Run the compiled forward once for each graph the step needs (one new token, several; with
        the hidden layers the step captures; with ``chains``, a chain's levels one forward each, as
        :meth:`chain` runs them until their graph is warm: a level's metadata is another graph's),
        then :meth:`warm_chains` of ``chain_levels``, so that they are compiled before a request calls
        them. Writes only the first blocks' slots, which every later forward overwrites before
        reading (a token's K/V is written before attention reads it); through a :meth:`compile_view`,
        only its scratch pool."""
        if not self.compiled:
            return
        compile_settings(self.device)  # this thread may not be the one that built the runner
        t0 = time.perf_counter()
        # The graph of several tokens, then a lone token's (see compile_forward).
        for n in (2, 1):
            blocks = list(range(-(-n // self.block_size)))
            self.forward([ForwardChunk([0] * n, 0, blocks, n)], skip=skip, hidden_layers=hidden_layers)
            if chains and self.defer_chains and self._chain is not self._eager[1]:  # (one level is a decode's)
                table = list(range(-(-3 // self.block_size)))
                batches = self.prepare_levels([ForwardChunk([0, 0], 1, table, 2)] * n)
                self.chain(batches, torch.zeros(n, dtype=torch.int64, device=self.device), skip=skip)
        logger.info("compiled %s forward in %.1fs", type(self.model).__name__, time.perf_counter() - t0)
        self.warm_chains(chain_levels, sampled_chains, skip)

    def warm_chains(self, chain_levels: int, sampled_chains: bool = True, skip: LayerSkip | None = None) -> bool:
        """Compile the chain graphs (see :meth:`chain`) of 1 .. ``chain_levels`` levels, for several
        sequences and for one, greedy, and sampled where ``sampled_chains`` (a drafter that never runs
        them does not pay for their graphs); each is used from the moment it is compiled (through a
        compile view: by its runner too). Each chain length is a graph of its own, traced through every
        level: most of a draft model's compile time. Returns whether it compiled any."""
        if not self.compiled or chain_levels < 1 or self._chain is self._eager[1]:
            return False
        compile_settings(self.device)
        t0 = time.perf_counter()
        # Deferred, the graph itself (chain would run it level by level until it is marked); else
        # through chain, which every rank of a sharded runner runs.
        run = self._fused_chain if self.defer_chains else self.chain
        for n in (2, 1):
            for levels in range(1, chain_levels + 1):  # n sequences of one token per level
                table = list(range(-(-(levels + 1) // self.block_size)))
                batches = self.prepare_levels([ForwardChunk([0] * levels, 1, table, levels)] * n)
                ids = torch.zeros(n, dtype=torch.int64, device=self.device)
                run(batches, ids, None, None, skip)
                self._chains_ready.add((levels, n > 1, False))
                if not sampled_chains:
                    continue
                temperature = torch.ones(n, device=self.device)
                noise = torch.ones(levels, n, self.vocab_size, device=self.device)
                run(batches, ids, temperature, noise, skip)
                self._chains_ready.add((levels, n > 1, True))
        logger.info("compiled %s chains in %.1fs", type(self.model).__name__, time.perf_counter() - t0)
        return True

    def capture_graphs(
        self, hidden_layers: tuple[int, ...] = (), skip: LayerSkip | None = None, features: int | None = None
    ) -> None:
        """With graphs, run (so capture) every shape warm-up covers (``CudaGraphs.warmup_shapes``), as
        the step will call it: with these hidden layers and skipped layers, and ``features``-wide
        per-token inputs for a model that takes them. Writes only the first blocks, as warmup does."""
        if self.graphs is None:
            return
        t0 = time.perf_counter()
        shapes = self.graphs.warmup_shapes()
        for n, width in shapes:  # n sequences of `width` tokens, in the first block(s)
            table = [b % self.num_blocks for b in range(-(-width // self.block_size))]
            batch = self.prepare([ForwardChunk([0] * width, 0, table, width)] * n)
            feats = None if features is None else torch.zeros(n * width, features, dtype=self.dtype, device=self.device)
            self.execute(batch, skip=skip, hidden_layers=hidden_layers, hidden_in=feats)
        self.synchronize()
        took = time.perf_counter() - t0
        logger.info("%s: %d graph shapes in %.1fs", type(self.model).__name__, len(shapes), took)

    @torch.inference_mode()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The model's token embeddings ``[T, hidden]`` (heads that read them: MTP)."""
        return self.model.embed(input_ids)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's output layer over final-normed states ``[N, hidden]`` → ``[N, vocab]`` float32."""
        return self.model.compute_logits(hidden)

    def lap(self) -> Lap:
        """Start timing device work (see engine.runner.timing): ``stop()`` it after launching the work."""
        return Lap(self.device)

    def synchronize(self) -> None:
        """Wait for the device."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
