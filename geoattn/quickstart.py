"""A five-minute tour on a laptop CPU, no downloads: a rotor built and checked in Cl(3), then the RT
Transformer and a standard Transformer trained briefly on the `filter` task (estimate a direction
drifting on the sphere from noisy measurements of varying confidence), side by side with the task's
closed-form and recursive reference filters. With --data FILE also a short character-LM comparison.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DEFAULT_OUT = "runs/quickstart"
MARKER = ".geoattn-quickstart"  # quickstart owns (and overwrites) only folders that carry this file
FILTER_MODELS = ("rt", "transformer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument(
        "--data", default=None, help="a UTF-8 text file: also compare rt and transformer as char LMs"
    )
    parser.add_argument("--iters", type=int, default=300, help="training steps per model on the filter task")
    parser.add_argument("--lm-iters", type=int, default=300, help="training steps per model with --data")
    parser.add_argument("--device", default="cpu", help="cpu | cuda")


def _claim(out: Path) -> None:
    """Make ``out`` quickstart's folder: refuse a non-empty folder that quickstart did not create."""
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MARKER).exists())):
        raise ValueError(f"{out} exists and was not written by quickstart; pass --out NEW_FOLDER")
    if out.exists():
        import shutil

        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / MARKER).write_text("written by `geoattn quickstart`, which overwrites this folder on every run\n")


def algebra_demo() -> None:
    """A rotor from two vectors of Cl(3), applied by the sandwich R v R~, checked."""
    import torch

    from geoattn.algebra import CliffordAlgebra

    cl3 = CliffordAlgebra(3)
    a = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    b = torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64) / 3**0.5
    rotor = cl3.rotor_between(cl3.vector(a), cl3.vector(b))
    moved = cl3.sandwich(rotor, cl3.vector(a))
    error = (moved - cl3.vector(b)).abs().max().item()
    unit = cl3.geometric_product(rotor, cl3.reverse(rotor))[0].item()
    angle = torch.rad2deg(torch.arccos((a * b).sum())).item()
    print("1. Clifford algebra Cl(3): a rotor R from a = e1 to b = (e1+e2+e3)/√3")
    print(f"   R = {_blades(cl3, rotor)}   (a {angle:.2f}° turn in the plane a∧b; R R~ = {unit:.6f})")
    print(f"   R a R~ = {_blades(cl3, moved)}   |R a R~ - b| = {error:.1e}")


def _blades(algebra, x) -> str:
    terms = [
        f"{v:+.4f}{'' if name in ('', '1') else name}"
        for v, name in zip(x.tolist(), algebra.blade_names)
        if abs(v) > 1e-9
    ]
    return " ".join(terms)


def _train(task_name: str, model: str, out: Path, device: str, **fields):
    from geoattn.tasks import get_task
    from geoattn.training.config import TrainConfig
    from geoattn.training.trainer import Trainer

    config = TrainConfig(task=task_name, model=model, out=str(out), device=device, **fields)
    task = get_task(task_name, data=config.data, block_size=config.block_size, options=config.task_options)
    trainer = Trainer(config, task, out, verbose=False)
    result = trainer.train()
    import torch

    from geoattn.training.plots import make_plots

    x, _ = task.get_batch("val", 1, torch.Generator().manual_seed(0), trainer.device)
    make_plots(out, trainer.model, x)
    n_params = sum(p.numel() for p in trainer.model.parameters())
    return task, result, n_params


def filter_comparison(out: Path, iters: int, device: str) -> None:
    from geoattn.bench.common import format_table

    print(f"\n2. The filter task: rt vs transformer, {iters} steps each (CPU, a minute or two)")
    rows, task = [], None
    for model in FILTER_MODELS:
        t0 = time.perf_counter()
        task, result, n_params = _train(
            "filter",
            model,
            out / f"filter_{model}",
            device,
            max_iters=iters,
            eval_interval=iters,
            eval_iters=4,
            batch_size=16,
            n_layer=2,
            n_head=2,
            n_embd=32,
            lr=3e-3,
            min_lr=3e-4,
            warmup_iters=min(50, iters // 5),
            weight_decay=0.0,
        )
        rows.append(
            [
                f"{model} (learned, {n_params / 1e3:.0f} k params)",
                result[f"val_{ANGLE}"],
                f"{time.perf_counter() - t0:.0f} s",
            ]
        )
    t0 = time.perf_counter()
    baselines = task.baselines("val")
    wall = f"{time.perf_counter() - t0:.0f} s (all)"
    for name, value in baselines.items():
        rows.append([BASELINE_NAMES.get(name, name), value, wall])
        wall = ""
    print(format_table(["estimator", "mean angular error (deg)", "wall"], rows))


ANGLE = "angle_deg"
BASELINE_NAMES = {
    "rt_filter": "closed-form RT filter, true parameters",
    "uniform": "uniform transported mean (no precision)",
    "kalman": "tangent-space Kalman filter",
    "particle": "particle filter (near-optimal)",
    "raw": "raw measurements z/|z|",
}


def lm_comparison(out: Path, data: str, iters: int, device: str) -> None:
    from geoattn.bench.common import format_table

    print(f"\n3. Character LM on {data}: rt vs transformer, {iters} steps each")
    rows = []
    for model in FILTER_MODELS:
        t0 = time.perf_counter()
        _, result, n_params = _train(
            "lm",
            model,
            out / f"lm_{model}",
            device,
            data=data,
            max_iters=iters,
            eval_interval=iters,
            eval_iters=10,
            batch_size=12,
            block_size=64,
            n_layer=2,
            n_head=4,
            n_embd=64,
            lr=2e-3,
            min_lr=2e-4,
            warmup_iters=min(50, iters // 5),
        )
        rows.append(
            [model, f"{n_params / 1e3:.0f} k", result["val_loss"], f"{time.perf_counter() - t0:.0f} s"]
        )
    print(format_table(["model", "params", "val loss (nats/char)", "wall"], rows))


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    out = Path(args.out)
    _claim(out)
    algebra_demo()
    filter_comparison(out, args.iters, args.device)
    if args.data:
        lm_comparison(out, args.data, args.lm_iters, args.device)
    print(
        f"\nPlots (loss.png, attention.png, precision.png) and metrics.jsonl in {out}/*/ ;"
        f" done in {time.perf_counter() - start:.0f} s."
    )
    print("Next: geoattn train --help  (e.g. --task lm --model rt --data tinyshakespeare --out runs/rt)")
    sys.stdout.flush()
    return 0
