"""Character-level language modelling on any UTF-8 text file (nanoGPT's shakespeare_char recipe).

The vocabulary is the sorted set of characters of the file; it is part of :meth:`LMTask.meta`, so a
checkpoint can encode prompts and decode samples without the text. The first 90 % of the characters
are the training split, the last 10 % the validation split (``task.selection`` carves a model-selection
split off the end of the training split, :class:`LMSettings`). A batch is ``batch_size`` random windows
of ``block_size + 1`` characters drawn with the trainer's generator: ``x`` the first ``block_size``
ids, ``y`` the same shifted by one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from geoattn.core.errors import ConfigError, DataError
from geoattn.models.base import TaskModel
from geoattn.tasks.base import EvalRow, ModelRow, Task
from geoattn.tasks.lm.analysis import key_norms_by_corruption, noisy_split_loss
from geoattn.tasks.lm.models import LM_TASK_TABLE

TRAIN_FRACTION = 0.9
CONTEXT_MULTIPLES = (1, 2, 4, 8, 16)


def read_text(path: str | Path) -> str:
    """The file as text; ValueError (naming the file) when it is missing, empty or not UTF-8."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist or is not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"data file {path} is not UTF-8 text (byte {err.start}: {err.reason})") from None
    if not text:
        raise DataError(f"data file {path} is empty")
    return text


@dataclass
class LMSettings:
    """Settings of the lm task (``--set task.KEY=VALUE``).

    corrupt: fraction of input characters replaced by uniformly random ones in every batch (targets
        stay clean): the noisy-token test of "magnitude encodes confidence" (0 = clean text).
    selection: fraction of the training split held out at its end for model selection (0: none). With
        it, the run trains on the rest, its "val" split *is* that held-out text (reported as
        ``select_loss_full``), and the validation split is never read, so a setting chosen on it can
        be reported on the validation split once, by a run without it.
    """

    corrupt: float = 0.0
    selection: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.corrupt < 1.0:
            raise ConfigError(f"task.corrupt must be in [0, 1), got {self.corrupt}")
        if not 0.0 <= self.selection < 1.0:
            raise ConfigError(f"task.selection must be in [0, 1), got {self.selection}")


class LMTask(Task):
    """Next-character prediction; the metric is the loss itself (nats per character).

    Args:
        data: path of a UTF-8 text file. May be ``None`` when ``vocab`` is given (sampling from a
            checkpoint needs only the vocabulary).
        block_size: training context length T.
        vocab: the character vocabulary to use instead of the file's own (a checkpoint's); every
            character of the file must be in it.
    """

    name: ClassVar[str] = "lm"
    table: ClassVar[dict[str, ModelRow]] = LM_TASK_TABLE
    Settings: ClassVar[type] = LMSettings
    description: ClassVar[str] = "character-level language modelling on a UTF-8 text (nanoGPT's recipe)"

    def __init__(
        self,
        data: str | Path | None,
        block_size: int,
        vocab: str | None = None,
        settings: LMSettings | None = None,
    ):
        self.settings = settings or LMSettings()
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.data = None if data is None else str(data)
        self.splits: dict[str, Tensor] = {}
        text = None if data is None else read_text(data)
        if vocab is None:
            if text is None:
                raise DataError(
                    "the lm task needs --data FILE (a UTF-8 text file) or a checkpoint's vocabulary"
                )
            vocab = "".join(sorted(set(text)))
        self.vocab = vocab
        self.stoi = {ch: i for i, ch in enumerate(vocab)}
        if text is not None:
            ids = self.encode(text)
            n_train = int(TRAIN_FRACTION * len(ids))
            self.splits = {"train": ids[:n_train], "val": ids[n_train:]}
            if self.settings.selection:
                n_fit = n_train - int(self.settings.selection * n_train)
                self.splits = {"train": ids[:n_fit], "val": ids[n_fit:n_train]}
            for split, data_ids in self.splits.items():
                if len(data_ids) < block_size + 1:
                    raise DataError(
                        f"data file {data} has {len(data_ids)} characters in its {split} split, fewer than "
                        f"block_size + 1 = {block_size + 1}; use a longer text or a smaller --block-size"
                    )

    @classmethod
    def from_settings(
        cls,
        settings: LMSettings,
        *,
        data: str | None,
        block_size: int,
        meta: dict[str, Any] | None,
        load_data: bool,
    ) -> LMTask:
        """``--data`` (a file or a registered dataset name) at ``--block-size``; a checkpoint's
        vocabulary when resuming or loading (so ids keep their meaning)."""
        from geoattn.tasks.lm.datasets import resolve_data

        data = data if load_data else None
        if data is None and meta is None:
            raise DataError(
                "the lm task needs --data FILE (a UTF-8 text file, or a dataset name: tinyshakespeare)"
            )
        path = None if data is None else resolve_data(data)
        vocab = None if meta is None else meta["vocab"]
        return cls(path, block_size, vocab=vocab, settings=settings)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> Tensor:
        """``(len(text),)`` int64 ids; ValueError listing characters outside the vocabulary."""
        unknown = sorted(set(text) - self.stoi.keys())
        if unknown:
            raise DataError(f"characters not in the vocabulary: {''.join(unknown)!r}")
        return torch.tensor([self.stoi[ch] for ch in text], dtype=torch.long)

    def decode(self, ids: Tensor | list[int]) -> str:
        return "".join(self.vocab[i] for i in (ids.tolist() if isinstance(ids, Tensor) else ids))

    def get_batch(
        self,
        split: str,
        batch_size: int,
        generator: torch.Generator,
        device: torch.device | str = "cpu",
        block_size: int | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``x, y``: ``(batch_size, T)`` int64, ``T = block_size`` (default: the training context)."""
        if split not in self.splits:
            raise ValueError(
                f"unknown split {split!r}; the lm task has {', '.join(self.splits) or 'no data'}"
            )
        T = block_size or self.block_size
        data = self.splits[split]
        if len(data) < T + 1:
            raise ValueError(f"the {split} split has {len(data)} characters, too few for windows of {T + 1}")
        starts = torch.randint(len(data) - T, (batch_size,), generator=generator)
        windows = data[starts[:, None] + torch.arange(T + 1)]  # (B, T+1)
        x, y = windows[:, :-1], windows[:, 1:]
        if self.settings.corrupt > 0:  # inputs only: the targets stay the clean text
            noisy = torch.rand(x.shape, generator=generator) < self.settings.corrupt
            x = torch.where(noisy, torch.randint(self.vocab_size, x.shape, generator=generator), x)
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    # ------------------------------------------------------------------ evaluation ---------------
    @torch.no_grad()
    def split_loss(
        self,
        model: TaskModel,
        split: str = "val",
        *,
        context: int | None = None,
        batch_size: int = 64,
        device: torch.device | str = "cpu",
    ) -> float:
        """Mean loss (nats/char) over the *whole* ``split`` in non-overlapping windows of ``context``.

        Every character of the split but the first is predicted exactly once, from its position in its
        window (windows start at 0, T, 2T, ...; the tail shorter than T is dropped). Inputs are the
        clean text even when ``corrupt`` is set, so the number measures the language model.
        """
        T = context or self.block_size
        data = self.splits[split]
        n = (len(data) - 1) // T
        if n < 1:
            raise DataError(
                f"the {split} split has {len(data)} characters, too few for one window of {T + 1}"
            )
        was_training = model.training
        model.eval()
        total = 0.0
        for start in range(0, n, batch_size):
            rows = torch.arange(start, min(start + batch_size, n))
            index = rows[:, None] * T + torch.arange(T + 1)  # (b, T + 1)
            windows = data[index].to(device)
            _, loss = model(windows[:, :-1], windows[:, 1:])
            total += float(loss) * len(rows)
        model.train(was_training)
        return total / n

    def final_metrics(self, model: TaskModel, device: torch.device) -> dict[str, float]:
        """``val_loss_full``: the loss over the whole validation split at the training context (clean
        inputs). With ``corrupt`` > 0 also ``val_loss_full_noisy`` (inputs corrupted at that rate, the
        same corruption for every model) and the mean key norms at corrupted vs clean positions."""
        if "val" not in self.splits:
            return {}
        key = "select_loss_full" if self.settings.selection else "val_loss_full"
        results = {key: self.split_loss(model, "val", device=device)}
        p = self.settings.corrupt
        if p > 0:
            val, V = self.splits["val"], self.vocab_size
            was_training = model.training
            model.eval()
            noisy = noisy_split_loss(model, val, self.block_size, p, V, device=device)
            results["val_loss_full_noisy"] = noisy
            results.update(key_norms_by_corruption(model, val, self.block_size, p, V, device=device))
            model.train(was_training)
        return results

    def evaluation(
        self,
        model: TaskModel,
        device: torch.device,
        sampled: Callable[[], dict[str, float]],
        *,
        over: str,
    ) -> list[EvalRow]:
        """Val loss over the whole validation split at 1×, 2×, 4×, 8×, 16× the training context (length
        extrapolation; a model that cannot run that long says why), then the batch estimates."""
        rows = []
        n_val = len(self.splits["val"])
        for k in CONTEXT_MULTIPLES:
            T = k * self.block_size
            try:
                value: float | str = self.split_loss(model, "val", context=T, device=device)
            except (ValueError, RuntimeError) as err:
                value = f"n/a: {str(err).splitlines()[0]}"
            rows.append(EvalRow(f"val_loss @ {T} ({k}×)", value, f"full val split ({n_val:,} chars)"))
        rows += [EvalRow(key, value, over) for key, value in sampled().items()]
        return rows

    def sample(
        self,
        model: TaskModel,
        prompt: str,
        *,
        max_new_tokens: int = 200,
        temperature: float = 1.0,
        top_k: int | None = None,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> str:
        """``prompt`` followed by ``max_new_tokens`` sampled characters."""
        idx = self.encode(prompt)[None].to(device)  # (1, T)
        torch.manual_seed(seed)
        with torch.no_grad():
            ids = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k)
        return self.decode(ids[0])

    def meta(self) -> dict[str, Any]:
        return {"task": self.name, "vocab": self.vocab, "block_size": self.block_size, "data": self.data}
