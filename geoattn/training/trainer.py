"""The one training loop for every task and model.

AdamW (betas 0.9/0.95), linear warmup then a cosine (nanoGPT) or exponential (GATr) decay to
``min_lr``, gradient clipping, periodic evaluation on fixed batches, ``metrics.jsonl``, atomic
checkpoints that resume exactly, Ctrl-C (or SIGTERM) saves and stops, DDP under ``torchrun``, optional
``torch.compile``. The task supplies data, model and metrics (``geoattn.tasks.base``); the model
answers the trainer's questions through :class:`geoattn.models.base.TaskModel`; the files go through
:class:`geoattn.training.run_dir.RunDirectory`.

Exact resume: training batches come from one CPU generator seeded with ``seed`` and checkpointed
with the torch/python/numpy global RNG states; evaluation batches come from their own generators,
re-seeded at every evaluation, so evaluating never moves the training stream.
"""

from __future__ import annotations

import dataclasses
import math
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

import geoattn
from geoattn.core.errors import CheckpointError, ConfigError
from geoattn.models.base import TaskModel
from geoattn.tasks import get_task
from geoattn.tasks.base import Task
from geoattn.training.compiling import (
    CompileChoice,
    CompiledModel,
    compile_choice,
    eager_step_seconds,
    weight_normalizer,
)
from geoattn.training.config import TrainConfig
from geoattn.training.distributed import DistEnv, all_reduce_mean, any_rank, barrier
from geoattn.training.loggers import RunLoggers, check_available
from geoattn.training.run_dir import RunDirectory, summary_line

EVAL_SPLITS = ("train", "val")


def run_task(config: TrainConfig, *, meta: dict[str, Any] | None = None, load_data: bool = True) -> Task:
    """The task of the run ``config``: its ``task.*`` options, ``--data`` and ``--block-size`` (see
    :meth:`geoattn.tasks.base.Task.from_options`), its test sets sealed unless ``config.read_test``."""
    task = get_task(
        config.task,
        config.task_options,
        data=config.data,
        block_size=config.block_size,
        meta=meta,
        load_data=load_data,
    )
    seal(task, config)
    return task


def seal(task: Task, config: TrainConfig) -> None:
    """Seal ``task``'s test sets for a run that may not read them (``read_test`` false: an
    exploratory experiment's run), so the task computes no metric of them."""
    if not config.read_test:
        task.sealed = frozenset(task.test_sets)


def host_value(x: torch.Tensor) -> float:
    """A scalar tensor read on the host: the training loop's one sync point (a GPU waits here for
    every queued step), taken only when a log line or an evaluation is due."""
    return float(x)


def run_model(task: Task, config: TrainConfig) -> TaskModel:
    """The network of the run ``config``: ``--model`` at the run's sizes with its ``model.*`` options."""
    return task.build_model(config.model, config.sizes, config.model_options)


def scheduled_lr(it: int, config: TrainConfig) -> float:
    """Learning rate of (0-based) step ``it``: linear warmup to ``lr``, held there ``hold_iters`` steps,
    then ``config.lr_schedule`` (cosine or exponential) down to ``config.final_lr`` at ``decay_iters``,
    then flat."""
    final = config.final_lr
    if it < config.warmup_iters:
        return config.lr * (it + 1) / (config.warmup_iters + 1)
    if it >= config.decay_iters:
        return final
    start = config.warmup_iters + config.hold_iters
    if it < start:
        return config.lr
    progress = (it - start) / max(1, config.decay_iters - start)
    if config.lr_schedule == "exponential":
        return config.lr * (final / config.lr) ** progress
    return final + 0.5 * (1.0 + math.cos(math.pi * progress)) * (config.lr - final)


def _numpy_state() -> tuple:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached


def _set_numpy_state(state: tuple) -> None:
    kind, keys, pos, has_gauss, cached = state
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


@torch.no_grad()
def evaluate_model(
    model: TaskModel,
    task: Task,
    config: TrainConfig,
    *,
    eval_iters: int | None = None,
    env: DistEnv | None = None,
    device: torch.device | str = "cpu",
    autocast=None,
    splits: tuple[str, ...] = EVAL_SPLITS,
) -> dict[str, float]:
    """Mean loss per split (and the task's metrics on val) over ``eval_iters`` batches of ``batch_size``.

    The batches come from a generator seeded from ``config.seed`` and the split, so every call sees
    the same ones. Returns ``{"train_eval_loss", "val_loss", "val_<metric>", ...}``.
    """
    env = env or DistEnv()
    eval_iters = eval_iters or config.eval_iters
    was_training = model.training
    model.eval()
    results: dict[str, float] = {}
    for index, split in enumerate(splits):
        generator = torch.Generator().manual_seed(config.seed + 1 + index)
        totals: dict[str, torch.Tensor] = {}
        for _ in range(eval_iters):
            x, y = task.get_batch(split, config.batch_size, generator, device)
            x, y = env.shard(x), env.shard(y)
            with autocast or nullcontext():
                prediction, loss = model(x, y)
            values = {"loss": loss.float()}
            if split == "val":
                for k, v in task.metrics(prediction.float(), y).items():
                    values[k] = torch.as_tensor(v, dtype=torch.float32, device=device)
            for k, v in values.items():
                totals[k] = totals[k] + v if k in totals else v
        names = list(totals)
        means = all_reduce_mean(torch.stack([totals[k] for k in names]) / eval_iters, env)
        prefix = "val_" if split == "val" else f"{split}_eval_"
        results.update({prefix + k: float(v) for k, v in zip(names, means)})
    model.train(was_training)
    return results


class Trainer:
    """Trains ``run_model(task, config)`` and writes everything into ``out``.

    Args:
        config: the run's TrainConfig.
        task: the task (data, model, metrics).
        out: run directory (created). Nothing is written there on ranks other than 0.
        env: this process's DDP place (default: a single process).
        device: where the model lives (default ``config.device``).
        verbose: print evaluation lines and show the progress bar (when stderr is a TTY).
    """

    def __init__(
        self,
        config: TrainConfig,
        task: Task,
        out: str | Path,
        *,
        env: DistEnv | None = None,
        device: torch.device | str | None = None,
        verbose: bool = True,
    ):
        self.config, self.task, self.out = config, task, Path(out)
        seal(task, config)  # (a task built by the caller)
        self.run = RunDirectory(self.out)
        self.env = env or DistEnv()
        self.device = torch.device(device or config.device)
        self.verbose = verbose and self.env.is_main
        if config.batch_size % self.env.world_size:
            raise ConfigError(
                f"batch_size={config.batch_size} does not split over {self.env.world_size} ranks; "
                f"use a multiple of {self.env.world_size}"
            )
        # The same seed on every rank gives identical initial weights; dropout then differs per rank.
        torch.manual_seed(config.seed)
        self.model = run_model(task, config).to(self.device)
        if not isinstance(self.model, TaskModel):
            raise TypeError(
                f"{type(task).__name__}.build_model returned {type(self.model).__name__}, not a TaskModel"
            )
        torch.manual_seed(config.seed + self.env.rank)
        self.ddp = None
        if self.env.enabled:
            on_cuda = self.device.type == "cuda"
            self.ddp = DistributedDataParallel(self.model, device_ids=[self.device] if on_cuda else None)
        # what the training step calls: the model, its DDP wrapper, compiled if asked (same maths)
        self.step_model = self.ddp or self.model
        self.compile_choice = self.compiled(config, task, self._eager_step_seconds)
        if self.compile_choice.on:
            self.step_model = CompiledModel(self.step_model)
        self.normalize_weights = weight_normalizer(self.model, self.compile_choice.on)
        self.optimizer = make_optimizer(self.model, config)
        # a group may ask for a multiple of the scheduled learning rate (e.g. scale parameters)
        self._lr_scale = [g["lr"] / config.lr for g in self.optimizer.param_groups]
        self.data_generator = torch.Generator().manual_seed(config.seed)
        self.iter = 0
        # wall time of the training before this process (a resumed run adds it to its own)
        self.wall_before = 0.0
        self._segment_start = time.perf_counter()
        self.stop_requested = False
        self._updating = False
        # keep_best: the lowest validation loss so far and its iteration (best.safetensors)
        self.best_val = math.inf
        self.best_iter: int | None = None
        dtype = torch.bfloat16 if config.dtype == "bfloat16" else None
        self._autocast = torch.autocast(self.device.type, dtype=dtype) if dtype is not None else nullcontext()
        check_available(config.logger)  # on every rank, before any of them starts

    # ---------------------------------------------------------------- state ----------------------
    def run_config(self) -> dict[str, Any]:
        """``config.json``: the TrainConfig, the model's own config, the task's meta data."""
        model_config = self.model.config
        is_config = dataclasses.is_dataclass(model_config) and not isinstance(model_config, type)
        model_dict = dataclasses.asdict(model_config) if is_config else None
        return {
            "geoattn_version": geoattn.__version__,
            "train": self.config.to_dict(),
            "model": model_dict,
            "task": self.task.meta(),
            "world_size": self.env.world_size,
            "compiled": {"on": self.compile_choice.on, "why": self.compile_choice.why},
        }

    def _rng_state(self) -> dict[str, Any]:
        return {
            "data": self.data_generator.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python": random.getstate(),
            "numpy": _numpy_state(),
        }

    def _set_rng_state(self, rng: dict[str, Any]) -> None:
        self.data_generator.set_state(rng["data"])
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        random.setstate(rng["python"])
        _set_numpy_state(rng["numpy"])

    @staticmethod
    def compiled(config: TrainConfig, task: Task, step_seconds: Callable[[], float]) -> CompileChoice:
        """Whether the training step runs through torch.compile, and why: ``config.compile`` if set,
        else :func:`~geoattn.training.compiling.compile_choice`'s rule for the task's ``compile_wins``
        models (``step_seconds()``: this run's eager step, measured only when the rule needs it)."""
        wins = config.model in type(task).compile_wins
        return compile_choice(config.compile, wins, config.max_iters, step_seconds)

    def _eager_step_seconds(self) -> float:
        """This run's eager step (forward and backward at its batch), as the compile rule reads it."""
        local = self.config.batch_size // self.env.world_size
        generator = torch.Generator().manual_seed(self.config.seed)
        return eager_step_seconds(
            self.step_model, lambda: self.task.get_batch("train", local, generator, self.device)
        )

    def wall_s(self) -> float:
        """Training wall time so far, over every process that trained this run (resumes add up)."""
        return self.wall_before + (time.perf_counter() - self._segment_start)

    def save(self) -> None:
        """Checkpoint at ``self.iter`` (rank 0 writes; every rank waits for it)."""
        rngs = self._gather(self._rng_state())
        if self.env.is_main:
            state = {
                "iter": self.iter,
                "optimizer": self.optimizer.state_dict(),
                "rng": rngs,
                "world_size": self.env.world_size,
                "wall_s": self.wall_s(),
                "best": {"val_loss": self.best_val, "iter": self.best_iter},
            }
            self.run.save_checkpoint(self.model, state, self.run_config())
        barrier(self.env)

    def _gather(self, rng: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's RNG states (dropout differs per rank), in rank order."""
        if not self.env.enabled:
            return [rng]
        states: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(states, rng)
        return states

    def resume(self) -> None:
        """Continue from the checkpoint in ``out``: weights, optimiser, iteration, RNG states, metrics."""
        weights_iter = self.run.load_weights(self.model, self.device)
        state = self.run.load_trainer_state()
        if weights_iter != state["iter"]:
            raise CheckpointError(
                f"checkpoint in {self.out} is inconsistent: weights at iter {weights_iter}, "
                f"trainer state at iter {state['iter']}"
            )
        try:
            self.optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError) as err:
            raise CheckpointError(f"optimiser state in {self.out} does not match the model ({err})") from None
        rngs = state["rng"]
        self._set_rng_state(rngs[self.env.rank] if self.env.rank < len(rngs) else rngs[0])
        self.iter = int(state["iter"])
        self.wall_before = float(state.get("wall_s", 0.0))
        best = state.get("best") or {}
        self.best_val = float(best.get("val_loss", math.inf))
        self.best_iter = best.get("iter")
        if self.env.is_main:
            self.run.truncate_metrics(self.iter)

    # ---------------------------------------------------------------- evaluation -----------------
    def evaluate(self, eval_iters: int | None = None) -> dict[str, float]:
        """:func:`evaluate_model` of this run (all ranks take part; the result is the global mean)."""
        return evaluate_model(
            self.model,
            self.task,
            self.config,
            eval_iters=eval_iters,
            env=self.env,
            device=self.device,
            autocast=self._autocast,
        )

    # ---------------------------------------------------------------- training -------------------
    def _request_stop(self, signum, frame) -> None:
        # torchrun's agent forwards the terminal's Ctrl-C a second time: under DDP only the flag counts,
        # so all ranks stop at the same iteration and save together.
        if self.stop_requested and not self.env.enabled:  # a second Ctrl-C aborts at once
            raise KeyboardInterrupt
        if not self.stop_requested and self.env.is_main:
            print("\ngeoattn: stopping after this iteration (Ctrl-C again to abort)", file=sys.stderr)
        self.stop_requested = True

    def train(self) -> dict[str, Any]:
        """Run to ``max_iters`` (or until Ctrl-C). Returns the last evaluation plus ``iter``,
        ``interrupted``, ``wall_s``, ``params``, the task's full-set ``final`` metrics and the
        ``plots`` written (the last three on rank 0 of a finished run; also in ``summary.json``);
        ``stop_requested`` when a Ctrl-C came too late to stop a run that then finished."""
        config = self.config
        self.out.mkdir(parents=True, exist_ok=True)
        if self.env.is_main:
            self.run.write_config(self.run_config())
        loggers = RunLoggers(config.logger, self.run, start_iter=self.iter) if self.env.is_main else None
        handler_installed = threading.current_thread() is threading.main_thread()
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = [signal.signal(s, self._request_stop) for s in signals] if handler_installed else []
        on_terminal = sys.stderr.isatty()
        bar = tqdm(
            total=config.max_iters,
            initial=self.iter,
            file=sys.stderr,
            disable=not (self.verbose and on_terminal),
            dynamic_ncols=True,
        )
        # a log (a scheduler's, nohup's, a pipe) gets a plain line every log_interval steps instead
        plain_lines = self.verbose and not on_terminal
        self._segment_start = time.perf_counter()
        self._last_line = (self.iter, self._segment_start)
        interrupted = False
        deterministic = _DeterministicAlgorithms(config.deterministic)
        try:
            while self.iter < config.max_iters:
                rng_before = self._rng_state()
                try:
                    record = self._step()
                except KeyboardInterrupt:
                    if self._updating:  # weights half-updated: keep the last saved checkpoint
                        raise
                    # Only the forward/backward ran: weights are untouched, so rewind the RNGs and
                    # save at the last completed iteration.
                    self._set_rng_state(rng_before)
                    self.optimizer.zero_grad(set_to_none=True)
                    interrupted = True
                    break
                evaluated = self.iter % config.eval_interval == 0 or self.iter == config.max_iters
                # the loss stays on the device (no host sync) unless a line or an evaluation is due
                due = self.iter % config.log_interval == 0 or evaluated
                if due:
                    record["train_loss"] = host_value(all_reduce_mean(record["train_loss"], self.env))
                if evaluated:
                    record.update(self.evaluate())
                    if config.keep_best:
                        self._keep_if_best(record)
                # the line goes out before the checkpoint: a resume drops lines past its checkpoint
                if loggers is not None and due:
                    loggers.log(record)
                if evaluated:
                    self.save()
                    if loggers is not None:
                        loggers.evaluation(self.iter, self.model, self._plot_input())
                    if self.verbose:
                        bar.write(self._eval_line(record), file=sys.stderr)
                if plain_lines and due:
                    print(self._progress_line(record["train_loss"]), file=sys.stderr, flush=True)
                bar.update(1)
                if due:
                    bar.set_postfix(loss=f"{record['train_loss']:.4f}", refresh=False)
                # under DDP the ranks agree on a stop at the steps that sync anyway
                check_stop = due or not self.env.enabled
                if (
                    self.iter < config.max_iters
                    and check_stop
                    and any_rank(self.stop_requested, self.env, self.device)
                ):
                    interrupted = True
                    break
        finally:
            deterministic.restore()
            bar.close()
            if loggers is not None:
                loggers.close()
            for sig, handler in zip(signals, previous):
                signal.signal(sig, handler)
        if interrupted:
            self.save()
        wall = self.wall_s()
        result = self.run.last_evaluation() if self.env.is_main else {}
        result.update(iter=self.iter, interrupted=interrupted, wall_s=wall, params=self.model.num_params())
        if self.env.is_main and not interrupted:
            result["final"] = self._final_metrics()
            result["plots"] = [p.name for p in self._plots()] if config.plots else []
            self.run.write_summary(result)
        if self.stop_requested and not interrupted:
            # Ctrl-C during the last iteration or its evaluation: the run is complete and kept, and
            # a caller running several (`geoattn experiment`) stops instead of starting the next
            result["stop_requested"] = True
        return result

    def _keep_if_best(self, record: dict[str, Any]) -> None:
        """``keep_best``: save the weights when this evaluation's validation loss is the lowest yet."""
        if "val_loss" not in record:
            raise ConfigError(f"keep_best needs a validation split; task {self.task.name} has none")
        if record["val_loss"] < self.best_val:
            self.best_val, self.best_iter = record["val_loss"], self.iter
            if self.env.is_main:
                self.run.save_best(self.model, self.iter)

    def _final_metrics(self) -> dict[str, Any]:
        """The task's full-set metrics of the final model; with ``keep_best`` those of the weights the
        validation chose (the model keeps them afterwards), the last model's as ``<name>_last``, and
        ``best_iter``."""
        last = self.task.final_metrics(self.model, self.device)
        if not self.config.keep_best or self.best_iter is None:
            return last
        if self.best_iter != self.iter:
            self.run.load_weights(self.model, self.device, best=True)
            final = self.task.final_metrics(self.model, self.device)
        else:
            final = dict(last)
        final.update({f"{k}_last": v for k, v in last.items()})
        final["best_iter"] = self.best_iter
        return final

    def _plot_input(self) -> torch.Tensor:
        """The one validation sample the attention map shows (always the same)."""
        x, _ = self.task.get_batch("val", 1, torch.Generator().manual_seed(0), self.device)
        return x

    def _plots(self) -> list[Path]:
        return self.run.plot(self.model, self._plot_input()) + self.task.plots(self.model, self.run.path)

    def _step(self) -> dict[str, Any]:
        """One optimiser step; the metrics.jsonl record of it (no evaluation yet)."""
        config = self.config
        t0 = time.perf_counter()
        lr = scheduled_lr(self.iter, config)
        for group, scale in zip(self.optimizer.param_groups, self._lr_scale):
            group["lr"] = lr * scale
        x, y = self.task.get_batch("train", config.batch_size, self.data_generator, self.device)
        n_targets = y.numel() if not y.is_floating_point() else y.shape[0]
        x, y = self.env.shard(x), self.env.shard(y)
        with self._autocast:
            _, loss = self.step_model(x, y)
        loss.backward()
        if config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), config.grad_clip)
        self._updating = True
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.normalize_weights()
        self.iter += 1
        self._updating = False
        elapsed = time.perf_counter() - t0  # (on a GPU: the time to queue the step, until a sync)
        rate_key = "tokens_per_s" if not y.is_floating_point() else "samples_per_s"
        return {
            "iter": self.iter,
            "train_loss": loss.detach().float(),  # on the device: read when a line is due
            "val_loss": None,
            "lr": lr,
            rate_key: n_targets / elapsed,
            "step_s": elapsed,
        }

    def _eval_line(self, record: dict[str, Any]) -> str:
        return summary_line(record, self.config.max_iters)

    def _progress_line(self, loss: float) -> str:
        """``iter 250/2000: loss 1.8421, 12.3 steps/s, ETA 2m22s``: the plain line a log gets every
        ``log_interval`` steps where stderr is no terminal (steps/s since the previous line)."""
        now = time.perf_counter()
        last_iter, last_time = self._last_line
        rate = (self.iter - last_iter) / max(now - last_time, 1e-9)
        self._last_line = (self.iter, now)
        left = (self.config.max_iters - self.iter) / rate if rate > 0 else math.inf
        eta = "?" if math.isinf(left) else f"{int(left // 60)}m{int(left % 60):02d}s"
        return f"iter {self.iter}/{self.config.max_iters}: loss {loss:.4f}, {rate:.2f} steps/s, ETA {eta}"


def make_optimizer(model: TaskModel, config: TrainConfig) -> torch.optim.Adam:
    """The trainer's AdamW (or Adam with an L2 term: ``config.optimizer``) over ``model.optim_groups``,
    fused: one pass over every parameter tensor per step instead of a dozen operations per tensor (the
    same update; the hypersphere models have twice the transformer's parameter tensors, so the
    per-tensor cost weighed more on them)."""
    kind = torch.optim.Adam if config.optimizer == "adam" else torch.optim.AdamW
    return kind(
        model.optim_groups(config.weight_decay),
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        fused=True,
    )


class _DeterministicAlgorithms:
    """``torch.use_deterministic_algorithms(enabled, warn_only=True)`` until `restore` puts back the
    process's previous setting (it is global state, and a caller may train several models)."""

    def __init__(self, enabled: bool) -> None:
        self.previous = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )
        torch.use_deterministic_algorithms(enabled, warn_only=True)

    def restore(self) -> None:
        torch.use_deterministic_algorithms(self.previous[0], warn_only=self.previous[1])
