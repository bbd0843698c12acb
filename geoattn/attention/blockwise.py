"""A generic flash-style attention kernel for logits that depend on more than ``⟨q_i, k_j⟩``.

`blockwise_attention` computes ``o_i = Σ_j softmax_j(score_ij) v_j`` where ``score_ij`` is any
differentiable function of block tensors: the dot products ``⟨q_i, k_j⟩``, the signed time
differences ``t_i − t_j``, per-query and per-key scalars, per-head parameters and relative tables
(functions of ``i − j``). It never holds an N×N tensor: queries are processed in blocks, keys in
chunks with a running max and log-sum-exp, key chunks above the causal diagonal are skipped, and
the backward pass recomputes each tile from the O(N) statistics saved by the forward
(FlashAttention-2 style, ``dS = P ⊙ (dP − rowsum(dO ⊙ O))``), then differentiates the score
function of that tile, with autograd or with derivatives the caller writes out
(`blockwise_backward`'s ``tile_backward``; RT-Filter attention does, so that its kernel runs inside
a custom operator). Large problems run the per-tile elementwise work through `torch.compile` (see
`COMPILE_MIN_PAIRS`); the matmuls stay in BLAS. Subnormal weights are flushed (`flush_small`), so
the cost does not depend on how sharp the attention is. RT-Filter attention
(`geoattn.attention.rt_kernel`) plugs its score function into it, and so could the isotropic RFA
baseline (its score ``−precision(Δt)·|q − e^{−μΔt} R k|²`` expands into ``dot``, ``Δt``, per-query
and per-key norms).
"""

from __future__ import annotations

import math
import types
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from geoattn.subnormals import subnormals_flushed

ScoreFn = Callable[[Tensor, Tensor, tuple[Tensor, ...], tuple[Tensor, ...], tuple[Tensor, ...]], Tensor]
"""``score_fn(dot, dt, query_scalars, key_scalars, params) -> logits`` on one tile:

* ``dot``: ``(B, H, bq, bk)``, ``⟨q_i, k_j⟩`` of the tensors given to `blockwise_attention`;
* ``dt``: ``(B | 1, 1, bq, bk)``, the signed ``t_i − t_j``;
* ``query_scalars``: tuple of ``(B | 1, H | 1, bq, 1)``; ``key_scalars``: tuple of ``(B | 1, H | 1, 1, bk)``;
* ``params``: tuple of ``(1, H, 1, 1)`` per-head parameters, and for a relative table (below)
  its ``(1, H, bq, bk)`` slice;
* returns the logits ``(B, H, bq, bk)``. It must be elementwise in ``(i, j)`` (no reductions over
  the tile), since the tile boundaries are an implementation detail.
"""

# Elements per (B·H)-batched score tile: large enough that the matmuls run at full speed, small
# enough that the score function's intermediates stay in cache and the backward's graph stays small.
_TILE_ELEMENTS = 1 << 19
_MAX_BLOCK_K = 256  # measured: 256-key chunks beat 512 and 128 for the LM recipe and B=1, H=8 alike
# Query rows per block at least (while a tile stays under _MAX_TILE_ELEMENTS): with many heads in a
# batch (the LM recipe's 12 × 4) the cache-sized tile has only 42 rows, and the per-tile matmuls and
# Python work then cost more than the cache saves (`geoattn bench lm` at T = 1024; B = 1, H = 8
# keeps its 256 rows).
_MIN_BLOCK_Q = 64
_MAX_TILE_ELEMENTS = 1 << 21
# Problems with at least this many (B·H·N²) score entries compile their tile functions by default
# (tests and toy sizes stay eager; the LM recipe's 12 × 4 heads compile from N = 128 on).
COMPILE_MIN_PAIRS = 1 << 19


def flush_small(x: Tensor, signed: bool = False) -> Tensor:
    """``x`` with the values below ``tiny^¾`` of the dtype in magnitude set to 0 (``signed=False``:
    ``x ≥ 0``, so the magnitude is ``x`` itself).

    For softmax weights (at most 1, relative to their row's maximum) and factors of logits that are
    added to terms of order one, such values change no sum at any precision; but they and their
    products would be subnormal numbers, on which each multiplication costs many times more. Without
    this the kernels' speed would depend on the data: on how spread the logits are (the key
    magnitudes) and, for decaying precisions, on how far back the keys lie.

    One pass each (``threshold``, ``hardshrink``) instead of a comparison and a select: eager kernels
    call this on every score tile. (A value exactly at ``tiny^¾`` is set to 0 too.) Where the CPU
    flushes subnormals itself (`geoattn.subnormals`: the ``geoattn`` program sets it) this returns
    ``x`` on the CPU: the products that would be subnormal are zero anyway, at no cost."""
    if x.device.type == "cpu" and subnormals_flushed():
        return x
    tiny = torch.finfo(x.dtype).tiny ** 0.75
    return F.hardshrink(x, tiny) if signed else F.threshold(x, tiny, 0.0)


def default_blocks(batch_heads: int, n: int) -> tuple[int, int]:
    """Query block and key chunk sizes for ``batch_heads`` (B·H) heads of length ``n``."""
    block_k = min(n, _MAX_BLOCK_K)
    in_cache = _TILE_ELEMENTS // (batch_heads * block_k)
    block_q = min(n, max(in_cache, min(_MIN_BLOCK_Q, _MAX_TILE_ELEMENTS // (batch_heads * block_k)), 1))
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
    compile: bool | None = None,
) -> Tensor:
    """Attention ``o_i = Σ_j softmax_j(score_fn(...)_ij) v_j`` with O(N) memory per head.

    Args:
        q, k: ``(B, H, N, Dk)``, the tensors whose dot products feed ``score_fn``.
        v: ``(B, H, N, Dv)``.
        score_fn: see `ScoreFn`.
        times: ``(N,)`` or ``(B, N)`` token times, giving ``dt = t_i − t_j``.
        query_scalars, key_scalars: tensors ``(B | 1, H | 1, N)``, sliced per tile.
        params: per-head tensors ``(H,)``, or relative tables ``(H, 2N − 1)``: functions of the index
            difference ``i − j`` (entry ``i − j + N − 1``), such as a relative-position bias; the score
            sees their tile slices and their gradients are summed along the tile's diagonals.
        causal: mask ``j > i`` (by index).
        block_q, block_k: tile sizes; default `default_blocks`.
        compile: run the tile functions through `torch.compile` (fused elementwise work, several
            times faster; the first call compiles for tens of seconds). None: when
            ``B·H·N² ≥ COMPILE_MIN_PAIRS``, so that small problems and tests stay eager.

    Returns:
        ``(B, H, N, Dv)``. Differentiable with respect to every tensor argument except ``times``.
    """
    b, h, n, _ = q.shape
    auto_q, auto_k = default_blocks(b * h, n)
    times = times if times.dim() == 2 else times.unsqueeze(0)
    if compile is None:
        compile = b * h * n * n >= COMPILE_MIN_PAIRS
    return _BlockwiseAttention.apply(
        score_fn,
        causal,
        block_q or auto_q,
        block_k or auto_k,
        compile,
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
        self.times = times.unsqueeze(1)  # (B|1, 1, N)
        self.n = times.shape[-1]
        self.query_scalars = query_scalars
        self.key_scalars = key_scalars
        # per-head parameters (H,) broadcast over the tile; relative tables (H, 2N − 1) are sliced
        self.heads = tuple(p.view(1, -1, 1, 1) if p.dim() == 1 else p.contiguous() for p in params)

    def params(self, i0: int, i1: int, j0: int, j1: int) -> tuple[Tensor, ...]:
        """The parameters for one tile: ``(1, H, 1, 1)`` per head; a relative table ``r (H, 2N − 1)``
        as ``(1, H, bq, bk)`` with entry ``r[h, i − j + N − 1]`` (a Toeplitz slice, copied once)."""
        return tuple(p if p.dim() == 4 else self._relative(p, i0, i1, j0, j1) for p in self.heads)

    def _relative(self, table: Tensor, i0: int, i1: int, j0: int, j1: int) -> Tensor:
        # r[h, lo + a + b'] for b' = bk − 1 − b is a strided view; flipping b' back copies the tile
        lo = self._lowest(i0, j1)
        view = table.as_strided(
            (table.shape[0], i1 - i0, j1 - j0), (table.stride(0), 1, 1), table.storage_offset() + lo
        )
        return view.flip(-1).unsqueeze(0).contiguous()  # one layout for every tile: no recompiles

    def _lowest(self, i0: int, j1: int) -> int:
        """Index in a relative table of the tile's smallest ``i − j`` (its first query, last key)."""
        return i0 - (j1 - 1) + self.n - 1

    def add_relative(self, acc: Tensor, grad: Tensor, i0: int, j1: int) -> None:
        """Accumulate a tile's gradient ``(B|1, H, bq, bk)`` of a relative table into ``acc (H, 2N − 1)``:
        the sums along its diagonals (one per ``i − j``)."""
        g = grad.sum(0) if grad.dim() == 4 else grad  # (H, bq, bk)
        bq, bk = g.shape[-2:]
        # row a of the key-flipped, zero-padded tile, read with row length bk + bq − 1, holds
        # (a, b) at column a − b + bk − 1: the column sums are the diagonal sums
        sheared = F.pad(g.flip(-1), (0, bq)).flatten(-2)[..., : bq * (bk + bq - 1)].unflatten(-1, (bq, -1))
        lo = self._lowest(i0, j1)
        acc[:, lo : lo + bq + bk - 1] += sheared.sum(-2)

    # Small copies (O(bq + bk)) rather than views: a compiled tile would otherwise guard on, and
    # recompile for, every storage offset.
    def tq(self, i0: int, i1: int) -> Tensor:
        return self.times[..., i0:i1, None].clone()  # (B|1, 1, bq, 1)

    def tk(self, j0: int, j1: int) -> Tensor:
        return self.times[..., None, j0:j1].clone()  # (B|1, 1, 1, bk)

    def qs(self, i0: int, i1: int) -> tuple[Tensor, ...]:
        return tuple(s[..., i0:i1, None].clone() for s in self.query_scalars)

    def ks(self, j0: int, j1: int) -> tuple[Tensor, ...]:
        return tuple(s[..., None, j0:j1].clone() for s in self.key_scalars)

    @staticmethod
    def indices(i0: int, i1: int, j0: int, j1: int, causal: bool, n: int, device) -> tuple[Tensor, Tensor]:
        """``(bq, 1)`` query and ``(1, bk)`` key indices; a key is masked where its index is larger.
        Without a causal mask the query indices are shifted past every key."""
        shift = 0 if causal else n
        return torch.arange(i0 + shift, i1 + shift, device=device)[:, None], torch.arange(
            j0, j1, device=device
        )[None]


def _key_end(i1: int, n: int, causal: bool) -> int:
    """The end of the keys a query block ``[·, i1)`` sees."""
    return min(i1, n) if causal else n


def _tile_forward(score_fn, dot, tq, tk, qs, ks, ps, qi, kj, run_max):
    """Scores of one tile and its online-softmax step: ``(p, new running max, rowsum p)``."""
    s = score_fn(dot, tq - tk, qs, ks, ps).masked_fill(kj > qi, -math.inf)
    new_max = torch.maximum(run_max, s.amax(-1))
    p = flush_small(torch.exp(s - new_max[..., None]))
    return p, new_max, p.sum(-1)


def _tile_backward(score_fn, dot, tq, tk, qs, ks, ps, qi, kj, lse, dp, delta):
    """``P`` and the vector-Jacobian product of the tile's scores with ``dS = P ⊙ (dP − δ)``:
    ``(p, d_dot, d_qs, d_ks, d_ps)``. Functional (`torch.func.vjp`), so that it compiles."""
    dt = tq - tk
    s, vjp = torch.func.vjp(lambda dot, qs, ks, ps: score_fn(dot, dt, qs, ks, ps), dot, qs, ks, ps)
    p = flush_small(torch.exp(s - lse).masked_fill(kj > qi, 0.0))
    return (p, *vjp(flush_small(p * (dp - delta), signed=True)))


def _tile_backward_eager(score_fn, dot, tq, tk, qs, ks, ps, qi, kj, lse, dp, delta):
    """`_tile_backward` with plain autograd: the same result without torch.func's seconds-long
    first-use set-up, for small problems that never compile."""
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_() for x in (dot, *qs, *ks, *ps)]
        n_qs, n_ks = len(qs), len(ks)
        args = (
            tuple(leaves[1 : 1 + n_qs]),
            tuple(leaves[1 + n_qs : 1 + n_qs + n_ks]),
            tuple(leaves[1 + n_qs + n_ks :]),
        )
        s = score_fn(leaves[0], tq - tk, *args)
    p = flush_small(torch.exp(s.detach() - lse).masked_fill(kj > qi, 0.0))
    grads = torch.autograd.grad(s, leaves, flush_small(p * (dp - delta), signed=True), allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]
    return (
        p,
        grads[0],
        tuple(grads[1 : 1 + n_qs]),
        tuple(grads[1 + n_qs : 1 + n_qs + n_ks]),
        tuple(grads[1 + n_qs + n_ks :]),
    )


def own_code(fn: Callable, name: str) -> Callable:
    """``fn`` (defaults and closure included) with a code object of its own, named ``name``.

    Dynamo keeps its compiled graphs, and counts its recompile limit, per code object: functions
    compiled once per variant or per model (a process that trains several models, a benchmark's
    variants) need their own, or they share that limit and fall back to eager when it is reached.
    """
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


class MaybeCompiled:
    """``fn`` run through `torch.compile` when asked and available, else ``eager`` (default ``fn``).

    If compilation fails (e.g. no C++ toolchain), it warns once and stays eager: the eager rerun
    raises any error that is not the compiler's.
    """

    broken = False

    def __init__(self, fn, eager=None) -> None:
        self.fn, self.eager, self.compiled = fn, eager or fn, None

    def __call__(self, use_compile: bool, *args):
        if torch.compiler.is_compiling():  # inside a compiled graph: traced and fused with the rest
            return self.fn(*args)
        if use_compile and not MaybeCompiled.broken:
            try:
                if self.compiled is None:
                    self.compiled = torch.compile(self.fn, dynamic=True)
                return self.compiled(*args)
            except Exception as err:  # noqa: BLE001 - any compiler failure falls back to eager
                MaybeCompiled.broken = True
                warnings.warn(f"torch.compile failed, attention kernels run eagerly: {err}", stacklevel=2)
        return self.eager(*args)


_FORWARD, _BACKWARD = MaybeCompiled(_tile_forward), MaybeCompiled(_tile_backward, _tile_backward_eager)


def blockwise_forward(
    score_fn: ScoreFn,
    causal: bool,
    block_q: int,
    block_k: int,
    use_compile: bool,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    times: Tensor,
    query_scalars: Sequence[Tensor],
    key_scalars: Sequence[Tensor],
    params: Sequence[Tensor],
) -> tuple[Tensor, Tensor]:
    """The forward loops: ``(out (B, H, N, Dv), lse (B, H, N))``, the per-query log-sum-exp being
    the only statistic the backward needs. ``times`` is ``(B | 1, N)``; see `blockwise_attention`."""
    tiles = _Tiles(times, query_scalars, key_scalars, params)
    b, h, n, _ = q.shape
    dv = v.shape[-1]
    q3, k3, v3 = (x.reshape(b * h, n, x.shape[-1]) for x in (q, k, v))
    out = torch.empty(b, h, n, dv, dtype=v.dtype, device=v.device)
    lse = torch.empty(b, h, n, dtype=q.dtype, device=q.device)  # (B, H, N) log-sum-exp per query
    for i0 in range(0, n, block_q):
        i1 = min(i0 + block_q, n)
        q_blk, qs, tq = q3[:, i0:i1], tiles.qs(i0, i1), tiles.tq(i0, i1)
        run_max = torch.full((b, h, i1 - i0), -math.inf, dtype=q.dtype, device=q.device)
        run_sum = torch.zeros_like(run_max)
        acc = torch.zeros(b * h, i1 - i0, dv, dtype=v.dtype, device=v.device)
        for j0 in range(0, _key_end(i1, n, causal), block_k):
            j1 = min(j0 + block_k, _key_end(i1, n, causal))
            dot = torch.bmm(q_blk, k3[:, j0:j1].transpose(-1, -2)).view(b, h, i1 - i0, j1 - j0)
            qi, kj = _Tiles.indices(i0, i1, j0, j1, causal, n, q.device)
            p, new_max, p_sum = _FORWARD(
                use_compile,
                score_fn,
                dot,
                tq,
                tiles.tk(j0, j1),
                qs,
                tiles.ks(j0, j1),
                tiles.params(i0, i1, j0, j1),
                qi,
                kj,
                run_max,
            )
            rescale = torch.exp(run_max - new_max)  # 0 on the first chunk
            run_sum = run_sum * rescale + p_sum
            acc.mul_(rescale.reshape(b * h, -1, 1)).add_(
                torch.bmm(p.reshape(b * h, i1 - i0, j1 - j0), v3[:, j0:j1])
            )
            run_max = new_max
        out[:, :, i0:i1] = acc.view(b, h, i1 - i0, dv) / run_sum[..., None]
        lse[:, :, i0:i1] = run_max + torch.log(run_sum)
    return out, lse


def blockwise_backward(
    score_fn: ScoreFn,
    causal: bool,
    block_q: int,
    block_k: int,
    use_compile: bool,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    times: Tensor,
    query_scalars: Sequence[Tensor],
    key_scalars: Sequence[Tensor],
    params: Sequence[Tensor],
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    tile_backward: MaybeCompiled | None = None,
) -> tuple[Tensor, Tensor, Tensor, list[Tensor], list[Tensor], list[Tensor]]:
    """The recomputing backward of `blockwise_forward` (or of any softmax attention whose per-query
    log-sum-exp ``lse`` is known): ``(dq, dk, dv, d query_scalars, d key_scalars, d params)``, each
    shaped like its input.

    ``tile_backward``: the tile's ``(p, d_dot, d_qs, d_ks, d_ps)`` with the signature of
    `_tile_backward`, e.g. a score function's derivatives written out; default: autograd through
    ``score_fn`` (which needs the autograd dispatch, so not inside a custom operator).
    """
    tile_backward = tile_backward or _BACKWARD
    tiles = _Tiles(times, query_scalars, key_scalars, params)
    b, h, nq, _ = q.shape
    n = k.shape[2]
    # (B·H, N, ·) accumulators: the tiles' products are batched matrix products over B·H
    dq, dk, dv = (
        torch.zeros(b * h, x.shape[2], x.shape[-1], dtype=x.dtype, device=x.device) for x in (q, k, v)
    )
    q3, k3, v3, do3 = (x.reshape(b * h, x.shape[2], x.shape[-1]) for x in (q, k, v, grad_out))
    grad_qs = [torch.zeros_like(s) for s in query_scalars]
    grad_ks = [torch.zeros_like(s) for s in key_scalars]
    grad_ps = [torch.zeros_like(p) for p in params]
    delta = (grad_out * out).sum(-1)  # (B, H, N), rowsum(dO ⊙ O)
    for i0 in range(0, nq, block_q):
        i1 = min(i0 + block_q, nq)
        q_blk, do_blk, qs, tq = q3[:, i0:i1], do3[:, i0:i1], tiles.qs(i0, i1), tiles.tq(i0, i1)
        lse_blk, delta_blk = lse[:, :, i0:i1, None].clone(), delta[:, :, i0:i1, None].clone()
        key_end = _key_end(i1, n, causal)
        for j0 in range(0, key_end, block_k):
            j1 = min(j0 + block_k, key_end)
            k_c, v_c = k3[:, j0:j1], v3[:, j0:j1]
            dot = torch.bmm(q_blk, k_c.transpose(-1, -2)).view(b, h, i1 - i0, j1 - j0)
            dp = torch.bmm(do_blk, v_c.transpose(-1, -2)).view(b, h, i1 - i0, j1 - j0)
            qi, kj = _Tiles.indices(i0, i1, j0, j1, causal, n, q.device)
            p, d_dot, d_qs, d_ks, d_ps = tile_backward(
                use_compile,
                score_fn,
                dot,
                tq,
                tiles.tk(j0, j1),
                qs,
                tiles.ks(j0, j1),
                tiles.params(i0, i1, j0, j1),
                qi,
                kj,
                lse_blk,
                dp,
                delta_blk,
            )
            p, d_dot = p.reshape(b * h, i1 - i0, j1 - j0), d_dot.reshape(b * h, i1 - i0, j1 - j0)
            # (bmm into a new tensor, then add: baddbmm_ into these strided slices is several times slower)
            dv[:, j0:j1] += torch.bmm(p.transpose(-1, -2), do_blk)
            dq[:, i0:i1] += torch.bmm(d_dot, k_c)
            dk[:, j0:j1] += torch.bmm(d_dot.transpose(-1, -2), q_blk)
            for acc, g in zip(grad_qs, d_qs):  # (B|1, H|1, bq, 1), already reduced over the tile
                acc[..., i0:i1] += g.squeeze(-1)
            for acc, g in zip(grad_ks, d_ks):
                acc[..., j0:j1] += g.squeeze(-2)
            for acc, g in zip(grad_ps, d_ps):
                if acc.dim() == 2:  # a relative table
                    tiles.add_relative(acc, g, i0, j1)
                else:
                    acc += g.reshape(acc.shape)
    dq, dk, dv = (g.view(b, h, g.shape[1], -1) for g in (dq, dk, dv))
    return dq, dk, dv, grad_qs, grad_ks, grad_ps


class _BlockwiseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, score_fn, causal, block_q, block_k, use_compile, n_qs, n_ks, q, k, v, times, *rest):
        query_scalars, key_scalars, params = rest[:n_qs], rest[n_qs : n_qs + n_ks], rest[n_qs + n_ks :]
        config = (score_fn, causal, block_q, block_k, use_compile)
        out, lse = blockwise_forward(*config, q, k, v, times, query_scalars, key_scalars, params)
        ctx.config, ctx.counts = config, (n_qs, n_ks)
        ctx.save_for_backward(q, k, v, times, out, lse, *rest)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, times, out, lse, *rest = ctx.saved_tensors
        n_qs, n_ks = ctx.counts
        query_scalars, key_scalars, params = rest[:n_qs], rest[n_qs : n_qs + n_ks], rest[n_qs + n_ks :]
        dq, dk, dv, grad_qs, grad_ks, grad_ps = blockwise_backward(
            *ctx.config, q, k, v, times, query_scalars, key_scalars, params, out, lse, grad_out
        )
        needs = ctx.needs_input_grad[11:]
        grads = [g if need else None for g, need in zip((*grad_qs, *grad_ks, *grad_ps), needs)]
        return (None,) * 7 + (dq, dk, dv, None, *grads)
