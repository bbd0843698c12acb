"""EGNN's charged-particle benchmark (``task.system = "charged"``) and the EGNN peer model.

``tests/data/egnn_charged`` holds files written by EGNN's own ``generate_dataset.py`` (commit e9ca6c0,
``--num-train 10 --num-valid 3 --num-test 3 --seed 43 --sufix small``): the independent reference for
our simulator, its layout and its scales.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from geoattn.core.errors import DataError
from geoattn.experiments import load_spec, plan, write_report
from geoattn.experiments.runner import execute
from geoattn.tasks.nbody import NBodyConfig, NBodyTask
from geoattn.tasks.nbody import charged as C
from geoattn.tasks.nbody.models import EGNNConfig, NBodyEGNN
from geoattn.tasks.nbody.task import equivariance_error

EGNN_FILES = Path(__file__).parent / "data" / "egnn_charged"
SIZES = {"train": 10, "val": 3, "test": 3}


@pytest.fixture(scope="module")
def egnn_sets():
    return C.load_egnn_format(EGNN_FILES)


@pytest.fixture(scope="module")
def ours():
    return C.simulate(SIZES)


def test_egnn_file_layout_loads(egnn_sets):
    for name, size in SIZES.items():
        data = egnn_sets[name]
        assert data.loc.shape == data.vel.shape == (size, 49, 3, 5)
        assert data.edges.shape == (size, 5, 5) and data.charges.shape == (size, 5, 1)
        assert set(np.unique(data.charges)) <= {-1.0, 1.0}
        np.testing.assert_array_equal(data.edges, data.charges @ data.charges.transpose(0, 2, 1))


def test_the_simulator_draws_egnn_systems_and_integrates_them_as_its_code(egnn_sets, ours):
    """Same seed, same stream: the same charges exactly, the same trajectories to float64 rounding
    (amplified by close encounters over 4,100 steps, still ≤ 1e-5 at the task's frames)."""
    for name in SIZES:
        mine, theirs = ours[name], egnn_sets[name]
        np.testing.assert_array_equal(mine.charges, theirs.charges)
        np.testing.assert_array_equal(mine.edges, theirs.edges)
        for array in ("loc", "vel"):
            a, b = getattr(mine, array)[:, :41], getattr(theirs, array)[:, :41]
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=f"{name} {array}")


def test_the_simulator_scales_match_egnn_files(egnn_sets):
    """Another seed: other systems with the same statistics (positions spread with time, speeds)."""
    other = C.simulate({"train": 300, "val": 1, "test": 1}, seed=7, steps=4200)["train"]
    theirs = np.concatenate([egnn_sets[n].loc for n in SIZES])
    speeds = np.linalg.norm(other.vel[:, 30], axis=1)
    assert 0.3 < np.median(speeds) < 1.5  # initial speed 0.5, energy exchanged in encounters
    for frame in (0, 30, 40):
        ratio = other.loc[:, frame].std() / theirs[:, frame].std()
        assert 0.6 < ratio < 1.6, (frame, ratio)


def test_the_task_is_egnn_nbody_small(egnn_sets):
    """Inputs at frame 30, targets at frame 40, charges as the scalar column, the first N samples."""
    task = NBodyTask(NBodyConfig(system="charged", data=str(EGNN_FILES), train_size=4))
    assert task.sets == ("train", "val", "test")
    train = task.dataset("train")
    assert len(train) == 4 and len(task.dataset("test")) == 3
    loc, vel = egnn_sets["train"].loc, egnn_sets["train"].vel
    np.testing.assert_array_equal(train.x_initial.numpy(), loc[:4, 30].transpose(0, 2, 1))
    np.testing.assert_array_equal(train.v_initial.numpy(), vel[:4, 30].transpose(0, 2, 1))
    np.testing.assert_array_equal(train.x_final.numpy(), loc[:4, 40].transpose(0, 2, 1))
    np.testing.assert_array_equal(train.m.numpy(), egnn_sets["train"].charges[:4, :, 0])
    assert task.horizon == pytest.approx(1.0)  # 10 frames of 100 steps of 0.001


def test_bad_or_missing_files_name_the_file(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        NBodyTask(NBodyConfig(system="charged", data=str(tmp_path / "nowhere")))
    for f in EGNN_FILES.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "vel_test_charged5_initvel1small.npy").unlink()
    with pytest.raises(DataError, match="vel_test_charged5_initvel1small.npy"):
        NBodyTask(NBodyConfig(system="charged", data=str(tmp_path)))
    np.save(tmp_path / "vel_test_charged5_initvel1small.npy", np.zeros((3, 49, 3, 4)))
    with pytest.raises(DataError, match=r"vel_test.*has shape \(3, 49, 3, 4\)"):
        NBodyTask(NBodyConfig(system="charged", data=str(tmp_path)))
    with pytest.raises(DataError, match="100 train samples asked, 10"):
        NBodyTask(NBodyConfig(system="charged", data=str(EGNN_FILES), train_size=100))


def test_the_command_line_error_is_one_line(tmp_path):
    command = [sys.executable, "-m", "geoattn", "train", "--task", "nbody", "--model", "egnn"]
    command += [
        "--set",
        "task.system=charged",
        "--data",
        str(tmp_path / "nowhere"),
        "--out",
        str(tmp_path / "o"),
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "nowhere" in done.stderr


def test_written_files_read_back_and_are_never_overwritten(tmp_path, ours):
    C.save_egnn_format(ours, tmp_path)
    back = C.load_egnn_format(tmp_path)
    for name in SIZES:
        np.testing.assert_array_equal(back[name].loc, ours[name].loc)
    with pytest.raises(DataError, match="exists"):
        C.save_egnn_format(ours, tmp_path)


@pytest.mark.parametrize("system", ["charged", "gravity"])
def test_egnn_is_e3_equivariant(system):
    """float64, random rotations and reflections with translations: equivariant to rounding."""
    torch.manual_seed(0)
    model = NBodyEGNN(EGNNConfig(n_layer=2, hidden=16)).double()
    for p in model.parameters():  # larger than EGNN's tiny initial coordinate gates, so they matter
        p.data += 0.1 * torch.randn_like(p)
    if system == "charged":
        x = NBodyTask(NBodyConfig(system="charged", data=str(EGNN_FILES))).dataset("train").inputs()
    else:
        x = NBodyTask(NBodyConfig(train_size=8, val_size=1, eval_size=1)).dataset("train").inputs()
    error = equivariance_error(model, x.double(), torch.Generator().manual_seed(1), shift_std=5.0)
    assert error < 1e-12
    # and not blind: a fixed direction added to the output breaks rotations, and the check sees it

    class Tilted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            out, _ = self.inner(x)
            return out + torch.tensor([0.1, 0.0, 0.0], dtype=out.dtype), None

    assert equivariance_error(Tilted(), x.double(), torch.Generator().manual_seed(1), shift_std=5.0) > 1e-3


def test_egnn_trains_on_the_charged_files(tmp_path):
    """A short run through the trainer: the test MSE beats the no-motion baseline of the same set."""
    from geoattn.training.recipes import build_config
    from geoattn.training.trainer import Trainer, run_task

    config = build_config(
        dict(task="nbody", model="egnn", data=str(EGNN_FILES), task_options={"system": "charged"},
             max_iters=60, batch_size=10, eval_interval=60, eval_iters=1, out=str(tmp_path / "run"),
             n_layer=2, n_embd=32, lr=3e-3, min_lr=3e-3, plots=False)
    )  # fmt: skip
    task = run_task(config)
    summary = Trainer(config, task, tmp_path / "run", verbose=False).train()
    assert summary["final"]["test_mse"] < task.baselines("test")["static_mse"]
    assert summary["final"]["equivariance_error"] < 1e-4


def test_peer_cells_run_their_command_and_report_its_metrics(tmp_path, monkeypatch):
    script = tmp_path / "peer.py"
    script.write_text(
        "import json, sys\n"
        "out, seed = sys.argv[1], int(sys.argv[2])\n"
        "json.dump({'val_mse': 0.5 + seed, 'wall_s': 1.0}, open(out + '/metrics.json', 'w'))\n"
    )
    spec_file = tmp_path / "peer.toml"
    spec_file.write_text(
        'seeds = [1, 2]\nmetrics = ["val_mse"]\n[base]\ntask = "nbody"\n'
        '[[cells]]\nname = "peer"\nmax_iters = 10\n'
        f'command = ["{{python}}", "{script}", "{{out}}", "{{seed}}"]\n'
    )
    spec = load_spec(str(spec_file))
    runs = tmp_path / "runs"
    plans = plan(spec, runs)
    assert [p.status for p in plans] == ["new", "new"]
    execute(spec, plans, print_line=lambda line: None)
    assert [p.status for p in plan(spec, runs)] == ["done", "done"]
    report = write_report(spec, plan(spec, runs), tmp_path / "results", runs).read_text()
    assert "2.000 ± 0.71 (n=2)" in report  # 1.5 and 2.5
    summary = json.loads((plans[0].out / "summary.json").read_text())
    assert summary["final"]["val_mse"] == 1.5 and summary["iter"] == 10


def test_a_failing_peer_names_its_log(tmp_path):
    spec_file = tmp_path / "bad.toml"
    spec_file.write_text(
        'metrics = ["val_mse"]\n[base]\ntask = "nbody"\n'
        '[[cells]]\nname = "peer"\nmax_iters = 10\ncommand = ["{python}", "-c", "raise SystemExit(3)"]\n'
    )
    spec = load_spec(str(spec_file))
    from geoattn.core.errors import UserError

    with pytest.raises(UserError, match="1 of 1 runs failed"):
        execute(spec, plan(spec, tmp_path / "runs"), print_line=lambda line: None)
    log = next((tmp_path / "runs").glob("peer-*/seed_1337/peer.log"))
    assert "raise SystemExit(3)" in log.read_text()


@pytest.mark.parametrize(
    "runner, flag, marker",
    [("egnn_nbody.py", "--egnn", "main_nbody.py"), ("cgenn_nbody.py", "--cgenn", "models/nbody_cggnn.py")],
)
def test_the_peer_runners_name_what_is_missing_in_one_line(tmp_path, runner, flag, marker):
    """EGNN's and CGENN's runners (benchmarks/): no checkout, then a missing data file, then an existing
    result: one line naming it, exit code 2, nothing written or overwritten."""
    script = Path(__file__).parents[1] / "benchmarks" / runner
    checkout, data, out = tmp_path / "checkout", tmp_path / "data", tmp_path / "out"

    def run() -> subprocess.CompletedProcess:
        command = [sys.executable, str(script), flag, str(checkout), "--data", str(data), "--out", str(out)]
        return subprocess.run(command, capture_output=True, text=True)

    done = run()
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and marker.split("/")[-1] in done.stderr
    (checkout / marker).parent.mkdir(parents=True)
    (checkout / marker).write_text("")
    data.mkdir()
    for f in EGNN_FILES.iterdir():
        (data / f.name).write_bytes(f.read_bytes())
    edges = "edges_valid_charged5_initvel1small.npy"
    (data / edges).unlink()
    done = run()
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and edges in done.stderr
    (data / edges).write_bytes((EGNN_FILES / edges).read_bytes())
    out.mkdir()
    (out / "metrics.json").write_text("{}")
    done = run()
    assert done.returncode == 2 and "exists" in done.stderr
    assert (out / "metrics.json").read_text() == "{}"
    assert not (out / "dataroot").exists() and not (out / "work").exists()


def test_a_peers_predictions_are_measured_as_our_runs_are(tmp_path):
    """A peer's ``predictions.npz`` (what its code predicted, per set) becomes the run's evaluation
    rows when the experiment evaluates: the same MSEs and per-sample profile the task gives its own
    models (here the static prediction, whose MSE is the task's own baseline); ``train`` may hold the
    first samples only; a run whose command wrote none is not evaluated; bad predictions are one line
    naming the file and the set."""
    from geoattn.core.errors import UserError
    from geoattn.experiments.runner import PEER_PREDICTIONS, evaluation_file
    from geoattn.tasks.nbody.task import error_profile

    task = NBodyTask(NBodyConfig(system="charged", data=str(EGNN_FILES)))
    script = tmp_path / "peer.py"
    script.write_text(
        "import json, sys\nimport numpy as np\n"
        "from geoattn.tasks.nbody import NBodyConfig, NBodyTask\n"
        "out, files, write = sys.argv[1], sys.argv[2], sys.argv[3] == '1'\n"
        "task = NBodyTask(NBodyConfig(system='charged', data=files))\n"
        "json.dump({'val_mse': 1.0, 'wall_s': 1.0}, open(out + '/metrics.json', 'w'))\n"
        "static = {n: task.dataset(n).x_initial.numpy() for n in ('val', 'test')}\n"
        "static['train'] = task.dataset('train').x_initial[:4].numpy()\n"
        "if write:\n"
        "    np.savez(out + '/predictions.npz', **static)\n"
    )

    def experiment(name: str, options: str = "") -> Path:
        spec_file = tmp_path / f"{name}.toml"
        spec_file.write_text(
            'seeds = [1]\nmetrics = ["test_mse"]\nevaluate = true\n[base]\ntask = "nbody"\n'
            f'data = "{EGNN_FILES}"\ntask_options = {{ system = "charged"{options} }}\n'
            + "".join(
                f'[[cells]]\nname = "{name}"\nmax_iters = 10\n'
                f'command = ["{{python}}", "{script}", "{{out}}", "{{data}}", "{write}"]\n'
                for name, write in (("peer", 1), ("mute", 0))
            )
        )
        return spec_file

    spec = load_spec(str(experiment("peer")))
    runs = tmp_path / "runs"
    execute(spec, plan(spec, runs), print_line=lambda line: None)
    peer, mute = plan(spec, runs)
    evaluation = evaluation_file(peer.config)
    assert peer.status == mute.status == "done" and not list(mute.out.glob("evaluation*.json"))
    rows = {r["metric"]: r["value"] for r in json.loads((peer.out / evaluation).read_text())["rows"]}
    recorded = json.loads((peer.out / evaluation).read_text())["sets"]  # the files it was scored on
    assert recorded == {name: task.dataset(name).content_hash() for name in ("train", "val", "test")}
    for name in ("val", "test"):
        assert rows[f"{name}_mse" if name == "test" else "val_mse_full"] == pytest.approx(
            task.baselines(name)["static_mse"], rel=1e-6
        )
        data = task.dataset(name)
        errors = (data.x_initial.double() - data.x_final.double()).pow(2).flatten(1).mean(1)
        assert rows[f"{name}_mse_median"] == pytest.approx(error_profile(errors)["mse_median"])
    head = task.dataset("train").head(4)
    static_train = float((head.x_initial - head.x_final).pow(2).mean())
    assert rows["train_mse_full"] == pytest.approx(static_train, rel=1e-6)
    report = write_report(spec, plan(spec, runs), tmp_path / "results", runs).read_text()
    peer_row = next(line for line in report.splitlines() if line.startswith("| peer ") and "(n=1)" in line)
    assert f"{rows['test_mse']:.4g} (n=1)" in peer_row  # the report's peer row reads the evaluation

    # a finished peer whose predictions come later (GATr's --predict-only) is evaluated then, once
    (mute.out / PEER_PREDICTIONS).write_bytes((peer.out / PEER_PREDICTIONS).read_bytes())
    assert [p.status for p in plan(spec, runs)] == ["done", "evaluate"]
    execute(spec, plan(spec, runs), print_line=lambda line: None)
    assert (mute.out / evaluation).read_text() == (peer.out / evaluation).read_text()
    evaluated = (mute.out / PEER_PREDICTIONS).stat().st_mtime - 5  # predicted again after the evaluation
    os.utime(mute.out / evaluation, (evaluated, evaluated))
    assert [p.status for p in plan(spec, runs)] == ["done", "evaluate"]
    execute(spec, plan(spec, runs), print_line=lambda line: None)
    assert [p.status for p in plan(spec, runs)] == ["done", "done"]

    # another experiment measuring the same peer run on other task settings gets its own evaluation
    # file: here settings that leave the sets as they are (rows equal, files apart), then a training
    # set of 2, shorter than the 4 training predictions (refused), neither touching this one's
    assert evaluation_file({"max_iters": 10}) == "evaluation.json"  # this project's runs: one file
    alike = load_spec(str(experiment("alike", ", seed = 5")))
    execute(alike, plan(alike, runs), print_line=lambda line: None)
    alike_file = evaluation_file(plan(alike, runs)[0].config)
    assert alike_file != evaluation and alike_file.startswith("evaluation-")
    assert (peer.out / alike_file).read_text() == (peer.out / evaluation).read_text()
    other = load_spec(str(experiment("other", ", train_size = 2")))
    shared = plan(other, runs)
    assert [p.out for p in shared] == [peer.out, mute.out]
    assert [p.status for p in shared] == ["evaluate", "evaluate"]
    kept = (peer.out / evaluation).read_text()
    lines = []
    with pytest.raises(UserError, match="2 of 2 runs failed"):
        execute(other, shared, print_line=lines.append)
    assert any("expected (2, 5, 3)" in line for line in lines), lines
    assert (peer.out / evaluation).read_text() == kept
    assert [p.status for p in plan(spec, runs)] == ["done", "done"]

    (peer.out / evaluation).unlink()
    for arrays, fault in (
        ({"val": np.zeros((2, 5, 3))}, "predictions for set 'val' have shape (2, 5, 3), expected (3, 5, 3)"),
        ({"eval": np.zeros((2, 5, 3))}, "predictions for set 'eval': this task's sets are train, val, test"),
        ({"train": np.zeros((0, 5, 3))}, "predictions for set 'train' have shape (0, 5, 3), expected"),
        (None, "cannot read the peer's predictions"),  # a half-written file
    ):
        if arrays is None:
            (peer.out / PEER_PREDICTIONS).write_bytes(b"PK\x03\x04 cut short")
        else:
            np.savez(peer.out / PEER_PREDICTIONS, **arrays)
        lines = []
        with pytest.raises(UserError, match="1 of 1 runs failed"):  # the other is done
            execute(spec, plan(spec, runs), print_line=lines.append)
        assert any(fault in line and "predictions.npz" in line for line in lines), lines
