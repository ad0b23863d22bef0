"""The synchronous engine: add requests, call :meth:`LLMEngine.step` until they finish.

This module builds the engine (target model, proposer, KV pool, scheduler) and runs the step
skeleton: the step itself (plan → schedule → propose → forward → accept → commit) is
``engine/core/step.py``; stop checks, detokenization and outputs are
``engine/core/output_processor.py``.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import threading
import time
from collections.abc import Iterable

import torch

from engine.config import EngineConfig
from engine.core.ahead import RunAhead
from engine.core.output_processor import OutputProcessor
from engine.core.scheduler import Scheduler
from engine.core.step import Step
from engine.decoding.beam import BeamSearch
from engine.kv import BlockManager
from engine.kv.block_manager import chain_root
from engine.lora import AdapterError, LoraSlots, read_adapter
from engine.lora.registry import AdapterRegistry
from engine.parallel import SINGLE
from engine.request.checks import InvalidRequestError, RequestLimits, TextFit
from engine.request.confine import Confine
from engine.request.outputs import CompletionOutput, RequestOutput, RequestStats
from engine.request.sampling_params import SamplingParams
from engine.request.sequence import BeamState, FinishReason, Sequence, SequenceGroup, SequenceStatus, TokenLogprob
from engine.request.state import SearchState
from engine.runner.loader import (
    batch_invariant_serves,
    eos_token_ids,
    generation_defaults,
    load_config,
    load_model,
    load_tokenizer,
    resolve_model_path,
)
from engine.runner.model_runner import ModelRunner, kv_pool_blocks
from engine.sampling.batch import Emit
from engine.speculative.controller import SpecController, profile_costs
from engine.speculative.methods import proposer_class, resolve_method
from engine.structured import GrammarError, Grammars

logger = logging.getLogger(__name__)


def is_out_of_memory(e: BaseException) -> bool:
    """A device (CUDA) or host allocation failed: the step was too big, not wrong."""
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(e, RuntimeError) and "can't allocate memory" in str(e)  # the CPU allocator's message


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.workers = None  # (tensor-parallel workers, once started: stopped if the build fails after)
        try:
            self._build(config)
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig) -> None:
        # The speculative method, resolved (a --draft-model directory's layout may name it) and checked.
        method = resolve_method(config.speculative_method, config.draft_model)
        config = dataclasses.replace(config, speculative_method=method)
        self.config = config
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        torch.manual_seed(config.seed)

        self.model_path = resolve_model_path(config.model)
        self.hf_config = load_config(self.model_path)
        self.tokenizer = load_tokenizer(resolve_model_path(config.tokenizer) if config.tokenizer else self.model_path)
        self.eos_token_ids = eos_token_ids(self.model_path, self.hf_config, self.tokenizer)
        self.generation_defaults = generation_defaults(self.model_path)  # the model's sampling defaults
        model_max = int(getattr(self.hf_config, "max_position_embeddings", 2048))
        if config.max_model_len is not None and config.max_model_len > model_max:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's {model_max} positions")
        max_len = config.max_model_len or model_max

        t0 = time.perf_counter()
        compiled = config.compile_enabled
        # Tensor parallelism: rank 0 (this engine) starts its workers, then loads its own shard.
        runner_cls, front = ModelRunner, ()
        if config.tensor_parallel_size > 1:
            from engine.runner.parallel import ShardedRunner, rank_device, start_workers

            self.workers = start_workers(config)
            self.device = rank_device(config, 0)
            runner_cls, front = ShardedRunner, (self.workers,)
        tp = self.workers.tp if self.workers is not None else SINGLE
        invariant = batch_invariant_serves(config)
        model = load_model(
            self.model_path, self.hf_config, self.dtype, self.device, max_len, pack=not compiled,
            quantization=config.quantization, tp=tp, batch_invariant=invariant,
        )  # fmt: skip
        self.batch_invariant = invariant  # a request's tokens depend on nothing but the request
        self.adapters = self._attach_adapters(model, config, invariant)  # LoRA adapters (None: not served)
        self.lora_queue: list[Sequence] = []  # requests whose adapter waits for a slot (engine/lora/registry.py)
        logger.info("loaded %s in %.1fs (%s, %s)", self.model_path, time.perf_counter() - t0, self.dtype, self.device)
        if tp.size > 1:
            logger.info("tensor parallel: rank 0 of %d", tp.size)
        self.runner = runner_cls(
            *front, model, self.hf_config, self.device, self.dtype, config.block_size, compile=compiled,
            attention_backend=config.attention_backend,
            # LoRA on the Triton kernels is captured (each row reads its slot from one device buffer); the
            # eager path's mask is sized at run time, so it runs uncaptured
            cuda_graph_max_seqs=(
                0 if self.adapters is not None and not self.adapters.slots.kernel else config.cuda_graph_max_seqs
            ),
            batch_invariant=invariant, kv_cache_dtype=config.kv_cache_dtype,
        )  # fmt: skip
        self.proposer = None
        if config.speculative_method != "none" and config.num_speculative_tokens > 0:
            cls = proposer_class(config.speculative_method)
            self.proposer = cls.build(config, self.runner, tokenizer=self.tokenizer, eos_token_ids=self.eos_token_ids)
            logger.info("speculative method %s", cls.method)

        extra = self.proposer.kv_bytes_per_token if self.proposer else 0  # sized into the same pool
        num_blocks = config.num_kv_blocks or kv_pool_blocks(self.runner, extra, config, max_len)
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
        self._text_fit = TextFit(self.tokenizer, max_len)
        self.runner.allocate_kv(num_blocks)
        if self.proposer is not None:
            self.proposer.allocate_kv(num_blocks)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        # What a request is checked against (fixed from here on; a front in another process gets a copy).
        amateur = self.proposer is not None and self.proposer.has_language_model
        self.limits = RequestLimits(
            self.vocab_size, max_len, config.max_num_seqs, config.max_num_batched_tokens,
            num_blocks * config.block_size, amateur, self.proposer.routes() if self.proposer else (),
        )  # fmt: skip
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.groups: dict[str, SequenceGroup] = {}
        self.num_steps = 0
        self.controller = (
            SpecController(self.proposer.deepest(config.num_speculative_tokens), self.proposer)
            if self.proposer
            else None
        )
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, max_len, self._finish_seq)
        beams = BeamSearch(self.eos_token_ids, max_len, self._fork_one, self._finish_seq)
        self.confine = Confine()  # per-request host work: a failure there fails that request alone
        self.step_runner = Step(
            self.runner, self.scheduler, self.proposer, self.controller, self._fork, beams, self.eos_token_ids, max_len,
            jump_forward=config.grammar_jump_forward, confine=self.confine,
        )  # fmt: skip
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids, config.grammar_cache_size)
        self.ahead = None  # run-ahead decoding (engine/core/ahead.py)
        if config.async_scheduling_enabled:
            # A proposer that reads the target's features of every computed token (EAGLE, Medusa, MTP)
            # would miss those of the forwards ahead.
            if tp.size == 1 and (self.proposer is None or not self.proposer.hidden_layers):
                self.ahead = RunAhead(self.runner, self.scheduler, max_len, config.max_num_seqs, self.eos_token_ids)
            elif config.async_scheduling == "on":
                logger.warning(
                    "--async-scheduling runs on one rank, beside a proposer that does not read the target's "
                    "features: off for this engine"
                )
        try:
            self.grammars.tokenizer()
        except GrammarError as e:  # the server still serves; constrained requests get this as a 400
            logger.warning("%s", e)
        # Compiled forwards: warmed up now, or served eagerly until a background thread has warmed
        # them up over scratch pools (compile_in_background); CUDA graphs capture what is served now.
        self.compile_state = "off"  # off | pending | ready (to swap in) | on | failed
        self.chains_warmed = False  # the background compile's chain graphs are ready (swap_in_compiled)
        if compiled:
            if config.compile_background and self.runner.graphs is None and tp.size == 1:
                for runner in self._runners():
                    runner.serve_eager()
                self.compile_state = "pending"
            else:
                self._warm_compiled(lambda runner: runner)
                self.compile_state = "on"
        self.runner.capture_graphs(self.step_runner.hidden_layers)
        if self.proposer is not None:
            self.proposer.warmup()
        if self.controller is not None:  # seed the cost model with timings of the shapes the step runs
            probes = [(self.runner.forward, "target"), *self.proposer.cost_probes()]
            c = config
            limits = (c.block_size, c.max_num_seqs, c.max_num_batched_tokens, self.block_manager.num_free_blocks)
            profile_costs(self.controller.cost, probes, self.runner.synchronize, *limits)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (they stop too if this process dies)."""
        if self.workers is not None:
            self.workers.close()

    # -- compiled forwards -------------------------------------------------------------------------
    def _attach_adapters(self, model: torch.nn.Module, config: EngineConfig, invariant: bool) -> AdapterRegistry | None:
        """Read every ``--lora-modules`` adapter (a bad one stops the start, saying why), then give the
        model its LoRA slots and know each adapter (engine/lora); None where adapters are not served."""
        if not config.lora_enabled:
            return None
        adapters = [read_adapter(name, path, config.max_lora_rank) for name, path in config.lora_modules.items()]
        slots = LoraSlots.attach(
            model, config.max_loras, config.max_lora_rank, config.max_num_batched_tokens, invariant
        )
        # slots are written through the runner: under tensor parallelism every rank writes its share
        registry = AdapterRegistry(
            slots, lambda s, a: self.runner.write_lora(s, a), lambda s: self.runner.clear_lora(s)
        )
        for adapter in adapters:
            registry.add(adapter)
            logger.info("LoRA adapter %s (rank %d, %d modules) from %s", adapter.name, adapter.rank,
                        len(adapter.pairs), adapter.path)  # fmt: skip
        return registry

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Know one more adapter (``POST /v1/load_lora_adapter``); :class:`AdapterError` if it cannot be."""
        if self.adapters is None:
            raise AdapterError("this engine serves no LoRA adapters (start it with --enable-runtime-lora)")
        self.adapters.add(read_adapter(name, path, self.config.max_lora_rank))
        self._forget_adapter(name)  # what an earlier adapter of this name left (its last request has ended)
        logger.info("LoRA adapter %s loaded from %s", name, path)

    def unload_lora_adapter(self, name: str) -> None:
        """Forget an adapter (``POST /v1/unload_lora_adapter``): new requests for it are refused, those
        running finish under it. KeyError if it is not loaded."""
        if self.adapters is None:
            raise KeyError(name)
        self.adapters.remove(name)
        self._forget_adapter(name)
        logger.info("LoRA adapter %s unloaded", name)

    def _forget_adapter(self, name: str) -> None:
        """Drop the drafting evidence kept from adapter ``name``'s requests: the proposers' stores of
        their outputs and the controller's acceptance for them (a name unloaded for good keeps nothing;
        one loaded again starts afresh)."""
        if self.proposer is not None:
            self.proposer.forget_adapter(name)
        if self.controller is not None:
            self.controller.forget_adapter(name)

    def _admit_lora_queue(self) -> list[RequestOutput]:
        """Schedule the waiting requests whose adapter has (or now gets) a slot, strictly in arrival order:
        from the first that finds every slot held by others' requests, the rest wait behind it (a request
        of a loaded adapter does not pass one that waits for a slot, so none waits forever). A request
        whose adapter cannot be written into its slot (out of memory) fails alone: its final output is
        returned, and the requests behind it go on."""
        failed: list[RequestOutput] = []
        while self.lora_queue:
            seq = self.lora_queue[0]
            try:
                slot = self.adapters.acquire(seq.params.lora)
            except Exception as e:
                logger.exception("LoRA adapter %s could not be written into a slot", seq.params.lora)
                error = f"LoRA adapter {seq.params.lora!r} could not be loaded into a slot: {type(e).__name__}: {e}"
                failed.append(self._fail_group(seq.group, error))
                continue
            if slot is None:
                break
            self.lora_queue.pop(0)
            self.adapters.unwait(seq.params.lora)
            seq.group.lora_slot = slot
            self.scheduler.add(seq)
        return failed

    def _drop_group(self, group: SequenceGroup) -> None:
        """A request leaves the engine: its adapter's slot is no longer held for it."""
        if self.groups.pop(group.request_id, None) is not None and group.lora_slot >= 0:
            self.adapters.release(group.params.lora)

    def _runners(self) -> list[ModelRunner]:
        """The target's runner and the proposer's, each once."""
        runners = [self.runner]
        for r in self.proposer.runners() if self.proposer is not None else ():
            if all(r is not have for have in runners):
                runners.append(r)
        return runners

    def _warm_compiled(self, view, chains: bool = True) -> None:
        """Run every compiled forward once as the step calls it, through ``view(runner)``; with
        ``chains``, the proposer's chain graphs too (``Proposer.warm_chains``)."""
        view(self.runner).warm_compiled(self.step_runner.hidden_layers)
        if self.proposer is not None:
            self.proposer.warm_compiled(view)
            if chains:
                self.proposer.warm_chains(view)

    def compile_in_background(self) -> threading.Thread | None:
        """Start compiling the forwards on a thread of their own while the engine serves eagerly
        (``compile_background``); :meth:`step` swaps them in once they are ready. Warm-up runs
        through each runner's compile view, whose scratch pool no request uses. A failed compile
        leaves the engine eager, logged."""
        if self.compile_state != "pending":
            return None
        # In a copy of this thread's context: torch's compile settings are context variables.
        context = contextvars.copy_context()
        thread = threading.Thread(target=context.run, args=(self._compile_forwards,), name="augur-compile", daemon=True)
        thread.start()
        return thread

    def _compile_forwards(self) -> None:
        t0 = time.perf_counter()
        views: dict[int, ModelRunner] = {}

        def view(runner: ModelRunner) -> ModelRunner:
            if id(runner) not in views:
                views[id(runner)] = runner.compile_view()
            return views[id(runner)]

        try:
            self._warm_compiled(view, chains=False)
        except Exception:
            logger.exception("compiling the forwards failed: serving with the eager ones")
            self.compile_state = "failed"
            return
        logger.info("compiled forwards ready after %.1fs: swapping them in", time.perf_counter() - t0)
        self.compile_state = "ready"
        # Then the draft's chain graphs (most of its compile time): until each is ready, its chains run
        # one compiled forward a level; each is used from the step after it is.
        if self.proposer is not None:
            try:
                warmed = self.proposer.warm_chains(view)
            except Exception:  # (those compiled before the failure are in use: their timings settle by themselves)
                logger.exception("compiling the draft's chains failed: their levels run one forward each")
                return
            if warmed:
                self.chains_warmed = True
                logger.info("compiled draft chains ready after %.1fs", time.perf_counter() - t0)

    def swap_in_compiled(self) -> None:
        """Between two steps: serve the compiled forwards once the background compile has them ready."""
        if self.compile_state == "ready":
            for runner in self._runners():
                runner.use_compiled()
            self.compile_state = "on"
            if self.controller is not None:  # its timings were the eager forwards', under the compiler's load
                self.controller.forwards_changed()
        if self.chains_warmed and self.compile_state == "on":
            self.chains_warmed = False  # the draft's levels now cost a fused chain's share, not a forward's
            if self.controller is not None:
                self.controller.forwards_changed()

    @property
    def spec_method(self) -> str:
        return self.proposer.method if self.proposer is not None else "none"

    @property
    def spec_stats(self):
        return self.step_runner.stats

    # -- requests ---------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            self.check_text_fits(prompt)
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def check_text_fits(self, text: str) -> None:
        """Refuse, before tokenizing it, a text too long for the context (:class:`TextFit`)."""
        self._text_fit.check(text)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError if this request cannot be served as asked."""
        self.limits.check(prompt_ids, params)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        checked: bool = False,
    ) -> None:
        """Queue a request. ``checked``: ``prompt`` is token ids that :meth:`validate` passed with these
        ``params`` already (the server's requests, checked once before they were queued)."""
        if request_id in self.groups:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        if params.lora is not None and (self.adapters is None or not self.adapters.is_known(params.lora)):
            raise InvalidRequestError(f"no LoRA adapter named {params.lora!r} is loaded")
        if checked:  # a cheap net under the promise: ids, and in the vocabulary (the model indexes with them)
            if isinstance(prompt, str) or not prompt or min(prompt) < 0 or max(prompt) >= self.vocab_size:
                raise InvalidRequestError("checked prompts are non-empty token ids within the vocabulary")
            prompt_ids = list(prompt)
        else:
            prompt_ids = self.tokenize(prompt)
            self.validate(prompt_ids, params)
        group = SequenceGroup(
            request_id,
            prompt_ids,
            params,
            time.monotonic() if arrival_time is None else arrival_time,
            prompt if isinstance(prompt, str) else None,
        )
        tenant = params.tenant if self.config.prefix_cache_scope == "api-key" else None
        if params.lora is not None or params.cache_salt is not None or tenant is not None:
            namespace = None if params.lora is None else self.adapters.kv_namespace(params.lora)
            group.kv_root = chain_root(namespace, params.cache_salt, tenant)
        if params.use_beam_search:
            group.beam = BeamState()
        seq = group.seqs[0]
        if params.contrastive_search:
            seq.search = SearchState()
        if params.structured is not None:  # GrammarError: an invalid spec
            left = seq.tokens_left(self.max_model_len) if params.close_at_max_tokens else None
            seq.grammar = self.grammars.start(params.structured, left)
        self._init_seq(seq, seed_offset=0)
        self.groups[request_id] = group
        if params.lora is not None:  # it holds its adapter from now; a step schedules it once the adapter
            self.adapters.wait(params.lora)  # has a slot (_admit_lora_queue)
            self.lora_queue.append(seq)
        else:
            self.scheduler.add(seq)

    def _init_seq(self, seq: Sequence, seed_offset: int) -> None:
        self.outputs.init_sequence(seq)
        if seq.params.seed is not None:  # choice i of an n > 1 request samples with seed + i, in 64 bits
            seq.seed = (seq.params.seed + seed_offset) % 2**64

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks. False if it is unknown or already done."""
        group = self.groups.get(request_id)
        if group is None:
            return False
        self._drop_group(group)
        for seq in group.seqs:
            if not seq.is_finished:
                self._finish_seq(seq)
                seq.finish_reason = FinishReason.ABORT
        return True

    def _finish_seq(self, seq: Sequence) -> None:
        if seq in self.lora_queue:  # never scheduled (its adapter had no slot yet): nothing to free
            self.lora_queue.remove(seq)
            self.adapters.unwait(seq.params.lora)
            seq.status = SequenceStatus.FINISHED
            return
        self.scheduler.finish(seq)
        self.step_runner.forget(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    @property
    def num_requests_running(self) -> int:
        return len({s.group.request_id for s in self.scheduler.running})

    @property
    def num_requests_waiting(self) -> int:
        waiting = {s.group.request_id for s in (*self.scheduler.waiting, *self.lora_queue)}
        return len(waiting - {s.group.request_id for s in self.scheduler.running})

    # -- the step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step. A failure is confined to the requests it concerns: an exception in one
        request's own work (its strategy, grammar, logprobs, stop checks, detokenizing:
        engine/request/confine.py) fails that request alone and the rest of the step commits; one in
        the step's shared work (the schedule, the batched forward) fails the requests of that step.
        The engine keeps serving the rest."""
        self.swap_in_compiled()
        outs = self._admit_lora_queue() if self.lora_queue else []
        if self.ahead is not None and self.ahead.pending is not None:
            return outs + self._step_ahead()
        try:
            emits, prompt_seqs = self.step_runner.run()
        except Exception as e:
            return outs + self._step_failed(e)
        if not emits and not prompt_seqs and not self.confine.failed:
            return outs
        self.scheduler.regrow()
        self.num_steps += 1
        touched = {seq.group.request_id: seq.group for seq in prompt_seqs}
        self._hand_out(emits, touched)
        outs += self._outputs(touched)
        if self.ahead is not None:
            outs += self._start_ahead()
        return outs

    def _step_failed(self, e: Exception) -> list[RequestOutput]:
        self.step_runner.next_plan = None  # (planned for sequences this failure may preempt)
        outs = self._outputs({})  # requests that failed alone before the step did
        if is_out_of_memory(e) and self.step_runner.scheduled:
            return outs + self._shrink_after_oom(e)
        failed = {seq.group.request_id: seq.group for seq in self.step_runner.scheduled}
        if not failed:
            raise e  # it failed before any request was in it: not a request's fault
        logger.exception("engine step failed; failing the %d requests in it", len(failed), exc_info=e)
        return outs + [self._fail_group(g, f"{type(e).__name__}: {e}") for g in failed.values() if g.error is None]

    def _hand_out(self, emits: list[Emit], touched: dict[str, SequenceGroup]) -> None:
        """Append each emit's tokens to its sequence (stop checks, detokenizing) and note its request."""
        now = time.monotonic()
        for e in emits:
            seq, group = e.seq, e.seq.group
            if group.error is not None:  # it failed alone inside the step: reported with the others
                continue
            group.num_decode_steps += 1
            self.confine.run(group, self._append, seq, e)
            if group.first_token_time is None:
                group.first_token_time = now
            touched[group.request_id] = group

    def _append(self, seq: Sequence, e: Emit) -> None:
        self.outputs.append(seq, e.tokens, e.logprobs, e.provenance)
        if not seq.is_finished:
            self.block_manager.commit(
                seq.block_table, seq.block_hashes, seq.token_ids, seq.num_computed_tokens, seq.kv_root
            )

    def _outputs(self, touched: dict[str, SequenceGroup]) -> list[RequestOutput]:
        """The outputs of the requests a step touched, and the final ones of those that failed alone in it
        (engine/request/confine.py), ended now: their blocks freed once. Making an output (its text) is
        a request's own work too: one that raises fails that request."""
        outs = []
        for group in touched.values():
            if group.error is None and (out := self.confine.run(group, self._make_output, group)) is not None:
                outs.append(out)
        for group in self.confine.take():
            if group.request_id in self.groups:
                outs.append(self._fail_group(group, group.error))
        return outs

    # -- run-ahead decoding (engine/core/ahead.py) -----------------------------------------------------
    def _start_ahead(self) -> list[RequestOutput]:
        """After an ordinary step whose sequences all decode plainly: launch the next forward, unread."""
        seqs = self.ahead.startable()
        if seqs is None:
            return []
        self.step_runner.scheduled = seqs
        try:
            if not self._plans_plain(ahead=0):
                return []
            pending = self.ahead.launch(seqs, None)
        except Exception as e:
            return self._step_failed(e)
        if pending is not None:
            self.step_runner.next_plan = None
            self._computed_ahead(pending.seqs)
            self.ahead.pending = pending
        return []

    def _step_ahead(self) -> list[RequestOutput]:
        """A forward is pending: launch the next over the same sequences from its tokens on the device
        if the batch is the same again, then read the pending tokens and hand them out (else: drain)."""
        t0 = time.perf_counter()
        pending, self.ahead.pending = self.ahead.pending, None
        self.step_runner.scheduled = [s for s in pending.seqs if s.status is SequenceStatus.RUNNING]
        try:
            steady = self.ahead.steady(pending) and self._plans_plain(ahead=1)
            following = self.ahead.launch(pending.seqs, pending.tokens) if steady else None
            if following is not None:
                self.step_runner.next_plan = None
            tokens = pending.ticket.tolist()
        except Exception as e:
            return self._step_failed(e)
        self.scheduler.regrow()
        self.num_steps += 1
        emits = [Emit(s, [t]) for s, t in zip(pending.seqs, tokens) if s.status is SequenceStatus.RUNNING]
        if self.controller is not None and following is not None and emits:
            # (A step that drains launched nothing: its time is the read's alone, the forward's was
            # the step before's. On a CPU, where launching is computing, a step ahead's time is that
            # of the forward it launched: one forward a token over a run of steps ahead.)
            self.controller.observe_ahead([e.seq for e in emits], time.perf_counter() - t0)
        touched: dict[str, SequenceGroup] = {}
        self._hand_out(emits, touched)
        live = [s for s in following.seqs if s.status is SequenceStatus.RUNNING] if following is not None else []
        if live:  # (a forward ahead of sequences that all ended is dropped unread)
            self._computed_ahead(live)
            self.ahead.pending = following
        return self._outputs(touched)

    def _plans_plain(self, ahead: int) -> bool:
        """Whether the controller, if any, drafts nothing in the step after the running sequences'
        ``ahead`` tokens on the device: then that step may run ahead. The plan is kept for that step
        (``Step.next_plan``) until a forward is launched on it: a plan that drafts, or one whose launch
        finds no KV slots, runs as an ordinary step on it. Each step is planned once."""
        if self.controller is None:
            return True
        return not self.step_runner.plan_ahead(ahead)

    def _computed_ahead(self, seqs: list[Sequence]) -> None:
        """A forward ahead computed each one's last known token (its own token is still on the device)."""
        for seq in seqs:
            seq.num_computed_tokens += 1
            self.block_manager.commit(
                seq.block_table, seq.block_hashes, seq.token_ids, seq.num_computed_tokens, seq.kv_root
            )

    def _shrink_after_oom(self, error: Exception) -> list[RequestOutput]:
        """A forward ran out of memory. Nothing of that step is kept: its sequences are preempted
        (recomputed later from their tokens) and steps shrink until they fit (``Scheduler.shrink``;
        they grow back after steps that do). Only a lone sequence that does not fit the smallest
        step fails, alone; the engine itself never fails for it."""
        seqs = [s for s in self.step_runner.scheduled if s.status is SequenceStatus.RUNNING]
        if not self.scheduler.shrink(len(seqs), self.config.block_size):
            logger.error("out of memory with one sequence in the smallest step: failing it (%s)", error)
            return [self._fail_group(seqs[0].group, f"out of memory: {error}")] if seqs else []
        for seq in reversed(seqs):
            self.step_runner.preempt(seq)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        logger.warning("out of memory: preempted the step's %d sequences and halved the step", len(seqs))
        return []

    def fail_requests(self, request_ids: list[str], error: str) -> list[RequestOutput]:
        """End these requests from outside the step (the front's verdict on a step that raised): each
        is aborted, its blocks freed, and gets a final output with ``error`` and finish reason error."""
        outs = []
        for request_id in request_ids:
            group = self.groups.get(request_id)
            if group is None:
                continue
            self.abort(request_id)
            outs.append(self._error_output(group, error))
        return outs

    @staticmethod
    def _error_output(group: SequenceGroup, error: str) -> RequestOutput:
        """A failed request's final output: its error, and no text (a stream has had what it had)."""
        return RequestOutput(
            group.request_id,
            group.prompt_ids,
            [CompletionOutput(s.index, "", "", [], None, s.num_output_tokens, "error") for s in group.seqs],
            True,
            RequestStats(arrival_time=group.arrival_time, num_prompt_tokens=group.num_prompt_tokens),
            error=error,
        )

    def requests_in_step(self) -> list[str]:
        """The requests the last step scheduled (those a failure of it concerns)."""
        in_step = {seq.group.request_id for seq in self.step_runner.scheduled}
        return [r for r in self.groups if r in in_step]

    def _fail_group(self, group: SequenceGroup, error: str) -> RequestOutput:
        """End a request that failed inside the engine, with its final output: its blocks are freed at once,
        those of every sequence of it the scheduler holds (one that failed mid-way through a beam step may
        hold forks not yet among ``group.seqs``)."""
        group.error = error
        held = [s for s in (*self.scheduler.running, *self.scheduler.waiting) if s.group is group]
        for seq in [*group.seqs, *held]:
            if not seq.is_finished:
                self._finish_seq(seq)
                seq.finish_reason = FinishReason.ERROR
        self._drop_group(group)
        return self._error_output(group, error)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Fork the other n - 1 choices of ``parent``'s request (the step runs it confined: if it raises,
        the request fails alone, and the children forked already end with it)."""
        group, children = parent.group, []
        for i in range(1, group.params.n):
            children.append(self._fork_one(parent, i))
            group.seqs.append(children[-1])
        return children

    def _fork_one(self, parent: Sequence, index: int | None = None) -> Sequence:
        """A new sequence of ``parent``'s request with its tokens, sharing its KV blocks (copy-on-write)
        and its penalty counts; it runs beside it, or waits (``parent`` was preempted, or a choice
        beyond the seats its request held: ``Scheduler.add_forked``). The caller puts it in ``group.seqs``."""
        child = Sequence(parent.group, parent.prompt_ids, index=parent.index if index is None else index)
        child.token_ids = list(parent.token_ids)
        child.block_table = self.block_manager.fork(parent.block_table)
        try:
            child.block_hashes = list(parent.block_hashes)
            child.num_computed_tokens = parent.num_computed_tokens
            self._init_seq(child, seed_offset=child.index)
            child.detok = parent.detok.fork()
            if parent.grammar is not None:
                child.grammar = parent.grammar.copy()
            if parent.token_counts is not None:
                child.token_counts, child.prompt_mask = parent.token_counts.clone(), parent.prompt_mask
            if self.proposer is not None:
                self.proposer.on_fork(parent, child)
        except Exception:
            self.block_manager.free(child.block_table)  # its shared references, not yet anyone's
            raise
        self.scheduler.add_forked(child, parent)
        return child

    def _make_output(self, group: SequenceGroup) -> RequestOutput:
        out = self.outputs.make_output(group)
        if out.finished:
            self._drop_group(group)
        return out

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
        acc: dict[tuple[str, int], tuple[list[int], list[TokenLogprob], list]] = {}
        while any(rid not in final for rid in ids):
            if not self.has_unfinished_requests():
                raise RuntimeError("requests vanished without finishing")
            for o in self.step():
                for c in o.outputs:
                    toks, lps, prov = acc.setdefault((o.request_id, c.index), ([], [], []))
                    toks.extend(c.delta_token_ids)
                    lps.extend(c.delta_logprobs or [])
                    prov.extend(c.delta_provenance or [])
                if o.finished:
                    final[o.request_id] = o
        for rid, o in final.items():
            for c in o.outputs:
                c.delta_token_ids, lps, prov = acc.get((rid, c.index), ([], [], []))
                c.delta_logprobs = lps if c.delta_logprobs is not None else None
                c.delta_provenance = prov if c.delta_provenance is not None else None
                c.delta_text = c.text
        return [final[rid] for rid in ids]
