"""Rotor attention (docs/concepts/rotors.md): attention whose values are moved by a per-pair versor.

Shapes: ``q, k`` are ``(B, H, N, C, dim)`` multivectors, ``v`` is ``(B, H, N, Cv, dim)``, the output is
``(B, H, N, Cv, dim)``; ``dim = algebra.dim``, ``n = algebra.n``.

Weights (every head type): ``α_ij = softmax_j(Σ_c ⟨reverse(q_ic) k_jc⟩₀ / sqrt(C · dim))``, GATr's
invariant inner product summed over channels. Directions: ``a_i = normalize(Σ_c vector_part(q_ic))``,
``b_j`` likewise from k, normalised in the algebra's metric (``a² = 1``; in PGA the degenerate ``e0``
coordinate does not count, so the construction stays E(3)-equivariant).

Head types, ``o_i = Σ_j α_ij T_ij(v_j)``:

* ``rotation``: ``T = R v R̃`` with ``R = (1 + b a) / sqrt(2(1 + ⟨a, b⟩))``, the rotor with ``R a R̃ = b``
  (the seed's query → key convention); ``inverse=True`` uses ``R = (1 + a b)/...`` (key → query).
* ``reflection``: ``T = n v̂ n`` with ``n = (a − b) / |a − b|`` (v̂ = grade involution): the reflection
  that maps a to b (and b to a, so ``inverse`` changes nothing).
* ``projection``: ``T = (v ⌋ b) b⁻¹``, the projection onto the line of b (keeps the scalar part and the
  component of the vector part along b; higher grades contract to 0). It does not involve a.
* ``frame`` (our extension, docs/concepts/rotors.md#frame-transport; Cl(3) only, C ≥ 2): each token carries
  the orthonormal frame ``x = normalize(vec c0)``, ``y = normalize(vec c1 − ⟨vec c1, x⟩ x)``, ``z = x × y``;
  ``T = R v R̃`` with R the rotor taking the key's frame to the query's. O(3)-equivariant, not only SO(3):
  a reflection g flips z in *both* frames, so ``F_i F̃_j`` is conjugated by g (tested).

Aggregation (``aggregation=``, rotation heads): ``"sum"`` is the sum above. ``"compose"`` is the
seed's composition of fractional rotors ``R_i1^{α_i1} R_i2^{α_i2} ⋯`` (docs/concepts/rotors.md#compose), made
order-free as the weighted mean in the Lie algebra::

    R̄_i = exp(½ Σ_j α_ij θ_ij B̂_ij),   out_i = R̄_i (Σ_j α_ij v_j) R̄_i~,

with ``R_ij = exp(½ θ_ij B̂_ij)`` the pair rotor above (θ_ij the angle from a_i to b_j, ``B̂_ij`` the unit
bivector of ``b_j ∧ a_i``; ``inverse=True``: the key → query rotors, so the mean bivector changes sign).
Equivariance: a global versor S moves every direction, ``a_i → S a_i S⁻¹`` (for odd S with the sign
of the grade involution), leaves every ``⟨a_i, b_j⟩``, θ_ij and α_ij unchanged and conjugates every
``b_j ∧ a_i``, so the mean bivector, R̄_i (exp commutes with conjugation) and the output transform by S
(tested for rotations and reflections). When the pair rotors of a query commute (one plane) R̄_i is
their ordered product; when they don't, the two differ by BCH's commutator term, ``½ Σ_{j<l}
[X_j, X_l]`` with ``X_j = ½ α_ij θ_ij B̂_ij`` to second order. Measured for random directions and
softmax weights of unit-variance logits (2000 queries; recomputed by
``test_compose_against_the_ordered_product_of_fractional_rotors``): the rotation between
``∏_j R_ij^{α_ij}`` (in key order) and R̄_i turns by a median 5.3° (90 %: 17.8°) for 2 keys, 3.5°
(10.7°) for 8, 0.8° (2.4°) for 64, while R̄_i itself turns by a median 69°, 40°, 15°.
Cheap: ``θ B̂ = f(⟨a, b⟩) (b ∧ a)`` with ``f(c) = arccos(c) / sqrt(1 − c²)`` (`params.rotor_log_scale`), so
``Σ_j α_ij θ_ij B̂_ij = (Σ_j α_ij f_ij b_j) ∧ a_i``: an attention-shaped sum of key vectors with
weights ``α_ij f_ij`` (f depends on the pair, so it is computed on the N×N scalar tiles), one wedge
and one closed-form exp per query (the mean is a simple bivector).

Antiparallel guard (both backends): the rotor's normaliser ``1 / (2(1 + ⟨a, b⟩))`` uses
``max(1 + ⟨a, b⟩, g)`` (reflection: ``max(1 − ⟨a, b⟩, g)``), g = `params.guard_eps` (`params.pair_scale`).
At exactly antiparallel a, b the unnormalised rotor ``1 + b a`` is 0, so the pair contributes 0 (the
limit of the guarded expression), with finite values and gradients; within the guard band
(angle within ~sqrt(2g) of π) the pair's contribution fades to 0 smoothly. The same holds for
``a = b`` in the reflection head. A zero vector part gives the direction 0 (rotation: ``R = 1/√2``)
in the reference; the factorised rotation and reflection sums use ``|a| = |b| = 1`` (the scaled
blades, and the rotation's rest on the sphere), so for a vector part below NORM_EPS they differ from
the reference: a measure-zero case.
Compose: f is guarded the same way (`params.rotor_log_scale`): the pair's rotation fades to 0 at
antiparallel directions, where its plane is undefined (its value still counts in the mean value).

Precision: the factorised sum's rounding error on a pair is ~ eps / (1 ± ⟨a, b⟩) of its value (terms
of size 1 cancel to a result of size 1 ± ⟨a, b⟩ before the division), hence the guard g = sqrt(eps).
Near-antiparallel pairs are ill-conditioned in any form (the rotor's plane is barely defined there).

Paths (`geoattn.attention.rotor.dispatch.PATHS`; each head's kernels are its registry entry's,
`geoattn.attention.rotor.heads`):

* ``reference`` (`geoattn.attention.rotor.reference`): the naive pairwise form, the oracle: N×N rotors /
  normals (compose: N×N pair bivectors ``θ_ij B̂_ij``) built with the algebra engine's products, each
  value sandwiched (pair tiles only bound the memory).
* ``fast`` (what ``auto`` runs): exact factorised forms. Rotation and reflection
  (docs/concepts/rotors.md#the-factorised-sandwich): the unscaled sandwich N (``(1 + b a) v (1 + a b)``,
  ``(a − b) v̂ (a − b)``) is a polynomial of degree ≤ 2 in a and in b, so
  ``o_i = Σ_r (ψ(a_i) @ Q)_r Σ_j W_ij (φ(b_j) ⊗ v_j @ K)_r`` with monomials ``φ(b) = [1, b_l,
  b_l b_m (l ≤ m)]`` (1 + 3 + 6 = 10 in 3D), ``W_ij = α_ij · pair_scale(⟨a_i, b_j⟩)`` and constant tables K, Q
  (`geoattn.attention.rotor.plan`). With ``d = 1 ± ⟨a, b⟩`` the sandwich splits as ``N = d G + rest``: the
  scalar and the pseudoscalar are only scaled by a versor (``N = 2 d e_A``), and the rotation's
  moved blades give ``G = 2⟨a, b⟩ v + [b ∧ a, v]`` and, in Cl(3), ``rest = 2 k (k · v)`` with k the
  dual of ``b ∧ a`` (Rodrigues' ``k kᵀ`` term); G is aggregated with the weights ``W ⊙ d``. Each part
  takes as few key features as its rank allows (on the unit sphere of directions, where that is
  fewer): Cl(3) rotation 16 + 14 features per value channel, reflection 20 + 2, where the plain
  monomial products took 62 (PGA rotation 88 instead of 212). Per query chunk
  (`geoattn.attention.rotor.blocks`): the logits GEMM, ``⟨a_i, b_j⟩``, softmax and weights, the two
  weight GEMMs with the key features, then the small per-query contraction. Compose: the same chunks
  with ``α @ v`` and ``(α f) @ b``. Chunks large enough run their softmax / guard / weight work as one
  ``torch.compile``d kernel between the GEMMs (`geoattn.attention.rotor.blocks.BlockKernel`; off
  with ``CliffordAlgebra(compile=False)``). Memory O(chunk · N) per (B, H), never an N×N×dim tensor; with
  gradients and several chunks, each chunk is recomputed in the backward (activation checkpointing),
  so training memory is O(N) too; compose's compiled chunks have a backward of their own instead
  (`geoattn.attention.rotor.compose`: flash attention's scheme, α recomputed from a log-sum-exp per query).
  Projection and frame factorise completely into per-key transforms
  around plain attention (``scaled_dot_product_attention``) and, for frame, per-query transforms.
"""

from __future__ import annotations

import torch
from torch import Tensor

from geoattn.algebra.clifford_algebra import CliffordAlgebra
from geoattn.attention.dtypes import outside_autocast
from geoattn.attention.rotor import dispatch
from geoattn.attention.rotor.dispatch import Call
from geoattn.attention.rotor.heads import HEADS, check_head_types
from geoattn.native.gradients import dense_grad


@outside_autocast
def rotor_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    algebra: CliffordAlgebra,
    head_type: str = "rotation",
    causal: bool = False,
    backend: str = "auto",
    inverse: bool = False,
    key_mask: Tensor | None = None,
    chunk_size: int | None = None,
    aggregation: str = "sum",
) -> Tensor:
    """Rotor attention over multivector channels (docs/concepts/rotors.md#the-functional-contract).

    Args:
        q, k: ``(B, H, N, C, dim)`` multivectors; v: ``(B, H, N, Cv, dim)``.
        algebra: the :class:`CliffordAlgebra` the multivectors live in (``dim == algebra.dim``).
        head_type: ``"rotation" | "reflection" | "projection" | "frame"`` (see the module docstring),
            or any type registered in `geoattn.attention.rotor.heads`.
        causal: attend to keys ``j ≤ i`` only.
        backend: ``"auto"`` (the first row of `geoattn.attention.rotor.dispatch.PATHS` that serves the
            call: the head's fast exact kernel) or a row by name, ``"reference"`` (the naive pairwise
            oracle) or ``"fast"``; a row that declines raises a ValueError with its reasons.
        inverse: rotation head only: use the key → query rotor ``(1 + a b)/sqrt(2(1 + ⟨a, b⟩))``
            instead of the query → key one (reflection: accepted, identical; others: ValueError).
        key_mask: optional ``(B, N)`` bool, True for keys that may be attended to (padding mask).
        chunk_size: queries per block on the ``auto`` rotation / reflection path (default: sized so a
            block's logits hold ~4 M numbers); any value gives the same result.
        aggregation: ``"sum"`` (``Σ_j α_ij R_ij v_j R̃_ij``) or, rotation heads only, ``"compose"``
            (one mean rotor per query, docs/concepts/rotors.md#compose; see the module docstring).

    Returns:
        ``(B, H, N, Cv, dim)``, dtype of v.
    """
    _check_inputs(q, k, v, algebra, head_type, backend, inverse, key_mask, chunk_size, aggregation)
    out_dtype = v.dtype
    # low-precision inputs are computed in float32: 1 + ⟨a, b⟩ cancels catastrophically in bf16
    dtype = torch.promote_types(
        torch.promote_types(q.dtype, k.dtype), torch.promote_types(v.dtype, torch.float32)
    )
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    head = HEADS[head_type]
    call = Call(q, k, v, algebra, head, aggregation, causal, inverse, key_mask, chunk_size, backend)
    out = dispatch.choose(call).run(call)
    # the kernels' batched products want a dense gradient; `out.sum().backward()` sends an expanded one
    return dense_grad(out).to(out_dtype)


def _check_inputs(q, k, v, algebra, head_type, backend, inverse, key_mask, chunk_size, aggregation) -> None:
    if not isinstance(algebra, CliffordAlgebra):
        raise ValueError(f"rotor_attention: algebra must be a CliffordAlgebra, got {type(algebra).__name__}")
    if backend not in dispatch.BACKENDS:
        raise ValueError(f"rotor_attention: unknown backend {backend!r}, expected one of {dispatch.BACKENDS}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor) or x.dim() != 5:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"rotor_attention: {name} has shape {shape}, expected (B, H, N, C, dim)")
        if x.shape[-1] != algebra.dim:
            raise ValueError(
                f"rotor_attention: {name} has shape {tuple(x.shape)}: last dim {x.shape[-1]} does not match "
                f"algebra.dim = {algebra.dim} of {algebra!r}"
            )
        if not x.is_floating_point():
            raise ValueError(f"rotor_attention: {name} must be floating point, got {x.dtype}")
    if q.shape != k.shape:
        raise ValueError(
            f"rotor_attention: q {tuple(q.shape)} and k {tuple(k.shape)} must have the same shape"
        )
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"rotor_attention: v {tuple(v.shape)} must share (B, H, N) = {tuple(k.shape[:3])} with k"
        )
    check_head_types(
        "rotor_attention",
        (head_type,),
        (algebra.p, algebra.q, algebra.r),
        q.shape[3],
        algebra=repr(algebra),
        aggregation=aggregation,
        inverse=inverse,
    )
    if key_mask is not None and (
        key_mask.dtype != torch.bool or tuple(key_mask.shape) != (q.shape[0], q.shape[2])
    ):
        raise ValueError(
            f"rotor_attention: key_mask must be a bool tensor of shape (B, N) = {(q.shape[0], q.shape[2])}, "
            f"got {key_mask.dtype} {tuple(key_mask.shape)}"
        )
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"rotor_attention: chunk_size must be a positive int, got {chunk_size!r}")
