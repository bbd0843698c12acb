"""`geoattn bench lm`: every model of the lm task gets a row (the rotor LM in both aggregations)."""

from __future__ import annotations

from geoattn.cli import main


def test_every_lm_model_steps_and_gets_a_ratio(capsys):
    flags = "--sizes 8 --batch 2 --n-layer 1 --n-head 2 --n-embd 32 --repeats 1 --warmup 1 --compile off"
    assert main(["bench", "lm", *flags.split(), "--ablations", "process_noise", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "failed" not in out
    rows = [line for line in out.splitlines() if line.startswith("| 8 ")]
    labels = [row.split("|")[2].strip() for row in rows]
    for label in ("transformer", "rt", "rfa", "ngpt", "rotor", "rt process_noise=False"):
        assert label in labels
    assert "rotor aggregation=compose" in labels
    assert all(float(row.split("|")[-2]) > 0 for row in rows)  # a ratio against transformer in every row
