"""benchmarks/gatr_generate.py: GATr's n-body files from its checkout's simulator and samplers alone.

GATr's checkout is not here in CI, so a stand-in has its two files' shapes: a samplers module whose top
imports what this environment lacks (as GATr's imports torch and its einsum cache) and a simulator that
draws from NumPy's global generator through them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "gatr_generate.py"

SAMPLERS = """
    import numpy as np
    import a_package_nobody_installed  # GATr's misc.py imports torch here: the script must not run it

    def sample_log_uniform(min_, max_, size):
        n = int(np.product(size))
        return np.exp(np.random.rand(n) * (np.log(max_) - np.log(min_)) + np.log(min_)).reshape(size)

    def sample_uniform_in_circle(n, min_radius=0.0, max_radius=1.0):
        return max_radius * np.random.uniform(low=-1, high=1, size=(n, 2))

    def something_else():
        return a_package_nobody_installed.value
"""

SIMULATOR = """
    import numpy as np
    from gatr.utils.misc import sample_log_uniform, sample_uniform_in_circle

    class NBodySimulator:
        def sample(self, num_samples, num_planets=3, domain_shift=False):
            m = sample_log_uniform(1.0, 10.0, size=(num_samples, num_planets + 1))
            x = np.zeros((num_samples, num_planets + 1, 3))
            x[..., :2] = sample_uniform_in_circle(num_samples * (num_planets + 1)).reshape(num_samples, -1, 2)
            x += 200.0 * domain_shift
            v = np.random.normal(size=x.shape)
            trajectory = np.stack([x + t * v for t in range(3)], axis=2)
            return m, x, v, x + 2 * v, trajectory
"""


def _checkout(root: Path) -> Path:
    for name, text in (("gatr/utils/misc.py", SAMPLERS), ("gatr/experiments/nbody/simulator.py", SIMULATOR)):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    return root


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_it_writes_gatrs_five_sets_from_the_seed(tmp_path):
    gatr = _checkout(tmp_path / "gatr")
    for out in ("a", "b"):
        done = _run("--gatr", str(gatr), "--seed", "7", "--out", str(tmp_path / out))
        assert done.returncode == 0, done.stderr
    names = ("train", "val", "eval", "e3_generalization", "object_generalization")
    for name in names:
        a, b = np.load(tmp_path / "a" / f"{name}.npz"), np.load(tmp_path / "b" / f"{name}.npz")
        assert a.files == ["m", "x_initial", "v_initial", "x_final", "trajectories"]
        assert all(np.array_equal(a[k], b[k]) for k in a.files)  # the seed decides every array
    sizes = {n: np.load(tmp_path / "a" / f"{n}.npz")["m"].shape for n in names}
    assert (
        sizes["train"] == (100_000, 4)
        and sizes["val"] == (5_000, 4)
        and sizes["object_generalization"] == (5_000, 6)
    )
    assert np.load(tmp_path / "a" / "e3_generalization.npz")["x_initial"].min() >= 199.0  # shifted
    other = _run("--gatr", str(gatr), "--seed", "8", "--out", str(tmp_path / "c"))
    assert other.returncode == 0
    assert not np.array_equal(
        np.load(tmp_path / "c" / "val.npz")["m"], np.load(tmp_path / "a" / "val.npz")["m"]
    )


def test_a_missing_checkout_or_a_used_folder_is_one_line_and_writes_nothing(tmp_path):
    done = _run("--gatr", str(tmp_path / "nowhere"), "--seed", "1", "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "no GATr checkout" in done.stderr
    assert not (tmp_path / "out").exists()
    used = tmp_path / "used"
    used.mkdir()
    (used / "train.npz").write_bytes(b"mine")
    done = _run("--gatr", str(_checkout(tmp_path / "gatr")), "--seed", "1", "--out", str(used))
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "is not empty" in done.stderr
    assert (used / "train.npz").read_bytes() == b"mine" and len(list(used.iterdir())) == 1
