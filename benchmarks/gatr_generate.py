"""GATr's n-body files in this interpreter's NumPy and SciPy, without GATr's other packages.

GATr's ``scripts/generate_nbody_dataset.py`` seeds NumPy's global generator and writes five sets
(train 100,000 systems of a star and 3 planets; val, eval, e3_generalization shifted, 5,000 each;
object_generalization 5,000 with 5 planets). Each system's rotation comes from SciPy's
``special_ortho_group``, whose sampling changed in SciPy 1.16: after the same seed it returns other
rotations and consumes the stream differently, so every set but the first's masses is another draw.
GATr's environment pins SciPy below 1.16 (hydra and its other packages); this script runs the same
simulator and samplers, loaded from the checkout's own files, in any environment with NumPy < 2 (GATr's
samplers call ``np.product``, which NumPy 2 removed; a shim adds it) and SciPy, and writes the files as
GATr's script does::

    python benchmarks/gatr_generate.py --gatr /work/peers/gatr --seed 1234 --out data/nbody-gatr-1234-scipy116

Under SciPy 1.15.3 it writes GATr's script's files at that seed; under 1.16.3 the files of
``data/nbody-gatr`` (seed 42), equal to them to float rounding (≤ 2e-8 in the final positions).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
import types
from pathlib import Path

SETS = (  # name, systems, planets, shifted: GATr's generate_datasets, in its order
    ("train", 100_000, 3, False),
    ("val", 5_000, 3, False),
    ("eval", 5_000, 3, False),
    ("e3_generalization", 5_000, 3, True),
    ("object_generalization", 5_000, 5, False),
)
SIMULATOR = "gatr/experiments/nbody/simulator.py"
SAMPLERS = "gatr/utils/misc.py"


def load_simulator(gatr: Path):
    """GATr's ``NBodySimulator`` class from the checkout, its module's two samplers taken from
    ``gatr/utils/misc.py`` alone (that module imports torch and GATr's einsum cache at the top)."""
    import numpy as np

    if not hasattr(np, "product"):  # removed in NumPy 2; GATr's sampler calls it
        np.product = np.prod
    for package in ("gatr", "gatr.utils", "gatr.experiments", "gatr.experiments.nbody"):
        sys.modules.setdefault(package, types.ModuleType(package))
    tree = ast.parse((gatr / SAMPLERS).read_text())
    wanted = ("sample_log_uniform", "sample_uniform_in_circle")
    body = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in wanted]
    samplers = types.ModuleType("gatr.utils.misc")
    samplers.np = np
    exec(compile(ast.Module(body=body, type_ignores=[]), str(gatr / SAMPLERS), "exec"), samplers.__dict__)
    sys.modules["gatr.utils.misc"] = samplers
    spec = importlib.util.spec_from_file_location("gatr.experiments.nbody.simulator", gatr / SIMULATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.NBodySimulator


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gatr", type=Path, required=True, help="GATr's checkout")
    parser.add_argument("--seed", type=int, required=True, help="the seed of GATr's script (its README: 42)")
    parser.add_argument("--out", type=Path, required=True, help="a new folder for the five .npz files")
    args = parser.parse_args(argv)
    missing = [name for name in (SIMULATOR, SAMPLERS) if not (args.gatr / name).is_file()]
    if missing:
        print(f"error: no GATr checkout at {args.gatr} ({', '.join(missing)} missing)", file=sys.stderr)
        return 2
    if args.out.exists() and any(args.out.iterdir()):
        print(f"error: {args.out} is not empty; nothing was written (choose a new folder)", file=sys.stderr)
        return 2
    import numpy as np
    import scipy

    simulator = load_simulator(args.gatr)()
    args.out.mkdir(parents=True, exist_ok=True)
    np.random.seed(args.seed)
    for name, systems, planets, shifted in SETS:
        m, x_initial, v_initial, x_final, trajectories = simulator.sample(
            systems, num_planets=planets, domain_shift=shifted
        )
        np.savez(
            args.out / f"{name}.npz",
            m=m, x_initial=x_initial, v_initial=v_initial, x_final=x_final, trajectories=trajectories,
        )  # fmt: skip
        print(f"{name}: {len(m)} systems", flush=True)
    print(f"seed {args.seed}, NumPy {np.__version__}, SciPy {scipy.__version__}: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
