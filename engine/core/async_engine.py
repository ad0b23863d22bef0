"""An asyncio front for :class:`LLMEngine`.

Handlers talk to the engine only through a front: read-only views and checks (the tokenizer, the
limits, :meth:`EngineFront.prepare`, :meth:`EngineFront.render_chat`), commands (add / abort) and, per
request, an async stream of :class:`RequestOutput`. Closing that stream early (a client disconnect)
aborts the request; the engine applies aborts before its next step, so the KV blocks come back
within one engine step.

Two fronts share this class's streams and checks: :class:`AsyncEngine` runs the step loop on a
thread of this process, off the event loop; ``engine.core.engine_core.ProcessEngine`` runs it in a
process of its own (``--engine-process``).
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextvars
import itertools
import logging
import queue
import threading
import time
import traceback
from collections.abc import AsyncIterator
from dataclasses import dataclass

import jinja2

from engine.core.llm_engine import LLMEngine
from engine.lora import AdapterError
from engine.request.checks import InvalidRequestError, RequestLimits, TextFit
from engine.request.outputs import RequestOutput
from engine.request.sampling_params import SamplingParams
from engine.request.structured import StructuredOutput
from engine.structured import GrammarError

GRAMMAR_COMPILE_SECONDS = 10.0  # a structured-output spec that takes longer to compile is refused

logger = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Lora:
    """Load or unload a LoRA adapter on the engine's thread (``op``: ``load`` | ``unload``)."""

    call_id: int
    op: str
    name: str
    path: str | None = None


def run_lora(engine: LLMEngine, cmd: _Lora) -> BaseException | None:
    """Carry out ``cmd`` on ``engine``: None, or the error to hand back (AdapterError, KeyError)."""
    try:
        if cmd.op == "load":
            engine.load_lora_adapter(cmd.name, cmd.path)
        else:
            engine.unload_lora_adapter(cmd.name)
    except (ValueError, KeyError) as e:  # AdapterError is a ValueError
        return e
    except Exception as e:  # anything else a file can make a reader raise: the load's error, not the engine's
        return AdapterError(f"adapter {cmd.name!r} could not be loaded: {type(e).__name__}: {e}")
    return None


class EngineDeadError(RuntimeError):
    pass


@dataclass(frozen=True)
class EngineLoad:
    """The engine's load, published by its thread after each change: others read it without
    touching the scheduler's queues while that thread mutates them."""

    running: int = 0  # requests running
    waiting: int = 0  # requests waiting to run
    kv_usage: float = 0.0  # fraction of KV blocks in use
    # Cumulative since start: prompt tokens looked up in the prefix cache, those found, preemptions.
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    # LoRA adapters (engine/lora): those of running requests, those of waiting ones, and the slots
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()
    max_lora: int = 0


@dataclass(frozen=True)
class CacheInfo:
    """The KV cache's shape, for the metrics that describe it (vLLM's ``cache_config_info``)."""

    block_size: int
    num_blocks: int
    dtype: str  # e.g. "float32", "bfloat16"
    prefix_caching: bool


class EngineFront(abc.ABC):
    """What every front shares: the request streams, the queue bound, the checks a request gets
    before it is queued, and the engine's death. A subclass sets ``tokenizer``, ``limits`` and
    ``grammars`` (:meth:`_bind`) and sends the commands (:meth:`_submit`)."""

    def __init__(self) -> None:
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()  # guards _streams
        self.dead_error: str | None = None
        self.tensor_parallel_size = 1  # ranks the target is sharded over (set by a subclass)
        self.batch_invariant = False  # the engine's batch-invariant mode is in force (set by a subclass)
        self.step_hooks: list = []  # callables(outputs, step_seconds), run where the outputs arrive
        self._unstarted: dict[
            str, float
        ] = {}  # admitted, no output yet (→ admission time): what --max-queue-len bounds
        self.load = EngineLoad()
        self._calls: dict[int, concurrent.futures.Future] = {}  # LoRA loads and unloads awaiting the engine
        self._call_ids = itertools.count()
        # Grammars compile here, two at a time at most, whatever the requests ask.
        self._grammar_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="augur-grammar")

    def _bind(self, tokenizer, limits: RequestLimits, grammars, generation_defaults: dict | None = None) -> None:
        self.tokenizer = tokenizer
        self._generation_defaults = dict(generation_defaults or {})
        self.limits = limits
        self.grammars = grammars
        self._text_fit = TextFit(tokenizer, limits.max_model_len)

    @abc.abstractmethod
    def _submit(self, command: _Add | _Abort | _Lora) -> None:
        """Hand an add, an abort or a LoRA load to the engine (each front its own way)."""

    @property
    def num_unstarted(self) -> int:
        """Requests accepted but not yet producing output (queued or still prefilling)."""
        self._expire_reservations()
        return len(self._unstarted)

    def reserve(self, request_ids: list[str], limit: int) -> bool:
        """Count requests as waiting from now on, if that keeps the count within ``limit``. Called on
        the event loop before the handler's first await, so a burst cannot slip past the bound."""
        with self._lock:
            self._expire_reservations()
            if len(self._unstarted) + len(request_ids) > limit:
                return False
            now = time.monotonic()
            for rid in request_ids:
                self._unstarted[rid] = now
        return True

    def _expire_reservations(self, ttl: float = 60.0) -> None:
        """Forget reservations whose request never started streaming (its handler died early)."""
        now = time.monotonic()
        stale = [r for r, t in self._unstarted.items() if r not in self._streams and now - t > ttl]
        for r in stale:
            del self._unstarted[r]

    # -- what handlers need of the engine ---------------------------------------------------------------
    # Read-only views and checks, safe from any thread: the tokenizer and the limits never change.
    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.limits.vocab_size

    def prepare(self, prompts: list[str | list[int]], params: SamplingParams) -> list[list[int]]:
        """Each prompt tokenized and checked against the engine's limits: the one check a request gets
        (InvalidRequestError says why it cannot be served). :meth:`generate` takes what this returns."""
        ids = []
        for p in prompts:
            if isinstance(p, str):
                self._text_fit.check(p)
                tokens = self.tokenizer.encode(p)
            else:
                tokens = list(p)
            self.limits.check(tokens, params)
            ids.append(tokens)
        return ids

    async def compile_grammar(self, so: StructuredOutput, timeout: float = GRAMMAR_COMPILE_SECONDS) -> None:
        """Compile a request's structured-output spec into the grammar cache, on a worker thread
        (llguidance drops the GIL while it builds), so that the engine thread only copies it.
        Raises GrammarError (an invalid spec, or one that takes longer than ``timeout`` to compile:
        its build is bounded by llguidance's limits and finishes on its thread, into the cache)."""
        future = asyncio.get_running_loop().run_in_executor(self._grammar_pool, self.grammars.compile, so)
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            raise GrammarError(f"the {so.kind} took longer than {timeout:g} s to compile", so.param) from None

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)

    def use_chat_template(self, template: str) -> None:
        """Serve with ``template`` instead of the tokenizer's own (``--chat-template``): chat, the
        Responses API, ``/tokenize`` and ``/tokenizer_info`` all see it."""
        self.tokenizer.chat_template = template

    @property
    def chat_template_takes_tools(self) -> bool:
        """The template renders a ``tools`` list (and tool calls and results in the history)."""
        return "tools" in (self.chat_template or "")

    def render_chat_text(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
        template_kwargs: dict | None = None,
    ) -> str:
        """Chat messages (and the offered ``tools``, for a template that takes them) through the
        model's chat template, as text; ``template_kwargs`` are the template's own variables
        (``enable_thinking`` ...). A text that cannot fit the context is refused before it is
        tokenized (InvalidRequestError), as is one the template itself refuses."""
        kw = dict(template_kwargs or {})
        if tools:
            kw["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                **kw,
            )
        except jinja2.TemplateError as e:  # the template's own checks (roles that must alternate, ...)
            raise InvalidRequestError(f"the model's chat template refused these messages: {e}", "messages") from None
        except ValueError as e:  # transformers' own (nothing to continue, ...)
            raise InvalidRequestError(f"the chat template refused these messages: {e}", "messages") from None
        self._text_fit.check(text)
        return text

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    **kw) -> list[int]:  # fmt: skip
        """:meth:`render_chat_text` as token ids."""
        text = self.render_chat_text(messages, add_generation_prompt, tools, **kw)
        return self.tokenizer.encode(text, add_special_tokens=False)

    @property
    def generation_config(self) -> dict:
        """The model's ``generation_config.json`` sampling defaults (``temperature``, ``top_p``,
        ``top_k``, ``min_p``, ``repetition_penalty``, ``max_tokens``), those it sets."""
        return dict(self._generation_defaults)

    # -- requests -----------------------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs until it finishes; leaving the loop early aborts the request.
        ``prompt_ids`` come from :meth:`prepare` with these ``params`` (checked there, not again)."""
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        with self._lock:
            # Checked again under the lock the dying loop thread takes to fail every stream: a
            # request either sees the death here or is among the streams that get its error.
            if self.dead_error is not None:
                raise EngineDeadError(self.dead_error)
            if request_id in self._streams:
                raise ValueError(f"duplicate request id {request_id!r}")
            self._streams[request_id] = (loop, stream)
            self._unstarted.setdefault(request_id, time.monotonic())
        self._submit(_Add(request_id, prompt_ids, params, time.monotonic()))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                self._unstarted.pop(request_id, None)
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
                self._unstarted.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._submit(_Abort(request_id))

    async def lora(self, op: str, name: str, path: str | None = None) -> None:
        """Load (``op="load"``, from ``path``) or unload a LoRA adapter, between two of the engine's steps;
        raises what the engine raised (AdapterError: the adapter cannot be served; KeyError: none of
        that name is loaded)."""
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        future: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._call_ids)
        with self._lock:
            self._calls[call_id] = future
        try:
            self._submit(_Lora(call_id, op, name, path))
        except BaseException:
            with self._lock:
                self._calls.pop(call_id, None)
            raise
        await asyncio.wrap_future(future)

    def _answer(self, call_id: int, error: BaseException | None) -> None:
        with self._lock:
            future = self._calls.pop(call_id, None)
        if future is not None and not future.done():
            future.set_result(None) if error is None else future.set_exception(error)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand items to their requests' streams with one wake-up per event loop: each wake-up writes to
        the loop's self-pipe, and after it the engine thread waits for the interpreter lock while the
        loop runs (a step's outputs one wake-up each cost ~0.2 ms a token at c = 1: docs/benchmarks.md)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for request_id, item in items:
                target = self._streams.get(request_id)
                if target is not None:
                    loop, stream = target
                    by_loop.setdefault(loop, []).append((stream, item))
        for loop, puts in by_loop.items():
            loop.call_soon_threadsafe(_put_all, puts)

    def _fail_streams(self, reason: str) -> None:
        """The engine is dead: no new request is taken (``generate`` checks ``dead_error`` under the
        same lock) and every waiting stream gets the error."""
        with self._lock:
            self.dead_error = reason
            targets = list(self._streams.items())
        for _, (loop, stream) in targets:
            loop.call_soon_threadsafe(stream.put_nowait, EngineDeadError(reason))
        self._fail_calls(reason)

    def _fail_calls(self, reason: str) -> None:
        """Answer every LoRA load or unload still waiting for the engine: it will not come."""
        with self._lock:
            calls, self._calls = list(self._calls.values()), {}
        for future in calls:
            if not future.done():
                future.set_exception(EngineDeadError(reason))

    def _run_hooks(self, outputs: list[RequestOutput], elapsed: float) -> None:
        for hook in self.step_hooks:
            try:
                hook(outputs, elapsed)
            except Exception:
                logger.exception("step hook failed")


class GuardedStep:
    """One engine step under the fronts' failure policy. The engine confines ordinary failures to
    their requests; a step that raises anyway is a bug in the step itself: the requests it held fail
    (none if it failed before scheduling anyone) and the rest keep being served, until ``limit``
    steps in a row have failed and the engine is declared dead (every request in it fails)."""

    def __init__(self, engine: LLMEngine, limit: int = 3) -> None:
        self.engine, self.limit, self.failures = engine, limit, 0

    def __call__(self) -> tuple[list[RequestOutput], float | None, str | None]:
        """(outputs, seconds, death): a step's outputs and seconds; or, after a failure, the failed
        requests' final outputs, None, and why the engine is dead if it now is."""
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception:
            self.failures += 1
            tb = traceback.format_exc()
            logger.error("engine step failed; failing its requests:\n%s", tb)
            failed = self.engine.fail_requests(self.engine.requests_in_step(), tb.strip().splitlines()[-1])
            if self.failures < self.limit:
                return failed, None, None
            death = f"the engine failed {self.limit} steps in a row"
            logger.error(death)
            return failed + self.engine.fail_requests(list(self.engine.groups), death), None, death
        self.failures = 0
        return outputs, time.perf_counter() - t0, None


class AsyncEngine(EngineFront):
    """The front whose engine steps on a thread of this process."""

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__()
        self.engine = engine
        self.tensor_parallel_size = engine.config.tensor_parallel_size
        self.batch_invariant = engine.batch_invariant
        self._bind(engine.tokenizer, engine.limits, engine.grammars, engine.generation_defaults)
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._step = GuardedStep(engine)

    def _submit(self, command: _Add | _Abort | _Lora) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            # The step runs in a copy of this thread's context (where the engine was built, as a rule):
            # torch keeps its compile settings in context variables, and compiled forwards are guarded
            # under them.
            context = contextvars.copy_context()
            self._thread = threading.Thread(target=context.run, args=(self._run,), name="augur-engine", daemon=True)
            self._thread.start()
            self.engine.compile_in_background()

    @property
    def compile_state(self) -> str:
        """off, pending (serving eagerly while the forwards compile), on, or failed (serving eagerly)."""
        state = self.engine.compile_state
        return "pending" if state == "ready" else state

    def shutdown(self) -> None:
        self._stopping = True
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        self._commands.put(None)
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self._fail_calls("the engine was shut down")
        self.engine.close()  # its tensor-parallel workers, if any

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    # -- the engine's state, read where it changes --------------------------------------------------------
    @property
    def spec_method(self) -> str:
        return self.engine.spec_method

    @property
    def grammar_stats(self) -> tuple[int, int, int]:
        """Cumulative (drafted, cut by the grammar, forced) tokens of constrained requests; read on the
        engine thread (a step hook)."""
        c = self.engine.step_runner.constraints
        return c.drafted_tokens, c.cut_tokens, c.forced_tokens

    @property
    def spec_stats(self):
        """Cumulative drafting statistics (:class:`~engine.speculative.stats.SpecStats`); read them on
        the engine thread (a step hook), where they change."""
        return self.engine.spec_stats

    @property
    def cache_info(self) -> CacheInfo:
        return cache_info(self.engine)

    # -- the loop thread ----------------------------------------------------------------------------
    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd is None:
                continue
            if isinstance(cmd, _Abort):
                self.engine.abort(cmd.request_id)
                continue
            if isinstance(cmd, _Lora):
                self._answer(cmd.call_id, run_lora(self.engine, cmd))
                continue
            with self._lock:
                wanted = cmd.request_id in self._streams
            if not wanted:  # the client left before the request reached the engine
                continue
            try:
                self.engine.add_request(cmd.request_id, cmd.prompt_ids, cmd.params, cmd.arrival_time, checked=True)
            except Exception as e:  # prepared already; anything here is confined to this request
                self._deliver(cmd.request_id, e)

    def _publish_load(self) -> None:
        self.load = engine_load(self.engine)

    def _run(self) -> None:
        while not self._stopping:
            self._drain_commands()
            self._publish_load()
            if not self.engine.has_unfinished_requests():
                self.engine.swap_in_compiled()  # (a step does it too, when busy)
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            outputs, elapsed, death = self._step()
            self._publish_load()
            self._deliver_all([(out.request_id, out) for out in outputs])
            if death is not None:
                self._fail_streams(death)
                return
            if elapsed is not None:
                self._run_hooks(outputs, elapsed)


def engine_load(engine: LLMEngine) -> EngineLoad:
    s = engine.scheduler
    lora: tuple = ((), (), 0)
    if engine.adapters is not None:
        running = {q.params.lora for q in s.running} - {None}
        waiting = {q.params.lora for q in (*s.waiting, *engine.lora_queue)} - {None}
        lora = (tuple(sorted(running)), tuple(sorted(waiting)), engine.config.max_loras)
    return EngineLoad(
        engine.num_requests_running,
        engine.num_requests_waiting,
        engine.block_manager.usage,
        s.prefix_queries,
        s.prefix_hits,
        s.num_preemptions,
        *lora,
    )


def cache_info(engine: LLMEngine) -> CacheInfo:
    dtype = str(engine.dtype).removeprefix("torch.")
    c = engine.config
    return CacheInfo(c.block_size, engine.block_manager.num_blocks, dtype, c.enable_prefix_caching)


def _put_all(puts: list[tuple[asyncio.Queue, object]]) -> None:
    for stream, item in puts:
        stream.put_nowait(item)
