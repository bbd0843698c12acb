"""Isotropic Robust Filter Attention (RFA, arXiv 2509.04154; docs/concepts/rt-filter.md#baselines): the
Euclidean predecessor of RT-Filter attention, kept as a baseline.

Two paths, rows of `PATHS` (`geoattn.attention.dispatch`): the reference (explicit N×N, the oracle and
the only one with the weights) and the chunked kernel (query blocks with a recomputing backward,
``chunk × N`` memory). The parameters' signs are value checks: they run with ``GEOATTN_DEBUG=1`` only
(`geoattn.attention.debug`).

RFA's output ``Σ_j A_ij E_ij R v_j`` decays each value by a pair-dependent factor, so it is not a
plain softmax-weighted sum.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from geoattn.algebra.rotation import rope_angles, rotate_pairs
from geoattn.attention import dispatch as table
from geoattn.attention.debug import value_checks
from geoattn.attention.dispatch import Path, no_weights
from geoattn.attention.dtypes import outside_autocast, work_dtype
from geoattn.rt.precision import rfa_precision

# name, the rule every head's value obeys (checked with GEOATTN_DEBUG=1)
_PARAMETERS = (("mu", "> 0"), ("sigma2", ">= 0"), ("eta2", "> 0"), ("gamma2", ">= 0"), ("beta", "> 0"))


class Call(NamedTuple):
    """One call of `rfa_attention` in the working dtype, q, k, v already in frame 0.

    ``q, k, v (B, H, N, D)``; ``qq (B, H, N, 1)`` and ``kk (B, H, 1, N)`` squared norms; ``t_q (B|1, 1,
    N, 1)``, ``t_k (B|1, 1, 1, N)`` times; ``params`` μ, σ², η², γ², β each ``(H, 1, 1)``."""

    q: Tensor
    k: Tensor
    v: Tensor
    qq: Tensor
    kk: Tensor
    t_q: Tensor
    t_k: Tensor
    params: tuple[Tensor, ...]
    causal: bool
    chunk_size: int
    backend: str
    return_weights: bool


def _block(q, k, v_rot, qq, kk, t_q, t_k, mu, sigma2, eta2, gamma2, beta, causal, start):
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


def _reference(call: Call) -> tuple[Tensor, Tensor]:
    """Every query at once: ``(o (B, H, N, D), A (B, H, N, N))``."""
    return _block(call.q, call.k, call.v, call.qq, call.kk, call.t_q, call.t_k, *call.params, call.causal, 0)


def _chunked(call: Call) -> tuple[Tensor, None]:
    """Query blocks of ``chunk_size``, each recomputed in the backward: ``(o (B, H, N, D), None)``."""
    N = call.q.shape[2]
    outs = []
    for s in range(0, N, call.chunk_size):
        e = min(s + call.chunk_size, N)
        m = e if call.causal else N  # causal: keys after the block's last query never count
        args = (call.q[:, :, s:e], call.k[:, :, :m], call.v[:, :, :m], call.qq[:, :, s:e], call.kk[..., :m])
        args += (call.t_q[:, :, s:e], call.t_k[..., :m], *call.params, call.causal, s)
        if torch.is_grad_enabled():
            outs.append(checkpoint(lambda *a_: _block(*a_)[0], *args, use_reentrant=False))
        else:
            outs.append(_block(*args)[0])
    return torch.cat(outs, dim=2), None


def _asked_for(call: Call) -> str | None:
    if call.backend == "reference":
        return None
    return "it materialises the N × N weights: only on request (backend='reference')"


PATHS: tuple[Path, ...] = (
    Path(
        "reference",
        (_asked_for,),
        _reference,
        "tests/test_rt_layers.py::test_rfa_reference_matches_the_per_pair_definition",
    ),
    Path(
        "chunked",
        (no_weights,),
        _chunked,
        "tests/test_rt_layers.py::test_rfa_chunked_matches_reference_values_and_gradients",
    ),
)
BACKENDS = table.backends(PATHS)


def explain(call: Call) -> list[tuple[str, tuple[str, ...]]]:
    """Every row's reasons for ``call``: ``[(name, reasons)]`` in priority order, ``()`` where it serves."""
    return table.explain(PATHS, call)


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
        mu, sigma2, eta2, gamma2, beta: ``(H,)``, constrained (μ > 0, σ² ≥ 0, η² > 0, γ² ≥ 0, β > 0;
            checked with ``GEOATTN_DEBUG=1``).
        omega: ``(H, D/2)`` or None (no rotation). positions: ``(N,)`` or ``(B, N)``, default ``arange(N)``.
        backend: ``"auto"`` (the first row of `PATHS` that serves the call: the chunked one) or a row by
            name: ``"reference"`` (explicit ``N×N``, returns weights if asked), ``"chunked"`` (query
            blocks of ``chunk_size`` with recomputing backward: ``chunk × N`` memory, never ``N×N``).

    Returns:
        ``o`` ``(B, H, N, D)``, and ``A`` ``(B, H, N, N)`` with ``backend="reference", return_weights=True``.
    """
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            "rfa_attention: q, k, v must share one shape (B, H, N, D); "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    B, H, N, D = q.shape
    if D % 2:
        raise ValueError(f"rfa_attention: head dimension D={D} must be even")
    raw = (mu, sigma2, eta2, gamma2, beta)
    for (name, _), p in zip(_PARAMETERS, raw):
        if p.shape != (H,):
            raise ValueError(f"rfa_attention: {name} has shape {tuple(p.shape)}, expected ({H},)")
    if value_checks():
        _check_values(raw)
    if backend not in BACKENDS:
        raise ValueError(f"rfa_attention: backend must be one of {BACKENDS}, got {backend!r}")
    out_dtype = q.dtype
    work = work_dtype(q.dtype)  # times, logs and exponentials need the mantissa
    q, k, v = q.to(work), k.to(work), v.to(work)
    if positions is None:
        positions = torch.arange(N, device=q.device, dtype=work)
    if positions.shape not in ((N,), (B, N)):
        raise ValueError(
            f"rfa_attention: positions has shape {tuple(positions.shape)}, expected ({N},) or ({B}, {N})"
        )
    t = (positions if positions.dim() == 2 else positions.unsqueeze(0)).to(q.dtype)  # (B|1, N)
    if omega is not None:
        if omega.shape != (H, D // 2):
            raise ValueError(f"rfa_attention: omega has shape {tuple(omega.shape)}, expected ({H}, {D // 2})")
        back = rope_angles(-t, omega.to(q.dtype))  # R(−t): every vector to frame 0
        q, k, v = rotate_pairs(q, back), rotate_pairs(k, back), rotate_pairs(v, back)
    call = Call(
        q=q,
        k=k,
        v=v,
        qq=(q * q).sum(-1, keepdim=True),  # (B, H, N, 1)
        kk=(k * k).sum(-1).unsqueeze(-2),  # (B, H, 1, N)
        t_q=t[:, None, :, None],
        t_k=t[:, None, None, :],
        params=tuple(p.to(q.dtype).view(H, 1, 1) for p in raw),
        causal=causal,
        chunk_size=chunk_size,
        backend=backend,
        return_weights=return_weights,
    )
    o, a = table.choose(PATHS, call, "rfa_attention").run(call)
    if omega is not None:
        o = rotate_pairs(o, rope_angles(t, omega.to(q.dtype)))  # back to each query's frame: R(t_i)
    return (o.to(out_dtype), a.to(out_dtype)) if return_weights else o.to(out_dtype)


def _check_values(params: tuple[Tensor, ...]) -> None:
    """The parameters' signs (reads them: a device sync on a GPU)."""
    for (name, rule), p in zip(_PARAMETERS, params):
        if bool((p <= 0).any() if rule == "> 0" else (p < 0).any()):
            got = p.detach().cpu().tolist()
            raise ValueError(f"rfa_attention: {name} must be {rule} in every head, got {got}")
