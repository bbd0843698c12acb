"""A generic flash-style attention kernel for logits that depend on more than ``⟨q_i, k_j⟩``.

`blockwise_attention` computes ``o_i = Σ_j softmax_j(score_ij) v_j`` where ``score_ij`` is any
differentiable function of block tensors: the dot products ``⟨q_i, k_j⟩``, the signed time
differences ``t_i − t_j``, per-query and per-key scalars and per-head parameters. It never holds
an N×N tensor: queries are processed in blocks, keys in chunks with a running max and
log-sum-exp, key chunks above the causal diagonal are skipped, and the backward pass recomputes
each tile from the O(N) statistics saved by the forward (FlashAttention-2 style,
``dS = P ⊙ (dP − rowsum(dO ⊙ O))``), then differentiates the score function of that tile with
autograd. RT-Filter attention (`geoattn.attention.rt`) and the isotropic RFA baseline both plug
their score function into it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

ScoreFn = Callable[[Tensor, Tensor, tuple[Tensor, ...], tuple[Tensor, ...], tuple[Tensor, ...]], Tensor]
"""``score_fn(dot, dt, query_scalars, key_scalars, params) -> logits`` on one tile:

* ``dot``: ``(B, H, bq, bk)``, ``⟨q_i, k_j⟩`` of the tensors given to `blockwise_attention`;
* ``dt``: ``(B | 1, 1, bq, bk)``, the signed ``t_i − t_j``;
* ``query_scalars``: tuple of ``(B | 1, H | 1, bq, 1)``; ``key_scalars``: tuple of ``(B | 1, H | 1, 1, bk)``;
* ``params``: tuple of ``(1, H, 1, 1)`` per-head parameters;
* returns the logits ``(B, H, bq, bk)``. It must be elementwise in ``(i, j)`` (no reductions over
  the tile), since the tile boundaries are an implementation detail.
"""

# Elements per (B·H)-batched score tile: large enough that the matmuls run at full speed, small
# enough that the score function's intermediates stay in cache and the backward's graph stays small.
_TILE_ELEMENTS = 1 << 20
_MAX_BLOCK_K = 1024
_MIN_BLOCK_Q = 16


def default_blocks(batch_heads: int, n: int) -> tuple[int, int]:
    """Query block and key chunk sizes for ``batch_heads`` (B·H) heads of length ``n``."""
    block_k = min(n, _MAX_BLOCK_K)
    block_q = min(n, max(_MIN_BLOCK_Q, _TILE_ELEMENTS // (batch_heads * block_k)))
    return block_q, block_k


def blockwise_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    score_fn: ScoreFn,
    times: Tensor,
    query_scalars: Sequence[Tensor] = (),
    key_scalars: Sequence[Tensor] = (),
    params: Sequence[Tensor] = (),
    causal: bool = True,
    block_q: int | None = None,
    block_k: int | None = None,
) -> Tensor:
    """Attention ``o_i = Σ_j softmax_j(score_fn(...)_ij) v_j`` with O(N) memory per head.

    Args:
        q, k: ``(B, H, N, Dk)``, the tensors whose dot products feed ``score_fn``.
        v: ``(B, H, N, Dv)``.
        score_fn: see `ScoreFn`.
        times: ``(N,)`` or ``(B, N)`` token times, giving ``dt = t_i − t_j``.
        query_scalars, key_scalars: tensors ``(B | 1, H | 1, N)``, sliced per tile.
        params: per-head tensors ``(H,)``.
        causal: mask ``j > i`` (by index).
        block_q, block_k: tile sizes; default `default_blocks`.

    Returns:
        ``(B, H, N, Dv)``. Differentiable with respect to every tensor argument except ``times``.
    """
    b, h, n, _ = q.shape
    auto_q, auto_k = default_blocks(b * h, n)
    times = times if times.dim() == 2 else times.unsqueeze(0)
    return _BlockwiseAttention.apply(
        score_fn,
        causal,
        block_q or auto_q,
        block_k or auto_k,
        len(query_scalars),
        len(key_scalars),
        q,
        k,
        v,
        times.detach(),
        *query_scalars,
        *key_scalars,
        *params,
    )


class _Tiles:
    """Slices of the inputs for one (query block, key chunk) tile, shaped for the score function."""

    def __init__(self, times: Tensor, query_scalars, key_scalars, params) -> None:
        self.times = times  # (B|1, N)
        self.query_scalars = query_scalars
        self.key_scalars = key_scalars
        self.params = tuple(p.view(1, -1, 1, 1) for p in params)

    def dt(self, i0: int, i1: int, j0: int, j1: int) -> Tensor:
        t = self.times
        return (t[:, i0:i1, None] - t[:, None, j0:j1]).unsqueeze(1)  # (B|1, 1, bq, bk)

    def qs(self, i0: int, i1: int, scalars=None) -> tuple[Tensor, ...]:
        return tuple(s[..., i0:i1, None] for s in (scalars or self.query_scalars))

    def ks(self, j0: int, j1: int, scalars=None) -> tuple[Tensor, ...]:
        return tuple(s[..., None, j0:j1] for s in (scalars or self.key_scalars))


def _causal_mask(i0: int, i1: int, j0: int, j1: int, device: torch.device) -> Tensor | None:
    """``(bq, bk)`` True where key j lies after query i, or None if the tile has no such pair."""
    if j1 - 1 <= i0:
        return None
    i = torch.arange(i0, i1, device=device)[:, None]
    j = torch.arange(j0, j1, device=device)[None, :]
    return j > i


def _key_end(i1: int, n: int, causal: bool) -> int:
    return i1 if causal else n


class _BlockwiseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, score_fn, causal, block_q, block_k, n_qs, n_ks, q, k, v, times, *rest):
        query_scalars, key_scalars, params = rest[:n_qs], rest[n_qs : n_qs + n_ks], rest[n_qs + n_ks :]
        tiles = _Tiles(times, query_scalars, key_scalars, params)
        b, h, n, _ = q.shape
        out = torch.empty(b, h, n, v.shape[-1], dtype=v.dtype, device=v.device)
        lse = torch.empty(b, h, n, dtype=q.dtype, device=q.device)  # (B, H, N) log-sum-exp per query
        for i0 in range(0, n, block_q):
            i1 = min(i0 + block_q, n)
            q_blk, qs = q[:, :, i0:i1], tiles.qs(i0, i1)
            run_max = run_sum = acc = None
            for j0 in range(0, _key_end(i1, n, causal), block_k):
                j1 = min(j0 + block_k, _key_end(i1, n, causal))
                dot = q_blk @ k[:, :, j0:j1].transpose(-1, -2)
                s = score_fn(dot, tiles.dt(i0, i1, j0, j1), qs, tiles.ks(j0, j1), tiles.params)
                mask = _causal_mask(i0, i1, j0, j1, q.device) if causal else None
                if mask is not None:
                    s = s.masked_fill(mask, -math.inf)
                tile_max = s.amax(-1)
                if run_max is None:
                    run_max = tile_max
                    p = torch.exp(s - run_max[..., None])
                    run_sum, acc = p.sum(-1), p @ v[:, :, j0:j1]
                else:
                    new_max = torch.maximum(run_max, tile_max)
                    p = torch.exp(s - new_max[..., None])
                    rescale = torch.exp(run_max - new_max)
                    run_sum = run_sum * rescale + p.sum(-1)
                    acc = acc * rescale[..., None] + p @ v[:, :, j0:j1]
                    run_max = new_max
            out[:, :, i0:i1] = acc / run_sum[..., None]
            lse[:, :, i0:i1] = run_max + torch.log(run_sum)
        ctx.score_fn, ctx.causal, ctx.block_q, ctx.block_k, ctx.n_qs, ctx.n_ks = (
            score_fn,
            causal,
            block_q,
            block_k,
            n_qs,
            n_ks,
        )
        ctx.save_for_backward(q, k, v, times, out, lse, *rest)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, times, out, lse, *rest = ctx.saved_tensors
        n_qs, n_ks = ctx.n_qs, ctx.n_ks
        query_scalars, key_scalars, params = rest[:n_qs], rest[n_qs : n_qs + n_ks], rest[n_qs + n_ks :]
        b, h, n, _ = q.shape
        needs = ctx.needs_input_grad[10:]
        grad_qs = [torch.zeros_like(s) if need else None for s, need in zip(query_scalars, needs[:n_qs])]
        grad_ks = [torch.zeros_like(s) if need else None for s, need in zip(key_scalars, needs[n_qs:])]
        grad_ps = [torch.zeros_like(p) if need else None for p, need in zip(params, needs[n_qs + n_ks :])]
        want_qs = [i for i, g in enumerate(grad_qs) if g is not None]
        want_ks = [i for i, g in enumerate(grad_ks) if g is not None]
        want_ps = [i for i, g in enumerate(grad_ps) if g is not None]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        delta = (grad_out * out).sum(-1)  # (B, H, N), rowsum(dO ⊙ O)
        times_tiles = _Tiles(times, query_scalars, key_scalars, ())
        for i0 in range(0, n, ctx.block_q):
            i1 = min(i0 + ctx.block_q, n)
            q_blk, do_blk = q[:, :, i0:i1], grad_out[:, :, i0:i1]
            lse_blk, delta_blk = lse[:, :, i0:i1, None], delta[:, :, i0:i1, None]
            end = _key_end(i1, n, ctx.causal)
            for j0 in range(0, end, ctx.block_k):
                j1 = min(j0 + ctx.block_k, end)
                k_c, v_c = k[:, :, j0:j1], v[:, :, j0:j1]
                with torch.enable_grad():
                    dot = (q_blk @ k_c.transpose(-1, -2)).requires_grad_()
                    qs = [
                        x.detach().requires_grad_(i in want_qs) for i, x in enumerate(times_tiles.qs(i0, i1))
                    ]
                    ks = [
                        x.detach().requires_grad_(i in want_ks) for i, x in enumerate(times_tiles.ks(j0, j1))
                    ]
                    ps = [
                        p.detach().view(1, -1, 1, 1).requires_grad_(i in want_ps)
                        for i, p in enumerate(params)
                    ]
                    s = ctx.score_fn(dot, times_tiles.dt(i0, i1, j0, j1), tuple(qs), tuple(ks), tuple(ps))
                p = torch.exp(s.detach() - lse_blk)
                mask = _causal_mask(i0, i1, j0, j1, q.device) if ctx.causal else None
                if mask is not None:
                    p = p.masked_fill(mask, 0.0)
                dv[:, :, j0:j1] += p.transpose(-1, -2) @ do_blk
                ds = p * (do_blk @ v_c.transpose(-1, -2) - delta_blk)
                inputs = [
                    dot,
                    *(qs[i] for i in want_qs),
                    *(ks[i] for i in want_ks),
                    *(ps[i] for i in want_ps),
                ]
                # autograd returns each leaf's own (broadcast-reduced) shape; None where a leaf is unused.
                grads = torch.autograd.grad(s, inputs, ds, allow_unused=True)
                d_dot, grads = grads[0], iter(grads[1:])
                if d_dot is not None:
                    dq[:, :, i0:i1] += d_dot @ k_c
                    dk[:, :, j0:j1] += d_dot.transpose(-1, -2) @ q_blk
                for i in want_qs:
                    if (g := next(grads)) is not None:
                        grad_qs[i][..., i0:i1] += g.squeeze(-1)
                for i in want_ks:
                    if (g := next(grads)) is not None:
                        grad_ks[i][..., j0:j1] += g.squeeze(-2)
                for i in want_ps:
                    if (g := next(grads)) is not None:
                        grad_ps[i] += g.reshape(-1)
        return (None,) * 6 + (dq, dk, dv, None, *grad_qs, *grad_ks, *grad_ps)
