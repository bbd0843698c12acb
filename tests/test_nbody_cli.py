"""`geoattn train/eval --task nbody` end to end on GATr-format files: sizes, config.json, failures."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from geoattn.cli import main
from geoattn.tasks.nbody import NBodyConfig, NBodyRotor, NBodyTask

SIZES = {"train_size": 40, "val_size": 16, "eval_size": 12, "e3_size": 8, "object_size": 8}
TINY = "--task nbody --n-layer 1 --n-head 2 --n-embd 16 --batch-size 8 --eval-iters 1 --no-plots".split()
STEPS = "--max-iters 2 --eval-interval 2".split()


@pytest.fixture(scope="module")
def gatr_dir(tmp_path_factory) -> Path:
    """Five tiny sets written in GATr's format."""
    directory = tmp_path_factory.mktemp("nbody_data")
    NBodyTask(NBodyConfig(**SIZES)).save_gatr_format(directory)
    return directory


def train(out: Path, data: Path, *flags: str) -> int:
    return main(["train", *TINY, *STEPS, "--data", str(data), "--out", str(out), *flags])


def test_task_sizes_are_honoured_with_data_and_recorded(gatr_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, gatr_dir, "--model", "transformer", "--set", "task.train_size=10") == 0
    task = json.loads((out / "config.json").read_text())["task"]
    assert task["source"]["directory"] == str(gatr_dir.resolve())
    assert task["source"]["sizes"]["train_size"] == 10
    assert {name: s["samples"] for name, s in task["sets"].items()} == {
        "train": 10, "val": 16, "eval": 12, "e3_generalization": 8, "object_generalization": 8
    }  # fmt: skip
    loaded = NBodyTask(NBodyConfig(data=str(gatr_dir)))
    assert task["sets"]["train"]["sha256"] == loaded.dataset("train").head(10).content_hash()
    capsys.readouterr()


def test_a_run_that_failed_before_its_first_checkpoint_leaves_out_reusable(
    gatr_dir, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "run"

    def fail(self, x, y=None):
        raise ValueError("a bug at the first step")

    with monkeypatch.context() as patch:
        patch.setattr(NBodyRotor, "forward", fail)
        with pytest.raises(ValueError, match="a bug at the first step"):
            train(out, gatr_dir, "--model", "rotor")
    assert any(out.iterdir()) and not (out / "model.safetensors").exists()  # files, no checkpoint
    assert train(out, gatr_dir, "--model", "rotor") == 0  # no --force needed
    assert (out / "model.safetensors").exists()
    capsys.readouterr()


def test_the_pga_rotor_model_trains_and_evaluates(gatr_dir, tmp_path, capsys):
    out = tmp_path / "run"
    # the recipe's Clifford message layers are Cl(3)'s: asked for both, a one-line error
    both = ("--set", 'model.algebra="pga"', "--set", "model.block_messages=clifford")
    assert train(out, gatr_dir, "--model", "rotor", *both) == 2
    err = capsys.readouterr().err.strip()
    assert "block_messages='clifford' needs algebra='cl3'" in err and len(err.splitlines()) == 1
    # PGA alone: the recipe's messages follow it (EGNN's, the messages PGA was measured with)
    assert train(out, gatr_dir, "--model", "rotor", "--set", 'model.algebra="pga"') == 0
    model = json.loads((out / "config.json").read_text())["model"]
    assert (model["algebra"], model["block_messages"], model["pair_every_block"]) == ("pga", "egnn", True)
    summary = json.loads((out / "summary.json").read_text())
    capsys.readouterr()
    assert main(["eval", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line.split("|")[3].strip() for line in table.splitlines()[3:]}
    assert rows["e3_generalization_mse"] == "all 8 e3_generalization samples"
    assert rows["eval_free_motion_mse"] == rows["eval_static_mse"] == "all 12 eval samples"
    assert rows["val_mse"] == "1 batches of 8"  # a batch estimate, said so
    assert rows["equivariance_error"].startswith("first 12 eval samples")
    header = table.splitlines()[0]
    assert f"{summary['params']:,} parameters, trained 2 iters in" in header and "evaluated in" in header
    value = table.splitlines()[3 + list(rows).index("eval_mse")].split("|")[2].strip()
    mantissa = value.split("e")[0].replace(".", "").lstrip("0")
    assert len(mantissa) == 4, value  # 4 significant digits
    assert summary["final"]["equivariance_error"] < 1e-3  # float32


@pytest.mark.parametrize("model", ["rotor", "transformer"])
def test_list_settings_explains_every_task_and_model_key(model, capsys):
    assert main(["train", "--task", "nbody", "--model", model, "--list-settings"]) == 0
    rows = [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith(("| task.", "| model."))
    ]
    keys = {row[0]: row[3] for row in rows}
    config_cls, fixed = NBodyTask.model_settings(model)
    expected = [f"task.{f.name}" for f in dataclasses.fields(NBodyConfig)]
    expected += [f"model.{f.name}" for f in dataclasses.fields(config_cls) if f.name not in fixed]
    assert sorted(keys) == sorted(expected)
    assert all(keys.values()), [k for k, v in keys.items() if not v]  # every key has a help text
    if model == "rotor":  # how the run's width maps onto the rotor model
        assert "n_embd // 8" in keys["model.channels"] and "n_embd // 8" in keys["model.scalars"]
        assert "--n-head" in keys["model.head_types"] and "--n-layer" in keys["model.n_layer"]
    assert "first N" in keys["task.train_size"]


def test_gatrs_budget_command_runs_on_files_written_by_save_gatr_format(gatr_dir, tmp_path, capsys):
    """The issue's command (GATr's batch, lr and exponential decay to lr/100, no warmup or hold), fewer steps
    and tiny sets."""
    out = tmp_path / "run"
    flags = "--model rotor --batch-size 64 --lr-schedule exponential --lr 3e-4 --max-iters 3 --hold-iters 0"
    flags += " --min-lr none --weight-decay 0"
    argv = ["train", "--task", "nbody", "--data", str(gatr_dir), "--out", str(out), *flags.split()]
    assert main([*argv, *"--eval-interval 3 --eval-iters 1 --warmup-iters 0 --no-plots".split()]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["lr"] == pytest.approx(3e-4 * 0.01 ** (2 / 3))  # the last step: 2/3 of the way to lr/100
    assert set(summary["final"]) == {
        "val_mse_full", "eval_mse", "e3_generalization_mse", "e3_generalization_unshifted_mse",
        "object_generalization_mse", "equivariance_error",
    }  # fmt: skip
    capsys.readouterr()
    assert main(["eval", "--out", str(out)]) == 0
    assert "object_generalization_mse" in capsys.readouterr().out


def test_help_names_gatrs_files_and_how_the_width_maps_onto_the_rotor_model(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "nbody: a directory of GATr's files" in text and "e3_generalization.npz" in text
    assert "n_embd/8 multivector and n_embd/8 scalar channels" in text and "model.scalars" in text
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    assert "nbody a directory of GATr's files" in " ".join(capsys.readouterr().out.split())


def test_the_rotor_default_is_the_message_model_validation_chose_and_old_cells_keep_theirs():
    """`--task nbody --model rotor` without flags is nbody-gatr-six-seeds' cell "rotor + Clifford messages
    before every block, lr 4e-3" (the same settings, so the same run directory, at GATr's budget); the
    cells of experiments from before pin the recipe they ran with (4 × 256, 128 scalars, GATr's
    exponential decay from 2e-3); another run length scales the warmup and the hold; flags still win."""
    from dataclasses import replace
    from pathlib import Path

    from geoattn.experiments import load_spec
    from geoattn.training.recipes import build_config

    spec = load_spec("nbody-gatr-six-seeds")
    cells = {c.name: c for c in spec.cells}
    chosen = cells["rotor + Clifford messages before every block, lr 4e-3"]
    defaults = replace(chosen, name="defaults", fields={"model": "rotor"})
    runs = Path("runs")
    assert spec.config(defaults, 1337, runs)["out"] == spec.config(chosen, 1337, runs)["out"]
    config = build_config({"task": "nbody", "model": "rotor"})
    assert (config.lr, config.n_embd, config.lr_schedule, config.weight_decay) == (4e-3, 128, "cosine", 0.5)
    assert config.model_options["block_messages"] == "clifford" and config.model_options["scalars"] == 16
    before = spec.config(cells["RotorTransformer, its recipe (the defaults)"], 1337, runs)
    assert (before["lr"], before["n_embd"], before["lr_schedule"]) == (2e-3, 256, "exponential")
    assert (before["warmup_iters"], before["hold_iters"], before["min_lr"]) == (0, 0, None)
    assert before["model_options"] == {"scalars": 128}
    longer = build_config({"task": "nbody", "model": "rotor", "max_iters": 4000})
    assert (longer.warmup_iters, longer.hold_iters) == (62, 2938)
    assert build_config({"task": "nbody", "model": "rotor", "lr": 1e-3}).lr == 1e-3


def test_the_clifford_default_is_the_schedule_the_test_experiment_ran_and_scales_with_the_run():
    """`--task nbody --model clifford` without flags is nbody-cgenn-schedule's cell (CGENN's schedule at
    the rate nbody-clifford-hold-lr chose); another run length scales the warmup and the hold with it
    (their shares of the run), a warmup or hold the user sets is kept, and "none" gives a field its
    own default back (the old experiments pin the old recipe so)."""
    from geoattn.experiments import load_spec
    from geoattn.training.recipes import build_config

    config = build_config({"task": "nbody", "model": "clifford"})
    cell = next(c for c in load_spec("nbody-cgenn-schedule").cells if "CGENN's schedule" in c.name)
    for key in ("lr", "min_lr", "warmup_iters", "hold_iters", "weight_decay"):
        assert getattr(config, key) == cell.fields[key], key
    assert config.max_iters == 4260
    longer = build_config({"task": "nbody", "model": "clifford", "max_iters": 17040})
    assert (longer.warmup_iters, longer.hold_iters) == (264, 12516)  # 4 × (66, 3129)
    short = build_config({"task": "nbody", "model": "clifford", "max_iters": 60})
    assert short.warmup_iters + short.hold_iters < 60
    kept = build_config({"task": "nbody", "model": "clifford", "max_iters": 17040, "hold_iters": 100})
    assert (kept.warmup_iters, kept.hold_iters) == (264, 100)  # the one not set still scales
    old = build_config({"task": "nbody", "model": "clifford", "min_lr": "none", "hold_iters": 0})
    assert old.min_lr is None and old.final_lr == pytest.approx(8e-4) and old.hold_iters == 0


def test_a_run_plots_its_errors_by_distance_and_force_clears_them(gatr_dir, tmp_path, capsys):
    """The task's own figure (`task_errors.png`: each validation sample's error against its closest
    pair of bodies) is written with the run's plots, named in the summary, and removed by --force."""
    out = tmp_path / "run"
    flags = [a for a in TINY if a != "--no-plots"]
    assert (
        main(["train", *flags, *STEPS, "--data", str(gatr_dir), "--out", str(out), "--model", "transformer"])
        == 0
    )
    figure = out / "task_errors.png"
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "task_errors.png" in json.loads((out / "summary.json").read_text())["plots"]
    assert train(out, gatr_dir, "--model", "transformer", "--force") == 0  # --no-plots: nothing redrawn
    assert not figure.exists()
    capsys.readouterr()
