"""Character-level language modelling on any UTF-8 text file (nanoGPT's shakespeare_char recipe).

The vocabulary is the sorted set of characters of the file; it is part of :meth:`LMTask.meta`, so a
checkpoint can encode prompts and decode samples without the text. The first 90 % of the characters
are the training split, the last 10 % the validation split. A batch is ``batch_size`` random windows
of ``block_size + 1`` characters drawn with the trainer's generator: ``x`` the first ``block_size``
ids, ``y`` the same shifted by one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from geoattn.tasks.base import Task

TRAIN_FRACTION = 0.9


def read_text(path: str | Path) -> str:
    """The file as text; ValueError (naming the file) when it is missing, empty or not UTF-8."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data file {path} does not exist or is not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"data file {path} is not UTF-8 text (byte {err.start}: {err.reason})") from None
    if not text:
        raise ValueError(f"data file {path} is empty")
    return text


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
    models: ClassVar[tuple[str, ...]] = ("transformer", "rt", "rfa", "ngpt")

    def __init__(self, data: str | Path | None, block_size: int, vocab: str | None = None):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.data = None if data is None else str(data)
        self.splits: dict[str, Tensor] = {}
        text = None if data is None else read_text(data)
        if vocab is None:
            if text is None:
                raise ValueError(
                    "the lm task needs --data FILE (a UTF-8 text file) or a checkpoint's vocabulary"
                )
            vocab = "".join(sorted(set(text)))
        self.vocab = vocab
        self.stoi = {ch: i for i, ch in enumerate(vocab)}
        if text is not None:
            ids = self.encode(text)
            n_train = int(TRAIN_FRACTION * len(ids))
            self.splits = {"train": ids[:n_train], "val": ids[n_train:]}
            for split, data_ids in self.splits.items():
                if len(data_ids) < block_size + 1:
                    raise ValueError(
                        f"data file {data} has {len(data_ids)} characters in its {split} split, fewer than "
                        f"block_size + 1 = {block_size + 1}; use a longer text or a smaller --block-size"
                    )

    @classmethod
    def from_meta(cls, meta: dict[str, Any], data: str | Path | None = None, block_size: int | None = None):
        """The task a checkpoint was trained on (its vocabulary), optionally with the text to evaluate."""
        return cls(data, block_size or meta["block_size"], vocab=meta["vocab"])

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> Tensor:
        """``(len(text),)`` int64 ids; ValueError listing characters outside the vocabulary."""
        unknown = sorted(set(text) - self.stoi.keys())
        if unknown:
            raise ValueError(f"characters not in the vocabulary: {''.join(unknown)!r}")
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
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    def build_model(self, model: str, config: Any) -> nn.Module:
        """``build_lm(model, LMConfig)`` with the trainer's sizes and its ``model_options``."""
        if model not in self.models:
            raise ValueError(f"the lm task supports models {', '.join(self.models)}, not {model!r}")
        from geoattn.models.lm import LMConfig, build_lm

        options = dict(getattr(config, "model_options", {}) or {})
        valid = {f.name for f in dataclasses.fields(LMConfig)} - {"vocab_size", "block_size"}
        unknown = sorted(set(options) - valid)
        if unknown:
            raise ValueError(
                f"unknown model option(s) {', '.join(unknown)}; valid: {', '.join(sorted(valid))}"
            )
        sizes = {
            k: getattr(config, k) for k in ("n_layer", "n_head", "n_embd", "dropout") if hasattr(config, k)
        }
        lm_config = LMConfig(vocab_size=self.vocab_size, block_size=self.block_size, **{**sizes, **options})
        return build_lm(model, lm_config)

    def meta(self) -> dict[str, Any]:
        return {"task": self.name, "vocab": self.vocab, "block_size": self.block_size, "data": self.data}
