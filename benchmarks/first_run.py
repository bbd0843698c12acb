"""The compile cost of a user's first run: one training step of a model at the lm recipe, compiled whole
(``torch.compile(model)``, what the trainer did before) and by regions (each block compiled in place,
`geoattn.training.compiling.CompiledModel`, what it does now), each in a fresh process on an empty
compile cache (``TORCHINDUCTOR_CACHE_DIR``: a new temporary folder), then again on the cache it filled.

    python benchmarks/first_run.py                      # rt, 4 layers x 4 heads x 128, T 64, batch 12
    python benchmarks/first_run.py --model ngpt --n-layer 6

Prints per mode: the first step's wall (compile included) on the empty cache and on the filled one,
the median of the next ``--steps`` steps, and the graphs Dynamo compiled. Time it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODES = ("eager", "whole", "regions")


def step_walls(mode: str, args: argparse.Namespace) -> dict[str, float]:
    """In this process: the walls of ``1 + args.steps`` training steps of ``args.model`` run ``mode``."""
    import torch
    from torch._dynamo.utils import counters

    from geoattn.models.base import ModelSizes
    from geoattn.models.lm import build_lm, config_class
    from geoattn.training.compiling import CompiledModel, weight_normalizer

    torch.manual_seed(0)
    sizes = ModelSizes(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block)
    model = build_lm(args.model, config_class(args.model).from_sizes(sizes, {}))
    step_model = {"eager": model, "whole": torch.compile(model), "regions": CompiledModel(model)}[mode]
    normalize = weight_normalizer(model, mode != "eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    walls = []
    for _ in range(1 + args.steps):
        x, y = (
            torch.randint(0, model.config.vocab_size, (args.batch, args.block), generator=g) for _ in "xy"
        )
        start = time.perf_counter()
        _, loss = step_model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        normalize()
        walls.append(time.perf_counter() - start)
    return {
        "first": walls[0],
        "step": statistics.median(walls[1:]),
        "graphs": counters["stats"]["unique_graphs"],
    }


def child(mode: str, args: argparse.Namespace, cache: str) -> dict[str, float]:
    """:func:`step_walls` in a fresh process on the compile cache ``cache``."""
    argv = [sys.executable, __file__, "--child", mode, *sys.argv[1:]]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="rt")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--steps", type=int, default=5, help="steps timed after the first")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(step_walls(args.child, args)))
        return
    shape = f"{args.n_layer} layers x {args.n_head} heads x {args.n_embd}, T {args.block}, batch {args.batch}"
    print(f"{args.model}: {shape}")
    print("| mode | first step s, empty cache | first step s, filled cache | step ms | graphs |")
    print("| --- | --- | --- | --- | --- |")
    for mode in args.modes:
        with tempfile.TemporaryDirectory(prefix="geoattn-first-run-") as cache:
            cold, warm = child(mode, args, cache), child(mode, args, cache)
        cells = [mode, f"{cold['first']:.1f}", f"{warm['first']:.1f}", f"{1e3 * cold['step']:.1f}"]
        print("| " + " | ".join([*cells, str(cold["graphs"])]) + " |")


if __name__ == "__main__":
    main()
