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


def token_table_rows(lens, kind: str, g: torch.Generator, spare: int = 64):
    """(table int32 [B, L] on the host, [each request's rows], N rows in all) of a page-size-1 cache under a token table
    (what the HF pass hands mla.decode), rows for request b: "runs", one run of consecutive rows at an offset off every
    tile edge (a static cache with left padding: every 64-token tile one TMA box); "holes", positions of the request's
    range with gaps (tiles with and without a gap); "shuffled", rows anywhere (every tile row copies). Every table
    entry past a request's length is far out of range (a kernel must never read it)."""
    B, L = len(lens), max(lens) + 200
    N = B * L + spare
    table = torch.full((B, L), 1 << 30, dtype=torch.int32)
    perm = torch.randperm(N, generator=g)
    rows_of = []
    for b, n in enumerate(lens):
        if kind == "runs":
            rows = b * L + int(torch.randint(0, L - n + 1, (1,), generator=g)) + torch.arange(n)
        elif kind == "holes":
            rows = b * L + torch.randperm(L, generator=g)[:n].sort().values
        else:
            rows = perm[b * L:b * L + n]
        table[b, :n] = rows.int()
        rows_of.append(rows)
    return table, rows_of, N
