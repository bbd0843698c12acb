"""RT-Filter attention kernels vs PyTorch SDPA: forward and forward+backward time and peak memory.

Causal, B = 1, float32, for each N: plain causal ``scaled_dot_product_attention`` on the same
shapes (the peer), `rt_attention` on each of its structures (``separable``: σ_t² = 0; ``tied``:
σ_t² = 2 μ_r η_t²; ``general``: free process noise, whose four parameters also receive gradients, as
in training) and the N×N reference where it fits. With the default times on the CPU every structure
runs the native kernel (`geoattn.native`); with ``GEOATTN_NATIVE=0`` (or where it cannot be
built) the chunked path, on CUDA FlexAttention (`geoattn.attention.rt.dispatch`). The header says which.

Keys are drawn as a trained model's are spread: each key is a Gaussian vector scaled by a factor
uniform in [0.5, 2.5] (``--key-spread 0.5 2.5``), so the precision κ = |k|²/η_t² spans more than an
order of magnitude; the table's header prints the spread. The rows marked ``unit keys`` repeat two
paths with unscaled Gaussian keys, to show whether a path's cost depends on the data.

All kernels of one N are timed round-robin (one call of each in turn, `interleaved_times`), and the
table reports min / median / max over ``--repeats`` calls and ratios of medians against SDPA from
the same run. Peak memory is the growth of the process during one forward+backward.
``--compile on`` times the rt fast paths through ``torch.compile``, as a compiled model runs them (at
small N the eager calls' fixed costs dominate); SDPA, one fused operator already, stays eager, so the
ratios include the compiled wrapper's own fixed cost. ``--profile`` adds, per N, the operators with
the most self time in one forward+backward of SDPA and of each rt fast path (`torch.profiler`).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from geoattn import native
from geoattn.algebra.rotation import rope_frequencies
from geoattn.attention.rt import rt_attention
from geoattn.bench.common import (
    CLOCKS,
    allow_recompiles,
    interleaved_times,
    memory_note,
    ms,
    operator_table,
    peak_memory_bytes,
    profile_events,
    spread,
    threads_note,
)
from geoattn.core.errors import ConfigError
from geoattn.core.formatting import format_table

# The reference holds ~10 (B, H, N, N) tensors through backward; above this it is skipped.
_REFERENCE_MAX_BYTES = 2 << 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096], help="sequence lengths N")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per cell (min/median/max)")
    parser.add_argument(
        "--key-spread",
        type=float,
        nargs=2,
        default=[0.5, 2.5],
        metavar=("LOW", "HIGH"),
        help="each key is a Gaussian vector times a factor uniform in [LOW, HIGH] (trained-model-like)",
    )
    parser.add_argument(
        "--compile",
        choices=["off", "on"],
        default="off",
        help="on: the rt fast paths through torch.compile, as in a compiled model (SDPA and the "
        "reference stay eager); the first, untimed call compiles",
    )
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall", help="wall time or process CPU time")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: PyTorch's choice)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also print a torch.profiler breakdown of one forward+backward of SDPA and of each rt fast "
        "path (trained-like keys), at each N",
    )


@dataclass
class Kernel:
    """One row: ``fn(q, k, v) -> out`` on the given keys, and the extra leaves whose gradients it needs."""

    name: str
    keys: str
    fn: Callable[[list[torch.Tensor]], torch.Tensor] | None
    trainable: list[torch.Tensor] = field(default_factory=list)
    skipped: str = ""


def run(args: argparse.Namespace) -> int:
    if args.head_dim % 2 or args.head_dim < 2:
        raise ConfigError(f"--head-dim must be even, got {args.head_dim}")
    if min(args.sizes) < 1 or args.heads < 1 or args.repeats < 1:
        raise ConfigError("--sizes, --heads and --repeats must be positive")
    low, high = args.key_spread
    if not 0 < low <= high:
        raise ConfigError(f"--key-spread needs 0 < LOW <= HIGH, got {low} {high}")
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads must be positive, got {args.threads}")
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    headers = [
        "N",
        "kernel",
        "keys",
        "fwd ms",
        "fwd+bwd min",
        "median",
        "max",
        "fwd / SDPA",
        "fwd+bwd / SDPA",
        "peak MB",
    ]
    rows, stats, profiles = [], [], []
    for n in args.sizes:
        size_rows, key_stats, size_profiles = _measure_size(n, args, device)
        rows += size_rows
        stats.append(f"N = {n}: {key_stats}")
        profiles += size_profiles
    print(
        f"attention kernels, B = 1, H = {args.heads}, D = {args.head_dim}, causal, float32, "
        f"{args.device}, {'rt compiled, ' if args.compile == 'on' else ''}{args.repeats} calls each "
        f"round-robin ({args.clock} clock), "
        f"{threads_note()}"
    )
    print(f"rt paths: {_paths_note(device)}")
    print("keys (|k|, and κ = |k|²/η_t² with η_t² = 1): " + "; ".join(stats))
    print(memory_note(device))
    print(format_table(headers, rows))
    for profile in profiles:
        print("\n" + profile)
    return 0


def _paths_note(device: torch.device) -> str:
    if device.type == "cuda":
        return "FlexAttention for every structure"
    if native.available():
        return "the native CPU kernel for every structure (GEOATTN_NATIVE=0: the chunked path)"
    return "the chunked path for every structure (the native kernel is not built)"


def _keys(g: torch.Generator, shape: tuple[int, ...], spread_: tuple[float, float], device) -> torch.Tensor:
    low, high = spread_
    k = torch.randn(*shape, generator=g, device=device)
    return k * (low + (high - low) * torch.rand(*shape[:-1], 1, generator=g, device=device))


def _key_stats(k: torch.Tensor) -> str:
    norm = torch.linalg.vector_norm(k, dim=-1).flatten().float()
    q = torch.quantile(norm.cpu(), torch.tensor([0.0, 0.5, 1.0])).tolist()
    return f"|k| {q[0]:.1f} / {q[1]:.1f} / {q[2]:.1f} (min / median / max), κ up to {q[2] ** 2:.0f}"


def _measure_size(n: int, args: argparse.Namespace, device: torch.device) -> tuple[list[list[object]], str]:
    h, d = args.heads, args.head_dim
    g = torch.Generator(device=device).manual_seed(0)
    q, v = (torch.randn(1, h, n, d, generator=g, device=device) for _ in range(2))
    trained = _keys(g, (1, h, n, d), tuple(args.key_spread), device)
    unit = torch.randn(1, h, n, d, generator=g, device=device)
    inputs = {"trained": [q, trained, v], "unit": [q, unit, v]}
    omega = rope_frequencies(d, h).to(device)
    mu_r = torch.full((h,), 0.02, device=device)
    eta_t2 = torch.ones(h, device=device)
    beta = torch.ones(h, device=device)
    general = torch.full((h,), 0.1, device=device)
    zero = torch.zeros(h, device=device)

    def rt(structure, sigma_t2, backend="auto"):
        trainable = structure == "general"
        params = [p.clone().requires_grad_(trainable) for p in (mu_r, sigma_t2, eta_t2, beta)]
        names = ("mu_r", "sigma_t2", "eta_t2", "beta")

        def fn(x):
            kwargs = dict(zip(names, params))
            return rt_attention(*x, **kwargs, omega=omega, backend=backend, structure=structure)

        return fn, params if trainable else []

    kernels = [Kernel("SDPA (peer)", "trained", lambda x: F.scaled_dot_product_attention(*x, is_causal=True))]
    for name, structure, sigma_t2 in (
        ("rt σ_t²=0", "separable", zero),
        ("rt tied 2μη²", "tied", 2 * mu_r * eta_t2),
        ("rt general", "general", general),
    ):
        kernels.append(Kernel(name, "trained", *rt(structure, sigma_t2)))
    for name, structure, sigma_t2 in (("rt σ_t²=0", "separable", zero), ("rt general", "general", general)):
        kernels.append(Kernel(name, "unit", *rt(structure, sigma_t2)))
    reference_bytes = 10 * h * n * n * 4
    if reference_bytes <= _REFERENCE_MAX_BYTES:
        kernels.append(Kernel("rt reference", "trained", *rt("general", general, "reference")))
    else:
        kernels.append(
            Kernel("rt reference", "trained", None, skipped=f"skipped: ~{reference_bytes / 2**30:.0f} GB")
        )

    if args.compile == "on":  # the rt fast paths; the peer is already one fused op (compiling it
        # only adds the compiled wrapper's fixed cost, large at small N), the oracle is no fast path
        allow_recompiles(4 * len(kernels))  # the rt rows share one code object
        for kernel in kernels:
            if kernel.fn is not None and kernel.name not in ("SDPA (peer)", "rt reference"):
                kernel.fn = torch.compile(kernel.fn)
    forward, forward_backward = {}, {}
    for i, kernel in enumerate(kernels):
        if kernel.fn is None:
            continue
        leaves = [t.clone().requires_grad_() for t in inputs[kernel.keys]]

        def fwd(fn=kernel.fn, leaves=leaves):
            with torch.no_grad():
                fn(leaves)

        def fwd_bwd(fn=kernel.fn, leaves=leaves, extra=kernel.trainable):
            fn(leaves).sum().backward()
            for t in (*leaves, *extra):
                t.grad = None

        forward[i], forward_backward[i] = fwd, fwd_bwd
    fwd_times = interleaved_times(forward, repeats=args.repeats, warmup=1, clock=args.clock)
    bwd_times = interleaved_times(forward_backward, repeats=args.repeats, warmup=1, clock=args.clock)
    base_fwd, base_bwd = statistics.median(fwd_times[0]), statistics.median(bwd_times[0])
    profiles = []
    if args.profile:  # the peer and the rt fast paths on trained-like keys
        for i, kernel in enumerate(kernels):
            if kernel.keys == "trained" and kernel.name != "rt reference" and kernel.fn is not None:
                table = operator_table(profile_events(forward_backward[i]), 3, top=10)
                head = f"profile: N = {n}, {kernel.name}, forward+backward (ms per call, profiler overhead"
                profiles.append(f"{head} included)\n{table}")
    rows = []
    for i, kernel in enumerate(kernels):
        keys = "unit keys" if kernel.keys == "unit" else "trained-like"
        if kernel.fn is None:
            rows.append([n, kernel.name, keys, kernel.skipped, "", "", "", "", "", ""])
            continue
        peak = peak_memory_bytes(forward_backward[i], device)
        fwd_med, bwd_med = statistics.median(fwd_times[i]), statistics.median(bwd_times[i])
        rows.append(
            [
                n,
                kernel.name,
                keys,
                ms(fwd_med),
                *spread(bwd_times[i]),
                f"{fwd_med / base_fwd:.2f}",
                f"{bwd_med / base_bwd:.2f}",
                f"{peak / 2**20:.0f}",
            ]
        )
    return rows, _key_stats(trained), profiles
