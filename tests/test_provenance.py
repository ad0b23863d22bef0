"""Each token's provenance (SamplingParams.include_speculation; the stream's
``stream_options.include_speculation``): drafted and accepted, the target's bonus or recovered token,
forced, plain; its proposer and the draft's depth. Counted against the request's own statistics, in
the engine and through the server with the official SDK; a client that does not ask sees nothing new."""

from __future__ import annotations

import openai
from test_ngram import target  # noqa: F401
from test_step import make
from test_step import prompts as repetitive_prompts

from engine.request.sampling_params import SamplingParams
from engine.sampling.batch import PROVENANCE
from server.app import ServerSettings, create_app
from servers import engine_factory, serve


def test_every_token_says_how_it_came_and_the_counts_are_the_requests(target):  # noqa: F811
    ps = repetitive_prompts(10, seed=3)
    plain = make(target).generate(ps, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    eng = make(target, "ngram", num_kv_blocks=48, max_num_batched_tokens=40)
    params = SamplingParams(
        temperature=0.0, max_tokens=32, ignore_eos=True, num_draft_tokens=4, include_speculation=True
    )
    outs = eng.generate(ps, params)
    kinds_seen = set()
    for out, want in zip(outs, plain, strict=True):
        c = out.outputs[0]
        assert c.delta_token_ids == want.outputs[0].delta_token_ids  # (speculation changes nothing)
        prov = c.delta_provenance
        assert len(prov) == len(c.delta_token_ids)
        kinds = [k for k, _, _ in prov]
        kinds_seen |= set(kinds)
        assert set(kinds) <= set(PROVENANCE)
        st = out.stats
        assert kinds.count("accepted") == st.num_accepted_tokens
        # one token of the target's own per verify step: after a draft (bonus, recovered) or without one
        assert len(kinds) - kinds.count("accepted") == st.num_decode_steps
        assert all(p == "ngram" and d > 0 for k, p, d in prov if k != "plain")
        assert all(p is None and d == 0 for k, p, d in prov if k == "plain")
        # a draft's accepted tokens come right before its bonus or recovered token
        for i, k in enumerate(kinds):
            if k == "accepted":
                assert kinds[i + 1] in ("accepted", "bonus", "recovered"), kinds
    assert {"accepted", "plain"} <= kinds_seen and kinds_seen & {"bonus", "recovered"}
    untold = eng.generate(ps[:1], SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert untold.outputs[0].delta_provenance is None


def test_the_stream_carries_it_when_asked(target):  # noqa: F811
    """Through the server: each streamed choice carries ``speculation`` (token ids, kinds, proposer,
    depth) for exactly its tokens; accepted ones add up to ``usage.speculative``; a plain stream has none."""
    with serve(
        create_app(ServerSettings(served_model_name="m"), engine_factory(target, speculative_method="ngram"))
    ) as srv:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="none")
        body = dict(model="m", max_tokens=30, temperature=0, stream=True, extra_body={"ignore_eos": True})
        prompt = "a b c a b c a b c a b"
        chunks = list(client.completions.create(
            prompt=prompt, stream_options={"include_usage": True, "include_speculation": True}, **body
        ))  # fmt: skip
        told = [t for ch in chunks for c in ch.choices for t in (c.model_extra.get("speculation") or [])]
        usage = chunks[-1].usage
        assert len(told) == usage.completion_tokens > 0
        assert sum(t["kind"] == "accepted" for t in told) == usage.model_extra["speculative"]["accepted_tokens"]
        assert all(set(t) == {"token_id", "text", "kind", "proposer", "depth"} for t in told)
        want = make(target).generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
        assert [t["token_id"] for t in told] == want[0].outputs[0].delta_token_ids
        assert "".join(c.text for ch in chunks for c in ch.choices) == want[0].outputs[0].text
        plain = list(client.chat.completions.create(messages=[{"role": "user", "content": "a b"}], **body))
        assert not any("speculation" in (c.model_extra or {}) for ch in plain for c in ch.choices)
        chat = list(client.chat.completions.create(
            messages=[{"role": "user", "content": "a b"}], stream_options={"include_speculation": True}, **body
        ))  # fmt: skip
        assert sum(len(c.model_extra.get("speculation") or []) for ch in chat for c in ch.choices) == 30
