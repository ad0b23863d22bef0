"""``POST /v1/completions``: OpenAI's legacy completions (prompts as text or token ids, echo, scoring,
logprobs with ``text_offset``), relayed by :mod:`server.relay`."""

from __future__ import annotations

import dataclasses

from fastapi import FastAPI, Request

from engine.request.outputs import CompletionOutput, RequestOutput
from engine.request.sequence import TokenLogprob
from server.common import check_model, parse_request, ready_engine, request_body
from server.protocol import CompletionRequest
from server.relay import Job, check_queue_bound, prepare, prepare_capped, respond, sampling_params
from server.state import ServerState
from server.tokens import TokenTexts


def add_completion_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(request: Request):
        req: CompletionRequest = await parse_request(request, CompletionRequest)
        check_model(state, req.model)
        eng = ready_engine(state)
        lp = req.logprobs
        # Scoring (max_tokens 0) runs one token, the least the engine generates, and drops it. A model's
        # generation_config.json max_new_tokens replaces OpenAI's default of 16 when the request says nothing.
        given = "max_tokens" in req.model_fields_set  # null: as long as the context allows
        max_tokens = req.max_tokens if given else state.sampling_defaults.get("max_tokens", req.max_tokens)
        max_tokens = 1 if req.scores_only else max_tokens
        params = sampling_params(state, req, max_tokens, lp, lp if req.echo and lp is not None else None)
        prompts = req.prompts()
        check_queue_bound(state, len(prompts))  # before tokenizing thousands of prompts for nothing
        # A default (none given) is capped per prompt at the room it leaves, as vLLM caps it: the
        # prompts are checked only for fitting the context, not against a length nobody asked for.
        capped = not given and max_tokens is not None
        ids = await (prepare_capped if capped else prepare)(eng, prompts, params)
        job = Job.admit(state, eng, request, "cmpl", ids, params, req.n, req.stream, req.include_usage)
        job.cap_max_tokens = capped
        job.continuous_usage = req.continuous_usage
        return await respond(job, CompletionFormat(req, prompts, state.token_texts))


@dataclasses.dataclass
class CompletionFormat:
    req: CompletionRequest
    prompts: list[str | list[int]]
    texts: TokenTexts
    echoed: set[int] = dataclasses.field(default_factory=set)  # streamed choices whose prompt was sent
    prompt_lps: dict[int, dict] = dataclasses.field(default_factory=dict)  # prompt i's echoed logprobs, built once
    offsets: dict[int, int] = dataclasses.field(default_factory=dict)  # streamed: a choice's next text_offset

    chunk_object = "text_completion"
    object = "text_completion"

    def adjust(self, c: CompletionOutput) -> CompletionOutput:
        if not self.req.scores_only:
            return c
        # The one token a scoring request ran for is nobody's: dropped (text, logprobs, count); the
        # choice ends as OpenAI ends it, at the length limit.
        reason = "length" if c.finished else None
        return dataclasses.replace(
            c, text="", delta_text="", delta_token_ids=[], delta_logprobs=[], delta_provenance=None, num_tokens=0,
            finish_reason=reason,
            stop_reason=None,
        )  # fmt: skip

    def usage(self, usage: dict) -> dict:
        return usage

    def stream_choices(self, i: int, idx: int, out: RequestOutput, c: CompletionOutput) -> list[dict]:
        text, lp = c.delta_text, None
        if self.req.logprobs is not None:  # offsets as the whole answer has them: the tokens' texts so far
            start = self.offsets.get(idx)
            if start is None:  # (the prompt's text, once: an echoed prompt comes before the first token)
                start = len(self._prompt_text(i)) if self.req.echo else 0
            lp = self._logprobs(c.delta_logprobs or [], start)
            self.offsets[idx] = start + sum(len(t) for t in lp["tokens"])
        if out.prompt_logprobs is not None and i not in self.prompt_lps:  # they come once, for all n choices
            self.prompt_lps[i] = self._prompt_logprobs(out)
        # A prompt prefilled over several steps has outputs before its logprobs: it is echoed with them.
        waiting = lp is not None and i not in self.prompt_lps and not c.delta_token_ids and not c.finished
        if self.req.echo and idx not in self.echoed and not waiting:
            self.echoed.add(idx)
            prompt = self._prompt_text(i)
            text = prompt + text
            if lp is not None:
                lp = _joined(self.prompt_lps.get(i), 0, lp)  # (its offsets are past the prompt already)
        if not text and not c.finished and not c.delta_token_ids:
            return []
        return [{"index": idx, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}]

    def choice(self, idx: int, text: str, logprobs: list, reason: str | None, prompt_out: RequestOutput | None) -> dict:
        lp = self._logprobs(logprobs, 0) if self.req.logprobs is not None else None
        if self.req.echo:
            i = idx // self.req.n
            prompt = self._prompt_text(i)
            if lp is not None:
                if prompt_out is not None and i not in self.prompt_lps:  # shared by the prompt's n choices
                    self.prompt_lps[i] = self._prompt_logprobs(prompt_out)
                lp = _joined(self.prompt_lps.get(i), len(prompt), lp)
            text = prompt + text
        return {"index": idx, "text": text, "logprobs": lp, "finish_reason": reason}

    # -- helpers ------------------------------------------------------------------------------------------
    def _prompt_text(self, i: int) -> str:
        p = self.prompts[i]
        return p if isinstance(p, str) else self.texts.tokenizer.decode(p)

    def _top(self, e: TokenLogprob) -> dict[str, float]:
        """A position's ``top_logprobs``: the ``logprobs`` best tokens and, as OpenAI's legacy completions
        always add it, the chosen token (so ``logprobs: 0`` gives the chosen token alone)."""
        top = {self.texts.text(t): lp for t, lp in e.top}
        top.setdefault(self.texts.text(e.token_id), e.logprob)
        return top

    def _logprobs(self, entries: list[TokenLogprob | None], offset: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        pos = offset
        for e in entries:
            if e is None:
                continue
            text = self.texts.text(e.token_id)
            tokens.append(text)
            token_lps.append(e.logprob)
            tops.append(self._top(e))
            offsets.append(pos)
            pos += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _prompt_logprobs(self, out: RequestOutput) -> dict:
        """The echoed prompt's logprobs (``None`` at the first token, which nothing predicts)."""
        res = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        pos = 0
        for tok, e in zip(out.prompt_token_ids, out.prompt_logprobs or []):
            text = self.texts.text(tok)
            res["tokens"].append(text)
            res["token_logprobs"].append(None if e is None else e.logprob)
            res["top_logprobs"].append(None if e is None else self._top(e))
            res["text_offset"].append(pos)
            pos += len(text)
        return res


def _joined(prompt_lp: dict | None, shift: int, lp: dict) -> dict:
    """The prompt's logprobs followed by the completion's (its offsets shifted past the prompt)."""
    pl = prompt_lp or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    return {
        "tokens": pl["tokens"] + lp["tokens"],
        "token_logprobs": pl["token_logprobs"] + lp["token_logprobs"],
        "top_logprobs": pl["top_logprobs"] + lp["top_logprobs"],
        "text_offset": pl["text_offset"] + [o + shift for o in lp["text_offset"]],
    }
