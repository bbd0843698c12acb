"""``geoattn export``: a training run's language model as a ``transformers`` model directory.

The directory holds ``config.json`` (the per-model :class:`~geoattn.hf.modeling.GeoattnConfig`),
``generation_config.json``, ``model.safetensors`` (the run's weights, keys prefixed ``model.``) and
the character tokenizer (``tokenizer.json``, ``tokenizer_config.json``). After ``import geoattn.hf``,
``AutoModelForCausalLM.from_pretrained(DIR)`` and ``AutoTokenizer.from_pretrained(DIR)`` load it.
"""

from __future__ import annotations

from pathlib import Path

from geoattn.core.errors import ConfigError
from geoattn.hf.modeling import GeoattnForCausalLM
from geoattn.hf.tokenizer import char_tokenizer

__all__ = ["export_run"]


def export_run(out: str | Path, to: str | Path, *, force: bool = False) -> Path:
    """Write the lm run in ``out`` (``geoattn train --task lm``) as a ``transformers`` directory ``to``.

    Args:
        out: the run directory (its last checkpoint is exported).
        to: the directory to write (created).
        force: write into a non-empty ``to`` (files of the same names are replaced).

    Raises:
        ConfigError: not an lm run, or ``to`` is not empty and ``force`` is not set.
        CheckpointError: the run's files are missing or do not match.
    """
    from geoattn.training.evaluate import load_run

    to = Path(to)
    if to.exists() and (not to.is_dir() or (any(to.iterdir()) and not force)):
        raise ConfigError(f"--to {to} exists and is not an empty directory (pass --force to write into it)")
    run = load_run(out, device="cpu", load_data=False)
    if run.config.task != "lm":
        raise ConfigError(f"geoattn export needs an lm run; {run.out} is a {run.config.task} run")
    model = GeoattnForCausalLM.from_task_model(
        run.model, name=run.config.model, vocab=run.task.vocab, block_size=run.task.block_size
    )
    model.save_pretrained(to)
    char_tokenizer(run.task.vocab, block_size=run.task.block_size).save_pretrained(to)
    return to
