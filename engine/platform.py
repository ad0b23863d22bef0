"""What this machine offers, probed once: the CPU's feature flags and whether it multiplies bf16 natively.

The floor of the engine: it imports nothing from it, so any module may ask.
"""

from __future__ import annotations

import functools


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
