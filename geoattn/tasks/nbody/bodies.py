"""What every n-body network reads and is scored by: the inputs' layout, the centroid, the pairs'
relative geometry and the position MSE (the rotor, Clifford, EGNN and Transformer models share them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def centroid(x: Tensor) -> Tensor:
    """Mean position over bodies ``(B, 1, 3)`` of ``x`` ``(B, n, 3)``."""
    return x.mean(1, keepdim=True)


def pair_invariants(x: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Relative positions and velocities ``x_ij = x_i − x_j``, ``v_ij`` ``(B, n, n, 3)`` and their
    invariants ``|x_ij|², x_ij · v_ij, |v_ij|²`` ``(B, n, n, 3)``, of ``x`` and ``v`` ``(B, n, 3)``."""
    dx = x[:, :, None] - x[:, None, :]
    dv = v[:, :, None] - v[:, None, :]
    return dx, dv, torch.stack(((dx * dx).sum(-1), (dx * dv).sum(-1), (dv * dv).sum(-1)), -1)


def other_bodies(n: int, device: torch.device | str = "cpu") -> Tensor:
    """``(n, n − 1)`` long: row i lists the bodies j ≠ i in order, so ``f[:, others]`` of a per-body
    ``f (B, n, ...)`` is ``f_j`` of every ordered pair ``(B, n, n − 1, ...)`` without the self-pairs."""
    j = torch.arange(n - 1, device=device)
    return j + (j[None, :] >= torch.arange(n, device=device)[:, None]).long()


def mean_over_others(n: int, like: Tensor) -> Tensor:
    """``(1, n, n, 1)`` weights of a mean over j ≠ i."""
    return (~torch.eye(n, dtype=torch.bool, device=like.device))[None, :, :, None].to(like.dtype) / (n - 1)


def check_inputs(x: Tensor) -> None:
    """ValueError unless ``x`` is ``(B, n, 7)`` = [scalar, position, velocity] per body."""
    if x.dim() != 3 or x.shape[-1] != 7:
        raise ValueError(f"x has shape {tuple(x.shape)}, expected (B, n, 7) = [mass, position, velocity]")


def position_mse(prediction: Tensor, y: Tensor | None) -> Tensor | None:
    """MSE of the predicted final positions against ``y`` (same shape, else ValueError); None without y."""
    if y is None:
        return None
    if y.shape != prediction.shape:
        raise ValueError(f"y has shape {tuple(y.shape)}, expected {tuple(prediction.shape)}")
    return F.mse_loss(prediction.float(), y.float())
