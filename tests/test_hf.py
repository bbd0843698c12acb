"""geoattn.hf: `geoattn export` → transformers' from_pretrained gives the run's own model.

For every model of the lm task: the exported model's logits equal the run's (float32, ≤ 1e-6),
greedy `generate` reproduces `geoattn sample --top-k 1`, save_pretrained → from_pretrained is
bit-identical, and the tokenizer is the task's vocabulary. No network: HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: it reads it once

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import SHAKESPEARE, tiny_lm_args  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import geoattn.hf  # noqa: E402  (registers the geoattn model types)
from geoattn.cli import main  # noqa: E402
from geoattn.core.errors import ConfigError  # noqa: E402
from geoattn.tasks.lm.task import LMTask  # noqa: E402
from geoattn.training.evaluate import load_run  # noqa: E402

MODELS = list(LMTask.models)
PROMPT = "ROMEO:\nWhat say"  # 15 characters; generation runs past the block size (16)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, tuple]:
    """For each lm model: (run directory, exported directory) of a 2-iteration tiny run."""
    root = tmp_path_factory.mktemp("hf")
    made = {}
    for name in MODELS:
        out, to = root / name, root / f"{name}_hf"
        assert main(["train", *tiny_lm_args(2, 2), "--model", name, "--out", str(out)]) == 0
        assert main(["export", "--out", str(out), "--to", str(to)]) == 0
        made[name] = (out, to)
    return made


@pytest.mark.parametrize("name", MODELS)
def test_exported_logits_equal_the_runs(exported, name):
    out, to = exported[name]
    model = AutoModelForCausalLM.from_pretrained(to)
    config_class, model_class = geoattn.hf.hf_classes(name)
    assert type(model) is model_class and type(model.config) is config_class
    assert model.config.model_type == f"geoattn_{name}"
    assert not model.training
    run = load_run(out, load_data=False)
    text = SHAKESPEARE.read_text(encoding="utf-8")[:200]
    x = run.task.encode(text).view(4, 50)  # (B, T) beyond the training context 16 where RoPE allows
    if run.model.config.pos == "learned":
        x = x[:, :16]
    with torch.no_grad():
        expected, expected_loss = run.model(x[:, :-1], x[:, 1:])
        got = model(input_ids=x[:, :-1])
        with_labels = model(input_ids=x, labels=x)
    assert got.logits.dtype == torch.float32
    assert (got.logits - expected).abs().max().item() <= 1e-6
    # HF's loss shifts the labels inside: the same next-character loss as geoattn's
    assert torch.allclose(with_labels.loss, expected_loss, rtol=0, atol=1e-6)


def geoattn_sample(out, capsys, *flags: str) -> str:
    capsys.readouterr()
    assert main(["sample", "--out", str(out), "--prompt", PROMPT, "--max-new-tokens", "40", *flags]) == 0
    return capsys.readouterr().out.removesuffix("\n")


@pytest.mark.parametrize("name", MODELS)
def test_generate_reproduces_geoattn_sample(exported, name, capsys):
    """Greedy: `generate(do_sample=False)` is `geoattn sample --top-k 1`. Sampling: both draw from the
    same top-k softmax with torch.multinomial, so the same seed gives the same text."""
    out, to = exported[name]
    model = AutoModelForCausalLM.from_pretrained(to)
    tokenizer = AutoTokenizer.from_pretrained(to)
    inputs = tokenizer(PROMPT, return_tensors="pt")
    greedy = model.generate(**inputs, max_new_tokens=40, do_sample=False)
    assert tokenizer.decode(greedy[0]) == geoattn_sample(out, capsys, "--top-k", "1")
    torch.manual_seed(3)
    sampled = model.generate(**inputs, max_new_tokens=40, do_sample=True, top_k=5)
    text = geoattn_sample(out, capsys, "--top-k", "5", "--seed", "3")
    assert tokenizer.decode(sampled[0]) == text
    assert len(text) == len(PROMPT) + 40 and len(set(text[len(PROMPT) :])) > 3


@pytest.mark.parametrize("name", MODELS)
def test_save_pretrained_round_trip_is_bit_identical(exported, name, tmp_path):
    _, to = exported[name]
    first = AutoModelForCausalLM.from_pretrained(to)
    first.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == (to / "model.safetensors").read_bytes()
    second = AutoModelForCausalLM.from_pretrained(tmp_path)
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # non-persistent buffers (not in the file; transformer's RoPE frequencies) equal the original's,
    # not transformers' empty placeholders
    buffers_a, buffers_b = dict(first.named_buffers()), dict(second.named_buffers())
    assert buffers_a.keys() == buffers_b.keys()
    assert all(torch.equal(buffers_a[k], buffers_b[k]) for k in buffers_a)
    x = torch.randint(first.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(first(input_ids=x).logits, second(input_ids=x).logits)


def test_tokenizer_is_the_tasks_vocabulary(exported):
    out, to = exported["transformer"]
    task = load_run(out, load_data=False).task
    tokenizer = AutoTokenizer.from_pretrained(to)
    text = SHAKESPEARE.read_text(encoding="utf-8")[:3000]  # newlines, spaces, punctuation
    ids = tokenizer(text).input_ids
    assert ids == task.encode(text).tolist()
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) == len(task.vocab)


def test_padding_is_refused(exported):
    _, to = exported["transformer"]
    model = AutoModelForCausalLM.from_pretrained(to)
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="no padding"):
        model(input_ids=ids, attention_mask=torch.tensor([[0, 1, 1, 1]]))


def test_export_refuses_a_non_empty_directory(exported, tmp_path, capsys):
    out, _ = exported["transformer"]
    (tmp_path / "keep.txt").write_text("mine")
    capsys.readouterr()
    assert main(["export", "--out", str(out), "--to", str(tmp_path)]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert main(["export", "--out", str(out), "--to", str(tmp_path), "--force"]) == 0
    assert (tmp_path / "keep.txt").read_text() == "mine" and (tmp_path / "model.safetensors").exists()


def test_missing_transformers_is_one_line_naming_the_extra(exported, tmp_path, monkeypatch, capsys):
    out, _ = exported["transformer"]
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    for module in [m for m in sys.modules if m == "geoattn.hf" or m.startswith("geoattn.hf.")]:
        monkeypatch.delitem(sys.modules, module)
    capsys.readouterr()
    assert main(["export", "--out", str(out), "--to", str(tmp_path / "x")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "geoattn[hf]" in lines[0], lines
    with pytest.raises(ConfigError, match=r"geoattn\[hf\]"):
        importlib.import_module("geoattn.hf")


def test_docs_example_runs(exported, capsys):
    """docs/hf.md's snippet, on an exported rt run, prints `geoattn sample --top-k 1`'s text."""
    readme = (Path(__file__).parents[1] / "docs" / "hf.md").read_text(encoding="utf-8")
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "import geoattn.hf" in b]
    out, to = exported["rt"]
    capsys.readouterr()
    exec(compile(block.replace("hf/lm_rt", str(to)), "README.md", "exec"), {})  # noqa: S102
    printed = capsys.readouterr().out.removesuffix("\n")
    argv = ["sample", "--out", str(out), "--prompt", "ROMEO:", "--max-new-tokens", "60", "--top-k", "1"]
    assert main(argv) == 0
    assert printed == capsys.readouterr().out.removesuffix("\n")
