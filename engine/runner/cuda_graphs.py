"""Static-shape forwards, captured as CUDA graphs: decode, draft levels and verify without launch cost.

Eager decoding on a GPU is launch-bound at small batches: an 8B model's step is about a thousand
kernels, whose launches take longer than their work. A CUDA graph records a forward's kernels once
and replays them in one launch. The price is fixed shapes and fixed addresses:

- *Shapes.* A batch qualifies when each sequence feeds at most ``width`` new tokens (one for decode
  and draft levels, the nodes plus the root for a verify) and any tree mask covers its new tokens
  only. Its sequences are padded up to a batch bucket (1, 2, 4, then multiples of 8) and each
  sequence's tokens up to a width bucket (powers of two), at most :data:`MAX_GRAPH_TOKENS` in all,
  and at most twice the real tokens unless within :data:`FREE_TOKENS` (a few decodes beside a
  prompt chunk run as they are, not as a batch of prompt-wide rows).
  A padding sequence or token writes its K/V to a scratch slot past the pool's blocks, no real token
  sees it (its tree-mask column is zero, or it comes after the real tokens), and its outputs are
  dropped.
- *Addresses.* The inputs live in static buffers, one set per runner shared by its graphs (graphs run
  one at a time, and each replay loads its own inputs first); the outputs are the graph's own. A
  replay copies the step's metadata in (a few small device copies), replays, and gathers the real
  rows out into new tensors, so that nothing a caller holds is overwritten by a later replay.

A graph runs the model up to its final-normed hidden states (and the layers proposers read): the
output layer runs after it on the rows needing logits only, so no graph keeps a ``[tokens, vocab]``
block. Every graph captures the union of the hidden layers asked for so far (a new layer drops the
graphs, to be captured again). Warm-up captures every shape, the largest first, so that serving
never waits for a capture (nor for ``torch.cuda.graph``'s sync and cache release); a shape not seen
there is captured on first use. All graphs of a runner share one memory pool. Only the triton backend's metadata has
static shapes (it is the GPU backend). On a CPU nothing is captured: the same padded forward on the
static buffers runs directly, which is how the tests check everything but the capture itself.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, field

import torch

from engine.attention.triton_paged import SEQ_FIELDS, TritonMetadata, key_splits, programs_per_sequence

logger = logging.getLogger(__name__)

MAX_GRAPH_TOKENS = 512  # padded tokens of the largest captured forward
MAX_GRAPH_WIDTH = 64  # most new tokens of one sequence in a captured forward
FREE_TOKENS = 64  # padded tokens a forward may have whatever its real ones (a GPU step costs the same)


def batch_buckets(max_seqs: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, then every multiple of 8 below ``max_seqs``, and ``max_seqs``."""
    return [b for b in (1, 2, 4) if b < max_seqs] + [b for b in range(8, max_seqs, 8)] + [max_seqs]


def width_buckets() -> list[int]:
    return [1 << i for i in range(MAX_GRAPH_WIDTH.bit_length()) if 1 << i <= MAX_GRAPH_WIDTH]


@dataclass
class GraphShape:
    """How a prepared batch maps onto a captured shape: ``num_seqs`` x ``width`` padded tokens."""

    num_seqs: int
    width: int
    token_rows: torch.Tensor  # [T] int64: each real token's row in the padded batch, in batch order
    logit_rows: torch.Tensor  # [N] int64: the padded rows of the tokens needing logits


@dataclass
class _Graph:
    outputs: tuple  # (captured {layer: [Tp, hidden]}, final hidden [Tp, hidden])
    graph: torch.cuda.CUDAGraph | None = None  # None on a CPU: the forward runs on the static buffers


@dataclass
class _StaticInputs:
    """Every input a captured forward reads, at the largest shape; graphs use their leading part."""

    input_ids: torch.Tensor  # [MAX_GRAPH_TOKENS] int64
    positions: torch.Tensor  # [MAX_GRAPH_TOKENS] int64
    no_rows: torch.Tensor  # [0] int64: the rows the graph computes logits of (none: see the module docstring)
    slot_mapping: torch.Tensor  # [MAX_GRAPH_TOKENS] int64
    block_tables: torch.Tensor  # [max_seqs, table_width] int32
    seq_info: torch.Tensor  # [max_seqs, SEQ_FIELDS] int32
    programs: torch.Tensor  # [MAX_GRAPH_TOKENS, 2] int32
    masks: torch.Tensor  # [MAX_GRAPH_TOKENS * MAX_GRAPH_WIDTH] uint8
    hidden_in: dict = field(default_factory=dict)  # (trailing shape, dtype) → [MAX_GRAPH_TOKENS, ...]


class CudaGraphs:
    """The captured forwards of one model runner (see the module docstring)."""

    def __init__(self, device: torch.device, max_seqs: int, num_blocks: int, block_size: int, num_kv_heads: int):
        self.device = device
        self.capture = device.type == "cuda"
        self.scratch_slot = num_blocks * block_size  # the block past the pool's (allocated by the runner)
        self.max_kv_len = num_blocks * block_size
        self.num_kv_heads = num_kv_heads
        table_width = num_blocks + MAX_GRAPH_WIDTH // block_size + 1  # a padded sequence's blocks at most
        self.buckets = [b for b in batch_buckets(max_seqs) if b <= MAX_GRAPH_TOKENS]
        self.widths = width_buckets()
        T, B = MAX_GRAPH_TOKENS, self.buckets[-1]
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.static = _StaticInputs(
            input_ids=torch.zeros(T, **i64),
            positions=torch.zeros(T, **i64),
            no_rows=torch.zeros(0, **i64),
            slot_mapping=torch.full((T,), self.scratch_slot, **i64),
            block_tables=torch.zeros(B, table_width, **i32),
            seq_info=torch.zeros(B, SEQ_FIELDS, **i32),
            programs=torch.zeros(T, 2, **i32),
            masks=torch.zeros(T * MAX_GRAPH_WIDTH, dtype=torch.uint8, device=device),
        )
        self.graphs: dict[tuple, _Graph] = {}
        self.hidden_layers: tuple[int, ...] = ()  # what every graph captures (see the module docstring)
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None

    def shape_for(self, q_lens: list[int], tree_reaches_back: bool) -> tuple[int, int] | None:
        """The padded (sequences, width) a batch runs at, or None where it runs as it is (too many
        sequences or tokens, too much padding, or a tree mask over keys before its new tokens)."""
        if tree_reaches_back or min(q_lens) == 0:
            return None
        q = max(q_lens)
        num_seqs = next((b for b in self.buckets if b >= len(q_lens)), None)
        width = next((w for w in self.widths if w >= q), None)
        if num_seqs is None or width is None or num_seqs * width > MAX_GRAPH_TOKENS:
            return None
        if num_seqs * width > max(FREE_TOKENS, 2 * sum(q_lens)):
            return None
        return num_seqs, width

    def warmup_shapes(self) -> list[tuple[int, int]]:
        """The shapes warm-up runs, the largest first: every one where graphs are captured; off CUDA,
        where nothing is, decode at each batch bucket."""
        widths = self.widths if self.capture else [1]
        shapes = [(b, w) for b in self.buckets for w in widths if b * w <= MAX_GRAPH_TOKENS]
        return sorted(shapes, key=lambda s: s[0] * s[1], reverse=True)

    def key_splits(self, num_seqs: int, width: int) -> int:
        """Key ranges per kernel program at a (sequences, width) shape: fixed per shape (a graph's
        launch grid is), chosen for the longest context the pool holds (shorter ones leave ranges empty)."""
        programs = num_seqs * programs_per_sequence(width) * self.num_kv_heads
        return key_splits(programs, num_seqs * width, self.max_kv_len, self.device)

    def run(self, fn, batch, input_ids, kv_cache, skip, hidden_layers, hidden_in, variant=None):
        """Load ``batch`` (padded by the runner's prepare) into the static buffers, replay its shape's
        graph (capturing it first if new), and return the hidden layers asked for and the final hidden
        states at the real rows, and the final hidden states at the rows needing logits. ``variant``:
        what else the forward's kernels depend on (LoRA slots: :meth:`engine.lora.LoraSlots.graph_key`),
        a graph of its own for each."""
        shape: GraphShape = batch.graph
        if not set(hidden_layers) <= set(self.hidden_layers):
            self.hidden_layers = tuple(sorted({*self.hidden_layers, *hidden_layers}))
            self.graphs.clear()
            if self.capture:  # the old graphs' memory pool is released with them: record into a new one
                self.pool = torch.cuda.graph_pool_handle()
        sig = None if hidden_in is None else (tuple(hidden_in.shape[1:]), hidden_in.dtype)
        key = (shape.num_seqs, shape.width, skip, sig, variant)
        args = self._load(batch, input_ids, hidden_in, sig)
        static_args = (*args, kv_cache, self.static.no_rows, skip, self.hidden_layers)
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._capture(fn, static_args, key)
        elif g.graph is not None:
            g.graph.replay()
        else:
            g.outputs = self._call(fn, static_args)
        captured, final = g.outputs
        rows = shape.token_rows
        return (
            {layer: captured[layer].index_select(0, rows) for layer in hidden_layers},
            final.index_select(0, rows),
            final.index_select(0, shape.logit_rows),
        )

    def _load(self, batch, input_ids, hidden_in, sig):
        """Copy the batch's inputs into the static buffers; the padded metadata over them."""
        s, meta, shape = self.static, batch.meta, batch.graph
        T = shape.num_seqs * shape.width
        s.input_ids.index_copy_(0, shape.token_rows, input_ids)
        s.positions[:T].copy_(batch.positions)
        for name in ("slot_mapping", "block_tables", "seq_info", "programs", "masks"):
            src = getattr(meta, name)
            getattr(s, name)[tuple(slice(0, n) for n in src.shape)].copy_(src)
        static_in = None
        if sig is not None:
            if sig not in s.hidden_in:
                s.hidden_in[sig] = torch.zeros(MAX_GRAPH_TOKENS, *sig[0], dtype=sig[1], device=self.device)
            static_in = s.hidden_in[sig][:T]
            static_in.index_copy_(0, shape.token_rows, hidden_in)
        static_meta = TritonMetadata(
            slot_mapping=s.slot_mapping[:T],
            block_tables=s.block_tables[: shape.num_seqs],
            seq_info=s.seq_info[: shape.num_seqs],
            programs=s.programs[: meta.programs.shape[0]],
            positions=s.positions[:T],
            masks=s.masks,
            block_size=meta.block_size,
            block_q=meta.block_q,
            sliding_window=meta.sliding_window,
            max_kv_len=meta.max_kv_len,
            num_splits=meta.num_splits,
            num_seqs=shape.num_seqs,
        )
        return s.input_ids[:T], s.positions[:T], static_meta, static_in

    @staticmethod
    def _call(fn, static_args):
        """The forward with no logit rows: its captured layers and final hidden states."""
        ids, pos, meta, hidden_in, kv_cache, no_rows, skip, hidden_layers = static_args
        _, captured, final = fn(ids, pos, meta, kv_cache, no_rows, skip, hidden_layers, hidden_in)
        return captured, final

    def _capture(self, fn, static_args, key) -> _Graph:
        """Run the forward once (this batch's real result, and Triton's compilation), then record it."""
        if not self.capture:
            return _Graph(self._call(fn, static_args))
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._call(fn, static_args)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # No garbage collection mid-capture: an unreachable graph of an earlier runner (engines hold
        # reference cycles), freed there, would reset on the capturing stream, which CUDA refuses.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = self._call(fn, static_args)
        finally:
            if gc_was_enabled:
                gc.enable()
        graph.replay()  # the capture ran nothing: this is the batch's result
        logger.info("captured a CUDA graph: %d sequences x %d tokens", key[0], key[1])
        return _Graph(outputs, graph)
