"""The molecule task: the MD data builder and its file format, the energy model's physics (forces are
−∂E/∂x, E(3) invariance / equivariance in float64), the one-line hint when the extra is missing, and a
short training run that must lower the force error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from geoattn.bench.molecule import model_epochs, peers
from geoattn.cli import main
from geoattn.core.errors import ConfigError
from geoattn.models.base import ModelSizes
from geoattn.tasks.molecule.data import (
    TrajectorySettings,
    build_trajectory,
    load_trajectory,
    one_openmp_thread,
    require,
    save_trajectory,
)
from geoattn.tasks.molecule.task import MoleculeConfig, MoleculeTask
from geoattn.tasks.nbody.simulator import random_orthogonal

pytest.importorskip("tblite", reason="the 'molecules' extra (tblite, ase, rdkit) is not installed")

# water, 10 MD steps after no equilibration: 5 frames two steps apart (well under a second)
WATER = {"name": "water", "frames": 5, "stride": 2, "equilibration": 0}
SIZES = ModelSizes(n_layer=2, n_head=2, n_embd=64)


@pytest.fixture(scope="module")
def water_file(tmp_path_factory):
    settings = TrajectorySettings(**{**WATER, "frames": 12})
    return save_trajectory(
        build_trajectory(settings, progress=False), tmp_path_factory.mktemp("mol") / "w.npz"
    )


@pytest.fixture(scope="module")
def water(water_file):
    return MoleculeTask(MoleculeConfig(name="water", data=str(water_file), n_train=6, n_val=3))


def test_builder_file_loads_back_bit_identically_and_is_reproducible(tmp_path):
    settings = TrajectorySettings(**WATER)
    first = build_trajectory(settings, progress=False)
    path = save_trajectory(first, tmp_path / "water.npz")
    loaded = load_trajectory(path)
    for key in ("atomic_numbers", "positions", "energies", "forces"):
        a, b = getattr(first, key), getattr(loaded, key)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), key
    assert loaded.settings["name"] == "water" and loaded.settings["stride"] == 2
    assert list(loaded.atomic_numbers) == [8, 1, 1] and loaded.positions.shape == (5, 3, 3)
    again = save_trajectory(build_trajectory(settings, progress=False), tmp_path / "again.npz")
    assert again.read_bytes() == path.read_bytes()  # a fixed seed gives the same file
    # frames are distinct configurations with GFN2-xTB-sized forces (eV/Å), not a frozen molecule
    assert np.abs(np.diff(loaded.positions, axis=0)).max() > 1e-3
    assert 0.01 < np.abs(loaded.forces).max() < 50


def _model(task: MoleculeTask) -> torch.nn.Module:
    torch.manual_seed(0)
    return task._build("rotor", SIZES, {})


def test_forces_are_the_negative_energy_gradient(water):
    model = _model(water).double().eval()
    x, _ = water.split("val", torch.float64)
    numbers, positions = x[:2, :, 0], x[:2, :, 1:]
    _, forces = model.energy_and_forces(numbers, positions, create_graph=False)
    h = 1e-5
    for atom, axis in [(0, 0), (1, 2), (2, 1)]:
        step = torch.zeros_like(positions)
        step[:, atom, axis] = h
        e_plus = model.energy(numbers, positions + step)
        e_minus = model.energy(numbers, positions - step)
        numeric = -(e_plus - e_minus) / (2 * h)
        # central differences: O(h²) truncation plus the kernels' ~1e-12 eV rounding over 2h (~2e-7 here)
        torch.testing.assert_close(forces[:, atom, axis], numeric, rtol=1e-5, atol=1e-6)


def test_force_loss_gradients_are_the_same_with_the_native_kernels_off(water, monkeypatch):
    """Training takes a derivative of the forces (the force loss's parameter gradients: a second
    derivative of the energy), through every native kernel the rotor model runs on the CPU (its q, k, v
    per head group, the grade norm, the geometric MLP's products), whose own backwards are first
    derivatives only: each must hand a second derivative to its torch form. The same gradients with
    the kernels switched off, in float64."""
    from geoattn.algebra import kernels
    from geoattn.attention.rotor import qkv as rotor_qkv
    from geoattn.layers import multivector

    model = _model(water).double().train()
    x, _ = water.split("val", torch.float64)
    numbers, positions = x[:2, :, 0], x[:2, :, 1:]

    def grads():
        energy, forces = model.energy_and_forces(numbers, positions, create_graph=True)
        loss = forces.pow(2).sum() + energy.pow(2).sum()
        return torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)

    native = grads()
    monkeypatch.setattr(rotor_qkv, "_native_ok", lambda *args: False)
    monkeypatch.setattr(multivector.GradeLayerNorm, "forward", lambda self, x: self.reference(x, self.gain))
    with kernels.compiled_instead():
        torch_only = grads()
    assert sum(g is not None for g in native) > 10
    for g, g_ref in zip(native, torch_only):
        if g_ref is None:
            assert g is None
            continue
        # float64 rounding of the kernels' forward values, carried through a second derivative: ~1e-12 of
        # each gradient's scale (the bug this guards against read 0.69 of it)
        scale = g_ref.abs().max().item()
        torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-10 * scale)


def test_environment_over_unordered_pairs_equals_the_sum_over_every_ordered_pair():
    """The environment sums each unordered pair once, for both atoms; the dense form over all N² ordered
    pairs (written here from the docstring's equations) must give the same scalars, vectors and every
    parameter gradient of a force loss (the double backward training runs), in float64."""
    from geoattn.tasks.molecule.models import AtomEnvironment, bessel_basis

    torch.manual_seed(0)
    env = AtomEnvironment(n_types=3, scalars=8, vectors=2, cutoff=2.5, n_rbf=4, interactions=2).double()
    positions = 1.2 * torch.randn(3, 7, 3, dtype=torch.float64)  # some pairs beyond the cut-off
    types = torch.randint(0, 3, (3, 7))

    def dense(x):
        rel = x[:, None, :, :] - x[:, :, None, :]  # r_ij = x_j − x_i
        off = ~torch.eye(x.shape[1], dtype=torch.bool)
        dist = torch.sqrt((rel * rel).sum(-1) + (~off).double())
        basis, envelope = bessel_basis(dist, env.cutoff, env.n_rbf)
        envelope = envelope * off[..., None].double()
        h = env.embed(types).double()
        for filt, inp, update in zip(env.filters, env.inputs, env.updates):
            h = h + update(torch.einsum("bijs,bjs->bis", filt(basis, envelope), inp(h)))
        u = env.vector_filter(basis, envelope)
        return h, torch.einsum("bijv,bjv,bijx->bivx", u, env.vector_gate(h), rel)

    def force_loss(fn):
        x = positions.clone().requires_grad_(True)
        h, v = fn(x)
        energy = h.pow(2).sum() + (v * v).sum().sqrt()
        (force,) = torch.autograd.grad(energy, x, create_graph=True)
        loss = force.pow(2).sum()
        return h, v, torch.autograd.grad(loss, list(env.parameters()), allow_unused=True)

    h, v, grads = force_loss(lambda x: env(x, types))
    h_ref, v_ref, grads_ref = force_loss(dense)
    assert (positions[:, :, None] - positions[:, None]).norm(dim=-1).max() > env.cutoff
    torch.testing.assert_close(h, h_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(v, v_ref, rtol=1e-12, atol=1e-12)
    assert v.abs().max() > 1e-2
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-12)


def test_energy_invariant_and_forces_equivariant_under_e3(water):
    model = _model(water).double().eval()
    x, _ = water.split("val", torch.float64)
    generator = torch.Generator().manual_seed(1)
    q = random_orthogonal(x.shape[0], generator)  # rotations, half of them with a reflection
    assert (torch.linalg.det(q) < 0).any() and (torch.linalg.det(q) > 0).any()
    shift = 3.0 * torch.randn(x.shape[0], 1, 3, generator=generator, dtype=torch.float64)
    moved = x.clone()
    moved[..., 1:] = torch.einsum("bij,bnj->bni", q, x[..., 1:]) + shift
    out, _ = model(x)
    out_moved, _ = model(moved)
    assert (out_moved[..., 0] - out[..., 0]).abs().max() <= 1e-8
    rotated_forces = torch.einsum("bij,bnj->bni", q, out[..., 1:])
    assert (out_moved[..., 1:] - rotated_forces).abs().max() <= 1e-8
    assert out[..., 1:].abs().max() > 1e-3  # the test is not passed by zero forces


def test_training_lowers_the_force_error(water):
    """40 Adam steps on the training frames cut the force error by 30 %. (At lr 3e-3 the error
    oscillated, and where it stood after step 40 depended on the thread count's rounding.)"""
    model = _model(water)
    x, y = water.split("train")
    before = water.evaluate_split(model, "train")["force_mae_mev"]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    for _ in range(40):
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = water.evaluate_split(model, "train")["force_mae_mev"]
    assert after < 0.7 * before, (before, after)


def test_batches_and_metrics(water):
    x, y = water.get_batch("train", 4, torch.Generator().manual_seed(0))
    assert x.shape == (4, 3, 4) and y.shape == (4, 3, 4) and x.dtype == torch.float32
    assert x[0, :, 0].tolist() == [8.0, 1.0, 1.0]
    assert (y[:, :, 0] == y[:, :1, 0]).all()  # the energy is repeated on every atom
    y = y.double()  # float32 energies (~137 eV) would round the 1 meV offset
    metrics = water.metrics(y + 0.001, y)
    assert metrics["energy_mae_mev"] == pytest.approx(1.0, rel=1e-3)
    assert metrics["force_mae_mev"] == pytest.approx(1.0, rel=1e-3)
    assert len(water.indices["test"]) == 3


def test_missing_extra_is_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "tblite", None)  # `import tblite` now raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'geoattn\[molecules\]'"):
        require("tblite")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["data", "make", "molecule", "--name", "water", "--frames", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "geoattn[molecules]" in err and "Traceback" not in err


def test_bench_trains_the_rotor_and_schnet_on_the_same_split(water_file, tmp_path, capsys, monkeypatch):
    """The bench's own pipeline end to end (MACE's is the same export + evaluation; its CLI start-up
    alone is too slow for the suite, so it runs in the bench, not here), leaving nothing in the working
    directory."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    argv = [
        "bench",
        "molecule",
        "--name",
        "water",
        "--data",
        str(water_file),
        "--n-train",
        "6",
        "--n-val",
        "3",
    ]
    argv += [
        "--epochs",
        "rotor=1",
        "schnet=2",
        "--models",
        "rotor",
        "schnet",
        "--out",
        str(tmp_path),
        "--json",
        str(tmp_path / "r.json"),
    ]
    argv += ["--rotor-set", "n_layer=1", "n_embd=32", "warmup_iters=0"]
    assert main(argv) == 0
    rows = json.loads((tmp_path / "r.json").read_text())
    assert [(r["model"], r["epochs"]) for r in rows] == [("rotor", 1), ("schnet", 2)]
    for row in rows:
        values = [row[f"{s}_{k}_mae_mev"] for s in ("val", "test") for k in ("energy", "force")]
        assert all(np.isfinite(v) and v > 0 for v in values), row
    assert "| rotor " in capsys.readouterr().out
    # the rotor trained with the task's recipe under the user's --rotor-set
    train = json.loads((tmp_path / "rotor" / "config.json").read_text())["train"]
    got = (train["lr"], train["model_options"], train["n_embd"], train["n_layer"])
    assert got == (1e-2, {"scalars": 64}, 32, 1)
    assert list(cwd.iterdir()) == []  # (SchNetPack's split lock file went to --out)


def test_bench_epochs_one_for_all_or_one_per_model():
    assert model_epochs(["3"], ["rotor", "mace"]) == {"rotor": 3, "mace": 3}
    assert model_epochs(["rotor=40", "schnet=25"], ["rotor", "schnet"]) == {"rotor": 40, "schnet": 25}
    for bad, message in (
        (["rotor=0"], "N ≥ 1"),
        (["rotor=x"], "N ≥ 1"),
        (["gatr=3"], "model 'gatr'"),
        (["rotor=3"], "no number for schnet"),
    ):
        with pytest.raises(ConfigError, match=message):
            model_epochs(bad, ["rotor", "schnet"])


def test_mace_recipe_stage_two_and_training_wall_from_its_log(tmp_path):
    runners = peers()  # benchmarks/molecule_peers.py of this checkout
    mace_stage_two, mace_training_wall = runners.mace_stage_two, runners.mace_training_wall
    assert [mace_stage_two(e) for e in (1, 4, 5, 12, 40)] == [0, 0, 1, 2, 8]
    log = tmp_path / "train.log"
    log.write_text(
        "2026-12-01 14:22:10.500 INFO: MACE version: 0.3.16\n"
        "2026-12-01 14:22:41.931 INFO: Started training, reporting errors on validation set\n"
        "2026-12-01 14:30:00.000 INFO: Epoch 0: head: Default, loss=0.79\n"
        "2026-12-01 14:32:42.431 INFO: Training complete\n"
    )
    assert mace_training_wall(log) == pytest.approx(600.5)
    log.write_text("2026-12-01 14:22:10.500 INFO: MACE version: 0.3.16\n")
    with pytest.raises(RuntimeError, match="no training start"):
        mace_training_wall(log)


def test_the_peers_runners_live_outside_the_package(water_file, tmp_path, capsys, monkeypatch):
    """MACE's and SchNet's runners are in the checkout's benchmarks/, not in the installed package;
    without them the bench says so in one line (exit 2) before training anything."""
    import geoattn
    import geoattn.bench.molecule as bench

    package = Path(geoattn.__file__).parent
    assert not any("schnetpack" in f.read_text() for f in package.rglob("*.py"))
    assert {"run_mace", "run_schnet"} <= set(vars(peers()))
    monkeypatch.setattr(bench, "PEERS_FILE", tmp_path / "benchmarks" / "molecule_peers.py")
    argv = ["bench", "molecule", "--name", "water", "--data", str(water_file), "--n-train", "6"]
    argv += ["--n-val", "3", "--models", "rotor", "schnet", "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "molecule_peers.py" in err and "--models rotor" in err
    assert not (tmp_path / "out").exists()


def test_bench_rotor_set_cannot_change_the_schedule_or_split(water_file, tmp_path, capsys):
    for fixed in ("seed=3", "task.n_train=4"):
        argv = ["bench", "molecule", "--name", "water", "--data", str(water_file), "--n-train", "6"]
        argv += ["--n-val", "3", "--models", "rotor", "--out", str(tmp_path), "--rotor-set", fixed]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and fixed.partition("=")[0] in err


def test_the_md_runs_on_one_openmp_thread_and_restores_the_count():
    import ctypes

    gomp = ctypes.CDLL("libgomp.so.1")
    gomp.omp_set_num_threads(2)
    with one_openmp_thread():
        assert gomp.omp_get_max_threads() == 1
    assert gomp.omp_get_max_threads() == 2


def test_mean_predictor_baseline_is_the_training_mean_and_zero_forces(water):
    _, y = water.split("test", torch.float64)
    mean = float(water.trajectory.energies[water.indices["train"]].mean())
    expected_energy = (y[:, 0, 0] - mean).abs().mean() * 1000
    expected_forces = y[..., 1:].abs().mean() * 1000
    baseline = water.baselines("test")
    assert baseline["energy_mae_mev"] == pytest.approx(float(expected_energy), rel=1e-9)
    assert baseline["force_mae_mev"] == pytest.approx(float(expected_forces), rel=1e-9)
    assert baseline["force_mae_mev"] > 0  # water's forces are not all zero, so the check can fail
    final = water.final_metrics(_model(water), torch.device("cpu"))
    assert final["test_baseline_energy_mae_mev"] == baseline["energy_mae_mev"]
    assert {"val_energy_mae_mev", "val_baseline_force_mae_mev", "test_force_mae_mev"} <= final.keys()
    with pytest.raises(ValueError, match="split 'nope'"):
        water.baselines("nope")


def test_peer_command_writes_metrics_with_the_grid_lr_and_the_baseline(water_file, tmp_path):
    """`benchmarks/molecule_peers.py` as an experiment's peer cell: SchNet at the given rate writes
    metrics.json with the MAEs and the mean predictor's beside them, read at its best validation epoch
    (as SchNetPack's spktrain tests); a second run refuses to overwrite."""
    runners = peers()
    out = tmp_path / "run"
    argv = ["--model", "schnet", "--data", str(water_file), "--out", str(out), "--epochs", "3"]
    argv += ["--lr", "3e-3", "--n-train", "6", "--n-val", "3", "--schnet-width", "16"]
    assert runners.main(argv) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["lr"] == 3e-3 and metrics["epochs"] == 3
    (kept,) = (out / "schnet" / "checkpoints").glob("*.ckpt")  # one: the lowest validation loss's
    assert torch.load(kept, weights_only=False)["epoch"] + 1 == metrics["best_epoch"] in (1, 2, 3)
    for key in ("val_force_mae_mev", "test_energy_mae_mev", "val_baseline_energy_mae_mev"):
        assert np.isfinite(metrics[key]) and metrics[key] > 0, key
    assert runners.main(argv) == 2  # metrics.json exists: nothing overwritten


def test_peer_command_missing_data_is_one_line(tmp_path, capsys):
    runners = peers()
    argv = ["--model", "mace", "--data", str(tmp_path / "none.npz"), "--out", str(tmp_path), "--epochs", "1"]
    assert runners.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "none.npz" in err
