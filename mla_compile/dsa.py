"""DSA dense/sparse selection — the one place the k-only decision is made.

`select_indices` compares a Python int `max_kv_len` with `topk` in plain control flow, so under
`torch.compile` Dynamo turns it into a guard (`max_kv_len <= topk` / `topk + 1 <= max_kv_len`) and keeps
exactly two graphs: dense (k-only: identity slots, no indexer logits or top-k) and sparse. The int must never
reach a tensor op — then it would become a graph input and CUDA-graph trees would re-record per value — so
the kernels read lengths from `seq_lens` on the device.
"""

from __future__ import annotations

import torch

from . import ops  # noqa: F401


def select_indices(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor, *, topk: int, sm_scale: float, max_kv_len: int) -> torch.Tensor:
    """Top-k physical slots for sparse attention; int32 [B, topk].

    `max_kv_len` is the host-side max of `seq_lens` (the scheduler knows it without a sync). When it is
    <= topk every token is selected, so the indexer's logits and top-k are skipped.
    """
    if max_kv_len <= topk:
        return torch.ops.dsa.k_only_indices(block_table, seq_lens, k_cache.shape[1], topk)
    return torch.ops.dsa.indexer_topk(q, weights, k_cache, block_table, seq_lens, topk, sm_scale)


def mark_max_kv_len_dynamic(source: str = "L['max_kv_len']") -> None:
    """Make Dynamo treat the `max_kv_len` int (or any int named by `source`) as symbolic from the first compile.

    Without this the first call specializes on the value (a third, value-pinned graph). `source` is the
    Dynamo source name of the int, e.g. "L['max_kv_len']" for a forward() argument, or a regex over such names.
    """
    cfg = torch.compiler.config
    current = [s for s in (cfg.dynamic_sources or "").split(",") if s]
    if source not in current:
        cfg.dynamic_sources = ",".join(current + [source])
