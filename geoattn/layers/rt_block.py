"""RT-Filter attention and the RT block (docs/concepts/rt-filter.md).

``RTAttention`` is the module around the functional kernel
``geoattn.attention.rt.rt_attention``: projections, the constrained per-head filter
parameters and the ablation switches. ``RTBlock`` is the hypersphere block of
``geoattn.layers.sphere`` (tangent correction, retraction or geodesic step, nGPT-style scales) around it.

Shapes: ``B`` batch, ``T`` tokens, ``C`` model width, ``H`` heads, ``D = C / H`` head width.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from geoattn.algebra.rotation import rope_frequencies
from geoattn.attention.rt import rt_attention_qkv
from geoattn.layers.common import (
    ScaledVector,
    check_heads,
    check_input,
    default_positions,
    filter_windows,
    merge_heads,
    normalize_,
)
from geoattn.layers.sphere import NormalizedSwiGLU, SphereBlock


def _init_omega(omega_init: Tensor | None, n_head: int, head_dim: int, rope_base: float) -> Tensor:
    if omega_init is None:
        return rope_frequencies(head_dim, n_head, rope_base)
    if omega_init.shape != (n_head, head_dim // 2):
        raise ValueError(
            f"omega_init has shape {tuple(omega_init.shape)}, expected ({n_head}, {head_dim // 2})"
        )
    if not torch.isfinite(omega_init).all():
        raise ValueError("omega_init must be finite")
    return omega_init.detach().float().clone()


class RTAttention(nn.Module):
    """RT-Filter attention: ``forward(x (B, T, C), positions (T,) | (B, T) | None) -> (B, T, C)``.

    The maths: docs/concepts/rt-filter.md#the-logit.

    Q/K/V/O projections without bias feed ``rt_attention``. Per head the filter parameters are stored
    as logarithms and used as ``exp`` (so ``μ_r, σ_t², η_t², β > 0``); ``precision_parameters()``
    returns the constrained ``(H,)`` tensors.

    Initialisation (a low-pass filter): head ``h`` gets a memory length ``W_h`` geometric in
    ``window`` (default 4 … 256 tokens), ``μ_r = 1/(2 W_h)``, ``η_t² = 1`` and ``σ_t² = 2 μ_r η_t²``, so
    ``c(Δt) = e^{Δt/W_h}`` exactly: a key's precision ``κ = m²·e^{−Δt/W_h}`` halves every ``W_h·ln 2``
    tokens, and ``log κ`` acts as an ALiBi-like recency bias of slope ``1/W_h``. ``β = sqrt(D)`` (or
    ``beta_init``): at ``κ = 1`` the logit is nGPT's ``sqrt(D)·cos`` up to a per-key constant.
    ω starts at the RoPE spectrum (``omega_init`` to override), learnable if ``learn_omega``.

    Mapping of nGPT's parameterisation onto the kernel: the kernel normalises q and k, so the
    per-dimension scale ``s_qk`` (init 1, stored with scale ``1/sqrt(C)``) acts on directions only
    (a learned diagonal metric, applied before the rotation, so logits stay relative-position), and
    the overall logit scale that nGPT keeps in ``s_qk²·sqrt(D)`` is ``β``. The key magnitude is
    measured as ``|k|·sqrt(C/D)``: a unit-norm input through unit-norm weight rows (the RT block's
    regime) gives ``|k|² ≈ D/C``, so magnitudes and ``κ`` start near 1.

    Switches (docs/concepts/rt-filter.md#switches):
        magnitude_precision: False → keys are normalised before the kernel, so ``κ = 1/c(Δt)``
            ignores ``|k_j|`` (the output is invariant to rescaling key projections).
        process_noise: False → ``σ_t² ≡ 0``: ``κ_j = m_j²/η_t²`` has no Δt dependence (no recency
            decay; ``μ_r`` then has no effect) and the kernel takes its separable SDPA path.
        qkv_norm: False → ``normalize_values=False``: the kernel averages raw values ``R(Δt) v_j``
            instead of unit values (q, k stay normalised: their directions are the measurement and
            ``|k_j|`` the precision, which the kernel needs either way).
        rotation: False → no transport rotation (ω = None).
    """

    def __init__(
        self,
        n_embd: int,
        n_head: int,
        *,
        causal: bool = True,
        magnitude_precision: bool = True,
        process_noise: bool = True,
        qkv_norm: bool = True,
        rotation: bool = True,
        learn_omega: bool = False,
        omega_init: Tensor | None = None,
        rope_base: float = 10000.0,
        window: tuple[float, float] = (4.0, 256.0),
        beta_init: float | None = None,
        backend: str = "auto",
    ):
        super().__init__()
        self.head_dim = check_heads(n_embd, n_head)
        if beta_init is not None and not beta_init > 0:
            raise ValueError(f"beta_init must be positive, got {beta_init}")
        self.n_embd, self.n_head, self.causal, self.backend = n_embd, n_head, causal, backend
        self.magnitude_precision, self.process_noise, self.qkv_norm = (
            magnitude_precision,
            process_noise,
            qkv_norm,
        )
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.s_qk = ScaledVector(n_embd, 1.0, n_embd**-0.5)
        self.key_scale = math.sqrt(n_head)  # sqrt(C / D)

        w = filter_windows(n_head, window)
        mu_r = 1.0 / (2.0 * w)
        eta_t2 = torch.ones(n_head, dtype=torch.float64)
        beta = torch.full((n_head,), beta_init or math.sqrt(self.head_dim), dtype=torch.float64)
        self.log_mu_r = nn.Parameter(mu_r.log().float())
        # process_noise=False: σ_t² ≡ 0 is no parameter at all (under DDP every parameter needs a gradient)
        self.log_sigma_t2 = nn.Parameter((2.0 * mu_r * eta_t2).log().float()) if process_noise else None
        self.log_eta_t2 = nn.Parameter(eta_t2.log().float())
        self.log_beta = nn.Parameter(beta.log().float())

        if not rotation:
            if omega_init is not None or learn_omega:
                raise ValueError("rotation=False takes neither omega_init nor learn_omega")
            self.omega = None
        elif learn_omega:
            self.omega = nn.Parameter(_init_omega(omega_init, n_head, self.head_dim, rope_base))
        else:
            self.register_buffer("omega", _init_omega(omega_init, n_head, self.head_dim, rope_base))

    def precision_parameters(self) -> dict[str, Tensor]:
        """The constrained kernel parameters ``mu_r, sigma_t2, eta_t2, beta``, each ``(H,)``."""
        eta_t2 = self.log_eta_t2.exp()
        return {
            "mu_r": self.log_mu_r.exp(),
            "sigma_t2": self.log_sigma_t2.exp() if self.process_noise else torch.zeros_like(eta_t2),
            "eta_t2": eta_t2,
            "beta": self.log_beta.exp(),
        }

    def _kernel(self, x: Tensor, positions: Tensor | None, backend: str, return_weights: bool):
        check_input(x, self.n_embd)
        b, t, _ = x.shape
        if positions is not None:
            positions = default_positions(x, positions)
        return rt_attention_qkv(
            self.c_attn(x).view(b, t, 3, self.n_head, self.head_dim),
            metric=self.s_qk().view(self.n_head, self.head_dim),
            key_scale=self.key_scale if self.magnitude_precision else None,
            **self.precision_parameters(),
            omega=self.omega,
            positions=positions,
            causal=self.causal,
            backend=backend,
            return_weights=return_weights,
            normalize_values=self.qkv_norm,
            structure="general" if self.process_noise else "separable",
        )

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        y = self._kernel(x, positions, self.backend, False)  # (B, H, T, D)
        return self.c_proj(merge_heads(y))

    def attention_weights(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """The RT attention weights ``(B, H, T, T)`` via the reference kernel (for plots)."""
        return self._kernel(x, positions, "reference", True)[1]

    def normalize_weights(self) -> None:
        """Unit-norm weights along the embedding axis (rows of c_attn, columns of c_proj)."""
        normalize_(self.c_attn.weight, dim=1)
        normalize_(self.c_proj.weight, dim=0)


class RTBlock(SphereBlock):
    """The RT block: ``forward(h (B, T, C) unit rows, positions) -> (B, T, C)`` unit rows.

    The maths: docs/concepts/rt-filter.md#the-block.

    Per sublayer: ``o`` = sublayer output, normalised (nGPT); tangent-space correction
    ``o ← o − ⟨o, h⟩h`` (switch ``tangent_correction``; off: nGPT's ``o − h``); then
    ``h ← normalize(h + α⊙o)`` or the exact geodesic step (``step="geodesic"``). ``α`` per channel,
    init ``alpha_init``, stored nGPT-style with scale ``1/sqrt(C)``. ``mlp`` is ``"swiglu"`` (nGPT's
    SwiGLU with scales ``s_u, s_v``), an ``nn.Module``, or None for an attention-only filter.
    Remaining keyword arguments go to :class:`RTAttention`.
    """

    def __init__(
        self,
        n_embd: int,
        n_head: int,
        *,
        mlp: str | nn.Module | None = "swiglu",
        mlp_hidden: int | None = None,
        alpha_init: float = 0.05,
        tangent_correction: bool = True,
        step: str = "retraction",
        **attention_kwargs,
    ):
        if isinstance(mlp, str):
            if mlp != "swiglu":
                raise ValueError(f"RTBlock mlp must be 'swiglu', a module or None, got {mlp!r}")
            mlp = NormalizedSwiGLU(n_embd, mlp_hidden)
        super().__init__(
            RTAttention(n_embd, n_head, **attention_kwargs),
            mlp,
            n_embd,
            alpha_init=alpha_init,
            tangent_correction=tangent_correction,
            step=step,
        )
