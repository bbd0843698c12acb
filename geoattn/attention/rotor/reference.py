"""The naive pairwise oracle every fast kernel is tested against: explicit weights α ``(B, H, N, N)``
and one transform per pair, built with the algebra engine's products (pair tiles only bound the
memory). `pairwise` makes a head's reference from its pair transform; `compose_reference` is the
compose aggregation's (every pair's ``θ_ij B̂_ij`` explicit, its exp and sandwich too).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from geoattn.attention.rotor.params import allowed_pairs, directions, rotor_log_scale

# rows (B·H·pairs·channels) per engine call: bounds the memory (the engine runs calls of ≥ 32768 rows
# through its compiled kernel, far cheaper than many small eager calls)
_REFERENCE_ROWS = 1 << 18

# pair_values(q, k, v, algebra, inverse) -> block(s, e, t, u) -> (B, H, e − s, u − t, Cv, dim): the value
# of key j as query i receives it, for queries s:e and keys t:u
PairValues = Callable[..., Callable[[int, int, int, int], Tensor]]


def weights(q: Tensor, k: Tensor, ga, causal: bool, key_mask: Tensor | None) -> Tensor:
    """``α = softmax_j(Σ_c ⟨reverse(q_ic) k_jc⟩₀ / sqrt(C · dim))`` with the engine's products:
    ``(B, H, N, N)``, pairs in (query block × key block) tiles of at most ``_REFERENCE_ROWS`` rows."""
    B, H, N, C, dim = q.shape
    qb, kb = _tiles(N, B * H * C)
    rows = []
    for s in range(0, N, qb):
        qs = ga.reverse(q[:, :, s : s + qb, None])
        tiles = [ga.scalar_product(qs, k[:, :, None, t : t + kb]).sum(-1) for t in range(0, N, kb)]
        rows.append(torch.cat(tiles, dim=-1))
    logits = torch.cat(rows, dim=2) / math.sqrt(C * dim)
    logits = logits.masked_fill(~allowed_pairs(N, N, 0, causal, key_mask, q.device), float("-inf"))
    return torch.softmax(logits, dim=-1)


def pairwise(pair_values: PairValues):
    """The reference kernel of a head (the registry's kernel signature) from its pair transform:
    ``o_i = Σ_j α_ij T_ij(v_j)``."""

    def kernel(q, k, v, algebra, *, causal, inverse, key_mask, chunk_size):
        B, H, N, Cv = v.shape[:4]
        alpha = weights(q, k, algebra, causal, key_mask)
        moved = pair_values(q, k, v, algebra, inverse)
        qb, kb = _tiles(N, B * H * Cv)
        outs = []
        for s in range(0, N, qb):
            acc = 0
            for t in range(0, N, kb):
                pairs = moved(s, min(s + qb, N), t, min(t + kb, N))  # (B, H, qb, kb, Cv, dim)
                acc = acc + torch.einsum("bhij,bhijcd->bhicd", alpha[:, :, s : s + qb, t : t + kb], pairs)
            outs.append(acc)
        return torch.cat(outs, dim=2)

    return kernel


def compose_reference(q, k, v, algebra, *, causal, inverse, key_mask, chunk_size) -> Tensor:
    """The compose aggregation's oracle (the registry's kernel signature): :func:`_reference_compose`."""
    return _reference_compose(q, k, v, algebra, weights(q, k, algebra, causal, key_mask), inverse)


def _reference_compose(q, k, v, ga, alpha, inverse) -> Tensor:
    """``R̄_i (Σ_j α_ij v_j) R̄_i~`` with ``R̄_i = exp(½ Σ_j α_ij θ_ij B̂_ij)``, every pair's ``θ_ij B̂_ij``
    built explicitly with the engine (``(B, H, qb, kb, dim)`` tiles), its exp and sandwich too."""
    B, H, N = q.shape[:3]
    a, b = ga.vector(directions(q, ga)), ga.vector(directions(k, ga))  # (B, H, N, dim)
    qb, kb = _tiles(N, B * H)
    rows = []
    for s in range(0, N, qb):
        a_ = a[:, :, s : s + qb, None]  # (B, H, qb, 1, dim)
        acc = 0
        for t in range(0, N, kb):
            b_ = b[:, :, None, t : t + kb]  # (B, H, 1, kb, dim)
            # θ B̂ = θ (b ∧ a) / |b ∧ a| and |b ∧ a| = sin θ for unit a, b
            log = rotor_log_scale(ga.inner_product(a_, b_))[..., None] * ga.outer_product(b_, a_)
            acc = acc + torch.einsum("bhij,bhijd->bhid", alpha[:, :, s : s + qb, t : t + kb], log)
        rows.append(acc)
    mean = torch.cat(rows, dim=2)  # (B, H, N, dim): Σ_j α_ij θ_ij B̂_ij
    rotor = ga.exp(-mean / 2 if inverse else mean / 2)  # inverse: the key → query rotors, R̃_ij
    return ga.sandwich(rotor[:, :, :, None], torch.einsum("bhij,bhjcd->bhicd", alpha, v))


def _tiles(N: int, rows_per_pair: int) -> tuple[int, int]:
    """Query and key block sizes with ``qb · kb · rows_per_pair ≤ _REFERENCE_ROWS`` (at least 1 × 1)."""
    pairs = max(1, _REFERENCE_ROWS // rows_per_pair)
    kb = min(N, pairs)
    return max(1, pairs // kb), kb
