"""Memory order of multivector tensors ``(..., dim)``: the default (blades innermost) or blade by blade.

Both hold the same values; the layers read and write the blade-by-blade order without copies where
they mix channels with one GEMM per blade (docs/concepts/rotors.md#memory-order), and the compiled
geometric product has a form for it (``geoattn.algebra.kernels``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def blade_major(x: Tensor) -> Tensor:
    """The same multivectors ``(..., C, dim)``, stored blade by blade: each blade's ``(..., C)`` numbers
    contiguous (``x.movedim(-1, 0)`` is contiguous). Only the memory order changes, not a value.

    :class:`~geoattn.layers.multivector.EquiLinear` mixes channels with one GEMM per blade: on a tensor
    stored so it reads and writes without copies, where the default order costs a transpose of its
    input and leaves its output in this order anyway. The rotor layers are elementwise or keep the
    order, so a stream converted once (:class:`~geoattn.models.rotor_lm.RotorStack`) stays so.
    """
    return x.movedim(-1, 0).contiguous().movedim(0, -1)


def is_blade_major(x: Tensor) -> bool:
    """Whether ``x (..., dim)`` is stored blade by blade: its blades the outermost stride, its last
    leading dim contiguous (a channel slice of a :func:`blade_major` tensor counts)."""
    return x.dim() > 1 and x.stride(-1) > 1 and x.stride(-2) == 1 and x.stride(-1) == max(x.stride())


def channel_halves(x: Tensor) -> tuple[Tensor, Tensor]:
    """The two channel halves of ``x (..., 2H, dim)`` as views ``(..., H, dim)``, cut blade by blade: a
    split's backward (one concatenation) then writes the gradient in the order a :func:`blade_major`
    ``x`` keeps it, the order the layer that made it reads."""
    left, right = x.movedim(-1, 0).chunk(2, -1)
    return left.movedim(0, -1), right.movedim(0, -1)


class _BladeMajorGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad if is_blade_major(grad) else blade_major(grad)


def blade_major_grad(x: Tensor) -> Tensor:
    """``x`` itself, whose gradient is stored blade by blade (:func:`blade_major`) on its way back.

    Elementwise operators give their gradients the memory order of the gradient they receive, so one
    read-out in the default order (e.g. invariant features) hands that order to every layer before it,
    and each :class:`~geoattn.layers.multivector.EquiLinear` then copies each blade's gradient matrix
    before its GEMMs; converting once where the stream ends saves those copies.
    """
    return _BladeMajorGrad.apply(x)
