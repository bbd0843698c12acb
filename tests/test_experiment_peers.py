"""Named peer cells (`experiments/peers.toml`): one definition, the same runs for every experiment that
names it, and one-line errors."""

from __future__ import annotations

import hashlib
import json
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from geoattn.cli import main
from geoattn.core.errors import ConfigError
from geoattn.experiments import load_spec
from geoattn.experiments.spec import PEERS_FILE

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

EXPERIMENTS = Path(__file__).parents[1] / "experiments"
PEER = '[egnn]\nname = "EGNN, its code"\nmax_iters = 10\ncommand = ["{python}", "egnn.py", "{out}"]\n'
HEAD = 'seeds = [1]\nmetrics = ["val_mse"]\n[base]\ntask = "nbody"\ndata = "files"\n'


def _write(folder: Path, name: str, cells: str) -> Path:
    folder.mkdir(exist_ok=True)
    path = folder / f"{name}.toml"
    path.write_text(HEAD + cells)
    return path


def test_a_named_peer_is_the_inline_cell_and_shares_its_runs(tmp_path):
    folder = tmp_path / "experiments"
    folder.mkdir()
    (folder / PEERS_FILE).write_text(PEER)
    named = load_spec(str(_write(folder, "named", '[[cells]]\npeer = "egnn"\n')))
    inline = load_spec(str(_write(folder, "inline", "[[cells]]\n" + PEER.split("\n", 1)[1])))
    assert [c.name for c in named.cells] == ["EGNN, its code"]
    runs = tmp_path / "runs"
    config = named.config(named.cells[0], 1, runs)
    assert config == inline.config(inline.cells[0], 1, runs)
    # the key of a peer's runs is what existing run directories hold: the name, and a digest of the
    # command as written, the budget and the data
    key = {"peer": ["{python}", "egnn.py", "{out}"], "max_iters": 10, "data": "files"}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    assert config["out"] == str(runs / f"peer-EGNN_its_code-{digest}" / "seed_1")


@pytest.mark.parametrize(
    "peers, cells, fragment",
    [
        (PEER, '[[cells]]\npeer = "mace"\n', "no peer 'mace'"),
        (PEER, '[[cells]]\npeer = "egnn"\nmax_iters = 20\n', "takes nothing else, got max_iters"),
        (None, '[[cells]]\npeer = "egnn"\n', "does not exist"),
        (PEER.replace("max_iters = 10\n", ""), '[[cells]]\npeer = "egnn"\n', "an integer"),
        ("[egnn\n", '[[cells]]\npeer = "egnn"\n', "not valid TOML"),
        (PEER, '[[cells]]\npeer = "egnn"\n[[cells]]\npeer = "egnn"\n', "two cells named"),
        (PEER, '[[cells]]\npeer = ["egnn"]\n', "must be an id"),
    ],
)
def test_a_bad_peer_reference_is_one_line(tmp_path, peers, cells, fragment):
    folder = tmp_path / "experiments"
    folder.mkdir()
    if peers is not None:
        (folder / PEERS_FILE).write_text(peers)
    with pytest.raises(ConfigError, match=fragment) as err:
        load_spec(str(_write(folder, "bad", cells)))
    assert "\n" not in str(err.value)


def test_the_peer_file_is_not_an_experiment(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / PEERS_FILE).write_text(PEER)
    assert main(["experiment", "peers", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not an experiment" in err


def test_each_peer_cell_of_the_repository_is_written_once():
    """A peer cell several experiments report lives in peers.toml only (the copies had to stay identical
    for the experiments to share runs); each named peer is reported by two or more experiments."""
    inline, named = defaultdict(set), defaultdict(set)
    for path in sorted([*EXPERIMENTS.glob("*.toml"), *EXPERIMENTS.glob("probes/*.toml")]):
        if path.name == PEERS_FILE:
            continue
        for cell in tomllib.loads(path.read_text(encoding="utf-8"))["cells"]:
            if "command" in cell:
                inline[json.dumps([cell["name"], cell["max_iters"], cell["command"]])].add(path.stem)
            elif "peer" in cell:
                named[cell["peer"]].add(path.stem)
    twice = {key: users for key, users in inline.items() if len(users) > 1}
    assert not twice, f"move these peer cells to {PEERS_FILE}: {twice}"
    defined = tomllib.loads((EXPERIMENTS / PEERS_FILE).read_text(encoding="utf-8"))
    assert set(named) == set(defined)
    assert all(len(users) > 1 for users in named.values()), dict(named)


def test_a_peers_evaluation_file_is_keyed_by_the_task_it_is_measured_on():
    """Our runs keep ``evaluation.json``; a peer's file name is a digest of ``evaluate_on``: the same for
    the same settings in any key order, another for other settings, and a TOML date among them is
    keyed by its text (no traceback)."""
    import datetime

    from geoattn.experiments.runner import evaluation_file

    def peer(on):
        return {"command": ["run"], "max_iters": 1, "evaluate_on": on}

    assert evaluation_file({"max_iters": 1}) == "evaluation.json"
    on = {"task": "nbody", "task_options": {"system": "charged", "train_size": 2}}
    name = evaluation_file(peer(on))
    assert name.startswith("evaluation-") and name.endswith(".json")
    reordered = {"task_options": {"train_size": 2, "system": "charged"}, "task": "nbody"}
    assert evaluation_file(peer(reordered)) == name
    assert evaluation_file(peer({**on, "task_options": {"system": "charged"}})) != name
    dated = evaluation_file(peer({**on, "task_options": {"since": datetime.date(2026, 12, 5)}}))
    assert dated.startswith("evaluation-") and dated != name
