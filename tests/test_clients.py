"""What evaluation clients and hostile requests hit, against live servers (issue 34).

- A request whose worst case could never fit the KV pool or the batch limits is a 400 before it is
  queued, for every strategy; one that fits, however tightly, finishes (nothing waits forever).
- Contrastive decoding refuses the layer-skip draft as its amateur, as documented.
- ``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` in vLLM's shapes, as lm-eval's remote
  tokenizer calls them, behind the API key.
- Scoring: ``max_tokens: 0`` with ``echo`` returns the prompt's logprobs and nothing generated;
  ``logprobs: 0`` gives each position's chosen token in ``top_logprobs``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from conftest import build_model_dir
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.request.sampling_params import SamplingParams
from server.app import ServerSettings, create_app
from servers import FIRST_LOAD_S, Served, engine_factory, serve, wait_until

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "tiny"
KEY = "sk-clients"
# The small pool: 32 blocks of 4 tokens = 128 token slots, and a context of as many.
BLOCKS, BLOCK, CONTEXT, SEQS, BATCH = 32, 4, 128, 16, 512
PROMPT = list(range(10, 30))  # 20 token ids


def factory(model_dir: Path, **kw):
    """An engine on the small pool."""
    pool = dict(num_kv_blocks=BLOCKS, block_size=BLOCK, max_model_len=CONTEXT, max_num_seqs=SEQS)
    return engine_factory(model_dir, **pool, max_num_batched_tokens=BATCH, **kw)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, tokenizer_dir) -> Path:
    return build_model_dir(
        tmp_path_factory.mktemp("draft"), tokenizer_dir, "LlamaForCausalLM", seed=1, num_hidden_layers=1
    )


@pytest.fixture(scope="module")
def pool(llama_dir, draft_dir) -> Iterator[Served]:
    """A speculating server (its draft model is contrastive decoding's amateur too) on the small pool."""
    make = factory(llama_dir, speculative_method="draft", draft_model=str(draft_dir), num_speculative_tokens=4)
    with serve(create_app(ServerSettings(served_model_name=MODEL), make)) as s:
        yield s


@pytest.fixture(scope="module")
def http(pool) -> Iterator[httpx.Client]:
    # The timeout turns a request that would wait forever into a failure; it is no timing claim.
    with httpx.Client(base_url=pool.base, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def client(pool) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=pool.base + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def keyed(llama_dir) -> Iterator[Served]:
    """A layer-skip server behind an API key."""
    make = factory(llama_dir, speculative_method="layer-skip", num_speculative_tokens=3)
    with serve(create_app(ServerSettings(served_model_name=MODEL, api_key=KEY), make), wait_ready=False) as s:
        ready = lambda: httpx.get(s.base + "/health").status_code == 200  # noqa: E731
        wait_until(ready, "the layer-skip server to load", FIRST_LOAD_S)
        yield s


@pytest.fixture(scope="module")
def tok(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


def idle(s: Served) -> bool:
    bm = s.engine.block_manager
    return not s.engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks


def completion(**kw) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "temperature": 0, **kw}


def error_of(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


# -- never fits: refused before it is queued --------------------------------------------------------------
def test_contrastive_search_that_can_never_fit_the_pool_is_refused(pool, http):
    # 256 candidates past a 20-token prompt: more slots than the pool has, whatever max_tokens is.
    err = error_of(http.post("/v1/completions", json=completion(max_tokens=20, top_k=256, penalty_alpha=0.5)), 400)
    assert "KV cache holds (128 tokens)" in err["message"] and "smaller top_k" in err["message"]
    # prompt + max_tokens + top_k - 1 = 20 + 20 + 90 - 1 = 129 slots: one too many; the message says
    # which max_tokens would fit.
    err = error_of(http.post("/v1/completions", json=completion(max_tokens=20, top_k=90, penalty_alpha=0.5)), 400)
    assert "129 KV slots" in err["message"] and "max_tokens at most 19" in err["message"]
    # Chat without max_tokens may run to the context, so its candidates would overflow the pool.
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_k": 2, "penalty_alpha": 0.5}
    assert "KV slots" in error_of(http.post("/v1/chat/completions", json=chat), 400)["message"]
    assert idle(pool)  # nothing was queued


def test_contrastive_search_that_just_fits_finishes(pool, http):
    # 20 + 20 + 89 - 1 = 128 slots: the whole pool, and it finishes.
    r = http.post("/v1/completions", json=completion(max_tokens=20, top_k=89, penalty_alpha=0.5, ignore_eos=True))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 20
    wait_until(lambda: idle(pool), "the KV pool to be free again")


@pytest.mark.parametrize(
    "body, param",
    [
        (completion(max_tokens=4, use_beam_search=True, best_of=SEQS + 1), "beams"),
        (completion(max_tokens=4, top_k=BATCH + 1, penalty_alpha=0.5), "--max-num-batched-tokens"),
        (completion(max_tokens=CONTEXT), "context length"),
    ],
    ids=["beams", "search-candidates", "context"],  # sampled choices beyond the seats wait (test_many_choices)
)
def test_requests_beyond_the_batch_limits_are_refused(pool, http, body, param):
    assert param in error_of(http.post("/v1/completions", json=body), 400)["message"]
    assert idle(pool)


def test_every_strategy_finishes_on_a_pool_it_outgrows(pool, http, llama_dir):
    """Choices, beams, speculation at the widest draft and contrastive decoding, each needing several
    times the pool's 128 slots in all, run at once and finish: preempted and recomputed, not stuck.
    The beam search's answer is the one a pool with room for everything gives."""
    bodies = {
        "choices": completion(max_tokens=100, n=8, temperature=1.0, seed=3, ignore_eos=True),
        "beams": completion(max_tokens=100, use_beam_search=True, best_of=8, n=2, ignore_eos=True),
        "speculative": completion(max_tokens=100, ignore_eos=True, speculative={"num_draft_tokens": 64}),
        "plain": completion(max_tokens=100, ignore_eos=True, speculative={"enabled": False}),
        "contrastive": completion(max_tokens=100, ignore_eos=True, contrastive={"alpha": 0.1, "beta": 0.5}),
    }
    with ThreadPoolExecutor(len(bodies)) as pool_:
        futures = {k: pool_.submit(http.post, "/v1/completions", json=b) for k, b in bodies.items()}
        out = {k: f.result() for k, f in futures.items()}
    for name, r in out.items():
        assert r.status_code == 200, (name, r.text)
    out = {k: r.json() for k, r in out.items()}
    assert [len(c["text"]) > 0 for c in out["choices"]["choices"]] == [True] * 8
    assert out["choices"]["usage"]["completion_tokens"] == 800
    assert out["speculative"]["choices"][0]["text"] == out["plain"]["choices"][0]["text"]  # lossless
    assert pool.engine.scheduler.num_preemptions > 0  # the pool really was outgrown

    roomy = LLMEngine(
        EngineConfig(model=str(llama_dir), device="cpu", dtype="float32", num_kv_blocks=512, block_size=4)
    )
    params = SamplingParams(max_tokens=100, use_beam_search=True, best_of=8, n=2, ignore_eos=True, temperature=0.0)
    want = roomy.generate([PROMPT], params)[0]
    assert [c["text"] for c in out["beams"]["choices"]] == [c.text for c in want.outputs]
    wait_until(lambda: idle(pool), "the KV pool to be free again")


def test_contrastive_decoding_refuses_the_layer_skip_draft(keyed):
    body = completion(max_tokens=4, contrastive={"alpha": 0.1, "beta": 0.5})
    r = httpx.post(keyed.base + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert "--draft-model" in error_of(r, 400)["message"]
    ok = httpx.post(
        keyed.base + "/v1/completions", json={**body, "contrastive": None}, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert ok.status_code == 200 and ok.json()["usage"]["speculative"]["method"] in ("layer-skip", "none")


# -- the tokenizer endpoints ------------------------------------------------------------------------------
def test_tokenizer_info_is_what_lm_eval_reads(http, tok):
    info = http.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == type(tok).__name__
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == (tok.eos_token, tok.bos_token, tok.pad_token)
    assert info["chat_template"] == tok.chat_template and info["model_max_length"] == CONTEXT
    assert info["vocab_size"] == len(tok)
    json.dumps(info)  # plain JSON all through


def test_tokenize_a_prompt_as_completions_count_it(http, client, tok):
    text = "def fibonacci(n):\n    return n"
    r = http.post("/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == CONTEXT and r["token_strs"] is None
    used = client.completions.create(model=MODEL, prompt=text, max_tokens=1, temperature=0).usage.prompt_tokens
    assert used == r["count"]
    # lm-eval's remote tokenizer: no special tokens, and the token strings on request.
    bare = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()
    assert bare["tokens"] == tok.encode(text, add_special_tokens=False)
    assert bare["token_strs"] == tok.convert_ids_to_tokens(bare["tokens"])
    assert http.post("/detokenize", json={"tokens": bare["tokens"]}).json() == {"prompt": text}
    assert http.post("/detokenize", json={"model": MODEL, "tokens": []}).json() == {"prompt": ""}


def test_tokenize_messages_as_chat_renders_them(http, client, tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a loop"}]
    r = http.post("/tokenize", json={"messages": messages}).json()
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert r["tokens"] == tok.encode(rendered, add_special_tokens=False)
    used = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0).usage
    assert used.prompt_tokens == r["count"]
    bare = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert bare["count"] < r["count"]


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, 400, None),
        ("/tokenize", {}, 400, None),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"messages": []}, 400, None),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "a"}]}, 400, None),
        ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
        ("/detokenize", {"tokens": [10**6]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
        ("/detokenize", {"tokens": [True]}, 400, "tokens.0"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
    ],
)
def test_tokenizer_endpoints_refuse_bad_input(pool, http, path, body, status, param):
    err = error_of(http.post(path, json=body), status)
    if param is not None:
        assert err["param"] == param
    assert pool.engine.tokenizer is not None and http.get("/health").status_code == 200


def test_tokenizer_endpoints_sit_behind_the_api_key(keyed, tok):
    auth = {"Authorization": f"Bearer {KEY}"}
    for method, path, body in [("GET", "/tokenizer_info", None), ("POST", "/tokenize", {"prompt": "x"}),
                               ("POST", "/detokenize", {"tokens": [5]})]:  # fmt: skip
        error_of(httpx.request(method, keyed.base + path, json=body), 401)
        assert httpx.request(method, keyed.base + path, json=body, headers=auth).status_code == 200
    # lm-eval's probe (check_remote_tokenizer_support), with its key.
    info = httpx.get(keyed.base + "/tokenizer_info", headers=auth).json()
    assert "eos_token" in info
    probe = httpx.post(keyed.base + "/tokenize", json={"prompt": "test", "add_special_tokens": False}, headers=auth)
    assert probe.json()["tokens"] == tok.encode("test", add_special_tokens=False)


# -- scoring ----------------------------------------------------------------------------------------------
def reference_logprobs(model_dir: Path, ids: list[int]) -> list[float]:
    """log p(token i | tokens before it) for i >= 1, by transformers itself."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def test_max_tokens_0_with_echo_scores_the_prompt(http, client, tok, llama_dir):
    text = "import string\nprint(string.digits)"
    ids = tok.encode(text)
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=1, temperature=0)
    c = r.choices[0]
    assert c.text == text and c.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    lp = c.logprobs
    assert lp.tokens == [tok.decode([t]) for t in ids] and lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(reference_logprobs(llama_dir, ids), abs=1e-4)
    assert lp.top_logprobs[0] is None
    assert all(lp.tokens[i] in lp.top_logprobs[i] for i in range(1, len(ids)))  # the chosen token is there
    assert lp.text_offset == [len(tok.decode(ids[:i])) for i in range(len(ids))]

    # Streamed: the same text and logprobs, then the end.
    chunks = list(client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=1, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == text
    streamed = [x for ch in chunks if ch.choices[0].logprobs for x in ch.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:])
    assert chunks[-1].choices[0].finish_reason == "length"

    # Token-id prompts score the same way; without echo, max_tokens 0 is a 400 that says why.
    by_ids = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0}).json()
    assert by_ids["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(lp.token_logprobs[1:])
    err = error_of(http.post("/v1/completions", json={"prompt": text, "max_tokens": 0}), 400)
    assert "echo" in err["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}
    error_of(http.post("/v1/chat/completions", json=chat), 400)


def test_logprobs_0_returns_the_chosen_token(client):
    r = client.completions.create(model=MODEL, prompt="import os", max_tokens=6, logprobs=0, temperature=0)
    lp = r.choices[0].logprobs
    assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs)]
    # Sampled, with alternatives: the chosen token is always among them, as OpenAI returns it.
    r = client.completions.create(model=MODEL, prompt="import os", max_tokens=6, logprobs=2, temperature=1.0, seed=5)
    lp = r.choices[0].logprobs
    for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and t in top
        if "\ufffd" not in t:  # byte pieces of a character all read U+FFFD: one key for several tokens
            assert top[t] == pytest.approx(v)


def test_echoed_logprobs_of_several_prompts_and_choices(http, tok):
    """Each choice echoes its own prompt's logprobs (choice i * n + c belongs to prompt i)."""
    texts = ["import os\n", "def f(x):"]
    body = {"prompt": texts, "n": 2, "max_tokens": 2, "echo": True, "logprobs": 1, "temperature": 1.0, "seed": 7}
    choices = http.post("/v1/completions", json=body).json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for c in choices:
        text, ids = texts[c["index"] // 2], tok.encode(texts[c["index"] // 2])
        lp = c["logprobs"]
        assert c["text"].startswith(text) and len(lp["tokens"]) == len(ids) + 2
        assert lp["tokens"][: len(ids)] == [tok.decode([t]) for t in ids] and lp["token_logprobs"][0] is None
    for a, b in ((choices[0], choices[1]), (choices[2], choices[3])):
        n = len(tok.encode(texts[a["index"] // 2]))
        assert a["logprobs"]["token_logprobs"][:n] == b["logprobs"]["token_logprobs"][:n]
