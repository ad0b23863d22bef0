"""An asyncio front for :class:`LLMEngine`.

The step loop runs on its own thread, off the event loop, so handlers stay responsive while the
model computes. Handlers talk to it only through this class: read-only views and checks (the
tokenizer, the limits, :meth:`AsyncEngine.prepare`, :meth:`AsyncEngine.render_chat`) and a command
queue (add / abort), and each request gets an async stream of :class:`RequestOutput`. Closing that
stream early (a client disconnect) aborts the request; the loop applies aborts before its next step,
so the KV blocks come back within one engine step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import queue
import threading
import time
import traceback
from collections.abc import AsyncIterator
from dataclasses import dataclass

import jinja2

from engine.core.llm_engine import LLMEngine
from engine.request.checks import InvalidRequestError
from engine.request.outputs import CompletionOutput, RequestOutput, RequestStats
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


@dataclass(frozen=True)
class CacheInfo:
    """The KV cache's shape, for the metrics that describe it (vLLM's ``cache_config_info``)."""

    block_size: int
    num_blocks: int
    dtype: str  # e.g. "float32", "bfloat16"
    prefix_caching: bool


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()  # guards _streams
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead_error: str | None = None
        self.step_hooks: list = []  # callables(outputs, step_seconds), run on the loop thread
        self._unstarted: dict[
            str, float
        ] = {}  # admitted, no output yet (→ admission time): what --max-queue-len bounds
        self._consecutive_failures = 0
        self.load = EngineLoad()
        # Grammars compile here, two at a time at most, whatever the requests ask.
        self._grammar_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="augur-grammar")

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

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    # -- what handlers need of the engine ---------------------------------------------------------------
    # Read-only views and checks, safe from any thread: the tokenizer and the limits never change.
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.engine.tokenizer, "chat_template", None))

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

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
        e = self.engine
        dtype = str(e.dtype).removeprefix("torch.")
        return CacheInfo(e.config.block_size, e.block_manager.num_blocks, dtype, e.config.enable_prefix_caching)

    def prepare(self, prompts: list[str | list[int]], params: SamplingParams) -> list[list[int]]:
        """Each prompt tokenized and checked against the engine's limits: the one check a request gets
        (InvalidRequestError says why it cannot be served). :meth:`generate` takes what this returns."""
        ids = []
        for p in prompts:
            tokens = self.engine.tokenize(p)
            self.engine.validate(tokens, params)
            ids.append(tokens)
        return ids

    async def compile_grammar(self, so: StructuredOutput, timeout: float = GRAMMAR_COMPILE_SECONDS) -> None:
        """Compile a request's structured-output spec into the engine's grammar cache, on a worker
        thread (llguidance drops the GIL while it builds), so that the engine thread only copies it.
        Raises GrammarError (an invalid spec, or one that takes longer than ``timeout`` to compile:
        its build is bounded by llguidance's limits and finishes on its thread, into the cache)."""
        future = asyncio.get_running_loop().run_in_executor(self._grammar_pool, self.engine.grammars.compile, so)
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            raise GrammarError(f"the {so.kind} took longer than {timeout:g} s to compile", so.param) from None

    @property
    def chat_template(self) -> str | None:
        return getattr(self.engine.tokenizer, "chat_template", None)

    @property
    def chat_template_takes_tools(self) -> bool:
        """The template renders a ``tools`` list (and tool calls and results in the history)."""
        return "tools" in (self.chat_template or "")

    def render_chat(
        self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None
    ) -> list[int]:
        """Chat messages (and the offered ``tools``, for a template that takes them) through the
        model's chat template, as token ids; a text that cannot fit the context is refused before it
        is tokenized (InvalidRequestError)."""
        tok = self.engine.tokenizer
        kw = {"tools": tools} if tools else {}
        try:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kw)
        except jinja2.TemplateError as e:  # the template's own checks (roles that must alternate, ...)
            raise InvalidRequestError(f"the model's chat template refused these messages: {e}", "messages") from None
        self.engine.check_text_fits(text)
        return tok.encode(text, add_special_tokens=False)

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
        self._commands.put(_Add(request_id, prompt_ids, params, time.monotonic()))
        self._wakeup.set()
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
        self._commands.put(_Abort(request_id))
        self._wakeup.set()

    # -- the loop thread ----------------------------------------------------------------------------
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
            with self._lock:
                wanted = cmd.request_id in self._streams
            if not wanted:  # the client left before the request reached the engine
                continue
            try:
                self.engine.add_request(cmd.request_id, cmd.prompt_ids, cmd.params, cmd.arrival_time, checked=True)
            except Exception as e:  # prepared already; anything here is confined to this request
                self._deliver(cmd.request_id, e)

    def _publish_load(self) -> None:
        e = self.engine
        s = e.scheduler
        self.load = EngineLoad(
            e.num_requests_running,
            e.num_requests_waiting,
            e.block_manager.usage,
            s.prefix_queries,
            s.prefix_hits,
            s.num_preemptions,
        )

    def _run(self) -> None:
        while not self._stopping:
            self._drain_commands()
            self._publish_load()
            if not self.engine.has_unfinished_requests():
                self.engine.swap_in_compiled()  # (a step does it too, when busy)
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            t0 = time.perf_counter()
            try:
                outputs = self.engine.step()
                self._consecutive_failures = 0
            except Exception:
                # The engine confines ordinary failures to their requests; reaching here is a bug in
                # the step itself. Fail what is in flight; after repeated failures declare it dead.
                self._consecutive_failures += 1
                self._fail_step(traceback.format_exc())
                if self._consecutive_failures >= 3:
                    self._die("the engine failed 3 steps in a row")
                    return
                continue
            self._publish_load()
            elapsed = time.perf_counter() - t0
            self._deliver_all([(out.request_id, out) for out in outputs])
            for hook in self.step_hooks:
                try:
                    hook(outputs, elapsed)
                except Exception:
                    logger.exception("step hook failed")

    def _fail_step(self, tb: str) -> None:
        """A step raised outside the engine's own confinement: fail the requests that were in it
        (none if it failed before scheduling anyone), keep serving the rest."""
        logger.error("engine step failed; failing its requests:\n%s", tb)
        in_step = {seq.group.request_id for seq in self.engine.step_runner.scheduled}
        self._fail_requests([r for r in self.engine.groups if r in in_step], tb.strip().splitlines()[-1])

    def _die(self, reason: str) -> None:
        """Stop serving: every request in the engine fails, every waiting stream gets the error, and
        no new request is taken (``generate`` checks ``dead_error`` under the same lock)."""
        logger.error(reason)
        self._fail_requests(list(self.engine.groups), reason)
        with self._lock:
            self.dead_error = reason
            targets = list(self._streams.items())
        for _, (loop, stream) in targets:
            loop.call_soon_threadsafe(stream.put_nowait, EngineDeadError(reason))

    def _fail_requests(self, request_ids: list[str], error: str) -> None:
        for request_id in request_ids:
            group = self.engine.groups[request_id]
            self.engine.abort(request_id)
            err = RequestOutput(
                request_id,
                group.prompt_ids,
                [CompletionOutput(s.index, "", "", [], None, s.num_output_tokens, "error") for s in group.seqs],
                True,
                RequestStats(arrival_time=group.arrival_time, num_prompt_tokens=group.num_prompt_tokens),
                error=error,
            )
            self._deliver(request_id, err)


def _put_all(puts: list[tuple[asyncio.Queue, object]]) -> None:
    for stream, item in puts:
        stream.put_nowait(item)
