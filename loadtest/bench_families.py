"""Every model family: Augur against transformers ``generate``, speculation against plain decoding.

On this CPU, on small random-weight checkpoints built in the same run.

``python -m loadtest.bench_families [--families A B ...] [--rounds 3] [--max-tokens 48] [--dtype auto]
[--compile off|auto|on] [--quick] [--json PATH]`` builds, per family, a random checkpoint at a small
but real-ish shape (hidden 512, 6 layers, 8 query heads over 2 KV heads, vocab 8192; the
mixtures scaled down from the released ratios: Qwen3-MoE 64 experts top-8, Qwen2-MoE 16 top-4 with a
shared expert, Mixtral 8 top-2, GLM-4.5 64 top-8 with a shared expert and its first layer dense,
DeepSeek-V3 the same in 8 groups of which 4 are kept, with latent attention over a latent of a quarter
of the hidden size, MiniMax-M2 64 top-8 by sigmoid, RoPE on half of each head),
saves it with a word-level tokenizer as a Hugging Face directory, and measures, greedy and in one
process:

- transformers ``generate`` at batch 1 (sdpa attention, the same dtype) and Augur at one request in
  flight, on the same prompt to the same number of tokens: tokens/s and their ratio;
- Augur with eight requests in flight (aggregate tokens/s);
- on a repetitive prompt (a random phrase said four times), plain decoding (an engine with
  ``--speculative-method none``) against the default ``auto`` (the lookups, chosen per request and
  step) and ngram alone (prompt lookup, pinned per request on the ``auto`` engine): tokens/s ratios
  and the mean acceptance length (tokens per verify step). Ngram stands for the lookups because it
  keeps no state across requests, where suffix decoding would draft from the ``auto`` run's output
  of the same prompt. Random weights do not copy the way trained ones do: these ratios measure the
  drafting's overhead and what the random model's own loops give, not a trained model's gain.

Both engines are built as ``augur serve`` builds them on this CPU (``--dtype auto``: bfloat16 where
the CPU has bf16 units, else float32; at most eight requests at once) but eager by default, as
``generate`` is: compiling two engines adds about a minute a family on two cores (more while other
work shares them); ``--compile auto`` measures the compiled forwards ``augur serve`` swaps in. The
host's speed drifts by a quarter within minutes, so each round runs every measurement once,
alternating which side of a pair goes first, with fresh prompts each round; a cell is the median over
rounds and a ratio the median of the rounds' own ratios.

Exactness, checked on the way: Augur's greedy tokens at one request equal ``generate``'s (in float32;
in bfloat16 the two round differently and may part at a near tie: reported, not an error), and the
speculative runs' tokens equal plain decoding's. A family whose module does not import yet is skipped
with a note. Prints a markdown table; ``--json`` writes every round.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.models import model_class
from engine.offline.measure import machine_description
from engine.request.sampling_params import SamplingParams

MOE = (
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "MixtralForCausalLM",
    "Glm4MoeForCausalLM",
    "DeepseekV3ForCausalLM",
    "MiniMaxM2ForCausalLM",
    "Mistral4ForCausalLM",
    "Ernie4_5_MoeForCausalLM",
)
DENSE = (
    "LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM",
    "SmolLM3ForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM", "GraniteForCausalLM", "Ministral3ForCausalLM",
    "SeedOssForCausalLM", "Ernie4_5ForCausalLM", "Exaone4ForCausalLM", "Gemma4ForCausalLM", "ArceeForCausalLM",
    "ApertusForCausalLM",
)  # fmt: skip
FAMILIES = MOE + DENSE
BOS, EOS, PAD = 0, 1, 2
CONCURRENCY = 8
NEAR_TIE = 1e-3  # top-two logit gap below which float32 rounding may pick either token


@dataclasses.dataclass(frozen=True)
class Shape:
    """A checkpoint's size. ``intermediate`` is a dense MLP's width (Mixtral's experts are that wide);
    ``expert`` the width of Qwen's experts, ``shared`` Qwen2-MoE's shared expert's."""

    vocab: int = 8192
    hidden: int = 512
    layers: int = 6
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 1536
    window: int = 128  # sliding-window layers' window (Gemma 2 and 3): shorter than the longest context
    expert: int = 192
    shared: int = 1024
    prompt_len: int = 64
    max_tokens: int = 48


BENCH = Shape()
QUICK = Shape(vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, window=16,
              expert=32, shared=64, prompt_len=16, max_tokens=16)  # fmt: skip


def family_config(arch: str, s: Shape) -> transformers.PretrainedConfig:
    common = dict(
        vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate, num_hidden_layers=s.layers,
        num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, max_position_embeddings=2048,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, architectures=[arch],
    )  # fmt: skip
    gemma = dict(head_dim=s.head_dim, query_pre_attn_scalar=s.head_dim, sliding_window=s.window)
    moe = dict(head_dim=s.head_dim, moe_intermediate_size=s.expert)
    mla = dict(  # latent attention over 64 experts and a shared one (DeepSeek-V3's and Mistral 4's)
        common, num_key_value_heads=s.heads, moe_intermediate_size=s.expert, kv_lora_rank=s.hidden // 4,
        qk_nope_head_dim=s.head_dim, v_head_dim=s.head_dim, n_routed_experts=64, n_shared_experts=1,
        norm_topk_prob=True,
    )  # fmt: skip
    configs = {  # the released models' features, at this shape
        "Qwen3MoeForCausalLM": lambda: transformers.Qwen3MoeConfig(
            **common, **moe, num_experts=64, num_experts_per_tok=8, norm_topk_prob=True
        ),
        "Qwen2MoeForCausalLM": lambda: transformers.Qwen2MoeConfig(
            **common, **moe, shared_expert_intermediate_size=s.shared, num_experts=16, num_experts_per_tok=4
        ),
        "MixtralForCausalLM": lambda: transformers.MixtralConfig(
            **common, head_dim=s.head_dim, num_local_experts=8, num_experts_per_tok=2
        ),
        "Glm4MoeForCausalLM": lambda: transformers.Glm4MoeConfig(  # GLM-4.5-Air's features (128 experts, top 8)
            **common,
            **moe,
            n_routed_experts=64,
            num_experts_per_tok=8,
            n_shared_experts=1,
            first_k_dense_replace=1,
            attention_bias=True,
            norm_topk_prob=True,
        ),
        "DeepseekV3ForCausalLM": lambda: transformers.DeepseekV3Config(  # DeepSeek-V3's ratios: 8 groups, top 4
            **mla,
            q_lora_rank=3 * s.hidden // 8,
            qk_rope_head_dim=s.head_dim // 2,
            num_experts_per_tok=8,
            n_group=8,
            topk_group=4,
            first_k_dense_replace=1,
        ),
        "Mistral4ForCausalLM": lambda: transformers.Mistral4Config(  # Small 4's ratios: 64 experts here, top 4
            **mla,
            q_lora_rank=s.hidden // 2,
            qk_rope_head_dim=s.head_dim,
            num_experts_per_tok=4,
            first_k_dense_replace=0,
            rope_parameters={  # the released RoPE and query scale, the original context cut to 256
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 256,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.1,
            },  # fmt: skip
        ),
        "Ernie4_5_MoeForCausalLM": lambda: transformers.Ernie4_5_MoeConfig(  # 21B-A3B's ratios: 64 experts, top 6
            **common,
            head_dim=s.head_dim,
            moe_intermediate_size=s.expert,
            moe_num_experts=64,
            moe_k=6,
            moe_num_shared_experts=2,
            moe_layer_start_index=1,
            moe_layer_end_index=s.layers - 1,
        ),
        "MiniMaxM2ForCausalLM": lambda: (
            transformers.MiniMaxM2Config(  # M2's ratios: 64 experts here, top 8, half-head RoPE
                **{**common, "intermediate_size": s.expert},
                head_dim=s.head_dim,
                num_local_experts=64,
                num_experts_per_tok=8,
                rotary_dim=s.head_dim // 2,
            )
        ),
        "LlamaForCausalLM": lambda: transformers.LlamaConfig(**common, head_dim=s.head_dim),
        "Qwen3ForCausalLM": lambda: transformers.Qwen3Config(**common, head_dim=s.head_dim),
        "Gemma2ForCausalLM": lambda: transformers.Gemma2Config(**common, **gemma),
        "Gemma3ForCausalLM": lambda: transformers.Gemma3TextConfig(**common, **gemma),
        "Phi3ForCausalLM": lambda: transformers.Phi3Config(**common),
        "SeedOssForCausalLM": lambda: transformers.SeedOssConfig(  # the released biases: q/k/v, not o
            **common, head_dim=s.head_dim, attention_bias=True, attention_out_bias=False
        ),
        "Ernie4_5ForCausalLM": lambda: transformers.Ernie4_5Config(**common, head_dim=s.head_dim),
        "Exaone4ForCausalLM": lambda: transformers.Exaone4Config(  # the 32B model's 3 sliding : 1 full layers
            **common, head_dim=s.head_dim, sliding_window=s.window, sliding_window_pattern=4
        ),
        "Gemma4ForCausalLM": lambda: transformers.Gemma4TextConfig(  # the 31B's: 5 local : 1 global layers, the
            # global ones with heads twice as wide, one KV head, keys as values and a quarter of each head turned
            **common,
            head_dim=s.head_dim,
            global_head_dim=2 * s.head_dim,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            sliding_window=s.window,
            hidden_size_per_layer_input=0,
            final_logit_softcapping=30.0,
        ),
        "ArceeForCausalLM": lambda: transformers.ArceeConfig(**common, hidden_act="relu2"),  # AFM-4.5B's MLP
        "ApertusForCausalLM": lambda: transformers.ApertusConfig(**common, head_dim=s.head_dim),  # xIELU, q/k norms
        "SmolLM3ForCausalLM": lambda: transformers.SmolLM3Config(**common, no_rope_layer_interval=4),
        "Olmo2ForCausalLM": lambda: transformers.Olmo2Config(**common),
        "Olmo3ForCausalLM": lambda: transformers.Olmo3Config(  # 3 sliding : 1 full layers, YaRN on the full ones
            **common,
            sliding_window=s.window,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
                "full_attention": {
                    "rope_type": "yarn",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "original_max_position_embeddings": 256,
                },
            },
        ),  # fmt: skip
        "Ministral3ForCausalLM": lambda: transformers.Ministral3Config(  # the released RoPE, its context cut to 256
            **common,
            head_dim=s.head_dim,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1_000_000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 256,
                "llama_4_scaling_beta": 0.1,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        ),  # fmt: skip
        "GraniteForCausalLM": lambda: transformers.GraniteConfig(  # Granite 3.3 8B's multipliers
            **common,
            embedding_multiplier=12.0,
            attention_multiplier=0.0078125,
            residual_multiplier=0.22,
            logits_scaling=16.0,
            tie_word_embeddings=True,
        ),
    }
    return configs[arch]()


def write_tokenizer(path: Path, vocab: int) -> None:
    """A word-level tokenizer, one word (`` w3``, `` w4``, ...) per id: the benchmark feeds token ids, so
    only decoding reads it (the detokenizer; structured outputs' token table, which wants byte-level
    tokens: ``Ġ`` is byte-level's space)."""
    words = {"<bos>": BOS, "<eos>": EOS, "<pad>": PAD, **{f"\u0120w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(path)


def build_checkpoint(path: Path, arch: str, shape: Shape, std: float = 0.08, seed: int = 0) -> tuple[int, int]:
    """A random-weight checkpoint of ``arch`` saved as transformers saves it; returns its parameters,
    all and active per token (a mixture's unchosen experts left out). Matrices get a wider spread than
    transformers' initializer (as the tests' checkpoints do), which makes near ties between the top two
    logits rarer; norm weights stay near transformers' own start (1, or 0 where the family scales by
    1 + weight); routers get larger weights, so that tokens spread over the experts (a sigmoid router
    short of saturating), and a sigmoid router's expert bias random values."""
    torch.manual_seed(seed)
    config = family_config(arch, shape)
    model = getattr(transformers, arch)(config).float()  # (Mistral 4's is not among AutoModelForCausalLM's)
    experts = 0
    # A sigmoid router (DeepSeek-V3's, GLM-4.5's, MiniMax-M2's) at 0.5 would saturate: scores of exactly 1.0
    # tie, and which of the tied experts a token reads is then the engines' tie-breaking, not the model's.
    sigmoid = config.model_type in ("glm4_moe", "deepseek_v3", "minimax_m2")
    router_std = 2.0 / shape.hidden**0.5 if sigmoid else 0.5
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".gate.weight"):  # a router (Qwen2-MoE's shared_expert_gate is not one)
                p.normal_(0.0, router_std)
            elif p.dim() > 1:
                p.normal_(0.0, std)
            else:
                p.add_(torch.randn_like(p), alpha=0.05)
            experts += p.numel() if ".experts." in name else 0
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # the learned balance: enough to change a choice
                b.normal_(0.0, 0.05)
    total = sum(p.numel() for p in model.parameters())
    n = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    active = total - experts + (experts * config.num_experts_per_tok // n if n else 0)
    model.save_pretrained(path)
    write_tokenizer(path, shape.vocab)
    transformers.GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD).save_pretrained(path)
    return total, active


def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], float]:
    """``generate``'s greedy tokens (EOS not special: it decodes ``n`` tokens as Augur's requests do)
    and its tokens/s."""
    ids = torch.tensor([prompt])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=None,
            pad_token_id=PAD,
        )  # fmt: skip
    seconds = time.perf_counter() - t0
    tokens = out[0, len(prompt) :].tolist()
    return tokens, len(tokens) / seconds


def augur_run(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, concurrency: int
) -> tuple[list[list[int]], float, float]:
    """Every prompt, ``concurrency`` requests in flight: the tokens per prompt, the aggregate
    tokens/s and the mean acceptance length (tokens per verify step of a request)."""
    pending = list(enumerate(prompts))
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    in_flight = steps = 0
    t0 = time.perf_counter()
    while pending or in_flight:
        while pending and in_flight < concurrency:
            i, p = pending.pop(0)
            engine.add_request(f"{i}-{time.monotonic_ns()}", p, params)
            in_flight += 1
        for out in engine.step():
            tokens[int(out.request_id.split("-")[0])] += out.outputs[0].delta_token_ids
            if out.finished:
                in_flight -= 1
                steps += out.stats.num_decode_steps
    seconds = time.perf_counter() - t0
    produced = sum(len(t) for t in tokens.values())
    return [tokens[i] for i in range(len(prompts))], produced / seconds, produced / max(steps, 1)


def round_prompts(shape: Shape, seed: int) -> dict[str, list[list[int]]]:
    """A round's prompts: one random prompt (batch 1), eight (concurrency 8), one repetitive."""
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(3, shape.vocab) for _ in range(n)]

    phrase = draw(shape.prompt_len // 4)
    return {
        "one": [draw(shape.prompt_len)],
        "many": [draw(shape.prompt_len) for _ in range(CONCURRENCY)],
        "repetitive": [phrase * 4],
    }


def first_difference(hf, prompt: list[int], a: list[int], b: list[int]) -> tuple[int, float]:
    """Where two greedy continuations part, and the gap between ``generate``'s top two logits there
    (near zero: a near tie, which two correct implementations summing in different orders may break
    differently)."""
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    with torch.inference_mode():
        top = hf(torch.tensor([prompt + a[:i]])).logits[0, -1].float().topk(2).values
    return i, float(top[0] - top[1])


def engine_config(path: Path, dtype: str, compile_: str, method: str, shape: Shape) -> EngineConfig:
    return EngineConfig(
        model=str(path), device="cpu", dtype=dtype, compile=compile_, speculative_method=method,
        max_num_seqs=CONCURRENCY, max_model_len=shape.prompt_len + shape.max_tokens + 32,
    )  # fmt: skip


@dataclasses.dataclass
class Subjects:
    """What one family at one dtype is measured on: transformers' model and Augur's two engines."""

    hf: transformers.PreTrainedModel
    plain: LLMEngine  # --speculative-method none
    spec: LLMEngine  # --speculative-method auto (the lookups)
    max_tokens: int

    def warm_up(self, ps: dict[str, list[list[int]]]) -> None:
        """Compiled shapes, allocators, the controller's first costs: a short run of every kind."""
        short = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        hf_greedy(self.hf, ps["one"][0], 8)
        for eng in (self.plain, self.spec):
            augur_run(eng, ps["one"], short, 1)
            augur_run(eng, ps["many"], short, CONCURRENCY)
        augur_run(self.spec, ps["repetitive"], short, 1)

    def round(self, ps: dict[str, list[list[int]]], flip: bool) -> dict:
        """Every measurement once on this round's prompts; ``flip``: the other side of each pair first."""
        n = self.max_tokens
        greedy = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        pair = {
            "hf": lambda: hf_greedy(self.hf, ps["one"][0], n),
            "augur": lambda: augur_run(self.plain, ps["one"], greedy, 1),
        }
        got = {k: pair[k]() for k in (("augur", "hf") if flip else ("hf", "augur"))}
        (hf_tokens, hf_tps), (augur_tokens, augur_tps, _) = got["hf"], got["augur"]
        _, many_tps, _ = augur_run(self.plain, ps["many"], greedy, CONCURRENCY)
        cells = {  # ngram after auto: auto's output would teach suffix decoding the answer, not prompt lookup
            "plain": (self.plain, greedy),
            "auto": (self.spec, greedy),
            "ngram": (self.spec, dataclasses.replace(greedy, speculative_method="ngram")),
        }
        order = ("auto", "ngram", "plain") if flip else ("plain", "auto", "ngram")
        rep = {m: augur_run(cells[m][0], ps["repetitive"], cells[m][1], 1) for m in order}
        same, at, gap = hf_tokens == augur_tokens[0], None, None
        if not same:
            at, gap = first_difference(self.hf, ps["one"][0], hf_tokens, augur_tokens[0])
        return {
            "hf_tps": hf_tps, "augur_tps": augur_tps, "augur_c8_tps": many_tps,
            "plain_rep_tps": rep["plain"][1], "auto_tps": rep["auto"][1], "ngram_tps": rep["ngram"][1],
            "auto_acceptance": rep["auto"][2], "ngram_acceptance": rep["ngram"][2],
            "identical": same, "first_difference": at, "logit_gap_at_difference": gap,
            "hf_tokens": hf_tokens, "augur_tokens": augur_tokens[0],
            "spec_identical": all(rep[m][0] == rep["plain"][0] for m in ("auto", "ngram")),
        }  # fmt: skip


def bench_dtype(path: Path, dtype: str, args: argparse.Namespace, shape: Shape) -> dict:
    """One family at one dtype: ``args.rounds`` interleaved rounds, fresh prompts each; medians."""
    plain = LLMEngine(engine_config(path, dtype, args.compile, "none", shape))
    spec = LLMEngine(engine_config(path, dtype, args.compile, "auto", shape))
    arch = transformers.AutoConfig.from_pretrained(path).architectures[0]  # (its class: Mistral 4's has no Auto entry)
    hf = getattr(transformers, arch).from_pretrained(path, dtype=plain.dtype).eval()
    subjects = Subjects(hf, plain, spec, shape.max_tokens)
    subjects.warm_up(round_prompts(shape, seed=10_000))
    rounds = [subjects.round(round_prompts(shape, seed=r), flip=r % 2 == 1) for r in range(args.rounds)]
    notes = []  # loud ("!!!") where exactness is promised: speculation always, generate's tokens in float32
    for r, x in enumerate(rounds):
        if not x["identical"]:
            i = x["first_difference"]
            notes.append(
                f"{'!!!' if plain.dtype == torch.float32 else 'note:'} round {r}: Augur's tokens differ from "
                f"generate's at token {i} ({x['hf_tokens'][i : i + 1]} vs {x['augur_tokens'][i : i + 1]}), "
                f"where generate's top two logits are {x['logit_gap_at_difference']:.2g} apart"
            )
        if not x["spec_identical"]:
            notes.append(f"!!! round {r}: speculative tokens differ from plain decoding's")

    def med(key: str) -> float:
        return statistics.median(x[key] for x in rounds)

    def ratio(a: str, b: str) -> float:
        return statistics.median(x[a] / x[b] for x in rounds)

    return {
        "dtype": str(plain.dtype).removeprefix("torch."),
        "hf_tps": med("hf_tps"),
        "augur_tps": med("augur_tps"),
        "augur_vs_hf": ratio("augur_tps", "hf_tps"),
        "augur_c8_tps": med("augur_c8_tps"),
        "plain_rep_tps": med("plain_rep_tps"),
        "auto_vs_plain": ratio("auto_tps", "plain_rep_tps"),
        "ngram_vs_plain": ratio("ngram_tps", "plain_rep_tps"),
        "auto_acceptance": med("auto_acceptance"),
        "ngram_acceptance": med("ngram_acceptance"),
        "identical": all(x["identical"] for x in rounds),
        "near_tie": all(x["identical"] or x["logit_gap_at_difference"] < NEAR_TIE for x in rounds),
        "spec_identical": all(x["spec_identical"] for x in rounds),
        "notes": notes,
        "rounds": rounds,
    }


def unavailable(arch: str) -> str | None:
    """Why the family cannot be benchmarked yet (its module does not import), or None."""
    try:
        model_class(arch)
    except Exception as e:  # a module being written: any error in importing it
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return None


def identity(row: dict) -> str:
    if row["identical"]:
        return "yes"
    return "no (near tie)" if row["near_tie"] else "NO"


def format_table(rows: list[dict]) -> str:
    header = (
        "| family | dtype | params M | active M | HF tok/s | Augur c=1 tok/s | Augur / HF | Augur c=8 tok/s "
        "| auto / plain | ngram / plain | acc. len auto, ngram | tokens = HF | spec = plain |"
    )
    lines = [header, "|" + " --- |" * header.count(" | ") + " --- |"]
    for r in rows:
        lines.append(
            f"| {r['family']} | {r['dtype']} | {r['params'] / 1e6:.1f} | {r['active_params'] / 1e6:.1f} "
            f"| {r['hf_tps']:.1f} | {r['augur_tps']:.1f} | {r['augur_vs_hf']:.2f}x | {r['augur_c8_tps']:.1f} "
            f"| {r['auto_vs_plain']:.2f}x | {r['ngram_vs_plain']:.2f}x "
            f"| {r['auto_acceptance']:.2f}, {r['ngram_acceptance']:.2f} "
            f"| {identity(r)} | {'yes' if r['spec_identical'] else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES, metavar="ARCH")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; --quick: 1)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens a request (default 48; --quick: 16)")
    ap.add_argument(
        "--dtype",
        nargs="+",
        default=["auto"],
        choices=["auto", "float32", "bfloat16"],
        help="auto (what augur serve picks), float32, bfloat16",
    )
    ap.add_argument(
        "--compile", default="off", choices=["off", "auto", "on"], help="both engines' forwards (auto: as augur serve)"
    )
    ap.add_argument("--quick", action="store_true", help="tiny shapes, one round, eager: a smoke test")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the rows, every round's numbers too")
    args = ap.parse_args(argv)
    shape = QUICK if args.quick else BENCH
    args.rounds = args.rounds or (1 if args.quick else 3)
    if args.max_tokens:
        shape = dataclasses.replace(shape, max_tokens=args.max_tokens)
    print(f"{machine_description(torch.device('cpu'))}, {torch.get_num_threads()} torch threads; {args.rounds} "
          f"rounds; prompts of {shape.prompt_len} tokens, {shape.max_tokens} generated; compile {args.compile}; "
          f"transformers {transformers.__version__}", flush=True)  # fmt: skip
    rows, skipped = [], {}
    with tempfile.TemporaryDirectory(prefix="augur-families-") as root:
        for arch in args.families:
            why = unavailable(arch)
            if why is not None:
                skipped[arch] = why
                print(f"skipped {arch}: its module does not import ({why})", flush=True)
                continue
            t0 = time.perf_counter()
            path = Path(root) / arch
            try:
                total, active = build_checkpoint(path, arch, shape)
                for dtype in args.dtype:
                    row = {"family": arch, "params": total, "active_params": active}
                    rows.append({**row, **bench_dtype(path, dtype, args, shape)})
                    gc.collect()
                    for note in rows[-1]["notes"]:
                        print(f"{arch} {rows[-1]['dtype']}: {note}", flush=True)
            except Exception as e:  # a family being written may load and fail: report it, go on
                traceback.print_exc()
                skipped[arch] = f"failed: {type(e).__name__}: {e}".splitlines()[0]
                print(f"skipped {arch}: {skipped[arch]}", flush=True)
            print(f"{arch}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    table = format_table(rows)
    print(table)
    for arch, why in skipped.items():
        print(f"- {arch} skipped: {why}")
    report = {
        "machine": machine_description(torch.device("cpu")), "shape": dataclasses.asdict(shape), "rounds": args.rounds,
        "compile": args.compile, "rows": rows, "skipped": skipped, "table": table,
    }  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
