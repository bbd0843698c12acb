"""The molecule task's files: extended XYZ (written by ASE), revised MD17's and sGDML's .npz (written by
NumPy in their own layouts and units), revised MD17's split files; each read back against the values
written, converted with ASE's constants; every malformed file refused in one line; each format trained
end to end through `geoattn train` and `geoattn experiment`; the peers' runners fed the same frames."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from geoattn.bench.molecule import peers
from geoattn.cli import main
from geoattn.core.errors import ConfigError, DataError
from geoattn.tasks.molecule.files import Keys, read_molecule_file
from geoattn.tasks.molecule.task import MoleculeConfig, MoleculeTask
from geoattn.training.recipes import build_config

ase = pytest.importorskip("ase", reason="the 'molecules' extra (ase) is not installed")
ase_io = pytest.importorskip("ase.io")
units = pytest.importorskip("ase.units")
SinglePointCalculator = pytest.importorskip("ase.calculators.singlepoint").SinglePointCalculator

FRAMES = 12
WATER = np.array([[0.0, 0.0, 0.0], [0.96, 0.0, 0.0], [-0.24, 0.93, 0.0]])  # Å
NUMBERS = np.array([8, 1, 1])
KCAL_MOL_IN_EV = 0.0433641  # the brief's constant, to 6 digits: ASE's units must agree with it
# tiny runs: 6 train, 3 val, 3 test frames of a 3-atom molecule, one small rotor block
TINY = ["--model", "rotor", "--max-iters", "3", "--eval-interval", "3", "--eval-iters", "1", "--n-layer", "1"]
TINY += ["--n-head", "2", "--n-embd", "16", "--batch-size", "2", "--no-plots", "--set", "model.scalars=8"]
SPLIT = {"n_train": 6, "n_val": 3}


def water_frames(seed: int = 0, frames: int = FRAMES) -> dict[str, np.ndarray]:
    """Positions (F, 3, 3) Å, energies (F,) and forces (F, 3, 3) in whatever unit the caller says."""
    rng = np.random.default_rng(seed)
    return {
        "positions": WATER + 0.05 * rng.standard_normal((frames, 3, 3)),
        "energies": -9.0 + 0.2 * rng.standard_normal(frames),
        "forces": rng.standard_normal((frames, 3, 3)),
    }


def write_extxyz(path: Path, arrays: dict[str, np.ndarray], *, ref_keys: bool = False) -> Path:
    """ASE's extxyz writer: labels on a SinglePointCalculator (energy=, forces), or MACE's REF_ keys."""
    frames = []
    for p, e, f in zip(arrays["positions"], arrays["energies"], arrays["forces"]):
        atoms = ase.Atoms(numbers=NUMBERS, positions=p)
        if ref_keys:
            atoms.info["REF_energy"] = float(e)
            atoms.arrays["REF_forces"] = f.copy()
        else:
            atoms.calc = SinglePointCalculator(atoms, energy=float(e), forces=f)
        frames.append(atoms)
    ase_io.write(path, frames, format="extxyz")
    return path


def write_rmd17(path: Path, arrays: dict[str, np.ndarray], **replace) -> Path:
    """revised MD17's keys (kcal/mol, kcal/mol/Å, Å), as its files hold them."""
    keys = {
        "nuclear_charges": NUMBERS,
        "coords": arrays["positions"],
        "energies": arrays["energies"],
        "forces": arrays["forces"],
        "old_indices": np.arange(len(arrays["energies"])),
    }
    np.savez(path, **{k: v for k, v in {**keys, **replace}.items() if v is not None})
    return path


def write_sgdml(path: Path, arrays: dict[str, np.ndarray], **extra) -> Path:
    """sGDML's keys: ``E`` (F, 1), unit strings when given."""
    np.savez(
        path,
        type="d",
        name="water",
        theory="test",
        z=NUMBERS,
        R=arrays["positions"],
        E=arrays["energies"][:, None],
        F=arrays["forces"],
        **extra,
    )
    return path


@pytest.fixture
def files(tmp_path) -> dict[str, tuple[Path, dict]]:
    """One file per format and what it holds (in its own units)."""
    arrays = water_frames()
    return {
        "extxyz": (write_extxyz(tmp_path / "water.xyz", arrays), arrays),
        "rmd17": (write_rmd17(tmp_path / "rmd17_water.npz", arrays), arrays),
        "sgdml": (write_sgdml(tmp_path / "md17_water.npz", arrays), arrays),
    }


def test_ase_units_are_the_kcal_per_mol_of_md17():
    assert units.kcal / units.mol == pytest.approx(KCAL_MOL_IN_EV, rel=1e-5)


def test_extxyz_reads_calculator_labels_as_ase_reads_them(files):
    path, _ = files["extxyz"]
    t = read_molecule_file(path)
    frames = ase_io.read(path, index=":")
    np.testing.assert_array_equal(t.atomic_numbers, NUMBERS)
    np.testing.assert_array_equal(t.positions, np.stack([a.positions for a in frames]))
    np.testing.assert_array_equal(t.energies, [a.get_potential_energy() for a in frames])
    np.testing.assert_array_equal(t.forces, np.stack([a.get_forces() for a in frames]))
    assert t.settings["format"] == "extxyz" and len(t.settings["sha256"]) == 64


def test_extxyz_reads_info_and_arrays_labels_under_the_keys_set(tmp_path):
    arrays = water_frames(1)
    path = write_extxyz(tmp_path / "ref.extxyz", arrays, ref_keys=True)
    t = read_molecule_file(path, Keys(energy="REF_energy", forces="REF_forces"))
    np.testing.assert_allclose(t.energies, arrays["energies"], rtol=1e-12)
    np.testing.assert_allclose(t.forces, arrays["forces"], rtol=1e-7, atol=1e-7)  # extxyz's 8 decimals
    with pytest.raises(
        DataError, match=r"ref\.extxyz: frame 0 has no energy 'energy' .*REF_energy.*task\.energy_key"
    ):
        read_molecule_file(path)


def test_rmd17_is_converted_from_kcal_per_mol(files):
    path, arrays = files["rmd17"]
    t = read_molecule_file(path)
    np.testing.assert_allclose(t.energies, arrays["energies"] * KCAL_MOL_IN_EV, rtol=1e-5)
    np.testing.assert_allclose(t.forces, arrays["forces"] * KCAL_MOL_IN_EV, rtol=1e-5)
    np.testing.assert_array_equal(t.positions, arrays["positions"])
    assert t.settings["format"] == "rmd17" and "kcal/mol" in t.settings["units"]
    assert "ase.units.kcal / ase.units.mol" in t.settings["conversion"]


def test_sgdml_honours_its_unit_fields(tmp_path, files):
    path, arrays = files["sgdml"]
    t = read_molecule_file(path)  # no unit fields: kcal/mol and Å
    np.testing.assert_allclose(t.energies, arrays["energies"] * KCAL_MOL_IN_EV, rtol=1e-5)
    assert t.name == "water"
    bohr = write_sgdml(tmp_path / "bohr.npz", arrays, e_unit="eV", r_unit="bohr")
    t = read_molecule_file(bohr)
    np.testing.assert_allclose(t.positions, arrays["positions"] * 0.529177, rtol=1e-5)
    np.testing.assert_allclose(t.energies, arrays["energies"], rtol=1e-12)
    np.testing.assert_allclose(t.forces, arrays["forces"] / 0.529177, rtol=1e-5)  # eV/bohr → eV/Å
    bad = write_sgdml(tmp_path / "furlong.npz", arrays, e_unit="kcal/mol", r_unit="furlong")
    with pytest.raises(DataError, match=r"furlong\.npz: unknown r_unit 'furlong'"):
        read_molecule_file(bad)


def _truncated(path: Path) -> Path:
    text = path.read_text()
    path.write_text(text[: len(text) - 40])
    return path


def _different_atoms(path: Path) -> Path:
    frames = [ase.Atoms("OH2", positions=WATER), ase.Atoms("H2O", positions=WATER)]
    for atoms in frames:
        atoms.calc = SinglePointCalculator(atoms, energy=-1.0, forces=np.zeros((3, 3)))
    ase_io.write(path, frames, format="extxyz")
    return path


def _periodic(path: Path) -> Path:
    atoms = ase.Atoms("OH2", positions=WATER, cell=[5, 5, 5], pbc=True)
    atoms.calc = SinglePointCalculator(atoms, energy=-1.0, forces=np.zeros((3, 3)))
    ase_io.write(path, [atoms], format="extxyz")
    return path


def _npz(path: Path, **arrays) -> Path:
    np.savez(path, **arrays)
    return path


def _text(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def _nan_at_4(values: np.ndarray) -> np.ndarray:
    return np.where(np.arange(FRAMES) == 4, np.nan, values)


BROKEN = {  # name -> (write the broken file into tmp_path d from arrays a, what the one-line error says)
    "truncated extxyz": (
        lambda d, a: _truncated(write_extxyz(d / "w.xyz", a)),
        r"w\.xyz is not a readable extended XYZ",
    ),
    "extxyz frames with different atoms": (
        lambda d, a: _different_atoms(d / "w.xyz"),
        r"frame 1 has atoms H2O",
    ),
    "periodic extxyz": (lambda d, a: _periodic(d / "w.xyz"), r"w\.xyz: frame 0 is periodic"),
    "empty extxyz": (lambda d, a: _text(d / "w.xyz", ""), r"w\.xyz holds no frames"),
    "npz missing forces": (
        lambda d, a: write_rmd17(d / "r.npz", a, forces=None),
        r"r\.npz looks like revised MD17 but has no 'forces'",
    ),
    "coords (N, A, 2)": (
        lambda d, a: write_rmd17(d / "r.npz", a, coords=a["positions"][..., :2]),
        r"r\.npz: coords have shape \(12, 3, 2\)",
    ),
    "NaN energies": (
        lambda d, a: write_rmd17(d / "r.npz", a, energies=_nan_at_4(a["energies"])),
        r"r\.npz: energies of 1 frame\(s\) are NaN .*frame 4",
    ),
    "energies that are not numbers": (
        lambda d, a: write_rmd17(d / "r.npz", a, energies=np.array(["high"] * FRAMES)),
        r"r\.npz: energies are not numbers",
    ),
    "unknown element": (
        lambda d, a: write_rmd17(d / "r.npz", a, nuclear_charges=np.array([8, 1, 0])),
        r"nuclear_charges must be 1\.\.118",
    ),
    "sGDML missing E": (
        lambda d, a: _npz(d / "s.npz", z=NUMBERS, R=a["positions"], F=a["forces"]),
        r"s\.npz looks like sGDML.* has no 'E'",
    ),
    "npz of unknown keys": (
        lambda d, a: _npz(d / "u.npz", x=np.zeros(3)),
        r"u\.npz has keys x; expected one of",
    ),
    "truncated npz": (
        lambda d, a: _text(d / "t.npz", write_rmd17(d / "r.npz", a).read_bytes()[:200]),
        r"t\.npz is not a readable \.npz",
    ),
    "unknown suffix": (
        lambda d, a: _text(d / "w.csv", "1,2\n"),
        r"w\.csv: the molecule task reads \.extxyz, \.npz, \.xyz files",
    ),
    "missing file": (lambda d, a: d / "none.npz", r"none\.npz does not exist"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_file_is_one_data_error_naming_it(tmp_path, case):
    write, message = BROKEN[case]
    path = write(tmp_path, water_frames())
    with pytest.raises(DataError, match=message) as info:
        MoleculeTask(MoleculeConfig(data=str(path), **SPLIT))
    assert len(str(info.value).splitlines()) == 1


# ---------------------------------------------------------------------------------- splits ----
def write_index(path: Path, indices) -> Path:
    path.write_text("".join(f"{i}\n" for i in indices))
    return path


def test_revised_md17_split_files(tmp_path, files):
    path, _ = files["rmd17"]
    splits = tmp_path / "splits"
    splits.mkdir()
    write_index(splits / "index_train_02.csv", [0, 2, 3, 5, 7, 8, 11])
    write_index(splits / "index_test_02.csv", [1, 4, 10])
    config = MoleculeConfig(data=str(path), splits_dir=str(splits), split_index=2, n_val=2)
    task = MoleculeTask(config)
    assert task.indices["test"].tolist() == [1, 4, 10]
    assert len(task.indices["val"]) == 2 and len(task.indices["train"]) == 5
    assert sorted(task.indices["train"].tolist() + task.indices["val"].tolist()) == [0, 2, 3, 5, 7, 8, 11]
    # frames 6 and 9 are in no file: never read
    x, _ = task.split("test", torch.float64)
    np.testing.assert_array_equal(x[..., 1:].numpy(), task.trajectory.positions[[1, 4, 10]])
    assert MoleculeTask(config).indices["val"].tolist() == task.indices["val"].tolist()  # seeded


SPLIT_ERRORS = {  # train file, test file, settings -> the error
    "past the end": ([0, 1, 2, 12], [5], {}, r"index_train_01\.csv: index 12 is outside .*12 frames"),
    "empty file": ([], [5], {}, r"index_train_01\.csv lists no frames"),
    "not an integer": ([0, "x"], [5], {}, r"line 2 is 'x', not a frame index"),
    "train and test share": ([0, 1, 2, 5], [5], {}, r"share 1 frame"),
    "val leaves no train": ([0, 1], [5], {"n_val": 2}, r"leaves none to train on"),
    "n_train beyond the file": ([0, 1, 2], [5], {"n_train": 5, "n_val": 1}, r"fewer than n_train=5"),
}


@pytest.mark.parametrize("case", SPLIT_ERRORS)
def test_a_bad_split_file_is_one_data_error(tmp_path, files, case):
    train, test, settings, message = SPLIT_ERRORS[case]
    write_index(tmp_path / "index_train_01.csv", train)
    write_index(tmp_path / "index_test_01.csv", test)
    config = MoleculeConfig(data=str(files["rmd17"][0]), splits_dir=str(tmp_path), **settings)
    with pytest.raises(DataError, match=message):
        MoleculeTask(config)


def test_empty_split_and_settings_that_would_be_ignored_are_refused(files):
    with pytest.raises(DataError, match="leave no test frames"):
        MoleculeTask(MoleculeConfig(data=str(files["rmd17"][0]), n_train=8, n_val=4))
    with pytest.raises(ConfigError, match="energy_key .* rmd17 .npz"):
        MoleculeTask(MoleculeConfig(data=str(files["rmd17"][0]), energy_key="REF_energy", **SPLIT))
    with pytest.raises(ConfigError, match="set task.splits_dir too"):
        MoleculeConfig(split_index=3)


# ------------------------------------------------------------------------ table and sealed sets ----
def test_the_model_table_and_its_recipe():
    from geoattn.models.rotor_transformer import RotorTransformerConfig

    assert list(MoleculeTask.models) == ["rotor"]
    assert MoleculeTask.model_settings("rotor") == (RotorTransformerConfig, MoleculeTask.row("rotor").fixed)
    config = build_config({"task": "molecule", "model": "rotor"}, {"lr": 3e-3})
    assert (config.lr, config.batch_size, config.model_options) == (3e-3, 10, {"scalars": 64})
    with pytest.raises(ConfigError, match="supports models rotor, not 'egnn'"):
        MoleculeTask.row("egnn")


def test_a_sealed_test_set_is_never_measured(files, monkeypatch):
    task = MoleculeTask(MoleculeConfig(data=str(files["extxyz"][0]), **SPLIT))
    model = task.build_model("rotor", build_config({"task": "molecule", "model": "rotor"}).sizes, {})
    task.sealed = frozenset(task.test_sets)
    assert task.test_sets == ("test",)
    real = task._split_tensors
    monkeypatch.setattr(
        task, "_split_tensors", lambda s: real(s) if s != "test" else pytest.fail("read test")
    )
    final = task.final_metrics(model, torch.device("cpu"))
    assert final and not any(k.startswith("test") for k in final)
    assert task.baselines("test") == {}
    rows = task.evaluation(model, torch.device("cpu"), lambda: {}, over="none")
    assert rows and not any("test" in r.metric for r in rows)
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="test set is sealed"):
        task.get_batch("test", 2, torch.Generator())


# ---------------------------------------------------------------------------- end to end ----
def cli_run(data: Path, out: Path, *extra: str) -> int:
    argv = ["train", "--task", "molecule", "--data", str(data), *TINY, "--out", str(out)]
    argv += ["--set", "task.n_train=6", "--set", "task.n_val=3", *extra]
    return main(argv)


@pytest.mark.parametrize("kind", ["extxyz", "rmd17", "sgdml"])
def test_each_format_trains_through_geoattn_train(files, tmp_path, kind, capsys):
    path, _ = files[kind]
    assert cli_run(path, tmp_path / "run") == 0
    task = json.loads((tmp_path / "run" / "config.json").read_text())["task"]
    assert task["data"]["format"] == kind and task["data"]["file"] == str(path)
    assert task["split"] == {"train": 6, "val": 3, "test": 3}
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert np.isfinite(summary["final"]["test_force_mae_mev"])


def test_cli_refuses_a_broken_file_in_one_line_and_writes_nothing(tmp_path, capsys):
    path = write_rmd17(tmp_path / "r.npz", water_frames(), forces=None)
    out = tmp_path / "run"
    assert cli_run(path, out) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "r.npz looks like revised MD17 but has no 'forces'" in err
    assert not out.exists()
    path = write_extxyz(tmp_path / "w.xyz", water_frames())
    assert cli_run(path, out, "--set", "task.energy_key=REF_energy") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no energy 'REF_energy'" in err and not out.exists()


EXPERIMENT = """
description = "each molecule format, a tiny run"
seeds = [1]
metrics = ["val_force_mae_mev"]

[base]
task = "molecule"
max_iters = 2
eval_interval = 2
eval_iters = 1
n_layer = 1
n_head = 2
n_embd = 16
batch_size = 2
plots = false
model_options = {{ scalars = 8 }}
task_options = {{ n_train = 6, n_val = 3{extra} }}

[[cells]]
name = "rotor"
model = "rotor"
data = "{data}"
"""


@pytest.mark.parametrize("kind", ["extxyz", "rmd17", "sgdml"])
def test_each_format_trains_through_the_experiment_runner(tmp_path, monkeypatch, capsys, kind):
    arrays = water_frames(2)
    if kind == "extxyz":
        path, extra = write_extxyz(tmp_path / "w.xyz", arrays, ref_keys=True), ', energy_key = "REF_energy"'
        extra += ', forces_key = "REF_forces"'
    else:
        path, extra = {"rmd17": write_rmd17, "sgdml": write_sgdml}[kind](tmp_path / f"{kind}.npz", arrays), ""
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "formats.toml").write_text(EXPERIMENT.format(data=path, extra=extra))
    monkeypatch.chdir(tmp_path)
    assert main(["experiment", "formats"]) == 0
    (summary,) = (tmp_path / "runs").rglob("summary.json")
    final = json.loads(summary.read_text())["final"]
    assert np.isfinite(final["val_force_mae_mev"])
    assert not any(key.startswith("test") for key in final)  # an exploratory run: the test set sealed
    (config,) = (tmp_path / "runs").rglob("config.json")
    assert json.loads(config.read_text())["task"]["data"]["format"] == kind


# ------------------------------------------------------------------------------ the peers ----
def test_the_peers_runners_get_the_frames_the_task_reads(tmp_path):
    """The MACE export and SchNet's database rows of an extxyz file with MACE's REF_ keys, through the
    peer command's own task (``--set task.KEY=VALUE``), equal the file's frames at the task's split."""
    runners = peers()
    arrays = water_frames(3)
    path = write_extxyz(tmp_path / "w.xyz", arrays, ref_keys=True)
    settings = ["task.energy_key=REF_energy", "task.forces_key=REF_forces"]
    task = runners.peer_task(path, 6, 3, settings)
    same = MoleculeTask(
        MoleculeConfig(data=str(path), energy_key="REF_energy", forces_key="REF_forces", **SPLIT)
    )
    assert all(np.array_equal(task.indices[s], same.indices[s]) for s in ("train", "val", "test"))
    source = ase_io.read(path, index=":")
    files = runners.export_splits(task, tmp_path)
    for split, file in files.items():
        exported = ase_io.read(file, index=":")
        picked = [source[i] for i in task.indices[split]]
        assert len(exported) == len(picked) > 0
        for got, want in zip(exported, picked):
            np.testing.assert_array_equal(got.numbers, want.numbers)
            np.testing.assert_allclose(got.positions, want.positions, rtol=0, atol=1e-8)
            assert got.info["REF_energy"] == pytest.approx(want.info["REF_energy"], abs=1e-8)
            np.testing.assert_allclose(got.arrays["REF_forces"], want.arrays["REF_forces"], atol=1e-8)
    properties, atoms = runners.schnet_systems(task)
    assert len(atoms) == len(source)
    for props, got, want in zip(properties, atoms, source):
        np.testing.assert_array_equal(got.positions, want.positions)
        assert props["energy"].tolist() == [want.info["REF_energy"]]
        np.testing.assert_array_equal(props["forces"], want.arrays["REF_forces"])
    with pytest.raises(ConfigError, match="task.KEY=VALUE only"):
        runners.peer_task(path, 6, 3, ["lr=1e-3"])
