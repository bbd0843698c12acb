"""Shared measurement helpers for `geoattn bench ...`: the machine header, medians, peak memory, tables.

Machines are noisy, so every benchmark reports medians over repeats and ratios against a peer
measured in the same run, never absolute targets.
"""

from __future__ import annotations

import gc
import os
import platform
import re
import statistics
import subprocess
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from geoattn.core.formatting import format_table
from geoattn.core.subnormals import subnormals_flushed


def peers_dir() -> str:
    """Where the peers' checkouts and environments live: ``$GEOATTN_PEERS`` or ``../peers``."""
    return os.environ.get("GEOATTN_PEERS", "../peers")


def machine_header() -> str:
    """What every ``geoattn bench`` prints first: the CPU a number was measured on, the vector
    instructions it has, the BLAS torch uses and the native kernels' build, two lines::

        cpu: AMD EPYC 9654 (AVX-512; torch's kernels: AVX512); blas: MKL 2024.2
        native kernels: -march=native (znver4), 16 float32 lanes (AVX-512)

    Builds the native kernels where they are enabled and not built yet (`geoattn.native`),
    so that no benchmark compiles them while it measures."""
    from geoattn import native

    if native.enabled():
        native.cpu_kernels()
    capability = torch.backends.cpu.get_cpu_capability()
    return (
        f"cpu: {cpu_model()} ({cpu_isa()}; torch's kernels: {capability}); blas: {blas()}\n"
        f"native kernels: {native.describe()}"
    )


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        text = open("/proc/cpuinfo").read()  # noqa: SIM115 - a one-shot read
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_model() -> str:
    """The CPU's model name (``AMD EPYC 9654``), else what the platform says of the processor."""
    info = _cpuinfo()
    if info.get("model name"):
        return info["model name"]
    if info.get("CPU implementer"):  # ARM Linux: no model name, the implementer and part codes
        part = info.get("CPU part", "?")
        return f"{platform.machine()} (implementer {info['CPU implementer']}, part {part})"
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_isa() -> str:
    """The widest vector instructions the CPU has: ``AVX-512``, ``AVX2``, ``AVX``, ``SSE``, ``SVE``,
    ``NEON`` or ``unknown``."""
    info = _cpuinfo()
    flags = set((info.get("flags") or info.get("Features") or "").split())
    for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX"), ("sve", "SVE")):
        if flag in flags:
            return name + (" + FMA" if name == "AVX2" and "fma" in flags else "")
    if "asimd" in flags or platform.machine().lower() in ("arm64", "aarch64"):
        return "NEON"
    if flags & {"sse2", "sse4_2"}:
        return "SSE"
    return "unknown"


def blas() -> str:
    """The BLAS torch links and its version (``MKL 2024.2``, ``OpenBLAS``), from its build
    configuration, with ``MKL_ENABLE_INSTRUCTIONS`` where it is set."""
    config = torch.__config__.show()
    mkl = re.search(r"Math Kernel Library Version ([\d.]+)", config)
    if torch.backends.mkl.is_available():
        name = "MKL" + (f" {mkl.group(1)}" if mkl else "")
        limit = os.environ.get("MKL_ENABLE_INSTRUCTIONS")
        return name + (f" (MKL_ENABLE_INSTRUCTIONS={limit})" if limit else "")
    info = re.search(r"BLAS_INFO=(\w+)", config)
    names = {"open": "OpenBLAS", "accelerate": "Accelerate", "blis": "BLIS", "flexi": "FlexiBLAS"}
    return names.get(info.group(1), info.group(1)) if info else "unknown"


def median_time(fn: Callable[[], object], *, repeats: int = 10, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` in seconds (CUDA-synchronised when a GPU is in use)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if sync:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
"""``wall``: elapsed time. ``cpu``: the CPU time of this process (all its threads), which on a
machine shared with other jobs excludes the time spent waiting for a core; with one thread it is
the most repeatable measure there, with several it also counts threads spinning at barriers."""


def interleaved_times(
    fns: dict[str, Callable[[], object]], *, repeats: int = 10, warmup: int = 1, clock: str = "wall"
) -> dict[str, list[float]]:
    """Times in seconds of each ``fns[name]()``, ``repeats`` each, measured round-robin.

    On a shared machine the load drifts over seconds; taking one repeat of every function in turn
    exposes all of them to the same drift, so their ratios stay meaningful even when the absolute
    times do not. ``warmup`` untimed calls of each come first. ``clock`` is a key of `CLOCKS`.
    """
    now = CLOCKS[clock]
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = now()
            fn()
            times[name].append(now() - t0)
    return times


def spread(seconds: list[float]) -> tuple[str, str, str]:
    """``(min, median, max)`` of wall times, formatted in milliseconds."""
    return ms(min(seconds)), ms(statistics.median(seconds)), ms(max(seconds))


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Exempt every object alive now from garbage collection (``gc.freeze``) until the block ends.

    The memory measurements collect garbage before each sample; in a process that has imported torch a
    full collection walks a few million objects (~0.3 s each, most of a small benchmark's time). Frozen,
    the collections walk only what the benchmark itself created since, which is what they are for."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def peak_memory_bytes(fn: Callable[[], object], device: str | torch.device = "cpu") -> int:
    """Peak memory growth while running ``fn()`` once.

    On CUDA this is ``max_memory_allocated`` growth. On CPU, PyTorch's allocator does not report
    peaks, so we sample the process's resident set in a background thread; the baseline is taken
    right before the call, so the number is the growth caused by ``fn``.
    """
    device = torch.device(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    return _cpu_peak_rss_growth(fn)


def memory_note(device: str | torch.device = "cpu") -> str:
    """How the peak-memory column was measured, for a benchmark's header.

    On CPU it is the growth of the resident set, which counts what the C allocator keeps after
    tensors are freed: glibc's default mmap threshold rises to the largest block freed so far, after
    which freed blocks below it stay with the process (reused, not returned). With
    ``MALLOC_MMAP_THRESHOLD_`` set in the environment (e.g. ``131072``) every large tensor is its own
    mapping and the growth is what the kernels hold at their peak."""
    if torch.device(device).type == "cuda":
        return "peak memory: growth of max_memory_allocated (tensors)"
    threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    if threshold:
        return f"peak memory: RSS growth, MALLOC_MMAP_THRESHOLD_={threshold} (what the tensors hold)"
    return (
        "peak memory: RSS growth, glibc's default allocator (includes freed memory it keeps; "
        "MALLOC_MMAP_THRESHOLD_=131072 measures what the tensors hold)"
    )


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _release_freed_memory() -> None:
    """Hand freed heap pages back to the OS so that the RSS baseline is honest."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: the baseline may then include cached pages
        pass


def _cpu_peak_rss_growth(fn: Callable[[], object]) -> int:
    import threading

    _release_freed_memory()
    base = _rss_bytes()
    peak = base
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _rss_bytes())
            time.sleep(0.0005)

    thread = threading.Thread(target=sample, daemon=True)
    tracemalloc.stop()  # never let Python-level tracing perturb the measurement
    thread.start()
    try:
        fn()
    finally:
        done.set()
        thread.join()
    return max(peak, _rss_bytes()) - base


def flag_names(argv: list[str]) -> list[str]:
    """The flags in ``argv`` (``--flag value`` or ``--flag=value``), in order."""
    return [arg.split("=", 1)[0] for arg in argv if arg.startswith("--")]


def flag_value(argv: list[str], flag: str) -> str | None:
    """The last value given to ``flag`` in ``argv`` (``--flag value`` or ``--flag=value``), or None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def git_revision(repo: Path) -> str:
    """A peer checkout's short commit, or ``""`` when it is not a git checkout."""
    if not (repo / ".git").exists():
        return ""
    done = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip() if done.returncode == 0 else ""


def ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.2f}"


def threads_note() -> str:
    """``"2 threads, subnormals flushed"``: the CPU settings a timing depends on
    (`geoattn.core.subnormals`)."""
    mode = "subnormals flushed" if subnormals_flushed() else "subnormals kept"
    return f"{torch.get_num_threads()} threads, {mode}"


def allow_recompiles(graphs: int) -> None:
    """Let dynamo keep ``graphs`` compiled graphs per code object (benchmark variants share code:
    blocks, attention kernels) rather than fall back to eager after its default limit of 8."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), graphs))


def profile_events(fn: Callable[[], object], calls: int = 3):
    """torch.profiler's per-operator averages (CPU) over ``calls`` calls of ``fn``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
    return prof.key_averages()


def operator_table(events, calls: int, top: int = 12, exclude: tuple[str, ...] = ()) -> str:
    """The ``top`` operators of `profile_events` by self time, in ms per call (profiler overhead
    included), leaving out the labels in ``exclude`` (e.g. phases recorded around them)."""
    ops = sorted((e for e in events if e.key not in exclude), key=lambda e: -e.self_cpu_time_total)[:top]
    rows = [[e.key[:60], f"{e.self_cpu_time_total / calls / 1e3:.2f}", e.count // calls] for e in ops]
    return format_table(["operator", "self ms", "calls"], rows)
