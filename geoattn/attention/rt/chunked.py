"""The chunked path: the reference's maths (`geoattn.attention.rt.params.block`) over query chunks
of `CHUNK` rows, recomputed in the backward (activation checkpointing), so that it holds
``B·H·CHUNK·N`` logits at a time and never an ``N × N`` tensor. Its backward is autograd's.

It serves what the native kernel and FlexAttention do not: the CPU with explicit times or a learned
ω, or without a C++ toolchain (as `rfa_attention`'s chunked backend does for RFA). The LM's
training step never takes it.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from geoattn.attention.rt.params import Call, angles, block, explicit_times, prepare, to_query_frame

CHUNK = 128


def run(call: Call) -> tuple[Tensor, None]:
    """``(o (B, H, N, D), None)``."""
    theta = angles(call)
    qh, kh, vh, log_m2 = prepare(call, theta)
    n = qh.shape[-2]
    t = explicit_times(call.times, n, qh.device, qh.dtype)
    outs = []
    for start in range(0, n, CHUNK):
        end = min(start + CHUNK, n)
        keys = end if call.causal else n  # causal: keys after the chunk's last query never count
        args = (qh[..., start:end, :], kh[..., :keys, :], vh[..., :keys, :], log_m2[..., :keys])
        args += (t[:, start:end], t[:, :keys], call.params, call.causal, start)
        if call.grad:
            outs.append(checkpoint(_outputs, *args, use_reentrant=False))
        else:
            outs.append(_outputs(*args))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)
    return to_query_frame(out, theta), None


def _outputs(*args) -> Tensor:
    return block(*args)[0]
