"""The FlexAttention path, for CUDA: `torch.nn.attention.flex_attention` compiled, with the RT logit
(`geoattn.attention.rt.params.rt_logits`) as its ``score_mod`` and a causal block mask. The
``score_mod`` captures the times, ``log m²`` and the four per-head parameters; FlexAttention's own
backward differentiates it, so every one of them gets its gradient.

On a GPU (an H200, torch 2.11) its values and every gradient matched the float64 reference
(``tests/test_cuda.py``, 300 tokens, causal and not, default and irregular times); it has not been
timed there yet. The CPU tests compile the same call (``tests/test_rt_flex.py``): the forward with
inductor, and forward and backward with the ``aot_eager`` backend (Dynamo and AOTAutograd trace the
same graph, run by FlexAttention's reference kernels), since torch declines FlexAttention's backward
on the CPU.

Under a caller's ``torch.compile`` (a compiled model, the trainer's ``--compile``) `attend` is a graph
break: FlexAttention compiles on its own, the call verified above. Lowered inside the caller's graph,
inductor's flex lowering failed (on that GPU, and on the CPU with ``NoValidChoicesError``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from geoattn.attention.rt.params import Call, angles, explicit_times, prepare, rt_logits, to_query_frame
from geoattn.core.compile import disabled

# The torch.compile backend of FlexAttention (the tests compile with "aot_eager" on the CPU).
COMPILE_BACKEND = "inductor"


def _on_cuda(call: Call) -> str | None:
    if call.qkv.device.type != "cuda":
        return f"the CUDA path (torch has no FlexAttention backward on {call.qkv.device.type})"
    return None


# the row's checks (`geoattn.attention.dispatch.Path.checks`)
CHECKS = (_on_cuda,)


def run(call: Call) -> tuple[Tensor, None]:
    """``(o (B, H, N, D), None)``."""
    theta = angles(call)
    qh, kh, vh, log_m2 = prepare(call, theta)
    return to_query_frame(attend(qh, kh, vh, log_m2, call.times, call.params, call.causal), theta), None


@disabled
def attend(qh: Tensor, kh: Tensor, vh: Tensor, log_m2: Tensor, times, params, causal: bool) -> Tensor:
    """``Σ_j A_ij vh_j`` of unit ``qh, kh, vh (B, H, N, D)`` in the common frame, ``log_m2 (B, H, N)``,
    ``times (N,) | (B, N) | None`` and the four ``(H,)`` parameters."""
    from torch.nn.attention.flex_attention import flex_attention

    b, _, n, _ = qh.shape
    t = explicit_times(times, n, qh.device, qh.dtype).expand(b, n)
    mu_r, sigma_t2, eta_t2, beta = params

    def score_mod(score, bi, hi, qi, kj):
        dt = t[bi, qi] - t[bi, kj]
        return rt_logits(score, dt, log_m2[bi, hi, kj], mu_r[hi], sigma_t2[hi], eta_t2[hi], beta[hi])

    mask = _causal_mask(n, qh.device) if causal else None
    return _compiled(flex_attention)(qh, kh, vh, score_mod=score_mod, block_mask=mask, scale=1.0)


_CACHE: dict[object, object] = {}


def _causal_mask(n: int, device):
    """The causal block mask for length ``n``: built once per (n, device), not at every layer and step."""
    from torch.nn.attention.flex_attention import create_block_mask

    key = ("causal", n, str(device))
    if key not in _CACHE:
        _CACHE[key] = create_block_mask(lambda bi, hi, qi, kj: qi >= kj, None, None, n, n, device=device)
    return _CACHE[key]


def _compiled(flex_attention):
    """FlexAttention runs fused only when compiled: once per process and backend."""
    key = ("fn", COMPILE_BACKEND)
    if key not in _CACHE:
        _CACHE[key] = torch.compile(flex_attention, dynamic=False, backend=COMPILE_BACKEND)
    return _CACHE[key]
