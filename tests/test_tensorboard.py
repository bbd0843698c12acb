"""`--logger tensorboard`: event files in RUN/tensorboard/ hold what metrics.jsonl holds, and figures.

The event files are read back with TensorBoard's own EventAccumulator: every logged scalar (losses,
learning rate, throughput, the task's metrics) at its step with its value, the loss curve and the
attention map at each evaluation, a resumed run without duplicate or stale steps.
"""

from __future__ import annotations

import shutil
import sys

import pytest
from conftest import tiny_lm_args
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from geoattn.cli import main
from geoattn.training.loggers import parse_loggers, scalar_tag
from geoattn.training.run_dir import RunDirectory


def events(out) -> EventAccumulator:
    accumulator = EventAccumulator(
        str(out / RunDirectory.TENSORBOARD), size_guidance={"scalars": 0, "images": 0}
    )
    return accumulator.Reload()


def scalars(accumulator: EventAccumulator, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in accumulator.Scalars(tag)}


def logged(out, key: str) -> dict[int, float]:
    return {r["iter"]: r[key] for r in RunDirectory(out).metrics() if r.get(key) is not None}


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tb") / "lm"
    argv = ["train", *tiny_lm_args(6, 3), "--model", "rt", "--logger", "jsonl,tensorboard", "--out", str(out)]
    assert main(argv) == 0
    return out


def test_event_files_hold_every_logged_scalar(lm_run):
    accumulator = events(lm_run)
    keys = ("train_loss", "lr", "tokens_per_s", "train_eval_loss", "val_loss")
    assert {scalar_tag(k) for k in keys} <= set(accumulator.Tags()["scalars"])
    for key in keys:
        expected, got = logged(lm_run, key), scalars(accumulator, scalar_tag(key))
        assert got.keys() == expected.keys(), key
        assert all(got[i] == pytest.approx(expected[i], rel=1e-6) for i in expected), key  # float32
    assert sorted(scalars(accumulator, "loss/train_batch")) == [1, 2, 3, 4, 5, 6]
    assert sorted(scalars(accumulator, "loss/val")) == [3, 6]


def test_figures_at_each_evaluation(lm_run):
    accumulator = events(lm_run)
    for tag in ("plots/loss", "plots/attention", "plots/precision"):  # precision: an rt model
        images = accumulator.Images(tag)
        assert [image.step for image in images] == [3, 6], tag
        assert all(image.width > 100 and image.height > 100 for image in images)
        assert images[0].encoded_image_string.startswith(b"\x89PNG")


def test_task_metrics_reach_tensorboard(tmp_path):
    out = tmp_path / "filter"
    argv = ["train", "--task", "filter", "--model", "transformer", "--max-iters", "2", "--eval-interval", "2"]
    argv += ["--eval-iters", "1", "--batch-size", "4", "--n-layer", "1", "--n-embd", "16", "--n-head", "2"]
    argv += ["--block-size", "16", "--no-plots", "--logger", "tensorboard", "--out", str(out)]
    assert main(argv) == 0
    accumulator = events(out)
    assert scalars(accumulator, "metrics/val_angle_deg") == pytest.approx(
        logged(out, "val_angle_deg"), rel=1e-6
    )
    assert RunDirectory(out).metrics_path.exists()  # the run's own record is written whatever the logger


def test_resume_purges_the_steps_after_the_checkpoint(tmp_path):
    """A run logged to iter 4 but checkpointed at 2 (as after a crash) resumes from 2: TensorBoard then
    holds steps 1-4 once each, equal to metrics.jsonl, like an unbroken run."""
    flags = [*tiny_lm_args(4, 2), "--logger", "tensorboard"]
    full, early = tmp_path / "full", tmp_path / "early"
    assert main(["train", *flags, "--out", str(full)]) == 0
    assert main(["train", *flags, "--max-iters", "2", "--out", str(early)]) == 0
    for name in (RunDirectory.WEIGHTS, RunDirectory.STATE):  # the same run's checkpoint at iter 2
        shutil.copyfile(early / name, full / name)
    assert main(["train", "--out", str(full), "--resume", "--max-iters", "4"]) == 0
    accumulator = events(full)
    steps = [e.step for e in accumulator.Scalars("loss/train_batch")]
    assert sorted(steps) == [1, 2, 3, 4]
    assert scalars(accumulator, "loss/train_batch") == pytest.approx(logged(full, "train_loss"), rel=1e-6)


def test_default_logger_writes_no_events_and_force_clears_them(lm_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(lm_run, out)
    assert (out / RunDirectory.TENSORBOARD).is_dir() and RunDirectory(out).owns(
        out / RunDirectory.TENSORBOARD
    )
    assert main(["train", *tiny_lm_args(2, 2), "--out", str(out), "--force"]) == 0
    assert not (out / RunDirectory.TENSORBOARD).exists()  # --force cleared it; jsonl wrote none


def test_logger_names_are_checked(capsys, tmp_path):
    assert parse_loggers(" tensorboard, jsonl ,tensorboard") == ("tensorboard", "jsonl")
    capsys.readouterr()
    assert main(["train", *tiny_lm_args(2, 2), "--logger", "wandb", "--out", str(tmp_path / "x")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "jsonl, tensorboard" in lines[0] and "'wandb'" in lines[0], lines


def test_missing_tensorboard_is_one_line_naming_the_extra(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` raises ImportError
    capsys.readouterr()
    argv = ["train", *tiny_lm_args(2, 2), "--logger", "tensorboard", "--out", str(tmp_path / "x")]
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "geoattn[tensorboard]" in lines[0], lines
