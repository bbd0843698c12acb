"""Small pieces every attention layer shares: input checks, head splitting, positions, nGPT scales.

Shapes: ``B`` batch, ``T`` tokens, ``C`` model width, ``H`` heads, ``D = C / H`` head width.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def default_positions(x: Tensor, positions: Tensor | None) -> Tensor:
    """Token times ``(T,)`` or ``(B, T)`` for ``x`` ``(B, T, C)``; ``arange(T)`` if ``positions`` is None."""
    B, T = x.shape[0], x.shape[1]
    if positions is None:
        return torch.arange(T, device=x.device, dtype=torch.float32)
    if positions.shape not in ((T,), (B, T)):
        raise ValueError(f"positions has shape {tuple(positions.shape)}, expected ({T},) or ({B}, {T})")
    return positions


def check_input(x: Tensor, n_embd: int, name: str = "x") -> None:
    """Raise a ValueError unless ``x`` is ``(B, T, n_embd)``."""
    if x.dim() != 3 or x.shape[-1] != n_embd:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected (B, T, {n_embd})")


def split_heads(x: Tensor, n_head: int) -> Tensor:
    """``(B, T, H·D)`` → ``(B, H, T, D)``."""
    B, T, C = x.shape
    return x.view(B, T, n_head, C // n_head).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """``(B, H, T, D)`` → ``(B, T, H·D)``."""
    B, H, T, D = x.shape
    return x.transpose(1, 2).reshape(B, T, H * D)


def causal_softmax(logits: Tensor, causal: bool) -> Tensor:
    """Softmax over the last axis of ``(..., T, T)`` logits, masking keys after the query if ``causal``."""
    if causal:
        T = logits.shape[-1]
        mask = torch.ones(T, T, dtype=torch.bool, device=logits.device).tril()
        logits = logits.masked_fill(~mask, float("-inf"))
    return logits.softmax(dim=-1)


def swiglu_hidden(n_embd: int) -> int:
    """SwiGLU width matched to a 4× GELU MLP (3·C·h = 8·C²), rounded to a multiple of 4: 340 at C=128."""
    return 4 * round(8 * n_embd / 3 / 4)


@torch.no_grad()
def normalize_(weight: Tensor, dim: int) -> None:
    """Renormalise ``weight`` in place to unit norm along ``dim`` (nGPT's weight projection).

    The same result as ``F.normalize`` (a norm below 1e-12 counts as 1e-12), in three in-place
    operations: it runs for every matrix after every optimiser step.
    """
    weight.div_(torch.linalg.vector_norm(weight, dim=dim, keepdim=True).clamp_min_(1e-12))


class ScaledVector(nn.Module):
    """A learnable vector in nGPT's parameterisation: stored as ``scale``, used as ``stored · init / scale``.

    At initialisation the effective value is ``init``; Adam moves the stored value by about ``lr`` per
    step, so the effective value moves by ``lr · init / scale``: ``scale`` sets the effective learning
    rate of the vector independently of the optimiser's global rate.
    """

    def __init__(self, size: int, init: float, scale: float):
        super().__init__()
        if init <= 0 or scale <= 0:
            raise ValueError(f"ScaledVector needs init > 0 and scale > 0, got init={init}, scale={scale}")
        self.init, self.scale = init, scale
        self.weight = nn.Parameter(torch.full((size,), scale))

    def forward(self) -> Tensor:
        """The effective vector ``(size,)``."""
        return self.weight * (self.init / self.scale)


def check_heads(n_embd: int, n_head: int) -> int:
    if n_head <= 0 or n_embd % n_head:
        raise ValueError(f"n_embd={n_embd} is not a multiple of n_head={n_head}")
    head_dim = n_embd // n_head
    if head_dim % 2:
        raise ValueError(f"head dimension n_embd/n_head = {head_dim} must be even (rotations act on pairs)")
    return head_dim


def filter_windows(n_head: int, window: tuple[float, float]) -> Tensor:
    """Per-head memory lengths ``(H,)``, geometric from ``window[0]`` to ``window[1]`` tokens."""
    w_min, w_max = window
    if not 0 < w_min <= w_max:
        raise ValueError(f"window must satisfy 0 < window[0] <= window[1], got {window}")
    if n_head == 1:
        return torch.tensor([math.sqrt(w_min * w_max)])
    return w_min * (w_max / w_min) ** (torch.arange(n_head, dtype=torch.float64) / (n_head - 1))
