"""DSA indexer ops in Triton: `dsa::indexer_topk` (order keys kernel + torch.topk + slots kernel) and
`dsa::k_only_indices` (the slots kernel alone).

Shapes only decide the work: the key row spans the block table's capacity T = MP * PS, tokens at or beyond a
request's length get `topk_order.NONE`, and picked keys become physical slots (NONE: -1). Rows with seq_len <= topk
skip their logits and take the k-only identity slots (no mixed-batch cliff). No host sync, so CUDA graphs capture
every launch.

A call is three steps: the logits kernel writes each token's int64 order key (`topk_order`: score descending, ties
to the lower token index; `_order_key` is the kernels' copy of that definition) instead of a float score, one
`torch.topk` takes the largest topk keys of each row, and the slots kernel turns them into slots (or writes the
identity rows). A block table of at most topk tokens leaves every row an identity row: the slots kernel alone.
`indexer_topk_plan` builds the launches once per call signature (ops/_plans.py); its plan allocates and launches
only (issue 29: float scores then ~12 aten ops to slots took ~450 us of host time per eager call on the H200).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import topk_order
from ._util import block, cdiv, dot_mode, mma, next_power_of_2, pdl_enter, pdl_launch
from ._launch import bind
from .scratch import Scratch

_NONE = tl.constexpr(topk_order.NONE)
_LOW = tl.constexpr(2**32 - 1)  # the key's index half (topk_order._LOW)
_BLOCK_T = 64  # token positions per logits program


@triton.jit
def _order_key(score, index):
    """int64 `topk_order.order_keys` of a valid token: score float32, index int in [0, 2^32) (same shape).
    A second implementation of that definition (tests assert bit equality with it): NaN and -inf -> -max, +inf ->
    +max, -0.0 -> +0.0, then the float's bits as an order-preserving int32 above the index's complement."""
    big = 3.4028234663852886e38
    s = tl.where(score != score, -big, tl.minimum(tl.maximum(score, -big), big))
    bits = s.to(tl.int32, bitcast=True)
    # -0.0 by its bits, not by `s + 0.0`: a compiler may fold x + 0.0 away, a compare on integers stays
    bits = tl.where(bits == -2147483648, 0, bits)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    return (ordered << 32) + (_LOW - index.to(tl.int64))


@triton.jit
def _indexer_logits_kernel(Q, W, K, Table, Lens, Out, scale, Hi, Di, PS, T, topk,
                           s_qb, s_qh, s_qd, s_wb, s_wh, s_kp, s_ks, s_kd, s_tb, s_tp, s_lb, s_ob,
                           BLOCK_HI: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
                           DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr, KEYS: tl.constexpr,
                           PDL: tl.constexpr = False):
    """Out[b, t] for t < T: the order key of token t (KEYS) or its float32 score; NONE / -inf at t >= seq_len and in
    rows with seq_len <= topk (their K reads are masked off: the caller gives them identity slots)."""
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.load(Lens + b * s_lb)
    mask_t = (offs_t < n) & (n > topk)
    offs_h = tl.arange(0, BLOCK_HI)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < Hi
    mask_d = offs_d < Di
    q = tl.load(Q + b * s_qb + offs_h[:, None] * s_qh + offs_d[None, :] * s_qd,
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    w = tl.load(W + b * s_wb + offs_h * s_wh, mask=mask_h, other=0.0)
    page = tl.load(Table + b * s_tb + (offs_t // PS) * s_tp, mask=mask_t, other=0).to(tl.int64)
    k = tl.load(K + page[:, None] * s_kp + (offs_t % PS)[:, None] * s_ks + offs_d[None, :] * s_kd,
                mask=mask_t[:, None] & mask_d[None, :], other=0.0)
    logits = mma(q, tl.trans(k), tl.zeros([BLOCK_HI, BLOCK_T], tl.float32), DOT_PREC, DOT_UPCAST)  # [Hi, T]
    logits = tl.maximum(logits * scale, 0.0)
    score = tl.sum(logits * w[:, None], 0)
    if KEYS:
        out = tl.where(mask_t, _order_key(score, offs_t), _NONE)
    else:
        out = tl.where(mask_t, score, float("-inf"))
    tl.store(Out + b * s_ob + offs_t, out, mask=offs_t < T)


@triton.jit
def _slots_kernel(Top, Table, Lens, Out, PS, capacity, topk, s_kb, s_tb, s_tp, s_lb, s_ob,
                  BLOCK: tl.constexpr, KEYED: tl.constexpr, PDL: tl.constexpr = False):
    """Out[b, j] for j < topk, int32: the physical slot block_table[b, t // PS] * PS + t % PS of the j-th token, -1
    past the selection. Rows with seq_len <= topk (every row when not KEYED): token j itself, for j < min(seq_len,
    capacity) (the k-only identity). Other rows (KEYED): the token of key Top[b, j] (NONE: -1); Top holds topk keys
    per row, largest first."""
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n = tl.load(Lens + b * s_lb)
    pos = offs.to(tl.int64)
    valid = offs < tl.minimum(n, capacity)
    if KEYED:
        ranked = n > topk  # an identity row's keys are all NONE (its logits were skipped): not read
        key = tl.load(Top + b * s_kb + offs, mask=(offs < topk) & ranked, other=_NONE)
        pos = tl.where(ranked, _LOW - (key & _LOW), pos)  # topk_order.key_index
        valid = tl.where(ranked, key != _NONE, valid)
    page = tl.load(Table + b * s_tb + (pos // PS) * s_tp, mask=valid, other=0).to(tl.int64)
    # int64 products truncated to int32: the bits an int32 product would wrap to (the ops check that slots fit)
    slot = tl.where(valid, page * PS + pos % PS, -1).to(tl.int32)
    tl.store(Out + b * s_ob + offs, slot, mask=offs < topk)


def _logits_launch(q, weights, k_cache, block_table, seq_lens, sm_scale, topk, keys: bool):
    """`launch(q, weights, k_cache, block_table, seq_lens, out)` writes out [B, T] (contiguous; int64 keys or float32
    scores) for inputs of this signature. q [B, Hi, Di], any strides."""
    B, Hi, Di = q.shape
    PS = k_cache.shape[1]
    T = block_table.shape[1] * PS
    bound = bind(_indexer_logits_kernel, (B, cdiv(T, _BLOCK_T)), BLOCK_HI=block(Hi), BLOCK_D=block(Di),
                 BLOCK_T=_BLOCK_T, KEYS=keys, **dot_mode(q.dtype), num_warps=4, **pdl_launch(q.device))
    numbers = (float(sm_scale), Hi, Di, PS, T, topk, *q.stride(), *weights.stride(), *k_cache.stride(),
               *block_table.stride(), seq_lens.stride(0), T)

    def launch(q, weights, k_cache, block_table, seq_lens, out):
        bound(q, weights, k_cache, block_table, seq_lens, out, *numbers)

    return launch


def _slots_plan(block_table, seq_lens, page_size: int, topk: int, keyed: bool):
    """`plan(top, block_table, seq_lens)` -> int32 [B, topk] (`_slots_kernel`; top int64 [B, topk] keys when keyed,
    else None) for tables and lengths of this signature."""
    B = block_table.shape[0]
    shape, device = (B, topk), block_table.device
    if B == 0:
        return lambda top, block_table, seq_lens: torch.empty(shape, dtype=torch.int32, device=device)
    blk = min(1024, next_power_of_2(topk))
    bound = bind(_slots_kernel, (B, cdiv(topk, blk)), BLOCK=blk, KEYED=keyed, num_warps=4, **pdl_launch(device))
    numbers = (page_size, block_table.shape[1] * page_size, topk)
    strides = (*block_table.stride(), seq_lens.stride(0), topk)  # the output's row stride last

    def plan(top, block_table, seq_lens):
        out = torch.empty(shape, dtype=torch.int32, device=device)
        bound(top, block_table, seq_lens, out, *numbers, 0 if top is None else top.stride(0), *strides)
        return out

    return plan


def indexer_topk_plan(q, weights, k_cache, block_table, seq_lens, topk: int, sm_scale: float):
    """`plan(q, weights, k_cache, block_table, seq_lens)` -> `dsa::indexer_topk` int32 [B, topk] for inputs of this
    signature (ops/_plans.py): q [B, Hi, Di], weights float32 [B, Hi], k_cache [NP, PS, Di], block_table int32
    [B, MP], seq_lens int32 [B]. A plan call allocates keys [B, T] (T = MP * PS) and the output and launches the
    logits kernel, torch.topk and the slots kernel; with T <= topk only the slots kernel (every row is an identity
    row)."""
    PS = k_cache.shape[1]
    T = block_table.shape[1] * PS
    B, device = q.shape[0], q.device
    if T <= topk or B == 0:  # seq_len <= T <= topk in every row (or no row): no key is ever read
        identity = k_only_plan(block_table, seq_lens, PS, topk)
        return lambda q, weights, k_cache, block_table, seq_lens: identity(block_table, seq_lens)
    slots = _slots_plan(block_table, seq_lens, PS, topk, keyed=True)
    logits = _logits_launch(q, weights, k_cache, block_table, seq_lens, sm_scale, topk, keys=True)
    # the keys are this call's intermediate (torch.topk reads them): scratch where it is safe (kernels/scratch.py)
    reused = Scratch([(B, 2 * T)], device, lambda raw: raw.view(torch.int64))

    def plan(q, weights, k_cache, block_table, seq_lens):
        keys = reused.get()
        logits(q, weights, k_cache, block_table, seq_lens, keys)
        # T > topk: every row yields topk keys, largest first (distinct for valid tokens, so the set is unique)
        return slots(torch.topk(keys, topk, dim=1).values, block_table, seq_lens)

    return plan


def indexer_topk(q, weights, k_cache, block_table, seq_lens, topk, sm_scale) -> torch.Tensor:
    """int32 [B, topk]: `dsa::indexer_topk` for q [B, Hi, Di] (one call: a fresh `indexer_topk_plan`)."""
    return indexer_topk_plan(q, weights, k_cache, block_table, seq_lens, topk, sm_scale)(
        q, weights, k_cache, block_table, seq_lens)


def _logits(q, weights, k_cache, block_table, seq_lens, sm_scale, topk, dtype) -> torch.Tensor:
    B = q.shape[0]
    out = torch.empty((B, block_table.shape[1] * k_cache.shape[1]), dtype=dtype, device=q.device)
    if out.numel():
        _logits_launch(q, weights, k_cache, block_table, seq_lens, sm_scale, topk, dtype == torch.int64)(
            q, weights, k_cache, block_table, seq_lens, out)
    return out


def indexer_keys(q, weights, k_cache, block_table, seq_lens, sm_scale, topk) -> torch.Tensor:
    """int64 [B, MP * PS]: the order key (`topk_order.order_keys`, index = token position) of every token position,
    NONE at and beyond the request's length and in rows with seq_len <= topk (their logits are skipped)."""
    return _logits(q, weights, k_cache, block_table, seq_lens, sm_scale, topk, torch.int64)


def indexer_scores(q, weights, k_cache, block_table, seq_lens, sm_scale, topk) -> torch.Tensor:
    """float32 [B, MP * PS]: the indexer score `indexer_keys` orders, as computed (NaN and +-inf kept: the key
    clamps them), -inf where `indexer_keys` has NONE."""
    return _logits(q, weights, k_cache, block_table, seq_lens, sm_scale, topk, torch.float32)


def k_only_plan(block_table, seq_lens, page_size: int, topk: int):
    """`plan(block_table, seq_lens)` -> `k_only_indices(...)` for tables and lengths of this signature."""
    slots = _slots_plan(block_table, seq_lens, page_size, topk, keyed=False)
    return lambda block_table, seq_lens: slots(None, block_table, seq_lens)


def k_only_indices(block_table, seq_lens, page_size, topk) -> torch.Tensor:
    """int32 [B, topk]: `dsa::k_only_indices`, slots of tokens 0 .. min(seq_len, topk) - 1 in order, then -1."""
    return k_only_plan(block_table, seq_lens, page_size, topk)(block_table, seq_lens)
