"""RT-Filter attention (SPEC §1.2, §1.5, contract §4.1): the functional kernel `rt_attention`.

For one head, with ``q̂ = q/|q|``, ``k̂ = k/|k|``, ``v̂ = v/|v|``, ``m_j² = |k_j|²`` and
``Δt_ij = t_i − t_j``::

    c(Δt)    = η_t² + σ_t² (e^{2 μ_r Δt} − 1)/(2 μ_r)          (geoattn.rt.precision)
    κ_ij     = m_j² / c(|Δt_ij|)
    logit_ij = log κ_ij + β κ_ij (⟨q̂_i, R(Δt_ij) k̂_j⟩ − 1)
    o_i      = Σ_j softmax_j(logit_ij) R(Δt_ij) v̂_j

``R`` is the pair rotation of `geoattn.algebra.rotation`. Since ``R(t_i − t_j) = R(t_i) R(−t_j)``
is orthogonal, ``⟨q̂_i, R(Δt_ij) k̂_j⟩ = ⟨R(−t_i) q̂_i, R(−t_j) k̂_j⟩`` and
``Σ_j A_ij R(Δt_ij) v̂_j = R(t_i) Σ_j A_ij R(−t_j) v̂_j``: every backend rotates per token
(O(N D)) and never per pair.

Backends: ``"reference"`` (explicit N×N, the oracle), ``"auto"`` (picks one of the fast paths
below, never materialises an N×N tensor), and for benchmarks and tests the general paths forced
by name, ``"blockwise"`` and ``"flex"``:

* ``σ_t² = 0``: ``κ_j = m_j²/η_t²`` depends on the key only; SDPA with ``κ_j`` folded into the
  key and the bias ``log κ_j − β κ_j`` as one extra coordinate (query side 1), ``scale = 1``;
* ``σ_t² = 2 μ_r η_t²`` (causal, non-decreasing times): ``c = η_t² e^{2 μ_r Δt}``, so
  ``κ_ij = s_i a_j`` with ``s_i = e^{−2μ_r (t_i − t₀)}`` and ``a_j = m_j² e^{2μ_r (t_j − t₀)}/η_t²``;
  SDPA again, queries split into chunks whose time span keeps ``e^{2 μ_r (t − t₀)}`` bounded
  (``t₀``: the chunk's first query time; ``log s_i`` is constant per query and cancels);
* otherwise: FlexAttention with a ``score_mod`` on CUDA (the blockwise kernel if it fails), and
  on other devices the blockwise flash-style kernel of `geoattn.attention.blockwise`.

The two SDPA paths are exact only on their parameter manifold, so ``auto`` takes them only when
no gradient is asked off it: ``σ_t² = 0`` needs ``sigma_t2`` not to require grad; the tied family
needs none of ``mu_r, sigma_t2, eta_t2`` to require grad. Otherwise the general path runs.

Problems with ``B·H·N² ≥ COMPILE_MIN_PAIRS`` run the per-token preparation (normalise, rotate,
fold) and the blockwise tiles through `torch.compile` (the first call compiles, for tens of
seconds on a CPU); smaller ones run eagerly. Half-precision inputs are computed in float32, with
autocast switched off inside (`geoattn.attention.dtypes`).
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from geoattn.algebra.rotation import rope_angles, rotate_pairs
from geoattn.attention.blockwise import COMPILE_MIN_PAIRS, MaybeCompiled, blockwise_attention
from geoattn.attention.dtypes import outside_autocast, work_dtype
from geoattn.rt.precision import rt_noise_variance

BACKENDS = ("auto", "reference", "blockwise", "flex")

# Largest 2 μ_r (t − t₀) within one SDPA chunk of the tied family: e^{±60} keeps the folded
# query and key scalings inside float32's range (e^{±87}) with room for m²/η² and β.
_TIED_MAX_EXPONENT = 60.0
# Queries per chunk when the tied family needs several chunks: its causal mask is
# (chunk, keys) booleans, so this bounds that mask to O(N) memory.
_TIED_MAX_CHUNK = 1024


@outside_autocast
def rt_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mu_r: Tensor,
    sigma_t2: Tensor,
    eta_t2: Tensor,
    beta: Tensor,
    omega: Tensor | None = None,
    positions: Tensor | None = None,
    causal: bool = True,
    backend: str = "auto",
    return_weights: bool = False,
    normalize_values: bool = True,
) -> Tensor | tuple[Tensor, Tensor]:
    """RT-Filter attention, exactly SPEC §4.1.

    Args:
        q, k, v: ``(B, H, N, D)`` raw projections, D even (normalised inside).
        mu_r, sigma_t2, eta_t2, beta: ``(H,)`` per-head parameters, already constrained:
            ``mu_r ≥ 0``, ``sigma_t2 ≥ 0``, ``eta_t2 > 0``, ``beta > 0``.
        omega: ``(H, D/2)`` angular frequencies of ``R``, or None for no rotation.
        positions: ``(N,)`` or ``(B, N)`` float times (irregular allowed); default ``arange(N)``.
        causal: attend to ``j ≤ i`` only.
        backend: ``"auto"`` | ``"reference"`` | ``"blockwise"`` | ``"flex"`` (see the module doc).
        return_weights: also return the attention weights ``(B, H, N, N)``. Weights are N×N by
            definition, so this always runs the reference path.
        normalize_values: our extension: False uses ``v`` as given instead of ``v̂ = v/|v|``
            (the ``qkv_norm=False`` ablation of the layers).

    Returns:
        ``o`` of shape ``(B, H, N, D)``, or ``(o, weights)`` when ``return_weights``.
    """
    dtype = q.dtype
    params = _validate(q, k, v, mu_r, sigma_t2, eta_t2, beta, omega, positions, backend)
    b, h, n, d = q.shape
    if positions is None:
        positions = torch.arange(n, device=q.device)
    work = work_dtype(q.dtype)
    times = positions.to(work)  # (N,) or (B, N)
    mu_r, sigma_t2, eta_t2, beta = (p.to(work) for p in params)
    q, k, v = q.to(work), k.to(work), v.to(work)
    angles = None if omega is None else rope_angles(times, omega.to(work))  # (B|1, H, N, D/2)
    use_compile = b * h * n * n >= COMPILE_MIN_PAIRS

    if return_weights or backend == "reference":
        qh, kh, vh, log_m2 = _prepare(q, k, v, angles, normalize_values)
        out, weights = _reference(qh, kh, vh, log_m2, times, mu_r, sigma_t2, eta_t2, beta, causal)
    else:
        weights = None
        path = _choose_path(backend, q.device, times, mu_r, sigma_t2, eta_t2, causal)
        if path == "separable":  # one fused preparation straight to the folded SDPA inputs
            folded = _PREPARE_SEPARABLE(use_compile, q, k, v, angles, normalize_values, mu_r, eta_t2, beta)
            out = _sdpa(*folded, d, is_causal=causal)
        else:
            qh, kh, vh, log_m2 = _PREPARE(use_compile, q, k, v, angles, normalize_values)
            args = (qh, kh, vh, log_m2, times, mu_r, sigma_t2, eta_t2, beta, causal, use_compile)
            try:
                out = _PATHS[path](*args)
            except Exception as err:  # noqa: BLE001 - only auto's choice of FlexAttention falls back
                if not (backend == "auto" and path == "flex"):
                    raise
                warnings.warn(f"FlexAttention failed ({err}); using the blockwise kernel", stacklevel=2)
                out = _blockwise(*args)
    if angles is not None:
        out = _FINISH(use_compile, out, angles)
    out = out.to(dtype)
    return (out, weights.to(dtype)) if return_weights else out


def rt_logits(
    dot: Tensor, dt: Tensor, log_m2: Tensor, mu_r: Tensor, sigma_t2: Tensor, eta_t2: Tensor, beta: Tensor
) -> Tensor:
    """``log κ + β κ (dot − 1)`` with ``κ = m²/c(|Δt|)``, elementwise and broadcasting.

    Shared by every backend. Typical shapes: ``dot (B, H, N, N)``, ``dt (B|1, 1, N, N)`` signed,
    ``log_m2 (B, H, 1, N)``, parameters ``(1, H, 1, 1)``.
    """
    log_kappa = log_m2 - torch.log(rt_noise_variance(dt.abs(), mu_r, sigma_t2, eta_t2))
    return log_kappa + beta * torch.exp(log_kappa) * (dot - 1)


def _rt_score(dot, dt, query_scalars, key_scalars, params):
    """The `geoattn.attention.blockwise.ScoreFn` of RT-Filter attention: key scalar ``log m_j²``."""
    return rt_logits(dot, dt, key_scalars[0], *params)


# ----------------------------------------------------------------------------------------------
# Backends. Each takes unit (or raw, for normalize_values=False) tensors already rotated to the
# common frame: qh, kh, vh (B, H, N, D), log_m2 (B, H, N), times (N,) | (B, N), params (H,), and
# returns Σ_j A_ij vh_j of shape (B, H, N, D) (still in the common frame).


def _reference(qh, kh, vh, log_m2, times, mu_r, sigma_t2, eta_t2, beta, causal):
    n = qh.shape[-2]
    t = times if times.dim() == 2 else times.unsqueeze(0)
    dt = (t[:, :, None] - t[:, None, :]).unsqueeze(1)  # (B|1, 1, N, N)
    heads = [p.view(1, -1, 1, 1) for p in (mu_r, sigma_t2, eta_t2, beta)]
    logits = rt_logits(qh @ kh.transpose(-1, -2), dt, log_m2.unsqueeze(-2), *heads)  # (B, H, N, N)
    if causal:
        future = torch.ones(n, n, dtype=torch.bool, device=qh.device).triu(1)
        logits = logits.masked_fill(future, -math.inf)
    weights = torch.softmax(logits, dim=-1)
    return weights @ vh, weights


def _prepare(q, k, v, angles, normalize_values):
    """Unit ``q̂, k̂`` (and ``v̂``) rotated to the common frame, and ``log |k|²``.

    ``q, k, v (B, H, N, D)``, ``angles (B|1, H, N, D/2)`` or None → ``qh, kh, vh (B, H, N, D)``,
    ``log_m2 (B, H, N)``.
    """
    qh, _ = _unit(q)
    kh, k_m2 = _unit(k)
    vh = _unit(v)[0] if normalize_values else v
    log_m2 = torch.log(k_m2.clamp_min(torch.finfo(k_m2.dtype).tiny))  # |k| = 0 stays finite
    if angles is not None:  # ⟨R(−t_i) q̂_i, R(−t_j) k̂_j⟩ = ⟨q̂_i, R(t_i − t_j) k̂_j⟩
        qh, kh, vh = (rotate_pairs(x, -angles) for x in (qh, kh, vh))
    return qh, kh, vh, log_m2


def _finish(out, angles):
    """Rotate ``Σ_j A_ij R(−t_j) v̂_j`` back to each query's own frame: ``(B, H, N, D)``."""
    return rotate_pairs(out, angles)


def _prepare_separable(q, k, v, angles, normalize_values, mu_r, eta_t2, beta):
    """Folded SDPA inputs for σ_t² = 0: ``[β q̂, 1, 0] · [κ k̂, log κ − β κ, 0] = logit``, each
    ``(B, H, N, D + 2)``, and the values zero-padded to the same width."""
    qh, kh, vh, log_m2 = _prepare(q, k, v, angles, normalize_values)
    # μ_r acts only through σ_t²: with σ_t² = 0 its gradient is exactly zero; the 0·μ_r term keeps
    # it connected so that optimisers and DDP see a (zero) gradient.
    log_kappa = log_m2 - torch.log(eta_t2).view(1, -1, 1) + 0 * mu_r.view(1, -1, 1)  # (B, H, N)
    kappa = torch.exp(log_kappa)
    b = beta.view(1, -1, 1, 1)
    ones = torch.ones_like(qh[..., :1])
    qx = torch.cat((b * qh, ones, ones * 0), dim=-1)
    kx = torch.cat((kappa[..., None] * kh, (log_kappa - b[..., 0] * kappa)[..., None], ones * 0), dim=-1)
    return qx, kx, F.pad(vh, (0, 2))


def _sdpa_tied(qh, kh, vh, log_m2, times, mu_r, sigma_t2, eta_t2, beta, causal, use_compile):
    d = qh.shape[-1]
    t = times if times.dim() == 2 else times.unsqueeze(0)  # (B|1, N)
    two_mu = (2 * mu_r).view(1, -1, 1)  # (1, H, 1)
    out = []
    for c0, c1 in _tied_chunks(t, float(two_mu.max())):
        t0 = t[:, None, c0 : c0 + 1]  # (B|1, 1, 1), the chunk's first query time
        folded = _FOLD_TIED(
            use_compile,
            qh[:, :, c0:c1],
            kh[:, :, :c1],
            vh[:, :, :c1],
            log_m2[..., :c1],
            t[:, None, c0:c1] - t0,
            t[:, None, :c1] - t0,
            two_mu,
            eta_t2,
            beta,
        )
        if c0 == 0:  # a square block from the start: SDPA's own causal mask
            out.append(_sdpa(*folded, d, is_causal=causal))
        else:
            visible = torch.ones(c1 - c0, c1, dtype=torch.bool, device=qh.device).tril(c0)
            out.append(_sdpa(*folded, d, mask=visible))
    return torch.cat(out, dim=-2)


def _fold_tied(q_c, k_p, v_p, log_m2_p, rel_q, rel_k, two_mu, eta_t2, beta):
    """Folded SDPA inputs of one query chunk for σ_t² = 2 μ_r η_t²: ``κ_ij = s_i a_j`` and
    ``[β s_i q̂_i, −β s_i, 1] · [a_j k̂_j, a_j, log a_j] = logit_ij − log s_i``.

    ``q_c (B, H, Lc, D)``; keys and values up to the chunk end ``k_p, v_p (B, H, c1, D)``,
    ``log_m2_p (B, H, c1)``; times relative to the chunk start ``rel_q (B|1, 1, Lc)``,
    ``rel_k (B|1, 1, c1)``; ``two_mu (1, H, 1)``. Returns ``(B, H, Lc | c1, D + 2)`` tensors.
    """
    bs = (beta.view(1, -1, 1, 1) * torch.exp(-two_mu * rel_q)[..., None]).expand_as(q_c[..., :1])  # β s_i
    log_a = log_m2_p - torch.log(eta_t2).view(1, -1, 1) + two_mu * rel_k  # (B, H, c1)
    a = torch.exp(log_a)[..., None]
    qx = torch.cat((bs * q_c, -bs, torch.ones_like(bs)), dim=-1)
    kx = torch.cat((a * k_p, a, log_a[..., None]), dim=-1)
    return qx, kx, F.pad(v_p, (0, 2))


def _tied_chunks(t: Tensor, two_mu_max: float) -> list[tuple[int, int]]:
    """Query chunks ``[c0, c1)`` with ``2 μ_r (t_{c1−1} − t_{c0}) ≤ _TIED_MAX_EXPONENT`` in all batch rows."""
    n = t.shape[-1]
    span = _TIED_MAX_EXPONENT / two_mu_max if two_mu_max > 0 else math.inf
    if span >= float((t[:, -1] - t[:, 0]).max()):
        return [(0, n)]
    chunks, c0 = [], 0
    while c0 < n:
        ends = torch.searchsorted(t.contiguous(), (t[:, c0] + span).unsqueeze(-1).contiguous(), right=True)
        c1 = max(c0 + 1, min(int(ends.min()), c0 + _TIED_MAX_CHUNK, n))
        chunks.append((c0, c1))
        c0 = c1
    return chunks


def _sdpa(qx: Tensor, kx: Tensor, vx: Tensor, d: int, *, is_causal=False, mask=None) -> Tensor:
    """SDPA with ``scale=1`` on folded queries/keys of width D + 2 and values zero-padded to the same
    width (SDPA's fused CPU kernels need equal widths); the output is cropped back to ``(…, D)``."""
    out = F.scaled_dot_product_attention(qx, kx, vx, attn_mask=mask, is_causal=is_causal, scale=1.0)
    return out[..., :d]


def _blockwise(qh, kh, vh, log_m2, times, mu_r, sigma_t2, eta_t2, beta, causal, use_compile):
    return blockwise_attention(
        qh,
        kh,
        vh,
        score_fn=_rt_score,
        times=times,
        key_scalars=(log_m2,),
        params=(mu_r, sigma_t2, eta_t2, beta),
        causal=causal,
        compile=use_compile,
    )


def _flex(qh, kh, vh, log_m2, times, mu_r, sigma_t2, eta_t2, beta, causal, use_compile):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    b, h, n, _ = qh.shape
    t = (times if times.dim() == 2 else times.unsqueeze(0)).expand(b, n)

    def score_mod(score, bi, hi, qi, kj):
        dt = t[bi, qi] - t[bi, kj]
        return rt_logits(score, dt, log_m2[bi, hi, kj], mu_r[hi], sigma_t2[hi], eta_t2[hi], beta[hi])

    block_mask = None
    if causal:  # depends on (n, device) only: built once, not at every layer and step
        key = ("causal_mask", n, str(qh.device))
        if key not in _FLEX_CACHE:
            _FLEX_CACHE[key] = create_block_mask(
                lambda bi, hi, qi, kj: qi >= kj, None, None, n, n, device=qh.device
            )
        block_mask = _FLEX_CACHE[key]
    return _compiled_flex(flex_attention)(qh, kh, vh, score_mod=score_mod, block_mask=block_mask, scale=1.0)


_FLEX_CACHE: dict[object, object] = {}


def _compiled_flex(flex_attention):
    """FlexAttention only runs fused when compiled; compile once per process."""
    if "fn" not in _FLEX_CACHE:
        _FLEX_CACHE["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX_CACHE["fn"]


_PREPARE, _PREPARE_SEPARABLE, _FOLD_TIED, _FINISH = (
    MaybeCompiled(f) for f in (_prepare, _prepare_separable, _fold_tied, _finish)
)
_PATHS = {
    "tied": _sdpa_tied,
    "blockwise": _blockwise,
    "flex": _flex,
}


def _choose_path(backend, device, times, mu_r, sigma_t2, eta_t2, causal) -> str:
    if backend in ("blockwise", "flex"):
        return backend
    if not sigma_t2.requires_grad and bool((sigma_t2 == 0).all()):
        return "separable"
    tied = torch.isclose(sigma_t2, 2 * mu_r * eta_t2, rtol=8 * torch.finfo(sigma_t2.dtype).eps, atol=0)
    process_grad = mu_r.requires_grad or sigma_t2.requires_grad or eta_t2.requires_grad
    if causal and not process_grad and bool(tied.all()) and bool((times.diff(dim=-1) >= 0).all()):
        return "tied"
    return "flex" if device.type == "cuda" else "blockwise"


# ----------------------------------------------------------------------------------------------
# Inputs.


def _unit(x: Tensor, eps: float = 1e-12) -> tuple[Tensor, Tensor]:
    """``(x/|x|, |x|²)`` of ``(B, H, N, D)``; a zero vector maps to zero with finite gradients."""
    m2 = (x * x).sum(-1)  # (B, H, N)
    return x * torch.rsqrt(m2.clamp_min(eps * eps))[..., None], m2


def _validate(q, k, v, mu_r, sigma_t2, eta_t2, beta, omega, positions, backend):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be a (B, H, N, D) tensor, got {_shape(x)}")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"q, k, v must have the same shape (B, H, N, D), got {_shape(q)}, {_shape(k)}, {_shape(v)}"
        )
    b, h, n, d = q.shape
    if d % 2:
        raise ValueError(
            f"the head dimension D must be even for the pair rotation, got q of shape {_shape(q)}"
        )
    params = (mu_r, sigma_t2, eta_t2, beta)
    for name, p in zip(("mu_r", "sigma_t2", "eta_t2", "beta"), params):
        if not isinstance(p, Tensor) or p.shape != (h,):
            raise ValueError(f"{name} must be a tensor of shape (H,) = ({h},), got {_shape(p)}")
    for name, p, ok, rule in (
        ("mu_r", mu_r, mu_r >= 0, "≥ 0"),
        ("sigma_t2", sigma_t2, sigma_t2 >= 0, "≥ 0"),
        ("eta_t2", eta_t2, eta_t2 > 0, "> 0"),
        ("beta", beta, beta > 0, "> 0"),
    ):
        if not bool(ok.all()):
            raise ValueError(f"{name} must be {rule} in every head, got {p.detach().cpu().tolist()}")
    if omega is not None and (not isinstance(omega, Tensor) or omega.shape != (h, d // 2)):
        raise ValueError(f"omega must have shape (H, D/2) = ({h}, {d // 2}), got {_shape(omega)}")
    if positions is not None:
        if not isinstance(positions, Tensor) or positions.shape not in ((n,), (b, n)):
            raise ValueError(
                f"positions must have shape (N,) = ({n},) or (B, N) = ({b}, {n}), got {_shape(positions)}"
            )
        if positions.is_complex() or positions.dtype == torch.bool:
            raise ValueError(f"positions must be real times, got dtype {positions.dtype}")
    return params


def _shape(x) -> str:
    return str(tuple(x.shape)) if isinstance(x, Tensor) else type(x).__name__
