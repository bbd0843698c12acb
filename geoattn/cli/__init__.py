"""The `geoattn` command: quickstart | train | eval | sample | export | experiment | bench | data | native."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import os
import sys
import time
from pathlib import Path

from geoattn.bench import BENCHMARKS
from geoattn.core.errors import ConfigError, NativeBuildError, UserError
from geoattn.core.formatting import format_table
from geoattn.core.subnormals import flush_unless_kept


class UsageError(ConfigError):
    """A command-line request that cannot be met (a flag combination, a missing device)."""


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
        p.set_defaults(func=_with_machine_header(mod.run))


def _with_machine_header(run):
    """A bench command's ``run``, after the header that says which machine measured it."""

    def header_then_run(args: argparse.Namespace) -> int:
        from geoattn.bench.common import frozen_heap, machine_header

        print(machine_header(), flush=True)
        with frozen_heap():  # the per-kernel memory samples collect only the benchmark's own garbage
            return run(args)

    return header_then_run


# ---------------------------------------------------------------------------------------- train ----
def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def train_flags() -> dict[str, dataclasses.Field]:
    """One command-line flag per TrainConfig field (its help is the field's), but for the option
    tables (``--set``), ``out`` and ``plots`` (their own flags)."""
    from geoattn.training.config import FIELDS

    return {_flag(name): f for name, f in FIELDS.items() if f.metadata.get("flag", True)}


def _flag_type(field: dataclasses.Field):
    from geoattn.training.config import coerce

    # "none" stays text until the layers merge: parsed here it would be None, which reads as "not given"
    # and would leave a recipe's value in place (`--min-lr none` gives the field its own default back)
    def parse(text: str):
        value = coerce(field.name, text)
        return text if value is None else value

    parse.__name__ = field.name  # argparse's message: "invalid max_iters value: 'abc'"
    return parse


def _add_train(sub: argparse._SubParsersAction) -> None:
    from geoattn.tasks import TASKS

    p = sub.add_parser(
        "train",
        help="train a model on a task (DDP under torchrun)",
        description="Train a model on a task. Settings: defaults < --config TOML < --set < flags; "
        "with --resume the run's saved config replaces the defaults. Tasks: "
        + ", ".join(TASKS)
        + ". `geoattn train --task T --model M --list-settings` lists every task.* and model.* key.",
    )
    p.add_argument("--out", help="run directory (metrics, checkpoints, plots)")
    for flag, field in train_flags().items():
        p.add_argument(
            flag, dest=field.name, type=_flag_type(field), default=None, help=field.metadata["help"]
        )
    p.add_argument("--config", help="TOML file with TrainConfig fields (sections only group keys)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any field, or model.KEY / task.KEY settings (repeatable; see --list-settings)",
    )
    p.add_argument("--resume", action="store_true", help="continue the checkpoint in --out exactly")
    p.add_argument("--force", action="store_true", help="overwrite the run files in a non-empty --out")
    p.add_argument("--no-plots", dest="plots", action="store_false", default=None, help="skip the PNG plots")
    p.add_argument(
        "--list-settings",
        action="store_true",
        help="list the task's models and every task.* / model.* setting of --task and --model, then exit",
    )
    p.set_defaults(func=cmd_train)


def train_config_from_args(args: argparse.Namespace):
    """The TrainConfig of ``geoattn train`` (saved config, TOML, --set and flags layered)."""
    from geoattn.training.config import load_toml, parse_set
    from geoattn.training.recipes import build_config
    from geoattn.training.run_dir import RunDirectory

    base = RunDirectory(args.out).read_config()["train"] if args.resume else {}
    toml = load_toml(args.config) if args.config else {}
    sets = parse_set(args.set)
    flags = {
        f.name: getattr(args, f.name) for f in train_flags().values() if getattr(args, f.name) is not None
    }
    if args.plots is not None:
        flags["plots"] = args.plots
    out = {"out": str(args.out)} if args.out else {}
    return build_config(base, toml, sets, flags, out)


def cmd_list_settings(args: argparse.Namespace) -> int:
    from geoattn.tasks import task_class
    from geoattn.training.recipes import recipe as model_recipe

    config = train_config_from_args(args)
    task = task_class(config.task)
    print(f"task {task.name}: {task.description}")
    print(format_table(["--model", "what"], [[name, text] for name, text in task.models.items()]))
    model = config.model if config.model in task.models else None
    recipe = model_recipe(config.task, config.model)
    if recipe:
        print(f"\n{config.model}'s recipe (its defaults here, measured): {recipe}")
    print(f"\nsettings (--set KEY=VALUE){'' if model else ' (pick --model to see its model.* keys)'}:")
    print(format_table(["key", "type", "default", "what"], task.settings_table(model)))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from geoattn.training import distributed

    if args.list_settings:
        return cmd_list_settings(args)
    if not args.out:
        raise UsageError("--out is required (the run directory)")
    env = distributed.from_environment()
    try:
        code = _train(args, env)
    except Exception as err:
        if not env.enabled:
            raise
        # Under torchrun every rank reports and leaves the group cleanly, so no rank hangs.
        if env.is_main:
            print(f"geoattn train: error: {err}", file=sys.stderr)
        distributed.teardown_and_exit(2 if isinstance(err, UserError) else 1)
    if env.enabled:
        distributed.teardown_and_exit(code)
    return code


def _train(args: argparse.Namespace, env) -> int:
    import torch

    from geoattn.training import distributed
    from geoattn.training.run_dir import RunDirectory
    from geoattn.training.trainer import Trainer, run_task

    run = RunDirectory(args.out)
    run.prepare(resume=args.resume, force=args.force, clear=False)  # a refused --out, before the data
    config = train_config_from_args(args)
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    # the task and its data before anything in --out changes: bad data leaves --out as it was
    task = run_task(config, meta=run.read_config()["task"] if args.resume else None)
    task.check_model(config.model)
    run.prepare(resume=args.resume, force=args.force, clear=env.is_main)
    device = distributed.init(env, config.device)
    trainer = Trainer(config, task, run.path, env=env, device=device)
    if args.resume:
        trainer.resume()
    if env.is_main:
        start = f"resuming at iter {trainer.iter}" if args.resume else "from scratch"
        print(
            f"{config.model} on {config.task}: {trainer.model.num_params() / 1e6:.3f} M parameters, {start} "
            f"to {config.max_iters} iters, batch {config.batch_size} on {env.world_size} x {device}, "
            f"out {run.path}",
            file=sys.stderr,
        )
    result = trainer.train()
    if env.is_main:
        report = run.report(result, [run.file(name) for name in result.get("plots", [])])
        print(report, file=sys.stderr if result["interrupted"] else sys.stdout)
    trainer.ddp = None  # drop the DDP wrapper before the process group goes (teardown_and_exit)
    return 130 if result["interrupted"] else 0


# ----------------------------------------------------------------------------------- eval/sample ----
def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate a trained run (its task's table: lm length extrapolation, nbody sets, filter bounds)",
        description="Evaluate the checkpoint in --out with its task's table. Each row says what it was "
        "measured on: a full set (lm: the whole validation split in non-overlapping windows, at 1x to "
        "16x the training context; nbody: the whole eval / E(3) / object sets) or a batch estimate.",
    )
    p.add_argument("--out", required=True, help="run directory written by geoattn train")
    p.add_argument("--eval-iters", type=int, default=None, help="batches per estimate (default: the run's)")
    p.add_argument("--batch-size", type=int, default=None, help="batch size (default: the run's)")
    p.add_argument(
        "--data",
        default=None,
        help="evaluate on other data than the run's: lm a text file (same vocabulary); "
        "nbody a directory of GATr's files",
    )
    p.add_argument("--device", default=None, help="cpu | cuda (default: the run's)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="task.KEY=VALUE",
        help="evaluate on another draw of the task's data: task.* settings only (e.g. pointcloud "
        "task.seed=7 task.test_size=10000: clouds no run has seen)",
    )
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    from geoattn.core.formatting import significant
    from geoattn.training.config import parse_set
    from geoattn.training.evaluate import evaluation_rows, load_run

    sets = parse_set(args.set)
    if set(sets) - {"task_options"}:
        raise ConfigError(f"geoattn eval --set takes task.* keys only (the data), got {', '.join(args.set)}")
    run = load_run(
        Path(args.out),
        device=args.device,
        data=args.data,
        batch_size=args.batch_size,
        eval_iters=args.eval_iters,
        task_options=sets.get("task_options"),
    )
    t0 = time.perf_counter()
    rows = evaluation_rows(run)
    wall = time.perf_counter() - t0
    summary = run.directory.read_summary()
    trained = f", trained {summary['iter']} iters in {summary['wall_s']:.0f} s" if summary else ""
    other = " ".join(f"task.{k}={v}" for k, v in sets.get("task_options", {}).items())
    print(
        f"{run.config.model} on {run.config.task} ({run.out}): "
        f"{run.model.num_params():,} parameters{trained}; evaluated in {wall:.1f} s"
        + (f" on other data: {other}" if other else "")
    )
    table = [
        [r.metric, significant(r.value) if isinstance(r.value, float) else r.value, r.over] for r in rows
    ]
    print(format_table(["metric", "value", "measured on"], table))
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
    from geoattn.training.evaluate import load_run

    if args.max_new_tokens < 0 or args.temperature <= 0 or (args.top_k is not None and args.top_k < 1):
        raise UsageError("need --max-new-tokens >= 0, --temperature > 0 and --top-k >= 1")
    if not args.prompt:
        raise UsageError("--prompt must not be empty")
    run = load_run(Path(args.out), device=args.device, load_data=False)
    text = run.task.sample(
        run.model,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        device=run.device,
    )
    print(text)
    return 0


# --------------------------------------------------------------------------------------- export ----
def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write an lm run as a Hugging Face transformers model directory (needs geoattn[hf])",
        description="Write the checkpoint of an lm run as a directory that transformers' "
        "AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained load after "
        "`import geoattn.hf`: config.json, model.safetensors, generation_config.json and the character "
        "tokenizer (tokenizer.json).",
    )
    p.add_argument("--out", required=True, help="run directory written by geoattn train --task lm")
    p.add_argument("--to", required=True, help="the directory to write")
    p.add_argument("--force", action="store_true", help="write into a non-empty --to")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from geoattn.core.extras import require

    require("transformers", extra="hf", purpose="geoattn export")
    from transformers.utils import logging as hf_logging

    from geoattn.hf import export_run

    hf_logging.disable_progress_bar()  # one line of output, not transformers' per-file bars
    to = export_run(Path(args.out), Path(args.to), force=args.force)
    print(f"wrote {to}/: {' '.join(sorted(p.name for p in to.iterdir()))}")
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
    make = actions.add_parser(
        "make", help="build a simulated dataset (molecule: MD with xTB; nbody-charged: EGNN's files)"
    )
    kinds = make.add_subparsers(dest="kind", required=True)
    from geoattn.tasks.molecule.cli import add_make_molecule
    from geoattn.tasks.nbody.charged import add_make_charged

    add_make_molecule(kinds)
    add_make_charged(kinds)


def cmd_data_list(args: argparse.Namespace) -> int:
    from geoattn.tasks.lm.datasets import DATASETS, cache_dir, cached_path

    rows = [
        [d.name, f"{d.size:,}", "yes" if cached_path(d.name).exists() else "no", d.description]
        for d in DATASETS.values()
    ]
    print(format_table(["name", "bytes", "cached", "description"], rows))
    print(f"cache: {cache_dir()}")
    return 0


def cmd_data_download(args: argparse.Namespace) -> int:
    from geoattn.tasks.lm.datasets import download

    print(download(args.name, force=args.force))
    return 0


# ------------------------------------------------------------------------------------ experiment ----
def _add_experiment(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "experiment",
        help="run a named grid of runs (experiments/NAME.toml) resumably and write results/NAME.md",
        description="Run the experiment defined in experiments/NAME.toml or experiments/probes/NAME.toml "
        "(cells x seeds): finished runs are skipped, interrupted ones resume from their checkpoints, then "
        "the results are aggregated into results/NAME.md (mean ± std, every seed, verdicts) and "
        "results/NAME_*.png. An exploratory experiment reads validation only; one with confirm = true "
        "reads its test sets once, recorded in results/ledger.jsonl, and reports Holm-adjusted verdicts.",
    )
    p.add_argument("name", nargs="?", help="experiment name (experiments/NAME.toml) or a path to such a file")
    p.add_argument(
        "--ledger", action="store_true", help="list the confirmations recorded in results/ledger.jsonl"
    )
    p.add_argument("--dry-run", action="store_true", help="list the runs and what would happen to each")
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel (worker processes); default 1")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads per run (default: all cores / --jobs; 1 when other work shares the machine)",
    )
    p.add_argument("--runs", default="runs/experiments", help="where the run directories live")
    p.add_argument("--results", default="results", help="where the report and plots go")
    p.add_argument("--report-only", action="store_true", help="aggregate what is finished, run nothing")
    p.add_argument(
        "--from-results",
        action="store_true",
        help="recompute the verdicts and reading of results/NAME.md from its own every-seed table "
        "(no runs needed, nothing run; the rest of the report is kept)",
    )
    p.set_defaults(func=cmd_experiment)


def cmd_experiment(args: argparse.Namespace) -> int:
    from geoattn.experiments import check_devices, execute, load_spec, plan, rewrite_verdicts, write_report
    from geoattn.experiments.ledger import LEDGER, recorded

    if args.ledger:
        return _print_ledger(Path(args.results))
    if not args.name:
        raise UsageError("name an experiment (or --ledger to list the confirmations)")
    if args.jobs < 1:
        raise UsageError(f"--jobs must be >= 1, got {args.jobs}")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    spec = load_spec(args.name)
    if args.from_results:
        print(f"wrote {rewrite_verdicts(spec, Path(args.results))}")
        return 0
    if spec.legacy and not (args.report_only or args.dry_run):
        raise UsageError(
            f"{spec.name} names test metrics ({', '.join(spec.test_metrics)}) and is not confirm = true: "
            "an exploratory experiment reads validation only; its report is the record read before the "
            "protocol (--report-only rewrites it); a claim on test data is a new confirm = true experiment"
        )
    ledger_path = Path(args.results) / LEDGER
    runs = Path(args.runs)
    plans = plan(spec, runs)
    if args.dry_run:
        if spec.confirm:
            entry = recorded(spec, ledger_path)  # a changed protocol is refused here already
            state = f"recorded (line {entry.line})" if entry else "not yet recorded"
            print(f"confirmation {spec.name}: {state} in {ledger_path}")
        rows = [
            [p.cell.name, p.seed, p.status + (f" at {p.at_iter}" if p.status == "resume" else ""), p.out]
            for p in plans
        ]
        print(f"experiment {spec.name}: {len(plans)} runs ({sum(p.status != 'done' for p in plans)} to run)")
        print(format_table(["cell", "seed", "status", "run directory"], rows))
        return 0
    failure = None
    if not args.report_only:
        check_devices(spec, plans)  # before anything runs or is written
        try:
            show = functools.partial(print, flush=True)
            execute(
                spec, plans, jobs=args.jobs, threads=args.threads, print_line=show, ledger_path=ledger_path
            )
        except UserError as err:  # some runs failed: report the others, then say which
            failure = err
        plans = plan(spec, runs)
    path = write_report(spec, plans, Path(args.results), runs)
    print(f"wrote {path}")
    if failure is not None:
        raise failure
    return 0


def _print_ledger(results: Path) -> int:
    """``geoattn experiment --ledger``: one row per recorded confirmation, with its verdict where its
    summary (``NAME.json``) has been written."""
    import json

    from geoattn.experiments.ledger import LEDGER, read_ledger

    entries = read_ledger(results / LEDGER)
    summaries = {}
    for path in results.rglob("*.json"):
        summary = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(summary, dict) and "comparisons" in summary:
            summaries[(summary.get("experiment"), summary.get("ledger", {}).get("spec_sha256"))] = summary
    rows = []
    for e in entries:
        r = e.record
        summary = summaries.get((r.get("experiment"), r.get("spec_sha256")))
        verdicts = (
            ", ".join("confirmed" if c["confirmed"] else "not confirmed" for c in summary["comparisons"])
            if summary
            else "no report yet"
        )
        commit = (r.get("commit") or "-")[:10] + ("+dirty" if r.get("dirty") else "")
        rows.append([e.line, r.get("experiment"), len(r.get("seeds", [])), commit, r.get("time"), verdicts])
    print(f"{len(entries)} confirmations in {results / LEDGER}")
    if rows:
        print(format_table(["line", "experiment", "seeds", "commit", "recorded", "verdicts"], rows))
    return 0


# --------------------------------------------------------------------------------------- native ----
def _add_native(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("native", help="the native CPU kernels: build them ahead of their first use")
    actions = p.add_subparsers(dest="action", required=True)
    b = actions.add_parser(
        "build",
        help="compile the native CPU kernels now (once per machine and -march; `make run` does this)",
        description="Compile the native CPU kernels into their cache folder, or find them built there, "
        "and print the compiler, its flags, the SIMD lanes, the folder and the seconds it took. "
        "Exits 1 with the compiler's error where they cannot be built.",
    )
    b.add_argument(
        "--march",
        default=None,
        help="the -march to build for (default: $GEOATTN_NATIVE_MARCH, else native); "
        "x86-64-v3 runs on any x86 CPU with AVX2 and FMA",
    )
    b.add_argument("--rebuild", action="store_true", help="compile afresh even where a build is found")
    b.set_defaults(func=cmd_native_build)


def cmd_native_build(args: argparse.Namespace) -> int:
    """``geoattn native build``: build (or find) the kernels and print the report; 1 where they cannot
    be built (the compiler's error on stderr)."""
    from geoattn import native

    if not native.enabled():
        print(f"the native kernels are switched off ({native.NATIVE_ENV}=0): nothing built")
        return 0
    result = native.build(args.march or native.march(), quiet=False, rebuild=args.rebuild)
    print("\n".join(result.lines()))
    return 0


# ------------------------------------------------------------------------------------ quickstart ----
def _add_quickstart(sub: argparse._SubParsersAction) -> None:
    from geoattn.cli import quickstart

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
    _add_export(sub)
    _add_experiment(sub)
    _add_bench(sub)
    _add_data(sub)
    _add_native(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except UserError as err:  # anything else is a bug and keeps its traceback
        print(f"geoattn {args.command}: error: {err}", file=sys.stderr)
        return 2
    except NativeBuildError as err:  # GEOATTN_NATIVE=require: the compiler's error, without a traceback
        print(f"geoattn {args.command}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("geoattn: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`geoattn ... | head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (so the exit flush cannot fail)
        return 141


def console() -> None:
    """The ``geoattn`` program (``python -m geoattn`` too): `main` with subnormal floats flushed in
    every thread (`geoattn.core.subnormals`; set before any torch work starts the worker threads).
    In-process callers (tests, notebooks) call `main` and keep their own floating-point mode."""
    flush_unless_kept()
    raise SystemExit(main())


if __name__ == "__main__":
    console()
