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
(O(N D)) and never per pair. q, k and v are normalised and rotated together, as one token-major
``(B, N, 3, H, D)`` tensor: the layout of a fused Q/K/V projection, which `rt_attention_qkv` takes
as it is.

Backends: ``"reference"`` (explicit N×N, the oracle), ``"auto"`` (below), and for benchmarks and
tests the paths forced by name, ``"dense"``, ``"blockwise"`` and ``"flex"``. ``auto`` chooses from
static facts only: the ``structure`` the caller declares, which parameters need gradients, the
shapes and the device; it never reads a tensor's values, so it runs under
``torch.compile(fullgraph=True)``:

* ``structure="separable"`` (``σ_t² = 0``): ``κ_j = m_j²/η_t²`` depends on the key only; SDPA's
  forward with ``κ_j`` folded into the key and the bias ``log κ_j − β κ_j`` as one extra coordinate
  (query side 1), ``scale = 1``;
* ``structure="tied"`` (``σ_t² = 2 μ_r η_t²``, causal, non-decreasing times): ``c = η_t² e^{2 μ_r Δt}``,
  so ``κ_ij = s_i a_j`` with ``s_i = e^{−2μ_r (t_i − t₀)}`` and ``a_j = m_j² e^{2μ_r (t_j − t₀)}/η_t²``;
  SDPA again (``log s_i`` is constant per query and cancels). ``e^{±2 μ_r t}`` leaves float range
  over long sequences, so time runs from ``t₀``, the first time of each query chunk: chunks span
  ``2 μ_r Δt ≤ 20`` (the folded scalings and their products stay normal numbers), each attends to
  its own keys causally and to the earlier ones in full, and the two SDPA calls merge by their
  log-sum-exps. Sequences that would need many short chunks (a fast decay) take the general
  kernel. The chunks come from ``μ_r`` and the times, so this one path reads values (and breaks a
  compiled graph);
* ``structure="general"`` (the default): FlexAttention with a ``score_mod`` on CUDA and, elsewhere,
  the blockwise flash-style kernel of `geoattn.attention.blockwise` (O(N) memory), registered as a
  custom operator so that a compiled graph calls it whole.

On the CPU with the default times (``positions=None``), every structure and length takes the native
kernel (`geoattn.attention.native`, compiled for the machine on first use): ``log c`` is then a table
over the lags, and one fused flash-style forward and backward in C++ computes the general logits
exactly, at the cost of SDPA's own CPU kernel to within tens of percent. Its fused entry
(``rt_qkv.h``, `_rt_qkv_op`) takes the stacked projections and the filter parameters as they are: the
normalisation, key magnitudes, ``log c`` table and both rotations run in the same call, so an eager
call is little more than the kernel (compiled graphs call the custom operator, eager ones the same
kernels through an autograd Function, without the operator's dispatch). A learned ω keeps the
Python rotation around the kernel's other entry (``rt_lag.h``, inside the blockwise custom operator).
Without a C++ toolchain (or with ``GEOATTN_NATIVE=0``) the paths below serve.

Short sequences take, whatever the structure, the dense exact kernel: one ``N × N`` tile per head
(``N ≤ DENSE_MAX_N`` and ``B·H·N² ≤ DENSE_MAX_ELEMENTS``; the one exception to "no N×N tensor",
bounded like a tile of the blockwise kernel), the logits in four passes from a batch-independent
``log c(|Δt|)`` table, and a hand-written backward that saves two ``N × N`` tensors. There fixed
per-call costs dominate and one tile costs less than the alternatives' set-up.

With the default times (``positions=None``) every ``|Δt_ij|`` is an integer lag, and the dense and
blockwise paths take ``log c`` from one ``(H, N)`` table over the lags instead of evaluating it per
pair. On the CPU the SDPA paths use SDPA's forward and a blockwise backward (`_softmax_attention_op`),
or SDPA's own backward where subnormal floats are flushed (`geoattn.subnormals`).

The cost does not depend on the data: weights, precisions and their products that would be subnormal
become zero (they change no sum, but as subnormal numbers each multiplication would cost many times
more, and how many there are depends on the key magnitudes), by the CPU itself where
`geoattn.subnormals.flush_subnormals` ran (the ``geoattn`` program) and otherwise by
`geoattn.attention.blockwise.flush_small` (below ``tiny^¾``); the SDPA paths' backward is SDPA's own
in the first case and the blockwise one in the second. ``log c`` is taken in log space where ``c``
would overflow (`log_noise_variance`).

The separable and tied paths are exact only on their parameter manifold: a declared structure whose
parameters need gradients off it (``sigma_t2`` for separable; ``mu_r, sigma_t2, eta_t2`` for tied)
runs the general path instead. In eager mode the declaration is checked against the values (a
ValueError if it does not hold), like the other parameter constraints; compiled graphs skip these
value checks.

Problems with ``B·H·N² ≥ COMPILE_MIN_PAIRS`` run the elementwise work of the dense path, the folds
and the blockwise tiles through `torch.compile` (the first call compiles, for tens of seconds on a
CPU); smaller ones, and the dense path without autograd (an evaluation), run eagerly.
Half-precision inputs are computed in float32, with autocast switched off inside
(`geoattn.attention.dtypes`).
"""

from __future__ import annotations

import functools
import math
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from geoattn.algebra.rotation import rope_angles, rotate_pairs
from geoattn.attention import native
from geoattn.attention.blockwise import (
    COMPILE_MIN_PAIRS,
    MaybeCompiled,
    blockwise_backward,
    blockwise_forward,
    default_blocks,
    flush_small,
)
from geoattn.attention.dtypes import outside_autocast, work_dtype
from geoattn.rt.precision import expm1_ratio, rt_noise_variance
from geoattn.subnormals import subnormals_flushed

BACKENDS = ("auto", "reference", "dense", "blockwise", "flex")
STRUCTURES = ("general", "separable", "tied")

# The dense path holds two (B, H, N, N) tensors per call for the backward; it beats the blockwise
# kernel (whose tiles stay in cache) up to N ≈ 128 on a CPU (one RT layer of the LM recipe, fwd+bwd,
# both with compiled elementwise work: 11.8 vs 12.9 ms at N = 64, 30.8 vs 29.5 at N = 128, 108 vs
# 65 at N = 256); the element bound keeps its memory in check for large batches.
DENSE_MAX_N = 128
DENSE_MAX_ELEMENTS = 1 << 24

# Query block and key chunk of the native CPU kernel (`geoattn.attention.native`): 64 × 256 ran
# as fast as 128 × 256, 64 × 128 and 32 × 512 for both B = 1, H = 8, N = 2048 and the LM recipe.
NATIVE_BLOCKS = (64, 256)

# The tied family runs on SDPA in query chunks (chunk-relative time, SPEC §1.5) that span at most
# this in 2 μ_r Δt, so that their folded scalings s_i = e^{−2 μ_r (t_i − t₀)} ≥ e^{−20} and a_j keep
# the products of the GEMMs (forward and backward) normal numbers; keys long before a chunk have
# a_j below e^{_TIED_NEGLIGIBLE} and fold to 0 (`_fold_tied`). A sequence that needs more than one
# chunk per _TIED_MIN_CHUNK tokens (a fast decay) takes the general kernel: many small SDPA calls
# cost more than it.
_TIED_MAX_EXPONENT = 20.0
_TIED_NEGLIGIBLE = -40.0
_TIED_MIN_CHUNK = 128


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
    structure: str = "general",
) -> Tensor | tuple[Tensor, Tensor]:
    """RT-Filter attention, exactly SPEC §4.1.

    Args:
        q, k, v: ``(B, H, N, D)`` raw projections, D even (normalised inside).
        mu_r, sigma_t2, eta_t2, beta: ``(H,)`` per-head parameters, already constrained:
            ``mu_r ≥ 0``, ``sigma_t2 ≥ 0``, ``eta_t2 > 0``, ``beta > 0``.
        omega: ``(H, D/2)`` angular frequencies of ``R``, or None for no rotation.
        positions: ``(N,)`` or ``(B, N)`` float times (irregular allowed); default ``arange(N)``.
        causal: attend to ``j ≤ i`` only.
        backend: ``"auto"`` | ``"reference"`` | ``"dense"`` | ``"blockwise"`` | ``"flex"`` (module doc).
        return_weights: also return the attention weights ``(B, H, N, N)``. Weights are N×N by
            definition, so this always runs the reference path.
        normalize_values: our extension: False uses ``v`` as given instead of ``v̂ = v/|v|``
            (the ``qkv_norm=False`` ablation of the layers).
        structure: our extension, what the caller knows about the parameters, so that ``auto`` can
            take a faster exact path without reading them: ``"general"`` (anything),
            ``"separable"`` (``sigma_t2 ≡ 0``) or ``"tied"`` (``sigma_t2 = 2 mu_r eta_t2``).

    Returns:
        ``o`` of shape ``(B, H, N, D)``, or ``(o, weights)`` when ``return_weights``.
    """
    _validate(q, k, v, mu_r, sigma_t2, eta_t2, beta, omega, positions, backend, structure)
    return _attention(
        torch.stack([x.transpose(1, 2) for x in (q, k, v)], dim=2),  # (B, N, 3, H, D)
        None,
        1.0,
        (mu_r, sigma_t2, eta_t2, beta),
        omega,
        positions,
        causal,
        backend,
        return_weights,
        normalize_values,
        structure,
    )


@outside_autocast
def rt_attention_qkv(
    qkv: Tensor,
    *,
    metric: Tensor | None = None,
    key_scale: float | None = 1.0,
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
    structure: str = "general",
) -> Tensor | tuple[Tensor, Tensor]:
    """`rt_attention` on stacked projections, as a fused Q/K/V projection produces them.

    Args:
        qkv: ``(B, N, 3, H, D)``: ``qkv[:, :, 0]`` are the queries ``(B, N, H, D)``, then keys and
            values; a fused projection ``(B, N, 3·H·D)`` viewed so, without a copy.
        metric: ``(H, D)`` per-dimension scales applied to q and k before they are normalised (a
            learned diagonal metric on the directions, the layers' ``s_qk``), or None.
        key_scale: the key magnitude is ``m_j = key_scale · |k_j|``, measured before ``metric``;
            None: ``m_j = 1`` (no magnitude precision, ``κ = 1/c``).
        The other arguments are those of `rt_attention`; with ``metric=None, key_scale=1.0`` this
        is `rt_attention` on ``q, k, v = qkv.unbind(2)`` (transposed to ``(B, H, N, D)``).

    Returns:
        ``(B, H, N, D)``, or ``(o, weights)`` when ``return_weights``.
    """
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv must be a (B, N, 3, H, D) tensor, got {_shape(qkv)}")
    q, k, v = qkv.unbind(2)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    _validate(q, k, v, mu_r, sigma_t2, eta_t2, beta, omega, positions, backend, structure)
    if metric is not None and (not isinstance(metric, Tensor) or metric.shape != qkv.shape[3:]):
        raise ValueError(f"metric must have shape (H, D) = {tuple(qkv.shape[3:])}, got {_shape(metric)}")
    params = (mu_r, sigma_t2, eta_t2, beta)
    args = (params, omega, positions, causal, backend, return_weights, normalize_values, structure)
    return _attention(qkv, metric, key_scale, *args)


def _attention(
    qkv, metric, key_scale, params, omega, positions, causal, backend, return_weights, normalize, structure
):
    dtype = qkv.dtype
    b, n, _, h, d = qkv.shape
    work = work_dtype(dtype)
    # None: the default times 0, 1, …, N−1, whose differences are integer lags (a static fact the
    # dense and blockwise paths use: the noise variance is then one (H, N) table over the lags)
    times = None if positions is None else positions.to(work)  # (N,) or (B, N)
    params = tuple(p.to(work) for p in params)
    qkv = qkv.to(work)
    metric = None if metric is None else metric.to(work)
    reference = return_weights or backend == "reference"
    path = (
        None
        if reference
        else _choose_path(backend, structure, qkv.device, b * h, n, params, causal, times is None)
    )
    if path == "blockwise" and times is None and _fused_native(qkv, omega):
        turns = None if omega is None else _turns(omega.to(work), n)
        flags = (key_scale, normalize, causal)
        if torch.compiler.is_compiling():
            out = torch.ops.geoattn.rt_qkv(qkv, metric, turns, list(params), *flags)[0]
        else:  # the same kernels without the custom operator's dispatch (most of a short call)
            out = _RTQkv.apply(qkv, metric, turns, flags, *params)
        return out.to(dtype)  # already in each query's frame

    angles = None
    if omega is not None:  # (B|1, H, N, D/2)
        angles = rope_angles(_explicit(times, n, qkv.device, work), omega.to(work))
    weights = None
    if reference:
        qh, kh, vh, log_m2 = _prepare_reference(qkv, metric, key_scale, angles, normalize)
        out, weights = _reference(qh, kh, vh, log_m2, times, *params, causal)
    else:
        use_compile = _worth_compiling(path, b * h * n * n)
        qh, kh, vh, log_m2 = _prepare(qkv, metric, key_scale, angles, normalize, use_compile)
        args = (qh, kh, vh, log_m2, times, *params, causal, use_compile)
        try:
            out = _PATHS[path](*args)
        except Exception as err:  # noqa: BLE001 - only auto's choice of FlexAttention falls back
            if not (backend == "auto" and path == "flex"):
                raise
            warnings.warn(f"FlexAttention failed ({err}); using the blockwise kernel", stacklevel=3)
            out = _blockwise(*args)
    if angles is not None:  # back to each query's own frame
        out = rotate_pairs(out, angles) if weights is not None else _rotate(out, angles)
    out = out.to(dtype)
    return (out, weights.to(dtype)) if return_weights else out


def _turns(omega: Tensor, n: int) -> Tensor:
    """``(cos θ, sin θ)`` of the default times' angles ``θ = i ω`` (`rope_angles`), ``(H, N, D/2, 2)``.

    ω is usually a buffer that never changes, so eager calls reuse the last table built for the
    same N, dtype and device while ω's values are equal to those it was built from (a comparison of
    ``H·D/2`` numbers instead of ``H·N·D/2`` cosines and sines); compiled graphs build it in place."""
    if torch.compiler.is_compiling() or omega.requires_grad:
        return _build_turns(omega, n)
    key = (n, omega.dtype, omega.device, tuple(omega.shape))
    cached = _TURNS.get(key)
    if cached is None or not torch.equal(cached[0], omega):
        cached = _TURNS[key] = (omega.clone(), _build_turns(omega, n))
        while len(_TURNS) > _TURNS_KEPT:  # a sampling loop calls every N once: keep the latest few
            del _TURNS[next(iter(_TURNS))]
    return cached[1]


def _build_turns(omega: Tensor, n: int) -> Tensor:
    angles = rope_angles(torch.arange(n, device=omega.device, dtype=omega.dtype), omega)[0]  # (H, N, D/2)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


_TURNS: dict[tuple, tuple[Tensor, Tensor]] = {}
_TURNS_KEPT = 8


def rt_logits(
    dot: Tensor, dt: Tensor, log_m2: Tensor, mu_r: Tensor, sigma_t2: Tensor, eta_t2: Tensor, beta: Tensor
) -> Tensor:
    """``log κ + β κ (dot − 1)`` with ``κ = m²/c(|Δt|)``, elementwise and broadcasting.

    Shared by the reference, blockwise and FlexAttention backends (the dense one computes the same
    expression from a precomputed ``log c`` table). Typical shapes: ``dot (B, H, N, N)``,
    ``dt (B|1, 1, N, N)`` signed, ``log_m2 (B, H, 1, N)``, parameters ``(1, H, 1, 1)``.
    """
    log_kappa = log_m2 - torch.log(rt_noise_variance(dt.abs(), mu_r, sigma_t2, eta_t2))
    return log_kappa + beta * torch.exp(log_kappa) * (dot - 1)


# Above this 2 μ_r Δt, e^{2 μ_r Δt} nears float32's largest number: log c is taken in log space there.
_FAR = 80.0


def log_noise_variance(dt: Tensor, mu_r: Tensor, sigma_t2: Tensor, eta_t2: Tensor) -> Tensor:
    """``log c(Δt)`` of `geoattn.rt.precision.rt_noise_variance`, finite with finite gradients at
    every lag (``Δt ≥ 0``, broadcasting like it).

    ``c`` grows like ``e^{2 μ_r Δt}``: for a fast-decaying head and a long sequence it overflows
    (float32 beyond ``2 μ_r Δt ≈ 88``), and its gradient ``0 · ∞`` is NaN. Beyond ``_FAR`` this
    takes the same quantity in log space, ``logaddexp(log η², log(σ² Δt/x) + x + log(1 − e^{−x}))``
    with ``x = 2 μ_r Δt``; below, the plain formula (values and gradients identical). At ``σ_t² = 0``
    the far branch is ``log η²`` and gives no gradient to ``σ_t²``.
    """
    x = 2 * mu_r * dt
    far = x > _FAR
    near = torch.log(rt_noise_variance(torch.where(far, 0.0, dt), mu_r, sigma_t2, eta_t2))
    x_far, dt_far = torch.where(far, x, 1.0), torch.where(far, dt, 1.0)  # safe where unused
    noisy = sigma_t2 > 0
    growth = (
        torch.log(torch.where(noisy, sigma_t2, 1.0) * dt_far / x_far)
        + x_far
        + torch.log1p(-torch.exp(-x_far))
    )
    growth = torch.where(noisy, growth, -math.inf)
    return torch.where(far, torch.logaddexp(torch.log(eta_t2).expand_as(growth), growth), near)


def _rt_score(dot, dt, query_scalars, key_scalars, params):
    """The `geoattn.attention.blockwise.ScoreFn` of RT-Filter attention: key scalar ``log m_j²``.
    `rt_logits`, with ``β κ`` flushed (`_beta_kappa`)."""
    mu_r, sigma_t2, eta_t2, beta = params
    log_kappa = key_scalars[0] - log_noise_variance(dt.abs(), mu_r, sigma_t2, eta_t2)
    return log_kappa + _beta_kappa(log_kappa, beta) * (dot - 1)


def _beta_kappa(log_kappa: Tensor, beta: Tensor) -> Tensor:
    """``β κ`` with values under ``tiny^¾`` set to 0 (`flush_small`): with a decaying precision, far
    keys have ``κ ≈ 0``, and this factor of ``(dot − 1) ∈ [−2, 0]`` would otherwise be subnormal."""
    return flush_small(beta * torch.exp(log_kappa))


def _rt_tile_backward(score_fn, dot, tq, tk, query_scalars, key_scalars, params, qi, kj, lse, dp, delta):
    """The blockwise tile backward of `_rt_score`, written out (no autograd, so it also runs inside
    a custom operator): ``(p, ∂/∂dot, (), (∂/∂log m²,), (∂/∂μ_r, ∂/∂σ_t², ∂/∂η_t², ∂/∂β))``.

    With ``dS = P ⊙ (dP − δ)``, ``A = dS β κ (dot − 1)`` and ``G = dS + A`` (the total through
    ``log κ = log m² − log c``): ``∂/∂dot = dS β κ``, ``∂/∂log m² = Σ_i G``, ``∂/∂p = −Σ G ∂c/∂p / c``
    for the three noise parameters, ``∂/∂β = Σ A / β``. Shapes as in `geoattn.attention.blockwise`.
    Pairs beyond ``2 μ_r Δt > _FAR`` give the noise parameters no gradient: their precision has
    decayed by ``e^{−80}`` or more (unless ``σ_t²/η_t²`` is below about ``10⁻⁷/Δt``), so their
    weight, and with it their gradient, is nil at any precision.
    """
    mu_r, sigma_t2, eta_t2, beta = params
    dt = (tq - tk).abs()
    x = 2 * mu_r * dt
    near = x <= _FAR
    c = rt_noise_variance(torch.where(near, dt, 0.0), mu_r, sigma_t2, eta_t2)  # finite everywhere
    log_c = torch.where(near, torch.log(c), log_noise_variance(dt, mu_r, sigma_t2, eta_t2))
    p, d_dot, through_kappa, total = _rt_tile_grads(dot, key_scalars[0] - log_c, beta, qi, kj, lse, dp, delta)
    # c depends on (head, Δt) only when the times are shared: reduce over the batch first
    d_c = -total.sum(0, keepdim=True) / c if c.shape[0] == 1 else -total / c  # ∂/∂c
    d_c = torch.where(near, d_c, 0.0)
    dt, x = torch.where(near, dt, 0.0), torch.where(near, x, 0.0)
    partials = (2 * sigma_t2 * dt * dt * _expm1_ratio_slope(x), dt * expm1_ratio(x), torch.ones_like(c))
    d_noise = tuple((d_c * part).sum((0, 2, 3), keepdim=True) for part in partials)
    d_beta = through_kappa.sum((0, 2, 3), keepdim=True) / beta
    return p, d_dot, (), (total.sum(-2, keepdim=True),), (*d_noise, d_beta)


def _rt_lag_score(dot, dt, query_scalars, key_scalars, params):
    """`_rt_score` for the default times: the tile of ``log c(|i − j|)`` comes from a relative table."""
    log_c, beta = params
    log_kappa = key_scalars[0] - log_c
    return log_kappa + _beta_kappa(log_kappa, beta) * (dot - 1)


def _rt_lag_tile_backward(score_fn, dot, tq, tk, query_scalars, key_scalars, params, qi, kj, lse, dp, delta):
    """`_rt_tile_backward` for `_rt_lag_score`: ``∂/∂log c = −G`` on the tile, which the blockwise
    kernel sums per lag; the parameters' gradients follow from the table by autograd, outside."""
    log_c, beta = params
    p, d_dot, through_kappa, total = _rt_tile_grads(dot, key_scalars[0] - log_c, beta, qi, kj, lse, dp, delta)
    d_beta = through_kappa.sum((0, 2, 3), keepdim=True) / beta
    return p, d_dot, (), (total.sum(-2, keepdim=True),), (-total.sum(0, keepdim=True), d_beta)


def _rt_tile_grads(dot, log_kappa, beta, qi, kj, lse, dp, delta):
    """``(P, ∂/∂dot, A, G)`` of one tile from ``log κ``: the part both tile backwards share."""
    b_kappa = _beta_kappa(log_kappa, beta)
    dm1 = dot - 1
    p = flush_small(torch.exp(log_kappa + b_kappa * dm1 - lse).masked_fill(kj > qi, 0.0))
    # products of small factors are flushed too: subnormal operands would slow the matmuls after
    ds = flush_small(p * (dp - delta), signed=True)
    d_dot = flush_small(ds * b_kappa, signed=True)
    through_kappa = flush_small(d_dot * dm1, signed=True)
    return p, d_dot, through_kappa, ds + through_kappa


def _expm1_ratio_slope(x: Tensor) -> Tensor:
    """``d/dx (e^x − 1)/x = (expm1(x)(x − 1) + x)/x²``, by its series near 0 (where the closed form
    cancels): ``Σ_{n≥1} n x^{n−1}/(n+1)!`` to ``x⁶``, below 0.5 in float32 and 0.01 otherwise, so that
    the first omitted term stays under the dtype's rounding."""
    below = 0.5 if x.dtype in (torch.float32, torch.float16, torch.bfloat16) else 0.01
    small = x.abs() < below
    safe = torch.where(small, torch.ones_like(x), x)
    closed = (torch.expm1(safe) * (safe - 1) + safe) / (safe * safe)
    series = 0.5 + x * (1 / 3 + x * (1 / 8 + x * (1 / 30 + x * (1 / 144 + x * (1 / 840 + x / 5760)))))
    return torch.where(small, series, closed)


# ----------------------------------------------------------------------------------------------
# Inputs.


def _prepare_reference(qkv, metric, key_scale, angles, normalize_values):
    """Unit ``q̂, k̂`` (and ``v̂``) rotated to the common frame, and ``log m²``, in plain differentiable
    operations (the reference's autograd checks the fast `_prepare`).

    ``qkv (B, N, 3, H, D)``, ``metric (H, D)`` or None, ``key_scale`` a number or None,
    ``angles (B|1, H, N, D/2)`` or None → ``qh, kh, vh (B, H, N, D)`` and ``log_m2 (B, H, N)``.
    """
    q, k, v = (x.transpose(1, 2) for x in qkv.unbind(2))  # (B, H, N, D)
    log_m2 = _log_key_norm2(torch.linalg.vecdot(k, k), key_scale)
    if metric is not None:
        q, k = q * metric[:, None], k * metric[:, None]
    units = [x * torch.rsqrt(torch.linalg.vecdot(x, x).clamp_min(_EPS2))[..., None] for x in (q, k, v)]
    if not normalize_values:
        units[2] = v
    if angles is not None:  # ⟨R(−t_i) q̂_i, R(−t_j) k̂_j⟩ = ⟨q̂_i, R(t_i − t_j) k̂_j⟩
        units = [rotate_pairs(x, -angles) for x in units]
    return (*units, log_m2)


def _prepare(qkv, metric, key_scale, angles, normalize_values, use_compile=False):
    """`_prepare_reference` with the normalisation and key magnitudes in one autograd node (a dozen
    passes over ``(B, N, 3, H, D)`` instead of about thirty, or with ``use_compile`` one compiled
    kernel each way) and the rotation as one complex multiplication that also writes the head-major
    layout the matmuls need (compiled, that layout change is slower: it stays eager). Compiled
    graphs trace the plain operations and fuse them."""
    if torch.compiler.is_compiling():
        return _prepare_reference(qkv, metric, key_scale, angles, normalize_values)
    scale = None if metric is None else torch.stack((metric, metric, torch.ones_like(metric)))  # (3, H, D)
    units, key_norm2 = _UnitQKV.apply(qkv, scale, key_scale is not None, normalize_values, use_compile)
    units = units.permute(2, 0, 3, 1, 4)  # (3, B, H, N, D) view
    if angles is not None:
        units = _rotate(units, -angles)
    qh, kh, vh = units.contiguous()
    if key_norm2 is None:  # no magnitude precision: log m² = 0
        return qh, kh, vh, qh.new_zeros(qh.shape[:-1])
    return qh, kh, vh, _log_key_norm2(key_norm2.transpose(1, 2), key_scale)


def _log_key_norm2(k_norm2: Tensor, key_scale: float | None) -> Tensor:
    """``log m² = log(key_scale² |k|²)``, with ``|k| = 0`` kept finite; 0 when ``key_scale`` is None."""
    if key_scale is None:
        return torch.zeros_like(k_norm2)
    return torch.log((k_norm2 * key_scale**2).clamp_min(torch.finfo(k_norm2.dtype).tiny))


_EPS2 = 1e-24  # |x|² below this counts as 1e-24: a zero vector maps to zero with finite gradients


class _UnitQKV(torch.autograd.Function):
    """``(qkv·scale)/|qkv·scale|`` over the last axis of ``qkv (B, N, 3, H, D)`` (values left as they
    are unless ``normalize_values``), and the raw squared key norms ``|k|² (B, N, H)``.

    ``scale (3, H, D)`` or None. Backward of ``u = y/|y|``: ``∂y = (∂u − ⟨∂u, u⟩ u)/|y|`` (no radial
    part; none at all where ``|y|²`` sits at the clamp); of ``|k|²``: ``2 k``. With ``use_compile``
    both directions run as compiled kernels (`_unit_forward`, `_unit_backward`).
    """

    @staticmethod
    def forward(ctx, qkv, scale, key_norms: bool, normalize_values: bool, use_compile: bool):
        units, key_norm2, inv, radial = _UNIT_FORWARD(use_compile, qkv, scale, key_norms, normalize_values)
        # qkv itself is needed only with a metric (its gradient): otherwise k = u_k / inv_k is
        # recovered from what is saved anyway, and the (often freshly stacked) input can be freed
        ctx.use_compile = use_compile
        ctx.save_for_backward(qkv if scale is not None else None, scale, inv, radial, units)
        return units, key_norm2

    @staticmethod
    def backward(ctx, grad_units, grad_key_norm2):
        qkv, scale, inv, radial, units = ctx.saved_tensors
        want_scale = scale is not None and ctx.needs_input_grad[1]
        grad_qkv, grad_scale = _UNIT_BACKWARD(
            ctx.use_compile, grad_units, grad_key_norm2, qkv, scale, inv, radial, units, want_scale
        )
        return grad_qkv, grad_scale, None, None, None


def _unit_forward(qkv, scale, key_norms: bool, normalize_values: bool):
    """`_UnitQKV`'s forward: ``(units, |k|² or None, 1/|y| (B, N, 3, H), radial mask (B, N, 3, H))``."""
    y = qkv if scale is None else qkv * scale
    norm2 = torch.linalg.vecdot(y, y)  # (B, N, 3, H)
    inv = torch.rsqrt(norm2.clamp_min(_EPS2))
    radial = (norm2 > _EPS2).to(y.dtype)  # where the norm is a function of y (not the clamp)
    if not normalize_values:
        inv[:, :, 2], radial[:, :, 2] = 1.0, 0.0
    units = y * inv[..., None]
    k = qkv[:, :, 1]
    key_norm2 = (norm2[:, :, 1] if scale is None else torch.linalg.vecdot(k, k)) if key_norms else None
    return units, key_norm2, inv, radial


def _unit_backward(grad_units, grad_key_norm2, qkv, scale, inv, radial, units, want_scale: bool):
    """`_UnitQKV`'s backward: ``(∂qkv, ∂scale or None)``; ``qkv`` is None without a metric."""
    along = torch.linalg.vecdot(grad_units, units) * radial  # (B, N, 3, H)
    grad_y = (grad_units - along[..., None] * units).mul_(inv[..., None])
    grad_qkv = grad_y if scale is None else grad_y * scale
    grad_scale = (grad_y * qkv).sum((0, 1)) if want_scale else None  # (3, H, D)
    if grad_key_norm2 is not None:  # grad_qkv is a fresh tensor: accumulate in place
        k = qkv[:, :, 1] if qkv is not None else units[:, :, 1] / inv[:, :, 1, :, None]
        grad_qkv[:, :, 1] += 2 * grad_key_norm2[..., None] * k
    return grad_qkv, grad_scale


_UNIT_FORWARD, _UNIT_BACKWARD = MaybeCompiled(_unit_forward), MaybeCompiled(_unit_backward)


def _rotate(x: Tensor, angles: Tensor) -> Tensor:
    """`rotate_pairs` ``(x (..., D), angles (..., D/2))``; in eager mode as one complex multiplication,
    ``(x₀ + i x₁) e^{iθ} = (x₀ cos θ − x₁ sin θ) + i (x₀ sin θ + x₁ cos θ)``, the same rotation in one
    pass forward and one backward instead of about eight. Compiled graphs use `rotate_pairs`, which
    the compiler fuses (it has no fused complex kernels)."""
    pairs = x.unflatten(-1, (-1, 2))
    if torch.compiler.is_compiling() or not _complex_view_ok(pairs):
        return rotate_pairs(x, angles)
    angles = angles.to(x.dtype)
    turn = torch.complex(torch.cos(angles), torch.sin(angles))  # (torch.polar: 6× slower, not vectorised)
    return torch.view_as_real(torch.view_as_complex(pairs) * turn).flatten(-2)


def _complex_view_ok(pairs: Tensor) -> bool:
    """Whether `torch.view_as_complex` accepts ``pairs (..., 2)``: unit last stride, even others."""
    even = all(stride % 2 == 0 for stride in pairs.stride()[:-1]) and pairs.storage_offset() % 2 == 0
    return pairs.stride(-1) == 1 and even and pairs.dtype in (torch.float32, torch.float64)


# ----------------------------------------------------------------------------------------------
# Backends. Each takes unit (or raw, for normalize_values=False) tensors already rotated to the
# common frame: qh, kh, vh (B, H, N, D), log_m2 (B, H, N), times (N,) | (B, N) | None (0 … N−1),
# params (H,), and returns Σ_j A_ij vh_j of shape (B, H, N, D) (still in the common frame).


def _explicit(times: Tensor | None, n: int, device, dtype) -> Tensor:
    """``(B|1, N)`` times; None stands for ``0, 1, …, N−1``."""
    if times is None:
        return torch.arange(n, device=device, dtype=dtype).unsqueeze(0)
    return times if times.dim() == 2 else times.unsqueeze(0)


def _noise_lags(n, mu_r, sigma_t2, eta_t2):
    """``log c(ℓ)`` for the lags ``ℓ = 0 … N−1`` per head, ``(H, N)``: with the default times every
    ``|Δt_ij|`` is a lag, so this holds all the transcendental work of the precision."""
    lags = torch.arange(n, device=mu_r.device, dtype=mu_r.dtype)
    return log_noise_variance(lags, mu_r[:, None], sigma_t2[:, None], eta_t2[:, None])


def _reference(qh, kh, vh, log_m2, times, mu_r, sigma_t2, eta_t2, beta, causal):
    n = qh.shape[-2]
    t = _explicit(times, n, qh.device, qh.dtype)
    dt = (t[:, :, None] - t[:, None, :]).unsqueeze(1)  # (B|1, 1, N, N)
    heads = [p.view(1, -1, 1, 1) for p in (mu_r, sigma_t2, eta_t2, beta)]
    logits = rt_logits(qh @ kh.transpose(-1, -2), dt, log_m2.unsqueeze(-2), *heads)  # (B, H, N, N)
    if causal:
        future = torch.ones(n, n, dtype=torch.bool, device=qh.device).triu(1)
        logits = logits.masked_fill(future, -math.inf)
    weights = torch.softmax(logits, dim=-1)
    return weights @ vh, weights


def _dense(qh, kh, vh, log_m2, times, mu_r, sigma_t2, eta_t2, beta, causal, use_compile):
    log_c = _log_noise_table(times, mu_r, sigma_t2, eta_t2, causal, qh.shape[-2])
    return _DenseRT.apply(qh, kh, vh, log_m2, log_c, beta, use_compile)


def _log_noise_table(times, mu_r, sigma_t2, eta_t2, causal, n):
    """``log c(|t_i − t_j|)`` per head, ``(B|1, H, N, N)``, ``+inf`` above the diagonal if causal.

    It does not depend on the batch when the times do not, so the transcendental work of the
    precision is ``H·N²`` however large the batch (``H·N`` with the default times, gathered from
    `_noise_lags`); gradients reach the three parameters through it.
    """
    if times is None:
        lags = _noise_lags(n, mu_r, sigma_t2, eta_t2)  # (H, N)
        log_c = (lags @ _lag_spread(n, mu_r.device, mu_r.dtype)).view(1, -1, n, n)
    else:
        t = _explicit(times, n, mu_r.device, mu_r.dtype)  # (B|1, N)
        dt = (t[:, None, :, None] - t[:, None, None, :]).abs()  # (B|1, 1, N, N)
        log_c = log_noise_variance(dt, *(p.view(1, -1, 1, 1) for p in (mu_r, sigma_t2, eta_t2)))
    if causal:
        log_c = log_c.masked_fill(torch.ones(n, n, dtype=torch.bool, device=log_c.device).triu(1), math.inf)
    return log_c


def _lag_spread(n: int, device, dtype) -> Tensor:
    """The one-hot ``(N, N·N)`` matrix with ``[ℓ, i·N + j] = 1`` where ``|i − j| = ℓ``: ``table @ it``
    spreads an ``(H, N)`` table over the lags to ``(H, N·N)`` pairs, exactly (one term per sum), and
    its backward, a matmul too, sums each lag's pairs (a gather's backward scatters instead, with
    accumulation, several times slower on a CPU). Eager calls reuse it (at most N = DENSE_MAX_N:
    8 MiB in float32); compiled graphs build it in place."""
    if torch.compiler.is_compiling():
        return _build_lag_spread(n, device, dtype)
    return _cached_lag_spread(n, torch.device(device), dtype)


def _build_lag_spread(n: int, device, dtype) -> Tensor:
    lag = torch.arange(n, device=device)
    return ((lag[:, None] - lag[None]).abs().flatten() == lag[:, None]).to(dtype)


_cached_lag_spread = functools.lru_cache(maxsize=8)(_build_lag_spread)


def _dense_weights(dm1, log_m2, log_c, beta):
    """The dense path's ``P = softmax(log κ + β κ (dot − 1))``, ``(B, H, N, N)``, from ``dm1 = dot − 1``.

    Weights and ``β κ`` below ``tiny^¾`` are set to 0 (`flush_small`): they change no sum at any
    precision, and subnormal operands slow every later multiplication severalfold (the cost would
    otherwise depend on the key magnitudes and on how fast the precision decays).
    """
    logits = (log_m2[..., None, :] - log_c).addcmul_(_dense_beta_kappa(log_m2, log_c, beta), dm1)
    return flush_small(torch.softmax(logits, dim=-1))


def _dense_beta_kappa(log_m2, log_c, beta):
    """``β κ = β m²_j / c_ij`` of the dense path, ``(B, H, N, N)``, flushed like `_beta_kappa`."""
    return flush_small(torch.exp(log_m2)[..., None, :] * (beta.view(-1, 1, 1) * torch.exp(-log_c)))


def _dense_weights_backward(dp, p, dm1, log_m2, log_c, beta, reduce_table: bool):
    """``(∂/∂dot, ∂/∂log m² (B, H, N), ∂/∂log c (like log_c), ∂/∂β (H,))`` from ``dP = ∂/∂P``."""
    ds = flush_small(torch._softmax_backward_data(dp, p, -1, p.dtype), signed=True)
    d_dot = flush_small(
        ds * _dense_beta_kappa(log_m2, log_c, beta), signed=True
    )  # (subnormals: slow matmuls)
    through_kappa = flush_small(d_dot * dm1, signed=True)  # A = dS β κ (dot − 1)
    total = ds + through_kappa  # G, the total through log κ
    d_c = -(total.sum(0, keepdim=True) if reduce_table else total)
    return d_dot, total.sum(-2), d_c, through_kappa.sum((0, 2, 3)) / beta


_DENSE_FORWARD, _DENSE_BACKWARD = MaybeCompiled(_dense_weights), MaybeCompiled(_dense_weights_backward)


class _DenseRT(torch.autograd.Function):
    """RT-Filter attention on one ``N × N`` tile per head, with a hand-written backward.

    With ``a = log κ = log m²_j − log c_ij`` and ``bκ = β κ``: ``s = a + bκ (⟨q̂, k̂⟩ − 1)``,
    ``P = softmax(s)``, ``O = P V``. Backward, with ``dS = P ⊙ (dP − rowsum(dP ⊙ P))``:
    ``∂/∂dot = dS ⊙ bκ``; ``A = dS ⊙ bκ ⊙ (dot − 1)`` is the part through ``κ``, ``G = dS + A`` the
    total through ``log κ``, so ``∂/∂log m²_j = Σ_i G``, ``∂/∂log c = −G``, ``∂/∂β = Σ A / β``.
    Masked entries have ``log c = +inf``: ``a = −inf``, ``bκ = 0``, and every gradient there is 0.
    Saves ``P`` and ``dot − 1``; the elementwise work runs compiled for large problems.
    """

    @staticmethod
    def forward(ctx, qh, kh, vh, log_m2, log_c, beta, use_compile):
        # qh, kh, vh (B, H, N, D); log_m2 (B, H, N); log_c (B|1, H, N, N); beta (H,)
        dm1 = torch.matmul(qh, kh.transpose(-1, -2)).sub_(1)  # ⟨q̂, k̂⟩ − 1, (B, H, N, N)
        p = _DENSE_FORWARD(use_compile, dm1, log_m2, log_c, beta)
        ctx.use_compile = use_compile
        ctx.save_for_backward(qh, kh, vh, log_m2, log_c, beta, p, dm1)
        return torch.matmul(p, vh)

    @staticmethod
    def backward(ctx, grad_out):
        qh, kh, vh, log_m2, log_c, beta, p, dm1 = ctx.saved_tensors
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        dv = torch.matmul(p.transpose(-1, -2), grad_out) if need_v else None
        dp = torch.matmul(grad_out, vh.transpose(-1, -2))
        reduce_table = log_c.shape[0] == 1 and p.shape[0] > 1
        d_dot, d_m2, d_c, d_beta = _DENSE_BACKWARD(
            ctx.use_compile, dp, p, dm1, log_m2, log_c, beta, reduce_table
        )
        dq = torch.matmul(d_dot, kh) if need_q else None
        dk = torch.matmul(d_dot.transpose(-1, -2), qh) if need_k else None
        return dq, dk, dv, d_m2, d_c, d_beta, None


def _separable(qh, kh, vh, log_m2, times, mu_r, sigma_t2, eta_t2, beta, causal, use_compile):
    folded = _FOLD_SEPARABLE(use_compile, qh, kh, vh, log_m2, mu_r, eta_t2, beta)
    return _sdpa(*folded, qh.shape[-1], causal, use_compile)


def _fold_separable(qh, kh, vh, log_m2, mu_r, eta_t2, beta):
    """Folded SDPA inputs for σ_t² = 0: ``[β q̂, 1, 0] · [κ k̂, log κ − β κ, 0] = logit``, each
    ``(B, H, N, D + 2)``, and the values zero-padded to the same width."""
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
    n = qh.shape[-2]
    t = _explicit(times, n, qh.device, qh.dtype)  # (B|1, N)
    two_mu = (2 * mu_r).view(1, -1, 1)  # (1, H, 1)
    starts = _tied_chunks(t, two_mu)
    if starts is None:  # many short chunks: the general kernel costs less
        general = _PATHS["flex" if qh.device.type == "cuda" else "blockwise"]
        return general(qh, kh, vh, log_m2, times, mu_r, sigma_t2, eta_t2, beta, causal, use_compile)
    vx = F.pad(vh, (0, 2))  # padded once: each chunk attends to a view of it
    outs = []
    for c0, c1 in zip(starts, [*starts[1:], n]):
        rel = t[:, None, :c1] - t[:, None, c0 : c0 + 1]  # (B|1, 1, c1): times from the chunk's first query
        q_c = qh[..., c0:c1, :]
        qx, kx = _FOLD_TIED(use_compile, q_c, kh[..., :c1, :], log_m2[..., :c1], rel, two_mu, eta_t2, beta)
        outs.append(_sdpa(qx, kx, vx[..., :c1, :], qh.shape[-1], causal, use_compile))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)


@torch.compiler.disable  # reads values: a compiled graph stops here on purpose (no item() warning)
def _tied_chunks(t: Tensor, two_mu: Tensor) -> list[int] | None:
    """Starts of the query chunks of the tied path: each spans at most ``_TIED_MAX_EXPONENT`` in
    ``2 μ_r Δt`` (``two_mu``: its largest value over the heads; every sequence of the batch, times
    ``t (B|1, N)`` non-decreasing), or None when that needs more than one chunk per
    ``_TIED_MIN_CHUNK`` tokens. Reads the times and ``two_mu`` (a host copy)."""
    n = t.shape[-1]
    two_mu = float(two_mu.max())
    if two_mu * float((t[:, -1] - t[:, 0]).max()) <= _TIED_MAX_EXPONENT:
        return [0]
    t = t.detach().cpu()
    starts = [0]
    while True:
        start = starts[-1]
        reach = t[:, start : start + 1] + _TIED_MAX_EXPONENT / two_mu  # (B|1, 1)
        end = max(start + 1, int(torch.searchsorted(t, reach, right=True).min()))
        if end >= n:
            return starts
        starts.append(end)
        if len(starts) > max(1, n // _TIED_MIN_CHUNK):
            return None


def _fold_tied(qh, kh, log_m2, rel, two_mu, eta_t2, beta):
    """Folded SDPA inputs for σ_t² = 2 μ_r η_t², for the queries of one chunk (the last ``nq`` of the
    keys) and every key up to its end: ``κ_ij = s_i a_j`` and
    ``[β s_i q̂_i, −β s_i, 1] · [a_j k̂_j, a_j, log a_j] = logit_ij − log s_i``.

    ``qh (B, H, nq, D)``, ``kh (B, H, Nk, D)``, ``log_m2 (B, H, Nk)``, key times from the chunk's
    first query ``rel (B|1, 1, Nk)`` (so ``s_i ≥ e^{−20}`` and ``a_j ≤ e^{20} m²/η²`` in the chunk),
    ``two_mu (1, H, 1)``. Returns ``(B, H, nq, D + 2)`` queries and ``(B, H, Nk, D + 2)`` keys (the
    values are only zero-padded, once for every chunk). Keys with ``a_j < e^{−40}``
    (``_TIED_NEGLIGIBLE``; long before the chunk) get 0 in the product coordinates: their term
    ``β s_i a_j (⟨q̂, k̂⟩ − 1)`` is below ``2 β e^{−40}``, under the rounding of their logit
    (``log a_j`` stays exact), and as subnormal numbers they would slow the matmuls many times.
    """
    bs = beta.view(1, -1, 1, 1) * torch.exp(-two_mu * rel[..., -qh.shape[-2] :])[..., None]
    bs = bs.expand_as(qh[..., :1])  # β s_i
    log_a = log_m2 - torch.log(eta_t2).view(1, -1, 1) + two_mu * rel  # (B, H, Nk)
    a = torch.where(log_a < _TIED_NEGLIGIBLE, 0.0, torch.exp(log_a))[..., None]
    qx = torch.cat((bs * qh, -bs, torch.ones_like(bs)), dim=-1)
    kx = torch.cat((a * kh, a, log_a[..., None]), dim=-1)
    return qx, kx


def _sdpa(qx: Tensor, kx: Tensor, vx: Tensor, d: int, causal: bool, use_compile: bool) -> Tensor:
    """Softmax attention with ``scale=1`` on folded queries/keys of width D + 2 and values zero-padded
    to the same width (SDPA's fused CPU kernels need equal widths), cropped back to ``(…, D)``.
    Causal with fewer queries than keys: the queries are the last positions (a chunk of the tied path)."""
    if causal and qx.shape[-2] < kx.shape[-2]:
        return _chunk_attention(qx, kx, vx, use_compile)[..., :d]
    if qx.device.type == "cpu" and not subnormals_flushed():
        return torch.ops.geoattn.softmax_attention(qx, kx, vx, causal, use_compile)[0][..., :d]
    return F.scaled_dot_product_attention(qx, kx, vx, is_causal=causal, scale=1.0)[..., :d]


def _chunk_attention(q: Tensor, k: Tensor, v: Tensor, use_compile: bool) -> Tensor:
    """Causal softmax attention (``scale=1``) of the queries at positions ``[c0, c0 + nq)`` on the keys
    ``[0, c0 + nq)``: ``q (B, H, nq, D)``, ``k, v (B, H, c0 + nq, D)``. SDPA aligns its causal mask
    at the first key; on the CPU the past keys and the chunk's own run as two fused calls merged by
    their log-sum-exps (`_ChunkAttention`), elsewhere as one call with a ``(nq, c0 + nq)`` mask."""
    if q.device.type == "cpu":
        return _ChunkAttention.apply(q, k, v, use_compile)
    c0 = k.shape[-2] - q.shape[-2]
    keys = torch.arange(k.shape[-2], device=q.device)
    mask = keys[None] <= torch.arange(c0, k.shape[-2], device=q.device)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)


class _ChunkAttention(torch.autograd.Function):
    """`_chunk_attention` on the CPU: ``o = e^{l₁ − l} o₁ + e^{l₂ − l} o₂`` with ``(o₁, l₁)`` SDPA's
    output and log-sum-exp over the past keys (no mask), ``(o₂, l₂)`` over the chunk (causal) and
    ``l = logaddexp(l₁, l₂)``. Backward: each part's softmax backward with the merged ``o`` and ``l``
    is that part's share of the whole softmax's (``P = e^{s − l}``, ``δ = rowsum(dO ⊙ o)``), so the
    gradients are the parts' (summed for q), by SDPA's own backward where subnormal floats are
    flushed and the blockwise one otherwise (as in `_sdpa`)."""

    @staticmethod
    def forward(ctx, q, k, v, use_compile):
        c0 = k.shape[-2] - q.shape[-2]
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        o1, l1 = flash(q, k[..., :c0, :], v[..., :c0, :], 0.0, False, scale=1.0)
        o2, l2 = flash(q, k[..., c0:, :], v[..., c0:, :], 0.0, True, scale=1.0)
        lse = torch.logaddexp(l1, l2)  # (B, H, nq)
        out = o1 * torch.exp(l1 - lse)[..., None] + o2 * torch.exp(l2 - lse)[..., None]
        ctx.use_compile = use_compile
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        c0 = k.shape[-2] - q.shape[-2]
        grad_out = grad_out.contiguous()
        past, own = (
            _softmax_backward(
                q, k[..., part, :], v[..., part, :], out, lse, grad_out, causal, ctx.use_compile
            )
            for part, causal in ((slice(None, c0), False), (slice(c0, None), True))
        )
        return past[0] + own[0], torch.cat((past[1], own[1]), -2), torch.cat((past[2], own[2]), -2), None


def _softmax_backward(q, k, v, out, lse, grad_out, causal, use_compile) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of ``softmax(q kᵀ) v`` (CPU, scale 1) from its output and log-sum-exp."""
    if subnormals_flushed():
        back = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        return back(grad_out, q, k, v, out, lse, 0.0, causal, scale=1.0)
    return torch.ops.geoattn.softmax_attention_backward(q, k, v, out, lse, grad_out, causal, use_compile)


# SDPA's forward with a backward that does not slow down on sharp attention, for processes that keep
# subnormal floats (where `geoattn.subnormals.flush_subnormals` ran, as in the geoattn program,
# SDPA's own backward runs instead): PyTorch's CPU SDPA backward recomputes exp(s − lse), and for
# logits spread over more than ~87 (large key magnitudes, as the folded precisions make them) many
# of those are subnormal; measured here, a logit scale of 30 made SDPA's fwd+bwd 11× slower. The
# blockwise backward flushes them instead.
@torch.library.custom_op("geoattn::softmax_attention", mutates_args=())
def _softmax_attention_op(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, use_compile: bool
) -> tuple[Tensor, Tensor]:
    # (CPU only, see _sdpa: this kernel returns the log-sum-exp that the backward needs)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = flash(q, k, v, 0.0, causal, scale=1.0)
    return out.contiguous(), lse.contiguous()  # (the layouts the fake implementation promises)


@_softmax_attention_op.register_fake
def _(q, k, v, causal, use_compile):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:-1])


@torch.library.custom_op("geoattn::softmax_attention_backward", mutates_args=())
def _softmax_attention_backward_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    causal: bool,
    use_compile: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    b, h, nq, _ = q.shape
    times = q.new_zeros(1, max(nq, k.shape[-2]))  # the plain score does not use them
    dq, dk, dv, *_ = blockwise_backward(
        _dot_score,
        causal,
        *default_blocks(b * h, k.shape[-2]),
        use_compile,
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        times,
        (),
        (),
        (),
        out,
        lse,
        grad_out.contiguous(),
        tile_backward=_DOT_TILE_BACKWARD,
    )
    return dq, dk, dv


@_softmax_attention_backward_op.register_fake
def _(q, k, v, out, lse, grad_out, causal, use_compile):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))


def _softmax_attention_setup(ctx, inputs, output):
    q, k, v, causal, use_compile = inputs
    ctx.flags = (causal, use_compile)
    ctx.save_for_backward(q, k, v, *output)


def _softmax_attention_grad(ctx, grad_out, grad_lse):
    dq, dk, dv = torch.ops.geoattn.softmax_attention_backward(*ctx.saved_tensors, grad_out, *ctx.flags)
    return dq, dk, dv, None, None


_softmax_attention_op.register_autograd(_softmax_attention_grad, setup_context=_softmax_attention_setup)


def _dot_score(dot, dt, query_scalars, key_scalars, params):
    return dot


def _dot_tile_backward(score_fn, dot, tq, tk, query_scalars, key_scalars, params, qi, kj, lse, dp, delta):
    """The tile backward of plain softmax attention (score = dot), subnormals flushed."""
    p = flush_small(torch.exp(dot - lse).masked_fill(kj > qi, 0.0))
    return p, flush_small(p * (dp - delta), signed=True), (), (), ()


def _blockwise(qh, kh, vh, log_m2, times, mu_r, sigma_t2, eta_t2, beta, causal, use_compile):
    if times is None:  # the default times: log c(|i − j|) as a relative table of the kernel
        params = [_lag_table(qh.shape[-2], mu_r, sigma_t2, eta_t2), beta]
        times = torch.arange(qh.shape[-2], device=qh.device, dtype=qh.dtype)
    else:
        params = [mu_r, sigma_t2, eta_t2, beta]
    t = times if times.dim() == 2 else times.unsqueeze(0)
    return torch.ops.geoattn.rt_blockwise(qh, kh, vh, log_m2, t, params, causal, use_compile)[0]


def _lag_table(n: int, mu_r: Tensor, sigma_t2: Tensor, eta_t2: Tensor) -> Tensor:
    """``log c`` of the default times as a relative table ``(H, 2N − 1)``, entry ``i − j + N − 1``."""
    lags = _noise_lags(n, mu_r, sigma_t2, eta_t2)  # (H, N), lags 0 … N − 1
    return torch.cat((lags[:, 1:].flip(-1), lags), dim=-1)


def _tile_functions(params: list[Tensor]):
    """The score and tile backward for the two parameter sets of `_rt_blockwise_op`: a relative
    table ``(log c (H, 2N − 1), β)`` or the four ``(H,)`` parameters."""
    if params[0].dim() == 2:
        return _rt_lag_score, _RT_LAG_TILE_BACKWARD
    return _rt_score, _RT_TILE_BACKWARD


# The blockwise kernel as a custom operator: a compiled graph calls it whole (its Python loops and
# compiled tiles run at call time) instead of tracing every tile, and the path stays fullgraph.
@torch.library.custom_op("geoattn::rt_blockwise", mutates_args=())
def _rt_blockwise_op(
    qh: Tensor,
    kh: Tensor,
    vh: Tensor,
    log_m2: Tensor,
    times: Tensor,
    params: list[Tensor],
    causal: bool,
    use_compile: bool,
) -> tuple[Tensor, Tensor]:
    kernel = _native_kernel(qh, params)
    if kernel is not None:
        out, lse = kernel.rt_lag_forward(
            *_rows(qh, kh, vh), *_contiguous(log_m2, *params), causal, *NATIVE_BLOCKS
        )
        return out, lse
    b, h, n, _ = qh.shape
    score, _ = _tile_functions(params)
    blocks = default_blocks(b * h, n)
    return blockwise_forward(score, causal, *blocks, use_compile, qh, kh, vh, times, (), (log_m2,), params)


def _native_kernel(qh: Tensor, params: list[Tensor]):
    """The native CPU kernel (`geoattn.attention.native`) where it applies: a lag table (the default
    times) on the CPU, float32 or float64, and the kernel built; else None (the Python loops)."""
    lag_table = params[0].dim() == 2
    if lag_table and qh.device.type == "cpu" and qh.dtype in (torch.float32, torch.float64):
        return native.cpu_kernels()
    return None


def _contiguous(*tensors: Tensor) -> list[Tensor]:
    return [t.contiguous() for t in tensors]


def _rows(*tensors: Tensor) -> list[Tensor]:
    """``(B, H, N, D)`` tensors as the native kernel reads them: rows contiguous, other strides free
    (a token-major projection's layout is read in place), else copied."""
    return [t if t.stride(-1) == 1 and t.stride(-2) >= t.shape[-1] else t.contiguous() for t in tensors]


@_rt_blockwise_op.register_fake
def _(qh, kh, vh, log_m2, times, params, causal, use_compile):
    return torch.empty_like(vh, memory_format=torch.contiguous_format), qh.new_empty(qh.shape[:-1])


@torch.library.custom_op("geoattn::rt_blockwise_backward", mutates_args=())
def _rt_blockwise_backward_op(
    qh: Tensor,
    kh: Tensor,
    vh: Tensor,
    log_m2: Tensor,
    times: Tensor,
    params: list[Tensor],
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    causal: bool,
    use_compile: bool,
) -> list[Tensor]:
    kernel = _native_kernel(qh, params)
    if kernel is not None:
        tensors = (*_rows(qh, kh, vh), *_contiguous(log_m2, *params, out, lse), *_rows(grad_out))
        return list(kernel.rt_lag_backward(*tensors, causal, *NATIVE_BLOCKS))
    b, h, n, _ = qh.shape
    score, tile_backward = _tile_functions(params)
    blocks = default_blocks(b * h, n)
    dq, dk, dv, _, (d_m2,), d_params = blockwise_backward(
        score,
        causal,
        *blocks,
        use_compile,
        qh,
        kh,
        vh,
        times,
        (),
        (log_m2,),
        params,
        out,
        lse,
        grad_out.contiguous(),
        tile_backward=tile_backward,
    )
    return [dq, dk, dv, d_m2, *d_params]


@_rt_blockwise_backward_op.register_fake
def _(qh, kh, vh, log_m2, times, params, out, lse, grad_out, causal, use_compile):
    return [torch.empty_like(x, memory_format=torch.contiguous_format) for x in (qh, kh, vh, log_m2, *params)]


def _blockwise_setup(ctx, inputs, output):
    qh, kh, vh, log_m2, times, params, causal, use_compile = inputs
    ctx.flags, ctx.n_params = (causal, use_compile), len(params)
    ctx.save_for_backward(qh, kh, vh, log_m2, times, *params, *output)


def _blockwise_grad(ctx, grad_out, grad_lse):
    qh, kh, vh, log_m2, times, *rest = ctx.saved_tensors
    params, (out, lse) = rest[: ctx.n_params], rest[ctx.n_params :]
    grads = torch.ops.geoattn.rt_blockwise_backward(
        qh, kh, vh, log_m2, times, params, out, lse, grad_out, *ctx.flags
    )
    dq, dk, dv, d_m2, *d_params = grads
    return dq, dk, dv, d_m2, None, d_params, None, None


_rt_blockwise_op.register_autograd(_blockwise_grad, setup_context=_blockwise_setup)


def _fused_native(qkv: Tensor, omega: Tensor | None) -> bool:
    """Whether `_rt_qkv_op` serves a call of the blockwise path with the default times: on the CPU in
    float32 or float64 with the native kernels built (a constant of the process) and ω not learned
    (its gradient is left to the Python rotation). Static facts only."""
    learned = omega is not None and omega.requires_grad
    floats = qkv.dtype in (torch.float32, torch.float64)
    return qkv.device.type == "cpu" and floats and not learned and native.available()


# The native kernel from the fused projection (`geoattn.attention.native`, ``rt_qkv.h``): `_prepare`,
# the lag table of `_lag_table`, the blockwise kernel and the rotation of the output back into each
# query's frame as one operator.
@torch.library.custom_op("geoattn::rt_qkv", mutates_args=())
def _rt_qkv_op(
    qkv: Tensor,
    metric: Tensor | None,
    turns: Tensor | None,
    params: list[Tensor],
    key_scale: float | None,
    normalize_values: bool,
    causal: bool,
) -> tuple[Tensor, Tensor]:
    """``qkv (B, N, 3, H, D)``, ``metric (H, D)``, ``turns (H, N, D/2, 2)`` (``cos θ, sin θ`` of the
    rotation angles) and ``params`` ``(μ_r, σ_t², η_t², β)``, each ``(H,)`` → ``(out (B, H, N, D)``
    in each query's frame, ``lse (B, H, N))``."""
    return _native_qkv_forward(qkv, metric, turns, params, key_scale, normalize_values, causal)


def _native_qkv_forward(qkv, metric, turns, params, key_scale, normalize_values, causal):
    inputs = _qkv_inputs(qkv, metric, turns, key_scale, normalize_values)
    kernel = native.cpu_kernels()
    out, lse = kernel.rt_qkv_forward(*inputs, _contiguous(*params), _FAR, causal, *NATIVE_BLOCKS)
    return out, lse


def _native_qkv_backward(qkv, metric, turns, params, key_scale, normalize_values, causal, out, lse, grad_out):
    inputs = _qkv_inputs(qkv, metric, turns, key_scale, normalize_values)
    tensors = (*_contiguous(out, lse), *_rows(grad_out))
    kernel = native.cpu_kernels()
    return list(kernel.rt_qkv_backward(*inputs, _contiguous(*params), _FAR, *tensors, causal, *NATIVE_BLOCKS))


def _qkv_inputs(qkv, metric, turns, key_scale, normalize_values) -> tuple:
    none = qkv.new_empty(0)
    magnitudes = key_scale is not None
    return (
        qkv.contiguous(),
        none if metric is None else metric.contiguous(),
        none if turns is None else turns.contiguous(),
        magnitudes,
        float(key_scale) if magnitudes else 0.0,
        normalize_values,
    )


@_rt_qkv_op.register_fake
def _(qkv, metric, turns, params, key_scale, normalize_values, causal):
    b, n, _, h, d = qkv.shape
    return qkv.new_empty(b, h, n, d), qkv.new_empty(b, h, n)


@torch.library.custom_op("geoattn::rt_qkv_backward", mutates_args=())
def _rt_qkv_backward_op(
    qkv: Tensor,
    metric: Tensor | None,
    turns: Tensor | None,
    params: list[Tensor],
    key_scale: float | None,
    normalize_values: bool,
    causal: bool,
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
) -> list[Tensor]:
    """``[∂qkv, ∂metric (empty without a metric), ∂μ_r, ∂σ_t², ∂η_t², ∂β]``."""
    args = (qkv, metric, turns, params, key_scale, normalize_values, causal, out, lse, grad_out)
    return _native_qkv_backward(*args)


@_rt_qkv_backward_op.register_fake
def _(qkv, metric, turns, params, key_scale, normalize_values, causal, out, lse, grad_out):
    grad_metric = qkv.new_empty(0) if metric is None else torch.empty_like(metric)
    return [qkv.new_empty(qkv.shape), grad_metric, *(torch.empty_like(p) for p in params)]


def _rt_qkv_setup(ctx, inputs, output):
    qkv, metric, turns, params, *flags = inputs
    ctx.flags, ctx.has_metric, ctx.n_params = flags, metric is not None, len(params)
    ctx.save_for_backward(qkv, metric, turns, *params, *output)


def _rt_qkv_grad(ctx, grad_out, grad_lse):
    qkv, metric, turns, *rest = ctx.saved_tensors
    params, (out, lse) = rest[: ctx.n_params], rest[ctx.n_params :]
    grads = torch.ops.geoattn.rt_qkv_backward(qkv, metric, turns, params, *ctx.flags, out, lse, grad_out)
    grad_qkv, grad_metric, *grad_params = grads
    return grad_qkv, grad_metric if ctx.has_metric else None, None, grad_params, None, None, None


_rt_qkv_op.register_autograd(_rt_qkv_grad, setup_context=_rt_qkv_setup)


class _RTQkv(torch.autograd.Function):
    """`_rt_qkv_op` for eager calls: ``apply(qkv, metric, turns, (key_scale, normalize_values,
    causal), *params) -> out``, the same native forward and backward."""

    @staticmethod
    def forward(ctx, qkv, metric, turns, flags, *params):
        out, lse = _native_qkv_forward(qkv, metric, turns, params, *flags)
        ctx.flags, ctx.has_metric = flags, metric is not None
        ctx.save_for_backward(qkv, metric, turns, out, lse, *params)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        qkv, metric, turns, out, lse, *params = ctx.saved_tensors
        args = (qkv, metric, turns, params, *ctx.flags, out, lse, grad_out)
        grad_qkv, grad_metric, *grad_params = _native_qkv_backward(*args)
        return grad_qkv, grad_metric if ctx.has_metric else None, None, None, *grad_params


def _flex(qh, kh, vh, log_m2, times, mu_r, sigma_t2, eta_t2, beta, causal, use_compile):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    b, h, n, _ = qh.shape
    t = _explicit(times, n, qh.device, qh.dtype).expand(b, n)

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


_FOLD_SEPARABLE, _FOLD_TIED, _RT_TILE_BACKWARD, _RT_LAG_TILE_BACKWARD, _DOT_TILE_BACKWARD = (
    MaybeCompiled(f)
    for f in (_fold_separable, _fold_tied, _rt_tile_backward, _rt_lag_tile_backward, _dot_tile_backward)
)
_PATHS = {
    "separable": _separable,
    "tied": _sdpa_tied,
    "dense": _dense,
    "blockwise": _blockwise,
    "flex": _flex,
}


def _worth_compiling(path: str, pairs: int) -> bool:
    """Whether the elementwise work of a call with ``pairs = B·H·N²`` runs through `torch.compile`:
    for large problems, except the dense path without autograd. An evaluation (a model's forward on a
    whole validation pool, once) would pay seconds of compilation there for a few passes over the
    tile that eager operations make in milliseconds; training repeats its shapes and amortises it."""
    return pairs >= COMPILE_MIN_PAIRS and (path != "dense" or torch.is_grad_enabled())


def _choose_path(backend, structure, device, batch_heads, n, params, causal, default_times=False) -> str:
    """The path of `_PATHS`, from static facts only (never from the values of a tensor). On the CPU
    with the default times, the native kernel (`geoattn.attention.native`, a constant of the process)
    serves every structure and length: exact for all parameters, level with the dense tile at
    N = 64 and faster than every other path beyond (BENCHMARKS.md)."""
    if backend != "auto":
        return backend
    if default_times and device.type == "cpu" and native.available():
        return "blockwise"
    mu_r, sigma_t2, eta_t2, _ = params
    if n <= DENSE_MAX_N and batch_heads * n * n <= DENSE_MAX_ELEMENTS:
        return "dense"  # short sequences: every structure, exactly (for σ_t² = 0 its table is log η_t²)
    if structure == "separable" and not sigma_t2.requires_grad:
        return "separable"
    process_grad = mu_r.requires_grad or sigma_t2.requires_grad or eta_t2.requires_grad
    if structure == "tied" and causal and not process_grad:
        return "tied"
    return "flex" if device.type == "cuda" else "blockwise"


# ----------------------------------------------------------------------------------------------
# Validation.


def _validate(q, k, v, mu_r, sigma_t2, eta_t2, beta, omega, positions, backend, structure):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if structure not in STRUCTURES:
        raise ValueError(f"structure must be one of {STRUCTURES}, got {structure!r}")
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
    if n == 0 or d == 0:
        raise ValueError(f"q, k, v need at least one token and D > 0, got q of shape {_shape(q)}")
    params = (mu_r, sigma_t2, eta_t2, beta)
    for name, p in zip(("mu_r", "sigma_t2", "eta_t2", "beta"), params):
        if not isinstance(p, Tensor) or p.shape != (h,):
            raise ValueError(f"{name} must be a tensor of shape (H,) = ({h},), got {_shape(p)}")
    if omega is not None and (not isinstance(omega, Tensor) or omega.shape != (h, d // 2)):
        raise ValueError(f"omega must have shape (H, D/2) = ({h}, {d // 2}), got {_shape(omega)}")
    if positions is not None:
        if not isinstance(positions, Tensor) or positions.shape not in ((n,), (b, n)):
            raise ValueError(
                f"positions must have shape (N,) = ({n},) or (B, N) = ({b}, {n}), got {_shape(positions)}"
            )
        if positions.is_complex() or positions.dtype == torch.bool:
            raise ValueError(f"positions must be real times, got dtype {positions.dtype}")
    if not torch.compiler.is_compiling():  # value checks read the parameters; compiled graphs skip them
        _validate_values(mu_r, sigma_t2, eta_t2, beta, positions, structure)


def _validate_values(mu_r, sigma_t2, eta_t2, beta, positions, structure):
    for name, p, ok, rule in (
        ("mu_r", mu_r, mu_r >= 0, "≥ 0"),
        ("sigma_t2", sigma_t2, sigma_t2 >= 0, "≥ 0"),
        ("eta_t2", eta_t2, eta_t2 > 0, "> 0"),
        ("beta", beta, beta > 0, "> 0"),
    ):
        if not bool(ok.all()):
            raise ValueError(f"{name} must be {rule} in every head, got {p.detach().cpu().tolist()}")
    if structure == "separable" and not bool((sigma_t2 == 0).all()):
        raise ValueError(f"structure='separable' needs sigma_t2 = 0, got {sigma_t2.detach().cpu().tolist()}")
    if structure == "tied":
        if positions is not None and not bool((positions.diff(dim=-1) >= 0).all()):
            raise ValueError("structure='tied' needs non-decreasing positions")
        tied = 2 * mu_r * eta_t2
        if not bool(torch.isclose(sigma_t2, tied, rtol=8 * torch.finfo(sigma_t2.dtype).eps, atol=0).all()):
            raise ValueError(
                "structure='tied' needs sigma_t2 = 2 mu_r eta_t2, got sigma_t2 = "
                f"{sigma_t2.detach().cpu().tolist()} and 2 mu_r eta_t2 = {tied.detach().cpu().tolist()}"
            )


def _shape(x) -> str:
    return str(tuple(x.shape)) if isinstance(x, Tensor) else type(x).__name__
