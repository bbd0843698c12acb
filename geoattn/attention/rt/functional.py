"""`rt_attention` and `rt_attention_qkv`: validate, gather the call, let `geoattn.attention.rt.dispatch`
choose the path, run it.

Value checks (the parameters' signs, a declared ``structure``) read tensors, which on a GPU
synchronises the device: they run only with ``GEOATTN_DEBUG=1`` (`geoattn.attention.debug`).
Shape and type checks always run. Half-precision inputs are computed in float32, with autocast
switched off inside (`geoattn.attention.dtypes`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from geoattn.attention.debug import value_checks
from geoattn.attention.dtypes import outside_autocast, work_dtype
from geoattn.attention.rt import dispatch
from geoattn.attention.rt.params import Call

STRUCTURES = ("general", "separable", "tied")


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
    """RT-Filter attention, exactly docs/concepts/rt-filter.md#the-functional-contract (the maths:
    `geoattn.attention.rt.params`).

    Args:
        q, k, v: ``(B, H, N, D)`` raw projections, D even (normalised inside).
        mu_r, sigma_t2, eta_t2, beta: ``(H,)`` per-head parameters, already constrained:
            ``mu_r ≥ 0``, ``sigma_t2 ≥ 0``, ``eta_t2 > 0``, ``beta > 0``.
        omega: ``(H, D/2)`` angular frequencies of ``R``, or None for no rotation.
        positions: ``(N,)`` or ``(B, N)`` float times (irregular allowed); default ``arange(N)``.
        causal: attend to ``j ≤ i`` only.
        backend: ``"auto"`` (the first path of `geoattn.attention.rt.dispatch.PATHS` that serves the
            call; never an N×N tensor) or a path by name: ``"reference"`` (explicit N×N, the
            oracle), ``"native"``, ``"flex"``, ``"chunked"``.
        return_weights: also return the attention weights ``(B, H, N, N)``: only the reference has them
            (``auto`` takes it; another backend named explicitly refuses).
        normalize_values: our extension: False uses ``v`` as given instead of ``v̂ = v/|v|``
            (the ``qkv_norm=False`` ablation of the layers).
        structure: our extension, what the caller knows about the parameters: ``"general"``,
            ``"separable"`` (``sigma_t2 ≡ 0``) or ``"tied"`` (``sigma_t2 = 2 mu_r eta_t2``). Every path
            computes every structure exactly, so it chooses nothing; ``GEOATTN_DEBUG=1`` checks it.

    Returns:
        ``o`` of shape ``(B, H, N, D)``, or ``(o, weights)`` when ``return_weights``.
    """
    _validate(q, k, v, mu_r, sigma_t2, eta_t2, beta, omega, positions, backend, structure)
    qkv = torch.stack([x.transpose(1, 2) for x in (q, k, v)], dim=2)  # (B, N, 3, H, D)
    params = (mu_r, sigma_t2, eta_t2, beta)
    return _attention(
        qkv, None, 1.0, params, omega, positions, causal, backend, return_weights, normalize_values
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
    if not isinstance(qkv, Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv must be a (B, N, 3, H, D) tensor, got {_shape(qkv)}")
    q, k, v = (x.transpose(1, 2) for x in qkv.unbind(2))
    _validate(q, k, v, mu_r, sigma_t2, eta_t2, beta, omega, positions, backend, structure)
    if metric is not None and (not isinstance(metric, Tensor) or metric.shape != qkv.shape[3:]):
        raise ValueError(f"metric must have shape (H, D) = {tuple(qkv.shape[3:])}, got {_shape(metric)}")
    params = (mu_r, sigma_t2, eta_t2, beta)
    return _attention(
        qkv, metric, key_scale, params, omega, positions, causal, backend, return_weights, normalize_values
    )


def _attention(qkv, metric, key_scale, params, omega, positions, causal, backend, return_weights, normalize):
    dtype = qkv.dtype
    work = work_dtype(dtype)
    call = Call(
        qkv=qkv.to(work),
        metric=None if metric is None else metric.to(work),
        key_scale=key_scale,
        params=tuple(p.to(work) for p in params),
        omega=omega,
        times=None if positions is None else positions.to(work),
        causal=causal,
        normalize_values=normalize,
        backend=backend,
        return_weights=return_weights,
    )
    out, weights = dispatch.choose(call).run(call)
    out = out.to(dtype)
    return (out, weights.to(dtype)) if return_weights else out


def _validate(q, k, v, mu_r, sigma_t2, eta_t2, beta, omega, positions, backend, structure):
    if backend not in dispatch.BACKENDS:
        raise ValueError(f"rt_attention: backend must be one of {dispatch.BACKENDS}, got {backend!r}")
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
    if value_checks():
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
