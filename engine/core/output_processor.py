"""From accepted token ids to what a client sees: stop checks, detokenization, output assembly.

The step hands over, per sequence, the tokens it emitted this step (one for plain decoding, several
after a verified draft) with their logprobs. They are appended one by one through the same stop
checks, so a speculative step stops exactly where plain decoding would: at EOS, a stop token id, a
stop string (held back while it may still be forming), ``max_tokens`` or the context length. No
tensor is touched here.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from engine.request.detokenizer import IncrementalDetokenizer
from engine.request.outputs import CompletionOutput, RequestOutput, RequestStats
from engine.request.sequence import FinishReason, Sequence, SequenceGroup, TokenLogprob


class OutputProcessor:
    def __init__(
        self,
        tokenizer,
        eos_token_ids: list[int],
        max_model_len: int,
        finish: Callable[[Sequence], None],  # frees a finished sequence's blocks and proposer state
    ) -> None:
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.finish = finish

    def init_sequence(self, seq: Sequence) -> None:
        p = seq.params
        seq.detok = IncrementalDetokenizer(
            self.tokenizer,
            seq.prompt_ids,
            skip_special_tokens=p.skip_special_tokens,
            kept_special_ids=p.kept_special_ids,
            stop=p.stop,
            include_stop_str_in_output=p.include_stop_str_in_output,
        )

    def append(
        self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None, provenance: list | None = None
    ) -> None:
        """Append accepted tokens one by one, stopping at the first stop condition. A sequence whose
        grammar failed raises (the engine fails its request alone)."""
        if seq.grammar is not None and seq.grammar.error is not None:
            raise RuntimeError(seq.grammar.error)
        p = seq.params
        for j, tok in enumerate(tokens):
            seq.token_ids.append(tok)
            if logprobs is not None:
                seq.logprobs.append(logprobs[j])
            if seq.params.include_speculation:
                seq.provenance.append(provenance[j] if provenance is not None else ("plain", None, 0))
            reason: FinishReason | None = None
            if tok in self.eos and not p.ignore_eos:
                reason = FinishReason.STOP
            elif tok in p.stop_token_ids:
                reason, seq.stop_reason = FinishReason.STOP, tok
            else:
                matched = seq.detok.append([tok], seq.num_output_tokens >= p.min_tokens)  # (vLLM's rule)
                if matched is not None:
                    reason, seq.stop_reason = FinishReason.STOP, matched
            if reason is None and j == len(tokens) - 1 and seq.grammar is not None and seq.grammar.terminated:
                # Its grammar is complete (the step cut the emit there): nothing may follow, even with
                # ignore_eos. The output ended by itself, even on its last allowed token.
                reason = FinishReason.STOP
            if reason is None and p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
                reason = FinishReason.LENGTH
            if reason is None and seq.num_tokens >= self.max_model_len:
                reason = FinishReason.LENGTH
            if reason is not None:
                seq.finish_reason = reason
                self.finish(seq)
                return

    def make_output(self, group: SequenceGroup) -> RequestOutput:
        """What changed for this request since its last output (and its totals)."""
        outputs = []
        finished = group.is_finished
        # A beam search shows nothing until it ends: its beams are not its choices until then.
        for seq in group.seqs if group.beam is None or finished else ():
            text = seq.detok.emittable_text(seq.is_finished)
            new_tokens = seq.token_ids[seq.num_prompt_tokens + seq.num_emitted_tokens :]  # (not a copy of all)
            new_lps = seq.logprobs[seq.num_emitted_tokens :] if seq.params.logprobs is not None else None
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    delta_text=text[seq.num_emitted_chars :],
                    delta_token_ids=new_tokens,
                    delta_logprobs=new_lps,
                    num_tokens=seq.num_output_tokens,
                    finish_reason=seq.finish_reason.value if seq.finish_reason else None,
                    stop_reason=seq.stop_reason,
                    delta_provenance=seq.provenance[seq.num_emitted_tokens :]
                    if seq.params.include_speculation
                    else None,
                )
            )
            seq.num_emitted_tokens = seq.num_output_tokens
            seq.num_emitted_chars = len(text)
        if finished and group.finished_time is None:
            group.finished_time = time.monotonic()
        stats = RequestStats(
            arrival_time=group.arrival_time,
            first_token_time=group.first_token_time,
            finished_time=group.finished_time,
            num_prompt_tokens=group.num_prompt_tokens,
            num_cached_prompt_tokens=group.num_cached_prompt_tokens or 0,
            num_generated_tokens=sum(s.num_output_tokens for s in group.seqs),
            num_preemptions=sum(s.num_preemptions for s in group.seqs),
            num_decode_steps=group.num_decode_steps,
            num_draft_tokens=group.num_draft_tokens,
            num_accepted_tokens=group.num_accepted_tokens,
            drafted_by={k: tuple(v) for k, v in group.drafted_by.items()},
            spec_reasons=dict(group.spec_reasons),
            num_forced_tokens=group.num_forced_tokens,
            grammar_seconds=sum(s.grammar.seconds for s in group.seqs if s.grammar is not None),
        )
        prompt_logprobs = None
        if (
            group.params.prompt_logprobs is not None
            and not group.prompt_logprobs_emitted
            and len(group.prompt_logprobs) == group.num_prompt_tokens
        ):
            prompt_logprobs = group.prompt_logprobs
            group.prompt_logprobs_emitted = True
        return RequestOutput(
            group.request_id,
            group.prompt_ids,
            outputs,
            finished,
            stats,
            error=group.error,
            prompt_logprobs=prompt_logprobs,
        )
