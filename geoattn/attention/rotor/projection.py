"""The projection head: ``T = (v ⌋ b) b⁻¹``, the projection onto the line of the key direction b (keeps
the scalar part and the component of the vector part along b; higher grades contract to 0). It does
not involve the query direction, so it factorises completely: a per-key transform around plain
attention (``scaled_dot_product_attention``). Its reference transform (`pair_values`) builds the same
with the algebra engine's contraction and inverse.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from geoattn.attention.rotor.params import directions, guard_eps, plain_attention, tables

# rows (B·H·keys·channels) per engine call in the reference transform: bounds its memory
_ROWS = 1 << 18


def _projected(k: Tensor, v: Tensor, algebra) -> Tensor:
    """Every value projected onto its key's line, closed form (b unit: scalar part kept, vector part →
    ``⟨v, b⟩ b``): ``k (B, H, N, C, dim)``, ``v (B, H, N, Cv, dim)`` → ``(B, H, N, Cv, dim)``."""
    dim = v.shape[-1]
    metric = tables(algebra, k.device, k.dtype)["metric"]
    b = directions(k, algebra)[..., None, :]  # (B, H, N, 1, n)
    bb = (b * b * metric).sum(-1, keepdim=True)  # b² (1 unless the direction is zero)
    inv_b = b / bb.clamp_min(guard_eps(bb.dtype))
    scalar = v[..., algebra.grade_slice(0)] * (bb / bb.clamp_min(guard_eps(bb.dtype)))  # (v₀ b) b⁻¹
    vec = (v[..., algebra.grade_slice(1)] * b * metric).sum(-1, keepdim=True) * inv_b
    return algebra.vector(vec) + F.pad(scalar, (0, dim - 1))  # the scalar is blade 0


def projection(q, k, v, algebra, *, causal, inverse, key_mask, chunk_size) -> Tensor:
    """``(v ⌋ b) b⁻¹`` per key (b unit: scalar part kept, vector part → ⟨v, b⟩ b), then plain attention."""
    B, H, N, Cv, dim = v.shape
    moved = _projected(k, v, algebra)
    out = plain_attention(q, k, moved.flatten(-2), algebra, causal, key_mask)
    return out.view(B, H, N, Cv, dim)


def pair_values(q, k, v, ga, inverse):
    """The reference's transform (`geoattn.attention.rotor.reference.pairwise`): ``(v ⌋ b) b⁻¹`` with the
    engine's products, per key, read by every query of a block: ``(B, H, qb, kb, Cv, dim)``."""
    B, H, N, Cv, _ = v.shape
    b = ga.vector(directions(k, ga))[:, :, :, None]  # (B, H, N, 1, dim)
    step = max(1, _ROWS // (B * H * Cv))
    moved = torch.cat(
        [
            ga.geometric_product(ga.left_contraction(v[:, :, t : t + step], b[:, :, t : t + step]),
                                 ga.inverse(b[:, :, t : t + step]))
            for t in range(0, N, step)
        ],
        dim=2,
    )  # fmt: skip

    def block(s: int, e: int, t: int, u: int) -> Tensor:
        return moved[:, :, None, t:u].expand(-1, -1, e - s, -1, -1, -1)

    return block
