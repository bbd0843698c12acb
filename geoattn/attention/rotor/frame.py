"""The frame head (our extension, docs/concepts/rotors.md#frame-transport; Cl(3) only, C ≥ 2): each token
carries the orthonormal frame ``x = normalize(vec c0)``, ``y = normalize(vec c1 − ⟨vec c1, x⟩ x)``,
``z = x × y``; ``T = R v R̃`` with R the rotor taking the key's frame to the query's. It factorises into
per-key and per-query transforms around plain attention: ``F_i (Σ_j α_ij F̃_j v_j F_j) F̃_i``. The
per-token transform runs natively on the CPU where the module is built (`geoattn.native`,
``frame.h``), else in torch; its reference transform (`pair_values`) builds every pair's rotor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from geoattn import native
from geoattn.algebra.clifford_algebra import CliffordAlgebra
from geoattn.attention.rotor.params import NORM_EPS, cached, plain_attention
from geoattn.native.gradients import torch_form_grads


def frame_axes(c0: Tensor, c1: Tensor) -> tuple[Tensor, Tensor]:
    """Gram–Schmidt x, y axes from the vector parts of channels 0, 1: two ``(..., 3)`` → two ``(..., 3)``."""
    ex = c0 / c0.norm(dim=-1, keepdim=True).clamp_min(NORM_EPS)
    y = c1 - (c1 * ex).sum(-1, keepdim=True) * ex
    return ex, y / y.norm(dim=-1, keepdim=True).clamp_min(NORM_EPS)


def _rotation_action_table(algebra: CliffordAlgebra) -> tuple[Tensor, Tensor, Tensor]:
    """``(T0 (8, 8), T (9, 64), Tt (9, 64))`` (Cl(3), float64): the action of a rotation on Cl(3) row
    vectors is ``T0 + vec(A) @ T`` for the row-convention rotation A (``u ↦ u @ A`` on vector
    coordinates, ``vec`` row-major); ``Tt`` takes ``vec(Aᵀ)`` instead.

    The rotor fixes the scalar and the pseudoscalar I (det = 1) and moves vectors by A; a bivector is
    ``v I`` for a vector v (I is central), so ``R (v I) R̃ = (R v R̃) I``: with D the matrix of
    ``v ↦ v I`` (vector → bivector coordinates, from the right multiplication by I) bivector rows move
    by ``D⁻ᵀ A Dᵀ``, linear in A.
    """
    vec, biv = list(algebra.vector_indices), list(algebra.bivector_indices)
    fixed = [*algebra.grade_indices[0], *algebra.grade_indices[algebra.n]]
    pseudoscalar = algebra.grade_indices[algebra.n][0]
    D = algebra.right_multiplication[pseudoscalar][biv][:, vec]  # (bivector, vector): column v ↦ v I
    n, dim = len(vec), algebra.dim
    T = torch.zeros(n, n, dim, dim, dtype=torch.float64)
    for i in range(n):
        for j in range(n):
            unit = torch.zeros(n, n, dtype=torch.float64)
            unit[i, j] = 1.0
            T[i, j, vec[0] : vec[-1] + 1, vec[0] : vec[-1] + 1] = unit
            T[i, j, biv[0] : biv[-1] + 1, biv[0] : biv[-1] + 1] = torch.linalg.inv(D).T @ unit @ D.T
    T0 = torch.diag(torch.zeros(dim, dtype=torch.float64).index_fill(0, torch.tensor(fixed), 1.0))
    return T0, T.reshape(n * n, dim * dim), T.transpose(0, 1).reshape(n * n, dim * dim)


def _frame_transform(frames: Tensor, m: Tensor, T0: Tensor, T: Tensor, vec: slice) -> Tensor:
    """``m`` moved by each token's frame rotor: the frame from the vector parts (``vec``) of channels
    0 and 1 of ``frames (B, H, N, C, 8)``, m ``(B, H, N, Cv, 8)``, T0 and T (out of the frame) or Tt
    (into it) from :func:`_rotation_action_table` → ``(B, H, N, Cv, 8)``. On the CPU, the native kernel
    (`geoattn.native`: one pass over the tokens, forward and backward) where it is built."""
    if m.device.type == "cpu" and m.dtype in (torch.float32, torch.float64) and native.available():
        flat = torch.ops.geoattn.frame_transform(frames.flatten(0, 2), m.flatten(0, 2), T0, T, vec.start)
        return flat.view(m.shape)
    return _frame_transform_torch(frames, m, T0, T, vec)


def _frame_transform_torch(frames: Tensor, m: Tensor, T0: Tensor, T: Tensor, vec: slice) -> Tensor:
    """:func:`_frame_transform` in torch operators (any leading dims)."""
    c0, c1 = frames[..., 0, vec], frames[..., 1, vec]
    ex, ey = frame_axes(c0, c1)
    # [x y z] concatenated is vec(Rotᵀ) for the frame's rotation Rot = [x y z] (axes as columns)
    axes = torch.cat([ex, ey, torch.linalg.cross(ex, ey)], dim=-1)  # (B, H, N, 9)
    return m @ ((axes @ T).view(*axes.shape[:-1], *T0.shape) + T0)


# The native frame transform as custom operators: compiled graphs call them whole.
@torch.library.custom_op("geoattn::frame_transform", mutates_args=())
def _frame_transform_op(frames: Tensor, m: Tensor, t0: Tensor, table: Tensor, vec: int) -> Tensor:
    tensors = (x.contiguous() for x in (frames, m, t0, table))
    return native.cpu_kernels().frame_forward(*tensors, NORM_EPS, vec)


@_frame_transform_op.register_fake
def _(frames, m, t0, table, vec):
    return torch.empty_like(m, memory_format=torch.contiguous_format)


@torch.library.custom_op("geoattn::frame_transform_backward", mutates_args=())
def _frame_transform_backward_op(
    frames: Tensor, m: Tensor, t0: Tensor, table: Tensor, grad_out: Tensor, vec: int
) -> list[Tensor]:
    tensors = (x.contiguous() for x in (frames, m, t0, table, grad_out))
    return list(native.cpu_kernels().frame_backward(*tensors, NORM_EPS, vec))


@_frame_transform_backward_op.register_fake
def _(frames, m, t0, table, grad_out, vec):
    return [torch.empty_like(x, memory_format=torch.contiguous_format) for x in (frames, m)]


def _frame_transform_setup(ctx, inputs, output):
    frames, m, t0, table, vec = inputs
    ctx.vec = vec
    ctx.save_for_backward(frames, m, t0, table)


def _frame_transform_grad(ctx, grad_out):
    if torch.is_grad_enabled():  # create_graph: the kernel's backward is a first derivative only
        frames, m, t0, table = ctx.saved_tensors
        vec = slice(ctx.vec, ctx.vec + 3)
        forms = torch_form_grads(
            lambda: _frame_transform_torch(frames, m, t0, table, vec),
            (frames, m),
            ctx.needs_input_grad[:2],
            grad_out,
        )
        return *forms, None, None, None
    g_frames, g_m = torch.ops.geoattn.frame_transform_backward(*ctx.saved_tensors, grad_out, ctx.vec)
    return g_frames, g_m, None, None, None


_frame_transform_op.register_autograd(_frame_transform_grad, setup_context=_frame_transform_setup)


def frame(q, k, v, algebra, *, causal, inverse, key_mask, chunk_size) -> Tensor:
    """``F_i (Σ_j α_ij F̃_j v_j F_j) F̃_i``: values into key frames, plain attention, out of query frames."""
    B, H, N, Cv, dim = v.shape
    T0, T, Tt = cached(
        algebra,
        ("rotation_action", q.device, q.dtype),
        lambda: tuple(t.to(q.device, q.dtype) for t in _rotation_action_table(algebra)),
    )
    vec = algebra.grade_slice(1)
    local = _frame_transform(k, v, T0, Tt, vec)  # into the key frames
    agg = plain_attention(q, k, local.flatten(-2), algebra, causal, key_mask)
    return _frame_transform(q, agg.view(B, H, N, Cv, dim), T0, T, vec)


def pair_values(q, k, v, ga, inverse):
    """The reference's transform (`geoattn.attention.rotor.reference.pairwise`): each pair's rotor
    (:func:`_frame_rotors`) applied to the key's value, ``(B, H, qb, kb, Cv, dim)``."""
    rotors = _frame_rotors(q, k, ga)

    def block(s: int, e: int, t: int, u: int) -> Tensor:
        R = rotors(s, e, t, u)[..., None, :]  # (B, H, qb, kb, 1, dim)
        return ga.geometric_product(ga.geometric_product(R, v[:, :, None, t:u]), ga.reverse(R))

    return block


def _frame_rotors(q, k, ga):
    """Blocks of ``R_ij`` taking key j's frame to query i's: ``R_ij = R2 R1`` with ``R1 = rotor_between``
    (key x → query x) and ``R2 = exp(φ/2 · y_i ∧ z_i)``, the turn about query x by the signed angle φ
    (atan2, well-defined up to a half turn) that takes the moved key y onto the query y."""
    qx, qy = frame_axes(ga.vector_part(q[..., 0, :]), ga.vector_part(q[..., 1, :]))
    kx, ky = frame_axes(ga.vector_part(k[..., 0, :]), ga.vector_part(k[..., 1, :]))
    qz = torch.linalg.cross(qx, qy)

    def block(s: int, e: int, t: int, u: int) -> Tensor:
        r1 = ga.rotor_between(kx[:, :, None, t:u], qx[:, :, s:e, None])  # (B, H, qb, kb, dim)
        y_moved = ga.vector_part(ga.sandwich(r1, ga.vector(ky[:, :, None, t:u])))  # ⟂ query x
        y_i, z_i = qy[:, :, s:e, None], qz[:, :, s:e, None]
        phi = torch.atan2((y_moved * z_i).sum(-1), (y_moved * y_i).sum(-1))
        plane = ga.outer_product(ga.vector(y_i), ga.vector(z_i))  # unit bivector ⟂ query x
        r2 = ga.exp(phi[..., None] / 2 * plane)
        return ga.geometric_product(r2, r1)

    return block
