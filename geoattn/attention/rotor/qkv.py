"""Rotor attention's q, k and v from its projection: cut into head groups, laid out as the heads read them,
q and k moved by the rotor positional encoding (:class:`~geoattn.layers.rotor_block.RotorAttention`).

``qkv_groups(qkv, action, groups)``: ``qkv (B, N, 3, H, C, dim)``, the projection's output; ``action``
``(1 | B, H, N, dim, dim)``, the matrix of ``x ↦ R_h(t) x R̃_h(t)`` at every head and position
(:meth:`~geoattn.layers.rotor_block.RotorPositionalEncoding.action`), applied to q and k as ``x @ Aᵀ``,
or None; ``groups``: the heads of each group (e.g. ``[[0, 1], [2], [3]]``, each head in one group) →
one ``(q, k, v)`` per group, each ``(B, H_g, N, C, dim)``.

On the CPU the native kernel (``rotor_qkv.h``) does it in one pass each way, where torch takes a
split, an einsum that copies its operand into the batch order and back, permutes and a split per
group, and in the backward a concatenation for each split; its backward writes the projection's
gradient blade by blade, the order the projection's GEMMs read (:func:`~geoattn.algebra.layout.blade_major`).
Elsewhere, or for an algebra of another size, the same maths in torch (:func:`_torch_groups`); both
are tested against each other (values, gradients and second derivatives, float64). The kernel's
backward is a first derivative only: under ``create_graph`` (the molecule model's force loss) the
backward takes the torch form's gradient, differentiably.
"""

from __future__ import annotations

import torch
from torch import Tensor

from geoattn import native
from geoattn.algebra import kernels
from geoattn.algebra.layout import is_blade_major
from geoattn.native.gradients import torch_form_grads


def qkv_groups(
    qkv: Tensor, action: Tensor | None, groups: list[list[int]]
) -> list[tuple[Tensor, Tensor, Tensor]]:
    """See the module docstring: ``qkv (B, N, 3, H, C, dim)``, ``action (1|B, H, N, dim, dim)`` | None →
    ``[(q_g, k_g, v_g) (B, H_g, N, C, dim) each]``."""
    if qkv.dim() != 6 or qkv.shape[2] != 3:
        raise ValueError(f"qkv_groups: qkv has shape {tuple(qkv.shape)}, expected (B, N, 3, H, C, dim)")
    B, N, _, H, C, dim = qkv.shape
    if action is not None and (
        action.dim() != 5 or action.shape[0] not in (1, B) or tuple(action.shape[1:]) != (H, N, dim, dim)
    ):
        raise ValueError(
            f"qkv_groups: action has shape {tuple(action.shape)}, expected (1 or {B}, {H}, {N}, {dim}, {dim})"
        )
    if sorted(h for g in groups for h in g) != list(range(H)):
        raise ValueError(f"qkv_groups: groups {groups} must hold each of the {H} heads once")
    if _native_ok(qkv, action):
        heads, sizes = [h for g in groups for h in g], [len(g) for g in groups]
        # blade by blade, (dim, B·N, 3, H, C): the projection's own order, read without a copy
        x = qkv.movedim(-1, 0) if is_blade_major(qkv) else qkv.movedim(-1, 0).contiguous()
        args = (x.reshape(dim, -1), action, [B, N, H, C, dim], heads, sizes)
        # compiled graphs call the custom operator whole; eager calls skip its dispatch (a third of the
        # kernel's time at the LM recipe's shapes)
        flat = torch.ops.geoattn.rotor_qkv(*args) if torch.compiler.is_compiling() else _RotorQkv.apply(*args)
        return [tuple(flat[3 * g : 3 * g + 3]) for g in range(len(groups))]
    return _torch_groups(qkv, action, groups)


def _native_ok(qkv: Tensor, action: Tensor | None) -> bool:
    """Where the kernel runs: where the algebra's native products run (the CPU, float32 or float64, the
    module built; `geoattn.algebra.kernels.native_products`), for 8 or 16 blades."""
    return (
        qkv.shape[-1] in (8, 16)
        and (action is None or action.dtype == qkv.dtype)
        and kernels.native_products(qkv) is not None
    )


def _torch_groups(
    qkv: Tensor, action: Tensor | None, groups: list[list[int]]
) -> list[tuple[Tensor, Tensor, Tensor]]:
    """The same in torch ops: one batched product per (head, position) over all rows and channels."""
    if action is None:
        q, k, v = qkv.permute(2, 0, 3, 1, 4, 5)  # each (B, H, N, C, dim)
    else:
        qk, v = qkv.split((2, 1), dim=2)  # a split, not slices: one concatenation backward
        if action.shape[0] == 1:
            qk = torch.einsum("bnshca,hnda->bnshcd", qk, action[0])
        else:
            qk = torch.einsum("bnshca,bhnda->bnshcd", qk, action)
        q, k = qk.permute(2, 0, 3, 1, 4, 5)
        v = v.squeeze(2).transpose(1, 2)
    if len(groups) == 1:
        return [(q, k, v)]
    consecutive = [g == list(range(g[0], g[0] + len(g))) for g in groups]
    in_order = all(consecutive) and [h for g in groups for h in g] == list(range(qkv.shape[3]))
    if in_order:  # one split per tensor (its backward one concatenation), where slices zero-fill each
        sizes = [len(g) for g in groups]
        return list(zip(q.split(sizes, 1), k.split(sizes, 1), v.split(sizes, 1)))
    return [(q[:, g], k[:, g], v[:, g]) for g in groups]


def _forward(
    x: Tensor, action: Tensor | None, shape: list[int], heads: list[int], sizes: list[int]
) -> list[Tensor]:
    empty = x.new_empty(0) if action is None else action.contiguous()
    return list(native.cpu_kernels().rotor_qkv_forward(x.contiguous(), empty, shape, heads, sizes))


def _backward(x, action, grads, shape, heads, sizes) -> tuple[Tensor, Tensor | None]:
    """∂x (x's layout) and ∂action (None without one); ``grads`` may hold None (an output not used)."""
    B, N, _, C, dim = shape
    grads = [
        g.contiguous() if g is not None else x.new_zeros(B, sizes[i // 3], N, C, dim)
        for i, g in enumerate(grads)
    ]
    empty = x.new_empty(0) if action is None else action.contiguous()
    g_x, g_action = native.cpu_kernels().rotor_qkv_backward(x.contiguous(), empty, grads, shape, heads, sizes)
    return g_x, (g_action if action is not None else None)


class _RotorQkv(torch.autograd.Function):
    """The native kernel each way; under a second derivative (the molecule model's forces) the backward
    takes the torch form's gradient instead, differentiably (:func:`_torch_backward`)."""

    @staticmethod
    def forward(ctx, x, action, shape, heads, sizes):
        ctx.args = (shape, heads, sizes)
        ctx.save_for_backward(x, action)
        return tuple(_forward(x, action, shape, heads, sizes))

    @staticmethod
    def backward(ctx, *grads):
        x, action = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: a derivative of these gradients will be taken
            return *_torch_backward(x, action, grads, *ctx.args, ctx.needs_input_grad[:2]), None, None, None
        return *_backward(x, action, grads, *ctx.args), None, None, None


def _torch_backward(x, action, grads, shape, heads, sizes, needs) -> tuple[Tensor | None, Tensor | None]:
    """∂x and ∂action by autograd through the torch form (:func:`_torch_groups`), with ``create_graph``:
    x ``(dim, B·N·3·H·C)`` blade by blade as the kernel reads it."""
    B, N, H, C, dim = shape
    groups, at = [], 0
    for size in sizes:
        groups.append(heads[at : at + size])
        at += size

    def form() -> list[Tensor]:
        qkv = x.view(dim, B, N, 3, H, C).movedim(0, -1)
        return [t for part in _torch_groups(qkv, action, groups) for t in part]

    return torch_form_grads(form, (x, action), needs, grads)


# The same kernel as custom operators, for compiled graphs.
@torch.library.custom_op("geoattn::rotor_qkv", mutates_args=())
def _rotor_qkv_op(
    x: Tensor, action: Tensor | None, shape: list[int], heads: list[int], sizes: list[int]
) -> list[Tensor]:
    return _forward(x, action, shape, heads, sizes)


@_rotor_qkv_op.register_fake
def _(x, action, shape, heads, sizes):
    B, N, _, C, dim = shape
    return [x.new_empty(B, size, N, C, dim) for size in sizes for _ in range(3)]


@torch.library.custom_op("geoattn::rotor_qkv_backward", mutates_args=())
def _rotor_qkv_backward_op(
    x: Tensor,
    action: Tensor | None,
    grads: list[Tensor],
    shape: list[int],
    heads: list[int],
    sizes: list[int],
) -> list[Tensor]:
    g_x, g_action = _backward(x, action, grads, shape, heads, sizes)
    return [g_x, g_action if g_action is not None else x.new_empty(0)]


@_rotor_qkv_backward_op.register_fake
def _(x, action, grads, shape, heads, sizes):
    return [torch.empty_like(x), x.new_empty(0) if action is None else torch.empty_like(action)]


def _setup(ctx, inputs, output):
    x, action, *ctx.args = inputs
    ctx.has_action = action is not None
    ctx.save_for_backward(x, action if action is not None else x.new_empty(0))


def _grad(ctx, grads):
    x, action = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph, as in _RotorQkv
        needs = (ctx.needs_input_grad[0], ctx.has_action and ctx.needs_input_grad[1])
        g_x, g_action = _torch_backward(x, action if ctx.has_action else None, grads, *ctx.args, needs)
        return g_x, g_action, None, None, None
    B, N, _, C, dim = ctx.args[0]
    sizes = ctx.args[2]
    grads = [g if g is not None else x.new_zeros(B, sizes[i // 3], N, C, dim) for i, g in enumerate(grads)]
    g_x, g_action = torch.ops.geoattn.rotor_qkv_backward(
        x, action if ctx.has_action else None, grads, *ctx.args
    )
    return g_x, (g_action if ctx.has_action else None), None, None, None


_rotor_qkv_op.register_autograd(_grad, setup_context=_setup)
