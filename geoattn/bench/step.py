"""`geoattn bench step`: milliseconds per training step of a task's models at one width and batch.

For the tasks whose models are not language models (``nbody``, ``pointcloud``, ``molecule``,
``series``, ...): a step is what the trainer does (forward on a batch from the task's training split,
backward, gradient clipping, AdamW, ``zero_grad``), with every model at the same ``--n-layer`` ×
``--n-head`` × ``--n-embd`` and ``--batch`` (not each model's recipe, whose widths differ), so the
ratio to the first model of ``--models`` (default ``transformer``) compares architectures, not
sizes. Models whose recipe fixes other options (the rotor's scalar channels) keep them; ``--set
model.KEY=VALUE`` overrides for every model. The models are timed round-robin, one step each in
turn (`interleaved_times`), so their ratios compare steps under the same machine load; the table
gives min / median / max over ``--repeats`` steps, the parameters, and the ratio of medians.
E.g. the n-body RotorTransformer against the transformer at the rotor recipe's width::

    geoattn bench step --task nbody --models transformer rotor egnn --batch 64 --n-embd 256

``--profile`` adds a `torch.profiler` table of the operators with the most self time per model.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from geoattn.bench.common import (
    CLOCKS,
    interleaved_times,
    operator_table,
    profile_events,
    spread,
    threads_note,
)
from geoattn.core.errors import ConfigError
from geoattn.core.formatting import format_table
from geoattn.tasks import task_class
from geoattn.training.compiling import CompiledModel
from geoattn.training.config import parse_set
from geoattn.training.recipes import build_config
from geoattn.training.trainer import make_optimizer, run_model, run_task


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's flags: the task, its models, and the width, batch and repeats of the timing."""
    parser.add_argument("--task", default="nbody", help="the task whose models and batches are timed")
    parser.add_argument(
        "--models", nargs="+", help="models, the first the reference of the ratios (default: the task's all)"
    )
    parser.add_argument("--batch", type=int, default=64, help="samples per step")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--data", help="the task's data (default: the task's own, e.g. simulated)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any `geoattn train` field, or task.KEY / model.KEY, for every model (repeatable)",
    )
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per model (min/median/max)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--compile", action="store_true", help="torch.compile every model")
    parser.add_argument(
        "--clock", choices=list(CLOCKS), default="wall", help="wall time or this process's CPU time"
    )
    parser.add_argument("--profile", action="store_true", help="also print each model's top operators")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: PyTorch's choice)")
    parser.add_argument("--seed", type=int, default=0)


def training_step(args: argparse.Namespace, model_name: str) -> tuple[Callable[[], None], int]:
    """A closure running one trainer-equivalent step of ``model_name`` on ``args.task``, and the
    model's parameter count."""
    config = build_config(
        {
            "task": args.task,
            "model": model_name,
            "n_layer": args.n_layer,
            "n_head": args.n_head,
            "n_embd": args.n_embd,
            "batch_size": args.batch,
            "data": args.data,
        },
        parse_set(args.set),
    )
    task = run_task(config)
    torch.manual_seed(args.seed)
    model = run_model(task, config)
    step_model = CompiledModel(model) if args.compile else model
    optimizer = make_optimizer(model, config)
    generator = torch.Generator().manual_seed(args.seed)
    x, y = task.get_batch("train", config.batch_size, generator, torch.device("cpu"))

    def step() -> None:
        _, loss = step_model(x, y)
        loss.backward()
        if config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.normalize_weights()

    return step, sum(p.numel() for p in model.parameters())


def run(args: argparse.Namespace) -> int:
    """Time one training step of each model and print medians and ratios to the first; a
    `ConfigError` (one line, exit 2) on bad flags."""
    if args.batch < 1 or args.repeats < 1 or args.warmup < 0:
        raise ConfigError("--batch and --repeats must be positive, --warmup non-negative")
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads must be positive, got {args.threads}")
        torch.set_num_threads(args.threads)
    known = list(task_class(args.task).models)
    models = args.models or known
    unknown = [m for m in models if m not in known]
    if unknown:
        raise ConfigError(f"--models {' '.join(unknown)}: task {args.task} has {', '.join(known)}")
    print(
        f"training step of task {args.task} (forward, backward, clip, AdamW): batch {args.batch}, "
        f"{args.n_layer} layers × {args.n_head} heads × {args.n_embd}, float32, cpu, "
        f"compile {'on' if args.compile else 'off'}, {threads_note()}, {args.repeats} steps each, "
        f"round-robin after {args.warmup} untimed, {args.clock} clock",
        flush=True,
    )
    steps, params = {}, {}
    for name in models:
        steps[name], params[name] = training_step(args, name)
    times = interleaved_times(steps, repeats=args.repeats, warmup=args.warmup, clock=args.clock)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    reference = models[0]
    table = [
        [name, f"{params[name]:,}", *spread(times[name]), f"{medians[name] / medians[reference]:.2f}"]
        for name in models
    ]
    headers = ["model", "params", "min ms", "median ms", "max ms", f"× {reference}"]
    print(format_table(headers, table), flush=True)
    if args.profile:
        for name, step in steps.items():
            events = profile_events(step, 3)
            print(f"\nprofile: {name} (ms per step, profiler overhead included)")
            print(operator_table(events, 3))
    return 0
