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

from geoattn.core.errors import ConfigError

DEFAULT_OUT = "runs/quickstart"
MARKER = ".geoattn-quickstart"  # quickstart owns (and overwrites) only folders that carry this file
FILTER_MODELS = ("rt", "transformer")
FILTER_SEQ_LEN = 32
FILTER_LR = 1e-2
LM_LR = {"rt": 1e-2, "transformer": 3e-3}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument(
        "--data", default=None, help="a UTF-8 text file: also compare rt and transformer as char LMs"
    )
    parser.add_argument("--iters", type=int, default=400, help="training steps per model on the filter task")
    parser.add_argument("--lm-iters", type=int, default=300, help="training steps per model with --data")
    parser.add_argument("--device", default="cpu", help="cpu | cuda")


def _claim(out: Path) -> None:
    """Make ``out`` quickstart's folder: refuse a non-empty folder that quickstart did not create."""
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MARKER).exists())):
        raise ConfigError(f"{out} exists and was not written by quickstart; pass --out NEW_FOLDER")
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


def _train(task, model: str, out: Path, device: str, **fields):
    """Train ``model`` on ``task`` quietly into ``out`` (with plots); returns the trainer and its result."""
    from geoattn.training.config import TrainConfig
    from geoattn.training.trainer import Trainer

    config = TrainConfig(task=task.name, model=model, out=str(out), device=device, **fields)
    trainer = Trainer(config, task, out, verbose=False)
    return trainer, trainer.train()  # writes the plots too


def filter_comparison(out: Path, iters: int, device: str) -> None:
    """rt and transformer against the reference filters, all on the same 256 validation sequences."""
    import torch

    from geoattn.core.formatting import format_table
    from geoattn.tasks import get_task

    task = get_task("filter", block_size=FILTER_SEQ_LEN)
    c = task.config
    print(f"\n2. The filter task: estimate a direction drifting on the sphere in R^{c.dim} from {c.seq_len}")
    print(f"   noisy measurements whose magnitude is their confidence; rt vs transformer, {iters} steps each")
    pool = task.pool("val")
    x = torch.cat((pool.z, pool.times[..., None]), dim=-1).float()  # (B, T, D + 1), as get_batch
    y = pool.directions.float()
    rows = []
    for model in FILTER_MODELS:
        t0 = time.perf_counter()
        trainer, _ = _train(
            task,
            model,
            out / f"filter_{model}",
            device,
            max_iters=iters,
            eval_interval=iters,
            eval_iters=2,
            batch_size=16,
            block_size=FILTER_SEQ_LEN,
            n_layer=2,
            n_head=2,
            n_embd=32,
            lr=FILTER_LR,
            min_lr=FILTER_LR / 10,
            warmup_iters=min(20, iters // 5),
            weight_decay=0.0,
        )
        trainer.model.eval()
        with torch.no_grad():
            prediction, _ = trainer.model(x.to(trainer.device), y.to(trainer.device))
        error = task.metrics(prediction.float().cpu(), y)[ANGLE]
        n_params = sum(p.numel() for p in trainer.model.parameters())
        rows.append(
            [
                f"{model} ({n_params / 1e3:.0f} k params, learned)",
                f"{error:.1f}",
                f"{time.perf_counter() - t0:.0f} s",
            ]
        )
    t0 = time.perf_counter()
    baselines = task.baselines("val")
    wall = f"{time.perf_counter() - t0:.0f} s (all)"
    for name, value in baselines.items():
        rows.append([BASELINE_NAMES.get(name, name), f"{value:.1f}", wall])
        wall = ""
    print(format_table(["estimator", "mean angular error (deg)", "wall"], rows))


ANGLE = "angle_deg"
BASELINE_NAMES = {
    "rt_filter": "closed-form RT filter, true parameters",
    "uniform": "uniform transported mean (no precision)",
    "kalman": "tangent-space Kalman filter",
    "particle": "particle filter, 1,000 particles",
    "raw": "raw measurement directions",
}


def lm_comparison(out: Path, data: str, iters: int, device: str) -> None:
    from geoattn.core.formatting import format_table
    from geoattn.tasks import get_task

    task = get_task("lm", data=data, block_size=64)
    print(f"\n3. Character LM on {data}: rt vs transformer, {iters} steps each (2 layers x 64, context 64)")
    rows = []
    for model in FILTER_MODELS:
        t0 = time.perf_counter()
        trainer, result = _train(
            task,
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
            lr=LM_LR[model],
            min_lr=LM_LR[model] / 10,
            warmup_iters=min(50, iters // 5),
        )
        n_params = sum(p.numel() for p in trainer.model.parameters())
        rows.append(
            [
                model,
                f"{n_params / 1e3:.0f} k",
                f"{result['val_loss']:.3f}",
                f"{time.perf_counter() - t0:.0f} s",
            ]
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
    wall = time.perf_counter() - start
    print(f"\nDone in {wall:.0f} s. Plots (loss, attention map; rt: learned precision) and metrics.jsonl:")
    for run_dir in sorted(p for p in out.iterdir() if p.is_dir()):
        print(f"   {run_dir}/: {' '.join(sorted(f.name for f in run_dir.glob('*.png')))}")
    print("Next: geoattn train --help  (e.g. --task lm --model rt --data tinyshakespeare --out runs/rt)")
    sys.stdout.flush()
    return 0
