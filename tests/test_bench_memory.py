"""The benchmarks' peak-memory column: it measures what a call allocates, and the frozen heap that keeps
its garbage collections cheap still collects what the benchmark leaves behind."""

from __future__ import annotations

import gc

import torch

from geoattn.bench.common import frozen_heap, peak_memory_bytes


def test_peak_memory_sees_a_64_mib_tensor_inside_a_frozen_heap():
    def allocate():
        return torch.ones(16 * 2**20).sum()  # 64 MiB of float32, written and freed inside the call

    with frozen_heap():
        grown = peak_memory_bytes(allocate)
    assert 48 * 2**20 <= grown <= 160 * 2**20, grown


def test_the_frozen_heap_collects_new_cycles_and_thaws_afterwards():
    class Node:
        pass

    with frozen_heap():
        assert gc.get_freeze_count() > 0
        a, b = Node(), Node()
        a.other, b.other = b, a  # a reference cycle: only the collector frees it
        del a, b
        assert gc.collect() >= 2  # created after the freeze: collected
    assert gc.get_freeze_count() == 0
