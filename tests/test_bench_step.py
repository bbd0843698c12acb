"""`geoattn bench step`: a task's models timed at one width and batch, against the first model."""

from __future__ import annotations

import pytest

from geoattn.cli import main

FLAGS = "--batch 4 --n-layer 1 --n-head 2 --n-embd 32 --repeats 1 --warmup 1 --threads 1"


def test_every_nbody_model_steps_at_one_width(capsys):
    args = ["bench", "step", "--task", "nbody", *FLAGS.split(), "--set", "task.train_size=16"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "1 layers × 2 heads × 32" in out and "batch 4" in out
    rows = {line.split("|")[1].strip(): line.split("|") for line in out.splitlines() if line.startswith("| ")}
    assert {"transformer", "rotor", "egnn"} <= rows.keys()
    assert float(rows["transformer"][-2]) == 1.0  # the first model is the reference
    assert all(float(rows[m][-2]) > 0 for m in ("rotor", "egnn"))
    assert all(int(rows[m][2].replace(",", "")) > 0 for m in ("transformer", "rotor", "egnn"))


@pytest.mark.parametrize(
    "extra, message",
    [(["--models", "nope"], "task nbody has transformer"), (["--set", "task.bogus=1"], "bogus")],
)
def test_bad_models_and_settings_are_one_line_errors(capsys, extra, message):
    assert main(["bench", "step", "--task", "nbody", *FLAGS.split(), *extra]) == 2
    assert message in capsys.readouterr().err
