"""LoRA adapters over one base model (engine/lora): PEFT's own adapters on tiny random models give
PEFT's logits and greedy tokens; a batch mixing adapters and the base gives each row what it gets
alone; the prefix cache never hands one adapter's KV to another; every proposer stays greedy-exact
on an adapted target; bad adapters are errors that say why; served through the SDK by model name."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers
from test_engine import hf_greedy, prompts
from test_server import metric, parse_metrics
from test_step import prompts as repetitive_prompts

from conftest import build_model_dir
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.lora import AdapterError, read_adapter
from engine.request.sampling_params import SamplingParams
from engine.runner.model_runner import ForwardChunk

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# three adapters unlike each other: every module at rank 4; q and v at rank 8 under rsLoRA; the MLP at
# rank 2 with the down projection's rank and alpha from PEFT's patterns
SPECS = {
    "all": dict(r=4, lora_alpha=8, target_modules=TARGETS),
    "qv": dict(r=8, lora_alpha=4, target_modules=["q_proj", "v_proj"], use_rslora=True),
    "mlp": dict(
        r=2,
        lora_alpha=6,
        target_modules=["gate_proj", "up_proj", "down_proj"],
        rank_pattern={"down_proj": 4},
        alpha_pattern={"down_proj": 2},
    ),  # fmt: skip
}


def make_adapter(base: Path, out: Path, seed: int, **spec) -> Path:
    """A PEFT LoRA adapter of ``base`` with random A and B (``init_lora_weights=False``: B is not zero,
    so the adapter changes the model), saved by PEFT."""
    import peft  # (here, not at the top: importing it takes seconds, and every worker collects this file)

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    adapted = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **spec))
    with torch.no_grad():  # larger than PEFT's init, so that greedy tokens move
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    adapted.save_pretrained(out)
    return out


def peft_model(base: Path, adapter: Path):
    import peft

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    return peft.PeftModel.from_pretrained(model, adapter).eval()


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(llama_dir, root / name, seed, **spec) for seed, (name, spec) in enumerate(SPECS.items())}


def make(model_dir: Path, lora: dict[str, Path] | None = None, method: str | None = None, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 128)
    kw.setdefault("block_size", 4)
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", "cpu")
    return LLMEngine(
        EngineConfig(
            model=str(model_dir), speculative_method=method,
            lora_modules={k: str(v) for k, v in (lora or {}).items()}, **kw,
        )
    )  # fmt: skip


def lora_logits(engine: LLMEngine, ids: list[int], name: str | None) -> torch.Tensor:
    """Every position's logits under adapter ``name`` (None: the base): a prefill of 11 tokens, one of
    9, then one token at a time through the paged cache."""
    runner, table = engine.runner, []
    slot = -1 if name is None else engine.adapters.acquire(name)  # (as a request takes it)
    assert engine.block_manager.reserve(table, 0, len(ids)) is not None
    cuts = [0, 11, 20, *range(21, len(ids) + 1)]
    got = [
        runner.forward([ForwardChunk(ids[a:b], a, table, num_logits=b - a, lora=slot)]).logits
        for a, b in zip(cuts, cuts[1:])
    ]
    engine.block_manager.free(table)
    if name is not None:
        engine.adapters.release(name)
    return torch.cat(got)


def staggered(engine: LLMEngine, ps: list[list[int]], params: list[SamplingParams]) -> dict[str, list[int]]:
    """Request i (with ``params[i]``) added at step 2 i: requests join a running batch mid-flight."""
    tokens: dict[str, list[int]] = {}
    step = 0
    while len(tokens) < len(ps) or engine.has_unfinished_requests():
        if step % 2 == 0 and len(tokens) < len(ps):
            i = len(tokens)
            engine.add_request(f"r{i}", ps[i], params[i])
            tokens[f"r{i}"] = []
        for out in engine.step():
            tokens[out.request_id].extend(out.outputs[0].delta_token_ids)
        step += 1
    return tokens


def greedy(engine: LLMEngine, ps: list[list[int]], lora: str | None, n: int = 12) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, lora=lora)
    return [o.outputs[0].delta_token_ids for o in engine.generate(ps, params)]


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"])
def test_logits_match_peft_and_the_base_rows_stay_the_base_models(model_dirs, tmp_path, arch):
    base = model_dirs[arch]
    made = {name: make_adapter(base, tmp_path / name, seed, **spec) for seed, (name, spec) in enumerate(SPECS.items())}
    engine = make(base, made)
    ids = list(range(5, 33))
    with torch.no_grad():
        plain = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        want_base = plain(torch.tensor([ids])).logits[0]
        for name, path in made.items():
            want = peft_model(base, path)(torch.tensor([ids])).logits[0]
            assert (want - want_base).abs().max() > 0.5, name  # the adapter matters
            torch.testing.assert_close(lora_logits(engine, ids, name), want, atol=2e-4, rtol=1e-4, msg=name)
    torch.testing.assert_close(lora_logits(engine, ids, None), want_base, atol=2e-4, rtol=1e-4)


def test_greedy_tokens_equal_peft_merged(llama_dir, adapters):
    engine = make(llama_dir, adapters)
    ps = prompts(3, seed=4, lo=6, hi=20)
    for name, path in adapters.items():
        merged = peft_model(llama_dir, path).merge_and_unload()
        assert greedy(engine, ps, name) == [hf_greedy(merged, p, 12) for p in ps], name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_mixed_batch_gives_each_row_what_it_gets_alone(llama_dir, adapters, dtype):
    """Rows of three adapters and the base in the same forwards (staggered arrivals: prefill chunks
    beside decodes), greedy and seeded: each request's tokens are those it gets alone, bit for bit,
    in bfloat16 too (the batch-invariant mode, a CPU's default, runs the adapters' products)."""
    engine = make(llama_dir, adapters, max_num_batched_tokens=40, dtype=dtype)
    ps = prompts(8, seed=7, lo=8, hi=30)
    names = [None, "all", "qv", "mlp"] * 2
    for temperature in (0.0, 0.8):
        params = [
            SamplingParams(temperature=temperature, max_tokens=10, ignore_eos=True, seed=i, lora=name)
            for i, name in enumerate(names)
        ]
        together = staggered(engine, ps, params)
        alone = {f"r{i}": engine.generate([p], params[i])[0].outputs[0].delta_token_ids for i, p in enumerate(ps)}
        assert together == alone, temperature
        outs = {name: alone[f"r{i}"] for i, name in enumerate(names[:4])}
        assert len({tuple(v) for v in outs.values()}) == 4  # the adapters do differ


def test_the_prefix_cache_never_crosses_adapters(llama_dir, adapters):
    """One prompt under an adapter, then under the base and another adapter, in one engine with the
    prefix cache on: each gets what a fresh engine gives it (KV computed under one model is no prefix
    of another's), and the same adapter again does reuse its own blocks."""
    ps = prompts(1, seed=11, lo=30, hi=31)
    engine = make(llama_dir, adapters, enable_prefix_caching=True)
    got = {name: greedy(engine, ps, name) for name in ("all", None, "qv", "all")}
    for name in ("all", None, "qv"):
        assert got[name] == greedy(make(llama_dir, adapters, enable_prefix_caching=False), ps, name), name
    again = engine.generate(ps, SamplingParams(temperature=0.0, max_tokens=4, lora="all"))[0]
    assert again.stats.num_cached_prompt_tokens > 0


@pytest.mark.parametrize("method", ["draft", "ngram", "suffix", "lookahead", "layer-skip", "eagle", "dflash"])
def test_every_proposer_is_greedy_exact_on_an_adapted_target(llama_dir, tokenizer_dir, adapters, tmp_path, method):
    """The draft (a base-model draft, n-grams, the suffix store, lookahead, the target's own skipped
    layers, an EAGLE head, a DFlash drafter) proposes; the adapted target verifies: its tokens stay the
    adapted model's."""
    from test_dflash import write_dflash
    from test_eagle import write_eagle
    from test_layer_skip import write_skip

    from engine.models.layer_skip import LayerSkip

    kw = {
        "draft": dict(
            draft_model=str(build_model_dir(tmp_path / "d", tokenizer_dir, "LlamaForCausalLM", seed=5)),
            spec_tree_topk=2,
        ),
        "layer-skip": dict(layer_skip_config=write_skip(tmp_path, LayerSkip(frozenset({1}), frozenset()))),
        "eagle": dict(draft_model=str(write_eagle(llama_dir, tmp_path / "eagle")), spec_tree_topk=2),
        "dflash": dict(draft_model=str(write_dflash(llama_dir, tmp_path / "dflash"))),
    }.get(method, {})
    ps = repetitive_prompts(4, seed=9)
    plain = make(llama_dir, adapters)
    want = {name: greedy(plain, ps, name, 16) for name in ("all", "mlp")}
    eng = make(llama_dir, adapters, method, num_kv_blocks=96, max_num_batched_tokens=40, **kw)
    for name in ("all", "mlp"):
        pinned = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, num_draft_tokens=3, lora=name)
        assert [o.outputs[0].delta_token_ids for o in eng.generate(ps, pinned)] == want[name], name
    assert eng.spec_stats.num_drafts > 0
    # the controller learns what each adapter's requests accept apart (a new request starts from its own)
    routes = {key[0] for key in eng.controller.population}
    assert {(r, True, n) for r in routes for n in ("all", "mlp")} <= set(eng.controller.population)


def _edited(src: Path, dst: Path, config: dict | None = None, tensors=None) -> Path:
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        (dst / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    if tensors is not None:
        from safetensors.torch import load_file, save_file

        save_file(tensors(load_file(dst / "adapter_model.safetensors")), dst / "adapter_model.safetensors")
    return dst


def test_bad_adapters_are_errors_that_say_why(llama_dir, model_dirs, adapters, tmp_path):
    good = adapters["all"]
    emb = "base_model.model.model.embed_tokens.lora_embedding_A"
    q_b = "layers.0.self_attn.q_proj.lora_B"
    cases = {
        "no adapter_config.json": (tmp_path / "empty", r"has no adapter_config\.json"),
        "weights missing": (
            _edited(good, tmp_path / "noweights", tensors=lambda t: t),
            r"has no adapter_model\.safetensors",
        ),
        "rank over the limit": (good, r"rank 4, over --max-lora-rank 2"),
        "DoRA": (_edited(good, tmp_path / "dora", {"use_dora": True}), r"DoRA"),
        "modules_to_save": (_edited(good, tmp_path / "mts", {"modules_to_save": ["lm_head"]}), r"modules_to_save"),
        "an embedding adapter": (
            _edited(good, tmp_path / "emb", tensors=lambda t: {**t, emb: torch.zeros(4, 8)}),
            r"embedding or LM-head adapter",
        ),
        "half a pair": (
            _edited(good, tmp_path / "half", tensors=lambda t: {k: v for k, v in t.items() if q_b not in k}),
            r"q_proj has lora_A without its pair",
        ),
    }  # fmt: skip
    (tmp_path / "empty").mkdir()
    (cases["weights missing"][0] / "adapter_model.safetensors").unlink()
    for why, (path, message) in cases.items():
        with pytest.raises(AdapterError, match=message):
            read_adapter("x", path, 2 if why == "rank over the limit" else 16)
    # at start: an adapter of another base model (its shapes), or a module we do not adapt
    other = make_adapter(model_dirs["Qwen3ForCausalLM"], tmp_path / "qwen3", 0, **SPECS["all"])  # head_dim 32
    with pytest.raises(AdapterError, match=r"an adapter of another base model\?"):
        make(llama_dir, {"other": other})
    head = make_adapter(llama_dir, tmp_path / "head", 0, r=2, lora_alpha=2, target_modules=["lm_head"])
    with pytest.raises(AdapterError, match=r"an embedding or LM-head adapter, which is not served"):
        make(llama_dir, {"head": head})
    # a module the model has no layer for: a mixture's experts, or a name from another family
    renamed = _edited(
        good, tmp_path / "renamed", tensors=lambda t: {k.replace("q_proj", "query"): v for k, v in t.items()}
    )
    with pytest.raises(AdapterError, match=r"self_attn\.query, which is not a layer LoRA serves"):
        make(llama_dir, {"renamed": renamed})
    engine = make(llama_dir, {"all": good})
    with pytest.raises(ValueError, match=r"no LoRA adapter named 'nope'"):
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, lora="nope"))


def test_served_by_model_name_through_the_sdk(llama_dir, adapters):
    from server.app import ServerSettings, create_app
    from servers import engine_factory, serve

    modules = {k: str(v) for k, v in adapters.items()}
    engine = make(llama_dir, adapters)
    ids = transformers.AutoTokenizer.from_pretrained(llama_dir).encode("a b c a b")
    settings = ServerSettings(served_model_name="base", lora_modules=modules)
    app = create_app(settings, engine_factory(llama_dir, lora_modules=modules, block_size=4, num_kv_blocks=128))
    with serve(app) as srv:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="none")
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {"base", *modules}
        assert all(
            cards[n].model_extra["parent"] == "base" and cards[n].model_extra["root"] == modules[n] for n in modules
        )
        for name in ("base", "all", "mlp"):
            out = client.completions.create(model=name, prompt="a b c a b", max_tokens=8, temperature=0)
            lora = None if name == "base" else name
            want = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=8, lora=lora))[0].outputs[0].text
            assert out.choices[0].text == want and out.model == name, name
            assert out.usage.model_extra["speculative"]["lora_adapter"] == lora
        chat = client.chat.completions.create(
            model="qv", messages=[{"role": "user", "content": "a b c"}], max_tokens=4, temperature=0
        )
        assert chat.model == "qv" and chat.usage.completion_tokens > 0
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.completions.create(model="nope", prompt="a b", max_tokens=2)
        # the metrics: requests per adapter, and vllm:lora_requests_info with a running adapter in it
        stream = client.completions.create(
            model="mlp", prompt="a b", max_tokens=60, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(stream))
        samples = parse_metrics(httpx.get(srv.base + "/metrics").text)
        assert list(stream)[-1].choices[0].finish_reason == "length"
        assert metric(samples, "augur_lora_requests_total", lora_name="mlp") == 2
        drafted = metric(samples, "augur_lora_spec_decode_tokens_total", lora_name="all", what="drafted")
        assert drafted >= metric(samples, "augur_lora_spec_decode_tokens_total", lora_name="all", what="accepted") >= 0
        assert metric(samples, "augur_lora_requests_total", lora_name="qv") == 1
        [(labels, stamp)] = [(lab, v) for n, lab, v in samples if n == "vllm:lora_requests_info"]
        assert labels == {"max_lora": "4", "waiting_lora_adapters": "", "running_lora_adapters": "mlp"}
        assert abs(stamp - time.time()) < 600


def test_more_adapters_than_slots_take_turns_and_each_row_stays_its_own(llama_dir, adapters):
    """One slot, three adapters, requests of all three and the base at once: a request waits while the
    slot is held by another adapter's requests, the least recently used idle adapter gives the slot up,
    and every request's tokens are those it gets with a slot for each adapter."""
    ps = prompts(6, seed=21, lo=6, hi=18)
    names = ["all", "qv", None, "mlp", "all", "qv"]
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, lora=n) for n in names]
    roomy = make(llama_dir, adapters)
    want = [roomy.generate([p], q)[0].outputs[0].delta_token_ids for p, q in zip(ps, params, strict=True)]
    tight = make(llama_dir, adapters, max_loras=1, max_num_batched_tokens=40)
    assert list(staggered(tight, ps, params).values()) == want
    registry = tight.adapters
    assert not registry.holders and len(registry.slot_of) == 1 and not tight.lora_queue


def test_adapters_load_and_unload_while_others_run(llama_dir, adapters):
    """Loaded while requests run, an adapter serves at once; unloaded while its own requests run, they
    finish under it and new ones are refused; its slot is then free, and a bad adapter changes nothing."""
    engine = make(llama_dir, {"all": adapters["all"]}, enable_runtime_lora=True, max_loras=2)
    ps = prompts(3, seed=5, lo=8, hi=16)
    want = {n: greedy(make(llama_dir, adapters), ps[:1], n, 10)[0] for n in ("all", "qv", None)}
    base = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    got: dict[str, list[int]] = {"base": [], "all": [], "qv": []}

    def step() -> None:
        for out in engine.step():
            got[out.request_id] += out.outputs[0].delta_token_ids

    engine.add_request("base", ps[0], base)
    engine.add_request("all", ps[0], dataclasses.replace(base, lora="all"))
    step()
    engine.load_lora_adapter("qv", str(adapters["qv"]))
    engine.add_request("qv", ps[0], dataclasses.replace(base, lora="qv"))
    step()
    engine.unload_lora_adapter("all")  # its request is running: it finishes under it
    with pytest.raises(ValueError, match="no LoRA adapter named 'all'"):
        engine.add_request("late", ps[0], dataclasses.replace(base, lora="all"))
    while engine.has_unfinished_requests():
        step()
    assert got == {"base": want[None], "all": want["all"], "qv": want["qv"]}
    assert set(engine.adapters.known) == {"qv"} and set(engine.adapters.slot_of) == {"qv"}
    with pytest.raises(KeyError):
        engine.unload_lora_adapter("all")
    with pytest.raises(AdapterError, match="already loaded"):
        engine.load_lora_adapter("qv", str(adapters["qv"]))
    with pytest.raises(AdapterError, match="over --max-lora-rank 2"):
        make(llama_dir, enable_runtime_lora=True, max_lora_rank=2).load_lora_adapter("x", str(adapters["all"]))


@pytest.mark.parametrize("front", ["thread", "process"])
def test_runtime_loading_through_the_api(llama_dir, adapters, front, monkeypatch):
    """--enable-runtime-lora: POST /v1/load_lora_adapter serves the adapter by name at once (and lists
    it), a bad one is a 400 that says why, /v1/unload_lora_adapter makes its name a 404, a base request
    streaming meanwhile is whole; the routes are behind the API key, and absent without the flag. With
    the engine on a thread of the server and in a process of its own (--engine-process)."""
    import httpx

    monkeypatch.setenv("AUGUR_TEST_FRONT", front)

    from server.app import ServerSettings, create_app
    from servers import engine_factory, serve

    ids = transformers.AutoTokenizer.from_pretrained(llama_dir).encode("a b c a b")
    want = make(llama_dir, adapters).generate([ids], SamplingParams(temperature=0.0, max_tokens=8, lora="mlp"))
    settings = ServerSettings(served_model_name="base", api_key="k", enable_runtime_lora=True)
    factory = engine_factory(llama_dir, enable_runtime_lora=True, block_size=4, num_kv_blocks=128)
    with serve(create_app(settings, factory)) as srv:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="k")
        auth = {"Authorization": "Bearer k"}
        stream = client.completions.create(model="base", prompt="a b c", max_tokens=24, temperature=0, stream=True)
        first = next(iter(stream))
        body = {"lora_name": "mlp", "lora_path": str(adapters["mlp"])}
        assert httpx.post(srv.base + "/v1/load_lora_adapter", json=body).status_code == 401
        r = httpx.post(srv.base + "/v1/load_lora_adapter", json=body, headers=auth)
        assert r.status_code == 200 and "added successfully" in r.text
        assert "mlp" in {m.id for m in client.models.list().data}
        out = client.completions.create(model="mlp", prompt="a b c a b", max_tokens=8, temperature=0)
        assert out.choices[0].text == want[0].outputs[0].text
        bad = httpx.post(
            srv.base + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"}, headers=auth
        )
        assert bad.status_code == 400 and "has no adapter_config.json" in bad.json()["error"]["message"]
        r = httpx.post(srv.base + "/v1/unload_lora_adapter", json={"lora_name": "mlp"}, headers=auth)
        assert r.status_code == 200
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="mlp", prompt="a b", max_tokens=2)
        again = httpx.post(srv.base + "/v1/unload_lora_adapter", json={"lora_name": "mlp"}, headers=auth)
        assert again.status_code == 404
        chunks = [first, *stream]
        assert "".join(c.choices[0].text for c in chunks) and chunks[-1].choices[0].finish_reason == "length"
    plain = ServerSettings(served_model_name="base")
    with serve(create_app(plain, engine_factory(llama_dir, block_size=4, num_kv_blocks=128))) as srv:
        assert httpx.post(srv.base + "/v1/load_lora_adapter", json=body).status_code == 404


def test_drafting_data_stays_within_an_api_key_and_an_adapter(llama_dir, adapters):
    """Suffix decoding's store, through the server: each API key's (and adapter's) finished outputs go
    to a store of their own, and no request is drafted from another's."""
    import hashlib

    from server.app import ServerSettings, create_app
    from servers import engine_factory, serve

    modules = {"all": str(adapters["all"])}
    settings = ServerSettings(served_model_name="base", api_key=["ka", "kb"], lora_modules=modules)
    factory = engine_factory(llama_dir, speculative_method="suffix", lora_modules=modules)
    with serve(create_app(settings, factory)) as srv:
        for key, model in (("ka", "base"), ("kb", "base"), ("kb", "all")):
            client = openai.OpenAI(base_url=srv.base + "/v1", api_key=key)
            client.completions.create(model=model, prompt="a b c a b", max_tokens=8, temperature=0)
        digest = {k: hashlib.sha256(k.encode()).hexdigest() for k in ("ka", "kb")}
        stores = srv.engine.proposer.stores
        assert set(stores) == {(None, digest["ka"]), (None, digest["kb"]), ("all", digest["kb"])}
        assert all(len(store.outputs) == 1 for store in stores.values())


ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
FAMILY_TARGETS = {
    "gemma2": TARGETS, "gemma3": TARGETS, "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "smollm3": TARGETS, "olmo2": TARGETS,
    # a mixture's experts are not adaptable: its attention (and the dense layers' none here)
    "qwen3-moe": ATTENTION, "mixtral": ATTENTION, "gpt-oss": ATTENTION,
}  # fmt: skip


def family_dir(family: str, path: Path, tokenizer_dir: Path) -> Path:
    from test_dense_families import build_dir
    from test_gemma2 import build_gemma2_dir
    from test_gemma3 import build_gemma3_dir
    from test_gpt_oss import build_dir as build_gpt_oss_dir
    from test_moe import build_moe_dir

    if family == "gemma2":
        return build_gemma2_dir(path, tokenizer_dir, std=0.2)
    if family == "gemma3":
        return build_gemma3_dir(path, tokenizer_dir, "text")
    if family == "gpt-oss":
        return build_gpt_oss_dir(path, tokenizer_dir)
    if family in ("qwen3-moe", "mixtral"):
        arch = {"qwen3-moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}[family]
        return build_moe_dir(path, tokenizer_dir, arch)
    return build_dir(path, tokenizer_dir, family)


@pytest.mark.parametrize("family", list(FAMILY_TARGETS))
def test_every_family_matches_peft(tmp_path, tokenizer_dir, family):
    """Each family's adaptable layers (its fused or unfused projections; a mixture's attention) take
    PEFT's adapter: logits within float32 tolerance of PEFT's PeftModel on the same checkpoint."""
    base = family_dir(family, tmp_path / "base", tokenizer_dir)
    adapter = make_adapter(base, tmp_path / "a", 3, r=4, lora_alpha=8, target_modules=FAMILY_TARGETS[family])
    engine = make(base, {"a": adapter})
    ids = list(range(5, 33))
    with torch.no_grad():
        kw = dict(dtype=torch.float32, attn_implementation="eager")
        plain = transformers.AutoModelForCausalLM.from_pretrained(base, **kw).eval()
        want = peft_model(base, adapter)(torch.tensor([ids])).logits[0]
        assert (want - plain(torch.tensor([ids])).logits[0]).abs().max() > 0.05  # the adapter matters
    torch.testing.assert_close(lora_logits(engine, ids, "a"), want, atol=5e-4, rtol=1e-4)


def test_two_ranks_serve_the_adapters_as_one_rank_does(llama_dir, adapters):
    """-tp 2: each rank holds its share of every adapter (B's rows of q/k/v and gate/up, A's inputs of o
    and down), written through the runner to every rank (a slot changed mid-run by a load: one slot,
    three adapters taking turns): each request's greedy tokens are one rank's."""
    ps = prompts(4, seed=8, lo=8, hi=20)
    names = ["all", "qv", None, "mlp"]
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, lora=n) for n in names]
    one = make(llama_dir, adapters)
    want = [one.generate([p], q)[0].outputs[0].delta_token_ids for p, q in zip(ps, params, strict=True)]
    eng = make(llama_dir, adapters, tensor_parallel_size=2, max_loras=1)
    try:
        assert eng.runner.model.tp.size == 2
        assert list(staggered(eng, ps, params).values()) == want
    finally:
        eng.close()


def _kernel_device() -> torch.device:
    """Where the Triton kernels run: CUDA, else CPU tensors in Triton's interpreter."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or Triton's interpreter")
    return torch.device("cpu")


def test_the_gpu_kernels_gather_each_rows_own_adapter_and_rows_stay_independent():
    """engine/lora/triton_lora.py (in Triton's interpreter here; compiled on CUDA): each row's delta is
    its own slot's B A x (a base row's exact zeros), and a row computed alone is the same bits."""
    device = _kernel_device()
    from engine.lora.triton_lora import lora_delta

    g = torch.Generator().manual_seed(0)
    slots_n, width, K, N = 3, 24, 600, 200  # (600 inputs: the shrink's three ranges)
    a, b = torch.randn(slots_n * width, K, generator=g), torch.randn(N, slots_n * width, generator=g)
    x = torch.randn(7, K, generator=g)
    slots = torch.tensor([2, -1, 0, 1, 2, -1, 0])
    a, b, x, slots = (t.to(device) for t in (a, b, x, slots))
    got = lora_delta(x, a, b, slots, width)
    assert got.device.type == device.type
    got, a, b, x = got.cpu(), a.cpu(), b.cpu(), x.cpu()
    for t, s in enumerate(slots.tolist()):
        want = torch.zeros(N) if s < 0 else b[:, s * width : (s + 1) * width] @ (a[s * width : (s + 1) * width] @ x[t])
        torch.testing.assert_close(got[t], want, atol=1e-4, rtol=1e-4)
        alone = lora_delta(*(v.to(device) for v in (x[t : t + 1], a, b, slots[t : t + 1])), width)
        assert torch.equal(alone[0].cpu(), got[t])
    assert torch.equal(got[1], torch.zeros(N))


def test_a_prefills_many_rows_take_the_products_over_every_slot():
    """From ``DENSE_ROWS`` rows (a prefill) outside the batch-invariant mode, the kernels' layer takes two
    matrix products over every slot with the other slots' columns zeroed: each row gets its own slot's
    delta, as the row-by-row kernels give it, and a base row exactly the base layer's output."""
    from engine.lora import LoraSlots
    from engine.lora.layers import DENSE_ROWS

    device = _kernel_device()
    g = torch.Generator().manual_seed(3)
    rows = DENSE_ROWS + 44
    model = torch.nn.Module()
    model.o_proj = base = torch.nn.Linear(64, 48, bias=False, device=device)
    slots = LoraSlots.attach(model, 3, 8, rows=rows)
    slots.kernel = True  # (CUDA's default; on CPU tensors the interpreter runs them)
    for t in (model.o_proj.a, model.o_proj.b):
        t.copy_(torch.randn(t.shape, generator=g))
    which = torch.tensor([(i % 4) - 1 for i in range(rows)])  # -1 (the base), 0, 1, 2 in turn
    x = torch.randn(rows, 64, generator=g).to(device)
    with torch.no_grad():
        slots.set_rows(which.to(device), rows, 3)
        dense = model.o_proj(x)
        slots.invariant = True  # the kernels' path, row by row
        gathered = model.o_proj(x)
        plain = base(x)
    torch.testing.assert_close(dense.cpu(), gathered.cpu(), atol=1e-4, rtol=1e-4)
    assert torch.equal(dense[which == -1].cpu(), plain[which == -1].cpu())
    assert not torch.allclose(dense[which >= 0].cpu(), plain[which >= 0].cpu())


def test_the_engine_on_the_gpu_kernels_matches_peft_and_a_mixed_batch(llama_dir, adapters):
    """The served path on the kernels (CUDA's default; forced on CPU tensors under the interpreter):
    PEFT's logits, and a mixed batch gives each request its tokens alone."""
    device = _kernel_device()
    # (on CUDA the base layers are batch-invariant only in that mode: what a row gets alone is asked of it)
    invariant = "on" if device.type == "cuda" else "auto"
    engine = make(llama_dir, adapters, device=str(device), batch_invariant=invariant)
    assert engine.adapters.slots.kernel == (device.type == "cuda")
    assert (engine.runner.graphs is not None) == (device.type == "cuda")  # on a GPU, through captured graphs
    engine.adapters.slots.kernel = True
    ids = list(range(5, 25))
    with torch.no_grad():
        want = peft_model(llama_dir, adapters["qv"])(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(lora_logits(engine, ids, "qv").cpu(), want, atol=2e-4, rtol=1e-4)
    ps = prompts(4, seed=2, lo=6, hi=12)
    params = [
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, lora=n) for n in ("all", None, "mlp", "qv")
    ]
    together = list(staggered(engine, ps, params).values())
    assert together == [engine.generate([p], q)[0].outputs[0].delta_token_ids for p, q in zip(ps, params, strict=True)]


def test_unloading_an_adapter_its_queued_requests_wait_for_keeps_it_for_them(llama_dir, adapters):
    """One slot held by a running request of one adapter; a request of another waits for it; that other
    adapter is unloaded meanwhile: the waiting request still runs under it (and gets its tokens), new
    ones are refused, and it is forgotten once the request ends; the engine serves on."""
    ps = prompts(2, seed=13, lo=6, hi=12)
    roomy = make(llama_dir, adapters)
    want = {n: greedy(roomy, ps[:1], n, 8)[0] for n in ("all", "qv")}
    engine = make(llama_dir, adapters, max_loras=1, enable_runtime_lora=True)
    base = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request("all", ps[0], dataclasses.replace(base, lora="all"))
    engine.add_request("qv", ps[0], dataclasses.replace(base, lora="qv"))
    got: dict[str, list[int]] = {"all": [], "qv": []}

    def step() -> None:
        for out in engine.step():
            assert out.error is None
            got[out.request_id] += out.outputs[0].delta_token_ids

    step()  # "all" takes the slot; "qv" waits for it
    assert [seq.group.request_id for seq in engine.lora_queue] == ["qv"]
    engine.unload_lora_adapter("qv")
    with pytest.raises(ValueError, match="no LoRA adapter named 'qv'"):
        engine.add_request("late", ps[0], dataclasses.replace(base, lora="qv"))
    while engine.has_unfinished_requests():
        step()
    assert got == want
    assert "qv" not in engine.adapters.known and not engine.adapters.waiting and not engine.adapters.holders
    engine.abort("nothing")  # (and the registry is whole: a new request of a known adapter runs)
    assert greedy(engine, ps[:1], "mlp", 8) == greedy(roomy, ps[:1], "mlp", 8)


def test_an_adapter_loaded_again_under_its_name_never_reuses_the_old_ones_kv(llama_dir, adapters):
    """The prefix cache keys KV by the adapter's load, not its name: unloaded and loaded again from
    other weights, a request gets the new adapter's tokens, not the old one's cached prefix."""
    ps = prompts(1, seed=17, lo=30, hi=31)
    fresh = greedy(make(llama_dir, adapters, enable_prefix_caching=False), ps, "qv", 8)
    engine = make(llama_dir, {"x": adapters["all"]}, enable_runtime_lora=True, enable_prefix_caching=True)
    greedy(engine, ps, "x", 8)
    engine.unload_lora_adapter("x")
    engine.load_lora_adapter("x", str(adapters["qv"]))
    out = engine.generate(ps, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, lora="x"))[0]
    assert out.outputs[0].delta_token_ids == fresh[0] and out.stats.num_cached_prompt_tokens == 0


def test_an_adapter_loaded_again_under_its_name_drafts_from_nothing_the_old_one_left(llama_dir, adapters):
    """What `auto` learned from an adapter's requests (suffix decoding's store of their outputs, the
    controller's acceptance for them) is dropped when it is unloaded, and again when a new adapter
    loads under its name: the new one neither drafts from the old one's text nor starts from its
    evidence, and a name unloaded for good keeps nothing; the base model's evidence stays."""
    engine = make(llama_dir, {"x": adapters["all"]}, "suffix", enable_runtime_lora=True)
    ps = [[5, 6, 7, 5, 6, 7, 5, 6]]

    def params(lora):  # a pinned depth: every step drafts, whatever the controller's costs say
        return SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, lora=lora, num_draft_tokens=2)

    for lora in ("x", None):
        engine.generate(ps, params(lora))
    stores, population = engine.proposer.stores, engine.controller.population
    assert {k[0] for k in stores} == {"x", None} and {k[2] for k in population} == {"x", None}
    engine.unload_lora_adapter("x")
    assert {k[0] for k in stores} == {None} and {k[2] for k in population} == {None}
    engine.load_lora_adapter("x", str(adapters["qv"]))
    out = engine.generate(ps, params("x"))[0]
    assert out.outputs[0].delta_token_ids == greedy(make(llama_dir, adapters), ps, "qv", 8)[0]
    assert {k[0] for k in stores} == {"x", None} and all(len(st.outputs) == 1 for st in stores.values())
    # lookahead's pools shared by the requests of a prompt family (--lookahead-shared) go the same way
    engine = make(llama_dir, {"x": adapters["all"]}, "lookahead", enable_runtime_lora=True, lookahead_shared=True)
    for lora in ("x", None):
        engine.generate(ps, params(lora))
    families = engine.proposer._families
    assert {k[0][0] for k in families} == {"x", None}
    engine.unload_lora_adapter("x")
    assert {k[0][0] for k in families} == {None}


def test_a_malformed_adapter_is_an_adapter_error(adapters, tmp_path):
    from engine.core.async_engine import _Lora, run_lora

    cases = {
        "a list": (["not", "an", "object"], "holds no JSON object"),
        "a bad pattern": ({"r": 4, "lora_alpha": 8, "rank_pattern": {"(": 2}}, "no regular expression"),
    }
    for why, (config, message) in cases.items():
        bad = tmp_path / why.replace(" ", "-")
        shutil.copytree(adapters["all"], bad)
        (bad / "adapter_config.json").write_text(json.dumps(config))
        with pytest.raises(AdapterError, match=message):
            read_adapter("x", bad, 16)

    class Raising:  # whatever else a file makes a reader raise comes back as the load's error
        def load_lora_adapter(self, name, path):
            raise PermissionError(13, "Permission denied", path)

    error = run_lora(Raising(), _Lora(0, "load", "x", "/root/x"))
    assert isinstance(error, AdapterError) and "PermissionError" in str(error)


def test_an_adapter_that_cannot_be_written_into_a_slot_fails_its_request_alone(llama_dir, adapters):
    """Writing an adapter into a slot can fail (out of memory on a GPU). That request ends with an
    error output; the requests beside it, of other adapters and of the base, get their tokens as
    before, the slot is not left half claimed, and the adapter serves once writing works again."""
    ps = prompts(3, seed=31, lo=6, hi=14)
    names = ["all", "qv", None]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, lora=n) for n in names]
    engine = make(llama_dir, adapters, max_loras=2)
    want = {f"r{i}": engine.generate([p], q)[0].outputs[0].delta_token_ids for i, (p, q) in enumerate(zip(ps, params))}
    registry = engine.adapters
    registry.recent.clear(), registry.slot_of.clear()  # a cold start: every adapter is written anew
    written = registry.write

    def write(slot, adapter):
        if adapter.name == "qv":
            raise torch.OutOfMemoryError("injected: no room for the adapter")
        written(slot, adapter)

    registry.write = write
    for i, (p, q) in enumerate(zip(ps, params)):
        engine.add_request(f"r{i}", p, q)
    got, errors = {f"r{i}": [] for i in range(3)}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id].extend(out.outputs[0].delta_token_ids)
            if out.error is not None:
                errors[out.request_id] = out.error
    assert list(errors) == ["r1"] and "qv" in errors["r1"] and "OutOfMemoryError" in errors["r1"]
    assert got["r0"] == want["r0"] and got["r2"] == want["r2"]
    assert not registry.holders and not registry.waiting and not engine.lora_queue
    assert "qv" not in registry.slot_of
    registry.write = written
    assert greedy(engine, [ps[1]], "qv", n=6) == [want["r1"]]
