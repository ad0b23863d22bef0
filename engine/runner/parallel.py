"""A tensor-parallel target: rank 0's runner drives N - 1 workers, one message a call.

Rank 0 is the engine: its scheduler, controller, proposer and sampler run once, there. Its target
runner is a :class:`ShardedRunner`: every call that touches the sharded model (a forward, a chain of
draft levels, the embedding or output layer, the pool's allocation) is first sent to the workers as
one message — the method's name and arguments, broadcast over torch.distributed's control group
(:func:`engine.parallel.control_group`) — and then run locally, so every rank runs the same forwards
in the same order and meets the same collectives. Calls on the KV pool alone (accepted nodes' moves,
copy-on-write block copies) run on rank 0 at once and ride with the next message, ahead of its call:
a step's target forward is its one message.
A worker (:func:`run_worker`) holds its shard, its own KV pool (its heads) and a plain
:class:`ModelRunner`, and loops: receive, run, drop the result (every rank ends a forward with the
same gathered logits; only rank 0's are read, so no rank samples on its own).

A proposer with a model of its own (a draft model, heads) runs on rank 0 only, unsharded: its runner
is not a :class:`ShardedRunner`; a draft model, Medusa heads or an EAGLE head may instead be sharded
like the target (``--draft-tensor-parallel-size``: :func:`open_sharded` gives the workers a second
runner, :func:`open_sharded_module` a module, which the messages name by its key). Unsharded, Medusa heads
read only the replicated final norm and hidden states; MTP heads reach the target's embedding and
output layer through the runner (``embed``, ``logits``: mirrored). An EAGLE head, which embeds
tokens inside its own forward, gets a whole copy of the target's embedding table on rank 0
(``engine.speculative.methods.eagle.whole_embedding``).

Failure: a worker that exits ends the engine's process (non-zero, naming the rank and its exit code),
and so does any call that raises on rank 0 (a collective that took longer than ``tp_timeout_s``
among them): the ranks cannot be brought back in step. A worker whose parent is gone exits, and one
whose collective times out raises and exits, which ends rank 0 in turn. While idle, rank 0 sends a
no-op message every quarter of ``tp_timeout_s``, so an idle server's waiting workers do not time out.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import socket
import threading
import time

import torch
import torch.distributed as dist

from engine.parallel import TensorParallel, control_group, join, leave
from engine.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def ranks_here(config) -> range:
    """The ranks this host runs: an even share of them, host ``node_rank``'s block (rank 0 on host 0)."""
    per = config.tensor_parallel_size // config.nnodes
    return range(config.node_rank * per, (config.node_rank + 1) * per)


def rank_device(config, rank: int) -> torch.device:
    """A rank's device: the CPU, or the host's GPUs in rank order from ``first_gpu`` (a CUDA
    ``device`` names no index under tensor parallelism)."""
    device = config.torch_device
    if device.type != "cuda":
        return device
    return torch.device("cuda", config.first_gpu + rank - ranks_here(config).start)


def init_method(config) -> str:
    """Where the ranks meet: torchrun's store where torchrun started this process (``env://``), the
    master's address on several hosts, else a free port of this host."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return "env://"
    if config.nnodes > 1 or config.master_port:
        return f"tcp://{config.master_addr}:{config.master_port}"
    return f"tcp://127.0.0.1:{free_port()}"


def check_parallel(config) -> None:
    """Start-up errors for a tensor-parallel size this host or this configuration cannot run."""
    n = config.tensor_parallel_size
    if config.torch_device.type == "cuda":
        if config.device not in ("auto", "cuda"):
            raise ValueError(f"--device {config.device} names one GPU; tensor parallelism uses cuda:0 .. cuda:{n - 1}")
        here = len(ranks_here(config))
        if torch.cuda.device_count() < config.first_gpu + here:
            raise ValueError(
                f"--tensor-parallel-size {n} puts {here} ranks on this host, which has {torch.cuda.device_count()} GPUs"
            )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Workers:
    """Rank 0's handle on its workers: their processes, the control group, and the message lock
    (messages and the forwards they announce go out from one thread at a time)."""

    def __init__(self, config, processes: dict, tp: TensorParallel) -> None:
        self.config, self.processes, self.tp = config, processes, tp  # processes: this host's, by rank
        self.group = control_group()
        self.lock = threading.RLock()
        self.last_sent = time.monotonic()
        self.closed = False
        self.deferred: list = []  # calls to send with the next message (see defer)
        self.on_death: list = []  # callables told why, before this process ends on a lost worker
        self.on_cuda = config.torch_device.type == "cuda"
        atexit.register(self.close)  # (before multiprocessing's exit joins the workers, which would wait forever)
        threading.Thread(target=self._watch, name="augur-tp-watch", daemon=True).start()
        threading.Thread(target=self._keepalive, name="augur-tp-keepalive", daemon=True).start()

    def send(self, key: str, name: str, *args, **kwargs) -> None:
        """One message: the calls deferred since the last one, then this one (runner ``key``'s method
        ``name``: each worker holds the target's runner, ``"target"``, and any it was told to open)."""
        calls, self.deferred = [*self.deferred, (key, name, args, kwargs)], []
        box = [[(r, n, _to_host(a), _to_host(k)) for r, n, a, k in calls] if self.on_cuda else calls]
        dist.broadcast_object_list(box, src=0, group=self.group)
        self.last_sent = time.monotonic()

    def defer(self, key: str, name: str, *args) -> None:
        """A call the workers need before their next forward only (a KV move, a block copy): it goes
        with the next message, so that a step's forward is the step's one message."""
        self.deferred.append((key, name, args, {}))

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            try:
                self.send("", "shutdown")
            except Exception:  # a worker already gone: nothing to tell
                logger.debug("tensor-parallel shutdown message not delivered", exc_info=True)
        for p in self.processes.values():
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        leave()

    def _watch(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in self.processes.items()}
        if not sentinels:  # (the workers are on other hosts: their loss shows as a failed collective)
            return
        ready = multiprocessing.connection.wait(list(sentinels))
        if self.closed:
            return
        rank = sentinels[ready[0]]
        self.processes[rank].join(timeout=5)  # (reaped: its exit code known)
        self.fail(f"tensor-parallel worker rank {rank} exited (exit code {self.processes[rank].exitcode})")

    def fail(self, reason: str) -> None:
        """End this process (the engine): the ranks cannot go on apart, nor be brought back in step.
        ``on_death`` hears why first (the API process, where the engine has a process of its own)."""
        logger.critical("%s: the engine stops", reason)
        for tell in self.on_death:
            try:
                tell(reason)
            except Exception:
                logger.exception("telling why the engine stops failed")
        os._exit(3)

    def _keepalive(self) -> None:
        every = self.config.tp_timeout_s / 4
        while not self.closed:
            time.sleep(min(every, 5.0))
            if time.monotonic() - self.last_sent < every:
                continue
            with self.lock:
                if not self.closed and time.monotonic() - self.last_sent >= every:
                    try:
                        self.send("", "noop")
                    except Exception as e:
                        self.fail(f"tensor-parallel message to the workers failed: {type(e).__name__}: {e}")


# What multiprocessing's fork server imports before it forks a worker: the runner, the loader, and
# transformers' configuration validators (the first config a process loads imports them, and through
# them torch.distributed.tensor: ~0.6 s). A name that does not import is skipped by the fork server.
WORKER_PRELOAD = [
    "engine.runner.parallel",
    "engine.runner.loader",
    "engine.config",
    "transformers.utils.type_validators",
]


def _spawn(config, ranks, init: str) -> dict:
    """Start ``ranks`` as worker processes. They fork from multiprocessing's fork server, a fresh
    interpreter that imports torch and the model code once (:data:`WORKER_PRELOAD`; it never touches
    a GPU, so forking it is safe) and then lives as long as this process: a worker starts in well
    under a second instead of spawn's ~2.5 s of imports, and exits without an interpreter's teardown."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(WORKER_PRELOAD)
    processes = {}
    for rank in ranks:
        p = ctx.Process(
            target=run_worker, name=f"augur-tp-rank{rank}", args=(config, rank, init, logging.getLogger().level)
        )
        p.start()
        processes[rank] = p
    return processes


def start_workers(config) -> Workers:
    """On host 0: start this host's other ranks (processes running :func:`run_worker`) and join the
    group as rank 0 (the other hosts' ranks join it from :func:`serve_headless`)."""
    check_parallel(config)
    if config.torch_device.type == "cpu":  # this host's ranks share its CPUs (as the workers do)
        from engine.platform import usable_cpus

        torch.set_num_threads(min(torch.get_num_threads(), max(1, usable_cpus() // len(ranks_here(config)))))
    init = init_method(config)
    # The workers read the configuration, not this process's environment (theirs is the fork server's,
    # as it was when it started): settle what the environment decides here.
    config = dataclasses.replace(config, compile="on" if config.compile_enabled else "off")
    processes = _spawn(config, ranks_here(config)[1:], init)
    try:
        tp = _join_watching(processes, config.tensor_parallel_size, init, rank_device(config, 0), config.tp_timeout_s)
    except BaseException:
        for p in processes.values():
            p.kill()
        raise
    return Workers(config, processes, tp)


def serve_headless(config) -> int:
    """A host other than rank 0's (``--node-rank`` > 0): run this host's ranks as workers of rank 0's
    engine until it stops them; the exit status is non-zero if any of them failed (and then the
    others are stopped: the group cannot go on without it)."""
    check_parallel(config)
    processes = _spawn(config, ranks_here(config), init_method(config))
    codes: dict[int, int] = {}
    while len(codes) < len(processes):
        multiprocessing.connection.wait([p.sentinel for r, p in processes.items() if r not in codes])
        for rank, p in processes.items():
            if rank not in codes and p.exitcode is not None:
                codes[rank] = p.exitcode
                if p.exitcode != 0:
                    logger.critical("tensor-parallel worker rank %d exited (exit code %s)", rank, p.exitcode)
                    for other in processes.values():
                        other.kill()
    return max((abs(c) for c in codes.values()), default=0)


def _join_watching(processes: dict, size: int, init: str, device: torch.device, timeout_s: float) -> TensorParallel:
    """Rank 0's :func:`join`, on a thread, while watching the workers: one that exits before the group
    is whole, or a group not whole within ``timeout_s``, is a clear error instead of a wait."""
    box: list = []
    thread = threading.Thread(target=lambda: box.append(_attempt(join, 0, size, init, device, timeout_s)), daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while thread.is_alive():
        for rank, p in processes.items():
            if p.exitcode is not None:
                raise RuntimeError(f"tensor-parallel worker rank {rank} exited before joining (exit code {p.exitcode})")
        if time.monotonic() > deadline + 5:
            raise RuntimeError(f"the tensor-parallel ranks did not all join within {timeout_s:g} s (--tp-timeout)")
        thread.join(0.1)
    ok, value = box[0]
    if not ok:
        why = f"did not all join within {timeout_s:g} s (--tp-timeout), or could not"  # (torch's error says which)
        raise RuntimeError(f"the tensor-parallel ranks {why}: {value}") from value
    return value


def _attempt(fn, *args):
    try:
        return True, fn(*args)
    except Exception as e:
        return False, e


class ShardedRunner(ModelRunner):
    """Rank 0's runner of a sharded model (the target, ``key`` ``"target"``, or one :func:`open_sharded`
    opened): each call below goes to the workers first (see the module)."""

    def __init__(self, workers: Workers, *args, key: str = "target", **kwargs) -> None:
        self.workers, self.key = workers, key
        super().__init__(*args, **kwargs)

    def _mirrored(self, name: str, *args, **kwargs):
        return _mirror(self.workers, self.key, name, getattr(super(), name), *args, **kwargs)

    def allocate_kv(self, num_blocks: int) -> None:
        self._mirrored("allocate_kv", num_blocks)

    def execute(self, batch, input_ids=None, skip=None, hidden_layers=(), hidden_in=None):
        return self._mirrored("execute", batch, input_ids, skip, hidden_layers, hidden_in)

    def chain(self, batches, input_ids, temperature=None, noise=None, skip=None):
        return self._mirrored("chain", batches, input_ids, temperature, noise, skip)

    def write_lora(self, slot: int, adapter) -> None:  # (every rank cuts its share: LoraSlots.place)
        self._mirrored("write_lora", slot, adapter)

    def clear_lora(self, slot: int) -> None:
        self._mirrored("clear_lora", slot)

    def embed(self, input_ids):
        return self._mirrored("embed", input_ids)

    def logits(self, hidden):
        return self._mirrored("logits", hidden)

    def move_slots(self, src: list[int], dst: list[int]) -> None:
        if src:
            self._deferred("move_slots", src, dst)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            self._deferred("copy_blocks", copies)

    def _deferred(self, name: str, *args) -> None:
        """Run a KV operation here now, on the workers before their next call (the next message)."""
        with self.workers.lock:
            getattr(super(), name)(*args)
            self.workers.defer(self.key, name, *args)

    def compile_view(self, scratch_tokens: int = 256) -> ModelRunner:
        raise RuntimeError("a tensor-parallel runner compiles before serving, not in the background")


def _mirror(workers: Workers, key: str, name: str, run, *args, **kwargs):
    """Send ``key``'s call ``name`` to the workers, then ``run`` it here."""
    with workers.lock:
        try:
            workers.send(key, name, *args, **kwargs)
            return run(*args, **kwargs)
        except Exception as e:
            # A rank that raised left the others waiting in a collective (or the reverse): fatal.
            workers.fail(f"tensor-parallel {name} failed on rank 0: {type(e).__name__}: {e}")
            raise


class ShardedModule:
    """Rank 0's handle on a module sharded over the ranks without a runner of its own (Medusa heads,
    whose output layers are split by vocabulary): a call goes to the workers first, then runs here;
    its attributes are the module's."""

    def __init__(self, workers: Workers, key: str, module: torch.nn.Module) -> None:
        self.workers, self.key, self.module = workers, key, module

    def __call__(self, *args):
        return _mirror(self.workers, self.key, "__call__", self.module, *args)

    def __getattr__(self, name: str):
        return getattr(self.module, name)


def run_worker(config, rank: int, init_method: str, log_level: int) -> None:
    """Rank ``rank``'s process: join the group, load its shard, then run what rank 0 sends until told to stop."""
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s [tp rank {rank}] %(name)s: %(message)s")
    parent = multiprocessing.parent_process()
    if parent is not None:  # an orphan worker would wait for messages forever
        threading.Thread(target=_exit_with, args=(parent.sentinel,), daemon=True).start()
    from engine.platform import usable_cpus
    from engine.runner.loader import batch_invariant_serves, load_config, load_model, resolve_model_path

    device = rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, usable_cpus() // len(ranks_here(config))))
    tp = join(rank, config.tensor_parallel_size, init_method, device, config.tp_timeout_s)
    group = control_group()
    path = resolve_model_path(config.model)
    hf_config = load_config(path)
    max_len = config.max_model_len or int(getattr(hf_config, "max_position_embeddings", 2048))
    invariant = batch_invariant_serves(config)  # as rank 0 decides it (LLMEngine): every rank the same kernels
    compiled = config.compile_enabled
    model = load_model(
        path, hf_config, config.torch_dtype, device, max_len, pack=not compiled, quantization=config.quantization,
        tp=tp, batch_invariant=invariant,
    )  # fmt: skip
    if config.lora_enabled:  # slots of its shapes; rank 0 sends what goes in them (ShardedRunner.write_lora)
        from engine.lora import LoraSlots

        LoraSlots.attach(model, config.max_loras, config.max_lora_rank, config.max_num_batched_tokens, invariant)
    runner = ModelRunner(
        model, hf_config, device, config.torch_dtype, config.block_size, compile=compiled,
        attention_backend=config.attention_backend,
        cuda_graph_max_seqs=0 if config.lora_enabled else config.cuda_graph_max_seqs,
        batch_invariant=model.batch_invariant, kv_cache_dtype=config.kv_cache_dtype,
    )  # fmt: skip
    logger.info("rank %d of %d: shard loaded on %s", rank, tp.size, device)
    runners = {"target": runner}
    running = True
    while running:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        for key, name, args, kwargs in box[0]:  # one message: the deferred calls, then the call itself
            if name == "shutdown":
                running = False
                break
            if name == "open":  # a model sharded like the target (see open_sharded)
                factory, fargs, runner_kwargs = args
                model, hf_config, dtype = factory(tp, device, runners["target"], *fargs)
                runners[key] = ModelRunner(model, hf_config, device, dtype, **runner_kwargs)
                logger.info("rank %d of %d: %s shard loaded on %s", rank, tp.size, key, device)
            elif name == "open_module":  # (see open_sharded_module)
                factory, *fargs = args
                runners[key] = factory(tp, device, runners["target"], *fargs)
            elif name != "noop":
                getattr(runners[key], name)(*_to_device(args, device), **_to_device(kwargs, device))
    leave()


def open_sharded(target: ShardedRunner, key: str, factory, args: tuple, **runner_kwargs) -> ShardedRunner:
    """Another model sharded like ``target`` over its ranks (a draft model or an EAGLE head at
    ``--draft-tensor-parallel-size N``), run by a runner of its own on every rank: ``factory(tp, device,
    target_runner, *args)`` returns a rank's ``(model, hf_config, dtype)`` (a module-level function: the
    workers get it by reference, and build their runner of it with ``runner_kwargs``; ``args`` name the
    model as the user did, so that each host resolves it in its own cache). Rank 0 builds its shard
    first, so that a size the model cannot use is its start-up error, not a worker's; from then on
    ``key`` names the runner in the messages."""
    workers, device = target.workers, target.device
    model, hf_config, dtype = _first_shard(key, factory, workers.tp, device, target, *args)
    runner = ShardedRunner(workers, model, hf_config, device, dtype, key=key, **runner_kwargs)
    with workers.lock:
        workers.send(key, "open", factory, args, runner_kwargs)
    return runner


def open_sharded_module(target: ShardedRunner, key: str, factory, *args) -> ShardedModule:
    """A module sharded like ``target`` over its ranks without a runner (Medusa heads): ``factory(tp,
    device, target_runner, *args)`` builds it on every rank, rank 0 first (as :func:`open_sharded`)."""
    workers = target.workers
    module = _first_shard(key, factory, workers.tp, target.device, target, *args)
    with workers.lock:
        workers.send(key, "open_module", factory, *args)
    return ShardedModule(workers, key, module)


def _first_shard(key: str, factory, tp: TensorParallel, *args):
    """Rank 0's shard from ``factory``; a size it cannot use is an error that names the drafter."""
    try:
        return factory(tp, *args)
    except ValueError as e:
        raise ValueError(f"--draft-tensor-parallel-size {tp.size}: the {key} cannot be sharded: {e}") from e


def _exit_with(sentinel) -> None:
    multiprocessing.connection.wait([sentinel])
    os._exit(1)


def _map_tensors(obj, fn):
    """``obj`` with ``fn`` applied to every tensor in it (nested in tuples, lists, dicts and dataclasses)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(x, fn) for x in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: _map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **fields)
    return obj


def _to_host(obj):
    """A message's arguments with their CUDA tensors on the host: a message is pickled, and a worker's
    GPU is not rank 0's."""
    return _map_tensors(obj, lambda t: t.cpu() if t.device.type == "cuda" else t)


def _to_device(obj, device: torch.device):
    """A received message's arguments on this worker's device (as they are, off CUDA)."""
    return obj if device.type != "cuda" else _map_tensors(obj, lambda t: t.to(device))
