"""`torchrun --nproc_per_node 2 -m geoattn train` (gloo) follows one process with the same global batch.

Judged from what rank 0 wrote (metrics.jsonl holds the all-reduced losses), not from exit codes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from conftest import tiny_lm_args

TINY = [*tiny_lm_args(8, 4), "--device", "cpu"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_ranks_match_one_process_with_the_same_global_batch(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    single, double = tmp_path / "single", tmp_path / "ddp"
    one = subprocess.run(
        [sys.executable, "-m", "geoattn", "train", *TINY, "--out", str(single)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert one.returncode == 0, one.stderr
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
    ]
    two = subprocess.run(
        [*launcher, "-m", "geoattn", "train", *TINY, "--out", str(double)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    expected, got = records(single), records(double)
    assert [r["iter"] for r in got] == list(range(1, 9)), two.stderr
    for a, b in zip(expected, got):
        assert abs(a["train_loss"] - b["train_loss"]) <= 1e-5, (a, b)
        assert a["lr"] == b["lr"]
        assert (a["val_loss"] is None) == (b["val_loss"] is None)
        if a["val_loss"] is not None:  # the all-reduced val loss of two half batches
            assert abs(a["val_loss"] - b["val_loss"]) <= 1e-5, (a, b)
            assert abs(a["train_eval_loss"] - b["train_eval_loss"]) <= 1e-5, (a, b)
    assert json.loads((double / "config.json").read_text())["world_size"] == 2
    assert two.returncode == 0, two.stderr  # deterministic teardown: no rank aborts at exit
    assert "Traceback" not in two.stderr
