"""The filter task's fixed pools: ``pool_seed`` (0: the literal seeds, else fresh pools), the held-out
``eval`` pool sealed in an exploratory run and measured otherwise, and a run on fresh pools from the
command line."""

from __future__ import annotations

import json
import math

import pytest
import torch

import geoattn.tasks.filter.task as filter_task
from geoattn.cli import main
from geoattn.experiments.spec import is_test_metric
from geoattn.models.base import ModelSizes
from geoattn.tasks.filter import FilterConfig, FilterTask, estimators, simulate
from geoattn.tasks.filter.simulator import SPLIT_SEEDS, split_seed

SMALL = {"seq_len": 8, "val_size": 6, "eval_size": 5, "n_particles": 20}


def _angle_deg(estimate: torch.Tensor, x: torch.Tensor) -> float:
    """Mean angle (degrees) between ``estimate`` and the direction of ``x`` ``(B, T, D)``, written out."""
    cos = (estimate / estimate.norm(dim=-1, keepdim=True) * x / x.norm(dim=-1, keepdim=True)).sum(-1)
    return float(torch.rad2deg(torch.acos(cos.double().clamp(-1, 1))).mean())


def _model(task: FilterTask):
    torch.manual_seed(0)
    return task.build_model("transformer", ModelSizes(n_layer=1, n_head=2, n_embd=16, dropout=0.0))


def test_pool_seed_zero_draws_the_pools_of_the_literal_seeds():
    config = FilterConfig(**SMALL)
    task = FilterTask(config)
    for split, seed, size in (("val", 1_000_003, 6), ("eval", 2_000_003, 5)):
        expected = simulate(config, size, torch.Generator().manual_seed(seed))
        pool = task.pool(split)
        assert torch.equal(pool.z, expected.z) and torch.equal(pool.x, expected.x)
        assert torch.equal(pool.times, expected.times)
    # the particle filter draws from the val seed + 1, as it always has
    pool = task.pool("val")
    expected = estimators.particle_filter(
        pool.z,
        pool.times,
        config.sde(),
        m0_range=config.m0_range,
        gain_ratio=config.gain_ratio,
        n_particles=20,
        generator=torch.Generator().manual_seed(1_000_004),
    )
    assert torch.equal(task.particle_estimates("val", 20), expected)


def test_pool_seeds_draw_distinct_pools_and_cache_files(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    tasks = {k: FilterTask(FilterConfig(**SMALL, pool_seed=k)) for k in (0, 7, 8)}
    pools = {(k, s): t.pool(s).z for k, t in tasks.items() for s in SPLIT_SEEDS}
    for a in pools:
        for b in pools:
            assert a == b or not torch.equal(pools[a][:5], pools[b][:5]), f"pools {a} and {b} coincide"
    # a pool seed gives the same pools in every task that names it
    assert torch.equal(FilterTask(FilterConfig(**SMALL, pool_seed=7)).pool("eval").z, pools[7, "eval"])
    # every split of every pool seed has its own seed, none of them a literal one
    seeds = [split_seed(s, k) for k in range(1, 500) for s in SPLIT_SEEDS]
    assert len(set(seeds)) == len(seeds) and not set(seeds) & set(SPLIT_SEEDS.values())
    assert all(0 <= seed < 2**63 for seed in seeds)
    # the baselines' disk cache: one file per pool seed, each with its own numbers
    first, second = tasks[0].baselines("val"), tasks[7].baselines("val")
    files = sorted((tmp_path / "geoattn" / "filter-baselines").glob("*.json"))
    assert len(files) == 2 and first != second
    assert sorted(json.loads(f.read_text())["raw"] for f in files) == sorted([first["raw"], second["raw"]])
    # each raw-direction error is that of its own pool, measured independently
    assert first["raw"] == pytest.approx(_angle_deg(tasks[0].pool("val").z, tasks[0].pool("val").x))
    assert second["raw"] == pytest.approx(_angle_deg(tasks[7].pool("val").z, tasks[7].pool("val").x))


def test_a_sealed_eval_pool_is_never_read(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config = FilterConfig(**SMALL, pool_seed=3)
    FilterTask(config).baselines("eval")  # cached on disk: a sealed run must not read it there either
    drawn = []

    def recording(config, size, generator):
        drawn.append(generator.initial_seed())
        return simulate(config, size, generator)

    monkeypatch.setattr(filter_task, "simulate", recording)
    task = FilterTask(config)
    task.sealed = frozenset(task.test_sets)
    assert task.test_sets == ("eval",)
    metrics = task.final_metrics(_model(task), torch.device("cpu"))
    assert "angle_deg_full" in metrics and not any(k.startswith("eval") for k in metrics)
    assert drawn == [split_seed("val", 3)]  # the val pool, nothing else
    for read in (
        lambda: task.get_batch("eval", 2, torch.Generator()),
        lambda: task.baselines("eval"),
        lambda: task.particle_estimates("eval", 20),
    ):
        with pytest.raises(ValueError, match="the eval pool is sealed"):
            read()
    assert drawn == [split_seed("val", 3)]
    task.get_batch("val", 2, torch.Generator())  # val stays readable


def test_a_run_that_may_read_eval_measures_all_of_it():
    task = FilterTask(FilterConfig(**SMALL, pool_seed=5))
    model = _model(task)
    sealed = FilterTask(FilterConfig(**SMALL, pool_seed=5))
    sealed.sealed = frozenset(sealed.test_sets)
    metrics = task.final_metrics(model, torch.device("cpu"))
    closed = {f"eval_baseline_{name}" for name in ("rt_filter", "uniform", "kalman", "raw")}
    added = set(metrics) - set(sealed.final_metrics(model, torch.device("cpu")))
    assert added == {"eval_angle_deg_full", *closed}  # no particle filter on eval: minutes each
    # the experiment protocol sees exactly these as test metrics (an exploratory spec may not name them)
    assert {k for k in metrics if is_test_metric(k, FilterTask.test_sets)} == added
    # against the eval pool drawn from its own seed, the angles written out
    pool = simulate(task.config, 5, torch.Generator().manual_seed(split_seed("eval", 5)))
    with torch.no_grad():
        prediction, _ = model(torch.cat((pool.z, pool.times[..., None]), dim=-1).float())
    assert metrics["eval_angle_deg_full"] == pytest.approx(_angle_deg(prediction.double(), pool.x), rel=1e-5)
    assert metrics["eval_baseline_raw"] == pytest.approx(_angle_deg(pool.z, pool.x))
    assert metrics["eval_baseline_raw"] != pytest.approx(metrics["baseline_raw"])  # not the val pool
    assert all(math.isfinite(v) and 0 < v < 180 for k, v in metrics.items() if k in added)


def test_training_on_fresh_pools_from_the_command_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    argv = ["train", "--task", "filter", "--model", "rt", "--set", "task.pool_seed=7", "--max-iters", "5"]
    argv += ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "8", "--batch-size", "4"]
    argv += ["--eval-interval", "5", "--eval-iters", "1", "--out", str(tmp_path / "run")]
    argv += ["--set", "task.val_size=6", "--set", "task.eval_size=5", "--set", "task.n_particles=20"]
    assert main(argv) == 0
    assert "eval_angle_deg_full" in capsys.readouterr().out
    final = json.loads((tmp_path / "run" / "summary.json").read_text())["final"]
    assert 0 < final["eval_angle_deg_full"] < 180 and "eval_baseline_kalman" in final
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["train"]["task_options"]["pool_seed"] == 7
    # the baselines were measured on the fresh val pool, not the default one
    fresh = FilterTask(FilterConfig(**SMALL, pool_seed=7)).baselines("val")
    assert final["baseline_raw"] == pytest.approx(fresh["raw"])
