"""`geoattn bench lm`: milliseconds per training step of every language model, against ``transformer``.

A step is what the trainer does (`geoattn.training.trainer.Trainer._step`): forward, backward,
gradient clipping, AdamW, ``zero_grad`` and the weight renormalisation of the hypersphere models,
with the trainer's default hyper-parameters, on random token batches of ``--batch`` × T. Every model
of the lm task (``LMTask.models``, the rows of ``LM_TABLE``, parameter-matched at the recipe's
width) is measured, each eagerly and through ``torch.compile`` (the trainer's ``--compile``), plus
the RT model with each ablation switch off and the rotor LM with ``aggregation="compose"``.
All variants of one T are timed round-robin, one step each in turn (`interleaved_times`), so the
ratio to ``transformer`` compares steps taken under the same machine load; the table reports
min / median / max over ``--repeats`` steps and the ratio of medians. ``first s`` is the wall time
of the first step, which includes compilation.

``--profile`` adds a `torch.profiler` breakdown of each variant: time per phase (forward, backward,
optimiser, renormalisation) and the operators with the most self time, per step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from geoattn.bench.common import (
    CLOCKS,
    allow_recompiles,
    interleaved_times,
    operator_table,
    profile_events,
    spread,
    threads_note,
)
from geoattn.core.errors import ConfigError
from geoattn.core.formatting import format_table
from geoattn.models.base import ModelSizes
from geoattn.models.lm import build_lm, config_class
from geoattn.tasks.lm.task import LMTask
from geoattn.training.compiling import CompiledModel, weight_normalizer
from geoattn.training.config import TrainConfig
from geoattn.training.trainer import make_optimizer

# The RT model's switches (docs/concepts/rt-filter.md#switches), each measured off.
ABLATIONS = ("process_noise", "magnitude_precision", "qkv_norm", "tangent_correction")
COMPILE_MODES = {"off": (False,), "on": (True,), "both": (False, True)}
_PHASES = ("forward", "backward", "optimizer", "renormalise")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models",
        nargs="+",
        default=list(LMTask.models),
        choices=list(LMTask.models),
        help="models to measure",
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024], help="context lengths T")
    parser.add_argument("--batch", type=int, default=12, help="sequences per step")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per variant (min/median/max)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first one compiles)")
    parser.add_argument(
        "--compile", choices=list(COMPILE_MODES), default="both", help="eager, torch.compile, or both"
    )
    parser.add_argument(
        "--ablations",
        nargs="*",
        default=list(ABLATIONS),
        choices=list(ABLATIONS),
        help="RT switches to measure off (one row each; none: no ablation rows)",
    )
    parser.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="wall",
        help="wall time, or this process's CPU time (steadier on a shared machine with --threads 1)",
    )
    parser.add_argument("--profile", action="store_true", help="also print a torch.profiler breakdown")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: PyTorch's choice)")
    parser.add_argument("--seed", type=int, default=0)


@dataclass(frozen=True)
class Variant:
    """One row: a model, its switches and whether it runs through torch.compile."""

    model: str
    options: tuple[tuple[str, object], ...] = ()
    compiled: bool = False

    @property
    def label(self) -> str:
        return " ".join([self.model, *(f"{k}={v}" for k, v in self.options)])


def variants(models: list[str], ablations: list[str], compile_mode: str) -> list[Variant]:
    """Every model, then ``rt`` with each ablated switch and ``rotor`` composing, for each compile
    setting."""
    rows = [(m, ()) for m in models]
    if "rt" in models:
        rows += [("rt", ((name, False),)) for name in ablations]
    if "rotor" in models:
        rows.append(("rotor", (("aggregation", "compose"),)))
    return [Variant(m, opts, c) for c in COMPILE_MODES[compile_mode] for m, opts in rows]


def training_step(
    variant: Variant, args: argparse.Namespace, t: int, *, labels: bool = False
) -> Callable[[], None]:
    """A closure running one trainer-equivalent step of ``variant`` at context ``t``."""
    train = TrainConfig()
    sizes = ModelSizes(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=t)
    options = dict(variant.options)
    torch.manual_seed(args.seed)
    config = config_class(variant.model).from_sizes(sizes, options, block_size=t)  # as the lm task's rows
    model = build_lm(variant.model, config)
    step_model = CompiledModel(model) if variant.compiled else model
    normalize_weights = weight_normalizer(model, variant.compiled)
    optimizer = make_optimizer(model, train)
    g = torch.Generator().manual_seed(args.seed)
    x, y = (torch.randint(0, config.vocab_size, (args.batch, t), generator=g) for _ in range(2))

    def phase(name: str):
        return torch.profiler.record_function(name) if labels else _NoLabel()

    def step() -> None:
        with phase("forward"):
            _, loss = step_model(x, y)
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            if train.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        with phase("renormalise"):
            normalize_weights()

    return step


class _NoLabel:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


def run(args: argparse.Namespace) -> int:
    if min(args.sizes) < 1 or args.batch < 1 or args.repeats < 1 or args.warmup < 0:
        raise ConfigError("--sizes, --batch and --repeats must be positive, --warmup non-negative")
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads must be positive, got {args.threads}")
        torch.set_num_threads(args.threads)
    rows = variants(args.models, args.ablations, args.compile)
    allow_recompiles(4 * len(rows))  # graphs per variant: forward, backward, per T
    print(
        f"training step (forward, backward, clip, AdamW, renormalise): batch {args.batch}, "
        f"{args.n_layer} layers × {args.n_head} heads × {args.n_embd}, float32, cpu, "
        f"{threads_note()}, {args.repeats} steps each, round-robin, {args.clock} clock"
    )
    headers = ["T", "model", "compile", "first s", "min ms", "median ms", "max ms", "× transformer"]
    profiles = []
    for t in args.sizes:  # one table per T, printed as soon as it is measured
        table = []
        torch._dynamo.reset()  # each T compiles its own static-shape graphs
        steps, first, failed = {}, {}, {}
        for v in rows:
            try:
                steps[v] = training_step(v, args, t)
                t0 = time.perf_counter()
                steps[v]()
                first[v] = time.perf_counter() - t0
                for _ in range(args.warmup - 1):
                    steps[v]()
            except Exception as err:  # noqa: BLE001 - a variant that cannot run is reported in its row
                steps.pop(v, None)
                failed[v] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:80]}"
        times = interleaved_times(steps, repeats=args.repeats, warmup=0, clock=args.clock)
        medians = {v: statistics.median(ts) for v, ts in times.items()}
        for v in rows:
            if v in failed:
                table.append([t, v.label, _on(v), failed[v], "", "", "", ""])
                continue
            peer = medians.get(Variant("transformer", (), v.compiled))
            ratio = f"{medians[v] / peer:.2f}" if peer else "n/a"
            table.append([t, v.label, _on(v), f"{first[v]:.1f}", *spread(times[v]), ratio])
        print(format_table(headers, table), flush=True)
        if args.profile:
            profiles += [_profile(v, args, t) for v in steps]
    for text in profiles:
        print("\n" + text)
    return 0


def _on(v: Variant) -> str:
    return "yes" if v.compiled else "no"


def _profile(v: Variant, args: argparse.Namespace, t: int, steps: int = 3, top: int = 12) -> str:
    step = training_step(v, args, t, labels=True)
    for _ in range(max(args.warmup, 1)):
        step()
    events = profile_events(step, steps)
    phases = {e.key: e.cpu_time_total / steps / 1e3 for e in events if e.key in _PHASES}
    return "\n".join(
        [
            f"profile: T = {t}, {v.label}, compile {_on(v)} (ms per step, profiler overhead included)",
            "  " + ", ".join(f"{p} {phases.get(p, 0.0):.1f}" for p in _PHASES),
            operator_table(events, steps, top, exclude=_PHASES),
        ]
    )
