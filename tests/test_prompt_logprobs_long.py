"""Scoring long texts (issue 56, item 5): prompt logprobs of prompts longer than one step's token budget.

A prompt longer than ``--max-num-batched-tokens`` is prefilled over several steps (chunked prefill);
its echoed logprobs must still equal transformers' float32 ``log_softmax`` at every position, as
lm-eval's ``local-completions`` reads them for ``loglikelihood_rolling``: token-id prompts (no BOS
added), ``echo: true``, ``max_tokens: 1``, ``logprobs: 1``, summing ``token_logprobs[ctxlen:-1]``.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
import transformers

from server.app import ServerSettings, create_app
from servers import Served, engine_factory, serve

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "tiny"
BUDGET = 32  # tokens per step: a prompt of 4 * BUDGET is prefilled in four chunks
TOL = 1e-4  # per token, float32 against float32


# Mistral's sliding window (24 tokens in the tiny config) is far shorter than these prompts.
@pytest.fixture(scope="module", params=["LlamaForCausalLM", "MistralForCausalLM"])
def model_dir(request, model_dirs):
    return model_dirs[request.param]


@pytest.fixture(scope="module")
def srv(model_dir) -> Iterator[Served]:
    make = engine_factory(model_dir, max_num_batched_tokens=BUDGET)
    with serve(create_app(ServerSettings(served_model_name=MODEL), make)) as s:
        yield s


@pytest.fixture(scope="module")
def hf(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference(hf, ids: list[int]) -> torch.Tensor:
    """transformers' float32 log-probabilities ``[len(ids), vocab]``: row i predicts token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def random_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 384, (n,), generator=g).tolist()


def rolling_windows(tokens: list[int], prefix: int, max_seq_len: int) -> list[tuple[list[int], list[int]]]:
    """lm-eval's ``get_rolling_token_windows(context_len=1)`` through ``make_disjoint_window``:
    (context, continuation) pairs whose continuations cover ``tokens`` once."""
    out, predicted = [], 0
    first = min(max_seq_len, len(tokens))
    out.append(([prefix], tokens[:first]))
    predicted = first
    while predicted < len(tokens):
        n = min(len(tokens) - predicted, max_seq_len)
        end = predicted + n
        window = tokens[end - max_seq_len - 1 : end - 1]
        out.append((window[: len(window) - (n - 1)], tokens[end - n : end]))
        predicted += n
    return out


def score(http: httpx.Client, prompts: list[list[int]], **kw) -> list[dict]:
    body = {"model": MODEL, "prompt": prompts, "echo": True, "logprobs": 1, "temperature": 0, "max_tokens": 1, **kw}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return [c["logprobs"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def test_echoed_logprobs_of_a_prompt_four_budgets_long(srv, client, hf):
    ids = random_ids(4 * BUDGET, seed=1)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0)
    lp = r.choices[0].logprobs
    assert r.usage.prompt_tokens == len(ids)  # token ids as sent: no BOS added
    assert len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = reference(hf, ids)
    want = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=TOL)
    for i in range(1, len(ids)):  # the chosen token and the best one, each at its own logprob
        top = lp.top_logprobs[i]
        if "\ufffd" in lp.tokens[i]:  # byte pieces of a character all read U+FFFD: one key for several
            continue
        assert top[lp.tokens[i]] == pytest.approx(want[i - 1], abs=TOL)
        assert max(top.values()) == pytest.approx(ref[i - 1].max().item(), abs=TOL)

    # Streamed: the prompt is echoed once, with its logprobs (outputs of the earlier chunks carry none).
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1, stream=True))
    echoed = [ch.choices[0] for ch in chunks if ch.choices[0].text]
    assert len(echoed) == 1 and echoed[0].logprobs.token_logprobs == lp.token_logprobs


def test_rolling_loglikelihood_as_lm_eval_reads_it(srv, hf):
    """Windows of 5 budgets (the first one BOS-prefixed), scored in one batched request and as
    concurrent requests: each window's sum of ``token_logprobs[ctxlen:-1]`` against transformers'."""
    tokens = random_ids(700, seed=2)
    windows = rolling_windows(tokens, prefix=0, max_seq_len=5 * BUDGET)
    assert len(windows) >= 4 and all(len(c) + len(t) > 4 * BUDGET for c, t in windows[:-1])
    prompts = [c + t for c, t in windows]
    want = []
    for (ctx, _), ids in zip(windows, prompts):
        ref = reference(hf, ids)
        want.append([ref[i - 1, ids[i]].item() for i in range(len(ctx), len(ids))])
    assert sum(len(w) for w in want) == len(tokens)
    with httpx.Client(base_url=srv.base, timeout=300) as http:
        batched = score(http, prompts)
        with ThreadPoolExecutor(len(prompts)) as pool:
            concurrent = [lps[0] for lps in pool.map(lambda p: score(http, [p]), prompts)]
    for got in (batched, concurrent):
        for (ctx, _), lp, w in zip(windows, got, want):
            assert len(lp["token_logprobs"]) == len(ctx) + len(w) + 1  # the prompt as sent, then one token
            per_token = lp["token_logprobs"][len(ctx) : -1]
            assert per_token == pytest.approx(w, abs=TOL)
            assert sum(per_token) == pytest.approx(sum(w), abs=TOL * len(w))


def test_a_cached_prefix_still_gets_every_prompt_logprob(srv, client, hf):
    """A prompt sharing a long, cached prefix with an earlier one is computed whole when its logprobs
    are asked for (and reuses the prefix when they are not)."""
    first = random_ids(3 * BUDGET, seed=3)
    second = first + random_ids(BUDGET + 5, seed=4)
    client.completions.create(model=MODEL, prompt=first, max_tokens=4, temperature=0)  # caches the prefix
    r = client.completions.create(model=MODEL, prompt=second, max_tokens=0, echo=True, logprobs=2, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    lp = r.choices[0].logprobs
    ref = reference(hf, second)
    want = [ref[i - 1, second[i]].item() for i in range(1, len(second))]
    assert len(lp.token_logprobs) == len(second) and lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=TOL)
    plain = client.completions.create(model=MODEL, prompt=second, max_tokens=1, temperature=0)
    assert plain.usage.prompt_tokens_details.cached_tokens >= 3 * BUDGET


@pytest.fixture(scope="module")
def small(llama_dir) -> Iterator[Served]:
    """A pool of 56 blocks of 4 (224 slots): two 4-budget prompts that go on generating cannot run
    together, so the newer is preempted, mid-prefill, and recomputed later."""
    make = engine_factory(llama_dir, max_num_batched_tokens=BUDGET, num_kv_blocks=56, max_model_len=224)
    with serve(create_app(ServerSettings(served_model_name=MODEL), make)) as s:
        yield s


def test_a_prompt_preempted_mid_prefill_keeps_its_logprobs(small, llama_dir):
    """Prompts that are preempted mid-prefill (their prompt logprobs half recorded) and readmitted
    (recomputed, from a cached prefix no longer than what they had scored) get every position once."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    prompts = [random_ids(4 * BUDGET, seed=10 + k) for k in range(3)]
    before = small.engine.scheduler.num_preemptions
    with httpx.Client(base_url=small.base, timeout=300) as http:
        got = score(http, prompts, max_tokens=64, ignore_eos=True)
    assert small.engine.scheduler.num_preemptions > before
    for ids, lp in zip(prompts, got):
        ref = reference(hf, ids)
        assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(ids) + 64
        want = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
        assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(want, abs=TOL)
