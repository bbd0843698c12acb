"""The nbody task: GATr's protocol, its simulator, the file format and the two models (SPEC §3)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from conftest import random_o3_versor

from geoattn.tasks.nbody import (
    SETS,
    NBodyConfig,
    NBodyTask,
    accelerations,
    equivariance_error,
    initial_conditions,
    leapfrog,
    random_orthogonal,
    save_gatr_format,
    simulate_systems,
)
from geoattn.training.config import TrainConfig

SMALL = {"train_size": 64, "val_size": 200, "eval_size": 48, "e3_size": 32, "object_size": 24}


@pytest.fixture(scope="module")
def task() -> NBodyTask:
    return NBodyTask(NBodyConfig(**SMALL))


def sizes(**options) -> TrainConfig:
    """A small run config; ``options`` are its ``model.*`` settings."""
    return TrainConfig(task="nbody", n_layer=1, n_head=4, n_embd=32, dropout=0.0, model_options=options)


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


def test_simulator_conserves_momentum_and_energy(task):
    data, c = task.dataset("val"), task.config
    x, v = leapfrog(data.m, data.x_initial, data.v_initial, time=c.time, steps=c.steps)
    torch.testing.assert_close(x, data.x_final, rtol=0, atol=0)  # the set is this integration
    momentum = lambda velocity: (data.m[..., None] * velocity).sum(1)  # noqa: E731
    scale = (data.m[..., None] * data.v_initial).abs().sum(1).amax()
    assert float((momentum(v) - momentum(data.v_initial)).abs().max() / scale) < 1e-12
    e0 = energy(data.m, data.x_initial, data.v_initial)
    drift = ((energy(data.m, x, v) - e0) / e0.abs()).abs()
    assert float(drift.median()) < 1e-6 and float(drift.quantile(0.9)) < 1e-4
    # second order: ten times smaller steps shrink the typical energy error about a hundredfold
    x10, v10 = leapfrog(data.m, data.x_initial, data.v_initial, time=c.time, steps=10 * c.steps)
    drift10 = ((energy(data.m, x10, v10) - e0) / e0.abs()).abs()
    assert float(drift.median() / drift10.median()) > 50


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
    xf, _ = leapfrog(light[:50], x[:50], v[:50], time=0.1, steps=1000)
    torch.testing.assert_close(xf[:, 1:].norm(dim=-1), radius[:50], rtol=1e-4, atol=0)
    # the velocity noise has the stated scale
    noisy = dataclasses.replace(config, vel_std=0.01)
    _, _, v_noisy = initial_conditions(500, 3, noisy, torch.Generator().manual_seed(1))
    assert 0.009 < float((v_noisy - v)[:, 1:].std()) < 0.011


def test_the_drop_rule_removes_far_movers():
    config = NBodyConfig(max_displacement=0.15)
    data = simulate_systems(300, 3, config, torch.Generator().manual_seed(2), shift_std=20.0)
    moved = (data.x_final - data.x_initial).norm(dim=-1).amax(1)
    assert len(data) == 300 and float(moved.max()) <= 0.15
    unfiltered = simulate_systems(
        300,
        3,
        dataclasses.replace(config, max_displacement=1e9),
        torch.Generator().manual_seed(2),
        shift_std=20.0,
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
    spread = {
        name: float(task.dataset(name).x_initial.mean(1).std()) for name in ("eval", "e3_generalization")
    }
    assert 12 < spread["eval"] < 30 and 120 < spread["e3_generalization"] < 300  # translation std 20 vs 200


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
        assert npz["x_initial"].shape == (48, 4, 3)
    loaded = NBodyTask(NBodyConfig(data=str(tmp_path)))
    for name in SETS:
        for array in ("m", "x_initial", "v_initial", "x_final"):
            assert torch.equal(getattr(loaded.dataset(name), array), getattr(task.dataset(name), array))
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
        "sizes": {"train_size": 10, "val_size": None, "eval_size": 7, "e3_size": None, "object_size": None},
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


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"star_mass_range": (10.0, 1.0)}, "star_mass_range"),
        ({"radius_range": (0.0, 1.0)}, "radius_range"),
        ({"train_size": 0}, "train_size"),
        ({"object_planets": 0}, "object_planets"),
        ({"steps": 0}, "steps"),
        ({"vel_std": -0.1}, "vel_std"),
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
        task.build_model("rt", sizes())
    with pytest.raises(ValueError, match="unknown model setting"):
        task.build_model("rotor", sizes(in_channels=4))
    with pytest.raises(ValueError, match=r"\(B, n, 7\)"):
        task.build_model("transformer", sizes())(torch.zeros(2, 4, 6))


def _centred_batch(task, count=64):
    """Eval inputs moved next to the origin: float32 then resolves the model, not the translation."""
    x = task.dataset("eval").inputs()[:count].clone()
    x[..., 1:4] -= x[..., 1:4].mean(1, keepdim=True)
    return x


def test_rotor_model_is_e3_equivariant(task):
    torch.manual_seed(0)
    model = task.build_model("rotor", sizes(n_layer=2)).double()
    x = _centred_batch(task)
    for seed in range(2):
        assert equivariance_error(model, x, torch.Generator().manual_seed(seed), shift_std=5.0) < 1e-8
    # float32 with projection heads: < 1e-5
    torch.manual_seed(0)
    projection = task.build_model("rotor", sizes(n_layer=2, head_types=("projection",) * 4))
    assert equivariance_error(projection, x.float(), torch.Generator().manual_seed(0)) < 1e-5
    # float32 with rotation/reflection heads: bounded by their antiparallel guard (see NBodyRotor)
    assert equivariance_error(model.float(), x.float(), torch.Generator().manual_seed(0)) < 2e-3


@pytest.mark.parametrize("algebra", ["cl3", "pga"])
def test_rotor_embedding_and_read_out_follow_the_algebras_versors(task, algebra):
    """embed(Q u) = V · embed(u) and displacement(V · mv) = Q displacement(mv) for O(3) versors V with
    matrix Q (read off how V moves the basis vectors), rotations and reflections."""
    model = task.build_model("rotor", sizes(algebra=algebra)).double()
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
    model = task.build_model("rotor", sizes(n_layer=2, algebra="pga")).double()
    assert model.algebra.r == 1 and model.algebra.dim == 16
    x = task.dataset("e3_generalization").inputs()[:32]  # far from the origin: translations must be exact
    for seed in range(3):  # rotations and reflections (random_orthogonal), translations of std 20
        assert equivariance_error(model, x, torch.Generator().manual_seed(seed), shift_std=20.0) < 1e-8
    rotations_only = equivariance_error(model, x, torch.Generator().manual_seed(5), reflect=False)
    assert rotations_only < 1e-8


def test_pga_rotor_model_learns(task):
    """150 steps of a 0.8 k-parameter PGA model halve the error of predicting no motion."""
    torch.manual_seed(0)
    config = TrainConfig(task="nbody", n_layer=1, n_head=2, n_embd=16, model_options={"algebra": "pga"})
    model = task.build_model("rotor", config)
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
    model = task.build_model("transformer", sizes()).double()
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
    model = task.build_model("transformer", TrainConfig(task="nbody", n_layer=2, n_head=4, n_embd=64))
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
        "eval_mse",
        "e3_generalization_mse",
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


def test_random_orthogonal_mixes_rotations_and_reflections():
    q = random_orthogonal(200, torch.Generator().manual_seed(0))
    torch.testing.assert_close(q @ q.transpose(1, 2), torch.eye(3, dtype=q.dtype).expand(200, 3, 3))
    det = torch.linalg.det(q)
    assert bool(((det - 1).abs() < 1e-12).any()) and bool(((det + 1).abs() < 1e-12).any())
