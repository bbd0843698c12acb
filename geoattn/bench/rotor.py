"""rotor attention: reference vs auto vs SDPA of the same width per head type (Cl(3), fwd and fwd+bwd)

For each head type and sequence length N: ``rotor_attention`` on q, k, v of shape ``(1, H, N, C, 8)``,
backend ``reference`` (naive pairwise) and ``auto`` (fast exact), against
``scaled_dot_product_attention`` on ``(1, H, N, C·8)`` tensors (the same width). Medians over
``--repeats`` runs after a warm-up, peak memory growth of one run, and the ratios auto/SDPA and
reference/auto measured in the same run. The reference is skipped (and the cell says why) where its
pairwise tensors would be too large or slow.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from geoattn.algebra.clifford_algebra import CliffordAlgebra
from geoattn.attention.rotor_kernel import HEAD_TYPES, rotor_attention
from geoattn.bench.common import median_time, ms, peak_memory_bytes
from geoattn.errors import ConfigError
from geoattn.formatting import format_table

# the reference builds (H, block, N, C, 8) products block by block: beyond these N it takes minutes
REFERENCE_MAX_N = {"forward": 512, "forward+backward": 256}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 512, 2048], help="sequence lengths N")
    parser.add_argument("--channels", type=int, default=16, help="multivector channels C per head (q, k, v)")
    parser.add_argument("--heads", type=int, default=4, help="heads H")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per cell (median)")
    parser.add_argument(
        "--head-types", nargs="+", default=list(HEAD_TYPES), choices=HEAD_TYPES, help="head types to measure"
    )
    parser.add_argument("--device", default="cpu", help="torch device")


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


def _warm_reference(ga: CliffordAlgebra, heads, H: int, C: int, device: torch.device) -> None:
    """Run the reference once, forward and backward, at N = 64: large engine calls go through its
    compiled kernels, whose one-off compilation must not land in a timed run."""
    q, k, v = (torch.randn(1, H, 64, C, 8, device=device, requires_grad=True) for _ in range(3))
    for head in heads:
        rotor_attention(q, k, v, algebra=ga, head_type=head, backend="reference").sum().backward()


def _kernel(ga: CliffordAlgebra, head: str, backend: str):
    return lambda q, k, v: rotor_attention(q, k, v, algebra=ga, head_type=head, backend=backend)


def _measure(fn, inputs, backward: bool, repeats: int, warmup: int = 1) -> tuple[float, float]:
    step = _step(fn, inputs, backward)
    seconds = median_time(step, repeats=repeats, warmup=warmup)
    peak = peak_memory_bytes(step, inputs[0].device)
    return seconds, peak / 2**20


def run(args: argparse.Namespace) -> int:
    for name in ("channels", "heads", "repeats"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be ≥ 1, got {getattr(args, name)}")
    if any(n < 1 for n in args.sizes):
        raise ConfigError(f"--sizes must be positive, got {args.sizes}")
    device = torch.device(args.device)
    ga = CliffordAlgebra(3)
    H, C = args.heads, args.channels
    print(
        f"rotor attention, Cl(3), B=1, H={H}, C={C} (width C·8 = {8 * C}), float32, {device}, torch threads="
        f"{torch.get_num_threads()}; medians of {args.repeats}, times in ms, peak memory growth in MiB"
    )
    _warm_reference(ga, args.head_types, H, C, device)
    for mode in ("forward", "forward+backward"):
        backward = mode == "forward+backward"
        rows = []
        for n in args.sizes:
            g = torch.Generator().manual_seed(n)
            q, k, v = (
                torch.randn(1, H, n, C, 8, generator=g).to(device).requires_grad_(backward) for _ in range(3)
            )
            flat = [x.detach().flatten(-2).requires_grad_(backward) for x in (q, k, v)]
            for head in args.head_types:
                # SDPA again for every row: ratios compare runs made at the same moment on a busy machine
                sdpa_s, sdpa_mb = _measure(F.scaled_dot_product_attention, flat, backward, args.repeats)
                auto_s, auto_mb = _measure(_kernel(ga, head, "auto"), [q, k, v], backward, args.repeats)
                if n <= REFERENCE_MAX_N[mode]:
                    ref = _kernel(ga, head, "reference")
                    # seconds per call, nothing to warm up: at most two timed runs
                    ref_s, ref_mb = _measure(ref, [q, k, v], backward, min(args.repeats, 2), warmup=0)
                    ref_cells = [ms(ref_s), f"{ref_s / auto_s:.1f}", f"{ref_mb:.0f}"]
                else:
                    ref_cells = [f"skipped (N > {REFERENCE_MAX_N[mode]})", "n/a", "n/a"]
                rows.append(
                    [head, n, ms(sdpa_s), ms(auto_s), ref_cells[0], f"{auto_s / sdpa_s:.2f}", ref_cells[1],
                     f"{sdpa_mb:.0f}", f"{auto_mb:.0f}", ref_cells[2]]
                )  # fmt: skip
        headers = ["head", "N", "SDPA", "auto", "reference", "auto/SDPA", "reference/auto", "SDPA MiB",
                   "auto MiB", "reference MiB"]  # fmt: skip
        print(f"\n{mode}\n")
        print(format_table(headers, rows))
    return 0
