"""Where a run's metrics go (``--logger``): ``metrics.jsonl``, and TensorBoard event files if asked.

``TrainConfig.logger`` names the loggers, comma-separated (``jsonl``, ``tensorboard``,
``jsonl,tensorboard``). ``metrics.jsonl`` is the run's own record, written whatever the setting:
resuming, the summary, the report and the plots read it, so ``tensorboard`` alone means "also
TensorBoard". The TensorBoard logger (the ``geoattn[tensorboard]`` extra) writes into the run's
``tensorboard/`` folder (:attr:`RunDirectory.TENSORBOARD`):

* every logged record as scalars: ``loss/train_batch``, ``loss/train``, ``loss/val``, ``optim/lr``,
  ``throughput/tokens_per_s`` (or ``samples_per_s``) and the task's metrics as ``metrics/val_*``;
* at every evaluation the run's figures as images (``plots/loss``, ``plots/attention``,
  ``plots/precision``, the model's own ``plots/model_*``), drawn by :meth:`RunDirectory.plot` as at
  the end of the run.

A resumed run purges the events after its checkpoint, as ``metrics.jsonl`` drops its lines.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from geoattn.core.errors import ConfigError
from geoattn.core.extras import require
from geoattn.models.base import TaskModel
from geoattn.training.run_dir import RunDirectory

LOGGERS = {
    "jsonl": "metrics.jsonl, one JSON record per logged step (always written)",
    "tensorboard": "TensorBoard event files in RUN/tensorboard/: scalars, and the figures at each evaluation",
}


def parse_loggers(spec: str) -> tuple[str, ...]:
    """The logger names of ``spec`` (``"jsonl,tensorboard"``), deduplicated, in order.

    Raises:
        ConfigError: an empty spec or an unknown name (the message lists the valid ones).
    """
    names = tuple(dict.fromkeys(part.strip() for part in spec.split(",") if part.strip()))
    unknown = [name for name in names if name not in LOGGERS]
    if not names or unknown:
        raise ConfigError(
            f"logger must be one or more of {', '.join(LOGGERS)} separated by commas, got {spec!r}"
        )
    return names


def check_available(spec: str) -> None:
    """ConfigError naming the extra when a logger of ``spec`` needs a package that is missing."""
    if "tensorboard" in parse_loggers(spec):
        require("tensorboard", extra="tensorboard", purpose="--logger tensorboard")


def scalar_tag(key: str) -> str:
    """The TensorBoard tag of a metrics.jsonl key (losses, learning rate, throughput, task metrics)."""
    named = {"train_loss": "loss/train_batch", "train_eval_loss": "loss/train", "val_loss": "loss/val"}
    if key in named:
        return named[key]
    if key == "lr":
        return "optim/lr"
    if key.endswith("_per_s") or key == "step_s":
        return f"throughput/{key}"
    if key.startswith("val_"):
        return f"metrics/{key}"
    return key


class JSONLLogger:
    """Appends each record to the run's ``metrics.jsonl`` (flushed, so a crash loses nothing logged)."""

    def __init__(self, run: RunDirectory):
        self.file = open(run.metrics_path, "a")  # noqa: SIM115 - closed by close()

    def log(self, record: dict[str, Any]) -> None:
        """Write ``record`` as one JSON line."""
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def figures(self, step: int, paths: list[Path]) -> None:
        """Nothing: the PNGs are written at the end of the run."""

    def close(self) -> None:
        """Close the file."""
        self.file.close()


class TensorBoardLogger:
    """Scalars and figures as TensorBoard events in ``RUN/tensorboard/``.

    Args:
        run: the run directory.
        start_iter: the iteration the run starts from; events after it from an earlier session (an
            interrupted run resumed at its checkpoint) are purged.
    """

    def __init__(self, run: RunDirectory, *, start_iter: int = 0):
        require("tensorboard", extra="tensorboard", purpose="--logger tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(
            log_dir=str(run.file(RunDirectory.TENSORBOARD)), purge_step=start_iter + 1 if start_iter else None
        )

    def log(self, record: dict[str, Any]) -> None:
        """Every finite number of ``record`` as a scalar at step ``record["iter"]``."""
        step = int(record["iter"])
        for key, value in record.items():
            if key == "iter" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                self.writer.add_scalar(scalar_tag(key), value, step)
        self.writer.flush()

    def figures(self, step: int, paths: list[Path]) -> None:
        """Each PNG of ``paths`` as the image ``plots/<name>`` at ``step``."""
        from matplotlib.image import imread

        for path in paths:
            image = imread(path)[..., :3]  # (H, W, 3) float in [0, 1]; PNGs carry alpha
            self.writer.add_image(f"plots/{path.stem}", image, step, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()


class RunLoggers:
    """The loggers named by ``spec`` for one run (the trainer makes them on rank 0 only).

    ``log(record)`` at every logged step, ``evaluation(step, model, x)`` after every evaluation
    (figures, only if a logger shows them), ``close()`` at the end.
    """

    def __init__(self, spec: str, run: RunDirectory, *, start_iter: int = 0):
        names = parse_loggers(spec)
        self.run = run
        self.loggers: list[JSONLLogger | TensorBoardLogger] = [JSONLLogger(run)]
        if "tensorboard" in names:
            self.loggers.append(TensorBoardLogger(run, start_iter=start_iter))

    def log(self, record: dict[str, Any]) -> None:
        """Hand ``record`` (a metrics.jsonl line) to every logger."""
        for logger in self.loggers:
            logger.log(record)

    def evaluation(self, step: int, model: TaskModel, x: torch.Tensor | None) -> None:
        """The run's figures at ``step`` (``x``: an input batch for the attention map)."""
        if not any(isinstance(logger, TensorBoardLogger) for logger in self.loggers):
            return
        with tempfile.TemporaryDirectory() as tmp:
            # a scratch run directory with the metrics so far: RunDirectory.plot draws exactly the
            # figures the run writes at its end
            scratch = RunDirectory(Path(tmp) / self.run.path.name)
            scratch.path.mkdir()
            if self.run.metrics_path.exists():
                shutil.copyfile(self.run.metrics_path, scratch.metrics_path)
            was_training = model.training
            model.eval()
            with torch.random.fork_rng(devices=[]):  # drawing must not move the training RNG
                paths = scratch.plot(model, x)
            model.train(was_training)
            for logger in self.loggers:
                logger.figures(step, paths)

    def close(self) -> None:
        """Close every logger."""
        for logger in self.loggers:
            logger.close()
