"""The engine in a process of its own (``augur serve --engine-process``), as vLLM's v1 engine core.

The API process tokenizes, checks, streams and serves HTTP; the engine process runs a busy loop
(admit, step, publish) on token ids, and the two never contend for one interpreter lock. Between
them, two ZeroMQ PUSH/PULL sockets over Unix domain sockets in a private directory:

* API → engine: commands, pickled (an add carries the request's :class:`SamplingParams`), one per
  message: ``("add", request_id, prompt_ids, params, arrival_time)``, ``("abort", request_id)``,
  ``("lora", call_id, op, name, path)`` (a LoRA adapter loaded or unloaded), ``("shutdown",)``.
* engine → API: a kind frame and a payload. ``step``: the step's :class:`RequestOutput` list with
  the load, the step's seconds and the drafting and grammar counters, encoded with msgspec
  (0.7 µs to encode one request's output against pickle's 4.4 µs; docs/benchmarks.md); ``load``
  the same without outputs, when idle; ``ready`` (the engine's :class:`EngineInfo`), ``failed``
  (it could not be built), ``error`` (one request could not be added), ``lora`` (a load's or unload's
  answer: its call id and None or the error) and ``dead``, pickled.

Stop strings are still checked where the tokens are appended (the engine's output processor), so a
speculative step stops exactly where plain decoding would and frees the blocks in that step; the
outputs carry their text. ``arrival_time`` and every stats time are ``time.monotonic()``, one clock
for both processes (CLOCK_MONOTONIC).

On a CPU of three or more usable cores the engine process runs torch on one CPU fewer than the usable
ones (:func:`engine.platform.engine_process_threads`): the API process's work then runs beside the
forward instead of stalling one of its OpenMP threads. On two, the engine takes both (measured faster).

Failure paths: an engine that cannot be built answers ``failed`` (the server's load failure); a step
that raises fails its requests, three in a row kill the engine (``dead``: every stream gets
:class:`EngineDeadError`); an engine process that dies without a word (killed, a segfault) is seen
by the API's receiver within a second; an API process that dies takes the engine process with it
(the engine polls its parent's sentinel). Back-pressure: ``--max-queue-len`` is counted in the API
process as before; the output socket's high-water mark blocks the engine if the API stops reading.
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import pickle
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass

import msgspec
import zmq

from engine.config import EngineConfig
from engine.core.async_engine import (
    CacheInfo,
    EngineDeadError,
    EngineFront,
    EngineLoad,
    GuardedStep,
    _Abort,
    _Add,
    _Lora,
    cache_info,
    engine_load,
    run_lora,
)
from engine.request.checks import RequestLimits
from engine.request.outputs import RequestOutput
from engine.speculative.stats import SpecStats
from engine.structured import GrammarError, Grammars

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 1000  # an idle engine wakes this often (to swap compiled forwards in, to see its parent)
GRAMMAR_POLL_MS = 5  # ... and this often while a request waits for its grammar
STARTUP_TIMEOUT_S = 3600.0  # a model's load, compile and capture


@dataclass(frozen=True)
class EngineInfo:
    """What the API process needs of a built engine, sent once when it is ready."""

    limits: RequestLimits
    spec_method: str
    cache: CacheInfo
    eos_token_ids: list[int]
    grammar_cache_size: int
    compile_state: str
    spec_depth: int
    batch_invariant: bool = False  # a request's tokens depend on nothing but the request


class StepMessage(msgspec.Struct, array_like=True):
    outputs: list[RequestOutput]
    load: EngineLoad
    seconds: float
    spec: tuple[int, int, int, list[int]]  # drafts, draft tokens, accepted tokens, accepted per position
    grammar: tuple[int, int, int]  # drafted, cut, forced tokens of constrained requests
    compile_state: str
    spec_by: dict[str, list[int]]  # proposer → drafts, draft tokens, accepted tokens


_ENCODER = msgspec.msgpack.Encoder()
_STEP_DECODER = msgspec.msgpack.Decoder(StepMessage)


# -- the engine process ---------------------------------------------------------------------------------
class EngineCore:
    """The busy loop: admit, step, publish. Runs in the engine process (:func:`run_engine_core`)."""

    def __init__(self, engine, commands: zmq.Socket, outputs: zmq.Socket, parent_sentinel: int | None) -> None:
        self.engine = engine
        self.commands, self.outputs = commands, outputs
        self.poller = zmq.Poller()
        self.poller.register(commands, zmq.POLLIN)
        self.parent_sentinel = parent_sentinel
        if parent_sentinel is not None:
            self.poller.register(parent_sentinel, zmq.POLLIN)
        self.grammar_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="augur-grammar")
        self.compiling: list[tuple[_Add, concurrent.futures.Future]] = []  # adds waiting for their grammar
        self.aborted_early: set[str] = set()  # aborted while their grammar compiled
        self.step = GuardedStep(engine)
        self.stopping = False
        self.last_load: EngineLoad | None = None
        self.last_compile_state: str | None = None

    def run(self) -> None:
        while not self.stopping:
            busy = self.engine.has_unfinished_requests()
            timeout = 0 if busy else GRAMMAR_POLL_MS if self.compiling else IDLE_POLL_MS
            events = dict(self.poller.poll(timeout))
            if self.parent_sentinel is not None and self.parent_sentinel in events:
                logger.error("the API process is gone: the engine process exits")
                return
            if self.commands in events:
                self._drain()
            self._admit_compiled()
            if self.stopping:
                return
            if not self.engine.has_unfinished_requests():
                self.engine.swap_in_compiled()
                self._publish([], 0.0, force=False)
                continue
            outputs, seconds, death = self.step()
            self._publish(outputs, seconds or 0.0, force=bool(outputs) or seconds is None)
            if death is not None:
                self._send_pickled(b"dead", death)
                return

    def _drain(self) -> None:
        while True:
            try:
                msg = pickle.loads(self.commands.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            kind = msg[0]
            if kind == "add":
                self._add(_Add(*msg[1:]))
            elif kind == "abort":
                waits = any(cmd.request_id == msg[1] for cmd, _ in self.compiling)
                if not self.engine.abort(msg[1]) and waits:  # (else it finished already: nothing to do)
                    self.aborted_early.add(msg[1])
            elif kind == "lora":
                error = run_lora(self.engine, _Lora(*msg[1:]))
                self._send_pickled(b"lora", (msg[1], None if error is None else _picklable(error)))
            elif kind == "shutdown":
                self.stopping = True
                return

    def _add(self, cmd: _Add) -> None:
        so = cmd.params.structured
        if so is not None:  # compiled off the loop (the API process checked the spec already)
            self.compiling.append((cmd, self.grammar_pool.submit(self.engine.grammars.compile, so)))
            return
        self._add_now(cmd)

    def _add_now(self, cmd: _Add) -> None:
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt_ids, cmd.params, cmd.arrival_time, checked=True)
        except Exception as e:  # confined to this request
            self._send_pickled(b"error", (cmd.request_id, _picklable(e)))

    def _admit_compiled(self) -> None:
        if not self.compiling:
            return
        waiting = []
        for cmd, future in self.compiling:
            if not future.done():
                waiting.append((cmd, future))
            elif cmd.request_id in self.aborted_early:
                self.aborted_early.discard(cmd.request_id)
            elif future.exception() is not None:
                self._send_pickled(b"error", (cmd.request_id, _picklable(future.exception())))
            else:
                self._add_now(cmd)
        self.compiling = waiting

    def _publish(self, outputs: list[RequestOutput], seconds: float, force: bool = True) -> None:
        load = engine_load(self.engine)
        e = self.engine
        # An idle engine publishes what changed: its load, or its compiled forwards swapped in (the
        # API process's /health reads the state from these messages).
        if not force and not outputs and load == self.last_load and e.compile_state == self.last_compile_state:
            return
        self.last_load, self.last_compile_state = load, e.compile_state
        st = e.spec_stats
        c = e.step_runner.constraints
        msg = StepMessage(
            outputs, load, seconds,
            (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, list(st.accepted_per_pos)),
            (c.drafted_tokens, c.cut_tokens, c.forced_tokens),
            e.compile_state, st.by_method,
        )  # fmt: skip
        self.outputs.send_multipart([b"step" if outputs else b"load", _ENCODER.encode(msg)], copy=False)

    def _send_pickled(self, kind: bytes, payload) -> None:
        self.outputs.send_multipart([kind, pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)])


def _picklable(e: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def run_engine_core(config: EngineConfig, commands_addr: str, outputs_addr: str, log_level: int) -> None:
    """The engine process's body: build the engine, say ready (or why not), loop until told to stop."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [engine] %(name)s: %(message)s")
    # Ctrl-C and a process group's SIGTERM are the API process's to handle: it drains its streams and
    # then stops this process (or, dying, wakes its sentinel here).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctx = zmq.Context()
    outputs = ctx.socket(zmq.PUSH)
    outputs.connect(outputs_addr)
    commands = ctx.socket(zmq.PULL)
    commands.connect(commands_addr)
    try:
        import torch

        from engine.core.llm_engine import LLMEngine
        from engine.platform import engine_process_threads

        if config.torch_device.type == "cpu":
            torch.set_num_threads(engine_process_threads())
        engine = LLMEngine(config)
        engine.compile_in_background()
        info = EngineInfo(
            engine.limits, engine.spec_method, cache_info(engine), list(engine.eos_token_ids),
            config.grammar_cache_size, engine.compile_state, config.num_speculative_tokens, engine.batch_invariant,
        )  # fmt: skip
    except Exception as e:
        logger.exception("the engine could not be built")
        outputs.send_multipart([b"failed", pickle.dumps(f"{type(e).__name__}: {e}")])
        outputs.close(linger=5000)
        ctx.term()
        return
    outputs.send_multipart([b"ready", pickle.dumps(info)])
    if engine.workers is not None:  # a lost rank is the API's news before this process ends
        engine.workers.on_death.append(lambda reason: _tell_dead(outputs_addr, reason))
    parent = multiprocessing.parent_process()
    core = EngineCore(engine, commands, outputs, parent.sentinel if parent is not None else None)
    try:
        core.run()
    finally:
        engine.close()  # its tensor-parallel workers, if any
        core.grammar_pool.shutdown(wait=False, cancel_futures=True)
        outputs.close(linger=1000)
        commands.close(linger=0)
        ctx.term()


def _tell_dead(outputs_addr: str, reason: str) -> None:
    """Send ``dead`` from a thread other than the loop's, on a socket of its own (a socket is not
    thread-safe; the API's pull socket takes both), delivered before this returns: the process ends next."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(outputs_addr)
    sock.send_multipart([b"dead", pickle.dumps(reason)])
    sock.close(linger=2000)
    ctx.term()  # waits for the message to leave (up to the linger)


# -- the API process ------------------------------------------------------------------------------------
class ProcessEngine(EngineFront):
    """The front of an engine running in its own process. Building it starts that process and waits
    until the engine is ready (or raises why it could not be built)."""

    def __init__(self, config: EngineConfig, startup_timeout: float = STARTUP_TIMEOUT_S) -> None:
        super().__init__()
        from engine.runner.loader import generation_defaults, load_tokenizer, resolve_model_path

        self.config = config
        self.tensor_parallel_size = config.tensor_parallel_size
        self._dir = tempfile.mkdtemp(prefix="augur-engine-")
        self._ctx = zmq.Context()
        self._commands = self._ctx.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.SNDHWM, 0)  # commands queue without bound: a send blocks only with no engine
        self._commands.bind(f"ipc://{self._dir}/commands")
        self._outputs = self._ctx.socket(zmq.PULL)
        self._outputs.bind(f"ipc://{self._dir}/outputs")
        self._send_lock = threading.Lock()  # a ZeroMQ socket is not thread-safe
        spawn = multiprocessing.get_context("spawn")
        self.process = spawn.Process(
            target=run_engine_core, name="augur-engine-core",
            args=(config, f"ipc://{self._dir}/commands", f"ipc://{self._dir}/outputs", logging.getLogger().level),
        )  # fmt: skip
        self.process.start()
        self._receiver: threading.Thread | None = None
        self._stopping = False
        self._grammar = (0, 0, 0)
        try:
            tokenizer = load_tokenizer(resolve_model_path(config.tokenizer or config.model))
            self.info = self._wait_ready(startup_timeout)
        except BaseException:
            self._stop_process()
            raise
        self.spec_method = self.info.spec_method
        self.batch_invariant = self.info.batch_invariant
        self.cache_info = self.info.cache
        self._compile_state = self.info.compile_state
        self._spec = SpecStats(self.info.spec_depth)
        info = self.info
        grammars = Grammars(tokenizer, info.limits.vocab_size, info.eos_token_ids, info.grammar_cache_size)
        self._bind(tokenizer, info.limits, grammars, generation_defaults(resolve_model_path(config.model)))
        try:  # built now, as the engine builds its own: no first structured request waits for it
            grammars.tokenizer()
        except GrammarError as e:  # constrained requests get this as a 400
            logger.warning("%s", e)

    def _wait_ready(self, timeout: float) -> EngineInfo:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._outputs.poll(500):
                kind, payload = self._outputs.recv_multipart()
                if kind == b"ready":
                    return pickle.loads(payload)
                if kind == b"failed":
                    raise RuntimeError(pickle.loads(payload))
                raise RuntimeError(f"the engine process said {kind!r} before it was ready")
            if not self.process.is_alive():
                raise RuntimeError(f"the engine process exited while loading (exit code {self.process.exitcode})")
        raise TimeoutError(f"the engine process was not ready within {timeout:g} s")

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        if self._receiver is None:
            self._receiver = threading.Thread(target=self._receive, name="augur-engine-outputs", daemon=True)
            self._receiver.start()

    @property
    def compile_state(self) -> str:
        return "pending" if self._compile_state == "ready" else self._compile_state

    def shutdown(self) -> None:
        self._stopping = True
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        self._send(("shutdown",))
        if self._receiver is not None:
            self._receiver.join(timeout=5)
            self._receiver = None
        self._fail_calls("the engine was shut down")
        self._stop_process()

    def _stop_process(self) -> None:
        self.process.join(timeout=10)
        if self.process.is_alive():
            logger.warning("the engine process did not stop: killing it")
            self.process.kill()
            self.process.join(timeout=5)
        self._commands.close(linger=0)
        self._outputs.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def is_running(self) -> bool:
        alive = self._receiver is not None and self._receiver.is_alive() and self.process.is_alive()
        return alive and self.dead_error is None

    # -- the engine's state, as its last message had it ------------------------------------------------
    @property
    def spec_stats(self) -> SpecStats:
        return self._spec

    @property
    def grammar_stats(self) -> tuple[int, int, int]:
        return self._grammar

    # -- commands and outputs -------------------------------------------------------------------------
    def _submit(self, command: _Add | _Abort | _Lora) -> None:
        if isinstance(command, _Add):
            self._send(("add", command.request_id, command.prompt_ids, command.params, command.arrival_time))
        elif isinstance(command, _Lora):
            self._send(("lora", command.call_id, command.op, command.name, command.path))
        elif self.dead_error is None:
            self._send(("abort", command.request_id))

    def _send(self, msg: tuple) -> None:
        """Send a command without blocking: only an engine process that is gone (or not yet there)
        takes none, and then an add fails with EngineDeadError while an abort or shutdown is moot."""
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            try:
                if not self._commands.closed:
                    self._commands.send(data, zmq.NOBLOCK)
                    return
            except zmq.Again:
                pass
        if msg[0] in ("add", "lora"):
            raise EngineDeadError(self.dead_error or "the engine process is not taking requests")

    def _receive(self) -> None:
        """The receiver thread: each engine message to its streams, the metrics' hooks after."""
        while not self._stopping:
            if not self._outputs.poll(IDLE_POLL_MS):
                if not self.process.is_alive() and not self._stopping:
                    self._engine_died(f"the engine process exited (exit code {self.process.exitcode})")
                    return
                continue
            kind, payload = self._outputs.recv_multipart()
            try:
                if not self._take(kind, payload):
                    return
            except Exception as e:  # a message this side cannot read: no stream could be trusted after it
                logger.exception("reading the engine's outputs failed")
                self._engine_died(f"the engine's outputs could not be read: {type(e).__name__}: {e}")
                self.process.kill()  # nobody reads what it computes now
                return

    def _take(self, kind: bytes, payload: bytes) -> bool:
        """Handle one engine message; False once the engine is dead."""
        if kind in (b"step", b"load"):
            msg = _STEP_DECODER.decode(payload)
            self.load, self._compile_state, self._grammar = msg.load, msg.compile_state, msg.grammar
            st = self._spec
            st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, st.accepted_per_pos = msg.spec
            st.by_method = msg.spec_by
            if msg.outputs:
                self._deliver_all([(out.request_id, out) for out in msg.outputs])
                self._run_hooks(msg.outputs, msg.seconds)
        elif kind == b"error":
            request_id, error = pickle.loads(payload)
            self._deliver(request_id, error)
        elif kind == b"lora":
            self._answer(*pickle.loads(payload))
        elif kind == b"dead":
            self._engine_died(pickle.loads(payload))
            return False
        return True

    def _engine_died(self, reason: str) -> None:
        logger.error("the engine is dead: %s", reason)
        self._fail_streams(reason)
