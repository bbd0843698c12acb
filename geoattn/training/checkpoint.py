"""Checkpoints: ``model.safetensors`` + ``trainer_state.pt`` + ``config.json`` in the run directory.

Each file is written to a temporary name in the same directory and moved into place with
``os.replace`` (atomic on POSIX), so a crash while saving leaves the previous file intact. The
iteration is stored in both the weights' metadata and the trainer state, and loading checks that
they agree, which catches a crash between the renames.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_model, save_model
from torch import nn

MODEL_FILE = "model.safetensors"
STATE_FILE = "trainer_state.pt"
CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, or does not match the model it should load into."""


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_config(out: Path, config: dict[str, Any]) -> None:
    _atomic_write(out / CONFIG_FILE, lambda p: p.write_text(json.dumps(config, indent=2) + "\n"))


def save_checkpoint(
    out: Path, model: nn.Module, trainer_state: dict[str, Any], config: dict[str, Any]
) -> None:
    """Write the three checkpoint files of ``model`` (unwrapped, not DDP) at ``trainer_state["iter"]``."""
    out.mkdir(parents=True, exist_ok=True)
    meta = {"iter": str(trainer_state["iter"])}
    _atomic_write(out / MODEL_FILE, lambda p: save_model(model, str(p), metadata=meta))
    _atomic_write(out / STATE_FILE, lambda p: torch.save(trainer_state, p))
    write_config(out, config)


def has_checkpoint(out: Path) -> bool:
    return (out / MODEL_FILE).exists() or (out / STATE_FILE).exists()


def read_config(out: Path) -> dict[str, Any]:
    """The run's ``config.json``; CheckpointError when it is missing or unreadable."""
    path = out / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist: {out} holds no geoattn run")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(config, dict) or "train" not in config:
        raise CheckpointError(f"{path} has no 'train' section: not a geoattn run config")
    return config


def _one_line(err: Exception) -> str:
    return "; ".join(line.strip() for line in str(err).splitlines() if line.strip())


def _first_difference(err: RuntimeError, limit: int = 240) -> str:
    """The first of load_state_dict's complaints, shortened, and how many more there are."""
    details = [line.strip() for line in str(err).splitlines()[1:] if line.strip()] or [str(err)]
    first = details[0] if len(details[0]) <= limit else details[0][: limit - 3] + "..."
    return first + (f" (and {len(details) - 1} more)" if len(details) > 1 else "")


def load_weights(out: Path, model: nn.Module, device: torch.device | str = "cpu") -> int:
    """Load ``model.safetensors`` into ``model`` (strict); returns the iteration it was saved at."""
    path = out / MODEL_FILE
    if not path.is_file():
        raise CheckpointError(f"no checkpoint in {out}: {MODEL_FILE} is missing")
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


def load_trainer_state(out: Path) -> dict[str, Any]:
    path = out / STATE_FILE
    if not path.is_file():
        raise CheckpointError(f"no checkpoint in {out}: {STATE_FILE} is missing")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated zip, unpickling errors: all mean a corrupt file
        raise CheckpointError(f"{path} is corrupt or truncated ({_one_line(err)})") from None
    if not isinstance(state, dict) or "iter" not in state:
        raise CheckpointError(f"{path} is not a geoattn trainer state")
    return state
