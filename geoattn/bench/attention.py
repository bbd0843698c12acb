"""RT-Filter attention kernels vs PyTorch SDPA: forward and forward+backward time and peak memory.

Causal, B = 1, float32, for each N: plain causal ``scaled_dot_product_attention`` on the same
shapes (the peer), `rt_attention` on its three paths (σ_t² = 0 → SDPA with folded keys; the tied
family σ_t² = 2 μ_r η_t² → chunked SDPA; general process noise → the blockwise kernel, whose
four parameters also receive gradients, as in training) and the N×N reference where it fits.
Medians over ``--repeats`` runs; ratios are against SDPA measured in the same run.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from geoattn.algebra.rotation import rope_frequencies
from geoattn.attention.rt_kernel import rt_attention
from geoattn.bench.common import median_time, ms, peak_memory_bytes
from geoattn.errors import ConfigError
from geoattn.formatting import format_table

# The reference holds ~10 (B, H, N, N) tensors through backward; above this it is skipped.
_REFERENCE_MAX_BYTES = 2 << 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096], help="sequence lengths N")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per cell (median)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: PyTorch's choice)")


def run(args: argparse.Namespace) -> int:
    if args.head_dim % 2 or args.head_dim < 2:
        raise ConfigError(f"--head-dim must be even, got {args.head_dim}")
    if min(args.sizes) < 1 or args.heads < 1 or args.repeats < 1:
        raise ConfigError("--sizes, --heads and --repeats must be positive")
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads must be positive, got {args.threads}")
        torch.set_num_threads(args.threads)
    headers = ["N", "kernel", "fwd ms", "fwd+bwd ms", "fwd / SDPA", "fwd+bwd / SDPA", "fwd+bwd peak MB"]
    rows = []
    for n in args.sizes:
        rows += _measure_size(n, args.heads, args.head_dim, args.repeats, torch.device(args.device))
    print(
        f"attention kernels, B = 1, H = {args.heads}, D = {args.head_dim}, causal, float32, "
        f"{args.device}, median of {args.repeats}, {torch.get_num_threads()} threads"
    )
    print(format_table(headers, rows))
    return 0


def _measure_size(n: int, h: int, d: int, repeats: int, device: torch.device) -> list[list[object]]:
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, h, n, d, generator=g, device=device) for _ in range(3))
    k = k * (0.5 + 2 * torch.rand(1, h, n, 1, generator=g, device=device))
    omega = rope_frequencies(d, h).to(device)
    mu_r = torch.full((h,), 0.02, device=device)
    eta_t2 = torch.ones(h, device=device)
    beta = torch.ones(h, device=device)
    variants: dict[str, Callable[[list[torch.Tensor]], torch.Tensor] | str] = {
        "SDPA (peer)": lambda x: F.scaled_dot_product_attention(*x[:3], is_causal=True),
    }
    for name, sigma_t2, trainable in (
        ("rt σ_t²=0", torch.zeros(h, device=device), False),
        ("rt tied 2μη²", 2 * mu_r * eta_t2, False),
        ("rt general", torch.full((h,), 0.1, device=device), True),
    ):
        variants[name] = _rt(mu_r, sigma_t2, eta_t2, beta, omega, "auto", trainable)
    reference_bytes = 10 * h * n * n * 4
    variants["rt reference"] = (
        _rt(mu_r, torch.full((h,), 0.1, device=device), eta_t2, beta, omega, "reference", True)
        if reference_bytes <= _REFERENCE_MAX_BYTES
        else f"skipped: ~{reference_bytes / 2**30:.0f} GB of N×N"
    )

    rows, base = [], None
    for name, fn in variants.items():
        if isinstance(fn, str):
            rows.append([n, name, fn, "", "", "", ""])
            continue
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        extra = getattr(fn, "trainable", [])

        def forward(fn=fn, leaves=leaves):
            with torch.no_grad():
                fn(leaves)

        def forward_backward(fn=fn, leaves=leaves, extra=extra):
            fn(leaves).sum().backward()
            for t in (*leaves, *extra):
                t.grad = None

        fwd = median_time(forward, repeats=repeats, warmup=1)
        fwd_bwd = median_time(forward_backward, repeats=repeats, warmup=1)
        peak = peak_memory_bytes(forward_backward, device)
        base = base or (fwd, fwd_bwd)
        rows.append(
            [
                n,
                name,
                ms(fwd),
                ms(fwd_bwd),
                f"{fwd / base[0]:.2f}",
                f"{fwd_bwd / base[1]:.2f}",
                f"{peak / 2**20:.0f}",
            ]
        )
    return rows


def _rt(mu_r, sigma_t2, eta_t2, beta, omega, backend, trainable):
    params = [p.clone().requires_grad_(trainable) for p in (mu_r, sigma_t2, eta_t2, beta)]

    def fn(x):
        return rt_attention(
            *x[:3],
            mu_r=params[0],
            sigma_t2=params[1],
            eta_t2=params[2],
            beta=params[3],
            omega=omega,
            backend=backend,
        )

    fn.trainable = params if trainable else []
    return fn
