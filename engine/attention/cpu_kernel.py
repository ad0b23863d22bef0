"""The C++ CPU kernel of ``augur::paged_attention`` (``paged_attention_cpu.cpp``): built on first use.

On a CPU the op's Python implementation (``sdpa.py``) costs more than its maths at decode sizes: a
compiled forward calls it once per layer, and each call re-enters the interpreter and dispatches a
dozen small ATen ops (about 0.1 ms a layer for the demo target, a quarter of its forward). The C++
kernel does the same work in one pass with no Python, and registers itself for CPU tensors; the
Python implementation stays the reference and serves every other device.

``torch.utils.cpp_extension`` builds it with the host's compiler (the one ``torch.compile`` needs on a
CPU anyway) into its cache directory, once per source and CPU: later processes only load it. Where it
cannot be built, a warning says why and the Python implementation serves.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import os
import shutil
import sys
import time
from pathlib import Path

# At import, in the importing thread, never lazily: cpp_extension imports setuptools, whose first import
# inserts a finder at the head of sys.meta_path and removes it again. Another thread importing at that
# moment walks the list as it shifts, skips the path finder and fails with "No module named ..." (CI
# saw it while the invariant and attention kernels built side by side, and inductor's C++ builder
# imports cpp_extension from the background compile thread too).
import torch
import torch.utils.cpp_extension  # noqa: F401

from engine.platform import cpu_flags

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention_cpu.cpp")


@functools.cache
def load_cpu_kernel() -> bool:
    """Build (first use) and register the CPU kernel; whether it now serves CPU tensors."""
    import engine.attention.sdpa  # noqa: F401  (defines the op the kernel is registered for)

    try:
        build_cpu_extension("augur_paged_attention_cpu", SOURCE, flags=("-fopenmp",))  # at::parallel_for: threads
    except Exception as exc:  # no compiler, no ninja, a build error: the Python implementation serves
        logger.warning("the C++ CPU attention kernel is unavailable (%s); using the Python implementation", exc)
        return False
    return True


def build_cpu_extension(stem: str, source_path: Path, flags: tuple[str, ...] = ()) -> None:
    """Build (once per source, CPU and environment; later processes only load it) and load the C++
    source at ``source_path``, which registers its kernels itself; raises where it cannot. ``flags``:
    the compiler's, beside the defaults."""
    from torch.utils.cpp_extension import load_inline  # imported at the top: a name lookup here

    _put_ninja_on_path()
    source = source_path.read_text()
    # Each source includes what it uses (ATen, torch/library.h: it registers ops, binds no Python).
    # load_inline's implicit <torch/extension.h> adds pybind11 and the C++ frontend: three times the
    # build (a cold start builds three of these: 82 s against 30 on one core). An older torch, without
    # the switch, includes it.
    lean = "no_implicit_headers" in inspect.signature(load_inline).parameters
    # -march=native: the build is for this CPU, so its cache entry is named after the CPU too, and
    # after the Python environment (its include paths are in the build: two virtualenvs sharing
    # one entry would rebuild it in turn, each under the other's lock), and after the header mode
    # (two checkouts on one environment would rebuild it in turn too).
    key = " ".join([source, *flags, *cpu_flags(), sys.prefix, torch.__version__, f"lean={lean}"])
    name = f"{stem}_{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    _clear_stale_lock(name)
    load_inline(
        name=name,
        cpp_sources=source,
        extra_cflags=["-O3", "-march=native", "-fopenmp-simd", *flags],
        extra_ldflags=[flag for flag in flags if flag == "-fopenmp"],
        is_python_module=False,
        verbose=False,
        **({"no_implicit_headers": True} if lean else {}),
    )


STALE_LOCK_SECONDS = 600  # a build takes ~10-15 s; a lock this old was left by a process that was killed


def _clear_stale_lock(name: str) -> None:
    """``torch.utils.cpp_extension`` waits for its build lock forever; a process killed while
    building (a container stopped mid-start) leaves it behind, and every later start would hang.
    Wait while another process may really be building (its lock is younger than any build takes),
    then remove a lock that outlived that."""
    try:
        from torch.utils.cpp_extension import _get_build_directory  # where load_inline builds

        lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    except Exception:  # a torch without that helper: nothing to check
        return
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return  # no lock (the rule), or its builder finished
        if age > STALE_LOCK_SECONDS:
            logger.warning("removing a stale build lock (%.0f s old): %s", age, lock)
            lock.unlink(missing_ok=True)
            return
        time.sleep(1.0)


def _put_ninja_on_path() -> None:
    """``torch.utils.cpp_extension`` runs ``ninja`` from ``PATH``; the ``ninja`` package (a dependency)
    installs it next to this interpreter, which is not on ``PATH`` unless the virtualenv is active."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
