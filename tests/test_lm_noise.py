"""The noisy-tokens setting of the lm task (#10): corrupted inputs, clean targets, key norms by corruption."""

from __future__ import annotations

import pytest
import torch
from conftest import SHAKESPEARE

from geoattn.models.lm import LMConfig, build_lm
from geoattn.tasks.lm import LMTask
from geoattn.training.config import TrainConfig
from geoattn.training.trainer import run_task


def test_corrupted_inputs_and_the_key_norms_by_corruption(tmp_path):
    small = tmp_path / "small.txt"
    small.write_text(SHAKESPEARE.read_text(encoding="utf-8")[:20000], encoding="utf-8")
    config = TrainConfig(task="lm", data=str(small), block_size=16, task_options={"corrupt": 0.3})
    task = run_task(config)
    x, y = task.get_batch("train", 64, torch.Generator().manual_seed(0))
    clean_x, clean_y = LMTask(small, block_size=16).get_batch("train", 64, torch.Generator().manual_seed(0))
    assert torch.equal(y, clean_y)  # targets stay clean
    changed = (x != clean_x).float().mean()
    assert 0.2 < changed < 0.35  # 30 % replaced (a replacement may draw the same id)
    torch.manual_seed(0)
    config_lm = LMConfig(vocab_size=task.vocab_size, block_size=16, n_layer=1, n_head=2, n_embd=32)
    model = build_lm("rt", config_lm)
    metrics = task.final_metrics(model, torch.device("cpu"))
    assert {"val_loss_full", "val_loss_full_noisy", "key_norm_ratio"} <= set(metrics)
    assert metrics["key_norm_corrupted"] > 0 and metrics["key_norm_clean"] > 0
    with pytest.raises(ValueError, match="task.corrupt must be in"):
        run_task(TrainConfig(task="lm", data=str(small), task_options={"corrupt": 1.5}))
