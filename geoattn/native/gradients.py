"""Gradient helpers: second derivatives through the native kernels, and dense incoming gradients.

A native kernel's backward is a first derivative: its gradients have no graph of their own. Where a
derivative of those gradients is wanted (``create_graph=True``, as the molecule model's force loss
takes: the forces are a gradient), the kernel's backward hands over to its torch form instead:
:func:`torch_form_grads` recomputes that form under autograd and differentiates it with
``create_graph``, so the gradients it returns carry their own graph.

:func:`dense_grad` hands a kernel's backward a dense gradient where autograd would hand it an
expanded one (``out.sum().backward()`` sends a tensor of stride 0): torch's batched matrix product on
such an operand runs one small product per batch entry (the rotation head's backward measured 3× its
time with it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor


def torch_form_grads(
    form: Callable[[], Tensor | Sequence[Tensor]],
    inputs: Sequence[Tensor | None],
    needs: Sequence[bool],
    grad_outputs: Tensor | Sequence[Tensor | None],
) -> tuple[Tensor | None, ...]:
    """The gradients of ``form()`` (its outputs, computed from ``inputs``) with respect to each input
    whose ``needs`` is true, for ``grad_outputs`` (None: an output not used), with ``create_graph``;
    None for the others. ``form`` runs under autograd, even inside a backward."""
    with torch.enable_grad():
        outputs = form()
    outputs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    grad_outputs = [grad_outputs] if isinstance(grad_outputs, Tensor) else list(grad_outputs)
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if g is not None]
    wanted = [x for x, need in zip(inputs, needs) if need]
    got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], create_graph=True))
    return tuple(next(got) if need else None for need in needs)


class _DenseGrad(torch.autograd.Function):
    """The identity whose backward makes its incoming gradient contiguous (differentiable: a second
    derivative passes through)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


def dense_grad(x: Tensor) -> Tensor:
    """``x``, whose gradient reaches the ops that made it dense (contiguous) whatever the caller's loss
    sends back; ``x`` itself where no gradient is recorded."""
    return _DenseGrad.apply(x) if torch.is_grad_enabled() and x.requires_grad else x
