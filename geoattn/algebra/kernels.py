"""Kernels of the bilinear products (geometric, outer, left contraction, twisted) of `CliffordAlgebra`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:
    from geoattn.algebra.clifford_algebra import CliffordAlgebra


def bilinear(algebra: CliffordAlgebra, a: Tensor, b: Tensor, table: str) -> Tensor:
    """``c_k = Σ_i sign[i, k] · a_i · b_{partner[i, k]}``; a, b ``(..., dim)`` broadcasting → ``(..., dim)``.

    Each output blade k gets one term per left blade i (the partner j = i xor k is unique), so this
    is exactly the nonzero Cayley entries (dim² multiply-adds), not the dense dim³ contraction.
    """
    t = algebra._table(a.device, a.dtype)
    return (a.unsqueeze(-1) * b[..., t["partner"]] * t[table]).sum(-2)
