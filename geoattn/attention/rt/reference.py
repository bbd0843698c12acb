"""The reference path: explicit ``N × N`` logits and weights (`geoattn.attention.rt.params.block` over
all queries at once), the oracle every other path is tested
against (float64-capable), and the only one that returns the weights. Its backward is autograd's."""

from __future__ import annotations

from torch import Tensor

from geoattn.attention.rt.params import Call, angles, block, explicit_times, prepare, to_query_frame


def run(call: Call) -> tuple[Tensor, Tensor]:
    """``(o (B, H, N, D), weights (B, H, N, N))``."""
    theta = angles(call)
    qh, kh, vh, log_m2 = prepare(call, theta)
    t = explicit_times(call.times, qh.shape[-2], qh.device, qh.dtype)
    out, weights = block(qh, kh, vh, log_m2, t, t, call.params, call.causal, 0)
    return to_query_frame(out, theta), weights
