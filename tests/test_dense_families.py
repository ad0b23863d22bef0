"""Phi-3, SmolLM3, OLMo 2, OLMo 3, Granite 3, Seed-OSS, EXAONE 4, Arcee and Apertus against transformers on
tiny random models (float32, CPU): logits through chunked prefill and paged decodes, greedy generation
with requests joining a running batch, speculative greedy identity (lookup and layer skipping), tensor
parallelism at 2 ranks (and 4 for OLMo 2's norms across replicated key heads), and one check per family
that its feature changes the result, so that the parity proves it implemented and not merely harmless:

- Phi-3: partial rotary embeddings (half of each head turned) and LongRoPE's short / long factors;
- SmolLM3: NoPE layers (every other one here, those also sliding-window layers);
- OLMo 2: q/k norms over the whole projection, not per head;
- OLMo 3: sliding-window layers, and YaRN on the full-attention layer's RoPE alone;
- Granite 3: its four multipliers (embeddings, attention scores, residual branches, logits);
- Seed-OSS: biases on q/k/v and none on the output projection, as released (Llama's rule, one flag for
  both, would look for an output bias the checkpoint does not have);
- EXAONE 4: sliding-window layers turning RoPE beside a full-attention layer turning none;
- Arcee and Apertus: an MLP without a gate, under ReLU squared and under xIELU with learned parameters.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from families import check_served, hf_logits, paged_logits, save_random
from families import hf_eager as hf_model
from test_engine import hf_greedy, prompts, run_staggered
from test_step import prompts as repetitive_prompts
from tp_ranks import model_logits, sharded_logits

from conftest import VOCAB
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.parallel import TensorParallel
from engine.request.sampling_params import SamplingParams
from engine.runner.loader import load_config, load_model

PHI3_WINDOW, SMOL_WINDOW, OLMO3_WINDOW, EXAONE_WINDOW = 16, 8, 8, 8
ORIGINAL = 32  # the LongRoPE model's original_max_position_embeddings
FAMILIES = ["phi3", "smollm3", "olmo2", "olmo3", "granite", "seed_oss", "exaone4", "arcee", "apertus"]
# Granite's multipliers, each away from 1 (and the attention scale from head_dim ** -0.5 = 0.25)
GRANITE = dict(embedding_multiplier=6.0, attention_multiplier=0.05, residual_multiplier=0.4, logits_scaling=3.0)


def family_config(family: str, **overrides):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    if family == "phi3":  # half of each 16-wide head rotated, a window shorter than the prompts
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        common.update(sliding_window=PHI3_WINDOW, rope_parameters=rope)
        cls = transformers.Phi3Config
    elif family == "phi3-longrope":  # Phi-4-mini's shape: 3/4 of each head rotated, LongRoPE, tied
        g = torch.Generator().manual_seed(5)
        rope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "short_factor": (1.0 + torch.rand(6, generator=g)).tolist(),
            "long_factor": (1.0 + 8.0 * torch.rand(6, generator=g)).tolist(),
        }
        common.update(
            max_position_embeddings=4 * ORIGINAL,
            original_max_position_embeddings=ORIGINAL,
            rope_parameters=rope,
            tie_word_embeddings=True,
        )
        family, cls = "phi3", transformers.Phi3Config
    elif family == "smollm3":  # layers 1 and 3 NoPE and sliding; biases on the attention
        common.update(no_rope_layer_interval=2, use_sliding_window=True, sliding_window=SMOL_WINDOW)
        common.update(attention_bias=True, tie_word_embeddings=False)
        cls = transformers.SmolLM3Config
    elif family == "olmo2":
        cls = transformers.Olmo2Config
    elif family == "olmo3":  # layers 0-2 sliding (a window shorter than the prompts), layer 3 full, its RoPE YaRN
        rope = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {
                "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
            },
        }  # fmt: skip
        common.update(sliding_window=OLMO3_WINDOW, rope_parameters=rope)
        cls = transformers.Olmo3Config
    elif family == "granite":  # biases on the attention and the MLP
        common.update(**GRANITE, attention_bias=True, mlp_bias=True)
        cls = transformers.GraniteConfig
    elif family == "seed_oss":  # the released biases: q/k/v, not o
        common.update(head_dim=16, attention_bias=True, attention_out_bias=False, mlp_bias=False)
        cls = transformers.SeedOssConfig
    elif family == "exaone4":  # layers 0-2 sliding (with RoPE), layer 3 full (NoPE); post-norms, per-head q/k norms
        common.update(head_dim=16, sliding_window=EXAONE_WINDOW, sliding_window_pattern=4, tie_word_embeddings=False)
        cls = transformers.Exaone4Config
    elif family == "arcee":  # an MLP without a gate, ReLU squared; YaRN
        yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128}
        common.update(hidden_act="relu2", rope_parameters=yarn)
        cls = transformers.ArceeConfig
    elif family == "apertus":  # q/k norms per head, an MLP without a gate under xIELU, Llama 3's RoPE scaling
        common.update(head_dim=16)
        cls = transformers.ApertusConfig
    else:
        raise ValueError(family)
    arch = {
        "phi3": "Phi3ForCausalLM", "smollm3": "SmolLM3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
        "olmo3": "Olmo3ForCausalLM", "granite": "GraniteForCausalLM", "seed_oss": "SeedOssForCausalLM",
        "exaone4": "Exaone4ForCausalLM", "arcee": "ArceeForCausalLM", "apertus": "ApertusForCausalLM",
    }[family]  # fmt: skip
    return cls(**{**common, "architectures": [arch], **overrides})


def build_dir(path: Path, tokenizer_dir: Path, family: str, std: float = 0.2, seed: int = 0) -> Path:
    """A random-weight model with the test tokenizer, saved as a Hugging Face directory. Norm weights
    near 1, biases near 0."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(family_config(family), dtype=torch.float32)
    return save_random(model, path, tokenizer_dir, std)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dense-families")
    return {f: build_dir(root / f, tokenizer_dir, f) for f in [*FAMILIES, "phi3-longrope"]}


def make_engine(model_dir: Path, **kw) -> LLMEngine:
    kw = {"num_kv_blocks": 128, "block_size": 4, "dtype": "float32", **kw}
    return LLMEngine(EngineConfig(model=str(model_dir), device="cpu", **kw))


def engine_logits(model_dir: Path, ids: list[int], **kw) -> torch.Tensor:
    return paged_logits(make_engine(model_dir, **kw), ids)


# -- parity with transformers -------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(dirs, family):
    """A 30-token prompt: past both sliding windows, so the windowed layers drop context."""
    ids = prompts(1, seed=1, lo=30, hi=31)[0]
    expected = hf_logits(hf_model(dirs[family]), ids)
    torch.testing.assert_close(engine_logits(dirs[family], ids), expected, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf_generate(dirs, family):
    """Requests joining a running batch every other step, prefill chunked (32 tokens a step), 4-token
    blocks; every KV block comes back."""
    engine = make_engine(dirs[family], max_num_batched_tokens=32)
    ps = prompts(4, seed=2, lo=10, hi=36)
    params = SamplingParams(temperature=0.0, max_tokens=10)
    got = run_staggered(engine, ps, params)
    ref = hf_model(dirs[family])
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == hf_greedy(ref, p, params.max_tokens), f"prompt {i}"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_greedy_is_plain_greedy(dirs, family):
    """Verify forwards of n-gram lookups and of the model drafting for itself with its middle layers
    skipped (the untuned layer-skip default: both sublayers of layers 1 and 2) emit exactly the plain
    greedy tokens."""
    ps = repetitive_prompts(4, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, num_draft_tokens=3)
    plain = [o.outputs[0].delta_token_ids for o in make_engine(dirs[family]).generate(ps, params)]
    accepted = 0
    for method in ("ngram", "layer-skip"):
        eng = make_engine(dirs[family], speculative_method=method, max_num_batched_tokens=32)
        assert [o.outputs[0].delta_token_ids for o in eng.generate(ps, params)] == plain, method
        assert eng.spec_stats.num_drafts > 0, method
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks, method
        accepted += eng.spec_stats.num_accepted_tokens
    assert accepted > 0, "some drafts must be right, or the accepting path went untested"


# -- tensor parallelism ---------------------------------------------------------------------------------
def test_sharded_logits_match_the_unsharded_model(dirs):
    """Each family at 2 ranks (Phi-3's fused checkpoint tensors cut per rank, OLMo 2's q/k norms summed
    over ranks) and OLMo 2 at 4 (each key head on two ranks: their sums counted once) give 1 rank's
    logits, for prefills of two sequences, a decode and a 3-token chunk."""
    names = [*FAMILIES, "phi3-longrope"]
    for name, sharded in zip(names, sharded_logits([dirs[n] for n in names], 2), strict=True):
        for want, have in zip(model_logits(dirs[name]), sharded, strict=True):
            torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5, msg=name)
    (four,) = sharded_logits([dirs["olmo2"]], 4)
    for want, have in zip(model_logits(dirs["olmo2"]), four, strict=True):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5, msg="olmo2 at 4 ranks")


def test_an_engine_at_two_ranks_decodes_as_one_rank_does(dirs):
    """Through the engine (rank 0 driving a worker process): greedy tokens at -tp 2 equal -tp 1's."""
    ps = prompts(2, seed=4, lo=12, hi=30)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for family in FAMILIES:
        want = [o.outputs[0].delta_token_ids for o in make_engine(dirs[family]).generate(ps, params)]
        eng = make_engine(dirs[family], tensor_parallel_size=2, compile="off")
        try:
            assert eng.runner.model.tp.size == 2
            assert [o.outputs[0].delta_token_ids for o in eng.generate(ps, params)] == want, family
        finally:
            eng.close()


def test_phi3_refuses_nf4_quantizing_under_tensor_parallelism(dirs):
    """NF4 quantizes each checkpoint matrix as it streams in, before Phi-3's loader could cut a rank's
    q/k/v and gate/up rows out of the fused ones: a clear start-up error, not a shape mismatch."""
    d = dirs["phi3"]
    with pytest.raises(ValueError, match="Phi-3 cannot be quantized as it loads under tensor parallelism"):
        load_model(
            d, load_config(d), torch.float32, torch.device("cpu"), 64, quantization="nf4", tp=TensorParallel(0, 2)
        )


# -- what each family's feature changes ------------------------------------------------------------------
def test_phi3_partial_rotary_matters(dirs):
    """Our model rotates 8 of 16 dimensions per head (the parity above); rotating all 16 would change
    transformers' logits far beyond the parity's tolerance."""
    model = make_engine(dirs["phi3"]).runner.model
    assert model.rope_cos.shape[1] == 8 and all(layer.self_attn.rotary_dim == 8 for layer in model.layers)
    assert model.sliding_window == PHI3_WINDOW and all(layer.self_attn.sliding for layer in model.layers)
    ids = prompts(1, seed=1, lo=30, hi=31)[0]
    partial = hf_logits(hf_model(dirs["phi3"]), ids)
    full_rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
    assert (hf_logits(hf_model(dirs["phi3"], rope_parameters=full_rope), ids) - partial).abs().max() > 1e-2


def test_phi3_longrope_picks_its_factors_by_the_engines_length(dirs):
    """An engine no longer than the original 32 positions uses the short factors: transformers' logits
    for a 30-token sequence. A longer one uses the long factors at every position: transformers' logits
    for a 40-token sequence (past 32, where it switches); on the 30 tokens those differ from the short
    ones (the rule matters). Partial rotary (12 of 16 dimensions) and a tied output layer too."""
    d = dirs["phi3-longrope"]
    ref = hf_model(d)
    short_ids = prompts(1, seed=6, lo=30, hi=31)[0]
    long_ids = prompts(1, seed=6, lo=40, hi=41)[0]
    short = engine_logits(d, short_ids, max_model_len=ORIGINAL)
    torch.testing.assert_close(short, hf_logits(ref, short_ids), atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(engine_logits(d, long_ids), hf_logits(ref, long_ids), atol=2e-4, rtol=2e-4)
    assert (engine_logits(d, short_ids) - short).abs().max() > 1e-2


def test_smollm3_nope_layers_matter(dirs):
    """Layers 1 and 3 leave RoPE out (and slide); with RoPE in every layer transformers' logits change
    far beyond the parity's tolerance."""
    model = make_engine(dirs["smollm3"]).runner.model
    assert [layer.self_attn.use_rope for layer in model.layers] == [True, False, True, False]
    assert [layer.self_attn.sliding for layer in model.layers] == [False, True, False, True]
    ids = prompts(1, seed=1, lo=30, hi=31)[0]
    nope = hf_logits(hf_model(dirs["smollm3"]), ids)
    all_rope = hf_logits(hf_model(dirs["smollm3"], no_rope_layers=[1, 1, 1, 1]), ids)
    assert (all_rope - nope).abs().max() > 1e-2


def test_olmo2_whole_projection_qk_norm_matters(dirs):
    """Normalizing q and k per head instead (Qwen3's way, the same weights) changes transformers' logits
    far beyond the parity's tolerance."""
    ids = prompts(1, seed=1, lo=30, hi=31)[0]
    ref = hf_model(dirs["olmo2"])
    whole = hf_logits(ref, ids)

    def per_head(norm, head_dim: int):
        def forward(x: torch.Tensor) -> torch.Tensor:
            h = x.float().unflatten(-1, (-1, head_dim))
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
            return (norm.weight * h.flatten(-2)).to(x.dtype)

        return forward

    for layer in ref.model.layers:
        attn = layer.self_attn
        attn.q_norm.forward, attn.k_norm.forward = per_head(attn.q_norm, 16), per_head(attn.k_norm, 16)
    assert (hf_logits(ref, ids) - whole).abs().max() > 1e-2


@pytest.mark.parametrize("family", ["olmo2", "olmo3"])
def test_olmo_turns_rope_in_float32_as_transformers_does(dirs, family, monkeypatch):
    """In bfloat16, each layer's q and k after RoPE are transformers' bit for bit, given the same q and
    k before it: OLMo 2 and 3 keep the tables in float32, turn in float32 and round after (rounding the
    tables to bfloat16 first, as Llama's do, gives other bits)."""
    import engine.models.olmo2 as olmo2

    hf = __import__(f"transformers.models.{family}.modeling_{family}", fromlist=["apply_rotary_pos_emb"])
    seen = []  # (input, cos, sin, output) of each call
    real = olmo2.apply_rope
    monkeypatch.setattr(olmo2, "apply_rope", lambda x, c, s: seen.append((x, c, s)) or real(x, c, s))
    engine = make_engine(dirs[family], dtype="bfloat16")
    ids = prompts(1, seed=1, lo=30, hi=31)[0]
    engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=1))
    model = transformers.AutoModelForCausalLM.from_pretrained(dirs[family], dtype=torch.bfloat16)
    positions = torch.arange(len(ids))[None]
    assert len(seen) == 2 * 4  # q and k, 4 layers: the prefill
    for layer in range(4):
        (q, cos, sin), (k, _, _) = seen[2 * layer], seen[2 * layer + 1]
        assert q.dtype == torch.bfloat16 and cos.dtype == torch.float32
        kind = () if family == "olmo2" else (model.config.layer_types[layer],)  # (OLMo 3's tables by layer type)
        want_cos, want_sin = model.model.rotary_emb(q, positions, *kind)
        want_q, want_k = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], want_cos, want_sin)
        got_q = real(q, cos, sin).to(q.dtype)
        assert torch.equal(got_q, want_q[0].transpose(0, 1)), layer
        assert torch.equal(real(k, cos, sin).to(k.dtype), want_k[0].transpose(0, 1)), layer


def test_olmo3_windows_and_rope_by_layer_type_matter(dirs):
    """Layers 0-2 slide, layer 3 attends to all and alone turns by YaRN: with every layer's window off,
    or with the sliding layers scaled too, transformers' logits change far beyond the parity's tolerance."""
    model = make_engine(dirs["olmo3"]).runner.model
    assert [layer.self_attn.sliding for layer in model.layers] == [True, True, True, False]
    assert [layer.local for layer in model.layers] == [True, True, True, False]
    assert not torch.equal(model.rope_cos, model.rope_local_cos)
    ids = prompts(1, seed=1, lo=30, hi=31)[0]
    want = hf_logits(hf_model(dirs["olmo3"]), ids)
    full = hf_logits(hf_model(dirs["olmo3"], layer_types=["full_attention"] * 4), ids)
    assert (full - want).abs().max() > 1e-2
    yarn = hf_model(dirs["olmo3"]).config.rope_parameters["full_attention"]
    both = hf_model(dirs["olmo3"], rope_parameters={"sliding_attention": dict(yarn), "full_attention": dict(yarn)})
    assert (hf_logits(both, ids) - want).abs().max() > 1e-2


def test_exaone4_windows_and_nope_matter(dirs):
    """Layers 0-2 slide and turn RoPE, layer 3 attends to all and turns nothing. With every layer full
    (none sliding, and, the model having a window, none turning RoPE) transformers' logits change far
    beyond the parity's tolerance, and they change again where RoPE turns in those full layers (no
    window at all): the parity above holds only with both rules implemented."""
    model = make_engine(dirs["exaone4"]).runner.model
    assert [layer.self_attn.sliding for layer in model.layers] == [True, True, True, False]
    assert [layer.self_attn.use_rope for layer in model.layers] == [True, True, True, False]
    ids = prompts(1, seed=1, lo=30, hi=31)[0]
    want = hf_logits(hf_model(dirs["exaone4"]), ids)
    full = hf_logits(hf_model(dirs["exaone4"], layer_types=["full_attention"] * 4), ids)
    assert (full - want).abs().max() > 1e-2
    rope = hf_logits(hf_model(dirs["exaone4"], layer_types=["full_attention"] * 4, sliding_window=None), ids)
    assert (rope - full).abs().max() > 1e-2


@pytest.mark.parametrize("multiplier", list(GRANITE))
def test_granite_multipliers_matter(dirs, multiplier):
    """Each multiplier set to 1 (the attention scale to Llama's) changes transformers' logits far beyond
    the parity's tolerance."""
    ids = prompts(1, seed=1, lo=30, hi=31)[0]
    want = hf_logits(hf_model(dirs["granite"]), ids)
    plain = 0.25 if multiplier == "attention_multiplier" else 1.0
    assert (hf_logits(hf_model(dirs["granite"], **{multiplier: plain}), ids) - want).abs().max() > 1e-2


@pytest.mark.parametrize("family", ["arcee", "apertus"])
def test_the_ungated_mlps_activation_matters(dirs, family):
    """ReLU squared (Arcee) and xIELU with the checkpoint's learned parameters (Apertus): transformers with
    SiLU in their place gives logits far beyond the parity's tolerance."""
    ids = prompts(1, seed=1, lo=30, hi=31)[0]
    want = hf_logits(hf_model(dirs[family]), ids)
    assert (hf_logits(hf_model(dirs[family], hidden_act="silu"), ids) - want).abs().max() > 1e-2


@pytest.mark.parametrize("quantization", ["nf4", "int4", "fp8"])
def test_the_ungated_mlp_loads_quantized(dirs, quantization):
    """``up_proj`` is a layer of its own, not half of a gate/up pair: every quantizer takes it whole."""
    model = make_engine(dirs["arcee"], quantization=quantization).runner.model
    assert not isinstance(model.layers[0].mlp.up_proj, torch.nn.Linear), type(model.layers[0].mlp.up_proj)


@pytest.mark.parametrize("family", FAMILIES)
def test_served_through_the_sdk(dirs, family):
    check_served(dirs[family], make_engine(dirs[family]))
