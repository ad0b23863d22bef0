"""A request's output depends on nothing but the request (``--batch-invariant``, on by default on CPUs):
its greedy tokens and its seeded samples are the same alone and in batches of any size, beside other
requests' prefill chunks and decodes, under a small step budget (its prompt prefilled in other chunks),
after preemption and with its prompt's KV from the prefix cache, with every speculative method at a
pinned depth, and through the server with concurrent clients; in bfloat16 and in float32. The shipped
demo target is the model (real weights: a random tiny model's logits are too far apart for the last
bits to change a token). And the control: the same checks with the batch-variant kernels (``off``) find
outputs that differ, so they could catch a kernel that breaks the promise."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from test_dflash import write_dflash
from test_eagle import write_eagle
from test_medusa import write_heads as write_medusa
from test_mtp import write_heads as write_mtp

from engine.assets import shipped_demo
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.request.sampling_params import SamplingParams
from engine.runner.model_runner import ForwardChunk
from server.app import ServerSettings, create_app
from servers import Served, engine_factory, serve

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DEMO = shipped_demo()
if DEMO is None:  # pragma: no cover - a checkout without the shipped pair
    pytest.skip("the shipped demo pair is missing", allow_module_level=True)
TARGET, DRAFT = DEMO / "target", DEMO / "draft"
PROMPTS = [json.loads(line)["prompt"] for line in (DEMO / "prompts.jsonl").read_text().splitlines()[:12]]
TOKENS = 24
PARAMS = {"greedy": SamplingParams(temperature=0.0, max_tokens=TOKENS),
          "seeded": SamplingParams(temperature=0.8, seed=11, max_tokens=TOKENS)}  # fmt: skip


def make(dtype: str, invariant: str = "on", **kw) -> LLMEngine:
    kw.setdefault("speculative_method", "none")
    kw.setdefault("compile", "off")
    return LLMEngine(EngineConfig(model=str(TARGET), device="cpu", dtype=dtype, batch_invariant=invariant, **kw))


def run(eng: LLMEngine, ids: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].delta_token_ids for o in eng.generate(ids, params)]


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def ids() -> list[list[int]]:
    eng = make("float32", "off")
    return [eng.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def alone(dtype, ids) -> dict[str, list[list[int]]]:
    """Each prompt's output with nothing else in the engine."""
    eng = make(dtype)
    assert eng.batch_invariant
    return {name: [run(eng, [i], p)[0] for i in ids] for name, p in PARAMS.items()}


def staggered(eng: LLMEngine, ids: list[list[int]], params: SamplingParams, every: int = 2) -> list[list[int]]:
    """The prompts added a few steps apart: each one's prefill shares steps with the others' decodes."""
    outs: dict[str, list[int]] = {}
    pending = list(enumerate(ids))
    steps = 0
    while pending or eng.has_unfinished_requests():
        if pending and steps % every == 0:
            i, prompt = pending.pop(0)
            eng.add_request(f"r{i}", prompt, params)
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.outputs[0].delta_token_ids)
        steps += 1
    return [outs[f"r{i}"] for i in range(len(ids))]


@pytest.mark.parametrize("name", list(PARAMS))
def test_batches_of_any_size_mixed_with_prefills_and_decodes(dtype, ids, alone, name):
    eng = make(dtype)
    params = PARAMS[name]
    for size in (2, 5, len(ids)):
        assert run(eng, ids[:size], params) == alone[name][:size], size
    assert staggered(eng, ids, params) == alone[name]
    assert staggered(eng, ids[::-1], params, every=3) == alone[name][::-1]


@pytest.mark.parametrize("name", list(PARAMS))
def test_chunked_prefill_preemption_and_prefix_cache(dtype, ids, alone, name):
    params = PARAMS[name]
    chunked = make(dtype, max_num_batched_tokens=48)  # prompts prefilled over several steps, split anyhow
    assert run(chunked, ids, params) == alone[name]
    small = make(dtype, num_kv_blocks=48, block_size=16, max_model_len=768)  # requests preempted, recomputed
    assert run(small, ids, params) == alone[name]
    assert small.scheduler.num_preemptions > 0
    cached = make(dtype)
    run(cached, ids, params)
    assert run(cached, ids, params) == alone[name]  # the prompts' KV from the prefix cache now


def forwards(eng: LLMEngine, ids: list[list[int]]) -> list[torch.Tensor]:
    """Raw forwards' logits: a prompt's prefill alone, three prompts together (one again in part), then
    decodes of one token and of three sequences at once (each forward writes its tokens' K/V; repeated, it writes
    them again with the same values)."""
    tables = []
    for prompt in ids[:3]:
        table = eng.block_manager.fork([])
        assert eng.block_manager.reserve(table, 0, len(prompt) + 2) is not None
        tables.append(table)
    a, b, c = ids[:3]
    batches = [
        [ForwardChunk(a, 0, tables[0], len(a))],
        [
            ForwardChunk(a[:5], 0, tables[0], 5),
            ForwardChunk(b, 0, tables[1], len(b)),
            ForwardChunk(c, 0, tables[2], 2),
        ],  # fmt: skip
        [ForwardChunk([a[0]], len(a), tables[0], 1)],
        [ForwardChunk([x[1]], len(x), t, 1) for x, t in zip((a, b, c), tables)],
    ]
    out = [eng.runner.forward(chunks).logits.clone() for chunks in batches]
    for table in tables:
        eng.block_manager.free(table)
    return out


@pytest.fixture(scope="module")
def compiled(dtype) -> LLMEngine:
    eng = make(dtype, compile="on")
    assert eng.runner.compiled and eng.batch_invariant
    return eng


def test_compiled_forwards_compute_the_eager_ones_bit_for_bit(compiled, ids, alone):
    """Whether the compiled forwards have been swapped in yet changes nothing: the compiled graphs (the
    invariant operators opaque to inductor, the rest rounded as eager rounds it) give eager's logits to
    the last bit at every batch shape, and the compiled engine the eager engine's tokens."""
    runner = compiled.runner
    runner.serve_eager()
    eager = forwards(compiled, ids)
    runner.use_compiled()
    got = forwards(compiled, ids)
    for k, (e, c) in enumerate(zip(eager, got)):
        assert torch.equal(e, c), f"forward {k}: {(e - c).abs().max()}"
    for name, params in PARAMS.items():
        assert run(compiled, ids, params) == alone[name], name
        assert staggered(compiled, ids[::-1], params, every=3) == alone[name][::-1], name


@pytest.mark.parametrize("quantization", ["int4", "nf4"])
def test_quantized_targets_keep_the_promise(ids, quantization):
    """int4 and NF4 weights (quantized as they load): an NF4 layer's product runs on the invariant linear
    kernel, an int4 layer on ATen's int4 kernel, which sums each output over K in order (checked below)."""
    eng = make("bfloat16", quantization=quantization)
    assert eng.batch_invariant
    for name, params in PARAMS.items():
        alone = [run(eng, [i], params)[0] for i in ids[:8]]
        assert run(eng, ids[:8], params) == alone, name
        assert staggered(eng, ids[:8], params) == alone, name


def test_the_int4_kernel_gives_a_row_the_same_output_in_any_batch():
    """What the int4 path relies on: ATen's CPU int4 kernel computes a row's outputs alike whatever rows
    come with it (row counts across its tile sizes, at a small and a model-sized layer)."""
    from engine.quant.int4 import Int4Linear, group_size_for

    torch.manual_seed(0)
    for k, n in [(320, 448), (2048, 1024)]:
        layer = Int4Linear.from_linear(torch.nn.Linear(k, n, bias=True), group_size_for(k, n))
        x = torch.randn(70, k, dtype=torch.bfloat16)
        full = layer(x)
        for rows in (1, 2, 3, 5, 8, 17, 33):
            for start in (0, 7):
                assert torch.equal(layer(x[start : start + rows]), full[start : start + rows]), (k, n, rows, start)


def test_without_a_compiler_auto_serves_without_the_mode_and_on_is_refused(monkeypatch):
    """A host whose kernels cannot be built (no C++ compiler; simulated): ``auto`` serves on the
    batch-variant path (with a warning), ``on`` is refused at load rather than served unkept."""
    import engine.runner.loader as loader

    monkeypatch.setattr(loader, "load_invariant_kernels", lambda: False)
    assert not make("float32", "auto").batch_invariant
    with pytest.raises(RuntimeError, match="could not be built"):
        make("float32", "on")


def spec_configs(tmp_path: Path) -> dict[str, dict]:
    return {
        "draft": {"speculative_method": "draft", "draft_model": str(DRAFT)},
        "draft-trees": {"speculative_method": "draft", "draft_model": str(DRAFT), "spec_tree_topk": 2},
        "ouroboros": {"speculative_method": "ouroboros", "draft_model": str(DRAFT)},
        "ngram": {"speculative_method": "ngram"},
        "suffix": {"speculative_method": "suffix"},
        "lookahead": {"speculative_method": "lookahead"},
        "layer-skip": {"speculative_method": "layer-skip"},
        "medusa": {"speculative_method": "medusa", "draft_model": str(write_medusa(TARGET, tmp_path / "medusa"))},
        "eagle": {"speculative_method": "eagle", "draft_model": str(write_eagle(TARGET, tmp_path / "eagle"))},
        "mtp": {"speculative_method": "mtp", "draft_model": str(write_mtp(TARGET, tmp_path / "mtp"))},
        "dflash": {"speculative_method": "dflash", "draft_model": str(write_dflash(TARGET, tmp_path / "dflash"))},
    }


METHODS = ["draft", "draft-trees", "ouroboros", "ngram", "suffix", "lookahead", "layer-skip"]
METHODS += ["medusa", "eagle", "mtp", "dflash"]


@pytest.fixture(scope="module")
def plain_bf16(ids) -> dict[str, list[list[int]]]:
    """Plain decoding's output of the first prompts, each alone in a fresh engine, in bfloat16 (the default
    wherever the CPU has bfloat16 units; float32 runs the same kernels): what every method must give."""
    return {name: [run(make("bfloat16"), [i], p)[0] for i in ids[:6]] for name, p in PARAMS.items()}


@pytest.mark.parametrize("method", METHODS)
def test_every_speculative_method_gives_plain_decodings_tokens(ids, plain_bf16, tmp_path, method):
    reference = plain_bf16
    eng = make("bfloat16", num_speculative_tokens=4, **spec_configs(tmp_path)[method])
    for name, params in PARAMS.items():
        pinned = dataclasses.replace(params, num_draft_tokens=3)
        assert run(eng, ids[:6], pinned) == reference[name], name
        assert staggered(eng, ids[:6], pinned) == reference[name], name
    assert eng.spec_stats.num_draft_tokens > 0


@pytest.fixture(scope="module")
def srv() -> Iterator[Served]:
    factory = engine_factory(TARGET, dtype="bfloat16", draft_model=str(DRAFT), num_kv_blocks=None,
                             block_size=16, max_model_len=2048)  # fmt: skip
    with serve(create_app(ServerSettings(served_model_name="demo"), factory)) as s:
        yield s


@pytest.mark.parametrize("extra", [{"temperature": 0}, {"temperature": 0.8, "seed": 11}], ids=["greedy", "seeded"])
def test_concurrent_clients_get_what_one_client_gets(srv, extra):
    assert httpx.get(srv.base + "/version").json()["batch_invariant"]  # auto: on, on a CPU
    with openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=300) as c:
        kw = dict(model="demo", max_tokens=TOKENS, **extra)
        one_by_one = [c.completions.create(prompt=p, **kw).choices[0].text for p in PROMPTS]
        together: dict[int, str] = {}

        def ask(k: int) -> None:
            together[k] = c.completions.create(prompt=PROMPTS[k], **kw).choices[0].text

        threads = [threading.Thread(target=ask, args=(k,)) for k in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [together[k] for k in range(len(PROMPTS))] == one_by_one


def test_the_batch_variant_kernels_fail_these_checks(ids):
    """The control: bfloat16 on the variant kernels (oneDNN / BLAS for batches, another attention path
    for long query runs) gives some prompt another output in a batch than alone."""
    eng = make("bfloat16", "off")
    assert not eng.batch_invariant
    alone = [run(eng, [i], PARAMS["greedy"])[0] for i in ids]
    batched = run(eng, ids, PARAMS["greedy"])
    chunked = run(make("bfloat16", "off", max_num_batched_tokens=48), ids, PARAMS["greedy"])
    assert batched != alone or chunked != alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_linear_kernel_gives_a_row_its_bits_in_any_batch(dtype):
    """``augur::invariant_linear`` on the CPU, in each dtype's own path (bfloat16 takes the
    AVX512-BF16 units where the CPU has them): the product, and every row's bits the same in a call of
    one row, of a few, across the kernel's 6-row tiles and 48-row blocks, and on one or two threads,
    with K and N that leave partial vectors and feature groups. The second inputs make every output
    hang on its sum's order: two products of 2^20 that cancel, in different lanes of the sum, with the
    rest of the sum added to them at a coarse float32 step (a tile that reduced its lanes in another
    order would move most outputs by a bfloat16 step)."""
    from engine.models.invariant import load_invariant_kernels

    assert load_invariant_kernels()
    op = torch.ops.augur.invariant_linear
    g = torch.Generator().manual_seed(5)
    tol = 1e-5 if dtype == torch.float32 else 0.02
    for m, k, n in [(100, 320, 70), (61, 45, 9), (13, 1, 3), (50, 864, 6)]:
        x = torch.randn(m, k, generator=g).to(dtype)
        w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
        b = torch.randn(n, generator=g).to(dtype)
        ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
        out = op(x, w, b)
        assert out.dtype == dtype and (out.double() - ref).abs().max() <= tol * ref.abs().max(), (m, k, n)
        cancelling = x.clone()
        if k >= 3:
            cancelling[:, 0], cancelling[:, 2] = 2.0**20, -(2.0**20)
            w = w.clone()
            w[:, 2] = w[:, 0]
        for xs, bias in [(x, None), (x, b), (cancelling, b)]:
            full = op(xs, w, bias)
            for lo, hi in [(0, 1), (m - 1, m), (3, 5), (2, 9), (1, m), (7, min(m, 55))]:
                assert torch.equal(op(xs[lo:hi], w, bias), full[lo:hi]), (m, k, n, lo, hi)
            threads = torch.get_num_threads()
            try:
                torch.set_num_threads(2)
                assert torch.equal(op(xs, w, bias), full), (m, k, n)
            finally:
                torch.set_num_threads(threads)
        assert op(x[:0], w, b).shape == (0, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_the_cpu_activation_kernel_gives_a_row_its_bits_in_any_batch(dtype, act):
    """``augur::invariant_act_mul`` on the CPU (SiLU in vectors of sixteen where the CPU has AVX-512, a
    scalar tail): eager's value within a few roundings, its NaNs and infinities where eager gives them
    (infinite and saturated inputs), and a row's bits the same alone and in calls of any size, on one
    or two threads."""
    from engine.models.invariant import _act_mul, load_invariant_kernels

    assert load_invariant_kernels()
    op = torch.ops.augur.invariant_act_mul
    g = torch.Generator().manual_seed(9)
    gate_up = (torch.randn(37, 2 * 867, generator=g) * 6).to(dtype)
    specials = torch.tensor([0.0, -0.0, 100.0, -100.0, 88.5, -88.5, 20.0, -20.0, float("inf"), float("-inf")])
    gate_up[0, : len(specials)] = specials.to(dtype)
    out = op(gate_up, act)
    eager = _act_mul(gate_up, act)  # the expression the operator replaces, in the same dtype
    assert out.dtype == dtype and torch.equal(out.isnan(), eager.isnan())
    assert torch.equal(out.isinf(), eager.isinf()) and torch.equal(out[out.isinf()], eager[eager.isinf()])
    finite = torch.isfinite(eager)
    rtol = 1e-6 if dtype == torch.float32 else 1.6e-2
    assert ((out - eager).double().abs()[finite] <= rtol * eager.double().abs()[finite] + 1e-5).all()

    def same(a, b):
        return bool(((a == b) & (a.signbit() == b.signbit()) | (a.isnan() & b.isnan())).all())

    for lo, hi in [(0, 1), (36, 37), (3, 11), (1, 37)]:
        assert same(op(gate_up[lo:hi], act), out[lo:hi]), (lo, hi)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert same(op(gate_up, act), out)
    finally:
        torch.set_num_threads(threads)


# -- the mode's GPU kernels, as far as a CPU can check them (their promise itself: test_batch_invariance_gpu.py)
def test_the_gpu_attention_takes_one_program_size_and_no_key_split_in_the_mode():
    """Under the mode the triton backend's metadata gives every batch the same program size and no key
    split, whatever the batch feeds and whatever split a captured graph asks for; without it both follow
    the batch (so a check of the mode's metadata can fail)."""
    from engine.attention.triton_paged import BLOCK_Q_CHUNK, build_triton_metadata

    def meta(q_lens, **kw):
        tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(q_lens))]
        pos = torch.zeros(sum(q_lens), dtype=torch.int64)
        return build_triton_metadata(q_lens, [20] * len(q_lens), tables, 16, pos, **kw)

    for q_lens in ([1], [5], [1, 1, 1], [40, 3]):
        m = meta(q_lens, num_splits=4, invariant=True)
        assert (m.block_q, m.num_splits) == (BLOCK_Q_CHUNK, 1), q_lens
    assert {meta(q).block_q for q in ([1], [5], [40])} == {1, 8, BLOCK_Q_CHUNK}
    assert meta([1], num_splits=4).num_splits == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gpu_linear_kernel_computes_the_product(dtype):
    """``augur::invariant_linear``'s CUDA kernel (Triton; here in its interpreter): the product, with its
    inner dimension whole or split into fixed ranges. Whether a row keeps its bits in any batch needs
    the GPU (the interpreter's tile products are numpy's, which reduce by a row's place in the tile)."""
    from engine.models import invariant_cuda

    g = torch.Generator().manual_seed(3)
    x = torch.randn(70, 1100, generator=g).to(dtype)
    w = (torch.randn(150, 1100, generator=g) / 30).to(dtype)
    b = torch.randn(150, generator=g).to(dtype)
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    tol = 1e-5 if dtype == torch.float32 else 0.05
    for splits in (1, 2, 3):
        out = invariant_cuda.invariant_linear(x, w, b, splits=splits)
        assert out.dtype == dtype and (out.float() - ref).abs().max() <= tol, splits
    assert invariant_cuda.invariant_linear(x[:0], w, b).shape == (0, 150)
