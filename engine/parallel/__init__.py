"""Tensor parallelism's process group and collectives: what the model code needs to be sharded.

A model built with a :class:`TensorParallel` of size N holds its rank's slice of every sharded weight
(Megatron's layout: attention split by heads, the MLP by its inner dimension, the embedding and the
LM head by vocabulary; ``engine/models/llama.py``) and calls :meth:`TensorParallel.all_reduce` after
each row-parallel product and :meth:`TensorParallel.gather_vocab` on the logits. The collectives are
custom operators (``augur_tp::all_reduce``, ``augur_tp::gather_last``) over torch.distributed's, which
``torch.compile`` keeps as calls in its graphs (its functional collectives take an argument the CPU
graphs' C++ wrapper cannot pass); at size 1 they are the identity and no process group exists.

Ranks join with :func:`join`: gloo between CPU processes (how the tests run), NCCL between GPUs. The
runner's side (rank 0 driving the workers, one message a call) is ``engine/runner/parallel.py``.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group_name: str = ""  # the device collectives' process group (gloo on CPU, NCCL on CUDA)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (a row-parallel product's partial sums), on every rank."""
        if self.size == 1:
            return x
        return torch.ops.augur_tp.all_reduce(x, self.group_name)

    def gather_vocab(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, V / size]`` slices of the vocabulary, one per rank in rank order → ``[N, V]`` on every rank."""
        if self.size == 1:
            return x
        return torch.ops.augur_tp.gather_last(x, self.group_name, self.size)

    def split(self, total: int, what: str) -> int:
        """This rank's share of ``total`` (heads, the MLP's inner size, the vocabulary), which the
        size must divide: a clear start-up error otherwise."""
        if total % self.size:
            raise ValueError(
                f"--tensor-parallel-size {self.size} does not divide the model's {what} ({total}); "
                f"choose a size that divides it"
            )
        return total // self.size

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(KV heads this rank holds, index of its first): split like the query heads while there are
        at least as many as ranks; past that each rank holds one, the KV head of its query heads'
        group (replicated across ``size / num_kv_heads`` ranks), which needs ``size`` a multiple."""
        if num_kv_heads >= self.size:
            n = self.split(num_kv_heads, "key/value heads")
            return n, self.rank * n
        if self.size % num_kv_heads:
            raise ValueError(
                f"--tensor-parallel-size {self.size} is neither a divisor nor a multiple of the model's "
                f"{num_kv_heads} key/value heads"
            )
        return 1, self.rank // (self.size // num_kv_heads)


SINGLE = TensorParallel()


def join(rank: int, size: int, init_method: str, device: torch.device, timeout_s: float) -> TensorParallel:
    """Join the ranks' process group (every rank calls this; ``init_method``: ``tcp://host:port``) and
    return this rank's :class:`TensorParallel`. ``timeout_s`` bounds each collective and the join."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=size, timeout=datetime.timedelta(seconds=timeout_s)
    )
    group = dist.group.WORLD
    _GROUPS[group.group_name] = group
    return TensorParallel(rank, size, group.group_name)


_GROUPS: dict[str, dist.ProcessGroup] = {}  # group name → group, for the operators below


@torch.library.custom_op("augur_tp::all_reduce", mutates_args=())
def _all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out, group=_GROUPS[group])
    return out


@_all_reduce.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("augur_tp::gather_last", mutates_args=())
def _gather_last(x: torch.Tensor, group: str, size: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=_GROUPS[group])
    return torch.cat(parts, dim=-1)


@_gather_last.register_fake
def _(x: torch.Tensor, group: str, size: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] * size))


def leave() -> None:
    """Leave the group (this process may join another later: the tests build engine after engine)."""
    global _GLOO
    if dist.is_initialized():
        dist.destroy_process_group()
    _GROUPS.clear()
    _GLOO = None


def control_group():
    """The group the runner's messages cross: a gloo one beside an NCCL world (messages are host
    objects), the world itself where that is gloo already."""
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    return _gloo_group()


_GLOO = None


def _gloo_group():
    global _GLOO
    if _GLOO is None:
        _GLOO = dist.new_group(backend="gloo")
    return _GLOO
