"""`geoattn bench algebra` runs end to end at a tiny size and prints its tables."""

import pytest

from geoattn.cli import main


def test_bench_algebra_prints_tables(capsys):
    assert main(["bench", "algebra", "--n", "64", "--repeats", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "torch 2." in out and "1 threads" in out
    for sig in ("Cl(3, 0, 0)", "Cl(3, 0, 1)"):
        assert f"### {sig}: 64 geometric products" in out
    assert out.count("| geoattn ") == 2
    assert out.count("| geoattn, native kernel off ") == 2  # the form the native kernel replaces
    assert out.count("| dense einsum (Cayley) ") == 2
    agreement = "agreement with geoattn (max abs diff): geoattn, native kernel off: product"
    assert out.count(agreement) == 2
    assert out.count("; kingdon (component-major): product") == 2


def test_bench_algebra_rejects_bad_sizes(capsys):
    assert main(["bench", "algebra", "--n", "0"]) == 2
    assert "--n must be ≥ 1, got 0" in capsys.readouterr().err


def test_bench_algebra_help_line():
    from geoattn.bench import algebra

    assert algebra.__doc__.splitlines()[0].startswith("Batched geometric product")
    with pytest.raises(SystemExit):
        main(["bench", "algebra", "--help"])


def test_memory_note_says_whether_the_allocator_keeps_freed_memory(monkeypatch):
    from geoattn.bench.common import memory_note

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert "includes freed memory" in memory_note("cpu")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert "131072" in memory_note("cpu") and "what the tensors hold" in memory_note("cpu")
    assert "max_memory_allocated" in memory_note("cuda")
