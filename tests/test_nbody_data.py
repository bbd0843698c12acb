"""`--task nbody --data DIR`: GATr's ``.npz`` sets and EGNN's ``.npy`` arrays, told apart by the files in
the folder (no ``task.system`` needed), read or refused in one line naming the file. Fixtures are written
here by NumPy itself (``np.savez``, ``np.save``) in each peer's layout, tiny."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from geoattn.cli import main
from geoattn.core.errors import DataError
from geoattn.models.base import ModelSizes
from geoattn.tasks.nbody import NBodyConfig, NBodyTask
from geoattn.tasks.nbody import charged as C

GATR_SETS = {"train": 8, "val": 4, "eval": 4, "e3_generalization": 4, "object_generalization": 4}
EGNN_SETS = {"train": 6, "val": 3, "test": 3}
TINY = "--n-layer 1 --n-head 2 --n-embd 16 --batch-size 4 --eval-iters 1 --no-plots".split()
STEPS = "--max-iters 2 --eval-interval 2".split()


def write_gatr(directory: Path, *, seed: int = 0, **override: dict[str, np.ndarray]) -> Path:
    """GATr's five ``{set}.npz`` (m ``(S, n)``, x_initial, v_initial, x_final ``(S, n, 3)``; 4 bodies, 6 in
    the object set; val with its trajectories); ``override[set]`` replaces arrays of that set."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for name, count in GATR_SETS.items():
        bodies = 6 if name == "object_generalization" else 4
        x = rng.normal(size=(count, bodies, 3))
        v = rng.normal(size=(count, bodies, 3))
        arrays = {"m": rng.uniform(0.01, 1.0, (count, bodies)), "x_initial": x, "v_initial": v}
        arrays["x_final"] = x + 0.1 * v
        if name == "val":
            arrays["trajectories"] = np.stack((x, arrays["x_final"]), axis=2)
        arrays.update(override.get(name, {}))
        np.savez(directory / f"{name}.npz", **arrays)
    return directory


def write_egnn(directory: Path, *, frames: int = 42, particles: int = 5, seed: int = 0, **override) -> Path:
    """EGNN's twelve ``.npy`` files as its generate_dataset.py names and shapes them (loc, vel
    ``(S, frames, 3, n)``, edges ``(S, n, n)``, charges ``(S, n, 1)``); ``override[set]`` replaces arrays."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for name, count in EGNN_SETS.items():
        charges = rng.choice([-1.0, 1.0], size=(count, particles, 1))
        arrays = {
            "loc": rng.normal(size=(count, frames, 3, particles)),
            "vel": rng.normal(size=(count, frames, 3, particles)),
            "edges": charges @ charges.transpose(0, 2, 1),
            "charges": charges,
        }
        arrays.update(override.get(name, {}))
        tag = C.FILE_TAGS[name]
        for array, values in arrays.items():
            np.save(directory / f"{array}_{tag}_charged{particles}_initvel1small.npy", values)
    return directory


def train(data: Path, out: Path, *flags: str) -> int:
    return main(["train", "--task", "nbody", *TINY, *STEPS, "--data", str(data), "--out", str(out), *flags])


# ------------------------------------------------------------------------------ told by the files ---
def test_the_folder_says_which_system(tmp_path):
    gatr = NBodyTask(NBodyConfig(data=str(write_gatr(tmp_path / "gatr"))))
    egnn = NBodyTask(NBodyConfig(data=str(write_egnn(tmp_path / "egnn"))))
    assert (gatr.config.system, gatr.sets[-1], len(gatr.dataset("train"))) == (
        "gravity",
        "object_generalization",
        8,
    )
    assert (egnn.config.system, egnn.sets, len(egnn.dataset("test"))) == (
        "charged",
        ("train", "val", "test"),
        3,
    )
    assert NBodyTask(NBodyConfig(system="charged", data=str(tmp_path / "egnn"))).config.system == "charged"
    assert NBodyTask(NBodyConfig()).config.system == "gravity"  # no files: the simulator's default


def test_a_system_the_folder_contradicts_names_both(tmp_path):
    with pytest.raises(DataError, match="holds EGNN's charged files .*but task.system=gravity reads GATr's"):
        NBodyTask(NBodyConfig(system="gravity", data=str(write_egnn(tmp_path / "egnn"))))
    with pytest.raises(DataError, match="holds GATr's gravity files .*but task.system=charged reads EGNN's"):
        NBodyTask(NBodyConfig(system="charged", data=str(write_gatr(tmp_path / "gatr"))))


def test_a_folder_of_neither_or_both_layouts_is_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("not n-body data")
    with pytest.raises(
        DataError, match="holds neither GATr's gravity files .*task.system=gravity.* nor EGNN's"
    ):
        NBodyTask(NBodyConfig(data=str(tmp_path)))
    write_egnn(write_gatr(tmp_path))
    with pytest.raises(
        DataError, match="holds both GATr's gravity files and EGNN's charged files: set task.system"
    ):
        NBodyTask(NBodyConfig(data=str(tmp_path)))
    assert NBodyTask(NBodyConfig(system="charged", data=str(tmp_path))).config.system == "charged"


def test_egnns_files_for_another_particle_count_name_the_option(tmp_path):
    write_egnn(tmp_path, particles=4)
    with pytest.raises(DataError, match="files for 4 particles .*task.particles=5: set task.particles=4"):
        NBodyTask(NBodyConfig(data=str(tmp_path)))
    assert NBodyTask(NBodyConfig(data=str(tmp_path), particles=4)).bodies == 4


# ------------------------------------------------------------------------------------ bad input ---
def _with_nan(shape: tuple[int, ...], sample: int) -> np.ndarray:
    values = np.zeros(shape)
    values[sample] = np.nan
    return values


def _samples(count: int, bodies: int) -> dict[str, np.ndarray]:
    """A GATr set's four arrays, ``count`` samples of ``bodies`` bodies."""
    vectors = {a: np.zeros((count, bodies, 3)) for a in ("x_initial", "v_initial", "x_final")}
    return {"m": np.ones((count, bodies)), **vectors}


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


GATR_CASES = {
    "truncated": (lambda d: _truncate(d / "val.npz"), r"val\.npz' is not a readable \.npz file"),
    "missing file": (lambda d: (d / "eval.npz").unlink(), r"missing file .*eval\.npz"),
    "misnamed key": (
        lambda d: np.savez(d / "eval.npz", mass=np.ones((4, 4)), x_initial=np.zeros((4, 4, 3))),
        r"eval\.npz' lacks array\(s\) m, v_initial, x_final",
    ),
    "wrong shape": (
        lambda d: write_gatr(d, train={"x_final": np.zeros((8, 4, 2))}),
        r"train\.npz' array x_final has shape \(8, 4, 2\), expected \(8, 4, 3\)",
    ),
    "NaN position": (
        lambda d: write_gatr(d, eval={"x_initial": _with_nan((4, 4, 3), sample=2)}),
        r"eval\.npz' array x_initial holds NaN or infinite values \(sample 2\)",
    ),
    "other bodies": (
        lambda d: write_gatr(d, eval=_samples(4, bodies=5)),
        r"eval\.npz' has 5 bodies per sample, train\.npz 4",
    ),
    "empty split": (
        lambda d: write_gatr(d, e3_generalization=_samples(0, bodies=4)),
        r"e3_generalization\.npz' array m has shape \(0, 4\), expected \(B, n\) with B ≥ 1",
    ),
}  # fmt: skip

EGNN_CASES = {
    "truncated": (
        lambda d: _truncate(d / "loc_valid_charged5_initvel1small.npy"),
        r"loc_valid_charged5_initvel1small\.npy' is not a readable NumPy array file",
    ),
    "missing file": (
        lambda d: (d / "charges_test_charged5_initvel1small.npy").unlink(),
        r"missing file .*charges_test_charged5_initvel1small\.npy",
    ),
    "wrong shape": (
        lambda d: write_egnn(d, train={"edges": np.zeros((6, 5, 4))}),
        r"edges_train_charged5_initvel1small\.npy has shape \(6, 5, 4\), expected \(6, 5, 5\)",
    ),
    "NaN position": (
        lambda d: write_egnn(d, test={"loc": np.full((3, 42, 3, 5), np.nan)}),
        r"loc_test_charged5_initvel1small\.npy' array loc holds NaN or infinite values \(sample 0\)",
    ),
    "other particles": (
        lambda d: write_egnn(d, val={"vel": np.zeros((3, 42, 3, 4))}),
        r"vel_valid_charged5_initvel1small\.npy has shape \(3, 42, 3, 4\), expected \(3, 42, 3, 5\)",
    ),
    "empty split": (
        lambda d: write_egnn(d, val={"loc": np.zeros((0, 42, 3, 5))}),
        r"loc_valid_charged5_initvel1small\.npy holds no trajectories",
    ),
    "too few frames": (
        lambda d: write_egnn(d, frames=20),
        r"loc_train_charged5_initvel1small\.npy' has 20 frames, task.frame_out=40 needs 41",
    ),
}


@pytest.mark.parametrize("case", GATR_CASES)
def test_bad_gatr_files_are_one_line_naming_the_file(tmp_path, case):
    break_it, match = GATR_CASES[case]
    break_it(write_gatr(tmp_path))
    with pytest.raises(DataError, match=match) as error:
        NBodyTask(NBodyConfig(data=str(tmp_path)))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("case", EGNN_CASES)
def test_bad_egnn_files_are_one_line_naming_the_file(tmp_path, case):
    break_it, match = EGNN_CASES[case]
    break_it(write_egnn(tmp_path))
    with pytest.raises(DataError, match=match) as error:
        NBodyTask(NBodyConfig(data=str(tmp_path)))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("layout", "case"), [("gatr", "NaN position"), ("egnn", "truncated"), ("egnn", "contradicted")]
)
def test_the_command_line_refuses_bad_files_in_one_line_and_writes_nothing(tmp_path, capsys, layout, case):
    data = tmp_path / "data"
    flags = []
    if layout == "gatr":
        GATR_CASES[case][0](write_gatr(data))
    elif case == "contradicted":
        write_egnn(data)
        flags = ["--set", "task.system=gravity"]
    else:
        EGNN_CASES[case][0](write_egnn(data))
    out = tmp_path / "run"
    assert train(data, out, "--model", "rotor", *flags) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(data) in err, err
    assert not out.exists()


# ------------------------------------------------------------------------------- end to end --------
@pytest.mark.parametrize("layout", ["gatr", "egnn"])
def test_each_layout_trains_through_the_command_line_without_a_system(tmp_path, capsys, layout):
    data = (write_gatr if layout == "gatr" else write_egnn)(tmp_path / "data")
    out = tmp_path / "run"
    assert train(data, out, "--model", "rotor") == 0
    task = json.loads((out / "config.json").read_text())["task"]
    expected = ("gravity", 8) if layout == "gatr" else ("charged", 6)
    assert (task["source"]["system"], task["sets"]["train"]["samples"]) == expected
    assert np.isfinite(json.loads((out / "summary.json").read_text())["final"]["val_mse_full"])
    capsys.readouterr()


EXPERIMENT = """
description = "the nbody task on {layout}'s files"
seeds = [1]
metrics = ["val_mse_full"]

[base]
task = "nbody"
model = "rotor"
data = "{data}"
max_iters = 2
eval_interval = 2
eval_iters = 1
n_layer = 1
n_head = 2
n_embd = 16
batch_size = 4
plots = false

[[cells]]
name = "rotor"
"""


@pytest.mark.parametrize("layout", ["gatr", "egnn"])
def test_each_layout_runs_through_the_experiment_runner(tmp_path, monkeypatch, capsys, layout):
    data = (write_gatr if layout == "gatr" else write_egnn)(tmp_path / "data")
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "files.toml").write_text(EXPERIMENT.format(layout=layout, data=data))
    monkeypatch.chdir(tmp_path)
    assert main(["experiment", "files"]) == 0
    assert ": done" in capsys.readouterr().out
    (summary,) = (tmp_path / "runs").rglob("summary.json")
    config = json.loads((summary.parent / "config.json").read_text())
    assert config["task"]["source"]["system"] == ("gravity" if layout == "gatr" else "charged")
    assert "rotor" in (tmp_path / "results" / "files.md").read_text()


# ------------------------------------------------------------------------------- sealed sets -------
def _is_test_metric(key: str, test_sets: tuple[str, ...]) -> bool:
    return any(key == s or key.startswith(f"{s}_") for s in test_sets)


@pytest.mark.parametrize(
    ("layout", "test_sets"),
    [("gatr", ("eval", "e3_generalization", "object_generalization")), ("egnn", ("test",))],
)
def test_sealed_test_sets_are_never_read(tmp_path, monkeypatch, layout, test_sets):
    """With its test sets sealed (an exploratory experiment), no metric, baseline, peer row or data
    record of the task reads one: every read of a set goes through ``dataset``, watched here."""
    assert NBodyTask.test_sets == ("eval", "e3_generalization", "object_generalization", "test")
    data = (write_gatr if layout == "gatr" else write_egnn)(tmp_path / "data")
    task = NBodyTask(NBodyConfig(data=str(data)))
    assert task.test_sets == test_sets
    model = task.build_model("egnn", ModelSizes(n_layer=1, n_head=2, n_embd=16))
    cpu = torch.device("cpu")
    predictions = {n: torch.zeros_like(task.dataset(n).x_final) for n in ("val", *test_sets)}
    task.sealed = frozenset(test_sets)
    read = []
    dataset = NBodyTask.dataset
    monkeypatch.setattr(NBodyTask, "dataset", lambda self, name: read.append(name) or dataset(self, name))
    final = task.final_metrics(model, cpu)
    rows = task.evaluation(model, cpu, lambda: {"val_mse": 1.0}, over="1 batch")
    peer = task.prediction_rows(predictions)
    assert task.baselines(test_sets[0]) == {}
    sets = task.meta()["sets"]
    assert read and not set(read) & set(test_sets), read
    keys = [*final, *(r.metric for r in rows), *(r.metric for r in peer), *sets]
    assert [k for k in keys if _is_test_metric(k, test_sets)] == []
    assert "val_mse_full" in final and "equivariance_error" in final and "val_mse_full" in keys
    with pytest.raises(ValueError, match="sealed"):
        dataset(task, test_sets[0])
    task.sealed = frozenset()  # the same calls on an open run do read them
    assert any(_is_test_metric(k, test_sets) for k in task.final_metrics(model, cpu))
