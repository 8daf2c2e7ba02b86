"""DSA indexer ops in Triton: `dsa::indexer_topk` (logits kernel + torch.topk) and `dsa::k_only_indices`.

Shapes only decide the work: the score row spans the block table's capacity (MP * PS), tokens at or beyond
a request's length score -inf, and top-k entries past the length become -1. Rows with seq_len <= topk skip
their logits and take the k-only identity slots (no mixed-batch cliff). No host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import topk_order
from ._util import block, cdiv, dot_mode, mma, next_power_of_2, pdl_enter, pdl_launch
from ._launch import fast


@triton.jit
def _indexer_logits_kernel(Q, W, K, Table, Lens, Score, scale, Hi, Di, PS, T, topk,
                           s_qb, s_qh, s_wb, s_kp, s_ks, s_tb, s_sb,
                           BLOCK_HI: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
                           DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.load(Lens + b)
    # a row with n <= topk selects every token: its K reads are masked off (the caller gives it identity slots)
    mask_t = (offs_t < n) & (n > topk)
    offs_h = tl.arange(0, BLOCK_HI)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < Hi
    mask_d = offs_d < Di
    q = tl.load(Q + b * s_qb + offs_h[:, None] * s_qh + offs_d[None, :], mask=mask_h[:, None] & mask_d[None, :],
                other=0.0)
    w = tl.load(W + b * s_wb + offs_h, mask=mask_h, other=0.0)
    page = tl.load(Table + b * s_tb + offs_t // PS, mask=mask_t, other=0).to(tl.int64)
    k = tl.load(K + page[:, None] * s_kp + (offs_t % PS)[:, None] * s_ks + offs_d[None, :],
                mask=mask_t[:, None] & mask_d[None, :], other=0.0)
    logits = mma(q, tl.trans(k), tl.zeros([BLOCK_HI, BLOCK_T], tl.float32), DOT_PREC, DOT_UPCAST)  # [Hi, T]
    logits = tl.maximum(logits * scale, 0.0)
    score = tl.sum(logits * w[:, None], 0)
    # valid tokens must outrank padding even if their score overflowed or is NaN: keep them finite
    big = 3.4028234663852886e38
    score = tl.where(score != score, -big, tl.minimum(tl.maximum(score, -big), big))
    tl.store(Score + b * s_sb + offs_t, tl.where(mask_t, score, float("-inf")), mask=offs_t < T)


@triton.jit
def _k_only_kernel(Table, Lens, Out, PS, capacity, topk, s_tb, s_ob, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n = tl.minimum(tl.load(Lens + b), capacity)
    valid = offs < n
    page = tl.load(Table + b * s_tb + offs // PS, mask=valid, other=0)
    tl.store(Out + b * s_ob + offs, tl.where(valid, page * PS + offs % PS, -1), mask=offs < topk)


def _slots_of(block_table: torch.Tensor, pos: torch.Tensor, page_size: int) -> torch.Tensor:
    return block_table.gather(1, (pos // page_size).to(torch.int64)).long() * page_size + pos % page_size


def indexer_scores(q, weights, k_cache, block_table, seq_lens, sm_scale, topk) -> torch.Tensor:
    """float32 [B, MP * PS]: indexer score of every token position, -inf at and beyond the request's length.
    Rows with seq_len <= topk are all -inf: their logits are skipped."""
    B, Hi, Di = q.shape
    PS = k_cache.shape[1]
    T = block_table.shape[1] * PS
    score = torch.empty((B, T), dtype=torch.float32, device=q.device)
    if B == 0 or T == 0:
        return score
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_t = 64
    grid = (B, cdiv(T, block_t))
    fast(_indexer_logits_kernel)[grid](
        q, weights, k_cache, block_table, seq_lens, score, sm_scale, Hi, Di, PS, T, topk,
        q.stride(0), q.stride(1), weights.stride(0), k_cache.stride(0), k_cache.stride(1), block_table.stride(0),
        score.stride(0), BLOCK_HI=block(Hi), BLOCK_D=block(Di), BLOCK_T=block_t, **dot_mode(q.dtype),
        num_warps=4, **pdl_launch(q.device))
    return score


def indexer_topk(q, weights, k_cache, block_table, seq_lens, topk, sm_scale) -> torch.Tensor:
    B = q.shape[0]
    PS = k_cache.shape[1]
    score = indexer_scores(q, weights, k_cache, block_table, seq_lens, sm_scale, topk)
    k = min(topk, score.shape[1])
    identity = k_only_indices(block_table, seq_lens, PS, topk)  # what rows with seq_len <= topk return
    if B == 0 or k == 0:
        return identity
    # score descending, ties to the lower token index: the order every path shares (`topk_order`)
    valid = torch.arange(score.shape[1], device=q.device)[None, :] < seq_lens[:, None]
    pos, picked = topk_order.top_positions(score, valid, k)
    pos = torch.where(picked, pos, 0)  # padding carries no position: any in-table one, masked below
    out = torch.full((B, topk), -1, dtype=torch.int32, device=q.device)
    # position validity (picked), not score finiteness, decides -1 (valid scores are clamped finite in the kernel)
    out[:, :k] = torch.where(picked, _slots_of(block_table, pos, PS), -1).to(torch.int32)
    return torch.where((seq_lens <= topk)[:, None], identity, out)


def k_only_indices(block_table, seq_lens, page_size, topk) -> torch.Tensor:
    B = block_table.shape[0]
    out = torch.empty((B, topk), dtype=torch.int32, device=block_table.device)
    if B == 0:
        return out
    block = min(1024, next_power_of_2(topk))
    fast(_k_only_kernel)[(B, cdiv(topk, block))](
        block_table, seq_lens, out, page_size, block_table.shape[1] * page_size, topk, block_table.stride(0),
        out.stride(0), BLOCK=block, num_warps=4, **pdl_launch(block_table.device))
    return out
