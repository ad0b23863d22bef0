"""Structured outputs in the engine: a grammar masks every row a request samples or verifies, so
greedy output under a grammar is plain constrained decoding's with every proposer, with speculation
on or off and jump-forward on or off, and sampled output follows the masked target distribution.

The reference is independent of the engine: Hugging Face's model, greedy, with llguidance's own
matcher masking each step."""

from __future__ import annotations

import json
import re

import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch
from test_dflash import write_dflash
from test_eagle import write_eagle
from test_medusa import write_heads as write_medusa
from test_mtp import write_heads as write_mtp
from test_spec import g_statistic, g_test_threshold, noisy_copy
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from conftest import build_model_dir
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.request.sampling_params import SamplingParams
from engine.request.structured import StructuredOutput
from engine.structured import GrammarError, GrammarState

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green", "blue"]},
        "name": {"type": "string", "maxLength": 6},
    },
    "required": ["id", "ok", "tag", "name"],
    "additionalProperties": False,
}
EMAIL = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
CHOICES = ["yes", "no", "maybe so"]
SPECS = [
    StructuredOutput.json_schema(SCHEMA, "response_format"),
    StructuredOutput("regex", EMAIL),
    StructuredOutput.choice(CHOICES, "structured_outputs"),
]


@pytest.fixture(scope="module")
def target(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("structured")
    return build_model_dir(root / "target", tokenizer_dir, "LlamaForCausalLM", std=0.3, num_hidden_layers=4)


def make(target, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("block_size", 8)
    return LLMEngine(EngineConfig(model=str(target), device="cpu", compile="off", **kw))


def reference(target, prompt: list[int], so: StructuredOutput, max_tokens: int) -> list[int]:
    """Greedy decoding of the Hugging Face model, each step masked by llguidance's matcher."""
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(target)
    vocab = model.config.vocab_size
    lt = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    from engine.structured.grammar import grammar_text

    matcher = llguidance.LLMatcher(lt, grammar_text(so))
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    out: list[int] = []
    with torch.no_grad():
        while len(out) < max_tokens and not matcher.is_stopped():
            logits = model(torch.tensor([prompt + out])).logits[0, -1]
            bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            allowed = torch.from_numpy(bits[:vocab].astype(bool))
            token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
            out.append(token)
            if token in eos:  # the engine keeps the end-of-text token in its output ids too
                break
            assert matcher.consume_token(token)
    return out


def prompts() -> list[list[int]]:
    return [[1, 20 + i, 40 + 3 * i, 7, 100 + i] for i in range(6)]


def run(eng: LLMEngine, max_tokens: int = 40, close: bool = False) -> list[list[int]]:
    """Greedy outputs of the prompts under the specs; ``close``: structures closed within ``max_tokens``
    (off by default: the reference decodes without it)."""
    ps = prompts()
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            structured=SPECS[i % 3],
            num_draft_tokens=3,
            close_at_max_tokens=close,
        )  # fmt: skip
        for i in range(len(ps))
    ]
    return [o.outputs[0].delta_token_ids for o in eng.generate(ps, params)]


def check_matches(eng: LLMEngine, outs: list[list[int]]) -> None:
    """Finished outputs match their spec (cut ones are prefixes of a match, which the grammar ensured)."""
    for i, toks in enumerate(outs):
        text = eng.tokenizer.decode(toks)
        kind = SPECS[i % 3].kind
        if kind == "json" and text.endswith("}"):
            obj = json.loads(text)
            assert list(obj) == ["id", "ok", "tag", "name"] and obj["tag"] in ("red", "green", "blue")
        elif kind == "regex" and text.endswith(("com", "org")):
            assert re.fullmatch(EMAIL, text)
        elif kind == "choice":
            assert text in CHOICES


METHODS = {
    "plain": lambda target, tmp: {},
    "draft": lambda target, tmp: {"draft_model": str(noisy_copy(target, tmp / "draft", 0.5))},
    "ouroboros": lambda target, tmp: {
        "speculative_method": "ouroboros",
        "draft_model": str(noisy_copy(target, tmp / "draft", 0.5)),
        "ouroboros_branches": 2,
    },
    "ngram": lambda target, tmp: {"speculative_method": "ngram"},
    "suffix": lambda target, tmp: {"speculative_method": "suffix"},
    "layer-skip": lambda target, tmp: {"speculative_method": "layer-skip"},
    "medusa": lambda target, tmp: {"draft_model": str(write_medusa(target, tmp / "medusa"))},
    "eagle": lambda target, tmp: {"draft_model": str(write_eagle(target, tmp / "eagle"))},
    "mtp": lambda target, tmp: {"draft_model": str(write_mtp(target, tmp / "mtp"))},
    "dflash": lambda target, tmp: {"draft_model": str(write_dflash(target, tmp / "dflash"))},
}


@pytest.fixture(scope="module")
def expected(target):
    ps = prompts()
    return [reference(target, p, SPECS[i % 3], 40) for i, p in enumerate(ps)]


CLOSE_BUDGET = 24  # tokens: the specs' outputs are cut there, so closing shapes them


@pytest.fixture(scope="module")
def closed(target):
    """Plain decoding's greedy outputs with closing, under a budget that cuts them."""
    outs = run(make(target), CLOSE_BUDGET, close=True)
    assert outs != [o[:CLOSE_BUDGET] for o in run(make(target), CLOSE_BUDGET)]  # closing changed something
    return outs


# Each method with chains and with trees; plain decoding once (it drafts nothing for a tree to shape).
GREEDY_CASES = [(topk, m) for topk in (1, 2) for m in METHODS if not (m == "plain" and topk == 2)]


@pytest.mark.parametrize(
    "topk,method", GREEDY_CASES, ids=[f"{'chains' if topk == 1 else 'trees'}-{m}" for topk, m in GREEDY_CASES]
)
def test_greedy_under_a_grammar_is_plain_constrained_decoding(target, tmp_path, expected, closed, method, topk):
    eng = make(target, spec_tree_topk=topk, **METHODS[method](target, tmp_path))
    assert run(eng) == expected
    check_matches(eng, expected)
    if method != "plain":
        assert eng.spec_stats.num_drafts > 0
    # Structures closed within the budget: every method's rows masked as plain decoding's.
    assert run(eng, CLOSE_BUDGET, close=True) == closed
    eng.step_runner.constraints.jump_forward = False  # every token through a forward: the same output
    assert run(eng) == expected
    assert run(eng, CLOSE_BUDGET, close=True) == closed
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_drafts_are_cut_where_the_grammar_forbids_and_forced_tokens_need_no_forward(target, tmp_path):
    eng = make(target, draft_model=str(noisy_copy(target, tmp_path / "draft", 0.5)))
    run(eng)
    c = eng.step_runner.constraints
    assert c.drafted_tokens > 0 and 0 < c.cut_tokens < c.drafted_tokens
    assert c.forced_tokens > 0  # the schema's keys and punctuation, the choices' tails


def test_forced_tokens_are_told_as_forced(target, tmp_path, expected):
    """With ``include_speculation``, each token a grammar forced (jump-forward: no forward chose it) is
    told as ``forced``, with no proposer and no depth; they are as many as the request's count of
    forced tokens, and telling changes no token."""
    eng = make(target, draft_model=str(noisy_copy(target, tmp_path / "draft", 0.5)))
    ps = prompts()
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=40,
            structured=SPECS[i % 3],
            num_draft_tokens=3,
            close_at_max_tokens=False,  # (as the reference decodes)
            include_speculation=True,
        )  # fmt: skip
        for i in range(len(ps))
    ]
    outs = eng.generate(ps, params)
    assert [o.outputs[0].delta_token_ids for o in outs] == expected
    for out in outs:
        prov = out.outputs[0].delta_provenance
        assert len(prov) == len(out.outputs[0].delta_token_ids)
        forced = [p for p in prov if p[0] == "forced"]
        assert len(forced) == out.stats.num_forced_tokens
        assert all(p == ("forced", None, 0) for p in forced)
    assert sum(o.stats.num_forced_tokens for o in outs) > 0


def test_grammar_end_finishes_with_stop_even_ignoring_eos(target):
    eng = make(target)
    so = StructuredOutput.choice(["alpha", "beta"], "structured_outputs")
    out = eng.generate([[1, 5, 9]], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, structured=so))[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text in ("alpha", "beta")


def test_n_choices_and_beams_each_follow_their_grammar(target):
    eng = make(target)
    so = StructuredOutput("regex", "[0-9]{3}-[a-z]{2}")
    outs = eng.generate([[1, 5, 9]], SamplingParams(temperature=1.0, n=4, seed=3, max_tokens=20, structured=so))[0]
    beams = eng.generate(
        [[1, 5, 9]], SamplingParams(use_beam_search=True, n=2, best_of=3, max_tokens=20, structured=so)
    )[0]
    for c in outs.outputs + beams.outputs:
        assert re.fullmatch("[0-9]{3}-[a-z]{2}", c.text), c.text
        assert c.finish_reason == "stop"


def test_contrastive_search_never_picks_a_forbidden_candidate(target):
    eng = make(target)
    so = StructuredOutput("regex", "[xyz]{4}")
    out = eng.generate(
        [[1, 5, 9]], SamplingParams(temperature=0.0, penalty_alpha=0.6, top_k=8, max_tokens=10, structured=so)
    )[0]
    assert re.fullmatch("[xyz]{4}", out.outputs[0].text)


@pytest.mark.parametrize(
    "so,match",
    [
        (StructuredOutput("json", '{"type": "nope"}', None, "response_format"), "invalid json"),
        (StructuredOutput("regex", "(ab", None, "structured_outputs"), "invalid regex"),
        (StructuredOutput("grammar", "start: foo\nfoo: 'a' |", None, "structured_outputs"), "invalid grammar"),
        (StructuredOutput("grammar", "root ::= (", None, "structured_outputs"), "invalid grammar"),
        (StructuredOutput("json", "{" * 300_000, None, "response_format"), "at most"),
    ],
)
def test_invalid_specs_are_refused_naming_their_field(target, so, match):
    eng = make(target)
    with pytest.raises(GrammarError, match=match) as err:
        eng.grammars.compile(so)
    assert err.value.param == so.param


def test_compiled_grammars_are_cached_by_spec(target):
    eng = make(target)
    a = eng.grammars.compile(SPECS[0])
    assert eng.grammars.compile(StructuredOutput.json_schema(SCHEMA, "structured_outputs")) is a  # same spec
    s1, s2 = eng.grammars.start(SPECS[0]), eng.grammars.start(SPECS[0])
    s1.advance(eng.tokenizer.encode('{"id', add_special_tokens=False))
    assert s2.walk([], []).masks.equal(GrammarState(a.deep_copy(), s2.words).walk([], []).masks)  # copies apart


# -- sampling: the masked target distribution, exactly -----------------------------------------------------
@pytest.fixture(scope="module")
def letters_pair(tmp_path_factory):
    """An 8-token vocabulary of single letters llguidance can read (a byte-level decoder), a tiny
    Llama over it and a noisy draft of it."""
    root = tmp_path_factory.mktemp("letters")
    words = ["<|bos|>", "<|eos|>", "<|pad|>", "a", "b", "c", "d", "e"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<|pad|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>")
    fast.save_pretrained(root / "tok")
    t = build_model_dir(root / "target", root / "tok", "LlamaForCausalLM", vocab_size=8, std=0.5)
    return t, noisy_copy(t, root / "draft", 0.1)  # close: its drafts reach the third letter's row


# After "a" (forced first), the second letter is a, b or c and the third depends on it: every set
# holds "a", so a rule that masks every row with the root's set still emits only allowed tokens.
PATHS = "a(a[a-c]|b[a-e]|c[a-d])"
ALLOWED = {(): "a", ("a",): "abc", ("a", "a"): "abc", ("a", "b"): "abcde", ("a", "c"): "abcd"}


def masked_joint(target_dir, prompt: list[int], temperature: float) -> dict[tuple, float]:
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    letters = "abcde"
    joint: dict[tuple, float] = {}

    def dist(path: tuple[str, ...]) -> dict[str, float]:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + [3 + letters.index(x) for x in path]])).logits[0, -1] / temperature
        allowed = [3 + letters.index(x) for x in ALLOWED[path]]
        p = torch.softmax(logits[allowed], -1)
        return {x: p[i].item() for i, x in enumerate(ALLOWED[path])}

    for x2, p2 in dist(("a",)).items():
        for x3, p3 in dist(("a", x2)).items():
            joint[(3, 3 + letters.index(x2), 3 + letters.index(x3))] = p2 * p3
    return joint


def sampled(target, draft, n: int, prompt: list[int], temperature: float) -> dict:
    eng = make(target, draft_model=str(draft), num_kv_blocks=4096, max_num_seqs=1024)
    so = StructuredOutput("regex", PATHS)
    per = 64
    for i in range(n // per):
        # Room for 4: the grammar ends the output at 3, so drafts may run to its end (and closing, which
        # would leave the 3-token outputs as they are, is off: tests/test_closing.py samples with it).
        params = SamplingParams(temperature=temperature, n=per, max_tokens=4, structured=so, num_draft_tokens=3,
                                close_at_max_tokens=False)  # fmt: skip
        eng.add_request(f"s{i}", prompt, params)
    toks: dict = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            for c in o.outputs:
                toks.setdefault((o.request_id, c.index), []).extend(c.delta_token_ids)
    assert eng.spec_stats.num_drafts > 0
    counts: dict = {}
    for v in toks.values():
        counts[tuple(v)] = counts.get(tuple(v), 0) + 1
    return counts


def test_sampling_under_a_grammar_follows_the_masked_target_and_wrong_rules_fail(letters_pair, monkeypatch):
    """Sampled drafts are verified against the masked target; two plausible wrong rules are caught:
    cutting forbidden tokens out of a sampled draft (the proposal is then q conditioned on the
    grammar, not the q the rule reads), and masking every row with the root's grammar state."""
    target, draft = letters_pair
    prompt, n, temperature = [0, 4, 5], 10_240, 1.0
    expected = masked_joint(target, prompt, temperature)
    counts = sampled(target, draft, n, prompt, temperature)
    assert set(counts) <= set(expected), f"outputs the grammar forbids: {set(counts) - set(expected)}"
    stat, dof = g_statistic(counts, expected, n)
    assert stat < g_test_threshold(dof), f"G={stat:.1f} dof={dof}"

    walk = GrammarState.walk
    with monkeypatch.context() as m:
        m.setattr(GrammarState, "walk", lambda self, tokens, parents, cut=True: walk(self, tokens, parents, True))
        stat, dof = g_statistic(sampled(target, draft, n, prompt, temperature), expected, n)
        assert stat > g_test_threshold(dof), f"cutting sampled drafts went unnoticed: G={stat:.1f} dof={dof}"

    def path_blind(self, tokens, parents, cut=True):  # every row gets the root's mask
        w = walk(self, tokens, parents, cut)
        w.masks[1:] = w.masks[0]
        return w

    monkeypatch.setattr(GrammarState, "walk", path_blind)
    stat, dof = g_statistic(sampled(target, draft, n, prompt, temperature), expected, n)
    assert stat > g_test_threshold(dof), f"the path-blind rule went unnoticed: G={stat:.1f} dof={dof}"


def test_a_grammar_that_fails_mid_output_fails_its_request_alone(target, monkeypatch):
    """llguidance puts a matcher in an error state when a step goes over its limits; the engine then
    fails that request (finish_reason "error") and every other request goes on."""
    eng = make(target)
    advance, steps = GrammarState.advance, []

    def failing(self, tokens):  # the third step's advance trips the limit
        steps.append(len(tokens))
        if len(steps) == 3:
            self.error = "the grammar failed: over a step limit (simulated)"
        return advance(self, tokens)

    doomed = StructuredOutput("regex", "[0-9]{40}")  # 40 digits: it cannot end before the failure
    monkeypatch.setattr(GrammarState, "advance", failing)
    # (not closed within max_tokens, which would force all 40 digits at once)
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=40, structured=doomed, close_at_max_tokens=False)
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    bad, good = eng.generate([[1, 5, 9], [1, 6, 7]], [params, plain])
    assert bad.outputs[0].finish_reason == "error" and "step limit" in bad.error
    assert good.outputs[0].finish_reason == "length" and len(good.outputs[0].delta_token_ids) == 12
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
