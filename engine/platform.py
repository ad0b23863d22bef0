"""What this machine offers, probed once: the CPU's feature flags and whether it multiplies bf16 natively.

The floor of the engine: it imports nothing from it, so any module may ask.
"""

from __future__ import annotations

import functools
import os
import time


def triton_interpreted() -> bool:
    """Whether Triton kernels run in its interpreter (on CPU tensors) instead of being compiled (read on
    each call: a test may set it)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def sm_count(device) -> int:
    """Streaming multiprocessors of the CUDA ``device`` (a torch.device), read once per device: what the
    Triton kernels size their launch grids by."""
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def cpu_flags() -> tuple[str, ...]:
    """This CPU's feature flags, as Linux reports them (empty where it does not)."""
    try:
        with open("/proc/cpuinfo") as f:
            return tuple(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return ()


@functools.cache
def cpu_has_bf16_units() -> bool:
    """Whether this CPU multiplies bf16 natively (AMX-BF16 or AVX512-BF16). Elsewhere bf16 matmuls
    are emulated through float32 conversions, so float32 is the default there."""
    flags = cpu_flags()
    return "amx_bf16" in flags or "avx512_bf16" in flags


def usable_cpus() -> int:
    """The CPUs this process may really use: its affinity mask (taskset, a cpuset), bounded by a
    cgroup CPU quota (``docker run --cpus``, a Kubernetes CPU limit), which os.cpu_count() and
    OpenMP's default both ignore."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, max(1, int(quota)))
    return max(1, cpus)


def cgroup_cpu_quota() -> float | None:
    """CPUs' worth of time the process's cgroup may use per period (v2 ``cpu.max``, v1
    ``cpu.cfs_quota_us``); None where unlimited or unknown."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:  # cgroup v2: "max 100000" or "200000 100000"
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as f:
            quota_us = int(f.read())
        with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
            period_us = int(f.read())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def openmp_defaults() -> dict[str, str]:
    """The OpenMP settings the ``augur`` command starts torch with, where the environment names none
    (OpenMP reads them once, when torch loads it): one thread per CPU the process may really use
    (:func:`usable_cpus`; OpenMP's own default counts the host's CPUs, not a container's quota). The
    wait policy stays OpenMP's (spin a while, then sleep), the fastest on a quiet machine; on a host
    shared with busy neighbours ``OMP_WAIT_POLICY=PASSIVE`` serves steadier (docs/benchmarks.md has
    both measured)."""
    return {"OMP_NUM_THREADS": str(usable_cpus())}


def engine_process_threads() -> int:
    """Torch's CPU threads in a separate engine process (``--engine-process on``): every usable CPU on a
    host of one or two, else one CPU fewer than the usable ones, so that the API process (HTTP, SSE,
    tokenizing, taking the outputs in) has a core that the forward's OpenMP threads do not wait on;
    ``AUGUR_ENGINE_THREADS`` sets it.

    On 2 cores the API process's work is a small share of a core, and the forwards that speculation
    runs (a verify of several rows, a batch) are bound by the batch-invariant kernels' arithmetic,
    which splits over threads: with both cores the demo pair served 1.04-1.09x faster plain and
    `auto` at 1.04-1.06x, and in-process speculation went from 0.92x to 1.08x plain decoding
    (docs/benchmarks.md). Holding a core back for the API there left it idle most of the time."""
    env = os.environ.get("AUGUR_ENGINE_THREADS", "")
    if env.isdigit() and int(env) >= 1:
        return int(env)
    usable = usable_cpus()
    return usable if usable <= 2 else usable - 1


class CpuThreads:
    """How many threads torch's CPU kernels should run with now: one per usable CPU that other
    processes leave free, at least one.

    Every parallel region of a kernel waits for its slowest thread; when a busy neighbour holds one of
    the CPUs, the thread the scheduler parks behind it holds up every region (and the others spin
    meanwhile): measured on 2 cores, a training step of the demo target took 4.1 s with one busy
    neighbour against 1.4 s quiet, and 2.5 s on one thread. So :meth:`poll`, called from a loop, measures every
    ``interval`` seconds how many CPUs' worth of time other processes took on this process's CPUs
    (``/proc/stat``'s per-CPU busy time less this process's own, ``os.times``) and answers the thread
    count to switch to, or None when it stays. Fixed at :func:`usable_cpus` where that cannot be
    measured (no ``/proc/stat``) or means little (a cgroup quota: the neighbours are elsewhere).

    For eager loops (the demo build's training). Not for compiled forwards: dynamo guards a graph on
    the thread count, so each switch would compile the graphs again.
    """

    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        self.usable = usable_cpus()
        try:
            self._cpus = {f"cpu{c}" for c in os.sched_getaffinity(0)}
        except (AttributeError, OSError):
            self._cpus = set()
        self.threads = self.usable
        worth_it = self.usable > 1 and bool(self._cpus) and cgroup_cpu_quota() is None
        self._last = self._sample() if worth_it else None
        self.adaptive = self._last is not None

    def _sample(self) -> tuple[float, float, float] | None:
        """(monotonic seconds, busy seconds of this process's CPUs, this process's CPU seconds)."""
        try:
            with open("/proc/stat") as f:
                lines = [line.split() for line in f if line.startswith("cpu")]
        except OSError:
            return None
        ticks = os.sysconf("SC_CLK_TCK")
        busy = 0
        for fields in lines:
            if fields[0] in self._cpus:  # user nice system idle iowait irq softirq steal
                user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
                busy += user + nice + system + irq + softirq + steal
        own = os.times()
        return time.monotonic(), busy / ticks, own.user + own.system

    def neighbours(self) -> float | None:
        """CPUs' worth of time other processes took on this process's CPUs since the last sample."""
        now = self._sample()
        if now is None or self._last is None:
            return None
        last, self._last = self._last, now
        elapsed = now[0] - last[0]
        if elapsed <= 0:
            return None
        return max(0.0, ((now[1] - last[1]) - (now[2] - last[2])) / elapsed)

    def poll(self) -> int | None:
        """The thread count to switch to, when it is time to look and it changes; None otherwise."""
        if not self.adaptive or time.monotonic() - self._last[0] < self.interval:
            return None
        others = self.neighbours()
        if others is None:
            return None
        threads = max(1, self.usable - int(others + 0.5))
        if threads == self.threads:
            return None
        self.threads = threads
        return threads
