"""EGNN's and CGENN's n-body runners (benchmarks/egnn_nbody.py, benchmarks/cgenn_nbody.py) keep the test
files sealed unless told: a sealed run never opens them (garbage there goes unnoticed) and reports no
test key, while ``--read-test`` (or ``GEOATTN_READ_TEST=1``) reads them. Runs the authors' own code for a
step or a few on 100 systems per set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from geoattn.bench.common import peers_dir
from geoattn.tasks.nbody.charged import egnn_file_names, save_egnn_format, simulate

REPO = Path(__file__).resolve().parent.parent
PEERS = (REPO / peers_dir()).resolve()
# (runner, its checkout flag, the checkout, the file marking it, a short budget the runner accepts,
# whether a test-reading run is trained too: CGENN's shortest schedule, 64 steps, takes a minute or more)
RUNNERS = {
    "egnn": ("egnn_nbody.py", "--egnn", PEERS / "egnn", "main_nbody.py", ["--steps", "1"], True),
    "cgenn": (
        "cgenn_nbody.py",
        "--cgenn",
        PEERS / "cgenn",
        "models/nbody_cggnn.py",
        ["--steps", "64", "--val-interval", "32"],
        False,
    ),
}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def charged(tmp_path_factory) -> Path:
    """100 systems per set in EGNN's layout, 41 frames (the task reads frames 30 and 40)."""
    path = tmp_path_factory.mktemp("charged")
    save_egnn_format(simulate({"train": 100, "val": 100, "test": 100}, seed=7, steps=4200), path)
    return path


def _run(
    peer: str, data: Path, out: Path, *extra: str, env: dict | None = None
) -> subprocess.CompletedProcess:
    script, flag, checkout, _, budget, _ = RUNNERS[peer]
    command = [sys.executable, str(REPO / "benchmarks" / script), flag, str(checkout), "--data", str(data)]
    command += ["--out", str(out), "--train-size", "100", "--threads", "1", *budget, *extra]
    return subprocess.run(command, capture_output=True, text=True, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("peer", sorted(RUNNERS))
def test_a_peer_run_reads_the_test_files_only_when_told(peer, charged, tmp_path):
    _, _, checkout, marker, _, trains_read = RUNNERS[peer]
    if not (checkout / marker).is_file():
        pytest.skip(f"no {peer} checkout at {checkout} (see benchmarks/{RUNNERS[peer][0]})")
    data = tmp_path / "data"
    data.mkdir()
    test_files = {f for (name, _), f in egnn_file_names().items() if name == "test"}
    for f in charged.iterdir():
        (data / f.name).write_bytes(b"not an array" if f.name in test_files else f.read_bytes())

    done = _run(peer, data, tmp_path / "sealed")
    assert done.returncode == 0, done.stderr[-2000:]
    sealed = json.loads((tmp_path / "sealed" / "metrics.json").read_text())
    assert sealed["read_test"] is False and not [k for k in sealed if k.startswith("test")]
    assert sealed["val_mse_full"] > 0 and sealed["val_mse_last"] > 0
    if peer == "egnn":  # its one evaluation scored the validation files under both names
        assert sealed["val_mse_last"] == sealed["val_mse_full"]

    # the same garbage read: the runner's --read-test does open the test files (np.load takes the
    # text for a pickle it may not load)
    done = _run(peer, data, tmp_path / "garbage", env={"GEOATTN_READ_TEST": "1"})
    assert done.returncode != 0 and "pickle" in done.stderr
    assert not (tmp_path / "garbage" / "metrics.json").exists()
    if not trains_read:
        return

    for f in test_files:
        (data / f).write_bytes((charged / f).read_bytes())
    done = _run(peer, data, tmp_path / "read", "--read-test")
    assert done.returncode == 0, done.stderr[-2000:]
    read = json.loads((tmp_path / "read" / "metrics.json").read_text())
    assert read["read_test"] is True and read["test_mse"] > 0 and read["test_mse_last"] > 0
    # another set than validation, scored by the same model (the runners seed it)
    assert read["val_mse_full"] == pytest.approx(sealed["val_mse_full"], rel=1e-6)
    assert read["test_mse_last"] != pytest.approx(read["val_mse_full"])
