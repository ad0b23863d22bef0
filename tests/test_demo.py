"""The embedded demo pair, built at the tiny size through the same code path as the real one."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch
import transformers

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.offline.demo import (
    MIN_PARAM_RATIO,
    DemoRecipe,
    build_demo,
    file_heads,
    is_built,
    is_degenerate,
    loop_coverage,
    repeated_ngrams,
    split_corpus,
)
from engine.request.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def demo(tiny_demo):
    return tiny_demo


def test_layout_and_report(demo):
    for name in ("target", "draft"):
        d = demo / name
        for f in (
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
        ):
            assert (d / f).is_file(), f"{name}/{f}"
    report = json.loads((demo / "report.json").read_text())
    assert report["target_params"] >= MIN_PARAM_RATIO * report["draft_params"]
    for key in ("target_perplexity", "draft_perplexity", "draft_target_top1_agreement"):
        assert report[key] > 0
    assert 0.0 <= report["draft_target_top1_agreement"] <= 1.0
    # Held-out perplexity is measured on files never trained on, and the trained target beats chance.
    assert report["target_perplexity"] < report["train_tokens"] and report["target_perplexity"] < 512


def test_report_has_the_greedy_quality_numbers(demo):
    """The build continues held-out prompts greedily and reports how many collapse into a loop (computed,
    not judged: the tiny model's value means nothing), with examples."""
    report = json.loads((demo / "report.json").read_text())
    recipe = DemoRecipe.tiny()
    assert report["greedy_prompts"] == recipe.quality_prompts and report["greedy_tokens"] == recipe.quality_tokens
    rate = report["greedy_degenerate_rate"]
    assert 0.0 <= rate <= 1.0 and (rate * recipe.quality_prompts).is_integer()
    prompts = [json.loads(line)["prompt"] for line in (demo / "prompts.jsonl").read_text().splitlines()]
    assert [s["prompt"] for s in report["greedy_samples"]] == prompts[: len(report["greedy_samples"])]
    assert report["greedy_samples"] and all(s["continuation"] for s in report["greedy_samples"])


def test_degenerate_output_check():
    assert loop_coverage([7] * 10) == 10
    assert loop_coverage([1, 2, 3, 1, 2, 3, 1, 2, 3]) == 9
    assert loop_coverage(list(range(20))) == 0
    assert loop_coverage([5, 9] * 3 + list(range(10, 20))) == 6
    assert loop_coverage(list(range(9)) * 2, max_period=8) == 0  # a 9-token unit is no short loop
    assert is_degenerate([4] * 40 + list(range(100, 188)))  # 40 of 128 tokens: a quarter and more
    assert not is_degenerate([4] * 31 + list(range(100, 197)))
    assert not is_degenerate(list(range(128))) and not is_degenerate([])


def test_prompts_come_from_heldout_files(demo):
    prompts = [json.loads(line) for line in (demo / "prompts.jsonl").read_text().splitlines()]
    recipe = DemoRecipe.tiny()
    assert len(prompts) == recipe.num_prompts
    train, heldout = split_corpus(recipe)
    heldout_names = {n for n, _ in heldout}
    assert heldout_names and not heldout_names & {n for n, _ in train}
    texts = dict(heldout)
    for p in prompts:
        assert p["source"] in heldout_names and p["prompt"] in texts[p["source"]]
        assert p["prompt"].endswith("\n") and p["prompt"].strip()


def test_second_build_is_cached(demo):
    before = (demo / "target" / "model.safetensors").stat().st_mtime_ns
    assert build_demo(demo, DemoRecipe.tiny()) == demo  # the weights' mtime below shows nothing was rebuilt
    assert (demo / "target" / "model.safetensors").stat().st_mtime_ns == before
    assert is_built(demo, DemoRecipe.tiny())
    assert not is_built(demo, DemoRecipe())  # another recipe has another key


def test_build_is_deterministic_and_a_reused_pretraining_changes_nothing(demo, tmp_path):
    """A second build of the recipe starts from the pretrained target the first left in the cache; a
    third pretrains again (as ``--check`` does). All three write the same bytes."""
    again = build_demo(tmp_path / "demo", DemoRecipe.tiny(), device="cpu")
    fresh = build_demo(tmp_path / "fresh", DemoRecipe.tiny(), device="cpu", reuse_pretraining=False)
    assert json.loads((again / "report.json").read_text())["seconds"]["target_pretraining_cached"]
    assert not json.loads((fresh / "report.json").read_text())["seconds"]["target_pretraining_cached"]
    for other in (again, fresh):
        for name in ("target", "draft"):
            a = (demo / name / "model.safetensors").read_bytes()
            b = (other / name / "model.safetensors").read_bytes()
            assert a == b, name
        assert (demo / "prompts.jsonl").read_text() == (other / "prompts.jsonl").read_text()


def test_unlikelihood_marks_the_tokens_of_repeated_ngrams_after_the_prefix():
    rows = [[1, 2, 3, 4, 9, 1, 2, 3, 4, 5], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]]
    mask = repeated_ngrams(rows, start=5, n=4).tolist()
    assert mask[0] == [False] * 5 + [True] * 4 + [False]  # 1 2 3 4 again, from the prefix
    assert mask[1] == [False] * 5 + [True] * 5  # the prefix's tokens themselves are never marked
    assert not any(repeated_ngrams([list(range(10))], start=2).flatten().tolist())


def test_file_heads_are_where_files_of_enough_tokens_start():
    eos = 1
    stream = torch.tensor([5, 6, 7, eos, 8, eos, 9, 9, 9, 9, eos])  # files of 3, 1 and 4 tokens
    assert file_heads(stream, eos, min_len=3).tolist() == [0, 6]
    assert file_heads(stream, eos, min_len=1).tolist() == [0, 4, 6]


@pytest.mark.parametrize("name", ["target", "draft"])
def test_loads_in_transformers_and_engine_with_same_greedy_text(demo, name):
    d = demo / name
    tok = transformers.AutoTokenizer.from_pretrained(d)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    prompt = json.loads((demo / "prompts.jsonl").read_text().splitlines()[0])["prompt"]
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    hf_text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    engine = LLMEngine(EngineConfig(model=str(d), device="cpu", num_kv_blocks=64, max_model_len=256))
    ours = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16))[0].outputs[0]
    assert ours.delta_token_ids == out[0, ids.shape[1] :].tolist()[: len(ours.delta_token_ids)]
    assert ours.text == hf_text


def test_tokenizer_round_trips_unicode(demo):
    tok = transformers.AutoTokenizer.from_pretrained(demo / "target")
    rng = random.Random(0)
    samples = ["def f(x):\n    return x ** 2\n", "naïve café — 你好, мир! 🙂🚀", "\t\r\n  \x00\x7f"]
    for _ in range(50):
        samples.append(
            "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x2FFFF)])) for _ in range(30))
        )
    for s in samples:
        s = s.encode("utf-8", "replace").decode("utf-8")  # no lone surrogates
        assert tok.decode(tok.encode(s, add_special_tokens=False)) == s


def test_chat_template_renders(demo):
    tok = transformers.AutoTokenizer.from_pretrained(demo / "target")
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "A function that adds two numbers."},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith(tok.bos_token)
    assert "<|system|>\nYou write Python." in text and "<|user|>\nA function" in text
    assert text.endswith("<|assistant|>\n")
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tok.convert_tokens_to_ids("<|user|>") in ids


def test_cli_demo_path_is_the_shipped_pair_whatever_was_built(demo, tmp_path):
    """`augur demo path` names the pair augur serve uses: the shipped one, not a build in $AUGUR_HOME."""
    from engine.assets import DEMO_DIR

    env = {"AUGUR_HOME": str(demo.parent), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "server.cli", "demo", "path"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == str(DEMO_DIR) != str(demo)
