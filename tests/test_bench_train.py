"""`geoattn bench train`: whole `geoattn train` runs in turn, timed from their own records and as
whole processes; nanoGPT's own ``train.py`` (a fake checkout here) in turn with them."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from conftest import tiny_lm_args

import geoattn.bench.train as bench_train
from geoattn.cli import main


def test_whole_runs_of_each_model_get_a_row_and_a_ratio(tmp_path, capsys):
    train = tiny_lm_args(max_iters=3, eval_interval=3)[4:]  # without --task lm --model transformer
    out = tmp_path / "bench"
    argv = ["bench", "train", "--models", "transformer", "rt", "--repeats", "2", "--out", str(out)]
    assert main([*argv, "--", *train, "--compile=false"]) == 0
    title, rows = _title_and_rows(capsys.readouterr().out)
    assert "--block-size 16" in title and " -- " not in title  # the runs' own arguments, as given
    assert set(rows) == {"transformer", "rt"}
    assert float(rows["transformer"][1]) == 1.0 and float(rows["rt"][1]) > 0  # whole processes
    assert float(rows["transformer"][4]) == 1.0 and float(rows["rt"][4]) > 0  # the trainers' walls
    assert len(rows["rt"][2].split()) == 2 and len(rows["rt"][7].split()) == 2  # a ratio and a loss per run
    low, median, high = (float(x) for x in rows["rt"][0].split(" / "))  # whole process: start-up and all
    assert 0 < low <= median <= high
    low, median, high = (float(x) for x in rows["rt"][3].split(" / "))  # the trainer's (0.0 s: tiny runs)
    assert 0 <= low <= median <= high
    assert float(rows["rt"][6]) > 0  # the median step, in ms
    # each timed run kept its directory; with --compile false nothing is compiled, so nothing primed
    assert (out / "rt_1" / "metrics.jsonl").is_file() and not (out / "prime_rt").exists()


def test_warm_runs_are_primed_by_a_compiled_run(tmp_path, monkeypatch):
    """``--cache warm`` fills each model's compile cache with an untimed run that compiles (a short
    run compiles only when told), then times runs on that cache."""
    calls = []

    def fake_train(argv, cache):
        calls.append((argv, cache))
        return 1, 0.0  # stop after the first call

    monkeypatch.setattr(bench_train, "_train", fake_train)
    train = tiny_lm_args(max_iters=3, eval_interval=3)[4:]
    assert main(["bench", "train", "--models", "rt", "--out", str(tmp_path / "b"), "--", *train]) == 2
    argv, cache = calls[0]
    assert argv[argv.index("--out") + 1].endswith("prime_rt") and cache.name == "rt"
    assert argv[-2:] == ["--compile", "true"]


def test_cold_runs_are_rerun_on_the_cache_they_filled(tmp_path, monkeypatch, capsys):
    """``--cache cold``: every run on an empty cache of its own, then the same run again on that cache
    (a user's second run), both whole-process walls in the table side by side."""
    calls = []

    def fake_train(argv, cache):
        run_dir = Path(argv[argv.index("--out") + 1])
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps({"wall_s": 1.0, "val_loss": 2.5}))
        (run_dir / "metrics.jsonl").write_text(json.dumps({"step_s": 0.5}) + "\n")
        calls.append((run_dir.name, cache.name))
        return 0, 9.0 if cache.name not in {c for _, c in calls[:-1]} else 4.0  # the rerun: no compile

    monkeypatch.setattr(bench_train, "_train", fake_train)
    argv = ["bench", "train", "--models", "transformer", "rt", "--cache", "cold"]
    assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    assert calls == [
        ("transformer_0", "transformer_0"),
        ("transformer_0_rerun", "transformer_0"),
        ("rt_0", "rt_0"),
        ("rt_0_rerun", "rt_0"),
        ("transformer_1", "transformer_1"),
        ("transformer_1_rerun", "transformer_1"),
        ("rt_1", "rt_1"),
        ("rt_1_rerun", "rt_1"),
    ]
    printed = capsys.readouterr().out
    _, rows = _title_and_rows(printed)
    assert rows["rt"][0] == "9.0 / 9.0 / 9.0" and rows["rt"][-1] == "4.0 / 4.0 / 4.0"
    assert "rerun s min / med / max" in printed


def test_a_used_out_folder_is_refused(tmp_path, capsys):
    (tmp_path / "mine.txt").write_text("keep")
    assert main(["bench", "train", "--out", str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (tmp_path / "mine.txt").read_text() == "keep"


def test_a_failing_run_is_one_line(tmp_path, capsys):
    argv = ["bench", "train", "--models", "nosuchmodel", "--repeats", "1", "--out", str(tmp_path / "b")]
    assert main([*argv, "--", *tiny_lm_args(max_iters=1, eval_interval=1)[4:]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nosuchmodel" in err[0]


def _title_and_rows(printed: str) -> tuple[str, dict[str, list[str]]]:
    """The title and the table's rows (by model) of the command's output, after the machine header."""
    lines = printed.split("\n", 2)[2].splitlines()  # after the machine header's two lines
    table = [line for line in lines if line.startswith("|")][2:]  # after the headers and the rule
    return lines[0], {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in table
    }


# A nanoGPT checkout as far as the bench reads it: ``train.py`` reads ``configurator.py`` and
# ``data/<dataset>/train.bin`` relative to its working directory, prints nanoGPT's evaluation and
# iteration lines and records what it saw; ``prepare.py`` turns the ``input.txt`` beside it into
# ``train.bin`` / ``val.bin``.
FAKE_NANOGPT = {
    "train.py": """
        import json, os, sys
        out_dir, dataset, max_iters, eval_interval = "out", "openwebtext", 5000, 2000
        exec(open("configurator.py").read())
        train_bin = os.path.getsize(os.path.join("data", dataset, "train.bin"))
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "seen.json"), "w") as f:
            json.dump({"argv": sys.argv[1:], "cwd": os.getcwd(), "train_bin": train_bin}, f)
        with open(os.environ["BENCH_CALLS"], "a") as f:
            f.write("nanogpt\\n")
        if os.environ.get("FAKE_NANOGPT_SILENT"):
            sys.exit(0)
        for it in range(max_iters + 1):
            if it % eval_interval == 0:
                print(f"step {it}: train loss {4 - it / 10:.4f}, val loss {4.1 - it / 10:.4f}")
            print(f"iter {it}: loss {4 - it / 10:.4f}, time 12.00ms, mfu -100.00%")
    """,
    "configurator.py": """
        import sys
        from ast import literal_eval
        for arg in sys.argv[1:]:
            if "=" not in arg:
                exec(open(arg).read())
            else:
                key, val = arg[2:].split("=")
                try:
                    globals()[key] = literal_eval(val)
                except (SyntaxError, ValueError):
                    globals()[key] = val
    """,
    "config/train_shakespeare_char.py": """
        dataset = "shakespeare_char"
        eval_interval = 250
        max_iters = 5000
    """,
    "data/shakespeare_char/prepare.py": """
        import os
        here = os.path.dirname(__file__)
        text = open(os.path.join(here, "input.txt")).read()
        n = int(0.9 * len(text))
        open(os.path.join(here, "train.bin"), "wb").write(text[:n].encode())
        open(os.path.join(here, "val.bin"), "wb").write(text[n:].encode())
    """,
}


def _fake_nanogpt(root):
    for name, source in FAKE_NANOGPT.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(source))
    return root


def _fake_ours(calls_file, argvs):
    """`_train` without a process: a run's summary and metrics, 4 s of whole-process wall."""

    def fake_train(argv, cache):
        run_dir = Path(argv[argv.index("--out") + 1])
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text(json.dumps({"wall_s": 2.0, "final": {"val_loss_full": 2.5}}))
        (run_dir / "metrics.jsonl").write_text(json.dumps({"step_s": 0.05}) + "\n")
        with open(calls_file, "a") as f:
            f.write(run_dir.name + "\n")
        argvs.append(argv)
        return 0, 4.0

    return fake_train


def test_nanogpt_runs_in_turn_on_the_same_corpus_from_its_prepared_folder(tmp_path, monkeypatch, capsys):
    """``--peer nanogpt``: its prepare.py writes the bins from our corpus (written as input.txt in
    --out, never in the checkout), its train.py runs from that folder with the recipe and our mapped
    flags after it, in turn with our runs; its last val loss and step go into the table."""
    repo = _fake_nanogpt(tmp_path / "nanogpt")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("To be, or not to be, that is the question.\n" * 40)
    calls, argvs = tmp_path / "calls.txt", []
    monkeypatch.setenv("GEOATTN_CORPUS", str(corpus))
    monkeypatch.setenv("BENCH_CALLS", str(calls))
    monkeypatch.setattr(bench_train, "_train", _fake_ours(calls, argvs))
    monkeypatch.chdir(tmp_path)  # a checkout named relative to here still runs from --out
    out = tmp_path / "bench"
    argv = ["bench", "train", "--peer", "nanogpt", "--nanogpt", "nanogpt", "--models", "transformer"]
    argv += [
        "--repeats",
        "2",
        "--out",
        str(out),
        "--",
        "--max-iters=3",
        "--eval-interval",
        "3",
        "--compile",
        "false",
    ]
    assert main(argv) == 0

    assert calls.read_text().split() == ["transformer_0", "nanogpt", "transformer_1", "nanogpt"]
    assert argvs[0][argvs[0].index("--data") + 1] == str(corpus.resolve())  # ours read the same file
    data = out / "nanogpt" / "data" / "shakespeare_char"
    assert (data / "input.txt").read_text() == corpus.read_text()
    assert sorted(p.name for p in repo.rglob("*") if p.is_file()) == sorted(
        n.split("/")[-1] for n in FAKE_NANOGPT
    )
    seen = json.loads((out / "nanogpt_1" / "seen.json").read_text())
    assert seen["cwd"] == str(out / "nanogpt") and seen["train_bin"] == (data / "train.bin").stat().st_size
    args = seen["argv"]
    assert args[:3] == ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False"]
    assert args.index("--max_iters=3") > args.index("--max_iters=2000")  # ours after the recipe: they win
    assert {"--lr_decay_iters=3", "--eval_interval=3", f"--out_dir={out / 'nanogpt_1'}"} <= set(args)

    printed = capsys.readouterr().out
    _, rows = _title_and_rows(printed)
    row = rows["nanoGPT train.py"]
    low, median, high = (float(x) for x in row[0].split(" / "))
    assert 0 <= low <= median <= high and float(row[1]) >= 0  # its whole process (a fake: 0.0 s), × ours
    assert row[3:6] == ["n/a", "n/a", "n/a"] and float(row[6]) == 12.0  # no trainer wall; its iter times
    assert row[7] == "3.8000 3.8000 (step 3)"
    assert float(rows["transformer"][0].split(" / ")[0]) == 4.0  # ours: whole processes too
    assert f"nanoGPT: cd {out / 'nanogpt'} && " in printed and "on eval_iters batches" in printed


def test_a_missing_nanogpt_checkout_is_one_line_that_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GEOATTN_PEERS", str(tmp_path / "peers"))
    assert main(["bench", "train", "--peer", "nanogpt", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(tmp_path / "peers" / "nanogpt") in err[0] and "git clone" in err[0]
    assert not (tmp_path / "b").exists()


def test_a_flag_nanogpt_cannot_follow_is_refused_in_one_line(tmp_path, capsys):
    repo = _fake_nanogpt(tmp_path / "nanogpt")
    argv = ["bench", "train", "--peer", "nanogpt", "--nanogpt", str(repo), "--out", str(tmp_path / "b")]
    assert main([*argv, "--", "--max-iters", "3", "--block-size", "16", "--set", "model.mlp=gelu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--block-size, --set would change ours only" in err[0]
    assert not (tmp_path / "b").exists()


def test_a_nanogpt_run_without_an_evaluation_is_one_line_naming_its_log(tmp_path, monkeypatch, capsys):
    repo = _fake_nanogpt(tmp_path / "nanogpt")
    (tmp_path / "corpus.txt").write_text("All the world's a stage.\n" * 40)
    monkeypatch.setenv("GEOATTN_CORPUS", str(tmp_path / "corpus.txt"))
    monkeypatch.setenv("BENCH_CALLS", str(tmp_path / "calls.txt"))
    monkeypatch.setenv("FAKE_NANOGPT_SILENT", "1")
    monkeypatch.setattr(bench_train, "_train", _fake_ours(tmp_path / "calls.txt", []))
    out = tmp_path / "b"
    argv = ["bench", "train", "--peer", "nanogpt", "--nanogpt", str(repo), "--models", "transformer"]
    assert main([*argv, "--repeats", "1", "--out", str(out), "--", "--compile", "false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no 'step N: train loss X, val loss Y' line" in err[0]
    assert str(out / "nanogpt_0.log") in err[0]


# GATr's runner as far as the bench reads it: a "venv interpreter" that records its arguments and
# writes the runner's metrics.json into --out (the real runner is benchmarks/gatr_nbody.py)
FAKE_GATR_PYTHON = """
    import json, pathlib, sys
    args = sys.argv[2:]  # after the runner's path
    out = pathlib.Path(args[args.index("--out") + 1])
    out.mkdir(parents=True)
    (out / "seen.json").write_text(json.dumps({"runner": sys.argv[1], "args": args}))
    (out / "metrics.json").write_text(json.dumps({"wall_s": 30.0, "s_per_step": 0.5, "val_mse_full": 6e-4}))
"""


def _fake_gatr(root: Path) -> tuple[Path, Path, Path]:
    """A GATr checkout, its venv's interpreter (:data:`FAKE_GATR_PYTHON`) and a directory of GATr's
    five sets (empty files: the fake runner reads none)."""
    import sys

    (root / "gatr" / "gatr" / "experiments" / "nbody").mkdir(parents=True)
    (root / "gatr" / "config").mkdir()
    (root / "gatr" / "config" / "nbody.yaml").write_text("exp_name: nbody\n")
    (root / "fake_runner.py").write_text(textwrap.dedent(FAKE_GATR_PYTHON))
    python = root / "gatr-venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {root / "fake_runner.py"} "$@"\n')
    python.chmod(0o755)
    data = root / "nbody-gatr"
    data.mkdir()
    for name in ("train", "val", "eval", "e3_generalization", "object_generalization"):
        (data / f"{name}.npz").write_bytes(b"")
    return root / "gatr", python, data


def test_gatr_runs_in_turn_on_the_same_files_with_the_same_budget_and_threads(tmp_path, monkeypatch, capsys):
    """``--peer gatr``: GATr's runner gets our steps, batch, seed, files and threads, the training set
    size both sides use (1,000 unless given), in turn with our runs; its trainer wall and val MSE go
    into the table beside ours."""
    import torch

    repo, python, data = _fake_gatr(tmp_path)
    calls, argvs = tmp_path / "calls.txt", []
    monkeypatch.setenv("BENCH_CALLS", str(calls))
    monkeypatch.setattr(bench_train, "_train", _fake_ours(calls, argvs))
    out = tmp_path / "bench"
    argv = ["bench", "train", "--task", "nbody", "--peer", "gatr", "--gatr", str(repo), "--gatr-python"]
    argv += [str(python), "--models", "rotor", "--repeats", "2", "--out", str(out), "--"]
    argv += ["--data", str(data), "--max-iters", "5", "--batch-size=8", "--lr", "2e-3", "--compile", "false"]
    assert main(argv) == 0

    assert calls.read_text().split() == ["rotor_0", "rotor_1"]  # ours; GATr's runs write their own dirs
    assert all(argv[argv.index("--set") + 1] == "task.train_size=1000" for argv in argvs)
    seen = json.loads((out / "gatr_1" / "seen.json").read_text())
    assert seen["runner"].endswith("benchmarks/gatr_nbody.py")
    args = seen["args"]
    pairs = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}
    assert pairs["--steps"] == "5" and pairs["--batch-size"] == "8" and pairs["--train-size"] == "1000"
    assert pairs["--data"] == str(data.resolve()) and pairs["--gatr"] == str(repo)
    assert pairs["--threads"] == str(torch.get_num_threads()) and pairs["--lr"] == "0.002"  # its chosen rate
    assert (out / "gatr_0" / "metrics.json").is_file()

    printed = capsys.readouterr().out
    _, rows = _title_and_rows(printed)
    row = rows["GATr (its own code)"]
    assert row[3] == "30.0 / 30.0 / 30.0" and float(row[4]) == 15.0  # its trainer wall, × ours (2.0 s)
    assert row[5] == "n/a" and float(row[6]) == 500.0 and row[7] == "6.000e-04 6.000e-04"
    assert "GATr: " in printed and "experiments/nbody-lr.toml" in printed


def test_gatr_peer_input_errors_are_one_line_and_write_nothing(tmp_path, monkeypatch, capsys):
    repo, python, data = _fake_gatr(tmp_path)
    out = tmp_path / "b"
    base = ["bench", "train", "--task", "nbody", "--peer", "gatr", "--out", str(out)]
    cases = [
        (["--gatr", str(tmp_path / "nowhere"), "--", "--data", str(data)], "no GATr checkout at"),
        (
            ["--gatr", str(repo), "--gatr-python", str(tmp_path / "py"), "--", "--data", str(data)],
            "no GATr venv",
        ),
        (["--gatr", str(repo), "--gatr-python", str(python)], "pass -- --data DIR"),
        (
            ["--gatr", str(repo), "--gatr-python", str(python), "--", "--data", str(tmp_path)],
            "has no train.npz",
        ),
        (
            ["--gatr", str(repo), "--gatr-python", str(python), "--", "--data", str(data), "--n-embd", "64"],
            "--n-embd would change ours only",
        ),
    ]
    for extra, message in cases:
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (extra, err)
    assert main(["bench", "train", "--peer", "gatr", "--gatr", str(repo), "--out", str(out)]) == 2
    assert "not --task lm" in capsys.readouterr().err
    assert not out.exists()


def test_a_peer_outside_a_source_checkout_is_one_line(tmp_path, capsys):
    """``--peer`` runs the driver script beside the package's source; where there is none it says so."""
    out = tmp_path / "b"
    argv = ["bench", "train", "--peer", "nanogpt", "--peers-scripts", str(tmp_path), "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(tmp_path / "peer_nanogpt.py") in err[0] and "source checkout" in err[0]
    assert not out.exists()


def test_each_driver_says_which_of_our_flags_reach_its_peer():
    """The drivers' ``flags``: JSON naming the task, the flags that reach the peer and ours only."""
    import subprocess
    import sys

    for name, task, reaches in (("nanogpt", "lm", "--max-iters"), ("gatr", "nbody", "--batch-size")):
        script = bench_train.SCRIPTS / f"peer_{name}.py"
        done = subprocess.run([sys.executable, str(script), "flags"], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        flags = json.loads(done.stdout)
        assert flags["task"] == task and reaches in flags["reach"] and "--compile" in flags["ours_only"]
