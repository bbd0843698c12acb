"""Isotropic Robust Filter Attention (RFA, arXiv 2509.04154), the RT layer's Euclidean predecessor.

``RFAAttention`` is the module around the functional kernel
``geoattn.attention.rfa.rfa_attention``, a drop-in for softmax attention in the pre-norm
``Block``.

Shapes: ``B`` batch, ``T`` tokens, ``C`` model width, ``H`` heads, ``D = C / H`` head width.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from geoattn.algebra.rotation import rope_frequencies
from geoattn.attention.rfa import rfa_attention
from geoattn.layers.common import (
    check_heads,
    check_input,
    default_positions,
    filter_windows,
    merge_heads,
    split_heads,
)


class RFAAttention(nn.Module):
    """Isotropic RFA as a drop-in for softmax attention: ``(x (B, T, C), positions) -> (B, T, C)``.

    Per-head parameters stored as logarithms (``exp`` constraint). Initialisation mirrors
    ``RTAttention``: memory length ``W_h`` geometric in ``window``, ``μ = 1/(2 W_h)`` (values and keys
    decay by ``e^{−Δt/(2W_h)}``), ``η² = 1``, ``σ² = 6 μ η²`` (the variance grows from ``η²`` to ``3 η²``),
    ``γ² = 0.01``, ``β = 1/(2 sqrt(D))`` so that at ``P = E = 1`` the cross term of the residual is
    standard attention's ``⟨q, k⟩/sqrt(D)``. Rotation ω: the RoPE spectrum (fixed) or none.
    """

    def __init__(
        self,
        n_embd: int,
        n_head: int,
        *,
        causal: bool = True,
        rotation: bool = True,
        rope_base: float = 10000.0,
        window: tuple[float, float] = (4.0, 256.0),
        backend: str = "auto",
        chunk_size: int = 128,
    ):
        super().__init__()
        self.head_dim = check_heads(n_embd, n_head)
        self.n_embd, self.n_head, self.causal = n_embd, n_head, causal
        self.backend, self.chunk_size = backend, chunk_size
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)
        mu = 1.0 / (2.0 * filter_windows(n_head, window))
        self.log_mu = nn.Parameter(mu.log().float())
        self.log_sigma2 = nn.Parameter((6.0 * mu).log().float())
        self.log_eta2 = nn.Parameter(torch.zeros(n_head))
        self.log_gamma2 = nn.Parameter(torch.full((n_head,), math.log(0.01)))
        self.log_beta = nn.Parameter(torch.full((n_head,), -math.log(2 * math.sqrt(self.head_dim))))
        if rotation:
            self.register_buffer("omega", rope_frequencies(self.head_dim, n_head, rope_base))
        else:
            self.omega = None

    def precision_parameters(self) -> dict[str, Tensor]:
        """The constrained parameters ``mu, sigma2, eta2, gamma2, beta``, each ``(H,)``."""
        names = ("mu", "sigma2", "eta2", "gamma2", "beta")
        return {n: getattr(self, f"log_{n}").exp() for n in names}

    def _kernel(self, x: Tensor, positions: Tensor | None, backend: str, return_weights: bool):
        check_input(x, self.n_embd)
        if positions is not None:
            positions = default_positions(x, positions)
        q, k, v = (split_heads(t, self.n_head) for t in self.c_attn(x).split(self.n_embd, dim=-1))
        return rfa_attention(
            q,
            k,
            v,
            **self.precision_parameters(),
            omega=self.omega,
            positions=positions,
            causal=self.causal,
            backend=backend,
            chunk_size=self.chunk_size,
            return_weights=return_weights,
        )

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        return self.c_proj(merge_heads(self._kernel(x, positions, self.backend, False)))

    def attention_weights(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """The RFA weights ``(B, H, T, T)`` via the reference kernel (for plots)."""
        return self._kernel(x, positions, "reference", True)[1]
