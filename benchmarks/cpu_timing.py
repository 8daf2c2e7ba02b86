"""CPU runs of the GPU benchmarks (their --smoke shapes) check the scripts; their timings are not performance."""

from __future__ import annotations

import contextlib

import torch

NOTE = "CPU run: the timings check the script; they are not representative (of GPU decode, or of CPU serving)"


@contextlib.contextmanager
def cpu_threads(device: torch.device, smoke: bool):
    """One intra-op thread for a CPU smoke run, restored after. The smoke shapes' ops take microseconds: with
    more threads than free cores (a 2-core CI machine, a shared one) the hand-offs dominate (a tiny bmm took
    8.6 ms on 2 threads vs 1.9 us on 1)."""
    if device.type != "cpu" or not smoke:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)
