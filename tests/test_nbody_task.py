"""The nbody task: GATr's protocol, its simulator, the file format and the two models
(docs/tasks.md#nbody)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from conftest import random_o3_versor

from geoattn.models.base import ModelSizes
from geoattn.tasks.nbody import (
    SETS,
    NBodyConfig,
    NBodyTask,
    accelerations,
    equivariance_error,
    initial_conditions,
    random_orthogonal,
    save_gatr_format,
    simulate_systems,
    symplectic_euler,
)

SMALL = {"train_size": 64, "val_size": 200, "eval_size": 48, "e3_size": 32, "object_size": 24}


@pytest.fixture(scope="module")
def task() -> NBodyTask:
    return NBodyTask(NBodyConfig(**SMALL))


def sizes(**options) -> tuple[ModelSizes, dict]:
    """A small run's sizes and ``model.*`` settings ``options`` (``build_model``'s arguments)."""
    return ModelSizes(n_layer=1, n_head=4, n_embd=32, dropout=0.0), options


def energy(m, x, v):
    """Kinetic + pairwise gravitational potential energy, G = 1, by an explicit loop over pairs."""
    total = 0.5 * (m * v.square().sum(-1)).sum(-1)
    n = m.shape[1]
    for i in range(n):
        for j in range(i + 1, n):
            total = total - m[:, i] * m[:, j] / (x[:, i] - x[:, j]).norm(dim=-1)
    return total


def test_accelerations_match_newtons_law_pair_by_pair():
    generator = torch.Generator().manual_seed(0)
    m = torch.rand(3, 4, generator=generator, dtype=torch.float64) + 0.1
    x = torch.randn(3, 4, 3, generator=generator, dtype=torch.float64)
    expected = torch.zeros_like(x)
    for i in range(4):
        for j in range(4):
            if i != j:
                d = x[:, j] - x[:, i]
                expected[:, i] += 2.0 * m[:, j, None] * d / d.norm(dim=-1, keepdim=True) ** 3
    torch.testing.assert_close(accelerations(m, x, G=2.0), expected)


def gatr_rule(m, x, v, time, steps):
    """GATr's update written out body by body: a from x, then v += dt a, then x += dt v."""
    dt, path = time / steps, [x]
    for _ in range(steps):
        a = torch.zeros_like(x)
        for i in range(x.shape[1]):
            for j in range(x.shape[1]):
                if i != j:
                    d = x[:, j] - x[:, i]
                    a[:, i] += m[:, j, None] * d / d.norm(dim=-1, keepdim=True) ** 3
        v = v + dt * a
        x = x + dt * v
        path.append(x)
    return x, v, torch.stack(path, dim=2)


def test_the_integrator_is_gatrs_symplectic_euler(task):
    data, c = task.dataset("val"), task.config
    few = data.head(20)
    expected_x, expected_v, expected_path = gatr_rule(few.m, few.x_initial, few.v_initial, c.time, c.steps)
    x, v, path = symplectic_euler(
        few.m, few.x_initial, few.v_initial, time=c.time, steps=c.steps, trajectory=True
    )
    torch.testing.assert_close(x, expected_x, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(v, expected_v, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(path, expected_path, rtol=1e-12, atol=1e-12)
    # the set is this integration, and val keeps its trajectories (GATr's pipeline reads them)
    x, v, _ = symplectic_euler(data.m, data.x_initial, data.v_initial, time=c.time, steps=c.steps)
    torch.testing.assert_close(x, data.x_final, rtol=0, atol=0)
    assert data.trajectories.shape == (200, 4, c.steps + 1, 3)
    assert torch.equal(data.trajectories[:, :, 0], data.x_initial)
    assert torch.equal(data.trajectories[:, :, -1], data.x_final)
    assert task.dataset("eval").trajectories is None
    # momentum is conserved to rounding (pairwise equal and opposite kicks)
    momentum = lambda velocity: (data.m[..., None] * velocity).sum(1)  # noqa: E731
    scale = (data.m[..., None] * data.v_initial).abs().sum(1).amax()
    assert float((momentum(v) - momentum(data.v_initial)).abs().max() / scale) < 1e-12
    # first order: ten times smaller steps shrink the typical energy error about tenfold (leapfrog: 100)
    e0 = energy(data.m, data.x_initial, data.v_initial)
    drift = ((energy(data.m, x, v) - e0) / e0.abs()).abs()
    x10, v10, _ = symplectic_euler(data.m, data.x_initial, data.v_initial, time=c.time, steps=10 * c.steps)
    drift10 = ((energy(data.m, x10, v10) - e0) / e0.abs()).abs()
    assert 5 < float(drift.median() / drift10.median()) < 20


def test_orbits_are_circular_before_the_perturbation():
    config = NBodyConfig(vel_std=0.0)
    m, x, v = initial_conditions(500, 3, config, torch.Generator().manual_seed(1))
    assert m.shape == (500, 4) and x.shape == v.shape == (500, 4, 3)
    assert bool((x[:, 0] == 0).all()) and bool((v[:, 0] == 0).all())  # the star at rest at the origin
    assert bool((m[:, 0] >= 1).all() & (m[:, 0] <= 10).all())
    assert bool((m[:, 1:] >= 0.01).all() & (m[:, 1:] <= 0.1).all())
    planets, speed = x[:, 1:], v[:, 1:].norm(dim=-1)
    radius = planets.norm(dim=-1)
    assert bool((planets[..., 2] == 0).all() & (v[:, 1:, 2] == 0).all())  # the x-y plane
    assert bool((radius >= 0.1 - 1e-12).all() & (radius <= 1 + 1e-12).all())
    torch.testing.assert_close(speed, torch.sqrt(m[:, :1] / radius))  # v = sqrt(G M / r)
    torch.testing.assert_close((planets * v[:, 1:]).sum(-1), torch.zeros_like(radius), atol=1e-12, rtol=0)
    spin = torch.sign(planets[..., 0] * v[:, 1:, 1] - planets[..., 1] * v[:, 1:, 0])
    assert 0.4 < float((spin > 0).double().mean()) < 0.6  # both orbit directions
    # a light planet on that orbit keeps its radius while it moves a good part of a revolution
    light = m.clone()
    light[:, 1:] = 1e-9
    xf, _, _ = symplectic_euler(light[:50], x[:50], v[:50], time=0.1, steps=1000)
    torch.testing.assert_close(xf[:, 1:].norm(dim=-1), radius[:50], rtol=2e-3, atol=0)  # first order
    # the velocity noise has the stated scale
    noisy = dataclasses.replace(config, vel_std=0.01)
    _, _, v_noisy = initial_conditions(500, 3, noisy, torch.Generator().manual_seed(1))
    assert 0.009 < float((v_noisy - v)[:, 1:].std()) < 0.011


def ks_distance(samples, cdf) -> float:
    """Kolmogorov–Smirnov distance between the empirical distribution of ``samples`` and ``cdf``."""
    x = samples.flatten().sort().values
    n = x.numel()
    f = cdf(x)
    grid = torch.arange(n + 1, dtype=x.dtype) / n
    return float(torch.maximum((grid[1:] - f).abs(), (f - grid[:-1]).abs()).max())


def test_simulated_sets_follow_gatrs_distribution():
    """The statistics of GATr's NBodySimulator() defaults (gatr/experiments/nbody/simulator.py): masses
    log-uniform (star 1–10, planets 0.01–0.1), planets uniform in area at 0.1–1 from the star in one
    plane, circular speed sqrt(M / r) plus N(0, 0.01²) per component, both orbit directions, Haar
    orientation, bodies in random order, translation N(0, 20²) per axis, + (200, 0, 0) for the E(3)
    set, every body within 2 of where it started. KS bounds at ~99.9 % (1.95 / sqrt(n))."""
    config, count = NBodyConfig(), 3000
    data = simulate_systems(count, 3, config, torch.Generator().manual_seed(11))
    star = data.m >= 1  # (B, 4), one per row
    assert bool((star.sum(1) == 1).all())
    index = star.double().argmax(1)
    assert float((torch.bincount(index, minlength=4) / count - 0.25).abs().max()) < 0.04  # random order
    m_star, m_planet = data.m[star], data.m[~star].view(count, 3)
    bound = lambda n: 1.95 / math.sqrt(n)  # noqa: E731
    assert ks_distance(m_star, lambda m: torch.log(m) / math.log(10)) < bound(count)
    assert ks_distance(m_planet, lambda m: torch.log(m / 0.01) / math.log(10)) < bound(3 * count)
    pick = lambda t: t[torch.arange(count), index]  # noqa: E731  the star's row
    x_star, v_star = pick(data.x_initial), pick(data.v_initial)
    assert bool((v_star == 0).all())  # at rest
    rel = data.x_initial[~star].view(count, 3, 3) - x_star[:, None]  # planets from the star
    v = data.v_initial[~star].view(count, 3, 3)
    radius = rel.norm(dim=-1)
    assert ks_distance(radius, lambda r: (r.square() - 0.01) / 0.99) < bound(3 * count)
    normal = torch.linalg.cross(rel[:, 0], rel[:, 1])
    normal = normal / normal.norm(dim=-1, keepdim=True)  # the orbital plane, Haar-oriented
    assert float((rel * normal[:, None]).sum(-1).abs().max()) < 1e-9  # all planets in it
    assert ks_distance(normal[:, 2].abs(), lambda c: c) < bound(count)  # |cos| uniform on a sphere
    radial_dir = rel / radius[..., None]
    tangent = torch.linalg.cross(normal[:, None].expand_as(rel), radial_dir)
    circular = torch.sqrt(m_star[:, None] / radius)
    along = (v * tangent).sum(-1)  # ±circular speed + noise
    noise = torch.stack(((v * radial_dir).sum(-1), (v * normal[:, None]).sum(-1), along.abs() - circular), -1)
    for k in range(3):  # radial, out of plane, along the orbit: N(0, 0.01²) each
        assert abs(float(noise[..., k].mean())) < 0.001 and 0.0095 < float(noise[..., k].std()) < 0.0105
    assert 0.45 < float((along > 0).double().mean()) < 0.55  # both directions
    assert float((data.x_final - data.x_initial).norm(dim=-1).max()) <= 2.0
    # translations: the star starts exactly at the shift; E(3) set: the same plus 200 along x
    shifted = simulate_systems(count, 3, config, torch.Generator().manual_seed(12), domain_shift=True)
    x_star_e3 = shifted.x_initial[shifted.m >= 1]  # (B, 3)
    for x0, mean in ((x_star, (0.0, 0.0, 0.0)), (x_star_e3, (200.0, 0.0, 0.0))):
        centred = (x0 - torch.tensor(mean, dtype=x0.dtype)) / 20
        normal_cdf = lambda z: 0.5 * (1 + torch.erf(z / math.sqrt(2)))  # noqa: E731
        assert ks_distance(centred, normal_cdf) < bound(3 * count)
        assert float(centred.mean(0).abs().max()) < 4 / math.sqrt(count)


def test_the_drop_rule_removes_far_movers():
    config = NBodyConfig(max_displacement=0.15)
    data = simulate_systems(300, 3, config, torch.Generator().manual_seed(2))
    moved = (data.x_final - data.x_initial).norm(dim=-1).amax(1)
    assert len(data) == 300 and float(moved.max()) <= 0.15
    unfiltered = simulate_systems(
        300, 3, dataclasses.replace(config, max_displacement=1e9), torch.Generator().manual_seed(2)
    )
    assert (
        float(((unfiltered.x_final - unfiltered.x_initial).norm(dim=-1).amax(1) > 0.15).double().mean()) > 0.1
    )


def test_sets_have_the_stated_shapes(task):
    for name in SETS:
        data = task.dataset(name)
        n = 6 if name == "object_generalization" else 4
        size = {"train": 64, "val": 200, "eval": 48, "e3_generalization": 32, "object_generalization": 24}[
            name
        ]
        assert data.m.shape == (size, n) and data.x_initial.shape == data.x_final.shape == (size, n, 3)
        assert ((data.m >= 1).sum(1) == 1).all()  # one star per system
        moved = (data.x_final - data.x_initial).norm(dim=-1)
        assert float(moved.max()) <= 2.0 and float(moved.mean()) > 0.05
        x, y = task.get_batch(name, 5, torch.Generator().manual_seed(0))
        assert x.shape == (5, n, 7) and y.shape == (5, n, 3) and x.dtype == y.dtype == torch.float32
    e3_centroids = task.dataset("e3_generalization").x_initial.mean(1)  # (32, 3): 200 along x, std 20
    assert 170 < float(e3_centroids[:, 0].mean()) < 230 and float(e3_centroids[:, 1:].abs().mean()) < 40


def test_sets_and_batches_are_seeded(task):
    again = NBodyTask(task.config)
    assert torch.equal(again.dataset("eval").x_final, task.dataset("eval").x_final)
    assert not torch.equal(task.dataset("val").x_initial[:10], task.dataset("train").x_initial[:10])
    (x1, y1), (x2, y2) = (task.get_batch("train", 8, torch.Generator().manual_seed(4)) for _ in range(2))
    assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_gatr_format_round_trip(task, tmp_path):
    task.save_gatr_format(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{name}.npz" for name in SETS)
    with np.load(tmp_path / "eval.npz") as npz:
        assert sorted(npz.files) == ["m", "v_initial", "x_final", "x_initial"]
        assert npz["x_initial"].shape == (48, 4, 3) and npz["x_initial"].dtype == np.float64
    with np.load(tmp_path / "val.npz") as npz:  # GATr's pipeline reads the val trajectories
        assert sorted(npz.files) == ["m", "trajectories", "v_initial", "x_final", "x_initial"]
        assert npz["trajectories"].shape == (200, 4, 101, 3)
    loaded = NBodyTask(NBodyConfig(data=str(tmp_path)))
    for name in SETS:
        for array in ("m", "x_initial", "v_initial", "x_final"):
            assert torch.equal(getattr(loaded.dataset(name), array), getattr(task.dataset(name), array))
    assert torch.equal(loaded.dataset("val").trajectories, task.dataset("val").trajectories)
    again = tmp_path / "again"
    loaded.save_gatr_format(again)  # a loaded set saves back unchanged
    with np.load(tmp_path / "val.npz") as first, np.load(again / "val.npz") as second:
        assert all(np.array_equal(first[a], second[a]) for a in first.files)
    generator = lambda: torch.Generator().manual_seed(7)  # noqa: E731
    assert all(
        torch.equal(a, b)
        for a, b in zip(loaded.get_batch("val", 9, generator()), task.get_batch("val", 9, generator()))
    )


def test_sizes_take_the_first_samples_of_loaded_files(task, tmp_path):
    task.save_gatr_format(tmp_path)
    loaded = NBodyTask(NBodyConfig(data=str(tmp_path), train_size=10, eval_size=7))
    train, first = loaded.dataset("train"), task.dataset("train").head(10)
    assert len(train) == 10 and len(loaded.dataset("eval")) == 7 and len(loaded.dataset("val")) == 200
    assert torch.equal(train.x_final, first.x_final)
    x, _ = loaded.get_batch("train", 256, torch.Generator().manual_seed(0))
    inputs = first.inputs().float()
    assert bool((x[:, None] == inputs[None]).all(-1).all(-1).any(1).all())  # every row one of the 10
    # config.json describes what was used: the directory, 10 samples and their hash, no simulator settings
    meta = json.loads(json.dumps(loaded.meta()))
    assert meta["source"] == {
        "directory": str(tmp_path.resolve()),
        "system": "gravity",
        "sizes": {
            "train_size": 10,
            "val_size": None,
            "eval_size": 7,
            "e3_size": None,
            "object_size": None,
            "test_size": None,
        },
    }
    assert meta["sets"]["train"] == {"samples": 10, "bodies": 4, "sha256": first.content_hash()}
    assert meta["sets"]["val"]["sha256"] == task.dataset("val").content_hash()
    assert meta["sets"]["object_generalization"]["bodies"] == 6
    with pytest.raises(ValueError, match=r"task.train_size=65, but train.npz in .* holds 64 samples"):
        NBodyTask(NBodyConfig(data=str(tmp_path), train_size=65))


def test_meta_of_simulated_sets_records_the_settings_and_hashes(task):
    meta = task.meta()
    assert meta["source"]["simulated"] == dataclasses.asdict(task.config)
    assert {name: meta["sets"][name]["samples"] for name in SETS} == {
        "train": 64, "val": 200, "eval": 48, "e3_generalization": 32, "object_generalization": 24
    }  # fmt: skip
    again = NBodyTask(task.config).meta()["sets"]
    assert again == meta["sets"]  # seeded: the same data, the same hashes
    other = NBodyTask(dataclasses.replace(task.config, seed=1)).meta()["sets"]
    assert other["eval"]["sha256"] != meta["sets"]["eval"]["sha256"]


def test_bad_data_directories_raise(task, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        NBodyTask(NBodyConfig(data=str(tmp_path / "nowhere")))
    sets = {name: task.dataset(name) for name in SETS}
    save_gatr_format(sets, tmp_path)
    (tmp_path / "e3_generalization.npz").unlink()
    with pytest.raises(ValueError, match=r"missing file .*e3_generalization\.npz"):
        NBodyTask(NBodyConfig(data=str(tmp_path)))
    save_gatr_format(sets, tmp_path)
    eval_set = sets["eval"]
    np.savez(
        tmp_path / "eval.npz",
        m=eval_set.m.numpy(),
        x_initial=eval_set.x_initial.numpy(),
        v_initial=eval_set.v_initial.numpy(),
        x_final=eval_set.x_final.numpy()[:, :3],
    )
    with pytest.raises(ValueError, match=r"array x_final has shape \(48, 3, 3\), expected \(48, 4, 3\)"):
        NBodyTask(NBodyConfig(data=str(tmp_path)))
    np.savez(tmp_path / "eval.npz", m=eval_set.m.numpy(), x_initial=eval_set.x_initial.numpy())
    with pytest.raises(ValueError, match="lacks array.*v_initial, x_final"):
        NBodyTask(NBodyConfig(data=str(tmp_path)))
    np.savez(
        tmp_path / "eval.npz",
        m=np.zeros(4),
        x_initial=np.zeros((4, 3)),
        v_initial=np.zeros((4, 3)),
        x_final=0,
    )
    with pytest.raises(ValueError, match=r"array m has shape \(4,\), expected \(B, n\)"):
        NBodyTask(NBodyConfig(data=str(tmp_path)))
    with pytest.raises(ValueError, match="'val' has no trajectories, which GATr's pipeline reads"):
        save_gatr_format({"val": dataclasses.replace(sets["val"], trajectories=None)}, tmp_path)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"star_mass_range": (10.0, 1.0)}, "star_mass_range"),
        ({"radius_range": (0.0, 1.0)}, "radius_range"),
        ({"train_size": 0}, "train_size"),
        ({"object_planets": 0}, "object_planets"),
        ({"steps": 0}, "steps"),
        ({"vel_std": -0.1}, "vel_std"),
        ({"e3_shift": -1.0}, "e3_shift"),
        ({"val_size": 0}, "val_size"),
        ({"time": 0.0}, "time"),
        ({"max_displacement": 0.0}, "max_displacement"),
    ],
)
def test_bad_config_values_raise(options, match):
    with pytest.raises(ValueError, match=match):
        NBodyConfig(**options)


def test_bad_requests_raise(task):
    with pytest.raises(ValueError, match="unknown split"):
        task.get_batch("test", 2, torch.Generator())
    with pytest.raises(ValueError, match="transformer, rotor"):
        task.build_model("rt", *sizes())
    with pytest.raises(ValueError, match="unknown model setting"):
        task.build_model("rotor", *sizes(in_channels=4))
    with pytest.raises(ValueError, match=r"\(B, n, 7\)"):
        task.build_model("transformer", *sizes())(torch.zeros(2, 4, 6))


def _centred_batch(task, count=64):
    """Eval inputs moved next to the origin: float32 then resolves the model, not the translation."""
    x = task.dataset("eval").inputs()[:count].clone()
    x[..., 1:4] -= x[..., 1:4].mean(1, keepdim=True)
    return x


def test_rotor_model_is_e3_equivariant(task):
    torch.manual_seed(0)
    model = task.build_model("rotor", *sizes(n_layer=2)).double()
    x = _centred_batch(task)
    for seed in range(2):
        assert equivariance_error(model, x, torch.Generator().manual_seed(seed), shift_std=5.0) < 1e-8
    # float32 with projection heads: < 1e-5
    torch.manual_seed(0)
    projection = task.build_model("rotor", *sizes(n_layer=2, head_types=("projection",) * 4))
    assert equivariance_error(projection, x.float(), torch.Generator().manual_seed(0)) < 1e-5
    # float32 with rotation/reflection heads: bounded by their antiparallel guard (see NBodyRotor)
    assert equivariance_error(model.float(), x.float(), torch.Generator().manual_seed(0)) < 2e-3


@pytest.mark.parametrize("algebra", ["cl3", "pga"])
def test_rotor_model_with_pair_messages_and_velocity_read_out_is_e3_equivariant(task, algebra):
    """The pair-message read-in and the velocity read-out keep the model E(3)-equivariant in float64,
    and each changes what the model computes (a read-in that dropped its vectors would pass the first
    check alone)."""
    torch.manual_seed(0)
    options = {"n_layer": 2, "algebra": algebra, "pair_vectors": 2, "pair_hidden": 8, "velocity_output": True}
    model = task.build_model("rotor", *sizes(**options)).double()
    assert model.model.config.in_channels == 3 + 4 and model.model.config.out_scalars == 1
    x = task.dataset("e3_generalization").inputs()[:32]
    for seed in range(3):
        assert equivariance_error(model, x, torch.Generator().manual_seed(seed), shift_std=20.0) < 1e-8
    out, _ = model(x)
    with torch.no_grad():
        model.pairs.weights.weight.add_(1.0)
    assert not torch.allclose(model(x)[0], out)
    with pytest.raises(ValueError, match="pair_vectors"):
        task.build_model("rotor", *sizes(pair_vectors=-1))


@pytest.mark.parametrize("algebra", ["cl3", "pga"])
def test_rotor_model_with_messages_before_every_block_is_e3_equivariant(task, algebra):
    """Messages before every block (EGNN's message passing on the current scalars) keep the model
    E(3)-equivariant in float64; they start at zero (the model computes what it did without them) and,
    once trained away from zero, change both the scalars and the vectors."""
    torch.manual_seed(0)
    options = {"n_layer": 2, "algebra": algebra, "pair_vectors": 2, "pair_hidden": 8}
    plain = task.build_model("rotor", *sizes(**options)).double()
    torch.manual_seed(0)
    model = task.build_model("rotor", *sizes(**options, pair_every_block=True)).double()
    assert len(model.block_messages) == 2
    x = task.dataset("e3_generalization").inputs()[:32]
    model.load_state_dict(plain.state_dict(), strict=False)
    torch.testing.assert_close(model(x)[0], plain(x)[0])
    for messages in model.block_messages:
        with torch.no_grad():
            for layer in (messages.to_scalars, messages.to_vectors):
                layer.weight.normal_()
    assert not torch.allclose(model(x)[0], plain(x)[0])
    for seed in range(3):
        assert equivariance_error(model, x, torch.Generator().manual_seed(seed), shift_std=20.0) < 1e-8
    alone = task.build_model("rotor", *sizes(n_layer=2, pair_every_block=True)).double()  # no read-in
    assert alone.pairs is None and alone(x)[0].shape == x[..., 1:4].shape


def test_rotor_model_with_clifford_messages_before_every_block_is_e3_equivariant(task):
    """The Clifford model's message layer before every block (``block_messages="clifford"``) keeps the
    rotor model E(3)-equivariant in float64 (random rotations, reflections and shifts), reads the pairs'
    products of their masses or charges (their weight changes what it computes; the read-in alone sees
    each body's own only), and is refused outside Cl(3), without ``pair_every_block`` (where it would do
    nothing) or under an unknown name with one line."""
    torch.manual_seed(0)
    options = {"n_layer": 2, "pair_every_block": True, "block_messages": "clifford", "velocity_output": True}
    model = task.build_model("rotor", *sizes(**options)).double()
    assert [type(m).__name__ for m in model.block_messages] == ["CliffordMessageLayer"] * 2
    x = task.dataset("e3_generalization").inputs()[:32]
    for seed in range(3):
        assert equivariance_error(model, x, torch.Generator().manual_seed(seed), shift_std=20.0) < 1e-8
    out = model(x)[0]
    with torch.no_grad():  # the weight of the pair's charge product c_i c_j (its fourth invariant)
        model.block_messages[0].geometry.s_to_s.weight[:, 3].add_(1.0)
    assert not torch.allclose(model(x)[0], out)
    bad_options = (
        ({"block_messages": "gatr"}, "block_messages"),
        ({"algebra": "pga"}, "cl3"),
        ({"pair_every_block": False}, "pair_every_block"),
    )
    for bad, match in bad_options:
        with pytest.raises(ValueError, match=match):
            task.build_model("rotor", *sizes(**{**options, **bad}))


@pytest.mark.parametrize("algebra", ["cl3", "pga"])
def test_rotor_embedding_and_read_out_follow_the_algebras_versors(task, algebra):
    """embed(Q u) = V · embed(u) and displacement(V · mv) = Q displacement(mv) for O(3) versors V with
    matrix Q (read off how V moves the basis vectors), rotations and reflections."""
    model = task.build_model("rotor", *sizes(algebra=algebra)).double()
    ga = model.algebra
    generator = torch.Generator().manual_seed(3)
    u = torch.randn(5, 3, generator=generator, dtype=torch.float64)
    mv = torch.randn(5, ga.dim, generator=generator, dtype=torch.float64)
    for n_vectors in (1, 2, 3):
        versor = random_o3_versor(ga, n_vectors, torch.float64, seed=n_vectors)
        basis = model.embed(torch.eye(3, dtype=torch.float64))  # (3, dim): embed(e_k)
        q = model.displacement(ga.sandwich(versor, basis)).T  # column k: where e_k goes
        torch.testing.assert_close(q @ q.T, torch.eye(3, dtype=torch.float64))
        assert float(torch.linalg.det(q)) == pytest.approx((-1) ** n_vectors)
        torch.testing.assert_close(model.embed(u @ q.T), ga.sandwich(versor, model.embed(u)))
        torch.testing.assert_close(model.displacement(ga.sandwich(versor, mv)), model.displacement(mv) @ q.T)


def test_pga_rotor_model_is_e3_equivariant_in_float64(task):
    torch.manual_seed(0)
    model = task.build_model("rotor", *sizes(n_layer=2, algebra="pga")).double()
    assert model.algebra.r == 1 and model.algebra.dim == 16
    x = task.dataset("e3_generalization").inputs()[:32]  # far from the origin: translations must be exact
    for seed in range(3):  # rotations and reflections (random_orthogonal), translations of std 20
        assert equivariance_error(model, x, torch.Generator().manual_seed(seed), shift_std=20.0) < 1e-8
    rotations_only = equivariance_error(model, x, torch.Generator().manual_seed(5), reflect=False)
    assert rotations_only < 1e-8


def test_pga_rotor_model_learns(task):
    """150 steps of a 0.8 k-parameter PGA model halve the error of predicting no motion."""
    torch.manual_seed(0)
    model = task.build_model("rotor", ModelSizes(n_layer=1, n_head=2, n_embd=16), {"algebra": "pga"})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    for _ in range(150):
        x, y = task.get_batch("train", 32, generator)
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    eval_set = task.dataset("eval")
    standing_still = float(torch.nn.functional.mse_loss(eval_set.x_initial, eval_set.x_final))
    results = task.evaluate_sets(model, batch_size=48)
    assert results["eval_mse"] < 0.5 * standing_still
    assert results["e3_generalization_mse"] < 0.5 * standing_still  # equivariant: no worse far away


def test_transformer_is_translation_and_permutation_equivariant_but_not_rotation(task):
    torch.manual_seed(0)
    model = task.build_model("transformer", *sizes()).double()
    x = _centred_batch(task, 16)
    shifted = x.clone()
    shifted[..., 1:4] += torch.tensor([3.0, -2.0, 1.0], dtype=x.dtype)
    with torch.no_grad():
        out, _ = model(x)
        out_shifted, _ = model(shifted)
        order = torch.tensor([2, 0, 3, 1])
        out_permuted, _ = model(x[:, order])
    torch.testing.assert_close(out_shifted, out + torch.tensor([3.0, -2.0, 1.0], dtype=x.dtype))
    torch.testing.assert_close(out_permuted, out[:, order])
    assert equivariance_error(model, x, torch.Generator().manual_seed(0), reflect=False) > 1e-3
    maps = model.attention_maps(x)
    assert len(maps) == 1 and maps[0].shape == (16, 4, 4, 4)
    torch.testing.assert_close(maps[0].sum(-1), torch.ones(16, 4, 4, dtype=maps[0].dtype))


def test_evaluate_sets_and_a_short_training_run(task):
    torch.manual_seed(0)
    model = task.build_model("transformer", ModelSizes(n_layer=2, n_head=4, n_embd=64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(150):
        x, y = task.get_batch("train", 32, generator)
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    results = task.evaluate_sets(model, batch_size=16)
    assert set(results) == {
        "val_mse_full",
        "eval_mse",
        "e3_generalization_mse",
        "e3_generalization_unshifted_mse",
        "object_generalization_mse",
        "equivariance_error",
    }
    assert all(math.isfinite(v) for v in results.values())
    eval_set = task.dataset("eval")
    standing_still = float(torch.nn.functional.mse_loss(eval_set.x_initial, eval_set.x_final))
    assert results["eval_mse"] < 0.5 * standing_still  # learned to move the bodies
    x, y = task.get_batch("eval", 48, torch.Generator().manual_seed(0))
    with torch.no_grad():
        prediction, loss = model(x, y)
    assert task.metrics(prediction, y)["mse"] == pytest.approx(float(loss))


def test_the_error_profile_tells_a_typical_sample_from_the_worst(task):
    """`geoattn eval`'s n-body rows on how each MSE is made up: per-sample errors whose mean is the
    set's MSE (against F.mse_loss over the whole set), the median and the worst 1 %'s share on known
    numbers, and the training set's MSE over every sample beside the trainer's batch estimates."""
    from geoattn.tasks.nbody.task import closest_distance, error_profile, sample_errors

    torch.manual_seed(0)
    model = task.build_model("transformer", ModelSizes(n_layer=1, n_head=2, n_embd=16)).eval()
    data = task.dataset("val")
    errors = sample_errors(model, data, batch_size=64)
    with torch.no_grad():
        prediction, _ = model(data.inputs().float())
    whole = torch.nn.functional.mse_loss(prediction.double(), data.x_final.double())
    assert errors.shape == (len(data),) and float(errors.mean()) == pytest.approx(float(whole), rel=1e-6)
    known = torch.tensor([1.0] * 198 + [50.0, 50.0], dtype=torch.float64)  # 2 of 200 are the worst 1 %
    assert error_profile(known) == {
        "mse": pytest.approx(1.49),
        "mse_median": 1.0,
        "worst_1pct_share": pytest.approx(100 / 298),
    }
    assert error_profile(torch.zeros(3, dtype=torch.float64))["worst_1pct_share"] == 0.0
    closest = torch.arange(200, dtype=torch.float64)  # the two worst samples are the last two
    assert error_profile(known, closest)["closest_worst_1pct"] == 198.0  # torch's lower median of 198, 199
    assert error_profile(known, closest)["closest_median"] == 99.0
    x = data.x_initial[:5].double()
    loop = [
        min(float((x[s, i] - x[s, j]).norm()) for i in range(4) for j in range(4) if i != j) for s in range(5)
    ]
    torch.testing.assert_close(
        closest_distance(data.subset(torch.arange(5))), torch.tensor(loop, dtype=torch.float64)
    )
    rows = {r.metric: r for r in task.evaluation(model, torch.device("cpu"), lambda: {}, over="-")}
    train = sample_errors(model, task.dataset("train"))
    assert rows["train_mse_full"].value == pytest.approx(float(train.mean()))
    assert rows["val_mse_median"].value == pytest.approx(float(errors.median()))
    assert rows["val_mse_full"].value == pytest.approx(float(whole), rel=1e-6)
    assert rows["val_worst_1pct_share"].value == pytest.approx(error_profile(errors)["worst_1pct_share"])
    assert math.isnan(error_profile(torch.tensor([1.0, math.nan], dtype=torch.float64))["worst_1pct_share"])
    model.train()  # dropout on: the errors are still the eval-mode model's, and its mode comes back
    dropped = task.build_model("transformer", ModelSizes(n_layer=1, n_head=2, n_embd=16, dropout=0.5))
    dropped.load_state_dict(model.state_dict())
    dropped.train()
    torch.testing.assert_close(sample_errors(dropped, data, batch_size=64), errors)
    assert dropped.training


def test_baselines_are_the_static_and_free_motion_predictions(task):
    for name in ("eval", "object_generalization"):
        data, baselines = task.dataset(name), task.baselines(name)
        static = (data.x_final - data.x_initial).square().mean()
        free = (data.x_final - data.x_initial - 0.1 * data.v_initial).square().mean()
        assert baselines == {
            "static_mse": pytest.approx(float(static)),
            "free_motion_mse": pytest.approx(float(free)),
        }
        assert baselines["free_motion_mse"] < 0.6 * baselines["static_mse"]  # velocities carry most of it


def test_random_orthogonal_mixes_rotations_and_reflections():
    q = random_orthogonal(200, torch.Generator().manual_seed(0))
    torch.testing.assert_close(q @ q.transpose(1, 2), torch.eye(3, dtype=q.dtype).expand(200, 3, 3))
    det = torch.linalg.det(q)
    assert bool(((det - 1).abs() < 1e-12).any()) and bool(((det + 1).abs() < 1e-12).any())


class _Predict(torch.nn.Module):
    """A stand-in model: ``rule(x_initial)`` as the final positions (x: (B, n, 7) mass, x, v)."""

    def __init__(self, rule):
        super().__init__()
        self.rule, self.unused = rule, torch.nn.Parameter(torch.zeros((), dtype=torch.float64))

    def forward(self, x):
        return self.rule(x[..., 1:4]), None


def test_the_e3_set_is_also_measured_without_its_shift(task):
    """``e3_generalization_unshifted_mse``: the same samples moved back by the fixed shift. A
    translation-equivariant prediction (nothing moves) reads the same MSE on both; one that is not
    (everything at the origin) does not."""
    static = task.evaluate_sets(_Predict(lambda x0: x0))
    same = pytest.approx(static["e3_generalization_mse"], rel=1e-9)
    assert static["e3_generalization_unshifted_mse"] == same
    assert static["e3_generalization_mse"] == pytest.approx(task.baselines("e3_generalization")["static_mse"])
    origin = task.evaluate_sets(_Predict(torch.zeros_like))
    assert origin["e3_generalization_mse"] > 10 * origin["e3_generalization_unshifted_mse"]  # 200 vs std 20
    unshifted = task.dataset("e3_generalization").translated(torch.tensor([-task.config.e3_shift, 0.0, 0.0]))
    assert unshifted.x_initial[..., 0].mean().abs() < 0.1 * task.config.e3_shift  # back near the origin
