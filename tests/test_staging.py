"""A forward's inputs in one copy from a pinned ring (engine/attention/staging.py): what the copy
hands over equals what was built, earlier sends survive the ring coming round, and a runner whose
inputs go through the ring (as on a GPU; forced here on the CPU) prepares the same batches, one copy
each, and computes the same logits, eager, compiled and chained, on both attention backends."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.attention.common import triton_interpreted
from engine.attention.staging import Staging, take_rows, to_device
from engine.runner.loader import load_config, load_model
from engine.runner.model_runner import ForwardBatch, ForwardChunk, ModelRunner
from engine.runner.readback import in_one_copy, to_host
from engine.sampling.tree import DraftTree, tree_layout

BS = 4


def mixed_arrays(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [
        rng.integers(-(2**40), 2**40, size=5, dtype=np.int64),
        rng.integers(0, 1000, size=(3, 2), dtype=np.int32),
        rng.integers(0, 255, size=7, dtype=np.uint8),
        rng.random((2, 1, 3)) < 0.5,
        np.zeros(0, dtype=np.int64),
        rng.random(4).astype(np.float32),
    ]


def test_one_send_hands_back_every_array_in_one_copy():
    staging = Staging("cpu", capacity=256, copy=True)
    arrays = mixed_arrays(0)
    out = staging.send(arrays)
    assert staging.num_copies == 1
    for a, t in zip(arrays, out):
        assert t.dtype == torch.from_numpy(a).dtype and tuple(t.shape) == a.shape
        assert np.array_equal(t.numpy(), a)
    # A copy, not the host's array: rewriting the array afterwards changes nothing sent.
    arrays[0][:] = 0
    assert out[0].abs().sum() > 0


def test_sends_survive_the_ring_coming_round_and_a_ring_too_small_grows():
    staging = Staging("cpu", capacity=128, copy=True)
    sent = [(arrays := mixed_arrays(i), staging.send(arrays)) for i in range(40)]  # ~10 times round
    for arrays, out in sent:
        for a, t in zip(arrays, out):
            assert np.array_equal(t.numpy(), a)
    big = np.arange(1000, dtype=np.int64)  # 8,000 bytes: past the ring
    (t,) = staging.send([big])
    assert np.array_equal(t.numpy(), big) and staging.host.numel() >= big.nbytes


def test_a_pack_is_read_after_it_is_sent_and_sent_once():
    pack = Staging("cpu", copy=True).pack()
    i = pack.add(np.arange(3))
    with pytest.raises(RuntimeError, match="after send"):
        pack[i]
    pack.send()
    assert pack.send() is pack and pack.staging.num_copies == 1
    with pytest.raises(RuntimeError, match="sent already"):
        pack.add(np.arange(2))
    with pytest.raises(TypeError, match="float64"):
        Staging("cpu").pack().add(np.zeros(2))


def test_on_a_cpu_arrays_are_handed_over_without_a_copy():
    staging = Staging("cpu")
    a = np.arange(4, dtype=np.int64)
    (t,) = staging.send([a])
    a[0] = 9
    assert t[0].item() == 9 and staging.num_copies == 0
    # An empty array's numpy strides are 0; a compiled forward guards on strides, so it gets a tensor's.
    (e,) = staging.send([np.zeros((0,), dtype=np.int64)])
    assert e.stride() == torch.empty(0, dtype=torch.int64).stride()


# -- a runner's forwards through the ring -------------------------------------------------------------
def test_take_rows_gathers_without_a_list_index():
    """A batch of decodes reads its logits as they are; other rows go by an index tensor (indexing a
    CUDA tensor with a list copies the list from pageable memory and waits for the device: the extra
    sync a GPU decode step once showed)."""
    logits = torch.randn(5, 11)
    assert take_rows(logits, [0, 1, 2, 3, 4]) is logits
    for rows in ([4, 0, 2], [0, 1, 2], [3, 3], []):
        assert torch.equal(take_rows(logits, rows), logits[rows])


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.bool])
def test_to_device_builds_what_torch_tensor_builds(dtype):
    values = {
        torch.int64: [[3, -(2**40), 7], [0, 1, 2]],
        torch.float32: [0.1, -2.5, 1e-30, 3.0],
        torch.bool: [True, False, True],
    }[dtype]
    got = to_device(values, "cpu", dtype)
    assert got.dtype == dtype and torch.equal(got, torch.tensor(values, dtype=dtype))
    assert to_device([], "cpu", dtype).shape == (0,)


def test_to_host_reads_several_tensors_as_each_tolist_would():
    """Each tensor back as its own ``tolist()``, through one transfer: shapes (a scalar, empty and
    nested ones included), ints past 2**31, bools, and float32, bfloat16 and float16 values exactly."""
    g = torch.Generator().manual_seed(0)
    ts = [
        torch.randn(3, 4, generator=g),
        torch.randint(-(2**40), 2**40, (2, 3, 2), generator=g),
        torch.tensor(5),
        torch.zeros(2, 0, dtype=torch.int64),
        torch.tensor([True, False]),
        torch.randn(2, 2, generator=g).bfloat16(),
        torch.randn(3, generator=g).half(),
        torch.empty(0, 3),
    ]
    for got in (in_one_copy(ts), to_host(*ts)):  # the transfer a GPU makes; a CPU's tolist() apiece
        assert len(got) == len(ts)
        for t, values in zip(ts, got):
            assert values == t.tolist() and type(values) is type(t.tolist())
        assert type(got[1][0][0][0]) is int and type(got[4][0]) is bool and type(got[0][0][0]) is float
    assert to_host() == []


def runner(path, copy: bool, compiled: bool = False, backend: str = "sdpa") -> ModelRunner:
    cfg = load_config(path)
    model = load_model(path, cfg, torch.float32, torch.device("cpu"), 128, pack=not compiled)
    cpu = torch.device("cpu")
    r = ModelRunner(model, cfg, cpu, torch.float32, BS, 40, compile=compiled, attention_backend=backend, freeze=False)
    if copy:
        r.staging = Staging(r.device, capacity=512, copy=True)  # small: the ring comes round in these tests
    return r


def steps(prompts: list[list[int]], tables: list[list[int]]) -> list[list[ForwardChunk]]:
    """A prefill, a decode, a draft tree's verify beside a decode, and a decode again."""
    tree = DraftTree(tokens=[11, 12, 13], parents=[-1, -1, 0])
    mask = tree_layout(tree).mask
    lens = [len(p) for p in prompts]
    return [
        [ForwardChunk(p, 0, t, 1) for p, t in zip(prompts, tables)],
        [ForwardChunk([7], n, t, 1) for n, t in zip(lens, tables)],
        [ForwardChunk([8, 11, 12, 13], lens[0] + 1, tables[0], 4, [lens[0] + d for d in (1, 2, 2, 3)], mask)]
        + [ForwardChunk([8], n + 1, t, 1) for n, t in zip(lens[1:], tables[1:])],
        [ForwardChunk([9], n + 5, t, 1) for n, t in zip(lens, tables)],
    ]


def fields(b: ForwardBatch) -> dict[str, object]:
    out = {"input_ids": b.input_ids, "positions": b.positions, "logit_rows": b.logit_rows}
    for name, v in vars(b.meta).items():
        out[f"meta.{name}"] = v
    return out


def assert_same_batch(got: ForwardBatch, want: ForwardBatch) -> None:
    g, w = fields(got), fields(want)
    assert g.keys() == w.keys()
    for name in w:
        if isinstance(w[name], torch.Tensor):
            assert torch.equal(g[name], w[name]), name
            assert g[name].shape == w[name].shape and g[name].dtype == w[name].dtype, name
        else:
            assert g[name] == w[name], name


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37, 38]]
TABLES = [[3, 9, 4, 12], [1, 7, 10], [2, 5, 14, 6]]


# triton: its kernel in Triton's interpreter, on CPU tensors (conftest sets it where there is no CUDA;
# where there is, tests/test_gpu_speculation.py and the GPU test below run it compiled).
TRITON_ON_CPU = pytest.param(
    "triton", marks=pytest.mark.skipif(not triton_interpreted(), reason="Triton's interpreter is off (a CUDA machine)")
)


@pytest.mark.parametrize("backend", ["sdpa", TRITON_ON_CPU])
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MistralForCausalLM"])  # Mistral: a sliding window
def test_a_runner_through_the_ring_prepares_the_same_batches_one_copy_each(model_dirs, arch, backend):
    a, b = runner(model_dirs[arch], copy=False, backend=backend), runner(model_dirs[arch], copy=True, backend=backend)
    for chunks in steps(PROMPTS, TABLES):
        before = b.staging.num_copies
        got, want = b.prepare(chunks), a.prepare(chunks)
        assert b.staging.num_copies == before + 1  # ids, positions, rows and the metadata: one copy
        assert_same_batch(got, want)
        torch.testing.assert_close(b.execute(got).logits, a.execute(want).logits, atol=0, rtol=0)
    torch.testing.assert_close(b.kv_cache, a.kv_cache, atol=0, rtol=0)


def test_the_comparison_can_fail(model_dirs):
    """A batch off by one position is caught by the same check."""
    r = runner(model_dirs["LlamaForCausalLM"], copy=True)
    chunks = steps(PROMPTS, TABLES)[1]
    shifted = [ForwardChunk(c.token_ids, c.ctx_len, c.block_table, 1, [c.ctx_len + 1]) for c in chunks]
    with pytest.raises(AssertionError, match="positions"):
        assert_same_batch(r.prepare(shifted), r.prepare(chunks))


def test_compiled_and_chained_forwards_read_the_ring_as_they_read_arrays(model_dirs):
    """A compiled forward takes the ring's slices of one device tensor (views of one buffer) as it
    takes separate tensors: the same logits and chains, and no recompilation once warm."""
    path = model_dirs["LlamaForCausalLM"]
    a, b = runner(path, copy=False, compiled=True), runner(path, copy=True, compiled=True)
    for r in (a, b):
        for chunks in steps(PROMPTS, TABLES)[:2]:
            r.forward(chunks)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for n in (1, 2):
        chunks = [ForwardChunk([9], len(p) + n, t, 1) for p, t in zip(PROMPTS, TABLES)]
        torch.testing.assert_close(b.forward(chunks).logits, a.forward(chunks).logits, atol=1e-5, rtol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    levels = [ForwardChunk([0] * 3, len(p) + 2, t, 3) for p, t in zip(PROMPTS, TABLES)]
    ids = torch.tensor([4, 5, 6])
    want = a.chain(a.prepare_levels(levels), ids)[0]
    got = b.chain(b.prepare_levels(levels), ids)[0]
    assert torch.equal(got, want)


@pytest.mark.gpu
def test_on_a_gpu_a_forward_copies_its_inputs_once_from_pinned_memory(model_dirs):
    path = model_dirs["LlamaForCausalLM"]
    cfg = load_config(path)
    dev = torch.device("cuda")
    model = load_model(path, cfg, torch.float32, dev, 128)
    r = ModelRunner(model, cfg, dev, torch.float32, BS, 40, attention_backend="triton")
    assert r.staging.copy and r.staging.host.is_pinned()
    for chunks in steps(PROMPTS, TABLES):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            r.prepare(chunks)
            torch.cuda.synchronize()
        copies = [e for e in prof.events() if "Memcpy HtoD" in e.name]
        assert len(copies) == 1, [e.name for e in copies]
