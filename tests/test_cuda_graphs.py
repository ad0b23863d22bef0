"""Captured-shape forwards (engine/runner/cuda_graphs.py): batches padded to a batch bucket and a width bucket,
run on static buffers, give the unpadded forward's logits, hidden states and KV pool.

Without CUDA (Triton's interpreter, as conftest sets) nothing is captured: everything but the capture
runs: the padding, the scratch slot, the loads into the static buffers and the gathers out. The
GPU-marked test captures real graphs and replays them on new inputs."""

from __future__ import annotations

import pytest
import torch
from test_engine import make_engine, prompts

from conftest import build_model_dir
from engine.config import EngineConfig
from engine.request.sampling_params import SamplingParams
from engine.runner.cuda_graphs import MAX_GRAPH_TOKENS, MAX_GRAPH_WIDTH, CudaGraphs, batch_buckets
from engine.runner.model_runner import ForwardChunk

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BS = 4  # block size (make_engine's)


@pytest.fixture
def graphs_everywhere(monkeypatch):
    """Engines capture (on a CPU: run on static buffers) as they would on a GPU."""
    monkeypatch.setattr(EngineConfig, "cuda_graph_max_seqs", property(lambda self: self.max_num_seqs))


def runners(model_dir, pick=lambda engine: engine.runner, **kw):
    """The same model twice on the triton backend: without graphs, and with them (buckets 1, 2, 4);
    ``pick`` chooses the engine's runner (the target's, or its proposer's)."""
    kw.setdefault("max_num_seqs", 4)
    with pytest.MonkeyPatch.context() as m:  # (on a GPU engines capture by default)
        m.setattr(EngineConfig, "cuda_graph_max_seqs", property(lambda self: 0))
        eager = pick(make_engine(model_dir, device=str(DEVICE), attention_backend="triton", **kw))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(EngineConfig, "cuda_graph_max_seqs", property(lambda self: self.max_num_seqs))
        graphed = pick(make_engine(model_dir, device=str(DEVICE), attention_backend="triton", **kw))
    assert eager.graphs is None and graphed.graphs is not None
    return eager, graphed


# On CUDA, warm-up captures every shape on the first blocks, up to a sequence of MAX_GRAPH_WIDTH tokens
# (garbage K/V that a sequence given those blocks overwrites before reading); the tests keep clear of them.
WARM_BLOCKS = MAX_GRAPH_WIDTH // BS


def table(seq: int) -> list[int]:
    return list(range(WARM_BLOCKS + 10 * seq, WARM_BLOCKS + 10 + 10 * seq))  # 40 slots each


def tree_mask(q: int, seed: int) -> torch.Tensor:
    """A random ancestor-style mask: lower-triangular with the diagonal set."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(q, q, generator=g) < 0.5
    return (m.tril() | torch.eye(q, dtype=torch.bool)).contiguous()


def steps(ctx: list[list[int]], seed: int) -> list[list[ForwardChunk]]:
    """Prefill chunks, one decode step, then a verify of ragged trees (one causal), each a batch."""
    g = torch.Generator().manual_seed(seed)
    tok = lambda n: torch.randint(3, 200, (n,), generator=g).tolist()  # noqa: E731
    n = [len(c) for c in ctx]
    out = [[ForwardChunk(c, 0, table(s), 1) for s, c in enumerate(ctx)]]
    out.append([ForwardChunk(tok(1), n[s], table(s), 1) for s in range(len(ctx))])
    widths = [3, 5, 1][: len(ctx)]
    verify = []
    for s, w in enumerate(widths):
        pos = [n[s] + 1 + i for i in range(w)] if s != 1 else [n[s] + 1] + [n[s] + 2] * (w - 1)
        mask = tree_mask(w, seed + s) if s == 1 else None
        verify.append(ForwardChunk(tok(w), n[s] + 1, table(s), w, pos, mask))
    out.append(verify)
    return out


def pool(runner) -> torch.Tensor:
    """The pool's blocks past those warm-up writes (which these tests never use)."""
    return runner.kv_cache[:, :, WARM_BLOCKS * runner.block_size : runner.num_blocks * runner.block_size].cpu()


def test_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(1) == [1]


def test_padded_forwards_match_the_unpadded_ones(llama_dir):
    eager, graphed = runners(llama_dir)
    ctx = prompts(3, seed=2, lo=5, hi=12)
    for round_, seed in enumerate((7, 8)):  # the second round replays the shapes the first captured
        if round_:
            ctx = [[t + 1 for t in c] for c in ctx]
        for chunks in steps(ctx, seed):
            batches = [r.prepare(chunks) for r in (eager, graphed)]
            assert batches[0].graph is None
            shape = batches[1].graph
            assert shape is not None and shape.num_seqs == 4  # 3 sequences → the bucket of 4
            pad = batches[1].meta.slot_mapping.view(shape.num_seqs, shape.width).cpu()
            real = [[i < len(c.token_ids) for i in range(shape.width)] for c in chunks]
            real = torch.tensor(real + [[False] * shape.width])  # one padding sequence
            assert (pad[~real] == graphed.graphs.scratch_slot).all()
            outs = [r.execute(b, hidden_layers=(0,)) for r, b in zip((eager, graphed), batches)]
            torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(outs[1].hidden_states[0], outs[0].hidden_states[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(outs[1].final_hidden, outs[0].final_hidden, atol=1e-5, rtol=1e-5)
            # Padding wrote the scratch slot only: the pool's blocks hold the same K/V.
            torch.testing.assert_close(pool(graphed), pool(eager), atol=1e-5, rtol=1e-5)
    # Asking for layer 0 dropped warm-up's graphs (decode at each bucket, without it); since then:
    # prefill width 16, decode width 1, verify width 8 at the bucket of 4, each capturing layer 0.
    assert graphed.graphs.hidden_layers == (0,)
    assert {(k[0], k[1]) for k in graphed.graphs.graphs} == {(4, 16), (4, 1), (4, 8)}


def test_input_ids_and_features_from_the_device(llama_dir, tmp_path, monkeypatch):
    """Tokens and per-token features fed from the device (an EAGLE head's drafting level: its tokens,
    its parents' states) land at their padded rows."""
    from test_eagle import write_eagle

    import engine.core.llm_engine as llm_engine_mod

    # Only the head's runners are used: the controller's timed cost profile (seconds of forwards in
    # Triton's interpreter) is not needed.
    monkeypatch.setattr(llm_engine_mod, "profile_costs", lambda *args: None)
    head = write_eagle(llama_dir, tmp_path / "head")
    spec = dict(speculative_method="eagle", draft_model=str(head), num_speculative_tokens=3)
    eager, graphed = runners(llama_dir, pick=lambda engine: engine.proposer.runner, **spec)
    ctx = prompts(2, seed=3, lo=6, hi=9)
    g = torch.Generator().manual_seed(3)
    for chunks in steps(ctx, 4)[:2]:
        ids = torch.tensor([t for c in chunks for t in c.token_ids], device=DEVICE).flip(0)
        feats = torch.randn(len(ids), eager.hf_config.hidden_size, generator=g).to(DEVICE)
        batches = [r.prepare(chunks) for r in (eager, graphed)]
        assert batches[0].graph is None and batches[1].graph is not None
        outs = [r.execute(b, input_ids=ids, hidden_in=feats) for r, b in zip((eager, graphed), batches)]
        torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(outs[1].final_hidden, outs[0].final_hidden, atol=1e-5, rtol=1e-5)
        shape = batches[1].graph  # run through the graph of this shape with the features' static buffer
        assert (shape.num_seqs, shape.width, None, (tuple(feats.shape[1:]), feats.dtype), None) in graphed.graphs.graphs
    # The features count: the last step again with other features (the same tokens) gives other logits.
    other = graphed.execute(graphed.prepare(chunks), input_ids=ids, hidden_in=feats.flip(0)).logits
    assert not torch.allclose(other, outs[1].logits, atol=1e-3)


def test_batches_without_a_captured_shape_run_as_they_are(llama_dir):
    _, graphed = runners(llama_dir, num_kv_blocks=512)
    # A tree mask over keys before its new tokens (a draft tree's cached levels).
    back = ForwardChunk([5, 6], 4, table(0), 2, [4, 5], torch.ones(2, 4, dtype=torch.bool), 2)
    assert graphed.prepare([back]).graph is None
    # More tokens than the largest captured forward.
    assert graphed.prepare([ForwardChunk([5] * (MAX_GRAPH_TOKENS + 1), 0, list(range(1, 300)), 1)]).graph is None
    assert graphed.prepare([ForwardChunk([5] * 64, 0, table(0) + table(1), 1)]).graph is not None
    # A prompt chunk beside decodes: 4 rows of 64 tokens for 43 real ones is too much padding.
    decodes = [ForwardChunk([5], 8, table(s), 1) for s in (1, 2, 3)]
    assert graphed.prepare([ForwardChunk([5] * 40, 0, table(0), 1), *decodes]).graph is None
    assert graphed.prepare([ForwardChunk([5] * 12, 0, table(0), 1), *decodes]).graph is not None  # 64 tokens


def test_warmup_captures_every_shape_the_largest_first():
    # The shapes are the graphs' own (a runner at 64 sequences makes these, then runs each of them at
    # warm-up: in Triton's interpreter here, minutes of a CPU that say nothing the list does not).
    g = CudaGraphs(torch.device("cpu"), max_seqs=64, num_blocks=64, block_size=BS, num_kv_heads=2)
    g.capture = False  # where nothing is captured (off CUDA), warm-up runs decode only
    assert g.warmup_shapes() == [(64, 1), (56, 1), (48, 1), (40, 1), (32, 1), (24, 1), (16, 1), (8, 1), (4, 1),
                                 (2, 1), (1, 1)]  # fmt: skip
    g.capture = True  # what a CUDA runner warms up (not run here)
    shapes = g.warmup_shapes()
    sizes = [b * w for b, w in shapes]
    assert sizes == sorted(sizes, reverse=True) and max(sizes) == MAX_GRAPH_TOKENS
    assert set(shapes) == {(b, w) for b in g.buckets for w in g.widths if b * w <= MAX_GRAPH_TOKENS}
    assert (1, 64) in shapes and (64, 8) in shapes and (64, 16) not in shapes


@pytest.mark.parametrize(
    "method,topk", [("draft", 1), ("draft", 2), ("eagle", 2), ("layer-skip", 1)],
    ids=["draft-chains", "draft-trees", "eagle-trees", "layer-skip"],
)  # fmt: skip
def test_speculating_engine_on_graphs_decodes_like_plain(
    llama_dir, tmp_path, tokenizer_dir, graphs_everywhere, method, topk
):
    """Target and proposer on captured shapes (a draft model's greedy chains level by level, or
    trees; an EAGLE head's features in a static buffer; the target with layers skipped, a key of its
    own): plain decoding's tokens."""
    if method == "eagle":
        from test_eagle import write_eagle

        draft = write_eagle(llama_dir, tmp_path / "head")
    else:
        draft = build_model_dir(tmp_path / "draft", tokenizer_dir, "LlamaForCausalLM", seed=5, num_hidden_layers=1)
    ps = prompts(3, seed=4, lo=10, hi=30)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, num_draft_tokens=3)
    with pytest.MonkeyPatch.context() as m:  # the reference: eager
        m.setattr(EngineConfig, "cuda_graph_max_seqs", property(lambda self: 0))
        plain = make_engine(llama_dir, device=str(DEVICE)).generate(ps, params)
    spec = make_engine(
        llama_dir, device=str(DEVICE), attention_backend="triton", speculative_method=method,
        draft_model=None if method == "layer-skip" else str(draft), num_speculative_tokens=3, spec_tree_topk=topk,
        max_num_seqs=4,
    )  # fmt: skip
    got = spec.generate(ps, params)
    assert [o.outputs[0].delta_token_ids for o in got] == [o.outputs[0].delta_token_ids for o in plain]
    assert spec.spec_stats.num_draft_tokens > 0
    assert spec.proposer.runner.graphs.graphs
    if method == "layer-skip":  # its runner is the target's: graphs with the skip set in their key
        assert any(k[2] is not None for k in spec.runner.graphs.graphs)
    else:
        assert spec.runner.graphs.graphs
    if method == "eagle":  # the head's features ride in a static buffer of their own
        assert any(k[3] is not None for k in spec.proposer.runner.graphs.graphs)


@pytest.mark.gpu
def test_captured_graphs_replay_new_inputs_on_gpu(llama_dir):
    """On CUDA: graphs are captured, and replays on later batches of the same shapes match eager runs."""
    eager, graphed = runners(llama_dir)
    ctx = prompts(3, seed=2, lo=5, hi=12)
    for seed in (7, 8, 9):
        ctx = [[t + 1 for t in c] for c in ctx]
        for chunks in steps(ctx, seed):
            outs = [r.execute(r.prepare(chunks)) for r in (eager, graphed)]
            torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(pool(graphed), pool(eager), atol=1e-5, rtol=1e-5)
    assert all(g.graph is not None for g in graphed.graphs.graphs.values())


def test_graphs_are_on_for_cuda_only_and_off_with_enforce_eager(monkeypatch):
    from server.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["generate", "--model", "m", "--enforce-eager", "--prompt", "x"])
    assert engine_config_from_args(args).enforce_eager
    assert EngineConfig(model="m", device="cpu", max_num_seqs=24).cuda_graph_max_seqs == 0
    monkeypatch.setattr(EngineConfig, "torch_device", property(lambda self: torch.device("cuda")))
    assert EngineConfig(model="m", max_num_seqs=24).cuda_graph_max_seqs == 24
    assert EngineConfig(model="m", max_num_seqs=24, enforce_eager=True).cuda_graph_max_seqs == 0
