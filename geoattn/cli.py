"""The `geoattn` command: quickstart | train | eval | sample | bench | data."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from geoattn.bench import BENCHMARKS
from geoattn.tasks.data import DownloadError


class UsageError(Exception):
    """A problem with what the user asked for: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``geoattn train: error: ...``), exit code 2."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ---------------------------------------------------------------------------------------- bench ----
def _add_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="measure kernels against their peers (medians, ratios)")
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="{" + ",".join(BENCHMARKS) + "}")
    for name, module in BENCHMARKS.items():
        mod = importlib.import_module(module)
        p = kinds.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0])
        mod.add_arguments(p)
        p.set_defaults(func=mod.run)


# ---------------------------------------------------------------------------------------- train ----
RUN_FILES = ("config.json", "model.safetensors", "trainer_state.pt", "metrics.jsonl")
RUN_PLOTS = ("loss.png", "attention.png", "precision.png")
TRAIN_FLAGS = {  # flag -> (TrainConfig field, type, help)
    "--task": ("task", str, "lm | filter | nbody"),
    "--model": ("model", str, "transformer | rt | rfa | ngpt | rotor (which ones a task supports varies)"),
    "--data": ("data", str, "lm: a UTF-8 text file or a dataset name (see `geoattn data list`)"),
    "--max-iters": ("max_iters", int, "optimiser steps"),
    "--eval-interval": ("eval_interval", int, "evaluate and checkpoint every N steps (and at the last)"),
    "--eval-iters": ("eval_iters", int, "batches per split per evaluation"),
    "--batch-size": ("batch_size", int, "global batch (split across DDP ranks)"),
    "--block-size": ("block_size", int, "context / sequence length"),
    "--n-layer": ("n_layer", int, "layers"),
    "--n-head": ("n_head", int, "attention heads"),
    "--n-embd": ("n_embd", int, "model width"),
    "--dropout": ("dropout", float, "dropout probability"),
    "--lr": ("lr", float, "peak learning rate"),
    "--min-lr": ("min_lr", float, "learning rate at the end of the cosine decay"),
    "--warmup-iters": ("warmup_iters", int, "linear warmup steps"),
    "--weight-decay": (
        "weight_decay",
        float,
        "AdamW weight decay (matrices only unless the model says otherwise)",
    ),
    "--seed": ("seed", int, "seed for initialisation and data"),
    "--device": ("device", str, "cpu | cuda"),
    "--dtype": ("dtype", str, "float32 | bfloat16 (autocast)"),
}


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a model on a task (DDP under torchrun)",
        description="Train a model on a task. Settings: defaults < --config TOML < --set < flags; "
        "with --resume the run's saved config replaces the defaults.",
    )
    p.add_argument("--out", required=True, help="run directory (metrics, checkpoints, plots)")
    for flag, (field, kind, text) in TRAIN_FLAGS.items():
        p.add_argument(flag, dest=field, type=kind, default=None, help=text)
    p.add_argument("--config", help="TOML file with TrainConfig fields (sections only group keys)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any field, or model.KEY / task.KEY options (repeatable)",
    )
    p.add_argument("--resume", action="store_true", help="continue the checkpoint in --out exactly")
    p.add_argument("--force", action="store_true", help="overwrite the run files in a non-empty --out")
    p.add_argument("--no-plots", dest="plots", action="store_false", default=None, help="skip the PNG plots")
    p.set_defaults(func=cmd_train)


def _prepare_out(out: Path, resume: bool, force: bool, delete: bool = True) -> None:
    from geoattn.training.checkpoint import has_checkpoint

    if resume:
        if not has_checkpoint(out):
            raise UsageError(f"--resume: no checkpoint in {out} (train without --resume first)")
        return
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise UsageError(
                f"--out {out} is not empty; pass --resume to continue that run or --force to overwrite it"
            )
        for name in RUN_FILES + RUN_PLOTS if delete else ():  # only what a run writes: other files stay
            (out / name).unlink(missing_ok=True)


def train_config_from_args(args: argparse.Namespace):
    """The TrainConfig of ``geoattn train`` (saved config, TOML, --set and flags layered)."""
    from geoattn.training import checkpoint as ckpt
    from geoattn.training.config import load_toml, merge, parse_set

    out = Path(args.out)
    base = ckpt.read_config(out)["train"] if args.resume else {}
    toml = load_toml(args.config) if args.config else {}
    sets = parse_set(args.set)
    flags = {
        field: getattr(args, field)
        for field, _, _ in TRAIN_FLAGS.values()
        if getattr(args, field) is not None
    }
    if args.plots is not None:
        flags["plots"] = args.plots
    return merge(base, toml, sets, flags, {"out": str(out)})


def cmd_train(args: argparse.Namespace) -> int:
    from geoattn.training import distributed

    env = distributed.from_environment()
    try:
        code = _train(args, env)
    except Exception as err:
        if not env.enabled:
            raise
        # Under torchrun every rank reports and leaves the group cleanly, so no rank hangs.
        if env.is_main:
            print(f"geoattn train: error: {err}", file=sys.stderr)
        distributed.teardown_and_exit(2 if isinstance(err, (UsageError, ValueError, DownloadError)) else 1)
    if env.enabled:
        distributed.teardown_and_exit(code)
    return code


def _train(args: argparse.Namespace, env) -> int:
    import torch

    from geoattn.tasks import get_task
    from geoattn.training import distributed
    from geoattn.training.checkpoint import read_config
    from geoattn.training.trainer import Trainer

    out = Path(args.out)
    _prepare_out(out, args.resume, args.force, delete=env.is_main)
    config = train_config_from_args(args)
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    meta = read_config(out)["task"] if args.resume else None
    task = get_task(
        config.task,
        data=config.data,
        block_size=config.block_size,
        options=config.task_options,
        meta=meta if config.task == "lm" else None,
    )
    if config.model not in task.models:
        raise UsageError(
            f"the {config.task} task supports models {', '.join(task.models)}, not {config.model!r}"
        )
    device = distributed.init(env, config.device)
    trainer = Trainer(config, task, out, env=env, device=device)
    if args.resume:
        trainer.resume()
    if env.is_main:
        n_params = sum(p.numel() for p in trainer.model.parameters())
        start = f"resuming at iter {trainer.iter}" if args.resume else "from scratch"
        print(
            f"{config.model} on {config.task}: {n_params / 1e6:.3f} M parameters, {start} to "
            f"{config.max_iters} iters, batch {config.batch_size} on {env.world_size} x {device}, out {out}",
            file=sys.stderr,
        )
    result = trainer.train()
    if env.is_main:
        _report(trainer, result)
    trainer.ddp = None  # drop the DDP wrapper before the process group goes (teardown_and_exit)
    return 130 if result["interrupted"] else 0


def _report(trainer, result: dict) -> None:
    from geoattn.training.plots import make_plots

    out = trainer.out
    if result["interrupted"]:
        print(
            f"interrupted at iter {result['iter']}: checkpoint saved in {out}; "
            f"continue with: geoattn train --out {out} --resume",
            file=sys.stderr,
        )
        return
    written = []
    if trainer.config.plots:
        import torch

        x, _ = trainer.task.get_batch("val", 1, torch.Generator().manual_seed(0), trainer.device)
        written = [p.name for p in make_plots(out, trainer.model, x)]
    val = result.get("val_loss")
    summary = f"iter {result['iter']}  val loss {val:.4f}" if val is not None else f"iter {result['iter']}"
    extras = "  ".join(f"{k} {v:.4g}" for k, v in result.items() if k.startswith("val_") and k != "val_loss")
    print(f"{summary}  {extras}  ({result['wall_s']:.1f} s)".replace("    ", "  "))
    print(f"wrote {out}/: config.json model.safetensors trainer_state.pt metrics.jsonl {' '.join(written)}")


# ----------------------------------------------------------------------------------- eval/sample ----
def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate a trained run (lm: length extrapolation table)",
        description="Evaluate the checkpoint in --out. For lm: val loss at 1x, 2x, 4x "
        "and 8x the training context.",
    )
    p.add_argument("--out", required=True, help="run directory written by geoattn train")
    p.add_argument("--eval-iters", type=int, default=None, help="batches per row (default: the run's)")
    p.add_argument("--batch-size", type=int, default=None, help="batch size (default: the run's)")
    p.add_argument("--data", default=None, help="evaluate on this text instead of the run's data (lm)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: the run's)")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    from geoattn.bench.common import format_table
    from geoattn.training.evaluate import evaluate_run, length_extrapolation, load_run

    run = load_run(
        Path(args.out),
        device=args.device,
        data=args.data,
        batch_size=args.batch_size,
        eval_iters=args.eval_iters,
    )
    if run.config.task == "lm":
        rows = length_extrapolation(run)
        print(
            f"{run.config.model} on {run.task.data}: val loss (nats/char) by context length, "
            f"{run.config.eval_iters} batches of {run.config.batch_size}"
        )
        rows = [[T, k, f"{v:.4f}" if isinstance(v, float) else v] for T, k, v in rows]
        print(format_table(["context", "× training", "val loss"], rows))
        return 0
    results = evaluate_run(run)
    print(format_table(["metric", "value"], sorted(results.items())))
    return 0


def _add_sample(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sample", help="generate text from a trained lm run")
    p.add_argument("--out", required=True, help="run directory written by geoattn train --task lm")
    p.add_argument("--prompt", default="\n", help="start of the text (characters of the run's vocabulary)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="characters to generate")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (> 0)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely characters")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--device", default=None, help="cpu | cuda (default: the run's)")
    p.set_defaults(func=cmd_sample)


def cmd_sample(args: argparse.Namespace) -> int:
    import torch

    from geoattn.training.evaluate import load_run

    if args.max_new_tokens < 0 or args.temperature <= 0 or (args.top_k is not None and args.top_k < 1):
        raise UsageError("need --max-new-tokens >= 0, --temperature > 0 and --top-k >= 1")
    if not args.prompt:
        raise UsageError("--prompt must not be empty")
    run = load_run(Path(args.out), device=args.device, need_data=False)
    if run.config.task != "lm":
        raise UsageError(f"sample needs an lm run; {args.out} is a {run.config.task} run")
    idx = run.task.encode(args.prompt)[None].to(run.device)  # (1, T)
    torch.manual_seed(args.seed)
    with torch.no_grad():
        ids = run.model.generate(idx, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k)
    print(run.task.decode(ids[0]))
    return 0


# ----------------------------------------------------------------------------------------- data ----
def _add_data(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="list or download the registered datasets")
    actions = p.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="registered datasets and where they are cached").set_defaults(
        func=cmd_data_list
    )
    d = actions.add_parser("download", help="download a dataset into the cache (sha256-checked)")
    d.add_argument("name", help="dataset name (see geoattn data list)")
    d.add_argument("--force", action="store_true", help="download again even if cached")
    d.set_defaults(func=cmd_data_download)


def cmd_data_list(args: argparse.Namespace) -> int:
    from geoattn.bench.common import format_table
    from geoattn.tasks.data import DATASETS, cache_dir, cached_path

    rows = [
        [d.name, f"{d.size:,}", "yes" if cached_path(d.name).exists() else "no", d.description]
        for d in DATASETS.values()
    ]
    print(format_table(["name", "bytes", "cached", "description"], rows))
    print(f"cache: {cache_dir()}")
    return 0


def cmd_data_download(args: argparse.Namespace) -> int:
    from geoattn.tasks.data import download

    print(download(args.name, force=args.force))
    return 0


# ------------------------------------------------------------------------------------ quickstart ----
def _add_quickstart(sub: argparse._SubParsersAction) -> None:
    from geoattn import quickstart

    p = sub.add_parser(
        "quickstart",
        help="a five-minute tour: algebra demo, rt vs transformer on the filter task",
        description=quickstart.__doc__,
    )
    quickstart.add_arguments(p)
    p.set_defaults(func=quickstart.run)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="geoattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_quickstart(sub)
    _add_train(sub)
    _add_eval(sub)
    _add_sample(sub)
    _add_bench(sub)
    _add_data(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (UsageError, ValueError, FileNotFoundError, DownloadError) as err:
        print(f"geoattn {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("geoattn: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
