"""Subnormal floats on the CPU: flushed to zero process-wide (the FTZ and DAZ modes of x86 CPUs).

Arithmetic on subnormal numbers (float32 below 1.2e-38) costs tens of times more than on normal
ones on x86 CPUs, and attention makes many: the weights ``e^{s − max}`` of sharp attention (large
key magnitudes, as the RT precisions make them) and their products in the backward, so PyTorch's
CPU SDPA with large keys is many times slower than with unit keys unless subnormals are flushed,
which makes the two take the same time. Such numbers
change no sum at float32 precision, so flushing them keeps every kernel exact to its tolerance and
makes its cost independent of the data.

The mode is a per-thread register that new threads inherit from the thread that creates them, so
it reaches PyTorch's worker threads only when set before the first parallel operation starts them.
It is global state that other code in the process sees too (NumPy, property-testing libraries that
generate subnormals), so the library leaves it alone: the ``geoattn`` command sets it first thing
(``GEOATTN_KEEP_SUBNORMALS=1`` in the environment keeps IEEE subnormals), and a program that wants it
calls `flush_subnormals` before its first torch operation. No kernel chooses its path by it: a plain
Python program and the ``geoattn`` command run the same code (the benchmarks print the mode).
"""

from __future__ import annotations

import os

import numpy as np
import torch

KEEP_ENV = "GEOATTN_KEEP_SUBNORMALS"

_flushed = False


def flush_subnormals() -> bool:
    """Flush subnormal floats to zero in this thread and the threads it creates from now on.

    Returns whether the CPU supports it. Call it before the first parallel torch operation (as the
    ``geoattn`` command does) so that PyTorch's worker threads inherit it.
    """
    global _flushed
    # NumPy computes (and caches) its float limits on first use; measured with subnormals flushed it
    # warns that the smallest subnormal is zero, once per type: measure them before flushing
    for dtype in (np.float16, np.float32, np.float64):
        _ = np.finfo(dtype).smallest_subnormal
    _flushed = torch.set_flush_denormal(True)
    return _flushed


def subnormals_flushed() -> bool:
    """Whether `flush_subnormals` ran in this process (what the benchmarks' headers report)."""
    return _flushed


def flush_unless_kept() -> None:
    """What the ``geoattn`` command does first: `flush_subnormals` unless ``GEOATTN_KEEP_SUBNORMALS=1``."""
    if os.environ.get(KEEP_ENV, "").strip().lower() not in ("1", "true", "yes"):
        flush_subnormals()
