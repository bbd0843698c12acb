"""rotor attention: reference vs auto vs SDPA of the same width per head type (Cl(3), fwd and fwd+bwd)

For each head type and sequence length N: ``rotor_attention`` on q, k, v of shape ``(1, H, N, C, 8)``,
backend ``reference`` (naive pairwise) and ``auto`` (fast exact), against
``scaled_dot_product_attention`` on ``(1, H, N, C·8)`` tensors (the same width). The row ``compose``
is a rotation head with ``aggregation="compose"`` (docs/concepts/rotors.md#compose). SDPA and auto are timed
round-robin (one call of each in turn, so both see the same load on a shared machine): min / median / max over
``--repeats`` calls after a warm-up, the ratio of the medians, and the peak memory growth of one call.
The reference (at most two calls, ratio reference/auto) is skipped where its pairwise tensors would
be too large or slow, and the cell says why. ``--profile`` adds, per N and head type, the operators
with the most self time in one forward+backward of auto and of SDPA (`torch.profiler`).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from geoattn.algebra.clifford_algebra import CliffordAlgebra
from geoattn.attention.rotor import rotor_attention
from geoattn.attention.rotor.heads import head_type_names
from geoattn.bench.common import (
    CLOCKS,
    interleaved_times,
    median_time,
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

# the reference builds (H, block, N, C, 8) products block by block: beyond these N it takes minutes
REFERENCE_MAX_N = {"forward": 512, "forward+backward": 256}
ROWS = (*head_type_names(), "compose")  # compose: a rotation head aggregating by rotor composition


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 512, 2048], help="sequence lengths N")
    parser.add_argument("--channels", type=int, default=16, help="multivector channels C per head (q, k, v)")
    parser.add_argument("--heads", type=int, default=4, help="heads H")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per cell (min / median / max)")
    parser.add_argument(
        "--head-types",
        nargs="+",
        default=list(ROWS),
        choices=ROWS,
        help="rows to measure (compose: a rotation head with aggregation='compose')",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument(
        "--clock", default="wall", choices=sorted(CLOCKS), help="wall time or this process's CPU time"
    )
    parser.add_argument("--device", default="cpu", help="torch device")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also print a torch.profiler breakdown of one forward+backward of auto and of SDPA, per N and "
        "head type",
    )


def _step(fn, inputs, backward: bool):
    def run():
        if not backward:
            with torch.no_grad():
                fn(*inputs)
            return
        out = fn(*inputs)
        out.backward(torch.ones_like(out))
        for x in inputs:
            x.grad = None

    return run


def _kernel(ga: CliffordAlgebra, row: str, backend: str):
    head, aggregation = ("rotation", "compose") if row == "compose" else (row, "sum")
    return lambda q, k, v: rotor_attention(
        q, k, v, algebra=ga, head_type=head, backend=backend, aggregation=aggregation
    )


def _warm_reference(ga: CliffordAlgebra, rows, H: int, C: int, n: int, device: torch.device) -> None:
    """Run the reference once, forward and backward, at N = n (the caller: 64, or the largest size
    measured if smaller): large engine calls go through its compiled kernels, whose one-off compilation
    must not land in a timed run; a warm-up larger than every timed call would compile kernels that
    none of them uses."""
    q, k, v = (torch.randn(1, H, n, C, 8, device=device, requires_grad=True) for _ in range(3))
    for row in rows:
        _kernel(ga, row, "reference")(q, k, v).sum().backward()


def _memory_mib(fn, inputs, backward: bool) -> float:
    return peak_memory_bytes(_step(fn, inputs, backward), inputs[0].device) / 2**20


def run(args: argparse.Namespace) -> int:
    for name in ("channels", "heads", "repeats"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be ≥ 1, got {getattr(args, name)}")
    if any(n < 1 for n in args.sizes):
        raise ConfigError(f"--sizes must be positive, got {args.sizes}")
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads must be ≥ 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    ga = CliffordAlgebra(3)
    H, C = args.heads, args.channels
    print(
        f"rotor attention, Cl(3), B=1, H={H}, C={C} (width C·8 = {8 * C}), float32, {device}, torch "
        f"{torch.__version__}, {threads_note()}, {args.clock} clock; SDPA and auto timed "
        f"round-robin, {args.repeats} calls each: min / median / max in ms, ratio of medians; peak memory "
        "growth of one call in MiB"
    )
    print(memory_note(device))
    _warm_reference(ga, args.head_types, H, C, min(64, max(args.sizes)), device)
    profiles = []
    for mode in ("forward", "forward+backward"):
        backward = mode == "forward+backward"
        rows = []
        for n in args.sizes:
            g = torch.Generator().manual_seed(n)
            q, k, v = (
                torch.randn(1, H, n, C, 8, generator=g).to(device).requires_grad_(backward) for _ in range(3)
            )
            flat = [x.detach().flatten(-2).requires_grad_(backward) for x in (q, k, v)]
            for row in args.head_types:
                # SDPA again for every row, interleaved with it: ratios of calls made at the same moment
                steps = {
                    "sdpa": _step(F.scaled_dot_product_attention, flat, backward),
                    "auto": _step(_kernel(ga, row, "auto"), [q, k, v], backward),
                }
                times = interleaved_times(steps, repeats=args.repeats, warmup=1, clock=args.clock)
                if args.profile and backward:
                    for name, step in (("auto", steps["auto"]), ("SDPA", steps["sdpa"])):
                        table = operator_table(profile_events(step), 3, top=10)
                        profiles.append(f"profile: N = {n}, {row}, {name}, forward+backward (ms per call, "
                                        f"profiler overhead included)\n{table}")  # fmt: skip
                sdpa_s, auto_s = (statistics.median(times[key]) for key in ("sdpa", "auto"))
                sdpa_mb = _memory_mib(F.scaled_dot_product_attention, flat, backward)
                auto_mb = _memory_mib(_kernel(ga, row, "auto"), [q, k, v], backward)
                if n <= REFERENCE_MAX_N[mode]:
                    ref = _step(_kernel(ga, row, "reference"), [q, k, v], backward)
                    # seconds per call, nothing to warm up: at most two timed calls
                    ref_s = median_time(ref, repeats=min(args.repeats, 2), warmup=0)
                    ref_mb = _memory_mib(_kernel(ga, row, "reference"), [q, k, v], backward)
                    ref_cells = [ms(ref_s), f"{ref_s / auto_s:.1f}", f"{ref_mb:.0f}"]
                else:
                    ref_cells = [f"skipped (N > {REFERENCE_MAX_N[mode]})", "n/a", "n/a"]
                rows.append(
                    [row, n, " / ".join(spread(times["sdpa"])), " / ".join(spread(times["auto"])),
                     f"{auto_s / sdpa_s:.2f}", ref_cells[0], ref_cells[1], f"{sdpa_mb:.0f}", f"{auto_mb:.0f}",
                     ref_cells[2]]
                )  # fmt: skip
        headers = ["head", "N", "SDPA min / med / max", "auto min / med / max", "auto/SDPA", "reference",
                   "reference/auto", "SDPA MiB", "auto MiB", "reference MiB"]  # fmt: skip
        print(f"\n{mode}\n")
        print(format_table(headers, rows))
    for profile in profiles:
        print("\n" + profile)
    return 0
