"""Query blocks: how the fast kernels bound their memory to O(chunk · N) per (B, H) and run the N×N
work between their GEMMs (softmax, guards, weights) as one ``torch.compile``d kernel where the block
is large enough (`BlockKernel`; off with ``CliffordAlgebra(compile=False)``). With gradients and
several chunks each chunk is recomputed in the backward (activation checkpointing), unless the block
has a backward of its own (``own_backward``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from geoattn.algebra.clifford_algebra import CliffordAlgebra
from geoattn.attention.rotor.params import allowed_pairs
from geoattn.core.compile import own_code, worth_compiling

AUTO_CHUNK_ELEMENTS = 1 << 21  # B·H·chunk·N logits per query chunk (8 MiB in float32)


# ---------------------------------------------------------------------------- fast: query blocks
# Blocks whose pair weights (B · H · queries · keys) pass `geoattn.core.compile.worth_compiling` run their
# N×N work (softmax, guards, weights) as one torch.compile'd kernel between the GEMMs; eager, each of
# those steps is a pass over the block (eager, those pointwise passes dominate the compose head's time).
# torch.compile backend of the block kernels (tests use "aot_eager": tracing without code generation)
COMPILE_BACKEND = "inductor"


class BlockKernel:
    """A query-block function, eager or under ``torch.compile`` (built on first use: specialised to the
    first shape, dynamic from a second one on, torch's default).

    ``kernel(compiled, *args)`` runs the compiled form when ``compiled`` is true and compilation
    works here; a missing compiler or a compile limit warns once and leaves the eager form, which
    computes the same values. Inside a caller's ``torch.compile`` the eager form is traced into its graph.
    Each variant of a call (dtype, device, grad mode, which arguments are None) compiles its own copy
    of the function: dynamo keeps its graphs per code object with a recompile limit (8), which one
    shared function would reach in a process that trains and evaluates in two dtypes (issue #12's
    crash, for these kernels).
    """

    def __init__(self, fn: Callable):
        self.fn = fn
        self._compiled: dict[tuple, Callable] = {}
        self.failed = False

    def __call__(self, compiled: bool, *args):
        if compiled and not self.failed and not torch.compiler.is_compiling():
            first = args[0]
            key = (first.dtype, first.device, torch.is_grad_enabled(), tuple(x is None for x in args))
            if key not in self._compiled:
                copy = own_code(self.fn, f"{self.fn.__name__}_{len(self._compiled)}")
                self._compiled[key] = torch.compile(
                    copy, backend=COMPILE_BACKEND, dynamic=None, fullgraph=True
                )
            try:
                return self._compiled[key](*args)
            except (
                torch._dynamo.exc.BackendCompilerFailed,
                torch._dynamo.exc.FailOnRecompileLimitHit,
            ) as err:
                warnings.warn(f"rotor_attention: {self.fn.__name__} stays eager ({err!r})", stacklevel=2)
                self.failed = True
        return self.fn(*args)


def block_weights(qs_c: Tensor, kf: Tensor, mask: Tensor | None) -> Tensor:
    """``α = softmax(qs_c @ kfᵀ)`` with disallowed pairs masked: ``(B, H, nq, nk)``."""
    logits = qs_c @ kf.transpose(-1, -2)
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    return torch.softmax(logits, dim=-1)


def query_blocks(
    block: BlockKernel,
    queries: tuple[Tensor, ...],
    keys: tuple[Tensor, ...],
    extra: tuple = (),
    *,
    causal: bool,
    key_mask: Tensor | None,
    chunk_size: int | None,
    algebra: CliffordAlgebra,
    grad: bool,
) -> tuple[Tensor, ...]:
    """``block(*query_chunk, *keys_seen, mask, *extra)`` over query chunks, outputs concatenated.

    ``queries``: ``(B, H, N, ·)`` tensors, sliced per chunk; ``keys``: ``(B, H, N, ·)`` tensors, cut to the
    keys the chunk may see (causal: later keys are never attended); mask: the chunk's
    ``(B|1, 1, nq, nk)`` allowed pairs or None. Memory
    O(chunk · N) per (B, H): with gradients and several chunks each chunk is recomputed in the
    backward (activation checkpointing), so training memory is O(N) too, unless the block recomputes
    what its backward needs itself (``block.own_backward``, where compiled: then it is called with
    ``single``, whether it is the only chunk).
    """
    B, H, N = queries[0].shape[:3]
    chunk = chunk_size or max(16, AUTO_CHUNK_ELEMENTS // max(1, B * H * N))
    compiled = algebra.compile and worth_compiling(B * H * min(chunk, N) * N)
    # a compiled block that recomputes what its backward needs itself is not checkpointed
    own_backward = compiled and getattr(block, "own_backward", False) and not torch.compiler.is_compiling()
    starts = range(0, N, chunk)
    parts = []
    for s in starts:
        nq = min(chunk, N - s)
        nk = s + nq if causal else N
        masked = causal or key_mask is not None
        mask = allowed_pairs(nq, nk, s, causal, key_mask, queries[0].device) if masked else None
        args = (
            *(x[:, :, s : s + nq] for x in queries),
            *(x[:, :, :nk] for x in keys),
            mask,
            *extra,
        )
        if own_backward:
            parts.append(block(compiled, *args, single=len(starts) == 1))
        elif len(starts) > 1 and grad:
            parts.append(checkpoint(block, compiled, *args, use_reentrant=False))
        else:
            parts.append(block(compiled, *args))
    return tuple(torch.cat(x, dim=2) if len(parts) > 1 else x[0] for x in zip(*parts))


def needs_grad(*xs: Tensor) -> bool:
    """Whether autograd will want a backward through a call on ``xs`` (any of them requires grad)."""
    return torch.is_grad_enabled() and any(x.requires_grad for x in xs)
