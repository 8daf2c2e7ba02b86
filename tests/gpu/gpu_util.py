"""Helpers of the GPU tests: CUDA-graph capture and the relative error they check against."""

from __future__ import annotations

import torch


def rel(a, b) -> float:
    """||a - b|| / ||b|| in float64 on the host."""
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def capture(fn):
    """Capture fn() in a CUDA graph (after a warm-up on a side stream that compiles every kernel outside the
    capture); returns (graph, static outputs)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    return graph, outs
