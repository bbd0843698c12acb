"""PNG plots of a run (matplotlib, Agg backend): loss curves, an attention map, RT precision."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from geoattn.training.checkpoint import METRICS_FILE


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def loss_curves(out: Path) -> Path:
    """``loss.png``: the per-step training loss and the evaluated train/val losses against iteration."""
    plt = _pyplot()
    records = [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines() if line]
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
    ax.set(xlabel="iteration", ylabel="loss", title=f"{out.name}: loss")
    ax.legend()
    fig.tight_layout()
    path = out / "loss.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@torch.no_grad()
def attention_map(out: Path, model: nn.Module, x: torch.Tensor) -> Path | None:
    """``attention.png``: layer 0, head 0 of ``model.attention_maps(x[:1])`` ((B, H, T, T) per layer).

    Returns None for models without ``attention_maps``.
    """
    if not hasattr(model, "attention_maps"):
        return None
    plt = _pyplot()
    was_training = model.training
    model.eval()
    weights = model.attention_maps(x[:1])[0][0, 0].float().cpu().numpy()  # (T, T)
    model.train(was_training)
    fig, ax = plt.subplots(figsize=(5, 4.5))
    image = ax.imshow(weights, cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, fraction=0.046)
    ax.set(xlabel="key position j", ylabel="query position i", title="attention, layer 0 head 0 (val sample)")
    fig.tight_layout()
    path = out / "attention.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@torch.no_grad()
def rt_precision(out: Path, model: nn.Module) -> Path | None:
    """``precision.png``: the learned κ = m² / c(Δt) of each head of the first RT layer.

    Left: κ against key magnitude m at Δt = 1; right: κ against Δt at m = 1. Returns None when the
    model has no RT layer (``precision_parameters()`` with ``mu_r``; RFA layers name theirs ``mu``).
    """
    layers = (m.precision_parameters() for m in model.modules() if hasattr(m, "precision_parameters"))
    found = next((p for p in layers if "mu_r" in p), None)
    if found is None:
        return None
    from geoattn.rt.precision import rt_noise_variance

    params = {k: v.detach().float().cpu() for k, v in found.items()}
    plt = _pyplot()
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
    fig.tight_layout()
    path = out / "precision.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def make_plots(out: Path, model: nn.Module, x: torch.Tensor | None) -> list[Path]:
    """All plots that apply to this run; ``x`` is a validation batch for the attention map."""
    paths = [loss_curves(out)]
    if x is not None:
        paths.append(attention_map(out, model, x))
    paths.append(rt_precision(out, model))
    return [p for p in paths if p is not None]
