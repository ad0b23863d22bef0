"""Helpers shared by the model-family tests (test_gemma2, test_gemma3, test_dense_families, test_moe,
test_gpt_oss, test_quantized_checkpoints): transformers' reference, the engine's logits through a
chunked prefill and paged decodes, and a family served through the official SDK."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from conftest import hf_causal_lm
from engine.core.llm_engine import LLMEngine
from engine.request.sampling_params import SamplingParams
from engine.runner.model_runner import ForwardChunk


def save_random(model, path: Path, tokenizer_dir: Path, std: float = 0.2) -> Path:
    """``model`` (transformers') with random weights, saved as a Hugging Face directory with the test
    tokenizer: every matrix drawn N(0, std), norm weights near 1, other vectors (biases) near 0."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, std)
            else:
                p.normal_(1.0 if "norm" in name else 0.0, 0.05)
    model.to(torch.float32).save_pretrained(path)
    transformers.PreTrainedTokenizerFast.from_pretrained(tokenizer_dir).save_pretrained(path)
    transformers.GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2).save_pretrained(path)
    return path


def hf_eager(model_dir: Path, **config_overrides):
    """transformers' model of a checkpoint, float32, eager attention."""
    return hf_causal_lm(model_dir, dtype=torch.float32, attn_implementation="eager", **config_overrides).eval()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def paged_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Every position's logits: the first 20 tokens prefilled in two chunks (11 + 9), the rest decoded
    one at a time through the paged cache."""
    runner, table = engine.runner, engine.block_manager.fork([]) or []
    assert engine.block_manager.reserve(table, 0, len(ids)) is not None
    got = [
        runner.forward([ForwardChunk(ids[:11], 0, table, num_logits=11)]).logits,
        runner.forward([ForwardChunk(ids[11:20], 11, table, num_logits=9)]).logits,
    ]
    for t in range(20, len(ids)):
        got.append(runner.forward([ForwardChunk(ids[t : t + 1], t, table, num_logits=1)]).logits)
    return torch.cat(got)


def check_served(model_dir: Path, engine: LLMEngine, **config) -> None:
    """A chat completion (the tokenizer's chat template) and a completion through the official SDK on
    a real server (``config``: its engine's fields besides the test defaults); the completion's text
    is ``engine``'s greedy text for the same prompt."""
    import openai

    from server.app import ServerSettings, create_app
    from servers import engine_factory, serve

    with serve(create_app(ServerSettings(served_model_name="m"), engine_factory(model_dir, **config))) as srv:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="none")
        chat = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "a b c"}], max_tokens=8, temperature=0
        )
        assert chat.choices[0].message.content is not None and chat.usage.completion_tokens > 0
        text = client.completions.create(model="m", prompt="a b c a b", max_tokens=8, temperature=0)
    ids = transformers.AutoTokenizer.from_pretrained(model_dir).encode("a b c a b")
    want = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0].text
    assert text.choices[0].text == want
