"""What a trained LM does with noisy tokens: the noisy-tokens test of "magnitude encodes confidence".

A fraction ``p`` of input characters is replaced by uniformly random ones (targets stay clean). If a
model uses its key magnitudes as confidence (the RT claim: precision κ_j ∝ |k_j|²), the keys of
corrupted positions should come out *smaller* than those of clean ones.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from geoattn.layers.robust_filter import RFAAttention
from geoattn.layers.rt_block import RTAttention
from geoattn.layers.transformer import CausalSelfAttention

# attention modules whose ``c_attn`` Linear emits [q | k | v] (B, T, 3C)
QKV_ATTENTIONS = (CausalSelfAttention, RTAttention, RFAAttention)


def corrupt_inputs(x: Tensor, p: float, vocab_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``x`` ``(B, T)`` with a fraction ``p`` of ids replaced by uniform random ones; and the mask
    ``(B, T)`` of replaced positions (a replacement may draw the same id: it still counts)."""
    noisy = torch.rand(x.shape, generator=generator) < p
    random_ids = torch.randint(vocab_size, x.shape, generator=generator)
    return torch.where(noisy, random_ids, x), noisy


@torch.no_grad()
def noisy_split_loss(
    model: nn.Module,
    data: Tensor,
    context: int,
    p: float,
    vocab_size: int,
    *,
    seed: int = 0,
    batch_size: int = 64,
    device: torch.device | str = "cpu",
) -> float:
    """Mean loss over every non-overlapping window of ``data`` with inputs corrupted at rate ``p``
    (a fixed generator: the same corruption for every model) and clean targets."""
    generator = torch.Generator().manual_seed(seed)
    n = (len(data) - 1) // context
    total = 0.0
    for start in range(0, n, batch_size):
        rows = torch.arange(start, min(start + batch_size, n))
        windows = data[rows[:, None] * context + torch.arange(context + 1)]
        x, _ = corrupt_inputs(windows[:, :-1], p, vocab_size, generator)
        _, loss = model(x.to(device), windows[:, 1:].to(device))
        total += float(loss) * len(rows)
    return total / n


@torch.no_grad()
def key_norms_by_corruption(
    model: nn.Module,
    data: Tensor,
    context: int,
    p: float,
    vocab_size: int,
    *,
    seed: int = 0,
    n_windows: int = 512,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """Mean key norm ``|k_j|`` (raw projection, before any normalisation; averaged over heads and
    layers) at corrupted and at clean input positions, and their ratio (< 1: corrupted tokens get
    smaller keys, i.e. less precision). Empty if the model has no [q|k|v] attention."""
    layers = [m for m in model.modules() if isinstance(m, QKV_ATTENTIONS)]
    if not layers:
        return {}
    captured: list[Tensor] = []

    def keep_keys(n_head: int):
        def hook(linear: nn.Module, inputs, output: Tensor) -> None:
            C = output.shape[-1] // 3
            k = output[..., C : 2 * C].float()  # (B, T, C)
            heads = k.view(*k.shape[:2], n_head, C // n_head)
            captured.append(heads.norm(dim=-1).mean(-1))  # (B, T)

        return hook

    handles = [layer.c_attn.register_forward_hook(keep_keys(layer.n_head)) for layer in layers]
    generator = torch.Generator().manual_seed(seed)
    n = min(n_windows, (len(data) - 1) // context)
    rows = torch.arange(n)
    windows = data[rows[:, None] * context + torch.arange(context + 1)]
    x, mask = corrupt_inputs(windows[:, :-1], p, vocab_size, generator)
    was_training = model.training
    model.eval()
    try:
        model(x.to(device))
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    norms = torch.stack(captured).mean(0).cpu()  # (B, T), averaged over layers
    corrupted, clean = float(norms[mask].mean()), float(norms[~mask].mean())
    return {
        "key_norm_corrupted": corrupted,
        "key_norm_clean": clean,
        "key_norm_ratio": corrupted / clean,
    }
