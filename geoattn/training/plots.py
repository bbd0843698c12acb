"""PNG plots of a run (matplotlib, Agg backend): loss curves, an attention map, RT precision.

Pure drawing: each function gets the numbers and the file to write; :class:`RunDirectory.plot`
decides which apply to a model. ``pyplot`` and ``save_figure`` are the task layer's
(:mod:`geoattn.tasks.plots`), shared with the tasks' own figures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from geoattn.tasks.plots import pyplot, save_figure


def loss_curves(records: list[dict[str, Any]], path: Path, *, title: str = "") -> Path:
    """The per-step training loss and the evaluated train/val losses against iteration."""
    plt = pyplot()
    evaluated = [r for r in records if r.get("val_loss") is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(
        [r["iter"] for r in records],
        [r["train_loss"] for r in records],
        lw=0.6,
        alpha=0.5,
        label="train (batch)",
    )
    if evaluated:
        iters = [r["iter"] for r in evaluated]
        ax.plot(iters, [r["train_eval_loss"] for r in evaluated], "o-", label="train (eval)")
        ax.plot(iters, [r["val_loss"] for r in evaluated], "o-", label="val")
    ax.set(xlabel="iteration", ylabel="loss", title=f"{title}: loss" if title else "loss")
    ax.legend()
    return save_figure(fig, path)


def attention_map(weights: Tensor, path: Path) -> Path:
    """One head's attention weights ``(T, T)`` as an image (layer 0, head 0 of a validation sample)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 4.5))
    image = ax.imshow(weights.detach().float().cpu().numpy(), cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, fraction=0.046)
    ax.set(xlabel="key position j", ylabel="query position i", title="attention, layer 0 head 0 (val sample)")
    return save_figure(fig, path)


@torch.no_grad()
def rt_precision(params: dict[str, Tensor], path: Path) -> Path:
    """The learned κ = m² / c(Δt) of each head of an RT layer (``mu_r, sigma_t2, eta_t2`` ``(H,)``).

    Left: κ against key magnitude m at Δt = 1; right: κ against Δt at m = 1.
    """
    from geoattn.rt.precision import rt_noise_variance

    params = {k: v.detach().float().cpu() for k, v in params.items()}
    plt = pyplot()
    m = torch.linspace(0.05, 3.0, 100)
    dt = torch.linspace(0.0, 64.0, 129)
    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(10, 4))
    for h in range(params["mu_r"].shape[0]):
        head = {k: params[k][h] for k in ("mu_r", "sigma_t2", "eta_t2")}
        ax_m.plot(m.numpy(), (m**2 / rt_noise_variance(torch.ones(()), **head)).numpy(), label=f"head {h}")
        ax_t.plot(dt.numpy(), (1.0 / rt_noise_variance(dt, **head)).numpy(), label=f"head {h}")
    ax_m.set(xlabel="key magnitude m = |k|", ylabel="κ at Δt = 1", title="precision vs key magnitude")
    ax_t.set(xlabel="Δt (tokens)", ylabel="κ at m = 1", yscale="log", title="precision vs Δt")
    ax_m.legend(fontsize=7)
    return save_figure(fig, path)
