"""The filter task: simulated data, reference estimators, batches and model wrappers
(docs/tasks.md#filter)."""

from __future__ import annotations

import math

import pytest
import torch

from geoattn.algebra.rotation import rotate_pairs
from geoattn.models.base import ModelSizes
from geoattn.tasks.filter import FilterConfig, FilterTask, estimators, simulate

MODELS = ("transformer", "rt", "rfa", "ngpt")


@pytest.fixture(scope="module")
def task() -> FilterTask:
    return FilterTask(FilterConfig(val_size=128, n_particles=500))


def tiny(**options) -> tuple[ModelSizes, dict]:
    """A small run's sizes and ``model.*`` settings ``options`` (``build_model``'s arguments)."""
    return ModelSizes(n_layer=1, n_head=2, n_embd=16, dropout=0.0), options


def test_simulated_sequences_have_the_stated_properties(task):
    pool = task.pool("val")
    c = task.config
    assert pool.z.shape == pool.x.shape == (128, c.seq_len, c.dim)
    assert pool.times.shape == (128, c.seq_len)
    gaps = pool.times.diff(dim=1)
    assert bool((gaps >= c.dt_range[0] - 1e-12).all()) and bool((gaps <= c.dt_range[1] + 1e-12).all())
    # token magnitudes vary at least 3x within every sequence
    norms = pool.z.norm(dim=-1)
    assert float((norms.amax(1) / norms.amin(1)).min()) >= 3.0
    # small-angle regime: the random part of the per-token direction change, ∠(u_i, R(Δt) u_{i-1})
    u = pool.directions
    omega = torch.tensor(c.omega, dtype=u.dtype)
    predicted = rotate_pairs(u[:, :-1], gaps[..., None] * omega)
    step = estimators.angular_error_deg(predicted, u[:, 1:])
    assert float(step.median()) < 10.0 and float(step.quantile(0.99)) < 20.0
    # the transport rotation itself is not small: without R the steps are larger
    assert float(estimators.angular_error_deg(u[:, :-1], u[:, 1:]).median()) > float(step.median()) + 2.0


def test_reference_estimators_are_ordered(task):
    errors = task.baselines("val")
    assert set(errors) == {"rt_filter", "uniform", "kalman", "particle", "raw"}
    assert errors["raw"] > errors["uniform"] + 8.0
    assert errors["uniform"] > errors["rt_filter"] + 1.0
    assert errors["rt_filter"] > errors["kalman"]
    assert errors["particle"] <= errors["kalman"] + 1.5
    assert errors["particle"] < errors["raw"] - 15.0
    assert task.baselines("val") == errors  # cached, identical


def test_closed_form_backends_agree_and_beta_one_is_worse(task):
    pool, sde = task.pool("val"), task.config.sde()
    z, times = pool.z[:16], pool.times[:16]
    auto = estimators.rt_filter(z, times, sde, beta=task.config.beta)
    reference = estimators.rt_filter(z, times, sde, beta=task.config.beta, backend="reference")
    torch.testing.assert_close(auto, reference, rtol=0, atol=1e-9)
    # β = 1 weighs keys by their agreement with the noisy current measurement (documented default 0.05)
    target = pool.directions[:16]
    vmf = estimators.rt_filter(z, times, sde, beta=1.0)
    err = estimators.angular_error_deg
    assert float(err(vmf, target).mean()) > float(err(auto, target).mean()) + 5.0


def _estimators(sde, config):
    return {
        "raw": lambda z, t: estimators.raw_directions(z),
        "uniform": lambda z, t: estimators.uniform_transported_mean(z, t, sde),
        "rt_filter": lambda z, t: estimators.rt_filter(z, t, sde, beta=config.beta),
        "kalman": lambda z, t: estimators.tangent_kalman_filter(z, t, sde, gain_ratio=config.gain_ratio),
        "particle": lambda z, t: estimators.particle_filter(
            z,
            t,
            sde,
            m0_range=config.m0_range,
            gain_ratio=config.gain_ratio,
            n_particles=64,
            generator=torch.Generator().manual_seed(5),
        ),
    }


@pytest.mark.parametrize("name", ["raw", "uniform", "rt_filter", "kalman", "particle"])
def test_estimators_are_causal(task, name):
    pool, cut = task.pool("val"), 9
    z, times = pool.z[:4, :20].clone(), pool.times[:4, :20]
    estimate = _estimators(task.config.sde(), task.config)[name]
    before = estimate(z, times)
    z[:, cut + 1 :] = torch.randn(
        z[:, cut + 1 :].shape, generator=torch.Generator().manual_seed(1), dtype=z.dtype
    )
    after = estimate(z, times)
    torch.testing.assert_close(after[:, : cut + 1], before[:, : cut + 1], rtol=0, atol=1e-10)
    assert float((after[:, cut + 1 :] - before[:, cut + 1 :]).abs().max()) > 1e-3  # the future did change


def test_uniform_transported_mean_matches_an_explicit_sum(task):
    pool, sde = task.pool("val"), task.config.sde()
    z, times = pool.z[:3, :12], pool.times[:3, :12]
    omega = torch.tensor(task.config.omega, dtype=z.dtype)
    unit = z / z.norm(dim=-1, keepdim=True)
    for i in range(12):
        dt = (times[:, i : i + 1] - times[:, : i + 1])[..., None]  # (B, i+1, 1)
        expected = rotate_pairs(unit[:, : i + 1], dt * omega).sum(1)
        expected = expected / expected.norm(dim=-1, keepdim=True)
        torch.testing.assert_close(estimators.uniform_transported_mean(z, times, sde)[:, i], expected)


def test_particle_filter_converges_to_the_kalman_filter_without_gains():
    # Linear-Gaussian-like regime (no gains, small noise): the two filters must agree closely.
    config = FilterConfig(gain_ratio=1.0, seq_len=24, val_size=32)
    pool, sde = FilterTask(config).pool("val"), config.sde()
    kalman = estimators.tangent_kalman_filter(pool.z, pool.times, sde)
    particle = estimators.particle_filter(
        pool.z,
        pool.times,
        sde,
        m0_range=config.m0_range,
        n_particles=2000,
        generator=torch.Generator().manual_seed(0),
    )
    err = estimators.angular_error_deg
    kalman_err, particle_err = (
        float(err(kalman, pool.directions).mean()),
        float(err(particle, pool.directions).mean()),
    )
    raw_err = float(err(pool.z, pool.directions).mean())
    assert particle_err < 0.6 * raw_err and abs(particle_err - kalman_err) < 0.1 * raw_err


def test_particle_filter_stays_finite_with_many_particles():
    """10⁴ particles draw initial tangent steps beyond π (sin|τ| < 0): once NaN for every weight."""
    c = FilterConfig()  # the task's defaults: initial steps of up to 0.5 rad per dimension
    pool = FilterTask(c).pool("val")
    particle = estimators.particle_filter(
        pool.z[:10, :4],
        pool.times[:10, :4],
        c.sde(),
        m0_range=c.m0_range,
        gain_ratio=c.gain_ratio,
        n_particles=10_000,
        generator=torch.Generator().manual_seed(1),
    )
    assert torch.isfinite(particle).all()


def test_get_batch_is_deterministic_given_the_generator(task):
    def draw(split, seed):
        return task.get_batch(split, 6, torch.Generator().manual_seed(seed))

    for split in ("train", "val", "eval"):
        (x1, y1), (x2, y2) = draw(split, 3), draw(split, 3)
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
        assert x1.shape == (6, 64, 9) and y1.shape == (6, 64, 8) and x1.dtype == torch.float32
        torch.testing.assert_close(y1.norm(dim=-1), torch.ones(6, 64))
        assert bool((x1[..., -1].diff(dim=1) > 0).all())
    generator = torch.Generator().manual_seed(3)
    first, second = task.get_batch("train", 6, generator), task.get_batch("train", 6, generator)
    assert not torch.equal(first[0], second[0])  # the generator advances
    # val batches are rows of the fixed pool
    x, _ = draw("val", 4)
    pool_z = task.pool("val").z.float()
    assert all(bool((pool_z == row[:, :8]).all(-1).all(-1).any()) for row in x)
    # the pools do not depend on anything but their seeds
    assert torch.equal(FilterTask(task.config).pool("val").z, task.pool("val").z)
    assert not torch.equal(task.pool("eval").z[:8], task.pool("val").z[:8])


def test_simulate_uses_only_the_generator(task):
    a = simulate(task.config, 3, torch.Generator().manual_seed(11))
    b = simulate(task.config, 3, torch.Generator().manual_seed(11))
    assert torch.equal(a.z, b.z) and torch.equal(a.x, b.x)
    torch.testing.assert_close(a.z - a.gains[..., None] * a.x, b.z - b.gains[..., None] * b.x)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"dim": 7}, "dim"),
        ({"omega": (0.1, 0.2)}, "omega"),
        ({"eta_t": 0.0}, "eta_t"),
        ({"sigma_t": -1.0}, "sigma_t"),
        ({"gain_ratio": 0.5}, "gain_ratio"),
        ({"m0_range": (2.0, 1.0)}, "m0_range"),
        ({"dt_range": (0.0, 1.0)}, "dt_range"),
        ({"seq_len": 1}, "seq_len"),
        ({"n_particles": 1}, "n_particles"),
        ({"beta": 0.0}, "beta"),
        ({"pool_seed": -1}, "pool_seed"),
    ],
)
def test_bad_config_values_raise(options, match):
    with pytest.raises(ValueError, match=match):
        FilterConfig(**options)


def test_bad_requests_raise(task):
    with pytest.raises(ValueError, match="split"):
        task.get_batch("test", 2, torch.Generator())
    with pytest.raises(ValueError, match="transformer, rt, rfa, ngpt"):
        task.build_model("gatr", *tiny())
    with pytest.raises(ValueError, match="unknown model setting"):
        task.build_model("transformer", *tiny(not_a_field=1))
    model = task.build_model("transformer", *tiny())
    with pytest.raises(ValueError, match=r"\(B, T, D \+ 1\)"):
        model(torch.zeros(2, 5, 8))


def test_config_accepts_lists_from_toml():
    config = FilterConfig(omega=[0.1, 0.2, 0.3, 0.4], m0_range=[1, 3])
    assert config.omega == (0.1, 0.2, 0.3, 0.4) and config.m0_range == (1.0, 3.0)


@pytest.mark.parametrize("name", MODELS)
def test_models_are_causal_and_differentiable(task, name):
    torch.manual_seed(0)
    model = task.build_model(name, *tiny())
    x, y = task.get_batch("val", 2, torch.Generator().manual_seed(0))
    x, y = x[:, :12], y[:, :12]
    prediction, loss = model(x, y)
    assert prediction.shape == y.shape and torch.isfinite(loss)
    torch.testing.assert_close(prediction.norm(dim=-1), torch.ones(2, 12))
    loss.backward()
    assert all(
        p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad
    )
    future = x.clone()
    future[:, 7:, :8] = 3 * torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        changed, _ = model(future, y)
    torch.testing.assert_close(changed[:, :7], prediction.detach()[:, :7], rtol=0, atol=1e-5)
    assert float((changed[:, 7:] - prediction.detach()[:, 7:]).abs().max()) > 1e-4
    maps = model.attention_maps(x)
    assert len(maps) == 1 and maps[0].shape == (2, 2, 12, 12)


def test_rt_model_sees_the_token_magnitude(task):
    # rescaling one token changes the rt model's output: |z| reaches the sphere backbone as a feature
    torch.manual_seed(0)
    model = task.build_model("rt", *tiny())
    x, _ = task.get_batch("val", 1, torch.Generator().manual_seed(0))
    scaled = x.clone()
    scaled[:, 3, :8] *= 4.0
    with torch.no_grad():
        a, _ = model(x)
        b, _ = model(scaled)
    assert float((a[:, 3:] - b[:, 3:]).abs().max()) > 1e-4


def test_a_short_training_run_beats_the_uniform_mean(task):
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    train = simulate(task.config, 512, generator)
    x_train = torch.cat((train.z, train.times[..., None]), dim=-1).float()
    y_train = train.directions.float()
    model = task.build_model("transformer", ModelSizes(n_layer=1, n_head=2, n_embd=32))
    optimizer = torch.optim.AdamW(model.optim_groups(0.0), lr=3e-3)
    for _ in range(120):
        index = torch.randint(512, (32,), generator=generator)
        _, loss = model(x_train[index], y_train[index])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    pool = task.pool("val")
    with torch.no_grad():
        prediction, _ = model(torch.cat((pool.z, pool.times[..., None]), dim=-1).float())
    learned = task.metrics(prediction, pool.directions.float())["angle_deg"]
    assert math.isfinite(learned) and learned < task.baselines("val")["uniform"]


def test_every_lm_backbone_is_a_row_and_runs_causally(task):
    """The filter task's table is ``LM_TABLE``'s backbones; the task fixes ``causal`` where the config
    has the switch (the RotorLM's attention has none: always causal)."""
    from geoattn.models.lm import LM_TABLE

    assert list(FilterTask.table) == list(LM_TABLE)
    assert FilterTask.model_settings("rt")[1] == ("vocab_size", "block_size", "causal")
    assert FilterTask.model_settings("rotor")[1] == ("vocab_size", "block_size")
    for name in LM_TABLE:
        model = task.build_model(name, *tiny())
        assert type(model.backbone.config) is LM_TABLE[name].config
        assert getattr(model.config, "causal", True) and model.config.block_size == task.config.seq_len
