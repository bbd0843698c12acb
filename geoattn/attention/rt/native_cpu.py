"""The native CPU path: the fused C++ kernel (`geoattn.native`, ``rt_qkv.h``) takes the
stacked projections and the filter parameters as they are; the normalisation, key magnitudes,
``log c`` table over the integer lags, the flash-style attention (forward and recomputing backward)
and both rotations run inside it. It needs the default times (``|Δt_ij|`` an integer lag), a fixed
ω (the kernel returns no gradient for the rotation table), float32 or float64, and the module built.

One custom operator, ``geoattn::rt_qkv``, with the kernel's own backward: eager calls and compiled
graphs call it alike (a compiled graph calls it whole).
"""

from __future__ import annotations

import torch
from torch import Tensor

from geoattn import native
from geoattn.attention.rt.params import FAR, Call, turns

# Query block and key chunk of the kernel: no other shape tried (128 × 256, 64 × 128, 32 × 512) was
# faster, for B = 1, H = 8, N = 2048 or for the LM recipe.
BLOCKS = (64, 256)


def _on_cpu(call: Call) -> str | None:
    if call.qkv.device.type != "cpu":
        return f"a CPU kernel, the inputs are on {call.qkv.device.type}"
    return None


def _float32_or_64(call: Call) -> str | None:
    if call.qkv.dtype not in (torch.float32, torch.float64):
        return f"float32 or float64 only, got {call.qkv.dtype}"
    return None


def _default_times(call: Call) -> str | None:
    if call.times is not None:
        return "explicit positions: its log c is a table over the integer lags of the default times"
    return None


def _fixed_omega(call: Call) -> str | None:
    if call.learned_omega:
        return "omega requires a gradient, which the kernel does not return"
    return None


def _built(call: Call) -> str | None:
    if not native.available():  # never builds: the build is `geoattn native build`'s, at set-up
        return native.NOT_BUILT
    return None


# the row's checks (`geoattn.attention.dispatch.Path.checks`), static facts only
CHECKS = (_on_cpu, _float32_or_64, _default_times, _fixed_omega, _built)


def run(call: Call) -> tuple[Tensor, None]:
    """``(o (B, H, N, D) in each query's frame, None)``."""
    qkv = call.qkv
    table = None if call.omega is None else turns(call.omega, qkv.shape[1], qkv.dtype)
    flags = (call.key_scale, call.normalize_values, call.causal)
    return torch.ops.geoattn.rt_qkv(qkv, call.metric, table, list(call.params), *flags)[0], None


@torch.library.custom_op("geoattn::rt_qkv", mutates_args=())
def _rt_qkv_op(
    qkv: Tensor,
    metric: Tensor | None,
    turns: Tensor | None,
    params: list[Tensor],
    key_scale: float | None,
    normalize_values: bool,
    causal: bool,
) -> tuple[Tensor, Tensor]:
    """``qkv (B, N, 3, H, D)``, ``metric (H, D)``, ``turns (H, N, D/2, 2)`` (``cos θ, sin θ``) and
    ``params`` ``(μ_r, σ_t², η_t², β)``, each ``(H,)`` → ``(out (B, H, N, D)`` in each query's frame,
    ``lse (B, H, N))``."""
    inputs = _inputs(qkv, metric, turns, key_scale, normalize_values)
    return native.cpu_kernels().rt_qkv_forward(*inputs, _contiguous(*params), FAR, causal, *BLOCKS)


@_rt_qkv_op.register_fake
def _(qkv, metric, turns, params, key_scale, normalize_values, causal):
    b, n, _, h, d = qkv.shape
    return qkv.new_empty(b, h, n, d), qkv.new_empty(b, h, n)


@torch.library.custom_op("geoattn::rt_qkv_backward", mutates_args=())
def _rt_qkv_backward_op(
    qkv: Tensor,
    metric: Tensor | None,
    turns: Tensor | None,
    params: list[Tensor],
    key_scale: float | None,
    normalize_values: bool,
    causal: bool,
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
) -> list[Tensor]:
    """``[∂qkv (B, N, 3, H, D), ∂metric (H, D) (empty without a metric), ∂μ_r, ∂σ_t², ∂η_t², ∂β]``."""
    inputs = _inputs(qkv, metric, turns, key_scale, normalize_values)
    tensors = (*_contiguous(out, lse), *_rows(grad_out))
    kernel = native.cpu_kernels()
    return list(kernel.rt_qkv_backward(*inputs, _contiguous(*params), FAR, *tensors, causal, *BLOCKS))


@_rt_qkv_backward_op.register_fake
def _(qkv, metric, turns, params, key_scale, normalize_values, causal, out, lse, grad_out):
    grad_metric = qkv.new_empty(0) if metric is None else torch.empty_like(metric)
    return [qkv.new_empty(qkv.shape), grad_metric, *(torch.empty_like(p) for p in params)]


def _setup(ctx, inputs, output):
    qkv, metric, turns, params, *flags = inputs
    ctx.flags, ctx.has_metric, ctx.n_params = flags, metric is not None, len(params)
    ctx.save_for_backward(qkv, metric, turns, *params, *output)


def _backward(ctx, grad_out, grad_lse):
    if torch.is_grad_enabled():  # create_graph: the kernel's gradients are not differentiable themselves
        raise RuntimeError(
            "rt_attention: the native CPU path gives first derivatives only; for a derivative of its "
            "gradients (create_graph=True) pass backend='chunked'"
        )
    qkv, metric, turns, *rest = ctx.saved_tensors
    params, (out, lse) = rest[: ctx.n_params], rest[ctx.n_params :]
    grads = torch.ops.geoattn.rt_qkv_backward(qkv, metric, turns, params, *ctx.flags, out, lse, grad_out)
    grad_qkv, grad_metric, *grad_params = grads
    return grad_qkv, grad_metric if ctx.has_metric else None, None, grad_params, None, None, None


_rt_qkv_op.register_autograd(_backward, setup_context=_setup)


def _inputs(qkv, metric, turns, key_scale, normalize_values) -> tuple:
    none = qkv.new_empty(0)
    magnitudes = key_scale is not None
    return (
        qkv.contiguous(),
        none if metric is None else metric.contiguous(),
        none if turns is None else turns.contiguous(),
        magnitudes,
        float(key_scale) if magnitudes else 0.0,
        normalize_values,
    )


def _contiguous(*tensors: Tensor) -> list[Tensor]:
    return [t.contiguous() for t in tensors]


def _rows(*tensors: Tensor) -> list[Tensor]:
    """``(B, H, N, D)`` tensors as the kernel reads them: rows contiguous, other strides free (a
    token-major layout is read in place), else copied."""
    return [t if t.stride(-1) == 1 and t.stride(-2) >= t.shape[-1] else t.contiguous() for t in tensors]
