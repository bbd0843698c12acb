"""The `geoattn` command line: train / eval / sample / data, config layering, and every bad input
ending in one line `geoattn <cmd>: error: ...` with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SHAKESPEARE, tiny_lm_args

from geoattn.cli import build_parser, main
from geoattn.tasks.lm import datasets as registry

TINY = tiny_lm_args(6, 3)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_usage_error(capsys, argv: list[str], command: str, *fragments: str) -> str:
    code, _, err = run(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"geoattn {command}: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """One tiny lm run shared by the eval / sample / checkpoint tests (they copy it before damaging it)."""
    out = tmp_path_factory.mktemp("cli") / "run"
    assert main(["train", *TINY, "--out", str(out)]) == 0
    return out


def copy_run(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


@pytest.mark.parametrize("command", ["quickstart", "train", "eval", "sample", "data", "bench"])
def test_every_subcommand_has_help(capsys, command):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: geoattn {command}" in capsys.readouterr().out


def test_train_flags_are_the_documented_ones():
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    flags = {s for action in train._actions for s in action.option_strings}
    documented = (
        "--task --model --data --out --max-iters --eval-interval --eval-iters --batch-size --block-size "
    )
    documented += "--n-layer --n-head --n-embd --lr --seed --device --resume --force --config --set"
    assert set(documented.split()) <= flags


def test_train_writes_a_run_and_reports_it(trained, capsys):
    lines = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in lines] == [1, 2, 3, 4, 5, 6]
    config = json.loads((trained / "config.json").read_text())["train"]
    assert (config["n_embd"], config["max_iters"], config["data"]) == (32, 6, str(SHAKESPEARE))


def test_toml_then_set_then_flags(tmp_path, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text(
        "max_iters = 100\nlr = 0.5\n\n[optim]\nwarmup_iters = 1\nweight_decay = 0.0\n\n"
        '[model_options]\nmlp = "gelu"\n'
    )
    out = tmp_path / "run"
    code, _, _ = run(
        capsys,
        "train",
        *TINY,
        "--out",
        str(out),
        "--config",
        str(toml),
        "--set",
        "lr=0.01",
        "--set",
        "model.dropout=0.0",
        "--set",
        "min_lr=1e-3",
    )
    assert code == 0
    config = json.loads((out / "config.json").read_text())["train"]
    assert config["max_iters"] == 6  # the flag beats the TOML
    assert config["lr"] == 0.01  # --set beats the TOML
    assert config["min_lr"] == 1e-3 and config["warmup_iters"] == 1 and config["weight_decay"] == 0.0
    assert config["model_options"] == {"mlp": "gelu", "dropout": 0.0}
    assert json.loads((out / "config.json").read_text())["model"]["mlp"] == "gelu"


def test_eval_prints_the_length_extrapolation_table(trained, capsys):
    code, out, _ = run(capsys, "eval", "--out", str(trained), "--eval-iters", "1")
    assert code == 0
    rows = [line for line in out.splitlines() if line.startswith("| val_loss @")]
    contexts = [row.split("|")[1].split("@")[1].split("(")[0].strip() for row in rows]
    assert contexts == ["16", "32", "64", "128", "256"]
    assert all("full val split" in row for row in rows)
    losses = [float(row.split("|")[2]) for row in rows]  # RoPE: every length runs
    assert all(0 < loss < 10 for loss in losses)
    assert "parameters" in out.splitlines()[0]


def test_eval_reports_what_learned_positions_cannot_do(tmp_path, capsys):
    out = tmp_path / "learned"
    assert main(["train", *TINY, "--out", str(out), "--set", 'model.pos="learned"']) == 0
    capsys.readouterr()
    code, text, _ = run(capsys, "eval", "--out", str(out), "--eval-iters", "1")
    assert code == 0
    rows = [line for line in text.splitlines() if line.startswith("| val_loss @")]
    assert float(rows[0].split("|")[2]) > 0
    assert all("n/a" in row for row in rows[1:])


def test_sample_continues_the_prompt(trained, capsys):
    argv = ["sample", "--out", str(trained), "--prompt", "ROMEO:", "--max-new-tokens", "30"]
    argv += ["--seed", "1", "--top-k", "5"]
    code, out, _ = run(capsys, *argv)
    assert code == 0
    text = out.rstrip("\n")
    assert text.startswith("ROMEO:") and len(text) == len("ROMEO:") + 30
    assert run(capsys, *argv)[1] == out  # the seed makes it reproducible
    assert_usage_error(capsys, ["sample", "--out", str(trained), "--prompt", "Ωmega"], "sample", "'Ω'")


def test_data_list_and_offline_download(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    code, out, _ = run(capsys, "data", "list")
    assert code == 0 and "tinyshakespeare" in out and str(tmp_path / "geoattn") in out

    def offline(url, timeout=None):
        raise registry.urllib.error.URLError("Temporary failure in name resolution")

    monkeypatch.setattr(registry.urllib.request, "urlopen", offline)
    assert_usage_error(capsys, ["data", "download", "tinyshakespeare"], "data", "pass --data FILE")
    assert_usage_error(capsys, ["data", "download", "nope"], "data", "unknown dataset 'nope'")
    # --data NAME downloads on first use: offline, the same one line
    assert_usage_error(
        capsys,
        ["train", *TINY, "--data", "tinyshakespeare", "--out", str(tmp_path / "r")],
        "train",
        "pass --data FILE",
    )


# ----------------------------------------------------------------------------- bad input -----------
@pytest.mark.parametrize(
    "content, fragment",
    [(None, "does not exist"), (b"", "is empty"), (b"\xff\xfe\x00bad", "is not UTF-8")],
)
def test_bad_data_files(tmp_path, capsys, content, fragment):
    path = tmp_path / "corpus.txt"
    if content is not None:
        path.write_bytes(content)
    assert_usage_error(
        capsys,
        ["train", *TINY, "--data", str(path), "--out", str(tmp_path / "r")],
        "train",
        fragment,
        "corpus.txt",
    )
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "flags, fragments",
    [
        (["--task", "vision"], ["unknown task 'vision'", "lm, filter, nbody"]),
        (["--model", "gpt5"], ["supports models transformer, rt, rfa, ngpt", "'gpt5'"]),
        (["--model", "gatr"], ["lm task supports models", "rotor", "'gatr'"]),
        (["--set", "lerning_rate=1"], ["unknown config key 'lerning_rate'", "valid keys:", "max_iters"]),
        (["--set", "model.widht=3"], ["unknown model setting(s) widht", "valid:"]),
        (["--max-iters", "0"], ["max_iters must be >= 1"]),
    ],
)
def test_bad_settings(tmp_path, capsys, flags, fragments):
    assert_usage_error(capsys, ["train", *TINY, *flags, "--out", str(tmp_path / "r")], "train", *fragments)


@pytest.mark.parametrize(
    "flags, fragments",
    [
        (["--model", "gatr"], ["filter task supports models transformer, rt, rfa, ngpt, rotor", "'gatr'"]),
        (["--set", "task.sigma=1"], ["unknown task setting(s) sigma", "valid:", "sigma_t"]),
        (["--data", str(SHAKESPEARE)], ["the filter task generates its data; it takes no --data"]),
    ],
)
def test_bad_filter_settings(tmp_path, capsys, flags, fragments):
    argv = ["train", "--task", "filter", "--max-iters", "1", "--out", str(tmp_path / "r"), *flags]
    assert_usage_error(capsys, argv, "train", *fragments)


def test_a_typo_in_the_toml_lists_the_valid_keys(tmp_path, capsys):
    toml = tmp_path / "bad.toml"
    toml.write_text("[optim]\nlearning_rate = 1e-3\n")
    line = assert_usage_error(
        capsys,
        ["train", *TINY, "--config", str(toml), "--out", str(tmp_path / "r")],
        "train",
        "unknown config key 'learning_rate'",
        "bad.toml",
        "valid keys:",
    )
    for key in ("lr", "min_lr", "warmup_iters", "batch_size", "model.KEY"):
        assert key in line


def test_out_is_never_overwritten_without_resume_or_force(trained, tmp_path, capsys):
    out = copy_run(trained, tmp_path / "run")
    before = (out / "metrics.jsonl").read_text()
    assert_usage_error(
        capsys, ["train", *TINY, "--out", str(out)], "train", "is not empty", "--resume", "--force"
    )
    assert (out / "metrics.jsonl").read_text() == before
    (out / "notes.txt").write_text("mine")
    code, _, _ = run(capsys, "train", *TINY, "--max-iters", "2", "--out", str(out), "--force")
    assert code == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert (out / "notes.txt").read_text() == "mine"  # --force replaces run files only


def test_bad_data_leaves_an_existing_out_untouched_even_with_force(trained, tmp_path, capsys):
    """The task and its data load before --out is cleared: a missing data file ends in one line and
    the run that was there is still there, file for file."""
    out = copy_run(trained, tmp_path / "run")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    argv = ["train", *TINY, "--data", str(tmp_path / "missing.txt"), "--out", str(out), "--force"]
    assert_usage_error(capsys, argv, "train", "missing.txt", "does not exist")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_piped_run_writes_a_progress_line_every_log_interval(tmp_path):
    """Where stderr is no terminal (a scheduler's log, nohup, a pipe) `geoattn train` writes a plain
    line every --log-interval steps: step, loss, steps/s, ETA."""
    out = tmp_path / "run"
    argv = [*tiny_lm_args(6, 6), "--log-interval", "2", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "geoattn", "train", *argv], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("iter ") and "steps/s" in line]
    assert [line.split(":")[0] for line in lines] == ["iter 2/6", "iter 4/6", "iter 6/6"], done.stderr
    assert all(", ETA " in line and "loss " in line for line in lines)
    assert float(lines[-1].split("loss ")[1].split(",")[0]) > 0


def test_resume_without_a_checkpoint(tmp_path, capsys):
    assert_usage_error(
        capsys, ["train", "--out", str(tmp_path / "empty"), "--resume"], "train", "--resume: no checkpoint in"
    )


def test_resume_continues_and_may_extend_the_run(trained, tmp_path, capsys):
    out = copy_run(trained, tmp_path / "run")
    code, _, err = run(capsys, "train", "--out", str(out), "--resume", "--max-iters", "8")
    assert code == 0 and "resuming at iter 6 to 8 iters" in err
    assert [json.loads(line)["iter"] for line in (out / "metrics.jsonl").read_text().splitlines()] == list(
        range(1, 9)
    )


def test_truncated_weights(trained, tmp_path, capsys):
    out = copy_run(trained, tmp_path / "run")
    data = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[: len(data) // 3])
    assert_usage_error(
        capsys, ["eval", "--out", str(out)], "eval", "model.safetensors is corrupt or truncated"
    )
    assert_usage_error(capsys, ["train", "--out", str(out), "--resume"], "train", "corrupt or truncated")


def test_model_config_that_does_not_match_the_weights(trained, tmp_path, capsys):
    out = copy_run(trained, tmp_path / "run")
    assert_usage_error(
        capsys,
        ["train", "--out", str(out), "--resume", "--n-embd", "64"],
        "train",
        "does not match the model built from its config.json",
    )
    config = json.loads((out / "config.json").read_text())
    config["train"]["n_layer"] = 2
    (out / "config.json").write_text(json.dumps(config))
    assert_usage_error(capsys, ["eval", "--out", str(out)], "eval", "does not match", "Missing key(s)")
    (out / "config.json").write_text("{not json")
    assert_usage_error(capsys, ["sample", "--out", str(out)], "sample", "config.json is not valid JSON")


def test_eval_of_a_folder_without_a_run(tmp_path, capsys):
    assert_usage_error(capsys, ["eval", "--out", str(tmp_path)], "eval", "holds no geoattn run")


def test_the_real_command_exits_2_with_one_line_and_no_traceback(tmp_path):
    missing = tmp_path / "missing.txt"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "geoattn",
            "train",
            *TINY,
            "--data",
            str(missing),
            "--out",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert (
        proc.stderr.strip()
        == f"geoattn train: error: data file {missing} does not exist (nor is it a dataset "
        f"name: tinyshakespeare)"
    )
    bad_flag = subprocess.run(
        [sys.executable, "-m", "geoattn", "train", "--max-iters", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad_flag.returncode == 2 and len(bad_flag.stderr.strip().splitlines()) == 1
    assert bad_flag.stderr.startswith("geoattn train: error: ")


def test_quickstart_runs_and_owns_only_its_folder(tmp_path, capsys):
    out = tmp_path / "qs"
    code, text, _ = run(capsys, "quickstart", "--out", str(out), "--iters", "2")
    assert code == 0
    assert "|R a R~ - b| = " in text and float(text.split("|R a R~ - b| = ")[1].split()[0]) < 1e-12
    rows = {
        line.split("|")[1].strip(): line.split("|")[2].strip()
        for line in text.splitlines()
        if line.startswith("| ") and "---" not in line
    }
    for name in (
        "closed-form RT filter, true parameters",
        "tangent-space Kalman filter",
        "particle filter, 1,000 particles",
        "raw measurement directions",
    ):
        assert 0 < float(rows[name]) < 90
    assert any(name.startswith("rt (") for name in rows) and any(
        name.startswith("transformer (") for name in rows
    )
    assert (out / "filter_rt" / "precision.png").exists() and (
        out / "filter_transformer" / "loss.png"
    ).exists()
    assert str(out) in text
    # a second run replaces its own folder; a folder with someone else's files is refused
    (out / "filter_rt" / "stale.txt").write_text("old")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("precious")
    assert_usage_error(
        capsys,
        ["quickstart", "--out", str(mine), "--iters", "1"],
        "quickstart",
        "was not written by quickstart",
    )
    assert (mine / "thesis.tex").read_text() == "precious"


def test_output_into_a_closed_pipe_ends_quietly():
    """`geoattn ... | head -1`: the reader has gone when the output is written; no traceback (and no
    "Exception ignored" at exit), the shell's code for a closed pipe."""
    import os

    read, write = os.pipe()
    os.close(read)  # every write into the pipe now fails with EPIPE
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "geoattn", "train", "--task", "lm", "--list-settings"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
    assert proc.returncode == 141
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


def test_the_command_line_and_the_models_import_without_the_compiler():
    """Parsing a command and importing every model imports no ``torch._dynamo`` (seconds at start-up):
    what only matters once something compiles is marked lazily (`geoattn.core.compile`)."""
    code = (
        "import sys\n"
        "from geoattn.cli import build_parser\n"
        "build_parser().parse_args(['data', 'list'])\n"
        "import geoattn.models, geoattn.layers, geoattn.attention\n"
        "from geoattn.models import RotorLM, RotorTransformer, TransformerLM\n"
        "from geoattn.attention import rotor_attention, rt_attention\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_the_lazy_compiler_markers_do_what_torchs_do():
    """`constant_result` sets what ``torch.compiler.assume_constant_result`` sets; `disabled` runs its
    function eagerly inside a caller's ``torch.compile`` (a graph break), as ``torch.compiler.disable``."""
    import torch

    from geoattn.core.compile import constant_result, disabled

    def ours():
        return 1

    def theirs():
        return 1

    assert vars(constant_result(ours)) == vars(torch.compiler.assume_constant_result(theirs))
    seen = []

    @disabled
    def inner(x):
        seen.append(torch.compiler.is_compiling())
        return x.sin()

    x = torch.randn(3)
    out = torch.compile(lambda x: inner(x + 1).cos(), backend="eager")(x)
    torch.testing.assert_close(out, (x + 1).sin().cos())
    assert seen == [False]
