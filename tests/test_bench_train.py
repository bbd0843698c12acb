"""`geoattn bench train`: whole `geoattn train` runs in turn, timed from their own records."""

from __future__ import annotations

from conftest import tiny_lm_args

import geoattn.bench.train as bench_train
from geoattn.cli import main


def test_whole_runs_of_each_model_get_a_row_and_a_ratio(tmp_path, capsys):
    train = tiny_lm_args(max_iters=3, eval_interval=3)[4:]  # without --task lm --model transformer
    out = tmp_path / "bench"
    argv = ["bench", "train", "--models", "transformer", "rt", "--repeats", "2", "--out", str(out)]
    assert main([*argv, "--", *train, "--compile=false"]) == 0
    printed = capsys.readouterr().out.split("\n", 2)[2]  # after the machine header's two lines
    title = printed.splitlines()[0]
    assert "--block-size 16" in title and " -- " not in title  # the runs' own arguments, as given
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in printed.splitlines()[3:]}
    assert set(rows) == {"transformer", "rt"}
    assert float(rows["transformer"][1]) == 1.0 and float(rows["rt"][1]) > 0
    assert len(rows["rt"][2].split()) == 2 and len(rows["rt"][5].split()) == 2  # a ratio and a loss per run
    low, median, high = (float(x) for x in rows["rt"][0].split(" / "))  # wall (0.0 s: tiny runs)
    assert 0 <= low <= median <= high
    assert float(rows["rt"][4]) > 0  # the median step, in ms
    # each timed run kept its directory; with --compile false nothing is compiled, so nothing primed
    assert (out / "rt_1" / "metrics.jsonl").is_file() and not (out / "prime_rt").exists()


def test_warm_runs_are_primed_by_a_compiled_run(tmp_path, monkeypatch):
    """``--cache warm`` fills each model's compile cache with an untimed run that compiles (a short
    run compiles only when told), then times runs on that cache."""
    calls = []

    def fake_train(argv, cache):
        calls.append((argv, cache))
        return 1  # stop after the first call

    monkeypatch.setattr(bench_train, "_train", fake_train)
    train = tiny_lm_args(max_iters=3, eval_interval=3)[4:]
    assert main(["bench", "train", "--models", "rt", "--out", str(tmp_path / "b"), "--", *train]) == 2
    argv, cache = calls[0]
    assert argv[argv.index("--out") + 1].endswith("prime_rt") and cache.name == "rt"
    assert argv[-2:] == ["--compile", "true"]


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
