"""Blade order, names and multiplication tables of Cl(p, q, r), in the conventions of the `clifford` package.

Pure Python on integers (no tensors): the algebra engine turns these tables into tensors per
(device, dtype) and into generated per-blade code.

* Basis vectors ``e1 .. en``: the r degenerate ones first (square 0), then p squaring to +1, then q
  squaring to -1 (``clifford.Cl(3, 0, 1)`` has signature ``[0, 1, 1, 1]``).
* Blades by grade, then lexicographically by basis index: ``'', e1, e2, e3, e12, e13, e23, e123``.
* A blade is stored as a bitmask (bit i = basis vector e_{i+1}); ``e_A e_B = sign · e_{A xor B}``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

# What each product keeps of e_A e_B (A, B blade bitmasks); the sign is always the geometric one.
PRODUCT_FILTERS = {
    "geometric": lambda a, b: True,
    "outer": lambda a, b: a & b == 0,  # e_A ∧ e_B: disjoint index sets
    "left_contraction": lambda a, b: a & b == a,  # e_A ⌋ e_B: A ⊆ B
}


@dataclass(frozen=True)
class BladeTables:
    """Everything about the basis of one signature, as plain tuples.

    ``products[name]`` lists the nonzero entries ``(i, j, k, sign)`` of ``e_i ∘ e_j = sign · e_k``
    for ``name`` in :data:`PRODUCT_FILTERS`, sorted by output blade k.
    """

    signature: tuple[int, ...]  # (n,) square of each basis vector
    masks: tuple[int, ...]  # (dim,) bitmask of each blade
    names: tuple[str, ...]  # (dim,) clifford's layout.names ('' for the scalar)
    grades: tuple[int, ...]  # (dim,)
    products: dict[str, tuple[tuple[int, int, int, int], ...]]


def signature(p: int, q: int, r: int) -> tuple[int, ...]:
    return (0,) * r + (1,) * p + (-1,) * q


def blade_masks(n: int) -> tuple[int, ...]:
    """Bitmasks of all 2ⁿ blades, by grade then lexicographically by basis index."""
    return tuple(
        sum(1 << i for i in combo) for k in range(n + 1) for combo in itertools.combinations(range(n), k)
    )


def reorder_sign(a: int, b: int) -> int:
    """Sign of bringing the basis vectors of ``e_A e_B`` into ascending order (number of swaps)."""
    swaps = 0
    a >>= 1
    while a:
        swaps += (a & b).bit_count()
        a >>= 1
    return -1 if swaps & 1 else 1


def blade_product(a: int, b: int, sig: tuple[int, ...]) -> tuple[int, int]:
    """``e_A e_B = sign · e_{A xor B}``: returns ``(A xor B, sign)`` with sign in {-1, 0, 1}."""
    sign = reorder_sign(a, b)
    common = a & b
    for i, s in enumerate(sig):
        if common >> i & 1:
            sign *= s
    return a ^ b, sign


def build_tables(p: int, q: int, r: int) -> BladeTables:
    sig = signature(p, q, r)
    n = len(sig)
    masks = blade_masks(n)
    index = {m: i for i, m in enumerate(masks)}
    names = tuple("e" + "".join(str(i + 1) for i in range(n) if m >> i & 1) if m else "" for m in masks)
    products = {}
    for name, keep in PRODUCT_FILTERS.items():
        entries = []
        for i, a in enumerate(masks):
            for j, b in enumerate(masks):
                k, sign = blade_product(a, b, sig)
                if sign and keep(a, b):
                    entries.append((i, j, index[k], sign))
        products[name] = tuple(sorted(entries, key=lambda e: (e[2], e[0])))
    return BladeTables(sig, masks, names, tuple(m.bit_count() for m in masks), products)
