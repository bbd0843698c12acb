"""The run directory: one object that owns its file names, checkpoints, metrics, plots and report.

Files of a run (nothing else in the directory is ever touched):

| file | written | what |
| --- | --- | --- |
| ``config.json`` | at start, with every checkpoint | TrainConfig, the model's config, the task's meta |
| ``metrics.jsonl`` | every ``log_interval`` steps | one JSON record per line |
| ``model.safetensors`` + ``trainer_state.pt`` | every evaluation, at the end, on Ctrl-C | the checkpoint |
| ``best.safetensors`` | at an evaluation with a new lowest validation loss (``keep_best``) | those weights |
| ``summary.json`` | at the end | the final metrics (full-set ones included), iterations, wall time |
| ``evaluation.json`` | by ``geoattn experiment`` | the task's evaluation table (``geoattn eval``'s rows) |
| ``evaluation-<key>.json`` | by ``geoattn experiment``, a peer's | its predictions' rows per task setting |
| ``*.png`` | at the end | loss curves, an attention map, the RT precision (what applies) |
| ``tensorboard/`` | every logged step (``--logger tensorboard``) | TensorBoard event files |

Every file is written to a temporary name in the same directory and moved into place with
``os.replace`` (atomic on POSIX), so a crash while saving leaves the previous file intact. The
iteration is stored in both the weights' metadata and the trainer state, and loading checks that
they agree, which catches a crash between the renames.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_model, save_model

from geoattn.core.errors import CheckpointError, ConfigError
from geoattn.models.base import TaskModel
from geoattn.training import plots

__all__ = ["RunDirectory", "CheckpointError", "summary_line"]


def _one_line(err: Exception) -> str:
    return "; ".join(line.strip() for line in str(err).splitlines() if line.strip())


def _first_difference(err: RuntimeError, limit: int = 240) -> str:
    """The first of load_state_dict's complaints, shortened, and how many more there are."""
    details = [line.strip() for line in str(err).splitlines()[1:] if line.strip()] or [str(err)]
    first = details[0] if len(details[0]) <= limit else details[0][: limit - 3] + "..."
    return first + (f" (and {len(details) - 1} more)" if len(details) > 1 else "")


def summary_line(record: dict[str, Any], max_iters: int | None = None) -> str:
    """One line for an evaluated record: iteration, train/val loss, lr, the task's ``val_*`` metrics."""
    it = f"iter {record['iter']}" + (f"/{max_iters}" if max_iters else "")
    parts = [it]
    if record.get("train_eval_loss") is not None:
        parts.append(f"train {record['train_eval_loss']:.4f}")
    if record.get("val_loss") is not None:
        parts.append(f"val {record['val_loss']:.4f}")
    if record.get("lr") is not None:
        parts.append(f"lr {record['lr']:.2e}")
    parts += [
        f"{k} {v:.4g}"
        for k, v in record.items()
        if k.startswith("val_") and k != "val_loss" and v is not None
    ]
    return "  ".join(parts)


class RunDirectory:
    """The files of one run in ``path`` (see the module docstring)."""

    CONFIG = "config.json"
    WEIGHTS = "model.safetensors"
    BEST = "best.safetensors"
    STATE = "trainer_state.pt"
    METRICS = "metrics.jsonl"
    SUMMARY = "summary.json"
    TENSORBOARD = "tensorboard"  # a folder: TensorBoard event files (geoattn.training.loggers)
    EVALUATION = "evaluation.json"
    PLOTS = ("loss.png", "attention.png", "precision.png")
    OWN_PLOT_PREFIXES = ("model_", "task_")  # own figures of the model and the task (their .plots)
    FILES = (CONFIG, WEIGHTS, BEST, STATE, METRICS, SUMMARY, EVALUATION, *PLOTS)

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDirectory({str(self.path)!r})"

    def file(self, name: str) -> Path:
        return self.path / name

    # ------------------------------------------------------------------ lifecycle ----------------
    def has_checkpoint(self) -> bool:
        return self.file(self.WEIGHTS).exists() or self.file(self.STATE).exists()

    def prepare(self, *, resume: bool = False, force: bool = False, clear: bool = True) -> None:
        """Make ``path`` ready for a run; never deletes a file that is not one of the run's.

        * ``resume``: a checkpoint must exist.
        * a directory holding files of a run that never wrote a checkpoint (it failed at the start) is
          reused: its run files are cleared;
        * any other non-empty directory needs ``force``, which clears the run files (others stay).

        ``clear=False`` only checks (DDP ranks other than 0).
        """
        if resume:
            if not self.has_checkpoint():
                raise ConfigError(f"--resume: no checkpoint in {self.path} (train without --resume first)")
            return
        if self.path.exists() and not self.path.is_dir():
            raise ConfigError(f"--out {self.path} exists and is not a directory")
        if not self.path.is_dir() or not any(self.path.iterdir()):
            return
        failed_start = not self.has_checkpoint() and all(self.owns(p) for p in self.path.iterdir())
        if not (force or failed_start):
            raise ConfigError(
                f"--out {self.path} is not empty; pass --resume to continue that run "
                "or --force to overwrite it"
            )
        if clear:
            self.clear()

    def owns(self, path: Path) -> bool:
        """Whether ``path`` is one of the files a run writes."""
        if path.name in self.FILES or path.name == self.TENSORBOARD:
            return True
        return path.name.startswith(self.OWN_PLOT_PREFIXES) and path.suffix == ".png"

    def clear(self) -> None:
        """Delete the run's own files (and nothing else)."""
        for name in self.FILES:
            self.file(name).unlink(missing_ok=True)
        for prefix in self.OWN_PLOT_PREFIXES:
            for path in self.path.glob(f"{prefix}*.png"):
                path.unlink()
        shutil.rmtree(self.file(self.TENSORBOARD), ignore_errors=True)

    # ------------------------------------------------------------------ files --------------------
    def _atomic_write(self, name: str, write: Callable[[Path], None]) -> None:
        path = self.file(name)
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            write(tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def _write_json(self, name: str, value: dict[str, Any]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self._atomic_write(name, lambda p: p.write_text(json.dumps(value, indent=2) + "\n"))

    def write_config(self, config: dict[str, Any]) -> None:
        self._write_json(self.CONFIG, config)

    def read_config(self) -> dict[str, Any]:
        """The run's ``config.json``; CheckpointError when it is missing or unreadable."""
        path = self.file(self.CONFIG)
        if not path.is_file():
            raise CheckpointError(f"{path} does not exist: {self.path} holds no geoattn run")
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{path} is not valid JSON ({err})") from None
        if not isinstance(config, dict) or "train" not in config:
            raise CheckpointError(f"{path} has no 'train' section: not a geoattn run config")
        return config

    def save_checkpoint(
        self, model: torch.nn.Module, trainer_state: dict[str, Any], config: dict[str, Any]
    ) -> None:
        """Write the checkpoint of ``model`` (unwrapped, not DDP) at ``trainer_state["iter"]``."""
        self._save_weights(self.WEIGHTS, model, trainer_state["iter"])
        self._atomic_write(self.STATE, lambda p: torch.save(trainer_state, p))
        self.write_config(config)

    def save_best(self, model: torch.nn.Module, iteration: int) -> None:
        """Write ``model``'s weights (unwrapped) as the best so far, from iteration ``iteration``."""
        self._save_weights(self.BEST, model, iteration)

    def _save_weights(self, name: str, model: torch.nn.Module, iteration: int) -> None:
        """``model``'s weights into ``name``, the iteration in their metadata (what loading checks)."""
        self.path.mkdir(parents=True, exist_ok=True)
        meta = {"iter": str(iteration)}
        self._atomic_write(name, lambda p: save_model(model, str(p), metadata=meta))

    def load_weights(
        self, model: torch.nn.Module, device: torch.device | str = "cpu", *, best: bool = False
    ) -> int:
        """Load the weights into ``model`` (strict): the checkpoint's, or with ``best`` those of
        :meth:`save_best`; returns the iteration they were saved at."""
        name = self.BEST if best else self.WEIGHTS
        path = self.file(name)
        if not path.is_file():
            raise CheckpointError(f"no checkpoint in {self.path}: {name} is missing")
        try:
            with safe_open(str(path), framework="pt") as f:
                saved_iter = int((f.metadata() or {}).get("iter", -1))
            load_model(model, str(path), strict=True, device=str(device))
        except RuntimeError as err:
            raise CheckpointError(
                f"{path} does not match the model built from its config.json: {_first_difference(err)}"
            ) from None
        except Exception as err:  # safetensors raises its own error type for truncated or corrupt files
            raise CheckpointError(f"{path} is corrupt or truncated ({_one_line(err)})") from None
        return saved_iter

    def load_trainer_state(self) -> dict[str, Any]:
        path = self.file(self.STATE)
        if not path.is_file():
            raise CheckpointError(f"no checkpoint in {self.path}: {self.STATE} is missing")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # truncated zip, unpickling errors: all mean a corrupt file
            raise CheckpointError(f"{path} is corrupt or truncated ({_one_line(err)})") from None
        if not isinstance(state, dict) or "iter" not in state:
            raise CheckpointError(f"{path} is not a geoattn trainer state")
        return state

    # ------------------------------------------------------------------ metrics ------------------
    @property
    def metrics_path(self) -> Path:
        return self.file(self.METRICS)

    def metrics(self) -> list[dict[str, Any]]:
        """Every record of ``metrics.jsonl`` (empty if there is none)."""
        path = self.metrics_path
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line]

    def truncate_metrics(self, last_iter: int) -> None:
        """Drop records written after ``last_iter``, so a resumed file equals an unbroken run's."""
        path = self.metrics_path
        if not path.exists():
            return
        kept = [
            line for line in path.read_text().splitlines() if line and json.loads(line)["iter"] <= last_iter
        ]
        self._atomic_write(self.METRICS, lambda p: p.write_text("".join(line + "\n" for line in kept)))

    def last_evaluation(self) -> dict[str, Any]:
        """The last record with a validation loss ({} if none)."""
        evaluated = [r for r in self.metrics() if r.get("val_loss") is not None]
        return dict(evaluated[-1]) if evaluated else {}

    def write_summary(self, summary: dict[str, Any]) -> None:
        self._write_json(self.SUMMARY, summary)

    def read_summary(self) -> dict[str, Any]:
        path = self.file(self.SUMMARY)
        return json.loads(path.read_text()) if path.exists() else {}

    def write_evaluation(
        self, rows: list[dict[str, Any]], name: str = EVALUATION, sets: dict[str, str] | None = None
    ) -> None:
        """The evaluation rows, in ``name`` (a peer's run keeps one file per task it is measured on), with
        ``sets`` (set name → sha256 of its samples) where the task records what it read."""
        self._write_json(name, {"rows": rows, **({"sets": sets} if sets else {})})

    def read_evaluation_sets(self, name: str = EVALUATION) -> dict[str, str]:
        """The ``sets`` an evaluation file records (empty when it records none or does not exist)."""
        path = self.file(name)
        return dict(json.loads(path.read_text()).get("sets", {})) if path.exists() else {}

    def read_evaluation(self, name: str = EVALUATION) -> list[dict[str, Any]]:
        path = self.file(name)
        return json.loads(path.read_text())["rows"] if path.exists() else []

    # ------------------------------------------------------------------ plots and report ---------
    def plot(self, model: TaskModel, x: torch.Tensor | None) -> list[Path]:
        """Every plot that applies: loss curves; the attention map of ``x`` (a validation batch) if the
        model shows one; the RT precision if it has an RT layer; the model's own (``model.plots``).

        Clearing a run (``--force``) removes the PNGs named in ``PLOTS``; a model's own plots are
        named ``model_*.png`` (and a task's, written by the trainer, ``task_*.png``) so they are cleared
        too."""
        written = [plots.loss_curves(self.metrics(), self.file("loss.png"), title=self.path.name)]
        if x is not None:
            maps = model.attention_maps(x[:1]) if x is not None else []
            if maps:
                written.append(plots.attention_map(maps[0][0, 0], self.file("attention.png")))
        params = model.rt_filter_parameters()
        if params is not None:
            written.append(plots.rt_precision(params, self.file("precision.png")))
        return written + model.plots(self.path)

    def report(self, result: dict[str, Any], written: list[Path]) -> str:
        """What ``geoattn train`` prints at the end of a run."""
        if result.get("interrupted"):
            return (
                f"interrupted at iter {result['iter']}: checkpoint saved in {self.path}; "
                f"continue with: geoattn train --out {self.path} --resume"
            )
        # the last evaluation's estimates and the full-set metrics can share names: keep them apart
        full = "  ".join(f"{k} {v:.4g}" for k, v in result.get("final", {}).items())
        full = f"  | full sets: {full}" if full else ""
        lines = [f"{summary_line(result)}{full}  ({result['wall_s']:.1f} s)".replace("    ", "  ")]
        names = [n for n in self.FILES if self.file(n).exists() and not n.endswith(".png")]
        lines.append(f"wrote {self.path}/: {' '.join(names + [p.name for p in written])}")
        return "\n".join(lines)
