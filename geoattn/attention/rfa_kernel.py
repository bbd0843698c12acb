"""Isotropic Robust Filter Attention (RFA, arXiv 2509.04154; docs/concepts/rt-filter.md#baselines): the
Euclidean predecessor of RT-Filter attention, kept as a baseline. Reference (explicit N×N) and chunked (query
blocks with a recomputing backward, ``chunk × N`` memory) kernels.

RFA's output ``Σ_j A_ij E_ij R v_j`` decays each value by a pair-dependent factor, so it is not a
plain softmax-weighted sum.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from geoattn.algebra.rotation import rope_angles, rotate_pairs
from geoattn.attention.dtypes import outside_autocast, work_dtype
from geoattn.rt.precision import rfa_precision

RFA_BACKENDS = ("auto", "reference", "chunked")


def _rfa_block(q, k, v_rot, qq, kk, t_q, t_k, mu, sigma2, eta2, gamma2, beta, causal, start):
    """Logits, weights and the weighted, decayed value sum for one query block starting at index ``start``.

    ``q`` ``(B, H, c, D)`` and ``k`` ``(B, H, M, D)`` already rotated to frame 0; ``v_rot`` ``(B, H, M, D)``;
    ``qq``/``kk`` squared norms ``(B, H, c, 1)``/``(B, H, 1, M)``; ``t_q`` ``(B|1, 1, c, 1)``, ``t_k``
    ``(B|1, 1, 1, M)``. Returns ``(o (B, H, c, D), A (B, H, c, M))``.
    """
    dt = (t_q - t_k).abs()
    decay = torch.exp(-mu * dt)  # E = e^{−μ|Δt|}
    precision = rfa_precision(dt, mu, sigma2, eta2, gamma2)
    r2 = qq + decay**2 * kk - 2 * decay * (q @ k.transpose(-2, -1))  # |q − E R k|²
    logits = precision.log() - beta * precision * r2
    if causal:  # by token index, as rt_attention and SDPA, whatever the times
        q_idx = torch.arange(start, start + q.shape[-2], device=q.device)[:, None]
        logits = logits.masked_fill(torch.arange(k.shape[-2], device=q.device) > q_idx, float("-inf"))
    a = logits.softmax(dim=-1)
    return (a * decay) @ v_rot, a


@outside_autocast
def rfa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mu: Tensor,
    sigma2: Tensor,
    eta2: Tensor,
    gamma2: Tensor,
    beta: Tensor,
    omega: Tensor | None = None,
    positions: Tensor | None = None,
    causal: bool = True,
    backend: str = "auto",
    chunk_size: int = 128,
    return_weights: bool = False,
):
    """Isotropic Robust Filter Attention (RFA, Gaussian weights), docs/concepts/rt-filter.md#baselines.

    With ``Δt = t_i − t_j``, ``E_ij = e^{−μ|Δt|}``, ``R`` the pair rotation by ``ω·Δt``:
    ``logit_ij = log P_ij − β P_ij |q_i − E_ij R(Δt) k_j|²`` with
    ``1/P = σ²(1 − e^{−2μ|Δt|})/(2μ) + η² e^{−2μ|Δt|} + γ²``; softmax over ``j`` (``j ≤ i`` if causal);
    ``o_i = Σ_j A_ij E_ij R(Δt) v_j`` (the transported, decayed values). q, k, v are raw (not normalised).

    Args:
        q, k, v: ``(B, H, N, D)``, D even.
        mu, sigma2, eta2, gamma2, beta: ``(H,)``, constrained (μ > 0, σ² ≥ 0, η² > 0, γ² ≥ 0, β > 0).
        omega: ``(H, D/2)`` or None (no rotation). positions: ``(N,)`` or ``(B, N)``, default ``arange(N)``.
        backend: ``"reference"`` (explicit ``N×N``, returns weights if asked), ``"chunked"``/``"auto"``
            (query blocks of ``chunk_size`` with recomputing backward: ``chunk × N`` memory, never ``N×N``).

    Returns:
        ``o`` ``(B, H, N, D)``, and ``A`` ``(B, H, N, N)`` with ``backend="reference", return_weights=True``.
    """
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            "q, k, v must share one shape (B, H, N, D); "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    B, H, N, D = q.shape
    if D % 2:
        raise ValueError(f"head dimension D={D} must be even")
    for name, p, positive in (
        ("mu", mu, True),
        ("sigma2", sigma2, False),
        ("eta2", eta2, True),
        ("gamma2", gamma2, False),
        ("beta", beta, True),
    ):
        if p.shape != (H,):
            raise ValueError(f"{name} has shape {tuple(p.shape)}, expected ({H},)")
        if (p <= 0).any() if positive else (p < 0).any():
            raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'}, got {p.tolist()}")
    if backend not in RFA_BACKENDS:
        raise ValueError(f"backend must be one of {RFA_BACKENDS}, got {backend!r}")
    if return_weights and backend != "reference":
        raise ValueError("return_weights=True needs backend='reference'")
    out_dtype = q.dtype
    work = work_dtype(q.dtype)  # times, logs and exponentials need the mantissa
    q, k, v = q.to(work), k.to(work), v.to(work)
    if positions is None:
        positions = torch.arange(N, device=q.device, dtype=work)
    if positions.shape not in ((N,), (B, N)):
        raise ValueError(f"positions has shape {tuple(positions.shape)}, expected ({N},) or ({B}, {N})")
    t = (positions if positions.dim() == 2 else positions.unsqueeze(0)).to(q.dtype)  # (B|1, N)
    if omega is not None:
        if omega.shape != (H, D // 2):
            raise ValueError(f"omega has shape {tuple(omega.shape)}, expected ({H}, {D // 2})")
        back = rope_angles(-t, omega.to(q.dtype))  # R(−t): every vector to frame 0
        q, k, v = rotate_pairs(q, back), rotate_pairs(k, back), rotate_pairs(v, back)
    params = [p.to(q.dtype).view(H, 1, 1) for p in (mu, sigma2, eta2, gamma2, beta)]
    qq = (q * q).sum(-1, keepdim=True)  # (B, H, N, 1)
    kk = (k * k).sum(-1).unsqueeze(-2)  # (B, H, 1, N)
    t_q, t_k = t[:, None, :, None], t[:, None, None, :]

    if backend == "reference":
        o, a = _rfa_block(q, k, v, qq, kk, t_q, t_k, *params, causal, 0)
    else:
        outs = []
        for s in range(0, N, chunk_size):
            e = min(s + chunk_size, N)
            m = e if causal else N  # causal: keys after the block's last query never count
            args = (q[:, :, s:e], k[:, :, :m], v[:, :, :m], qq[:, :, s:e], kk[..., :m])
            args += (t_q[:, :, s:e], t_k[..., :m], *params, causal, s)
            if torch.is_grad_enabled():
                outs.append(checkpoint(lambda *a_: _rfa_block(*a_)[0], *args, use_reentrant=False))
            else:
                outs.append(_rfa_block(*args)[0])
        o = torch.cat(outs, dim=2)
    if omega is not None:
        o = rotate_pairs(o, rope_angles(t, omega.to(q.dtype)))  # back to each query's frame: R(t_i)
    return (o.to(out_dtype), a.to(out_dtype)) if return_weights else o.to(out_dtype)
