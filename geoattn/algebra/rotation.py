"""The pairwise plane rotation shared by RoPE, RT transport R(Δt) and the 2D rotor encoding.

One concept, one place: every rotation of coordinate pairs in geoattn goes through `rotate_pairs`.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rotate_pairs(x: Tensor, angle: Tensor) -> Tensor:
    """Rotate consecutive coordinate pairs of ``x`` by ``angle``.

    Pair ``(2k, 2k+1)`` maps to ``(cos·x₀ − sin·x₁, sin·x₀ + cos·x₁)`` with the angle of pair k.

    Args:
        x: ``(..., D)`` with D even.
        angle: ``(..., D/2)``, broadcastable against ``x[..., ::2]`` (e.g. ``omega * t``).

    Returns:
        ``(..., D)``, the rotated tensor, same dtype as ``x``.
    """
    if x.shape[-1] % 2:
        raise ValueError(f"rotate_pairs needs an even last dimension, got shape {tuple(x.shape)}")
    if angle.shape[-1] != x.shape[-1] // 2:
        raise ValueError(
            f"angle has last dimension {angle.shape[-1]}, expected D/2 = {x.shape[-1] // 2} for x of shape "
            f"{tuple(x.shape)}"
        )
    cos, sin = torch.cos(angle).to(x.dtype), torch.sin(angle).to(x.dtype)
    if not torch.compiler.is_compiling() and _complex_view_ok(x):
        # eager: the pair as one complex number times e^{iθ}, one kernel each way instead of the
        # strided halves' four products and a stack (the RoPE transformer's step: ~10 % less)
        z = torch.view_as_complex(x.unflatten(-1, (-1, 2))) * torch.complex(cos, sin)
        return torch.view_as_real(z).flatten(-2)
    if torch.compiler.is_compiling():
        # the same products and sums over whole rows, ``x ⊙ (c, c) + swap(x) ⊙ (−s, s)``: inductor
        # vectorises this along D, but generates scalar loops for the stack of strided halves below
        cos_d = torch.stack((cos, cos), dim=-1).flatten(-2)
        sin_d = torch.stack((-sin, sin), dim=-1).flatten(-2)
        return x * cos_d + x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2) * sin_d
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((cos * x0 - sin * x1, sin * x0 + cos * x1), dim=-1).flatten(-2)


def _complex_view_ok(x: Tensor) -> bool:
    """Whether ``x (..., D)`` can be viewed as ``(..., D/2)`` complex numbers without a copy."""
    return (
        x.dtype in (torch.float32, torch.float64)
        and x.stride(-1) == 1
        and x.storage_offset() % 2 == 0
        and all(s % 2 == 0 for s in x.stride()[:-1])
    )


def rope_angles(positions: Tensor, omega: Tensor) -> Tensor:
    """Angles ``omega[h, k] · t`` for every head, position and pair.

    Args:
        positions: ``(N,)`` or ``(B, N)`` float times.
        omega: ``(H, D/2)`` angular frequencies.

    Returns:
        ``(1, H, N, D/2)`` or ``(B, H, N, D/2)``, ready to broadcast against ``(B, H, N, D)`` tensors.
    """
    if omega.dim() != 2:
        raise ValueError(f"omega must have shape (H, D/2), got {tuple(omega.shape)}")
    t = positions if positions.dim() == 2 else positions.unsqueeze(0)  # (B|1, N)
    # at least float32: a bf16 time is exact only up to 256 (positions 257 and 259 would round)
    dtype = torch.promote_types(omega.dtype, torch.float32)
    return t[:, None, :, None].to(dtype) * omega.to(dtype)[None, :, None, :]


def rope_frequencies(head_dim: int, n_heads: int = 1, base: float = 10000.0) -> Tensor:
    """The standard RoPE spectrum ``base^(−2k/D)``, ``(n_heads, D/2)``."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head dimension, got {head_dim}")
    k = torch.arange(head_dim // 2, dtype=torch.float32)
    return (base ** (-2.0 * k / head_dim)).expand(n_heads, -1).clone()
