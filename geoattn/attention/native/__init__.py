"""Native CPU kernels, compiled for the machine on first use (one module, `cpu_kernels`).

* ``rt_lag_forward`` / ``rt_lag_backward`` (``rt_lag.h``): RT-Filter attention with a lag table (the
  default times, where ``log c`` depends on ``i − j`` only), a fused flash-style forward and backward,
  the matmuls in the BLAS torch links and the elementwise work in SIMD lanes, parallel over heads and
  query blocks. It computes exactly what the Python blockwise kernel computes (the same flushing of
  subnormal factors), without its per-tile Python and compiled-call overhead.
* ``rt_qkv_forward`` / ``rt_qkv_backward`` (``rt_qkv.h``): the same attention from the fused Q/K/V
  projection ``(B, N, 3, H, D)``: the normalisation (with the learned metric), the key magnitudes and
  the rotations into and out of the common frame happen in the same call instead of as separate
  passes around the kernel, each head instance's rows when its work item starts (in a per-thread
  scratch the attention then reads from cache) and their gradients as soon as its backward is done.
* ``frame_forward`` / ``frame_backward`` (``frame.h``): the rotor frame head's per-token transform
  (Gram–Schmidt frame, its rotation's action on Cl(3), applied to every channel) in one pass.

The first call compiles the source with the toolchain ``torch.utils.cpp_extension`` uses (a C++
compiler and ``ninja``; about a minute on two cores) into a cache folder per machine,
``$GEOATTN_CACHE/native`` (default ``~/.cache/geoattn/native``); later processes load it. Where it
cannot be built, or with ``GEOATTN_NATIVE=0``, `cpu_kernels` returns None, with a one-line warning in
the first case, and the kernels use their Python forms.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch

NATIVE_ENV = "GEOATTN_NATIVE"
_FOLDER = Path(__file__).parent
_SOURCE = _FOLDER / "module.cpp"  # includes rt_lag.h, rt_qkv.h and frame.h
_NAME = "geoattn_native_cpu"
# -march=native: the build is per machine (the cache folder carries the CPU's flags in its name)
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_state: dict[str, ModuleType | None] = {}


def enabled() -> bool:
    """Whether native kernels may be used: not switched off by ``GEOATTN_NATIVE=0``."""
    return os.environ.get(NATIVE_ENV, "1").strip().lower() not in ("0", "false", "no")


@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether `cpu_kernels` gives the module (building it on the first call). A constant of the
    process, so a compiled graph's path choice treats it as a static fact."""
    return cpu_kernels() is not None


def cpu_kernels() -> ModuleType | None:
    """The compiled module (the functions above), or None (see above)."""
    if "cpu" not in _state:
        _state["cpu"] = _build() if enabled() else None
    return _state["cpu"]


def _build() -> ModuleType | None:
    try:
        from torch.utils.cpp_extension import load

        folder = _cache_folder()
        folder.mkdir(parents=True, exist_ok=True)
        _clear_stale_lock(folder)
        if not any(folder.glob(f"{_NAME}*.so")):
            print("geoattn: compiling the native CPU kernels (once per machine)", file=sys.stderr)
        return load(
            name=_NAME,
            sources=[str(_SOURCE)],
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            verbose=False,
        )
    except Exception as err:  # noqa: BLE001 - no compiler, no ninja, a foreign BLAS: the Python path
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        warnings.warn(
            f"geoattn: native CPU kernels unavailable ({reason[:200]}); using the Python kernels",
            stacklevel=3,
        )
        return None


# torch's build lock: a build interrupted (Ctrl-C, a killed job) leaves it behind, and every later
# process would wait for it forever. A build takes about a minute; an older lock is stale.
_STALE_LOCK_S = 600


def _clear_stale_lock(folder: Path) -> None:
    lock = folder / "lock"
    try:
        if time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            lock.unlink()
    except FileNotFoundError:
        pass


def _cache_folder() -> Path:
    root = Path(os.environ.get("GEOATTN_CACHE", Path.home() / ".cache" / "geoattn")) / "native"
    # the sources' text is part of the key: a changed header (which torch's own check does not see)
    # builds afresh
    sources = "".join(p.read_text() for p in sorted(_FOLDER.glob("*.[ch]*")) if p.suffix in (".h", ".cpp"))
    key = f"{torch.__version__}|{platform.machine()}|{_cpu_flags()}|{sources}"
    key = hashlib.sha256(key.encode()).hexdigest()[:12]
    return root / key


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()
