"""The filter task's particle-filter reference: convergence sizes, the disk cache, the gap."""

from __future__ import annotations

import torch

from geoattn.models.base import ModelSizes
from geoattn.tasks.filter import FilterConfig, FilterTask


def test_particle_sizes_the_cache_and_the_gap_to_the_bound(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config = FilterConfig(seq_len=8, val_size=6, n_particles=50, particle_sizes=(200,))
    task = FilterTask(config)
    # chunked: a state tensor of at most 2 sequences' particles gives the same shapes and finite values
    chunked = task.particle_estimates("val", 200, max_elements=2 * 200 * config.dim)
    assert chunked.shape == (6, 8, config.dim) and torch.isfinite(chunked).all()
    torch.manual_seed(0)
    model = task.build_model("transformer", ModelSizes(n_layer=1, n_head=2, n_embd=16))
    metrics = task.final_metrics(model, torch.device("cpu"))
    assert {"angle_deg_full", "baseline_particle", "baseline_particle_200", "baseline_kalman"} <= set(metrics)
    bound = metrics["baseline_particle_200"]  # the largest size is the reference
    assert abs(metrics["gap_to_particle_pct"] - 100 * (metrics["angle_deg_full"] / bound - 1)) < 1e-9
    cached = list((tmp_path / "geoattn" / "filter-baselines").glob("*.json"))
    assert len(cached) == 1
    again = FilterTask(config).baselines("val")  # read back from the cache, not recomputed
    assert again == {k.removeprefix("baseline_"): v for k, v in metrics.items() if k.startswith("baseline_")}
