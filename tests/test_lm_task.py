"""The lm task (character vocabulary, nanoGPT splits, batches) and the dataset registry / download."""

from __future__ import annotations

import hashlib
import io
import urllib.error

import pytest
import torch
from conftest import SHAKESPEARE

from geoattn.tasks.lm import LMTask
from geoattn.tasks.lm import datasets as registry
from geoattn.training.config import TrainConfig
from geoattn.training.trainer import run_task


@pytest.fixture(scope="module")
def text() -> str:
    return SHAKESPEARE.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def task() -> LMTask:
    return LMTask(SHAKESPEARE, block_size=16)


def test_vocabulary_and_splits_follow_nanogpt(task, text):
    assert task.vocab == "".join(sorted(set(text)))
    assert task.vocab_size == 65  # nanoGPT's shakespeare_char vocabulary
    n_train = int(0.9 * len(text))
    assert len(task.splits["train"]) == n_train
    assert len(task.splits["val"]) == len(text) - n_train
    assert task.decode(task.splits["val"][:50]) == text[n_train : n_train + 50]
    assert task.meta() == {"task": "lm", "vocab": task.vocab, "block_size": 16, "data": str(SHAKESPEARE)}


def test_selection_split_is_carved_from_the_training_text_and_hides_the_validation_text(text):
    from geoattn.tasks.lm.task import LMSettings

    selecting = LMTask(SHAKESPEARE, block_size=16, settings=LMSettings(selection=0.1))
    n_train = int(0.9 * len(text))
    n_fit = n_train - int(0.1 * n_train)
    assert selecting.decode(selecting.splits["train"]) == text[:n_fit]
    assert selecting.decode(selecting.splits["val"]) == text[n_fit:n_train]  # never the last 10 %
    with pytest.raises(ValueError, match="task.selection must be in"):
        LMSettings(selection=1.0)


def test_batches_are_shifted_windows_of_their_own_split(task, text):
    n_train = int(0.9 * len(text))
    x, y = task.get_batch("val", 8, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.long
    for row_x, row_y in zip(x, y):
        window = task.decode(row_x) + task.decode(row_y[-1:])
        assert window in text[n_train:]
        assert torch.equal(row_x[1:], row_y[:-1])
    longer, _ = task.get_batch("train", 2, torch.Generator().manual_seed(0), block_size=64)
    assert longer.shape == (2, 64)


def test_batches_depend_only_on_the_generator(task):
    a = task.get_batch("train", 4, torch.Generator().manual_seed(5))
    b = task.get_batch("train", 4, torch.Generator().manual_seed(5))
    c = task.get_batch("train", 4, torch.Generator().manual_seed(6))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_a_checkpoint_vocabulary_keeps_ids_and_rejects_unknown_characters(task, tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("to be or not to be, " * 10, encoding="utf-8")
    reused = LMTask(small, block_size=8, vocab=task.vocab)
    assert reused.encode("be").tolist() == task.encode("be").tolist()
    with pytest.raises(ValueError, match="not in the vocabulary: '@'"):
        task.encode("to be @ home")
    with pytest.raises(ValueError, match="the lm task needs --data"):
        run_task(TrainConfig(task="lm", data=None))


@pytest.mark.parametrize(
    "content, match",
    [
        (None, "does not exist"),
        (b"", "is empty"),
        (b"caf\xe9 latin-1", "is not UTF-8"),
        (b"tiny", "fewer than"),
    ],
)
def test_bad_data_files_raise_valueerror_naming_the_file(tmp_path, content, match):
    path = tmp_path / "corpus.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=match) as err:
        LMTask(path, block_size=16)
    assert "corpus.txt" in str(err.value)


# ------------------------------------------------------------------------------ registry ----------
def test_registry_checksum_is_the_shared_files():
    entry = registry.get_dataset("tinyshakespeare")
    assert entry.sha256 == registry.sha256_of(SHAKESPEARE)
    assert entry.size == SHAKESPEARE.stat().st_size
    assert entry.url.endswith("karpathy/char-rnn/master/data/tinyshakespeare/input.txt")
    with pytest.raises(ValueError, match="unknown dataset 'shakespear'; known datasets: tinyshakespeare"):
        registry.get_dataset("shakespear")


def test_cache_respects_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert registry.cache_dir() == tmp_path / "xdg" / "geoattn"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert registry.cache_dir() == tmp_path / "home" / ".cache" / "geoattn"


class _Response(io.BytesIO):
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _serve(monkeypatch, payload: bytes | Exception) -> list[str]:
    requested: list[str] = []

    def urlopen(url, timeout=None):
        requested.append(url)
        if isinstance(payload, Exception):
            raise payload
        return _Response(payload)

    monkeypatch.setattr(registry.urllib.request, "urlopen", urlopen)
    return requested


def test_download_checks_the_sha256_and_renames_into_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    payload = SHAKESPEARE.read_bytes()
    requested = _serve(monkeypatch, payload)
    path = registry.download("tinyshakespeare")
    assert requested == [registry.DATASETS["tinyshakespeare"].url]
    assert path == tmp_path / "geoattn" / "tinyshakespeare.txt"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == registry.DATASETS["tinyshakespeare"].sha256
    assert registry.resolve_data("tinyshakespeare") == path  # cached: no second request
    assert len(requested) == 1
    assert sorted(p.name for p in path.parent.iterdir()) == ["tinyshakespeare.txt"]


def test_a_corrupt_download_leaves_nothing_behind(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _serve(monkeypatch, SHAKESPEARE.read_bytes()[:-1] + b"?")
    with pytest.raises(registry.DownloadError, match="sha256"):
        registry.download("tinyshakespeare")
    assert list((tmp_path / "geoattn").iterdir()) == []


def test_offline_download_tells_the_user_to_pass_data(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _serve(monkeypatch, urllib.error.URLError("Name or service not known"))
    with pytest.raises(registry.DownloadError, match="pass --data FILE"):
        registry.download("tinyshakespeare")
    assert list((tmp_path / "geoattn").iterdir()) == []


def test_the_model_table_is_lm_table_with_the_task_recipes():
    """Every language model of ``LM_TABLE`` (the RotorLM included) is one row of the lm task, with its
    config class, its recipe's rate and the fields the task fixes; the built model is the table's."""
    from geoattn.models.base import ModelSizes
    from geoattn.models.lm import LM_TABLE

    assert list(LMTask.table) == list(LM_TABLE)
    assert LMTask.recipes == {
        "transformer": {"lr": 1e-3},
        "rt": {"lr": 8e-3},
        "rfa": {"lr": 2e-3},
        "ngpt": {"lr": 8e-3},
        "rotor": {"lr": 4e-3},
    }
    task = LMTask(None, block_size=8, vocab="abcd")
    for name, model in LM_TABLE.items():
        assert LMTask.model_settings(name) == (model.config, ("vocab_size", "block_size"))
        built = task.build_model(name, ModelSizes(n_layer=1, n_head=2, n_embd=16))
        assert type(built) is model.lm and type(built.config) is model.config
        assert (built.config.vocab_size, built.config.block_size) == (4, 8)


def test_no_model_name_branch_in_the_lm_and_filter_packages():
    """What varies by model is a field of its row: no ``model == "..."`` outside a table."""
    import re
    from pathlib import Path

    import geoattn

    root = Path(geoattn.__file__).parent
    pattern = re.compile(r"\bmodel\s*(==|!=|in \()|\bname\s*(==|!=) *\"")
    for folder in ("tasks/lm", "tasks/filter", "models"):
        for path in (root / folder).rglob("*.py"):
            hits = [line for line in path.read_text().splitlines() if pattern.search(line)]
            assert not hits, f"{path}: {hits}"
