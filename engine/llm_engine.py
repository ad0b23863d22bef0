"""The synchronous engine: add requests, call :meth:`LLMEngine.step` until they finish.

Each step: schedule → forward one flattened batch (prefill chunks and decode tokens mixed) → sample
→ append tokens, detokenize, check stop conditions → report what changed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.kv import BlockManager
from engine.loader import eos_token_ids, load_config, load_model, load_tokenizer, resolve_model_path
from engine.model_runner import ForwardChunk, ModelRunner, available_memory_bytes, kv_bytes_per_token
from engine.outputs import CompletionOutput, RequestOutput, RequestStats
from engine.sampler import SamplingMetadata, apply_logits_processors, compute_probs
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import FinishReason, Sequence, SequenceGroup, TokenLogprob
from engine.speculative.controller import SpecController, Timer
from engine.speculative.draft_model import DraftModelProposer
from engine.speculative.proposer import ProposeContext
from engine.speculative.tree import DraftTree, tree_layout
from engine.speculative.verify import build_verify_input, verify

logger = logging.getLogger(__name__)


class SpecStats:
    """Cumulative speculative-decoding counters (read by the server's metrics)."""

    def __init__(self, max_depth: int) -> None:
        self.num_drafts = 0  # verify steps that carried a draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * max(max_depth, 1)

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for j in range(min(accepted, len(self.accepted_per_pos))):
            self.accepted_per_pos[j] += 1


class InvalidRequestError(ValueError):
    """The request itself is wrong (the server answers 400)."""


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        torch.manual_seed(config.seed)

        self.model_path = resolve_model_path(config.model)
        self.hf_config = load_config(self.model_path)
        self.tokenizer = load_tokenizer(resolve_model_path(config.tokenizer) if config.tokenizer else self.model_path)
        self.eos_token_ids = eos_token_ids(self.model_path, self.hf_config, self.tokenizer)
        self._eos = set(self.eos_token_ids)
        model_max = int(getattr(self.hf_config, "max_position_embeddings", 2048))
        if config.max_model_len is not None and config.max_model_len > model_max:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's {model_max} positions")
        max_len = config.max_model_len or model_max

        t0 = time.perf_counter()
        model = load_model(self.model_path, self.hf_config, self.dtype, self.device, max_len)
        logger.info("loaded %s in %.1fs (%s, %s)", self.model_path, time.perf_counter() - t0, self.dtype, self.device)
        draft_model = None
        if config.speculative_method == "draft":
            self.draft_path = resolve_model_path(config.draft_model)
            self.draft_config = load_config(self.draft_path)
            self._check_draft_vocab()
            draft_model = load_model(self.draft_path, self.draft_config, self.dtype, self.device, max_len)
            logger.info("draft model %s loaded", self.draft_path)

        num_blocks = self._num_kv_blocks(max_len)
        capacity = num_blocks * config.block_size
        if capacity < max_len:
            if config.max_model_len is not None:
                raise ValueError(
                    f"the KV pool holds {capacity} tokens, fewer than max_model_len {max_len}: "
                    "lower --max-model-len or raise --num-kv-blocks / --kv-cache-memory-fraction"
                )
            logger.warning("max_model_len lowered from %d to the KV pool's %d tokens", max_len, capacity)
            max_len = capacity
        self.max_model_len = max_len
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.runner = ModelRunner(model, self.hf_config, self.device, self.dtype, config.block_size, num_blocks)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.groups: dict[str, SequenceGroup] = {}
        self.num_steps = 0
        self.spec_stats = SpecStats(config.num_speculative_tokens)
        self._forward_seconds = 0.0  # this step's forward time (the rest is host work)
        self._num_drafting = 0
        self.proposer = None
        self.controller = None
        if draft_model is not None and config.num_speculative_tokens > 0:
            draft_runner = ModelRunner(
                draft_model, self.draft_config, self.device, self.dtype, config.block_size, num_blocks
            )
            self.proposer = DraftModelProposer(
                draft_runner,
                self.hf_config.vocab_size,
                self.eos_token_ids,
                tree=config.spec_tree_topk > 1,
                topk=config.spec_tree_topk,
                budget=config.spec_tree_budget,
            )
            self.controller = SpecController(config.num_speculative_tokens, self.proposer.slots_needed)
            self._calibrate()

    @property
    def spec_method(self) -> str:
        return self.proposer.method if self.proposer is not None else "none"

    def _check_draft_vocab(self) -> None:
        """A draft must speak the target's vocabulary: same ids for the same tokens."""
        draft_tok = load_tokenizer(self.draft_path)
        if draft_tok.get_vocab() != self.tokenizer.get_vocab():
            raise ValueError(
                f"the draft model {self.draft_path} has a different tokenizer vocabulary from the target "
                f"{self.model_path}; speculative decoding needs the same tokenizer"
            )
        # Checkpoints of one family often pad their embedding tables differently (Qwen2.5-7B: 152064,
        # Qwen2.5-0.5B: 151936); that is fine as long as both cover the shared tokenizer.
        need = len(self.tokenizer)
        for name, cfg in (("draft", self.draft_config), ("target", self.hf_config)):
            if cfg.vocab_size < need:
                raise ValueError(
                    f"the {name} model's vocab_size ({cfg.vocab_size}) is smaller than its tokenizer ({need})"
                )

    def _calibrate(self) -> None:
        """Time target and draft forwards over a range of batch sizes, seeding the controller's cost model."""
        table: list[int] = []
        n = min(64, self.block_manager.num_blocks * self.config.block_size - 1)
        if self.block_manager.reserve(table, 0, n) is None:
            return
        try:
            for runner, kind in ((self.runner, "target"), (self.proposer.runner, "draft")):
                t = 1
                while t <= n:
                    chunk = [ForwardChunk([3] * t, 0, table, 1)]
                    for rep in range(2):
                        with Timer() as timer:
                            runner.forward(chunk)
                            self._sync()
                        if rep:
                            self.controller.cost.observe(kind, t, timer.seconds)
                    t *= 2
        finally:
            self.block_manager.free(table)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _num_kv_blocks(self, max_len: int) -> int:
        c = self.config
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        per_token = kv_bytes_per_token(self.hf_config, self.dtype)
        if c.speculative_method == "draft":
            per_token += kv_bytes_per_token(self.draft_config, self.dtype)  # the draft's pool has as many slots
        per_block = per_token * c.block_size
        blocks = int(available_memory_bytes(self.device) * c.kv_cache_memory_fraction) // per_block
        if self.device.type == "cpu":
            # On a CPU the pool shares RAM with everything else: take no more than a full batch needs.
            blocks = min(blocks, c.max_num_seqs * (-(-max_len // c.block_size) + 1))
        if blocks < 1:
            raise ValueError("no memory left for the KV cache")
        return blocks

    # -- requests ---------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError if this request cannot be served as asked."""
        if not prompt_ids:
            raise InvalidRequestError("the prompt must not be empty")
        if params.n > self.config.max_num_seqs:
            raise InvalidRequestError(
                f"n = {params.n} exceeds the {self.config.max_num_seqs} sequences one batch can hold (--max-num-seqs)"
            )
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        if params.logit_bias:
            bad = [t for t in params.logit_bias if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"logit_bias token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_ids)} tokens; this model's context length is {self.max_model_len}"
            )
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                f"length of {self.max_model_len} tokens"
            )

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        if request_id in self.groups:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        prompt_ids = self.tokenize(prompt)
        self.validate(prompt_ids, params)
        group = SequenceGroup(
            request_id,
            prompt_ids,
            params,
            time.monotonic() if arrival_time is None else arrival_time,
            prompt if isinstance(prompt, str) else None,
        )
        seq = group.seqs[0]
        self._init_seq(seq, seed_offset=0)
        self.groups[request_id] = group
        self.scheduler.add(seq)

    def _init_seq(self, seq: Sequence, seed_offset: int) -> None:
        p = seq.params
        seq.detok = IncrementalDetokenizer(
            self.tokenizer,
            seq.prompt_ids,
            skip_special_tokens=p.skip_special_tokens,
            stop=p.stop,
            include_stop_str_in_output=p.include_stop_str_in_output,
        )
        if p.seed is not None:
            seq.generator = self.runner.make_generator(p.seed + seed_offset)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks. False if it is unknown or already done."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return False
        for seq in group.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = FinishReason.ABORT
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    @property
    def num_requests_running(self) -> int:
        return len({s.group.request_id for s in self.scheduler.running})

    @property
    def num_requests_waiting(self) -> int:
        return len(
            {s.group.request_id for s in self.scheduler.waiting} - {s.group.request_id for s in self.scheduler.running}
        )

    # -- the step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step. A failure is confined to the requests it concerns: an exception while
        finishing one request's tokens fails that request; one in the batched forward fails the
        requests of that batch. The engine keeps serving the rest."""
        want = self._plan_drafts()
        lookahead = None
        if want:
            lookahead = lambda seq: self.proposer.slots_needed(want.get(seq.seq_id, 0), seq.params.greedy)  # noqa: E731
        sched = self.scheduler.schedule(lookahead=lookahead)
        if not sched.scheduled:
            return []
        self.num_steps += 1
        step_start = time.perf_counter()
        self._forward_seconds = 0.0
        self._num_drafting = 0
        try:
            touched, results = self._forward_and_sample(sched, want)
        except Exception as e:
            logger.exception("engine step failed; failing the %d requests in it", len(sched.scheduled))
            failed = {seq.group.request_id: seq.group for seq, _ in sched.scheduled}
            return [self._fail_group(g, f"{type(e).__name__}: {e}") for g in failed.values()]
        now = time.monotonic()
        for seq, tokens, lps in results:
            group = seq.group
            if group.error is not None:
                continue
            group.num_decode_steps += 1
            try:
                self._append_tokens(seq, tokens, lps)
                if not seq.is_finished:
                    self.block_manager.commit(seq.block_table, seq.block_hashes, seq.token_ids, seq.num_computed_tokens)
            except Exception as e:
                logger.exception("request %s failed while appending tokens", group.request_id)
                self._fail_group(group, f"{type(e).__name__}: {e}", emit=False)
            if group.first_token_time is None:
                group.first_token_time = now
            touched[group.request_id] = group
        outputs = [self._make_output(g) for g in touched.values()]
        if self.controller is not None:
            host = time.perf_counter() - step_start - self._forward_seconds
            self.controller.cost.observe_step(host, len(sched.scheduled), self._num_drafting)
        return outputs

    def _plan_drafts(self) -> dict[int, int]:
        """Draft depth wanted per decoding sequence this step (seq_id → depth; absent = none)."""
        if self.controller is None:
            return {}
        decode = [s for s in self.scheduler.running if s.num_uncomputed_tokens == 1]
        if not decode:
            return {}
        other = sum(s.num_uncomputed_tokens for s in self.scheduler.running if s.num_uncomputed_tokens > 1)
        other += sum(s.num_tokens for s in list(self.scheduler.waiting)[:4])  # likely admissions
        depths = self.controller.plan(decode, min(other, self.config.max_num_batched_tokens))
        want = {}
        for seq, d in zip(decode, depths):
            # Never draft past max_tokens or the context length.
            left = self.max_model_len - seq.num_tokens
            if seq.params.max_tokens is not None:
                left = min(left, seq.params.max_tokens - seq.num_output_tokens)
            d = min(d, left - 1)
            if d <= 0 and seq.params.speculative is not False and seq.params.num_draft_tokens is None:
                # A request the controller keeps at zero still probes now and then, so that a better
                # phase of its text (or a lighter load) is noticed.
                seq.spec_idle_steps += 1
                if seq.spec_idle_steps >= 32 and left > 1:
                    seq.spec_idle_steps, d = 0, 1
            if d > 0:
                want[seq.seq_id] = d
        return want

    def _forward_and_sample(self, sched, want: dict[int, int]) -> tuple[dict[str, SequenceGroup], list]:
        self.runner.copy_blocks(sched.block_copies)
        spec_seqs: list[Sequence] = []
        depths: list[int] = []
        if self.proposer is not None:
            self.proposer.copy_blocks(sched.block_copies)
            for seq, _ in sched.scheduled:
                granted = sched.lookahead.get(seq.seq_id, 0)
                d = want.get(seq.seq_id, 0)
                while d > 0 and self.proposer.slots_needed(d, seq.params.greedy) > granted:
                    d -= 1
                if d > 0:
                    spec_seqs.append(seq)
                    depths.append(d)
        trees: dict[int, DraftTree] = {}
        if spec_seqs:
            drafted = self.proposer.propose(spec_seqs, depths, ProposeContext())
            trees = {s.seq_id: t for s, t in zip(spec_seqs, drafted) if len(t)}
            self._num_drafting = len(spec_seqs)
            for kind, tokens, seconds in self.proposer.runner_timings():
                self.controller.cost.observe(kind, tokens, seconds)
                self._forward_seconds += seconds

        chunks: list[ForwardChunk] = []
        sample_rows: list[int] = []  # logits row each finishing chunk samples from (no draft)
        sample_seqs: list[Sequence] = []
        spec_rows: list[tuple[Sequence, DraftTree, int, int]] = []  # (seq, tree, first logits row, depth)
        prompt_spans: list[tuple[Sequence, int, int, int]] = []  # (seq, first logits row, first position, count)
        row = 0
        for seq, n in sched.scheduled:
            start = seq.num_computed_tokens
            tree = trees.get(seq.seq_id)
            if tree is not None:
                layout = tree_layout(tree)
                chunks.append(
                    ForwardChunk(
                        [seq.token_ids[start]] + tree.tokens,
                        start,
                        seq.block_table,
                        len(tree) + 1,
                        positions=[start + d for d in layout.depths],
                        tree_mask=layout.mask,
                    )
                )
                spec_rows.append((seq, tree, row, max(layout.depths)))
                row += len(tree) + 1
                continue
            done = start + n == seq.num_tokens
            group = seq.group
            wants_prompt = (
                seq.params.prompt_logprobs is not None
                and seq.index == 0
                and len(group.prompt_logprobs) < group.num_prompt_tokens
                and start < group.num_prompt_tokens
            )
            num_logits = n if wants_prompt else int(done)
            chunks.append(ForwardChunk(seq.token_ids[start : start + n], start, seq.block_table, num_logits))
            if wants_prompt:
                prompt_spans.append((seq, row, start, n))
            if done:
                sample_rows.append(row + num_logits - 1)
                sample_seqs.append(seq)
            row += num_logits
        with Timer() as timer:
            out = self.runner.forward(chunks)
            self._sync()
        self._forward_seconds += timer.seconds
        if self.controller is not None:
            self.controller.cost.observe("target", sum(len(c.token_ids) for c in chunks), timer.seconds)

        for seq, n in sched.scheduled:
            if seq.seq_id in trees:
                continue  # advanced after verification
            seq.num_computed_tokens += n
            self.block_manager.commit(seq.block_table, seq.block_hashes, seq.token_ids, seq.num_computed_tokens)
        touched: dict[str, SequenceGroup] = {}
        if prompt_spans:
            self._record_prompt_logprobs(out.logits, prompt_spans)
            for seq, *_ in prompt_spans:
                touched[seq.group.request_id] = seq.group

        results = []
        if spec_rows:
            results.extend(self._verify(out.logits, spec_rows))
        # A request with n > 1 forks its other choices off the first once the prompt is prefilled;
        # each choice samples its first token from the same prompt logits.
        rows: list[int] = []
        row_seqs: list[Sequence] = []
        for r, seq in zip(sample_rows, sample_seqs):
            family = [seq]
            if seq.group.params.n > 1 and len(seq.group.seqs) == 1:
                family += self._fork(seq)
            rows.extend([r] * len(family))
            row_seqs.extend(family)
        if row_seqs:
            logits = out.logits[rows]
            sampled = self.runner.sample(
                logits,
                [s.params for s in row_seqs],
                [s.prompt_ids for s in row_seqs],
                [s.output_ids for s in row_seqs],
                [s.generator for s in row_seqs],
                self.eos_token_ids,
            )
            tokens = sampled.token_ids.tolist()
            logprobs = self._logprob_lists(sampled, row_seqs)
            results.extend((s, [t], [lp] if lp is not None else None) for s, t, lp in zip(row_seqs, tokens, logprobs))
        return touched, results

    def _verify(self, logits: torch.Tensor, spec_rows: list[tuple[Sequence, DraftTree, int, int]]) -> list:
        """Accept losslessly from every drafted sequence's tree; move accepted KV into place."""
        rows: list[int] = []
        params, prompts, histories, gens = [], [], [], []
        for seq, tree, first, _ in spec_rows:
            rows.extend(range(first, first + len(tree) + 1))
            paths: list[list[int]] = [[]]
            for tok, par in zip(tree.tokens, tree.parents):
                paths.append(paths[par + 1] + [tok])
            for path in paths:  # every row samples with its own history: output + drafted path
                params.append(seq.params)
                prompts.append(seq.prompt_ids)
                histories.append(seq.output_ids + path)
                gens.append(seq.generator)
        raw = logits[rows]
        md = SamplingMetadata.build(
            params, prompts, histories, gens, self.eos_token_ids, self.runner.vocab_size, self.device
        )
        p = compute_probs(apply_logits_processors(raw, md) if md.needs_processing else raw, md)
        inp, _ = build_verify_input(p, [t for _, t, _, _ in spec_rows], self.runner.vocab_size)
        res = verify(inp, [seq.generator for seq, *_ in spec_rows])

        want_lp = any(seq.params.logprobs is not None for seq, *_ in spec_rows)
        log_p = torch.log_softmax(raw.float(), -1) if want_lp else None
        moves_src, moves_dst = [], []
        results = []
        base = 0
        bs = self.config.block_size
        for b, (seq, tree, _, depth) in enumerate(spec_rows):
            acc_rows = res.accepted_rows[b]
            local = [r - base - 1 for r in acc_rows]  # node indices
            a = len(local)
            tokens = [tree.tokens[i] for i in local] + [res.final_tokens[b]]
            c = seq.num_computed_tokens
            for i, node in enumerate(local):  # node i of the path belongs at position c + 1 + i
                if node != i:
                    src, dst = c + 1 + node, c + 1 + i
                    moves_src.append(seq.block_table[src // bs] * bs + src % bs)
                    moves_dst.append(seq.block_table[dst // bs] * bs + dst % bs)
            lps = None
            if seq.params.logprobs is not None:
                k = seq.params.logprobs
                emit_rows = [base] + acc_rows  # each emitted token is drawn at its parent's row
                lps = []
                for tok, r in zip(tokens, emit_rows):
                    top = log_p[r].topk(k) if k else None
                    lps.append(
                        TokenLogprob(
                            tok,
                            log_p[r, tok].item(),
                            list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [],
                        )
                    )
            seq.num_computed_tokens = c + 1 + a
            self.block_manager.release_tail(seq.block_table, seq.block_hashes, seq.num_computed_tokens)
            self.proposer.on_verified(seq, tree, a)
            self.controller.update(seq, depth, a)
            self.spec_stats.record(len(tree), a)
            seq.group.num_draft_tokens += len(tree)
            seq.group.num_accepted_tokens += a
            seq.spec_idle_steps = 0
            results.append((seq, tokens, lps))
            base += len(tree) + 1
        self.runner.move_slots(moves_src, moves_dst)
        return results

    def _record_prompt_logprobs(self, logits, spans: list[tuple[Sequence, int, int, int]]) -> None:
        """Logprob of each prompt token given the tokens before it, with the top alternatives."""
        import torch

        rows, targets, owners = [], [], []
        for seq, first_row, start, n in spans:
            for i in range(n):
                pos = start + i  # the logits at `pos` predict the token at pos + 1
                if pos + 1 < seq.group.num_prompt_tokens:
                    rows.append(first_row + i)
                    targets.append(seq.token_ids[pos + 1])
                    owners.append(seq.group)
        for seq, _, start, _ in spans:
            if start == 0 and not seq.group.prompt_logprobs:
                seq.group.prompt_logprobs.append(None)  # nothing predicts the first token
        if not rows:
            return
        k = max(seq.params.prompt_logprobs for seq, *_ in spans)
        lp = torch.log_softmax(logits[rows].float(), dim=-1)
        chosen = lp.gather(1, torch.tensor(targets, device=lp.device)[:, None])[:, 0].tolist()
        top_v, top_i = lp.topk(k, dim=-1) if k > 0 else (None, None)
        top_v = top_v.tolist() if top_v is not None else None
        top_i = top_i.tolist() if top_i is not None else None
        for j, (group, tok) in enumerate(zip(owners, targets)):
            kk = group.params.prompt_logprobs
            top = list(zip(top_i[j][:kk], top_v[j][:kk])) if top_i is not None and kk else []
            group.prompt_logprobs.append(TokenLogprob(tok, chosen[j], top))

    def _fail_group(self, group: SequenceGroup, error: str, emit: bool = True) -> RequestOutput | None:
        """End a request that failed inside the engine; its blocks are freed at once."""
        group.error = error
        for seq in group.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = FinishReason.ERROR
        return self._make_output(group) if emit else None

    def _fork(self, parent: Sequence) -> list[Sequence]:
        group = parent.group
        children = []
        for i in range(1, group.params.n):
            child = Sequence(group, parent.prompt_ids, index=i)
            child.block_table = self.block_manager.fork(parent.block_table)
            child.block_hashes = list(parent.block_hashes)
            child.num_computed_tokens = parent.num_computed_tokens
            child.draft_num_computed = parent.draft_num_computed
            self._init_seq(child, seed_offset=i)
            group.seqs.append(child)
            self.scheduler.add_running(child)
            children.append(child)
        return children

    @staticmethod
    def _logprob_lists(sampled, seqs: list[Sequence]) -> list[TokenLogprob | None]:
        if sampled.logprobs is None:
            return [None] * len(seqs)
        lps = sampled.logprobs.tolist()
        top_ids = sampled.top_token_ids.tolist() if sampled.top_token_ids is not None else None
        top_lps = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None
        tokens = sampled.token_ids.tolist()
        result: list[TokenLogprob | None] = []
        for i, seq in enumerate(seqs):
            k = seq.params.logprobs
            if k is None:
                result.append(None)
                continue
            top = list(zip(top_ids[i][:k], top_lps[i][:k])) if top_ids is not None and k > 0 else []
            result.append(TokenLogprob(tokens[i], lps[i], top))
        return result

    def _append_tokens(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob] | None) -> None:
        """Append accepted tokens one by one, stopping at the first stop condition."""
        p = seq.params
        for j, tok in enumerate(tokens):
            seq.token_ids.append(tok)
            if logprobs is not None:
                seq.logprobs.append(logprobs[j])
            reason: FinishReason | None = None
            if tok in self._eos and not p.ignore_eos:
                reason = FinishReason.STOP
            elif tok in p.stop_token_ids:
                reason, seq.stop_reason = FinishReason.STOP, tok
            else:
                matched = seq.detok.append([tok])
                if matched is not None:
                    reason, seq.stop_reason = FinishReason.STOP, matched
            if reason is None and p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
                reason = FinishReason.LENGTH
            if reason is None and seq.num_tokens >= self.max_model_len:
                reason = FinishReason.LENGTH
            if reason is not None:
                seq.finish_reason = reason
                self.scheduler.finish(seq)
                return

    def _make_output(self, group: SequenceGroup) -> RequestOutput:
        outputs = []
        for seq in group.seqs:
            text = seq.detok.emittable_text(seq.is_finished)
            new_tokens = seq.output_ids[seq.num_emitted_tokens :]
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
                )
            )
            seq.num_emitted_tokens = seq.num_output_tokens
            seq.num_emitted_chars = len(text)
        finished = group.is_finished
        if finished:
            group.finished_time = time.monotonic()
            self.groups.pop(group.request_id, None)
        stats = RequestStats(
            arrival_time=group.arrival_time,
            first_token_time=group.first_token_time,
            finished_time=group.finished_time,
            num_prompt_tokens=group.num_prompt_tokens,
            num_generated_tokens=sum(s.num_output_tokens for s in group.seqs),
            num_preemptions=sum(s.num_preemptions for s in group.seqs),
            num_decode_steps=group.num_decode_steps,
            num_draft_tokens=group.num_draft_tokens,
            num_accepted_tokens=group.num_accepted_tokens,
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

    # -- convenience ------------------------------------------------------------------------------
    def generate(
        self, prompts: Iterable[str | list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[RequestOutput]:
        """Run prompts to completion. Returns each request's final output, whose ``delta_*`` fields hold the
        whole completion (everything since the request started)."""
        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{self.num_steps}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        final: dict[str, RequestOutput] = {}
        acc: dict[tuple[str, int], tuple[list[int], list[TokenLogprob]]] = {}
        while any(rid not in final for rid in ids):
            if not self.has_unfinished_requests():
                raise RuntimeError("requests vanished without finishing")
            for o in self.step():
                for c in o.outputs:
                    toks, lps = acc.setdefault((o.request_id, c.index), ([], []))
                    toks.extend(c.delta_token_ids)
                    lps.extend(c.delta_logprobs or [])
                if o.finished:
                    final[o.request_id] = o
        for rid, o in final.items():
            for c in o.outputs:
                c.delta_token_ids, lps = acc.get((rid, c.index), ([], []))
                c.delta_logprobs = lps if c.delta_logprobs is not None else None
                c.delta_text = c.text
        return [final[rid] for rid in ids]
