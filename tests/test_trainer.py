"""The trainer: schedule, metrics, checkpoints, exact resume, Ctrl-C, plots, and that it learns."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch
from conftest import SHAKESPEARE
from torch import nn

from geoattn.core.errors import CheckpointError
from geoattn.models.base import decay_groups
from geoattn.tasks.lm import LMTask
from geoattn.training import run_dir
from geoattn.training.config import TrainConfig
from geoattn.training.run_dir import RunDirectory
from geoattn.training.trainer import Trainer, make_optimizer, run_model, scheduled_lr


@pytest.fixture(scope="module")
def task() -> LMTask:
    return LMTask(SHAKESPEARE, block_size=16)


def tiny(out: Path, **fields) -> TrainConfig:
    """1 layer, 32 wide, context 16: a few iterations take well under a second."""
    values = dict(
        task="lm",
        model="transformer",
        data=str(SHAKESPEARE),
        out=str(out),
        n_layer=1,
        n_head=2,
        n_embd=32,
        block_size=16,
        batch_size=8,
        max_iters=20,
        eval_interval=10,
        eval_iters=2,
        warmup_iters=4,
        lr=3e-3,
        min_lr=3e-4,
        plots=False,
    )
    return TrainConfig(**{**values, **fields})


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / RunDirectory.METRICS).read_text().splitlines()]


def test_schedule_warms_up_linearly_then_follows_a_cosine_to_min_lr():
    config = TrainConfig(lr=1.0, min_lr=0.1, warmup_iters=10, max_iters=110)
    assert [scheduled_lr(i, config) for i in range(3)] == pytest.approx([1 / 11, 2 / 11, 3 / 11])
    assert scheduled_lr(10, config) == pytest.approx(1.0)
    assert scheduled_lr(60, config) == pytest.approx(0.55)  # half way: the mean of lr and min_lr
    assert scheduled_lr(35, config) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))
    assert scheduled_lr(110, config) == scheduled_lr(500, config) == pytest.approx(0.1)
    decay = [scheduled_lr(i, config) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))


def test_exponential_schedule_and_a_min_lr_relative_to_lr():
    gatr = TrainConfig(lr=3e-4, lr_schedule="exponential", warmup_iters=0, max_iters=2000)
    assert gatr.final_lr == pytest.approx(3e-6)  # GATr: decay to x0.01
    assert scheduled_lr(1000, gatr) == pytest.approx(3e-4 * 0.01**0.5)
    assert scheduled_lr(2000, gatr) == pytest.approx(3e-6)
    # lr below the old fixed min_lr default no longer fails; cosine decays to lr/10 unless told
    low = TrainConfig(lr=5e-5)
    assert low.final_lr == pytest.approx(5e-6) and scheduled_lr(5000, low) == pytest.approx(5e-6)
    with pytest.raises(ValueError, match="min_lr <= lr"):
        TrainConfig(lr=1e-4, min_lr=1e-3)


def test_hold_keeps_the_peak_rate_before_the_decay_and_adam_adds_an_l2_term():
    """Warmup-stable-decay (CGENN's schedule): lr held ``hold_iters`` steps after the warmup, then the
    whole cosine in the steps left; ``optimizer="adam"``: the weight decay enters the gradient (one Adam
    step from zero moments moves a parameter by lr·sign(g + wd·p)), where AdamW shrinks it apart."""
    config = TrainConfig(lr=1.0, min_lr=0.1, warmup_iters=10, hold_iters=50, max_iters=110)
    assert scheduled_lr(10, config) == scheduled_lr(59, config) == pytest.approx(1.0)
    assert scheduled_lr(85, config) == pytest.approx(0.55)  # half way through the 50-step cosine
    assert scheduled_lr(110, config) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="hold_iters must be >= 0"):
        TrainConfig(hold_iters=-1)
    with pytest.raises(ValueError, match=r"warmup_iters \+ hold_iters \(10 \+ 100\) must end before"):
        TrainConfig(warmup_iters=10, hold_iters=100, max_iters=110)
    with pytest.raises(ValueError, match="optimizer must be one of adamw, adam"):
        TrainConfig(optimizer="sgd")
    layer = nn.Linear(1, 1, bias=False)
    layer.optim_groups = lambda wd: decay_groups(layer, wd)  # what a TaskModel gives the trainer
    steps = {}
    for kind in ("adam", "adamw"):
        with torch.no_grad():
            layer.weight.fill_(1.0)
        opt = make_optimizer(layer, TrainConfig(lr=0.1, weight_decay=10.0, optimizer=kind))
        layer.weight.grad = torch.full_like(layer.weight, -1.0)  # alone it would raise the weight
        opt.step()
        steps[kind] = layer.weight.item() - 1.0
    assert isinstance(make_optimizer(layer, TrainConfig(optimizer="adam")), torch.optim.Adam)
    assert steps["adam"] == pytest.approx(-0.1, rel=1e-4)  # g + wd·p = 9 > 0: the L2 term wins
    assert steps["adamw"] == pytest.approx(-0.1 * 10.0 + 0.1, rel=1e-4)  # shrink by lr·wd, step up by lr


def test_weight_decay_falls_back_to_matrices_only():
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    decayed, plain = decay_groups(model, 0.1)
    assert {p.dim() for p in decayed["params"]} == {2} and decayed["weight_decay"] == 0.1
    assert {p.dim() for p in plain["params"]} == {1} and plain["weight_decay"] == 0.0
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))


def test_metrics_config_and_checkpoint_files(task, tmp_path):
    out = tmp_path / "run"
    result = Trainer(tiny(out, max_iters=12, eval_interval=5), task, out, verbose=False).train()
    lines = records(out)
    assert [r["iter"] for r in lines] == list(range(1, 13))
    evaluated = [r["iter"] for r in lines if r["val_loss"] is not None]
    assert evaluated == [5, 10, 12]  # every eval_interval and the last step
    for r in lines:
        assert {"iter", "train_loss", "val_loss", "lr", "tokens_per_s"} <= r.keys()
        assert r["tokens_per_s"] > 0 and math.isfinite(r["train_loss"])
    assert lines[-1]["val_loss"] == result["val_loss"] and result["iter"] == 12
    files = ["config.json", "metrics.jsonl", "model.safetensors", "summary.json", "trainer_state.pt"]
    assert sorted(p.name for p in out.iterdir()) == files
    config = json.loads((out / "config.json").read_text())
    assert config["train"]["n_embd"] == 32 and config["train"]["max_iters"] == 12
    assert config["task"]["vocab"] == task.vocab
    assert config["model"]["n_embd"] == 32 and config["model"]["vocab_size"] == 65
    assert RunDirectory(out).load_trainer_state()["iter"] == 12


def test_evaluation_uses_the_same_batches_every_time(task, tmp_path):
    trainer = Trainer(tiny(tmp_path), task, tmp_path, verbose=False)
    first, second = trainer.evaluate(), trainer.evaluate()
    assert first == second
    assert set(first) == {"train_eval_loss", "val_loss"}
    state = trainer.data_generator.get_state()
    trainer.evaluate()
    assert torch.equal(state, trainer.data_generator.get_state())  # evaluation never moves the training data


def _interrupt_at(monkeypatch, step: int, how: str) -> None:
    """Ctrl-C while step ``step`` draws its batch: a real SIGINT, or a KeyboardInterrupt raised there."""
    original_step, original_batch = Trainer._step, LMTask.get_batch
    current = {"step": 0}

    def _step(self):
        current["step"] = self.iter + 1
        try:
            return original_step(self)
        finally:
            current["step"] = 0

    def get_batch(self, split, *args, **kwargs):
        batch = original_batch(self, split, *args, **kwargs)  # the generator moves before the interrupt
        if current["step"] == step:
            if how == "sigint":
                os.kill(os.getpid(), signal.SIGINT)
            else:
                raise KeyboardInterrupt
        return batch

    monkeypatch.setattr(Trainer, "_step", _step)
    monkeypatch.setattr(LMTask, "get_batch", get_batch)


@pytest.mark.parametrize("model, how", [("transformer", "sigint"), ("rt", "keyboardinterrupt")])
def test_ctrl_c_saves_and_resume_continues_exactly(task, tmp_path, monkeypatch, model, how):
    # dropout draws from the global RNG, so this also checks that its state is restored
    config = dict(model=model, dropout=0.1, max_iters=16, eval_interval=5)
    full = tmp_path / "full"
    Trainer(tiny(full, **config), task, full, verbose=False).train()

    part = tmp_path / "part"
    with monkeypatch.context() as patch:
        _interrupt_at(patch, step=8, how=how)
        result = Trainer(tiny(part, **config), task, part, verbose=False).train()
    # SIGINT stops after finishing step 8; an exception inside step 8 rewinds to step 7
    stopped = 8 if how == "sigint" else 7
    assert result["interrupted"] and result["iter"] == stopped
    assert RunDirectory(part).load_trainer_state()["iter"] == stopped
    assert [r["iter"] for r in records(part)][-1] == stopped

    resumed = Trainer(tiny(part, **config), task, part, verbose=False)
    resumed.resume()
    assert resumed.iter == stopped
    assert not resumed.train()["interrupted"]
    expected, got = records(full), records(part)
    assert [r["iter"] for r in got] == [r["iter"] for r in expected]
    for a, b in zip(expected, got):
        assert b["train_loss"] == pytest.approx(a["train_loss"], abs=1e-6), a["iter"]
        assert b["lr"] == a["lr"]
        assert (a["val_loss"] is None) == (b["val_loss"] is None)
        if a["val_loss"] is not None:
            assert b["val_loss"] == pytest.approx(a["val_loss"], abs=1e-6)


def test_resume_with_more_iterations_matches_one_long_run(task, tmp_path):
    # the schedule is pinned by lr_decay_iters, so stopping at 8 and extending to 16 is one run
    full, part = tmp_path / "full", tmp_path / "part"
    Trainer(tiny(full, max_iters=16, lr_decay_iters=16, eval_interval=4), task, full, verbose=False).train()
    Trainer(tiny(part, max_iters=8, lr_decay_iters=16, eval_interval=4), task, part, verbose=False).train()
    trainer = Trainer(tiny(part, max_iters=16, lr_decay_iters=16, eval_interval=4), task, part, verbose=False)
    trainer.resume()
    trainer.train()
    expected = [(r["iter"], r["train_loss"], r["val_loss"]) for r in records(full)]
    got = [(r["iter"], r["train_loss"], r["val_loss"]) for r in records(part)]
    assert got == expected


def test_resume_drops_metrics_written_after_the_checkpoint(task, tmp_path):
    out = tmp_path / "run"
    Trainer(tiny(out, max_iters=10, eval_interval=5), task, out, verbose=False).train()
    # a crash after iter 10's checkpoint but before the next: lines 11..12 must not survive a resume
    with open(out / RunDirectory.METRICS, "a") as f:
        for i in (11, 12):
            f.write(json.dumps({"iter": i, "train_loss": 0.0, "val_loss": None, "lr": 0.0}) + "\n")
    trainer = Trainer(tiny(out, max_iters=12, eval_interval=5), task, out, verbose=False)
    trainer.resume()
    trainer.train()
    lines = records(out)
    assert [r["iter"] for r in lines] == list(range(1, 13))
    assert all(r["train_loss"] > 0 for r in lines)


def test_an_inconsistent_or_truncated_checkpoint_is_refused(task, tmp_path):
    out = tmp_path / "run"
    trainer = Trainer(tiny(out, max_iters=4, eval_interval=2), task, out, verbose=False)
    trainer.train()
    state = RunDirectory(out).load_trainer_state()
    torch.save({**state, "iter": 3}, out / RunDirectory.STATE)
    with pytest.raises(CheckpointError, match="inconsistent: weights at iter 4, trainer state at iter 3"):
        Trainer(tiny(out, max_iters=8), task, out, verbose=False).resume()
    data = (out / RunDirectory.STATE).read_bytes()
    (out / RunDirectory.STATE).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="trainer_state.pt is corrupt or truncated"):
        Trainer(tiny(out, max_iters=8), task, out, verbose=False).resume()


def test_checkpoints_are_written_atomically(task, tmp_path, monkeypatch):
    out = tmp_path / "run"
    Trainer(tiny(out, max_iters=2, eval_interval=2), task, out, verbose=False).train()
    before = (out / RunDirectory.WEIGHTS).read_bytes()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(run_dir.torch, "save", crash)
    trainer = Trainer(tiny(out, max_iters=4, eval_interval=2), task, out, verbose=False)
    trainer.resume()
    with pytest.raises(OSError, match="disk full"):
        trainer.train()
    # the new weights went in, the trainer state did not: no temporary files, old state intact
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]
    assert RunDirectory(out).load_trainer_state()["iter"] == 2
    assert (out / RunDirectory.WEIGHTS).read_bytes() != before
    with pytest.raises(CheckpointError, match="inconsistent"):
        Trainer(tiny(out, max_iters=4), task, out, verbose=False).resume()


@pytest.mark.parametrize("model, lr", [("transformer", 1e-2), ("rt", 5e-2)])
def test_training_reaches_a_loss_an_untrained_model_cannot(task, tmp_path, model, lr):
    # untrained: ln 65 = 4.17 nats/char; unigram statistics alone: 3.31 (measured: about 2.8 / 2.5 here)
    out = tmp_path / model
    config = tiny(
        out,
        model=model,
        max_iters=150,
        eval_interval=150,
        eval_iters=4,
        batch_size=16,
        lr=lr,
        min_lr=lr / 10,
        warmup_iters=10,
    )
    trainer = Trainer(config, task, out, verbose=False)
    assert trainer.train()["val_loss"] < 3.0
    x, _ = task.get_batch("val", 1, torch.Generator().manual_seed(0))
    written = {p.name for p in RunDirectory(out).plot(trainer.model, x)}
    expected = {"loss.png", "attention.png"} | ({"precision.png"} if model == "rt" else set())
    assert written == expected
    for name in expected:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_for_a_model_without_rt_layers(task, tmp_path):
    # RFA layers also have precision_parameters (mu, sigma2, ...): no RT precision plot for them
    trainer = Trainer(
        tiny(tmp_path, model="rfa", max_iters=2, eval_interval=2), task, tmp_path, verbose=False
    )
    trainer.train()
    x, _ = task.get_batch("val", 1, torch.Generator().manual_seed(0))
    assert {p.name for p in RunDirectory(tmp_path).plot(trainer.model, x)} == {"loss.png", "attention.png"}


def test_a_resumed_run_reports_the_wall_time_of_all_its_segments(task, tmp_path):
    out = tmp_path / "run"
    first = Trainer(tiny(out, max_iters=4, eval_interval=2), task, out, verbose=False).train()
    saved = RunDirectory(out).load_trainer_state()["wall_s"]
    assert 0 < saved <= first["wall_s"]
    resumed = Trainer(tiny(out, max_iters=8, eval_interval=2), task, out, verbose=False)
    resumed.resume()
    assert resumed.train()["wall_s"] > saved


@pytest.mark.parametrize("deterministic", [True, False])
def test_deterministic_algorithms_hold_while_training_and_are_restored(
    task, tmp_path, monkeypatch, deterministic
):
    # Compiled rt runs are reproducible across processes only with deterministic algorithms (a
    # fused scatter-add otherwise uses atomic adds): the trainer turns them on for its steps, as
    # asked, and gives the process its own setting back.
    seen = []
    step = Trainer._step

    def spy(self):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return step(self)

    monkeypatch.setattr(Trainer, "_step", spy)
    before = torch.are_deterministic_algorithms_enabled()
    config = tiny(tmp_path, max_iters=3, eval_interval=3, deterministic=deterministic)
    Trainer(config, task, tmp_path, verbose=False).train()
    assert seen == [deterministic] * 3
    assert torch.are_deterministic_algorithms_enabled() == before
    assert TrainConfig().deterministic  # on by default


@pytest.mark.parametrize("model", ["transformer", "rt"])
def test_the_fused_optimizer_updates_as_plain_adamw(task, tmp_path, model):
    # make_optimizer fuses AdamW's per-tensor operations into one kernel: the same update as the
    # unfused reference implementation, step for step, on every parameter group
    config = tiny(tmp_path, model=model)
    torch.manual_seed(0)
    fused_model = run_model(task, config)
    plain_model = run_model(task, config)
    plain_model.load_state_dict(fused_model.state_dict())
    fused = make_optimizer(fused_model, config)
    plain = torch.optim.AdamW(
        plain_model.optim_groups(config.weight_decay),
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        foreach=False,
    )
    assert fused.defaults["fused"] and not plain.defaults["fused"]
    x, y = task.get_batch("train", 8, torch.Generator().manual_seed(0), torch.device("cpu"))
    for _ in range(3):
        for m, opt in ((fused_model, fused), (plain_model, plain)):
            m(x, y)[1].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    for (name, a), b in zip(fused_model.named_parameters(), plain_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_keep_best_reports_the_weights_validation_chose(task, tmp_path, monkeypatch):
    """keep_best: the final metrics are those of the evaluation with the lowest validation loss (here
    scripted: iteration 10 of 5, 10, 15, 20), the last model's beside them as ``*_last``; both checked
    against the saved weights loaded into a fresh model, and the choice survives a resume."""
    scripted = iter([3.0, 1.0, 2.0, 1.5])
    real_evaluate = Trainer.evaluate

    def evaluate(self, eval_iters=None):
        return {**real_evaluate(self, eval_iters), "val_loss": next(scripted)}

    monkeypatch.setattr(Trainer, "evaluate", evaluate)
    out = tmp_path / "run"
    config = tiny(out, max_iters=10, lr_decay_iters=20, eval_interval=5, keep_best=True)
    Trainer(config, task, out, verbose=False).train()
    assert RunDirectory(out).load_trainer_state()["best"] == {"val_loss": 1.0, "iter": 10}
    trainer = Trainer(tiny(out, max_iters=20, lr_decay_iters=20, eval_interval=5, keep_best=True), task, out,
                      verbose=False)  # fmt: skip
    trainer.resume()
    result = trainer.train()
    final = result["final"]
    assert final["best_iter"] == 10
    for name, loader in (("", dict(best=True)), ("_last", {})):
        fresh = run_model(task, config)
        assert RunDirectory(out).load_weights(fresh, **loader) == (10 if name == "" else 20)
        expected = task.final_metrics(fresh, torch.device("cpu"))
        for key, value in expected.items():
            assert final[key + name] == pytest.approx(value, rel=1e-6)
    assert final["val_loss_full"] != final["val_loss_full_last"]
    assert "best.safetensors" in {p.name for p in out.iterdir()}


def test_without_keep_best_the_final_model_is_reported(task, tmp_path):
    out = tmp_path / "run"
    result = Trainer(tiny(out, max_iters=10, eval_interval=5), task, out, verbose=False).train()
    assert "best_iter" not in result["final"] and not (out / "best.safetensors").exists()


def test_a_training_step_reads_nothing_on_the_host_until_a_line_is_due(task, tmp_path, monkeypatch):
    """The loss stays on the device between log lines: no tensor is read on the host (``float``,
    ``item``, ``tolist``) in the steps between them; at a due step the loss is read once."""
    from geoattn.training import trainer as trainer_module

    trainer = Trainer(
        tiny(tmp_path, max_iters=8, log_interval=4, eval_interval=8), task, tmp_path, verbose=False
    )
    reads: list[int] = []
    counting = [True]
    for name in ("__float__", "item", "tolist", "__bool__"):
        real = getattr(torch.Tensor, name)

        def spy(self, *args, _real=real, **kwargs):
            if counting[0]:
                reads.append(trainer.iter)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    real_evaluate, real_final = trainer.evaluate, trainer._final_metrics

    def uncounted(fn):
        def wrapped(*args, **kwargs):
            counting[0] = False
            try:
                return fn(*args, **kwargs)
            finally:
                counting[0] = True

        return wrapped

    monkeypatch.setattr(trainer, "evaluate", uncounted(real_evaluate))
    monkeypatch.setattr(trainer, "_final_metrics", uncounted(real_final))
    synced = []
    real_host_value = trainer_module.host_value
    monkeypatch.setattr(
        trainer_module, "host_value", lambda x: synced.append(trainer.iter) or real_host_value(x)
    )
    trainer.train()
    assert synced == [4, 8]  # the loss read at the due steps only
    assert set(reads) <= {4, 8}, reads  # and nothing else read on the host in steps 1-3, 5-7
    assert [r["iter"] for r in records(tmp_path)] == [4, 8]
    assert all(isinstance(r["train_loss"], float) for r in records(tmp_path))
